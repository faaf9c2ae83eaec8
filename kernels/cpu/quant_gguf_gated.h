// The gated epilogue of the tiled GGUF kernels (every type's, through quant_gguf_tiles.h's
// store_tile): silu(gate) * up of one row's 16 columns.  Each half is finished as the plain
// tile finishes its output (bias added to the float32 sum, then rounded to bf16 for bf16
// output, float32 kept otherwise), then the main kernels' own SiLU-and-mul (elementwise.h)
// runs on the two, so the fused op is bit for bit silu_and_mul(gguf_linear_out(...)).
#pragma once

#include "elementwise.h"
#include "quant_gguf_common.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(PAGEDSERVE_HAVE_AVX512)
#define PAGEDSERVE_GGUF_K_GATED 1

namespace pagedserve_gguf {

#if defined(PAGEDSERVE_HAVE_AVX512BF16)
using GatedIsa = pagedserve_cpu::Avx512Bf16;
#else
using GatedIsa = pagedserve_cpu::Avx512;
#endif

// g, u: the float32 sums of a row's 16 gate columns (from column ng) and of their up
// columns (from nu), bias not yet added; the result goes to element `at` of o.y.
inline void store_silu_mul(__m512 g, __m512 u, const Output& o, int64_t ng, int64_t nu, int64_t at) {
  using pagedserve_cpu::BF16;
  using pagedserve_cpu::Elementwise;
  if (o.bias) {
    g = _mm512_add_ps(g, _mm512_loadu_ps(o.bias + ng));
    u = _mm512_add_ps(u, _mm512_loadu_ps(o.bias + nu));
  }
  if (o.bf16) {
    const auto widen = [](__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); };
    GatedIsa::store(static_cast<BF16*>(o.y) + at,
                    Elementwise<GatedIsa, BF16>::silu_mul(widen(to_bf16(g)), widen(to_bf16(u))));
  } else {
    GatedIsa::store(static_cast<float*>(o.y) + at, Elementwise<GatedIsa, float>::silu_mul(g, u));
  }
}

}  // namespace pagedserve_gguf

#endif
