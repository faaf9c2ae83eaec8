// Matmul on GGUF Q3_K blocks kept in the file's bytes: the row kernel (every build) and a tiled
// GEMM on the blocks repacked once at load (AVX-512 VNNI builds), on the same int8 activation
// blocks of 32 as the other types (quantized once per call by quant_gguf.cpp).
//
// Q3_K (ggml-common.h, 110 bytes per 256 values): hmask[32] | qs[64] | scales[12] | d (fp16).
// 16 sub-blocks of 16 values: value v = d * (sc[v / 16] - 32) * (q - 4), q in 0..7.  Element
// 32j + l of half n (n = 0, 1; j = 0..3; l = 0..31; v = 128n + 32j + l) has its low 2 bits
// at bits 2j of qs[32n + l] and its third bit at bit 4n + j of hmask[l] (ggml's "subtract 4
// where the hmask bit is clear").  The 6-bit scale sc[i] has its low 4 bits in the low (i < 8)
// or high (i >= 8) nibble of scales[i % 8] and its top 2 bits at bits 2 (i / 4) of
// scales[8 + i % 4].
//
// Numerics: per 16 values, the exact integer sum(q * x) - 4 * sum(x) of the unsigned q and
// the int8 activations, scaled by the exact float d * (sc - 32); the two halves of a 32-value
// activation block are joined before its one d_x step, acc += d_x * (w_0 * dot_0 + w_1 *
// dot_1), in the row kernel and the tiled one alike (only float32 summation order differs).
//
// Packed layout (tiled kernel): uint8 [N/16, K/256, 1760] (the file's size exactly), one
// entry per (16-column group, super-block):
//   8 sub-blocks of 32 values, 192 bytes each: three lines of 64 bytes V0, V1, V2, byte 4c+t
//   of each belonging to column c, and within a sub-block "line" L (L = 0..7) meaning the 4
//   values at k = 4L + t:
//     V0: bits 0-2 q of line 0, bits 3-5 q of line 1, bits 6-7 the low 2 bits of line 6
//     V1: bits 0-2 q of line 2, bits 3-5 q of line 3, bits 6-7 the low 2 bits of line 7
//     V2: bits 0-2 q of line 4, bits 3-5 q of line 5, bit 6 the third bit of line 6, bit 7
//         that of line 7
//   so that one gf2p8affineqb (or a shift and a mask) unpacks each of lines 0-5 into bytes
//   0..7 for vpdpbusd, and three operations each of lines 6-7;
//   then the 12 scale bytes transposed (byte 16r + c = scales[r] of column c: 192 bytes),
//   unpacked for 16 columns at once with 128-bit masks and shifts; then 16 fp16 d.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

#include "quant_gguf_common.h"
#include "quant_gguf_tiles.h"

using pagedserve_gguf::half_to_float;
using pagedserve_gguf::row_kernel_gemm;
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
using pagedserve_gguf::scaled_sums16;
#endif
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PAGEDSERVE_GGUF_Q3K_TILED 1
#endif

// Register tile (rows x 16-column groups) and row chunk of the tiled kernel, compile-time
// overridable; prefetch distance in sub-blocks of 32 values (220 bytes per group), 0: none.
#ifndef PAGEDSERVE_GGUF_Q3K_TILE_M
#define PAGEDSERVE_GGUF_Q3K_TILE_M 6
#endif
#ifndef PAGEDSERVE_GGUF_Q3K_TILE_G
#define PAGEDSERVE_GGUF_Q3K_TILE_G 2
#endif
#ifndef PAGEDSERVE_GGUF_Q3K_CHUNK_M
#define PAGEDSERVE_GGUF_Q3K_CHUNK_M 240
#endif
#ifndef PAGEDSERVE_GGUF_Q3K_PREFETCH
#define PAGEDSERVE_GGUF_Q3K_PREFETCH 8
#endif
// Tiles of at most this many rows unpack with gf2p8affineqb where the build has GFNI (as
// quant_gguf_packed.cpp's Q5_x lines: with few rows the unpacking is the critical work).
#ifndef PAGEDSERVE_GGUF_Q3K_GFNI_MAX_ROWS
#define PAGEDSERVE_GGUF_Q3K_GFNI_MAX_ROWS 4
#endif

namespace {

constexpr int64_t kQ3K = 11;
constexpr int QK = 32;
constexpr int QKK = 256;
constexpr int kBlockBytes = 110;
constexpr int kCols = 16;
constexpr int kSubBytes = 192;                               // packed bytes of one 32-value sub-block
constexpr int kScalesAt = 8 * kSubBytes;                     // 1536: transposed scales[12]
constexpr int kDAt = kScalesAt + 12 * kCols;                 // 1728: 16 fp16 d
constexpr int kEntryBytes = kDAt + 2 * kCols;                // 1760 = 16 * 110
static_assert(kEntryBytes == kCols * kBlockBytes, "the packed entry holds the file's bytes");

// The 16 six-bit scales of a block minus 32 (-32..31).
inline void block_scales(const uint8_t* s, int8_t* out) {
  for (int i = 0; i < 16; ++i) {
    const int low = i < 8 ? s[i] & 0x0F : s[i - 8] >> 4;
    const int top = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
    out[i] = static_cast<int8_t>((low | (top << 4)) - 32);
  }
}

// The 256 unsigned q (0..7) of a block, in value order.
inline void block_ints(const uint8_t* blk, uint8_t* q) {
  const uint8_t* hm = blk;
  const uint8_t* qs = blk + 32;
  for (int n = 0; n < 2; ++n)
    for (int j = 0; j < 4; ++j)
      for (int l = 0; l < QK; ++l) {
        const int low = (qs[32 * n + l] >> (2 * j)) & 3;
        const int high = (hm[l] >> (4 * n + j)) & 1;
        q[128 * n + 32 * j + l] = static_cast<uint8_t>(low | (high << 2));
      }
}

// -- the row kernel (the file's blocks; every build) ------------------------------------------

struct XRow {
  const int8_t* q;  // K int8
  const float* d;   // K/32 fp16-rounded scales
};

#if defined(__AVX2__)

inline __m256i load256(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// One block in registers: piece p (values 32p..32p+31) as signed q - 4 (-4..3), and its two
// weight scales d * (sc - 32) per lane (lanes 0-3 of the int32 dot product: values 0-15).
struct Regs {
  __m256i q[8];
  __m256 scale[8];
};

inline void decode_regs(const uint8_t* blk, Regs& r) {
  const __m256i three = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1), four = _mm256_set1_epi8(4);
  const __m256i hm = load256(blk);
  for (int n = 0; n < 2; ++n) {
    const __m256i qs = load256(blk + 32 + 32 * n);
    for (int j = 0; j < 4; ++j) {
      const int p = 4 * n + j;
      // 16-bit shifts of at most 7 places: bits 0-1 (0) of each byte come from the byte itself.
      const __m256i low = _mm256_and_si256(_mm256_srli_epi16(qs, 2 * j), three);
      const __m256i high = _mm256_and_si256(_mm256_srli_epi16(hm, p), one);
      r.q[p] = _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(high, 2)), four);
    }
  }
  int8_t sc[16];
  block_scales(blk + 96, sc);
  const float d = half_to_float(blk + 108);
  for (int p = 0; p < 8; ++p) {
    const float lo = d * sc[2 * p], hi = d * sc[2 * p + 1];
    r.scale[p] = _mm256_setr_ps(lo, lo, lo, lo, hi, hi, hi, hi);
  }
}
#endif

// Dot products of one weight row (nsb blocks) with MB activation rows.
template <int MB>
void row_dot(const uint8_t* w, int64_t nsb, const XRow* xr, float* out) {
#if defined(__AVX2__)
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  Regs r;
  for (int64_t s = 0; s < nsb; ++s) {
    decode_regs(w + s * kBlockBytes, r);
    for (int p = 0; p < 8; ++p) {
      const int64_t b = s * 8 + p;
      // Signs moved into the activations: |q| (0..4) unsigned, x * sign(q) signed.
      const __m256i wu = _mm256_sign_epi8(r.q[p], r.q[p]);
      for (int m = 0; m < MB; ++m) {
        const __m256i xq = _mm256_sign_epi8(load256(reinterpret_cast<const uint8_t*>(xr[m].q + b * QK)), r.q[p]);
        const __m256 dot = _mm256_cvtepi32_ps(dot_u8s8(wu, xq));
        acc[m] = _mm256_fmadd_ps(_mm256_mul_ps(r.scale[p], _mm256_set1_ps(xr[m].d[b])), dot, acc[m]);
      }
    }
  }
  for (int m = 0; m < MB; ++m) out[m] = hsum(acc[m]);
#else
  for (int m = 0; m < MB; ++m) out[m] = 0.f;
  uint8_t q[QKK];
  int8_t sc[16];
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* blk = w + s * kBlockBytes;
    block_ints(blk, q);
    block_scales(blk + 96, sc);
    const float d = half_to_float(blk + 108);
    for (int p = 0; p < 8; ++p) {
      const int64_t b = s * 8 + p;
      for (int m = 0; m < MB; ++m) {
        const int8_t* xq = xr[m].q + b * QK;
        int lo = 0, hi = 0;
        for (int l = 0; l < 16; ++l) lo += (q[32 * p + l] - 4) * xq[l];
        for (int l = 16; l < QK; ++l) hi += (q[32 * p + l] - 4) * xq[l];
        out[m] += xr[m].d[b] * (d * sc[2 * p] * lo + d * sc[2 * p + 1] * hi);
      }
    }
  }
#endif
}

// -- packing -----------------------------------------------------------------------------------

// One (group, super-block) entry from the 16 columns' blocks (row stride row_bytes).
void pack_entry(const uint8_t* w, int64_t row_bytes, uint8_t* dst) {
  std::memset(dst, 0, kEntryBytes);
  uint8_t q[QKK];
  for (int c = 0; c < kCols; ++c) {
    const uint8_t* blk = w + c * row_bytes;
    block_ints(blk, q);
    for (int sub = 0; sub < 8; ++sub) {
      uint8_t* v = dst + sub * kSubBytes;  // V0, V1, V2 at 0, 64, 128
      for (int k = 0; k < QK; ++k) {
        const int line = k / 4, at = 4 * c + k % 4;
        const uint8_t value = q[32 * sub + k];
        if (line < 6) {
          v[64 * (line / 2) + at] |= uint8_t(value << (3 * (line % 2)));
        } else {  // lines 6, 7: low bits at 6-7 of V0 / V1, third bit at bit line of V2
          v[64 * (line - 6) + at] |= uint8_t((value & 3) << 6);
          v[128 + at] |= uint8_t((value >> 2) << line);
        }
      }
    }
    for (int r = 0; r < 12; ++r) dst[kScalesAt + 16 * r + c] = blk[96 + r];
    std::memcpy(dst + kDAt + 2 * c, blk + 108, 2);
  }
}

// Column c's block of the packed entry e, in the file's layout (blk).
void unpack_block(const uint8_t* e, int c, uint8_t* blk) {
  std::memset(blk, 0, 96);
  for (int sub = 0; sub < 8; ++sub) {
    const uint8_t* v = e + sub * kSubBytes;
    for (int k = 0; k < QK; ++k) {
      const int line = k / 4, at = 4 * c + k % 4;
      int value;
      if (line < 6)
        value = (v[64 * (line / 2) + at] >> (3 * (line % 2))) & 7;
      else
        value = ((v[64 * (line - 6) + at] >> 6) & 3) | (((v[128 + at] >> line) & 1) << 2);
      const int idx = 32 * sub + k, n = idx / 128, j = (idx % 128) / 32, l = idx % 32;
      blk[32 + 32 * n + l] |= uint8_t((value & 3) << (2 * j));
      blk[l] |= uint8_t((value >> 2) << (4 * n + j));
    }
  }
  for (int r = 0; r < 12; ++r) blk[96 + r] = e[kScalesAt + 16 * r + c];
  std::memcpy(blk + 108, e + kDAt + 2 * c, 2);
}

// -- the tiled kernel (AVX-512 VNNI) -----------------------------------------------------------
#if defined(PAGEDSERVE_GGUF_Q3K_TILED)

struct Activations {
  const int8_t* q;     // [M, K]
  const float* d;      // [M, K/32]
  const int32_t* c16;  // [M, K/16] -4 * the integer sum of 16 activations (q - 4)
  int64_t k, nb;
};

inline __m128i load128(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

// The 16 columns' 16 scales (sc - 32, as int8) of an entry from its transposed scales[12].
inline void unpack_scales(const uint8_t* t, __m128i (&sc)[16]) {
  const __m128i m4 = _mm_set1_epi8(0x0F), m3 = _mm_set1_epi8(3), m32 = _mm_set1_epi8(32);
  __m128i top[4];
  for (int b = 0; b < 4; ++b) top[b] = load128(t + 16 * (8 + b));
  for (int i = 0; i < 16; ++i) {
    const __m128i row = load128(t + 16 * (i % 8));
    const __m128i low = _mm_and_si128(i < 8 ? row : _mm_srli_epi16(row, 4), m4);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(top[i % 4], 2 * (i / 4)), m3);
    sc[i] = _mm_sub_epi8(_mm_or_si128(low, _mm_slli_epi16(hi, 4)), m32);
  }
}

#if defined(__GFNI__)
constexpr bool kGfni = true;
#else
constexpr bool kGfni = false;
#endif

#if defined(__GFNI__)
// gf2p8affineqb matrix taking input bits s0, s1, s2 to output bits 0, 1, 2 (-1: none); the
// matrix's byte 7 - i selects the input bits of output bit i.
constexpr long long bit_rows(int s0, int s1, int s2) {
  return static_cast<long long>((s0 < 0 ? 0ull : 1ull << (56 + s0)) | (s1 < 0 ? 0ull : 1ull << (48 + s1)) |
                                (s2 < 0 ? 0ull : 1ull << (40 + s2)));
}
#endif

// Unpacked line L (0..7) of a sub-block: bytes 4c+t = q (0..7) of column c at k = 4L + t;
// GFNI: with gf2p8affineqb (one operation per line 0-5; the build has GFNI), else shifts
// and masks (two).
template <int L, bool GFNI>
inline __m512i unpack_line(const __m512i (&v)[3]) {
#if defined(__GFNI__)
  if constexpr (GFNI) {
    if constexpr (L < 6) {
      constexpr int at = 3 * (L % 2);
      return _mm512_gf2p8affine_epi64_epi8(v[L / 2], _mm512_set1_epi64(bit_rows(at, at + 1, at + 2)), 0);
    } else {
      const __m512i low = _mm512_gf2p8affine_epi64_epi8(v[L - 6], _mm512_set1_epi64(bit_rows(6, 7, -1)), 0);
      const __m512i top = _mm512_gf2p8affine_epi64_epi8(v[2], _mm512_set1_epi64(bit_rows(-1, -1, L)), 0);
      return _mm512_or_si512(low, top);
    }
  }
#endif
  // 16-bit shifts: the bits kept by the masks come from the byte itself.
  if constexpr (L < 6) {
    const __m512i src = v[L / 2];
    return _mm512_and_si512(L % 2 ? _mm512_srli_epi16(src, 3) : src, _mm512_set1_epi8(7));
  } else {
    const __m512i low = _mm512_and_si512(_mm512_srli_epi16(v[L - 6], 6), _mm512_set1_epi8(3));
    // low | (third bit, moved from bit L to bit 2, & 4)
    return _mm512_ternarylogic_epi32(low, _mm512_srli_epi16(v[2], L - 2), _mm512_set1_epi8(4), 0xF8);
  }
}

// iacc[i][j] += the dot products of line L of NG column groups with row i's 4 activations.
template <int L, int MT, int NG>
inline void line_dots(const __m512i (&v)[NG][3], const int8_t* const* xs, __m512i (&iacc)[MT][NG]) {
  constexpr bool gfni = kGfni && MT <= PAGEDSERVE_GGUF_Q3K_GFNI_MAX_ROWS;
  __m512i wv[NG];
  for (int j = 0; j < NG; ++j) wv[j] = unpack_line<L, gfni>(v[j]);
  pagedserve_gguf::dot4<MT, NG>(xs, 4 * L, wv, iacc);
}

inline void prefetch_ahead(const uint8_t* group, int64_t nsb, int64_t s, int sub) {
  if constexpr (PAGEDSERVE_GGUF_Q3K_PREFETCH > 0) {
    constexpr int64_t PART = kEntryBytes / 8;
    const int64_t at = (8 * s + sub + PAGEDSERVE_GGUF_Q3K_PREFETCH) * PART;
    prefetch_lines(group, at, PART, nsb * kEntryBytes);
  }
}

// Rows [m0, m0 + MT) x NG column groups from g0 (quant_gguf_tiles.h).  Integer accumulators
// MT x NG in registers, one 16-value half at a time; float accumulators in an L1 buffer.
// GATED: the first NG/2 groups are gate groups g0.., the last NG/2 their up groups
// g0 + o.half.., each lane summed as in a plain tile.
template <int MT, int NG, bool GATED>
void tile(const Activations& a, const uint8_t* w, int64_t group_stride, int64_t m0, int64_t g0, const Output& o) {
  alignas(64) float facc[MT][NG][kCols];
  alignas(64) float first[MT][NG][kCols];
  const int8_t* xr[MT];
  const uint8_t* wg[NG];
  pagedserve_gguf::tile_start<MT, NG, GATED>(a.q, a.k, w, group_stride, m0, g0, o, facc, xr, wg);
  const int64_t nsb = a.k / QKK;
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* e[NG];
    __m512 dv[NG];
    __m128i sc[NG][16];
    for (int j = 0; j < NG; ++j) {
      e[j] = wg[j] + s * kEntryBytes;
      dv[j] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(e[j] + kDAt)));
      unpack_scales(e[j] + kScalesAt, sc[j]);
    }
    for (int sub = 0; sub < 8; ++sub) {
      const int64_t b = s * 8 + sub;
      for (int j = 0; j < NG; ++j) prefetch_ahead(wg[j], nsb, s, sub);
      __m512i v[NG][3];
      for (int j = 0; j < NG; ++j)
        for (int r = 0; r < 3; ++r) v[j][r] = _mm512_loadu_si512(e[j] + sub * kSubBytes + 64 * r);
      const int8_t* xs[MT];
      for (int i = 0; i < MT; ++i) xs[i] = xr[i] + b * QK;
      for (int half = 0; half < 2; ++half) {
        __m512i iacc[MT][NG];
        for (int i = 0; i < MT; ++i) {
          const __m512i init = _mm512_set1_epi32(a.c16[(m0 + i) * (a.k / 16) + 2 * b + half]);
          for (int j = 0; j < NG; ++j) iacc[i][j] = init;
        }
        if (half == 0) {
          line_dots<0, MT, NG>(v, xs, iacc);
          line_dots<1, MT, NG>(v, xs, iacc);
          line_dots<2, MT, NG>(v, xs, iacc);
          line_dots<3, MT, NG>(v, xs, iacc);
        } else {
          line_dots<4, MT, NG>(v, xs, iacc);
          line_dots<5, MT, NG>(v, xs, iacc);
          line_dots<6, MT, NG>(v, xs, iacc);
          line_dots<7, MT, NG>(v, xs, iacc);
        }
        __m512 wsc[NG];
        for (int j = 0; j < NG; ++j)  // d * (sc - 32), exact
          wsc[j] = _mm512_mul_ps(dv[j], _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc[j][2 * sub + half])));
        pagedserve_gguf::accumulate_half<MT, NG>(half, a.d, a.nb, m0, b, wsc, iacc, first, facc);
      }
    }
  }
  pagedserve_gguf::store_tile<MT, NG, GATED>(facc, m0, g0, o);
}

#ifndef PAGEDSERVE_GGUF_Q3K_GATED_TILE_M
#define PAGEDSERVE_GGUF_Q3K_GATED_TILE_M PAGEDSERVE_GGUF_Q3K_TILE_M
#endif

// The tiles' policy (quant_gguf_tiles.h).
struct Tiles : pagedserve_gguf::TileShape<QKK, kEntryBytes, PAGEDSERVE_GGUF_Q3K_CHUNK_M, PAGEDSERVE_GGUF_Q3K_TILE_M,
                                          PAGEDSERVE_GGUF_Q3K_TILE_G, PAGEDSERVE_GGUF_Q3K_GATED_TILE_M> {
  using Activations = ::Activations;
  template <int MT, int NG, bool GATED>
  static void tile(const Activations& a, const uint8_t* w, int64_t gs, int64_t m0, int64_t g0, const Output& o) {
    ::tile<MT, NG, GATED>(a, w, gs, m0, g0, o);
  }
};

#endif  // PAGEDSERVE_GGUF_Q3K_TILED

}  // namespace

// Whether `type` is Q3_K; its block's values and bytes.
bool gguf_q3k_block(int64_t type, int* values, int* bytes) {
  if (type != kQ3K) return false;
  *values = QKK;
  *bytes = kBlockBytes;
  return true;
}

// Whether this build has the tiled Q3_K kernel (AVX-512 VNNI).
bool gguf_q3k_tiled() {
#if defined(PAGEDSERVE_GGUF_Q3K_TILED)
  return true;
#else
  return false;
#endif
}

// y float32 [M, N] = the int8 activation blocks (xq [M, K], xd [M, K/32]) times the Q3_K rows
// w [N, K/256 * 110] (the file's blocks).
void gguf_q3k_row_gemm(const int8_t* xq, const float* xd, int64_t M, int64_t K, const uint8_t* w, int64_t N,
                       float* y) {
  const int64_t nb = K / QK, nsb = K / QKK, row_bytes = nsb * kBlockBytes;
  // Weight rows across threads; each thread decodes its rows once per 8 activation rows.
  row_kernel_gemm<XRow>(
      M, N, w, row_bytes, y, [&](int64_t m) { return XRow{xq + m * K, xd + m * nb}; },
      [&](auto mb, const uint8_t* wr, const XRow* xr, float* out) {
        row_dot<decltype(mb)::value>(wr, nsb, xr, out);
      });
}

// weight: uint8 [N, K/256 * 110] Q3_K blocks, N a multiple of 16 -> the packed layout above,
// uint8 [N/16, K/256, 1760].
torch::Tensor gguf_q3k_pack(torch::Tensor weight) {
  return pagedserve_gguf::pack_groups(weight, kBlockBytes, "Q3_K blocks", pack_entry);
}

// Rows `ids` (int64 [n]) of a packed Q3_K weight [N/16, K/256, 1760] in the file's blocks,
// uint8 [n, K/256 * 110] (a tied embedding's rows).
torch::Tensor gguf_q3k_unpack_rows(torch::Tensor packed, torch::Tensor ids) {
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == torch::kUInt8 && packed.size(2) == kEntryBytes,
              "gguf_unpack_rows: packed Q3_K uint8 [N/16, K/256, 1760] expected");
  return pagedserve_gguf::unpack_group_rows(packed, ids, kBlockBytes, unpack_block);
}

// Whether this build has the gated tiled Q3_K kernel.
bool gguf_q3k_gated() {
#if defined(PAGEDSERVE_GGUF_Q3K_TILED) && defined(PAGEDSERVE_GGUF_K_GATED)
  return true;
#else
  return false;
#endif
}

// Call c on a packed Q3_K weight [N/16, K/256, 1760] (t.groups = N/16): y [M, N] = the
// quantized activations @ its transpose (+ bias), the gated op, or a part's runner.  Its
// per-16 activation sums (-4 * the integer sum of every 16 activations: the start of each
// 16-value dot product of the unsigned q) are computed here, once, before any parallel region.
PartRunner gguf_q3k_call(Call c, const TiledArgs& t) {
#if defined(PAGEDSERVE_GGUF_Q3K_TILED)
  auto c16 = std::make_shared<const std::vector<int32_t>>(scaled_sums16(t.xq, t.M, t.K, -4));
  return pagedserve_gguf::run_call<Tiles>(c, Activations{t.xq, t.xd, c16->data(), t.K, t.K / QK}, t, c16);
#else
  (void)t;
  TORCH_CHECK(false, pagedserve_gguf::call_name(c), ": this build has no tiled Q3_K kernel (AVX-512 VNNI)");
#endif
}
