// Matmul on GGUF (ggml) quantized weights kept in their blocks: Q4_0, Q4_1, Q8_0 here;
// Q5_0, Q5_1, Q4_K, Q5_K and Q6_K in quant_gguf_kquant.cpp, Q3_K in quant_gguf_q3k.cpp,
// IQ4_NL in quant_gguf_iq4nl.cpp, IQ4_XS in quant_gguf_iq4xs.cpp, on the same activations.
//
// y[m, n] = sum_k x[m, k] * W[n, k], with W stored as ggml blocks of 32 values per
// row ([N, K/32 * block_bytes] uint8, exactly the bytes of the .gguf file).  As in
// llama.cpp, the activations are quantized to int8 per 32-value block first (as its q8_1
// / q8_0 blocks: an fp16 scale and the block's integer sum, see quantize_row), so each
// block pair is one integer dot product:
//   Q4_0: d_w * d_x * (sum q*xq - 8 * sum xq)
//   Q4_1: d_w * d_x * sum q*xq + m_w * d_x * sum xq
//   Q8_0: d_w * d_x * sum q*xq
// With AVX-512 VNNI (+VL) a block's dot product is one vpdpbusd on 256-bit lanes; AVX2
// uses vpmaddubsw + vpmaddwd (no saturation: |u8 * s8 pair sums| < 2^15 for these
// ranges); otherwise a scalar loop.  The instruction set is fixed at compile time by
// the arch flags (one build per machine, see kernels/build.py).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "quant_gguf_common.h"

namespace {

using pagedserve_gguf::half_to_float;
using pagedserve_gguf::round_to_half;
#if defined(__AVX512F__) && defined(__AVX512BW__)
using pagedserve_gguf::quantize_row_vec;
#endif

constexpr int QK = 32;

enum GgufType : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, IQ4_NL = 20 };

// Bytes of one 32-value block of the types this file's row kernel (and the packed
// kernel: Q5_0 and Q5_1 too; IQ4_NL's row kernel: quant_gguf_iq4nl.cpp) reads; the
// others' in gguf_ext_type.
inline int block_bytes(int64_t t) {
  switch (t) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case IQ4_NL: return 18;
  }
  TORCH_CHECK(false, "unsupported ggml type id ", t,
              " (supported: Q4_0=2, Q4_1=3, Q8_0=8, IQ4_NL=20; Q5_0=6, Q5_1=7 packed)");
}

// One row of activations quantized per block: xq [K] int8, scale [K/32], sum [K/32].
struct QuantRow {
  const int8_t* q;
  const float* d;
  const float* ds;  // d * (integer sum of the block)
};

// Activations quantized to int8 blocks exactly as llama.cpp quantizes them for the same
// weights (ggml-cpu's quantize_row_q8_1 / quantize_row_q8_0), so that both engines see the
// same integers and scales on the same file: the scale d = max|x| / 127 is stored as an
// fp16 (q8_x blocks hold ggml_half), the values are round-half-even(x * (127 / max|x|)),
// and for Q4_1's minimum term (q8_1's s) d * sum is computed from the unrounded d and
// rounded to fp16 too.  Q4_0 and Q8_0 take no s: ds is then d * sum of the fp16 d, the
// value llama.cpp's integer (q - 8) * x products give.  (The kernels compute
// d_w * d_x * dot + m_w * ds per block, as ggml's vec_dot does.)
template <typename T>
void quantize_row(const T* x, int64_t K, bool half_sum, int8_t* q, float* d, float* ds, int32_t* isum) {
  for (int64_t b = 0; b < K / QK; ++b) {
    float amax = 0.f;
    float v[QK];
    for (int i = 0; i < QK; ++i) {
      v[i] = static_cast<float>(x[b * QK + i]);
      amax = std::fmax(amax, std::fabs(v[i]));
    }
    // 127, not 128: Q8_0 weights flip signs into the activations (vpsignb).
    const float scale = amax / 127.f;
    const float inv = amax != 0.f ? 127.f / amax : 0.f;
    int sum = 0;
    for (int i = 0; i < QK; ++i) {
      const int qi = static_cast<int>(std::nearbyint(v[i] * inv));
      q[b * QK + i] = static_cast<int8_t>(qi);
      sum += qi;
    }
    d[b] = round_to_half(scale);
    ds[b] = half_sum ? round_to_half(scale * static_cast<float>(sum)) : d[b] * static_cast<float>(sum);
    isum[b] = sum;
  }
}

#if defined(__AVX2__)
using pagedserve_gguf::dot_u8s8;
using pagedserve_gguf::hsum;

// 16 bytes of packed nibbles -> 32 unsigned values, low nibbles first (ggml's order).
inline __m256i unpack_nibbles(const uint8_t* qs) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(b, mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
  return _mm256_set_m128i(hi, lo);
}
#endif

// Dot products of one weight row with up to MB activation rows.
template <int MB>
void row_dot(int64_t type, const uint8_t* w, int64_t nb, const QuantRow* xr, float* out) {
  const int bb = block_bytes(type);
#if defined(__AVX2__)
  __m256 acc[MB];
  float extra[MB];
  for (int m = 0; m < MB; ++m) { acc[m] = _mm256_setzero_ps(); extra[m] = 0.f; }
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * bb;
    const float dw = half_to_float(blk);
    if (type == Q8_0) {
      const __m256i wq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
      const __m256i wabs = _mm256_sign_epi8(wq, wq);
      for (int m = 0; m < MB; ++m) {
        const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr[m].q + b * QK));
        const __m256i dot = dot_u8s8(wabs, _mm256_sign_epi8(xq, wq));
        acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(dw * xr[m].d[b]), _mm256_cvtepi32_ps(dot), acc[m]);
      }
    } else {
      const bool has_min = type == Q4_1;
      const __m256i wq = unpack_nibbles(blk + (has_min ? 4 : 2));
      const float mw = has_min ? half_to_float(blk + 2) : -8.f * dw;
      for (int m = 0; m < MB; ++m) {
        const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr[m].q + b * QK));
        const __m256i dot = dot_u8s8(wq, xq);
        acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(dw * xr[m].d[b]), _mm256_cvtepi32_ps(dot), acc[m]);
        extra[m] += mw * xr[m].ds[b];
      }
    }
  }
  for (int m = 0; m < MB; ++m) out[m] = hsum(acc[m]) + extra[m];
#else
  for (int m = 0; m < MB; ++m) out[m] = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * bb;
    const float dw = half_to_float(blk);
    for (int m = 0; m < MB; ++m) {
      const int8_t* xq = xr[m].q + b * QK;
      int dot = 0;
      if (type == Q8_0) {
        const int8_t* wq = reinterpret_cast<const int8_t*>(blk + 2);
        for (int i = 0; i < QK; ++i) dot += wq[i] * xq[i];
        out[m] += dw * xr[m].d[b] * dot;
      } else {
        const uint8_t* qs = blk + (type == Q4_1 ? 4 : 2);
        for (int i = 0; i < 16; ++i) dot += (qs[i] & 0x0F) * xq[i] + (qs[i] >> 4) * xq[i + 16];
        const float mw = type == Q4_1 ? half_to_float(blk + 2) : -8.f * dw;
        out[m] += dw * xr[m].d[b] * dot + mw * xr[m].ds[b];
      }
    }
  }
#endif
}

}  // namespace

// The other block types (quant_gguf_kquant.cpp).
bool gguf_ext_type(int64_t type, int* values, int* bytes);
void gguf_ext_gemm(const int8_t* xq, const float* xd, const float* xds, int64_t M, int64_t K, const uint8_t* w,
                   int64_t N, int64_t type, float* y);

// IQ4_NL's row kernel (quant_gguf_iq4nl.cpp; its tiled kernel is quant_gguf_packed.cpp's).
void gguf_iq4nl_row_gemm(const int8_t* xq, const float* xd, int64_t M, int64_t K, const uint8_t* w, int64_t N,
                         float* y);

// The tiled kernel on repacked Q4_K / Q6_K weights (quant_gguf_kpacked.cpp).
bool gguf_kpacked_type(int64_t type);
torch::Tensor gguf_kpack_weight(torch::Tensor weight, int64_t type);
torch::Tensor gguf_unpack_rows(torch::Tensor packed, int64_t type, torch::Tensor ids);
bool gguf_kpacked_gated(int64_t type);
pagedserve_gguf::PartRunner gguf_kpacked_call(pagedserve_gguf::Call c, const pagedserve_gguf::TiledArgs& t);

// The tiled kernel on repacked weights (quant_gguf_packed.cpp).
bool gguf_packed_available();
torch::Tensor gguf_pack_weight(torch::Tensor weight, int64_t type);
torch::Tensor gguf_packed_unpack_rows(torch::Tensor packed, int64_t type, torch::Tensor ids);
bool gguf_packed_gated_available();
pagedserve_gguf::PartRunner gguf_packed_call(pagedserve_gguf::Call c, const pagedserve_gguf::TiledArgs& t);
// Q3_K, row kernel and tiled kernel (quant_gguf_q3k.cpp).
bool gguf_q3k_block(int64_t type, int* values, int* bytes);
bool gguf_q3k_tiled();
void gguf_q3k_row_gemm(const int8_t* xq, const float* xd, int64_t M, int64_t K, const uint8_t* w, int64_t N,
                       float* y);
torch::Tensor gguf_q3k_pack(torch::Tensor weight);
torch::Tensor gguf_q3k_unpack_rows(torch::Tensor packed, torch::Tensor ids);
bool gguf_q3k_gated();
pagedserve_gguf::PartRunner gguf_q3k_call(pagedserve_gguf::Call c, const pagedserve_gguf::TiledArgs& t);
// IQ4_XS, row kernel and tiled kernel (quant_gguf_iq4xs.cpp).
bool gguf_iq4xs_block(int64_t type, int* values, int* bytes);
bool gguf_iq4xs_tiled();
void gguf_iq4xs_row_gemm(const int8_t* xq, const float* xd, int64_t M, int64_t K, const uint8_t* w, int64_t N,
                         float* y);
torch::Tensor gguf_iq4xs_pack(torch::Tensor weight);
torch::Tensor gguf_iq4xs_unpack_rows(torch::Tensor packed, torch::Tensor ids);
bool gguf_iq4xs_gated();
pagedserve_gguf::PartRunner gguf_iq4xs_call(pagedserve_gguf::Call c, const pagedserve_gguf::TiledArgs& t);

namespace {

constexpr int64_t Q3_K = 11;
constexpr int64_t IQ4_XS = 23;

// The block of a type of another file (quant_gguf_kquant.cpp, quant_gguf_q3k.cpp,
// quant_gguf_iq4xs.cpp).
bool other_block(int64_t type, int* values, int* bytes) {
  return gguf_ext_type(type, values, bytes) || gguf_q3k_block(type, values, bytes) ||
         gguf_iq4xs_block(type, values, bytes);
}

// Whether `type` has a tiled kernel on a 256-value layout in this build.
bool k_tiled(int64_t type) {
  return gguf_kpacked_type(type) || (type == Q3_K && gguf_q3k_tiled()) || (type == IQ4_XS && gguf_iq4xs_tiled());
}

// Whether that tiled kernel has its gated variant (gguf_linear_silu_out) in this build.
bool k_gated(int64_t type) {
  return (gguf_kpacked_type(type) && gguf_kpacked_gated(type)) ||
         (type == Q3_K && gguf_q3k_tiled() && gguf_q3k_gated()) ||
         (type == IQ4_XS && gguf_iq4xs_tiled() && gguf_iq4xs_gated());
}

// Whether `type` is one of the 32-value types of the tiled kernel (quant_gguf_packed.cpp).
bool packed32(int64_t type) {
  return type == Q4_0 || type == Q4_1 || type == Q5_0 || type == Q5_1 || type == Q8_0 || type == IQ4_NL;
}

// Activations quantized per 32-value block, once per call (not per output tile).
struct QuantizedX {
  std::unique_ptr<int8_t[]> q;
  std::unique_ptr<float[]> d, ds;
  std::unique_ptr<int32_t[]> sum;
};

// Call c of the tiled kernel of `type` on the packed weight [groups, ...] w (the file of
// its type's kernel): y [M, 16 * groups] (kLinear), [M, 8 * groups] (kGated), or the part's
// runner (kPart, y and bias unused).
pagedserve_gguf::PartRunner tiled_call(pagedserve_gguf::Call c, const QuantizedX& qx, int64_t M, int64_t K,
                                       const uint8_t* w, int64_t groups, int64_t type, void* y, bool y_bf16,
                                       const float* bias) {
  const pagedserve_gguf::TiledArgs t{qx.q.get(), qx.d.get(), qx.ds.get(), qx.sum.get(), M, K, w, groups, type,
                                     y, y_bf16, bias};
  if (type == Q3_K) return gguf_q3k_call(c, t);
  if (type == IQ4_XS) return gguf_iq4xs_call(c, t);
  if (gguf_kpacked_type(type)) return gguf_kpacked_call(c, t);
  return gguf_packed_call(c, t);
}

template <typename T>
void quantize_rows(const T* xp, int64_t M, int64_t K, bool half_sum, QuantizedX& qx) {
  const int64_t nb = K / QK;
  // Small calls stay on the calling thread: a parallel region costs more than the work.
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / K), [&](int64_t a, int64_t b) {
    for (int64_t m = a; m < b; ++m) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
      quantize_row_vec(xp + m * K, K, half_sum, &qx.q[m * K], &qx.d[m * nb], &qx.ds[m * nb], &qx.sum[m * nb]);
#else
      quantize_row(xp + m * K, K, half_sum, &qx.q[m * K], &qx.d[m * nb], &qx.ds[m * nb], &qx.sum[m * nb]);
#endif
    }
  });
}

// half_sum: Q4_1's minimum term takes q8_1's fp16 s (see quantize_row).
QuantizedX quantize_activations(const torch::Tensor& x, int64_t type) {
  const bool half_sum = type == Q4_1;
  const int64_t M = x.size(0), K = x.size(1), nb = K / QK;
  QuantizedX qx{std::unique_ptr<int8_t[]>(new int8_t[M * K]), std::unique_ptr<float[]>(new float[M * nb]),
                std::unique_ptr<float[]>(new float[M * nb]), std::unique_ptr<int32_t[]>(new int32_t[M * nb])};
  if (x.scalar_type() == torch::kFloat) {
    quantize_rows(x.data_ptr<float>(), M, K, half_sum, qx);
  } else if (x.scalar_type() == torch::kBFloat16) {
    quantize_rows(x.data_ptr<at::BFloat16>(), M, K, half_sum, qx);
  } else {
    TORCH_CHECK(false, "gguf_linear: x must be float32 or bfloat16");
  }
  return qx;
}

// Checks shapes; returns N.
int64_t check_gguf_args(const torch::Tensor& x, const torch::Tensor& weight, int64_t type) {
  const bool packed = weight.dim() == 3;
  TORCH_CHECK(x.dim() == 2 && (weight.dim() == 2 || packed),
              "gguf_linear: x [M, K] and weight [N, row_bytes] or packed [N/16, K/32, 16 * block_bytes] expected");
  TORCH_CHECK(weight.scalar_type() == torch::kUInt8, "gguf_linear: weight must be uint8 blocks");
  const int64_t K = x.size(1), N = packed ? weight.size(0) * 16 : weight.size(0);
  TORCH_CHECK(K % QK == 0, "gguf_linear: K=", K, " is not a multiple of 32");
  const int64_t nb = K / QK;
  int ext_values = 0, ext_bytes = 0;
  if (other_block(type, &ext_values, &ext_bytes) && packed && k_tiled(type)) {
    TORCH_CHECK(K % ext_values == 0, "gguf_linear: K=", K, " is not a multiple of ", ext_values,
                " (the block of ggml type ", type, ")");
    TORCH_CHECK(weight.size(1) == K / ext_values && weight.size(2) == 16 * ext_bytes, "gguf_linear: packed weight ",
                weight.sizes(), " does not hold K=", K, " values of this type");
    return N;
  }
  if (other_block(type, &ext_values, &ext_bytes) && !packed) {
    TORCH_CHECK(K % ext_values == 0, "gguf_linear: K=", K, " is not a multiple of ", ext_values,
                " (the block of ggml type ", type, ")");
    TORCH_CHECK(weight.size(1) == K / ext_values * ext_bytes, "gguf_linear: weight rows hold ", weight.size(1),
                " bytes, expected ", K / ext_values * ext_bytes, " for K=", K);
    return N;
  }
  const int bb = block_bytes(type);
  if (packed) {
    TORCH_CHECK(gguf_packed_available(), "gguf_linear: this build has no tiled kernel for packed weights");
    TORCH_CHECK(weight.size(1) == nb && weight.size(2) == 16 * bb, "gguf_linear: packed weight ", weight.sizes(),
                " does not hold K=", K, " values of this type");
  } else {
    TORCH_CHECK(weight.size(1) == nb * bb, "gguf_linear: weight rows hold ", weight.size(1), " bytes, expected ",
                nb * bb, " for K=", K);
  }
  return N;
}

// The row kernel: y float32 [M, N] from the file's blocks.
void row_gemm(const QuantizedX& qx, int64_t M, int64_t K, const torch::Tensor& weight, int64_t type, float* yp) {
  const int64_t nb = K / QK, N = weight.size(0), row_bytes = weight.size(1);
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  if (type == IQ4_NL) {
    gguf_iq4nl_row_gemm(qx.q.get(), qx.d.get(), M, K, wp, N, yp);
    return;
  }
  int ext_values = 0, ext_bytes = 0;
  if (type == Q3_K) {
    gguf_q3k_row_gemm(qx.q.get(), qx.d.get(), M, K, wp, N, yp);
    return;
  }
  if (type == IQ4_XS) {
    gguf_iq4xs_row_gemm(qx.q.get(), qx.d.get(), M, K, wp, N, yp);
    return;
  }
  if (gguf_ext_type(type, &ext_values, &ext_bytes)) {
    gguf_ext_gemm(qx.q.get(), qx.d.get(), qx.ds.get(), M, K, wp, N, type, yp);
    return;
  }
  // Rows of W across threads; each thread streams its rows once per 8 activation rows.
  pagedserve_gguf::row_kernel_gemm<QuantRow>(
      M, N, wp, row_bytes, yp, [&](int64_t m) { return QuantRow{&qx.q[m * K], &qx.d[m * nb], &qx.ds[m * nb]}; },
      [type, nb](auto mb, const uint8_t* wr, const QuantRow* xr, float* out) {
        row_dot<decltype(mb)::value>(type, wr, nb, xr, out);
      });
}

}  // namespace

// x: [M, K] float32/bfloat16 (contiguous); weight: uint8 [N, K/32 * block_bytes] (the
// file's blocks) or [N/16, K/32, 16 * block_bytes] (repacked by gguf_pack_weight);
// returns float32 [M, N].
torch::Tensor gguf_linear(torch::Tensor x, torch::Tensor weight, int64_t type) {
  x = x.contiguous();
  weight = weight.contiguous();
  const int64_t N = check_gguf_args(x, weight, type), M = x.size(0), K = x.size(1);
  const QuantizedX qx = quantize_activations(x, type);
  auto y = torch::empty({M, N}, x.options().dtype(torch::kFloat));
  if (weight.dim() == 3)
    tiled_call(pagedserve_gguf::Call::kLinear, qx, M, K, weight.data_ptr<uint8_t>(), weight.size(0), type,
               y.data_ptr<float>(), false, nullptr);
  else
    row_gemm(qx, M, K, weight, type, y.data_ptr<float>());
  return y;
}

// As gguf_linear, plus bias (float [N], or None) and the result in x's dtype: the float32
// sum + bias rounded once, as gguf_linear(x, w) + bias then .to(x.dtype) would give; the
// tiled kernel writes it directly (no float32 [M, N] pass through memory).  float32_out:
// the float32 sums (+ bias) unrounded whatever x's dtype (a projection writing into a
// float32 residual stream); the activations quantize the same either way.
torch::Tensor gguf_linear_out(torch::Tensor x, torch::Tensor weight, int64_t type, std::optional<torch::Tensor> bias,
                              bool float32_out) {
  x = x.contiguous();
  weight = weight.contiguous();
  const int64_t N = check_gguf_args(x, weight, type), M = x.size(0), K = x.size(1);
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(torch::kFloat).contiguous();
    TORCH_CHECK(b.dim() == 1 && b.size(0) == N, "gguf_linear: bias of shape ", bias->sizes(), " for N=", N);
  }
  const QuantizedX qx = quantize_activations(x, type);
  const bool bf16 = x.scalar_type() == torch::kBFloat16 && !float32_out;
  const auto out_options = x.options().dtype(bf16 ? torch::kBFloat16 : torch::kFloat);
  if (weight.dim() == 3) {
    auto y = torch::empty({M, N}, out_options);
    tiled_call(pagedserve_gguf::Call::kLinear, qx, M, K, weight.data_ptr<uint8_t>(), weight.size(0), type,
               y.data_ptr(), bf16, b.defined() ? b.data_ptr<float>() : nullptr);
    return y;
  }
  auto y = torch::empty({M, N}, x.options().dtype(torch::kFloat));
  row_gemm(qx, M, K, weight, type, y.data_ptr<float>());
  if (b.defined()) y += b;
  return bf16 ? y.to(torch::kBFloat16) : y;
}

// silu_and_mul(gguf_linear_out(x, weight, type, bias)) for a packed [gate; up] weight
// (2d columns, d a multiple of 16): [M, d] in x's dtype, bit for bit the two in sequence
// (each half rounded to x's dtype, then the main kernels' SiLU-and-mul), without the
// [M, 2d] intermediate.
torch::Tensor gguf_linear_silu_out(torch::Tensor x, torch::Tensor weight, int64_t type,
                                   std::optional<torch::Tensor> bias) {
  x = x.contiguous();
  weight = weight.contiguous();
  TORCH_CHECK(weight.dim() == 3, "gguf_linear_silu_and_mul: the weight must be packed by pack_weight");
  const bool k = k_tiled(type);
  TORCH_CHECK(!k || k_gated(type), "gguf_linear_silu_and_mul: no gated kernel for ggml type id ", type);
  TORCH_CHECK(k || gguf_packed_gated_available(), "gguf_linear_silu_and_mul: this build has no gated packed kernel");
  const int64_t N = check_gguf_args(x, weight, type), M = x.size(0), K = x.size(1);
  TORCH_CHECK(weight.size(0) % 2 == 0, "gguf_linear_silu_and_mul: N=", N, " is not 2 x a multiple of 16");
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(torch::kFloat).contiguous();
    TORCH_CHECK(b.dim() == 1 && b.size(0) == N, "gguf_linear_silu_and_mul: bias of shape ", bias->sizes(),
                " for N=", N);
  }
  const QuantizedX qx = quantize_activations(x, type);
  auto y = torch::empty({M, N / 2}, x.options());
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  tiled_call(pagedserve_gguf::Call::kGated, qx, M, K, weight.data_ptr<uint8_t>(), weight.size(0), type, y.data_ptr(),
             bf16, b.defined() ? b.data_ptr<float>() : nullptr);
  return y;
}

// gguf_linear_out over several weights packed by gguf_pack_weight side by side (a fused
// projection whose parts have different block types: [q; k] Q5_0 beside a Q8_0 v, a
// Q4_K_M's [q; k] Q4_K beside a Q6_K v, or 32-value and K-quant parts together): y [M, sum
// N_i] = the parts' results concatenated (+ bias float32 [sum N_i]), bit for bit, with the
// activations quantized once per format (every type reads the same int8 blocks of 32 with
// their fp16 scales and sums, but Q4_1, whose d * sum is rounded to fp16: parts of both
// kinds take two quantizations; the K-quants' per-16 sums, Q2_K's, Q3_K's and Q6_K's,
// derived from them once per part) and one parallel region over every part's column
// groups, each part writing its column range of y in place with its own tiles.  The
// groups are split across threads by
// the bytes they read where rows are few (a Q8_0 group reads 272 bytes per 256 values, a
// Q4_K one 144), evenly by count otherwise.
torch::Tensor gguf_linear_multi_out(torch::Tensor x, std::vector<torch::Tensor> weights, std::vector<int64_t> types,
                                    std::optional<torch::Tensor> bias, bool float32_out) {
  TORCH_CHECK(!weights.empty() && weights.size() == types.size(), "gguf_linear_multi: one type per weight");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  const size_t parts = weights.size();
  std::vector<int64_t> groups(parts), cost(parts);
  int64_t N = 0;
  for (size_t i = 0; i < parts; ++i) {
    weights[i] = weights[i].contiguous();
    const int64_t t = types[i];
    TORCH_CHECK(weights[i].dim() == 3 && (packed32(t) || k_tiled(t)),
                "gguf_linear_multi: every part must be a Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/IQ4_NL weight, or a K-quant "
                "(Q2_K-Q6_K) or IQ4_XS weight of this build's tiled kernel, packed by pack_weight");
    N += check_gguf_args(x, weights[i], t);
    groups[i] = weights[i].size(0);
    int values = QK, bytes = 0;
    if (!packed32(t)) other_block(t, &values, &bytes);
    cost[i] = packed32(t) ? 8 * block_bytes(t) : bytes * (256 / values);  // bytes per 256 values
  }
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(torch::kFloat).contiguous();
    TORCH_CHECK(b.dim() == 1 && b.size(0) == N, "gguf_linear_multi: bias of shape ", bias->sizes(), " for N=", N);
  }
  // One quantization per activation format the parts read: Q4_1's (fp16 sums), the others'.
  std::optional<QuantizedX> q41, plain;
  for (const int64_t t : types) {
    if (t == Q4_1 && !q41) q41.emplace(quantize_activations(x, Q4_1));
    if (t != Q4_1 && !plain) plain.emplace(quantize_activations(x, t));
  }
  const bool bf16 = x.scalar_type() == torch::kBFloat16 && !float32_out;
  auto y = torch::empty({M, N}, x.options().dtype(bf16 ? torch::kBFloat16 : torch::kFloat));
  std::vector<pagedserve_gguf::PartRunner> run(parts);
  for (size_t i = 0; i < parts; ++i) {
    const uint8_t* w = weights[i].data_ptr<uint8_t>();
    const int64_t t = types[i];
    run[i] = tiled_call(pagedserve_gguf::Call::kPart, t == Q4_1 ? *q41 : *plain, M, K, w, groups[i], t, nullptr,
                        bf16, nullptr);
  }
  const bool by_bytes = M <= 16;
  std::vector<int64_t> start(parts + 1, 0), column(parts, 0);
  int64_t total_groups = 0;
  for (size_t i = 0; i < parts; ++i) {
    if (!by_bytes) cost[i] = 1;
    start[i + 1] = start[i] + groups[i] * cost[i];
    if (i > 0) column[i] = column[i - 1] + groups[i - 1] * 16;
    total_groups += groups[i];
  }
  const int64_t total = start[parts];
  const size_t esize = bf16 ? 2 : 4;
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  char* yp = static_cast<char*>(y.data_ptr());
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), total_groups));
  at::parallel_for(0, threads, 1, [&](int64_t tb, int64_t te) {
    for (int64_t t = tb; t < te; ++t) {
      // This thread's share of the cost, [lo, hi); a group goes to the thread whose share
      // holds its first unit of cost.
      const int64_t lo = total * t / threads, hi = total * (t + 1) / threads;
      for (size_t i = 0; i < parts; ++i) {
        const auto first_at = [&](int64_t c) {
          return std::clamp<int64_t>((c - start[i] + cost[i] - 1) / cost[i], 0, groups[i]);
        };
        const int64_t gb = first_at(lo), ge = first_at(hi);
        if (gb < ge) run[i](gb, ge, yp + column[i] * esize, bp ? bp + column[i] : nullptr, N);
      }
    }
  });
  return y;
}

std::string isa() {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return "avx512vnni";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "scalar";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Tensors in and out only: these run without the GIL (see bindings.cpp).
  m.def("gguf_linear", &gguf_linear, py::call_guard<py::gil_scoped_release>(),
        "x [M,K] @ GGUF blocks [N, row_bytes] (or packed)^T -> float32 [M,N]");
  m.def("gguf_linear_out", &gguf_linear_out, py::call_guard<py::gil_scoped_release>(),
        "gguf_linear + bias, in x's dtype (float32 with float32_out)", py::arg("x"), py::arg("weight"),
        py::arg("type"), py::arg("bias") = py::none(), py::arg("float32_out") = false);
  m.def("gguf_linear_silu_out", &gguf_linear_silu_out, py::call_guard<py::gil_scoped_release>(),
        "silu_and_mul(gguf_linear_out(...)) for a packed [gate; up] weight", py::arg("x"), py::arg("weight"),
        py::arg("type"), py::arg("bias") = py::none());
  m.def("gguf_linear_multi_out", &gguf_linear_multi_out, py::call_guard<py::gil_scoped_release>(),
        "gguf_linear_out over several packed weights side by side, outputs concatenated", py::arg("x"),
        py::arg("weights"), py::arg("types"), py::arg("bias") = py::none(), py::arg("float32_out") = false);
  m.def("has_packed_gated", &gguf_packed_gated_available, "whether the gated tiled kernel is built");
  m.def("isa", &isa, "instruction set compiled in");
  m.def("has_packed", &gguf_packed_available, "whether the tiled kernel on repacked weights is built");
  m.def(
      "pack_weight",
      [](torch::Tensor weight, int64_t type) {
        if (type == Q3_K) return gguf_q3k_pack(weight);
        if (type == IQ4_XS) return gguf_iq4xs_pack(weight);
        return gguf_kpacked_type(type) ? gguf_kpack_weight(weight, type) : gguf_pack_weight(weight, type);
      },
      "GGUF blocks uint8 [N, row_bytes] -> packed [N/16, K/32 (K/256: Q2_K-Q6_K, IQ4_XS), 16*block_bytes]");
  m.def(
      "unpack_rows",
      [](torch::Tensor packed, int64_t type, torch::Tensor ids) {
        // Q5_0 / Q5_1 / Q3_K / IQ4_XS: their packing's own inverse (quant_gguf_packed.cpp,
        // quant_gguf_q3k.cpp, quant_gguf_iq4xs.cpp); the others in quant_gguf_kpacked.cpp
        // (IQ4_NL's entries are Q4_0's, byte for byte).
        if (type == Q3_K) return gguf_q3k_unpack_rows(packed, ids);
        if (type == IQ4_XS) return gguf_iq4xs_unpack_rows(packed, ids);
        if (type == Q5_0 || type == Q5_1) return gguf_packed_unpack_rows(packed, type, ids);
        return gguf_unpack_rows(packed, type == IQ4_NL ? Q4_0 : type, ids);
      },
      py::call_guard<py::gil_scoped_release>(), "rows ids of a packed weight as the file's blocks uint8 [n, row_bytes]");
  m.def("has_kpacked", &k_tiled, "whether ggml type id `type` has a K-quant tiled kernel");
  m.def("has_kpacked_gated", &k_gated, "whether ggml type id `type` has a gated K-quant tiled kernel");
}
