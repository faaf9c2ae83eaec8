// Skinny bf16 linear for decode: y[M, N] = x[M, K] . w[N, K]^T (+ bias) with M small.
//
// A decode step multiplies a handful of activation rows by every weight of the model, so
// it is bound by reading the weights once from memory.  General GEMM libraries pack
// and block for large M and, for a few rows, spend more time on that than on the
// weights.  Here each tile of 4 weight rows is read straight from its [N, K] rows
// (VDPBF16PS takes bf16 pairs as they are stored: no conversion, no packing) and is
// multiplied with up to 4 activation rows at once; further row blocks reuse it from L1.
// Products of two bf16 values are exact in float32, so the result differs from a
// float32-accumulating reference only by summation order and the final rounding.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "elementwise.h"
#include "kernels.h"
#include "vec.h"

#if defined(PAGEDSERVE_HAVE_AVX512BF16)
namespace pagedserve_cpu {

struct SkinnyLinearBf16 {
  static constexpr int kTileN = 4, kTileM = 4;

  // 32 bf16 values from p; the last chunk of a row (rem < 32 values) zero-fills.
  static __m512i load32(const BF16* p, int64_t rem) {
    if (rem >= 32) return _mm512_loadu_si512(p);
    return _mm512_maskz_loadu_epi16(__mmask32((1ull << rem) - 1), p);
  }

  // Output rows [m0, m0 + MB) x columns [n0, n0 + nb), nb <= kTileN.
  template <int MB>
  static void tile(const LinearArgs& a, int64_t m0, int64_t n0, int nb) {
    const BF16* x = static_cast<const BF16*>(a.x);
    const BF16* w = static_cast<const BF16*>(a.w);
    const BF16* wr[kTileN];
    for (int j = 0; j < kTileN; ++j) wr[j] = w + (n0 + std::min(j, nb - 1)) * a.w_stride;  // repeats past nb
    const BF16* xr[MB];
    for (int i = 0; i < MB; ++i) xr[i] = x + (m0 + i) * a.x_stride;
    __m512 acc[16];
#pragma GCC unroll 16
    for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t k = 0; k < a.k; k += 32) {
      const int64_t rem = a.k - k;
      __m512i wv[kTileN];
#pragma GCC unroll 4
      for (int j = 0; j < kTileN; ++j) wv[j] = load32(wr[j] + k, rem);
#pragma GCC unroll 4
      for (int i = 0; i < MB; ++i) {
        const __m512bh xv = (__m512bh)load32(xr[i] + k, rem);
#pragma GCC unroll 4
        for (int j = 0; j < kTileN; ++j) acc[i * kTileN + j] = _mm512_dpbf16_ps(acc[i * kTileN + j], xv, (__m512bh)wv[j]);
      }
    }
    alignas(64) float s[16];
    _mm512_store_ps(s, Avx512::reduce_tree(acc));  // lane t = sum of acc[t]
    const BF16* bias = static_cast<const BF16*>(a.bias);
    BF16* out = static_cast<BF16*>(a.out);
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < nb; ++j) {
        const float v = s[i * kTileN + j] + (bias ? to_float(bias[n0 + j]) : 0.f);
        out[(m0 + i) * a.out_stride + n0 + j] = from_float<BF16>(v);
      }
  }

  // Columns [n_begin, n_end) of every output row.
  static void run(const LinearArgs& a, int64_t n_begin, int64_t n_end) {
    for (int64_t n0 = n_begin; n0 < n_end; n0 += kTileN) {
      const int nb = int(std::min<int64_t>(kTileN, n_end - n0));
      for (int64_t m0 = 0; m0 < a.m; m0 += kTileM) {
        switch (std::min<int64_t>(kTileM, a.m - m0)) {
          case 1: tile<1>(a, m0, n0, nb); break;
          case 2: tile<2>(a, m0, n0, nb); break;
          case 3: tile<3>(a, m0, n0, nb); break;
          default: tile<4>(a, m0, n0, nb); break;
        }
      }
    }
  }
};

// Packed bf16 linear for any number of rows: y[M, N] = x[M, K] . w[N, K]^T (+ bias).
//
// The weight is packed once at load into [N/16][K/2][16][2] (VNNI pairs): for every 16
// output columns, K/2 rows of 16 (w[n][k], w[n][k+1]) pairs.  One VDPBF16PS then
// multiplies a broadcast pair (x[m][k], x[m][k+1]) with 16 columns' pairs and adds into
// 16 float32 lanes that each belong to one output column, so the sums need no
// horizontal reduction and each weight load serves kTileM rows.  A tile is up to 4
// column blocks (64 columns) x kTileM rows: 24 accumulators, 4 weight loads and 6
// broadcasts per pair of k.  Weights of a tile are read once from memory and then
// reused from L1/L2 for the following row tiles; while those run, the next column
// tile's weights are prefetched in software (one line per block and pair of k), so
// that a column tile's first row tile waits less for memory (docs/benchmarks.md, "Zen 4
// decode GEMM": 2-6% on a decode step's GEMMs from 4 rows on).  The first column tile
// of each thread's range has no tile before it to fetch it: its first row tile also
// prefetches its own blocks kSelfAhead lines ahead of its loads.
//
// The gated variant (Gated = true) computes silu(x . gate^T) * (x . up^T) for a weight
// [gate; up] of N = 2d rows, as silu_and_mul(linear(x, w)) would: a tile takes NB/2
// gate blocks and the NB/2 up blocks of the same output columns, rounds both sums to
// bf16 like the plain linear's output, and writes only the d-wide product, so the 2d
// intermediate values never reach memory.
struct PackedLinearBf16 {
  static constexpr int kTileM = 6, kMaxNB = 4;
  // Lines (pairs of k) ahead of the loads that a thread's first tile prefetches of its
  // own blocks: about a memory latency of 4 streams at one core's bandwidth.
  static constexpr int kSelfAhead = 16;

  // Output columns nb0 * 16 onward (gated: of the d-wide product) for rows [m0, m0 + MT).
  // pf[0, npf): 16-column blocks (of the next column tile) to prefetch, one cache line of
  // each per pair of k, so that a row tile brings npf whole blocks towards L2.
  template <int MT, int NB, bool Gated>
  static void tile(const PackedLinearArgs& a, int64_t m0, int64_t nb0, const BF16* const* pf, int npf) {
    static_assert(!Gated || NB % 2 == 0, "a gated tile pairs gate and up blocks");
    constexpr int NO = Gated ? NB / 2 : NB;  // output blocks
    const int64_t kp_count = a.k / 2;
    const int64_t wb = kp_count * 32;  // elements per 16-column block
    const BF16* w = static_cast<const BF16*>(a.w) + nb0 * wb;
    const int64_t up_off = Gated ? (a.n / 32) * wb : 0;  // the up half starts at block n/32
    const BF16* xr[MT];
    for (int i = 0; i < MT; ++i) xr[i] = static_cast<const BF16*>(a.x) + (m0 + i) * a.x_stride;
    __m512 acc[MT][NB];
#pragma GCC unroll 6
    for (int i = 0; i < MT; ++i)
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int64_t kp = 0; kp < kp_count; ++kp) {
      for (int p = 0; p < npf; ++p) _mm_prefetch(reinterpret_cast<const char*>(pf[p] + kp * 32), _MM_HINT_T1);
      __m512i wv[NB];
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j)
        wv[j] = _mm512_loadu_si512(w + (j < NO ? j * wb : up_off + (j - NO) * wb) + kp * 32);
#pragma GCC unroll 6
      for (int i = 0; i < MT; ++i) {
        int32_t pair;
        std::memcpy(&pair, xr[i] + 2 * kp, sizeof(pair));
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
        for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xb, (__m512bh)wv[j]);
      }
    }
    const BF16* bias = static_cast<const BF16*>(a.bias);
    BF16* out = static_cast<BF16*>(a.out);
#pragma GCC unroll 4
    for (int j = 0; j < NO; ++j) {
      const int64_t n0 = (nb0 + j) * 16;
      const __m512 b = bias ? Avx512::load(bias + n0) : _mm512_setzero_ps();
      if constexpr (Gated) {
        const __m512 bu = bias ? Avx512::load(bias + a.n / 2 + n0) : _mm512_setzero_ps();
#pragma GCC unroll 6
        for (int i = 0; i < MT; ++i) {
          const __m512 g = Avx512Bf16::round<BF16>(_mm512_add_ps(acc[i][j], b));
          const __m512 u = Avx512Bf16::round<BF16>(_mm512_add_ps(acc[i][j + NO], bu));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (m0 + i) * a.out_stride + n0),
                              Avx512Bf16::bf16_bits(Elementwise<Avx512Bf16, BF16>::silu_mul(g, u)));
        }
      } else {
#pragma GCC unroll 6
        for (int i = 0; i < MT; ++i)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (m0 + i) * a.out_stride + n0),
                              Avx512Bf16::bf16_bits(_mm512_add_ps(acc[i][j], b)));
      }
    }
  }

  // Rows [m_begin, m_end) of the column tile at block nb0.  While its row tiles run, the
  // weights of the next column tile (blocks nb0 + NO on, gated: of both halves) are
  // prefetched, spread over the row tiles: the first row tile of a column tile otherwise
  // waits for memory while the later ones run from L2.
  // first: the first column tile of this thread's range (see kSelfAhead).
  template <int NB, bool Gated>
  static void rows(const PackedLinearArgs& a, int64_t m_begin, int64_t m_end, int64_t nb0, bool first) {
    constexpr int NO = Gated ? NB / 2 : NB;
    const int64_t wb = (a.k / 2) * 32, out_blocks = Gated ? a.n / 32 : a.n / 16;
    const BF16* w = static_cast<const BF16*>(a.w);
    // [0, NB): this tile's own blocks kSelfAhead lines on (first tile only), then the
    // next column tile's blocks.
    const BF16* pf_all[2 * kMaxNB];
    int nself = 0;
    if (first)
      for (int j = 0; j < NB; ++j)
        pf_all[nself++] = w + (j < NO ? (nb0 + j) * wb : ((a.n / 32) + nb0 + j - NO) * wb) + kSelfAhead * 32;
    const BF16** next = pf_all + nself;
    int nnext = 0;
    for (int j = 0; j < NO && nb0 + NO + j < out_blocks; ++j) {
      next[nnext++] = w + (nb0 + NO + j) * wb;
      if constexpr (Gated) next[nnext++] = w + ((a.n / 32) + nb0 + NO + j) * wb;
    }
    const int64_t row_tiles = (m_end - m_begin + kTileM - 1) / kTileM;
    const int per_tile = int((nnext + row_tiles - 1) / row_tiles);  // blocks each row tile fetches
    int64_t m0 = m_begin;
    int done = 0;
    // The first row tile's list starts with the own blocks, right before its share.
    auto fetch = [&](int& npf) {
      npf = std::max(0, std::min(per_tile, nnext - done));
      const BF16* const* p = next + done;
      done += npf;
      if (nself > 0) {
        p -= nself;
        npf += nself;
        nself = 0;
      }
      return p;
    };
    int npf;
    for (; m0 + kTileM <= m_end; m0 += kTileM) {
      const BF16* const* p = fetch(npf);
      tile<kTileM, NB, Gated>(a, m0, nb0, p, npf);
    }
    const BF16* const* p = fetch(npf);
    switch (m_end - m0) {
      case 1: tile<1, NB, Gated>(a, m0, nb0, p, npf); break;
      case 2: tile<2, NB, Gated>(a, m0, nb0, p, npf); break;
      case 3: tile<3, NB, Gated>(a, m0, nb0, p, npf); break;
      case 4: tile<4, NB, Gated>(a, m0, nb0, p, npf); break;
      case 5: tile<5, NB, Gated>(a, m0, nb0, p, npf); break;
      default: break;
    }
  }

  // Rows [m_begin, m_end) x 16-column blocks [nb_begin, nb_end), 64 columns at a time.
  static void run(const PackedLinearArgs& a, int64_t m_begin, int64_t m_end, int64_t nb_begin, int64_t nb_end) {
    for (int64_t nb = nb_begin; nb < nb_end; nb += kMaxNB) {
      const bool first = nb == nb_begin;
      switch (std::min<int64_t>(kMaxNB, nb_end - nb)) {
        case 1: rows<1, false>(a, m_begin, m_end, nb, first); break;
        case 2: rows<2, false>(a, m_begin, m_end, nb, first); break;
        case 3: rows<3, false>(a, m_begin, m_end, nb, first); break;
        default: rows<4, false>(a, m_begin, m_end, nb, first); break;
      }
    }
  }

  // Gated: output blocks [nb_begin, nb_end) of the d-wide product (a.n = 2d columns of
  // weight, d % 16 == 0), 32 output columns at a time.
  static void run_gated(const PackedLinearArgs& a, int64_t m_begin, int64_t m_end, int64_t nb_begin,
                        int64_t nb_end) {
    for (int64_t nb = nb_begin; nb < nb_end; nb += kMaxNB / 2) {
      if (nb_end - nb >= 2)
        rows<4, true>(a, m_begin, m_end, nb, nb == nb_begin);
      else
        rows<2, true>(a, m_begin, m_end, nb, nb == nb_begin);
    }
  }
};

}  // namespace pagedserve_cpu
#endif
