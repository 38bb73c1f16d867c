// MXFP8 weights (core/mxfp8.h): SPEC 5.4 fact G8, gemmWeight against the quantization of the
// unpadded weight, GTP_remat on against off, dgrad reading the columnwise copy, and the errors.
// Expected values come from a host quantizer written here with scalar loops (the block exponent
// searched, not derived), and dtype.h's E4M3 conversion, which dtype_test.cc checks on its own.
#include "core/mxfp8.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <mutex>

#include "core/gtp.h"
#include "core/layers.h"
#include "core/process_groups.h"
#include "tests/sim_test_util.h"

namespace tpsim {
namespace {

using ::testing::HasSubstr;
using testing::errorOf;
using testing::runRanks;
using testing::table;
using testing::tensorOf;
using testing::valuesOf;
using testing::wave;

// deq(Q(w)) of a row-major (rows, cols) host matrix, blocks of 32 along `axis` (1: rowwise).
std::vector<double> hostMxfp8(const std::vector<double>& w, std::int64_t rows, std::int64_t cols, int axis) {
  std::vector<double> out(w.size());
  const std::int64_t along = axis == 1 ? cols : rows, across = axis == 1 ? rows : cols;
  auto index = [&](std::int64_t a, std::int64_t k) { return std::size_t(axis == 1 ? a * cols + k : k * cols + a); };
  for (std::int64_t a = 0; a < across; ++a)
    for (std::int64_t first = 0; first < along; first += 32) {
      const std::int64_t last = std::min(along, first + 32);
      double amax = 0;
      for (std::int64_t k = first; k < last; ++k) amax = std::max(amax, std::fabs(w[index(a, k)]));
      int e = -127;
      while (e < 127 && amax > 448.0 * std::ldexp(1.0, e)) ++e;
      for (std::int64_t k = first; k < last; ++k)
        out[index(a, k)] = e4m3ToFloat(toE4m3(w[index(a, k)] / std::ldexp(1.0, e))) * std::ldexp(1.0, e);
    }
  return out;
}

// c = a·bᵀ with a (m, k), b (n, k), and per element the bound of an fp32 GEMM rounded once into
// `dtype`: k·2^-24·Σ|a·b| for the accumulation plus half an ulp of the result.
struct Product {
  std::vector<double> value, bound;
};
Product hostProduct(const std::vector<double>& a, const std::vector<double>& b, std::int64_t m, std::int64_t n,
                    std::int64_t k, DType dtype) {
  const double unit = dtype == DType::kBFloat16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -24);
  Product p{std::vector<double>(std::size_t(m * n)), std::vector<double>(std::size_t(m * n))};
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      double sum = 0, mag = 0;
      for (std::int64_t l = 0; l < k; ++l) {
        sum += a[i * k + l] * b[j * k + l];
        mag += std::fabs(a[i * k + l] * b[j * k + l]);
      }
      p.value[i * n + j] = sum;
      p.bound[i * n + j] = double(k) * std::ldexp(1.0, -24) * mag + unit * std::fabs(sum) + 1e-30;
    }
  return p;
}

std::vector<double> transposed(const std::vector<double>& m, std::int64_t rows, std::int64_t cols) {
  return table(cols, rows, [&](std::int64_t i, std::int64_t j) { return m[j * cols + i]; });
}

// An InitMethod that writes f(row, col) into the (rows, cols) master weight.
InitMethod initFrom(std::int64_t cols, std::function<double(std::int64_t, std::int64_t)> f) {
  return [cols, f](Generator&, std::vector<float>& master) {
    for (std::size_t i = 0; i < master.size(); ++i)
      master[i] = float(f(std::int64_t(i) / cols, std::int64_t(i) % cols));
  };
}

TEST(WeightFormat, NamesRoundTrip) {
  for (WeightFormat f : {WeightFormat::kNative, WeightFormat::kMxfp8})
    EXPECT_EQ(parseWeightFormat(weightFormatName(f)), f);
  EXPECT_STREQ(weightFormatName(WeightFormat::kMxfp8), "mxfp8");
  EXPECT_EQ(errorOf([] { parseWeightFormat("fp8"); }), "weight format must be native or mxfp8, got 'fp8'");
}

// G8: native MXFP8, N = 120, G = 4 (a = 32): pad_length 8 on every rank, output (32, 120), finite,
// and equal to x·deq(Q_row(W))ᵀ, which differs from the unquantized x·Wᵀ.
TEST(Mxfp8Facts, G8) {
  runRanks(4, [](RankContext& ctx) {
    GtpGradReducer reducer(ctx.compute, {});
    auto tp = ctx.comm.split(ctx.comm.rank(), 0, "tp");
    Generator gen(8);
    ModelParallelConfig config;
    config.useCpuInitialization = true;
    config.paramsDtype = DType::kBFloat16;
    config.gtpPadForAlignment = 32;
    config.weightFormat = WeightFormat::kMxfp8;
    ColumnParallelOptions o;
    o.bias = false;
    ColumnParallelLinear col({ctx.compute, *tp, nullptr, &gen, &ctx.comm, nullptr, &reducer}, config, 64, 120,
                             initMethodNormal(0.1), o);
    EXPECT_EQ(col.weight()->attrs.padLength, std::optional<int>(8)) << "rank " << ctx.comm.rank();
    ASSERT_EQ(col.weight()->data.shape(), Shape({32, 64}));
    const auto xv = valuesOf(ctx.compute, tensorOf(ctx.compute, DType::kBFloat16, wave(32 * 64, 0.5)));
    Tensor x = tensorOf(ctx.compute, DType::kBFloat16, xv, Shape{32, 64});
    Tensor y = col.forward(x).output;
    ASSERT_EQ(y.shape(), Shape({32, 120}));
    const auto yv = valuesOf(ctx.compute, y);
    for (std::size_t i = 0; i < yv.size(); ++i) ASSERT_TRUE(std::isfinite(yv[i])) << "element " << i;

    const auto w = valuesOf(ctx.compute, materialize(ctx.compute, *col.weight()).weight);  // (120, 64) bf16
    const Product ref = hostProduct(xv, hostMxfp8(w, 120, 64, 1), 32, 120, 64, DType::kBFloat16);
    const Product native = hostProduct(xv, w, 32, 120, 64, DType::kBFloat16);
    int differs = 0;
    for (std::size_t i = 0; i < yv.size(); ++i) {
      ASSERT_NEAR(yv[i], ref.value[i], ref.bound[i]) << "output element " << i;
      differs += std::fabs(yv[i] - native.value[i]) > 2 * native.bound[i];
    }
    EXPECT_GT(differs, 100) << "the output should show the quantization of W";
  });
}

// gemmWeight of a GTP_remat shard (a = 32, pad rows spilling over two peers) is bitwise the
// quantization of the unpadded TP-local weight, for both uses; the wire carries fp8 bytes.
TEST(GemmWeight, GtpShardEqualsTheUnpaddedQuantization) {
  const std::int64_t dLog = 72, k = 40;  // G = 4, a = 32: pad 56, S = 32; peers 2 and 3 hold pad rows
  const auto full = table(dLog, k, [](std::int64_t i, std::int64_t j) {
    return std::ldexp(std::sin(0.3 * double(i * k + j)), int((i + 3 * j) % 11) - 5);
  });
  WorldOptions options;
  options.size = 4;
  options.trace = true;
  sim::World world(options);
  world.run([&](RankContext& ctx) {
    for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
      Tensor unpadded = tensorOf(ctx.compute, dtype, full, Shape{dLog, k});
      Parameter w;
      w.name = "w";
      w.data = tensorOf(ctx.compute, dtype, full, Shape{dLog, k});
      wrapGtp(ctx.compute, w, ctx.comm, 32);
      ASSERT_EQ(w.data.shape(), Shape({32, k}));
      for (GemmUse use : {GemmUse::kFprop, GemmUse::kDgrad}) {
        const int axis = use == GemmUse::kFprop ? 1 : 0;
        const GemmWeight got = gemmWeight(ctx.compute, w, WeightFormat::kMxfp8, use, dtype);
        ASSERT_EQ(got.weight.shape(), Shape({dLog, k}));
        Tensor data = ctx.compute.empty({dLog, k}, DType::kFloat8E4M3);
        Tensor scales = ctx.compute.empty(axis == 1 ? Shape{dLog, 2} : Shape{3, k}, DType::kFloat8E8M0);
        ctx.compute.quantizeMxfp8(unpadded, data, scales, axis);
        Tensor want = ctx.compute.empty({dLog, k}, dtype);
        ctx.compute.dequantizeMxfp8(data, scales, axis, want);
        EXPECT_EQ(valuesOf(ctx.compute, got.weight), valuesOf(ctx.compute, want))
            << dtypeName(dtype) << " axis " << axis;
        const auto host = hostMxfp8(valuesOf(ctx.compute, unpadded), dLog, k, axis);
        EXPECT_EQ(valuesOf(ctx.compute, got.weight), host) << dtypeName(dtype) << " axis " << axis << " vs host";
      }
      // Native: materialize for a shard, the parameter itself otherwise.
      const GemmWeight native = gemmWeight(ctx.compute, w, WeightFormat::kNative, GemmUse::kDgrad, dtype);
      EXPECT_EQ(valuesOf(ctx.compute, native.weight), valuesOf(ctx.compute, unpadded));
      Parameter plain;
      plain.data = tensorOf(ctx.compute, dtype, full, Shape{dLog, k});
      const GemmWeight same = gemmWeight(ctx.compute, plain, WeightFormat::kNative, GemmUse::kFprop, dtype);
      EXPECT_EQ(same.weight.data(), plain.data.data());
      EXPECT_EQ(same.storage, nullptr);
    }
  });
  // Per mxfp8 gemmWeight: one gather of S·K = 1280 E4M3 bytes and one of the scales.
  std::vector<std::string> gathers;
  for (const TraceEvent& e : world.trace()[2])
    if (e.op == "allGather") gathers.push_back(e.dtype + ":" + std::to_string(e.bytes));
  const std::vector<std::string> mx = {"fp8e4m3:1280", "e8m0:64", "fp8e4m3:1280", "e8m0:40"};
  std::vector<std::string> want;
  for (const char* native : {"fp32:5120", "bf16:2560"}) {
    want.insert(want.end(), mx.begin(), mx.end());
    want.push_back(native);
  }
  EXPECT_EQ(gathers, want);
}

TEST(GemmWeight, RejectsMisalignedShardsAndNonMatrices) {
  runRanks(4, [](RankContext& ctx) {
    Parameter w;
    w.name = "w";
    w.data = ctx.compute.zeros({64, 8}, DType::kFloat32);
    wrapGtp(ctx.compute, w, ctx.comm, 16);  // S = 16
    EXPECT_EQ(errorOf([&] { gemmWeight(ctx.compute, w, WeightFormat::kMxfp8, GemmUse::kDgrad, DType::kFloat32); }),
              "gemmWeight: the GTP_remat shard w must have a multiple of 32 rows for mxfp8, got 16; a columnwise "
              "block must not straddle two shards, set pad_for_alignment to a multiple of 32");
    Parameter cube;
    cube.name = "cube";
    cube.data = ctx.compute.zeros({2, 2, 2}, DType::kFloat32);
    EXPECT_EQ(errorOf([&] { gemmWeight(ctx.compute, cube, WeightFormat::kMxfp8, GemmUse::kFprop, DType::kFloat32); }),
              "gemmWeight: cube must be a matrix (N, K) for mxfp8, got fp32 (2, 2, 2)");
  });
}

// The layers check pad_for_alignment when they are built, before any weight is wrapped.
TEST(Mxfp8Layers, GtpNeedsPadForAlignmentOf32) {
  runRanks(4, [](RankContext& ctx) {
    GtpGradReducer reducer(ctx.compute, {});
    auto tp = ctx.comm.split(ctx.comm.rank(), 0, "tp");
    Generator gen(1);
    ModelParallelConfig config;
    config.useCpuInitialization = true;
    config.weightFormat = WeightFormat::kMxfp8;
    const LayerContext lc{ctx.compute, *tp, nullptr, &gen, &ctx.comm, nullptr, &reducer};
    for (int a : {16, 0, 48}) {
      config.gtpPadForAlignment = a;
      EXPECT_EQ(errorOf([&] { ColumnParallelLinear(lc, config, 64, 120, initMethodNormal(0.1)); }),
                "ColumnParallelLinear: pad_for_alignment (--pad-for-alignment) must be a positive multiple of 32 for "
                "mxfp8 weights under GTP_remat (size 4), got " + std::to_string(a) +
                "; each shard must hold whole 32-row MXFP8 blocks");
      EXPECT_THAT(errorOf([&] { RowParallelLinear(lc, config, 64, 120, initMethodNormal(0.1)); }),
                  HasSubstr("RowParallelLinear: pad_for_alignment (--pad-for-alignment) must be a positive multiple "
                            "of 32 for mxfp8 weights under GTP_remat (size 4), got " + std::to_string(a)));
    }
    // Without GTP_remat, or natively, any a is fine.
    config.gtpPadForAlignment = 16;
    ColumnParallelLinear({ctx.compute, *tp, nullptr, &gen}, config, 64, 120, initMethodNormal(0.1));
    config.weightFormat = WeightFormat::kNative;
    ColumnParallelLinear(lc, config, 64, 120, initMethodNormal(0.1));
    // The quantized bytes on the GTP_remat group can be gathered, never summed.
    Tensor q = ctx.compute.zeros({4}, DType::kFloat8E4M3);
    EXPECT_THAT(errorOf([&] { ctx.comm.allReduce(q)->wait(); }), HasSubstr("allReduce on world[0-3] (rank "));
    EXPECT_THAT(errorOf([&] { ctx.comm.allReduce(q)->wait(); }), HasSubstr("cannot reduce fp8e4m3 data"));
  });
}

// A weight whose two MXFP8 copies differ: every odd column is 2^-20 times smaller than its even
// neighbours, so rowwise blocks (along K) flush those elements to zero while columnwise blocks
// (along N) keep them to E4M3 precision. (Elsewhere the copies agree: E4M3 rounds to 3 mantissa
// bits whatever the power-of-two scale, unless an element falls to its subnormals.)
double stripes(std::int64_t i, std::int64_t j) {
  return 0.1 * (1.0 + double((i * 13 + j * 7) % 17) / 17.0) * (j % 2 ? std::ldexp(1.0, -20) : 1.0);
}

// dgrad multiplies by the columnwise copy: dX's odd columns tell the copies apart.
TEST(Mxfp8Layers, DgradUsesTheColumnwiseCopy) {
  const std::int64_t n = 96, k = 64, m = 8;  // G = 4, a = 32: S = 32, peer 3 holds only pad rows
  const auto f = stripes;
  const auto w = table(n, k, [&](std::int64_t i, std::int64_t j) { return double(float(f(i, j))); });
  const auto xv = table(m, k, [](std::int64_t i, std::int64_t j) { return double((i * 5 + j * 3) % 7) - 3.0; });
  const auto dyv = table(m, n, [](std::int64_t i, std::int64_t j) { return double((i * 3 + j) % 5) - 1.5; });
  for (int g : {1, 4})
    runRanks(g, [&](RankContext& ctx) {
      GtpGradReducer reducer(ctx.compute, {});
      auto tp = ctx.comm.split(ctx.comm.rank(), 0, "tp");
      Generator gen(1);
      ModelParallelConfig config;
      config.useCpuInitialization = true;
      config.gtpPadForAlignment = 32;
      config.weightFormat = WeightFormat::kMxfp8;
      ColumnParallelOptions o;
      o.bias = false;
      ColumnParallelLinear col({ctx.compute, *tp, nullptr, &gen, &ctx.comm, nullptr, &reducer}, config, k, n,
                               initFrom(k, f), o);
      if (g > 1) col.weight()->mainGrad = ctx.compute.zeros(col.weight()->data.shape(), DType::kFloat32);
      const Tensor x = tensorOf(ctx.compute, DType::kFloat32, xv, Shape{m, k});  // alive until backward
      Tensor y = col.forward(x).output;
      Tensor dx = col.backward(tensorOf(ctx.compute, DType::kFloat32, dyv, Shape{m, n}));
      reducer.drain();
      const auto yv = valuesOf(ctx.compute, y), dxv = valuesOf(ctx.compute, dx);
      const Product yRef = hostProduct(xv, hostMxfp8(w, n, k, 1), m, n, k, DType::kFloat32);
      // dX = dY·W = dY·(Wᵀ)ᵀ: the host product of dY (m, n) with Wᵀ (k, n).
      const Product dxCol = hostProduct(dyv, transposed(hostMxfp8(w, n, k, 0), n, k), m, k, n, DType::kFloat32);
      const Product dxRow = hostProduct(dyv, transposed(hostMxfp8(w, n, k, 1), n, k), m, k, n, DType::kFloat32);
      for (std::size_t i = 0; i < yv.size(); ++i) ASSERT_NEAR(yv[i], yRef.value[i], yRef.bound[i]) << "y " << i;
      int oddNonZero = 0;
      for (std::int64_t r = 0; r < m; ++r)
        for (std::int64_t c = 0; c < k; ++c) {
          const std::size_t i = std::size_t(r * k + c);
          ASSERT_NEAR(dxv[i], dxCol.value[i], dxCol.bound[i]) << "G " << g << " dX (" << r << ", " << c << ")";
          if (c % 2) {
            EXPECT_EQ(dxRow.value[i], 0.0) << "the rowwise copy flushed column " << c;
            oddNonZero += dxv[i] != 0.0;
          }
        }
      EXPECT_GT(oddNonZero, m * k / 4);
    });
}

// Everything a GTP-on run and the matching GTP-off run of one layer produce.
struct Outcome {
  std::vector<double> output, dInput, weightGrad;  // weightGrad: unsharded, pad rows included
};

// Runs a column or row layer with mxfp8 weights on T·G ranks with identical data on every GTP
// peer, CPU-initialized from one seed so the TP-local weights match the G = 1 run. Returns what
// TP rank 0, GTP rank 0 sees, with the weight gradient assembled from every peer's main_grad.
Outcome runLayer(bool column, int T, int G, DType dtype, bool frozen) {
  Outcome out;
  std::mutex mu;
  std::vector<std::vector<double>> shardGrads(G);
  ParallelSizes sizes;
  sizes.world = T * G;
  sizes.tp = T;
  sizes.gtpRemat = G;
  const ParallelLayout layout(sizes);
  runRanks(T * G, [&](RankContext& ctx) {
    ProcessGroups pg(ctx.comm, layout);
    GtpGradReducer reducer(ctx.compute, {});
    Generator gen(42);
    LayerContext lc{ctx.compute, pg.tp(), nullptr, &gen, &pg.gtpRemat(), &pg.dpCp(), &reducer};
    ModelParallelConfig config;
    config.tensorModelParallelSize = T;
    config.useCpuInitialization = true;
    config.paramsDtype = dtype;
    config.gtpPadForAlignment = 32;
    config.weightFormat = WeightFormat::kMxfp8;
    const std::int64_t s = 3, b = 2, k = 40, n = 72 * T;  // rowwise tail blocks of 8; N/T = 72: pad 56 at G = 4
    auto data = [&](std::int64_t count, int salt) {
      std::vector<double> v(count);
      for (std::int64_t i = 0; i < count; ++i) v[i] = double((i * 7 + salt) % 9) / 4.0 - 1.0;
      return v;
    };
    // Two elements 2^18 times larger than the rest push their blocks' other elements into E4M3's
    // subnormals, where the cut of the blocks matters.
    const InitMethod init = [](Generator& g, std::vector<float>& master) {
      initMethodNormal(0.5)(g, master);
      master[0] *= 262144.f;
      master[master.size() / 2 + 3] *= 262144.f;
    };
    std::optional<ColumnParallelLinear> col;
    std::optional<RowParallelLinear> row;
    Parameter* weight;
    if (column) {
      col.emplace(lc, config, k, n, init);
      weight = col->weight();
    } else {
      RowParallelOptions o;
      o.inputIsParallel = true;
      row.emplace(lc, config, k * T, n, init, o);
      weight = &row->weight();
    }
    weight->requiresGrad = !frozen;
    if (G > 1 && !frozen) weight->mainGrad = ctx.compute.zeros(weight->data.shape(), DType::kFloat32);
    const int t = pg.tp().rank();
    Tensor x = tensorOf(ctx.compute, dtype, data(s * b * k, t), Shape{s, b, k});
    Tensor y = column ? col->forward(x).output : row->forward(x).output;
    Tensor dy = tensorOf(ctx.compute, dtype, data(y.numel(), 3 + t), y.shape());
    Tensor dx = column ? col->backward(dy) : row->backward(dy);
    reducer.drain();
    if (t != 0) return;
    std::lock_guard<std::mutex> lock(mu);
    const int g = pg.gtpRemat().rank();
    if (!frozen) shardGrads[g] = valuesOf(ctx.compute, G > 1 ? ConstView(weight->mainGrad) : ConstView(weight->grad));
    if (g == 0) {
      out.output = valuesOf(ctx.compute, y);
      out.dInput = valuesOf(ctx.compute, dx);
    }
  });
  for (const auto& g : shardGrads) out.weightGrad.insert(out.weightGrad.end(), g.begin(), g.end());
  return out;
}

// GTP_remat stays transparent under mxfp8: shards quantized separately and gathered as fp8 give
// the same operands as the unsharded weight, so outputs and dgrads equal G = 1 bitwise and the
// main_grads (MEAN of identical peers) equal the G = 1 wgrad, pad rows zero.
TEST(Mxfp8Layers, GtpOnEqualsGtpOff) {
  for (bool column : {true, false})
    for (int T : {1, 2})
      for (DType dt : {DType::kFloat32, DType::kBFloat16})
        for (bool frozen : {false, true}) {
          SCOPED_TRACE(::testing::Message() << (column ? "column" : "row") << " T=" << T << " " << dtypeName(dt)
                                            << (frozen ? " frozen" : ""));
          const Outcome off = runLayer(column, T, 1, dt, frozen);
          const Outcome on = runLayer(column, T, 4, dt, frozen);
          ASSERT_FALSE(off.output.empty());
          EXPECT_EQ(on.output, off.output);
          EXPECT_EQ(on.dInput, off.dInput);
          ASSERT_GE(on.weightGrad.size(), off.weightGrad.size());
          for (std::size_t i = 0; i < on.weightGrad.size(); ++i)
            ASSERT_EQ(on.weightGrad[i], i < off.weightGrad.size() ? off.weightGrad[i] : 0.0)
                << "main_grad element " << i << (i >= off.weightGrad.size() ? " (a pad row)" : "");
        }
}

// The frozen path keeps the columnwise copy from its forward: backward issues no weight gather,
// and dX still reads Q_col(W).
TEST(Mxfp8Layers, FrozenWeightKeepsBothOperands) {
  WorldOptions options;
  options.size = 2;
  options.trace = true;
  sim::World world(options);
  world.run([](RankContext& ctx) {
    GtpGradReducer reducer(ctx.compute, {});
    Generator gen(7);
    ModelParallelConfig config;
    config.useCpuInitialization = true;
    config.gtpPadForAlignment = 32;
    config.weightFormat = WeightFormat::kMxfp8;
    auto single = ctx.comm.split(ctx.comm.rank(), 0, "tp");
    ColumnParallelOptions o;
    o.bias = false;
    ColumnParallelLinear col({ctx.compute, *single, nullptr, &gen, &ctx.comm, nullptr, &reducer}, config, 40, 50,
                             initFrom(40, stripes), o);
    col.weight()->requiresGrad = false;
    const Tensor x = tensorOf(ctx.compute, DType::kFloat32, table(1, 40, [](auto, auto j) { return j == 0; }),
                              Shape{1, 40});  // alive until backward
    Tensor y = col.forward(x).output;
    Tensor dx = col.backward(tensorOf(ctx.compute, DType::kFloat32, table(1, 50, [](auto, auto j) { return j == 0; }),
                                      Shape{1, 50}));
    // y = column 0 of deq(Q_row(W)); dX = row 0 of deq(Q_col(W)).
    const auto w = valuesOf(ctx.compute, materialize(ctx.compute, *col.weight()).weight);  // (50, 40)
    const auto rowQ = hostMxfp8(w, 50, 40, 1), colQ = hostMxfp8(w, 50, 40, 0);
    const auto yv = valuesOf(ctx.compute, y), dxv = valuesOf(ctx.compute, dx);
    for (int r = 0; r < 50; ++r) EXPECT_EQ(yv[r], rowQ[r * 40]) << "row " << r;
    for (int c = 0; c < 40; ++c) EXPECT_EQ(dxv[c], colQ[c]) << "column " << c;
    EXPECT_NE(rowQ, colQ);
  });
  // The forward gathered data and scales for both copies; the backward gathered nothing; the
  // check's own materialize is the last gather.
  std::vector<std::string> ops;
  for (const TraceEvent& e : world.trace()[0])
    if (e.op == "allGather") ops.push_back(e.op + ":" + e.dtype);
  EXPECT_EQ(ops, (std::vector<std::string>{"allGather:fp8e4m3", "allGather:e8m0", "allGather:fp8e4m3",
                                           "allGather:e8m0", "allGather:fp32"}));
}

}  // namespace
}  // namespace tpsim
