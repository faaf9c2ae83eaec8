// SIMD abstraction used by every native CPU kernel of pagedserve.
//
// Each instruction set is a struct of static functions over one float vector type
// (`V`, `W` lanes).  Kernels are templates over that struct, so one kernel source
// yields an AVX-512, an AVX2 and a portable build.  Which structs exist is decided at
// compile time by the architecture flags (-mavx512f ... / -mavx2 -mfma); which one
// runs is decided at run time from the CPU's features (see bindings.cpp).
//
// Storage types: float, BF16 and F16 (16-bit patterns).  All arithmetic is float32;
// conversions to 16-bit types round to nearest even, as torch does.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__)
#define PAGEDSERVE_HAVE_AVX512 1
#endif
#if defined(PAGEDSERVE_HAVE_AVX512) && defined(__AVX512BF16__)
#define PAGEDSERVE_HAVE_AVX512BF16 1
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PAGEDSERVE_HAVE_AVX2 1
#endif

namespace pagedserve_cpu {

struct BF16 {
  uint16_t bits;
};
struct F16 {
  uint16_t bits;
};
// 8-bit float KV cache elements (torch.float8_e4m3fn, torch.float8_e5m2): only loaded,
// never stored, by the kernels (the cache write is a saturating cast in torch).
struct FP8E4M3 {
  uint8_t bits;
};
struct FP8E5M2 {
  uint8_t bits;
};
// int8 KV cache elements (torch.int8): a row is D of them followed by the row's float32
// scale (kernels/reference.py, quantize_kv_int8); loaded as integers, scaled per row.
struct I8S {
  int8_t bits;
};
// Row-scaled 8-bit float KV cache elements: a row is D of them followed by the row's
// float32 scale (kernels/reference.py, quantize_kv_rows); loaded as their unscaled
// format, scaled per row.
struct FP8E4M3S {
  uint8_t bits;
};
struct FP8E5M2S {
  uint8_t bits;
};
// Whether rows of KV element type KT carry a float32 scale after their D values.
template <typename KT>
inline constexpr bool kRowScaled =
    std::is_same_v<KT, I8S> || std::is_same_v<KT, FP8E4M3S> || std::is_same_v<KT, FP8E5M2S>;
// The scale of a row of D values of a scaled KV cache.
template <int D, typename KT>
inline float row_scale(const KT* row) {
  float s;
  std::memcpy(&s, reinterpret_cast<const char*>(row + D), sizeof s);
  return s;
}

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ---- scalar conversions (tails and the portable path) -------------------------------
inline float to_float(float x) { return x; }
inline float to_float(BF16 x) {
  const uint32_t u = uint32_t(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline float to_float(F16 x) {
  _Float16 h;
  std::memcpy(&h, &x.bits, sizeof h);
  return float(h);
}

template <typename T>
inline T from_float(float f);
template <>
inline float from_float<float>(float f) {
  return f;
}
template <>
inline BF16 from_float<BF16>(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return BF16{0x7fc0};  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);                             // round to nearest even
  return BF16{uint16_t(u >> 16)};
}
template <>
inline F16 from_float<F16>(float f) {
  const _Float16 h = static_cast<_Float16>(f);
  F16 r;
  std::memcpy(&r.bits, &h, sizeof r.bits);
  return r;
}

// Rounds a float to the precision of T and back (emulates an op computed in T).
template <typename T>
inline float round_to(float f) {
  return to_float(from_float<T>(f));
}

// Cephes-style exp constants (about 1 ulp in float32).
namespace expc {
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kC1 = 0.693359375f;
constexpr float kC2 = -2.12194440e-4f;
constexpr float kP0 = 1.9875691500e-4f;
constexpr float kP1 = 1.3981999507e-3f;
constexpr float kP2 = 8.3334519073e-3f;
constexpr float kP3 = 4.1665795894e-2f;
constexpr float kP4 = 1.6666665459e-1f;
constexpr float kP5 = 5.0000001201e-1f;
// Below kLo the result is (at most) a denormal: flushed to 0.  Inputs are clamped to
// kHi so that 2^n stays a normal float; above kOverflow the result is +inf.
constexpr float kLo = -87.33654475f;
constexpr float kHi = 88.0f;
constexpr float kOverflow = 88.72283935f;

// exp(r) for |r| <= ln2 / 2 as the polynomial 1 + r + r^2 * P(r), in ISA S's vectors (the
// SIMD structs' exp: n = round(x * log2e), r = x - n * ln2, exp(x) = exp(r) * 2^n).
template <class S>
inline typename S::V poly(typename S::V r) {
  typename S::V y = S::set1(kP0);
  y = S::fma(y, r, S::set1(kP1));
  y = S::fma(y, r, S::set1(kP2));
  y = S::fma(y, r, S::set1(kP3));
  y = S::fma(y, r, S::set1(kP4));
  y = S::fma(y, r, S::set1(kP5));
  return S::fma(y, S::mul(r, r), S::add(r, S::set1(1.f)));
}
}  // namespace expc

// ---- portable path: GCC/Clang generic vectors of 8 floats ----------------------------
// The compiler lowers them to whatever SIMD the flags allow (or to scalar code), which
// keeps this path portable and cheap to compile.
struct Scalar {
  static constexpr int W = 8;
  static constexpr int kMaxAccRegs = 8;
  typedef float V __attribute__((vector_size(32)));
  typedef int32_t VI __attribute__((vector_size(32)));
  static V zero() { return set1(0.f); }
  static V set1(float x) { return V{x, x, x, x, x, x, x, x}; }
  static V load(const float* p) {
    V r;
    std::memcpy(&r, p, sizeof r);
    return r;
  }
  template <typename T>
  static V load(const T* p) {
    V r;
    for (int i = 0; i < W; ++i) r[i] = to_float(p[i]);
    return r;
  }
  static void store(float* p, V a) { std::memcpy(p, &a, sizeof a); }
  template <typename T>
  static void store(T* p, V a) {
    for (int i = 0; i < W; ++i) p[i] = from_float<T>(a[i]);
  }
  template <typename T>
  static V round(V a) {
    if constexpr (!std::is_same_v<T, float>)
      for (int i = 0; i < W; ++i) a[i] = round_to<T>(a[i]);
    return a;
  }
  static V add(V a, V b) { return a + b; }
  static V sub(V a, V b) { return a - b; }
  static V mul(V a, V b) { return a * b; }
  static V div(V a, V b) { return a / b; }
  static V max(V a, V b) { return a > b ? a : b; }
  static V fma(V a, V b, V c) { return a * b + c; }
  static V exp(V a) {
    for (int i = 0; i < W; ++i) a[i] = std::exp(a[i]);
    return a;
  }
  static float reduce_add(V a) {
    float s = 0.f;
    for (int i = 0; i < W; ++i) s += a[i];
    return s;
  }
  static float reduce_max(V a) {
    float m = a[0];
    for (int i = 1; i < W; ++i) m = a[i] > m ? a[i] : m;
    return m;
  }
  // Lanes >= n take `fill`.
  static V mask_tail(V a, int n, float fill) {
    const VI idx{0, 1, 2, 3, 4, 5, 6, 7};
    const VI nv{n, n, n, n, n, n, n, n};
    return idx < nv ? a : set1(fill);
  }
  // W vectors in, one out: lane i holds the horizontal sum of a[i].
  static V reduce_tree(const V* a) {
    V r;
    for (int i = 0; i < W; ++i) r[i] = reduce_add(a[i]);
    return r;
  }
};

#if defined(PAGEDSERVE_HAVE_AVX2)
struct Avx2 {
  static constexpr int W = 8;
  // 16 ymm registers: keep accumulator chunks to half of them.
  static constexpr int kMaxAccRegs = 8;
  using V = __m256;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const BF16* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static V load(const F16* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store(float* p, V a) { _mm256_storeu_ps(p, a); }
  static __m128i bf16_bits(V a) {
    const __m256i u = _mm256_castps_si256(a);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    const __m256 nan = _mm256_cmp_ps(a, a, _CMP_UNORD_Q);
    r = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r),
                                             _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)), nan));
    r = _mm256_srli_epi32(r, 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  }
  static void store(BF16* p, V a) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bf16_bits(a)); }
  static void store(F16* p, V a) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  template <typename T>
  static V round(V a) {
    if constexpr (std::is_same_v<T, BF16>) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bf16_bits(a)), 16));
    } else if constexpr (std::is_same_v<T, F16>) {
      return _mm256_cvtph_ps(_mm256_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    } else {
      return a;
    }
  }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V exp(V x) {
    using namespace expc;
    const V xc = _mm256_min_ps(_mm256_max_ps(x, set1(kLo)), set1(kHi));
    const V fx = _mm256_round_ps(_mm256_mul_ps(xc, set1(kLog2e)),
                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    V r = _mm256_fnmadd_ps(fx, set1(kC1), xc);
    r = _mm256_fnmadd_ps(fx, set1(kC2), r);
    V y = poly<Avx2>(r);
    const __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(n));
    y = _mm256_blendv_ps(y, zero(), _mm256_cmp_ps(x, set1(kLo), _CMP_LT_OQ));
    y = _mm256_blendv_ps(y, set1(std::numeric_limits<float>::infinity()),
                         _mm256_cmp_ps(x, set1(kOverflow), _CMP_GT_OQ));
    return _mm256_blendv_ps(y, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));  // NaN in, NaN out
  }
  static float reduce_add(V a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static float reduce_max(V a) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static V mask_tail(V a, int n, float fill) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), idx));
    return _mm256_blendv_ps(set1(fill), a, keep);
  }
  // Transpose-and-add tree: 8 vectors -> lane i = sum(a[i]) in 7*3 + 3 instructions
  // instead of 8 separate horizontal sums.
  static V reduce_tree(const V* a) {
    V c[4], d[2];
    for (int i = 0; i < 4; ++i)
      c[i] = _mm256_add_ps(_mm256_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                           _mm256_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 2; ++i) {
      const __m256d x = _mm256_castps_pd(c[2 * i]), y = _mm256_castps_pd(c[2 * i + 1]);
      d[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)),
                           _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
    }
    return _mm256_add_ps(_mm256_permute2f128_ps(d[0], d[1], 0x20),
                         _mm256_permute2f128_ps(d[0], d[1], 0x31));
  }
};
#endif  // PAGEDSERVE_HAVE_AVX2

#if defined(PAGEDSERVE_HAVE_AVX512)
struct Avx512 {
  static constexpr int W = 16;
  static constexpr int kMaxAccRegs = 20;  // of 32 zmm registers
  using V = __m512;
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const BF16* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static V load(const F16* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  // e5m2 is the upper byte of an fp16: widen, shift, VCVTPH2PS (exact, inf/NaN included).
  static V load(const FP8E5M2* p) {
    const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm512_cvtph_ps(_mm256_slli_epi16(w, 8));
  }
  // e4m3fn (bias 7, no inf): sign to bit 15, exponent and mantissa to bits 13..7 of an
  // fp16 (bias 15), times 2^8; subnormals map to fp16 subnormals, so this is exact.
  // 0x7f/0xff are NaN.
  static V load(const FP8E4M3* p) {
    const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i em = _mm256_and_si256(w, _mm256_set1_epi16(0x7f));
    const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8),
                                      _mm256_slli_epi16(em, 7));
    const V f = _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
    const __mmask16 nan = _mm256_cmpeq_epi16_mask(em, _mm256_set1_epi16(0x7f));
    return _mm512_mask_blend_ps(nan, f, _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
  }
  // Row-scaled fp8: the values as unscaled fp8 (the row's scale is applied by the caller).
  static V load(const FP8E5M2S* p) { return load(reinterpret_cast<const FP8E5M2*>(p)); }
  static V load(const FP8E4M3S* p) { return load(reinterpret_cast<const FP8E4M3*>(p)); }
  // int8 values widened exactly (the row's scale is applied by the caller).
  static V load(const I8S* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static void store(float* p, V a) { _mm512_storeu_ps(p, a); }
  // Integer round-to-nearest-even rather than VCVTNEPS2BF16, which flushes denormals
  // and would differ from torch's conversion.
  static __m256i bf16_bits(V a) {
    const __m512i u = _mm512_castps_si512(a);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    const __mmask16 nan = _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
    r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7fc00000));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
  }
  static void store(BF16* p, V a) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_bits(a));
  }
  static void store(F16* p, V a) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  template <typename T>
  static V round(V a) {
    if constexpr (std::is_same_v<T, BF16>) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_bits(a)), 16));
    } else if constexpr (std::is_same_v<T, F16>) {
      return _mm512_cvtph_ps(_mm512_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    } else {
      return a;
    }
  }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V exp(V x) {
    using namespace expc;
    const V xc = _mm512_min_ps(_mm512_max_ps(x, set1(kLo)), set1(kHi));
    const V fx = _mm512_roundscale_ps(_mm512_mul_ps(xc, set1(kLog2e)),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    V r = _mm512_fnmadd_ps(fx, set1(kC1), xc);
    r = _mm512_fnmadd_ps(fx, set1(kC2), r);
    V y = poly<Avx512>(r);
    const __m512i n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
    y = _mm512_mul_ps(y, _mm512_castsi512_ps(n));
    y = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, set1(kLo), _CMP_LT_OQ), y, zero());
    y = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, set1(kOverflow), _CMP_GT_OQ), y,
                             set1(std::numeric_limits<float>::infinity()));
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), y, x);
  }
  static float reduce_add(V a) { return _mm512_reduce_add_ps(a); }
  static float reduce_max(V a) { return _mm512_reduce_max_ps(a); }
  static V mask_tail(V a, int n, float fill) {
    const __mmask16 keep = n >= W ? __mmask16(0xffff) : __mmask16((1u << n) - 1u);
    return _mm512_mask_blend_ps(keep, set1(fill), a);
  }
  // Transpose-and-add tree: 16 vectors -> lane i = sum(a[i]) in 45 instructions
  // instead of 16 separate horizontal sums (about 8 each).
  static V reduce_tree(const V* a) {
    V c[8], d[4], e[2];
    for (int i = 0; i < 8; ++i)  // lanes: even = a[2i], odd = a[2i+1] partials
      c[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                           _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {  // each 128-bit lane: [a4i, a4i+1, a4i+2, a4i+3]
      const __m512d x = _mm512_castps_pd(c[2 * i]), y = _mm512_castps_pd(c[2 * i + 1]);
      d[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                           _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; ++i)  // 128-bit lanes: [d2i A, d2i B, d2i+1 A, d2i+1 B]
      e[i] = _mm512_add_ps(_mm512_shuffle_f32x4(d[2 * i], d[2 * i + 1], 0x88),
                           _mm512_shuffle_f32x4(d[2 * i], d[2 * i + 1], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(e[0], e[1], 0x88),
                         _mm512_shuffle_f32x4(e[0], e[1], 0xdd));
  }
};
#endif  // PAGEDSERVE_HAVE_AVX512

#if defined(PAGEDSERVE_HAVE_AVX512BF16)
// AVX-512 with the BF16 extension: float32 -> bf16 in one VCVTNEPS2BF16, which rounds to
// nearest even like torch.  It flushes denormals and keeps NaN payloads, where torch
// keeps denormals and writes 0x7fc0; VFPCLASSPS finds those lanes (rare) and they take
// Avx512's integer path, so the bits are torch's in every case.
struct Avx512Bf16 : Avx512 {
  using Avx512::store;
  static constexpr int kSpecial = 0x01 | 0x20 | 0x80;  // quiet NaN, denormal, signalling NaN
  static __m256i bf16_bits(V a) {
    if (_mm512_fpclass_ps_mask(a, kSpecial)) [[unlikely]]
      return Avx512::bf16_bits(a);
    return (__m256i)_mm512_cvtneps_pbh(a);
  }
  static void store(BF16* p, V a) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_bits(a)); }
  template <typename T>
  static V round(V a) {
    if constexpr (std::is_same_v<T, BF16>) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_bits(a)), 16));
    } else {
      return Avx512::round<T>(a);
    }
  }
};
#endif  // PAGEDSERVE_HAVE_AVX512BF16

}  // namespace pagedserve_cpu
