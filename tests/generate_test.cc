// Generated data: drawNormals is std::normal_distribution's draws bit for bit, whatever the block
// and task boundaries, and generateInputs draws every tensor of a kind from one engine in the
// kind's order, a fresh distribution each, so a seed makes the data it always made.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <random>
#include <vector>

#include "backends/dtype.h"
#include "backends/errors.h"
#include "sim/host_pool.h"
#include "tests/sim_test_util.h"
#include "tools/lib/host_tensor.h"
#include "tools/lib/layer_kind.h"

namespace tpsim::tools {
namespace {

// The plain loop drawNormals stands for.
std::vector<char> standardDraws(std::mt19937_64& rng, double sigma, DType dtype, std::int64_t n) {
  std::normal_distribution<double> normal(0.0, sigma);
  const std::size_t size = dtypeSize(dtype);
  std::vector<char> out(std::size_t(n) * size);
  for (std::int64_t i = 0; i < n; ++i)
    storeFromDouble(dtype, roundedTo(dtype, normal(rng)), out.data() + std::size_t(i) * size);
  return out;
}

TEST(Generate, DrawNormalsIsTheStandardDistributionBitForBit) {
  constexpr std::int64_t kBlock = std::int64_t(1) << 20;  // drawNormals' block, in elements
  sim::HostPool pool(1);
  for (std::int64_t n : {std::int64_t(0), std::int64_t(1), std::int64_t(2), std::int64_t(7), kBlock - 1, kBlock,
                         kBlock + 1, 2 * kBlock + 3})
    for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat64}) {
      const double sigma = dtype == DType::kBFloat16 ? 0.02 : 1.0;
      std::mt19937_64 ours(99 + std::uint64_t(n)), theirs(99 + std::uint64_t(n));
      std::vector<char> got(std::size_t(n) * dtypeSize(dtype));
      // With helpers and without (every task in order on this thread).
      drawNormals(ours, sigma, dtype, n, dtype == DType::kBFloat16 ? nullptr : &pool,
                  [&](std::int64_t offset, std::int64_t count, const char* bytes) {
                    std::memcpy(got.data() + std::size_t(offset) * dtypeSize(dtype), bytes,
                                std::size_t(count) * dtypeSize(dtype));
                  });
      const std::vector<char> want = standardDraws(theirs, sigma, dtype, n);
      ASSERT_EQ(got.size(), want.size());
      for (std::int64_t i = 0; i < n; ++i)
        ASSERT_EQ(std::memcmp(got.data() + std::size_t(i) * dtypeSize(dtype),
                              want.data() + std::size_t(i) * dtypeSize(dtype), dtypeSize(dtype)), 0)
            << "n " << n << " " << dtypeName(dtype) << ": element " << i << " differs";
      EXPECT_TRUE(ours == theirs) << "n " << n << ": the engine is left in another state";
    }
}

TEST(Generate, DrawNormalsHandsOverOrderedPiecesOfAtMostAPiece) {
  const std::int64_t n = 2 * kInputPieceElements + 3;
  std::mt19937_64 ours(5), theirs(5);
  std::vector<char> got;
  std::int64_t next = 0;
  drawNormals(ours, 1.0, DType::kFloat32, n, nullptr, [&](std::int64_t offset, std::int64_t count, const char* bytes) {
    EXPECT_EQ(offset, next);
    EXPECT_GE(count, 1);
    EXPECT_LE(count, kInputPieceElements);
    got.insert(got.end(), bytes, bytes + count * 4);
    next = offset + count;
  });
  EXPECT_EQ(next, n);
  EXPECT_EQ(got, standardDraws(theirs, 1.0, DType::kFloat32, n));
}

// The pieces a taker does not want are drawn but not handed over: the others are the same bytes
// at the same offsets, and the stream goes on as if every piece had been taken.
TEST(Generate, DrawNormalsSkipsThePiecesNotWantedButDrawsThem) {
  const std::int64_t n = 3 * kInputPieceElements + 3;
  std::mt19937_64 ours(7), theirs(7);
  std::vector<std::int64_t> offsets;
  std::vector<char> got;
  drawNormals(
      ours, 1.0, DType::kFloat32, n, nullptr,
      [&](std::int64_t offset, std::int64_t count, const char* bytes) {
        offsets.push_back(offset);
        got.insert(got.end(), bytes, bytes + count * 4);
      },
      [](std::int64_t offset, std::int64_t) { return offset / kInputPieceElements % 2 == 1; });
  const std::vector<char> all = standardDraws(theirs, 1.0, DType::kFloat32, n);
  EXPECT_EQ(offsets, (std::vector<std::int64_t>{kInputPieceElements, 3 * kInputPieceElements}));
  std::vector<char> wanted(all.begin() + kInputPieceElements * 4, all.begin() + 2 * kInputPieceElements * 4);
  wanted.insert(wanted.end(), all.begin() + 3 * kInputPieceElements * 4, all.end());
  EXPECT_EQ(got, wanted);
  EXPECT_EQ(ours(), theirs());
}

using testing::errorOf;

// Keeps the pieces it takes, for CheckedInputs to hand them to.
class Collected : public InputSink {
 public:
  void begin(const std::string& name, const TensorHeader&) override { names.push_back(name); }
  void piece(std::int64_t, std::int64_t count, const char*) override { elements += count; }
  void end() override { ++ended; }
  std::vector<std::string> names;
  std::int64_t elements = 0;
  int ended = 0;
};

// The checks of checkInputValues a piece at a time: positions are the tensor's, counts span its
// pieces, and a tensor whose header is not the one that sized the run is refused.
TEST(Generate, CheckedInputsCheckEachPieceWhereItLies) {
  RunConfig c;
  c.layer = layerKind("embedding");
  c.tp = 2;
  const InputMap in = generateInputs(c);
  auto send = [&](const std::string& name, StoredTensor t, std::int64_t pieceElements) {
    Collected next;
    CheckedInputs checked(c, {}, next);
    const std::size_t size = dtypeSize(t.dtype);
    checked.begin(name, {t.shape, t.dtype});
    for (std::int64_t first = 0; first < t.numel(); first += pieceElements)
      checked.piece(first, std::min(pieceElements, t.numel() - first), t.bytes.data() + std::size_t(first) * size);
    checked.end();
    EXPECT_EQ(next.elements, t.numel());
    EXPECT_EQ(next.ended, 1);
  };
  EXPECT_EQ(errorOf([&] { send("weight", in.at("weight"), 5); }), "no error");
  StoredTensor weight = in.at("weight");
  const float nan = std::nanf(""), inf = INFINITY;
  std::memcpy(weight.bytes.data() + 7 * 4, &nan, 4);
  std::memcpy(weight.bytes.data() + 12 * 4, &inf, 4);
  EXPECT_EQ(errorOf([&] { send("weight", weight, 5); }),
            "tpsim run: weight.npy: expected finite values, got 2 NaN or Inf, the first at flat index 7");
  StoredTensor ids = in.at("input");
  storeFromDouble(DType::kInt64, double(c.vocab), ids.bytes.data() + 9 * 8);
  EXPECT_EQ(errorOf([&] { send("input", ids, 4); }),
            "tpsim run: input.npy holds id 32 at flat position 9, outside [0, V=32)");
  StoredTensor wider = in.at("weight");
  wider.shape[1] *= 2;
  wider.bytes.resize(wider.bytes.size() * 2);
  EXPECT_EQ(errorOf([&] { send("weight", wider, 64); }),
            "tpsim run: weight.npy: expected fp32 (32, 16) as its header said, got fp32 (32, 32) (it changed while "
            "the run read it)");
}

TEST(Generate, InputsAreOneStreamInTheKindsOrder) {
  for (const char* layer : {"mlp", "embedding", "grouped-column"}) {
    RunConfig c;
    c.layer = layerKind(layer);
    c.tp = 2;
    c.bias = true;
    c.seed = 77;
    c.dtype = DType::kBFloat16;
    const InputMap got = generateInputs(c);
    std::mt19937_64 rng(c.seed);
    for (const TensorSpec& t : c.layer->tensors(c)) {
      const StoredTensor& tensor = got.at(t.name);
      if (t.idRange.empty()) {
        EXPECT_EQ(tensor.bytes, standardDraws(rng, t.sigma, c.dtype, tensor.numel())) << layer << " " << t.name;
        continue;
      }
      std::uniform_int_distribution<std::int64_t> id(0, sizeValue(c, t.idRange) - 1);
      for (std::int64_t i = 0; i < tensor.numel(); ++i)
        ASSERT_EQ(tensor.at(i), double(id(rng))) << layer << " " << t.name;
    }
  }
}

}  // namespace
}  // namespace tpsim::tools
