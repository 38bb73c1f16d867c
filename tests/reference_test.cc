// The dense reference's magnitudes: computed in float or bf16, they must never fall below the same
// products computed in double (the bound they replace), whatever the magnitudes, and stay close.
// The MLP's reference, which takes F in blocks, and the linear's, which takes its weight's rows in
// blocks, against loops over the whole.
#include "tools/lib/reference.h"
#include "tools/lib/layer_kind.h"
#include "sim/sgemm.h"

#include <gtest/gtest.h>

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>

namespace tpsim::tools {
namespace {

using Matrix = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// rows·cols nonnegative values 10^e with e uniform in [lo, hi], a fifth of them zero.
std::vector<double> magnitudes(std::int64_t n, double lo, double hi, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> exponent(lo, hi), unit(0, 1);
  std::vector<double> v(static_cast<std::size_t>(n));
  for (double& x : v) x = unit(rng) < 0.2 ? 0.0 : std::pow(10.0, exponent(rng));
  return v;
}

struct Range {
  double lo, hi;
};

// The arithmetic this core runs for the magnitudes: float, and bf16 where the core has it.
std::vector<MagnitudeGemm> magnitudeGemms() {
  std::vector<MagnitudeGemm> gemms = {MagnitudeGemm::kFloat};
  if (bestMagnitudeGemm() == MagnitudeGemm::kBf16) gemms.push_back(MagnitudeGemm::kBf16);
  return gemms;
}

TEST(Reference, MagnitudeProductIsAnUpperBoundOfTheDoubleProduct) {
  std::mt19937_64 rng(7);
  // Normal, tiny (below float's range), huge (beyond it), and spread over 70 decades in one matrix.
  const std::vector<Range> ranges = {{-1, 1}, {-45, -38}, {-200, -150}, {30, 40}, {140, 150}, {-40, 30}};
  for (MagnitudeGemm gemm : magnitudeGemms()) {
    const bool bf16 = gemm == MagnitudeGemm::kBf16;
    for (const Range& ra : ranges)
      for (const Range& rb : ranges)
        for (std::int64_t k : {1, 7, 300, 5000}) {
          const std::int64_t m = 9, n = 600;  // n spans two column tiles
          const std::vector<double> a = magnitudes(m * k, ra.lo, ra.hi, rng), b = magnitudes(k * n, rb.lo, rb.hi, rng);
          const Matrix exact = Eigen::Map<const Matrix>(a.data(), m, k) * Eigen::Map<const Matrix>(b.data(), k, n);
          const std::vector<double> got = magnitudeProduct(a, b, m, k, n, gemm);
          // Rounded-up operands (by up to 2^-7 each in bf16), F, the float sums.
          const double slack = (bf16 ? (1 + 0x1p-7) * (1 + 0x1p-7) : 1.0) * (1 + (2.2 * double(k) + 10) * 0x1p-24);
          // Above it by underflow at most: float's subnormals (bf16: values and sums below 2^-126),
          // scaled by the largest a and b.
          const double aMax = *std::max_element(a.begin(), a.end()), bMax = *std::max_element(b.begin(), b.end());
          const double underflow = 16 * double(k + 2) * (bf16 ? 0x1p-125 : 0x1p-149) * aMax * bMax + 0x1p-1000;
          for (std::int64_t i = 0; i < m * n; ++i) {
            const double want = exact.data()[i], upper = got[std::size_t(i)];
            ASSERT_GE(upper, want) << (bf16 ? "bf16" : "float") << " a 10^[" << ra.lo << ", " << ra.hi << "] b 10^["
                                   << rb.lo << ", " << rb.hi << "] K=" << k << ": element " << i;
            ASSERT_LE(upper, want * slack + underflow)
                << (bf16 ? "bf16" : "float") << " K=" << k << ": element " << i;
          }
        }
  }
}

TEST(Reference, MagnitudeProductKeepsInfinityAndNan) {
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<double> a = {inf, 1, 0, 2}, b = {1, 0, 3, 4};  // (2, 2) · (2, 2)
  for (MagnitudeGemm gemm : magnitudeGemms()) {
    const std::vector<double> got = magnitudeProduct(a, b, 2, 2, 2, gemm);
    EXPECT_EQ(got[0], inf);
    EXPECT_TRUE(std::isnan(got[1]));  // ∞·0, as in double
    EXPECT_GE(got[2], 6.0);
    EXPECT_GE(got[3], 8.0);
  }
}

// fp32 normals of `shape`, held in double as the reference reads them.
HostTensor randomTensor(std::vector<std::int64_t> shape, std::mt19937_64& rng) {
  std::normal_distribution<float> normal;
  std::int64_t n = 1;
  for (std::int64_t d : shape) n *= d;
  std::vector<double> v(static_cast<std::size_t>(n));
  for (double& x : v) x = normal(rng);
  return HostTensor{std::move(shape), DType::kFloat32, std::move(v)};
}

// Each result the loops sum, with its sum of |terms| for the tolerance.
struct LoopSums {
  std::map<std::string, std::vector<double>> want, scale;
  void result(const std::string& name, std::size_t n) {
    want[name].assign(n, 0.0);
    scale[name].assign(n, 0.0);
  }
  void add(const std::string& name, std::int64_t i, double term) {
    want[name][std::size_t(i)] += term;
    scale[name][std::size_t(i)] += std::fabs(term);
  }
};

// Each result of the reference in one block and in three against the loops' sums, to 1e-13 of their
// sum of |terms|; `bounds` checks element i's bounds in one block (a) and in three (b).
void expectLoopSums(const LoopSums& sums, const std::map<std::string, Checked>& one,
                    const std::map<std::string, Checked>& three,
                    const std::function<void(const std::string&, std::size_t, const Checked&, const Checked&)>& bounds) {
  ASSERT_EQ(one.size(), sums.want.size());
  for (const auto& [name, values] : sums.want) {
    const Checked &a = one.at(name), &b = three.at(name);
    ASSERT_EQ(a.value.values.size(), values.size()) << name;
    ASSERT_EQ(b.value.values.size(), values.size()) << name;
    for (std::size_t i = 0; i < values.size(); ++i) {
      const double tolerance = 1e-13 * sums.scale.at(name)[i] + 1e-300;
      ASSERT_NEAR(a.value.values[i], values[i], tolerance) << name << " element " << i << ", one block";
      ASSERT_NEAR(b.value.values[i], values[i], tolerance) << name << " element " << i << ", three blocks";
      bounds(name, i, a, b);
    }
  }
}

// A linear kind's reference (its weights (n, k)) whole and in blocks of 256 weight rows against the
// loops; where the packed kernels run, the blocks change no bit of a value or a bound.
void expectWeightRowBlocksMatchLoops(const LoopSums& sums, const std::string& kind, const TensorMap& in,
                                     std::int64_t k) {
  ReferenceOptions whole;
  whole.layer = layerKind(kind);
  ReferenceOptions blocks = whole;
  blocks.blockElements = k * 256;
  const bool packed = sim::bestGemmKernel() != sim::GemmKernel::kEigen;
  expectLoopSums(sums, denseReference(whole, storedOf(in)), denseReference(blocks, storedOf(in)),
                 [&](const std::string& name, std::size_t i, const Checked& a, const Checked& c) {
                   ASSERT_GE(a.bound[i], 0x1p-24 * sums.scale.at(name)[i]) << name << " element " << i;
                   if (!packed) return;
                   ASSERT_EQ(c.value.values[i], a.value.values[i]) << name << " element " << i;
                   ASSERT_EQ(c.bound[i], a.bound[i]) << name << " element " << i;
                 });
}

// An MLP small enough for loops: 6 tokens, h = 5, F = 700. In blocks of 256 columns of F (256, 256,
// 188) and in one block, the reference's values are the loops' in double, and its bounds agree to
// their float rounding (each block rounds its own operands up, with F factors of its own depth).
TEST(Reference, MlpInBlocksOfFMatchesLoopsOverTheWhole) {
  const std::int64_t tokens = 6, h = 5, f = 700;
  std::mt19937_64 rng(11);
  auto random = [&rng](std::vector<std::int64_t> shape) { return randomTensor(std::move(shape), rng); };
  const TensorMap in = {{"input", random({2, 3, h})},     {"grad_output", random({2, 3, h})},
                        {"fc1.weight", random({f, h})},   {"fc1.bias", random({f})},
                        {"fc2.weight", random({h, f})},   {"fc2.bias", random({h})}};
  const std::vector<double> &x = in.at("input").values, &dy = in.at("grad_output").values;
  const std::vector<double> &w1 = in.at("fc1.weight").values, &b1 = in.at("fc1.bias").values;
  const std::vector<double> &w2 = in.at("fc2.weight").values, &b2 = in.at("fc2.bias").values;

  // The loops.
  LoopSums sums;
  sums.result("output", tokens * h), sums.result("input.grad", tokens * h), sums.result("fc1.weight.grad", f * h);
  sums.result("fc1.bias.grad", f), sums.result("fc2.weight.grad", h * f), sums.result("fc2.bias.grad", h);
  auto add = [&sums](const std::string& name, std::int64_t i, double term) { sums.add(name, i, term); };
  for (std::int64_t t = 0; t < tokens; ++t) {
    std::vector<double> a(static_cast<std::size_t>(f)), dh(static_cast<std::size_t>(f));
    for (std::int64_t j = 0; j < f; ++j) {
      double z = b1[std::size_t(j)];
      for (std::int64_t k = 0; k < h; ++k) z += x[std::size_t(t * h + k)] * w1[std::size_t(j * h + k)];
      a[std::size_t(j)] = gelu(z);
      double da = 0;
      for (std::int64_t k = 0; k < h; ++k) da += dy[std::size_t(t * h + k)] * w2[std::size_t(k * f + j)];
      dh[std::size_t(j)] = da * geluGrad(z);
      add("fc1.bias.grad", j, dh[std::size_t(j)]);
      for (std::int64_t k = 0; k < h; ++k) {
        add("output", t * h + k, a[std::size_t(j)] * w2[std::size_t(k * f + j)]);
        add("input.grad", t * h + k, dh[std::size_t(j)] * w1[std::size_t(j * h + k)]);
        add("fc1.weight.grad", j * h + k, dh[std::size_t(j)] * x[std::size_t(t * h + k)]);
        add("fc2.weight.grad", k * f + j, dy[std::size_t(t * h + k)] * a[std::size_t(j)]);
      }
    }
    for (std::int64_t k = 0; k < h; ++k) {
      add("output", t * h + k, b2[std::size_t(k)]);
      add("fc2.bias.grad", k, dy[std::size_t(t * h + k)]);
    }
  }

  ReferenceOptions whole;
  whole.layer = layerKind("mlp");
  ReferenceOptions blocks = whole;
  blocks.blockElements = tokens * 256;
  expectLoopSums(sums, denseReference(whole, storedOf(in)), denseReference(blocks, storedOf(in)),
                 [](const std::string& name, std::size_t i, const Checked& a, const Checked& b) {
                   ASSERT_GT(a.bound[i], 0.0) << name << " element " << i;
                   ASSERT_NEAR(b.bound[i] / a.bound[i], 1.0, 1e-4) << name << " element " << i;
                 });
}

// Parts of an MLP's reference run as the processes of a spread world run them, on threads: each
// holds its rows of F of the weights, gathers with the others and sends its sums to the first.
class PartsFabric {
 public:
  explicit PartsFabric(int parts) : parts_(parts), gathered_(std::size_t(parts)), passed_(std::size_t(parts)) {}

  ReferencePart part(int p, std::int64_t f, const std::map<std::string, int>& split) {
    ReferencePart out;
    out.index = p, out.count = parts_;
    out.begin = f / parts_ * p, out.end = f / parts_ * (p + 1), out.whole = f, out.split = split;
    out.allGather = [this, p](const std::vector<double>& mine) {
      std::unique_lock<std::mutex> lock(mu_);
      const int round = rounds_[std::size_t(p)]++;
      gathered_[std::size_t(p)].push_back(mine);
      cv_.notify_all();
      cv_.wait(lock, [&] {
        for (const auto& g : gathered_)
          if (int(g.size()) <= round) return false;
        return true;
      });
      std::vector<double> all;
      for (const auto& g : gathered_) all.insert(all.end(), g[std::size_t(round)].begin(), g[std::size_t(round)].end());
      return all;
    };
    out.send = [this, p](const std::vector<double>& sums) {
      std::lock_guard<std::mutex> lock(mu_);
      passed_[std::size_t(p)].push_back(sums);
      cv_.notify_all();
    };
    out.receive = [this](int from, std::vector<double>& sums) {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return !passed_[std::size_t(from)].empty(); });
      sums = std::move(passed_[std::size_t(from)].front());
      passed_[std::size_t(from)].pop_front();
    };
    return out;
  }

 private:
  const int parts_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::size_t, int> rounds_;
  std::vector<std::vector<std::vector<double>>> gathered_;  // by part, by round
  std::vector<std::deque<std::vector<double>>> passed_;      // from each part
};

// Every element each part sends, in place in the whole result, and how many times it came.
class PartsSink final : public ReferenceSink {
 public:
  void result(const std::string& name, const std::vector<std::int64_t>& shape, DType) override {
    std::lock_guard<std::mutex> lock(mu_);
    std::int64_t n = 1;
    for (std::int64_t d : shape) n *= d;
    if (!value.count(name)) value[name].assign(std::size_t(n), 0), bound[name].assign(std::size_t(n), 0),
                            sent[name].assign(std::size_t(n), 0), cols[name] = shape.back();
  }
  void block(const std::string& name, const ReferenceBlock& b) override {
    std::lock_guard<std::mutex> lock(mu_);
    for (std::int64_t r = 0; r < b.rows; ++r)
      for (std::int64_t c = 0; c < b.cols; ++c) {
        const auto at = std::size_t((b.row + r) * cols.at(name) + b.col + c);
        value.at(name)[at] = b.value[r * b.ld + c], bound.at(name)[at] = b.bound[r * b.ld + c];
        ++sent.at(name)[at];
      }
  }
  std::map<std::string, std::vector<double>> value, bound;
  std::map<std::string, std::vector<int>> sent;

 private:
  std::mutex mu_;
  std::map<std::string, std::int64_t> cols;
};

// Rows [begin, begin + rows) along dim (0 or 1) of a vector or matrix.
HostTensor sliceAlong(const HostTensor& t, int dim, std::int64_t begin, std::int64_t rows) {
  const std::int64_t cols = t.shape.back(), outer = dim == 0 ? 1 : t.numel() / cols;
  const std::int64_t run = dim == 0 ? rows * (t.shape.size() == 1 ? 1 : cols) : rows;
  const std::int64_t from = dim == 0 ? begin * (t.shape.size() == 1 ? 1 : cols) : begin;
  HostTensor out{t.shape, t.dtype, {}};
  out.shape[std::size_t(dim)] = rows;
  for (std::int64_t o = 0; o < outer; ++o)
    out.values.insert(out.values.end(), t.values.begin() + o * cols + from, t.values.begin() + o * cols + from + run);
  return out;
}

// `whole`'s reference in 2 and 4 parts of the split dimension (`size`), on threads, each part
// holding the rows of the `split` inputs (dimension each) from begin = size / parts · part: each
// element sent once; the sums over the split dimension (`sums`) within 1e-9 of their bound of the
// whole's and their bounds within 1e-5 (each part rounds its bounds' products to float on its own,
// as blocks do), every other result the whole's bit for bit (fp32: the parts' sums of ℓ1 norms
// change no bound). Nothing a verdict sees.
void expectPartsGiveTheWhole(const ReferenceOptions& whole, const TensorMap& in, std::int64_t size,
                             const std::map<std::string, int>& split, const std::vector<std::string>& sums) {
  const std::map<std::string, Checked> want = denseReference(whole, storedOf(in));
  for (const int parts : {2, 4}) {
    PartsFabric fabric(parts);
    PartsSink sink;
    std::vector<std::thread> threads;
    for (int p = 0; p < parts; ++p) {
      TensorMap mine = in;
      for (const auto& [name, dim] : split) mine[name] = sliceAlong(in.at(name), dim, size / parts * p, size / parts);
      threads.emplace_back([&, p, mine = storedOf(mine)] {
        const ReferencePart part = fabric.part(p, size, split);
        ReferenceOptions o = whole;
        o.part = &part;
        streamReference(o, mine, sink);
      });
    }
    for (std::thread& t : threads) t.join();
    ASSERT_EQ(sink.value.size(), want.size()) << parts << " parts";
    for (const auto& [name, c] : want) {
      for (std::size_t i = 0; i < c.bound.size(); ++i) {
        ASSERT_EQ(sink.sent.at(name)[i], 1) << name << " element " << i << ", " << parts << " parts";
        const double value = sink.value.at(name)[i], bound = sink.bound.at(name)[i];
        if (std::count(sums.begin(), sums.end(), name)) {
          ASSERT_NEAR(value, c.value.values[i], 1e-9 * c.bound[i]) << name << " element " << i << ", " << parts;
          ASSERT_NEAR(bound, c.bound[i], 1e-5 * c.bound[i]) << name << " element " << i << ", " << parts;
        } else {
          ASSERT_EQ(value, c.value.values[i]) << name << " element " << i << ", " << parts << " parts";
          ASSERT_EQ(bound, c.bound[i]) << name << " element " << i << ", " << parts << " parts";
        }
      }
    }
  }
}

// An MLP at T = 4 (F = 1200 in blocks of 256), whole and in 2 and 4 parts (blocks from each part's
// first row: 256, 256, 88 and 256, 44): output and input.grad sum over F.
TEST(Reference, MlpInPartsOfWholeRanksGivesTheWhole) {
  const std::int64_t h = 5, f = 1200;
  std::mt19937_64 rng(19);
  auto random = [&rng](std::vector<std::int64_t> shape) { return randomTensor(std::move(shape), rng); };
  const TensorMap in = {{"input", random({2, 3, h})},     {"grad_output", random({2, 3, h})},
                        {"fc1.weight", random({f, h})},   {"fc1.bias", random({f})},
                        {"fc2.weight", random({h, f})},   {"fc2.bias", random({h})}};
  ReferenceOptions whole;
  whole.layer = layerKind("mlp");
  whole.tp = 4;
  whole.blockElements = 6 * 256;
  expectPartsGiveTheWhole(whole, in, f, {{"fc1.bias", 0}, {"fc1.weight", 0}, {"fc2.weight", 1}},
                          {"output", "input.grad"});
}

// A column (N = 1200 split, in blocks of 256 rows of the weight) and a row (K = 1200 split, N = 700
// in blocks of 256) at T = 4, whole and in 2 and 4 parts: the column's input.grad sums over N, the
// row's output over K; its bias.grad comes from the first part alone.
TEST(Reference, LinearInPartsOfWholeRanksGivesTheWhole) {
  const std::int64_t wide = 1200, narrow = 5, rowN = 700;
  std::mt19937_64 rng(23);
  auto random = [&rng](std::vector<std::int64_t> shape) { return randomTensor(std::move(shape), rng); };
  ReferenceOptions column;
  column.layer = layerKind("column");
  column.tp = 4;
  column.blockElements = narrow * 256;
  const TensorMap columnIn = {{"input", random({2, 3, narrow})}, {"weight", random({wide, narrow})},
                              {"bias", random({wide})},          {"grad_output", random({2, 3, wide})}};
  expectPartsGiveTheWhole(column, columnIn, wide, {{"weight", 0}, {"bias", 0}}, {"input.grad"});
  ReferenceOptions row = column;
  row.layer = layerKind("row");
  const TensorMap rowIn = {{"input", random({2, 3, wide})}, {"weight", random({rowN, wide})},
                           {"bias", random({rowN})},        {"grad_output", random({2, 3, rowN})}};
  expectPartsGiveTheWhole(row, rowIn, wide, {{"weight", 1}}, {"output"});
}

// Grouped experts (3, the second without tokens) at T = 4, each a column (N = 1200 split, with
// biases) or a row (K = 1200 split), whole and in 2 and 4 parts: the column's input.grad sums over
// N, the row's output over K; the empty expert's zero gradients come once each.
TEST(Reference, GroupedInPartsOfWholeRanksGivesTheWhole) {
  const std::int64_t wide = 1200, narrow = 5, tokens = 7, experts = 3;
  std::mt19937_64 rng(31);
  const HostTensor ids{{tokens}, DType::kInt64, {2, 0, 2, 2, 0, 0, 2}};
  for (const bool column : {true, false}) {
    ReferenceOptions whole;
    whole.layer = layerKind(column ? "grouped-column" : "grouped-row");
    whole.tp = 4;
    whole.blockElements = narrow * 256;
    const std::int64_t n = column ? wide : narrow, k = column ? narrow : wide;
    TensorMap in = {{"input", randomTensor({tokens, k}, rng)},
                    {"expert_ids", ids},
                    {"grad_output", randomTensor({tokens, n}, rng)}};
    std::map<std::string, int> split;
    for (std::int64_t e = 0; e < experts; ++e) {
      const std::string weight = "weight" + std::to_string(e), bias = "bias" + std::to_string(e);
      in[weight] = randomTensor({n, k}, rng), in[bias] = randomTensor({n}, rng);
      split[weight] = column ? 0 : 1;
      if (column) split[bias] = 0;
    }
    expectPartsGiveTheWhole(whole, in, wide, split, {column ? "input.grad" : "output"});
  }
}

// An embedding of 1200 rows (in blocks of 256) at T = 4, whole and in 2 and 4 parts of its
// vocabulary, its output reduce-scattered and not: every result the whole's bit for bit (each
// token's row comes from one part, and the others add zeros).
TEST(Reference, EmbeddingInPartsOfWholeRanksGivesTheWhole) {
  const std::int64_t vocab = 1200, h = 5;
  std::mt19937_64 rng(29);
  std::vector<double> ids;
  for (int i = 0; i < 24; ++i) ids.push_back(double(rng() % vocab));
  ids.front() = 0, ids.back() = vocab - 1, ids[1] = vocab / 2, ids[2] = vocab / 2 - 1;  // parts' edges
  for (const bool reduceScatter : {false, true}) {
    ReferenceOptions whole;
    whole.layer = layerKind("embedding");
    whole.tp = 4;
    whole.blockElements = h * 256;
    whole.reduceScatterEmbeddings = reduceScatter;
    const std::vector<std::int64_t> output = reduceScatter ? std::vector<std::int64_t>{6, 4, h}
                                                           : std::vector<std::int64_t>{4, 6, h};
    const TensorMap in = {{"input", HostTensor{{4, 6}, DType::kInt64, ids}},
                          {"weight", randomTensor({vocab, h}, rng)},
                          {"grad_output", randomTensor(output, rng)}};
    expectPartsGiveTheWhole(whole, in, vocab, {{"weight", 0}}, {});
  }
}

// A column layer small enough for loops: 6 tokens, K = 5, N = 700 output features. In blocks of 256
// of the weight's rows (256, 256, 188) and in one block, the reference's values are the loops' in
// double, and the blocks change no bit of a value or a bound where the packed kernels run (the
// blocks add to input.grad in the order of one product's K blocks).
TEST(Reference, LinearInBlocksOfWeightRowsMatchesLoopsAndTheWholeBitForBit) {
  const std::int64_t tokens = 6, k = 5, n = 700;
  std::mt19937_64 rng(13);
  auto random = [&rng](std::vector<std::int64_t> shape) { return randomTensor(std::move(shape), rng); };
  const TensorMap in = {{"input", random({2, 3, k})},
                        {"weight", random({n, k})},
                        {"bias", random({n})},
                        {"grad_output", random({2, 3, n})}};
  const std::vector<double> &x = in.at("input").values, &w = in.at("weight").values, &b = in.at("bias").values;
  const std::vector<double>& dy = in.at("grad_output").values;

  LoopSums sums;
  sums.result("output", tokens * n), sums.result("input.grad", tokens * k), sums.result("weight.grad", n * k);
  sums.result("bias.grad", n);
  auto add = [&sums](const std::string& name, std::int64_t i, double term) { sums.add(name, i, term); };
  for (std::int64_t t = 0; t < tokens; ++t)
    for (std::int64_t j = 0; j < n; ++j) {
      add("output", t * n + j, b[std::size_t(j)]);
      add("bias.grad", j, dy[std::size_t(t * n + j)]);
      for (std::int64_t i = 0; i < k; ++i) {
        add("output", t * n + j, x[std::size_t(t * k + i)] * w[std::size_t(j * k + i)]);
        add("input.grad", t * k + i, dy[std::size_t(t * n + j)] * w[std::size_t(j * k + i)]);
        add("weight.grad", j * k + i, dy[std::size_t(t * n + j)] * x[std::size_t(t * k + i)]);
      }
    }

  expectWeightRowBlocksMatchLoops(sums, "column", in, k);
}

// An embedding small enough for loops: a table of 700 rows of h = 5, six tokens whose ids repeat and
// lie on the blocks' edges. In blocks of 256 rows of the table (256, 256, 188) and in one block, the
// reference's values are the loops' (each row of the gradient its tokens' rows in token order), and
// the blocks change no bit of a value or a bound.
TEST(Reference, EmbeddingInBlocksOfTableRowsMatchesLoopsAndTheWholeBitForBit) {
  const std::int64_t tokens = 6, h = 5, vocab = 700;
  std::mt19937_64 rng(17);
  const std::vector<double> ids = {0, 256, 255, 699, 256, 511};
  const TensorMap in = {{"input", HostTensor{{2, 3}, DType::kInt64, ids}},
                        {"weight", randomTensor({vocab, h}, rng)},
                        {"grad_output", randomTensor({2, 3, h}, rng)}};
  const std::vector<double> &w = in.at("weight").values, &dy = in.at("grad_output").values;

  LoopSums sums;
  sums.result("output", tokens * h), sums.result("weight.grad", vocab * h);
  for (std::int64_t t = 0; t < tokens; ++t)
    for (std::int64_t j = 0; j < h; ++j) {
      const std::int64_t row = std::int64_t(ids[std::size_t(t)]);
      sums.add("output", t * h + j, w[std::size_t(row * h + j)]);
      sums.add("weight.grad", row * h + j, dy[std::size_t(t * h + j)]);
    }

  ReferenceOptions whole;
  whole.layer = layerKind("embedding");
  ReferenceOptions blocks = whole;
  blocks.blockElements = h * 256;
  expectLoopSums(sums, denseReference(whole, storedOf(in)), denseReference(blocks, storedOf(in)),
                 [&](const std::string& name, std::size_t i, const Checked& a, const Checked& c) {
                   ASSERT_GE(a.bound[i], 0x1p-24 * sums.scale.at(name)[i]) << name << " element " << i;
                   ASSERT_EQ(c.value.values[i], a.value.values[i]) << name << " element " << i;
                   ASSERT_EQ(c.bound[i], a.bound[i]) << name << " element " << i;
                 });
}

// The grouped experts small enough for loops: six tokens of k = 5 over three experts of n = 700, the
// last without tokens. In blocks of 256 weight rows and in one block, the reference's values are the
// loops' (each token through its expert's weight and bias; each expert's gradients its own tokens'),
// the expert without tokens gets zero gradients, and the blocks change no bit of a value or a bound.
// An id outside [0, E) is refused.
TEST(Reference, GroupedExpertsInBlocksOfWeightRowsMatchLoopsAndTheWholeBitForBit) {
  const std::int64_t tokens = 6, k = 5, n = 700, experts = 3;
  std::mt19937_64 rng(19);
  const std::vector<double> ids = {1, 0, 1, 1, 0, 0};
  TensorMap in = {{"input", randomTensor({tokens, k}, rng)},
                  {"expert_ids", HostTensor{{tokens}, DType::kInt64, ids}},
                  {"grad_output", randomTensor({tokens, n}, rng)}};
  for (std::int64_t e = 0; e < experts; ++e) {
    in["weight" + std::to_string(e)] = randomTensor({n, k}, rng);
    in["bias" + std::to_string(e)] = randomTensor({n}, rng);
  }
  const std::vector<double> &x = in.at("input").values, &dy = in.at("grad_output").values;

  LoopSums sums;
  sums.result("output", tokens * n), sums.result("input.grad", tokens * k);
  for (std::int64_t e = 0; e < experts; ++e) {
    sums.result("weight" + std::to_string(e) + ".grad", n * k);
    sums.result("bias" + std::to_string(e) + ".grad", n);
  }
  for (std::int64_t t = 0; t < tokens; ++t) {
    const std::string e = std::to_string(std::int64_t(ids[std::size_t(t)]));
    const std::vector<double> &w = in.at("weight" + e).values, &b = in.at("bias" + e).values;
    for (std::int64_t j = 0; j < n; ++j) {
      sums.add("output", t * n + j, b[std::size_t(j)]);
      sums.add("bias" + e + ".grad", j, dy[std::size_t(t * n + j)]);
      for (std::int64_t i = 0; i < k; ++i) {
        sums.add("output", t * n + j, x[std::size_t(t * k + i)] * w[std::size_t(j * k + i)]);
        sums.add("input.grad", t * k + i, dy[std::size_t(t * n + j)] * w[std::size_t(j * k + i)]);
        sums.add("weight" + e + ".grad", j * k + i, dy[std::size_t(t * n + j)] * x[std::size_t(t * k + i)]);
      }
    }
  }

  expectWeightRowBlocksMatchLoops(sums, "grouped-column", in, k);

  in.at("expert_ids").values[3] = 3;
  ReferenceOptions options;
  options.layer = layerKind("grouped-column");
  EXPECT_THROW(denseReference(options, storedOf(in)), std::exception);
}

}  // namespace
}  // namespace tpsim::tools
