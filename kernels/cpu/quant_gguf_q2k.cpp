// Matmul on GGUF Q2_K blocks kept quantized: a row kernel on the file's blocks (any N, any
// build) and a tiled AVX-512 VNNI kernel on a layout repacked once at load (N a multiple
// of 16), on the same int8 activations as the other types (quantized once per call by
// quant_gguf.cpp: int8 per 32 values, fp16 scale d_x).
//
// Q2_K (ggml-common.h), 84 bytes per 256 values: scales[16] | qs[64] | d | dmin (fp16):
// 16 sub-blocks of 16 values, scales[r] = 4-bit scale sc (low nibble) and 4-bit minimum mn
// (high nibble) of sub-block r; element 32j + l of the 128-value half h is bits 2j, 2j+1
// of qs[32h + l]; value d*sc*q - dmin*mn.
//
// Numerics (both kernels): per 32-value activation block b (sub-blocks 2b and 2b + 1),
// the integer sc_0 * sum(q x) + sc_1 * sum(q x) exactly, then acc += (d * d_x) * that;
// the minimum term -dmin * mn * (d_x * s16) with s16 the integer sum of the 16
// activations of the sub-block, summed apart and added at the end.  The per-16 sums
// (d_x * s16, float32) are computed once per activation row per call.  Only float32
// rounding and summation order differ from the exact product of the int8 activations
// with the dequantized weight.  Each row's result depends on that row alone.
//
// Packed layout: uint8 [N/16, K/256, 16 * 84] (the file's size exactly), one entry of 1344
// bytes per (16-column group, super-block):
//   16 lines of 64 bytes, line r = sub-block r: byte 4c + t holds in bits 2i, 2i+1 column
//   c's q at k = 16r + 4i + t (one shift and mask per unpacked line of 4 k x 16 columns);
//   then the scale bytes transposed (byte 16r + c = scales[r] of column c), 16 fp16 d and
//   16 fp16 dmin.
// The tile folds each sub-block's 4-bit scale into its unpacked weights: a vpshufb table
// per 128-bit lane (4 columns) maps q to q * sc (0..45, still an unsigned byte for
// vpdpbusd), built once per sub-block and column group with one vpmullw, so the two
// sub-blocks of an activation block share one integer accumulator and one float step.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "quant_gguf_common.h"
#include "quant_gguf_tiles.h"

using pagedserve_gguf::half_to_float;
using pagedserve_gguf::row_kernel_gemm;
using pagedserve_gguf::Call;
using pagedserve_gguf::PartRunner;
using pagedserve_gguf::TiledArgs;
#if defined(__AVX512F__) && defined(__AVX512BW__)
using pagedserve_gguf::Output;
using pagedserve_gguf::prefetch_lines;
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define PAGEDSERVE_GGUF_Q2K_TILED 1
#endif

// Register tile (rows x 16-column groups), row chunk and weight prefetch distance (in
// 32-value pieces of a group's entries, 168 bytes each; 0: none), compile-time overridable.
#ifndef PAGEDSERVE_GGUF_Q2K_TILE_M
#define PAGEDSERVE_GGUF_Q2K_TILE_M 4
#endif
#ifndef PAGEDSERVE_GGUF_Q2K_TILE_G
#define PAGEDSERVE_GGUF_Q2K_TILE_G 3
#endif
#ifndef PAGEDSERVE_GGUF_Q2K_CHUNK_M
#define PAGEDSERVE_GGUF_Q2K_CHUNK_M 240
#endif
#ifndef PAGEDSERVE_GGUF_Q2K_PREFETCH
#define PAGEDSERVE_GGUF_Q2K_PREFETCH 8
#endif

namespace {

constexpr int QK = 32;
constexpr int QKK = 256;
constexpr int kCols = 16;
constexpr int kBlockBytes = 84;
constexpr int kEntryBytes = kCols * kBlockBytes;  // 1344
constexpr int kScalesAt = 1024;                    // 16 lines of 64 bytes first
constexpr int kDAt = kScalesAt + 256;
constexpr int kDminAt = kDAt + 32;

// Element v (0..255) of a Q2_K block: its 2-bit q.
inline int q_of(const uint8_t* blk, int v) {
  const int h = v / 128, j = (v % 128) / 32, l = v % 32;
  return (blk[16 + 32 * h + l] >> (2 * j)) & 3;
}

// One (group, super-block) entry from the 16 columns' blocks (row stride row_bytes).
void pack_entry(const uint8_t* w, int64_t row_bytes, uint8_t* e) {
  std::memset(e, 0, kScalesAt);
  for (int c = 0; c < kCols; ++c) {
    const uint8_t* blk = w + c * row_bytes;
    for (int k = 0; k < QKK; ++k) {
      const int r = k / 16, i = (k % 16) / 4, t = k % 4;
      e[64 * r + 4 * c + t] |= static_cast<uint8_t>(q_of(blk, k) << (2 * i));
    }
    for (int r = 0; r < 16; ++r) e[kScalesAt + 16 * r + c] = blk[r];
    std::memcpy(e + kDAt + 2 * c, blk + 80, 2);
    std::memcpy(e + kDminAt + 2 * c, blk + 82, 2);
  }
}

// d_x * (integer sum of each 16 activations), float32 [M, K/16]: the minimum term's sums.
std::vector<float> sums16(const int8_t* xq, const float* xd, int64_t M, int64_t K) {
  const int64_t n16 = K / 16;
  std::vector<float> out(static_cast<size_t>(M * n16));
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t r = 0; r < n16; ++r) {
        const int8_t* x = xq + m * K + 16 * r;
        int s = 0;
        for (int t = 0; t < 16; ++t) s += x[t];
        out[m * n16 + r] = xd[m * (K / QK) + r / 2] * static_cast<float>(s);
      }
  });
  return out;
}

// One activation row as the row kernel reads it.
struct XRow {
  const int8_t* q;    // [K]
  const float* d;     // [K / 32]
  const float* s16;   // [K / 16], d_x * the integer sum of each 16 (sums16)
};

// The row kernel: one weight row against up to 8 activation rows (each decoded block
// serves them all).
template <int MB>
void row_dot(const uint8_t* w, int64_t nsb, const XRow* xr, float* out) {
  float acc[MB], ext[MB];
  for (int m = 0; m < MB; ++m) acc[m] = ext[m] = 0.f;
  uint8_t q[QKK];
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* blk = w + s * kBlockBytes;
    for (int h = 0; h < 2; ++h)
      for (int j = 0; j < 4; ++j)
        for (int l = 0; l < 32; ++l) q[128 * h + 32 * j + l] = (blk[16 + 32 * h + l] >> (2 * j)) & 3;
    const float d = half_to_float(blk + 80), dmin = half_to_float(blk + 82);
    for (int b = 0; b < 8; ++b) {
      const int sc0 = blk[2 * b] & 0x0F, sc1 = blk[2 * b + 1] & 0x0F;
      const int64_t xb = s * 8 + b;
      for (int m = 0; m < MB; ++m) {
        const int8_t* x = xr[m].q + xb * QK;
        int lo = 0, hi = 0;
        for (int t = 0; t < 16; ++t) lo += q[32 * b + t] * x[t];
        for (int t = 16; t < QK; ++t) hi += q[32 * b + t] * x[t];
        acc[m] += (d * xr[m].d[xb]) * static_cast<float>(sc0 * lo + sc1 * hi);
      }
    }
    // The minimum term after the main one, in the tiled kernel's order (per super-block).
    for (int r = 0; r < 16; ++r) {
      const float mn = -dmin * static_cast<float>(blk[r] >> 4);
      for (int m = 0; m < MB; ++m) ext[m] += mn * xr[m].s16[s * 16 + r];
    }
  }
  for (int m = 0; m < MB; ++m) out[m] = acc[m] + ext[m];
}

}  // namespace

// y float32 [M, N] = int8 activation blocks (xq [M, K], xd [M, K/32]) times Q2_K rows
// w [N, K/256 * 84] in the file's layout.
void gguf_q2k_row_gemm(const int8_t* xq, const float* xd, int64_t M, int64_t K, const uint8_t* w, int64_t N,
                       float* y) {
  const int64_t nsb = K / QKK, row_bytes = nsb * kBlockBytes, nb = K / QK, n16 = K / 16;
  const std::vector<float> s16 = sums16(xq, xd, M, K);
  // Weight rows across threads; each thread decodes its rows once per 8 activation rows.
  row_kernel_gemm<XRow>(
      M, N, w, row_bytes, y, [&](int64_t m) { return XRow{xq + m * K, xd + m * nb, s16.data() + m * n16}; },
      [&](auto mb, const uint8_t* wr, const XRow* xr, float* out) {
        row_dot<decltype(mb)::value>(wr, nsb, xr, out);
      });
}

// Whether this build has the tiled kernel (and so packs Q2_K weights).
bool gguf_q2k_tiled() {
#if defined(PAGEDSERVE_GGUF_Q2K_TILED)
  return true;
#else
  return false;
#endif
}

// weight: uint8 [N, K/256 * 84] Q2_K blocks, N a multiple of 16 -> the packed layout above.
torch::Tensor gguf_q2k_pack_weight(torch::Tensor weight) {
  return pagedserve_gguf::pack_groups(weight, kBlockBytes, "blocks", pack_entry);
}

// Column c's block, in the file's layout (blk), of the packed entry e.
void gguf_q2k_unpack_block(const uint8_t* e, int c, uint8_t* blk) {
  std::memset(blk + 16, 0, 64);
  for (int v = 0; v < QKK; ++v) {
    const int r = v / 16, i = (v % 16) / 4, t = v % 4;
    const int q = (e[64 * r + 4 * c + t] >> (2 * i)) & 3;
    const int h = v / 128, j = (v % 128) / 32, l = v % 32;
    blk[16 + 32 * h + l] |= static_cast<uint8_t>(q << (2 * j));
  }
  for (int r = 0; r < 16; ++r) blk[r] = e[kScalesAt + 16 * r + c];
  std::memcpy(blk + 80, e + kDAt + 2 * c, 2);
  std::memcpy(blk + 82, e + kDminAt + 2 * c, 2);
}

#if defined(PAGEDSERVE_GGUF_Q2K_TILED)
namespace {

struct Activations {
  const int8_t* q;   // [M, K]
  const float* d;    // [M, K/32]
  const float* s16;  // [M, K/16] d_x * integer sum of 16
  int64_t k, nb, n16;
};

inline __m128i load128(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline __m512 load_halves(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// The vpshufb table of sub-block r of a group entry e: in 128-bit lane l (columns 4l..4l+3),
// byte 4cl + q = q * sc of column 4l + cl (q = 0..3).  The lane's 16 scale bytes are
// broadcast, each column's scale moved to bytes 4cl and 4cl + 2 (zeros above), and one
// 16-bit multiply by 0x0100 / 0x0302 writes the pair (0, sc) / (2 sc, 3 sc).
inline __m512i scale_table(const uint8_t* e, int r) {
  const __m512i sc = _mm512_and_si512(_mm512_broadcast_i32x4(load128(e + kScalesAt + 16 * r)), _mm512_set1_epi8(0x0F));
  // Index bytes 4cl and 4cl + 2 of lane l: 4l + cl; the others 0x80 (zero).
  const __m512i idx = _mm512_set_epi32(
      static_cast<int>(0x800F800Fu), static_cast<int>(0x800E800Eu), static_cast<int>(0x800D800Du),
      static_cast<int>(0x800C800Cu), static_cast<int>(0x800B800Bu), static_cast<int>(0x800A800Au),
      static_cast<int>(0x80098009u), static_cast<int>(0x80088008u), static_cast<int>(0x80078007u),
      static_cast<int>(0x80068006u), static_cast<int>(0x80058005u), static_cast<int>(0x80048004u),
      static_cast<int>(0x80038003u), static_cast<int>(0x80028002u), static_cast<int>(0x80018001u),
      static_cast<int>(0x80008000u));
  return _mm512_mullo_epi16(_mm512_shuffle_epi8(sc, idx), _mm512_set1_epi32(0x03020100));
}

template <int PF>
inline void prefetch_ahead(const uint8_t* group, int64_t nsb, int64_t s, int piece) {
  if constexpr (PF > 0) {
    constexpr int64_t PART = kEntryBytes / 8;
    const int64_t at = (8 * s + piece + PF) * PART;
    prefetch_lines(group, at, PART, nsb * kEntryBytes);
  }
}

// Rows [m0, m0 + MT) x NG column groups from g0 (quant_gguf_tiles.h).  Integer accumulators
// MT x NG in registers (one per 32-value activation block), float ones in an L1 buffer; the
// minimum term in a second pass over the super-blocks.  GATED: the first NG/2 groups are
// gate groups g0.., the last NG/2 their up groups g0 + o.half.., each lane summed as in a
// plain tile.
template <int MT, int NG, bool GATED>
void tile(const Activations& a, const uint8_t* w, int64_t group_stride, int64_t m0, int64_t g0, const Output& o) {
  alignas(64) float facc[MT][NG][kCols];
  const int8_t* xr[MT];
  const uint8_t* wg[NG];
  pagedserve_gguf::tile_start<MT, NG, GATED>(a.q, a.k, w, group_stride, m0, g0, o, facc, xr, wg);
  const int64_t nsb = a.k / QKK;
  const __m512i three = _mm512_set1_epi8(3);
  // Byte b of a line: 4 * (its column within the 128-bit lane) = b & 12.
  const __m512i lane_col = _mm512_set4_epi32(0x0C0C0C0C, 0x08080808, 0x04040404, 0);
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* e[NG];
    __m512 dv[NG];
    for (int j = 0; j < NG; ++j) {
      e[j] = wg[j] + s * kEntryBytes;
      dv[j] = load_halves(e[j] + kDAt);
    }
    for (int piece = 0; piece < 8; ++piece) {
      const int64_t b = s * 8 + piece;
      for (int j = 0; j < NG; ++j) prefetch_ahead<PAGEDSERVE_GGUF_Q2K_PREFETCH>(wg[j], nsb, s, piece);
      __m512i iacc[MT][NG];
      for (int i = 0; i < MT; ++i)
        for (int j = 0; j < NG; ++j) iacc[i][j] = _mm512_setzero_si512();
      for (int h = 0; h < 2; ++h) {
        const int r = 2 * piece + h;
        __m512i table[NG], raw[NG];
        for (int j = 0; j < NG; ++j) {
          table[j] = scale_table(e[j], r);
          raw[j] = _mm512_loadu_si512(e[j] + 64 * r);
        }
#pragma GCC unroll 4
        for (int line = 0; line < 4; ++line) {
          __m512i wv[NG];
          for (int j = 0; j < NG; ++j) {
            const __m512i q = line ? _mm512_srli_epi16(raw[j], 2 * line) : raw[j];
            // (q & 3) | 4 * column-in-lane: the table index of q * sc.
            wv[j] = _mm512_shuffle_epi8(table[j], _mm512_ternarylogic_epi32(q, three, lane_col, 0xEA));
          }
          pagedserve_gguf::dot4<MT, NG>(xr, b * QK + 16 * h + 4 * line, wv, iacc);
        }
      }
      pagedserve_gguf::accumulate<MT, NG>(a.d, a.nb, m0, b, dv, iacc, facc);
    }
  }
  __m512 fext[MT][NG];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NG; ++j) fext[i][j] = _mm512_setzero_ps();
  for (int64_t s = 0; s < nsb; ++s) {
    __m512 mv[NG];
    for (int j = 0; j < NG; ++j) mv[j] = _mm512_sub_ps(_mm512_setzero_ps(), load_halves(wg[j] + s * kEntryBytes + kDminAt));
    for (int r = 0; r < 16; ++r) {
      __m512 wmn[NG];
      for (int j = 0; j < NG; ++j) {
        const __m128i mn = _mm_and_si128(_mm_srli_epi16(load128(wg[j] + s * kEntryBytes + kScalesAt + 16 * r), 4),
                                         _mm_set1_epi8(0x0F));
        wmn[j] = _mm512_mul_ps(mv[j], _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(mn)));  // -dmin * mn, exact
      }
      for (int i = 0; i < MT; ++i) {
        const __m512 sx = _mm512_set1_ps(a.s16[(m0 + i) * a.n16 + s * 16 + r]);
        for (int j = 0; j < NG; ++j) fext[i][j] = _mm512_fmadd_ps(wmn[j], sx, fext[i][j]);
      }
    }
  }
  pagedserve_gguf::store_tile<MT, NG, GATED>(facc, fext, m0, g0, o);
}

// Gated tiles' rows.
#ifndef PAGEDSERVE_GGUF_Q2K_GATED_TILE_M
#define PAGEDSERVE_GGUF_Q2K_GATED_TILE_M 4
#endif

// The tiles' policy (quant_gguf_tiles.h).
struct Tiles : pagedserve_gguf::TileShape<QKK, kEntryBytes, PAGEDSERVE_GGUF_Q2K_CHUNK_M, PAGEDSERVE_GGUF_Q2K_TILE_M,
                                          PAGEDSERVE_GGUF_Q2K_TILE_G, PAGEDSERVE_GGUF_Q2K_GATED_TILE_M> {
  using Activations = ::Activations;
  template <int MT, int NG, bool GATED>
  static void tile(const Activations& a, const uint8_t* w, int64_t gs, int64_t m0, int64_t g0, const Output& o) {
    ::tile<MT, NG, GATED>(a, w, gs, m0, g0, o);
  }
};

}  // namespace
#endif  // PAGEDSERVE_GGUF_Q2K_TILED

// Whether this build has the gated tiled Q2_K kernel.
bool gguf_q2k_gated() {
#if defined(PAGEDSERVE_GGUF_Q2K_TILED) && defined(PAGEDSERVE_GGUF_K_GATED)
  return true;
#else
  return false;
#endif
}

// Call c on a packed Q2_K weight [N/16, K/256, 1344] (t.groups = N/16): y [M, N] = the
// quantized activations @ its transpose (+ bias), the gated op, or a part's runner.  Its
// per-16 activation sums are computed here, once, before any parallel region.
PartRunner gguf_q2k_call(Call c, const TiledArgs& t) {
#if defined(PAGEDSERVE_GGUF_Q2K_TILED)
  auto s16 = std::make_shared<const std::vector<float>>(sums16(t.xq, t.xd, t.M, t.K));
  return pagedserve_gguf::run_call<Tiles>(c, Activations{t.xq, t.xd, s16->data(), t.K, t.K / QK, t.K / 16}, t, s16);
#else
  (void)t;
  TORCH_CHECK(false, pagedserve_gguf::call_name(c), ": this build has no AVX-512 VNNI Q2_K kernel");
#endif
}
