#include "tools/host_tensor.h"

#include <cmath>

#include "backends/errors.h"

namespace tpsim::tools {

std::int64_t checkedMul(std::int64_t a, std::int64_t b, const std::string& what) {
  std::int64_t product = 0;
  TPSIM_CHECK(a >= 0 && b >= 0 && !__builtin_mul_overflow(a, b, &product), what,
              ": expected sizes whose product fits in 64 bits, got ", a, " x ", b);
  return product;
}
namespace {

std::int64_t product(const std::vector<std::int64_t>& s, std::size_t from, std::size_t to) {
  std::int64_t p = 1;
  for (std::size_t i = from; i < to; ++i) p *= s[i];
  return p;
}

int normalize(int dim, std::size_t rank) { return dim < 0 ? dim + int(rank) : dim; }

double roundValue(DType dtype, double v) {
  switch (dtype) {
    case DType::kFloat32: return double(float(v));
    case DType::kBFloat16: return double(bf16ToFloat(floatToBf16(float(v))));
    case DType::kFloat16: return double(halfToFloat(floatToHalf(float(v))));
    case DType::kFloat64: return v;
    case DType::kInt64:
      TPSIM_CHECK(v == std::floor(v), "HostTensor: int64 values must be integers, got ", v);
      return v;
    case DType::kFloat8E4M3: return double(e4m3ToFloat(toE4m3(v)));
    case DType::kFloat8E8M0: return double(e8m0ToFloat(toE8m0(v)));
  }
  return v;
}

}  // namespace

std::int64_t HostTensor::numel() const { return product(shape, 0, shape.size()); }

std::string HostTensor::shapeStr() const {
  std::string s = "(";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + (shape.size() == 1 ? ",)" : ")");
}

HostTensor makeHost(std::vector<std::int64_t> shape, DType dtype, std::vector<double> values) {
  HostTensor t{std::move(shape), dtype, std::move(values)};
  TPSIM_INTERNAL_ASSERT(std::int64_t(t.values.size()) == t.numel(), "values do not fill ", t.shapeStr());
  for (double& v : t.values) v = roundValue(dtype, v);
  return t;
}

HostTensor slice(const HostTensor& t, int dim, std::int64_t begin, std::int64_t end) {
  dim = normalize(dim, t.shape.size());
  const std::int64_t outer = product(t.shape, 0, dim), inner = product(t.shape, dim + 1, t.shape.size());
  HostTensor out{t.shape, t.dtype, {}};
  out.shape[dim] = end - begin;
  out.values.reserve(std::size_t(out.numel()));
  for (std::int64_t o = 0; o < outer; ++o) {
    const auto first = t.values.begin() + (o * t.shape[dim] + begin) * inner;
    out.values.insert(out.values.end(), first, first + (end - begin) * inner);
  }
  return out;
}

HostTensor chunk(const HostTensor& t, int dim, int index, int parts) {
  const std::int64_t n = t.shape[normalize(dim, t.shape.size())] / parts;
  return slice(t, dim, index * n, (index + 1) * n);
}

HostTensor concat(const std::vector<HostTensor>& parts, int dim) {
  dim = normalize(dim, parts[0].shape.size());
  HostTensor out{parts[0].shape, parts[0].dtype, {}};
  out.shape[dim] = 0;
  for (const auto& p : parts) out.shape[dim] += p.shape[dim];
  const std::int64_t outer = product(out.shape, 0, dim), inner = product(out.shape, dim + 1, out.shape.size());
  for (std::int64_t o = 0; o < outer; ++o)
    for (const auto& p : parts) {
      const auto first = p.values.begin() + o * p.shape[dim] * inner;
      out.values.insert(out.values.end(), first, first + p.shape[dim] * inner);
    }
  return out;
}

HostTensor swap01(const HostTensor& t) {
  HostTensor out{t.shape, t.dtype, std::vector<double>(t.values.size())};
  std::swap(out.shape[0], out.shape[1]);
  const std::int64_t a = t.shape[0], b = t.shape[1], inner = product(t.shape, 2, t.shape.size());
  for (std::int64_t i = 0; i < a; ++i)
    for (std::int64_t j = 0; j < b; ++j)
      for (std::int64_t k = 0; k < inner; ++k) out.values[(j * a + i) * inner + k] = t.values[(i * b + j) * inner + k];
  return out;
}

HostTensor sum(const std::vector<HostTensor>& parts) {
  HostTensor out = parts[0];
  for (std::size_t p = 1; p < parts.size(); ++p)
    for (std::size_t i = 0; i < out.values.size(); ++i) out.values[i] += parts[p].values[i];
  return out;
}

Tensor toBackend(Compute& compute, const HostTensor& t) {
  Shape shape(t.shape.data(), int(t.shape.size()));
  Tensor out = compute.empty(shape, t.dtype);
  std::vector<char> bytes(t.values.size() * dtypeSize(t.dtype));
  for (std::size_t i = 0; i < t.values.size(); ++i)
    storeFromDouble(t.dtype, t.values[i], bytes.data() + i * dtypeSize(t.dtype));
  compute.upload(bytes.data(), out);
  return out;
}

HostTensor fromBackend(Compute& compute, ConstView v) {
  Tensor dense;
  if (!v.isContiguous()) {
    dense = compute.empty(v.shape(), v.dtype());
    compute.copy(v, dense);
    v = dense;
  }
  std::vector<char> bytes(v.bytes());
  compute.download(v, bytes.data());
  HostTensor out;
  for (int i = 0; i < v.rank(); ++i) out.shape.push_back(v.dim(i));
  out.dtype = v.dtype();
  out.values.resize(std::size_t(v.numel()));
  for (std::size_t i = 0; i < out.values.size(); ++i)
    out.values[i] = loadAsDouble(v.dtype(), bytes.data() + i * dtypeSize(v.dtype()));
  return out;
}

}  // namespace tpsim::tools
