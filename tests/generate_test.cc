// Generated data: drawNormals is std::normal_distribution's draws bit for bit, whatever the block
// and task boundaries, and generateInputs draws every tensor of a kind from one engine in the
// kind's order, a fresh distribution each, so a seed makes the data it always made.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "backends/dtype.h"
#include "sim/host_pool.h"
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
      drawNormals(ours, sigma, dtype, n, got.data(), dtype == DType::kBFloat16 ? nullptr : &pool);
      const std::vector<char> want = standardDraws(theirs, sigma, dtype, n);
      ASSERT_EQ(got.size(), want.size());
      for (std::int64_t i = 0; i < n; ++i)
        ASSERT_EQ(std::memcmp(got.data() + std::size_t(i) * dtypeSize(dtype),
                              want.data() + std::size_t(i) * dtypeSize(dtype), dtypeSize(dtype)), 0)
            << "n " << n << " " << dtypeName(dtype) << ": element " << i << " differs";
      EXPECT_TRUE(ours == theirs) << "n " << n << ": the engine is left in another state";
    }
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
