// Matmul on GGUF IQ4_XS blocks kept in the file's bytes: the row kernel (every build) and a tiled
// GEMM on the blocks repacked once at load (AVX-512 VNNI builds), on the same int8 activation
// blocks of 32 as the other types (quantized once per call by quant_gguf.cpp).
//
// IQ4_XS (ggml-common.h block_iq4_xs, 136 bytes per 256 values): d (fp16) | scales_h (uint16) |
// scales_l[4] | qs[128].  8 sub-blocks of 32 values; sub-block j has the 6-bit scale
// ls_j = (nibble j % 2 of scales_l[j / 2]) | (bits 2j, 2j+1 of scales_h) << 4, and its 32
// nibbles in qs[16j .. 16j + 15] placed as IQ4_NL's (element l < 16 the low nibble of byte l,
// l + 16 its high nibble), each an index into IQ4_NL's 16 int8 levels (quant_gguf_iq4nl.h):
// value = (d * (ls_j - 32)) * level[nibble] (ggml's dequantize_row_iq4_xs).
//
// Numerics (both kernels): per sub-block, which is one 32-value activation block b, the exact
// integer dot = sum(level * x_q) (|dot| <= 32 * 127 * 127 < 2^20), then
// acc += ((d * (ls - 32)) * d_x) * dot; d * (ls - 32) is exact in float32 (an fp16 times a
// 6-bit integer).  Only the float32 summation order differs between the kernels; each row's
// result depends on that row alone.  (llama.cpp pairs IQ4_XS with q8_K activation blocks of
// 256 and one float32 scale; here, as for every other type, the activations are blocks of 32
// with fp16 scales: the difference is activation rounding, measured as KL in
// docs/quantization.md.)
//
// Row kernel: a sub-block's 32 nibbles become their levels with one vpshufb per 16 (AVX2);
// the product is Q8_0's, the levels' signs moved into the activations (vpsignb) and |level|
// the unsigned operand of vpdpbusd (AVX-512 VNNI/VL) or vpmaddubsw + vpmaddwd (pair sums <=
// 2 * 127 * 127 < 2^15: no saturation).  Otherwise a scalar loop with the same integers.
//
// Packed layout (tiled kernel): uint8 [N/16, K/256, 2176] (the file's size exactly), one entry
// per (16-column group, super-block):
//   8 sub-blocks of 256 bytes, each Q4_K's nibble lines of quant_gguf_kpacked.cpp: 4 lines of
//   64 bytes, byte 4c+t of line p holding column c's nibble at k = 8p+t (within the
//   sub-block) in its low half and at k = 8p+4+t in its high half;
//   then 16 fp16 d (32 bytes), 16 uint16 scales_h (32 bytes), and scales_l transposed: byte
//   16r + c = scales_l[r] of column c (64 bytes).
// The tile looks each masked nibble line up in the 16 levels + 128 (1..241, vpdpbusd's
// unsigned operand; one vpshufb per 64 bytes, the table in every 128-bit lane) and starts a
// sub-block's integer accumulators at -128 * sum(x_q) of the row's activation block, so the
// dot product is exact with no correction per column; the 16 columns' 8 scales are unpacked
// once per super-block into an L1 buffer of d * (ls - 32).
//
// Gated tiles (gguf_linear_silu_out on a packed [gate; up] weight, as quant_gguf_q3k.cpp's):
// one gate group and its up group per tile, each summed exactly as in a plain tile, then
// quant_gguf_gated.h's epilogue writes silu(gate) * up.  Part runner (gguf_linear_multi_out):
// the tiled kernel over a range of column groups inside the caller's parallel region.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "quant_gguf_common.h"
#include "quant_gguf_gated.h"

using pagedserve_gguf::half_to_float;
using pagedserve_gguf::PartRunner;
#if defined(__AVX2__)
using pagedserve_gguf::dot_u8s8;
using pagedserve_gguf::hsum;
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__)
using pagedserve_gguf::Output;
using pagedserve_gguf::prefetch_lines;
using pagedserve_gguf::to_bf16;
#endif

#include "quant_gguf_iq4nl.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PAGEDSERVE_GGUF_IQ4XS_TILED 1
#endif

// Register tile (rows x 16-column groups) and row chunk of the tiled kernel, compile-time
// overridable; prefetch distance in sub-blocks of 32 values (272 bytes of a group's entries),
// 0: none.  The tile and prefetch are Q4_K's (quant_gguf_kpacked.cpp), whose lines these are.
#ifndef PAGEDSERVE_GGUF_IQ4XS_TILE_M
#define PAGEDSERVE_GGUF_IQ4XS_TILE_M 5
#endif
#ifndef PAGEDSERVE_GGUF_IQ4XS_TILE_G
#define PAGEDSERVE_GGUF_IQ4XS_TILE_G 3
#endif
#ifndef PAGEDSERVE_GGUF_IQ4XS_CHUNK_M
#define PAGEDSERVE_GGUF_IQ4XS_CHUNK_M 240
#endif
#ifndef PAGEDSERVE_GGUF_IQ4XS_PREFETCH
#define PAGEDSERVE_GGUF_IQ4XS_PREFETCH 8
#endif

namespace {

constexpr int64_t kIq4xs = 23;
constexpr int QK = 32;
constexpr int QKK = 256;
constexpr int kBlockBytes = 136;
constexpr int kCols = 16;
constexpr int kSubBytes = 256;                     // packed bytes of one 32-value sub-block
constexpr int kDAt = 8 * kSubBytes;                // 2048: 16 fp16 d
constexpr int kHighAt = kDAt + 2 * kCols;          // 2080: 16 uint16 scales_h
constexpr int kLowAt = kHighAt + 2 * kCols;        // 2112: scales_l[4] transposed
constexpr int kEntryBytes = kLowAt + 4 * kCols;    // 2176 = 16 * 136
static_assert(kEntryBytes == kCols * kBlockBytes, "the packed entry holds the file's bytes");

using pagedserve_iq4nl::kValues;

// The 8 sub-block scales of a block, ls - 32 (-32..31).
inline void block_scales(const uint8_t* blk, int* out) {
  const unsigned high = blk[2] | (unsigned(blk[3]) << 8);
  for (int j = 0; j < 8; ++j) {
    const int low = (blk[4 + j / 2] >> (4 * (j % 2))) & 0x0F;
    out[j] = (low | (((high >> (2 * j)) & 3) << 4)) - 32;
  }
}

// Nibble k (0..31) of sub-block j of a block.
inline int nibble_of(const uint8_t* blk, int j, int k) {
  const uint8_t byte = blk[8 + 16 * j + k % 16];
  return k < 16 ? byte & 0x0F : byte >> 4;
}

// -- the row kernel (the file's blocks; every build) ------------------------------------------

struct XRow {
  const int8_t* q;  // [K]
  const float* d;   // [K / 32]
};

#if defined(__AVX2__)
// A sub-block's 32 levels (int8) from its 16 bytes of nibbles: element l < 16 from the low
// nibbles, l + 16 from the high ones.
inline __m256i sub_levels(const uint8_t* qs, __m256i levels) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low4), _mm_and_si128(b, low4));
  return _mm256_shuffle_epi8(levels, nib);  // per 128-bit lane, both lanes holding the table
}
#endif

// Dot products of one weight row (nsb blocks) with MB activation rows.
template <int MB>
void row_dot(const uint8_t* w, int64_t nsb, const XRow* xr, float* out) {
  int sc[8];
#if defined(__AVX2__)
  const __m256i levels = pagedserve_iq4nl::levels_s8_256();
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* blk = w + s * kBlockBytes;
    const float d = half_to_float(blk);
    block_scales(blk, sc);
    for (int j = 0; j < 8; ++j) {
      const int64_t b = s * 8 + j;
      const float dl = d * static_cast<float>(sc[j]);  // exact
      const __m256i wq = sub_levels(blk + 8 + 16 * j, levels);
      const __m256i wabs = _mm256_sign_epi8(wq, wq);
      for (int m = 0; m < MB; ++m) {
        const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr[m].q + b * QK));
        const __m256i dot = dot_u8s8(wabs, _mm256_sign_epi8(xq, wq));
        acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(dl * xr[m].d[b]), _mm256_cvtepi32_ps(dot), acc[m]);
      }
    }
  }
  for (int m = 0; m < MB; ++m) out[m] = hsum(acc[m]);
#else
  for (int m = 0; m < MB; ++m) out[m] = 0.f;
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* blk = w + s * kBlockBytes;
    const float d = half_to_float(blk);
    block_scales(blk, sc);
    for (int j = 0; j < 8; ++j) {
      const int64_t b = s * 8 + j;
      int8_t q[QK];
      for (int k = 0; k < QK; ++k) q[k] = kValues[nibble_of(blk, j, k)];
      const float dl = d * static_cast<float>(sc[j]);
      for (int m = 0; m < MB; ++m) {
        const int8_t* xq = xr[m].q + b * QK;
        int dot = 0;
        for (int k = 0; k < QK; ++k) dot += q[k] * xq[k];
        out[m] += (dl * xr[m].d[b]) * static_cast<float>(dot);
      }
    }
  }
#endif
}

// -- packing -----------------------------------------------------------------------------------

// One (group, super-block) entry from the 16 columns' blocks (row stride row_bytes).
void pack_entry(const uint8_t* w, int64_t row_bytes, uint8_t* dst) {
  std::memset(dst, 0, kDAt);
  for (int c = 0; c < kCols; ++c) {
    const uint8_t* blk = w + c * row_bytes;
    for (int j = 0; j < 8; ++j) {
      uint8_t* sub = dst + j * kSubBytes;
      for (int k = 0; k < QK; ++k) {
        const int group = k / 4;  // lines 2p (low nibble) and 2p+1 (high) share byte line p
        const uint8_t v = static_cast<uint8_t>(nibble_of(blk, j, k));
        sub[(group / 2) * 64 + c * 4 + k % 4] |= (group % 2) ? uint8_t(v << 4) : v;
      }
    }
    std::memcpy(dst + kDAt + 2 * c, blk, 2);
    std::memcpy(dst + kHighAt + 2 * c, blk + 2, 2);
    for (int r = 0; r < 4; ++r) dst[kLowAt + 16 * r + c] = blk[4 + r];
  }
}

// Column c's block of the packed entry e, in the file's layout (blk).
void unpack_block(const uint8_t* e, int c, uint8_t* blk) {
  std::memcpy(blk, e + kDAt + 2 * c, 2);
  std::memcpy(blk + 2, e + kHighAt + 2 * c, 2);
  for (int r = 0; r < 4; ++r) blk[4 + r] = e[kLowAt + 16 * r + c];
  std::memset(blk + 8, 0, 128);
  for (int j = 0; j < 8; ++j) {
    const uint8_t* sub = e + j * kSubBytes;
    for (int k = 0; k < QK; ++k) {
      const int group = k / 4;
      const uint8_t byte = sub[(group / 2) * 64 + c * 4 + k % 4];
      const uint8_t v = (group % 2) ? byte >> 4 : byte & 0x0F;
      blk[8 + 16 * j + k % 16] |= k < 16 ? v : uint8_t(v << 4);
    }
  }
}

// -- the tiled kernel (AVX-512 VNNI) -----------------------------------------------------------
#if defined(PAGEDSERVE_GGUF_IQ4XS_TILED)

struct Activations {
  const int8_t* q;      // [M, K]
  const float* d;       // [M, K/32]
  const int32_t* isum;  // [M, K/32] the integer sum of each activation block
  int64_t k, nb;
};

inline __m128i load128(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline __m256i load256(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// The 16 columns' weight scales d * (ls_j - 32) of entry e, for the 8 sub-blocks j.
inline void entry_scales(const uint8_t* e, float (&wsc)[8][kCols]) {
  const __m512 d = _mm512_cvtph_ps(load256(e + kDAt));
  const __m512i high = _mm512_cvtepu16_epi32(load256(e + kHighAt));
  const __m512i m4 = _mm512_set1_epi32(0x0F), m3 = _mm512_set1_epi32(3), m32 = _mm512_set1_epi32(32);
  for (int r = 0; r < 4; ++r) {
    const __m512i low = _mm512_cvtepu8_epi32(load128(e + kLowAt + 16 * r));
    for (int h = 0; h < 2; ++h) {
      const int j = 2 * r + h;
      const __m512i lo = _mm512_and_si512(h ? _mm512_srli_epi32(low, 4) : low, m4);
      const __m512i hi = _mm512_and_si512(_mm512_srlv_epi32(high, _mm512_set1_epi32(2 * j)), m3);
      const __m512i ls = _mm512_sub_epi32(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 4)), m32);
      _mm512_store_ps(wsc[j], _mm512_mul_ps(d, _mm512_cvtepi32_ps(ls)));  // exact
    }
  }
}

inline void prefetch_ahead(const uint8_t* group, int64_t nsb, int64_t s, int sub) {
  if constexpr (PAGEDSERVE_GGUF_IQ4XS_PREFETCH > 0) {
    constexpr int64_t PART = kEntryBytes / 8;
    const int64_t at = (8 * s + sub + PAGEDSERVE_GGUF_IQ4XS_PREFETCH) * PART;
    prefetch_lines(group, at, PART, nsb * kEntryBytes);
  }
}

// The integer dot products of one 32-value sub-block for MT rows x NG column groups:
// iacc[i][j] lane c = sum over the 32 k of column c's level times row i's x (the levels + 128
// through vpdpbusd from init[i] = -128 * sum(x)).  xb[i]: the row's 32 activations; wb[j]: the
// group's packed sub-block.
template <int MT, int NG>
inline void sub_dots(const int8_t* const* xb, const __m512i (&init)[MT], const uint8_t* const* wb,
                     __m512i (&iacc)[MT][NG]) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i levels = pagedserve_iq4nl::levels_u8_512();
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NG; ++j) iacc[i][j] = init[i];
#pragma GCC unroll 4
  for (int p = 0; p < 4; ++p) {
    __m512i raw[NG];
    for (int j = 0; j < NG; ++j) raw[j] = _mm512_loadu_si512(wb[j] + p * 64);
    for (int h = 0; h < 2; ++h) {
      __m512i wv[NG];
      for (int j = 0; j < NG; ++j)  // nibble -> its level + 128
        wv[j] = _mm512_shuffle_epi8(levels, _mm512_and_si512(h ? _mm512_srli_epi16(raw[j], 4) : raw[j], low4));
      for (int i = 0; i < MT; ++i) {
        int32_t x4;
        std::memcpy(&x4, xb[i] + 8 * p + 4 * h, 4);
        const __m512i xv = _mm512_set1_epi32(x4);
        for (int j = 0; j < NG; ++j) iacc[i][j] = _mm512_dpbusd_epi32(iacc[i][j], wv[j], xv);
      }
    }
  }
}

// Rows [m0, m0 + MT) x NG column groups from g0.  Integer accumulators MT x NG in registers
// (one sub-block at a time), float accumulators and the super-block's scales in L1 buffers.
// GATED: the first NG/2 groups are gate groups g0.., the last NG/2 their up groups
// g0 + o.half.., the epilogue writes silu(gate) * up at the gate columns
// (quant_gguf_gated.h), each lane summed as in a plain tile.
template <int MT, int NG, bool GATED = false>
void tile(const Activations& a, const uint8_t* w, int64_t group_stride, int64_t m0, int64_t g0, const Output& o) {
  alignas(64) float facc[MT][NG][kCols];
  alignas(64) float wsc[NG][8][kCols];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NG; ++j) _mm512_store_ps(facc[i][j], _mm512_setzero_ps());
  const int64_t nsb = a.k / QKK;
  const int8_t* xr[MT];
  for (int i = 0; i < MT; ++i) xr[i] = a.q + (m0 + i) * a.k;
  const uint8_t* wg[NG];
  for (int j = 0; j < NG; ++j) wg[j] = w + (GATED && j >= NG / 2 ? g0 + o.half + j - NG / 2 : g0 + j) * group_stride;
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* e[NG];
    for (int j = 0; j < NG; ++j) {
      e[j] = wg[j] + s * kEntryBytes;
      entry_scales(e[j], wsc[j]);
    }
    for (int sub = 0; sub < 8; ++sub) {
      const int64_t b = s * 8 + sub;
      for (int j = 0; j < NG; ++j) prefetch_ahead(wg[j], nsb, s, sub);
      const int8_t* xb[MT];
      __m512i init[MT];
      for (int i = 0; i < MT; ++i) {
        xb[i] = xr[i] + b * QK;
        init[i] = _mm512_set1_epi32(-128 * a.isum[(m0 + i) * a.nb + b]);
      }
      const uint8_t* wb[NG];
      for (int j = 0; j < NG; ++j) wb[j] = e[j] + sub * kSubBytes;
      __m512i iacc[MT][NG];
      sub_dots<MT, NG>(xb, init, wb, iacc);
      for (int i = 0; i < MT; ++i) {
        const __m512 dx = _mm512_set1_ps(a.d[(m0 + i) * a.nb + b]);
        for (int j = 0; j < NG; ++j)
          _mm512_store_ps(facc[i][j], _mm512_fmadd_ps(_mm512_mul_ps(_mm512_load_ps(wsc[j][sub]), dx),
                                                      _mm512_cvtepi32_ps(iacc[i][j]), _mm512_load_ps(facc[i][j])));
      }
    }
  }
  if constexpr (GATED) {
#if defined(PAGEDSERVE_GGUF_K_GATED)
    constexpr int P = NG / 2;
    for (int j = 0; j < P; ++j) {
      const int64_t ng = (g0 + j) * kCols, nu = (g0 + o.half + j) * kCols;
      for (int i = 0; i < MT; ++i)
        pagedserve_gguf::store_silu_mul(_mm512_load_ps(facc[i][j]), _mm512_load_ps(facc[i][j + P]), o, ng, nu,
                                        (m0 + i) * o.ldy + ng);
    }
#endif
    return;
  }
  for (int j = 0; j < NG; ++j) {
    const int64_t n0 = (g0 + j) * kCols;
    const __m512 bias = o.bias ? _mm512_loadu_ps(o.bias + n0) : _mm512_setzero_ps();
    for (int i = 0; i < MT; ++i) {
      __m512 v = _mm512_load_ps(facc[i][j]);
      if (o.bias) v = _mm512_add_ps(v, bias);
      const int64_t at = (m0 + i) * o.ldy + n0;
      if (o.bf16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(o.y) + at), to_bf16(v));
      else
        _mm512_storeu_ps(static_cast<float*>(o.y) + at, v);
    }
  }
}

// The tile of h <= H rows at m0.
template <int H, int NG, bool GATED = false>
inline void tile_of_height(int64_t h, const Activations& a, const uint8_t* w, int64_t gs, int64_t m0, int64_t g0,
                           const Output& o) {
  if constexpr (H >= 1) {
    if (h == H) return tile<H, NG, GATED>(a, w, gs, m0, g0, o);
    tile_of_height<H - 1, NG, GATED>(h, a, w, gs, m0, g0, o);
  }
}

// Rows [mb, me) of NG column groups from g0, in tiles of heights as even as they go (no short
// tile that unpacks the weights for one row).
template <int TM, int NG, bool GATED = false>
void rows(const Activations& a, const uint8_t* w, int64_t gs, int64_t mb, int64_t me, int64_t g0, const Output& o) {
  const int64_t count = me - mb;
  if (count <= 0) return;
  const int64_t tiles = (count + TM - 1) / TM;
  for (int64_t t = 0, m0 = mb; t < tiles; ++t) {
    const int64_t h = count / tiles + (t < count % tiles);
    tile_of_height<TM, NG, GATED>(h, a, w, gs, m0, g0, o);
    m0 += h;
  }
}

// Rows [mb, me) of g <= NG column groups from g0.
template <int TM, int NG>
inline void rows_of_width(int64_t g, const Activations& a, const uint8_t* w, int64_t gs, int64_t mb, int64_t me,
                          int64_t g0, const Output& o) {
  if constexpr (NG >= 1) {
    if (g == NG) return rows<TM, NG>(a, w, gs, mb, me, g0, o);
    rows_of_width<TM, NG - 1>(g, a, w, gs, mb, me, g0, o);
  }
}

// Column groups [gb, ge) for every row, on the calling thread.
void run_groups(const Activations& a, const uint8_t* w, int64_t M, int64_t gb, int64_t ge, const Output& o) {
  constexpr int TM = PAGEDSERVE_GGUF_IQ4XS_TILE_M, TG = PAGEDSERVE_GGUF_IQ4XS_TILE_G;
  static_assert(TM >= 1 && TM <= 8 && TG >= 1 && TG <= 4, "IQ4_XS tiles: up to 8 rows x 4 groups");
  const int64_t gs = (a.k / QKK) * kEntryBytes;
  for (int64_t mb = 0; mb < M; mb += PAGEDSERVE_GGUF_IQ4XS_CHUNK_M) {
    const int64_t me = std::min<int64_t>(M, mb + PAGEDSERVE_GGUF_IQ4XS_CHUNK_M);
    for (int64_t g0 = gb; g0 < ge; g0 += TG)
      rows_of_width<TM, TG>(std::min<int64_t>(TG, ge - g0), a, w, gs, mb, me, g0, o);
  }
}

void run_tiled(const Activations& a, const uint8_t* w, int64_t M, int64_t groups, const Output& o) {
  at::parallel_for(0, groups, 1, [&](int64_t gb, int64_t ge) { run_groups(a, w, M, gb, ge, o); });
}

#if defined(PAGEDSERVE_GGUF_K_GATED)
#ifndef PAGEDSERVE_GGUF_IQ4XS_GATED_TILE_M
#define PAGEDSERVE_GGUF_IQ4XS_GATED_TILE_M PAGEDSERVE_GGUF_IQ4XS_TILE_M
#endif
// As run_tiled, over the o.half gate groups, each tile taking its up group along.
void run_gated(const Activations& a, const uint8_t* w, int64_t M, const Output& o) {
  constexpr int TM = PAGEDSERVE_GGUF_IQ4XS_GATED_TILE_M;
  static_assert(TM >= 1 && TM <= 8, "IQ4_XS gated tiles: up to 8 rows");
  const int64_t gs = (a.k / QKK) * kEntryBytes;
  at::parallel_for(0, o.half, 1, [&](int64_t gb, int64_t ge) {
    for (int64_t mb = 0; mb < M; mb += PAGEDSERVE_GGUF_IQ4XS_CHUNK_M) {
      const int64_t me = std::min<int64_t>(M, mb + PAGEDSERVE_GGUF_IQ4XS_CHUNK_M);
      for (int64_t g0 = gb; g0 < ge; ++g0) rows<TM, 2, true>(a, w, gs, mb, me, g0, o);
    }
  });
}
#endif

#endif  // PAGEDSERVE_GGUF_IQ4XS_TILED

}  // namespace

// Whether `type` is IQ4_XS; its block's values and bytes.
bool gguf_iq4xs_block(int64_t type, int* values, int* bytes) {
  if (type != kIq4xs) return false;
  *values = QKK;
  *bytes = kBlockBytes;
  return true;
}

// Whether this build has the tiled IQ4_XS kernel (AVX-512 VNNI).
bool gguf_iq4xs_tiled() {
#if defined(PAGEDSERVE_GGUF_IQ4XS_TILED)
  return true;
#else
  return false;
#endif
}

// y float32 [M, N] = the int8 activation blocks (xq [M, K], xd [M, K/32]) times the IQ4_XS
// rows w [N, K/256 * 136] (the file's blocks).
void gguf_iq4xs_row_gemm(const int8_t* xq, const float* xd, int64_t M, int64_t K, const uint8_t* w, int64_t N,
                         float* y) {
  const int64_t nb = K / QK, nsb = K / QKK, row_bytes = nsb * kBlockBytes;
  // Weight rows across threads; each thread decodes its rows once per 8 activation rows.
  pagedserve_gguf::row_kernel_gemm<XRow>(
      M, N, w, row_bytes, y, [&](int64_t m) { return XRow{xq + m * K, xd + m * nb}; },
      [nsb](auto mb, const uint8_t* wr, const XRow* xr, float* out) {
        row_dot<decltype(mb)::value>(wr, nsb, xr, out);
      });
}

// weight: uint8 [N, K/256 * 136] IQ4_XS blocks, N a multiple of 16 -> the packed layout above,
// uint8 [N/16, K/256, 2176].
torch::Tensor gguf_iq4xs_pack(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kUInt8, "gguf_pack_weight: uint8 [N, row_bytes]");
  weight = weight.contiguous();
  const int64_t N = weight.size(0), row_bytes = weight.size(1);
  TORCH_CHECK(N % kCols == 0, "gguf_pack_weight: N=", N, " is not a multiple of ", kCols);
  TORCH_CHECK(row_bytes % kBlockBytes == 0, "gguf_pack_weight: rows of ", row_bytes,
              " bytes are not whole IQ4_XS blocks");
  const int64_t nsb = row_bytes / kBlockBytes, groups = N / kCols;
  auto out = torch::empty({groups, nsb, kEntryBytes}, weight.options());
  const uint8_t* src = weight.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t s = 0; s < nsb; ++s)
        pack_entry(src + g * kCols * row_bytes + s * kBlockBytes, row_bytes, dst + (g * nsb + s) * kEntryBytes);
  });
  return out;
}

// Rows `ids` (int64 [n]) of a packed IQ4_XS weight [N/16, K/256, 2176] in the file's blocks,
// uint8 [n, K/256 * 136] (a tied embedding's rows).
torch::Tensor gguf_iq4xs_unpack_rows(torch::Tensor packed, torch::Tensor ids) {
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == torch::kUInt8 && packed.size(2) == kEntryBytes,
              "gguf_unpack_rows: packed IQ4_XS uint8 [N/16, K/256, 2176] expected");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == torch::kLong, "gguf_unpack_rows: ids must be int64 [n]");
  packed = packed.contiguous();
  ids = ids.contiguous();
  const int64_t groups = packed.size(0), nsb = packed.size(1), n = ids.size(0);
  auto out = torch::empty({n, nsb * kBlockBytes}, packed.options());
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < groups * kCols, "gguf_unpack_rows: row ", id[i], " out of range");
  const uint8_t* src = packed.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, n, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t g = id[i] / kCols;
      const int c = static_cast<int>(id[i] % kCols);
      for (int64_t s = 0; s < nsb; ++s)
        unpack_block(src + (g * nsb + s) * kEntryBytes, c, dst + (i * nsb + s) * kBlockBytes);
    }
  });
  return out;
}

// y [M, N] = quantized activations (xq [M, K], xd [M, K/32], xsum [M, K/32] their integer
// block sums) @ packed IQ4_XS weight [N/16, K/256, 2176]^T (+ bias float32 [N] or null):
// float32, or bf16 (y_bf16) rounded once.
void gguf_iq4xs_tiled_gemm(const int8_t* xq, const float* xd, const int32_t* xsum, int64_t M, int64_t K,
                           const uint8_t* w, int64_t groups, void* y, bool y_bf16, const float* bias) {
#if defined(PAGEDSERVE_GGUF_IQ4XS_TILED)
  const Activations a{xq, xd, xsum, K, K / QK};
  const Output o{y, y_bf16, bias, groups * kCols};
  run_tiled(a, w, M, groups, o);
#else
  (void)xq, (void)xd, (void)xsum, (void)M, (void)K, (void)w, (void)groups, (void)y, (void)y_bf16, (void)bias;
  TORCH_CHECK(false, "gguf_linear: this build has no tiled IQ4_XS kernel (AVX-512 VNNI)");
#endif
}

// Whether this build has the gated tiled IQ4_XS kernel.
bool gguf_iq4xs_gated() {
#if defined(PAGEDSERVE_GGUF_IQ4XS_TILED) && defined(PAGEDSERVE_GGUF_K_GATED)
  return true;
#else
  return false;
#endif
}

// silu(y[:, :d]) * y[:, d:] of gguf_iq4xs_tiled_gemm for a packed [gate; up] weight of
// `groups` column groups (d = 8 * groups), y [M, d], each half rounded first as
// gguf_iq4xs_tiled_gemm rounds its output, then the main kernels' SiLU-and-mul.
void gguf_iq4xs_tiled_gemm_silu(const int8_t* xq, const float* xd, const int32_t* xsum, int64_t M, int64_t K,
                                const uint8_t* w, int64_t groups, void* y, bool y_bf16, const float* bias) {
#if defined(PAGEDSERVE_GGUF_IQ4XS_TILED) && defined(PAGEDSERVE_GGUF_K_GATED)
  TORCH_CHECK(groups % 2 == 0, "gguf_linear_silu_and_mul: ", groups, " column groups do not split into gate and up");
  const Activations a{xq, xd, xsum, K, K / QK};
  const Output o{y, y_bf16, bias, groups / 2 * kCols, groups / 2};
  run_gated(a, w, M, o);
#else
  (void)xq, (void)xd, (void)xsum, (void)M, (void)K, (void)w, (void)groups, (void)y, (void)y_bf16, (void)bias;
  TORCH_CHECK(false, "gguf_linear_silu_and_mul: this build has no gated IQ4_XS kernel");
#endif
}

// A packed IQ4_XS weight as one part of a stacked call (its activation block sums are the
// caller's, computed once with the activations).
PartRunner gguf_iq4xs_part(const int8_t* xq, const float* xd, const int32_t* xsum, int64_t M, int64_t K,
                           const uint8_t* w, bool y_bf16) {
#if defined(PAGEDSERVE_GGUF_IQ4XS_TILED)
  return [=](int64_t gb, int64_t ge, void* y, const float* bias, int64_t ldy) {
    const Activations a{xq, xd, xsum, K, K / QK};
    run_groups(a, w, M, gb, ge, Output{y, y_bf16, bias, ldy});
  };
#else
  (void)xq, (void)xd, (void)xsum, (void)M, (void)K, (void)w, (void)y_bf16;
  TORCH_CHECK(false, "gguf_linear_multi: this build has no tiled IQ4_XS kernel (AVX-512 VNNI)");
#endif
}
