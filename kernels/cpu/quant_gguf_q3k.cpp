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
#include "quant_gguf_gated.h"

using pagedserve_gguf::half_to_float;
using pagedserve_gguf::row_kernel_gemm;
using pagedserve_gguf::PartRunner;
#if defined(__AVX2__)
using pagedserve_gguf::dot_u8s8;
using pagedserve_gguf::hsum;
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__)
using pagedserve_gguf::Output;
using pagedserve_gguf::prefetch_lines;
using pagedserve_gguf::scaled_sums16;
using pagedserve_gguf::to_bf16;
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
  for (int i = 0; i < MT; ++i) {
    int32_t x4;
    std::memcpy(&x4, xs[i] + 4 * L, 4);
    const __m512i xv = _mm512_set1_epi32(x4);
    for (int j = 0; j < NG; ++j) iacc[i][j] = _mm512_dpbusd_epi32(iacc[i][j], wv[j], xv);
  }
}

inline void prefetch_ahead(const uint8_t* group, int64_t nsb, int64_t s, int sub) {
  if constexpr (PAGEDSERVE_GGUF_Q3K_PREFETCH > 0) {
    constexpr int64_t PART = kEntryBytes / 8;
    const int64_t at = (8 * s + sub + PAGEDSERVE_GGUF_Q3K_PREFETCH) * PART;
    prefetch_lines(group, at, PART, nsb * kEntryBytes);
  }
}

// Rows [m0, m0 + MT) x NG column groups from g0.  Integer accumulators MT x NG in registers,
// one 16-value half at a time; float accumulators in an L1 buffer.  GATED: the first NG/2
// groups are gate groups g0.., the last NG/2 their up groups g0 + o.half.., the epilogue
// writes silu(gate) * up at the gate columns (quant_gguf_gated.h), each lane summed as in a
// plain tile.
template <int MT, int NG, bool GATED = false>
void tile(const Activations& a, const uint8_t* w, int64_t group_stride, int64_t m0, int64_t g0, const Output& o) {
  alignas(64) float facc[MT][NG][kCols];
  alignas(64) float first[MT][NG][kCols];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NG; ++j) _mm512_store_ps(facc[i][j], _mm512_setzero_ps());
  const int64_t nsb = a.k / QKK;
  const int8_t* xr[MT];
  for (int i = 0; i < MT; ++i) xr[i] = a.q + (m0 + i) * a.k;
  const uint8_t* wg[NG];
  for (int j = 0; j < NG; ++j) wg[j] = w + (GATED && j >= NG / 2 ? g0 + o.half + j - NG / 2 : g0 + j) * group_stride;
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
        if (half == 0) {
          for (int i = 0; i < MT; ++i)
            for (int j = 0; j < NG; ++j)
              _mm512_store_ps(first[i][j], _mm512_mul_ps(wsc[j], _mm512_cvtepi32_ps(iacc[i][j])));
        } else {  // facc += d_x * (first + w_1 * dot_1)
          for (int i = 0; i < MT; ++i) {
            const __m512 dx = _mm512_set1_ps(a.d[(m0 + i) * a.nb + b]);
            for (int j = 0; j < NG; ++j) {
              const __m512 both =
                  _mm512_fmadd_ps(wsc[j], _mm512_cvtepi32_ps(iacc[i][j]), _mm512_load_ps(first[i][j]));
              _mm512_store_ps(facc[i][j], _mm512_fmadd_ps(both, dx, _mm512_load_ps(facc[i][j])));
            }
          }
        }
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
      __m512 val = _mm512_load_ps(facc[i][j]);
      if (o.bias) val = _mm512_add_ps(val, bias);
      const int64_t at = (m0 + i) * o.ldy + n0;
      if (o.bf16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(o.y) + at), to_bf16(val));
      else
        _mm512_storeu_ps(static_cast<float*>(o.y) + at, val);
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

// Rows [mb, me) of NG column groups from g0, in tiles of heights as even as they go.
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
  constexpr int TM = PAGEDSERVE_GGUF_Q3K_TILE_M, TG = PAGEDSERVE_GGUF_Q3K_TILE_G;
  static_assert(TM >= 1 && TM <= 8 && TG >= 1 && TG <= 4, "Q3_K tiles: up to 8 rows x 4 groups");
  const int64_t gs = (a.k / QKK) * kEntryBytes;
  for (int64_t mb = 0; mb < M; mb += PAGEDSERVE_GGUF_Q3K_CHUNK_M) {
    const int64_t me = std::min<int64_t>(M, mb + PAGEDSERVE_GGUF_Q3K_CHUNK_M);
    for (int64_t g0 = gb; g0 < ge; g0 += TG)
      rows_of_width<TM, TG>(std::min<int64_t>(TG, ge - g0), a, w, gs, mb, me, g0, o);
  }
}

void run_tiled(const Activations& a, const uint8_t* w, int64_t M, int64_t groups, const Output& o) {
  at::parallel_for(0, groups, 1, [&](int64_t gb, int64_t ge) { run_groups(a, w, M, gb, ge, o); });
}

#if defined(PAGEDSERVE_GGUF_K_GATED)
#ifndef PAGEDSERVE_GGUF_Q3K_GATED_TILE_M
#define PAGEDSERVE_GGUF_Q3K_GATED_TILE_M PAGEDSERVE_GGUF_Q3K_TILE_M
#endif
// As run_tiled, over the o.half gate groups, each tile taking its up group along.
void run_gated(const Activations& a, const uint8_t* w, int64_t M, const Output& o) {
  constexpr int TM = PAGEDSERVE_GGUF_Q3K_GATED_TILE_M;
  static_assert(TM >= 1 && TM <= 8, "Q3_K gated tiles: up to 8 rows");
  const int64_t gs = (a.k / QKK) * kEntryBytes;
  at::parallel_for(0, o.half, 1, [&](int64_t gb, int64_t ge) {
    for (int64_t mb = 0; mb < M; mb += PAGEDSERVE_GGUF_Q3K_CHUNK_M) {
      const int64_t me = std::min<int64_t>(M, mb + PAGEDSERVE_GGUF_Q3K_CHUNK_M);
      for (int64_t g0 = gb; g0 < ge; ++g0) rows<TM, 2, true>(a, w, gs, mb, me, g0, o);
    }
  });
}
#endif

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
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kUInt8, "gguf_pack_weight: uint8 [N, row_bytes]");
  weight = weight.contiguous();
  const int64_t N = weight.size(0), row_bytes = weight.size(1);
  TORCH_CHECK(N % kCols == 0, "gguf_pack_weight: N=", N, " is not a multiple of ", kCols);
  TORCH_CHECK(row_bytes % kBlockBytes == 0, "gguf_pack_weight: rows of ", row_bytes, " bytes are not whole Q3_K blocks");
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

// Rows `ids` (int64 [n]) of a packed Q3_K weight [N/16, K/256, 1760] in the file's blocks,
// uint8 [n, K/256 * 110] (a tied embedding's rows).
torch::Tensor gguf_q3k_unpack_rows(torch::Tensor packed, torch::Tensor ids) {
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == torch::kUInt8 && packed.size(2) == kEntryBytes,
              "gguf_unpack_rows: packed Q3_K uint8 [N/16, K/256, 1760] expected");
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

// y [M, N] = quantized activations (xq [M, K], xd [M, K/32]) @ packed Q3_K weight
// [N/16, K/256, 1760]^T (+ bias float32 [N] or null): float32, or bf16 (y_bf16) rounded once.
void gguf_q3k_tiled_gemm(const int8_t* xq, const float* xd, int64_t M, int64_t K, const uint8_t* w, int64_t groups,
                         void* y, bool y_bf16, const float* bias) {
#if defined(PAGEDSERVE_GGUF_Q3K_TILED)
  // -4 * the integer sum of every 16 activations: the start of each 16-value dot product of
  // the unsigned q.
  const std::vector<int32_t> c16 = scaled_sums16(xq, M, K, -4);
  const Activations a{xq, xd, c16.data(), K, K / QK};
  const Output o{y, y_bf16, bias, groups * kCols};
  run_tiled(a, w, M, groups, o);
#else
  (void)xq, (void)xd, (void)M, (void)K, (void)w, (void)groups, (void)y, (void)y_bf16, (void)bias;
  TORCH_CHECK(false, "gguf_linear: this build has no tiled Q3_K kernel (AVX-512 VNNI)");
#endif
}

// Whether this build has the gated tiled Q3_K kernel.
bool gguf_q3k_gated() {
#if defined(PAGEDSERVE_GGUF_Q3K_TILED) && defined(PAGEDSERVE_GGUF_K_GATED)
  return true;
#else
  return false;
#endif
}

// silu(y[:, :d]) * y[:, d:] of gguf_q3k_tiled_gemm for a packed [gate; up] weight of
// `groups` column groups (d = 8 * groups), y [M, d], each half rounded first as
// gguf_q3k_tiled_gemm rounds its output, then the main kernels' SiLU-and-mul.
void gguf_q3k_tiled_gemm_silu(const int8_t* xq, const float* xd, int64_t M, int64_t K, const uint8_t* w,
                              int64_t groups, void* y, bool y_bf16, const float* bias) {
#if defined(PAGEDSERVE_GGUF_Q3K_TILED) && defined(PAGEDSERVE_GGUF_K_GATED)
  TORCH_CHECK(groups % 2 == 0, "gguf_linear_silu_and_mul: ", groups, " column groups do not split into gate and up");
  const std::vector<int32_t> c16 = scaled_sums16(xq, M, K, -4);
  const Activations a{xq, xd, c16.data(), K, K / QK};
  const Output o{y, y_bf16, bias, groups / 2 * kCols, groups / 2};
  run_gated(a, w, M, o);
#else
  (void)xq, (void)xd, (void)M, (void)K, (void)w, (void)groups, (void)y, (void)y_bf16, (void)bias;
  TORCH_CHECK(false, "gguf_linear_silu_and_mul: this build has no gated Q3_K kernel");
#endif
}

// A packed Q3_K weight as one part of a stacked call: its per-16 activation sums computed
// here, once, before the caller's parallel region.
PartRunner gguf_q3k_part(const int8_t* xq, const float* xd, int64_t M, int64_t K, const uint8_t* w, bool y_bf16) {
#if defined(PAGEDSERVE_GGUF_Q3K_TILED)
  auto c16 = std::make_shared<const std::vector<int32_t>>(scaled_sums16(xq, M, K, -4));
  return [=](int64_t gb, int64_t ge, void* y, const float* bias, int64_t ldy) {
    const Activations a{xq, xd, c16->data(), K, K / QK};
    run_groups(a, w, M, gb, ge, Output{y, y_bf16, bias, ldy});
  };
#else
  (void)xq, (void)xd, (void)M, (void)K, (void)w, (void)y_bf16;
  TORCH_CHECK(false, "gguf_linear_multi: this build has no tiled Q3_K kernel (AVX-512 VNNI)");
#endif
}
