#include "tools/lib/checkpoint_files.h"

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <set>
#include <tuple>
#include <nlohmann/json.hpp>

#include "backends/errors.h"
#include "tools/lib/input_file.h"
#include "tools/lib/output_files.h"

namespace tpsim {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using Ints = std::vector<std::int64_t>;

constexpr const char* kIndexName = "index.json";
constexpr const char* kFormat = "tpsim-checkpoint";
constexpr int kVersion = 1;
// An index holds a few hundred bytes per chunk: 64 MiB is some 100,000 chunks, more than any layer
// has, and a bound on what a file named index.json can make a load read.
constexpr std::uint64_t kMaxIndexBytes = std::uint64_t(64) << 20;

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

std::string hex64(std::uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016" PRIx64, v);
  return buf;
}

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

bool overlaps(const Ints& aOff, const Ints& aShape, const Ints& bOff, const Ints& bShape) {
  for (std::size_t i = 0; i < aOff.size(); ++i)
    if (aOff[i] + aShape[i] <= bOff[i] || bOff[i] + bShape[i] <= aOff[i]) return false;
  return volume(aShape) > 0 && volume(bShape) > 0;
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

// Every key's chunks tile its logical tensor exactly once: saved boxes disjoint (no chunk written
// twice) and real rows adding up to the whole (none missing). `where` names the index or the save.
void checkTiling(const CheckpointKey& k, const std::string& where) {
  const auto& c = k.chunks;
  for (std::size_t i = 0; i < c.size(); ++i)
    for (std::size_t j = i + 1; j < c.size(); ++j)
      TPSIM_CHECK(!overlaps(c[i].globalOffset, c[i].localShape, c[j].globalOffset, c[j].localShape), where, ": key '",
                  k.key, "': expected each chunk written once, got ranks ", c[i].writer, " and ", c[j].writer,
                  " both writing offsets ", shapeText(c[i].globalOffset), " and ", shapeText(c[j].globalOffset),
                  " of ", shapeText(k.savedGlobalShape), " (two main replicas)");
  std::int64_t real = 0;
  for (const auto& ch : c) real += volume(ch.storedShape);
  TPSIM_CHECK(real == volume(k.globalShape), where, ": key '", k.key, "': expected chunks covering all ",
              volume(k.globalShape), " elements of ", shapeText(k.globalShape), ", got ", real,
              "; a chunk is missing (a rank that holds it did not contribute, or no replica of it is main)");
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
         {"fnv1a64", hex64(c.checksum)}};
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

// Reading: every field is type-checked; nlohmann's own errors become InvalidArgument naming the file.
template <typename F>
auto parsing(const std::string& where, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const json::exception& e) {
    throw InvalidArgument(detail::concat(where, ": expected a well-formed tpsim checkpoint index, got ", e.what()));
  }
}

// Dims non-negative and their product below 2^48 elements, so that no offset arithmetic can overflow.
Ints readShape(const json& j, const std::string& where, const char* field) {
  Ints s = j.at(field).get<Ints>();
  std::int64_t n = 1;
  for (std::int64_t d : s) {
    TPSIM_CHECK(d >= 0 && d < (std::int64_t(1) << 48) && (d == 0 || n <= (std::int64_t(1) << 48) / d), where, ": ",
                field, ": expected non-negative dims of fewer than 2^48 elements, got ", shapeText(s));
    n = d == 0 ? n : n * d;
  }
  return s;
}

// The 16 hex digits hex64 writes; anything else is a corrupt index, not a number.
std::uint64_t readHex64(const json& j, const std::string& where, const char* field) {
  const std::string text = j.at(field).get<std::string>();
  TPSIM_CHECK(text.size() == 16 && text.find_first_not_of("0123456789abcdef") == std::string::npos, where, ": ",
              field, ": expected 16 lowercase hex digits, got '", text, "'");
  return std::stoull(text, nullptr, 16);
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

void CheckpointWriter::commit(const std::string& dir) const {
  std::lock_guard<std::mutex> lock(mu_);
  const std::string where = "checkpoint save to " + dir;
  // Keys, checked before anything is written.
  std::map<std::string, CheckpointKey> keys;
  std::map<int, std::vector<SafetensorsEntry>> files;  // writer -> its tensors
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
    CheckpointChunk c = h.chunk;
    c.file = fileName(c.writer);
    std::string name = h.key + "@";
    for (std::size_t i = 0; i < c.globalOffset.size(); ++i) name += (i ? "," : "") + std::to_string(c.globalOffset[i]);
    c.tensor = name;
    k.chunks.push_back(c);
    files[c.writer].push_back({name, h.dtype, c.storedShape, h.bytes});
  }
  for (const auto& [name, k] : keys) checkTiling(k, where);
  for (const auto& [name, o] : objects_) {
    const std::set<Ints> cells(o.offsets.begin(), o.offsets.end());
    TPSIM_CHECK(volume(o.globalShape) == std::int64_t(o.offsets.size()) && cells.size() == o.offsets.size(), where,
                ": key '", name, "': expected one main replica for each of the ", volume(o.globalShape),
                " cells of the object grid ", shapeText(o.globalShape), ", got ", o.offsets.size(), " for ",
                cells.size(), " distinct cells");
  }

  // An old index goes first, so that a save failing halfway leaves no checkpoint that loads.
  const fs::path root(dir);
  fs::remove(root / kIndexName);
  tools::OutputFiles output(where);  // the files, then the index last
  json index{{"format", kFormat}, {"version", kVersion}, {"files", json::object()}, {"tensors", json::object()},
             {"objects", json::object()}};
  std::vector<std::string> written;
  for (const auto& [writer, tensors] : files) {
    const std::string file = fileName(writer);
    const std::string bytes = safetensorsBytes(tensors, {{"source", "tpsim checkpoint"}, {"rank", std::to_string(writer)}});
    std::uint64_t headerLen = 0;
    for (int i = 0; i < 8; ++i) headerLen |= std::uint64_t(static_cast<unsigned char>(bytes[i])) << (8 * i);
    output.write((root / file).string(), bytes);
    written.push_back(file);
    index["files"][file] = {{"writer", writer},
                            {"size", bytes.size()},
                            {"header_fnv1a64", hex64(fnv1a64(bytes.data(), std::size_t(8 + headerLen)))}};
  }
  // Files of an earlier, larger save are no part of this one.
  for (const auto& e : fs::directory_iterator(root)) {
    const std::string n = e.path().filename().string();
    if (n.rfind("rank-", 0) == 0 && e.path().extension() == ".safetensors" &&
        std::find(written.begin(), written.end(), n) == written.end())
      fs::remove(e.path());
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
  output.write((root / kIndexName).string(), index.dump(1) + "\n");
  output.commit();
}

// ---- Load ----------------------------------------------------------------------------------------

CheckpointReader::CheckpointReader(const std::string& dir) : dir_(dir), indexPath_((fs::path(dir) / kIndexName).string()) {
  TPSIM_CHECK(fs::is_directory(dir), "checkpoint ", dir, ": expected a directory, got ",
              fs::exists(dir) ? "another kind of file" : "nothing there");
  // Messages name the file, and what it should be: "checkpoint ck/index.json: expected a readable
  // index (written last by a complete save), got no such file".
  // A checkpoint's files lie in its directory: a name that resolves elsewhere (a symlink out of
  // it) is refused once opened, so that what the open refuses (a FIFO behind a link) says so first.
  const fs::path home = fs::canonical(dir);
  const auto openFile = [&home](const std::string& path, const std::string& kind, const std::string& what) {
    tools::InputFile input(path, "checkpoint " + path, kind, [&](int error) {
      return detail::concat("checkpoint ", path, ": expected a readable ", what, ", got ",
                            error == ENOENT ? "no such file" : "an unreadable file");
    });
    const fs::path real = input.realPath();
    TPSIM_CHECK(real.parent_path() == home, "checkpoint ", path, ": expected a file in ", home.string(),
                ", got one resolving to ", tools::printable(real.string()), "; a checkpoint's files lie in its directory");
    return input;
  };
  const std::vector<char> indexText =
      openFile(indexPath_, "an index", "index (written last by a complete save)").readAll(kMaxIndexBytes);
  const std::string& where = indexPath_;
  const json index = parsing(where, [&] { return json::parse(indexText.begin(), indexText.end()); });
  parsing(where, [&] {
    TPSIM_CHECK(index.at("format") == kFormat && index.at("version") == kVersion, where, ": expected format '",
                kFormat, "' version ", kVersion, ", got ", index.at("format").dump(), " version ",
                index.at("version").dump());
    // Files: size, header checksum, header well-formed and consistent with its data.
    std::map<std::string, std::map<std::string, std::pair<DType, Ints>>> headers;
    for (const auto& [file, rec] : index.at("files").items()) {
      TPSIM_CHECK(isPlainFileName(file), where, ": expected plain file names, got '", tools::printable(file), "'");
      const std::string fw = (fs::path(dir) / file).string();
      tools::InputFile input = openFile(fw, "a safetensors file", "safetensors file named in the index");
      const auto size = rec.at("size").get<std::uint64_t>();
      // Before reading: a file of another size, however large, is never read.
      TPSIM_CHECK(input.size() == size, fw, ": expected ", size, " bytes (the index's size), got ", input.size(),
                  "; the file is truncated or was replaced");
      std::vector<char> bytes = input.readAll(size);
      TPSIM_CHECK(bytes.size() >= 8, fw, ": expected an 8-byte header length, got a ", bytes.size(), "-byte file");
      std::uint64_t n = 0;
      for (int i = 0; i < 8; ++i) n |= std::uint64_t(static_cast<unsigned char>(bytes[i])) << (8 * i);
      TPSIM_CHECK(n <= bytes.size() - 8, fw, ": expected a header length <= ", bytes.size() - 8,
                  " (the file size less 8), got ", n);
      const std::uint64_t sum = fnv1a64(bytes.data(), std::size_t(8 + n)), want = readHex64(rec, where, "header_fnv1a64");
      TPSIM_CHECK(sum == want, fw, ": expected header checksum ", hex64(want), " (the index's), got ", hex64(sum),
                  "; the header is corrupt");
      json header;
      try {
        header = json::parse(bytes.begin() + 8, bytes.begin() + 8 + std::ptrdiff_t(n));
      } catch (const json::exception& e) {
        throw InvalidArgument(detail::concat(fw, ": expected a JSON header, got ", e.what()));
      }
      const std::uint64_t dataSize = bytes.size() - 8 - n;
      std::vector<std::pair<std::uint64_t, std::uint64_t>> ranges;
      TPSIM_CHECK(header.is_object(), fw, ": expected a JSON object as header, got ", header.type_name());
      for (const auto& [name, t] : header.items()) {
        if (name == "__metadata__") continue;
        TPSIM_CHECK(t.is_object() && t.contains("dtype") && t.contains("shape") && t.contains("data_offsets") &&
                        t["dtype"].is_string() && t["data_offsets"].is_array(),
                    fw, ": tensor '", name, "': expected dtype, shape and data_offsets, got ", t.dump());
        const std::string dt = t.at("dtype").get<std::string>();
        const auto dtype = parseSafetensorsDtype(dt);
        TPSIM_CHECK(dtype, fw, ": tensor '", name, "': expected a known dtype (F32, BF16, F16, F64, I64, F8_E4M3, "
                    "F8_E8M0), got '", dt, "'");
        const Ints shape = readShape(t, fw, "shape");
        const auto off = t.at("data_offsets").get<std::vector<std::uint64_t>>();
        TPSIM_CHECK(off.size() == 2 && off[0] <= off[1] && off[1] <= dataSize, fw, ": tensor '", name,
                    "': expected data_offsets [begin, end] within the ", dataSize, " data bytes, got ",
                    t.at("data_offsets").dump());
        TPSIM_CHECK(off[1] - off[0] == std::uint64_t(volume(shape)) * dtypeSize(*dtype), fw, ": tensor '", name,
                    "': expected ", volume(shape) * std::int64_t(dtypeSize(*dtype)), " bytes for ", dt, " ",
                    shapeText(shape), ", got ", off[1] - off[0]);
        ranges.push_back({off[0], off[1]});
        headers[file][name] = {*dtype, shape};
        dataBegin_[{file, name}] = std::size_t(8 + n + off[0]);
      }
      // No overlap and no gap: every data byte belongs to exactly one tensor (and so to a checksum).
      std::sort(ranges.begin(), ranges.end());
      std::uint64_t at = 0;
      for (auto [b, e] : ranges) {
        TPSIM_CHECK(b == at, fw, ": expected tensors' data to follow each other without overlap or gap, got one "
                    "starting at byte ", b, " after one ending at ", at);
        at = e;
      }
      TPSIM_CHECK(at == dataSize, fw, ": expected the tensors to fill the ", dataSize, " data bytes, got ", at);
      files_[file] = std::move(bytes);
    }
    // Tensors: chunks consistent with the headers, checksums, tiling.
    std::set<std::pair<std::string, std::string>> used;
    for (const auto& [name, t] : index.at("tensors").items()) {
      CheckpointKey k;
      k.key = name;
      const auto dtype = parseSafetensorsDtype(t.at("dtype").get<std::string>());
      TPSIM_CHECK(dtype, where, ": key '", name, "': expected a known dtype, got ", t.at("dtype").dump());
      k.dtype = *dtype;
      k.globalShape = readShape(t, where, "global_shape");
      k.savedGlobalShape = readShape(t, where, "saved_global_shape");
      if (t.contains("placement")) {
        const json& p = t.at("placement");
        TPSIM_CHECK(p.is_object() && p.contains("text") && p.at("text").is_string(), where, ": key '", name,
                    "': expected a placement object with a text, got ", p.dump());
        k.placement = p.at("text").get<std::string>();
      }
      TPSIM_CHECK(!k.globalShape.empty() && k.globalShape.size() == k.savedGlobalShape.size(), where, ": key '", name,
                  "': expected global shapes of one rank >= 1, got ", shapeText(k.globalShape), " and ",
                  shapeText(k.savedGlobalShape));
      for (const auto& cj : t.at("chunks")) {
        CheckpointChunk c;
        c.file = cj.at("file").get<std::string>();
        c.tensor = cj.at("tensor").get<std::string>();
        c.writer = cj.at("writer").get<int>();
        c.globalOffset = readShape(cj, where, "global_offset");
        c.localShape = readShape(cj, where, "local_shape");
        c.storedShape = readShape(cj, where, "stored_shape");
        c.paddedAxis = cj.at("padded_axis").get<int>();
        c.replicaId = cj.at("replica_id").get<ReplicaId>();
        if (!cj.at("gtp_padding").is_null()) {
          const json& g = cj.at("gtp_padding");
          c.gtpPadding = GtpPadding{g.at("tp_axis").get<int>(), g.at("tp_size").get<int>(),
                                    g.at("pad_length").get<std::int64_t>()};
          TPSIM_CHECK(c.gtpPadding->tpSize >= 1 && c.gtpPadding->padLength >= 0, where, ": key '", name,
                      "': expected tp_size >= 1 and pad_length >= 0, got ", g.dump());
        }
        const std::string cw = detail::concat(where, ": key '", name, "' chunk '", c.tensor, "' in ", c.file);
        const std::size_t r = k.globalShape.size();
        TPSIM_CHECK(c.globalOffset.size() == r && c.localShape.size() == r && c.storedShape.size() == r &&
                        c.paddedAxis >= 0 && std::size_t(c.paddedAxis) < r,
                    cw, ": expected offsets and shapes of rank ", r, " and a padded axis below it");
        for (std::size_t i = 0; i < r; ++i)
          TPSIM_CHECK(c.globalOffset[i] + c.localShape[i] <= k.savedGlobalShape[i], cw, ": expected the chunk ",
                      shapeText(c.localShape), " at ", shapeText(c.globalOffset), " inside ", shapeText(k.savedGlobalShape));
        const RowMap m = rowMap(k.savedGlobalShape, c.paddedAxis, c.gtpPadding, cw);
        TPSIM_CHECK(logicalShape(k.savedGlobalShape, m) == k.globalShape, cw, ": expected its padding to leave ",
                    shapeText(k.globalShape), ", got ", shapeText(logicalShape(k.savedGlobalShape, m)));
        TPSIM_CHECK(logicalBox(c.globalOffset, c.localShape, m, cw).shape == c.storedShape, cw,
                    ": expected stored shape ", shapeText(logicalBox(c.globalOffset, c.localShape, m, cw).shape),
                    " (its real rows), got ", shapeText(c.storedShape));
        const auto h = headers.find(c.file);
        TPSIM_CHECK(h != headers.end(), cw, ": expected ", c.file, " among the index's files, got no such entry");
        const auto ht = h->second.find(c.tensor);
        TPSIM_CHECK(ht != h->second.end(), cw, ": expected tensor '", c.tensor, "' in ", c.file, ", got none");
        TPSIM_CHECK(ht->second.first == k.dtype && ht->second.second == c.storedShape, cw, ": expected ",
                    safetensorsDtype(k.dtype), " ", shapeText(c.storedShape), " (the index's), got ",
                    safetensorsDtype(ht->second.first), " ", shapeText(ht->second.second), " in the file");
        TPSIM_CHECK(used.insert({c.file, c.tensor}).second, cw, ": expected each stored tensor used once, got it twice");
        c.checksum = readHex64(cj, cw, "fnv1a64");
        const std::size_t bytes = std::size_t(volume(c.storedShape)) * dtypeSize(k.dtype);
        const std::uint64_t sum = fnv1a64(files_.at(c.file).data() + dataBegin_.at({c.file, c.tensor}), bytes);
        TPSIM_CHECK(sum == c.checksum, cw, ": expected data checksum ", hex64(c.checksum), " (the index's), got ",
                    hex64(sum), "; the data is corrupt");
        k.chunks.push_back(std::move(c));
      }
      checkTiling(k, where);
      keys_[name] = std::move(k);
    }
    for (const auto& [name, o] : index.at("objects").items()) {
      CheckpointObject rec;
      rec.key = name;
      rec.globalShape = readShape(o, where, "global_shape");
      rec.offsets = o.at("offsets").get<std::vector<Ints>>();
      rec.writers = o.at("writers").get<std::vector<int>>();
      objects_[name] = std::move(rec);
    }
    // A stored tensor no chunk names would be bytes nobody checks.
    for (const auto& [file, names] : headers)
      for (const auto& [name, unused] : names)
        TPSIM_CHECK(used.count({file, name}), where, ": expected every tensor of ", file, " named by a chunk, got '",
                    name, "' named by none");
  });
}

const CheckpointKey& CheckpointReader::key(const std::string& key) const {
  const auto it = keys_.find(key);
  if (it == keys_.end()) {
    std::string have;
    for (const auto& [n, k] : keys_) have += (have.empty() ? "" : ", ") + n;
    throw InvalidArgument(detail::concat("checkpoint ", indexPath_, ": expected key '", key, "', got only ",
                                         have.empty() ? "no keys" : have));
  }
  return it->second;
}

void CheckpointReader::load(const ShardedTensor& target, View dst, Compute& compute) const {
  const CheckpointKey& k = key(target.key);
  const std::string where = detail::concat("checkpoint ", indexPath_, ": key '", target.key, "'");
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
    filled += copyOverlap(src, files_.at(c.file).data() + dataBegin_.at({c.file, c.tensor}), k.dtype, box, local,
                          host.data(), target.dtype);
  }
  TPSIM_INTERNAL_ASSERT(filled == volume(box.shape), where, ": ", filled, " of ", volume(box.shape), " elements");
  Tensor staged = compute.empty(dst.shape(), dst.dtype());
  compute.upload(host.data(), staged);
  compute.copy(staged, dst);
}

void CheckpointReader::checkObject(const ShardedObject& target) const {
  const auto it = objects_.find(target.key);
  TPSIM_CHECK(it != objects_.end(), "checkpoint ", indexPath_, ": expected object '", target.key, "', got none");
  TPSIM_CHECK(it->second.globalShape == target.globalShape, "checkpoint ", indexPath_, ": object '", target.key,
              "': expected grid ", shapeText(target.globalShape), ", got ", shapeText(it->second.globalShape));
}

std::vector<char> CheckpointReader::consolidated(const std::string& name) const {
  const CheckpointKey& k = key(name);
  std::vector<char> out(std::size_t(volume(k.globalShape)) * dtypeSize(k.dtype));
  const Box all{Ints(k.globalShape.size(), 0), k.globalShape};
  for (const CheckpointChunk& c : k.chunks) {
    const Box src = logicalBox(c.globalOffset, c.localShape,
                               rowMap(k.savedGlobalShape, c.paddedAxis, c.gtpPadding, indexPath_), indexPath_);
    copyOverlap(src, files_.at(c.file).data() + dataBegin_.at({c.file, c.tensor}), k.dtype, all, k.globalShape,
                out.data(), k.dtype);
  }
  return out;
}

}  // namespace tpsim
