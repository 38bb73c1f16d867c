#include "tools/reference.h"

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <future>
#include <tuple>
#include <utility>

#include "backends/errors.h"

namespace tpsim::tools {
namespace {

// The products are Eigen's, in double, so the reference runs at BLAS-like speed. Its own rounding
// (about K·2^-53 relative, whatever order Eigen sums in) stays far below the bounds' fp32 terms.
using Matrix = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using MatrixView = Eigen::Map<const Matrix>;

// Row-major matrix of a HostTensor's values: (rows, cols) with cols = the last dim.
struct Mat {
  std::int64_t rows = 0, cols = 0;
  std::vector<double> v;
  operator MatrixView() const { return {v.data(), rows, cols}; }  // products read a Mat in place
};

// A tensor's values as a matrix, in place: (numel / last dim, last dim).
MatrixView viewOf(const HostTensor& t) {
  const std::int64_t cols = t.shape.back();
  return {t.values.data(), t.numel() / cols, cols};
}

// `e` evaluated into m, with no temporary even for a product. m's storage is reused when it has the
// size: a fresh large buffer page-faults all over again.
template <class Expr>
const Mat& evaluateInto(Mat& m, const Eigen::MatrixBase<Expr>& e) {
  m.rows = e.rows();
  m.cols = e.cols();
  m.v.resize(std::size_t(m.rows * m.cols));
  Eigen::Map<Matrix>(m.v.data(), m.rows, m.cols).noalias() = e;
  return m;
}

template <class Expr>
Mat evaluate(const Eigen::MatrixBase<Expr>& e) {
  Mat m;
  evaluateInto(m, e);
  return m;
}

Mat asMat(const HostTensor& t) { return evaluate(viewOf(t)); }

Mat absMat(MatrixView m) { return evaluate(m.cwiseAbs()); }

// a·bᵀ (+ bias). a: (M, K)  b: (N, K)  -> (M, N)
Mat linear(MatrixView a, MatrixView b, const std::vector<double>* bias) {
  Mat out = evaluate(a * b.transpose());
  if (bias)
    Eigen::Map<Matrix>(out.v.data(), out.rows, out.cols).rowwise() +=
        Eigen::Map<const Eigen::RowVectorXd>(bias->data(), b.rows());
  return out;
}

// a·b. a: (M, N)  b: (N, K)  -> (M, K)
Mat matmul(MatrixView a, MatrixView b) { return evaluate(a * b); }

// aᵀ·b. a: (M, N)  b: (M, K)  -> (N, K)
Mat transposeMatmul(MatrixView a, MatrixView b) { return evaluate(a.transpose() * b); }

std::vector<double> columnSums(MatrixView m) { return evaluate(m.colwise().sum()).v; }

// Whether products of `flops` each pay for a second thread: the property suite computes thousands
// of tiny references, `tpsim run` a few large ones.
bool worthAThread(double flops) { return flops >= 1e7; }

// f() here and g() on a second thread when `threaded`: a result's value and magnitude (or two
// elementwise maps of one matrix) are independent, and a machine has cores to spare.
template <class F, class G>
auto both(bool threaded, F f, G g) {
  if (!threaded) {
    auto first = f();
    return std::pair(std::move(first), g());
  }
  auto second = std::async(std::launch::async, g);
  auto first = f();
  return std::pair(std::move(first), second.get());
}

double unitRoundoff(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16: return std::ldexp(1.0, -8);
    case DType::kFloat16: return std::ldexp(1.0, -11);
    case DType::kFloat64: return std::ldexp(1.0, -53);
    default: return std::ldexp(1.0, -24);
  }
}

// The relative part of a result's bound: length · u_acc + stages · u_store.
double relativeBound(double uAcc, std::int64_t length, int stages, DType storeDtype) {
  return double(length + 2) * uAcc + double(stages) * unitRoundoff(storeDtype);
}

// A dense result and its bound: (length · u_acc + stages · u_store) · magnitude. The gradual
// underflow allowance is added once per reference (denseReference).
Checked checked(double uAcc, std::vector<std::int64_t> shape, DType dtype, Mat value, Mat magnitude,
                std::int64_t length, int stages, DType storeDtype) {
  const double rel = relativeBound(uAcc, length, stages, storeDtype);
  for (double& m : magnitude.v) m *= rel;
  return {HostTensor{std::move(shape), dtype, std::move(value.v)}, std::move(magnitude.v)};
}

// The rows (or columns) of a dim of `total` that TP rank t owns: chunks t, t + T, ... of
// total/(T·stride), in order (SPEC 3.11).
std::vector<std::int64_t> ownedIndices(std::int64_t total, int tp, int stride, int t) {
  const std::int64_t chunk = total / (std::int64_t(tp) * stride);
  std::vector<std::int64_t> owned;
  for (int j = 0; j < stride; ++j)
    for (std::int64_t i = 0; i < chunk; ++i) owned.push_back((t + std::int64_t(j) * tp) * chunk + i);
  return owned;
}

// Half the smallest subnormal: the absolute error of one rounding near zero.
double halfSubnormal(DType dtype) {
  switch (dtype) {
    case DType::kFloat16: return std::ldexp(1.0, -25);
    case DType::kBFloat16: return std::ldexp(1.0, -134);
    case DType::kFloat64: return std::ldexp(1.0, -1075);
    default: return std::ldexp(1.0, -150);
  }
}

// Gradual underflow, which a relative bound misses: each rounding near zero errs by up to half the
// smallest subnormal δ, at most T + 3 times per path (the GEMM, the MLP's two extra stages, the T
// partial sums), and a later GEMM multiplies an intermediate's error by at most the ℓ1 norm S of
// its other operand (1.13·S through GeLU'). Hence (T + 3)·δ·(1 + 1.13·S), with S the largest ℓ1
// norm of an input: nothing for fp32 and bf16, a few ulps of fp16's subnormals.
double underflowAllowance(const ReferenceOptions& o, const TensorMap& inputs) {
  const double delta = std::max(halfSubnormal(o.computeDtype), halfSubnormal(o.outputDtype));
  double l1 = 0;
  for (const auto& [name, t] : inputs) {
    if (t.dtype == DType::kInt64) continue;
    double sum = 0;
    for (double v : t.values) sum += std::fabs(v);
    l1 = std::max(l1, sum);
  }
  return (o.tp + 3) * delta * (1 + 1.13 * l1);
}

std::vector<std::int64_t> withLast(std::vector<std::int64_t> shape, std::int64_t n) {
  shape.back() = n;
  return shape;
}

const HostTensor& need(const TensorMap& m, const std::string& name) {
  auto it = m.find(name);
  TPSIM_INTERNAL_ASSERT(it != m.end(), "reference input ", name, " missing");
  return it->second;
}

// m (rows, cols) row-major replaced by deq(Q(m)), blocks of 32 along `axis`; a NaN makes its
// block NaN.
void fakeQuantize(std::vector<double>& m, std::int64_t rows, std::int64_t cols, int axis) {
  const std::int64_t along = axis == 1 ? cols : rows, across = axis == 1 ? rows : cols;
  auto at = [&](std::int64_t a, std::int64_t k) -> double& {
    return m[std::size_t(axis == 1 ? a * cols + k : k * cols + a)];
  };
  for (std::int64_t a = 0; a < across; ++a)
    for (std::int64_t first = 0; first < along; first += 32) {
      const std::int64_t last = std::min(along, first + 32);
      double amax = 0;
      bool nan = false;
      for (std::int64_t k = first; k < last; ++k) {
        nan = nan || std::isnan(at(a, k));
        amax = std::max(amax, std::fabs(at(a, k)));
      }
      const double scale = std::ldexp(1.0, mxfp8ScaleExponent(amax));
      for (std::int64_t k = first; k < last; ++k)
        at(a, k) = nan ? std::nan("") : double(e4m3ToFloat(toE4m3(at(a, k) / scale))) * scale;
    }
}

// The weight a linear's GEMM multiplies by for `axis` (1: fprop, 0: dgrad): w itself, or its MXFP8
// copy, made in `quantized`.
const HostTensor& gemmOperand(const ReferenceOptions& o, const HostTensor& w, int axis, int splitDim,
                              HostTensor& quantized) {
  if (o.weightFormat == WeightFormat::kNative) return w;
  quantized = mxfp8Weight(w, axis, splitDim, o.tp, o.stride, o.computeDtype);
  return quantized;
}

// One linear layer y = x·Wᵀ + b and its gradients, written into `out` under `prefix`. wFprop and
// wDgrad are the weight as the forward and the dgrad GEMM read it (W itself unless quantized).
void linearLayer(const ReferenceOptions& o, const HostTensor& x, const HostTensor& wFprop, const HostTensor& wDgrad,
                 const HostTensor* b, const HostTensor& dy, const std::string& prefix,
                 std::map<std::string, Checked>& out, int extraStages) {
  const MatrixView X = viewOf(x), W = viewOf(wFprop), Wd = viewOf(wDgrad), dY = viewOf(dy);
  const Mat aX = absMat(X), aW = absMat(W), aWd = absMat(Wd), adY = absMat(dY);
  const std::vector<double>* bias = b ? &b->values : nullptr;
  const std::vector<double> absBias = b ? absMat(viewOf(*b)).v : std::vector<double>{};
  const DType c = o.computeDtype;
  const int reduceStages = o.tp;  // partial sums rounded once each, then added in rank order
  const bool threaded = worthAThread(2.0 * double(X.rows()) * double(X.cols()) * double(W.rows()));
  auto [y, ay] =
      both(threaded, [&] { return linear(X, W, bias); }, [&] { return linear(aX, aW, b ? &absBias : nullptr); });
  out[prefix + "output"] = checked(o.accumulationUnit, withLast(x.shape, W.rows()), o.outputDtype, std::move(y),
                                   std::move(ay), X.cols(), 1 + extraStages + reduceStages, o.outputDtype);
  auto [dx, adx] = both(threaded, [&] { return matmul(dY, Wd); }, [&] { return matmul(adY, aWd); });
  out[prefix + "input.grad"] = checked(o.accumulationUnit, x.shape, c, std::move(dx), std::move(adx), W.rows(),
                                       1 + extraStages + reduceStages, c);
  auto [dw, adw] = both(threaded, [&] { return transposeMatmul(dY, X); }, [&] { return transposeMatmul(adY, aX); });
  out[prefix + "weight.grad"] = checked(o.accumulationUnit, wFprop.shape, c, std::move(dw), std::move(adw), X.rows(),
                                        1 + extraStages, c);
  if (b) {
    Mat db{1, dY.cols(), columnSums(dY)}, adb{1, dY.cols(), columnSums(adY)};
    out[prefix + "bias.grad"] = checked(o.accumulationUnit, b->shape, c, std::move(db), std::move(adb), dY.rows(),
                                        1 + extraStages + reduceStages, c);
  }
}

// A column layer's input gradient under disable_grad_reduce: for each TP rank t, dY over its
// output rows times those rows of W, one GEMM rounded once, stacked (T, …, K).
Checked partialDgrads(const ReferenceOptions& o, const HostTensor& x, const HostTensor& wDgrad, const HostTensor& dy) {
  const MatrixView W = viewOf(wDgrad), dY = viewOf(dy);
  std::vector<std::int64_t> shape = x.shape;
  shape.insert(shape.begin(), o.tp);
  Checked all{HostTensor{shape, o.computeDtype, {}}, {}};
  for (int t = 0; t < o.tp; ++t) {
    const std::vector<std::int64_t> rows = ownedIndices(W.rows(), o.tp, o.stride, t);
    const Eigen::Map<const Eigen::Array<std::int64_t, Eigen::Dynamic, 1>> owned(rows.data(), std::int64_t(rows.size()));
    const Mat dYt = evaluate(dY(Eigen::all, owned)), Wt = evaluate(W(owned, Eigen::all));
    const std::int64_t n = std::int64_t(rows.size());
    const Checked part = checked(o.accumulationUnit, x.shape, o.computeDtype, matmul(dYt, Wt),
                                 matmul(absMat(dYt), absMat(Wt)), n, 1, o.computeDtype);
    all.value.values.insert(all.value.values.end(), part.value.values.begin(), part.value.values.end());
    all.bound.insert(all.bound.end(), part.bound.begin(), part.bound.end());
  }
  return all;
}

}  // namespace

// The dense results and their relative bounds; denseReference adds the underflow allowance.
static std::map<std::string, Checked> denseValues(const ReferenceOptions& o, const TensorMap& in);

const char* layerName(LayerKind kind) {
  switch (kind) {
    case LayerKind::kColumn: return "column";
    case LayerKind::kRow: return "row";
    case LayerKind::kEmbedding: return "embedding";
    case LayerKind::kMlp: return "mlp";
  }
  return "unknown";
}

double gelu(double x) { return 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0))); }

double geluGrad(double x) {
  return 0.5 * (1.0 + std::erf(x / std::sqrt(2.0))) + x * std::exp(-0.5 * x * x) / std::sqrt(2.0 * M_PI);
}

std::map<std::string, Checked> denseReference(const ReferenceOptions& o, const TensorMap& in) {
  std::map<std::string, Checked> out = denseValues(o, in);
  const double underflow = underflowAllowance(o, in);
  // The GTP_remat reduce-scatter's roundings: each at most u(wire)·magnitude, and the bound holds at
  // least u(compute)·magnitude (its storage rounding), so they fit in a factor; plus their underflow.
  const bool gtp = o.gtpRemat > 1;
  const double gtpFactor = gtp ? 1.0 + o.gtpRemat * unitRoundoff(o.gtpWireDtype) / unitRoundoff(o.computeDtype) : 1.0;
  const double gtpUnderflow = gtp ? o.gtpRemat * halfSubnormal(o.gtpWireDtype) : 0.0;
  for (auto& [name, c] : out) {
    const bool gtpWeight = gtp && name.find("weight.grad") != std::string::npos;
    for (double& b : c.bound) b = (gtpWeight ? b * gtpFactor + gtpUnderflow : b) + underflow;
  }
  return out;
}

static std::map<std::string, Checked> denseValues(const ReferenceOptions& o, const TensorMap& in) {
  std::map<std::string, Checked> out;
  switch (o.kind) {
    case LayerKind::kColumn:
    case LayerKind::kRow: {
      auto b = in.find("bias");
      const HostTensor& w = need(in, "weight");
      const int splitDim = o.kind == LayerKind::kColumn ? 0 : 1;
      HostTensor fpropMxfp8, dgradMxfp8;
      const HostTensor& wDgrad = gemmOperand(o, w, 0, splitDim, dgradMxfp8);
      linearLayer(o, need(in, "input"), gemmOperand(o, w, 1, splitDim, fpropMxfp8), wDgrad,
                  b == in.end() ? nullptr : &b->second, need(in, "grad_output"), "", out, 0);
      if (o.disableGradReduce) out["input.grad"] = partialDgrads(o, need(in, "input"), wDgrad, need(in, "grad_output"));
      break;
    }
    case LayerKind::kEmbedding: {
      const HostTensor& ids = need(in, "input");  // (b, s)
      const Mat W = asMat(need(in, "weight"));
      const std::int64_t h = W.cols;
      HostTensor e{{ids.shape[0], ids.shape[1], h}, need(in, "weight").dtype, {}};
      for (double id : ids.values)
        e.values.insert(e.values.end(), W.v.begin() + std::int64_t(id) * h, W.v.begin() + (std::int64_t(id) + 1) * h);
      if (o.reduceScatterEmbeddings) e = swap01(e);  // (s, b, h)
      HostTensor dy = need(in, "grad_output");
      if (o.reduceScatterEmbeddings) dy = swap01(dy);  // back to (b, s, h)
      Mat dW{W.rows, h, std::vector<double>(W.v.size(), 0.0)}, adW = dW;
      for (std::size_t i = 0; i < ids.values.size(); ++i)
        for (std::int64_t j = 0; j < h; ++j) {
          dW.v[std::int64_t(ids.values[i]) * h + j] += dy.values[i * h + j];
          adW.v[std::int64_t(ids.values[i]) * h + j] += std::fabs(dy.values[i * h + j]);
        }
      const Mat eMat = asMat(e);
      out["output"] = checked(o.accumulationUnit, e.shape, e.dtype, eMat, absMat(eMat), 0, 1 + o.tp, e.dtype);
      out["weight.grad"] = checked(o.accumulationUnit, need(in, "weight").shape, e.dtype, dW, adW,
                                   std::int64_t(ids.values.size()), 1,
                                   e.dtype);
      break;
    }
    case LayerKind::kMlp: {
      // fc1 (column) -> GeLU -> fc2 (row), each with its bias; SPEC's MLP block.
      // fc1 is column-parallel, fc2 row-parallel (stride 1): each GEMM reads its own copy.
      // A bound is rel · (the same computation on |values|) plus the error that a rounded
      // intermediate (GeLU(H), dH) carries through the products after it. Both terms are products
      // with the same non-negative right operand: each bound is one product of the summed left ones.
      const HostTensor &x = need(in, "input"), &dy = need(in, "grad_output");
      const HostTensor &w1 = need(in, "fc1.weight"), &w2 = need(in, "fc2.weight");
      const HostTensor &b1 = need(in, "fc1.bias"), &b2 = need(in, "fc2.bias");
      HostTensor w1fMxfp8, w1dMxfp8, w2fMxfp8, w2dMxfp8;
      const HostTensor &w1f = gemmOperand(o, w1, 1, 0, w1fMxfp8), &w1d = gemmOperand(o, w1, 0, 0, w1dMxfp8);
      const HostTensor &w2f = gemmOperand(o, w2, 1, 1, w2fMxfp8), &w2d = gemmOperand(o, w2, 0, 1, w2dMxfp8);
      const MatrixView X = viewOf(x), dY = viewOf(dy), W1 = viewOf(w1f), W1d = viewOf(w1d), W2 = viewOf(w2f),
                       W2d = viewOf(w2d);
      const std::int64_t tokens = X.rows(), h = X.cols(), f = W1.rows();
      const bool threaded = worthAThread(2.0 * double(tokens) * double(h) * double(f));  // every product's size
      const double uAcc = o.accumulationUnit;
      const DType c = o.computeDtype;
      const int stages = 3, T = o.tp;  // the GEMM's rounding and the MLP's two more; the T partial sums
      // std::tie where a later lambda reads the result: a C++17 lambda cannot capture a structured binding.
      Mat aX, adY, aW1, aW2, aW1d, aW2d;
      std::tie(aX, adY) = both(threaded, [&] { return absMat(X); }, [&] { return absMat(dY); });
      std::tie(aW1, aW2) = both(threaded, [&] { return absMat(W1); }, [&] { return absMat(W2); });
      std::tie(aW1d, aW2d) = both(threaded, [&] { return absMat(W1d); }, [&] { return absMat(W2d); });

      // H = X·W1ᵀ + b1, its magnitude aH = |X|·|W1|ᵀ, then GeLU(H) and GeLU'(H).
      Mat H, aH, A, dGelu;
      std::tie(H, aH) =
          both(threaded, [&] { return linear(X, W1, &b1.values); }, [&] { return linear(aX, aW1, nullptr); });
      std::tie(A, dGelu) =
          both(threaded, [&] { return evaluate(MatrixView(H).unaryExpr([](double v) { return gelu(v); })); },
               [&] { return evaluate(MatrixView(H).unaryExpr([](double v) { return geluGrad(v); })); });
      // fc2 reads GeLU(H) rounded: an error of up to aErr·aH (|GeLU'| < 1.13) in each element.
      const double aErr = 1.13 * (double(h + 2) * unitRoundoff(DType::kFloat32) + 2 * unitRoundoff(c));
      // The bounds' (tokens, F) left operands, |intermediate| · rel + its carried error, one at a time.
      Mat operand;

      // fc2: y = A·W2ᵀ + b2; dA = dY·W2d; dW2 = dYᵀ·A; db2 = Σ dY.
      const double relY = relativeBound(uAcc, f, stages + T, o.outputDtype);
      const double relW2 = relativeBound(uAcc, tokens, stages, c);
      const std::vector<double> boundB2 = evaluate(relY * viewOf(b2).cwiseAbs()).v;
      auto [y, boundY] = both(threaded, [&] { return linear(A, W2, &b2.values); }, [&] {
        return linear(evaluateInto(operand, relY * MatrixView(A).cwiseAbs() + aErr * MatrixView(aH)), aW2, &boundB2);
      });
      Mat dA, adA;
      std::tie(dA, adA) = both(threaded, [&] { return matmul(dY, W2d); }, [&] { return matmul(adY, aW2d); });
      auto [dW2, boundW2] = both(threaded, [&] { return transposeMatmul(dY, A); }, [&] {
        return transposeMatmul(adY, evaluateInto(operand, relW2 * MatrixView(A).cwiseAbs() + aErr * MatrixView(aH)));
      });
      out["fc2.bias.grad"] = checked(uAcc, b2.shape, c, Mat{1, h, columnSums(dY)}, Mat{1, h, columnSums(adY)}, tokens,
                                     stages + T, c);

      // GeLU's backward: dH = dA ⊙ GeLU'(H), in dA's place. dH carries fc2's dgrad error, up to
      // dhErr·adA (adA = |dY|·|W2d|), into fc1's backward.
      for (std::size_t i = 0; i < dA.v.size(); ++i) dA.v[i] *= dGelu.v[i];
      const Mat& dH = dA;
      const double dhErr = 1.13 * (double(h + 2) * unitRoundoff(DType::kFloat32) + 4 * unitRoundoff(c));

      // fc1: dX = dH·W1d; dW1 = dHᵀ·X; db1 = Σ dH.
      const double relX = relativeBound(uAcc, f, stages + T, c), relW1 = relativeBound(uAcc, tokens, stages, c);
      const double relB1 = relativeBound(uAcc, tokens, stages + T, c);
      auto [dX, boundX] = both(threaded, [&] { return matmul(dH, W1d); }, [&] {
        return matmul(evaluateInto(operand, relX * MatrixView(dH).cwiseAbs() + dhErr * MatrixView(adA)), aW1d);
      });
      auto [dW1, boundW1] = both(threaded, [&] { return transposeMatmul(dH, X); }, [&] {
        return transposeMatmul(evaluateInto(operand, relW1 * MatrixView(dH).cwiseAbs() + dhErr * MatrixView(adA)), aX);
      });

      out["output"] = {HostTensor{withLast(x.shape, W2.rows()), o.outputDtype, std::move(y.v)}, std::move(boundY.v)};
      out["input.grad"] = {HostTensor{x.shape, c, std::move(dX.v)}, std::move(boundX.v)};
      out["fc1.weight.grad"] = {HostTensor{w1f.shape, c, std::move(dW1.v)}, std::move(boundW1.v)};
      Mat db1Bound = evaluate((relB1 * MatrixView(dH).cwiseAbs() + dhErr * MatrixView(adA)).colwise().sum());
      out["fc1.bias.grad"] = {HostTensor{b1.shape, c, columnSums(dH)}, std::move(db1Bound.v)};
      out["fc2.weight.grad"] = {HostTensor{w2f.shape, c, std::move(dW2.v)}, std::move(boundW2.v)};
      break;
    }
  }
  return out;
}

HostTensor mxfp8Weight(const HostTensor& w, int axis, int splitDim, int tp, int stride, DType dtype) {
  TPSIM_CHECK(w.shape.size() == 2, "mxfp8Weight: the weight must be (N, K), got ", w.shapeStr());
  const std::int64_t rows = w.shape[0], cols = w.shape[1], total = w.shape[splitDim];
  const std::int64_t local = total / (std::int64_t(tp) * stride) * stride;
  std::vector<double> out = w.values;
  for (int t = 0; t < tp; ++t) {
    const std::vector<std::int64_t> owned = ownedIndices(total, tp, stride, t);
    const std::int64_t lr = splitDim == 0 ? local : rows, lc = splitDim == 0 ? cols : local;
    auto global = [&](std::int64_t r, std::int64_t c) {
      return std::size_t(splitDim == 0 ? owned[r] * cols + c : r * cols + owned[c]);
    };
    std::vector<double> m(std::size_t(lr * lc));  // the TP-local weight (lr, lc)
    for (std::int64_t r = 0; r < lr; ++r)
      for (std::int64_t c = 0; c < lc; ++c) m[r * lc + c] = w.values[global(r, c)];
    fakeQuantize(m, lr, lc, axis);
    for (std::int64_t r = 0; r < lr; ++r)
      for (std::int64_t c = 0; c < lc; ++c) out[global(r, c)] = m[r * lc + c];
  }
  return makeHost(w.shape, dtype, std::move(out));
}

}  // namespace tpsim::tools
