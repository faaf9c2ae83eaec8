// Tiled GEMM on GGUF Q4_0 / Q4_1 / Q8_0 weights repacked once at load (AVX-512 VNNI).
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
//   Q8_0:        8 lines of 64 bytes, byte 4c+t of line p = column c's int8 value at
//                k = 4p+t plus 128 (an unsigned operand for vpdpbusd, the 128 * sum(x)
//                subtracted again); then the 16 fp16 scales.
//
// Numerics: the same int8 activations (quant_gguf.cpp quantizes them once per call),
// the same exact integer dot product per block, and the same block scale math as the
// row kernel: acc += (d_w * d_x) * dot in float32, the minimum term (m_w * d_x * sum(x),
// -8 d_w for Q4_0) summed apart and added at the end.  Only the float32 summation order
// differs (the row kernel adds 8 partial lanes per block and reduces them at the end),
// a few units in the last place.  Each row's result depends on that row alone.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define PAGEDSERVE_GGUF_PACKED 1
#endif

namespace {

constexpr int QK = 32;
constexpr int kCols = 16;
enum GgufType : int64_t { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };

int packed_block_bytes(int64_t type) {
  switch (type) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q8_0: return 34;
  }
  TORCH_CHECK(false, "gguf packing: unsupported ggml type id ", type, " (supported: Q4_0=2, Q4_1=3, Q8_0=8)");
}

// Bytes of quants in one packed (group, block) entry, before the scales.
inline int quant_bytes(int64_t type) { return type == Q8_0 ? 512 : 256; }

void pack_entry(const uint8_t* w, int64_t row_bytes, int64_t type, int bb, uint8_t* dst) {
  const int qb = quant_bytes(type);
  std::memset(dst, 0, qb);
  for (int c = 0; c < kCols; ++c) {
    const uint8_t* blk = w + c * row_bytes;
    if (type == Q8_0) {
      for (int k = 0; k < QK; ++k) dst[(k / 4) * 64 + c * 4 + k % 4] = blk[2 + k] ^ 0x80;
    } else {
      const uint8_t* qs = blk + (type == Q4_1 ? 4 : 2);
      for (int k = 0; k < QK; ++k) {
        const uint8_t q = k < 16 ? (qs[k] & 0x0F) : (qs[k - 16] >> 4);
        const int group = k / 4;  // 4 consecutive k; groups 2p and 2p+1 share line p
        dst[(group / 2) * 64 + c * 4 + k % 4] |= (group % 2) ? uint8_t(q << 4) : q;
      }
    }
    std::memcpy(dst + qb + 2 * c, blk, 2);
    if (type == Q4_1) std::memcpy(dst + qb + 32 + 2 * c, blk + 2, 2);
  }
  (void)bb;
}

#if defined(PAGEDSERVE_GGUF_PACKED)

struct Activations {
  const int8_t* q;     // [M, K]
  const float* d;      // [M, nb]
  const float* ds;     // [M, nb] d * integer sum
  const int32_t* sum;  // [M, nb] integer sums
  int64_t k, nb;
};

// Rows [m0, m0 + MT) x columns of NG groups starting at group g0.
template <int MT, int NG, int64_t TYPE>
void tile(const Activations& a, const uint8_t* w, int64_t group_stride, int64_t m0, int64_t g0, float* y,
          int64_t ldy) {
  constexpr int gbb = kCols * (TYPE == Q4_0 ? 18 : TYPE == Q4_1 ? 20 : 34);
  constexpr int qb = TYPE == Q8_0 ? 512 : 256;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 facc[MT][NG], fext[MT][NG];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NG; ++j) facc[i][j] = fext[i][j] = _mm512_setzero_ps();
  const uint8_t* wg[NG];
  for (int j = 0; j < NG; ++j) wg[j] = w + (g0 + j) * group_stride;
  for (int64_t b = 0; b < a.nb; ++b) {
    __m512i iacc[MT][NG];
    for (int i = 0; i < MT; ++i)
      for (int j = 0; j < NG; ++j) iacc[i][j] = _mm512_setzero_si512();
    const int8_t* xb[MT];
    for (int i = 0; i < MT; ++i) xb[i] = a.q + (m0 + i) * a.k + b * QK;
    const uint8_t* wb[NG];
    for (int j = 0; j < NG; ++j) wb[j] = wg[j] + b * gbb;
    if constexpr (TYPE == Q8_0) {
#pragma GCC unroll 8
      for (int p = 0; p < 8; ++p) {
        __m512i wv[NG];
        for (int j = 0; j < NG; ++j) wv[j] = _mm512_loadu_si512(wb[j] + p * 64);
        for (int i = 0; i < MT; ++i) {
          int32_t x4;
          std::memcpy(&x4, xb[i] + 4 * p, 4);
          const __m512i xv = _mm512_set1_epi32(x4);
          for (int j = 0; j < NG; ++j) iacc[i][j] = _mm512_dpbusd_epi32(iacc[i][j], wv[j], xv);
        }
      }
    } else {
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {
        __m512i lo[NG], hi[NG];
        for (int j = 0; j < NG; ++j) {
          const __m512i raw = _mm512_loadu_si512(wb[j] + p * 64);
          lo[j] = _mm512_and_si512(raw, low4);
          hi[j] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
        }
        for (int i = 0; i < MT; ++i) {
          int32_t x0, x1;
          std::memcpy(&x0, xb[i] + 8 * p, 4);
          std::memcpy(&x1, xb[i] + 8 * p + 4, 4);
          const __m512i xv0 = _mm512_set1_epi32(x0), xv1 = _mm512_set1_epi32(x1);
          for (int j = 0; j < NG; ++j) {
            iacc[i][j] = _mm512_dpbusd_epi32(iacc[i][j], lo[j], xv0);
            iacc[i][j] = _mm512_dpbusd_epi32(iacc[i][j], hi[j], xv1);
          }
        }
      }
    }
    __m512 dw[NG], mw[NG];
    for (int j = 0; j < NG; ++j) {
      dw[j] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb[j] + qb)));
      if constexpr (TYPE == Q4_1) {
        mw[j] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb[j] + qb + 32)));
      } else {
        mw[j] = _mm512_mul_ps(dw[j], _mm512_set1_ps(-8.f));
      }
    }
    for (int i = 0; i < MT; ++i) {
      const int64_t xi = (m0 + i) * a.nb + b;
      const __m512 dx = _mm512_set1_ps(a.d[xi]);
      const __m512 dsx = _mm512_set1_ps(a.ds[xi]);
      const __m512i bias = _mm512_set1_epi32(128 * a.sum[xi]);
      for (int j = 0; j < NG; ++j) {
        __m512i dot = iacc[i][j];
        if constexpr (TYPE == Q8_0) dot = _mm512_sub_epi32(dot, bias);
        facc[i][j] = _mm512_fmadd_ps(_mm512_mul_ps(dw[j], dx), _mm512_cvtepi32_ps(dot), facc[i][j]);
        if constexpr (TYPE != Q8_0) fext[i][j] = _mm512_fmadd_ps(mw[j], dsx, fext[i][j]);
      }
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NG; ++j)
      _mm512_storeu_ps(y + (m0 + i) * ldy + (g0 + j) * kCols, _mm512_add_ps(facc[i][j], fext[i][j]));
}

constexpr int kTileM = 4, kTileG = 2;

template <int64_t TYPE>
void run(const Activations& a, const uint8_t* w, int64_t M, int64_t groups, float* y) {
  const int64_t group_stride = a.nb * kCols * packed_block_bytes(TYPE);
  const int64_t ldy = groups * kCols;
  const int64_t col_tiles = (groups + kTileG - 1) / kTileG;
  // Column tiles across threads (both cores work at one row); each tile's weights are
  // read from memory once and reused from cache by the following row tiles.
  at::parallel_for(0, col_tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t g0 = t * kTileG;
      const bool full = g0 + kTileG <= groups;
      for (int64_t m0 = 0; m0 < M; m0 += kTileM) {
        const int64_t mt = std::min<int64_t>(kTileM, M - m0);
#define PAGEDSERVE_TILE(MT)                                          \
  if (full)                                                          \
    tile<MT, kTileG, TYPE>(a, w, group_stride, m0, g0, y, ldy);      \
  else                                                               \
    tile<MT, 1, TYPE>(a, w, group_stride, m0, g0, y, ldy);
        switch (mt) {
          case 1: PAGEDSERVE_TILE(1) break;
          case 2: PAGEDSERVE_TILE(2) break;
          case 3: PAGEDSERVE_TILE(3) break;
          default: PAGEDSERVE_TILE(4) break;
        }
#undef PAGEDSERVE_TILE
      }
    }
  });
}

#endif  // PAGEDSERVE_GGUF_PACKED

}  // namespace

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
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kUInt8, "gguf_pack_weight: uint8 [N, row_bytes]");
  const int bb = packed_block_bytes(type);
  weight = weight.contiguous();
  const int64_t N = weight.size(0), row_bytes = weight.size(1);
  TORCH_CHECK(N % kCols == 0, "gguf_pack_weight: N=", N, " is not a multiple of ", kCols);
  TORCH_CHECK(row_bytes % bb == 0, "gguf_pack_weight: rows of ", row_bytes, " bytes are not whole blocks");
  const int64_t nb = row_bytes / bb, groups = N / kCols;
  auto out = torch::empty({groups, nb, kCols * bb}, weight.options());
  const uint8_t* src = weight.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = 0; b < nb; ++b)
        pack_entry(src + g * kCols * row_bytes + b * bb, row_bytes, type, bb, dst + (g * nb + b) * kCols * bb);
  });
  return out;
}

// y [M, N] float32 = quantized activations @ packed weight [N/16, nb, 16 * block_bytes]^T.
void gguf_packed_gemm(const int8_t* xq, const float* xd, const float* xds, const int32_t* xsum, int64_t M,
                      int64_t K, const uint8_t* w, int64_t groups, int64_t type, float* y) {
#if defined(PAGEDSERVE_GGUF_PACKED)
  const Activations a{xq, xd, xds, xsum, K, K / QK};
  switch (type) {
    case Q4_0: run<Q4_0>(a, w, M, groups, y); return;
    case Q4_1: run<Q4_1>(a, w, M, groups, y); return;
    case Q8_0: run<Q8_0>(a, w, M, groups, y); return;
  }
  TORCH_CHECK(false, "gguf_packed_gemm: unsupported ggml type id ", type);
#else
  TORCH_CHECK(false, "gguf_packed_gemm: this build has no AVX-512 VNNI packed kernel");
#endif
}
