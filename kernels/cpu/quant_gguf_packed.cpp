// Tiled GEMM on GGUF Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / IQ4_NL weights repacked once at load (AVX-512 VNNI).
//
// The row-by-row kernel of quant_gguf.cpp reduces each (activation row, weight row) dot
// product horizontally and reads every weight row once per 8 activation rows, so from a
// few rows on it spends its time on reductions and reloads.  Here the weights of 16
// output columns are interleaved so that one vpdpbusd multiplies 4 consecutive k of all
// 16 columns with a broadcast group of 4 int8 activations: the 16 int32 lanes each
// belong to one column, a block's 8 (Q8_0) or 4 unpacked (Q4_x) loads serve every row
// of a register tile, and nothing is reduced horizontally.
//
// Packed layout: uint8 [N/16, K/32, 16 * block_bytes] (the file's size exactly), one
// entry per (16-column group, 32-value block):
//   Q4_0 / Q4_1: 4 lines of 64 bytes, byte 4c+t of line p holding column c's value at
//                k = 8p+t in its low nibble and k = 8p+4+t in its high nibble; then the
//                16 columns' fp16 scales d; Q4_1 then their fp16 minimums m.
//   IQ4_NL:      Q4_0's entry byte for byte (its blocks are Q4_0's, the nibbles indexes
//                into a table of 16 levels, quant_gguf_iq4nl.h): a line's nibbles are
//                masked as Q4_0's, then one vpshufb turns them into level + 128, the
//                unsigned operand of vpdpbusd, the 128 * sum(x) subtracted again (Q8_0's
//                offset).
//   Q5_0:        4 lines of 64 bytes, byte 4c+t of line p holding column c's 5-bit value
//                at k = 8p+t in bits 3-7 and the low 3 bits of the one at k = 8p+4+t in
//                bits 0-2; then the 16 fp16 scales d; then 64 top bytes, bits 2p and 2p+1
//                of byte 4c+t holding bits 3-4 of the value at k = 8p+4+t.  Line 2p
//                unpacks with a shift and a mask, line 2p+1 with one vpternlogd of the
//                line and its top bits (bits 2p, 2p+1 moved to 3-4 by a gf2p8affineqb, or
//                a shift and a mask): 2 and 3 (2 with GFNI) vector operations, where a
//                low 4-bit line and a separate fifth-bit plane took 3 and 4.
//   Q5_1:        Q5_0's lines, then the scales, the minimums and Q5_0's 64 top bytes.
//   Q8_0:        8 lines of 64 bytes, byte 4c+t of line p = column c's int8 value at
//                k = 4p+t plus 128 (an unsigned operand for vpdpbusd, the 128 * sum(x)
//                subtracted again); then the 16 fp16 scales.
//
// Numerics: the same int8 activations (quant_gguf.cpp quantizes them once per call),
// the same exact integer dot product per block as the row kernel, and acc += (d_w * d_x)
// * dot in float32.  The symmetric types' offset is part of the integer dot product here
// (as in ggml's own q4_0 / q5_0 / q8_0 dot products): each block's accumulators start at
// -8, -16 or -128 times the block's integer activation sum (Q4_0, Q5_0, Q8_0's and
// IQ4_NL's +128 storage), so dot = sum (q - offset) x exactly and there is no minimum term; the row
// kernel adds that term (-8 d_w d_x sum(x), -16 d_w ...) apart, a difference of float32
// rounding only.  Q4_1 / Q5_1's minimum term (m_w * d_x * sum(x)) is summed apart and
// added at the end, as the row kernel does.  Otherwise only the float32 summation order
// differs (the row kernel adds 8 partial lanes per block and reduces them at the end), a
// few units in the last place.  Each row's result depends on that row alone.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define PAGEDSERVE_GGUF_PACKED 1
#endif

#include "quant_gguf_common.h"
#include "quant_gguf_iq4nl.h"
#include "quant_gguf_tiles.h"

// The gated epilogue (silu(gate) * up, quant_gguf_gated.h) is the main kernels' own
// SiLU-and-mul (elementwise.h), so that the fused op rounds bit for bit as the two ops in
// sequence.
#if defined(PAGEDSERVE_GGUF_PACKED) && defined(PAGEDSERVE_GGUF_K_GATED)
#define PAGEDSERVE_GGUF_GATED 1
#endif

// Tile shape and row chunk; compile-time overridable for tile-shape measurements (the
// shapes tried and their figures: docs/quantization.md).
#ifndef PAGEDSERVE_GGUF_TILE_M
#define PAGEDSERVE_GGUF_TILE_M 5
#endif
#ifndef PAGEDSERVE_GGUF_CHUNK_M
#define PAGEDSERVE_GGUF_CHUNK_M 240
#endif
#ifndef PAGEDSERVE_GGUF_TILE_G
#define PAGEDSERVE_GGUF_TILE_G 3
#endif
// Q5_x's plain tiles: taller and narrower (their unpacking costs more per line, spread
// over more rows; 6 x 2 measured 2-20% faster than 5 x 3 on Zen 4 at 1-256 rows).
#ifndef PAGEDSERVE_GGUF_TILE_M_Q5
#define PAGEDSERVE_GGUF_TILE_M_Q5 6
#endif
#ifndef PAGEDSERVE_GGUF_TILE_G_Q5
#define PAGEDSERVE_GGUF_TILE_G_Q5 2
#endif

namespace {

constexpr int QK = 32;
constexpr int kCols = 16;
enum GgufType : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, IQ4_NL = pagedserve_iq4nl::kTypeId };

int packed_block_bytes(int64_t type) {
  switch (type) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case IQ4_NL: return pagedserve_iq4nl::kBlockBytes;
  }
  TORCH_CHECK(false, "gguf packing: unsupported ggml type id ", type,
              " (supported: Q4_0=2, Q4_1=3, Q5_0=6, Q5_1=7, Q8_0=8, IQ4_NL=20)");
}

// Bytes of quants in one packed (group, block) entry, before the scales.
inline int quant_bytes(int64_t type) { return type == Q8_0 ? 512 : 256; }
// Q5_0 / Q5_1: where the 64 top bytes start (after the scales, and Q5_1's minimums).
constexpr int mask_offset(int64_t type) { return 256 + (type == Q5_1 ? 64 : 32); }
inline bool has_fifth_bit(int64_t type) { return type == Q5_0 || type == Q5_1; }

void pack_entry(const uint8_t* w, int64_t row_bytes, int64_t type, int bb, uint8_t* dst) {
  const int qb = quant_bytes(type);
  std::memset(dst, 0, qb);
  if (has_fifth_bit(type)) std::memset(dst + mask_offset(type), 0, 64);
  for (int c = 0; c < kCols; ++c) {
    const uint8_t* blk = w + c * row_bytes;
    if (type == Q8_0) {
      for (int k = 0; k < QK; ++k) dst[(k / 4) * 64 + c * 4 + k % 4] = blk[2 + k] ^ 0x80;
    } else {
      const uint8_t* qs = blk + (type == Q4_1 ? 4 : type == Q5_0 ? 6 : type == Q5_1 ? 8 : 2);
      uint32_t qh = 0;
      if (has_fifth_bit(type)) std::memcpy(&qh, blk + (type == Q5_1 ? 4 : 2), 4);
      for (int k = 0; k < QK; ++k) {
        const uint8_t q = k < 16 ? (qs[k] & 0x0F) : (qs[k - 16] >> 4);
        const int group = k / 4;  // 4 consecutive k; groups 2p and 2p+1 share line p
        uint8_t& line = dst[(group / 2) * 64 + c * 4 + k % 4];
        if (has_fifth_bit(type)) {
          const uint8_t v = uint8_t(q | (((qh >> k) & 1) << 4));
          if (group % 2 == 0) {
            line |= uint8_t(v << 3);
          } else {  // bits 3-4 to bits 2p, 2p+1 (group - 1 = 2p) of the top byte
            line |= uint8_t(v & 7);
            dst[mask_offset(type) + c * 4 + k % 4] |= uint8_t((v >> 3) << (group - 1));
          }
        } else {
          line |= (group % 2) ? uint8_t(q << 4) : q;
        }
      }
    }
    std::memcpy(dst + qb + 2 * c, blk, 2);
    if (type == Q4_1 || type == Q5_1) std::memcpy(dst + qb + 32 + 2 * c, blk + 2, 2);
  }
  (void)bb;
}

// Column c's Q5_0 / Q5_1 block of the packed entry e, in the file's layout (blk).
void unpack_entry(const uint8_t* e, int c, int64_t type, uint8_t* blk) {
  const bool has_min = type == Q5_1;
  std::memcpy(blk, e + 256 + 2 * c, 2);
  if (has_min) std::memcpy(blk + 2, e + 256 + 32 + 2 * c, 2);
  uint8_t* qs = blk + (has_min ? 8 : 6);
  std::memset(qs, 0, 16);
  uint32_t qh = 0;
  const uint8_t* top = e + mask_offset(type);
  for (int k = 0; k < QK; ++k) {
    const int group = k / 4, t = k % 4;
    const uint8_t byte = e[(group / 2) * 64 + c * 4 + t];
    const int v = group % 2 == 0 ? byte >> 3 : (byte & 7) | (((top[c * 4 + t] >> (group - 1)) & 3) << 3);
    qs[k % 16] |= uint8_t((v & 15) << (k < 16 ? 0 : 4));
    qh |= uint32_t(v >> 4) << k;
  }
  std::memcpy(blk + (has_min ? 4 : 2), &qh, 4);
}

#if defined(PAGEDSERVE_GGUF_PACKED)

using pagedserve_gguf::Output;

struct Activations {
  const int8_t* q;     // [M, K]
  const float* d;      // [M, nb]
  const float* ds;     // [M, nb] d * integer sum
  const int32_t* sum;  // [M, nb] integer sums
  int64_t k, nb;
};

template <int64_t TYPE>
constexpr int group_block_bytes() {
  return kCols * (TYPE == Q4_0 || TYPE == IQ4_NL ? 18 : TYPE == Q4_1 ? 20 : TYPE == Q5_0 ? 22 : TYPE == Q5_1 ? 24 : 34);
}

// The stored value's offset of the symmetric types (value = d * (q - offset)): each
// block's integer accumulators start at -offset * sum(x), so that the dot product is
// sum (q - offset) x with no float term for it (Q8_0's int8 values, and IQ4_NL's levels
// once looked up, are + 128 as vpdpbusd's unsigned operand; Q4_1 / Q5_1 have a minimum
// instead, summed apart).
template <int64_t TYPE>
constexpr int32_t offset() {
  return TYPE == Q4_0 ? 8 : TYPE == Q5_0 ? 16 : TYPE == Q8_0 || TYPE == IQ4_NL ? 128 : 0;
}

// Tiles of at most this many rows move Q5_x's top bits with gf2p8affineqb where the build
// has GFNI (one vector operation; a shift and a mask otherwise): with few rows the
// unpacking is the critical work.  Taller tiles take the shift and mask (gf2p8affineqb
// competes with vpdpbusd for execution ports on Zen 4; docs/quantization.md).
#ifndef PAGEDSERVE_GGUF_GFNI_MAX_ROWS
#define PAGEDSERVE_GGUF_GFNI_MAX_ROWS 4
#endif
// How many blocks ahead a tile prefetches its weights' bytes: a column group's weights are
// one short sequential stream (K 576: 18 blocks, 6 KB), over before the hardware
// prefetchers ramp up, so the plain GEMM on 4- and 5-bit blocks asks for them 2 blocks
// ahead (0.55-0.9x the time of 1-4-row calls on Zen 4, no loss from 64 rows).  Q8_0's
// (34 bytes per 32 values) lost 5-25% that way, and the gated tiles 12-40% at 1-4 rows;
// Q5_x's gated tiles gained 1-6% from 16 rows 1 block ahead, within 2% below.
#ifndef PAGEDSERVE_GGUF_PREFETCH
#define PAGEDSERVE_GGUF_PREFETCH 2
#endif
#ifndef PAGEDSERVE_GGUF_GATED_PREFETCH_Q5
#define PAGEDSERVE_GGUF_GATED_PREFETCH_Q5 1
#endif

// Compile-time choices of the tiles (a type, so that variants can be instantiated side by
// side for measurements): the tallest tile that unpacks Q5_x lines with gf2p8affineqb, and
// how many blocks ahead a tile prefetches (-1: PAGEDSERVE_GGUF_PREFETCH for plain tiles but
// Q8_0's, PAGEDSERVE_GGUF_GATED_PREFETCH_Q5 for Q5_x's gated ones, none for the others).
struct TileCfg {
  static constexpr int gfni_max_rows = PAGEDSERVE_GGUF_GFNI_MAX_ROWS;
  static constexpr int prefetch = -1;
};

template <class Cfg, int64_t TYPE, bool GATED>
constexpr int prefetch_blocks() {
  if constexpr (Cfg::prefetch >= 0) return Cfg::prefetch;
  if constexpr (!GATED) return TYPE == Q8_0 ? 0 : PAGEDSERVE_GGUF_PREFETCH;
  return TYPE == Q5_0 || TYPE == Q5_1 ? PAGEDSERVE_GGUF_GATED_PREFETCH_Q5 : 0;
}

// The integer dot products of one block for rows [m0, m0 + MT) x NG column groups:
// iacc[i][j] lane c += sum over the block's 32 k of q_w(column c) * x(row i), q_w the
// stored unsigned value (the caller starts iacc at the offset term, see tile()).
template <int MT, int NG, int64_t TYPE, class Cfg = TileCfg>
inline void block_dots(const int8_t* const* xb, const uint8_t* const* wb, __m512i (&iacc)[MT][NG]) {
  if constexpr (TYPE == Q8_0) {
#pragma GCC unroll 8
    for (int p = 0; p < 8; ++p) {
      __m512i wv[NG];
      for (int j = 0; j < NG; ++j) wv[j] = _mm512_loadu_si512(wb[j] + p * 64);
      pagedserve_gguf::dot4<MT, NG>(xb, 4 * p, wv, iacc);
    }
  } else if constexpr (TYPE == Q5_0 || TYPE == Q5_1) {
#if defined(__GFNI__)
    constexpr bool gfni = MT <= Cfg::gfni_max_rows;
#else
    constexpr bool gfni = false;
#endif
    __m512i top[NG];
    for (int j = 0; j < NG; ++j) top[j] = _mm512_loadu_si512(wb[j] + mask_offset(TYPE));
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      // Line 2p (k = 8p..8p+3) then 2p+1 (8p+4..8p+7): only NG unpacked lines live.
      __m512i raw[NG];
      for (int j = 0; j < NG; ++j) raw[j] = _mm512_loadu_si512(wb[j] + p * 64);
      for (int h = 0; h < 2; ++h) {
        __m512i wv[NG];
        if (h == 0) {  // bits 3-7
          for (int j = 0; j < NG; ++j) wv[j] = _mm512_and_si512(_mm512_srli_epi16(raw[j], 3), _mm512_set1_epi8(0x1F));
        } else {  // bits 0-2, and bits 2p, 2p+1 of the top bytes as bits 3-4
          for (int j = 0; j < NG; ++j) {
            __m512i hi;
            if constexpr (gfni) {
#if defined(__GFNI__)
              // The matrix's byte 7 - i selects the input bits of output bit i.
              hi = _mm512_gf2p8affine_epi64_epi8(
                  top[j], _mm512_set1_epi64(static_cast<long long>((1ull << (2 * p + 32)) | (2ull << (2 * p + 24)))), 0);
#endif
            } else {
              // 16-bit shifts: bits 3-4 of each byte come from its own bits 2p, 2p+1.
              const __m512i f = top[j];
              const __m512i moved = p == 0   ? _mm512_slli_epi16(f, 3)
                                    : p == 1 ? _mm512_slli_epi16(f, 1)
                                    : p == 2 ? _mm512_srli_epi16(f, 1)
                                             : _mm512_srli_epi16(f, 3);
              hi = _mm512_and_si512(moved, _mm512_set1_epi8(0x18));
            }
            wv[j] = _mm512_ternarylogic_epi32(raw[j], hi, _mm512_set1_epi8(0x07), 0xEC);  // (raw & 7) | hi
          }
        }
        pagedserve_gguf::dot4<MT, NG>(xb, 8 * p + 4 * h, wv, iacc);
      }
    }
  } else {
    [[maybe_unused]] const __m512i levels = pagedserve_iq4nl::levels_u8_512();
    pagedserve_gguf::nibble_dots<MT, NG>(xb, wb, iacc, [&](__m512i (&wv)[NG], int) {
      if constexpr (TYPE == IQ4_NL)  // nibble -> its level + 128
        for (int j = 0; j < NG; ++j) wv[j] = _mm512_shuffle_epi8(levels, wv[j]);
    });
  }
}

// Rows [m0, m0 + MT) x columns of NG groups starting at group g0.  The float32
// accumulators live in an L1 buffer rather than registers, so that the register file
// holds MT x NG int32 accumulators (each weight line feeds MT rows, each activation
// broadcast NG groups).  Per (row, group, block) the float work is the row kernel's
// acc += (d_w * d_x) * float(dot), dot holding the symmetric types' offset term already
// (see offset()); Q4_1 / Q5_1's minimum term (m_w d_x sum(x)) is summed apart over the
// blocks afterwards and added at the end, so every lane adds the same values in the same
// order whatever the tile shape.
// GATED: the first NG/2 groups are gate columns g0.., the last NG/2 the up columns
// g0 + o.half..; the epilogue rounds both as gguf_linear's output would be rounded and
// writes silu_and_mul's result (the main kernels' silu_mul) at the gate columns
// (quant_gguf_tiles.h store_tile).
template <int MT, int NG, int64_t TYPE, bool GATED, class Cfg>
void tile(const Activations& a, const uint8_t* w, int64_t group_stride, int64_t m0, int64_t g0, const Output& o) {
  constexpr int gbb = group_block_bytes<TYPE>();
  constexpr int qb = TYPE == Q8_0 ? 512 : 256;
  alignas(64) float facc[MT][NG][kCols];
  const int8_t* xr[MT];
  const uint8_t* wg[NG];
  pagedserve_gguf::tile_start<MT, NG, GATED>(a.q, a.k, w, group_stride, m0, g0, o, facc, xr, wg);
  for (int64_t b = 0; b < a.nb; ++b) {
    const int8_t* xb[MT];
    for (int i = 0; i < MT; ++i) xb[i] = xr[i] + b * QK;
    const uint8_t* wb[NG];
    for (int j = 0; j < NG; ++j) wb[j] = wg[j] + b * gbb;
    __m512i iacc[MT][NG];
    if constexpr (offset<TYPE>() != 0) {
      for (int i = 0; i < MT; ++i) {
        const __m512i start = _mm512_set1_epi32(-offset<TYPE>() * a.sum[(m0 + i) * a.nb + b]);
        for (int j = 0; j < NG; ++j) iacc[i][j] = start;
      }
    } else {
      for (int i = 0; i < MT; ++i)
        for (int j = 0; j < NG; ++j) iacc[i][j] = _mm512_setzero_si512();
    }
    constexpr int pf = prefetch_blocks<Cfg, TYPE, GATED>();
    if constexpr (pf > 0) {
      if (b + pf < a.nb)
        for (int j = 0; j < NG; ++j)
          for (int l = 0; l < gbb; l += 64)
            _mm_prefetch(reinterpret_cast<const char*>(wb[j] + pf * gbb + l), _MM_HINT_T0);
    }
    block_dots<MT, NG, TYPE, Cfg>(xb, wb, iacc);
    __m512 dw[NG];
    for (int j = 0; j < NG; ++j)
      dw[j] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb[j] + qb)));
    pagedserve_gguf::accumulate<MT, NG>(a.d, a.nb, m0, b, dw, iacc, facc);
  }
  __m512 fext[MT][NG];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NG; ++j) fext[i][j] = _mm512_setzero_ps();
  if constexpr (TYPE == Q4_1 || TYPE == Q5_1) {
    for (int64_t b = 0; b < a.nb; ++b) {
      __m512 mw[NG];
      for (int j = 0; j < NG; ++j)
        mw[j] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg[j] + b * gbb + qb + 32)));
      for (int i = 0; i < MT; ++i) {
        const __m512 dsx = _mm512_set1_ps(a.ds[(m0 + i) * a.nb + b]);
        for (int j = 0; j < NG; ++j) fext[i][j] = _mm512_fmadd_ps(mw[j], dsx, fext[i][j]);
      }
    }
  }
  pagedserve_gguf::store_tile<MT, NG, GATED>(facc, fext, m0, g0, o);
}

// Calls of at most this many rows (decode steps: one row tile, whose weights are read
// once from memory) take tiles of their own width and prefetch distance: Q5_x's as its
// taller tiles (2 groups, 2 blocks ahead; 3 and 4 groups, 1 and 4 blocks ahead measured
// within noise), Q8_0's 4 groups wide (7-15% less time than 3 at 1-4 rows on Zen 4).
// The tiles' shapes and their figures: docs/quantization.md.
#ifndef PAGEDSERVE_GGUF_FEW_ROWS
#define PAGEDSERVE_GGUF_FEW_ROWS 4
#endif
#ifndef PAGEDSERVE_GGUF_TILE_G_Q5_FEW
#define PAGEDSERVE_GGUF_TILE_G_Q5_FEW 2
#endif
#ifndef PAGEDSERVE_GGUF_PREFETCH_Q5_FEW
#define PAGEDSERVE_GGUF_PREFETCH_Q5_FEW PAGEDSERVE_GGUF_PREFETCH
#endif
#ifndef PAGEDSERVE_GGUF_TILE_G_Q8_FEW
#define PAGEDSERVE_GGUF_TILE_G_Q8_FEW 4
#endif
#ifndef PAGEDSERVE_GGUF_PREFETCH_Q8_FEW
#define PAGEDSERVE_GGUF_PREFETCH_Q8_FEW 0
#endif
struct FewRowsQ5Cfg : TileCfg {
  static constexpr int prefetch = PAGEDSERVE_GGUF_PREFETCH_Q5_FEW;
};
struct FewRowsQ8Cfg : TileCfg {
  static constexpr int prefetch = PAGEDSERVE_GGUF_PREFETCH_Q8_FEW;
};

// Gate/up column-group pairs per gated tile (2 x this many groups in registers).
#ifndef PAGEDSERVE_GGUF_GATED_PAIRS
#define PAGEDSERVE_GGUF_GATED_PAIRS 1
#endif
#ifndef PAGEDSERVE_GGUF_GATED_TILE_M
#define PAGEDSERVE_GGUF_GATED_TILE_M 5
#endif
// Q5_x's gated tiles are taller: their unpacking costs more per line, spread over more rows.
#ifndef PAGEDSERVE_GGUF_GATED_TILE_M_Q5
#define PAGEDSERVE_GGUF_GATED_TILE_M_Q5 6
#endif

template <int64_t TYPE>
constexpr bool has_q5_tiles() {
  return TYPE == Q5_0 || TYPE == Q5_1;
}

// The tiles of TYPE with the choices Cfg (a policy, quant_gguf_tiles.h): TM x TG plain tiles,
// rows in chunks of PAGEDSERVE_GGUF_CHUNK_M (a multiple of every tile height up to 8).
template <int64_t TYPE, int TM, int TG, class Cfg = TileCfg>
struct TilesOf
    : pagedserve_gguf::TileShape<QK, group_block_bytes<TYPE>(), PAGEDSERVE_GGUF_CHUNK_M, TM, TG,
                                 has_q5_tiles<TYPE>() ? PAGEDSERVE_GGUF_GATED_TILE_M_Q5 : PAGEDSERVE_GGUF_GATED_TILE_M,
                                 PAGEDSERVE_GGUF_GATED_PAIRS> {
  using Activations = ::Activations;
  template <int MT, int NG, bool GATED>
  static void tile(const Activations& a, const uint8_t* w, int64_t gs, int64_t m0, int64_t g0, const Output& o) {
    ::tile<MT, NG, TYPE, GATED, Cfg>(a, w, gs, m0, g0, o);
  }
};

// TYPE's tiles: Q5_x's taller and narrower; Q5_x's and Q8_0's calls of at most
// PAGEDSERVE_GGUF_FEW_ROWS rows in their few-row tiles.
template <int64_t TYPE>
struct Tiles : TilesOf<TYPE, has_q5_tiles<TYPE>() ? PAGEDSERVE_GGUF_TILE_M_Q5 : PAGEDSERVE_GGUF_TILE_M,
                       has_q5_tiles<TYPE>() ? PAGEDSERVE_GGUF_TILE_G_Q5 : PAGEDSERVE_GGUF_TILE_G> {
  static constexpr bool kQ5 = has_q5_tiles<TYPE>();
  static constexpr int64_t kFewRows = kQ5 || TYPE == Q8_0 ? PAGEDSERVE_GGUF_FEW_ROWS : 0;
  using Few = TilesOf<TYPE, PAGEDSERVE_GGUF_FEW_ROWS,
                      kQ5 ? PAGEDSERVE_GGUF_TILE_G_Q5_FEW : PAGEDSERVE_GGUF_TILE_G_Q8_FEW,
                      std::conditional_t<kQ5, FewRowsQ5Cfg, FewRowsQ8Cfg>>;
};

// f(Tiles<T>{}) for the ggml type `type` (op: the caller's name, for the error).
template <class F>
void with_tiles(int64_t type, const char* op, F&& f) {
  switch (type) {
    case Q4_0: return f(Tiles<Q4_0>{});
    case Q4_1: return f(Tiles<Q4_1>{});
    case Q5_0: return f(Tiles<Q5_0>{});
    case Q5_1: return f(Tiles<Q5_1>{});
    case Q8_0: return f(Tiles<Q8_0>{});
    case IQ4_NL: return f(Tiles<IQ4_NL>{});
  }
  TORCH_CHECK(false, op, ": unsupported ggml type id ", type);
}

#endif  // PAGEDSERVE_GGUF_PACKED

}  // namespace

bool gguf_packed_gated_available() {
#if defined(PAGEDSERVE_GGUF_GATED)
  return true;
#else
  return false;
#endif
}

bool gguf_packed_available() {
#if defined(PAGEDSERVE_GGUF_PACKED)
  return true;
#else
  return false;
#endif
}

// weight: uint8 [N, K/32 * block_bytes] ggml blocks, N a multiple of 16 -> the packed
// layout above, uint8 [N/16, K/32, 16 * block_bytes].
torch::Tensor gguf_pack_weight(torch::Tensor weight, int64_t type) {
  TORCH_CHECK(gguf_packed_available(), "gguf_pack_weight: this build has no AVX-512 VNNI packed kernel");
  const int bb = packed_block_bytes(type);
  return pagedserve_gguf::pack_groups(weight, bb, "blocks", [&](const uint8_t* w, int64_t row_bytes, uint8_t* dst) {
    pack_entry(w, row_bytes, type, bb, dst);
  });
}

// Rows `ids` (int64 [n]) of a packed Q5_0 / Q5_1 weight [N/16, nb, 16 * block_bytes] in
// the file's blocks, uint8 [n, nb * block_bytes] (the inverse of pack_entry for those rows).
torch::Tensor gguf_packed_unpack_rows(torch::Tensor packed, int64_t type, torch::Tensor ids) {
  TORCH_CHECK(has_fifth_bit(type), "gguf_packed_unpack_rows: Q5_0 or Q5_1 expected, not ggml type id ", type);
  const int bb = packed_block_bytes(type);
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == torch::kUInt8 && packed.size(2) == kCols * bb,
              "gguf_unpack_rows: packed uint8 [N/16, blocks, 16 * block_bytes] expected");
  return pagedserve_gguf::unpack_group_rows(packed, ids, bb, [type](const uint8_t* e, int c, uint8_t* blk) {
    unpack_entry(e, c, type, blk);
  });
}

// Call c on a packed weight [N/16, nb, 16 * block_bytes] of a 32-value type (t.groups =
// N/16): y [M, N] = the quantized activations @ its transpose (+ bias), float32, or bf16
// rounded once from the float32 sum; the gated op; or a part's runner (quant_gguf.cpp
// gguf_linear_multi_out: its column groups [gb, ge) with its own tiles, on the caller's
// thread, from the call's activations, so its columns are bit for bit the linear op's).
pagedserve_gguf::PartRunner gguf_packed_call(pagedserve_gguf::Call c, const pagedserve_gguf::TiledArgs& t) {
  packed_block_bytes(t.type);  // checks the type
#if defined(PAGEDSERVE_GGUF_PACKED)
  const Activations a{t.xq, t.xd, t.xds, t.xsum, t.K, t.K / QK};
  pagedserve_gguf::PartRunner run;
  with_tiles(t.type, pagedserve_gguf::call_name(c),
             [&](auto tiles) { run = pagedserve_gguf::run_call<decltype(tiles)>(c, a, t); });
  return run;
#else
  (void)t;
  TORCH_CHECK(false, pagedserve_gguf::call_name(c), ": this build has no AVX-512 VNNI packed kernel");
#endif
}
