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
#include "quant_gguf_tiles.h"

using pagedserve_gguf::half_to_float;
using pagedserve_gguf::Call;
using pagedserve_gguf::PartRunner;
using pagedserve_gguf::TiledArgs;
#if defined(__AVX2__)
using pagedserve_gguf::dot_u8s8;
using pagedserve_gguf::hsum;
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__)
using pagedserve_gguf::Output;
using pagedserve_gguf::prefetch_lines;
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
      const __m256i wq = pagedserve_iq4nl::nibble_levels(blk + 8 + 16 * j, levels);
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
  const __m512i levels = pagedserve_iq4nl::levels_u8_512();
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NG; ++j) iacc[i][j] = init[i];
  pagedserve_gguf::nibble_dots<MT, NG>(xb, wb, iacc, [&](__m512i (&wv)[NG], int) {
    for (int j = 0; j < NG; ++j) wv[j] = _mm512_shuffle_epi8(levels, wv[j]);  // nibble -> its level + 128
  });
}

// Rows [m0, m0 + MT) x NG column groups from g0 (quant_gguf_tiles.h).  Integer accumulators
// MT x NG in registers (one sub-block at a time), float accumulators and the super-block's
// scales in L1 buffers.  GATED: the first NG/2 groups are gate groups g0.., the last NG/2
// their up groups g0 + o.half.., each lane summed as in a plain tile.
template <int MT, int NG, bool GATED>
void tile(const Activations& a, const uint8_t* w, int64_t group_stride, int64_t m0, int64_t g0, const Output& o) {
  alignas(64) float facc[MT][NG][kCols];
  alignas(64) float wsc[NG][8][kCols];
  const int8_t* xr[MT];
  const uint8_t* wg[NG];
  pagedserve_gguf::tile_start<MT, NG, GATED>(a.q, a.k, w, group_stride, m0, g0, o, facc, xr, wg);
  const int64_t nsb = a.k / QKK;
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
      __m512 ws[NG];
      for (int j = 0; j < NG; ++j) ws[j] = _mm512_load_ps(wsc[j][sub]);
      pagedserve_gguf::accumulate<MT, NG>(a.d, a.nb, m0, b, ws, iacc, facc);
    }
  }
  pagedserve_gguf::store_tile<MT, NG, GATED>(facc, m0, g0, o);
}

#ifndef PAGEDSERVE_GGUF_IQ4XS_GATED_TILE_M
#define PAGEDSERVE_GGUF_IQ4XS_GATED_TILE_M PAGEDSERVE_GGUF_IQ4XS_TILE_M
#endif

// The tiles' policy (quant_gguf_tiles.h).
struct Tiles
    : pagedserve_gguf::TileShape<QKK, kEntryBytes, PAGEDSERVE_GGUF_IQ4XS_CHUNK_M, PAGEDSERVE_GGUF_IQ4XS_TILE_M,
                                 PAGEDSERVE_GGUF_IQ4XS_TILE_G, PAGEDSERVE_GGUF_IQ4XS_GATED_TILE_M> {
  using Activations = ::Activations;
  template <int MT, int NG, bool GATED>
  static void tile(const Activations& a, const uint8_t* w, int64_t gs, int64_t m0, int64_t g0, const Output& o) {
    ::tile<MT, NG, GATED>(a, w, gs, m0, g0, o);
  }
};

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
  return pagedserve_gguf::pack_groups(weight, kBlockBytes, "IQ4_XS blocks", pack_entry);
}

// Rows `ids` (int64 [n]) of a packed IQ4_XS weight [N/16, K/256, 2176] in the file's blocks,
// uint8 [n, K/256 * 136] (a tied embedding's rows).
torch::Tensor gguf_iq4xs_unpack_rows(torch::Tensor packed, torch::Tensor ids) {
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == torch::kUInt8 && packed.size(2) == kEntryBytes,
              "gguf_unpack_rows: packed IQ4_XS uint8 [N/16, K/256, 2176] expected");
  return pagedserve_gguf::unpack_group_rows(packed, ids, kBlockBytes, unpack_block);
}

// Whether this build has the gated tiled IQ4_XS kernel.
bool gguf_iq4xs_gated() {
#if defined(PAGEDSERVE_GGUF_IQ4XS_TILED) && defined(PAGEDSERVE_GGUF_K_GATED)
  return true;
#else
  return false;
#endif
}

// Call c on a packed IQ4_XS weight [N/16, K/256, 2176] (t.groups = N/16): y [M, N] = the
// quantized activations @ its transpose (+ bias), the gated op, or a part's runner (its
// activation block sums, t.xsum, are the caller's, computed once with the activations).
PartRunner gguf_iq4xs_call(Call c, const TiledArgs& t) {
#if defined(PAGEDSERVE_GGUF_IQ4XS_TILED)
  return pagedserve_gguf::run_call<Tiles>(c, Activations{t.xq, t.xd, t.xsum, t.K, t.K / QK}, t);
#else
  (void)t;
  TORCH_CHECK(false, pagedserve_gguf::call_name(c), ": this build has no tiled IQ4_XS kernel (AVX-512 VNNI)");
#endif
}
