#include "sim/gelu.h"

#include <cmath>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace tpsim::sim {
namespace {

#if defined(__x86_64__)
// glibc 2.36's erff (sysdeps/ieee754/flt-32/s_erff.c), whose constants these are, bit for bit.
constexpr float kErx = 8.4506291151e-01f;
constexpr float kPp[] = {1.2837916613e-01f, -3.2504209876e-01f, -2.8481749818e-02f, -5.7702702470e-03f,
                         -2.3763017452e-05f};
constexpr float kQq[] = {3.9791721106e-01f, 6.5022252500e-02f, 5.0813062117e-03f, 1.3249473704e-04f,
                         -3.9602282413e-06f};
constexpr float kPa[] = {-2.3621185683e-03f, 4.1485610604e-01f, -3.7220788002e-01f, 3.1834661961e-01f,
                         -1.1089469492e-01f, 3.5478305072e-02f, -2.1663755178e-03f};
constexpr float kQa[] = {1.0642088205e-01f, 5.4039794207e-01f, 7.1828655899e-02f, 1.2617121637e-01f,
                         1.3637083583e-02f, 1.1984500103e-02f};
// erfc's R/S on [1.25, 1/0.35) and on [1/0.35, 6). The second pair has one coefficient fewer:
// padded with a 0 at the top, its Horner steps are the same additions (c + s·0 == c), so one
// evaluation with coefficients chosen per lane serves both.
constexpr float kRa[] = {-9.8649440333e-03f, -6.9385856390e-01f, -1.0558626175e+01f, -6.2375331879e+01f,
                         -1.6239666748e+02f, -1.8460508728e+02f, -8.1287437439e+01f, -9.8143291473e+00f};
constexpr float kSa[] = {1.9651271820e+01f, 1.3765776062e+02f, 4.3456588745e+02f, 6.4538726807e+02f,
                         4.2900814819e+02f, 1.0863500214e+02f, 6.5702495575e+00f, -6.0424413532e-02f};
constexpr float kRb[] = {-9.8649431020e-03f, -7.9928326607e-01f, -1.7757955551e+01f, -1.6063638306e+02f,
                         -6.3756646729e+02f, -1.0250950928e+03f, -4.8351919556e+02f, 0.f};
constexpr float kSb[] = {3.0338060379e+01f, 3.2579251099e+02f, 1.5367296143e+03f, 3.1998581543e+03f,
                         2.5530502930e+03f, 4.7452853394e+02f, -2.2440952301e+01f, 0.f};

// glibc 2.36's expf (sysdeps/ieee754/flt-32/e_expf.c with __exp2f_data, N = 32) as its FMA build
// compiles it: k = round(x·32/ln2) by adding 1.5·2^52 in one FMA, r = x·32/ln2 − k in another,
// 2^(k/32)·(1 + r·C2 + r²·(r·C0 + C1)).
constexpr double kInvLn2N = 0x1.71547652b82fep+5, kShift = 0x1.8p+52;
constexpr double kC0 = 0x1.c6af84b912394p-20, kC1 = 0x1.ebfce50fac4f3p-13, kC2 = 0x1.62e42ff0c52d6p-6;
constexpr std::uint64_t kExp2Table[32] = {
    0x3ff0000000000000, 0x3fefd9b0d3158574, 0x3fefb5586cf9890f, 0x3fef9301d0125b51, 0x3fef72b83c7d517b,
    0x3fef54873168b9aa, 0x3fef387a6e756238, 0x3fef1e9df51fdee1, 0x3fef06fe0a31b715, 0x3feef1a7373aa9cb,
    0x3feedea64c123422, 0x3feece086061892d, 0x3feebfdad5362a27, 0x3feeb42b569d4f82, 0x3feeab07dd485429,
    0x3feea47eb03a5585, 0x3feea09e667f3bcd, 0x3fee9f75e8ec5f74, 0x3feea11473eb0187, 0x3feea589994cce13,
    0x3feeace5422aa0db, 0x3feeb737b0cdc5e5, 0x3feec49182a3f090, 0x3feed503b23e255d, 0x3feee89f995ad3ad,
    0x3feeff76f2fb5e47, 0x3fef199bdd85529c, 0x3fef3720dcef9069, 0x3fef5818dcfba487, 0x3fef7c97337b9b5f,
    0x3fefa4afa2a490da, 0x3fefd0765b6e4540};

#define TPSIM_AVX512 __attribute__((target("avx512f"), always_inline)) inline

// expf on 8 lanes widened to double; every lane's |x| < 88 (glibc's fast path).
TPSIM_AVX512 __m256 exp8(__m256 x) {
  const __m512d invLn2N = _mm512_set1_pd(kInvLn2N), shift = _mm512_set1_pd(kShift);
  const __m512d xd = _mm512_cvtps_pd(x);
  __m512d kd = _mm512_fmadd_pd(invLn2N, xd, shift);
  const __m512i ki = _mm512_castpd_si512(kd);
  kd = _mm512_sub_pd(kd, shift);
  const __m512d r = _mm512_fmsub_pd(invLn2N, xd, kd);
  // T[ki % 32]: two 16-entry permutes, chosen by bit 4 of ki.
  const __m512i lo = _mm512_permutex2var_epi64(_mm512_loadu_si512(kExp2Table), ki, _mm512_loadu_si512(kExp2Table + 8));
  const __m512i hi =
      _mm512_permutex2var_epi64(_mm512_loadu_si512(kExp2Table + 16), ki, _mm512_loadu_si512(kExp2Table + 24));
  const __mmask8 upper = _mm512_test_epi64_mask(ki, _mm512_set1_epi64(16));
  const __m512i t = _mm512_add_epi64(_mm512_mask_blend_epi64(upper, lo, hi), _mm512_slli_epi64(ki, 47));
  const __m512d z = _mm512_fmadd_pd(_mm512_set1_pd(kC0), r, _mm512_set1_pd(kC1));
  const __m512d r2 = _mm512_mul_pd(r, r);
  __m512d y = _mm512_fmadd_pd(r, _mm512_set1_pd(kC2), _mm512_set1_pd(1.0));
  y = _mm512_fmadd_pd(z, r2, y);
  return _mm512_cvtpd_ps(_mm512_mul_pd(y, _mm512_castsi512_pd(t)));
}

TPSIM_AVX512 __m512 exp16(__m512 x) {
  const __m256 lo = exp8(_mm512_castps512_ps256(x));
  const __m256 hi = exp8(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)), _mm256_castps_pd(hi), 1));
}

// Lanes whose expf leaves glibc's fast path (|x| >= 88, NaN, infinities).
TPSIM_AVX512 __mmask16 expOutside(__m512 x) {
  const __m512i top = _mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(x), 20), _mm512_set1_epi32(0x7ff));
  return _mm512_cmpgt_epi32_mask(top, _mm512_set1_epi32(0x42a));
}

TPSIM_AVX512 __m512 withSignOf(__m512 v, __m512i signBits) {
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), signBits));
}

// erff on 16 lanes, branch by branch as glibc takes them; only the branches some lane needs run.
// *libmLanes: the lanes left to libm (NaN, infinities, |x| < 2^-28).
TPSIM_AVX512 __m512 erf16(__m512 x, __mmask16* libmLanes) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i ix = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
  const __m512i sign = _mm512_and_si512(bits, _mm512_set1_epi32(int(0x80000000u)));
  const __m512 ax = _mm512_castsi512_ps(ix), one = _mm512_set1_ps(1.f);
  const __mmask16 tiny = _mm512_cmplt_epi32_mask(ix, _mm512_set1_epi32(0x31800000));
  const __mmask16 belowB = _mm512_cmplt_epi32_mask(ix, _mm512_set1_epi32(0x3f580000));
  const __mmask16 belowC = _mm512_cmplt_epi32_mask(ix, _mm512_set1_epi32(0x3fa00000));
  const __mmask16 belowD = _mm512_cmplt_epi32_mask(ix, _mm512_set1_epi32(0x4036DB6E));
  const __mmask16 belowE = _mm512_cmplt_epi32_mask(ix, _mm512_set1_epi32(0x40c00000));
  const __mmask16 finite = _mm512_cmplt_epi32_mask(ix, _mm512_set1_epi32(0x7f800000));
  const __mmask16 a = belowB & ~tiny, b = belowC & ~belowB, cd = belowE & ~belowC, e = finite & ~belowE;
  *libmLanes = __mmask16(~(a | b | cd | e));
  __m512 result = _mm512_setzero_ps();
  if (a) {  // 2^-28 <= |x| < 0.84375: x + x·(r/s)
    const __m512 z = _mm512_mul_ps(x, x);
    __m512 r = _mm512_set1_ps(kPp[4]), s = _mm512_set1_ps(kQq[4]);
    for (int i = 3; i >= 0; --i) r = _mm512_add_ps(_mm512_set1_ps(kPp[i]), _mm512_mul_ps(z, r));
    for (int i = 3; i >= 0; --i) s = _mm512_add_ps(_mm512_set1_ps(kQq[i]), _mm512_mul_ps(z, s));
    s = _mm512_add_ps(one, _mm512_mul_ps(z, s));
    result = _mm512_mask_mov_ps(result, a, _mm512_add_ps(x, _mm512_mul_ps(x, _mm512_div_ps(r, s))));
  }
  if (b) {  // 0.84375 <= |x| < 1.25: ±(erx + P/Q); -erx - P/Q is the negation of erx + P/Q
    const __m512 s = _mm512_sub_ps(ax, one);
    __m512 p = _mm512_set1_ps(kPa[6]), q = _mm512_set1_ps(kQa[5]);
    for (int i = 5; i >= 0; --i) p = _mm512_add_ps(_mm512_set1_ps(kPa[i]), _mm512_mul_ps(s, p));
    for (int i = 4; i >= 0; --i) q = _mm512_add_ps(_mm512_set1_ps(kQa[i]), _mm512_mul_ps(s, q));
    q = _mm512_add_ps(one, _mm512_mul_ps(s, q));
    const __m512 v = _mm512_add_ps(_mm512_set1_ps(kErx), _mm512_div_ps(p, q));
    result = _mm512_mask_mov_ps(result, b, withSignOf(v, sign));
  }
  if (cd) {  // 1.25 <= |x| < 6: ±(1 - exp(-z²-0.5625)·exp((z-|x|)(z+|x|) + R/S)/|x|)
    const __mmask16 far = ~belowD;  // |x| >= 1/0.35
    const __m512 s = _mm512_div_ps(one, _mm512_mul_ps(x, x));
    __m512 r = _mm512_mask_blend_ps(far, _mm512_set1_ps(kRa[7]), _mm512_set1_ps(kRb[7]));
    __m512 q = _mm512_mask_blend_ps(far, _mm512_set1_ps(kSa[7]), _mm512_set1_ps(kSb[7]));
    for (int i = 6; i >= 0; --i) {
      r = _mm512_add_ps(_mm512_mask_blend_ps(far, _mm512_set1_ps(kRa[i]), _mm512_set1_ps(kRb[i])),
                        _mm512_mul_ps(s, r));
      q = _mm512_add_ps(_mm512_mask_blend_ps(far, _mm512_set1_ps(kSa[i]), _mm512_set1_ps(kSb[i])),
                        _mm512_mul_ps(s, q));
    }
    q = _mm512_add_ps(one, _mm512_mul_ps(s, q));
    const __m512 z = _mm512_castsi512_ps(_mm512_and_si512(ix, _mm512_set1_epi32(int(0xfffff000u))));
    const __m512 e1 =
        exp16(_mm512_sub_ps(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), z), z), _mm512_set1_ps(0.5625f)));
    const __m512 e2 =
        exp16(_mm512_add_ps(_mm512_mul_ps(_mm512_sub_ps(z, ax), _mm512_add_ps(z, ax)), _mm512_div_ps(r, q)));
    const __m512 v = _mm512_sub_ps(one, _mm512_div_ps(_mm512_mul_ps(e1, e2), ax));
    result = _mm512_mask_mov_ps(result, cd, withSignOf(v, sign));
  }
  if (e) {  // 6 <= |x| < inf: ±(1 - 1e-30), which rounds to ±1
    const __m512 v = _mm512_sub_ps(one, _mm512_set1_ps(1e-30f));
    result = _mm512_mask_mov_ps(result, e, withSignOf(v, sign));
  }
  return result;
}

__attribute__((target("avx512f"))) void gelu16(const float* x, float* y, std::int64_t n) {
  const __m512 sqrtHalf = _mm512_set1_ps(kGeluSqrtHalf), half = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.f);
  for (std::int64_t i = 0; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    __mmask16 libm;
    const __m512 erf = erf16(_mm512_mul_ps(v, sqrtHalf), &libm);
    _mm512_storeu_ps(y + i, _mm512_mul_ps(_mm512_mul_ps(v, half), _mm512_add_ps(one, erf)));
    for (int l = 0; libm; ++l, libm >>= 1)
      if (libm & 1) y[i + l] = geluOf(x[i + l]);
  }
}

__attribute__((target("avx512f"))) void geluBackward16(const float* x, const float* dy, float* dx, std::int64_t n) {
  const __m512 sqrtHalf = _mm512_set1_ps(kGeluSqrtHalf), half = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.f);
  const __m512 minusHalf = _mm512_set1_ps(-0.5f), invSqrt2Pi = _mm512_set1_ps(kGeluInvSqrt2Pi);
  for (std::int64_t i = 0; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    __mmask16 libm;
    const __m512 cdf = _mm512_mul_ps(half, _mm512_add_ps(one, erf16(_mm512_mul_ps(v, sqrtHalf), &libm)));
    const __m512 arg = _mm512_mul_ps(_mm512_mul_ps(minusHalf, v), v);
    libm |= expOutside(arg);
    const __m512 pdf = _mm512_mul_ps(exp16(arg), invSqrt2Pi);
    const __m512 d = _mm512_mul_ps(_mm512_loadu_ps(dy + i), _mm512_add_ps(cdf, _mm512_mul_ps(v, pdf)));
    _mm512_storeu_ps(dx + i, d);
    for (int l = 0; libm; ++l, libm >>= 1)
      if (libm & 1) dx[i + l] = geluBackwardOf(x[i + l], dy[i + l]);
  }
}

#define TPSIM_AVX2 __attribute__((target("avx2,fma"), always_inline)) inline

// The same two functions on 8 lanes of AVX2: masks are lanes of all ones, the table is gathered.
// (Names differ from the AVX-512 ones: same-named functions of two targets would be multiversioned.)
// expf on 4 lanes widened to double; every lane's |x| < 88.
TPSIM_AVX2 __m128 exp4(__m128 x) {
  const __m256d invLn2N = _mm256_set1_pd(kInvLn2N), shift = _mm256_set1_pd(kShift);
  const __m256d xd = _mm256_cvtps_pd(x);
  __m256d kd = _mm256_fmadd_pd(invLn2N, xd, shift);
  const __m256i ki = _mm256_castpd_si256(kd);
  kd = _mm256_sub_pd(kd, shift);
  const __m256d r = _mm256_fmsub_pd(invLn2N, xd, kd);
  const __m256i entry = _mm256_i64gather_epi64(reinterpret_cast<const long long*>(kExp2Table),
                                               _mm256_and_si256(ki, _mm256_set1_epi64x(31)), 8);
  const __m256i t = _mm256_add_epi64(entry, _mm256_slli_epi64(ki, 47));
  const __m256d z = _mm256_fmadd_pd(_mm256_set1_pd(kC0), r, _mm256_set1_pd(kC1));
  const __m256d r2 = _mm256_mul_pd(r, r);
  __m256d y = _mm256_fmadd_pd(r, _mm256_set1_pd(kC2), _mm256_set1_pd(1.0));
  y = _mm256_fmadd_pd(z, r2, y);
  return _mm256_cvtpd_ps(_mm256_mul_pd(y, _mm256_castsi256_pd(t)));
}

TPSIM_AVX2 __m256 exp8Avx2(__m256 x) {
  return _mm256_set_m128(exp4(_mm256_extractf128_ps(x, 1)), exp4(_mm256_castps256_ps128(x)));
}

TPSIM_AVX2 __m256i below8(__m256i ix, int bound) { return _mm256_cmpgt_epi32(_mm256_set1_epi32(bound), ix); }
TPSIM_AVX2 bool any8(__m256i mask) { return !_mm256_testz_si256(mask, mask); }
TPSIM_AVX2 __m256 where8(__m256i mask, __m256 v, __m256 otherwise) {
  return _mm256_blendv_ps(otherwise, v, _mm256_castsi256_ps(mask));
}

TPSIM_AVX2 __m256i expOutside8(__m256 x) {
  const __m256i top = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(x), 20), _mm256_set1_epi32(0x7ff));
  return _mm256_cmpgt_epi32(top, _mm256_set1_epi32(0x42a));
}

TPSIM_AVX2 __m256 withSignOf8(__m256 v, __m256i signBits) {
  return _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(v), signBits));
}

// erf16's branches on 8 lanes. *libmLanes: the lanes left to libm, a bit each.
TPSIM_AVX2 __m256 erf8(__m256 x, int* libmLanes) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i ix = _mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff));
  const __m256i sign = _mm256_and_si256(bits, _mm256_set1_epi32(int(0x80000000u)));
  const __m256 ax = _mm256_castsi256_ps(ix), one = _mm256_set1_ps(1.f);
  const __m256i tiny = below8(ix, 0x31800000), belowB = below8(ix, 0x3f580000), belowC = below8(ix, 0x3fa00000);
  const __m256i belowD = below8(ix, 0x4036DB6E), belowE = below8(ix, 0x40c00000), finite = below8(ix, 0x7f800000);
  const __m256i a = _mm256_andnot_si256(tiny, belowB), b = _mm256_andnot_si256(belowB, belowC);
  const __m256i cd = _mm256_andnot_si256(belowC, belowE), e = _mm256_andnot_si256(belowE, finite);
  const __m256i vector = _mm256_or_si256(_mm256_or_si256(a, b), _mm256_or_si256(cd, e));
  *libmLanes = ~_mm256_movemask_ps(_mm256_castsi256_ps(vector)) & 0xff;
  __m256 result = _mm256_setzero_ps();
  if (any8(a)) {
    const __m256 z = _mm256_mul_ps(x, x);
    __m256 r = _mm256_set1_ps(kPp[4]), s = _mm256_set1_ps(kQq[4]);
    for (int i = 3; i >= 0; --i) r = _mm256_add_ps(_mm256_set1_ps(kPp[i]), _mm256_mul_ps(z, r));
    for (int i = 3; i >= 0; --i) s = _mm256_add_ps(_mm256_set1_ps(kQq[i]), _mm256_mul_ps(z, s));
    s = _mm256_add_ps(one, _mm256_mul_ps(z, s));
    result = where8(a, _mm256_add_ps(x, _mm256_mul_ps(x, _mm256_div_ps(r, s))), result);
  }
  if (any8(b)) {
    const __m256 s = _mm256_sub_ps(ax, one);
    __m256 p = _mm256_set1_ps(kPa[6]), q = _mm256_set1_ps(kQa[5]);
    for (int i = 5; i >= 0; --i) p = _mm256_add_ps(_mm256_set1_ps(kPa[i]), _mm256_mul_ps(s, p));
    for (int i = 4; i >= 0; --i) q = _mm256_add_ps(_mm256_set1_ps(kQa[i]), _mm256_mul_ps(s, q));
    q = _mm256_add_ps(one, _mm256_mul_ps(s, q));
    const __m256 v = _mm256_add_ps(_mm256_set1_ps(kErx), _mm256_div_ps(p, q));
    result = where8(b, withSignOf8(v, sign), result);
  }
  if (any8(cd)) {
    const __m256i far = _mm256_xor_si256(belowD, _mm256_set1_epi32(-1));
    const __m256 s = _mm256_div_ps(one, _mm256_mul_ps(x, x));
    __m256 r = where8(far, _mm256_set1_ps(kRb[7]), _mm256_set1_ps(kRa[7]));
    __m256 q = where8(far, _mm256_set1_ps(kSb[7]), _mm256_set1_ps(kSa[7]));
    for (int i = 6; i >= 0; --i) {
      r = _mm256_add_ps(where8(far, _mm256_set1_ps(kRb[i]), _mm256_set1_ps(kRa[i])), _mm256_mul_ps(s, r));
      q = _mm256_add_ps(where8(far, _mm256_set1_ps(kSb[i]), _mm256_set1_ps(kSa[i])), _mm256_mul_ps(s, q));
    }
    q = _mm256_add_ps(one, _mm256_mul_ps(s, q));
    const __m256 z = _mm256_castsi256_ps(_mm256_and_si256(ix, _mm256_set1_epi32(int(0xfffff000u))));
    const __m256 e1 =
        exp8Avx2(_mm256_sub_ps(_mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), z), z), _mm256_set1_ps(0.5625f)));
    const __m256 e2 =
        exp8Avx2(_mm256_add_ps(_mm256_mul_ps(_mm256_sub_ps(z, ax), _mm256_add_ps(z, ax)), _mm256_div_ps(r, q)));
    const __m256 v = _mm256_sub_ps(one, _mm256_div_ps(_mm256_mul_ps(e1, e2), ax));
    result = where8(cd, withSignOf8(v, sign), result);
  }
  if (any8(e)) {
    const __m256 v = _mm256_sub_ps(one, _mm256_set1_ps(1e-30f));
    result = where8(e, withSignOf8(v, sign), result);
  }
  return result;
}

__attribute__((target("avx2,fma"))) void gelu8(const float* x, float* y, std::int64_t n) {
  const __m256 sqrtHalf = _mm256_set1_ps(kGeluSqrtHalf), half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.f);
  for (std::int64_t i = 0; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    int libm;
    const __m256 erf = erf8(_mm256_mul_ps(v, sqrtHalf), &libm);
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(v, half), _mm256_add_ps(one, erf)));
    for (int l = 0; libm; ++l, libm >>= 1)
      if (libm & 1) y[i + l] = geluOf(x[i + l]);
  }
}

__attribute__((target("avx2,fma"))) void geluBackward8(const float* x, const float* dy, float* dx, std::int64_t n) {
  const __m256 sqrtHalf = _mm256_set1_ps(kGeluSqrtHalf), half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.f);
  const __m256 minusHalf = _mm256_set1_ps(-0.5f), invSqrt2Pi = _mm256_set1_ps(kGeluInvSqrt2Pi);
  for (std::int64_t i = 0; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    int libm;
    const __m256 cdf = _mm256_mul_ps(half, _mm256_add_ps(one, erf8(_mm256_mul_ps(v, sqrtHalf), &libm)));
    const __m256 arg = _mm256_mul_ps(_mm256_mul_ps(minusHalf, v), v);
    libm |= _mm256_movemask_ps(_mm256_castsi256_ps(expOutside8(arg)));
    const __m256 pdf = _mm256_mul_ps(exp8Avx2(arg), invSqrt2Pi);
    const __m256 d = _mm256_mul_ps(_mm256_loadu_ps(dy + i), _mm256_add_ps(cdf, _mm256_mul_ps(v, pdf)));
    _mm256_storeu_ps(dx + i, d);
    for (int l = 0; libm; ++l, libm >>= 1)
      if (libm & 1) dx[i + l] = geluBackwardOf(x[i + l], dy[i + l]);
  }
}

// Every branch of both functions and their edges: a spread of float bit patterns over the
// magnitudes GeLU reaches (with both signs, so erf's arguments cover all its ranges and exp's
// reach past -88), the branch bounds and their neighbours, and the special values.
std::vector<float> probeInputs() {
  std::vector<float> in;
  auto add = [&](std::uint32_t bits) {
    for (std::uint32_t s : {0u, 0x80000000u}) {
      float v;
      const std::uint32_t b = bits | s;
      std::memcpy(&v, &b, sizeof v);
      in.push_back(v);
    }
  };
  for (std::uint32_t b = 0x30000000; b < 0x42000000; b += 0x1f3b) add(b);
  for (std::uint32_t bound : {0x31800000u, 0x3f580000u, 0x3fa00000u, 0x4036DB6Eu, 0x40c00000u})
    for (std::uint32_t d = 0; d < 64; ++d) {
      add(bound - 32 + d);  // erf's argument: the bound itself, scaled back to GeLU's input
      float t;
      const std::uint32_t b = bound - 32 + d;
      std::memcpy(&t, &b, sizeof t);
      in.push_back(t * 1.41421356f);
    }
  for (float v : {0.f, -1e-30f, 1e-38f, 3.f, 13.3f, 13.4f, 14.f, 1e30f, INFINITY, -INFINITY, NAN}) in.push_back(v);
  while (in.size() % 16) in.push_back(1.f);  // whole vectors of either width
  return in;
}

bool probeMatches(GeluIsa isa, float (*gelu)(float), float (*backward)(float, float)) {
  const std::vector<float> in = probeInputs();
  const std::int64_t n = std::int64_t(in.size());
  std::vector<float> dy(in.size()), y(in.size()), dx(in.size());
  for (std::size_t i = 0; i < in.size(); ++i) dy[i] = 1.f + float(i % 7) * 0.25f;
  vectorGelu(isa, in.data(), y.data(), n);
  vectorGeluBackward(isa, in.data(), dy.data(), dx.data(), n);
  // A NaN's sign and payload follow the compiler's operand order, not the formula: any NaN will do.
  auto same = [](float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0 || (std::isnan(a) && std::isnan(b)); };
  for (std::size_t i = 0; i < in.size(); ++i)
    if (!same(y[i], gelu(in[i])) || !same(dx[i], backward(in[i], dy[i]))) return false;
  return true;
}
#endif

}  // namespace

const char* geluIsaName(GeluIsa isa) { return isa == GeluIsa::kAvx512 ? "avx512" : "avx2"; }

bool geluIsaRuns([[maybe_unused]] GeluIsa isa) {
#if defined(__x86_64__)
  if (isa == GeluIsa::kAvx512) return __builtin_cpu_supports("avx512f");
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

std::optional<GeluIsa> vectorGeluIsa() {
  static const std::optional<GeluIsa> chosen = []() -> std::optional<GeluIsa> {
    for (GeluIsa isa : {GeluIsa::kAvx512, GeluIsa::kAvx2})
      if (geluIsaRuns(isa) && vectorGeluMatches(isa, geluOf, geluBackwardOf)) return isa;
    return std::nullopt;
  }();
  return chosen;
}

bool vectorGeluMatches([[maybe_unused]] GeluIsa isa, [[maybe_unused]] float (*gelu)(float),
                       [[maybe_unused]] float (*backward)(float, float)) {
#if defined(__x86_64__)
  return probeMatches(isa, gelu, backward);
#else
  return false;
#endif
}

void vectorGelu([[maybe_unused]] GeluIsa isa, const float* x, float* y, std::int64_t n) {
  std::int64_t whole = 0;
#if defined(__x86_64__)
  const std::int64_t lanes = isa == GeluIsa::kAvx512 ? 16 : 8;
  whole = n / lanes * lanes;
  if (isa == GeluIsa::kAvx512) gelu16(x, y, whole);
  else gelu8(x, y, whole);
#endif
  for (std::int64_t i = whole; i < n; ++i) y[i] = geluOf(x[i]);
}

void vectorGeluBackward([[maybe_unused]] GeluIsa isa, const float* x, const float* dy, float* dx, std::int64_t n) {
  std::int64_t whole = 0;
#if defined(__x86_64__)
  const std::int64_t lanes = isa == GeluIsa::kAvx512 ? 16 : 8;
  whole = n / lanes * lanes;
  if (isa == GeluIsa::kAvx512) geluBackward16(x, dy, dx, whole);
  else geluBackward8(x, dy, dx, whole);
#endif
  for (std::int64_t i = whole; i < n; ++i) dx[i] = geluBackwardOf(x[i], dy[i]);
}

}  // namespace tpsim::sim
