// The linear functions (SPEC 3.12-3.16, 3.20): the worked example, test facts L1-L6, sharded
// equals dense (invariant 1) with and without sequence parallelism, fusion into main_grad, the
// dummy gradient, wgrad deferral and its drain, and every rejected combination.
#include "core/linear.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <mutex>

#include "tests/sim_test_util.h"

namespace tpsim {
namespace {

using ::testing::HasSubstr;
using testing::errorOf;
using testing::runRanks;
using testing::tensorOf;
using testing::valuesOf;

// Row-major host matrix, double precision: the dense reference.
struct Mat {
  std::int64_t rows = 0, cols = 0;
  std::vector<double> v;
  double& at(std::int64_t r, std::int64_t c) { return v[r * cols + c]; }
  double at(std::int64_t r, std::int64_t c) const { return v[r * cols + c]; }
};

Mat filled(std::int64_t rows, std::int64_t cols, const std::function<double(std::int64_t, std::int64_t)>& f) {
  Mat m{rows, cols, std::vector<double>(rows * cols)};
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) m.at(r, c) = f(r, c);
  return m;
}

Mat matmul(const Mat& a, const Mat& b, bool transposeB) {  // a·b or a·bᵀ
  const std::int64_t n = transposeB ? b.rows : b.cols, k = a.cols;
  return filled(a.rows, n, [&](std::int64_t i, std::int64_t j) {
    double s = 0;
    for (std::int64_t p = 0; p < k; ++p) s += a.at(i, p) * (transposeB ? b.at(j, p) : b.at(p, j));
    return s;
  });
}

Mat rowsOf(const Mat& m, std::int64_t begin, std::int64_t end) {
  return filled(end - begin, m.cols, [&](std::int64_t r, std::int64_t c) { return m.at(begin + r, c); });
}

Parameter param(Compute& compute, const std::string& name, DType dtype, const Mat& m) {
  Parameter p;
  p.name = name;
  p.data = tensorOf(compute, dtype, m.v, m.rows == 1 && name.find("bias") != std::string::npos
                                             ? Shape{m.cols}
                                             : Shape{m.rows, m.cols});
  return p;
}

TEST(LinearForward, KeepsTheInputDtypeAndMatchesAPlainLinear) {  // L4
  runRanks(1, [](RankContext& ctx) {
    const Mat x = filled(12, 16, [](auto r, auto c) { return double((r * 3 + c) % 7) - 3; });
    const Mat w = filled(32, 16, [](auto r, auto c) { return double((r + 2 * c) % 5) - 2; });
    const Mat b = filled(1, 32, [](auto, auto c) { return double(c % 3); });
    const Mat ref = matmul(x, w, true);
    for (DType dt : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
      Tensor xt = tensorOf(ctx.compute, dt, x.v, Shape{4, 3, 16});
      Tensor wt = tensorOf(ctx.compute, dt, w.v, Shape{32, 16});
      Tensor bt = tensorOf(ctx.compute, dt, b.v, Shape{32});
      Tensor y = linearForward(ctx.compute, xt, wt, bt);
      EXPECT_EQ(y.dtype(), dt);
      EXPECT_EQ(y.shape(), Shape({4, 3, 32}));
      auto got = valuesOf(ctx.compute, y);
      for (std::int64_t i = 0; i < 12 * 32; ++i)  // small integers: exact in every dtype
        ASSERT_EQ(got[i], ref.v[i] + b.v[i % 32]) << dtypeName(dt) << " mismatch at index " << i;
    }
  });
}

TEST(LinearForward, Bf16OperandsWithFp32OutputAreBitExactOnIntegers) {  // L5, L6
  runRanks(1, [](RankContext& ctx) {
    const Mat x = filled(8, 512, [](auto r, auto c) { return double((r * 7 + c * 3) % 17) - 8; });
    const Mat w = filled(16, 512, [](auto r, auto c) { return double((r * 5 + c) % 17) - 8; });
    Tensor xt = tensorOf(ctx.compute, DType::kBFloat16, x.v, Shape{8, 512});
    Tensor wt = tensorOf(ctx.compute, DType::kBFloat16, w.v, Shape{16, 512});
    Tensor y = linearForward(ctx.compute, xt, wt, ConstView(), DType::kFloat32);
    EXPECT_EQ(y.dtype(), DType::kFloat32);
    const Mat ref = matmul(x, w, true);
    auto got = valuesOf(ctx.compute, y);
    for (std::size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], ref.v[i]) << "mismatch at index " << i;
    // Backward dtypes: dX and dW in the input dtype regardless of output_dtype (invariant 17).
    Parameter weight;
    weight.name = "weight";
    weight.data = tensorOf(ctx.compute, DType::kBFloat16, w.v, Shape{16, 512});
    LinearOptions o;
    o.outputDtype = DType::kFloat32;
    LinearWithGradAccumulation linear(ctx.compute, ctx.comm, o);
    Tensor y2 = linear.forward(xt, weight, nullptr);
    Tensor dY = ctx.compute.zeros({8, 16}, DType::kFloat32);
    ctx.compute.fill(dY, 1.0);
    LinearGrads g = linear.backward(dY);
    EXPECT_EQ(g.dX.dtype(), DType::kBFloat16);
    EXPECT_EQ(g.dW.dtype(), DType::kBFloat16);
  });
}

TEST(LinearForward, NarrowerOutputDtypeWithoutBiasRoundsOnce) {
  runRanks(1, [](RankContext& ctx) {
    // fp32 operands, fp16 or bf16 output: the GEMM accumulates in fp32 and rounds once.
    Tensor x = tensorOf(ctx.compute, DType::kFloat32, {0.1, 0.2, 0.3, 0.4}, Shape{1, 4});
    Tensor w = tensorOf(ctx.compute, DType::kFloat32, {1, 1, 1, 1, 1, -1, 1, -1}, Shape{2, 4});
    for (DType out : {DType::kFloat16, DType::kBFloat16}) {
      Tensor y = linearForward(ctx.compute, x, w, ConstView(), out);
      EXPECT_EQ(y.dtype(), out);
      const auto v = valuesOf(ctx.compute, y);
      const float sum = 0.1f + 0.2f + 0.3f + 0.4f, alt = 0.1f - 0.2f + 0.3f - 0.4f;
      EXPECT_EQ(v[0], double(roundTo(out, sum)));
      EXPECT_EQ(v[1], double(roundTo(out, alt)));
    }
    Tensor h = tensorOf(ctx.compute, DType::kFloat16, {1, 2, 3, 4}, Shape{1, 4});
    Tensor wh = tensorOf(ctx.compute, DType::kFloat16, {1, 1, 1, 1}, Shape{1, 4});
    EXPECT_EQ(valuesOf(ctx.compute, linearForward(ctx.compute, h, wh, ConstView(), DType::kBFloat16)),
              std::vector<double>{10.0});
  });
}

TEST(LinearWithGradAccumulation, SpecWorkedExample) {  // 3.14 worked example, T = 2
  runRanks(2, [](RankContext& ctx) {
    const int t = ctx.comm.rank();
    const Mat full{4, 2, {1, 0, 0, 1, 1, 1, 2, 0}};
    Parameter w = param(ctx.compute, "weight", DType::kFloat32, rowsOf(full, 2 * t, 2 * t + 2));
    Tensor x = tensorOf(ctx.compute, DType::kFloat32, {1, 2}, Shape{1, 2});
    LinearOptions o;
    o.allreduceDgrad = true;
    LinearWithGradAccumulation linear(ctx.compute, ctx.comm, o);
    Tensor y = linear.forward(x, w, nullptr);
    EXPECT_EQ(valuesOf(ctx.compute, y), t == 0 ? (std::vector<double>{1, 2}) : (std::vector<double>{3, 2}));
    Tensor dY = tensorOf(ctx.compute, DType::kFloat32, {1, 1}, Shape{1, 2});
    LinearGrads g = linear.backward(dY);
    EXPECT_EQ(valuesOf(ctx.compute, g.dX), (std::vector<double>{4, 2}));
    EXPECT_EQ(valuesOf(ctx.compute, g.dW), (std::vector<double>{1, 2, 1, 2}));
  });
}

// Column-style use on T ranks: each rank owns rows [t·N/T, (t+1)·N/T) of W. Checks invariant 1.
void checkColumnEquivalence(int T, bool sp, DType dt) {
  const std::int64_t s = 2 * T, b = 3, k = 8, n = 4 * T;
  const Mat x = filled(s * b, k, [](auto r, auto c) { return double((r * 5 + c * 3) % 7) - 3; });  // (s·b, K)
  const Mat w = filled(n, k, [](auto r, auto c) { return double((r * 3 + c) % 5) - 2; });
  const Mat bias = filled(1, n, [](auto, auto c) { return double(c % 4); });
  const Mat dy = filled(s * b, n, [](auto r, auto c) { return double((r + 2 * c) % 3) - 1; });
  const Mat y = matmul(x, w, true), dx = matmul(dy, w, false);
  Mat dyT = filled(n, s * b, [&](auto r, auto c) { return dy.at(c, r); });
  const Mat dw = matmul(dyT, x, false);
  const std::int64_t nl = n / T, rowsPerRank = s / T * b;
  runRanks(T, [&](RankContext& ctx) {
    const int t = ctx.comm.rank();
    Parameter weight = param(ctx.compute, "weight", dt, rowsOf(w, t * nl, (t + 1) * nl));
    Parameter bp;
    bp.name = "bias";
    std::vector<double> bl(bias.v.begin() + t * nl, bias.v.begin() + (t + 1) * nl);
    bp.data = tensorOf(ctx.compute, dt, bl, Shape{nl});
    LinearOptions o;
    o.sequenceParallel = sp;
    o.allreduceDgrad = !sp && T > 1;
    LinearWithGradAccumulation linear(ctx.compute, ctx.comm, o);
    // SP: this rank holds sequence rows [t·s/T, (t+1)·s/T), i.e. flat rows [t·rowsPerRank, ...).
    Mat xl = sp ? rowsOf(x, t * rowsPerRank, (t + 1) * rowsPerRank) : x;
    Tensor xt = tensorOf(ctx.compute, dt, xl.v, Shape{sp ? s / T : s, b, k});
    Tensor out = linear.forward(xt, weight, &bp);
    ASSERT_EQ(out.shape(), Shape({s, b, nl}));
    auto got = valuesOf(ctx.compute, out);
    for (std::int64_t m = 0; m < s * b; ++m)
      for (std::int64_t j = 0; j < nl; ++j)
        ASSERT_EQ(got[m * nl + j], y.at(m, t * nl + j) + bias.v[t * nl + j]) << "forward row " << m << " col " << j;
    Mat dyl = filled(s * b, nl, [&](auto r, auto c) { return dy.at(r, t * nl + c); });
    Tensor dyt = tensorOf(ctx.compute, dt, dyl.v, Shape{s, b, nl});
    LinearGrads g = linear.backward(dyt);
    const Mat dxExpect = sp ? rowsOf(dx, t * rowsPerRank, (t + 1) * rowsPerRank) : dx;
    EXPECT_EQ(g.dX.shape(), xt.shape());
    EXPECT_EQ(valuesOf(ctx.compute, g.dX), dxExpect.v) << "dgrad";
    EXPECT_EQ(valuesOf(ctx.compute, g.dW), rowsOf(dw, t * nl, (t + 1) * nl).v) << "wgrad";
    std::vector<double> db(nl, 0);
    for (std::int64_t m = 0; m < s * b; ++m)
      for (std::int64_t j = 0; j < nl; ++j) db[j] += dyl.at(m, j);
    EXPECT_EQ(valuesOf(ctx.compute, g.db), db) << "bias grad";
  });
}

TEST(LinearWithGradAccumulation, ColumnShardsEqualTheDenseLinear) {
  for (int T : {1, 2, 3, 4})
    for (bool sp : {false, true})
      for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
        SCOPED_TRACE(::testing::Message() << "T=" << T << " sp=" << sp << " " << dtypeName(dt));
        checkColumnEquivalence(T, sp, dt);
      }
}

TEST(LinearWithGradAccumulation, FusionAccumulatesIntoMainGradAcrossMicroBatches) {  // invariant 15, 16
  runRanks(2, [](RankContext& ctx) {
    const Mat w = filled(4, 6, [](auto r, auto c) { return double(r - c); });
    for (bool zeroOut : {false, true}) {
      Parameter weight = param(ctx.compute, "weight", DType::kBFloat16, w);
      weight.mainGrad = ctx.compute.zeros({4, 6}, DType::kFloat32);
      weight.attrs.gradAddedToMainGrad = false;
      weight.attrs.zeroOutWgrad = zeroOut;
      LinearOptions o;
      o.gradientAccumulationFusion = true;
      o.allreduceDgrad = true;
      Mat expect = filled(4, 6, [](auto, auto) { return 0.0; });
      for (int mb = 0; mb < 3; ++mb) {
        const Mat x = filled(5, 6, [&](auto r, auto c) { return double((r + c + mb) % 4); });
        const Mat dy = filled(5, 4, [&](auto r, auto c) { return double((r * c + mb) % 3) - 1; });
        LinearWithGradAccumulation linear(ctx.compute, ctx.comm, o);
        Tensor xt = tensorOf(ctx.compute, DType::kBFloat16, x.v, Shape{5, 6});
        linear.forward(xt, weight, nullptr);
        LinearGrads g = linear.backward(tensorOf(ctx.compute, DType::kBFloat16, dy.v, Shape{5, 4}));
        ASSERT_TRUE(g.dWIsDummy);
        EXPECT_EQ(g.dW.shape(), Shape({4, 6}));
        EXPECT_EQ(g.dW.dtype(), DType::kBFloat16);
        if (zeroOut) {
          EXPECT_EQ(valuesOf(ctx.compute, g.dW), std::vector<double>(24, 0.0));
        }
        EXPECT_EQ(weight.attrs.gradAddedToMainGrad, std::optional<bool>(true));
        Mat dyT = filled(4, 5, [&](auto r, auto c) { return dy.at(c, r); });
        const Mat term = matmul(dyT, x, false);
        for (std::size_t i = 0; i < expect.v.size(); ++i) expect.v[i] += term.v[i];
      }
      EXPECT_EQ(valuesOf(ctx.compute, weight.mainGrad), expect.v);
    }
    // Without the attribute the returned weight gradient is None.
    Parameter weight = param(ctx.compute, "weight", DType::kFloat32, w);
    weight.mainGrad = ctx.compute.zeros({4, 6}, DType::kFloat32);
    LinearOptions o;
    o.gradientAccumulationFusion = true;
    LinearWithGradAccumulation linear(ctx.compute, ctx.comm, o);
    Tensor xt = ctx.compute.zeros({2, 6}, DType::kFloat32);
    linear.forward(xt, weight, nullptr);
    EXPECT_FALSE(linear.backward(ctx.compute.zeros({2, 4}, DType::kFloat32)).dW.defined());
  });
}

// Deferred wgrads plus the drain equal immediate fused accumulation (invariant 14), m = 1 included.
TEST(WgradDeferral, DrainEqualsImmediateFusion) {
  for (bool sp : {false, true})
    for (int limit : {0, 1, 2})
      for (int microBatches : {1, 3}) {
        SCOPED_TRACE(::testing::Message() << "sp=" << sp << " limit=" << limit << " m=" << microBatches);
        runRanks(2, [&](RankContext& ctx) {
          const int t = ctx.comm.rank();
          const Mat w = filled(3, 4, [&](auto r, auto c) { return double(r + c + t); });
          auto run = [&](bool defer) {
            Parameter weight = param(ctx.compute, "weight", DType::kFloat32, w);
            weight.mainGrad = ctx.compute.zeros({3, 4}, DType::kFloat32);
            std::vector<Tensor> activations, gradOutputs;
            LinearOptions o;
            o.gradientAccumulationFusion = true;
            o.sequenceParallel = sp;
            o.allreduceDgrad = !sp;
            if (defer) {
              o.gradOutputBuffer = &gradOutputs;
              o.wgradDeferralLimit = limit;
            }
            for (int mb = 0; mb < microBatches; ++mb) {
              const Mat x = filled(2 * 2, 4, [&](auto r, auto c) { return double((r + c * t + mb) % 5); });
              Tensor xt = tensorOf(ctx.compute, DType::kFloat32, x.v, Shape{2, 2, 4});  // (s/T, b, K)
              if (defer && (limit == 0 || int(activations.size()) < limit)) {
                activations.push_back(ctx.compute.empty(xt.shape(), xt.dtype()));
                ctx.compute.copy(xt, activations.back());
              }
              LinearWithGradAccumulation linear(ctx.compute, ctx.comm, o);
              Tensor y = linear.forward(xt, weight, nullptr);
              Tensor dy = ctx.compute.empty(y.shape(), y.dtype());
              ctx.compute.fill(dy, double(mb + 1));
              linear.backward(dy);
            }
            drainEmbeddingWgrad(ctx.compute, ctx.comm, sp, activations, gradOutputs, weight);
            EXPECT_TRUE(activations.empty() && gradOutputs.empty());
            return valuesOf(ctx.compute, weight.mainGrad);
          };
          EXPECT_EQ(run(true), run(false));
        });
      }
}

TEST(LinearWithFrozenWeight, TestFactsL1L2L3) {
  runRanks(1, [](RankContext& ctx) {  // L1: X = I8, W = ones, b = 0
    const Mat eye = filled(8, 8, [](auto r, auto c) { return double(r == c); });
    Parameter w = param(ctx.compute, "weight", DType::kFloat32, filled(8, 8, [](auto, auto) { return 1.0; }));
    Parameter b;
    b.data = ctx.compute.zeros({8}, DType::kFloat32);
    LinearWithFrozenWeight linear(ctx.compute, ctx.comm, {});
    Tensor x = tensorOf(ctx.compute, DType::kFloat32, eye.v, Shape{8, 8});
    EXPECT_EQ(valuesOf(ctx.compute, linear.forward(x, w, &b)), std::vector<double>(64, 1.0));
    Tensor dy = ctx.compute.zeros({8, 8}, DType::kFloat32);
    ctx.compute.fill(dy, 1.0);
    LinearGrads g = linear.backward(dy);
    EXPECT_EQ(valuesOf(ctx.compute, g.dX), std::vector<double>(64, 8.0));
    EXPECT_FALSE(g.dW.defined());
    EXPECT_EQ(valuesOf(ctx.compute, g.db), std::vector<double>(8, 8.0));  // computed, unlike Megatron
  });
  runRanks(8, [](RankContext& ctx) {  // L2: T = 8, allreduce_dgrad
    Parameter w = param(ctx.compute, "weight", DType::kFloat32, filled(1, 8, [](auto, auto) { return 1.0; }));
    LinearOptions o;
    o.allreduceDgrad = true;
    LinearWithFrozenWeight linear(ctx.compute, ctx.comm, o);
    Tensor x = tensorOf(ctx.compute, DType::kFloat32, filled(8, 8, [](auto r, auto c) { return double(r == c); }).v,
                        Shape{8, 8});
    EXPECT_EQ(valuesOf(ctx.compute, linear.forward(x, w, nullptr)), std::vector<double>(8, 1.0));
    Tensor dy = ctx.compute.zeros({8, 1}, DType::kFloat32);
    ctx.compute.fill(dy, 1.0);
    EXPECT_EQ(valuesOf(ctx.compute, linear.backward(dy).dX), std::vector<double>(64, 8.0));
  });
  runRanks(1, [](RankContext& ctx) {  // L3: 3-D input
    const Mat x = filled(12, 8, [](auto r, auto c) { return double((r + c) % 5) - 2; });
    const Mat w = filled(6, 8, [](auto r, auto c) { return double((r * c) % 3) - 1; });
    Parameter wp = param(ctx.compute, "weight", DType::kFloat32, w);
    Parameter b;
    b.data = tensorOf(ctx.compute, DType::kFloat32, {1, 2, 3, 4, 5, 6});
    LinearWithFrozenWeight linear(ctx.compute, ctx.comm, {});
    Tensor xt = tensorOf(ctx.compute, DType::kFloat32, x.v, Shape{4, 3, 8});
    Tensor y = linear.forward(xt, wp, &b);
    const Mat ref = matmul(x, w, true);
    auto got = valuesOf(ctx.compute, y);
    for (std::size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], ref.v[i] + double(i % 6 + 1)) << "index " << i;
    Tensor dy = tensorOf(ctx.compute, DType::kFloat32, filled(12, 6, [](auto r, auto c) { return double(r - c); }).v,
                         Shape{4, 3, 6});
    const Mat dx = matmul(filled(12, 6, [](auto r, auto c) { return double(r - c); }), w, false);
    LinearGrads g = linear.backward(dy);
    EXPECT_EQ(g.dX.shape(), Shape({4, 3, 8}));
    EXPECT_EQ(valuesOf(ctx.compute, g.dX), dx.v);
  });
}

TEST(Linear, RejectedCombinationsNameTheProblem) {
  runRanks(2, [](RankContext& ctx) {
    LinearOptions both;
    both.sequenceParallel = both.allreduceDgrad = true;
    EXPECT_THAT(errorOf([&] { LinearWithGradAccumulation(ctx.compute, ctx.comm, both); }),
                HasSubstr("sequence_parallel and allreduce_dgrad are mutually exclusive"));
    EXPECT_THAT(errorOf([&] { LinearWithFrozenWeight(ctx.compute, ctx.comm, both); }),
                HasSubstr("would reduce dX twice"));
    std::vector<Tensor> buffer;
    LinearOptions deferNoFusion;
    deferNoFusion.gradOutputBuffer = &buffer;
    EXPECT_THAT(errorOf([&] { LinearWithGradAccumulation(ctx.compute, ctx.comm, deferNoFusion); }),
                HasSubstr("wgrad deferral (grad_output_buffer) needs gradient accumulation fusion"));
    Parameter w;
    w.name = "fc1.weight";
    w.data = ctx.compute.zeros({4, 3}, DType::kFloat32);
    LinearOptions fusion;
    fusion.gradientAccumulationFusion = true;
    Tensor x = ctx.compute.zeros({2, 3}, DType::kFloat32);
    EXPECT_THAT(errorOf([&] { LinearWithGradAccumulation(ctx.compute, ctx.comm, fusion).forward(x, w, nullptr); }),
                HasSubstr("needs fc1.weight.main_grad allocated before forward"));
    w.mainGrad = ctx.compute.zeros({4, 3}, DType::kFloat64);
    EXPECT_THAT(errorOf([&] {
                  LinearWithGradAccumulation l(ctx.compute, ctx.comm, fusion);
                  l.forward(x, w, nullptr);
                  l.backward(ctx.compute.zeros({2, 4}, DType::kFloat32));
                }),
                HasSubstr("unsupported gradient type for gradient accumulation fusion"));
    Tensor badX = ctx.compute.zeros({2, 5}, DType::kFloat32);
    EXPECT_THAT(errorOf([&] { linearForward(ctx.compute, badX, w.data, ConstView()); }),
                HasSubstr("linearForward: weight must be (N, K=5), got fp32 (4, 3)"));
    LinearWithGradAccumulation plain(ctx.compute, ctx.comm, {});
    plain.forward(x, w, nullptr);
    EXPECT_THAT(errorOf([&] { plain.backward(ctx.compute.zeros({2, 5}, DType::kFloat32)); }),
                HasSubstr("grad_output must be (2, 4) like the forward output, got fp32 (2, 5)"));
  });
}

}  // namespace
}  // namespace tpsim
