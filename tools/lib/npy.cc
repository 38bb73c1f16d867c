#include "tools/lib/npy.h"

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <system_error>

#include "backends/dims.h"
#include "backends/errors.h"
#include "tools/lib/input_file.h"

namespace tpsim::tools {
namespace {

constexpr char kMagic[] = "\x93NUMPY";
constexpr std::size_t kMagicSize = sizeof kMagic - 1;
constexpr std::size_t kPreambleSize = kMagicSize + 2;  // magic, major, minor
constexpr std::size_t kAlign = 64;                     // numpy ARRAY_ALIGN: data offset alignment
// numpy GROWTH_AXIS_MAX_DIGITS: room left after the dict so the first axis can grow in place.
constexpr std::size_t kGrowthAxisMaxDigits = 21;
constexpr std::size_t kMaxV1HeaderSize = 0xffff;
constexpr char kExampleHeader[] = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";
constexpr char kWhitespace[] = " \t\n\r";

// The dtypes NumPy can hold, by descr without its byte-order character.
struct NpyType {
  DType dtype;
  const char* code;
};
constexpr NpyType kTypes[] = {{DType::kFloat32, "f4"},
                              {DType::kFloat16, "f2"},
                              {DType::kFloat64, "f8"},
                              {DType::kInt64, "i8"}};
constexpr char kSupportedDescrs[] = "'<f4', '<f2', '<f8', '<i8'";

struct FileCloser {
  void operator()(std::FILE* f) const { std::fclose(f); }
};
using File = std::unique_ptr<std::FILE, FileCloser>;

struct Header {
  std::string descr;  // as written, e.g. "<f4"
  DType dtype;
  std::vector<std::int64_t> shape;
};

bool hostIsLittleEndian() {
  const std::uint16_t one = 1;
  unsigned char first;
  std::memcpy(&first, &one, 1);
  return first == 1;
}

std::string trim(const std::string& s) {
  const std::size_t begin = s.find_first_not_of(kWhitespace);
  if (begin == std::string::npos) return "";
  return s.substr(begin, s.find_last_not_of(kWhitespace) - begin + 1);
}

// Bytes taken by `shape` elements of `itemSize` bytes; nullopt past the int64 range numpy uses.
std::optional<std::uint64_t> byteCount(const std::vector<std::int64_t>& shape,
                                       std::size_t itemSize) {
  constexpr auto kMax = std::uint64_t(std::numeric_limits<std::int64_t>::max());
  std::uint64_t bytes = itemSize;
  for (std::int64_t d : shape) {
    if (d == 0) return 0;
    if (bytes > kMax / std::uint64_t(d)) return std::nullopt;
    bytes *= std::uint64_t(d);
  }
  return bytes;
}

// Splits the header's Python dict literal into key -> value source text. Values stay text so an
// unsupported one is quoted back verbatim; only the three known keys are interpreted later.
class DictSplitter {
 public:
  DictSplitter(const std::string& where, const std::string& text) : where_(where), text_(text) {}

  std::map<std::string, std::string> split() {
    std::map<std::string, std::string> entries;
    skipSpace();
    expect('{');
    for (;;) {
      skipSpace();
      if (peek() == '}') break;  // empty dict or trailing comma
      std::string key = stringLiteral();
      skipSpace();
      expect(':');
      std::string value = trim(valueText());
      if (value.empty()) fail("missing value for key '" + key + "'");
      entries[key] = value;  // a repeated key keeps the last value, as in Python
      skipSpace();
      if (peek() == '}') break;
      expect(',');
    }
    ++pos_;
    skipSpace();
    if (pos_ != text_.size()) fail("unexpected text after '}'");
    return entries;
  }

 private:
  char peek() const { return pos_ < text_.size() ? text_[pos_] : '\0'; }
  void skipSpace() { pos_ = std::min(text_.find_first_not_of(kWhitespace, pos_), text_.size()); }
  void expect(char c) {
    if (peek() != c) fail(std::string("expected '") + c + "'");
    ++pos_;
  }

  std::string stringLiteral() {
    const char quote = peek();
    if (quote != '\'' && quote != '"') fail("expected a quoted key");
    const std::size_t end = text_.find(quote, pos_ + 1);
    if (end == std::string::npos) fail("unterminated string");
    std::string s = text_.substr(pos_ + 1, end - pos_ - 1);
    pos_ = end + 1;
    return s;
  }

  // Source text up to the ',' or '}' that ends this value, skipping nested brackets and strings.
  std::string valueText() {
    const std::size_t begin = pos_;
    int depth = 0;
    for (; pos_ < text_.size(); ++pos_) {
      const char c = text_[pos_];
      if (c == '\'' || c == '"') {
        const std::size_t close = text_.find(c, pos_ + 1);
        if (close == std::string::npos) fail("unterminated string");
        pos_ = close;
      } else if (c == '(' || c == '[' || c == '{') {
        ++depth;
      } else if (c == ')' || c == ']' || c == '}') {
        if (depth == 0 && c == '}') break;
        if (depth == 0) fail(std::string("unbalanced '") + c + "'");
        --depth;
      } else if (c == ',' && depth == 0) {
        break;
      }
    }
    if (pos_ >= text_.size()) fail("unexpected end");
    return text_.substr(begin, pos_ - begin);
  }

  [[noreturn]] void fail(const std::string& what) const {
    throw InvalidArgument(detail::concat(where_, ": header must be a Python dict literal like ",
                                         kExampleHeader, ", got \"", printable(trim(text_)), "\" (",
                                         what, " at offset ", pos_, ")"));
  }

  const std::string& where_;
  const std::string& text_;
  std::size_t pos_ = 0;
};

// "(2, 3)", "(5,)" or "()" -> dims; nullopt for anything that is not a tuple of non-negative
// int64 literals (Python reads "(5)" as the int 5, so it is rejected too).
std::optional<std::vector<std::int64_t>> parseShape(const std::string& text) {
  if (text.size() < 2 || text.front() != '(' || text.back() != ')') return std::nullopt;
  std::vector<std::string> items;
  std::size_t begin = 1;
  for (std::size_t comma; (comma = text.find(',', begin)) != std::string::npos; begin = comma + 1)
    items.push_back(trim(text.substr(begin, comma - begin)));
  const std::string last = trim(text.substr(begin, text.size() - 1 - begin));
  if (!last.empty()) {
    if (items.empty()) return std::nullopt;  // "(5)": no comma, not a tuple
    items.push_back(last);
  }
  std::vector<std::int64_t> shape;
  for (const std::string& item : items) {
    std::int64_t d = 0;
    const char* end = item.data() + item.size();
    const auto [ptr, ec] = std::from_chars(item.data(), end, d);
    if (item.empty() || item[0] == '-' || ec != std::errc() || ptr != end) return std::nullopt;
    shape.push_back(d);
  }
  return shape;
}

// The dtype of a quoted descr such as '<f4'. '|' and '=' mean native order, so they are
// little-endian only on a little-endian machine.
DType parseDescr(const std::string& where, const std::string& valueText) {
  const bool quoted = valueText.size() == 5 && (valueText[0] == '\'' || valueText[0] == '"') &&
                      valueText.back() == valueText[0];
  const char order = quoted ? valueText[1] : '?';
  const std::string code = quoted ? valueText.substr(2, 2) : "";
  for (const NpyType& t : kTypes) {
    if (code != t.code || std::string("<>|=").find(order) == std::string::npos) continue;
    const bool native = order == '|' || order == '=';
    TPSIM_CHECK(order == '<' || (native && hostIsLittleEndian()), where,
                ": data must be little-endian, got descr ", valueText,
                native ? " on a big-endian machine" : "", "; convert with a.astype('<", t.code,
                "') before np.save");
    return t.dtype;
  }
  throw InvalidArgument(detail::concat(where, ": descr must be one of ", kSupportedDescrs, ", got ",
                                       valueText,
                                       "; convert with a.astype(np.float32) (values) or a.astype(np.int64) (token ids) before np.save"));
}

Header parseHeader(const std::string& where, const std::string& text) {
  const std::map<std::string, std::string> entries = DictSplitter(where, text).split();
  std::string keys;
  for (const auto& entry : entries) keys += (keys.empty() ? "'" : ", '") + entry.first + "'";
  TPSIM_CHECK(entries.size() == 3 && entries.count("descr") && entries.count("fortran_order") &&
                  entries.count("shape"),
              where,
              ": header must have exactly the keys 'descr', 'fortran_order' and 'shape', got ",
              keys.empty() ? "none" : keys);

  Header header;
  const std::string& descrText = entries.at("descr");
  header.dtype = parseDescr(where, descrText);
  header.descr = descrText.substr(1, 3);

  const std::string& fortran = entries.at("fortran_order");
  TPSIM_CHECK(fortran == "True" || fortran == "False", where,
              ": fortran_order must be True or False, got ", fortran);
  TPSIM_CHECK(fortran == "False", where,
              ": expected fortran_order False (only C order is supported), got True; save with "
              "np.save(path, np.ascontiguousarray(a))");

  const std::string& shapeText = entries.at("shape");
  std::optional<std::vector<std::int64_t>> shape = parseShape(shapeText);
  TPSIM_CHECK(shape, where,
              ": shape must be a tuple of non-negative integers like (2, 3), (5,) or (), got ",
              shapeText);
  header.shape = std::move(*shape);
  return header;
}

// numpy _wrap_header: spaces then '\n' so the data starts on a kAlign boundary; always 1..kAlign
// spaces, never zero.
std::size_t headerPadding(std::size_t dictSize, std::size_t lengthFieldSize) {
  return kAlign - (kPreambleSize + lengthFieldSize + dictSize + 1) % kAlign;
}

}  // namespace

namespace {

// An open .npy file positioned at its data, whose header and size have been checked.
struct OpenNpy {
  InputFile file;
  Header header;
  std::uint64_t dataBytes = 0;
};

OpenNpy openNpy(const std::string& path, const std::string& where) {
  InputFile file(path, where, "a .npy file", [&](int error) {
    return detail::concat(where, ": expected a readable .npy file, got '", std::strerror(error), "'");
  });
  const std::uint64_t fileSize = file.size();

  std::string preamble(std::min<std::uint64_t>(fileSize, kPreambleSize), '\0');
  file.read(preamble.data(), preamble.size(), "magic string");
  const bool isZip = preamble.compare(0, 2, "PK") == 0;
  TPSIM_CHECK(preamble.size() == kPreambleSize && preamble.compare(0, kMagicSize, kMagic) == 0,
              where, ": expected the .npy magic string \"\\x93NUMPY\" and a version, got \"",
              printable(preamble), "\"",
              isZip ? "; this looks like an .npz archive, save each array with np.save" : "");

  const int major = static_cast<unsigned char>(preamble[kMagicSize]);
  const int minor = static_cast<unsigned char>(preamble[kMagicSize + 1]);
  TPSIM_CHECK((major == 1 || major == 2 || major == 3) && minor == 0, where,
              ": format version must be 1.0, 2.0 or 3.0, got ", major, ".", minor);

  // 1.0 stores the header length as uint16, 2.0 and 3.0 as uint32 (3.0 only differs in using
  // UTF-8 for the header, which matters only for structured field names we reject anyway).
  const std::size_t lengthFieldSize = major == 1 ? 2 : 4;
  TPSIM_CHECK(fileSize >= kPreambleSize + lengthFieldSize, where, ": expected a ", lengthFieldSize,
              "-byte header length after the magic string, found ", fileSize - kPreambleSize,
              " bytes; the file is truncated");
  unsigned char lengthBytes[4];
  file.read(lengthBytes, lengthFieldSize, "header length");
  std::uint64_t headerSize = 0;
  for (std::size_t i = lengthFieldSize; i-- > 0;) headerSize = (headerSize << 8) | lengthBytes[i];
  const std::uint64_t dataOffset = kPreambleSize + lengthFieldSize + headerSize;
  TPSIM_CHECK(dataOffset <= fileSize, where, ": expected a header of ", headerSize,
              " bytes, found ", fileSize - kPreambleSize - lengthFieldSize,
              "; the file is truncated");
  std::string headerText(headerSize, '\0');
  file.read(headerText.data(), headerText.size(), "header");
  Header header = parseHeader(where, headerText);

  const std::optional<std::uint64_t> bytes = byteCount(header.shape, dtypeSize(header.dtype));
  const std::uint64_t found = fileSize - dataOffset;
  TPSIM_CHECK(bytes, where, ": expected a shape of at most 2^63 bytes, got ",
              shapeText(header.shape), " of ", header.descr, " with ", found, " bytes of data");
  TPSIM_CHECK(*bytes == found, where, ": expected ", *bytes, " bytes of data for shape ",
              shapeText(header.shape), " of ", header.descr, ", found ", found,
              found < *bytes ? std::string("; the file is truncated")
                             : "; the file has " + std::to_string(found - *bytes) +
                                   " trailing bytes after the array; write one array per file "
                                   "with np.save");

  return {std::move(file), std::move(header), *bytes};
}

}  // namespace

NpyArray readNpyHeader(const std::string& path) {
  OpenNpy npy = openNpy(path, "readNpy '" + path + "'");
  return {npy.header.dtype, std::move(npy.header.shape), {}};
}

NpyArray readNpy(const std::string& path) {
  NpyReader reader(path);
  NpyArray array{reader.dtype(), reader.shape(), {}};
  array.data.resize(std::size_t(reader.numel()) * dtypeSize(reader.dtype()));
  reader.read(reader.numel(), array.data.data());
  return array;
}

struct NpyReader::Open {
  OpenNpy npy;
  std::int64_t numel = 1;
};

NpyReader::NpyReader(const std::string& path)
    : open_(std::make_unique<Open>(Open{openNpy(path, "readNpy '" + path + "'")})) {
  for (std::int64_t d : open_->npy.header.shape) open_->numel *= d;  // fits: the data's bytes were counted
}
NpyReader::~NpyReader() = default;
NpyReader::NpyReader(NpyReader&&) noexcept = default;
DType NpyReader::dtype() const { return open_->npy.header.dtype; }
const std::vector<std::int64_t>& NpyReader::shape() const { return open_->npy.header.shape; }
std::int64_t NpyReader::numel() const { return open_->numel; }

void NpyReader::read(std::int64_t count, char* out) {
  open_->npy.file.read(out, std::size_t(count) * dtypeSize(dtype()), "data");
}
void NpyReader::skip(std::int64_t count) { open_->npy.file.skip(std::uint64_t(count) * dtypeSize(dtype())); }

namespace {

// The header numpy.save writes for (dtype, shape), after checking them; `bytes` gets the data size.
std::string npyHeader(const std::string& where, DType dtype, const std::vector<std::int64_t>& shape,
                      const void* data, std::uint64_t& bytes) {
  const NpyType* type = nullptr;
  for (const NpyType& t : kTypes)
    if (t.dtype == dtype) type = &t;
  TPSIM_CHECK(type, where, ": dtype must be one of fp32, fp16, fp64, int64, got ", dtypeName(dtype),
              "; NumPy has no bfloat16 or fp8 type, widen to fp32 first");
  for (std::int64_t d : shape)
    TPSIM_CHECK(d >= 0, where, ": shape must be non-negative, got ", shapeText(shape));
  const std::optional<std::uint64_t> count = byteCount(shape, dtypeSize(dtype));
  TPSIM_CHECK(count, where, ": expected a shape of at most 2^63 bytes, got ", shapeText(shape),
              " of ", dtypeName(dtype));
  TPSIM_CHECK(data || *count == 0, where, ": data must not be null for shape ", shapeText(shape),
              ", got nullptr");
  bytes = *count;

  // Keys sorted, each value's repr followed by ", " -- the exact text numpy.save writes.
  std::string dict = std::string("{'descr': '<") + type->code +
                     "', 'fortran_order': False, 'shape': " + shapeText(shape) + ", }";
  if (!shape.empty()) dict.append(kGrowthAxisMaxDigits - std::to_string(shape[0]).size(), ' ');
  std::size_t lengthFieldSize = 2;
  std::size_t padding = headerPadding(dict.size(), lengthFieldSize);
  if (dict.size() + padding + 1 > kMaxV1HeaderSize) {  // too long for 1.0's uint16 length
    lengthFieldSize = 4;
    padding = headerPadding(dict.size(), lengthFieldSize);
  }
  const std::size_t headerSize = dict.size() + padding + 1;

  std::string out(kMagic, kMagicSize);
  out += char(lengthFieldSize == 2 ? 1 : 2);
  out += char(0);
  for (std::size_t i = 0; i < lengthFieldSize; ++i) out += char((headerSize >> (8 * i)) & 0xff);
  out += dict;
  out.append(padding, ' ');
  out += '\n';
  return out;
}

bool writeAll(std::FILE* file, const std::string& header, const void* data, std::uint64_t bytes) {
  return std::fwrite(header.data(), 1, header.size(), file) == header.size() &&
         (bytes == 0 || std::fwrite(data, 1, bytes, file) == bytes);
}

}  // namespace

void writeNpy(const std::string& path, DType dtype, const std::vector<std::int64_t>& shape,
              const void* data) {
  const std::string where = "writeNpy '" + path + "'";
  std::uint64_t bytes = 0;
  const std::string header = npyHeader(where, dtype, shape, data, bytes);
  File file(std::fopen(path.c_str(), "wb"));
  const int openErrno = errno;
  TPSIM_CHECK(file, where, ": expected a writable path, got '", std::strerror(openErrno), "'");
  bool ok = writeAll(file.get(), header, data, bytes);
  int writeErrno = errno;
  // fclose flushes the buffer, so a full disk often shows up only here.
  if (std::fclose(file.release()) != 0 && ok) {
    ok = false;
    writeErrno = errno;
  }
  TPSIM_CHECK(ok, where, ": expected to write ", header.size() + bytes, " bytes, got '",
              std::strerror(writeErrno), "'");
}

void writeNpy(std::FILE* file, const std::string& where, DType dtype, const std::vector<std::int64_t>& shape,
              const void* data) {
  std::uint64_t bytes = 0;
  const std::string header = npyHeader(where, dtype, shape, data, bytes);
  TPSIM_CHECK(writeAll(file, header, data, bytes), where, ": expected to write ", header.size() + bytes,
              " bytes, got '", std::strerror(errno), "'");
}

void checkIdsOrValues(DType dtype, DType want, const std::string& where) {
  const bool ids = want == DType::kInt64;
  TPSIM_CHECK(ids == (dtype == DType::kInt64), where, ": expected ",
              ids ? "int64 token ids" : "float32, float64 or float16 values", ", got ", dtypeName(dtype));
}

StoredTensor storedTensorOf(DType dtype, const std::vector<std::int64_t>& shape, const void* data, DType want,
                            const std::string& where) {
  checkIdsOrValues(dtype, want, where);
  StoredTensor out{shape, want, {}};
  out.bytes.resize(std::size_t(out.numel()) * dtypeSize(want));
  convertElements(dtype, data, out.numel(), want, out.bytes.data());
  return out;
}

}  // namespace tpsim::tools
