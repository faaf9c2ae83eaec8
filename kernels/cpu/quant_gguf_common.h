// Small helpers the GGUF kernel files of the quantized CPU extension share (fp16 fields,
// the tiled types' repacking loops, the row kernels' driver over activation rows and output
// columns, the AVX2 row kernels'
// unsigned x signed byte dot product and horizontal sum, the tiled kernels' bf16 rounding,
// output descriptor and weight prefetch).  Each file brings them into its own anonymous
// namespace with using-declarations.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pagedserve_gguf {

// One part of a stacked call (quant_gguf.cpp gguf_linear_multi_out), its activations and
// weight bound: writes column groups [gb, ge) of its weight for every row at y (the part's
// first column, ldy elements per row) with bias (the part's, or null), inside the caller's
// parallel region (no region of its own).
using PartRunner = std::function<void(int64_t gb, int64_t ge, void* y, const float* bias, int64_t ldy)>;

// What a tiled type's entry point (gguf_<type>_call) runs: the linear op (y [M, 16 * groups]),
// the gated op (silu(gate) * up of `groups` column groups [gate; up], y [M, 8 * groups]) or
// one part of a stacked call (its PartRunner returned; the others return an empty one).
enum class Call { kLinear, kGated, kPart };

// The op's name in its errors.
inline const char* call_name(Call c) {
  return c == Call::kLinear ? "gguf_linear" : c == Call::kGated ? "gguf_linear_silu_and_mul" : "gguf_linear_multi";
}

// A tiled call's arguments: the quantized activations (xq int8 [M, K]; xd, xds, xsum [M, K/32]
// their blocks' scales, scaled sums and integer sums), the packed weight w of `groups` column
// groups of ggml type `type`, and where the result goes (y float32, or bf16 if y_bf16, with
// bias float32 or null; a part's are the caller's).
struct TiledArgs {
  const int8_t* xq;
  const float* xd;
  const float* xds;
  const int32_t* xsum;
  int64_t M, K;
  const uint8_t* w;
  int64_t groups, type;
  void* y;
  bool y_bf16;
  const float* bias;
};

// The fp16 field at p (any alignment) as float32.
inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

// f rounded to fp16 (to nearest even) and back.
inline float round_to_half(float f) { return static_cast<float>(c10::Half(f)); }

// -- repacking ----------------------------------------------------------------------------
//
// Every tiled type repacks a weight uint8 [N, row_bytes] of N a multiple of 16 (blocks of
// block_bytes) into uint8 [N/16, blocks, 16 * block_bytes]: entry (g, b), the file's size,
// holds block b of the 16 rows of column group g.

// The packed weight: pack_entry(the first row's block b of group g, row_bytes, entry (g, b))
// for every entry, the groups split across threads.  blocks: the blocks' name for the error
// ("blocks", "Q3_K blocks").
template <class PackEntry>
at::Tensor pack_groups(at::Tensor weight, int64_t block_bytes, const char* blocks, const PackEntry& pack_entry) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kByte, "gguf_pack_weight: uint8 [N, row_bytes]");
  weight = weight.contiguous();
  const int64_t N = weight.size(0), row_bytes = weight.size(1), eb = 16 * block_bytes;
  TORCH_CHECK(N % 16 == 0, "gguf_pack_weight: N=", N, " is not a multiple of ", 16);
  TORCH_CHECK(row_bytes % block_bytes == 0, "gguf_pack_weight: rows of ", row_bytes, " bytes are not whole ", blocks);
  const int64_t nb = row_bytes / block_bytes, groups = N / 16;
  auto out = at::empty({groups, nb, eb}, weight.options());
  const uint8_t* src = weight.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = 0; b < nb; ++b)
        pack_entry(src + g * 16 * row_bytes + b * block_bytes, row_bytes, dst + (g * nb + b) * eb);
  });
  return out;
}

// Rows `ids` (int64 [n]) of a packed weight [N/16, blocks, 16 * block_bytes] (its shape
// checked by the caller) in the file's blocks, uint8 [n, blocks * block_bytes]:
// unpack_block(entry, column c of its 16, the block) for each of their blocks.
template <class UnpackBlock>
at::Tensor unpack_group_rows(at::Tensor packed, at::Tensor ids, int64_t block_bytes, const UnpackBlock& unpack_block) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "gguf_unpack_rows: ids must be int64 [n]");
  packed = packed.contiguous();
  ids = ids.contiguous();
  const int64_t groups = packed.size(0), nb = packed.size(1), eb = packed.size(2), n = ids.size(0);
  auto out = at::empty({n, nb * block_bytes}, packed.options());
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < groups * 16, "gguf_unpack_rows: row ", id[i], " out of range");
  const uint8_t* src = packed.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, n, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t g = id[i] / 16;
      const int c = static_cast<int>(id[i] % 16);
      for (int64_t b = 0; b < nb; ++b)
        unpack_block(src + (g * nb + b) * eb, c, dst + (i * nb + b) * block_bytes);
    }
  });
  return out;
}

// -- the row kernels' driver -------------------------------------------------------------
//
// Every type's row kernel (weights in the file's blocks, not repacked: the only path of the
// AVX2-only and scalar builds) is one templated function
//   template <int MB> void row_dot(const uint8_t* w_row, ..., const XRow* xr, float* out)
// writing out[0..MB), the dot products of one weight row with MB (1..8) activation rows,
// each of which it reads through its XRow (the file's per-row activation pointers).
// row_kernel_gemm does the rest, the same for every type:
//   y float32 [M, N] (row stride N) = M activation rows times the N weight rows at w,
//   row_bytes apart.
// The weight rows are split across threads (at::parallel_for over n, grain 16); each thread
// takes the activations 8 rows at a time, so that every weight row it decodes serves up to
// 8 of them: for rows m0..m0+mb it fills xr[i] = x_row(m0 + i), then, for each weight row n
// of its range, calls
//   dot(std::integral_constant<int, mb>{}, w + n * row_bytes, xr, out)
// (mb a compile-time constant, 1..8, dispatched by with_rows) and stores out[m] to
// y[(m0 + m) * N + n].  A file's use, with XRow { q, d } and nb blocks per row:
//   pagedserve_gguf::row_kernel_gemm<XRow>(
//       M, N, w, row_bytes, y, [&](int64_t m) { return XRow{xq + m * K, xd + m * nb}; },
//       [&](auto mb, const uint8_t* wr, const XRow* xr, float* out) {
//         row_dot<decltype(mb)::value>(wr, nb, xr, out);
//       });

// The row-count dispatch: f(std::integral_constant<int, mb>{}) for mb in 1..7, 8 otherwise.
template <class F>
inline void with_rows(int64_t mb, F&& f) {
  switch (mb) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}

// Weight rows n0..n1 against the MB activation rows xr (rows m0.. of y).
template <int MB, class XRow, class Dot>
void row_kernel_rows(const Dot& dot, const uint8_t* w, int64_t row_bytes, const XRow* xr, float* y, int64_t N,
                     int64_t m0, int64_t n0, int64_t n1) {
  float out[MB];
  for (int64_t n = n0; n < n1; ++n) {
    dot(std::integral_constant<int, MB>{}, w + n * row_bytes, xr, out);
    for (int m = 0; m < MB; ++m) y[(m0 + m) * N + n] = out[m];
  }
}

// See above: x_row(m) -> XRow of activation row m; dot(integral_constant<int, MB>, w_row,
// const XRow* xr, float* out).
template <class XRow, class XRowOf, class Dot>
void row_kernel_gemm(int64_t M, int64_t N, const uint8_t* w, int64_t row_bytes, float* y, const XRowOf& x_row,
                     const Dot& dot) {
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    XRow xr[8];
    for (int64_t m0 = 0; m0 < M; m0 += 8) {
      const int64_t mb = std::min<int64_t>(8, M - m0);
      for (int64_t i = 0; i < mb; ++i) xr[i] = x_row(m0 + i);
      with_rows(mb, [&](auto rows) {
        row_kernel_rows<decltype(rows)::value>(dot, w, row_bytes, xr, y, N, m0, n0, n1);
      });
    }
  });
}

#if defined(__AVX2__)
// Per 32-bit lane: the sum of four products of u's unsigned and s's signed bytes
// (vpdpbusd where AVX-512 VNNI/VL exists; else vpmaddubsw, whose pairwise 16-bit sums
// cannot saturate for the operands these kernels pass, then vpmaddwd).
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v);
  lo = _mm_add_ps(lo, _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
// float32 -> bf16 rounded to nearest even, NaN kept quiet (as torch's .to(bfloat16);
// vcvtneps2bf16 also flushes float32 subnormals to zero, which torch does not, a case
// these sums never reach).  The fallback equals the instruction on every other input.
inline __m256i to_bf16(__m512 v) {
#if defined(__AVX512BF16__)
  return (__m256i)_mm512_cvtneps_pbh(v);
#else
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(r);
#endif
}

// 16 activations as float32.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// One row of K activations quantized per 32-value block (quant_gguf.cpp's quantize_row,
// which says why each step) with 512-bit vectors, bit for bit the same: the same amax,
// scale and 127/amax, the same float32 product, rounded to nearest even (the default MXCSR
// mode, as nearbyint), the same integer sum.  q [K] int8, d, ds, isum [K/32].  The tiled
// kernels' and the AMX kernel's (quant_gguf_amx.cpp) quantization.
template <typename T>
void quantize_row_vec(const T* x, int64_t K, bool half_sum, int8_t* q, float* d, float* ds, int32_t* isum) {
  constexpr int64_t QK = 32;
  for (int64_t b = 0; b < K / QK; ++b) {
    const __m512 v0 = load16(x + b * QK), v1 = load16(x + b * QK + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float scale = amax / 127.f;
    const float inv = amax != 0.f ? 127.f / amax : 0.f;
    const __m512 vinv = _mm512_set1_ps(inv);
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, vinv));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, vinv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * QK), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * QK + 16), _mm512_cvtepi32_epi8(q1));
    const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    d[b] = round_to_half(scale);
    ds[b] = half_sum ? round_to_half(scale * static_cast<float>(sum)) : d[b] * static_cast<float>(sum);
    isum[b] = sum;
  }
}

// Where a tiled kernel writes its [rows, 16-column group] results: float32 or bf16 y with
// ldy elements per row, an optional float32 bias.  Gated tiles pair gate group g with up
// group g + half and write silu(gate) * up at group g (quant_gguf_gated.h).
struct Output {
  void* y;
  bool bf16;
  const float* bias;
  int64_t ldy;
  int64_t half = 0;
};

// factor * the integer sum of every 16 int8 activations, int32 [M, K/16] (a sum of absolute
// differences of x + 128 against zero per 8 bytes): the start of the 16-value dot products
// of Q6_K (factor -32: q - 32 through the unsigned q) and Q3_K (-4).
inline std::vector<int32_t> scaled_sums16(const int8_t* xq, int64_t M, int64_t K, int32_t factor) {
  const int64_t nh = K / 16;
  std::vector<int32_t> out(static_cast<size_t>(M * nh));
  const __m128i flip = _mm_set1_epi8(static_cast<char>(0x80)), zero = _mm_setzero_si128();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t h = 0; h < nh; ++h) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(xq + m * K + 16 * h));
      const __m128i sad = _mm_sad_epu8(_mm_xor_si128(v, flip), zero);
      const int32_t sum = _mm_cvtsi128_si32(sad) + _mm_extract_epi32(sad, 2) - 16 * 128;
      out[m * nh + h] = factor * sum;
    }
  return out;
}

// Prefetches the cache lines of bytes [at, at + len) of base into L1, nothing when at is
// at or past end (the stream's last byte + 1).
inline void prefetch_lines(const uint8_t* base, int64_t at, int64_t len, int64_t end) {
  if (at >= end) return;
  const uintptr_t first = reinterpret_cast<uintptr_t>(base + at) & ~uintptr_t(63);
  const uintptr_t last = reinterpret_cast<uintptr_t>(base + at + len - 1) & ~uintptr_t(63);
  for (uintptr_t line = first; line <= last; line += 64) _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T0);
}
#endif

}  // namespace pagedserve_gguf
