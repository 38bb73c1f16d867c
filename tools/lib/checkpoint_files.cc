#include "tools/lib/checkpoint_files.h"

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <set>
#include <tuple>
#include <unordered_map>
#include <nlohmann/json.hpp>

#include <sys/resource.h>

#include "backends/errors.h"
#include "backends/wire.h"
#include "tools/lib/input_file.h"
#include "tools/lib/memory.h"
#include "tools/lib/output_files.h"

namespace tpsim {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using Ints = std::vector<std::int64_t>;

constexpr const char* kIndexName = "index.json";
constexpr const char* kFormat = "tpsim-checkpoint";
constexpr int kVersion = 2;  // 2: the index's own checksum, chunks' data_offsets, the layer kind
constexpr const char* kIndexChecksum = "index_fnv1a64";
// An index holds a few hundred bytes per chunk: 64 MiB is over 100,000 chunks (4096 experts at
// TP 32), and a bound on what a file named index.json can make a load read.
constexpr std::uint64_t kMaxIndexBytes = std::uint64_t(64) << 20;
// A checkpoint's tensors have a Shape's 4 modes and at most two prepended axes (layer offsets, the
// experts' axis). The tiling check looks at each chunk's 2^rank corners.
constexpr std::size_t kMaxRank = 6;
// Deeper than any index (tensors, key, chunks, chunk, gtp_padding) or safetensors header nests.
constexpr int kMaxJsonDepth = 16;
// Dims and their products stay below 2^48, so that no offset arithmetic can overflow.
constexpr std::int64_t kMaxElements = std::int64_t(1) << 48;

std::int64_t volume(const Ints& s) {
  std::int64_t n = 1;
  for (std::int64_t d : s) n *= d;
  return n;
}

std::string fileName(int writer) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "rank-%05d.safetensors", writer);
  return buf;
}

// A rank's file, of this save or of an earlier one.
bool isRankFile(const fs::path& path) {
  return path.filename().string().rfind("rank-", 0) == 0 && path.extension() == ".safetensors";
}

std::string hex64(std::uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016" PRIx64, v);
  return buf;
}

// The safetensors name of a chunk: its key and global offset, "fc1.weight@32,0".
std::string chunkTensorName(const std::string& key, const Ints& globalOffset) {
  std::string name = key + "@";
  for (std::size_t i = 0; i < globalOffset.size(); ++i) name += (i ? "," : "") + std::to_string(globalOffset[i]);
  return name;
}

// Names read from a file (keys, tensors, files) as messages quote them: escaped and short.
std::string nameText(const std::string& name) { return "'" + tools::printable(name, 80) + "'"; }

// Where a saved or target chunk's rows sit in the logical (unpadded) global tensor (checkpoint.h,
// "Padding and resharding"): the padded axis is laid out as core/placement.h lays out a GTP_remat
// weight, the pad rows behind each TP slice when TP cuts that axis, at the tail otherwise.
struct RowMap {
  int axis = 0;
  bool padded = false;
  std::int64_t slicePad = 0;  // padded rows of one TP slice
  TensorPlacement layout;     // shape: the logical tensor; layoutShape(): the saved one
};

// `where` names the chunk when the padding record cannot describe the global shape.
RowMap rowMap(const Ints& savedGlobalShape, int axis, const std::optional<GtpPadding>& pad, const std::string& where) {
  RowMap m;
  m.axis = axis;
  if (!pad || pad->padLength == 0) return m;
  const bool interleaved = pad->tpAxis == 0 && pad->tpSize > 1;
  const std::int64_t extent = savedGlobalShape[std::size_t(axis)];
  TPSIM_CHECK(pad->tpSize >= 1 && pad->padLength > 0 && (!interleaved || extent % pad->tpSize == 0), where,
              ": expected padded axis ", axis, " of ", shapeText(savedGlobalShape), " to hold tp_size ", pad->tpSize,
              " equal slices, got a remainder");
  m.padded = true;
  m.slicePad = interleaved ? extent / pad->tpSize : extent;
  const std::int64_t dLog = m.slicePad - pad->padLength;
  TPSIM_CHECK(dLog >= 0, where, ": expected pad_length ", pad->padLength, " <= the ", m.slicePad,
              " padded rows of a TP slice, got more");
  m.layout.shape = savedGlobalShape;
  m.layout.shape[std::size_t(axis)] = (interleaved ? pad->tpSize : 1) * dLog;
  if (interleaved) m.layout.tp = {AxisKind::kShard, pad->tpSize, axis};
  m.layout.gtp = {AxisKind::kShard, 1, axis, 1, pad->padLength};
  return m;
}

Ints logicalShape(const Ints& savedGlobalShape, const RowMap& m) { return m.padded ? m.layout.shape : savedGlobalShape; }

// A block of the logical tensor: begin and extent per axis.
struct Box {
  Ints begin, shape;
};

// The real rows of a chunk (offset, localShape) as a logical box: a prefix of its rows, since a chunk
// never spans two TP slices and a slice's pad rows follow its last real row. `where` names the chunk
// for the error.
Box logicalBox(const Ints& offset, const Ints& localShape, const RowMap& m, const std::string& where) {
  Box b{offset, localShape};
  if (!m.padded) return b;
  const std::size_t axis = std::size_t(m.axis);
  const std::int64_t o = offset[axis], rows = localShape[axis];
  TPSIM_CHECK(m.slicePad > 0 && o % m.slicePad + rows <= m.slicePad, where, ": expected the chunk's rows [", o, ", ",
              o + rows, ") within one TP slice of ", m.slicePad, " padded rows, got them across slices");
  std::int64_t real = 0;
  while (real < rows && logicalIndexOf(m.layout, o + real)) ++real;
  b.begin[axis] = real > 0 ? *logicalIndexOf(m.layout, o) : 0;
  b.shape[axis] = real;
  return b;
}

// Copies the intersection of the logical boxes `src` and `dst`. srcData holds exactly src's box;
// dstData is laid out as dstLayout, with dst's box starting at index 0 on every axis (a target
// chunk's real rows are a prefix of its rows). Converts the dtype when the two differ (rounds once,
// to nearest even). Returns the number of elements copied.
std::int64_t copyOverlap(const Box& src, const char* srcData, DType srcDtype, const Box& dst, const Ints& dstLayout,
                         char* dstData, DType dstDtype) {
  const int rank = int(src.begin.size());
  Ints lo(rank), hi(rank);
  for (int i = 0; i < rank; ++i) {
    lo[i] = std::max(src.begin[i], dst.begin[i]);
    hi[i] = std::min(src.begin[i] + src.shape[i], dst.begin[i] + dst.shape[i]);
    if (hi[i] <= lo[i]) return 0;
  }
  const std::size_t srcSize = dtypeSize(srcDtype), dstSize = dtypeSize(dstDtype);
  const std::int64_t run = hi[rank - 1] - lo[rank - 1];
  Ints idx = lo;
  std::int64_t copied = 0;
  while (true) {
    std::int64_t s = 0, d = 0;
    for (int i = 0; i < rank; ++i) {
      s = s * src.shape[i] + (idx[i] - src.begin[i]);
      d = d * dstLayout[i] + (idx[i] - dst.begin[i]);
    }
    const char* from = srcData + s * srcSize;
    char* to = dstData + d * dstSize;
    if (srcDtype == dstDtype) {
      std::memcpy(to, from, std::size_t(run) * srcSize);
    } else {
      for (std::int64_t j = 0; j < run; ++j) storeFromDouble(dstDtype, loadAsDouble(srcDtype, from + j * srcSize), to + j * dstSize);
    }
    copied += run;
    int i = rank - 2;  // odometer over every axis but the last
    for (; i >= 0; --i) {
      if (++idx[i] < hi[i]) break;
      idx[i] = lo[i];
    }
    if (i < 0) return copied;
  }
}

// Whether the boxes share an element.
bool overlaps(const Box& a, const Box& b) {
  for (std::size_t i = 0; i < a.begin.size(); ++i)
    if (std::max(a.begin[i], b.begin[i]) >= std::min(a.begin[i] + a.shape[i], b.begin[i] + b.shape[i])) return false;
  return true;
}

// An element of a tensor that boxes inside it cover other than exactly once, and how many do.
struct TilingFault {
  Ints element;
  std::int64_t count = 0;  // 0: a hole; 2 or more: an overlap
};

// The first such element, or nullopt when the boxes (each inside `shape`) tile it. Sort and sweep,
// O(m log m) for the m = n·2^r corners of n boxes of rank r, never all pairs: the boxes tile the
// shape iff their indicator functions sum to the shape's, iff the sums of the functions' mixed
// differences agree (the difference loses nothing on functions of finite support). A box [a, a + s)
// has the mixed difference ±1 at its 2^r corners, - where an odd number of coordinates are a + s;
// an empty box none. No other difference lies below the first in lexicographic order on every
// axis, so there the coverage is the shape's (1) plus that difference.
std::optional<TilingFault> tilingFault(const std::vector<Box>& boxes, const Ints& shape) {
  const std::size_t rank = shape.size(), n = boxes.size();
  const Box whole{Ints(rank, 0), shape};
  // A corner: box index << rank | the axes on which it is the box's end; box n is the shape itself.
  const auto coordinate = [&](std::uint64_t corner, std::size_t axis) {
    const Box& b = corner >> rank < n ? boxes[corner >> rank] : whole;
    return b.begin[axis] + ((corner >> axis) & 1 ? b.shape[axis] : 0);
  };
  const auto less = [&](std::uint64_t a, std::uint64_t b) {
    for (std::size_t axis = 0; axis < rank; ++axis)
      if (coordinate(a, axis) != coordinate(b, axis)) return coordinate(a, axis) < coordinate(b, axis);
    return false;
  };
  std::vector<std::uint64_t> corners;
  for (std::uint64_t i = 0; i <= n; ++i)
    if (volume(i < n ? boxes[i].shape : shape) > 0)
      for (std::uint64_t ends = 0; ends < (std::uint64_t(1) << rank); ++ends) corners.push_back(i << rank | ends);
  std::sort(corners.begin(), corners.end(), less);
  for (std::size_t i = 0, j = 0; i < corners.size(); i = j) {
    std::int64_t sum = 0;
    for (j = i; j < corners.size() && !less(corners[i], corners[j]); ++j) {
      const std::uint64_t c = corners[j];
      const bool odd = __builtin_popcountll(c & ((std::uint64_t(1) << rank) - 1)) % 2;
      sum += (odd ? -1 : 1) * (c >> rank < n ? 1 : -1);
    }
    if (sum == 0) continue;
    TilingFault fault{Ints(rank), 1 + sum};
    for (std::size_t axis = 0; axis < rank; ++axis) fault.element[axis] = coordinate(corners[i], axis);
    TPSIM_INTERNAL_ASSERT(fault.count >= 0, "tilingFault: ", fault.count, " boxes at ", shapeText(fault.element));
    return fault;
  }
  return std::nullopt;
}

bool contains(const Box& b, const Ints& element) {
  for (std::size_t i = 0; i < element.size(); ++i)
    if (element[i] < b.begin[i] || element[i] >= b.begin[i] + b.shape[i]) return false;
  return true;
}

std::string paddingText(const CheckpointChunk& c) {
  const std::string axis = detail::concat("padded_axis ", c.paddedAxis, ", gtp_padding ");
  if (!c.gtpPadding) return axis + "null";
  return axis + detail::concat("(tp_axis ", c.gtpPadding->tpAxis, ", tp_size ", c.gtpPadding->tpSize, ", pad_length ",
                               c.gtpPadding->padLength, ")");
}

// A key's chunks share one padding record (it describes the saved tensor, not a chunk), tile the
// saved tensor, pad rows included, and their real rows the logical tensor, each element exactly
// once: no chunk written twice, none missing. `where` names the index or the save.
void checkKey(const CheckpointKey& k, const std::string& where) {
  const auto& c = k.chunks;
  const std::string key = detail::concat(where, ": key ", nameText(k.key));
  TPSIM_CHECK(!c.empty(), key, ": expected at least one chunk, got none");
  for (const CheckpointChunk& chunk : c)
    TPSIM_CHECK(paddingText(chunk) == paddingText(c.front()), key, ": expected every chunk to share one padding record, ",
                paddingText(c.front()), ", got ", paddingText(chunk), " for the chunk at ", shapeText(chunk.globalOffset),
                " of rank ", chunk.writer);
  std::vector<Box> saved, logical;
  for (const CheckpointChunk& chunk : c) {
    saved.push_back({chunk.globalOffset, chunk.localShape});
    logical.push_back(logicalBox(chunk.globalOffset, chunk.localShape,
                                 rowMap(k.savedGlobalShape, chunk.paddedAxis, chunk.gtpPadding, key), key));
  }
  // The first two chunks holding `element`.
  const auto holders = [&](const std::vector<Box>& boxes, const Ints& element) {
    std::vector<std::size_t> found;
    for (std::size_t i = 0; i < boxes.size() && found.size() < 2; ++i)
      if (contains(boxes[i], element)) found.push_back(i);
    TPSIM_INTERNAL_ASSERT(found.size() == 2, key, ": element ", shapeText(element), " in ", found.size(), " chunks");
    return found;
  };
  const auto missing = [&](const std::vector<Box>& boxes, const Ints& shape, const char* tensor, const Ints& element) {
    std::int64_t covered = 0;
    for (const Box& b : boxes) covered += volume(b.shape);
    return InvalidArgument(detail::concat(key, ": expected chunks covering all ", volume(shape), " elements of ",
                                          tensor, shapeText(shape), ", got ", covered, " with element ",
                                          shapeText(element), " in none; a chunk is missing (a rank that holds it did "
                                          "not contribute, or no replica of it is main)"));
  };
  if (const auto fault = tilingFault(saved, k.savedGlobalShape)) {
    if (fault->count == 0) throw missing(saved, k.savedGlobalShape, "the saved tensor ", fault->element);
    const auto two = holders(saved, fault->element);
    const CheckpointChunk &a = c[two[0]], &b = c[two[1]];
    throw InvalidArgument(detail::concat(key, ": expected each chunk written once, got ranks ", a.writer, " and ",
                                         b.writer, " both writing offsets ", shapeText(a.globalOffset), " and ",
                                         shapeText(b.globalOffset), " of ", shapeText(k.savedGlobalShape),
                                         " (two main replicas)"));
  }
  if (const auto fault = tilingFault(logical, k.globalShape)) {
    if (fault->count == 0) throw missing(logical, k.globalShape, "the logical tensor ", fault->element);
    const auto two = holders(logical, fault->element);
    const CheckpointChunk &a = c[two[0]], &b = c[two[1]];
    throw InvalidArgument(detail::concat(key, ": expected each logical element in one chunk, got element ",
                                         shapeText(fault->element), " in the chunks at ", shapeText(a.globalOffset),
                                         " (rank ", a.writer, ") and ", shapeText(b.globalOffset), " (rank ",
                                         b.writer, ")"));
  }
}

json axisJson(const AxisPlacement& a) {
  json j = {{"kind", axisKindName(a.kind)}, {"size", a.size}};
  if (a.kind == AxisKind::kShard) {
    j["dim"] = a.dim;
    j["stride"] = a.stride;
    j["pad_length"] = a.padLength;
  }
  return j;
}

json placementJson(const TensorPlacement& p) {
  return {{"text", placementText(p)}, {"tp", axisJson(p.tp)}, {"gtp_remat", axisJson(p.gtp)}};
}

json chunkJson(const CheckpointChunk& c) {
  json j{{"file", c.file},
         {"tensor", c.tensor},
         {"writer", c.writer},
         {"global_offset", c.globalOffset},
         {"local_shape", c.localShape},
         {"stored_shape", c.storedShape},
         {"padded_axis", c.paddedAxis},
         {"replica_id", c.replicaId},
         {"fnv1a64", hex64(c.checksum)},
         {"data_offsets", {c.dataBegin, c.dataEnd}}};
  j["gtp_padding"] = c.gtpPadding ? json{{"tp_axis", c.gtpPadding->tpAxis},
                                         {"tp_size", c.gtpPadding->tpSize},
                                         {"pad_length", c.gtpPadding->padLength}}
                                  : json(nullptr);
  return j;
}


// A name in the checkpoint's directory itself: no separator, not "." or "..", visible ASCII only
// (no NUL, which would end the name the system sees early).
bool isPlainFileName(const std::string& name) {
  return !name.empty() && name != "." && name != ".." &&
         std::all_of(name.begin(), name.end(), [](char c) { return c > 0x20 && c < 0x7f && c != '/' && c != '\\'; });
}

// ---- Reading untrusted JSON ------------------------------------------------------------------------
//
// An index or a header is parsed only once its nesting is known to be bounded and each key of an
// object given once; every number is an integer in its range (nlohmann would truncate 464.9 and
// wrap 2^32 to 0 in an int); no message shows more than a short, escaped excerpt of what was read.

// A JSON value as a message shows it: a number, bool or null as written, a string quoted, an array
// or object by its size, never dumped whole.
std::string excerpt(const json& v) {
  if (v.is_string()) return nameText(v.get_ref<const std::string&>());
  if (v.is_array()) return detail::concat("an array of ", v.size(), " elements");
  if (v.is_object()) return detail::concat("an object of ", v.size(), " fields");
  return v.dump();
}

// A first pass over untrusted JSON text that builds nothing: it stops at the first nesting deeper
// than kMaxJsonDepth, before anything that deep exists (nlohmann parses iteratively, but dump() and
// other walks of a value recurse), and at a key given twice in one object (nlohmann would keep the
// last). `what` is what the text should be: "a well-formed tpsim checkpoint index".
class UntrustedJsonCheck final : public json::json_sax_t {
 public:
  UntrustedJsonCheck(const std::string& where, const std::string& what) : where_(where), what_(what) {}
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override {
    deeper();
    keys_.emplace_back();
    return true;
  }
  bool key(string_t& key) override {
    TPSIM_CHECK(keys_.back().insert(key).second, where_, ": expected ", what_, " with each key once in an object, got ",
                nameText(key), " twice");
    return true;
  }
  bool end_object() override {
    keys_.pop_back();
    --depth_;
    return true;
  }
  bool start_array(std::size_t) override {
    deeper();
    return true;
  }
  bool end_array() override {
    --depth_;
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override {
    throw InvalidArgument(detail::concat(where_, ": expected ", what_, ", got ", tools::printable(e.what())));
  }

 private:
  void deeper() {
    TPSIM_CHECK(++depth_ <= kMaxJsonDepth, where_, ": expected ", what_, " nested at most ", kMaxJsonDepth,
                " deep, got deeper");
  }
  const std::string &where_, &what_;
  int depth_ = 0;
  std::vector<std::set<std::string>> keys_;  // of each open object, innermost last
};

json parseUntrusted(const char* begin, const char* end, const std::string& where, const std::string& what) {
  UntrustedJsonCheck check(where, what);
  json::sax_parse(begin, end, &check);
  try {
    return json::parse(begin, end);
  } catch (const json::exception& e) {
    throw InvalidArgument(detail::concat(where, ": expected ", what, ", got ", tools::printable(e.what())));
  }
}

// Field access and types in the index: nlohmann's own errors (a missing field, a string for an
// array) become InvalidArgument naming the file.
template <typename F>
auto parsing(const std::string& where, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const json::exception& e) {
    throw InvalidArgument(detail::concat(where, ": expected a well-formed tpsim checkpoint index, got ",
                                         tools::printable(e.what())));
  }
}

// An integer in [lo, hi]: a JSON integer, never a fraction, an exponent, a string or a bool.
std::int64_t readInt(const json& v, const std::string& where, const std::string& field, std::int64_t lo, std::int64_t hi) {
  const bool integer = v.is_number_integer() && !(v.is_number_unsigned() && v.get<std::uint64_t>() > std::uint64_t(INT64_MAX));
  const std::int64_t x = integer ? v.get<std::int64_t>() : 0;
  TPSIM_CHECK(integer && x >= lo && x <= hi, where, ": ", field, ": expected an integer in [", lo, ", ", hi, "], got ",
              excerpt(v));
  return x;
}

std::int64_t readInt(const json& j, const char* field, const std::string& where, std::int64_t lo, std::int64_t hi) {
  return readInt(j.at(field), where, field, lo, hi);
}

// A shape or an offset: at most kMaxRank non-negative integers whose product is below 2^48.
Ints shapeOf(const json& v, const std::string& where, const std::string& field) {
  TPSIM_CHECK(v.is_array() && v.size() <= kMaxRank, where, ": ", field, ": expected an array of at most ", kMaxRank,
              " dims, got ", excerpt(v));
  Ints s;
  std::int64_t n = 1;
  for (const json& d : v) {
    s.push_back(readInt(d, where, field, 0, kMaxElements - 1));
    TPSIM_CHECK(s.back() == 0 || n <= kMaxElements / s.back(), where, ": ", field,
                ": expected dims of fewer than 2^48 elements, got ", shapeText(s), "...");
    n = s.back() == 0 ? n : n * s.back();
  }
  return s;
}

Ints readShape(const json& j, const std::string& where, const char* field) { return shapeOf(j.at(field), where, field); }

const json& readObject(const json& j, const char* field, const std::string& where) {
  const json& v = j.at(field);
  TPSIM_CHECK(v.is_object(), where, ": ", field, ": expected an object, got ", excerpt(v));
  return v;
}

std::string readString(const json& j, const char* field, const std::string& where) {
  TPSIM_CHECK(j.contains(field), where, ": ", field, ": expected a string, got none");
  const json& v = j.at(field);
  TPSIM_CHECK(v.is_string(), where, ": ", field, ": expected a string, got ", excerpt(v));
  return v.get<std::string>();
}

// The 16 hex digits hex64 writes; anything else is a corrupt index, not a number.
std::uint64_t readHex64(const json& j, const std::string& where, const char* field) {
  const std::string text = readString(j, field, where);
  TPSIM_CHECK(text.size() == 16 && text.find_first_not_of("0123456789abcdef") == std::string::npos, where, ": ",
              field, ": expected 16 lowercase hex digits, got ", nameText(text));
  return std::stoull(text, nullptr, 16);
}

// The checksum of an index: FNV-1a 64 of its canonical content, the compact dump (keys sorted, as
// nlohmann's objects are) without the checksum's own field.
std::uint64_t indexChecksum(json index) {
  index.erase(kIndexChecksum);
  const std::string canonical = index.dump();
  return fnv1a64(canonical.data(), canonical.size());
}

std::string sealed(json index) {
  index[kIndexChecksum] = hex64(indexChecksum(index));
  return index.dump(1) + "\n";
}

}  // namespace

std::string safetensorsBytes(const std::vector<SafetensorsEntry>& tensors,
                             const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::uint64_t at = 0;
  for (const auto& t : tensors) {
    TPSIM_INTERNAL_ASSERT(std::int64_t(t.bytes.size()) == volume(t.shape) * std::int64_t(dtypeSize(t.dtype)),
                          t.name, ": ", t.bytes.size(), " bytes for ", shapeText(t.shape));
    TPSIM_CHECK(!header.contains(t.name), "safetensorsBytes: tensor names must be unique, got '", t.name, "' twice");
    header[t.name] = {{"dtype", safetensorsDtype(t.dtype)}, {"shape", t.shape}, {"data_offsets", {at, at + t.bytes.size()}}};
    at += t.bytes.size();
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data starts 8-byte aligned, as safetensors pads
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = char((std::uint64_t(text.size()) >> (8 * i)) & 0xff);
  out += text;
  for (const auto& t : tensors) out.append(t.bytes.data(), t.bytes.size());
  return out;
}

std::uint64_t safetensorsHeaderLength(const char* first, std::uint64_t fileSize, const std::string& where) {
  TPSIM_CHECK(fileSize >= 8, where, ": expected an 8-byte header length, got a ", fileSize, "-byte file");
  std::uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= std::uint64_t(static_cast<unsigned char>(first[i])) << (8 * i);
  TPSIM_CHECK(n <= fileSize - 8, where, ": expected a header length <= ", fileSize - 8,
              " (the file size less 8), got ", n);
  return n;
}

std::uint64_t safetensorsHeaderLength(const std::vector<char>& bytes, const std::string& where) {
  return safetensorsHeaderLength(bytes.data(), bytes.size(), where);
}

std::vector<SafetensorsTensor> readSafetensorsHeader(const std::vector<char>& bytes, const std::string& where) {
  const std::uint64_t n = safetensorsHeaderLength(bytes, where);
  return readSafetensorsHeader(bytes.data() + 8, n, bytes.size() - 8 - n, where);
}

std::vector<SafetensorsTensor> readSafetensorsHeader(const char* text, std::uint64_t n, std::uint64_t dataSize,
                                                     const std::string& where) {
  const json header = parseUntrusted(text, text + n, where, "a JSON header");
  TPSIM_CHECK(header.is_object(), where, ": expected a JSON object as header, got ", excerpt(header));
  std::vector<SafetensorsTensor> tensors;
  for (const auto& [name, t] : header.items()) {
    if (name == "__metadata__") {
      TPSIM_CHECK(t.is_object() && std::all_of(t.begin(), t.end(), [](const json& v) { return v.is_string(); }),
                  where, ": expected __metadata__ to map names to strings, got ", excerpt(t));
      continue;
    }
    const std::string tw = detail::concat(where, ": tensor ", nameText(name));
    TPSIM_CHECK(t.is_object() && t.size() == 3 && t.contains("dtype") && t.contains("shape") &&
                    t.contains("data_offsets") && t["dtype"].is_string() && t["data_offsets"].is_array() &&
                    t["data_offsets"].size() == 2,
                tw, ": expected dtype, shape and data_offsets [begin, end], got ", excerpt(t));
    const std::string& dt = t["dtype"].get_ref<const std::string&>();
    const auto dtype = parseSafetensorsDtype(dt);
    TPSIM_CHECK(dtype, tw, ": expected a known dtype (F32, BF16, F16, F64, I64, F8_E4M3, F8_E8M0), got ", nameText(dt));
    SafetensorsTensor out{name, *dtype, readShape(t, tw, "shape")};
    const json& off = t["data_offsets"];
    out.begin = std::uint64_t(readInt(off[0], tw, "data_offsets", 0, std::int64_t(dataSize)));
    out.end = std::uint64_t(readInt(off[1], tw, "data_offsets", std::int64_t(out.begin), std::int64_t(dataSize)));
    const std::uint64_t want = std::uint64_t(volume(out.shape)) * dtypeSize(*dtype);
    TPSIM_CHECK(out.end - out.begin == want, tw, ": expected ", want, " bytes for ", dt, " ", shapeText(out.shape),
                ", got data_offsets [", out.begin, ", ", out.end, ")");
    tensors.push_back(std::move(out));
  }
  // The format's byte buffer is entirely indexed: each data byte belongs to exactly one tensor (and
  // in a checkpoint to one checksum).
  std::sort(tensors.begin(), tensors.end(), [](const SafetensorsTensor& a, const SafetensorsTensor& b) {
    return std::tie(a.begin, a.end) < std::tie(b.begin, b.end);
  });
  std::uint64_t at = 0;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const SafetensorsTensor& t = tensors[i];
    TPSIM_CHECK(t.begin == at, where, ": tensor ", nameText(t.name), ": expected data_offsets from byte ", at,
                i == 0 ? std::string(" (the first data byte)") : " (where tensor " + nameText(tensors[i - 1].name) + " ends)",
                ", got [", t.begin, ", ", t.end, "): ", t.begin > at ? "a hole of " : "an overlap of ",
                t.begin > at ? t.begin - at : at - t.begin, " bytes");
    at = t.end;
  }
  TPSIM_CHECK(at == dataSize, where, ": ",
              tensors.empty() ? std::string("expected tensors") : "tensor " + nameText(tensors.back().name) +
                  detail::concat(" [", tensors.back().begin, ", ", at, "): expected the last tensor"),
              " to end at the data's end, byte ", dataSize, ", got a hole of ", dataSize - at, " bytes after ",
              tensors.empty() ? "the header" : "it");
  return tensors;
}

const char* safetensorsDtype(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "F32";
    case DType::kBFloat16: return "BF16";
    case DType::kFloat16: return "F16";
    case DType::kFloat64: return "F64";
    case DType::kInt64: return "I64";
    case DType::kFloat8E4M3: return "F8_E4M3";
    case DType::kFloat8E8M0: return "F8_E8M0";
  }
  return "?";
}

std::optional<DType> parseSafetensorsDtype(const std::string& name) {
  for (DType d : {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kFloat64, DType::kInt64,
                  DType::kFloat8E4M3, DType::kFloat8E8M0})
    if (name == safetensorsDtype(d)) return d;
  return std::nullopt;
}

std::uint64_t fnv1a64(const void* data, std::size_t size) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < size; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

// ---- Save ----------------------------------------------------------------------------------------

void CheckpointWriter::describe(const TensorPlacement& placement) {
  std::lock_guard<std::mutex> lock(mu_);
  placements_[placement.name] = placement;
}

void CheckpointWriter::add(int rank, const ShardedStateDict& stateDict, Compute& compute) {
  std::vector<Held> mine;
  std::vector<std::pair<ShardedObject, int>> objects;
  for (const ShardedEntry& entry : stateDict) {
    if (const auto* o = std::get_if<ShardedObject>(&entry)) {
      if (o->isMainReplica()) objects.push_back({*o, rank});
      continue;
    }
    const ShardedTensor& t = std::get<ShardedTensor>(entry);
    if (!t.isMainReplica()) continue;
    const int p = t.prependAxisNum;
    Held h;
    h.key = t.key;
    h.dtype = t.dtype;
    h.savedGlobalShape = t.globalShape;
    CheckpointChunk& c = h.chunk;
    c.writer = rank;
    c.globalOffset = t.globalOffset;
    c.localShape = Ints(std::size_t(p), 1);
    c.localShape.insert(c.localShape.end(), t.localShape.begin(), t.localShape.end());
    c.paddedAxis = p;
    c.gtpPadding = t.gtpPadding;
    c.replicaId = t.replicaId;
    const std::string where = detail::concat("checkpoint save: key '", t.key, "' of rank ", rank);
    TPSIM_CHECK(c.localShape.size() == t.globalShape.size() && c.globalOffset.size() == t.globalShape.size() &&
                    !t.globalShape.empty(),
                where, ": expected local shape, offset and global shape of one rank >= 1, got ", shapeText(c.localShape),
                ", ", shapeText(c.globalOffset), ", ", shapeText(t.globalShape));
    const Box real = logicalBox(c.globalOffset, c.localShape, rowMap(t.globalShape, p, t.gtpPadding, where), where);
    c.storedShape = c.localShape;
    c.storedShape[p] = real.shape[p];
    // The real rows are a prefix of the data's dim 0: a prefix of its row-major bytes.
    ConstView v = t.data;
    Tensor dense;
    if (!v.isContiguous()) {
      dense = compute.empty(v.shape(), v.dtype());
      compute.copy(v, dense);
      v = dense;
    }
    TPSIM_INTERNAL_ASSERT(v.dtype() == t.dtype && v.numel() == volume(c.localShape), where);
    std::vector<char> all(v.bytes());
    compute.download(v, all.data());
    all.resize(std::size_t(volume(c.storedShape)) * dtypeSize(t.dtype));
    c.checksum = fnv1a64(all.data(), all.size());
    h.bytes = std::move(all);
    mine.push_back(std::move(h));
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& h : mine) chunks_.push_back(std::move(h));
  for (auto& [o, r] : objects) {
    CheckpointObject& rec = objects_[o.key];
    TPSIM_CHECK(rec.key.empty() || rec.globalShape == o.globalShape, "checkpoint save: key '", o.key,
                "': expected one grid ", shapeText(rec.globalShape), " for every rank, got ", shapeText(o.globalShape),
                " from rank ", r);
    rec.key = o.key;
    rec.globalShape = o.globalShape;
    rec.offsets.push_back(o.globalOffset);
    rec.writers.push_back(r);
  }
}

namespace {

void putInts(std::string& out, const Ints& v) {
  wire::put(out, std::uint64_t(v.size()));
  for (std::int64_t x : v) wire::put(out, x);
}
Ints getInts(wire::Reader& in) {
  Ints v(in.get<std::uint64_t>());
  for (std::int64_t& x : v) x = in.get<std::int64_t>();
  return v;
}

}  // namespace

std::string CheckpointWriter::packed() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string out;
  wire::put(out, std::uint64_t(chunks_.size()));
  for (const Held& h : chunks_) {
    const CheckpointChunk& c = h.chunk;
    wire::putString(out, h.key);
    wire::put(out, h.dtype);
    putInts(out, h.savedGlobalShape);
    wire::putString(out, std::string(h.bytes.begin(), h.bytes.end()));
    wire::put(out, std::int32_t(c.writer));
    putInts(out, c.globalOffset);
    putInts(out, c.localShape);
    putInts(out, c.storedShape);
    wire::put(out, std::int32_t(c.paddedAxis));
    wire::put(out, std::uint8_t(c.gtpPadding.has_value()));
    if (c.gtpPadding) {
      wire::put(out, std::int32_t(c.gtpPadding->tpAxis));
      wire::put(out, std::int32_t(c.gtpPadding->tpSize));
      wire::put(out, c.gtpPadding->padLength);
    }
    putInts(out, Ints(c.replicaId.begin(), c.replicaId.end()));
    wire::put(out, c.checksum);
  }
  wire::put(out, std::uint64_t(objects_.size()));
  for (const auto& [key, o] : objects_) {
    wire::putString(out, key);
    putInts(out, o.globalShape);
    wire::put(out, std::uint64_t(o.offsets.size()));
    for (std::size_t i = 0; i < o.offsets.size(); ++i) {
      putInts(out, o.offsets[i]);
      wire::put(out, std::int32_t(o.writers[i]));
    }
  }
  return out;
}

void CheckpointWriter::addPacked(const std::string& bytes) {
  wire::Reader in(bytes, "a process's checkpoint chunks");
  std::vector<Held> held(in.get<std::uint64_t>());
  for (Held& h : held) {
    CheckpointChunk& c = h.chunk;
    h.key = in.getString();
    h.dtype = in.get<DType>();
    h.savedGlobalShape = getInts(in);
    const std::string data = in.getString();
    h.bytes.assign(data.begin(), data.end());
    c.writer = in.get<std::int32_t>();
    c.globalOffset = getInts(in);
    c.localShape = getInts(in);
    c.storedShape = getInts(in);
    c.paddedAxis = in.get<std::int32_t>();
    if (in.get<std::uint8_t>()) {
      GtpPadding& g = c.gtpPadding.emplace();
      g.tpAxis = in.get<std::int32_t>();
      g.tpSize = in.get<std::int32_t>();
      g.padLength = in.get<std::int64_t>();
    }
    const Ints replica = getInts(in);
    c.replicaId.assign(replica.begin(), replica.end());
    c.checksum = in.get<std::uint64_t>();
  }
  std::map<std::string, CheckpointObject> objects;
  for (auto n = in.get<std::uint64_t>(); n > 0; --n) {
    const std::string key = in.getString();
    CheckpointObject& o = objects[key];
    o.key = key;
    o.globalShape = getInts(in);
    for (auto cells = in.get<std::uint64_t>(); cells > 0; --cells) {
      o.offsets.push_back(getInts(in));
      o.writers.push_back(in.get<std::int32_t>());
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (Held& h : held) chunks_.push_back(std::move(h));
  for (const auto& [key, o] : objects) {
    CheckpointObject& rec = objects_[key];
    TPSIM_CHECK(rec.key.empty() || rec.globalShape == o.globalShape, "checkpoint save: key '", key,
                "': expected one grid ", shapeText(rec.globalShape), " for every rank, got ", shapeText(o.globalShape),
                " from ranks of another process");
    rec.key = key;
    rec.globalShape = o.globalShape;
    rec.offsets.insert(rec.offsets.end(), o.offsets.begin(), o.offsets.end());
    rec.writers.insert(rec.writers.end(), o.writers.begin(), o.writers.end());
  }
}

void CheckpointWriter::commit(const std::string& dir) const {
  std::lock_guard<std::mutex> lock(mu_);
  const std::string where = "checkpoint save to " + dir;
  // Keys, checked before anything is written.
  std::map<std::string, CheckpointKey> keys;
  std::map<int, std::vector<SafetensorsEntry>> files;  // writer -> its tensors
  std::map<int, std::uint64_t> fileData;               // writer -> its data bytes so far
  // Rank threads add in any order; the files and the index do not depend on it.
  std::vector<const Held*> held;
  for (const Held& h : chunks_) held.push_back(&h);
  std::sort(held.begin(), held.end(), [](const Held* a, const Held* b) {
    return std::tie(a->chunk.writer, a->key, a->chunk.globalOffset) < std::tie(b->chunk.writer, b->key, b->chunk.globalOffset);
  });
  for (const Held* hp : held) {
    const Held& h = *hp;
    CheckpointKey& k = keys[h.key];
    const RowMap m = rowMap(h.savedGlobalShape, h.chunk.paddedAxis, h.chunk.gtpPadding, where);
    const Ints logical = logicalShape(h.savedGlobalShape, m);
    if (k.key.empty()) {
      k.key = h.key;
      k.dtype = h.dtype;
      k.savedGlobalShape = h.savedGlobalShape;
      k.globalShape = logical;
    }
    TPSIM_CHECK(k.dtype == h.dtype && k.savedGlobalShape == h.savedGlobalShape && k.globalShape == logical, where,
                ": key '", h.key, "': expected every chunk of dtype ", dtypeName(k.dtype), " in global shape ",
                shapeText(k.savedGlobalShape), ", got ", dtypeName(h.dtype), " in ", shapeText(h.savedGlobalShape),
                " from rank ", h.chunk.writer);
    TPSIM_CHECK(k.savedGlobalShape.size() <= kMaxRank, where, ": key '", h.key, "': expected at most ", kMaxRank,
                " axes (what a load reads), got ", shapeText(k.savedGlobalShape));
    CheckpointChunk c = h.chunk;
    c.file = fileName(c.writer);
    c.tensor = chunkTensorName(h.key, c.globalOffset);
    c.dataBegin = fileData[c.writer];
    c.dataEnd = fileData[c.writer] += h.bytes.size();  // safetensorsBytes lays the tensors out in order
    k.chunks.push_back(c);
    files[c.writer].push_back({c.tensor, h.dtype, c.storedShape, h.bytes});
  }
  for (const auto& [name, k] : keys) checkKey(k, where);
  for (const auto& [name, o] : objects_) {
    const std::set<Ints> cells(o.offsets.begin(), o.offsets.end());
    TPSIM_CHECK(volume(o.globalShape) == std::int64_t(o.offsets.size()) && cells.size() == o.offsets.size(), where,
                ": key '", name, "': expected one main replica for each of the ", volume(o.globalShape),
                " cells of the object grid ", shapeText(o.globalShape), ", got ", o.offsets.size(), " for ",
                cells.size(), " distinct cells");
  }

  // The files' bytes and the index, whole before anything is written.
  json index{{"format", kFormat}, {"version", kVersion}, {"files", json::object()}, {"tensors", json::object()},
             {"objects", json::object()}};
  if (!layer_.empty()) index["layer"] = layer_;
  std::map<std::string, std::string> fileBytes;
  for (const auto& [writer, tensors] : files) {
    const std::string file = fileName(writer);
    std::string& bytes = fileBytes[file] =
        safetensorsBytes(tensors, {{"source", "tpsim checkpoint"}, {"rank", std::to_string(writer)}});
    std::uint64_t headerLen = 0;
    for (int i = 0; i < 8; ++i) headerLen |= std::uint64_t(static_cast<unsigned char>(bytes[i])) << (8 * i);
    index["files"][file] = {{"writer", writer},
                            {"size", bytes.size()},
                            {"header_fnv1a64", hex64(fnv1a64(bytes.data(), std::size_t(8 + headerLen)))}};
  }
  for (const auto& [name, k] : keys) {
    json chunks = json::array();
    for (const auto& c : k.chunks) chunks.push_back(chunkJson(c));
    index["tensors"][name] = {{"dtype", safetensorsDtype(k.dtype)},
                              {"global_shape", k.globalShape},
                              {"saved_global_shape", k.savedGlobalShape},
                              {"chunks", chunks}};
    if (const auto p = placements_.find(name); p != placements_.end())
      index["tensors"][name]["placement"] = placementJson(p->second);
  }
  for (const auto& [name, o] : objects_) {
    std::vector<std::pair<int, Ints>> cells;
    for (std::size_t i = 0; i < o.writers.size(); ++i) cells.push_back({o.writers[i], o.offsets[i]});
    std::sort(cells.begin(), cells.end());
    json offsets = json::array(), writers = json::array();
    for (const auto& [w, off] : cells) {
      writers.push_back(w);
      offsets.push_back(off);
    }
    index["objects"][name] = {{"global_shape", o.globalShape}, {"offsets", offsets}, {"writers", writers},
                              {"value", nullptr}};
  }
  const std::string indexText = sealed(std::move(index));
  TPSIM_CHECK(indexText.size() <= kMaxIndexBytes, where, ": expected an index of at most ", kMaxIndexBytes,
              " bytes (what a load reads), got ", indexText.size(), "; save fewer chunks");

  const fs::path root(dir);
  tools::OutputFiles output(where);  // the files, then the index last
  for (const auto& [file, bytes] : fileBytes) output.write((root / file).string(), bytes);
  output.write((root / kIndexName).string(), indexText);
  // The old index goes before any file it names is replaced; the new one lands last. A save that
  // fails before commit leaves the old checkpoint as it was, one that fails during it no index.
  output.removeBeforeRenames((root / kIndexName).string());
  // Files of an earlier, larger save are no part of this one. The directory is locked since the
  // first write: no other writer's files are listed.
  for (const auto& e : fs::directory_iterator(root))
    if (isRankFile(e.path()) && !fileBytes.count(e.path().filename().string()))
      output.removeAfterRenames(e.path().string());
  output.commit();
}

std::vector<std::string> checkpointOutputs(const std::string& dir, int ranks) {
  const fs::path root(dir);
  std::set<std::string> paths{(root / kIndexName).string()};
  for (int r = 0; r < ranks; ++r) paths.insert((root / fileName(r)).string());
  std::error_code ec;
  for (fs::directory_iterator e(root, ec), end; !ec && e != end; e.increment(ec))
    if (isRankFile(e->path())) paths.insert(e->path().string());
  return {paths.begin(), paths.end()};
}

// ---- Load ----------------------------------------------------------------------------------------

std::string sealCheckpointIndex(const std::string& text) {
  const std::string where = "sealCheckpointIndex";
  json index = parseUntrusted(text.data(), text.data() + text.size(), where, "a JSON object");
  TPSIM_CHECK(index.is_object(), where, ": expected a JSON object, got ", excerpt(index));
  return parsing(where, [&] { return sealed(std::move(index)); });
}

namespace {

// Messages name the file, and what it should be: "checkpoint ck/index.json: expected a readable
// index (written last by a complete save), got no such file". A checkpoint's files lie in its
// directory `home`: a name that resolves elsewhere (a symlink out of it) is refused once opened, so
// that what the open refuses (a FIFO behind a link) says so first.
tools::InputFile openCheckpointFile(const std::string& home, const std::string& path, const std::string& kind,
                                    const std::string& what) {
  tools::InputFile input(path, "checkpoint " + path, kind, [&](int error) {
    return detail::concat("checkpoint ", path, ": expected a readable ", what, ", got ",
                          error == ENOENT ? "no such file" : "an unreadable file");
  });
  const fs::path real = input.realPath();
  TPSIM_CHECK(real.parent_path() == fs::path(home), "checkpoint ", path, ": expected a file in ", home,
              ", got one resolving to ", tools::printable(real.string()), "; a checkpoint's files lie in its directory");
  return input;
}

// How messages name a key of the index at `where`, and a chunk of it.
std::string keyWhere(const std::string& where, const std::string& key) { return where + ": key " + nameText(key); }
std::string chunkWhere(const std::string& where, const std::string& key, const CheckpointChunk& c) {
  return detail::concat(keyWhere(where, key), " chunk ", nameText(c.tensor), " in ", tools::printable(c.file, 80));
}

}  // namespace

CheckpointIndex::CheckpointIndex(CheckpointIndex&&) noexcept = default;
CheckpointIndex::~CheckpointIndex() = default;

CheckpointIndex::CheckpointIndex(const std::string& dir) : indexPath_((fs::path(dir) / kIndexName).string()) {
  TPSIM_CHECK(fs::is_directory(dir), "checkpoint ", dir, ": expected a directory, got ",
              fs::exists(dir) ? "another kind of file" : "nothing there");
  home_ = fs::canonical(dir).string();
  lock_ = std::make_unique<tools::DirectoryReadLock>(dir);
  const std::vector<char> indexText =
      openCheckpointFile(home_, indexPath_, "an index", "index (written last by a complete save)")
          .readAll(kMaxIndexBytes);
  paths_.push_back(indexPath_);
  const std::string& where = indexPath_;
  json index = parseUntrusted(indexText.data(), indexText.data() + indexText.size(), where,
                              "a well-formed tpsim checkpoint index");
  parsing(where, [&] {
    TPSIM_CHECK(index.is_object() && index.contains("format") && index.contains("version"), where,
                ": expected a well-formed tpsim checkpoint index, got ", excerpt(index), " without format and version");
    TPSIM_CHECK(index["format"] == kFormat && index["version"].is_number_integer() && index["version"] == kVersion,
                where, ": expected format '", kFormat, "' version ", kVersion, ", got ", excerpt(index["format"]),
                " version ", excerpt(index["version"]));
    // The index's own checksum, before anything it says is believed: an edited index is corrupt.
    const std::uint64_t want = readHex64(index, where, kIndexChecksum), sum = indexChecksum(index);
    TPSIM_CHECK(sum == want, where, ": expected index checksum ", hex64(want), " (its ", kIndexChecksum, "), got ",
                hex64(sum), "; the index is corrupt or was edited");
    if (index.contains("layer")) {
      TPSIM_CHECK(index["layer"].is_string(), where, ": layer: expected a string, got ", excerpt(index["layer"]));
      layer_ = index["layer"].get<std::string>();
    }
    // Files: a plain name, the writer, the size and the header checksum that the reader compares.
    std::map<std::string, int> writers;
    for (const auto& [file, rec] : readObject(index, "files", where).items()) {
      TPSIM_CHECK(isPlainFileName(file), where, ": expected plain file names, got ", nameText(file));
      TPSIM_CHECK(!tools::isTemporaryName(file), where,
                  ": expected file names other than a save's temporaries (.tpsim-*.partial), which the next save "
                  "into the directory removes, got ",
                  nameText(file));
      TPSIM_CHECK(rec.is_object(), where, ": file ", nameText(file), ": expected an object, got ", excerpt(rec));
      File f{file, (fs::path(dir) / file).string()};
      f.writer = writers[file] = int(readInt(rec, "writer", where + ": file " + nameText(file), 0, INT32_MAX));
      f.size = std::uint64_t(readInt(rec, "size", where + ": file " + nameText(file), 0, INT64_MAX));
      f.headerChecksum = readHex64(rec, where, "header_fnv1a64");
      paths_.push_back(f.path);
      files_.push_back(std::move(f));
    }
    // Tensors: every chunk's fields, its shapes and padding against its key's, its name and writer.
    for (const auto& [name, t] : readObject(index, "tensors", where).items()) {
      const std::string kw = keyWhere(where, name);
      TPSIM_CHECK(t.is_object(), kw, ": expected an object, got ", excerpt(t));
      CheckpointKey k;
      k.key = name;
      const auto dtype = parseSafetensorsDtype(readString(t, "dtype", kw));
      TPSIM_CHECK(dtype, kw, ": expected a known dtype, got ", excerpt(t.at("dtype")));
      k.dtype = *dtype;
      k.globalShape = readShape(t, kw, "global_shape");
      k.savedGlobalShape = readShape(t, kw, "saved_global_shape");
      if (t.contains("placement")) {
        const json& p = t.at("placement");
        TPSIM_CHECK(p.is_object() && p.contains("text") && p.at("text").is_string(), kw,
                    ": expected a placement object with a text, got ", excerpt(p));
        k.placement = p.at("text").get<std::string>();
      }
      const std::size_t r = k.globalShape.size();
      TPSIM_CHECK(r >= 1 && k.savedGlobalShape.size() == r, kw, ": expected global shapes of one rank >= 1, got ",
                  shapeText(k.globalShape), " and ", shapeText(k.savedGlobalShape));
      const json& chunks = t.at("chunks");
      TPSIM_CHECK(chunks.is_array() && !chunks.empty(), kw, ": chunks: expected at least one chunk, got ",
                  chunks.is_array() ? "none" : excerpt(chunks));
      for (const auto& cj : chunks) {
        TPSIM_CHECK(cj.is_object(), kw, ": expected chunk objects, got ", excerpt(cj));
        CheckpointChunk c;
        c.file = readString(cj, "file", kw);
        c.tensor = readString(cj, "tensor", kw);
        const std::string cw = chunkWhere(where, name, c);
        c.writer = int(readInt(cj, "writer", cw, 0, INT32_MAX));
        c.globalOffset = readShape(cj, cw, "global_offset");
        c.localShape = readShape(cj, cw, "local_shape");
        c.storedShape = readShape(cj, cw, "stored_shape");
        TPSIM_CHECK(c.globalOffset.size() == r && c.localShape.size() == r && c.storedShape.size() == r, cw,
                    ": expected offsets and shapes of rank ", r, ", got ", shapeText(c.globalOffset), ", ",
                    shapeText(c.localShape), ", ", shapeText(c.storedShape));
        c.paddedAxis = int(readInt(cj, "padded_axis", cw, 0, std::int64_t(r) - 1));
        const json& replica = cj.at("replica_id");
        TPSIM_CHECK(replica.is_array(), cw, ": replica_id: expected an array, got ", excerpt(replica));
        for (const json& id : replica) c.replicaId.push_back(int(readInt(id, cw, "replica_id", 0, INT32_MAX)));
        TPSIM_CHECK(isMainReplica(c.replicaId), cw, ": replica_id: expected a main replica's (all zeros: only they "
                    "are written), got ", shapeText(Ints(c.replicaId.begin(), c.replicaId.end())));
        if (!cj.at("gtp_padding").is_null()) {
          const json& g = cj.at("gtp_padding");
          TPSIM_CHECK(g.is_object(), cw, ": gtp_padding: expected an object or null, got ", excerpt(g));
          c.gtpPadding = GtpPadding{int(readInt(g, "tp_axis", cw, 0, std::int64_t(r) - 1 - c.paddedAxis)),
                                    int(readInt(g, "tp_size", cw, 1, INT32_MAX)),
                                    readInt(g, "pad_length", cw, 0, kMaxElements - 1)};
        }
        c.checksum = readHex64(cj, cw, "fnv1a64");
        const json& offsets = cj.at("data_offsets");
        TPSIM_CHECK(offsets.is_array() && offsets.size() == 2, cw, ": data_offsets: expected [begin, end], got ",
                    excerpt(offsets));
        c.dataBegin = std::uint64_t(readInt(offsets[0], cw, "data_offsets", 0, INT64_MAX));
        c.dataEnd = std::uint64_t(readInt(offsets[1], cw, "data_offsets", 0, INT64_MAX));
        for (std::size_t i = 0; i < r; ++i)
          TPSIM_CHECK(c.globalOffset[i] + c.localShape[i] <= k.savedGlobalShape[i], cw, ": expected the chunk ",
                      shapeText(c.localShape), " at ", shapeText(c.globalOffset), " inside ", shapeText(k.savedGlobalShape));
        const RowMap m = rowMap(k.savedGlobalShape, c.paddedAxis, c.gtpPadding, cw);
        TPSIM_CHECK(logicalShape(k.savedGlobalShape, m) == k.globalShape, cw, ": expected its padding to leave ",
                    shapeText(k.globalShape), ", got ", shapeText(logicalShape(k.savedGlobalShape, m)));
        TPSIM_CHECK(logicalBox(c.globalOffset, c.localShape, m, cw).shape == c.storedShape, cw,
                    ": expected stored shape ", shapeText(logicalBox(c.globalOffset, c.localShape, m, cw).shape),
                    " (its real rows), got ", shapeText(c.storedShape));
        // The name its key and offset give, a file of the index and that file's writer; the reader
        // compares the rest with the file's header.
        const std::string want = chunkTensorName(name, c.globalOffset);
        TPSIM_CHECK(c.tensor == want, cw, ": expected tensor name ", nameText(want), " (its key and global offset), got ",
                    nameText(c.tensor));
        const auto w = writers.find(c.file);
        TPSIM_CHECK(w != writers.end(), cw, ": expected ", nameText(c.file),
                    " among the index's files, got no such entry");
        TPSIM_CHECK(c.writer == w->second, cw, ": expected writer ", w->second, " (the writer of ", nameText(c.file),
                    "), got ", c.writer);
        k.chunks.push_back(std::move(c));
      }
      keys_[name] = std::move(k);
    }
    for (const auto& [name, o] : readObject(index, "objects", where).items()) {
      const std::string ow = where + ": object " + nameText(name);
      const bool hasValue = o.is_object() && o.contains("value");
      TPSIM_CHECK(hasValue && o["value"].is_null(), ow, ": expected an object whose value is null (the layers' extra "
                  "state is None), got ", hasValue ? "value " + excerpt(o["value"]) : excerpt(o));
      CheckpointObject rec;
      rec.key = name;
      rec.globalShape = readShape(o, ow, "global_shape");
      const json &offsets = o.at("offsets"), &cellWriters = o.at("writers");
      TPSIM_CHECK(offsets.is_array() && cellWriters.is_array() && offsets.size() == cellWriters.size(), ow,
                  ": expected offsets and writers, one each per cell, got ", excerpt(offsets), " and ",
                  excerpt(cellWriters));
      for (std::size_t i = 0; i < offsets.size(); ++i) {
        rec.offsets.push_back(shapeOf(offsets[i], ow, "offsets"));
        bool inside = rec.offsets.back().size() == rec.globalShape.size();
        for (std::size_t a = 0; inside && a < rec.globalShape.size(); ++a)
          inside = rec.offsets.back()[a] < rec.globalShape[a];
        TPSIM_CHECK(inside, ow, ": offsets: expected cells of the grid ", shapeText(rec.globalShape), ", got ",
                    shapeText(rec.offsets.back()));
        rec.writers.push_back(int(readInt(cellWriters[i], ow, "writers", 0, INT32_MAX)));
      }
      objects_[name] = std::move(rec);
    }
  });
}

std::uint64_t CheckpointIndex::largestChunkBytes() const {
  std::uint64_t most = 0;
  for (const auto& [name, k] : keys_)
    for (const CheckpointChunk& c : k.chunks) most = std::max(most, c.dataEnd - c.dataBegin);
  return most;
}

std::uint64_t CheckpointIndex::chunkCacheBytes(std::int64_t boxElements) const {
  std::uint64_t most = 0;
  for (const auto& [name, k] : keys_) {
    // The chunks whose rows meet chunk c's are those that start before c ends, less those that end
    // by its start: two sorted prefix sums, not a pass over every pair (a key may have 10^5 chunks).
    using Edge = std::pair<std::int64_t, std::uint64_t>;  // a row, and the bytes of a chunk there
    std::vector<Edge> starts, ends;
    for (const CheckpointChunk& c : k.chunks) {
      starts.push_back({c.globalOffset[0], c.dataEnd - c.dataBegin});
      ends.push_back({c.globalOffset[0] + c.localShape[0], c.dataEnd - c.dataBegin});
    }
    std::sort(starts.begin(), starts.end());
    std::sort(ends.begin(), ends.end());
    std::vector<std::uint64_t> startSums(1, 0), endSums(1, 0);  // the bytes of the first i edges
    for (const Edge& e : starts) startSums.push_back(startSums.back() + e.second);
    for (const Edge& e : ends) endSums.push_back(endSums.back() + e.second);
    auto before = [](const std::vector<Edge>& edges, std::int64_t row, bool atRowToo) {
      const auto at = atRowToo ? std::upper_bound(edges.begin(), edges.end(), Edge{row, UINT64_MAX})
                               : std::lower_bound(edges.begin(), edges.end(), Edge{row, 0});
      return std::size_t(at - edges.begin());
    };
    std::uint64_t band = 0;  // the most bytes of the chunks whose rows meet one chunk's
    for (const CheckpointChunk& c : k.chunks) {
      const std::int64_t first = c.globalOffset[0], end = first + c.localShape[0];
      band = std::max(band, startSums[before(starts, end, false)] - endSums[before(ends, first, true)]);
    }
    const std::uint64_t all = startSums.back();
    most = std::max(most, std::min(all, 2 * band + std::uint64_t(boxElements) * dtypeSize(k.dtype)));
  }
  return most;
}

void CheckpointIndex::checkFitsInMemory(const std::string& holder) const {
  double bytes = 0;
  for (const File& f : files_) bytes += double(f.size);
  const std::optional<tools::AvailableMemory> available = tools::availableMemory();
  TPSIM_CHECK(!available || bytes <= double(available->bytes), "checkpoint ", home_, ": expected a checkpoint whose "
              "files fit in memory (", holder, " holds its tensors whole), got ", tools::bytesText(bytes),
              " (the index's sizes), more than the ", tools::bytesText(double(available->bytes)), " available (",
              available->source, ")");
}

const CheckpointKey& CheckpointIndex::key(const std::string& key) const {
  const auto it = keys_.find(key);
  if (it == keys_.end()) {
    std::string have;
    for (const auto& [n, k] : keys_) have += (have.empty() ? "" : ", ") + n;
    throw InvalidArgument(detail::concat("checkpoint ", indexPath_, ": expected key '", key, "', got only ",
                                         have.empty() ? "no keys" : tools::printable(have, 400)));
  }
  return it->second;
}

namespace {

// A reader keeps every file of its checkpoint open: where they are more than the soft limit on open
// descriptors leaves room for (ulimit -n, often 1024), the limit is raised, up to the hard one.
void allowOpenFiles(std::size_t files, const std::string& where) {
  constexpr rlim_t kOthers = 32;  // the process's own descriptors besides
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return;
  const rlim_t want = rlim_t(files) + kOthers;
  if (limit.rlim_cur < want) {
    limit.rlim_cur = limit.rlim_max == RLIM_INFINITY ? want : std::min(want, limit.rlim_max);
    if (::setrlimit(RLIMIT_NOFILE, &limit) != 0 || ::getrlimit(RLIMIT_NOFILE, &limit) != 0) return;
  }
  TPSIM_CHECK(limit.rlim_cur == RLIM_INFINITY || limit.rlim_cur >= want, where, ": expected at most ",
              limit.rlim_cur > kOthers ? limit.rlim_cur - kOthers : 0, " files, which a load keeps open (the hard "
              "limit on open files, ulimit -Hn, is ", limit.rlim_max, "), got ", files);
}

}  // namespace

CheckpointReader::CheckpointReader(CheckpointIndex index) : index_(std::move(index)) {
  const std::string& where = index_.indexPath_;
  allowOpenFiles(index_.files_.size(), where);
  // Files: size, header checksum, header well-formed and consistent with the file's size.
  // file -> its tensors by name, each with whether a chunk names it
  std::map<std::string, std::unordered_map<std::string, std::pair<SafetensorsTensor, bool>>> headers;
  for (const CheckpointIndex::File& f : index_.files_) {
    const std::string& fw = f.path;
    tools::InputFile input =
        openCheckpointFile(index_.home_, fw, "a safetensors file", "safetensors file named in the index");
    // Before reading: a file of another size, however large, is never read.
    TPSIM_CHECK(input.size() == f.size, fw, ": expected ", f.size, " bytes (the index's size), got ", input.size(),
                "; the file is truncated or was replaced");
    // The header alone first: its tensors must index the whole data, so that a file whose size was
    // edited with the index (a sparse file, the index resealed) is refused before its data is read.
    std::vector<char> bytes(std::size_t(std::min<std::uint64_t>(f.size, 8)));
    input.readAt(0, bytes.data(), bytes.size(), "header length");
    const std::uint64_t n = safetensorsHeaderLength(bytes.data(), f.size, fw);
    bytes.resize(std::size_t(8 + n));
    input.readAt(8, bytes.data() + 8, std::size_t(n), "header");
    const std::uint64_t header = fnv1a64(bytes.data(), bytes.size());
    TPSIM_CHECK(header == f.headerChecksum, fw, ": expected header checksum ", hex64(f.headerChecksum),
                " (the index's), got ", hex64(header), "; the header is corrupt");
    for (SafetensorsTensor& t : readSafetensorsHeader(bytes.data() + 8, n, f.size - 8 - n, fw)) {
      std::string name = t.name;
      headers[f.name][name] = {std::move(t), false};
    }
    dataStart_[f.name] = 8 + n;
    files_.emplace(f.name, std::move(input));
  }
  // Each chunk is read whole: one larger than the memory there is is refused before it is read.
  const std::optional<tools::AvailableMemory> available = tools::availableMemory();
  // Tensors: every chunk as its file's header has it, checksums, one padding record, tiling.
  for (const auto& [name, k] : index_.keys_) {
    for (const CheckpointChunk& c : k.chunks) {
      const std::string cw = chunkWhere(where, name, c);
      const auto ht = headers[c.file].find(c.tensor);
      TPSIM_CHECK(ht != headers[c.file].end(), cw, ": expected tensor ", nameText(c.tensor), " in ",
                  nameText(c.file), ", got none");
      const SafetensorsTensor& stored = ht->second.first;
      TPSIM_CHECK(stored.dtype == k.dtype && stored.shape == c.storedShape && stored.begin == c.dataBegin &&
                      stored.end == c.dataEnd,
                  cw, ": expected ", safetensorsDtype(k.dtype), " ", shapeText(c.storedShape), " at data_offsets [",
                  c.dataBegin, ", ", c.dataEnd, ") (the index's), got ", safetensorsDtype(stored.dtype), " ",
                  shapeText(stored.shape), " at [", stored.begin, ", ", stored.end, ") in the file");
      TPSIM_CHECK(!ht->second.second, cw, ": expected each stored tensor used once, got it twice");
      ht->second.second = true;
      const double bytes = double(c.dataEnd - c.dataBegin);
      TPSIM_CHECK(!available || bytes <= double(available->bytes), cw, ": expected a chunk that fits in memory (each "
                  "is read whole), got ", tools::bytesText(bytes), " (its data_offsets), more than the ",
                  tools::bytesText(double(available->bytes)), " available (", available->source, ")");
      chunkData(name, c);
    }
    checkKey(k, where);
  }
  // A stored tensor no chunk names would be bytes nobody checks.
  for (const auto& [file, names] : headers)
    for (const auto& [name, tensor] : names)
      TPSIM_CHECK(tensor.second, where, ": expected every tensor of ", nameText(file),
                  " named by a chunk, got ", nameText(name), " named by none");
  // The files are checked, and stay open: a save into the directory may go ahead, since one that
  // replaces a file leaves the reader reading the one it checked.
  index_.lock_.reset();
}

void CheckpointReader::load(const ShardedTensor& target, View dst, Compute& compute) const {
  const CheckpointKey& k = key(target.key);
  const std::string where = detail::concat("checkpoint ", index_.indexPath_, ": key '", target.key, "'");
  const int p = target.prependAxisNum;
  Ints local(std::size_t(p), 1);
  local.insert(local.end(), target.localShape.begin(), target.localShape.end());
  TPSIM_CHECK(local.size() == target.globalShape.size() && target.globalOffset.size() == local.size(), where,
              ": expected the target's local shape, offset and global shape of one rank, got ", shapeText(local), ", ",
              shapeText(target.globalOffset), ", ", shapeText(target.globalShape));
  const RowMap m = rowMap(target.globalShape, p, target.gtpPadding, where);
  const Ints logical = logicalShape(target.globalShape, m);
  TPSIM_CHECK(logical == k.globalShape, where, ": expected global shape ", shapeText(logical),
              " (this topology's, pad rows left out), got ", shapeText(k.globalShape), " in the checkpoint");
  TPSIM_CHECK(target.dtype == k.dtype || (isFloating(target.dtype) && isFloating(k.dtype)), where, ": expected dtype ",
              dtypeName(target.dtype), " or a floating type to convert from, got ", dtypeName(k.dtype));
  TPSIM_CHECK(dst.dtype() == target.dtype && dst.numel() == volume(local), where, ": expected a destination of ",
              dtypeName(target.dtype), " ", shapeText(local), ", got ", dst.str());
  const Box box = logicalBox(target.globalOffset, local, m, where);
  std::vector<char> host(std::size_t(volume(local)) * dtypeSize(target.dtype), 0);  // pad rows stay 0
  std::int64_t filled = 0;
  for (const CheckpointChunk& c : k.chunks) {
    const RowMap cm = rowMap(k.savedGlobalShape, c.paddedAxis, c.gtpPadding, where);
    const Box src = logicalBox(c.globalOffset, c.localShape, cm, where);
    if (overlaps(src, box)) filled += copyOverlap(src, chunkData(target.key, c).data(), k.dtype, box, local,
                                                  host.data(), target.dtype);
  }
  TPSIM_INTERNAL_ASSERT(filled == volume(box.shape), where, ": ", filled, " of ", volume(box.shape), " elements");
  Tensor staged = compute.empty(dst.shape(), dst.dtype());
  compute.upload(host.data(), staged);
  compute.copy(staged, dst);
}

std::vector<char> CheckpointReader::chunkData(const std::string& key, const CheckpointChunk& chunk) const {
  std::vector<char> data(std::size_t(chunk.dataEnd - chunk.dataBegin));
  files_.at(chunk.file).readAt(dataStart_.at(chunk.file) + chunk.dataBegin, data.data(), data.size(), "chunk data");
  const std::uint64_t sum = fnv1a64(data.data(), data.size());
  TPSIM_CHECK(sum == chunk.checksum, chunkWhere(index_.indexPath_, key, chunk), ": expected data checksum ",
              hex64(chunk.checksum), " (the index's), got ", hex64(sum),
              "; the data is corrupt, or changed after it was checked");
  return data;
}

void CheckpointReader::checkObject(const ShardedObject& target) const {
  const auto it = objects().find(target.key);
  if (it == objects().end()) {
    std::string have;
    for (const auto& [name, o] : objects()) {
      if (have.size() > 400) {  // a short excerpt, as every message shows of what it read
        have += ", ...";
        break;
      }
      have += (have.empty() ? "" : ", ") + nameText(name);
    }
    throw InvalidArgument(detail::concat("checkpoint ", index_.indexPath_, ": expected object '", target.key, "', got ",
                                         have.empty() ? "no objects" : "only " + have));
  }
  TPSIM_CHECK(it->second.globalShape == target.globalShape, "checkpoint ", index_.indexPath_, ": object '", target.key,
              "': expected grid ", shapeText(target.globalShape), ", got ", shapeText(it->second.globalShape));
}

std::vector<char> CheckpointReader::consolidated(const std::string& name) const {
  const CheckpointKey& k = key(name);
  std::vector<char> out(std::size_t(volume(k.globalShape)) * dtypeSize(k.dtype));
  readBox(name, Ints(k.globalShape.size(), 0), k.globalShape, out.data());
  return out;
}

void CheckpointReader::readBox(const std::string& name, const Ints& begin, const Ints& shape, char* out,
                               ChunkCache* cache) const {
  const CheckpointKey& k = key(name);
  const std::string& where = index_.indexPath_;
  bool inside = begin.size() == k.globalShape.size() && shape.size() == begin.size();
  for (std::size_t i = 0; inside && i < begin.size(); ++i)
    inside = begin[i] >= 0 && shape[i] >= 0 && begin[i] + shape[i] <= k.globalShape[i];
  TPSIM_INTERNAL_ASSERT(inside, where, ": key '", name, "': box at ", shapeText(begin), " of ", shapeText(shape),
                        " outside ", shapeText(k.globalShape));
  const Box box{begin, shape};
  if (cache && cache->key != name) *cache = {name, {}};
  std::int64_t filled = 0;
  for (const CheckpointChunk& c : k.chunks) {
    const Box src =
        logicalBox(c.globalOffset, c.localShape, rowMap(k.savedGlobalShape, c.paddedAxis, c.gtpPadding, where), where);
    if (!overlaps(src, box)) {
      if (cache) cache->chunks.erase(&c);
      continue;
    }
    if (!cache) {
      filled += copyOverlap(src, chunkData(name, c).data(), k.dtype, box, shape, out, k.dtype);
      continue;
    }
    auto held = cache->chunks.find(&c);
    if (held == cache->chunks.end()) held = cache->chunks.emplace(&c, chunkData(name, c)).first;
    filled += copyOverlap(src, held->second.data(), k.dtype, box, shape, out, k.dtype);
  }
  // The reader checked that the chunks tile the tensor exactly once.
  TPSIM_INTERNAL_ASSERT(filled == volume(shape), where, ": key '", name, "': ", filled, " of ", volume(shape),
                        " elements");
}

}  // namespace tpsim
