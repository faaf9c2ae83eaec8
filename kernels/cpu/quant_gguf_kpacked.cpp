// Tiled GEMM on the K-quants Q4_K, Q5_K and Q6_K repacked once at load (AVX-512 VNNI), the
// super-block counterpart of quant_gguf_packed.cpp's Q4_x / Q5_0 / Q8_0 kernel.
//
// The row kernel (quant_gguf_kquant.cpp) decodes a weight row's super-blocks once per 8
// activation rows and reduces every dot product horizontally.  Here 16 output columns are
// interleaved per 4 k, as in the Q4_x packed layout: one vpdpbusd multiplies 4 k of all 16
// columns with a broadcast group of 4 int8 activations, so a weight line serves every row
// of a register tile and nothing is reduced horizontally.  The scales of the 16 columns
// sit side by side, so that a sub-block's 16 scales are one vector.
//
// Packed layout: uint8 [N/16, K/256, 16 * block_bytes] (the file's size exactly), one entry
// per (16-column group, 256-value super-block):
//   Q4_K (2304 bytes): 8 sub-blocks of 256 bytes, each the Q4_x lines of quant_gguf_packed:
//        4 lines of 64 bytes, byte 4c+t of line p holding column c's value at k = 8p+t
//        (within the sub-block) in its low nibble and at k = 8p+4+t in its high nibble;
//        then 16 fp16 d, 16 fp16 dmin, and the 12 scale bytes transposed: byte 16r+c =
//        byte r of column c's scales[12] (the 6-bit scales and minimums, unpacked here
//        for 16 columns at once with 128-bit masks and shifts).
//   Q5_K (2816 bytes): 8 sub-blocks of 320 bytes: the low 4 bits of q (0..31) in Q4_K's
//        lines, then 64 bytes of fifth bits (a plane of its own: bit j of byte
//        4c+t is the fifth bit of column c's value at k = 4j+t, moved to bit 4 of unpacked
//        line j by a shift and merged with one vpternlogd); then Q4_K's tail (d, dmin,
//        transposed scales[12]).
//   Q6_K (3360 bytes): 8 sub-blocks of 384 bytes: the low 4 bits of q (0..63) in the
//        lines above, then 2 lines of 64 bytes of top bits: byte 4c+t of line h holds in
//        bits 2i..2i+1 the top 2 bits of column c's value at k = 16h+4i+t; then the int8
//        scales transposed (byte 16r+c = scale r, per 16 values, of column c) and 16
//        fp16 d.
//
// Numerics: the same int8 activations (quantized once per call by quant_gguf.cpp) and the
// same exact integer dot product per 32 values (Q4_K, Q5_K) or 16 values (Q6_K, q - 32 through
// the unsigned q and the integer sum of the 16 activations) as the row kernel, and the
// same float products: acc += (d*sc * d_x) * dot, the minimum term -dmin*mn * d_x * sum(x)
// summed apart and added at the end; Q6_K joins a block's two halves before its one d_x
// step, acc += d_x * (d*sc_0 * dot_0 + d*sc_1 * dot_1).  Only the float32 rounding and
// summation order differ (a few units in the last place).  Each row's result depends on
// that row alone.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "quant_gguf_common.h"
#include "quant_gguf_tiles.h"

using pagedserve_gguf::Call;
using pagedserve_gguf::PartRunner;
using pagedserve_gguf::TiledArgs;
#if defined(__AVX512F__) && defined(__AVX512BW__)
using pagedserve_gguf::Output;
using pagedserve_gguf::prefetch_lines;
using pagedserve_gguf::scaled_sums16;
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define PAGEDSERVE_GGUF_KPACKED 1
#endif

// Register tiles (rows x 16-column groups) and row chunk, compile-time overridable:
// PAGEDSERVE_GGUF_K_TILE_* for Q4_K / Q5_K, PAGEDSERVE_GGUF_Q6K_TILE_* for Q6_K (figures
// in docs/quantization.md).  The minimum term of Q4_K / Q5_K is summed in a second pass
// over the super-blocks, so the main loop's registers hold only the integer accumulators
// (as in quant_gguf_packed.cpp's tile), not float ones beside them.
#ifndef PAGEDSERVE_GGUF_K_TILE_M
#define PAGEDSERVE_GGUF_K_TILE_M 5
#endif
#ifndef PAGEDSERVE_GGUF_K_TILE_G
#define PAGEDSERVE_GGUF_K_TILE_G 3
#endif
#ifndef PAGEDSERVE_GGUF_Q6K_TILE_M
#define PAGEDSERVE_GGUF_Q6K_TILE_M 6
#endif
#ifndef PAGEDSERVE_GGUF_Q6K_TILE_G
#define PAGEDSERVE_GGUF_Q6K_TILE_G 2
#endif
#ifndef PAGEDSERVE_GGUF_K_CHUNK_M
#define PAGEDSERVE_GGUF_K_CHUNK_M 240
#endif
// How far ahead a tile prefetches its column groups' weights, in sub-blocks of 32 values
// (an eighth of a (group, super-block) entry: 288 bytes Q4_K, 352 Q5_K, 420 Q6_K); 0: none.
// A group's weights are one short sequential stream (K 1536: 6 entries, 14-20 KB), as in
// quant_gguf_packed.cpp; one super-block ahead took 0.78-0.85x main's time at 4 rows and
// 0.86-0.94x at 16 on Zen 4, within noise from 64 (docs/quantization.md).
#ifndef PAGEDSERVE_GGUF_Q4K_PREFETCH
#define PAGEDSERVE_GGUF_Q4K_PREFETCH 8
#endif
#ifndef PAGEDSERVE_GGUF_Q5K_PREFETCH
#define PAGEDSERVE_GGUF_Q5K_PREFETCH 8
#endif
#ifndef PAGEDSERVE_GGUF_Q6K_PREFETCH
#define PAGEDSERVE_GGUF_Q6K_PREFETCH 8
#endif
// Calls of at most PAGEDSERVE_GGUF_K_SMALL_M rows take tiles of PAGEDSERVE_GGUF_K_SMALL_G
// column groups (0: the tiles above): at one or two rows a tile's integer accumulators
// are few dependency chains of vpdpbusd, so more column groups keep more of them in flight.
// 2 rows x 4 groups measured within noise of the tiles above (Q6_K 0.90x at one row, the
// others 0.95-1.04x), so it is off.
#ifndef PAGEDSERVE_GGUF_K_SMALL_M
#define PAGEDSERVE_GGUF_K_SMALL_M 0
#endif
#ifndef PAGEDSERVE_GGUF_K_SMALL_G
#define PAGEDSERVE_GGUF_K_SMALL_G 4
#endif
// The gated tiles (gguf_linear_silu_out on a [gate; up] weight): rows, and gate/up pairs of
// column groups per tile (2 x this many groups in registers).
#ifndef PAGEDSERVE_GGUF_K_GATED_TILE_M
#define PAGEDSERVE_GGUF_K_GATED_TILE_M 5
#endif
#ifndef PAGEDSERVE_GGUF_Q6K_GATED_TILE_M
#define PAGEDSERVE_GGUF_Q6K_GATED_TILE_M 6
#endif
#ifndef PAGEDSERVE_GGUF_K_GATED_PAIRS
#define PAGEDSERVE_GGUF_K_GATED_PAIRS 1
#endif

namespace {

constexpr int QK = 32;
constexpr int QKK = 256;
constexpr int kCols = 16;
enum KType : int64_t { Q4_K = 12, Q5_K = 13, Q6_K = 14, Q2_K = 10 };

constexpr int kblock_bytes(int64_t t) { return t == Q4_K ? 144 : t == Q5_K ? 176 : 210; }
constexpr int sub_bytes(int64_t t) { return t == Q4_K ? 256 : t == Q5_K ? 320 : 384; }
template <int64_t T>
constexpr int kblock_bytes() {
  return kblock_bytes(T);
}
template <int64_t T>
constexpr int sub_bytes() {  // packed bytes of one 32-value sub-block of 16 columns
  return sub_bytes(T);
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// The 256 integers of one super-block of a column: Q4_K 0..15, Q5_K 0..31, Q6_K 0..63
// (q before - 32).
void decode_ints(const uint8_t* blk, int64_t type, uint8_t* q) {
  if (type == Q4_K || type == Q5_K) {
    const uint8_t* qs = blk + (type == Q5_K ? 48 : 16);
    const uint8_t* qh = blk + 16;  // Q5_K: bit j of qh[l] is sub-block j's fifth bit
    for (int j = 0; j < 8; ++j)
      for (int l = 0; l < QK; ++l) {
        const uint8_t byte = qs[32 * (j / 2) + l];
        q[32 * j + l] = (j % 2) ? byte >> 4 : byte & 0x0F;
        if (type == Q5_K) q[32 * j + l] |= uint8_t(((qh[l] >> j) & 1) << 4);
      }
  } else {
    const uint8_t* ql = blk;
    const uint8_t* qh = blk + 128;
    for (int h = 0; h < 2; ++h)
      for (int c = 0; c < 4; ++c)
        for (int l = 0; l < QK; ++l) {
          const uint8_t lo = ql[64 * h + l + 32 * (c % 2)];
          const int low = c < 2 ? lo & 0x0F : lo >> 4;
          const int high = (qh[32 * h + l] >> (2 * c)) & 3;
          q[128 * h + 32 * c + l] = static_cast<uint8_t>(low | (high << 4));
        }
  }
}

// One (group, super-block) entry from the 16 columns' blocks (row stride row_bytes).
void pack_kentry(const uint8_t* w, int64_t row_bytes, int64_t type, uint8_t* dst) {
  const int sb = sub_bytes(type);
  std::memset(dst, 0, 8 * sb);
  uint8_t q[QKK];
  for (int c = 0; c < kCols; ++c) {
    const uint8_t* blk = w + c * row_bytes;
    decode_ints(blk, type, q);
    for (int j = 0; j < 8; ++j) {
      uint8_t* sub = dst + j * sb;
      for (int k = 0; k < QK; ++k) {
        const uint8_t v = q[32 * j + k];
        const int group = k / 4;  // lines 2p (low nibble) and 2p+1 (high) share byte line p
        sub[(group / 2) * 64 + c * 4 + k % 4] |= (group % 2) ? uint8_t((v & 0x0F) << 4) : uint8_t(v & 0x0F);
        if (type == Q6_K) sub[256 + (k / 16) * 64 + c * 4 + k % 4] |= uint8_t((v >> 4) << (2 * ((k % 16) / 4)));
        // Q5_K's fifth bit: bit `group` (= 2p + h, the unpacked line) of byte 4c + t.
        if (type == Q5_K && (v >> 4)) sub[256 + c * 4 + k % 4] |= uint8_t(1u << group);
      }
    }
    uint8_t* tail = dst + 8 * sb;
    if (type == Q4_K || type == Q5_K) {
      std::memcpy(tail + 2 * c, blk, 2);
      std::memcpy(tail + 32 + 2 * c, blk + 2, 2);
      for (int r = 0; r < 12; ++r) tail[64 + 16 * r + c] = blk[4 + r];
    } else {
      for (int r = 0; r < 16; ++r) tail[16 * r + c] = blk[192 + r];
      std::memcpy(tail + 256 + 2 * c, blk + 208, 2);
    }
  }
}

#if defined(PAGEDSERVE_GGUF_KPACKED)

struct Activations {
  const int8_t* q;    // [M, K]
  const float* d;     // [M, nb]
  const float* ds;    // [M, nb] d * integer sum
  const int32_t* c16; // [M, K/16] -32 * the integer sum of 16 values (Q6_K's q - 32), else null
  int64_t k, nb;
};

inline __m512 bytes_to_ps(__m128i b) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)); }
inline __m128i load128(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline __m512 load_halves(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <int64_t T>
constexpr int prefetch_subs() {
  return T == Q4_K ? PAGEDSERVE_GGUF_Q4K_PREFETCH : T == Q5_K ? PAGEDSERVE_GGUF_Q5K_PREFETCH
                                                              : PAGEDSERVE_GGUF_Q6K_PREFETCH;
}

// Prefetches the cache lines of the eighth of a group's weight stream that sub-block
// `sub` of super-block `s` is PF sub-blocks ahead of (bytes [(8s + sub + PF) EB/8, + EB/8)
// of the group's entries), none past the group's last entry.
template <int64_t T, int PF>
inline void prefetch_ahead(const uint8_t* group, int64_t nsb, int64_t s, int sub) {
  if constexpr (PF > 0) {
    constexpr int64_t EB = kCols * kblock_bytes<T>(), PART = EB / 8;
    const int64_t at = (8 * s + sub + PF) * PART;
    prefetch_lines(group, at, PART, nsb * EB);
  }
}

// Q5_K's fifth bits of unpacked line j (bit j of every byte) at bit 4
// (a 16-bit shift of at most 4 places never crosses a byte here).
inline __m512i fifth_bits_at_4(__m512i f, int line) {
  switch (line) {
    case 0: return _mm512_slli_epi16(f, 4);
    case 1: return _mm512_slli_epi16(f, 3);
    case 2: return _mm512_slli_epi16(f, 2);
    case 3: return _mm512_slli_epi16(f, 1);
    case 4: return f;
    case 5: return _mm512_srli_epi16(f, 1);
    case 6: return _mm512_srli_epi16(f, 2);
    default: return _mm512_srli_epi16(f, 3);
  }
}

// Q4_K / Q5_K: the 16 columns' 6-bit scales (MINS false) or minimums (MINS true) of the 8
// sub-blocks, as bytes, from the transposed scales[12] (rows r = 0..11 of 16 bytes):
// sub-blocks 0-3 take the low 6 bits of rows 0-3 (scales) or 4-7 (minimums), sub-blocks
// 4-7 the low (scales) or high (minimums) nibbles of rows 8-11 with the top two bits of
// rows 0-3 / 4-7 above them.
template <bool MINS>
inline void unpack_scales16(const uint8_t* t, __m128i (&v)[8]) {
  const __m128i m6 = _mm_set1_epi8(0x3F), m4 = _mm_set1_epi8(0x0F), m30 = _mm_set1_epi8(0x30);
  for (int j = 0; j < 4; ++j) {
    const __m128i a = load128(t + 16 * (MINS ? 4 + j : j)), c = load128(t + 16 * (8 + j));
    const __m128i nibble = MINS ? _mm_srli_epi16(c, 4) : c;
    v[j] = _mm_and_si128(a, m6);
    v[4 + j] = _mm_or_si128(_mm_and_si128(nibble, m4), _mm_and_si128(_mm_srli_epi16(a, 2), m30));
  }
}

// Q4_K / Q5_K: the integer dot products of one 32-value sub-block for MT rows x NG column
// groups: iacc[i][j] lane c = sum over the 32 k of column c's q (0..15, Q5_K 0..31) times
// row i's x.  xb[i]: the row's 32 activations; wb[j]: the group's packed sub-block.
template <int MT, int NG, int64_t T>
inline void sub_dots(const int8_t* const* xb, const uint8_t* const* wb, __m512i (&iacc)[MT][NG]) {
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NG; ++j) iacc[i][j] = _mm512_setzero_si512();
  __m512i fifth[NG];
  if constexpr (T == Q5_K)
    for (int j = 0; j < NG; ++j) fifth[j] = _mm512_loadu_si512(wb[j] + 256);
  pagedserve_gguf::nibble_dots<MT, NG>(xb, wb, iacc, [&](__m512i (&wv)[NG], int line) {
    if constexpr (T == Q5_K)
      for (int j = 0; j < NG; ++j)  // wv | (fifth bit at bit 4 & 0x10)
        wv[j] = _mm512_ternarylogic_epi32(wv[j], fifth_bits_at_4(fifth[j], line), _mm512_set1_epi8(0x10), 0xF8);
  });
}

// Q6_K: the integer dot products of one 16-value half of a sub-block, sum (q - 32) x: the
// accumulators start at init[i] = -32 * sum(x) of row i's 16 activations (xh[i]), so the
// unsigned q (0..63) goes into vpdpbusd and no correction is subtracted per column.
// lines[j]: the half's 2 nibble lines; top[j]: its line of top bits, pair i (bits 2i,
// 2i+1) of byte 4c+t belonging to unpacked line i.  The pairs are masked once per half
// (0x33: pairs 0 and 2; 0xCC: 1 and 3), so one shift puts each line's pair at bits 4-5
// with bits 6-7 clear, and one vpternlogd takes bits 0-3 from the nibble line, 4-7 from
// that: 2.75 vector operations per unpacked line.
template <int MT, int NG>
inline void half_dots(const int8_t* const* xh, const __m512i (&init)[MT], const uint8_t* const* lines,
                      const uint8_t* const* top, __m512i (&iacc)[MT][NG]) {
  const __m512i low4 = _mm512_set1_epi8(0x0F), m33 = _mm512_set1_epi8(0x33);
  const __m512i mcc = _mm512_set1_epi8(static_cast<char>(0xCC));
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NG; ++j) iacc[i][j] = init[i];
  __m512i u[NG], v[NG];
  for (int j = 0; j < NG; ++j) {
    const __m512i hv = _mm512_loadu_si512(top[j]);
    u[j] = _mm512_and_si512(hv, m33);
    v[j] = _mm512_and_si512(hv, mcc);
  }
#pragma GCC unroll 2
  for (int pp = 0; pp < 2; ++pp) {
    __m512i raw[NG];
    for (int j = 0; j < NG; ++j) raw[j] = _mm512_loadu_si512(lines[j] + pp * 64);
    for (int h = 0; h < 2; ++h) {
      const int line = 2 * pp + h;
      __m512i wv[NG];
      for (int j = 0; j < NG; ++j) {
        __m512i t;
        switch (line) {
          case 0: t = _mm512_slli_epi16(u[j], 4); break;
          case 1: t = _mm512_slli_epi16(v[j], 2); break;
          case 2: t = u[j]; break;
          default: t = _mm512_srli_epi16(v[j], 2); break;
        }
        // Bits 0-3 of lo are the value's low 4 bits (bits 4-7 are not read).
        const __m512i lo = h ? _mm512_srli_epi16(raw[j], 4) : raw[j];
        wv[j] = _mm512_ternarylogic_epi32(lo, t, low4, 0xE4);  // low4 ? lo : t
      }
      pagedserve_gguf::dot4<MT, NG>(xh, 4 * line, wv, iacc);
    }
  }
}

// Rows [m0, m0 + MT) x NG column groups from g0 (quant_gguf_tiles.h).  Float accumulators
// in an L1 buffer (as the Q4_x tile), integer accumulators MT x NG in registers; Q4_K /
// Q5_K's minimum term (-dmin * mn * d_x * sum(x), per sub-block) summed in a second pass, in
// the same order.  GATED: the first NG/2 groups are gate groups g0.., the last NG/2 their up
// groups g0 + o.half..; every lane sums exactly as in a plain tile.
template <int MT, int NG, int64_t T, bool GATED>
void tile(const Activations& a, const uint8_t* w, int64_t group_stride, int64_t m0, int64_t g0, const Output& o) {
  constexpr int SB = sub_bytes<T>();
  constexpr int EB = kCols * kblock_bytes<T>();
  alignas(64) float facc[MT][NG][kCols];
  const int8_t* xr[MT];
  const uint8_t* wg[NG];
  pagedserve_gguf::tile_start<MT, NG, GATED>(a.q, a.k, w, group_stride, m0, g0, o, facc, xr, wg);
  const int64_t nsb = a.k / QKK;
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* e[NG];
    for (int j = 0; j < NG; ++j) e[j] = wg[j] + s * EB;
    __m512 dv[NG];
    if constexpr (T == Q4_K || T == Q5_K) {
      __m128i sc[NG][8];
      for (int j = 0; j < NG; ++j) {
        dv[j] = load_halves(e[j] + 8 * SB);
        unpack_scales16<false>(e[j] + 8 * SB + 64, sc[j]);
      }
      for (int sub = 0; sub < 8; ++sub) {
        const int64_t b = s * 8 + sub;
        for (int j = 0; j < NG; ++j) prefetch_ahead<T, prefetch_subs<T>()>(wg[j], nsb, s, sub);
        const int8_t* xb[MT];
        for (int i = 0; i < MT; ++i) xb[i] = xr[i] + b * QK;
        const uint8_t* wb[NG];
        for (int j = 0; j < NG; ++j) wb[j] = e[j] + sub * SB;
        __m512i iacc[MT][NG];
        sub_dots<MT, NG, T>(xb, wb, iacc);
        __m512 wsc[NG];
        for (int j = 0; j < NG; ++j) wsc[j] = _mm512_mul_ps(dv[j], bytes_to_ps(sc[j][sub]));  // d * sc, exact
        pagedserve_gguf::accumulate<MT, NG>(a.d, a.nb, m0, b, wsc, iacc, facc);
      }
    } else {
      // The first half's scaled sums wait in L1 for the second's: one d_x step per 32 values.
      alignas(64) float first[MT][NG][kCols];
      for (int j = 0; j < NG; ++j) dv[j] = load_halves(e[j] + 8 * SB + 256);
      for (int sub = 0; sub < 8; ++sub) {
        const int64_t b = s * 8 + sub;
        for (int j = 0; j < NG; ++j) prefetch_ahead<T, prefetch_subs<T>()>(wg[j], nsb, s, sub);
#pragma GCC unroll 2
        for (int half = 0; half < 2; ++half) {
          __m512i init[MT];
          const int8_t* xh[MT];
          for (int i = 0; i < MT; ++i) {
            init[i] = _mm512_set1_epi32(a.c16[(m0 + i) * (a.k / 16) + 2 * b + half]);
            xh[i] = xr[i] + b * QK + 16 * half;
          }
          const uint8_t* lines[NG];
          const uint8_t* top[NG];
          for (int j = 0; j < NG; ++j) {
            lines[j] = e[j] + sub * SB + 128 * half;
            top[j] = e[j] + sub * SB + 256 + 64 * half;
          }
          __m512i iacc[MT][NG];
          half_dots<MT, NG>(xh, init, lines, top, iacc);
          __m512 wsc[NG];
          for (int j = 0; j < NG; ++j) {
            const __m128i scb = load128(e[j] + 8 * SB + 16 * (2 * sub + half));
            wsc[j] = _mm512_mul_ps(dv[j], _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(scb)));  // d * scale, exact
          }
          pagedserve_gguf::accumulate_half<MT, NG>(half, a.d, a.nb, m0, b, wsc, iacc, first, facc);
        }
      }
    }
  }
  __m512 fext[MT][NG];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NG; ++j) fext[i][j] = _mm512_setzero_ps();
  if constexpr (T == Q4_K || T == Q5_K) {
    for (int64_t s = 0; s < nsb; ++s) {
      __m512 mv[NG];
      __m128i mn[NG][8];
      for (int j = 0; j < NG; ++j) {
        const uint8_t* tail = wg[j] + s * EB + 8 * SB;
        mv[j] = _mm512_sub_ps(_mm512_setzero_ps(), load_halves(tail + 32));  // -dmin
        unpack_scales16<true>(tail + 64, mn[j]);
      }
      for (int sub = 0; sub < 8; ++sub) {
        const int64_t b = s * 8 + sub;
        __m512 wmn[NG];
        for (int j = 0; j < NG; ++j) wmn[j] = _mm512_mul_ps(mv[j], bytes_to_ps(mn[j][sub]));
        for (int i = 0; i < MT; ++i) {
          const __m512 dsx = _mm512_set1_ps(a.ds[(m0 + i) * a.nb + b]);
          for (int j = 0; j < NG; ++j) fext[i][j] = _mm512_fmadd_ps(wmn[j], dsx, fext[i][j]);
        }
      }
    }
  }
  pagedserve_gguf::store_tile<MT, NG, GATED>(facc, fext, m0, g0, o);
}

// The tiles of type T (a policy, quant_gguf_tiles.h): TM x TG plain tiles, GTM-row gated tiles.
template <int64_t T, int TM, int TG, int GTM>
struct TilesOf
    : pagedserve_gguf::TileShape<QKK, kCols * kblock_bytes<T>(), PAGEDSERVE_GGUF_K_CHUNK_M, TM, TG, GTM,
                                 PAGEDSERVE_GGUF_K_GATED_PAIRS> {
  using Activations = ::Activations;
  template <int MT, int NG, bool GATED>
  static void tile(const Activations& a, const uint8_t* w, int64_t gs, int64_t m0, int64_t g0, const Output& o) {
    ::tile<MT, NG, T, GATED>(a, w, gs, m0, g0, o);
  }
};

template <int64_t T>
constexpr int tile_rows() {
  return T == Q6_K ? PAGEDSERVE_GGUF_Q6K_TILE_M : PAGEDSERVE_GGUF_K_TILE_M;
}
template <int64_t T>
constexpr int tile_groups() {
  return T == Q6_K ? PAGEDSERVE_GGUF_Q6K_TILE_G : PAGEDSERVE_GGUF_K_TILE_G;
}
template <int64_t T>
constexpr int gated_tile_rows() {
  return T == Q6_K ? PAGEDSERVE_GGUF_Q6K_GATED_TILE_M : PAGEDSERVE_GGUF_K_GATED_TILE_M;
}
static_assert(PAGEDSERVE_GGUF_K_SMALL_M >= 0 &&
                  PAGEDSERVE_GGUF_K_SMALL_M <= std::min(PAGEDSERVE_GGUF_K_TILE_M, PAGEDSERVE_GGUF_Q6K_TILE_M),
              "small tiles: at most the tiles' rows");
// Type T's tiles; calls of at most PAGEDSERVE_GGUF_K_SMALL_M rows (0: none) in tiles of
// PAGEDSERVE_GGUF_K_SMALL_G groups.
template <int64_t T>
struct Tiles : TilesOf<T, tile_rows<T>(), tile_groups<T>(), gated_tile_rows<T>()> {
  static constexpr int64_t kFewRows = PAGEDSERVE_GGUF_K_SMALL_M;
  using Few = TilesOf<T, std::max(PAGEDSERVE_GGUF_K_SMALL_M, 1), PAGEDSERVE_GGUF_K_SMALL_G, gated_tile_rows<T>()>;
};

// f(Tiles<T>{}) for the K-quant type `type` (op: the caller's name, for the error).
template <class F>
void with_tiles(int64_t type, const char* op, F&& f) {
  switch (type) {
    case Q4_K: return f(Tiles<Q4_K>{});
    case Q5_K: return f(Tiles<Q5_K>{});
    case Q6_K: return f(Tiles<Q6_K>{});
  }
  TORCH_CHECK(false, op, ": no K-quant tiled kernel for ggml type id ", type);
}

#endif  // PAGEDSERVE_GGUF_KPACKED

}  // namespace

// Q2_K's tiled kernel and packing (quant_gguf_q2k.cpp).
bool gguf_q2k_tiled();
torch::Tensor gguf_q2k_pack_weight(torch::Tensor weight);
void gguf_q2k_unpack_block(const uint8_t* e, int c, uint8_t* blk);
bool gguf_q2k_gated();
PartRunner gguf_q2k_call(Call c, const TiledArgs& t);

// Whether `type` has the K-quant tiled kernel in this build.
bool gguf_kpacked_type(int64_t type) {
#if defined(PAGEDSERVE_GGUF_KPACKED)
  return type == Q4_K || type == Q5_K || type == Q6_K || (type == Q2_K && gguf_q2k_tiled());
#else
  (void)type;
  return false;
#endif
}

// weight: uint8 [N, K/256 * block_bytes] Q4_K / Q5_K / Q6_K blocks, N a multiple of 16 -> the
// packed layout above, uint8 [N/16, K/256, 16 * block_bytes].
torch::Tensor gguf_kpack_weight(torch::Tensor weight, int64_t type) {
  TORCH_CHECK(gguf_kpacked_type(type), "gguf_pack_weight: no K-quant tiled kernel for ggml type id ", type);
  if (type == Q2_K) return gguf_q2k_pack_weight(weight);
  return pagedserve_gguf::pack_groups(weight, kblock_bytes(type), "blocks",
                                      [type](const uint8_t* w, int64_t row_bytes, uint8_t* dst) {
                                        pack_kentry(w, row_bytes, type, dst);
                                      });
}

namespace {

// Column c's block of the packed (group, block) entry e, in the file's layout (blk).
void unpack_block(const uint8_t* e, int c, int64_t type, uint8_t* blk) {
  // The 4-bit lines shared by Q4_0 / Q4_1 / Q4_K / Q6_K: value k of 32 in `lines`.
  const auto nibble = [c](const uint8_t* lines, int k) -> uint8_t {
    const int group = k / 4;
    const uint8_t byte = lines[(group / 2) * 64 + c * 4 + k % 4];
    return (group % 2) ? byte >> 4 : byte & 0x0F;
  };
  switch (type) {
    case 8: {  // Q8_0: 8 lines of value + 128, then the fp16 scales
      std::memcpy(blk, e + 512 + 2 * c, 2);
      for (int k = 0; k < QK; ++k) blk[2 + k] = e[(k / 4) * 64 + c * 4 + k % 4] ^ 0x80;
      return;
    }
    case 2:
    case 3: {  // Q4_0 d | qs; Q4_1 d | m | qs (Q5_0 / Q5_1 unpack in quant_gguf_packed.cpp)
      std::memcpy(blk, e + 256 + 2 * c, 2);
      if (type == 3) std::memcpy(blk + 2, e + 256 + 32 + 2 * c, 2);
      uint8_t* qs = blk + (type == 2 ? 2 : 4);
      for (int k = 0; k < 16; ++k) qs[k] = nibble(e, k) | uint8_t(nibble(e, k + 16) << 4);
      return;
    }
    case Q4_K:
    case Q5_K: {
      const int sb = sub_bytes(type);
      const uint8_t* tail = e + 8 * sb;
      std::memcpy(blk, tail + 2 * c, 2);
      std::memcpy(blk + 2, tail + 32 + 2 * c, 2);
      for (int r = 0; r < 12; ++r) blk[4 + r] = tail[64 + 16 * r + c];
      uint8_t* qh = blk + 16;  // Q5_K only
      uint8_t* qs = blk + (type == Q5_K ? 48 : 16);
      std::memset(blk + 16, 0, type == Q5_K ? 160 : 128);
      for (int j = 0; j < 8; ++j) {
        const uint8_t* sub = e + sb * j;
        for (int k = 0; k < QK; ++k) {
          qs[32 * (j / 2) + k] |= uint8_t(nibble(sub, k) << (4 * (j % 2)));
          if (type == Q5_K) qh[k] |= uint8_t(((sub[256 + c * 4 + k % 4] >> (k / 4)) & 1) << j);
        }
      }
      return;
    }
    case Q2_K: gguf_q2k_unpack_block(e, c, blk); return;
    case Q6_K: {
      const uint8_t* tail = e + 8 * 384;
      uint8_t* ql = blk;
      uint8_t* qh = blk + 128;
      std::memset(blk, 0, 192);
      for (int j = 0; j < 8; ++j) {
        const uint8_t* sub = e + 384 * j;
        for (int k = 0; k < QK; ++k) {
          const int top = (sub[256 + (k / 16) * 64 + c * 4 + k % 4] >> (2 * ((k % 16) / 4))) & 3;
          const int v = 32 * j + k, h = v / 128, cc = (v % 128) / 32, l = v % 32;
          ql[64 * h + l + 32 * (cc % 2)] |= uint8_t(nibble(sub, k) << (cc < 2 ? 0 : 4));
          qh[32 * h + l] |= uint8_t(top << (2 * cc));
        }
      }
      for (int r = 0; r < 16; ++r) blk[192 + r] = tail[16 * r + c];
      std::memcpy(blk + 208, tail + 256 + 2 * c, 2);
      return;
    }
  }
  TORCH_CHECK(false, "gguf_unpack_rows: unsupported ggml type id ", type);
}

}  // namespace

// Rows `ids` (int64 [n]) of a packed weight [N/16, nb, 16 * block_bytes] (any type
// gguf_pack_weight packs) in the file's blocks, uint8 [n, nb * block_bytes]: the rows of
// an embedding that shares its LM head's packed weight, without unpacking the rest.
torch::Tensor gguf_unpack_rows(torch::Tensor packed, int64_t type, torch::Tensor ids) {
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == torch::kUInt8 && packed.size(2) % kCols == 0,
              "gguf_unpack_rows: packed uint8 [N/16, blocks, 16 * block_bytes] expected");
  return pagedserve_gguf::unpack_group_rows(packed, ids, packed.size(2) / kCols,
                                            [type](const uint8_t* e, int c, uint8_t* blk) {
                                              unpack_block(e, c, type, blk);
                                            });
}

// Whether `type` (a gguf_kpacked_type) has the gated tiled kernel in this build.
bool gguf_kpacked_gated(int64_t type) {
#if defined(PAGEDSERVE_GGUF_K_GATED)
  return gguf_kpacked_type(type) && (type != Q2_K || gguf_q2k_gated());
#else
  (void)type;
  return false;
#endif
}

// Call c on a packed Q2_K / Q4_K / Q5_K / Q6_K weight [N/16, K/256, 16 * bb] (t.groups =
// N/16): y [M, N] = the quantized activations @ its transpose (+ bias), float32, or bf16
// rounded once from the float32 sum; the gated op; or a part's runner.  The activations'
// extra sums (Q6_K's: -32 * the integer sum of every 16 activations, the start of its
// 16-value dot products; Q2_K's) are computed here, once, before any parallel region.
PartRunner gguf_kpacked_call(Call c, const TiledArgs& t) {
#if defined(PAGEDSERVE_GGUF_KPACKED)
  TORCH_CHECK(gguf_kpacked_type(t.type), pagedserve_gguf::call_name(c), ": no K-quant tiled kernel for ggml type id ",
              t.type);
  if (t.type == Q2_K) return gguf_q2k_call(c, t);
  auto c16 = std::make_shared<const std::vector<int32_t>>(t.type == Q6_K ? scaled_sums16(t.xq, t.M, t.K, -32)
                                                                         : std::vector<int32_t>{});
  const Activations a{t.xq, t.xd, t.xds, c16->empty() ? nullptr : c16->data(), t.K, t.K / QK};
  PartRunner run;
  with_tiles(t.type, pagedserve_gguf::call_name(c),
             [&](auto tiles) { run = pagedserve_gguf::run_call<decltype(tiles)>(c, a, t, c16); });
  return run;
#else
  (void)t;
  TORCH_CHECK(false, pagedserve_gguf::call_name(c), ": this build has no AVX-512 VNNI K-quant kernel");
#endif
}
