// Unit tests of tools/lib/npy.h: round trips, numpy.save's exact header bytes, hand-written 2.0 and
// 3.0 files, and the message of every error readNpy and writeNpy report.
//
// numpy is not needed: the expected headers are derived from the format spec (numpy/lib/format.py
// _write_array_header and _wrap_header) and hard-coded here.
#include "tools/lib/npy.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "backends/dims.h"
#include "backends/errors.h"
#include "tests/scratch_dir.h"

namespace tpsim::tools {
namespace {

namespace fs = std::filesystem;
using namespace std::string_literals;

using testing::ScratchDir;

std::string readBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// The message of the InvalidArgument `fn` throws; fails the test if it throws nothing.
template <typename Fn>
std::string errorOf(Fn fn) {
  try {
    fn();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected InvalidArgument";
  return "";
}

// A .npy file written by hand: magic, version, header length (uint16 for 1.x, else uint32,
// little-endian), then `header` and `data` exactly as given, with no padding added.
std::string npyBytes(int major, int minor, const std::string& header,
                     const std::string& data = "") {
  std::string out = "\x93NUMPY"s + char(major) + char(minor);
  const int lengthBytes = major == 1 ? 2 : 4;
  for (int i = 0; i < lengthBytes; ++i) out += char((header.size() >> (8 * i)) & 0xff);
  return out + header + data;
}

const std::string kHeader23 = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }\n";
const std::string kData23(24, '\x01');  // (2, 3) fp32

TEST(ShapeStringTest, PrintsLikeNumpy) {
  EXPECT_EQ(shapeText({}), "()");
  EXPECT_EQ(shapeText({5}), "(5,)");
  EXPECT_EQ(shapeText({0}), "(0,)");
  EXPECT_EQ(shapeText({2, 3}), "(2, 3)");
  EXPECT_EQ(shapeText({2, 3, 4}), "(2, 3, 4)");
}

using RoundTripCase = std::tuple<DType, std::vector<std::int64_t>>;
class NpyRoundTripTest : public ::testing::TestWithParam<RoundTripCase> {};

TEST_P(NpyRoundTripTest, ReadsBackWhatWasWritten) {
  const auto& [dtype, shape] = GetParam();
  std::size_t count = 1;
  for (std::int64_t d : shape) count *= std::size_t(d);
  std::vector<char> data(count * dtypeSize(dtype));  // (shape...) of dtype, arbitrary bits
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = char(i * 131 + 7);

  ScratchDir dir;
  const std::string path = dir.file("a.npy");
  writeNpy(path, dtype, shape, data.data());
  EXPECT_EQ((fs::file_size(path) - data.size()) % 64, 0u) << "data must start 64-byte aligned";

  const NpyArray array = readNpy(path);
  EXPECT_EQ(array.dtype, dtype);
  EXPECT_EQ(array.shape, shape);
  ASSERT_EQ(array.data.size(), data.size());
  for (std::size_t i = 0; i < data.size(); ++i)
    ASSERT_EQ(array.data[i], data[i]) << "mismatch at byte " << i;
}

INSTANTIATE_TEST_SUITE_P(AllDTypesAndShapes, NpyRoundTripTest,
                         ::testing::Combine(::testing::Values(DType::kFloat32, DType::kFloat16,
                                                              DType::kFloat64, DType::kInt64),
                                            ::testing::Values(std::vector<std::int64_t>{},
                                                              std::vector<std::int64_t>{0},
                                                              std::vector<std::int64_t>{5},
                                                              std::vector<std::int64_t>{2, 3, 4})),
                         [](const ::testing::TestParamInfo<RoundTripCase>& testCase) {
                           const std::vector<std::int64_t>& shape = std::get<1>(testCase.param);
                           std::string name = dtypeName(std::get<0>(testCase.param));
                           name += shape.empty() ? "_scalar" : "_shape";
                           for (std::int64_t d : shape) name += "_" + std::to_string(d);
                           return name;
                         });

// NpyReader reads what readNpy reads, in parts of any size; a file cut short after its header was
// checked is named when the read reaches the end.
TEST(NpyReaderTest, ReadsInPartsWhatReadNpyReads) {
  ScratchDir dir;
  const std::string path = dir.file("a.npy");
  std::vector<char> data(7 * 5 * 8);
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = char(i * 37 + 1);
  writeNpy(path, DType::kFloat64, {7, 5}, data.data());
  NpyReader reader(path);
  EXPECT_EQ(reader.dtype(), DType::kFloat64);
  EXPECT_EQ(reader.shape(), (std::vector<std::int64_t>{7, 5}));
  ASSERT_EQ(reader.numel(), 35);
  std::vector<char> got(data.size());
  for (std::int64_t first = 0, count = 1; first < 35; count += 2) {
    const std::int64_t n = std::min<std::int64_t>(count, 35 - first);
    reader.read(n, got.data() + first * 8);
    first += n;
  }
  EXPECT_EQ(got, data);
  EXPECT_EQ(readNpy(path).data, data);

  NpyReader cut(path);
  fs::resize_file(path, fs::file_size(path) - 8);
  std::vector<char> part(34 * 8);
  cut.read(34, part.data());
  EXPECT_EQ(errorOf([&] { cut.read(1, part.data()); }),
            "readNpy '" + path + "': expected to read 8 bytes of data, got 0 (the file shrank while being read)");
}

// numpy.save(np.zeros((2, 3), np.float32)): 10-byte preamble, then a 118-byte (0x76) header of
// dict, spaces and '\n' so the data starts at 128. numpy's growth padding (20 spaces after the
// dict) lands inside the same 64-byte block, so old and new numpy write the same bytes.
TEST(NpyWriteTest, HeaderMatchesNumpySaveByteForByte) {
  ScratchDir dir;
  const std::string path = dir.file("a.npy");
  const std::vector<float> zeros(6, 0.f);  // (2, 3)
  writeNpy(path, DType::kFloat32, {2, 3}, zeros.data());
  const std::string expected = "\x93NUMPY\x01\x00\x76\x00"s +
                               "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }" +
                               std::string(58, ' ') + "\n" + std::string(24, '\0');
  EXPECT_EQ(readBytes(path), expected);
}

// numpy.save(np.float64(1.0)): shape () gets no growth padding.
TEST(NpyWriteTest, ScalarHeaderMatchesNumpySave) {
  ScratchDir dir;
  const std::string path = dir.file("a.npy");
  const double one = 1.0;
  writeNpy(path, DType::kFloat64, {}, &one);
  const std::string expected = "\x93NUMPY\x01\x00\x76\x00"s +
                               "{'descr': '<f8', 'fortran_order': False, 'shape': (), }" +
                               std::string(62, ' ') + "\n" + "\0\0\0\0\0\0\xf0\x3f"s;
  EXPECT_EQ(readBytes(path), expected);
}

// 15 ones: the 98-character dict plus 20 growth spaces (21 digits minus len("1")) pushes the
// header into a third 64-byte block, as numpy.save has done since numpy PR #20321 (2022); older
// numpy wrote a 128-byte header here.
TEST(NpyWriteTest, GrowthPaddingMatchesNumpySave) {
  ScratchDir dir;
  const std::string path = dir.file("a.npy");
  const std::vector<std::int64_t> shape(15, 1);
  const float x = 0.f;
  writeNpy(path, DType::kFloat32, shape, &x);
  const std::string dict =
      "{'descr': '<f4', 'fortran_order': False, 'shape': "
      "(1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1), }";
  ASSERT_EQ(dict.size(), 98u);
  const std::string expected =
      "\x93NUMPY\x01\x00\xb6\x00"s + dict + std::string(20 + 63, ' ') + "\n" + std::string(4, '\0');
  EXPECT_EQ(readBytes(path), expected);
}

TEST(NpyWriteTest, HeaderOver65535BytesUsesVersion2) {
  ScratchDir dir;
  const std::string path = dir.file("a.npy");
  const std::vector<std::int64_t> shape(22000, 1);  // "1, " x 22000 > 65535 header bytes
  const float x = 3.f;
  writeNpy(path, DType::kFloat32, shape, &x);
  const std::string bytes = readBytes(path);
  ASSERT_GT(bytes.size(), 12u);
  EXPECT_EQ(bytes.substr(0, 8), "\x93NUMPY\x02\x00"s);
  std::uint32_t headerSize = 0;
  for (int i = 3; i >= 0; --i) headerSize = (headerSize << 8) | std::uint8_t(bytes[8 + i]);
  EXPECT_GT(headerSize, 65535u);
  EXPECT_EQ((12 + headerSize) % 64, 0u);
  EXPECT_EQ(bytes.size(), 12 + headerSize + 4);

  const NpyArray array = readNpy(path);
  EXPECT_EQ(array.shape, shape);
  ASSERT_EQ(array.data.size(), 4u);
  EXPECT_EQ(std::memcmp(array.data.data(), &x, 4), 0);
}

TEST(NpyReadTest, ReadsVersion2) {
  ScratchDir dir;
  const std::string data = "\x01\0\0\0\0\0\0\0\xfe\xff\xff\xff\xff\xff\xff\xff\x03\0\0\0\0\0\0\0"s;
  const std::string path = dir.write(
      "a.npy", npyBytes(2, 0, "{'descr': '<i8', 'fortran_order': False, 'shape': (3,), }\n", data));
  const NpyArray array = readNpy(path);
  EXPECT_EQ(array.dtype, DType::kInt64);
  EXPECT_EQ(array.shape, std::vector<std::int64_t>{3});
  std::int64_t values[3];  // (3)
  ASSERT_EQ(array.data.size(), sizeof values);
  std::memcpy(values, array.data.data(), sizeof values);
  EXPECT_EQ(values[0], 1);
  EXPECT_EQ(values[1], -2);
  EXPECT_EQ(values[2], 3);
}

TEST(NpyReadTest, ReadsVersion3) {
  ScratchDir dir;
  const std::string data = "\x00\x3c\x00\xc0"s;  // fp16 1.0, -2.0
  const std::string path = dir.write(
      "a.npy",
      npyBytes(3, 0, "{'descr': '<f2', 'fortran_order': False, 'shape': (2,), }  \n", data));
  const NpyArray array = readNpy(path);
  EXPECT_EQ(array.dtype, DType::kFloat16);
  EXPECT_EQ(array.shape, std::vector<std::int64_t>{2});
  EXPECT_EQ(std::string(array.data.begin(), array.data.end()), data);
}

// ast.literal_eval accepts any spelling of the dict; so do we.
TEST(NpyReadTest, AcceptsOtherDictSpellings) {
  ScratchDir dir;
  for (const std::string& header : {
           "{\"shape\":(2,3),\"fortran_order\":False,\"descr\":\"<f4\"}"s,
           "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3,)}\n"s,
           "  {\n 'descr' : '<f4' ,\t'fortran_order':False, 'shape':( 2 , 3 ), }\r\n"s,
       }) {
    const NpyArray array = readNpy(dir.write("a.npy", npyBytes(1, 0, header, kData23)));
    EXPECT_EQ(array.shape, (std::vector<std::int64_t>{2, 3})) << header;
  }
}

TEST(NpyReadTest, AcceptsNativeByteOrderMarksOnLittleEndianMachines) {
  const std::uint16_t one = 1;
  if (*reinterpret_cast<const unsigned char*>(&one) != 1) GTEST_SKIP() << "big-endian machine";
  ScratchDir dir;
  for (const char* descr : {"|f4", "=f4"}) {
    const std::string header =
        "{'descr': '"s + descr + "', 'fortran_order': False, 'shape': (2, 3), }\n";
    const NpyArray array = readNpy(dir.write("a.npy", npyBytes(1, 0, header, kData23)));
    EXPECT_EQ(array.dtype, DType::kFloat32) << descr;
  }
}

TEST(NpyReadErrorTest, MissingFile) {
  ScratchDir dir;
  const std::string path = dir.file("missing.npy");
  EXPECT_EQ(
      errorOf([&] { readNpy(path); }),
      "readNpy '" + path + "': expected a readable .npy file, got 'No such file or directory'");
}

TEST(NpyReadErrorTest, Directory) {
  ScratchDir dir;
  const std::string path = dir.file("");
  EXPECT_EQ(errorOf([&] { readNpy(path); }),
            "readNpy '" + path + "': expected a .npy file, got a directory");
}

TEST(NpyReadErrorTest, BadMagic) {
  ScratchDir dir;
  const std::string prefix = "': expected the .npy magic string \"\\x93NUMPY\" and a version, got ";
  std::string path = dir.write("text.npy", "hello world");
  EXPECT_EQ(errorOf([&] { readNpy(path); }), "readNpy '" + path + prefix + "\"hello wo\"");
  path = dir.write("empty.npy", "");
  EXPECT_EQ(errorOf([&] { readNpy(path); }), "readNpy '" + path + prefix + "\"\"");
  path = dir.write("short.npy", "\x93NUMPY\x01");
  EXPECT_EQ(errorOf([&] { readNpy(path); }), "readNpy '" + path + prefix + "\"\\x93NUMPY\\x01\"");
  path = dir.write("a.npz", "PK\x03\x04\x14\0\0\0\x08\0"s);
  EXPECT_EQ(errorOf([&] { readNpy(path); }),
            "readNpy '" + path + prefix +
                "\"PK\\x03\\x04\\x14\\x00\\x00\\x00\"; this looks like an .npz archive, save "
                "each array with np.save");
}

TEST(NpyReadErrorTest, UnsupportedVersion) {
  ScratchDir dir;
  for (const auto& [major, minor, text] :
       {std::tuple{4, 0, "4.0"}, std::tuple{1, 1, "1.1"}, std::tuple{0, 0, "0.0"}}) {
    const std::string path = dir.write("a.npy", npyBytes(major, minor, kHeader23, kData23));
    EXPECT_EQ(errorOf([&] { readNpy(path); }),
              "readNpy '" + path + "': format version must be 1.0, 2.0 or 3.0, got " + text);
  }
}

TEST(NpyReadErrorTest, TruncatedHeader) {
  ScratchDir dir;
  std::string path = dir.write("a.npy", "\x93NUMPY\x02\x00\x10\x00"s);
  EXPECT_EQ(errorOf([&] { readNpy(path); }),
            "readNpy '" + path +
                "': expected a 4-byte header length after the magic string, found 2 bytes; the "
                "file is truncated");
  path = dir.write("b.npy", npyBytes(1, 0, kHeader23).substr(0, 30));
  EXPECT_EQ(
      errorOf([&] { readNpy(path); }),
      "readNpy '" + path + "': expected a header of 60 bytes, found 20; the file is truncated");
}

TEST(NpyReadErrorTest, HeaderNotADict) {
  ScratchDir dir;
  const std::string expected =
      "': header must be a Python dict literal like {'descr': '<f4', "
      "'fortran_order': False, 'shape': (2, 3), }, got ";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"[1, 2]\n", "\"[1, 2]\" (expected '{' at offset 0)"},
      {"{'descr': '<f4'", "\"{'descr': '<f4'\" (unexpected end at offset 15)"},
      {"{'descr': '<f4\n", "\"{'descr': '<f4\" (unterminated string at offset 10)"},
      {"{descr: 1}", "\"{descr: 1}\" (expected a quoted key at offset 1)"},
      {"{'descr' '<f4'}", "\"{'descr' '<f4'}\" (expected ':' at offset 9)"},
      {"{'descr': }", "\"{'descr': }\" (missing value for key 'descr' at offset 10)"},
      {"{'shape': 2)}", "\"{'shape': 2)}\" (unbalanced ')' at offset 11)"},
      {"{'descr': '<f4'} x", "\"{'descr': '<f4'} x\" (unexpected text after '}' at offset 17)"},
      {"{'descr': '<f4'}\0"s, "\"{'descr': '<f4'}\\x00\" (unexpected text after '}' at offset 16)"},
  };
  for (const auto& [header, got] : cases) {
    const std::string path = dir.write("a.npy", npyBytes(1, 0, header, kData23));
    EXPECT_EQ(errorOf([&] { readNpy(path); }), "readNpy '" + path + expected + got) << header;
  }
}

TEST(NpyReadErrorTest, WrongKeys) {
  ScratchDir dir;
  const std::string expected =
      "': header must have exactly the keys 'descr', 'fortran_order' and 'shape', got ";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"{'descr': '<f4', 'shape': (2, 3), }", "'descr', 'shape'"},
      {"{}", "none"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), 'extra': 1}",
       "'descr', 'extra', 'fortran_order', 'shape'"},
  };
  for (const auto& [header, got] : cases) {
    const std::string path = dir.write("a.npy", npyBytes(1, 0, header, kData23));
    EXPECT_EQ(errorOf([&] { readNpy(path); }), "readNpy '" + path + expected + got) << header;
  }
}

TEST(NpyReadErrorTest, UnparsableShape) {
  ScratchDir dir;
  for (const std::string shape : {"[2, 3]", "(5)", "(-1,)", "(2, x)", "(2.5,)", "(,)", "(2,,3)",
                                  "(99999999999999999999,)", "None"}) {
    const std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': " + shape + "}";
    const std::string path = dir.write("a.npy", npyBytes(1, 0, header, kData23));
    EXPECT_EQ(errorOf([&] { readNpy(path); }),
              "readNpy '" + path +
                  "': shape must be a tuple of non-negative integers like (2, 3), (5,) or (), "
                  "got " +
                  shape);
  }
}

TEST(NpyReadErrorTest, ShapeTooLarge) {
  ScratchDir dir;
  const std::string path = dir.write(
      "a.npy",
      npyBytes(1, 0,
               "{'descr': '<f4', 'fortran_order': False, 'shape': (4611686018427387904, 4)}"));
  EXPECT_EQ(errorOf([&] { readNpy(path); }),
            "readNpy '" + path +
                "': expected a shape of at most 2^63 bytes, got (4611686018427387904, 4) of <f4 "
                "with 0 bytes of data");
}

TEST(NpyReadErrorTest, FortranOrder) {
  ScratchDir dir;
  std::string path = dir.write(
      "a.npy",
      npyBytes(1, 0, "{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3), }", kData23));
  EXPECT_EQ(errorOf([&] { readNpy(path); }),
            "readNpy '" + path +
                "': expected fortran_order False (only C order is supported), got True; save "
                "with np.save(path, np.ascontiguousarray(a))");
  path = dir.write(
      "b.npy", npyBytes(1, 0, "{'descr': '<f4', 'fortran_order': 0, 'shape': (2, 3), }", kData23));
  EXPECT_EQ(errorOf([&] { readNpy(path); }),
            "readNpy '" + path + "': fortran_order must be True or False, got 0");
}

TEST(NpyReadErrorTest, UnsupportedDescr) {
  ScratchDir dir;
  for (const std::string descr : {"'<i4'", "'|b1'", "'<c8'", "'<f4 '", "'f4'", "'xf4'", "\"<U5\"",
                                  "[('a', '<f4'), ('b', '<i8')]", "np.float32"}) {
    const std::string header = "{'descr': " + descr + ", 'fortran_order': False, 'shape': (2, 3)}";
    const std::string path = dir.write("a.npy", npyBytes(1, 0, header, kData23));
    EXPECT_EQ(errorOf([&] { readNpy(path); }),
              "readNpy '" + path + "': descr must be one of '<f4', '<f2', '<f8', '<i8', got " +
                  descr + "; convert with a.astype(np.float32) (values) or a.astype(np.int64) (token ids) before np.save");
  }
}

TEST(NpyReadErrorTest, BigEndian) {
  ScratchDir dir;
  for (const char* code : {"f4", "f2", "f8", "i8"}) {
    const std::string header =
        "{'descr': '>"s + code + "', 'fortran_order': False, 'shape': (2, 3), }";
    const std::string path = dir.write("a.npy", npyBytes(1, 0, header, std::string(48, '\0')));
    EXPECT_EQ(errorOf([&] { readNpy(path); }),
              "readNpy '" + path + "': data must be little-endian, got descr '>" + code +
                  "'; convert with a.astype('<" + code + "') before np.save");
  }
}

TEST(NpyReadErrorTest, TruncatedData) {
  ScratchDir dir;
  const std::string path = dir.write("a.npy", npyBytes(1, 0, kHeader23, kData23.substr(4)));
  EXPECT_EQ(errorOf([&] { readNpy(path); }),
            "readNpy '" + path +
                "': expected 24 bytes of data for shape (2, 3) of <f4, found 20; the file is "
                "truncated");
}

TEST(NpyReadErrorTest, TrailingBytes) {
  ScratchDir dir;
  const std::string path = dir.write("a.npy", npyBytes(1, 0, kHeader23, kData23 + "abcd"));
  EXPECT_EQ(errorOf([&] { readNpy(path); }),
            "readNpy '" + path +
                "': expected 24 bytes of data for shape (2, 3) of <f4, found 28; the file has 4 "
                "trailing bytes after the array; write one array per file with np.save");
}

TEST(NpyReadErrorTest, EmptyArrayWithData) {
  ScratchDir dir;
  const std::string path = dir.write(
      "a.npy", npyBytes(1, 0, "{'descr': '<f8', 'fortran_order': False, 'shape': (0,), }", "x"));
  EXPECT_EQ(errorOf([&] { readNpy(path); }),
            "readNpy '" + path +
                "': expected 0 bytes of data for shape (0,) of <f8, found 1; the file has 1 "
                "trailing bytes after the array; write one array per file with np.save");
}

TEST(NpyWriteErrorTest, UnwritablePath) {
  ScratchDir dir;
  const std::string path = dir.file("no_such_dir/a.npy");
  const float x = 0.f;
  EXPECT_EQ(errorOf([&] { writeNpy(path, DType::kFloat32, {}, &x); }),
            "writeNpy '" + path + "': expected a writable path, got 'No such file or directory'");
}

TEST(NpyWriteErrorTest, FullDisk) {
  if (!fs::exists("/dev/full")) GTEST_SKIP() << "no /dev/full";
  const std::vector<float> x(6, 0.f);  // (2, 3)
  EXPECT_EQ(errorOf([&] {
              writeNpy("/dev/full", DType::kFloat32, {2, 3}, x.data());
            }),
            "writeNpy '/dev/full': expected to write 152 bytes, got 'No space left on device'");
}

TEST(NpyWriteErrorTest, BadArguments) {
  ScratchDir dir;
  const std::string path = dir.file("a.npy");
  const std::uint16_t bf16[2] = {0, 0};
  EXPECT_EQ(errorOf([&] { writeNpy(path, DType::kBFloat16, {2}, bf16); }),
            "writeNpy '" + path +
                "': dtype must be one of fp32, fp16, fp64, int64, got bf16; NumPy has no "
                "bfloat16 or fp8 type, widen to fp32 first");
  const std::uint8_t fp8[2] = {0, 0};
  EXPECT_NE(errorOf([&] { writeNpy(path, DType::kFloat8E4M3, {2}, fp8); }).find("got fp8e4m3; NumPy has no"),
            std::string::npos);
  EXPECT_EQ(errorOf([&] {
              writeNpy(path, DType::kFloat32, {2, -1}, bf16);
            }),
            "writeNpy '" + path + "': shape must be non-negative, got (2, -1)");
  EXPECT_EQ(errorOf([&] { writeNpy(path, DType::kFloat32, {2}, nullptr); }),
            "writeNpy '" + path + "': data must not be null for shape (2,), got nullptr");
  EXPECT_EQ(errorOf([&] {
              writeNpy(path, DType::kInt64, {std::int64_t(1) << 62, 4}, bf16);
            }),
            "writeNpy '" + path +
                "': expected a shape of at most 2^63 bytes, got (4611686018427387904, 4) of int64");
  EXPECT_FALSE(fs::exists(path)) << "a rejected write must not create the file";
  writeNpy(path, DType::kFloat32, {0}, nullptr);  // no elements: null data is fine
  EXPECT_EQ(readNpy(path).shape, std::vector<std::int64_t>{0});
}

// The conversion --load and the Python module share: values round to the run's dtype (to nearest
// even), ids stay ids.
TEST(StoredTensorOfTest, RoundsToTheRunsDtype) {
  const std::vector<double> values = {1 + std::ldexp(1, -30), 0.1};
  const StoredTensor t = storedTensorOf(DType::kFloat64, {2, 1}, values.data(), DType::kFloat32, "x");
  EXPECT_EQ(t.dtype, DType::kFloat32);
  EXPECT_EQ(t.shape, (std::vector<std::int64_t>{2, 1}));
  EXPECT_EQ(hostOf(t).values, (std::vector<double>{1, double(0.1f)}));
  const std::vector<float> near = {1 + std::ldexp(1.f, -8), 1 + std::ldexp(1.f, -8) + std::ldexp(1.f, -9)};
  const StoredTensor rounded = storedTensorOf(DType::kFloat32, {2}, near.data(), DType::kBFloat16, "x");
  EXPECT_EQ(rounded.bytes.size(), 4u);
  // A tie goes to even, above it up.
  EXPECT_EQ(hostOf(rounded).values, (std::vector<double>{1, 1 + std::ldexp(1, -7)}));
  const std::vector<std::int64_t> ids = {3, 0, 7};
  EXPECT_EQ(hostOf(storedTensorOf(DType::kInt64, {3}, ids.data(), DType::kInt64, "ids")).values,
            (std::vector<double>{3, 0, 7}));
}

TEST(StoredTensorOfTest, RefusesValuesForIdsAndIdsForValues) {
  const std::vector<std::int64_t> ids = {1};
  const std::vector<float> values = {1};
  EXPECT_EQ(errorOf([&] { storedTensorOf(DType::kInt64, {1}, ids.data(), DType::kFloat32, "w.npy"); }),
            "w.npy: expected float32, float64 or float16 values, got int64");
  EXPECT_EQ(errorOf([&] { storedTensorOf(DType::kFloat32, {1}, values.data(), DType::kInt64, "input.npy"); }),
            "input.npy: expected int64 token ids, got fp32");
}

}  // namespace
}  // namespace tpsim::tools
