// Matmul on the GGUF block types beyond Q4_0 / Q4_1 / Q8_0, kept in the file's blocks:
// Q5_0, Q5_1 (32 values per block) and the K-quants Q4_K, Q5_K, Q6_K (256 values per
// super-block).  Block layouts (ggml-common.h; d, dmin, m fp16):
//   Q5_0  d | u32 qh | qs[16]                value (q - 16) * d
//   Q5_1  d | m | u32 qh | qs[16]            value q * d + m
//     q = nibble (element j < 16: low nibble of qs[j]; j + 16: its high nibble) plus 16 *
//     bit j of qh.
//   Q4_K  d | dmin | scales[12] | qs[128]    8 sub-blocks of 32 with 6-bit scale sc and
//   Q5_K  d | dmin | scales[12] | qh[32] | qs[128]    minimum mn: d*sc*q - dmin*mn
//     qs byte l of each 32-byte group i holds element l of sub-block 2i (low nibble) and
//     of 2i + 1 (high nibble); Q5_K adds 16 * bit j of qh[l] for sub-block j.
//     scales: sub-blocks 0-3 take the low 6 bits of bytes 0-3 (sc) and 4-7 (mn); 4-7
//     take the nibbles of bytes 8-11 (sc low, mn high) with the top two bits of bytes
//     0-3 (sc) and 4-7 (mn) above them.
//   Q6_K  ql[128] | qh[64] | int8 scales[16] | d     16 sub-blocks of 16: d*scale*(q-32)
//     per 128-value half: element 32c + l (c = 0..3) has its low 4 bits in the low
//     (c < 2) or high nibble of ql[l + 32 (c % 2)] and its top 2 in bits 2c of qh[l].
//
// The activations are the same int8 blocks of 32 as for the other types (quantized once
// per call by quant_gguf.cpp, fp16 scale d_x, integer sum s): every 32-value piece of a
// weight row (a Q5 block, a K-quant sub-block) is decoded in registers into 32 integers
// and one float scale per 16 values, then multiplied with one 32-byte integer dot
// product (vpdpbusd with AVX-512 VNNI, vpmaddubsw + vpmaddwd on AVX2):
//   y += (w_scale * d_x) * sum(q * x_q) + w_min * d_x * s
// with w_scale = d (Q5_x), d * sc (Q4_K, Q5_K; the 6-bit scales and minimums unpacked
// from their 12 bytes with 32-bit masks and shifts, once per super-block), d * scale per
// 16 values (Q6_K, signed q - 32: signs moved into the activations as for Q8_0), and
// w_min = -16 d (Q5_0), m (Q5_1), -dmin * mn (Q4_K, Q5_K), 0 (Q6_K).  Products stay
// within int16 for vpmaddubsw (|q| <= 32, |x_q| <= 127).  The only error against the
// float reference is that of the int8 activations, as for the other types.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "quant_gguf_common.h"

using pagedserve_gguf::half_to_float;
using pagedserve_gguf::row_kernel_gemm;
#if defined(__AVX2__)
using pagedserve_gguf::dot_u8s8;
using pagedserve_gguf::hsum;
#endif

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int QK = 32;

enum ExtType : int64_t { Q5_0 = 6, Q5_1 = 7, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Q4_K / Q5_K: the 8 sub-blocks' 6-bit scales and minimums from scales[12], four per
// 32-bit word (byte j of `sc_lo` is sub-block j's scale, of `sc_hi` sub-block 4 + j's).
struct KScales {
  uint8_t sc[8], mn[8];
};

inline KScales unpack_kscales(const uint8_t* s) {
  const uint32_t a = load_u32(s), b = load_u32(s + 4), c = load_u32(s + 8);
  const uint32_t sc_lo = a & 0x3F3F3F3Fu, mn_lo = b & 0x3F3F3F3Fu;
  // Bits 6-7 of each byte of a (b) become bits 4-5 above the nibble of c.
  const uint32_t sc_hi = (c & 0x0F0F0F0Fu) | ((a >> 2) & 0x30303030u);
  const uint32_t mn_hi = ((c >> 4) & 0x0F0F0F0Fu) | ((b >> 2) & 0x30303030u);
  KScales k;
  std::memcpy(k.sc, &sc_lo, 4);
  std::memcpy(k.sc + 4, &sc_hi, 4);
  std::memcpy(k.mn, &mn_lo, 4);
  std::memcpy(k.mn + 4, &mn_hi, 4);
  return k;
}

template <int T>
constexpr int block_values() {
  return (T == Q5_0 || T == Q5_1) ? 32 : 256;
}
template <int T>
constexpr int block_bytes() {
  return T == Q5_0 ? 22 : T == Q5_1 ? 24 : T == Q4_K ? 144 : T == Q5_K ? 176 : 210;
}

// One super-block (a single block for Q5_x) decoded: per 32-value piece j, its integers,
// the weight scale of its two halves of 16 and its minimum coefficient.
template <int T>
struct Decoded {
  static constexpr int kPieces = block_values<T>() / QK;
  static constexpr bool kSigned = T == Q6_K;  // q - 32 in [-32, 31]; others unsigned 0..31
  alignas(32) int8_t q[kPieces][QK];
  float scale[kPieces][2];
  float min[kPieces];
};

// Portable decoding into Decoded (every build; the AVX2 path decodes in registers).
template <int T>
void decode_scalar(const uint8_t* blk, Decoded<T>& out) {
  if constexpr (T == Q5_0 || T == Q5_1) {
    const float d = half_to_float(blk);
    const int at = T == Q5_0 ? 2 : 4;
    const uint32_t qh = load_u32(blk + at);
    const uint8_t* qs = blk + at + 4;
    for (int j = 0; j < 16; ++j) {
      out.q[0][j] = static_cast<int8_t>((qs[j] & 0x0F) | (((qh >> j) & 1) << 4));
      out.q[0][j + 16] = static_cast<int8_t>((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
    }
    out.scale[0][0] = out.scale[0][1] = d;
    out.min[0] = T == Q5_0 ? -16.f * d : half_to_float(blk + 2);
  } else if constexpr (T == Q4_K || T == Q5_K) {
    const float d = half_to_float(blk), dmin = half_to_float(blk + 2);
    const KScales k = unpack_kscales(blk + 4);
    const uint8_t* qh = blk + 16;
    const uint8_t* qs = blk + (T == Q5_K ? 48 : 16);
    for (int j = 0; j < 8; ++j) {
      for (int l = 0; l < QK; ++l) {
        const uint8_t byte = qs[32 * (j / 2) + l];
        int v = (j % 2) ? byte >> 4 : byte & 0x0F;
        if (T == Q5_K) v |= ((qh[l] >> j) & 1) << 4;
        out.q[j][l] = static_cast<int8_t>(v);
      }
      out.scale[j][0] = out.scale[j][1] = d * k.sc[j];
      out.min[j] = -dmin * k.mn[j];
    }
  } else {
    const uint8_t* ql = blk;
    const uint8_t* qh = blk + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    const float d = half_to_float(blk + 208);
    for (int h = 0; h < 2; ++h) {
      for (int c = 0; c < 4; ++c) {
        const int j = 4 * h + c;
        for (int l = 0; l < QK; ++l) {
          const uint8_t lo = ql[64 * h + l + 32 * (c % 2)];
          const int low = c < 2 ? lo & 0x0F : lo >> 4;
          const int high = (qh[32 * h + l] >> (2 * c)) & 3;
          out.q[j][l] = static_cast<int8_t>((low | (high << 4)) - 32);
        }
        out.scale[j][0] = d * sc[2 * j];
        out.scale[j][1] = d * sc[2 * j + 1];
        out.min[j] = 0.f;
      }
    }
  }
}

#if defined(__AVX2__)

inline __m256i load256(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// 32 bits -> 32 bytes, byte j = 16 if bit j is set, else 0.
inline __m256i bits_to_16s(uint32_t bits) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  return _mm256_maskz_mov_epi8(static_cast<__mmask32>(bits), _mm256_set1_epi8(16));
#else
  // Byte j takes byte j / 8 of the word, keeps bit j % 8, and compares it with itself.
  const __m256i word = _mm256_set1_epi32(static_cast<int>(bits));
  const __m256i spread = _mm256_shuffle_epi8(
      word, _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL));
  const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
  return _mm256_and_si256(set, _mm256_set1_epi8(16));
#endif
}

// The pieces of one super-block in registers: integers, per-lane weight scales (lanes
// 0-3 of the int32 dot product cover values 0-15, lanes 4-7 values 16-31) and minimums.
template <int T>
struct Regs {
  static constexpr int kPieces = block_values<T>() / QK;
  __m256i q[kPieces];
  __m256 scale[kPieces];
  float min[kPieces];
};

template <int T>
inline void decode_regs(const uint8_t* blk, Regs<T>& r) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  if constexpr (T == Q5_0 || T == Q5_1) {
    constexpr int at = T == Q5_0 ? 2 : 4;
    const float d = half_to_float(blk);
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + at + 4));
    const __m256i nib = _mm256_and_si256(
        _mm256_set_m128i(_mm_srli_epi16(b, 4), b), low4);  // low nibbles, then high nibbles
    r.q[0] = _mm256_or_si256(nib, bits_to_16s(load_u32(blk + at)));
    r.scale[0] = _mm256_set1_ps(d);
    r.min[0] = T == Q5_0 ? -16.f * d : half_to_float(blk + 2);
  } else if constexpr (T == Q4_K || T == Q5_K) {
    const float d = half_to_float(blk), dmin = half_to_float(blk + 2);
    const KScales k = unpack_kscales(blk + 4);
    constexpr int qs_at = T == Q5_K ? 48 : 16;
    __m256i qh = _mm256_setzero_si256();
    if constexpr (T == Q5_K) qh = load256(blk + 16);
    for (int i = 0; i < 4; ++i) {
      const __m256i bytes = load256(blk + qs_at + 32 * i);
      r.q[2 * i] = _mm256_and_si256(bytes, low4);
      r.q[2 * i + 1] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
      if constexpr (T == Q5_K) {
        // Bit j of each qh byte -> 16: shift the 16-bit lanes right by j, keep bit 0 of
        // every byte (that is bit j of the byte itself), move it up to bit 4.
        const __m256i one = _mm256_set1_epi8(1);
        const __m256i h0 = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * i), one);
        const __m256i h1 = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * i + 1), one);
        r.q[2 * i] = _mm256_or_si256(r.q[2 * i], _mm256_slli_epi16(h0, 4));
        r.q[2 * i + 1] = _mm256_or_si256(r.q[2 * i + 1], _mm256_slli_epi16(h1, 4));
      }
    }
    for (int j = 0; j < 8; ++j) {
      r.scale[j] = _mm256_set1_ps(d * k.sc[j]);
      r.min[j] = -dmin * k.mn[j];
    }
  } else {
    const float d = half_to_float(blk + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    const __m256i three = _mm256_set1_epi8(3), m32 = _mm256_set1_epi8(32);
    for (int h = 0; h < 2; ++h) {
      const __m256i ql0 = load256(blk + 64 * h), ql1 = load256(blk + 64 * h + 32);
      const __m256i qh = load256(blk + 128 + 32 * h);
      const __m256i lows[4] = {_mm256_and_si256(ql0, low4), _mm256_and_si256(ql1, low4),
                               _mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4),
                               _mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4)};
      for (int c = 0; c < 4; ++c) {
        const __m256i high = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), three);
        const int j = 4 * h + c;
        r.q[j] = _mm256_sub_epi8(_mm256_or_si256(lows[c], _mm256_slli_epi16(high, 4)), m32);
        const float lo = d * sc[2 * j], hi = d * sc[2 * j + 1];
        r.scale[j] = _mm256_setr_ps(lo, lo, lo, lo, hi, hi, hi, hi);
        r.min[j] = 0.f;
      }
    }
  }
}
#endif

struct XRow {
  const int8_t* q;  // K int8
  const float* d;   // K/32 fp16-rounded scales
  const float* ds;  // d * integer sum, per 32
};

// Dot products of one weight row (nsb super-blocks) with MB activation rows.
template <int T, int MB>
void row_dot(const uint8_t* w, int64_t nsb, const XRow* xr, float* out) {
  constexpr int P = block_values<T>() / QK;
  constexpr int BB = block_bytes<T>();
  constexpr bool kHasMin = T != Q6_K;
#if defined(__AVX2__)
  __m256 acc[MB];
  float extra[MB];
  for (int m = 0; m < MB; ++m) {
    acc[m] = _mm256_setzero_ps();
    extra[m] = 0.f;
  }
  Regs<T> r;
  for (int64_t s = 0; s < nsb; ++s) {
    decode_regs<T>(w + s * BB, r);
    for (int j = 0; j < P; ++j) {
      const int64_t b = s * P + j;
      __m256i wu = r.q[j];
      if constexpr (T == Q6_K) wu = _mm256_sign_epi8(r.q[j], r.q[j]);
      for (int m = 0; m < MB; ++m) {
        __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr[m].q + b * QK));
        if constexpr (T == Q6_K) xq = _mm256_sign_epi8(xq, r.q[j]);
        const __m256 dot = _mm256_cvtepi32_ps(dot_u8s8(wu, xq));
        acc[m] = _mm256_fmadd_ps(_mm256_mul_ps(r.scale[j], _mm256_set1_ps(xr[m].d[b])), dot, acc[m]);
        if constexpr (kHasMin) extra[m] += r.min[j] * xr[m].ds[b];
      }
    }
  }
  for (int m = 0; m < MB; ++m) out[m] = hsum(acc[m]) + extra[m];
#else
  for (int m = 0; m < MB; ++m) out[m] = 0.f;
  Decoded<T> dec;
  for (int64_t s = 0; s < nsb; ++s) {
    decode_scalar<T>(w + s * BB, dec);
    for (int j = 0; j < P; ++j) {
      const int64_t b = s * P + j;
      for (int m = 0; m < MB; ++m) {
        const int8_t* xq = xr[m].q + b * QK;
        int lo = 0, hi = 0;
        for (int l = 0; l < 16; ++l) lo += dec.q[j][l] * xq[l];
        for (int l = 16; l < QK; ++l) hi += dec.q[j][l] * xq[l];
        out[m] += xr[m].d[b] * (dec.scale[j][0] * lo + dec.scale[j][1] * hi);
        if (kHasMin) out[m] += dec.min[j] * xr[m].ds[b];
      }
    }
  }
#endif
}

template <int T>
void gemm(const int8_t* xq, const float* xd, const float* xds, int64_t M, int64_t K, const uint8_t* w,
          int64_t N, float* y) {
  const int64_t nb = K / QK, nsb = K / block_values<T>(), row_bytes = nsb * block_bytes<T>();
  // Weight rows across threads; each thread decodes its rows once per 8 activation rows.
  row_kernel_gemm<XRow>(
      M, N, w, row_bytes, y, [&](int64_t m) { return XRow{xq + m * K, xd + m * nb, xds + m * nb}; },
      [&](auto mb, const uint8_t* wr, const XRow* xr, float* out) {
        row_dot<T, decltype(mb)::value>(wr, nsb, xr, out);
      });
}

}  // namespace

// Q2_K's row kernel (quant_gguf_q2k.cpp).
void gguf_q2k_row_gemm(const int8_t* xq, const float* xd, int64_t M, int64_t K, const uint8_t* w, int64_t N,
                       float* y);

// Whether `type` (a ggml type id) is one of this file's (or Q2_K, whose row kernel is in
// quant_gguf_q2k.cpp); its block's values and bytes.
bool gguf_ext_type(int64_t type, int* values, int* bytes) {
  switch (type) {
    case Q5_0: *values = 32; *bytes = 22; return true;
    case Q5_1: *values = 32; *bytes = 24; return true;
    case Q4_K: *values = 256; *bytes = 144; return true;
    case Q5_K: *values = 256; *bytes = 176; return true;
    case Q6_K: *values = 256; *bytes = 210; return true;
    case 10: *values = 256; *bytes = 84; return true;  // Q2_K
  }
  return false;
}

// y float32 [M, N] = the int8 activation blocks (xq [M, K], xd / xds [M, K/32]) times
// the weight rows w [N, K/values * bytes] of `type`.
void gguf_ext_gemm(const int8_t* xq, const float* xd, const float* xds, int64_t M, int64_t K, const uint8_t* w,
                   int64_t N, int64_t type, float* y) {
  switch (type) {
    case Q5_0: gemm<Q5_0>(xq, xd, xds, M, K, w, N, y); break;
    case Q5_1: gemm<Q5_1>(xq, xd, xds, M, K, w, N, y); break;
    case Q4_K: gemm<Q4_K>(xq, xd, xds, M, K, w, N, y); break;
    case Q5_K: gemm<Q5_K>(xq, xd, xds, M, K, w, N, y); break;
    case Q6_K: gemm<Q6_K>(xq, xd, xds, M, K, w, N, y); break;
    case 10: gguf_q2k_row_gemm(xq, xd, M, K, w, N, y); break;  // Q2_K
    default: TORCH_CHECK(false, "gguf_linear: ggml type id ", type, " has no kernel here");
  }
}
