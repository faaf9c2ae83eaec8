// Paged attention over the reference KV layout, templated over the instruction set.
//
// One work item = one sequence x a range of kv heads x a tile of query tokens x a
// range of keys.  All query heads of a kv head's group are processed together so each
// K/V row read from the cache (in place, through the block table) serves the whole
// group; taking several kv heads per item reads each block as one contiguous run.
// Softmax is online (flash-attention style) in float32, one span of up to 64 keys
// (several cache blocks) at a time.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "vec.h"

namespace pagedserve_cpu {

// Software prefetch of the K/V rows a work item will read, in the order it reads them,
// paced by what it consumes.  The blocks are scattered through the cache, so the
// hardware prefetchers cannot see the next one coming.  The cursor starts kLeadLines
// ahead of the compute; every row the compute then takes moves it on by as many
// lines, so a steady few prefetches are in flight at all times.  Issuing a whole span's
// rows at once instead (hundreds of lines) fills the core's miss buffers, and the core
// then waits for memory and computes in turn rather than at once.
struct KvPrefetcher {
  struct Run {
    const char* p;  // 64-byte aligned
    int64_t lines;
  };
  std::vector<Run> runs;
  size_t run = 0;
  int64_t line = 0;

  void clear() {
    runs.clear();
    run = 0;
    line = 0;
  }
  void add(const void* p, int64_t bytes) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p), first = a / 64, last = (a + bytes - 1) / 64;
    runs.push_back({reinterpret_cast<const char*>(first * 64), int64_t(last - first + 1)});
  }
  // Prefetch (into L2) the next n lines.
  void pump(int64_t n) {
    while (n > 0 && run < runs.size()) {
      const Run& r = runs[run];
      const int64_t take = std::min(n, r.lines - line);
      for (int64_t i = 0; i < take; ++i) __builtin_prefetch(r.p + (line + i) * 64, 0, 2);
      line += take;
      n -= take;
      if (line == r.lines) {
        ++run;
        line = 0;
      }
    }
  }
};

// Per-thread buffers, grown on demand and reused across calls so the hot loop never
// allocates.
struct AttnScratch {
  KvPrefetcher pf;
  std::vector<float> q, acc, m, l, kf, scores, m_new, alpha;
  std::vector<uint16_t> pb;         // probabilities rounded to bf16 (paired P.V)
  std::vector<const void*> vrows;  // a span's V rows, in key order (paired P.V)
  std::vector<uint16_t> kvb;       // a span's 8-bit K then V rows as bf16 (kv8_rows_to_bf16)
  std::vector<float> kvsc;         // their row scales (K's times the softmax scale)
  static void grow(std::vector<float>& v, size_t n) {
    if (v.size() < n) v.resize(n);
  }
};

inline AttnScratch& attn_scratch() {
  static thread_local AttnScratch s;
  return s;
}

constexpr int round_up(int x, int m) { return (x + m - 1) / m * m; }

// Largest divisor of nv not above cap: how many vectors of a row's accumulator stay
// in registers while V rows stream through.
constexpr int acc_chunk(int nv, int cap) {
  for (int c = cap < nv ? cap : nv; c > 1; --c)
    if (nv % c == 0) return c;
  return 1;
}

// q.k with float32 FMAs on float32 rows (rows of 16-bit caches are converted once
// per block by the caller).
template <class Isa, int D>
struct QkFma {
  using Elem = float;
  using QElem = float;  // what the query rows are read as
  static constexpr bool kPairedPV = false;
  static constexpr bool kConvV = true;
  using V = typename Isa::V;
  static constexpr int W = Isa::W, NV = D / W;

  // Lane t = q . k_t for the n (<= W) keys k_t = k + t * ks.
  template <bool kFull>
  static V chunk(const float* q, const float* k, int64_t ks, int n) {
    V qv[NV];
#pragma GCC unroll 32
    for (int v = 0; v < NV; ++v) qv[v] = Isa::load(q + v * W);
    V acc[W];
#pragma GCC unroll 16
    for (int t = 0; t < W; ++t) {
      if (kFull || t < n) {
        const float* kr = k + t * ks;
        V a = Isa::mul(qv[0], Isa::load(kr));
#pragma GCC unroll 32
        for (int v = 1; v < NV; ++v) a = Isa::fma(qv[v], Isa::load(kr + v * W), a);
        acc[t] = a;
      } else {
        acc[t] = Isa::zero();
      }
    }
    return Isa::reduce_tree(acc);
  }
};

#if defined(PAGEDSERVE_HAVE_AVX512BF16)
// q.k straight from bf16 rows with VDPBF16PS: products of two bf16 values are exact
// in float32, so this matches the float32 reference up to summation order, and needs
// neither a conversion pass over K nor float32 copies of the query.
template <int D>
struct QkBf16Dot {
  using Elem = BF16;
  using QElem = BF16;
  using VElem = BF16;  // the V rows pv() reads
  // 8-bit caches (Attention::kConvBf16): V rows converted to bf16 copies too.
  static constexpr bool kConvV = true;
  using V = __m512;
  static constexpr int NC = (D + 31) / 32;
  // P.V with VDPBF16PS too (head sizes that are whole 32-value vectors): see pv().
  static constexpr bool kPairedPV = D % 32 == 0;
  static constexpr __mmask32 kLastMask =
      D % 32 == 0 ? __mmask32(0xffffffffu) : __mmask32((1u << (D % 32)) - 1u);

  static __m512i load_pairs(const BF16* p, int c) {
    // The masked tail (head size 80) zero-fills, so it neither reads the next head
    // nor lets stray NaNs into the sum.
    if (D % 32 != 0 && c == NC - 1) return _mm512_maskz_loadu_epi16(kLastMask, p + 32 * c);
    return _mm512_loadu_si512(p + 32 * c);
  }

  template <bool kFull>
  static V chunk(const BF16* q, const BF16* k, int64_t ks, int n) {
    __m512i qv[NC];
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) qv[c] = load_pairs(q, c);
    V acc[16];
#pragma GCC unroll 16
    for (int t = 0; t < 16; ++t) {
      if (kFull || t < n) {
        const BF16* kr = k + t * ks;
        V a = _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int c = 0; c < NC; ++c)
          a = _mm512_dpbf16_ps(a, (__m512bh)qv[c], (__m512bh)load_pairs(kr, c));
        acc[t] = a;
      } else {
        acc[t] = _mm512_setzero_ps();
      }
    }
    return Avx512::reduce_tree(acc);
  }

  // acc_r = acc_r * alpha_r + sum_j p_r[j] * v_j for R query rows (acc row stride D,
  // score row stride sp) over n keys whose V rows are rows[0, n).  Two keys per
  // VDPBF16PS: interleaving rows t and u gives (v_t[d], v_u[d]) pairs, and the pair
  // (p_t, p_u) is broadcast, so each instruction does 32 multiply-adds where the
  // float32 path does 16 and needs no bf16 -> float32 conversion of V.  p is rounded
  // to bf16 first (relative error 2^-9, as a bf16 attention GEMM rounds the
  // probabilities); the sums stay float32.  The interleave works within 128-bit lanes,
  // so accumulator dword 4L+i holds value 8L+i (lo) or 8L+4+i (hi) of each 32; the
  // end of the call puts them back in order.
  // vsc (or nullptr): each V row's scale, folded into its probability before the
  // rounding (p * (s * v) = (p * s) * v); finite past n.
  template <int R>
  static void pv(float* acc, const float* alpha, const float* p, int sp, const BF16* const* rows, int n,
                 uint16_t* pb, KvPrefetcher* pf, const float* vsc = nullptr) {
    constexpr int kRowLines = (D * 2 + 63) / 64;
    static_assert(D % 32 == 0, "paired P.V needs whole 32-value vectors");
    constexpr int NZ = D / 32, ZC = NZ % 2 == 0 ? 2 : 1;  // 32-value chunks per row; per pass
    for (int r = 0; r < R; ++r)  // p is zero past n up to sp (a multiple of 16)
      for (int c = 0; c < sp; c += 16) {
        __m512 pr = _mm512_loadu_ps(p + r * sp + c);
        if (vsc != nullptr) pr = _mm512_mul_ps(pr, _mm512_loadu_ps(vsc + c));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + r * sp + c), (__m256i)_mm512_cvtneps_pbh(pr));
      }
    const __m512i idx0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i idx1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int z0 = 0; z0 < NZ; z0 += ZC) {
      __m512 a[R][2 * ZC];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
        for (int z = 0; z < 2 * ZC; ++z) a[r][z] = _mm512_setzero_ps();
      for (int j = 0; j < n; j += 2) {
        if (pf && z0 == 0) pf->pump(2 * kRowLines);
        // An odd last key pairs with a row of zeros (its partner's p is 0, the padding
        // of p; pairing it with itself would turn an infinite value into 0 * inf = NaN).
        alignas(64) static const uint16_t kZeroRow[D] = {};
        const BF16* vt = rows[j] + 32 * z0;
        const BF16* vu = (j + 1 < n ? rows[j + 1] : reinterpret_cast<const BF16*>(kZeroRow)) + 32 * z0;
        __m512i lo[ZC], hi[ZC];
#pragma GCC unroll 4
        for (int z = 0; z < ZC; ++z) {
          const __m512i x = _mm512_loadu_si512(vt + 32 * z), y = _mm512_loadu_si512(vu + 32 * z);
          lo[z] = _mm512_unpacklo_epi16(x, y);
          hi[z] = _mm512_unpackhi_epi16(x, y);
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          int32_t pair;
          std::memcpy(&pair, pb + r * sp + j, sizeof(pair));
          const __m512bh pp = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
          for (int z = 0; z < ZC; ++z) {
            a[r][2 * z] = _mm512_dpbf16_ps(a[r][2 * z], (__m512bh)lo[z], pp);
            a[r][2 * z + 1] = _mm512_dpbf16_ps(a[r][2 * z + 1], (__m512bh)hi[z], pp);
          }
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m512 va = _mm512_set1_ps(alpha[r]);
#pragma GCC unroll 4
        for (int z = 0; z < ZC; ++z) {
          float* o = acc + r * D + 32 * (z0 + z);
          const __m512 n0 = _mm512_permutex2var_ps(a[r][2 * z], idx0, a[r][2 * z + 1]);
          const __m512 n1 = _mm512_permutex2var_ps(a[r][2 * z], idx1, a[r][2 * z + 1]);
          _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_loadu_ps(o), va, n0));
          _mm512_storeu_ps(o + 16, _mm512_fmadd_ps(_mm512_loadu_ps(o + 16), va, n1));
        }
      }
    }
  }
};

// 8-bit KV rows -> bf16 rows, exactly: every e4m3, e5m2 and int8 value is a bf16 value
// (subnormals, infinities and NaNs included).  Two 128-entry byte tables give the high
// and the low byte of the bf16 bits of each byte's magnitude (VPERMI2B reads the low 7
// bits of each index byte: the magnitude for the sign-magnitude fp8 formats, |x| for
// int8), the sign bit is ORed back, and VPERMT2B interleaves the two halves into 16-bit
// lanes in order: per 64 values one load, four permutes and one logic op, against a
// widening, an integer-to-float or half-to-float conversion and, for e4m3, a multiply
// and a NaN blend per 16 values to float32.  The rows then take the bf16 kernel's
// VDPBF16PS q.k and paired P.V, once per span for every query head of the group.
template <typename KT>
struct Kv8Bf16Tables {
  alignas(64) uint8_t hi[128], lo[128];
  static float magnitude(int i) {
    if constexpr (std::is_same_v<KT, I8S>) {
      return float(i);
    } else if constexpr (std::is_same_v<KT, FP8E4M3> || std::is_same_v<KT, FP8E4M3S>) {
      const int e = i >> 3, m = i & 7;
      if (i == 0x7f) return std::numeric_limits<float>::quiet_NaN();
      return e == 0 ? std::ldexp(float(m), -9) : std::ldexp(float(8 + m), e - 10);
    } else {
      static_assert(std::is_same_v<KT, FP8E5M2> || std::is_same_v<KT, FP8E5M2S>, "8-bit KV element");
      const int e = i >> 2, m = i & 3;
      if (e == 31) return m == 0 ? std::numeric_limits<float>::infinity() : std::numeric_limits<float>::quiet_NaN();
      return e == 0 ? std::ldexp(float(m), -16) : std::ldexp(float(4 + m), e - 17);
    }
  }
  Kv8Bf16Tables() {
    for (int i = 0; i < 128; ++i) {
      const uint16_t b = from_float<BF16>(magnitude(i)).bits;
      hi[i] = uint8_t(b >> 8);
      lo[i] = uint8_t(b & 0xff);
    }
  }
  static const Kv8Bf16Tables& get() {
    static const Kv8Bf16Tables t;
    return t;
  }
};

// Whether this CPU runs kv8_rows_to_bf16 (AVX512-VBMI: Zen 4 onwards, Ice Lake onwards;
// not Cooper Lake, whose bf16 8-bit caches then take the float32 kernel).
inline bool kv8_bf16_supported() {
  static const bool ok = __builtin_cpu_supports("avx512vbmi");
  return ok;
}

// Rows j < n of D values (src + j * stride) -> dst[j * D, (j + 1) * D) as bf16 bits;
// a row-scaled row's scale times mul -> scales[j].  Compiled for VBMI alone (the
// callers are not), so it converts whole runs of rows per call.
template <typename KT, int D>
__attribute__((target("avx512vbmi"), noinline)) void kv8_rows_to_bf16(const KT* src, int64_t stride, int n,
                                                                      uint16_t* dst, float* scales, float mul) {
  static_assert(D % 32 == 0, "rows of whole 32-value vectors");
  const Kv8Bf16Tables<KT>& t = Kv8Bf16Tables<KT>::get();
  const __m512i th0 = _mm512_load_si512(t.hi), th1 = _mm512_load_si512(t.hi + 64);
  const __m512i tl0 = _mm512_load_si512(t.lo), tl1 = _mm512_load_si512(t.lo + 64);
  const __m512i sign = _mm512_set1_epi8(char(0x80));
  // Byte 2k of 16-bit lane k takes low byte k (index k), byte 2k + 1 high byte k (64 + k);
  // the second 32 lanes take values 32..63.
  alignas(64) static const uint8_t kInterleave[128] = {
#define PS_I2(k) uint8_t(k), uint8_t(64 + (k))
#define PS_I8(k) PS_I2(k), PS_I2(k + 1), PS_I2(k + 2), PS_I2(k + 3), PS_I2(k + 4), PS_I2(k + 5), PS_I2(k + 6), PS_I2(k + 7)
      PS_I8(0), PS_I8(8), PS_I8(16), PS_I8(24), PS_I8(32), PS_I8(40), PS_I8(48), PS_I8(56)
#undef PS_I8
#undef PS_I2
  };
  const __m512i i0 = _mm512_load_si512(kInterleave), i1 = _mm512_load_si512(kInterleave + 64);
  for (int j = 0; j < n; ++j) {
    const uint8_t* r = reinterpret_cast<const uint8_t*>(src + j * stride);
    uint16_t* o = dst + int64_t(j) * D;
#pragma GCC unroll 4
    for (int c = 0; c < D; c += 64) {
      const bool half = D - c == 32;  // head size 96: a last run of 32 values
      const __m512i x = half ? _mm512_maskz_loadu_epi8(0xffffffffull, r + c) : _mm512_loadu_si512(r + c);
      __m512i ix = x;
      __mmask64 min_int8 = 0;
      if constexpr (std::is_same_v<KT, I8S>) {
        min_int8 = _mm512_cmpeq_epi8_mask(x, sign);  // -128: |x| = 0x80 reads entry 0
        ix = _mm512_abs_epi8(x);
      }
      __m512i h = _mm512_permutex2var_epi8(th0, ix, th1);
      const __m512i l = _mm512_permutex2var_epi8(tl0, ix, tl1);
      h = _mm512_ternarylogic_epi32(h, x, sign, 0xf8);  // h | (x & 0x80)
      if constexpr (std::is_same_v<KT, I8S>) h = _mm512_mask_mov_epi8(h, min_int8, _mm512_set1_epi8(char(0xc3)));
      _mm512_storeu_si512(o + c, _mm512_permutex2var_epi8(l, i0, h));
      if (!half) _mm512_storeu_si512(o + c + 32, _mm512_permutex2var_epi8(l, i1, h));
    }
    if constexpr (kRowScaled<KT>) scales[j] = row_scale<D>(src + j * stride) * mul;
  }
}

// Whether this CPU runs PvI8Wssd (AVX512-VNNI: Ice Lake, Cooper Lake, Zen 4 onwards).
inline bool kv8_vnni_supported() {
  static const bool ok = __builtin_cpu_supports("avx512vnni");
  return ok;
}

// P.V over int8 V rows (I8S) read in place with integer dot products (VPDPWSSD: pairs
// of int16 products summed into int32, exact).  Pairs two keys per instruction like
// QkBf16Dot::pv; each probability times its V row's scale is quantized per query row
// and span to int16 (max / 32767: an error of at most 1/65534 of the largest term,
// where bf16 rounding costs up to 1/512 of each), the V rows are sign-extended
// (VPMOVSXBW) as they are read, and the int32 sums come back to float32 times that
// scale: no conversion pass and no copy of a V row.
template <int D>
struct PvI8Wssd {
  static_assert(D % 32 == 0, "whole 32-value vectors");
  // vsc: the V rows' scales (always given: I8S rows are scaled), finite past n.
  template <int R>
  __attribute__((target("avx512vnni"), noinline)) static void pv(float* acc, const float* alpha, const float* p,
                                                                 int sp, const I8S* const* rows, int n,
                                                                 uint16_t* pbu, KvPrefetcher* pf,
                                                                 const float* vsc) {
    constexpr int kRowLines = (2 * (D + 4) + 63) / 64;
    constexpr int NZ = D / 32, ZC = NZ % 2 == 0 ? 2 : 1;
    int16_t* pb = reinterpret_cast<int16_t*>(pbu);
    // The int32 sums of n products (|v| <= 128) stay below 2^31.
    const float top = n <= 256 ? 32767.f : 32767.f * 256.f / float(n);
    float ps[R];
    for (int r = 0; r < R; ++r) {
      __m512 mx = _mm512_setzero_ps();
      for (int c = 0; c < sp; c += 16)
        mx = _mm512_max_ps(mx, _mm512_mul_ps(_mm512_loadu_ps(p + r * sp + c), _mm512_loadu_ps(vsc + c)));
      const float m = _mm512_reduce_max_ps(mx);  // >= 0: probabilities times scales
      const bool ok = m > 0.f && std::isfinite(m);
      const __m512 vi = _mm512_set1_ps(ok ? top / m : 0.f);
      ps[r] = ok ? m / top : (m > 0.f ? std::numeric_limits<float>::quiet_NaN() : 0.f);
      for (int c = 0; c < sp; c += 16) {
        const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(p + r * sp + c), _mm512_loadu_ps(vsc + c));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + r * sp + c),
                            _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(x, vi))));
      }
    }
    const __m512i idx0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i idx1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    alignas(64) static const int8_t kZeroRow[D + 4] = {};
    for (int z0 = 0; z0 < NZ; z0 += ZC) {
      __m512i a[R][2 * ZC];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
        for (int z = 0; z < 2 * ZC; ++z) a[r][z] = _mm512_setzero_si512();
      for (int j = 0; j < n; j += 2) {
        if (pf && z0 == 0) pf->pump(kRowLines);
        const int8_t* vt = reinterpret_cast<const int8_t*>(rows[j]) + 32 * z0;
        const int8_t* vu = (j + 1 < n ? reinterpret_cast<const int8_t*>(rows[j + 1]) : kZeroRow) + 32 * z0;
        __m512i lo[ZC], hi[ZC];
#pragma GCC unroll 4
        for (int z = 0; z < ZC; ++z) {
          const __m512i x = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vt + 32 * z)));
          const __m512i y = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vu + 32 * z)));
          lo[z] = _mm512_unpacklo_epi16(x, y);
          hi[z] = _mm512_unpackhi_epi16(x, y);
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          int32_t pair;
          std::memcpy(&pair, pb + r * sp + j, sizeof(pair));
          const __m512i pp = _mm512_set1_epi32(pair);
#pragma GCC unroll 4
          for (int z = 0; z < ZC; ++z) {
            a[r][2 * z] = _mm512_dpwssd_epi32(a[r][2 * z], lo[z], pp);
            a[r][2 * z + 1] = _mm512_dpwssd_epi32(a[r][2 * z + 1], hi[z], pp);
          }
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m512 va = _mm512_set1_ps(alpha[r]), vs = _mm512_set1_ps(ps[r]);
#pragma GCC unroll 4
        for (int z = 0; z < ZC; ++z) {
          float* o = acc + r * D + 32 * (z0 + z);
          const __m512 f0 = _mm512_cvtepi32_ps(a[r][2 * z]), f1 = _mm512_cvtepi32_ps(a[r][2 * z + 1]);
          const __m512 n0 = _mm512_permutex2var_ps(f0, idx0, f1);
          const __m512 n1 = _mm512_permutex2var_ps(f0, idx1, f1);
          _mm512_storeu_ps(o, _mm512_fmadd_ps(n0, vs, _mm512_mul_ps(_mm512_loadu_ps(o), va)));
          _mm512_storeu_ps(o + 16, _mm512_fmadd_ps(n1, vs, _mm512_mul_ps(_mm512_loadu_ps(o + 16), va)));
        }
      }
    }
  }
};

// int8 caches with a bf16 query: K rows converted to bf16 copies once per span
// (kv8_rows_to_bf16, exact) for QkBf16Dot's q.k, so the scores are as exact as the bf16
// kernel's; V rows read in place by PvI8Wssd.
template <int D>
struct QkI8Bf16Dot : QkBf16Dot<D> {
  using VElem = I8S;
  static constexpr bool kConvV = false;
  template <int R>
  static void pv(float* acc, const float* alpha, const float* p, int sp, const I8S* const* rows, int n,
                 uint16_t* pb, KvPrefetcher* pf, const float* vsc) {
    PvI8Wssd<D>::template pv<R>(acc, alpha, p, sp, rows, n, pb, pf, vsc);
  }
};
#endif

// cap * tanh(x / cap) as cap - 2 cap / (exp(2 x / cap) + 1): exact limits +-cap where
// exp overflows or underflows, and an absolute error of a few ulps of cap near 0.
template <class Isa>
struct SoftCap {
  typename Isa::V cap, two_cap, two_over_cap, one;
  explicit SoftCap(float c)
      : cap(Isa::set1(c)), two_cap(Isa::set1(2.f * c)), two_over_cap(Isa::set1(2.f / c)), one(Isa::set1(1.f)) {}
  typename Isa::V operator()(typename Isa::V x) const {
    const auto e = Isa::exp(Isa::mul(x, two_over_cap));
    return Isa::sub(cap, Isa::div(two_cap, Isa::add(e, one)));
  }
};

// kSoftCap: scores pass through SoftCap (a separate instantiation, so layers without a
// cap run exactly the code they ran before).  The sliding window is a runtime bound:
// it moves where the key loop starts and masks at most a block's worth of keys per
// query token, a few integer operations per span when off.
// KT: the KV cache's element type (T, or an 8-bit float whose rows are converted to
// float32 as they are read; q.k then runs on float32 copies of each span's keys).
// With Qk = QkBf16Dot (or QkI8Bf16Dot) and an 8-bit KT, each span's K rows (and V rows
// where Qk::kConvV; int8 V rows are read in place) are converted to bf16 once
// (kv8_rows_to_bf16) and run the bf16 kernel's q.k and P.V; row scales join the scores
// (times the softmax scale) and the probabilities (p * s before the rounding).
template <class Isa, typename T, int D, class Qk, bool kSoftCap = false, typename KT = T>
struct Attention {
  using V = typename Isa::V;
  using E = typename Qk::Elem;  // what the q.k product reads: KT itself, float32 or bf16
  static constexpr int W = Isa::W, NV = D / W;
  // An 8-bit cache read through bf16 copies of its rows (see kv8_rows_to_bf16).
  static constexpr bool kConvBf16 = std::is_same_v<E, BF16> && !std::is_same_v<KT, BF16>;
  static_assert(!kConvBf16 || Qk::kPairedPV, "bf16 copies of 8-bit rows take the paired P.V");
  using QE = typename Qk::QElem;  // what the q.k product reads of the query
  // Row scales gathered per span (Span::ksc, vsc) rather than applied as rows are read.
  static constexpr bool kScaledSpan = kConvBf16 && kRowScaled<KT>;
  // P.V runs over up to kGroupTile query rows at once so each V row is loaded and
  // converted once for all of them; CH vectors of each row's accumulator stay in
  // registers.
  static constexpr int kGroupTile = 4;
  static constexpr int CH = acc_chunk(NV, Isa::kMaxAccRegs / kGroupTile);
  static_assert(D % W == 0, "head size must be a multiple of the vector width");

  // Elements of one K or V row in the cache (a row-scaled row ends with its float32 scale).
  static constexpr int kRowElems = D + (kRowScaled<KT> ? 4 : 0);
  // Cache lines of one K or V row.
  static constexpr int kRowLines = (kRowElems * int(sizeof(KT)) + 63) / 64;
  // How far the prefetch cursor runs ahead of the compute (16 KiB).  Against
  // prefetching each next span whole when the span before it starts, decode attention
  // over 30 layers' caches went from 676 to 499 us per layer at 64 sequences x 190
  // keys and from 1530 to 1185 at 32 x 1000 (same process, alternating, medians);
  // leads of 128 to 384 lines measured alike.
  static constexpr int kLeadLines = 256;
  // n rows of a block (stride in elements) -> dense float32 [n, D]; rows of a
  // row-scaled (int8 or fp8) cache come out times their scales (q * s in float32, as the reference reads them).
  template <typename S>
  static void to_f32(const S* src, int64_t stride, int n, float* dst) {
    for (int j = 0; j < n; ++j) {
      if constexpr (kRowScaled<S>) {
        const V sc = Isa::set1(row_scale<D>(src + j * stride));
#pragma GCC unroll 32
        for (int v = 0; v < NV; ++v)
          Isa::store(dst + j * D + v * W, Isa::mul(Isa::load(src + j * stride + v * W), sc));
      } else {
#pragma GCC unroll 32
        for (int v = 0; v < NV; ++v) Isa::store(dst + j * D + v * W, Isa::load(src + j * stride + v * W));
      }
    }
  }

  // Keys of one kv head taken together by the online softmax: up to kMaxSegs runs
  // (one per cache block) of rows at a common stride.  Spanning several blocks
  // amortises the per-step work (max, rescale, horizontal sums) and gives the
  // out-of-order core independent exp chains to overlap.
  static constexpr int kSpanKeys = 64;
  static constexpr int kMaxSegs = kSpanKeys / W;
  struct Span {
    const E* k[kMaxSegs];
    const KT* v[kMaxSegs];
    int n[kMaxSegs];
    int segs;
    int64_t ks, vs;
    // kConvBf16: the span's V rows as bf16, D apart, in key order; with row scales, each
    // key's score multiplier (its K row's scale times the softmax scale) and V row scale.
    const BF16* vb = nullptr;
    const float* ksc = nullptr;
    const float* vsc = nullptr;
  };

  // acc_r = acc_r * alpha_r + sum_j p_r[j] * v_j for R rows (row stride D, score
  // stride sp) over the first n keys of the span, V rows read straight from the cache.
  template <int R>
  static void pv_rows(float* acc, const float* alpha, const float* p, int sp, const Span& sn, int n,
                      KvPrefetcher* pf) {
    for (int c0 = 0; c0 < NV; c0 += CH) {
      V a[R][CH];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const V va = Isa::set1(alpha[r]);
#pragma GCC unroll 16
        for (int c = 0; c < CH; ++c) a[r][c] = Isa::mul(Isa::load(acc + r * D + (c0 + c) * W), va);
      }
      for (int sg = 0, j0 = 0; sg < sn.segs && j0 < n; j0 += sn.n[sg++]) {
        const int m = std::min(sn.n[sg], n - j0);
        for (int j = 0; j < m; ++j) {
          if (pf && c0 == 0) pf->pump(kRowLines);
          const KT* vrow = sn.v[sg] + j * sn.vs;
          const KT* vr = vrow + c0 * W;
          // A scaled row's scale folds into its probabilities: p * (s * q) = (p * s) * q.
          float vscale = 1.f;
          if constexpr (kRowScaled<KT>) vscale = row_scale<D>(vrow);
          V vj[CH];
#pragma GCC unroll 16
          for (int c = 0; c < CH; ++c) vj[c] = Isa::load(vr + c * W);
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) {
            const V pr = Isa::set1(kRowScaled<KT> ? p[r * sp + j0 + j] * vscale : p[r * sp + j0 + j]);
#pragma GCC unroll 16
            for (int c = 0; c < CH; ++c) a[r][c] = Isa::fma(pr, vj[c], a[r][c]);
          }
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
        for (int c = 0; c < CH; ++c) Isa::store(acc + r * D + (c0 + c) * W, a[r][c]);
    }
  }

  // Keys [0, skip) of s[0, n) left the query's window: -inf; returns the max of the rest.
  [[gnu::noinline]] static float mask_head(float* s, int n, int skip) {
    std::fill_n(s, skip, kNegInf);
    float m = kNegInf;
    for (int j = skip; j < n; ++j) m = std::max(m, s[j]);
    return m;
  }

  // Scaled (and, with kSoftCap, capped) scores of one query row against keys
  // [skip, n) of the span -> s[0, n) (keys before skip and the padding up to a multiple
  // of W are -inf); returns their maximum.  Every segment but the last holds a
  // multiple of W keys, so chunks never straddle two blocks.
  // The window's masking stays out of the loop (mask_head): it concerns at most one
  // span per query token.
  static float scores(const QE* q, const Span& sn, int n, int skip, const AttnParams& p, float* s, KvPrefetcher* pf) {
    const V vscale = Isa::set1(p.scale);
    V vmax = Isa::set1(kNegInf);
    for (int sg = 0, j0 = 0; sg < sn.segs && j0 < n; j0 += sn.n[sg++]) {
      const int m = std::min(sn.n[sg], n - j0);
      const E* k = sn.k[sg];
      int c = 0;
      for (; c + W <= m; c += W) {
        if (pf) pf->pump(W * kRowLines);
        V x = Isa::mul(Qk::template chunk<true>(q, k + c * sn.ks, sn.ks, W),
                       kScaledSpan ? Isa::load(sn.ksc + j0 + c) : vscale);
        if constexpr (kSoftCap) x = SoftCap<Isa>(p.soft_cap)(x);
        Isa::store(s + j0 + c, x);
        vmax = Isa::max(vmax, x);
      }
      if (c < m) {
        if (pf) pf->pump((m - c) * kRowLines);
        V x = Isa::mul(Qk::template chunk<false>(q, k + c * sn.ks, sn.ks, m - c),
                       kScaledSpan ? Isa::load(sn.ksc + j0 + c) : vscale);
        if constexpr (kSoftCap) x = SoftCap<Isa>(p.soft_cap)(x);
        x = Isa::mask_tail(x, m - c, kNegInf);
        Isa::store(s + j0 + c, x);
        vmax = Isa::max(vmax, x);
      }
    }
    if (skip > 0) [[unlikely]]
      return mask_head(s, n, skip);
    return Isa::reduce_max(vmax);
  }

  // The G query rows of one token (row stride qs, all seeing keys [skip, n) of the
  // span): scores, online-softmax rescale, then P.V for all of them together.
  // pf: the item's prefetcher (single-token items only).
  // Kept out of item(): a build in which GCC inlined it there (with the window's
  // masking inside the score loop) ran layers without a window 30% slower, decode and
  // prefill alike; this one times like the kernel before windows (docs/benchmarks.md).
  [[gnu::noinline]] static void token_rows(AttnScratch& sc, int row0, int G, const QE* q, int64_t qs, const Span& sn,
                                           int n, int skip, const AttnParams& p, KvPrefetcher* pf) {
    const int sp = round_up(n, W);
    float* s = sc.scores.data();
    float* m = sc.m.data() + row0;
    float* l = sc.l.data() + row0;
    float* m_new = sc.m_new.data();
    float* alpha = sc.alpha.data();
    for (int g = 0; g < G; ++g)
      m_new[g] = std::max(m[g], scores(q + g * qs, sn, n, skip, p, s + g * sp, g == 0 ? pf : nullptr));
    for (int g = 0; g < G; g += W)  // exp(m - m_new) is 0 on the first span (m = -inf)
      Isa::store(alpha + g, Isa::exp(Isa::sub(Isa::load(m + g), Isa::load(m_new + g))));
    for (int g = 0; g < G; ++g) {
      const V vm = Isa::set1(m_new[g]);
      V vsum = Isa::zero();
      for (int c = 0; c < n; c += W) {
        const V e = Isa::exp(Isa::sub(Isa::load(s + g * sp + c), vm));
        Isa::store(s + g * sp + c, e);
        vsum = Isa::add(vsum, e);
      }
      l[g] = l[g] * alpha[g] + Isa::reduce_add(vsum);
      m[g] = m_new[g];
    }
    float* acc = sc.acc.data() + size_t(row0) * D;
    if constexpr (Qk::kPairedPV) {
      const void** vr = sc.vrows.data();
      if constexpr (kConvBf16 && Qk::kConvV) {
        for (int j = 0; j < n; ++j) vr[j] = sn.vb + int64_t(j) * D;
      } else {
        for (int sg = 0, j0 = 0; sg < sn.segs && j0 < n; j0 += sn.n[sg++])
          for (int j = 0, m = std::min(sn.n[sg], n - j0); j < m; ++j) vr[j0 + j] = sn.v[sg] + j * sn.vs;
      }
      const typename Qk::VElem* const* rows = reinterpret_cast<const typename Qk::VElem* const*>(vr);
      uint16_t* pb = sc.pb.data();
      const float* vsc = kScaledSpan ? sn.vsc : nullptr;
      for (int g = 0; g < G; g += kGroupTile) {
        float* a = acc + size_t(g) * D;
        KvPrefetcher* f = g == 0 ? pf : nullptr;
        switch (std::min(kGroupTile, G - g)) {
          case 1: Qk::template pv<1>(a, alpha + g, s + g * sp, sp, rows, n, pb, f, vsc); break;
          case 2: Qk::template pv<2>(a, alpha + g, s + g * sp, sp, rows, n, pb, f, vsc); break;
          case 3: Qk::template pv<3>(a, alpha + g, s + g * sp, sp, rows, n, pb, f, vsc); break;
          default: Qk::template pv<4>(a, alpha + g, s + g * sp, sp, rows, n, pb, f, vsc); break;
        }
      }
      return;
    }
    for (int g = 0; g < G; g += kGroupTile) {
      float* a = acc + size_t(g) * D;
      switch (std::min(kGroupTile, G - g)) {
        case 1: pv_rows<1>(a, alpha + g, s + g * sp, sp, sn, n, g == 0 ? pf : nullptr); break;
        case 2: pv_rows<2>(a, alpha + g, s + g * sp, sp, sn, n, g == 0 ? pf : nullptr); break;
        case 3: pv_rows<3>(a, alpha + g, s + g * sp, sp, sn, n, g == 0 ? pf : nullptr); break;
        default: pv_rows<4>(a, alpha + g, s + g * sp, sp, sn, n, g == 0 ? pf : nullptr); break;
      }
    }
  }

  // Rows of a work item: r = (local kv head * n_tok + token) * G + group member.
  struct Rows {
    int G, n_tok, kv_begin;
    // Offset of row r in a [tokens, heads, D] tensor, from the item's first token.
    int64_t offset(int r, int64_t s_tok, int64_t s_head) const {
      const int h = kv_begin + r / (n_tok * G), t = (r / G) % n_tok;
      return t * s_tok + int64_t(h * G + r % G) * s_head;
    }
    // Query head of row r.
    int head(int r) const { return (kv_begin + r / (n_tok * G)) * G + r % G; }
  };

  // 1 / softmax denominator of a row whose online softmax ended at (max m, sum l),
  // times the rescale of its accumulator: 1 / l, or with a sink logit s the sum also
  // holds exp(s - M), M = max(m, s), and the accumulator is rescaled by exp(m - M).
  // Runs once per output row, never per key, so rows without sinks pay one branch.
  static float inv_denominator(const AttnParams& p, const Rows& rm, int r, float m, float l) {
    if (p.sinks == nullptr) return 1.f / l;
    const float s = p.sinks[rm.head(r)], mm = std::max(m, s), a = std::exp(m - mm);
    return a / (l * a + std::exp(s - mm));
  }

  static int blocks_per_span(int bs) { return bs % W == 0 ? std::max(1, kSpanKeys / bs) : 1; }

  static void prepare(AttnScratch& sc, int rows, int G, int bs) {
    const int span = blocks_per_span(bs) * bs;
    AttnScratch::grow(sc.acc, size_t(rows) * D);
    AttnScratch::grow(sc.m, rows + W);  // + W: alphas are computed W rows at a time
    AttnScratch::grow(sc.l, rows);
    AttnScratch::grow(sc.m_new, G + W);
    AttnScratch::grow(sc.alpha, G + W);
    AttnScratch::grow(sc.scores, size_t(G) * round_up(span, W));
    if constexpr (Qk::kPairedPV) {
      if (sc.pb.size() < size_t(kGroupTile) * round_up(span, W)) sc.pb.resize(size_t(kGroupTile) * round_up(span, W));
      if (sc.vrows.size() < size_t(span)) sc.vrows.resize(span);
    }
    if constexpr (kConvBf16) {
      if (sc.kvb.size() < size_t(2) * span * D) sc.kvb.resize(size_t(2) * span * D);
      AttnScratch::grow(sc.kvsc, size_t(2) * (round_up(span, W) + W));
    } else if constexpr (!std::is_same_v<E, KT>) {
      AttnScratch::grow(sc.kf, size_t(span) * D);
    }
    std::fill_n(sc.acc.data(), size_t(rows) * D, 0.f);
    std::fill_n(sc.m.data(), rows + W, kNegInf);
    std::fill_n(sc.l.data(), rows, 0.f);
    std::fill_n(sc.m_new.data(), G + W, 0.f);
  }

  static void item(const AttnParams& p, const AttnWork& w, float* partials) {
    const int G = p.num_heads / p.num_kv_heads, bs = p.block_size;
    const int q0 = p.query_start_loc[w.seq];
    const int first_pos = p.seq_lens[w.seq] - (p.query_start_loc[w.seq + 1] - q0);
    const int n_tok = w.tok_end - w.tok_begin, n_kv = w.kv_end - w.kv_begin;
    const int rows = n_kv * n_tok * G;
    const Rows rm{G, n_tok, w.kv_begin};
    AttnScratch& sc = attn_scratch();
    prepare(sc, rows, G, bs);
    const T* query = static_cast<const T*>(p.query) + int64_t(q0 + w.tok_begin) * p.q_stride_tok;
    if constexpr (!std::is_same_v<QE, T>) {  // float32 copy of the item's query rows
      AttnScratch::grow(sc.q, size_t(rows) * D);
      for (int r = 0; r < rows; ++r)
        to_f32(query + rm.offset(r, p.q_stride_tok, p.q_stride_head), 0, 1, sc.q.data() + size_t(r) * D);
    }
    // Keys visible to the item's last token; earlier tokens see fewer (causal), unless
    // key_ends lets a span's tokens see further.
    const int32_t* ends = p.key_ends == nullptr ? nullptr : p.key_ends + q0 + w.tok_begin;
    int tile_end = first_pos + w.tok_end;
    if (ends != nullptr)
      for (int t = 0; t < n_tok; ++t) tile_end = std::max(tile_end, int(ends[t]));
    const int key_end = std::min(w.ctx_end, tile_end);
    const int key_begin = first_key(p, w, first_pos);
    const int bps = blocks_per_span(bs);
    // Software prefetch for single-token (decode) items only: a tile of several query
    // tokens uses each K/V row for all of them, is bound by compute, and measured 2-3%
    // faster without it (benchmarks/cpu_kernels.py --prefill).
    KvPrefetcher* pf = n_tok == 1 ? &sc.pf : nullptr;
    if (pf) {
      plan_prefetch(p, *pf, w, bps, key_begin, key_end);
      pf->pump(kLeadLines);
    }
    for (int kb = key_begin / bs; kb * bs < key_end; kb += bps) {
      const int kb_end = std::min(kb + bps, (key_end + bs - 1) / bs);
      const int j0 = std::max(key_begin, kb * bs), j1 = std::min(key_end, kb_end * bs);
      for (int h = w.kv_begin; h < w.kv_end; ++h) {
        const Span sn = make_span(p, sc, w.seq, h, kb, kb_end, j0, j1, kConvBf16 ? pf : nullptr);
        for (int t = 0; t < n_tok; ++t) {
          const int pos = first_pos + w.tok_begin + t;
          const int visible = std::min(j1, ends == nullptr ? pos + 1 : int(ends[t])) - j0;
          const int skip = p.sliding_window > 0 ? std::max(0, pos - p.sliding_window + 1 - j0) : 0;
          if (visible <= skip) continue;
          const int r = (h - w.kv_begin) * n_tok * G + t * G;
          // The converted path paced the prefetch as it read the rows (make_span).
          KvPrefetcher* tpf = kConvBf16 ? nullptr : pf;
          if constexpr (std::is_same_v<QE, T>)
            token_rows(sc, r, G, query + t * p.q_stride_tok + int64_t(h) * G * p.q_stride_head, p.q_stride_head,
                       sn, visible, skip, p, tpf);
          else
            token_rows(sc, r, G, sc.q.data() + size_t(r) * D, D, sn, visible, skip, p, tpf);
        }
      }
    }
    finish(p, w, partials, sc, rm, q0, rows);
  }

  // First key the item reads: its key range's start, or, with a window, the start of
  // the block holding the first key its first token sees (earlier blocks may be freed).
  static int first_key(const AttnParams& p, const AttnWork& w, int first_pos) {
    if (p.sliding_window <= 0) return w.ctx_begin;
    const int lo = std::max(0, first_pos + w.tok_begin - p.sliding_window + 1);
    return std::max(w.ctx_begin, lo / p.block_size * p.block_size);
  }

  // The K then V rows of every (span, kv head) of the item, in the order item() reads
  // them: whole runs where a block's rows of one head are contiguous (the CPU
  // platform's head-major storage), row by row otherwise.
  static void plan_prefetch(const AttnParams& p, KvPrefetcher& pf, const AttnWork& w, int bps, int key_begin,
                            int key_end) {
    const int bs = p.block_size;
    const int32_t* table = p.block_tables + w.seq * p.bt_stride;
    const int64_t row_bytes = kRowElems * int64_t(sizeof(KT));
    // Rows [first, last) of block b, kv head h, of one cache.
    auto rows = [&](const void* cache, int64_t s_block, int64_t s_head, int64_t s_tok, int h, int b, int first,
                    int last) {
      const KT* r = static_cast<const KT*>(cache) + int64_t(table[b]) * s_block + h * s_head +
                   int64_t(first - b * bs) * s_tok;
      if (s_tok == kRowElems)
        pf.add(r, (last - first) * row_bytes);
      else
        for (int j = 0; j < last - first; ++j) pf.add(r + j * s_tok, row_bytes);
    };
    pf.clear();
    for (int kb = key_begin / bs; kb * bs < key_end; kb += bps) {
      const int kb_end = std::min(kb + bps, (key_end + bs - 1) / bs);
      for (int h = w.kv_begin; h < w.kv_end; ++h)
        for (int v = 0; v < 2; ++v)  // the keys of the span, then its values
          for (int b = kb; b < kb_end; ++b) {
            const int first = std::max(key_begin, b * bs), last = std::min(key_end, (b + 1) * bs);
            if (v == 0)
              rows(p.key_cache, p.kc_stride_block, p.kc_stride_head, p.kc_stride_tok, h, b, first, last);
            else
              rows(p.value_cache, p.vc_stride_block, p.vc_stride_head, p.vc_stride_tok, h, b, first, last);
          }
    }
  }

  // Row pointers of keys [j0, j1) (blocks [kb, kb_end)) of kv head h; kConvBf16: their
  // rows converted, the prefetch (pf, or nullptr) pumped as they are read.
  static Span make_span(const AttnParams& p, AttnScratch& sc, int seq, int h, int kb, int kb_end, int j0, int j1,
                        KvPrefetcher* pf = nullptr) {
    const int bs = p.block_size;
    const int32_t* table = p.block_tables + seq * p.bt_stride;
    const KT* kc = static_cast<const KT*>(p.key_cache) + h * p.kc_stride_head;
    const KT* vc = static_cast<const KT*>(p.value_cache) + h * p.vc_stride_head;
    Span sn;
    sn.segs = kb_end - kb;
    sn.ks = p.kc_stride_tok;
    sn.vs = p.vc_stride_tok;
    for (int b = kb, i = 0; b < kb_end; ++b, ++i) {
      const int first = std::max(j0, b * bs), last = std::min(j1, (b + 1) * bs);
      sn.n[i] = last - first;
      const int64_t block = table[b];
      sn.v[i] = vc + block * p.vc_stride_block + int64_t(first - b * bs) * p.vc_stride_tok;
      if constexpr (std::is_same_v<E, KT>)
        sn.k[i] = kc + block * p.kc_stride_block + int64_t(first - b * bs) * p.kc_stride_tok;
    }
    if constexpr (kConvBf16) {
#if defined(PAGEDSERVE_HAVE_AVX512BF16)
      const int span = blocks_per_span(bs) * bs, cap = round_up(span, W) + W;
      uint16_t* kd = sc.kvb.data();
      uint16_t* vd = kd + size_t(span) * D;
      float* ksc = sc.kvsc.data();
      float* vsc = ksc + cap;
      const int64_t row_bytes = kRowElems * int64_t(sizeof(KT));
      int off = 0;
      for (int b = kb, i = 0; b < kb_end; ++b, ++i) {
        const int first = std::max(j0, b * bs);
        if (pf) pf->pump((sn.n[i] * row_bytes + 63) / 64);
        kv8_rows_to_bf16<KT, D>(kc + table[b] * p.kc_stride_block + int64_t(first - b * bs) * p.kc_stride_tok,
                                p.kc_stride_tok, sn.n[i], kd + size_t(off) * D, ksc + off, p.scale);
        sn.k[i] = reinterpret_cast<const E*>(kd + size_t(off) * D);
        off += sn.n[i];
      }
      off = 0;
      for (int i = 0; i < sn.segs; ++i) {
        if (pf) pf->pump((sn.n[i] * row_bytes + 63) / 64);
        if constexpr (Qk::kConvV) {
          kv8_rows_to_bf16<KT, D>(sn.v[i], p.vc_stride_tok, sn.n[i], vd + size_t(off) * D, vsc + off, 1.f);
        } else {  // read in place by Qk::pv: only their scales
          for (int j = 0; j < sn.n[i]; ++j) vsc[off + j] = row_scale<D>(sn.v[i] + j * sn.vs);
        }
        off += sn.n[i];
      }
      if constexpr (kRowScaled<KT>) {  // lanes past the keys: finite (a probability 0 times it)
        std::fill(ksc + off, ksc + round_up(off, W), 0.f);
        std::fill(vsc + off, vsc + round_up(off, W), 0.f);
      }
      sn.ks = D;
      sn.vb = reinterpret_cast<const BF16*>(vd);
      sn.ksc = ksc;
      sn.vsc = vsc;
#endif
    } else if constexpr (!std::is_same_v<E, KT>) {  // float32 copy of the span's keys
      float* dst = sc.kf.data();
      for (int b = kb, i = 0; b < kb_end; ++b, ++i) {
        const int first = std::max(j0, b * bs);
        to_f32(kc + table[b] * p.kc_stride_block + int64_t(first - b * bs) * p.kc_stride_tok, p.kc_stride_tok,
               sn.n[i], dst);
        sn.k[i] = dst;
        dst += size_t(sn.n[i]) * D;
      }
      sn.ks = D;
    }
    return sn;
  }

  static void finish(const AttnParams& p, const AttnWork& w, float* partials, const AttnScratch& sc, const Rows& rm,
                     int q0, int rows) {
    if (w.partial_row >= 0) {  // split context: keep (max, sum, acc) for the merge
      for (int r = 0; r < rows; ++r) {
        float* dst = partials + (w.partial_row + r) * (D + 2);
        dst[0] = sc.m[r];
        dst[1] = sc.l[r];
        std::copy_n(sc.acc.data() + size_t(r) * D, D, dst + 2);
      }
      return;
    }
    T* out = static_cast<T*>(p.out) + int64_t(q0 + w.tok_begin) * p.o_stride_tok;
    for (int r = 0; r < rows; ++r) {
      T* o = out + rm.offset(r, p.o_stride_tok, p.o_stride_head);
      const V inv = Isa::set1(inv_denominator(p, rm, r, sc.m[r], sc.l[r]));
      const float* a = sc.acc.data() + size_t(r) * D;
#pragma GCC unroll 32
      for (int v = 0; v < NV; ++v) Isa::store(o + v * W, Isa::mul(Isa::load(a + v * W), inv));
    }
  }

  // Combines the context splits of one (sequence, kv heads, token tile).
  static void merge(const AttnParams& p, const AttnMerge& mg, const float* partials) {
    const int G = p.num_heads / p.num_kv_heads, n_tok = mg.tok_end - mg.tok_begin;
    const int rows = (mg.kv_end - mg.kv_begin) * n_tok * G;
    const Rows rm{G, n_tok, mg.kv_begin};
    T* out = static_cast<T*>(p.out) + int64_t(p.query_start_loc[mg.seq] + mg.tok_begin) * p.o_stride_tok;
    float acc[D];
    for (int r = 0; r < rows; ++r) {
      auto part = [&](int s) { return partials + (mg.first_row + int64_t(s) * rows + r) * (D + 2); };
      float m = kNegInf;
      for (int s = 0; s < mg.num_splits; ++s) m = std::max(m, part(s)[0]);
      float l = 0.f;
      std::fill_n(acc, D, 0.f);
      for (int s = 0; s < mg.num_splits; ++s) {
        const float* src = part(s);
        if (src[1] == 0.f) continue;  // this split saw no key of this row
        const float f = std::exp(src[0] - m);
        l += f * src[1];
        const V vf = Isa::set1(f);
        for (int v = 0; v < NV; ++v)
          Isa::store(acc + v * W, Isa::fma(vf, Isa::load(src + 2 + v * W), Isa::load(acc + v * W)));
      }
      T* o = out + rm.offset(r, p.o_stride_tok, p.o_stride_head);
      const V inv = Isa::set1(inv_denominator(p, rm, r, m, l));
      for (int v = 0; v < NV; ++v) Isa::store(o + v * W, Isa::mul(Isa::load(acc + v * W), inv));
    }
  }
};

template <class Isa, typename T, int D, typename KT = T>
AttnFns attention_fma_fns() {
  using K = Attention<Isa, T, D, QkFma<Isa, D>, false, KT>;
  using KCap = Attention<Isa, T, D, QkFma<Isa, D>, true, KT>;
  return {&K::item, &K::merge, &KCap::item};
}

// (dtype, head size) -> the float32-FMA kernel of instruction set Isa.
template <class Isa>
AttnFns attention_fns(DType dtype, int head_size) {
  auto by_head = [head_size](auto tag) -> AttnFns {
    using T = decltype(tag);
    switch (head_size) {
      case 64: return attention_fma_fns<Isa, T, 64>();
      case 80: return attention_fma_fns<Isa, T, 80>();
      case 96: return attention_fma_fns<Isa, T, 96>();
      case 128: return attention_fma_fns<Isa, T, 128>();
      case 256: return attention_fma_fns<Isa, T, 256>();
      default: return {};
    }
  };
  switch (dtype) {
    case DType::kFloat32: return by_head(float{});
    case DType::kBFloat16: return by_head(BF16{});
    case DType::kFloat16: return by_head(F16{});
    default: return {};
  }
  return {};
}

// (query dtype float32 or bf16, KV dtype 8-bit float or int8, head size) -> the
// float32-FMA kernel of Isa reading the cache's rows in registers (Isa::load of
// FP8E4M3/FP8E5M2/I8S/FP8E4M3S/FP8E5M2S; row-scaled rows scaled as they are read).
template <class Isa>
AttnFns attention_kv8_fns(DType dtype, DType kv_dtype, int head_size) {
  auto by_head = [head_size](auto q_tag, auto kv_tag) -> AttnFns {
    using T = decltype(q_tag);
    using KT = decltype(kv_tag);
    switch (head_size) {
      case 64: return attention_fma_fns<Isa, T, 64, KT>();
      case 80: return attention_fma_fns<Isa, T, 80, KT>();
      case 96: return attention_fma_fns<Isa, T, 96, KT>();
      case 128: return attention_fma_fns<Isa, T, 128, KT>();
      case 256: return attention_fma_fns<Isa, T, 256, KT>();
      default: return {};
    }
  };
  auto by_kv = [&](auto q_tag) -> AttnFns {
    if (kv_dtype == DType::kFloat8E4M3) return by_head(q_tag, FP8E4M3{});
    if (kv_dtype == DType::kFloat8E5M2) return by_head(q_tag, FP8E5M2{});
    if (kv_dtype == DType::kInt8) return by_head(q_tag, I8S{});
    if (kv_dtype == DType::kFloat8E4M3Scaled) return by_head(q_tag, FP8E4M3S{});
    if (kv_dtype == DType::kFloat8E5M2Scaled) return by_head(q_tag, FP8E5M2S{});
    return {};
  };
  if (dtype == DType::kFloat32) return by_kv(float{});
  if (dtype == DType::kBFloat16) return by_kv(BF16{});
  return {};
}

}  // namespace pagedserve_cpu
