// Cross-checks of a Compute against SimCompute for the gpu tests: random data valid for each
// dtype, strided layouts, and one check per elementwise op that runs it on both backends from the
// same bytes and compares the whole buffer, so writes outside a view fail too. Used on the kernels
// run on the host (gpu_element_math_test.cu) and on GpuCompute (gpu_compute_test.cu). Bitwise,
// NaN matching any NaN (payloads may differ), but GeLU on the GPU, which is held to a bound.
// Also the gpu tests' environment guard.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "backends/compute.h"
#include "backends/errors.h"
#include "sim/sim_compute.h"

namespace tpsim::gputest {

using Bytes = std::vector<unsigned char>;
using Rng = std::mt19937_64;

const DType kAllDTypes[] = {DType::kFloat32, DType::kBFloat16,   DType::kFloat16,   DType::kFloat64,
                            DType::kInt64,   DType::kFloat8E4M3, DType::kFloat8E8M0};
const DType kFloating[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kFloat64};
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

// Sets an environment variable for one scope.
class EnvGuard {
 public:
  EnvGuard(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old, had_ = true;
    setenv(name, value, 1);
  }
  ~EnvGuard() {
    if (had_)
      setenv(name_, old_.c_str(), 1);
    else
      unsetenv(name_);
  }
  EnvGuard(const EnvGuard&) = delete;
  EnvGuard& operator=(const EnvGuard&) = delete;

 private:
  const char* name_;
  std::string old_;
  bool had_ = false;
};

// ---- Elements -----------------------------------------------------------------------------------

inline bool isNanElement(DType d, const unsigned char* p) {
  std::uint64_t u = 0;
  std::memcpy(&u, p, dtypeSize(d));
  switch (d) {
    case DType::kFloat32: return (u & 0x7fffffffu) > 0x7f800000u;
    case DType::kBFloat16: return (u & 0x7fffu) > 0x7f80u;
    case DType::kFloat16: return (u & 0x7fffu) > 0x7c00u;
    case DType::kFloat64: return (u & 0x7fffffffffffffffull) > 0x7ff0000000000000ull;
    case DType::kFloat8E4M3: return (u & 0x7fu) == 0x7fu;
    case DType::kFloat8E8M0: return u == 0xffu;
    case DType::kInt64: return false;
  }
  return false;
}

inline bool sameElement(DType d, const unsigned char* a, const unsigned char* b) {
  return std::memcmp(a, b, dtypeSize(d)) == 0 || (isNanElement(d, a) && isNanElement(d, b));
}

inline std::string bitsStr(DType d, const unsigned char* p) {
  std::uint64_t u = 0;
  std::memcpy(&u, p, dtypeSize(d));
  char buf[40];
  std::snprintf(buf, sizeof buf, "0x%llx (%g)", static_cast<unsigned long long>(u), loadAsDouble(d, p));
  return buf;
}

// Mostly moderate values of both signs (2^-12 .. 2^12), with zeros, infinities, NaN, tiny values
// (subnormal or zero in 16 bits), values beyond fp16's range, and fp64 values just above a bf16 or
// fp16 tie (which round up directly but down through a nearest-even float) mixed in.
inline double randomValue(Rng& rng) {
  const int kind = std::uniform_int_distribution<int>(0, 99)(rng);
  switch (kind) {
    case 0: return 0.0;
    case 1: return -0.0;
    case 2: return kInf;
    case 3: return -kInf;
    case 4: return kNaN;
    case 5: return 3e-41;
    case 6: return -7e4;
    case 7: return 1.0 + 0x1p-8 + 0x1p-30;
    case 8: return -(1.0 + 0x1p-11 + 0x1p-30);
    default: break;
  }
  const double mantissa = std::uniform_real_distribution<double>(1.0, 2.0)(rng);
  const int exponent = std::uniform_int_distribution<int>(-12, 12)(rng);
  return (kind % 2 ? -1.0 : 1.0) * std::ldexp(mantissa, exponent);
}

// n random elements of `d`: randomValue rounded to d for floating types, integers for int64 (a few
// near ±2^62), any byte for the fp8 types (NaN codes included).
inline Bytes randomElements(DType d, std::int64_t n, Rng& rng) {
  const std::size_t size = dtypeSize(d);
  Bytes out(std::size_t(n) * size);
  for (std::int64_t i = 0; i < n; ++i) {
    unsigned char* p = out.data() + std::size_t(i) * size;
    if (d == DType::kInt64) {
      const std::int64_t range = std::int64_t(1) << 40;
      std::int64_t v = std::uniform_int_distribution<std::int64_t>(-range, range)(rng);
      if (i % 17 == 3) v = (v % 2 ? -1 : 1) * (std::int64_t(1) << 62) + v;
      std::memcpy(p, &v, 8);
    } else if (isFloat8(d)) {
      *p = static_cast<unsigned char>(rng());
    } else {
      storeFromDouble(d, randomValue(rng), p);
    }
  }
  return out;
}

// n elements of `from` that a store into `to` accepts: integers in range for int64, exact powers
// of two (and NaN) for e8m0; random ones when `to` takes anything.
inline Bytes storableElements(DType from, DType to, std::int64_t n, Rng& rng) {
  if (to != DType::kInt64 && to != DType::kFloat8E8M0) return randomElements(from, n, rng);
  const std::size_t size = dtypeSize(from);
  Bytes out(std::size_t(n) * size);
  for (std::int64_t i = 0; i < n; ++i) {
    double v;
    if (to == DType::kInt64)
      v = from == DType::kFloat8E8M0 ? std::ldexp(1.0, std::uniform_int_distribution<int>(-20, 40)(rng))
                                     : std::uniform_real_distribution<double>(-448.0, 448.0)(rng);
    else if (from == DType::kInt64)
      v = std::ldexp(1.0, std::uniform_int_distribution<int>(0, 40)(rng));
    else
      v = i % 11 == 5 ? kNaN : std::ldexp(1.0, std::uniform_int_distribution<int>(-9, 8)(rng));
    if (from == DType::kInt64) {
      const std::int64_t x = std::int64_t(v);
      std::memcpy(out.data() + std::size_t(i) * size, &x, 8);
    } else {
      storeFromDouble(from, v, out.data() + std::size_t(i) * size);
    }
  }
  return out;
}

inline Bytes int64Elements(const std::vector<std::int64_t>& values) {
  Bytes out(values.size() * 8);
  if (!values.empty()) std::memcpy(out.data(), values.data(), out.size());
  return out;
}

// ---- Layouts ------------------------------------------------------------------------------------

struct Layout {
  std::string name;
  Shape shape;
  Strides strides;
  std::int64_t span = 1;  // elements of the buffer it needs
};

inline Layout makeLayout(const std::string& name, Shape shape, Strides strides) {
  Layout l{name, shape, strides, 1};
  if (shape.numel() > 0)
    for (int i = 0; i < shape.rank(); ++i) l.span += (shape[i] - 1) * strides[i];
  return l;
}

// Dense row-major; rows padded by 3 elements; and column-major (every mode reversed). A vector
// gets dense and every third element.
inline std::vector<Layout> layoutsOf(Shape shape) {
  const int r = shape.rank();
  std::vector<Layout> out{makeLayout("dense", shape, shape.contiguousStrides())};
  if (r == 1) {
    out.push_back(makeLayout("stride 3", shape, Shape{3}));
    return out;
  }
  std::int64_t padded[Shape::kMaxRank], reversed[Shape::kMaxRank];
  padded[r - 1] = 1;
  for (int i = r - 2; i >= 0; --i) padded[i] = padded[i + 1] * (shape[i + 1] + (i + 1 == r - 1 ? 3 : 0));
  reversed[0] = 1;
  for (int i = 1; i < r; ++i) reversed[i] = reversed[i - 1] * shape[i - 1];
  out.push_back(makeLayout("padded", shape, Strides(padded, r)));
  out.push_back(makeLayout("column-major", shape, Strides(reversed, r)));
  return out;
}

// ---- One buffer on both backends ----------------------------------------------------------------

// `elems` elements of `dtype` holding the same bytes on SimCompute and on the backend under test.
class Twin {
 public:
  Twin(sim::SimCompute& sim, Compute& other, DType dtype, std::int64_t elems, const Bytes& bytes)
      : sim_(sim), other_(other), dtype_(dtype) {
    EXPECT_EQ(bytes.size(), std::size_t(elems) * dtypeSize(dtype)) << "test bug: wrong byte count";
    simT_ = sim.empty(Shape{elems}, dtype);
    otherT_ = other.empty(Shape{elems}, dtype);
    if (!bytes.empty()) std::memcpy(simT_.data(), bytes.data(), bytes.size());
    other.upload(bytes.data(), otherT_);
  }

  View sim(const Layout& l, std::int64_t offset = 0) { return on(simT_, l, offset); }
  View other(const Layout& l, std::int64_t offset = 0) { return on(otherT_, l, offset); }
  View simAll() { return simT_.view(); }
  View otherAll() { return otherT_.view(); }
  DType dtype() const { return dtype_; }

  Bytes simBytes() const {
    Bytes b(simT_.view().bytes());
    if (!b.empty()) std::memcpy(b.data(), simT_.data(), b.size());
    return b;
  }
  Bytes otherBytes() const {
    Bytes b(otherT_.view().bytes());
    other_.download(otherT_, b.data());
    return b;
  }

 private:
  View on(Tensor& t, const Layout& l, std::int64_t offset) {
    return View(t.view().at(offset), l.shape, l.strides, dtype_, t.device());
  }

  sim::SimCompute& sim_;
  Compute& other_;
  DType dtype_;
  Tensor simT_, otherT_;
};

// Every element of both buffers equal (NaN matching NaN); the first mismatch is reported.
inline void expectSame(const Twin& t, const std::string& what) {
  const Bytes a = t.simBytes(), b = t.otherBytes();
  const std::size_t size = dtypeSize(t.dtype());
  std::size_t bad = 0, first = 0;
  for (std::size_t i = 0; i < a.size() / size; ++i)
    if (!sameElement(t.dtype(), &a[i * size], &b[i * size]) && bad++ == 0) first = i;
  if (bad != 0)
    ADD_FAILURE() << what << ": " << bad << " of " << a.size() / size << " elements differ; first at index "
                  << first << ": sim " << bitsStr(t.dtype(), &a[first * size]) << ", other "
                  << bitsStr(t.dtype(), &b[first * size]);
}

// The spacing of `dtype` at |v|, and its smallest subnormal.
inline double ulpOf(DType dtype, double v) {
  const int bits = dtype == DType::kBFloat16 ? 7 : dtype == DType::kFloat16 ? 10 : dtype == DType::kFloat32 ? 23 : 52;
  const double tiny = dtype == DType::kBFloat16 ? 0x1p-133 : dtype == DType::kFloat16 ? 0x1p-24
                      : dtype == DType::kFloat32 ? 0x1p-149 : 0x1p-1074;
  return std::max(std::ldexp(std::fabs(v), -bits), tiny);
}

// GeLU's results on the two backends differ by at most what erf/exp's last bits (<= 4 ulp of the
// arithmetic type each, both implementations together) move them, `scale` (|x| for gelu,
// |dy|·(1 + |x|) for its backward) times 8 units, plus 2 ulp of the output dtype for the roundings
// that follow. Infinities must match; NaN must match NaN.
inline void expectGeluClose(const Twin& out, const std::vector<double>& scale, bool fp64Arithmetic,
                            const std::string& what) {
  const Bytes a = out.simBytes(), b = out.otherBytes();
  const std::size_t size = dtypeSize(out.dtype());
  const double unit = fp64Arithmetic ? 0x1p-53 : 0x1p-24;
  for (std::size_t i = 0; i < a.size() / size; ++i) {
    const double s = loadAsDouble(out.dtype(), &a[i * size]), o = loadAsDouble(out.dtype(), &b[i * size]);
    if (std::isnan(s) || std::isnan(o) || std::isinf(s) || std::isinf(o)) {
      if (!sameElement(out.dtype(), &a[i * size], &b[i * size]) && !(std::isnan(s) && std::isnan(o))) {
        ADD_FAILURE() << what << ": index " << i << ": sim " << s << ", other " << o;
        return;
      }
      continue;
    }
    const double bound = 8 * unit * scale[i] + 2 * ulpOf(out.dtype(), std::max(std::fabs(s), std::fabs(o)));
    if (std::fabs(s - o) > bound) {
      ADD_FAILURE() << what << ": index " << i << ": sim " << s << ", other " << o << " differ by "
                    << std::fabs(s - o) << " > bound " << bound;
      return;
    }
  }
}

inline std::string caseName(const std::string& op, std::initializer_list<DType> dtypes, const std::string& layout) {
  std::string s = op + "(";
  for (DType d : dtypes) s += std::string(s.back() == '(' ? "" : ", ") + dtypeName(d);
  return s + ") " + layout;
}

// ---- The checks, one per op ---------------------------------------------------------------------

// Shapes every elementwise check runs on: a vector, a matrix, rank 3, rank 4 with a unit mode, empty.
inline std::vector<Shape> elementwiseShapes() {
  return {Shape{37}, Shape{6, 11}, Shape{3, 5, 7}, Shape{2, 3, 1, 5}, Shape{0, 4}};
}

inline std::int64_t spanOf(const std::vector<Layout>& ls) {
  std::int64_t s = 1;
  for (const Layout& l : ls) s = std::max(s, l.span);
  return s;
}

inline void checkFill(sim::SimCompute& sim, Compute& other) {
  Rng rng(1);
  const double values[] = {0.0, -0.0, 1.5, -3.25, 0.1, 1e-30, 3e-41, 65504.0, 65520.0, 1e30, 500.0, -7.9,
                           std::ldexp(1.0, -127), 1e18, kNaN, kInf, -kInf};
  for (DType d : kAllDTypes)
    for (const Shape& shape : elementwiseShapes())
      for (const Layout& l : layoutsOf(shape))
        for (double v : values) {
          bool storable = true;
          if (d == DType::kInt64) storable = v >= -0x1p63 && v < 0x1p63;
          if (d == DType::kFloat8E8M0) {
            try {
              toE8m0(v);
            } catch (const InvalidArgument&) {
              storable = false;
            }
          }
          if (!storable) continue;
          Twin y(sim, other, d, l.span, randomElements(d, l.span, rng));
          sim.fill(y.sim(l), v);
          other.fill(y.other(l), v);
          expectSame(y, caseName("fill " + std::to_string(v), {d}, l.name + " " + shape.str()));
        }
}

inline void checkCopy(sim::SimCompute& sim, Compute& other) {
  Rng rng(2);
  for (DType dx : kAllDTypes)
    for (DType dy : kAllDTypes)
      for (const Shape& shape : elementwiseShapes()) {
        const std::vector<Layout> ls = layoutsOf(shape);
        for (const Layout& lx : ls)
          for (const Layout& ly : ls) {
            Twin x(sim, other, dx, lx.span, storableElements(dx, dy, lx.span, rng));
            Twin y(sim, other, dy, ly.span, randomElements(dy, ly.span, rng));
            sim.copy(x.sim(lx), y.sim(ly));
            other.copy(x.other(lx), y.other(ly));
            expectSame(y, caseName("copy", {dx, dy}, lx.name + " -> " + ly.name + " " + shape.str()));
          }
      }
}

inline bool holds(DType wide, DType narrow) {
  if (wide == narrow) return true;
  if (wide == DType::kFloat64) return narrow == DType::kFloat32 || is16Bit(narrow);
  return wide == DType::kFloat32 && is16Bit(narrow);
}

inline void checkAxpy(sim::SimCompute& sim, Compute& other) {
  Rng rng(3);
  for (DType dx : kFloating)
    for (DType dy : kFloating) {
      if (!holds(dy, dx)) continue;
      for (const Shape& shape : elementwiseShapes()) {
        const std::vector<Layout> ls = layoutsOf(shape);
        for (const Layout& lx : ls)
          for (const Layout& ly : ls)
            for (float alpha : {1.f, -0.75f, 3.1f}) {
              Twin x(sim, other, dx, lx.span, randomElements(dx, lx.span, rng));
              Twin y(sim, other, dy, ly.span, randomElements(dy, ly.span, rng));
              sim.axpy(alpha, x.sim(lx), y.sim(ly));
              other.axpy(alpha, x.other(lx), y.other(ly));
              expectSame(y, caseName("axpy " + std::to_string(alpha), {dx, dy}, lx.name + ", " + ly.name + " " +
                                                                                     shape.str()));
            }
      }
    }
}

inline void checkScale(sim::SimCompute& sim, Compute& other) {
  Rng rng(4);
  for (DType d : kFloating)
    for (const Shape& shape : elementwiseShapes())
      for (const Layout& l : layoutsOf(shape))
        for (float alpha : {0.5f, -3.f, 0.f, 1e-3f}) {
          Twin y(sim, other, d, l.span, randomElements(d, l.span, rng));
          sim.scale(y.sim(l), alpha);
          other.scale(y.other(l), alpha);
          expectSame(y, caseName("scale " + std::to_string(alpha), {d}, l.name + " " + shape.str()));
        }
}

inline void checkAddBias(sim::SimCompute& sim, Compute& other) {
  Rng rng(5);
  for (DType db : kFloating)
    for (DType dy : kFloating)
      for (const Shape& shape : elementwiseShapes()) {
        const std::vector<Layout> lbs = layoutsOf(Shape{shape[shape.rank() - 1]});
        for (const Layout& ly : layoutsOf(shape))
          for (const Layout& lb : lbs) {
            Twin bias(sim, other, db, lb.span, randomElements(db, lb.span, rng));
            Twin y(sim, other, dy, ly.span, randomElements(dy, ly.span, rng));
            sim.addBias(bias.sim(lb), y.sim(ly));
            other.addBias(bias.other(lb), y.other(ly));
            expectSame(y, caseName("addBias", {db, dy}, lb.name + ", " + ly.name + " " + shape.str()));
          }
      }
}

inline void checkSumRows(sim::SimCompute& sim, Compute& other) {
  Rng rng(6);
  std::vector<Shape> shapes = elementwiseShapes();
  shapes.push_back(Shape{0, 5});  // no rows: out = beta·out
  for (DType dy : kFloating)
    for (DType dout : kFloating)
      for (const Shape& shape : shapes) {
        const std::vector<Layout> los = layoutsOf(Shape{shape[shape.rank() - 1]});
        for (const Layout& ly : layoutsOf(shape))
          for (const Layout& lo : los)
            for (float beta : {0.f, 1.f, -0.5f}) {
              Twin y(sim, other, dy, ly.span, randomElements(dy, ly.span, rng));
              Twin out(sim, other, dout, lo.span, randomElements(dout, lo.span, rng));
              if (beta == 0.f) {  // beta == 0 must not read out: NaN there must not leak
                sim.fill(out.simAll(), kNaN);
                other.fill(out.otherAll(), kNaN);
              }
              sim.sumRows(y.sim(ly), out.sim(lo), beta);
              other.sumRows(y.other(ly), out.other(lo), beta);
              expectSame(out, caseName("sumRows " + std::to_string(beta), {dy, dout},
                                       ly.name + ", " + lo.name + " " + shape.str()));
            }
      }
}

// |x| (or |dy|·(1 + |x|)) of every element of the output buffer: 0 outside the view.
inline std::vector<double> geluScale(const Twin& x, const Layout& lx, const Twin* dy, const Layout* ldy,
                                     const Layout& lout, std::int64_t outSpan) {
  std::vector<double> scale(std::size_t(outSpan), 0.0);
  const Bytes xb = x.simBytes();
  const Bytes dyb = dy ? dy->simBytes() : Bytes{};
  const Shape& s = lout.shape;
  std::int64_t dims[4] = {1, 1, 1, 1}, sx[4] = {}, so[4] = {}, sd[4] = {};
  const int pad = 4 - s.rank();
  for (int i = 0; i < s.rank(); ++i) {
    dims[pad + i] = s[i];
    sx[pad + i] = lx.strides[i];
    so[pad + i] = lout.strides[i];
    if (ldy) sd[pad + i] = ldy->strides[i];
  }
  for (std::int64_t a = 0; a < dims[0]; ++a)
    for (std::int64_t b = 0; b < dims[1]; ++b)
      for (std::int64_t c = 0; c < dims[2]; ++c)
        for (std::int64_t d = 0; d < dims[3]; ++d) {
          const std::int64_t ox = a * sx[0] + b * sx[1] + c * sx[2] + d * sx[3];
          const std::int64_t oo = a * so[0] + b * so[1] + c * so[2] + d * so[3];
          double v = std::fabs(loadAsDouble(x.dtype(), &xb[std::size_t(ox) * dtypeSize(x.dtype())]));
          if (dy) {
            const std::int64_t od = a * sd[0] + b * sd[1] + c * sd[2] + d * sd[3];
            v = std::fabs(loadAsDouble(dy->dtype(), &dyb[std::size_t(od) * dtypeSize(dy->dtype())])) * (1 + v);
          }
          scale[std::size_t(oo)] = v;
        }
  return scale;
}

// bitwise: the backend under test shares SimCompute's erf/exp (the kernels on the host).
inline void checkGelu(sim::SimCompute& sim, Compute& other, bool bitwise) {
  Rng rng(7);
  for (DType dx : kFloating)
    for (DType dy : kFloating)
      for (const Shape& shape : elementwiseShapes()) {
        const std::vector<Layout> ls = layoutsOf(shape);
        for (const Layout& lx : ls)
          for (const Layout& ly : ls) {
            Twin x(sim, other, dx, lx.span, randomElements(dx, lx.span, rng));
            Twin y(sim, other, dy, ly.span, randomElements(dy, ly.span, rng));
            sim.gelu(x.sim(lx), y.sim(ly));
            other.gelu(x.other(lx), y.other(ly));
            const std::string what = caseName("gelu", {dx, dy}, lx.name + " -> " + ly.name + " " + shape.str());
            if (bitwise)
              expectSame(y, what);
            else
              expectGeluClose(y, geluScale(x, lx, nullptr, nullptr, ly, ly.span),
                              dx == DType::kFloat64 || dy == DType::kFloat64, what);
          }
      }
}

inline void checkGeluBackward(sim::SimCompute& sim, Compute& other, bool bitwise) {
  Rng rng(8);
  const Shape shape{3, 5, 7};
  const std::vector<Layout> ls = layoutsOf(shape);
  for (DType dx : kFloating)
    for (DType ddy : kFloating)
      for (DType ddx : kFloating)
        for (std::size_t k = 0; k < ls.size(); ++k) {
          const Layout &lx = ls[k], &ldy = ls[(k + 1) % ls.size()], &ldx = ls[(k + 2) % ls.size()];
          Twin x(sim, other, dx, lx.span, randomElements(dx, lx.span, rng));
          Twin dy(sim, other, ddy, ldy.span, randomElements(ddy, ldy.span, rng));
          Twin out(sim, other, ddx, ldx.span, randomElements(ddx, ldx.span, rng));
          sim.geluBackward(x.sim(lx), dy.sim(ldy), out.sim(ldx));
          other.geluBackward(x.other(lx), dy.other(ldy), out.other(ldx));
          const std::string what =
              caseName("geluBackward", {dx, ddy, ddx}, lx.name + ", " + ldy.name + " -> " + ldx.name);
          if (bitwise)
            expectSame(out, what);
          else
            expectGeluClose(out, geluScale(x, lx, &dy, &ldy, ldx, ldx.span),
                            dx == DType::kFloat64 || ddy == DType::kFloat64 || ddx == DType::kFloat64, what);
        }
}

// Moderate values whose magnitude grows along the matrix (so block scales differ), with a NaN, an
// infinity and an all-zero row and column planted where the shape has room.
inline Bytes mxfp8Input(DType d, const Layout& l, Rng& rng) {
  std::vector<double> values(std::size_t(l.span), 0.0);
  const std::int64_t rows = l.shape[0], cols = l.shape[1];
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) {
      double v = std::uniform_real_distribution<double>(-1.0, 1.0)(rng) * std::ldexp(1.0, int((r + 3 * c) % 30) - 15);
      if (r == 2 || c == 3) v = 0.0;
      if (r == 0 && c == 5) v = kNaN;
      if (r == 4 && c == 40) v = -kInf;
      values[std::size_t(r * l.strides[0] + c * l.strides[1])] = v;
    }
  Bytes out(std::size_t(l.span) * dtypeSize(d));
  for (std::size_t i = 0; i < values.size(); ++i) storeFromDouble(d, values[i], &out[i * dtypeSize(d)]);
  return out;
}

inline std::vector<Shape> mxfp8Shapes() {
  return {Shape{37, 70}, Shape{64, 32}, Shape{1, 1}, Shape{0, 5}, Shape{5, 0}};
}

inline Shape scaleShape(const Shape& s, int axis) {
  return axis == 1 ? Shape{s[0], (s[1] + 31) / 32} : Shape{(s[0] + 31) / 32, s[1]};
}

inline void checkQuantizeMxfp8(sim::SimCompute& sim, Compute& other) {
  Rng rng(9);
  for (DType dx : kFloating)
    for (int axis : {0, 1})
      for (const Shape& shape : mxfp8Shapes()) {
        const std::vector<Layout> ls = layoutsOf(shape), lss = layoutsOf(scaleShape(shape, axis));
        for (std::size_t k = 0; k < ls.size(); ++k) {
          const Layout &lx = ls[k], &ld = ls[(k + 1) % ls.size()], &lsc = lss[k % lss.size()];
          Twin x(sim, other, dx, lx.span, mxfp8Input(dx, lx, rng));
          Twin data(sim, other, DType::kFloat8E4M3, ld.span, randomElements(DType::kFloat8E4M3, ld.span, rng));
          Twin scales(sim, other, DType::kFloat8E8M0, lsc.span, randomElements(DType::kFloat8E8M0, lsc.span, rng));
          sim.quantizeMxfp8(x.sim(lx), data.sim(ld), scales.sim(lsc), axis);
          other.quantizeMxfp8(x.other(lx), data.other(ld), scales.other(lsc), axis);
          const std::string what = caseName("quantizeMxfp8 axis " + std::to_string(axis), {dx},
                                            lx.name + " -> " + ld.name + ", " + lsc.name + " " + shape.str());
          expectSame(data, what + " data");
          expectSame(scales, what + " scales");
        }
      }
}

inline void checkDequantizeMxfp8(sim::SimCompute& sim, Compute& other) {
  Rng rng(10);
  for (DType dy : kFloating)
    for (int axis : {0, 1})
      for (const Shape& shape : mxfp8Shapes()) {
        const std::vector<Layout> ls = layoutsOf(shape), lss = layoutsOf(scaleShape(shape, axis));
        for (std::size_t k = 0; k < ls.size(); ++k) {
          const Layout &ld = ls[k], &ly = ls[(k + 1) % ls.size()], &lsc = lss[k % lss.size()];
          Twin data(sim, other, DType::kFloat8E4M3, ld.span, randomElements(DType::kFloat8E4M3, ld.span, rng));
          Twin scales(sim, other, DType::kFloat8E8M0, lsc.span, randomElements(DType::kFloat8E8M0, lsc.span, rng));
          Twin y(sim, other, dy, ly.span, randomElements(dy, ly.span, rng));
          sim.dequantizeMxfp8(data.sim(ld), scales.sim(lsc), axis, y.sim(ly));
          other.dequantizeMxfp8(data.other(ld), scales.other(lsc), axis, y.other(ly));
          expectSame(y, caseName("dequantizeMxfp8 axis " + std::to_string(axis), {dy},
                                 ld.name + ", " + lsc.name + " -> " + ly.name + " " + shape.str()));
        }
      }
}

// n ids around the shard [first, first + vocab), some outside it, some repeated.
inline std::vector<std::int64_t> randomIds(std::int64_t n, std::int64_t first, std::int64_t vocab, Rng& rng) {
  std::vector<std::int64_t> ids(static_cast<std::size_t>(n));
  for (auto& id : ids) id = std::uniform_int_distribution<std::int64_t>(first - 3, first + vocab + 2)(rng);
  return ids;
}

inline void checkGatherRows(sim::SimCompute& sim, Compute& other) {
  Rng rng(11);
  const std::int64_t vocab = 9, h = 6, first = 100;
  for (DType dt : kFloating)
    for (DType dout : kFloating)
      for (std::int64_t n : {13, 0}) {
        const std::vector<Layout> lts = layoutsOf(Shape{vocab, h}), los = layoutsOf(Shape{n, h}),
                                  lis = layoutsOf(Shape{n});
        for (std::size_t k = 0; k < lts.size(); ++k) {
          const Layout &lt = lts[k], &lo = los[(k + 1) % los.size()], &li = lis[k % lis.size()];
          std::vector<std::int64_t> ids(std::size_t(li.span), 0);
          const std::vector<std::int64_t> drawn = randomIds(n, first, vocab, rng);
          for (std::int64_t i = 0; i < n; ++i) ids[std::size_t(i * li.strides[0])] = drawn[std::size_t(i)];
          Twin table(sim, other, dt, lt.span, randomElements(dt, lt.span, rng));
          Twin idT(sim, other, DType::kInt64, li.span, int64Elements(ids));
          Twin out(sim, other, dout, lo.span, randomElements(dout, lo.span, rng));
          sim.gatherRows(table.sim(lt), idT.sim(li), first, out.sim(lo));
          other.gatherRows(table.other(lt), idT.other(li), first, out.other(lo));
          expectSame(out, caseName("gatherRows n=" + std::to_string(n), {dt, dout},
                                   lt.name + ", ids " + li.name + " -> " + lo.name));
        }
      }
}

inline void checkScatterAddRows(sim::SimCompute& sim, Compute& other) {
  Rng rng(12);
  const std::int64_t vocab = 9, h = 6, first = 100;
  for (DType dg : kFloating)
    for (DType dt : kFloating) {
      if (!holds(dt, dg)) continue;
      for (std::int64_t n : {40, 0}) {
        const std::vector<Layout> lgs = layoutsOf(Shape{n, h}), lts = layoutsOf(Shape{vocab, h}),
                                  lis = layoutsOf(Shape{n});
        for (std::size_t k = 0; k < lgs.size(); ++k) {
          const Layout &lg = lgs[k], &lt = lts[(k + 1) % lts.size()], &li = lis[k % lis.size()];
          std::vector<std::int64_t> ids(std::size_t(li.span), 0);
          const std::vector<std::int64_t> drawn = randomIds(n, first, vocab, rng);
          for (std::int64_t i = 0; i < n; ++i) ids[std::size_t(i * li.strides[0])] = drawn[std::size_t(i)];
          Twin grad(sim, other, dg, lg.span, randomElements(dg, lg.span, rng));
          Twin idT(sim, other, DType::kInt64, li.span, int64Elements(ids));
          Twin table(sim, other, dt, lt.span, randomElements(dt, lt.span, rng));
          sim.scatterAddRows(grad.sim(lg), idT.sim(li), first, table.sim(lt));
          other.scatterAddRows(grad.other(lg), idT.other(li), first, table.other(lt));
          expectSame(table, caseName("scatterAddRows n=" + std::to_string(n), {dg, dt},
                                     lg.name + ", ids " + li.name + " -> " + lt.name));
        }
      }
    }
}

}  // namespace tpsim::gputest
