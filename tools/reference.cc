#include "tools/reference.h"

#include <algorithm>
#include <cmath>

#include "backends/errors.h"

namespace tpsim::tools {
namespace {

// Row-major matrix view of a HostTensor's values: (rows, cols) with cols = the last dim.
struct Mat {
  std::int64_t rows, cols;
  std::vector<double> v;
};

Mat asMat(const HostTensor& t) {
  const std::int64_t cols = t.shape.back();
  return {t.numel() / cols, cols, t.values};
}

Mat absMat(Mat m) {
  for (double& x : m.v) x = std::fabs(x);
  return m;
}

// a·bᵀ (+ bias). a: (M, K)  b: (N, K)  -> (M, N)
Mat linear(const Mat& a, const Mat& b, const std::vector<double>* bias) {
  Mat out{a.rows, b.rows, std::vector<double>(a.rows * b.rows)};
  for (std::int64_t i = 0; i < a.rows; ++i)
    for (std::int64_t j = 0; j < b.rows; ++j) {
      double s = bias ? (*bias)[j] : 0.0;
      for (std::int64_t p = 0; p < a.cols; ++p) s += a.v[i * a.cols + p] * b.v[j * b.cols + p];
      out.v[i * out.cols + j] = s;
    }
  return out;
}

// a·b. a: (M, N)  b: (N, K)  -> (M, K)
Mat matmul(const Mat& a, const Mat& b) {
  Mat out{a.rows, b.cols, std::vector<double>(a.rows * b.cols, 0.0)};
  for (std::int64_t i = 0; i < a.rows; ++i)
    for (std::int64_t p = 0; p < a.cols; ++p) {
      const double x = a.v[i * a.cols + p];
      for (std::int64_t j = 0; j < b.cols; ++j) out.v[i * out.cols + j] += x * b.v[p * b.cols + j];
    }
  return out;
}

// aᵀ·b. a: (M, N)  b: (M, K)  -> (N, K)
Mat transposeMatmul(const Mat& a, const Mat& b) {
  Mat out{a.cols, b.cols, std::vector<double>(a.cols * b.cols, 0.0)};
  for (std::int64_t m = 0; m < a.rows; ++m)
    for (std::int64_t i = 0; i < a.cols; ++i) {
      const double x = a.v[m * a.cols + i];
      for (std::int64_t j = 0; j < b.cols; ++j) out.v[i * out.cols + j] += x * b.v[m * b.cols + j];
    }
  return out;
}

std::vector<double> columnSums(const Mat& m) {
  std::vector<double> s(m.cols, 0.0);
  for (std::int64_t i = 0; i < m.rows; ++i)
    for (std::int64_t j = 0; j < m.cols; ++j) s[j] += m.v[i * m.cols + j];
  return s;
}

double unitRoundoff(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16: return std::ldexp(1.0, -8);
    case DType::kFloat16: return std::ldexp(1.0, -11);
    case DType::kFloat64: return std::ldexp(1.0, -53);
    default: return std::ldexp(1.0, -24);
  }
}

// A dense result and its bound: (length · u_acc + stages · u_store) · magnitude. The gradual
// underflow allowance is added once per reference (denseReference).
Checked checked(double uAcc, std::vector<std::int64_t> shape, DType dtype, const Mat& value, const Mat& magnitude,
                std::int64_t length, int stages, DType storeDtype) {
  const double rel = double(length + 2) * uAcc + double(stages) * unitRoundoff(storeDtype);
  Checked c{HostTensor{std::move(shape), dtype, value.v}, std::vector<double>(value.v.size())};
  for (std::size_t i = 0; i < value.v.size(); ++i) c.bound[i] = rel * magnitude.v[i];
  return c;
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

// The weight a linear's GEMM multiplies by for `axis` (1: fprop, 0: dgrad).
HostTensor gemmOperand(const ReferenceOptions& o, const HostTensor& w, int axis, int splitDim) {
  if (o.weightFormat == WeightFormat::kNative) return w;
  return mxfp8Weight(w, axis, splitDim, o.tp, o.stride, o.computeDtype);
}

// One linear layer y = x·Wᵀ + b and its gradients, written into `out` under `prefix`. wFprop and
// wDgrad are the weight as the forward and the dgrad GEMM read it (W itself unless quantized).
void linearLayer(const ReferenceOptions& o, const HostTensor& x, const HostTensor& wFprop, const HostTensor& wDgrad,
                 const HostTensor* b, const HostTensor& dy, const std::string& prefix,
                 std::map<std::string, Checked>& out, int extraStages) {
  const Mat X = asMat(x), W = asMat(wFprop), Wd = asMat(wDgrad), dY = asMat(dy);
  const Mat aX = absMat(X), aW = absMat(W), aWd = absMat(Wd), adY = absMat(dY);
  std::vector<double> bias, absBias;
  if (b) {
    bias = b->values;
    absBias = absMat(asMat(*b)).v;
  }
  const DType c = o.computeDtype;
  const double u = o.accumulationUnit;
  const int reduceStages = o.tp;  // partial sums rounded once each, then added in rank order
  out[prefix + "output"] = checked(u, withLast(x.shape, W.rows), o.outputDtype, linear(X, W, b ? &bias : nullptr),
                                   linear(aX, aW, b ? &absBias : nullptr), X.cols, 1 + extraStages + reduceStages,
                                   o.outputDtype);
  out[prefix + "input.grad"] = checked(u, x.shape, c, matmul(dY, Wd), matmul(adY, aWd), W.rows,
                                       1 + extraStages + reduceStages, c);
  out[prefix + "weight.grad"] = checked(u, wFprop.shape, c, transposeMatmul(dY, X), transposeMatmul(adY, aX), X.rows,
                                        1 + extraStages, c);
  if (b) {
    Mat db{1, dY.cols, columnSums(dY)}, adb{1, dY.cols, columnSums(adY)};
    out[prefix + "bias.grad"] = checked(u, b->shape, c, db, adb, dY.rows, 1 + extraStages + reduceStages, c);
  }
}

// A column layer's input gradient under disable_grad_reduce: for each TP rank t, dY over its
// output rows times those rows of W, one GEMM rounded once, stacked (T, …, K).
Checked partialDgrads(const ReferenceOptions& o, const HostTensor& x, const HostTensor& wDgrad, const HostTensor& dy) {
  const Mat W = asMat(wDgrad), dY = asMat(dy);
  std::vector<std::int64_t> shape = x.shape;
  shape.insert(shape.begin(), o.tp);
  Checked all{HostTensor{shape, o.computeDtype, {}}, {}};
  for (int t = 0; t < o.tp; ++t) {
    const std::vector<std::int64_t> rows = ownedIndices(W.rows, o.tp, o.stride, t);
    const std::int64_t n = std::int64_t(rows.size());
    Mat dYt{dY.rows, n, {}}, Wt{n, W.cols, {}};
    for (std::int64_t i = 0; i < dY.rows; ++i)
      for (std::int64_t j : rows) dYt.v.push_back(dY.v[i * dY.cols + j]);
    for (std::int64_t j : rows) Wt.v.insert(Wt.v.end(), W.v.begin() + j * W.cols, W.v.begin() + (j + 1) * W.cols);
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
      const HostTensor wDgrad = gemmOperand(o, w, 0, splitDim);
      linearLayer(o, need(in, "input"), gemmOperand(o, w, 1, splitDim), wDgrad, b == in.end() ? nullptr : &b->second,
                  need(in, "grad_output"), "", out, 0);
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
      const HostTensor& x = need(in, "input");
      const HostTensor &w1 = need(in, "fc1.weight"), &w2 = need(in, "fc2.weight");
      const HostTensor w1f = gemmOperand(o, w1, 1, 0), w1d = gemmOperand(o, w1, 0, 0);
      const HostTensor w2f = gemmOperand(o, w2, 1, 1), w2d = gemmOperand(o, w2, 0, 1);
      const Mat X = asMat(x), W1 = asMat(w1f), W2 = asMat(w2f);
      const std::vector<double>& b1 = need(in, "fc1.bias").values;
      const Mat H = linear(X, W1, &b1);  // (M, F)
      Mat A = H, dGelu = H;
      for (std::size_t i = 0; i < H.v.size(); ++i) {
        A.v[i] = gelu(H.v[i]);
        dGelu.v[i] = geluGrad(H.v[i]);
      }
      HostTensor a{withLast(x.shape, W1.rows), x.dtype, A.v};
      const HostTensor& dy = need(in, "grad_output");
      std::map<std::string, Checked> fc2;
      linearLayer(o, a, w2f, w2d, &need(in, "fc2.bias"), dy, "", fc2, 2);
      // GeLU's backward: dH = dA ⊙ GeLU'(H); then fc1's backward from dH.
      HostTensor dh{a.shape, x.dtype, fc2["input.grad"].value.values};
      for (std::size_t i = 0; i < dh.values.size(); ++i) dh.values[i] *= dGelu.v[i];
      std::map<std::string, Checked> fc1;
      linearLayer(o, x, w1f, w1d, &need(in, "fc1.bias"), dh, "", fc1, 2);
      // fc1's input gradient went through fc2's dgrad, GeLU and fc1: widen its bound by fc2's
      // reduction length through the magnitudes (|dY|·|W2| feeds |dH| up to max|GeLU'| < 1.13).
      const double chain = double(W2.rows + 2) * unitRoundoff(DType::kFloat32) + 4 * unitRoundoff(o.computeDtype);
      const Mat adH = [&] {
        Mat m = matmul(absMat(asMat(dy)), absMat(asMat(w2d)));
        for (double& v : m.v) v *= 1.13;
        return m;
      }();
      const Mat adX = matmul(adH, absMat(asMat(w1d)));
      for (std::size_t i = 0; i < adX.v.size(); ++i) fc1["input.grad"].bound[i] += chain * adX.v[i];
      const Mat adW1 = transposeMatmul(adH, absMat(X));
      for (std::size_t i = 0; i < adW1.v.size(); ++i) fc1["weight.grad"].bound[i] += chain * adW1.v[i];
      const std::vector<double> adb1 = columnSums(adH);
      for (std::size_t i = 0; i < adb1.size(); ++i) fc1["bias.grad"].bound[i] += chain * adb1[i];
      // fc2's input is GeLU(H) rounded: its error feeds the output and fc2's wgrad.
      const Mat aH = linear(absMat(X), absMat(W1), nullptr);
      const double hErr = double(W1.cols + 2) * unitRoundoff(DType::kFloat32) + 2 * unitRoundoff(o.computeDtype);
      const Mat outErr = linear(aH, absMat(W2), nullptr);
      for (std::size_t i = 0; i < outErr.v.size(); ++i) fc2["output"].bound[i] += 1.13 * hErr * outErr.v[i];
      const Mat w2Err = transposeMatmul(absMat(asMat(dy)), aH);
      for (std::size_t i = 0; i < w2Err.v.size(); ++i) fc2["weight.grad"].bound[i] += 1.13 * hErr * w2Err.v[i];
      out["output"] = std::move(fc2["output"]);
      out["input.grad"] = std::move(fc1["input.grad"]);
      out["fc1.weight.grad"] = std::move(fc1["weight.grad"]);
      out["fc1.bias.grad"] = std::move(fc1["bias.grad"]);
      out["fc2.weight.grad"] = std::move(fc2["weight.grad"]);
      out["fc2.bias.grad"] = std::move(fc2["bias.grad"]);
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
