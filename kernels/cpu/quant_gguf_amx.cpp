// GEMM on GGUF Q4_0 / Q4_1 / Q8_0 weights on AMX int8 tiles (a separate extension,
// compiled with -mamx-tile -mamx-int8 only where the CPU has them).
//
// It reads the weights repacked at load for the AVX-512 VNNI tiled kernel
// (quant_gguf_packed.cpp: [N/16, K/32, 16 * block_bytes], 16 columns interleaved per
// 4 k), so both kernels share one copy of the weights.  That layout is already AMX's
// VNNI-4 B layout: a block's lines are tile rows of 16 columns x 4 k.  Q8_0's 8 lines
// (value + 128) load as a B tile as they are; Q4_x's 4 lines of nibble pairs are split
// into 8 rows (low nibbles k = 8p..8p+3, high 8p+4..8p+7) once per column group and call.
//
// Numerics: the activations are quantized exactly as quant_gguf.cpp quantizes them
// (llama.cpp's q8_1 / q8_0: the same code below), each (row, 16 columns, 32-value block)
// integer dot product is one K=32 tile product (_tile_dpbsud: signed activations x
// unsigned weight bytes; Q8_0 subtracts 128 * sum(x) again), and the float32 work per
// block is the VNNI tiled kernel's, in its order: acc += (d_w * d_x) * float(dot), the
// minimum term (m_w * ds_x, -8 d_w for Q4_0) summed apart and added at the end.  The
// result is therefore bit for bit the VNNI tiled kernel's, and each row's result
// depends on that row alone (padding rows are zeros and never written).
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <torch/extension.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "elementwise.h"
#include "quant_gguf_common.h"

namespace {

constexpr int QK = 32;
constexpr int kCols = 16;
constexpr int kRows = 16;  // activation rows per A tile
enum GgufType : int64_t { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };
using pagedserve_amx::request_amx_permission;
using pagedserve_amx::TileConfig;
using pagedserve_amx::TileScope;
using pagedserve_gguf::quantize_row_vec;

int group_block_bytes(int64_t type) {
  switch (type) {
    case Q4_0: return kCols * 18;
    case Q4_1: return kCols * 20;
    case Q8_0: return kCols * 34;
  }
  TORCH_CHECK(false, "gguf amx: unsupported ggml type id ", type, " (supported: Q4_0=2, Q4_1=3, Q8_0=8)");
}

// Activations of Mp rows (M real, the rest zeros: they only feed rows never written).
struct QuantizedX {
  std::vector<int8_t> q;
  std::vector<float> d, ds;
  std::vector<int32_t> sum;
  int64_t k, nb;
};

template <typename T>
void quantize_rows(const T* xp, int64_t M, int64_t K, bool half_sum, QuantizedX& qx) {
  const int64_t nb = K / QK;
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / K), [&](int64_t a, int64_t b) {
    for (int64_t m = a; m < b; ++m)
      quantize_row_vec(xp + m * K, K, half_sum, &qx.q[m * K], &qx.d[m * nb], &qx.ds[m * nb], &qx.sum[m * nb]);
  });
}

// float32 -> bf16 rounded to nearest even (as quant_gguf_packed.cpp's to_bf16).
inline __m256i to_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

// tmm0-3: C tiles 16 rows x 16 int32 (2 row tiles x 2 column groups); tmm4-5: A tiles
// 16 rows x 32 int8 (one block); tmm6-7: B tiles 8 rows x (16 columns x 4 k) (loaded per
// thread share by a TileScope).
const TileConfig& tile_config() {
  static const TileConfig cfg = [] {
    TileConfig c;
    for (int i = 0; i < 4; ++i) c.colsb[i] = 64, c.rows[i] = kRows;
    for (int i = 4; i < 6; ++i) c.colsb[i] = QK, c.rows[i] = kRows;
    for (int i = 6; i < 8; ++i) c.colsb[i] = 64, c.rows[i] = QK / 4;
    return c;
  }();
  return cfg;
}

struct Output {
  void* y;
  bool bf16;
  const float* bias;
  int64_t ldy, m;
};

// The B rows of column group g for every block: Q8_0 points into the packed weight,
// Q4_x splits the nibbles into buf (nb x 512 bytes).
template <int64_t TYPE>
const uint8_t* b_rows(const uint8_t* wg, int64_t nb, uint8_t* buf) {
  if constexpr (TYPE == Q8_0) {
    (void)nb, (void)buf;
    return wg;
  } else {
    const int gbb = group_block_bytes(TYPE);
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; ++b)
      for (int p = 0; p < 4; ++p) {
        const __m512i raw = _mm512_loadu_si512(wg + b * gbb + p * 64);
        _mm512_storeu_si512(buf + b * 512 + (2 * p) * 64, _mm512_and_si512(raw, low4));
        _mm512_storeu_si512(buf + b * 512 + (2 * p + 1) * 64, _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4));
      }
    return buf;
  }
}

// Rows [m0, m0 + 16 * MT) x column groups g0 .. g0 + NG.
template <int MT, int NG, int64_t TYPE>
void tile(const QuantizedX& a, const uint8_t* w, int64_t group_stride, const uint8_t* const* brows, int64_t bstride,
          int64_t m0, int64_t g0, const Output& o) {
  constexpr int qb = TYPE == Q8_0 ? 512 : 256;
  const int gbb = group_block_bytes(TYPE);
  // facc: the scaled dot products; fext: the minimum term, summed apart (as the VNNI
  // kernel sums it) but in the same pass, so that its chains run side by side.
  alignas(64) float facc[MT][NG][kRows][kCols];
  alignas(64) float fext[MT][NG][kRows][kCols];
  // Two buffers: block b's products are stored while block b - 1's are scaled, so the
  // vector loads never wait on the tile stores just issued.
  alignas(64) int32_t ibuf[2][MT][NG][kRows][kCols];
  std::memset(facc, 0, sizeof(facc));
  std::memset(fext, 0, sizeof(fext));
  const auto scale_block = [&](int64_t b) {
    const auto& ib = ibuf[b & 1];
    __m512 dw[NG], mw[NG];
    for (int j = 0; j < NG; ++j) {
      const uint8_t* s = w + (g0 + j) * group_stride + b * gbb + qb;
      dw[j] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
      if constexpr (TYPE == Q4_1)
        mw[j] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 32)));
      else
        mw[j] = _mm512_mul_ps(dw[j], _mm512_set1_ps(-8.f));
    }
    for (int i = 0; i < MT; ++i)
      for (int r = 0; r < kRows; ++r) {
        const int64_t xi = (m0 + i * kRows + r) * a.nb + b;
        const __m512 dx = _mm512_set1_ps(a.d[xi]);
        for (int j = 0; j < NG; ++j) {
          __m512i dot = _mm512_load_si512(ib[i][j][r]);
          if constexpr (TYPE == Q8_0) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(128 * a.sum[xi]));
          _mm512_store_ps(facc[i][j][r], _mm512_fmadd_ps(_mm512_mul_ps(dw[j], dx), _mm512_cvtepi32_ps(dot),
                                                         _mm512_load_ps(facc[i][j][r])));
          if constexpr (TYPE != Q8_0)
            _mm512_store_ps(fext[i][j][r], _mm512_fmadd_ps(mw[j], _mm512_set1_ps(a.ds[xi]), _mm512_load_ps(fext[i][j][r])));
        }
      }
  };
  for (int64_t b = 0; b < a.nb; ++b) {
    auto& ib = ibuf[b & 1];
    _tile_zero(0);
    if constexpr (NG > 1) _tile_zero(1);
    if constexpr (MT > 1) _tile_zero(2);
    if constexpr (MT > 1 && NG > 1) _tile_zero(3);
    _tile_loadd(4, a.q.data() + m0 * a.k + b * QK, a.k);
    if constexpr (MT > 1) _tile_loadd(5, a.q.data() + (m0 + kRows) * a.k + b * QK, a.k);
    _tile_loadd(6, brows[0] + b * bstride, 64);
    if constexpr (NG > 1) _tile_loadd(7, brows[1] + b * bstride, 64);
    _tile_dpbsud(0, 4, 6);
    if constexpr (NG > 1) _tile_dpbsud(1, 4, 7);
    if constexpr (MT > 1) _tile_dpbsud(2, 5, 6);
    if constexpr (MT > 1 && NG > 1) _tile_dpbsud(3, 5, 7);
    _tile_stored(0, ib[0][0], 64);
    if constexpr (NG > 1) _tile_stored(1, ib[0][NG - 1], 64);
    if constexpr (MT > 1) _tile_stored(2, ib[MT - 1][0], 64);
    if constexpr (MT > 1 && NG > 1) _tile_stored(3, ib[MT - 1][NG - 1], 64);
    if (b > 0) scale_block(b - 1);
  }
  scale_block(a.nb - 1);
  for (int i = 0; i < MT; ++i)
    for (int r = 0; r < kRows; ++r) {
      const int64_t m = m0 + i * kRows + r;
      if (m >= o.m) break;
      for (int j = 0; j < NG; ++j) {
        const int64_t n0 = (g0 + j) * kCols;
        __m512 v = _mm512_add_ps(_mm512_load_ps(facc[i][j][r]), _mm512_load_ps(fext[i][j][r]));
        if (o.bias) v = _mm512_add_ps(v, _mm512_loadu_ps(o.bias + n0));
        const int64_t at = m * o.ldy + n0;
        if (o.bf16)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(o.y) + at), to_bf16(v));
        else
          _mm512_storeu_ps(static_cast<float*>(o.y) + at, v);
      }
    }
}

template <int64_t TYPE>
void run(const QuantizedX& a, const uint8_t* w, int64_t Mp, int64_t groups, const Output& o) {
  const int64_t group_stride = a.nb * group_block_bytes(TYPE);
  const int64_t pairs = (groups + 1) / 2;
  at::parallel_for(0, pairs, 1, [&](int64_t pb, int64_t pe) {
    TileScope scope(tile_config());
    std::vector<uint8_t> buf(TYPE == Q8_0 ? 0 : 2 * a.nb * 512);
    const int64_t bstride = TYPE == Q8_0 ? group_block_bytes(TYPE) : 512;
    for (int64_t p = pb; p < pe; ++p) {
      const int64_t g0 = 2 * p;
      const bool two = g0 + 1 < groups;
      const uint8_t* brows[2];
      brows[0] = b_rows<TYPE>(w + g0 * group_stride, a.nb, buf.data());
      brows[1] = two ? b_rows<TYPE>(w + (g0 + 1) * group_stride, a.nb, buf.data() + a.nb * 512) : brows[0];
      int64_t m0 = 0;
      for (; m0 + 2 * kRows <= Mp; m0 += 2 * kRows) {
        if (two)
          tile<2, 2, TYPE>(a, w, group_stride, brows, bstride, m0, g0, o);
        else
          tile<2, 1, TYPE>(a, w, group_stride, brows, bstride, m0, g0, o);
      }
      if (m0 < Mp) {
        if (two)
          tile<1, 2, TYPE>(a, w, group_stride, brows, bstride, m0, g0, o);
        else
          tile<1, 1, TYPE>(a, w, group_stride, brows, bstride, m0, g0, o);
      }
    }
  });
}


// ---------------------------------------------------------------------------------------
// The same weights on AMX-BF16 tiles: each thread dequantizes a pair of 16-column groups
// over all of K into bf16 (K x 32 values, d * q + m rounded once to bf16; at most a
// few hundred KB, so it stays in L2) and multiplies every row tile of x (bf16) with it,
// float32 sums across all of K in the tile registers.  The weights stay quantized in
// memory; the dequantization is paid once per call and column pair, not per row, so
// from a few dozen rows the tile products dominate.  Numerics: x in bf16 (a float32 x
// rounded to bf16), the weight rounded to bf16, float32 sums: closer to the float
// product than the int8 activations of the VNNI kernel, a different rounding.  Each
// row's result still depends on that row alone (padding rows are zeros, never written).
namespace bf16tiles {

// One block of 16 columns x 32 k as an AMX-BF16 B tile: 16 rows (k pairs) x 16 columns
// x 2 bf16 (even k in the low half of a column's 32 bits).
constexpr int kTileBytes = 1024;

// bf16 of a and b interleaved per 32-bit lane: lane c = bf16(a[c]) | bf16(b[c]) << 16.
inline __m512i pair_bf16(__m512 a, __m512 b) {
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                              6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh(b, a));
}

// x with the bits of v placed at [lo, lo + width) of each 32-bit lane from bit `at`.
template <int AT, int LO>
inline __m512i move_bits(__m512i v) {
  if constexpr (AT <= LO)
    return _mm512_slli_epi32(v, LO - AT);
  else
    return _mm512_srli_epi32(v, AT - LO);
}

// 1 + q / 2^W as float32 bits (q the W-bit field at bit AT of each lane): the field
// moved to the top of the mantissa and the exponent of 1.0 set in one ternary-logic op
// ((a & mask) | one); d * q + m is then one FMA: (2^W d) * that + (m - 2^W d).
template <int AT, int W>
inline __m512 one_plus(__m512i raw) {
  constexpr int lo = 23 - W;
  const __m512i mask = _mm512_set1_epi32(((1 << W) - 1) << lo);
  const __m512i one = _mm512_set1_epi32(0x3F800000);
  return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(move_bits<AT, lo>(raw), mask, one, 0xEA));
}

// Block b of one column group (16 columns x 32 k) -> one B tile of bf16 at t.
template <int64_t TYPE>
inline void dequant_block(const uint8_t* e, uint8_t* t) {
  constexpr int qb = TYPE == Q8_0 ? 512 : 256;
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(e + qb)));
  if constexpr (TYPE == Q8_0) {
    // Line p: k = 4p + j at byte j of each column's 32 bits, value + 128:
    // d * (byte - 128) = (256 d) * (1 + byte / 256) - 384 d.
    const __m512 s = _mm512_mul_ps(d, _mm512_set1_ps(256.f)), c = _mm512_mul_ps(d, _mm512_set1_ps(-384.f));
    for (int p = 0; p < 8; ++p) {
      const __m512i raw = _mm512_loadu_si512(e + p * 64);
      const __m512 f0 = _mm512_fmadd_ps(s, one_plus<0, 8>(raw), c), f1 = _mm512_fmadd_ps(s, one_plus<8, 8>(raw), c);
      const __m512 f2 = _mm512_fmadd_ps(s, one_plus<16, 8>(raw), c), f3 = _mm512_fmadd_ps(s, one_plus<24, 8>(raw), c);
      _mm512_store_si512(t + (2 * p) * 64, pair_bf16(f0, f1));
      _mm512_store_si512(t + (2 * p + 1) * 64, pair_bf16(f2, f3));
    }
  } else {
    // Line p: low nibbles k = 8p + j, high nibbles k = 8p + 4 + j (byte j of a column):
    // d * q + m = (16 d) * (1 + q / 16) + (m - 16 d); Q4_0's m is -8 d.
    const __m512 m = TYPE == Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(e + qb + 32)))
                                  : _mm512_mul_ps(d, _mm512_set1_ps(-8.f));
    const __m512 s = _mm512_mul_ps(d, _mm512_set1_ps(16.f)), c = _mm512_sub_ps(m, s);
    for (int p = 0; p < 4; ++p) {
      const __m512i raw = _mm512_loadu_si512(e + p * 64);
      uint8_t* row = t + 4 * p * 64;
      _mm512_store_si512(row, pair_bf16(_mm512_fmadd_ps(s, one_plus<0, 4>(raw), c),
                                        _mm512_fmadd_ps(s, one_plus<8, 4>(raw), c)));
      _mm512_store_si512(row + 64, pair_bf16(_mm512_fmadd_ps(s, one_plus<16, 4>(raw), c),
                                             _mm512_fmadd_ps(s, one_plus<24, 4>(raw), c)));
      _mm512_store_si512(row + 128, pair_bf16(_mm512_fmadd_ps(s, one_plus<4, 4>(raw), c),
                                              _mm512_fmadd_ps(s, one_plus<12, 4>(raw), c)));
      _mm512_store_si512(row + 192, pair_bf16(_mm512_fmadd_ps(s, one_plus<20, 4>(raw), c),
                                              _mm512_fmadd_ps(s, one_plus<28, 4>(raw), c)));
    }
  }
}

// tmm0-3: C 16 x 16 float32 (2 row tiles x 2 column groups); tmm4-5: A 16 rows x 32
// bf16; tmm6-7: B 16 k pairs x 16 columns x 2.
const TileConfig& tile_config() {
  static const TileConfig cfg = [] {
    TileConfig c;
    for (int i = 0; i < 8; ++i) c.colsb[i] = 64, c.rows[i] = 16;
    return c;
  }();
  return cfg;
}

struct Out {
  void* y;
  bool bf16;
  const float* bias;
  int64_t ldy, m, half;  // half: gate/up column groups apart (0: not gated)
};

inline __m512 widen(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

// Rows [m0, m0 + 16 MT) of the column groups cg[0..NG): C tiles stored, bias added and
// rounded to y's dtype (gated: silu(gate) * up of the two groups, as the registry's
// silu_and_mul rounds it after a gguf_linear of that dtype).
// ``side(k)`` runs in the k loop next to the tile products of block k: the next column
// pair's dequantization of block k there (vector work the out-of-order core overlaps
// with the tile unit's), a no-op otherwise.
template <int MT, int NG, bool GATED, class Side>
void tile(const uint16_t* x, int64_t K, const uint8_t* const* b, int64_t m0, const int64_t* cg, const Out& o,
          const Side& side) {
  const int64_t nb = K / QK;
  _tile_zero(0);
  if constexpr (NG > 1) _tile_zero(1);
  if constexpr (MT > 1) _tile_zero(2);
  if constexpr (MT > 1 && NG > 1) _tile_zero(3);
  const uint16_t* x0 = x + m0 * K;
  for (int64_t k = 0; k < nb; ++k) {
    _tile_loadd(4, x0 + k * QK, K * 2);
    if constexpr (MT > 1) _tile_loadd(5, x0 + 16 * K + k * QK, K * 2);
    _tile_loadd(6, b[0] + k * kTileBytes, 64);
    if constexpr (NG > 1) _tile_loadd(7, b[1] + k * kTileBytes, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NG > 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (MT > 1) _tile_dpbf16ps(2, 5, 6);
    if constexpr (MT > 1 && NG > 1) _tile_dpbf16ps(3, 5, 7);
    side(k);
  }
  alignas(64) float c[MT][NG][16][16];
  _tile_stored(0, c[0][0], 64);
  if constexpr (NG > 1) _tile_stored(1, c[0][NG - 1], 64);
  if constexpr (MT > 1) _tile_stored(2, c[MT - 1][0], 64);
  if constexpr (MT > 1 && NG > 1) _tile_stored(3, c[MT - 1][NG - 1], 64);
  for (int i = 0; i < MT; ++i)
    for (int r = 0; r < 16; ++r) {
      const int64_t row = m0 + 16 * i + r;
      if (row >= o.m) return;
      if constexpr (GATED) {
        using pagedserve_cpu::Avx512Bf16;
        using pagedserve_cpu::BF16;
        using pagedserve_cpu::Elementwise;
        const int64_t ng = cg[0] * kCols, nu = cg[1] * kCols;
        __m512 g = _mm512_load_ps(c[i][0][r]), u = _mm512_load_ps(c[i][NG - 1][r]);
        if (o.bias) {
          g = _mm512_add_ps(g, _mm512_loadu_ps(o.bias + ng));
          u = _mm512_add_ps(u, _mm512_loadu_ps(o.bias + nu));
        }
        const int64_t at = row * o.ldy + ng;
        if (o.bf16)
          Avx512Bf16::store(static_cast<BF16*>(o.y) + at,
                            Elementwise<Avx512Bf16, BF16>::silu_mul(widen(to_bf16(g)), widen(to_bf16(u))));
        else
          Avx512Bf16::store(static_cast<float*>(o.y) + at, Elementwise<Avx512Bf16, float>::silu_mul(g, u));
      } else {
        for (int j = 0; j < NG; ++j) {
          const int64_t n0 = cg[j] * kCols;
          __m512 v = _mm512_load_ps(c[i][j][r]);
          if (o.bias) v = _mm512_add_ps(v, _mm512_loadu_ps(o.bias + n0));
          const int64_t at = row * o.ldy + n0;
          if (o.bf16)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(o.y) + at), to_bf16(v));
          else
            _mm512_storeu_ps(static_cast<float*>(o.y) + at, v);
        }
      }
    }
}

// Column groups in pairs (gated: gate group g with up group g + half), per thread: the
// pair dequantized once into one of two buffers, then every row tile; the next pair's
// blocks are dequantized into the other buffer inside this pair's k loops, spread
// evenly over its row tiles.
template <int64_t TYPE, bool GATED>
void run(const uint16_t* x, int64_t Mp, int64_t K, const uint8_t* w, int64_t groups, const Out& o) {
  const int64_t nb = K / QK, group_stride = nb * group_block_bytes(TYPE), gbb = group_block_bytes(TYPE);
  const int64_t pairs = GATED ? groups / 2 : (groups + 1) / 2;
  const auto groups_of = [&](int64_t p, int64_t* cg) {
    cg[0] = GATED ? p : 2 * p;
    cg[1] = GATED ? p + o.half : 2 * p + 1;
    return GATED || cg[1] < groups;
  };
  at::parallel_for(0, pairs, 1, [&](int64_t pb, int64_t pe) {
    TileScope scope(tile_config());
    std::vector<uint8_t> buf(4 * nb * kTileBytes + 64);
    uint8_t* base = buf.data() + (64 - reinterpret_cast<uintptr_t>(buf.data()) % 64) % 64;
    uint8_t* bufs[2] = {base, base + 2 * nb * kTileBytes};
    const auto dequant = [&](int64_t p, uint8_t* dst, int64_t k) {
      int64_t cg[2];
      const bool two = groups_of(p, cg);
      dequant_block<TYPE>(w + cg[0] * group_stride + k * gbb, dst + k * kTileBytes);
      if (two) dequant_block<TYPE>(w + cg[1] * group_stride + k * gbb, dst + (nb + k) * kTileBytes);
    };
    for (int64_t k = 0; k < nb; ++k) dequant(pb, bufs[0], k);
    // The next pair's nb blocks spread evenly over this pair's tiles x nb k steps.
    const int64_t tiles = (Mp + 31) / 32;
    for (int64_t p = pb; p < pe; ++p) {
      int64_t cg[2];
      const bool two = groups_of(p, cg);
      uint8_t* cur = bufs[(p - pb) & 1];
      uint8_t* nxt = bufs[(p - pb + 1) & 1];
      const uint8_t* b[2] = {cur, cur + nb * kTileBytes};
      const bool ahead = p + 1 < pe;
      int64_t done = ahead ? 0 : nb, tile_index = 0;
      const auto next = [&](int64_t k) {
        const int64_t target = (tile_index * nb + k + 1) / tiles;
        for (; done < target; ++done) dequant(p + 1, nxt, done);
      };
      const auto step = [&](auto mt, int64_t m0) {
        constexpr int MT = decltype(mt)::value;
        if (two)
          tile<MT, 2, GATED>(x, K, b, m0, cg, o, next);
        else
          tile<MT, 1, false>(x, K, b, m0, cg, o, next);
        ++tile_index;
      };
      int64_t m0 = 0;
      for (; m0 + 32 <= Mp; m0 += 32) step(std::integral_constant<int, 2>{}, m0);
      if (m0 < Mp) step(std::integral_constant<int, 1>{}, m0);
    }
  });
}

template <bool GATED>
void dispatch(int64_t type, const uint16_t* x, int64_t Mp, int64_t K, const uint8_t* w, int64_t groups, const Out& o) {
  switch (type) {
    case Q4_0: run<Q4_0, GATED>(x, Mp, K, w, groups, o); break;
    case Q4_1: run<Q4_1, GATED>(x, Mp, K, w, groups, o); break;
    case Q8_0: run<Q8_0, GATED>(x, Mp, K, w, groups, o); break;
    default: TORCH_CHECK(false, "gguf_amx_bf16_linear: unsupported ggml type id ", type);
  }
}

}  // namespace bf16tiles

}  // namespace

bool available() { return request_amx_permission(); }

// y [M, N] in x's dtype = gguf_linear(x, packed weight) (+ bias), the VNNI tiled
// kernel's result bit for bit (see the top of this file).
torch::Tensor gguf_amx_linear_out(torch::Tensor x, torch::Tensor weight, int64_t type,
                                  std::optional<torch::Tensor> bias) {
  TORCH_CHECK(request_amx_permission(), "pagedserve: the kernel refused AMX tile state (arch_prctl)");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 3 && weight.scalar_type() == torch::kUInt8,
              "gguf_amx_linear: x [M, K] and packed uint8 weight [N/16, K/32, 16 * block_bytes] expected");
  x = x.contiguous();
  weight = weight.contiguous();
  const int64_t M = x.size(0), K = x.size(1), groups = weight.size(0), N = groups * kCols;
  TORCH_CHECK(K % QK == 0 && weight.size(1) == K / QK && weight.size(2) == group_block_bytes(type),
              "gguf_amx_linear: weight ", weight.sizes(), " does not match K=", K, " for type ", type);
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(torch::kFloat).contiguous();
    TORCH_CHECK(b.dim() == 1 && b.size(0) == N, "gguf_amx_linear: bias of shape ", bias->sizes(), " for N=", N);
  }
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(bf16 || x.scalar_type() == torch::kFloat, "gguf_amx_linear: x must be float32 or bfloat16");
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const int64_t Mp = (M + kRows - 1) / kRows * kRows, nb = K / QK;
  QuantizedX qx{std::vector<int8_t>(Mp * K, 0), std::vector<float>(Mp * nb, 0.f), std::vector<float>(Mp * nb, 0.f),
                std::vector<int32_t>(Mp * nb, 0), K, nb};
  if (bf16)
    quantize_rows(x.data_ptr<at::BFloat16>(), M, K, type == Q4_1, qx);
  else
    quantize_rows(x.data_ptr<float>(), M, K, type == Q4_1, qx);
  const Output o{y.data_ptr(), bf16, b.defined() ? b.data_ptr<float>() : nullptr, N, M};
  const uint8_t* w = weight.data_ptr<uint8_t>();
  switch (type) {
    case Q4_0: run<Q4_0>(qx, w, Mp, groups, o); break;
    case Q4_1: run<Q4_1>(qx, w, Mp, groups, o); break;
    case Q8_0: run<Q8_0>(qx, w, Mp, groups, o); break;
    default: TORCH_CHECK(false, "gguf_amx_linear: unsupported ggml type id ", type);
  }
  return y;
}

// y [M, N] (gated: [M, N / 2] = silu(y[:, :N/2]) * y[:, N/2:]) in x's dtype on AMX-BF16
// tiles over the packed weight dequantized per column pair (see bf16tiles above).
torch::Tensor gguf_amx_bf16_out(torch::Tensor x, torch::Tensor weight, int64_t type, std::optional<torch::Tensor> bias,
                                bool gated) {
  TORCH_CHECK(request_amx_permission(), "pagedserve: the kernel refused AMX tile state (arch_prctl)");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 3 && weight.scalar_type() == torch::kUInt8,
              "gguf_amx_bf16_linear: x [M, K] and packed uint8 weight [N/16, K/32, 16 * block_bytes] expected");
  weight = weight.contiguous();
  const int64_t M = x.size(0), K = x.size(1), groups = weight.size(0), N = groups * kCols;
  TORCH_CHECK(K % QK == 0 && weight.size(1) == K / QK && weight.size(2) == group_block_bytes(type),
              "gguf_amx_bf16_linear: weight ", weight.sizes(), " does not match K=", K, " for type ", type);
  TORCH_CHECK(!gated || groups % 2 == 0, "gguf_amx_bf16_linear: ", groups,
              " column groups do not split into gate and up");
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(torch::kFloat).contiguous();
    TORCH_CHECK(b.dim() == 1 && b.size(0) == N, "gguf_amx_bf16_linear: bias of shape ", bias->sizes(), " for N=", N);
  }
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(bf16 || x.scalar_type() == torch::kFloat, "gguf_amx_bf16_linear: x must be float32 or bfloat16");
  auto y = torch::empty({M, gated ? N / 2 : N}, x.options());
  if (M == 0) return y;
  const int64_t Mp = (M + 15) / 16 * 16;
  // x as bf16 rows, zero padded to whole tiles (a copy only where needed).
  torch::Tensor xb = x.to(torch::kBFloat16).contiguous();
  if (Mp != M) xb = torch::constant_pad_nd(xb, {0, 0, 0, Mp - M});
  const bf16tiles::Out o{y.data_ptr(), bf16, b.defined() ? b.data_ptr<float>() : nullptr, y.size(1), M,
                         gated ? groups / 2 : 0};
  const auto* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>());
  if (gated)
    bf16tiles::dispatch<true>(type, xp, Mp, K, weight.data_ptr<uint8_t>(), groups, o);
  else
    bf16tiles::dispatch<false>(type, xp, Mp, K, weight.data_ptr<uint8_t>(), groups, o);
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "whether the kernel was granted the AMX tile state");
  m.def("gguf_linear_out", &gguf_amx_linear_out, py::call_guard<py::gil_scoped_release>(),
        "gguf_linear on weights packed by pack_weight, on AMX int8 tiles");
  m.def(
      "gguf_bf16_linear_out",
      [](torch::Tensor x, torch::Tensor w, int64_t type, std::optional<torch::Tensor> bias) {
        return gguf_amx_bf16_out(x, w, type, bias, false);
      },
      py::call_guard<py::gil_scoped_release>(),
      "gguf_linear on weights packed by pack_weight, dequantized per column pair onto AMX-BF16 tiles");
  m.def(
      "gguf_bf16_linear_silu_out",
      [](torch::Tensor x, torch::Tensor w, int64_t type, std::optional<torch::Tensor> bias) {
        return gguf_amx_bf16_out(x, w, type, bias, true);
      },
      py::call_guard<py::gil_scoped_release>(),
      "silu(gate) * up of a packed [gate; up] weight on AMX-BF16 tiles");
}
