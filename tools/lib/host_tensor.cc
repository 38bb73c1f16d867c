#include "tools/lib/host_tensor.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "backends/errors.h"
#include "backends/huge_pages.h"

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

}  // namespace

double roundedTo(DType dtype, double v) {
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

std::int64_t HostTensor::numel() const { return product(shape, 0, shape.size()); }

std::int64_t StoredTensor::numel() const { return product(shape, 0, shape.size()); }

HostTensor makeHost(std::vector<std::int64_t> shape, DType dtype, std::vector<double> values) {
  HostTensor t{std::move(shape), dtype, std::move(values)};
  TPSIM_INTERNAL_ASSERT(std::int64_t(t.values.size()) == t.numel(), "values do not fill ", shapeText(t.shape));
  for (double& v : t.values) v = roundedTo(dtype, v);
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

namespace {

std::vector<std::int64_t> rowMajorStrides(const std::vector<std::int64_t>& shape) {
  std::vector<std::int64_t> strides(shape.size(), 1);
  for (int d = int(shape.size()) - 2; d >= 0; --d) strides[d] = strides[d + 1] * shape[d + 1];
  return strides;
}

// Calls f(global offset, local offset, n) for each run of a real block along its last dim.
template <typename F>
void forEachRun(const Block& b, const std::vector<std::int64_t>& globalStrides,
                const std::vector<std::int64_t>& localStrides, F f) {
  const int rank = int(b.global.size());
  std::vector<std::int64_t> at(rank, 0);  // odometer over every dim but the last
  const std::int64_t run = rank ? b.global[rank - 1].size() : 1;
  while (true) {
    std::int64_t g = 0, l = 0;
    for (int d = 0; d < rank; ++d) {
      g += (b.global[d].begin + at[d]) * globalStrides[d];
      l += (b.local[d] + at[d]) * localStrides[d];
    }
    f(g, l, run);
    int d = rank - 2;
    while (d >= 0 && ++at[d] == b.global[d].size()) at[d--] = 0;
    if (d < 0) return;
  }
}

// copy(from, to, n) for each run of rank (t, g)'s real blocks: n elements from the global tensor's
// flat offset `from` to the local tensor's `to`.
template <class Copy>
void forEachShardRun(const TensorPlacement& p, const std::vector<std::int64_t>& fullShape,
                     const std::vector<std::int64_t>& localShape, int t, int g, Copy copy) {
  TPSIM_INTERNAL_ASSERT(fullShape == p.shape, p.name, ": placement of ", shapeText(p.shape), " for a tensor ",
                        shapeText(fullShape));
  const auto gs = rowMajorStrides(fullShape), ls = rowMajorStrides(localShape);
  for (const Block& b : blocksOf(p, t, g))
    if (!b.pad) forEachRun(b, gs, ls, copy);
}

}  // namespace

std::vector<ShardRun> shardRuns(const TensorPlacement& p, int t, int g) {
  std::vector<ShardRun> runs;
  auto add = [&runs](const ShardRun& r) {
    ShardRun* last = runs.empty() ? nullptr : &runs.back();
    if (last != nullptr && last->from + last->n == r.from && last->to + last->n == r.to) last->n += r.n;
    else if (r.n > 0) runs.push_back(r);
  };
  forEachShardRun(p, p.shape, localShape(p, t, g), t, g,
                  [&](std::int64_t from, std::int64_t to, std::int64_t n) { add({from, to, n}); });
  // A rank's blocks come in its own order, which a strided or padded placement takes out of the
  // global one.
  const auto byFrom = [](const ShardRun& a, const ShardRun& b) { return a.from < b.from; };
  if (!std::is_sorted(runs.begin(), runs.end(), byFrom)) {
    std::vector<ShardRun> unsorted;
    unsorted.swap(runs);
    std::sort(unsorted.begin(), unsorted.end(), byFrom);
    for (const ShardRun& r : unsorted) add(r);
  }
  return runs;
}

HostTensor shardOf(const TensorPlacement& p, const HostTensor& full, int t, int g) {
  HostTensor out{localShape(p, t, g), full.dtype, {}};
  out.values.assign(std::size_t(out.numel()), 0.0);
  forEachShardRun(p, full.shape, out.shape, t, g, [&](std::int64_t from, std::int64_t to, std::int64_t n) {
    std::copy_n(full.values.begin() + from, n, out.values.begin() + to);
  });
  return out;
}

StoredTensor shardOf(const TensorPlacement& p, const StoredTensor& full, int t, int g) {
  StoredTensor out{localShape(p, t, g), full.dtype, {}};
  const std::size_t size = dtypeSize(full.dtype);
  resizeFresh(out.bytes, std::size_t(out.numel()) * size);  // pad rows: +0
  forEachShardRun(p, full.shape, out.shape, t, g, [&](std::int64_t from, std::int64_t to, std::int64_t n) {
    std::memcpy(out.bytes.data() + std::size_t(to) * size, full.bytes.data() + std::size_t(from) * size,
                std::size_t(n) * size);
  });
  return out;
}

namespace {

double valueAt(const HostTensor& t, std::int64_t i) { return t.values[std::size_t(i)]; }
double valueAt(const StoredTensor& t, std::int64_t i) { return t.at(i); }

// A rank's tensor that is not here: no shape and no data.
bool absent(const StoredTensor& t) { return t.shape.empty() && t.bytes.empty(); }
bool absent(const HostTensor& t) { return t.shape.empty() && t.values.empty(); }

// MatrixRect r of assemble(p, local) into value; with `farthest`, the copies farthest from it as well.
template <class Local>
bool gatherRect(const TensorPlacement& p, const std::function<const Local&(int t, int g)>& local, const MatrixRect& r,
                double* value, double* farthest) {
  const auto gs = rowMajorStrides(p.shape);
  const std::int64_t cols = p.shape.empty() ? 1 : p.shape.back();
  // f(at, from, n) for the part of a run of n elements, global offset g0 and local l0, inside r: a run
  // lies along the last dim, so in one row of the matrix.
  auto inRect = [&](std::int64_t g0, std::int64_t l0, std::int64_t n, auto f) {
    const std::int64_t row = g0 / cols, c0 = g0 % cols;
    if (row < r.row || row >= r.row + r.rows) return;
    const std::int64_t from = std::max(c0, r.col), to = std::min(c0 + n, r.col + r.cols);
    if (from < to) f((row - r.row) * r.cols + (from - r.col), l0 + (from - c0), to - from);
  };
  auto holders = [&](auto each) {
    for (int g = 0; g < p.gtp.size; ++g)
      for (int t = 0; t < p.tp.size; ++t) {
        const Local& mine = local(t, g);
        if (absent(mine)) continue;  // a rank another process runs (ShardedResult)
        TPSIM_INTERNAL_ASSERT(mine.shape == localShape(p, t, g), p.name, " of rank (t=", t, ", g=", g, "): expected ",
                              shapeText(localShape(p, t, g)), ", got ", shapeText(mine.shape));
        const auto ls = rowMajorStrides(mine.shape);
        for (const Block& b : blocksOf(p, t, g))
          if (!b.pad)
            forEachRun(b, gs, ls, [&](std::int64_t at, std::int64_t from, std::int64_t n) {
              inRect(at, from, n, [&](std::int64_t to, std::int64_t first, std::int64_t count) {
                each(t, g, mine, to, first, count);
              });
            });
      }
  };
  std::fill_n(value, r.rows * r.cols, 0.0);
  holders([&](int t, int g, const Local& mine, std::int64_t to, std::int64_t from, std::int64_t n) {
    if ((p.tp.kind == AxisKind::kReplicate && t > 0) || (p.gtp.kind == AxisKind::kReplicate && g > 0)) return;
    const bool add = (p.tp.kind == AxisKind::kPartial && t > 0) || (p.gtp.kind == AxisKind::kPartial && g > 0);
    for (std::int64_t i = 0; i < n; ++i)
      value[to + i] = add ? value[to + i] + valueAt(mine, from + i) : valueAt(mine, from + i);
  });
  if (!farthest) return false;
  std::copy_n(value, r.rows * r.cols, farthest);
  if (p.tp.kind == AxisKind::kPartial || p.gtp.kind == AxisKind::kPartial) return false;
  auto distance = [](double a, double b) { return std::isnan(a) || std::isnan(b) ? HUGE_VAL : std::fabs(a - b); };
  bool differs = false;
  holders([&](int, int, const Local& mine, std::int64_t to, std::int64_t from, std::int64_t n) {
    for (std::int64_t i = 0; i < n; ++i) {
      const double copy = valueAt(mine, from + i), want = value[to + i];
      if (std::memcmp(&copy, &want, sizeof copy) == 0) continue;  // bitwise: -0 differs from +0 too
      differs = true;
      if (distance(copy, want) >= distance(farthest[to + i], want)) farthest[to + i] = copy;
    }
  });
  return differs;
}

template <class Local>
HostTensor assembleWhole(const TensorPlacement& p, const std::function<const Local&(int t, int g)>& local) {
  HostTensor out{p.shape, local(0, 0).dtype, {}};
  out.values.resize(std::size_t(out.numel()));
  const std::int64_t cols = p.shape.empty() ? 1 : p.shape.back();
  gatherRect(p, local, MatrixRect{0, 0, out.numel() / cols, cols}, out.values.data(), nullptr);
  return out;
}

}  // namespace

HostTensor assemble(const TensorPlacement& p, const std::function<const HostTensor&(int t, int g)>& local) {
  return assembleWhole(p, local);
}

HostTensor assemble(const TensorPlacement& p, const std::function<const StoredTensor&(int t, int g)>& local) {
  return assembleWhole(p, local);
}

bool assembleRect(const TensorPlacement& p, const std::function<const StoredTensor&(int t, int g)>& local,
                  const MatrixRect& r, std::vector<double>& value, std::vector<double>& farthest) {
  value.resize(std::size_t(r.rows * r.cols));
  farthest.resize(value.size());
  return gatherRect(p, local, r, value.data(), farthest.data());
}

Tensor toBackend(Compute& compute, const HostTensor& t) { return toBackend(compute, storedOf(t)); }

Tensor toBackend(Compute& compute, const StoredTensor& t) {
  Tensor out = compute.empty(Shape(t.shape.data(), int(t.shape.size())), t.dtype);
  compute.upload(t.bytes.data(), out);
  return out;
}

StoredTensor storedOf(const HostTensor& t) {
  TPSIM_INTERNAL_ASSERT(std::int64_t(t.values.size()) == t.numel(), "values do not fill ", shapeText(t.shape));
  StoredTensor out{t.shape, t.dtype, std::vector<char>(t.values.size() * dtypeSize(t.dtype))};
  for (std::size_t i = 0; i < t.values.size(); ++i)
    storeFromDouble(t.dtype, t.values[i], out.bytes.data() + i * dtypeSize(t.dtype));
  return out;
}

void convertElements(DType dtype, const void* data, std::int64_t n, DType want, char* out) {
  const char* bytes = static_cast<const char*>(data);
  const std::size_t from = dtypeSize(dtype), to = dtypeSize(want);
  for (std::int64_t i = 0; i < n; ++i)
    storeFromDouble(want, roundedTo(want, loadAsDouble(dtype, bytes + std::size_t(i) * from)),
                    out + std::size_t(i) * to);
}

InputMap storedOf(const TensorMap& tensors) {
  InputMap out;
  for (const auto& [name, t] : tensors) out[name] = storedOf(t);
  return out;
}

TensorMap hostOf(const InputMap& tensors) {
  TensorMap out;
  for (const auto& [name, t] : tensors) out[name] = hostOf(t);
  return out;
}

void readDoubles(const StoredTensor& t, std::int64_t begin, std::int64_t n, double* out) {
  const std::size_t size = dtypeSize(t.dtype);
  const char* from = t.bytes.data() + std::size_t(begin) * size;
  if (t.dtype == DType::kFloat32) {
    for (std::int64_t i = 0; i < n; ++i) {
      float f;
      std::memcpy(&f, from + std::size_t(i) * 4, 4);
      out[i] = f;
    }
    return;
  }
  for (std::int64_t i = 0; i < n; ++i) out[i] = loadAsDouble(t.dtype, from + std::size_t(i) * size);
}

HostTensor hostOf(const StoredTensor& t) {
  HostTensor out{t.shape, t.dtype, std::vector<double>(std::size_t(t.numel()))};
  readDoubles(t, 0, t.numel(), out.values.data());
  return out;
}

HostTensor fromBackend(Compute& compute, ConstView v) { return hostOf(storedFromBackend(compute, v)); }

StoredTensor storedFromBackend(Compute& compute, ConstView v) {
  Tensor dense;
  if (!v.isContiguous()) {
    dense = compute.empty(v.shape(), v.dtype());
    compute.copy(v, dense);
    v = dense;
  }
  StoredTensor out;
  for (int i = 0; i < v.rank(); ++i) out.shape.push_back(v.dim(i));
  out.dtype = v.dtype();
  resizeFresh(out.bytes, v.bytes());
  compute.download(v, out.bytes.data());
  return out;
}

}  // namespace tpsim::tools
