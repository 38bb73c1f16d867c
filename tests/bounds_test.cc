// The error bounds `tpsim run` checks results against, pinned and shown tight.
//
// Pinned: on small hand-made inputs, every element's bound on the path `tpsim run` takes
// (referenceFor, which verify calls) equals the formula of docs/bounds.md, written out here again
// with loops, up to the magnitude products' documented upward rounding. Tight: inputs built so that
// one term dominates a bound, run sharded on the simulator, err by at least a stated fraction of
// that term, and of the whole bound (docs/bounds.md lists the fractions and why some stay below 1).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "tools/lib/layer_kind.h"
#include "tools/lib/reference.h"
#include "tools/lib/runner.h"

namespace tpsim::tools {
namespace {

// ---- The formula (docs/bounds.md), independent of tools/lib/reference.cc -------------------------

constexpr double kUAcc = 0x1p-24;  // the simulator's fp32 accumulation

double u(DType d) {
  return d == DType::kBFloat16 ? 0x1p-8 : d == DType::kFloat16 ? 0x1p-11 : 0x1p-24;
}
double halfSubnormal(DType d) {
  return d == DType::kBFloat16 ? 0x1p-134 : d == DType::kFloat16 ? 0x1p-25 : 0x1p-150;
}
// (L + 2)·u_acc + the storage roundings.
double rel(std::int64_t length, double roundings) { return double(length + 2) * kUAcc + roundings; }

// One result's bound, and how far above it the tool's may be: its magnitudes are products computed
// in float (or bf16 operands) rounded upwards, documented in tools/lib/reference.h as at most
// (2L + 6)·2^-24 above for depth L, times (1 + 2^-7)^2 for operands that bf16 must round up.
struct Want {
  std::vector<double> bound;
  double above = 1;  // the tool's bound lies in [bound, bound · above]
};
using Wants = std::map<std::string, Want>;

double upward(std::int64_t depth, bool roundedOperands) {
  const double operands = !roundedOperands ? 1.0
                          : bestMagnitudeGemm() == MagnitudeGemm::kBf16 ? (1 + 0x1p-7) * (1 + 0x1p-7)
                                                                         : (1 + 0x1p-23) * (1 + 0x1p-23);
  return operands * (1 + double(2 * depth + 6) * 0x1p-24);
}

// What the run holds, as README's rules say, not as the tool derives it.
struct Dtypes {
  DType c, out, wgrad, wire;
};
Dtypes dtypesOf(const RunConfig& c) {
  const bool embedding = c.layer == layerKind("embedding");
  const DType wire = embedding ? c.dtype : c.mainGradDtype;  // the table has no main_grad on the wire
  const DType wgrad = c.gtpRemat > 1 ? wire : c.gradAccumulationFusion ? c.mainGradDtype : c.dtype;
  return {c.dtype, c.outputDtype.value_or(c.dtype), wgrad, wire};
}

// (T + 3)·δ·(1 + 1.13·S): δ half the smallest subnormal of the compute or output dtype, S the
// largest ℓ1 norm of a float input.
double underflow(const RunConfig& c, const TensorMap& in) {
  const Dtypes d = dtypesOf(c);
  double s = 0;
  for (const auto& [name, t] : in)
    if (t.dtype != DType::kInt64) {
      double l1 = 0;
      for (double v : t.values) l1 += std::fabs(v);
      s = std::max(s, l1);
    }
  return (c.tp + 3) * std::max(halfSubnormal(d.c), halfSubnormal(d.out)) * (1 + 1.13 * s);
}

// What every kind shares: the underflow allowance, GTP_remat's on its weight gradients, and MEAN's
// 1/G on every parameter gradient.
void finish(const RunConfig& c, const TensorMap& in, const std::vector<std::string>& gtpWeights, Wants& w) {
  const double allowance = underflow(c, in), G = c.gtpRemat;
  for (auto& [name, want] : w) {
    const bool gtp = G > 1 && std::count(gtpWeights.begin(), gtpWeights.end(), name);
    const bool parameter = name != "output" && name != "input.grad";
    for (double& b : want.bound) {
      b += allowance + (gtp ? G * halfSubnormal(dtypesOf(c).wire) : 0.0);
      if (parameter && G > 1 && c.gtpReduceMean) b /= G;
    }
  }
}

// G·u(wire) for a GTP_remat weight gradient: its reduce-scatter's partial sums and MEAN's pre-scale.
double gtpRoundings(const RunConfig& c) { return c.gtpRemat > 1 ? c.gtpRemat * u(dtypesOf(c).wire) : 0.0; }

const std::vector<double>& values(const TensorMap& in, const char* name) { return in.at(name).values; }

// Column and row: y = x·Wᵀ + b on (M, K) tokens, W (N, K) as the GEMMs read it (fprop for the
// output, dgrad for input.grad). The same computation on |values|, each result's magnitude:
struct LinearMagnitudes {
  std::vector<double> output, inputGrad, weightGrad, biasGrad;  // (M, N), (M, K), (N, K), (N)
};
LinearMagnitudes linearMagnitudes(const TensorMap& in, const std::vector<double>& wFprop,
                                  const std::vector<double>& wDgrad) {
  const std::vector<double> &x = values(in, "input"), &dy = values(in, "grad_output");
  const std::int64_t K = in.at("weight").shape[1], N = in.at("weight").shape[0], M = std::int64_t(x.size()) / K;
  const bool bias = in.count("bias");
  LinearMagnitudes a;
  a.output.assign(std::size_t(M * N), 0.0), a.inputGrad.assign(std::size_t(M * K), 0.0);
  a.weightGrad.assign(std::size_t(N * K), 0.0), a.biasGrad.assign(bias ? std::size_t(N) : 0, 0.0);
  for (std::int64_t m = 0; m < M; ++m)
    for (std::int64_t n = 0; n < N; ++n) {
      double& y = a.output[std::size_t(m * N + n)];
      if (bias) {
        y = std::fabs(values(in, "bias")[std::size_t(n)]);
        a.biasGrad[std::size_t(n)] += std::fabs(dy[std::size_t(m * N + n)]);
      }
      for (std::int64_t k = 0; k < K; ++k) {
        y += std::fabs(x[std::size_t(m * K + k)] * wFprop[std::size_t(n * K + k)]);
        a.inputGrad[std::size_t(m * K + k)] += std::fabs(dy[std::size_t(m * N + n)] * wDgrad[std::size_t(n * K + k)]);
        a.weightGrad[std::size_t(n * K + k)] += std::fabs(dy[std::size_t(m * N + n)] * x[std::size_t(m * K + k)]);
      }
    }
  return a;
}

// The magnitudes of a linear that reads its weight as it is.
LinearMagnitudes magnitudes(const TensorMap& in) {
  return linearMagnitudes(in, values(in, "weight"), values(in, "weight"));
}

std::vector<double> times(double factor, std::vector<double> v) {
  for (double& x : v) x *= factor;
  return v;
}

Wants linearWant(const RunConfig& c, const TensorMap& in, const std::vector<double>& wFprop,
                 const std::vector<double>& wDgrad) {
  const Dtypes d = dtypesOf(c);
  const std::int64_t K = in.at("weight").shape[1], N = in.at("weight").shape[0];
  const std::int64_t M = in.at("input").numel() / K;
  const int T = c.tp;
  const LinearMagnitudes a = linearMagnitudes(in, wFprop, wDgrad);
  Wants w;
  w["output"] = {times(rel(K, (1 + T) * u(d.out)), a.output), upward(K, false)};
  w["input.grad"] = {times(rel(N, (1 + T) * u(d.c)), a.inputGrad), upward(N, false)};
  w["weight.grad"] = {times(rel(M, u(d.wgrad) + gtpRoundings(c)), a.weightGrad), upward(M, false)};
  if (in.count("bias")) w["bias.grad"] = {times(rel(M, (1 + T) * u(d.c)), a.biasGrad)};
  finish(c, in, {"weight.grad"}, w);
  return w;
}

Wants linearWant(const RunConfig& c, const TensorMap& in) {
  return linearWant(c, in, values(in, "weight"), values(in, "weight"));
}

// The embedding: a lookup of ids (b, s) in W (V, h); grad_output (b, s, h).
Wants embeddingWant(const RunConfig& c, const TensorMap& in) {
  const Dtypes d = dtypesOf(c);
  const std::vector<double> &ids = values(in, "input"), &W = values(in, "weight"), &dy = values(in, "grad_output");
  const std::int64_t h = in.at("weight").shape[1], V = in.at("weight").shape[0], n = std::int64_t(ids.size());
  Wants w;
  std::vector<double> &y = w["output"].bound, &dW = w["weight.grad"].bound;
  y.assign(std::size_t(n * h), 0.0), dW.assign(std::size_t(V * h), 0.0);
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t j = 0; j < h; ++j) {
      const std::int64_t id = std::int64_t(ids[std::size_t(i)]);
      y[std::size_t(i * h + j)] = rel(0, (1 + c.tp) * u(d.c)) * std::fabs(W[std::size_t(id * h + j)]);
      dW[std::size_t(id * h + j)] += rel(n, u(d.wgrad) + gtpRoundings(c)) * std::fabs(dy[std::size_t(i * h + j)]);
    }
  finish(c, in, {"weight.grad"}, w);
  return w;
}

double gelu(double x) { return x * 0.5 * (1 + std::erf(x / std::sqrt(2.0))); }
double geluGrad(double x) {
  return 0.5 * (1 + std::erf(x / std::sqrt(2.0))) + x * std::exp(-x * x / 2) / std::sqrt(2 * M_PI);
}

// The MLP block: H = X·W1ᵀ + b1, A = GeLU(H), y = A·W2ᵀ + b2; dA = dY·W2, dH = dA ⊙ GeLU'(H).
Wants mlpWant(const RunConfig& c, const TensorMap& in) {
  const Dtypes d = dtypesOf(c);
  const std::vector<double> &x = values(in, "input"), &dy = values(in, "grad_output");
  const std::vector<double> &w1 = values(in, "fc1.weight"), &b1 = values(in, "fc1.bias");
  const std::vector<double>& w2 = values(in, "fc2.weight");
  const std::int64_t F = in.at("fc1.weight").shape[0], h = in.at("fc1.weight").shape[1], M = std::int64_t(x.size()) / h;
  const int T = c.tp;
  // The error an intermediate carries into the products after it, relative to aH = |X|·|W1|ᵀ
  // and adA = |dY|·|W2|: H's or dA's own (through |GeLU'| < 1.13), and GeLU's (GeLU''s)
  // evaluation in fp32, 4 (8) units.
  const double aErr = 1.13 * (double(h + 2) * kUAcc + 2 * u(d.c)) + 4 * u(DType::kFloat32);
  const double dhErr = 1.13 * (double(h + 2) * kUAcc + 4 * u(d.c)) + 8 * u(DType::kFloat32);
  const double relY = rel(F, (3 + T) * u(d.out)), relX = rel(F, (3 + T) * u(d.c)), relB = rel(M, (3 + T) * u(d.c));
  const double relW = rel(M, 2 * u(d.c) + u(d.wgrad) + gtpRoundings(c));
  // Per token t and hidden unit j: the operands of the bounds' products.
  std::vector<double> yLeft(std::size_t(M * F)), dhLeft(std::size_t(M * F)), w2Right(std::size_t(M * F)),
      w1Left(std::size_t(M * F)), b1Terms(std::size_t(M * F));
  for (std::int64_t t = 0; t < M; ++t)
    for (std::int64_t j = 0; j < F; ++j) {
      double H = b1[std::size_t(j)], aH = 0, dA = 0, adA = 0;
      for (std::int64_t k = 0; k < h; ++k) {
        H += x[std::size_t(t * h + k)] * w1[std::size_t(j * h + k)];
        aH += std::fabs(x[std::size_t(t * h + k)] * w1[std::size_t(j * h + k)]);
        dA += dy[std::size_t(t * h + k)] * w2[std::size_t(k * F + j)];
        adA += std::fabs(dy[std::size_t(t * h + k)] * w2[std::size_t(k * F + j)]);
      }
      const double A = std::fabs(gelu(H)), dH = std::fabs(dA * geluGrad(H));
      const std::size_t at = std::size_t(t * F + j);
      yLeft[at] = relY * A + aErr * aH;
      w2Right[at] = relW * A + aErr * aH;
      dhLeft[at] = relX * dH + dhErr * adA;
      w1Left[at] = relW * dH + dhErr * adA;
      b1Terms[at] = relB * dH + dhErr * adA;
    }
  Wants w;
  std::vector<double> &y = w["output"].bound, &dx = w["input.grad"].bound;
  std::vector<double> &dW1 = w["fc1.weight.grad"].bound, &db1 = w["fc1.bias.grad"].bound;
  std::vector<double> &dW2 = w["fc2.weight.grad"].bound, &db2 = w["fc2.bias.grad"].bound;
  y.assign(std::size_t(M * h), 0.0), dx.assign(std::size_t(M * h), 0.0), dW1.assign(std::size_t(F * h), 0.0);
  db1.assign(std::size_t(F), 0.0), dW2.assign(std::size_t(h * F), 0.0), db2.assign(std::size_t(h), 0.0);
  for (std::int64_t t = 0; t < M; ++t)
    for (std::int64_t j = 0; j < F; ++j) {
      const std::size_t at = std::size_t(t * F + j);
      db1[std::size_t(j)] += b1Terms[at];
      for (std::int64_t k = 0; k < h; ++k) {
        y[std::size_t(t * h + k)] += yLeft[at] * std::fabs(w2[std::size_t(k * F + j)]);
        dx[std::size_t(t * h + k)] += dhLeft[at] * std::fabs(w1[std::size_t(j * h + k)]);
        dW1[std::size_t(j * h + k)] += w1Left[at] * std::fabs(x[std::size_t(t * h + k)]);
        dW2[std::size_t(k * F + j)] += std::fabs(dy[std::size_t(t * h + k)]) * w2Right[at];
      }
    }
  for (std::int64_t k = 0; k < h; ++k)
    for (std::int64_t t = 0; t < M; ++t) {
      y[std::size_t(t * h + k)] += relY * std::fabs(values(in, "fc2.bias")[std::size_t(k)]);
      db2[std::size_t(k)] += relB * std::fabs(dy[std::size_t(t * h + k)]);
    }
  // The carried operands are rounded up once (depth h), then multiplied (depth F or M).
  w["output"].above = upward(h, true) * upward(F, true), w["input.grad"].above = upward(h, true) * upward(F, true);
  w["fc1.weight.grad"].above = w["fc2.weight.grad"].above = upward(h, true) * upward(M, true);
  w["fc1.bias.grad"].above = upward(h, true);
  finish(c, in, {"fc1.weight.grad", "fc2.weight.grad"}, w);
  return w;
}

// ---- Hand-made inputs -----------------------------------------------------------------------------

// values rounded to dtype, which must leave them as they are.
HostTensor exactTensor(std::vector<std::int64_t> shape, DType dtype, std::vector<double> v) {
  HostTensor t = makeHost(shape, dtype, v);
  EXPECT_EQ(t.values, v) << "a hand-made input is not exact in " << dtypeName(dtype);
  return t;
}

// n values k/16, k in [-15, 15] from `seed`, some zero: 5 significant bits, exact in every dtype
// and in the bf16 operands of the bounds' products, so only their depth factors separate the tool's
// bounds from the formula's.
HostTensor pattern(std::vector<std::int64_t> shape, DType dtype, int seed) {
  std::int64_t n = 1;
  for (std::int64_t d : shape) n *= d;
  std::vector<double> v(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) v[std::size_t(i)] = double((i * 7 + seed * 5 + i * i) % 31 - 15) / 16;
  return exactTensor(std::move(shape), dtype, std::move(v));
}

RunConfig sized(RunConfig c, const TensorMap& in) {
  ShapeMap shapes;
  for (const auto& [name, t] : in) shapes[name] = t.shape;
  return withSizesOf(c, shapes);
}

// s = 2, b = 2 (b = 4 under GTP_remat), K = 4, N = 4.
TensorMap linearInputs(const RunConfig& c) {
  const std::int64_t b = 2 * c.gtpRemat;
  TensorMap in = {{"input", pattern({2, b, 4}, c.dtype, 1)}, {"weight", pattern({4, 4}, c.dtype, 2)},
                  {"grad_output", pattern({2, b, 4}, c.dtype, 3)}};
  if (c.bias) in["bias"] = pattern({4}, c.dtype, 4);
  return in;
}

// s = 2, b = 2, h = 3, F = 4; fc1's bias moves H off the grid of exact values.
TensorMap mlpInputs(const RunConfig& c) {
  const std::int64_t b = 2 * c.gtpRemat;
  return {{"input", pattern({2, b, 3}, c.dtype, 1)},      {"fc1.weight", pattern({4, 3}, c.dtype, 2)},
          {"fc1.bias", pattern({4}, c.dtype, 3)},         {"fc2.weight", pattern({3, 4}, c.dtype, 4)},
          {"fc2.bias", pattern({3}, c.dtype, 5)},         {"grad_output", pattern({2, b, 3}, c.dtype, 6)}};
}

// ids (b = 2, s = 4) with repeats, V = 4, h = 3.
TensorMap embeddingInputs(const RunConfig& c) {
  const std::int64_t b = 2 * c.gtpRemat;
  std::vector<double> ids;
  for (std::int64_t i = 0; i < b * 4; ++i) ids.push_back(double((i * 3) % 5 % 4));
  return {{"input", exactTensor({b, 4}, DType::kInt64, ids)}, {"weight", pattern({4, 3}, c.dtype, 2)},
          {"grad_output", pattern({b, 4, 3}, c.dtype, 3)}};
}

// Element by element, the tool's bound (verify's path) against the formula's.
void expectPinned(const RunConfig& config, const TensorMap& in, const Wants& wants) {
  const RunConfig c = sized(config, in);
  const std::map<std::string, Checked> got = referenceFor(c, storedOf(in));
  ASSERT_EQ(got.size(), wants.size()) << c.str();
  for (const auto& [name, want] : wants) {
    ASSERT_TRUE(got.count(name)) << c.str() << ": no bound for " << name;
    const std::vector<double>& bound = got.at(name).bound;
    ASSERT_EQ(bound.size(), want.bound.size()) << c.str() << " " << name;
    for (std::size_t i = 0; i < bound.size(); ++i) {
      // 2^-50 below: the formula and the tool multiply in different orders in double.
      EXPECT_GE(bound[i], want.bound[i] * (1 - 0x1p-50)) << c.str() << ": " << name << " element " << i;
      EXPECT_LE(bound[i], want.bound[i] * want.above) << c.str() << ": " << name << " element " << i;
    }
  }
}

RunConfig config(const char* layer, int tp, DType dtype, bool bias = true) {
  RunConfig c;
  c.layer = layerKind(layer);
  c.tp = tp;
  c.dtype = dtype;
  c.bias = bias && layerKind(layer)->takes(LayerOption::kBias);
  return c;
}

const DType kDtypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};

// ---- Pinned ---------------------------------------------------------------------------------------

TEST(BoundsPinned, ColumnAndRowInEveryDtype) {
  for (const char* layer : {"column", "row"})
    for (DType dtype : kDtypes)
      for (int tp : {1, 2}) {
        const RunConfig c = config(layer, tp, dtype);
        const TensorMap in = linearInputs(c);
        expectPinned(c, in, linearWant(c, in));
      }
}

TEST(BoundsPinned, EmbeddingInEveryDtype) {
  for (DType dtype : kDtypes) {
    const RunConfig c = config("embedding", 2, dtype);
    const TensorMap in = embeddingInputs(c);
    expectPinned(c, in, embeddingWant(c, in));
  }
}

TEST(BoundsPinned, MlpWithGeluTerms) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16})
    for (int tp : {1, 2}) {
      const RunConfig c = config("mlp", tp, dtype);
      const TensorMap in = mlpInputs(c);
      expectPinned(c, in, mlpWant(c, in));
    }
}

// A weight gradient's bound counts the rounding into the dtype it lands in: an fp32 main_grad under
// fusion has fp32's, a bf16 one bf16's, whatever the activations' dtype.
TEST(BoundsPinned, FusedWeightGradientsFollowMainGrad) {
  for (const char* layer : {"column", "row", "mlp"})
    for (DType mainGrad : {DType::kFloat32, DType::kBFloat16}) {
      RunConfig c = config(layer, 2, DType::kBFloat16);
      c.gradAccumulationFusion = true;
      c.mainGradDtype = mainGrad;
      if (c.layer == layerKind("mlp")) {
        const TensorMap in = mlpInputs(c);
        expectPinned(c, in, mlpWant(c, in));
      } else {
        const TensorMap in = linearInputs(c);
        expectPinned(c, in, linearWant(c, in));
      }
    }
}

// GTP_remat: weight gradients add G roundings in the wire dtype (main_grad's; the embedding's
// table dtype); MEAN divides every parameter gradient's bound by G, bit for bit SUM's / G.
TEST(BoundsPinned, GtpRematSumAndMean) {
  struct Case {
    const char* layer;
    DType dtype, mainGrad;
  };
  for (const Case& k : {Case{"column", DType::kBFloat16, DType::kBFloat16},
                        Case{"column", DType::kBFloat16, DType::kFloat32},
                        Case{"row", DType::kFloat32, DType::kFloat32}, Case{"mlp", DType::kBFloat16, DType::kFloat32},
                        Case{"embedding", DType::kBFloat16, DType::kFloat32}}) {
    RunConfig sum = config(k.layer, 2, k.dtype);
    sum.gtpRemat = 2;
    sum.mainGradDtype = k.mainGrad;
    sum.gtpReduceMean = false;
    RunConfig mean = sum;
    mean.gtpReduceMean = true;
    const bool mlp = sum.layer == layerKind("mlp"), embedding = sum.layer == layerKind("embedding");
    const TensorMap in = mlp ? mlpInputs(sum) : embedding ? embeddingInputs(sum) : linearInputs(sum);
    for (const RunConfig& c : {sum, mean})
      expectPinned(c, in, mlp ? mlpWant(c, in) : embedding ? embeddingWant(c, in) : linearWant(c, in));
    const auto sums = referenceFor(sized(sum, in), storedOf(in)), means = referenceFor(sized(mean, in), storedOf(in));
    for (const auto& [name, s] : sums) {
      const bool parameter = name != "output" && name != "input.grad";
      for (std::size_t i = 0; i < s.bound.size(); ++i)
        ASSERT_EQ(means.at(name).bound[i], parameter ? s.bound[i] / 2 : s.bound[i])
            << sum.str() << ": " << name << " " << i;
    }
  }
}

// deq(Q(w)) of an MXFP8 block of 32 along `axis` of one TP rank's (rows, cols) weight, as Transformer
// Engine's rule reads: scale 2^e with e the least exponent that fits amax under 448·2^e, the
// element rounded to nearest even on E4M3's grid: 3 mantissa bits, steps of 2^-9 below 2^-6.
void quantize(std::vector<double>& w, std::int64_t rows, std::int64_t cols, int axis) {
  const std::int64_t along = axis == 1 ? cols : rows, across = axis == 1 ? rows : cols;
  for (std::int64_t a = 0; a < across; ++a)
    for (std::int64_t first = 0; first < along; first += 32) {
      auto at = [&](std::int64_t k) -> double& { return w[std::size_t(axis == 1 ? a * cols + k : k * cols + a)]; };
      const std::int64_t last = std::min(along, first + 32);
      double amax = 0;
      for (std::int64_t k = first; k < last; ++k) amax = std::max(amax, std::fabs(at(k)));
      int e = -127;
      while (amax > 448 * std::ldexp(1.0, e)) ++e;
      for (std::int64_t k = first; k < last; ++k) {
        const double v = at(k) / std::ldexp(1.0, e);
        if (v == 0) continue;
        const double step = std::fabs(v) < 0x1p-6 ? 0x1p-9 : std::ldexp(1.0, std::ilogb(v) - 3);
        at(k) = std::nearbyint(v / step) * step * std::ldexp(1.0, e);
      }
    }
}

// Column at T = 2 with MXFP8 weights: the output's bound reads the rowwise copy (blocks along K),
// input.grad's the columnwise one (blocks along each rank's N/T rows); weight.grad is unchanged.
TEST(BoundsPinned, Mxfp8ColumnReadsEachRanksQuantizedWeight) {
  RunConfig c = config("column", 2, DType::kBFloat16);
  c.weightFormat = WeightFormat::kMxfp8;
  TensorMap in = linearInputs(c);
  // 1.0625 has a bit too many for E4M3: 1 in either copy. 5·2^-17 beside 3 is E4M3-subnormal
  // (scale 2^-7) and rounds to 4·2^-17 rowwise, but beside 0.5 in its column it stays.
  in["weight"] = exactTensor({4, 4}, c.dtype, {3, 0x1.4p-15, -0.3125, 0.5, -1.0625, 0.5, 0.375, 0.0703125, 2, -0.5,
                                                 1.0625, 0.25, 0.75, 0.5, -3, 1.0625});
  std::vector<double> rowwise = values(in, "weight"), columnwise = rowwise;
  quantize(rowwise, 4, 4, 1);
  for (int t = 0; t < 2; ++t) {  // rank t's rows [2t, 2t + 2)
    std::vector<double> mine(columnwise.begin() + 8 * t, columnwise.begin() + 8 * t + 8);
    quantize(mine, 2, 4, 0);
    std::copy(mine.begin(), mine.end(), columnwise.begin() + 8 * t);
  }
  ASSERT_NE(rowwise, values(in, "weight"));
  ASSERT_NE(columnwise, values(in, "weight"));
  ASSERT_NE(columnwise, rowwise);
  expectPinned(c, in, linearWant(c, in, rowwise, columnwise));
}

// ---- Tight ---------------------------------------------------------------------------------------

// A run on the simulator checked as `tpsim run` checks it: per result, each element's |sharded −
// dense| and its bound, which must hold.
struct Observed {
  std::vector<double> err, bound;
};
std::map<std::string, Observed> observe(const RunConfig& config, const TensorMap& in) {
  const RunConfig c = sized(config, in);
  const RunResult r = runSharded(c, storedOf(in));
  std::map<std::string, Observed> out;
  for (const auto& [name, ref] : referenceFor(c, storedOf(in), r.placements)) {
    Observed& o = out[name];
    const std::vector<double>& got = r.results.at(name).values;
    for (std::size_t i = 0; i < got.size(); ++i) {
      o.err.push_back(std::fabs(got[i] - ref.value.values[i]));
      EXPECT_LE(o.err.back(), ref.bound[i]) << c.str() << ": " << name << " element " << i << " outside its bound";
    }
    o.bound = ref.bound;
  }
  return out;
}

// The largest err_i / term_i, over the elements with a term.
double reached(const std::vector<double>& err, const std::vector<double>& term) {
  double most = 0;
  for (std::size_t i = 0; i < err.size(); ++i)
    if (term[i] > 0) most = std::max(most, err[i] / term[i]);
  return most;
}

// Each named tensor of `shape` filled with `pattern` repeated, in dtype (the embedding's ids input in int64).
TensorMap filled(const std::map<std::string, std::pair<std::vector<std::int64_t>, std::vector<double>>>& parts,
                 DType dtype, bool ids = false) {
  TensorMap in;
  for (const auto& [name, part] : parts) {
    std::int64_t n = 1;
    for (std::int64_t d : part.first) n *= d;
    std::vector<double> v;
    while (std::int64_t(v.size()) < n) v.insert(v.end(), part.second.begin(), part.second.end());  // repeated
    v.resize(std::size_t(n));
    in[name] = exactTensor(part.first, ids && name == "input" ? DType::kInt64 : dtype, v);
  }
  return in;
}

// Just under half an fp32 ulp of 1, in every dtype: 1 + δ rounds back to 1 in an fp32 sum.
constexpr double kDelta = 0x1.fep-25;

// The fp32 sum of 1 and L − 1 values δ just under half an ulp of 1 loses every δ: an error of
// (L − 1)·δ ≈ (L − 1)·2^-24 against the term (L + 2)·2^-24·magnitude, a fraction (L − 1)/(L + 2).
TEST(BoundsTight, AccumulationOverTheReductionLength) {
  const std::int64_t L = 64;
  std::vector<double> oneThenDeltas(L, kDelta);
  oneThenDeltas[0] = 1;
  {  // column fp32, output: each token's row of x against a weight of ones (K = L)
    const RunConfig c = config("column", 2, DType::kFloat32, false);
    const TensorMap in = filled({{"input", {{2, 2, L}, oneThenDeltas}}, {"weight", {{4, L}, {1}}},
                                 {"grad_output", {{2, 2, 4}, {1}}}}, c.dtype);
    const auto seen = observe(c, in);
    const auto& y = seen.at("output");
    const std::vector<double> term = times(double(L + 2) * kUAcc, magnitudes(in).output);
    EXPECT_GE(reached(y.err, term), 0.9) << "output: (L − 1)/(L + 2) = 0.955 of its accumulation term";
    EXPECT_GE(reached(y.err, y.bound), 0.85) << "output: with 3 fp32 roundings, 0.909 of its bound";
  }
  {  // column bf16 under fusion, weight.grad into an fp32 main_grad: tokens M = L
    RunConfig c = config("column", 2, DType::kBFloat16, false);
    c.gradAccumulationFusion = true;
    std::vector<double> dy;  // (s, b, N): token 0 gives 1 to every output, the others δ
    for (double v : oneThenDeltas) dy.insert(dy.end(), 4, v);
    const TensorMap in = filled({{"input", {{L / 2, 2, 2}, {1}}}, {"weight", {{4, 2}, {1}}},
                                 {"grad_output", {{L / 2, 2, 4}, dy}}}, c.dtype);
    const auto seen = observe(c, in);
    const auto& dW = seen.at("weight.grad");
    const std::vector<double> term = times(double(L + 2) * kUAcc, magnitudes(in).weightGrad);
    EXPECT_GE(reached(dW.err, term), 0.9) << "weight.grad: (L − 1)/(L + 2) of its accumulation term";
    EXPECT_GE(reached(dW.err, dW.bound), 0.9) << "weight.grad in an fp32 main_grad: 0.937 of its bound, not 2^-8's";
  }
  {  // embedding fp32, weight.grad: L positions all look up id 0
    const RunConfig c = config("embedding", 2, DType::kFloat32);
    std::vector<double> dy;  // (b, s, h)
    for (double v : oneThenDeltas) dy.insert(dy.end(), 3, v);
    const TensorMap in = filled(
        {{"input", {{2, L / 2}, {0}}}, {"weight", {{4, 3}, {1}}}, {"grad_output", {{2, L / 2, 3}, dy}}}, c.dtype, true);
    const auto seen = observe(c, in);
    const auto& dW = seen.at("weight.grad");
    std::vector<double> term(dW.err.size(), 0.0);
    for (std::size_t i = 0; i < dy.size(); ++i) term[i % 3] += double(L + 2) * kUAcc * dy[i];
    EXPECT_GE(reached(dW.err, term), 0.9) << "weight.grad: (L − 1)/(L + 2) of its accumulation term";
    EXPECT_GE(reached(dW.err, dW.bound), 0.9) << "weight.grad: one fp32 rounding more, 0.937 of its bound";
  }
}

// a = u(1 − 2u) is just under half an ulp of 1: every 16-bit rounding of 1 + a loses all of it,
// so k roundings in a row err by k·a ≈ k·u against the term stages·u·magnitude.
double belowHalfUlp(DType dtype) { return u(dtype) * (1 - 2 * u(dtype)); }

TEST(BoundsTight, EachStorageRounding) {
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    const double a = belowHalfUlp(dtype);
    {  // column, T = 1: the GEMM rounds 1 + a once (a 16-bit bias joins that rounding, cuBLAS's
       // epilogue), and nothing reduces the output: 1 of the (1 + T) = 2 stages
      const RunConfig c = config("column", 1, dtype, false);
      const TensorMap in = filled({{"input", {{2, 1, 2}, {1, a}}}, {"weight", {{2, 2}, {1}}},
                                   {"grad_output", {{2, 1, 2}, {1}}}}, dtype);
      const auto seen = observe(c, in);
      const auto& y = seen.at("output");
      const std::vector<double> term =
          times(2 * u(dtype), magnitudes(in).output);
      EXPECT_GE(reached(y.err, term), 0.45) << dtypeName(dtype) << " column output: 1 of its 2 stages";
      EXPECT_GE(reached(y.err, y.bound), 0.45) << dtypeName(dtype) << " column output";
    }
    {  // row, T = 2: rank 0's GEMM rounds 1 + a, the all-reduce's add and the bias add round again:
       // 3 of (1 + T) = 3 stages
      const RunConfig c = config("row", 2, dtype);
      const TensorMap in = filled({{"input", {{2, 1, 4}, {1, a, a, 0}}},
                                   {"weight", {{2, 4}, {1}}},
                                   {"bias", {{2}, {a}}},
                                   {"grad_output", {{2, 1, 2}, {1}}}}, dtype);
      const auto seen = observe(c, in);
      const auto& y = seen.at("output");
      const std::vector<double> term =
          times(3 * u(dtype), magnitudes(in).output);
      EXPECT_GE(reached(y.err, term), 0.95) << dtypeName(dtype) << " row output: all three stages";
      EXPECT_GE(reached(y.err, y.bound), 0.95) << dtypeName(dtype) << " row output";
    }
    {  // column weight.grad rounded into the compute dtype (no fusion): 1 stage
      const RunConfig c = config("column", 1, dtype, false);
      const TensorMap in = filled({{"input", {{2, 1, 2}, {1}}}, {"weight", {{2, 2}, {1}}},
                                   {"grad_output", {{2, 1, 2}, {1, 1, a, a}}}}, dtype);
      const auto seen = observe(c, in);
      const auto& dW = seen.at("weight.grad");
      const std::vector<double> term =
          times(u(dtype), magnitudes(in).weightGrad);
      EXPECT_GE(reached(dW.err, term), 0.95) << dtypeName(dtype) << " weight.grad";
      EXPECT_GE(reached(dW.err, dW.bound), 0.95) << dtypeName(dtype) << " weight.grad";
    }
  }
}

// GTP_remat G = 2, bf16 on the wire: peer 0's wgrad 1 + a rounds to 1, the reduce-scatter's add of
// peer 1's a rounds again (MEAN's pre-scale by 1/2 is exact), 2 of the (1 + G) = 3 stages counted:
// 2/3 of the term, under SUM and under MEAN, whose bound is SUM's / G like its values.
TEST(BoundsTight, GtpRematReduceScatterRoundings) {
  const double a = belowHalfUlp(DType::kBFloat16);
  for (bool mean : {false, true}) {
    RunConfig c = config("column", 1, DType::kBFloat16, false);
    c.gtpRemat = 2;
    c.mainGradDtype = DType::kBFloat16;
    c.gtpReduceMean = mean;
    // (s, b, N): peer g holds batch column g; peer 0's tokens give 1 and a, peer 1's a and 0.
    const TensorMap in = filled({{"input", {{2, 2, 2}, {1}}}, {"weight", {{2, 2}, {1}}},
                                 {"grad_output", {{2, 2, 2}, {1, 1, a, a, a, a, 0, 0}}}}, c.dtype);
    const auto seen = observe(c, in);
    const auto& dW = seen.at("weight.grad");
    const std::vector<double> term =
        times(3 * u(c.dtype) / (mean ? 2 : 1), magnitudes(in).weightGrad);
    EXPECT_GE(reached(dW.err, term), 0.6) << (mean ? "MEAN" : "SUM") << ": 2/3 of the three stages";
    EXPECT_GE(reached(dW.err, dW.bound), 0.6) << (mean ? "MEAN" : "SUM");
  }
}

// The MLP's output, bf16, T = 2: GeLU(16) = 16 and GeLU(0) = 0 exactly, so fc2 is a row layer on
// exact values: rank 0's GEMM rounds 16 + 16a, the all-reduce's add and fc2's bias round again.
// Those are 3 of the (3 + T) = 5 stages the bound counts (GeLU(H)'s own storage rounding is exact
// here, and one stage is spare): 3/5 of the term.
TEST(BoundsTight, MlpStorageRoundings) {
  const double a = belowHalfUlp(DType::kBFloat16);
  const RunConfig c = config("mlp", 2, DType::kBFloat16);
  const TensorMap in = filled({{"input", {{2, 1, 1}, {16}}},
                               {"fc1.weight", {{4, 1}, {1, 1, 1, 0}}},
                               {"fc1.bias", {{4}, {0}}},
                               {"fc2.weight", {{1, 4}, {1, a, a, 1}}}, {"fc2.bias", {{1}, {16 * a}}},
                               {"grad_output", {{2, 1, 1}, {1}}}},
                              DType::kBFloat16);
  const auto seen = observe(c, in);
  const auto& y = seen.at("output");
  // (3 + T)·u·(|GeLU(H)|·|W2|ᵀ + |b2|): GeLU(H) = (16, 16, 16, 0) for each token.
  const double magnitude = 16 + 16 * a + 16 * a + 16 * a;
  EXPECT_GE(reached(y.err, std::vector<double>(y.err.size(), 5 * u(c.dtype) * magnitude)), 0.55) << "3/5 of the stages";
}

// GeLU's evaluation in fp32, alone: h = F = 1 with unit weights and no biases make every GEMM
// exact, so the output's error is GeLU's (term 4·2^-24·|H|) and input.grad's GeLU''s (term
// 8·2^-24·|dA|), over 512 values of H in [-6, 6).
TEST(BoundsTight, GeluEvaluation) {
  const RunConfig c = config("mlp", 1, DType::kFloat32);
  std::vector<double> h;
  for (int i = 0; i < 512; ++i) h.push_back(double(float(-6 + 12 * (i + 0.37) / 512)));
  const TensorMap in = filled({{"input", {{256, 2, 1}, h}}, {"fc1.weight", {{1, 1}, {1}}}, {"fc1.bias", {{1}, {0}}},
                               {"fc2.weight", {{1, 1}, {1}}},
                               {"fc2.bias", {{1}, {0}}},
                               {"grad_output", {{256, 2, 1}, {1}}}},
                              c.dtype);
  const auto seen = observe(c, in);
  std::vector<double> geluTerm, gradTerm(h.size(), 8 * 0x1p-24);
  for (double x : h) geluTerm.push_back(4 * 0x1p-24 * std::fabs(x));
  const double y = reached(seen.at("output").err, geluTerm), dx = reached(seen.at("input.grad").err, gradTerm);
  RecordProperty("gelu", std::to_string(y));
  RecordProperty("gelu_grad", std::to_string(dx));
  EXPECT_GE(y, 0.3) << "GeLU's evaluation";
  EXPECT_GE(dx, 0.15) << "GeLU''s evaluation";
}

}  // namespace
}  // namespace tpsim::tools
