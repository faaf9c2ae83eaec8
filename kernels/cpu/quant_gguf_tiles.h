// The scaffolding of the tiled GGUF kernels (AVX-512 VNNI builds: quant_gguf_packed.cpp,
// quant_gguf_kpacked.cpp, quant_gguf_q2k.cpp, quant_gguf_q3k.cpp, quant_gguf_iq4xs.cpp): how a
// call's rows and 16-column groups are cut into register tiles and spread over threads, and
// the steps every tile repeats (its weights' and activations' starts, the broadcast vpdpbusd,
// the float step, the stores).  A type brings its tile alone, through a policy:
//
//   struct MyTiles : pagedserve_gguf::TileShape<VALUES, ENTRY_BYTES, CHUNK, TM, TG, GATED_TM, PAIRS> {
//     using Activations = MyActivations;  // what the tile reads of the activations (k: values per row)
//     template <int MT, int NG, bool GATED>
//     static void tile(const Activations& a, const uint8_t* w, int64_t group_stride, int64_t m0,
//                      int64_t g0, const Output& o);
//   };
//
// tile<MT, NG, GATED> writes rows [m0, m0 + MT) of the NG column groups from g0 (MT 1..8): the
// weight of column group g starts at w + g * group_stride (its K / VALUES packed entries of
// ENTRY_BYTES, one per 16 columns and VALUES values).  GATED tiles (NG even) take the NG / 2
// gate groups from g0 and their up groups from g0 + o.half, and write silu(gate) * up at the
// gate columns (store_tile).  With it:
//   run_tiled<MyTiles>(a, w, M, groups, o)   the linear op: y [M, 16 groups] (o.ldy = 16 groups),
//   run_gated<MyTiles>(a, w, M, o)           the gated op on 2 * o.half groups [gate; up],
//   part_runner<MyTiles>(a, w, M, y_bf16)    one part of a stacked call (PartRunner),
//   run_call<MyTiles>(call, a, args)         whichever of the three an entry point is asked for.
// The work split, the same for every type: column groups across threads (at::parallel_for,
// grain one group; the gated op: gate groups), then on each thread rows in chunks of CHUNK
// (a multiple of every tile height up to 8, so that only a call's last chunk has a partial
// row tile; the chunk's activations stay in L2 while the column tiles pass over them), and
// in a chunk tiles of TG groups (the last one narrower) over all its rows, each group's
// weights read from memory by the first row tile and from cache by the others.  The rows
// of a chunk go in ceil(rows / TM) tiles of heights as even as they go (16 rows of 5-row
// tiles as 4 + 4 + 4 + 4, not 5 + 5 + 5 + 1: no short tile that unpacks the weights for one
// row).  Gated tiles: GATED_TM rows, PAIRS gate/up pairs (1 or 2), the last one single.
// A policy may also set kFewRows and Few (a policy of its own): calls of at most kFewRows
// rows then take Few's tiles (decode steps, whose weights are read once); calls of at most
// kStreamRows rows (below) take one-group tiles before either.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>

#include "quant_gguf_common.h"
#include "quant_gguf_gated.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>

namespace pagedserve_gguf {

// Columns per group: the 16 float32 / int32 lanes of one vector.
constexpr int kTileCols = 16;

// Calls of at most this many rows (decode steps) take plain tiles of one column group: a
// group's weights are contiguous and a thread's groups adjacent, so the thread reads its
// weights as one sequential stream.  Tiles of several groups read as many short streams at
// once (a group is K / 256 entries: 18 KB of Q4_K at K 2048), which at one row, where
// reading the weights is the whole cost, took up to 1.4x the time on Zen 4 at K 2048
// (Q3_K 2-2.8x), 0.9-1.2x at K 8192 (docs/quantization.md).  From two rows tiles of
// several groups measured as fast or faster.  Not the gated op: its gate and up groups
// are two streams either way (a gate group whole, then its up group, measured 0.84-1.25x
// the gated tile).
// 0: off.
#ifndef PAGEDSERVE_GGUF_STREAM_ROWS
#define PAGEDSERVE_GGUF_STREAM_ROWS 1
#endif
constexpr int kStreamRows = PAGEDSERVE_GGUF_STREAM_ROWS;
static_assert(kStreamRows >= 0 && kStreamRows <= 8, "stream rows: 0 (off) to 8");

// A policy's shapes (see above); the policy derives from it and adds Activations and tile.
template <int VALUES, int ENTRY_BYTES, int64_t CHUNK, int TM, int TG, int GATED_TM = TM, int PAIRS = 1>
struct TileShape {
  static_assert(TM >= 1 && TM <= 8 && TG >= 1 && TG <= 8, "tiles of 1-8 rows x 1-8 column groups");
  static_assert(GATED_TM >= 1 && GATED_TM <= 8 && PAIRS >= 1 && PAIRS <= 2, "gated tiles: 1-8 rows, 1 or 2 pairs");
  static_assert(CHUNK >= 8, "row chunks of at least 8 rows");
  static constexpr int kEntryValues = VALUES, kEntryBytes = ENTRY_BYTES;
  static constexpr int64_t kChunkM = CHUNK;
  static constexpr int kTileM = TM, kTileG = TG, kGatedTileM = GATED_TM, kGatedPairs = PAIRS;
  static constexpr int64_t kFewRows = 0;
  template <class A>
  static int64_t group_stride(const A& a) {
    return (a.k / VALUES) * ENTRY_BYTES;
  }
};

// -- the work split -------------------------------------------------------------------------

// The tile of h <= H rows at m0.
template <class P, int H, int NG, bool GATED>
inline void tile_of_height(int64_t h, const typename P::Activations& a, const uint8_t* w, int64_t gs, int64_t m0,
                           int64_t g0, const Output& o) {
  if constexpr (H >= 1) {
    if (h == H) return P::template tile<H, NG, GATED>(a, w, gs, m0, g0, o);
    tile_of_height<P, H - 1, NG, GATED>(h, a, w, gs, m0, g0, o);
  }
}

// Rows [mb, me) of NG column groups from g0, in tiles of at most TM rows, heights as even as
// they go.
template <class P, int TM, int NG, bool GATED>
void rows(const typename P::Activations& a, const uint8_t* w, int64_t gs, int64_t mb, int64_t me, int64_t g0,
          const Output& o) {
  const int64_t count = me - mb;
  if (count <= 0) return;
  const int64_t tiles = (count + TM - 1) / TM;
  for (int64_t t = 0, m0 = mb; t < tiles; ++t) {
    const int64_t h = count / tiles + (t < count % tiles);
    tile_of_height<P, TM, NG, GATED>(h, a, w, gs, m0, g0, o);
    m0 += h;
  }
}

// Rows [mb, me) of g <= NG column groups from g0.
template <class P, int TM, int NG>
inline void rows_of_width(int64_t g, const typename P::Activations& a, const uint8_t* w, int64_t gs, int64_t mb,
                          int64_t me, int64_t g0, const Output& o) {
  if constexpr (NG >= 1) {
    if (g == NG) return rows<P, TM, NG, false>(a, w, gs, mb, me, g0, o);
    rows_of_width<P, TM, NG - 1>(g, a, w, gs, mb, me, g0, o);
  }
}

// Column groups [gb, ge) for all M rows, on the calling thread (inside the caller's parallel
// region, if any).
template <class P>
void run_groups(const typename P::Activations& a, const uint8_t* w, int64_t M, int64_t gb, int64_t ge,
                const Output& o) {
  if constexpr (kStreamRows > 0) {
    if (M <= kStreamRows) {  // one group at a time: the thread's weights are one sequential stream
      const int64_t gs = P::group_stride(a);
      for (int64_t g0 = gb; g0 < ge; ++g0) rows<P, kStreamRows, 1, false>(a, w, gs, 0, M, g0, o);
      return;
    }
  }
  if constexpr (P::kFewRows > 0) {
    if (M <= P::kFewRows) return run_groups<typename P::Few>(a, w, M, gb, ge, o);
  }
  constexpr int TM = P::kTileM, TG = P::kTileG;
  const int64_t gs = P::group_stride(a);
  for (int64_t mb = 0; mb < M; mb += P::kChunkM) {
    const int64_t me = std::min<int64_t>(M, mb + P::kChunkM);
    for (int64_t g0 = gb; g0 < ge; g0 += TG)
      rows_of_width<P, TM, TG>(std::min<int64_t>(TG, ge - g0), a, w, gs, mb, me, g0, o);
  }
}

// The linear op: `groups` column groups for all M rows, the groups split across threads.
template <class P>
void run_tiled(const typename P::Activations& a, const uint8_t* w, int64_t M, int64_t groups, const Output& o) {
  at::parallel_for(0, groups, 1, [&](int64_t gb, int64_t ge) { run_groups<P>(a, w, M, gb, ge, o); });
}

// The gated op: as run_tiled over the o.half gate groups, each tile taking its up groups along.
template <class P>
void run_gated(const typename P::Activations& a, const uint8_t* w, int64_t M, const Output& o) {
  constexpr int TM = P::kGatedTileM, PAIRS = P::kGatedPairs;
  const int64_t gs = P::group_stride(a);
  at::parallel_for(0, o.half, 1, [&](int64_t gb, int64_t ge) {
    for (int64_t mb = 0; mb < M; mb += P::kChunkM) {
      const int64_t me = std::min<int64_t>(M, mb + P::kChunkM);
      for (int64_t g0 = gb; g0 < ge;) {
        if (ge - g0 >= PAIRS) {
          rows<P, TM, 2 * PAIRS, true>(a, w, gs, mb, me, g0, o);
          g0 += PAIRS;
        } else {
          rows<P, TM, 2, true>(a, w, gs, mb, me, g0, o);
          g0 += 1;
        }
      }
    }
  });
}

// One part of a stacked call: run_groups on the part's activations a (copied into the
// runner; keep: what they point into, kept alive with it).
template <class P>
PartRunner part_runner(const typename P::Activations& a, const uint8_t* w, int64_t M, bool y_bf16,
                       std::shared_ptr<const void> keep = nullptr) {
  return [a, w, M, y_bf16, keep](int64_t gb, int64_t ge, void* y, const float* bias, int64_t ldy) {
    (void)keep;
    run_groups<P>(a, w, M, gb, ge, Output{y, y_bf16, bias, ldy});
  };
}

// Call c (quant_gguf_common.h) of the tiles P on activations a, the rest of its arguments in t
// (keep: what a points into, kept alive with a part's runner).  A type's entry point
// computes a (the sums its tiles read beside t's) and returns this.
template <class P>
PartRunner run_call(Call c, const typename P::Activations& a, const TiledArgs& t,
                    std::shared_ptr<const void> keep = nullptr) {
  switch (c) {
    case Call::kLinear:
      run_tiled<P>(a, t.w, t.M, t.groups, Output{t.y, t.y_bf16, t.bias, t.groups * kTileCols});
      return nullptr;
    case Call::kGated:
#if defined(PAGEDSERVE_GGUF_K_GATED)
      TORCH_CHECK(t.groups % 2 == 0, "gguf_linear_silu_and_mul: ", t.groups,
                  " column groups do not split into gate and up");
      run_gated<P>(a, t.w, t.M, Output{t.y, t.y_bf16, t.bias, t.groups / 2 * kTileCols, t.groups / 2});
      return nullptr;
#else
      TORCH_CHECK(false, "gguf_linear_silu_and_mul: this build has no gated tiled kernel");
#endif
    case Call::kPart:
      return part_runner<P>(a, t.w, t.M, t.y_bf16, std::move(keep));
  }
  return nullptr;
}

// -- a tile's steps -------------------------------------------------------------------------

// A tile's start: its float32 accumulators zeroed, its rows' activations xr[i] (row m0 + i of
// the int8 [M, k] xq) and its column groups' weights wg[j] (GATED: the last NG / 2 the up
// groups of the first NG / 2, o.half groups on).
template <int MT, int NG, bool GATED>
inline void tile_start(const int8_t* xq, int64_t k, const uint8_t* w, int64_t gs, int64_t m0, int64_t g0,
                       const Output& o, float (&facc)[MT][NG][kTileCols], const int8_t* (&xr)[MT],
                       const uint8_t* (&wg)[NG]) {
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NG; ++j) _mm512_store_ps(facc[i][j], _mm512_setzero_ps());
  for (int i = 0; i < MT; ++i) xr[i] = xq + (m0 + i) * k;
  for (int j = 0; j < NG; ++j) wg[j] = w + (GATED && j >= NG / 2 ? g0 + o.half + j - NG / 2 : g0 + j) * gs;
}

// iacc[i][j] += the dot products of wv[j] (4 consecutive k of a group's 16 columns, unsigned
// bytes) with the 4 int8 activations of row i at xs[i] + at, broadcast (vpdpbusd).
template <int MT, int NG>
inline void dot4(const int8_t* const* xs, int64_t at, const __m512i (&wv)[NG], __m512i (&iacc)[MT][NG]) {
  for (int i = 0; i < MT; ++i) {
    int32_t x4;
    std::memcpy(&x4, xs[i] + at, 4);
    const __m512i xv = _mm512_set1_epi32(x4);
    for (int j = 0; j < NG; ++j) iacc[i][j] = _mm512_dpbusd_epi32(iacc[i][j], wv[j], xv);
  }
}

// iacc[i][j] += the dot products of a 32-value block in Q4_x's nibble lines (quant_gguf_packed.cpp:
// at wb[j], 4 lines of 64 bytes, byte 4c+t of line p holding column c's value at k = 8p+t in
// its low nibble and at k = 8p+4+t in its high one) with row i's 32 activations at xb[i].
// Unpacked line L = 2p + h (k = 4L..4L+3) is the masked nibbles, then finish(wv, L) turns
// them into vpdpbusd's unsigned operand where the type needs more (levels, a fifth bit).
template <int MT, int NG, class Finish>
inline void nibble_dots(const int8_t* const* xb, const uint8_t* const* wb, __m512i (&iacc)[MT][NG],
                        const Finish& finish) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 4
  for (int p = 0; p < 4; ++p) {
    // Low nibbles (k = 8p..8p+3) then high (8p+4..8p+7): only NG unpacked lines live.
    __m512i raw[NG];
    for (int j = 0; j < NG; ++j) raw[j] = _mm512_loadu_si512(wb[j] + p * 64);
    for (int h = 0; h < 2; ++h) {
      __m512i wv[NG];
      for (int j = 0; j < NG; ++j) wv[j] = _mm512_and_si512(h ? _mm512_srli_epi16(raw[j], 4) : raw[j], low4);
      finish(wv, 2 * p + h);
      dot4<MT, NG>(xb, 8 * p + 4 * h, wv, iacc);
    }
  }
}

// facc[i][j] += (wsc[j] * d_x) * float(iacc[i][j]), d_x = xd[(m0 + i) * nb + b] the scale of
// row m0 + i's activation block b: the row kernels' float step.
template <int MT, int NG>
inline void accumulate(const float* xd, int64_t nb, int64_t m0, int64_t b, const __m512 (&wsc)[NG],
                       const __m512i (&iacc)[MT][NG], float (&facc)[MT][NG][kTileCols]) {
  for (int i = 0; i < MT; ++i) {
    const __m512 dx = _mm512_set1_ps(xd[(m0 + i) * nb + b]);
    for (int j = 0; j < NG; ++j)
      _mm512_store_ps(facc[i][j], _mm512_fmadd_ps(_mm512_mul_ps(wsc[j], dx), _mm512_cvtepi32_ps(iacc[i][j]),
                                                  _mm512_load_ps(facc[i][j])));
  }
}

// The float step of a 32-value block b summed in two 16-value halves (Q3_K, Q6_K: a weight
// scale wsc per half): half 0 keeps first = wsc[j] * dot, half 1 adds facc += d_x * (first +
// wsc[j] * dot), one d_x step per block as in the row kernels.
template <int MT, int NG>
inline void accumulate_half(int half, const float* xd, int64_t nb, int64_t m0, int64_t b, const __m512 (&wsc)[NG],
                            const __m512i (&iacc)[MT][NG], float (&first)[MT][NG][kTileCols],
                            float (&facc)[MT][NG][kTileCols]) {
  if (half == 0) {
    for (int i = 0; i < MT; ++i)
      for (int j = 0; j < NG; ++j) _mm512_store_ps(first[i][j], _mm512_mul_ps(wsc[j], _mm512_cvtepi32_ps(iacc[i][j])));
  } else {
    for (int i = 0; i < MT; ++i) {
      const __m512 dx = _mm512_set1_ps(xd[(m0 + i) * nb + b]);
      for (int j = 0; j < NG; ++j) {
        const __m512 both = _mm512_fmadd_ps(wsc[j], _mm512_cvtepi32_ps(iacc[i][j]), _mm512_load_ps(first[i][j]));
        _mm512_store_ps(facc[i][j], _mm512_fmadd_ps(both, dx, _mm512_load_ps(facc[i][j])));
      }
    }
  }
}

// A tile's stores: value(i, j), the float32 sums of row m0 + i's 16 columns of group j (bias
// not added), plus the bias, rounded to bf16 (to_bf16) or kept float32, at o.y; GATED: gate
// group j and its up group j + NG / 2, each so finished, through the main kernels'
// SiLU-and-mul (store_silu_mul), at the gate columns.
template <int MT, int NG, bool GATED, class Value>
inline void store_tile_with(const Value& value, int64_t m0, int64_t g0, const Output& o) {
  if constexpr (GATED) {
#if defined(PAGEDSERVE_GGUF_K_GATED)
    constexpr int P = NG / 2;
    for (int j = 0; j < P; ++j) {
      const int64_t ng = (g0 + j) * kTileCols, nu = (g0 + o.half + j) * kTileCols;
      for (int i = 0; i < MT; ++i) store_silu_mul(value(i, j), value(i, j + P), o, ng, nu, (m0 + i) * o.ldy + ng);
    }
#else
    static_assert(!GATED, "this build has no gated epilogue (quant_gguf_gated.h)");
#endif
  } else {
    for (int j = 0; j < NG; ++j) {
      const int64_t n0 = (g0 + j) * kTileCols;
      const __m512 bias = o.bias ? _mm512_loadu_ps(o.bias + n0) : _mm512_setzero_ps();
      for (int i = 0; i < MT; ++i) {
        __m512 v = value(i, j);
        if (o.bias) v = _mm512_add_ps(v, bias);
        const int64_t at = (m0 + i) * o.ldy + n0;
        if (o.bf16)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(o.y) + at), to_bf16(v));
        else
          _mm512_storeu_ps(static_cast<float*>(o.y) + at, v);
      }
    }
  }
}

// The sums facc.
template <int MT, int NG, bool GATED>
inline void store_tile(const float (&facc)[MT][NG][kTileCols], int64_t m0, int64_t g0, const Output& o) {
  store_tile_with<MT, NG, GATED>([&](int i, int j) { return _mm512_load_ps(facc[i][j]); }, m0, g0, o);
}

// The sums facc + fext (a minimum term summed apart).
template <int MT, int NG, bool GATED>
inline void store_tile(const float (&facc)[MT][NG][kTileCols], const __m512 (&fext)[MT][NG], int64_t m0, int64_t g0,
                       const Output& o) {
  store_tile_with<MT, NG, GATED>([&](int i, int j) { return _mm512_add_ps(_mm512_load_ps(facc[i][j]), fext[i][j]); },
                                 m0, g0, o);
}

}  // namespace pagedserve_gguf

#endif
