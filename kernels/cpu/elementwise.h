// Row-wise kernels (RMSNorm, residual add + RMSNorm, neox rotary embedding,
// SiLU-and-mul, argmax), templated over the instruction set and the storage type.
//
// Each reproduces the rounding steps of kernels/reference.py: where the reference
// computes an intermediate in the storage dtype (e.g. `(x * r).to(bf16) * weight`),
// the kernel rounds that intermediate to the storage dtype too (Isa::round<T>).
#pragma once

#include <cmath>
#include <limits>

#include "kernels.h"
#include "vec.h"

namespace pagedserve_cpu {

template <class Isa, typename T>
struct Elementwise {
  using V = typename Isa::V;
  static constexpr int W = Isa::W;

  static float sum_squares(const T* x, int64_t n) {
    V ss = Isa::zero();
    int64_t i = 0;
    for (; i + W <= n; i += W) {
      const V v = Isa::load(x + i);
      ss = Isa::fma(v, v, ss);
    }
    float s = Isa::reduce_add(ss);
    for (; i < n; ++i) s += to_float(x[i]) * to_float(x[i]);
    return s;
  }

  // out = (x * rsqrt(mean(x^2) + eps)).to(T) * weight
  static void normalize(const T* x, const T* w, T* out, int64_t n, float eps) {
    const float r = 1.f / std::sqrt(sum_squares(x, n) / float(n) + eps);
    const V vr = Isa::set1(r);
    int64_t i = 0;
    for (; i + W <= n; i += W)
      Isa::store(out + i, Isa::mul(Isa::template round<T>(Isa::mul(Isa::load(x + i), vr)), Isa::load(w + i)));
    for (; i < n; ++i) out[i] = from_float<T>(round_to<T>(to_float(x[i]) * r) * to_float(w[i]));
  }

  static void rms_norm(const RmsNormArgs& a, int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row)
      normalize(static_cast<const T*>(a.x) + row * a.x_stride, static_cast<const T*>(a.weight),
                static_cast<T*>(a.out) + row * a.out_stride, a.hidden, a.eps);
  }

  static void fused_add_rms_norm(const AddRmsNormArgs& a, int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      T* x = static_cast<T*>(a.x) + row * a.x_stride;
      T* res = static_cast<T*>(a.residual) + row * a.res_stride;
      int64_t i = 0;
      for (; i + W <= a.hidden; i += W) Isa::store(res + i, Isa::add(Isa::load(x + i), Isa::load(res + i)));
      for (; i < a.hidden; ++i) res[i] = from_float<T>(to_float(x[i]) + to_float(res[i]));
      normalize(res, static_cast<const T*>(a.weight), x, a.hidden, a.eps);
    }
  }

  // res (float32) <- x + res over n values, x of float or T.
  template <typename S>
  static void add_into_f32(const S* x, float* res, int64_t n) {
    int64_t i = 0;
    for (; i + W <= n; i += W) Isa::store(res + i, Isa::add(Isa::load(res + i), Isa::load(x + i)));
    for (; i < n; ++i) res[i] = res[i] + to_float(x[i]);
  }

  // The float32 residual stream (AddRmsNormF32Args): the reference's
  // (res * rsqrt(mean(res^2) + eps) * weight).to(T), one rounding.  The whole row is added
  // before any of out is written, so out may be x.
  static void fused_add_rms_norm_f32res(const AddRmsNormF32Args& a, int64_t begin, int64_t end) {
    const T* w = static_cast<const T*>(a.weight);
    for (int64_t row = begin; row < end; ++row) {
      float* res = a.residual + row * a.hidden;
      if (a.x_f32)
        add_into_f32(static_cast<const float*>(a.x) + row * a.hidden, res, a.hidden);
      else
        add_into_f32(static_cast<const T*>(a.x) + row * a.hidden, res, a.hidden);
      V ss = Isa::zero();
      int64_t i = 0;
      for (; i + W <= a.hidden; i += W) {
        const V v = Isa::load(res + i);
        ss = Isa::fma(v, v, ss);
      }
      float s = Isa::reduce_add(ss);
      for (; i < a.hidden; ++i) s += res[i] * res[i];
      const float r = 1.f / std::sqrt(s / float(a.hidden) + a.eps);
      const V vr = Isa::set1(r);
      T* out = static_cast<T*>(a.out) + row * a.hidden;
      i = 0;
      for (; i + W <= a.hidden; i += W)
        Isa::store(out + i, Isa::mul(Isa::mul(Isa::load(res + i), vr), Isa::load(w + i)));
      for (; i < a.hidden; ++i) out[i] = from_float<T>(res[i] * r * to_float(w[i]));
    }
  }

  // (x1, x2) <- (x1 cos - x2 sin, x2 cos + x1 sin) over the first rot_dim elements.
  static void rotate(T* x, const float* cos, const float* sin, int half) {
    int i = 0;
    for (; i + W <= half; i += W) {
      const V x1 = Isa::load(x + i), x2 = Isa::load(x + half + i);
      const V c = Isa::load(cos + i), s = Isa::load(sin + i);
      Isa::store(x + i, Isa::sub(Isa::mul(x1, c), Isa::mul(x2, s)));
      Isa::store(x + half + i, Isa::add(Isa::mul(x2, c), Isa::mul(x1, s)));
    }
    for (; i < half; ++i) {
      const float x1 = to_float(x[i]), x2 = to_float(x[half + i]);
      x[i] = from_float<T>(x1 * cos[i] - x2 * sin[i]);
      x[half + i] = from_float<T>(x2 * cos[i] + x1 * sin[i]);
    }
  }

  static void rotary(const RotaryArgs& a, int64_t begin, int64_t end) {
    const int half = a.rot_dim / 2;
    for (int64_t t = begin; t < end; ++t) {
      const float* cos = a.cos_sin + a.positions[t] * a.cs_stride;
      const float* sin = cos + half;
      T* q = static_cast<T*>(a.query) + t * a.q_stride_tok;
      for (int h = 0; h < a.num_q_heads; ++h) rotate(q + h * a.q_stride_head, cos, sin, half);
      T* k = static_cast<T*>(a.key) + t * a.k_stride_tok;
      for (int h = 0; h < a.num_k_heads; ++h) rotate(k + h * a.k_stride_head, cos, sin, half);
    }
  }

  // silu(g).to(T) * up, as torch computes silu and the product separately; g and up
  // hold values of T.  The gated linear kernel (linear.h) applies it to its sums.
  static V silu_mul(V g, V up) {
    const V s = Isa::div(g, Isa::add(Isa::set1(1.f), Isa::exp(Isa::sub(Isa::zero(), g))));
    return Isa::mul(Isa::template round<T>(s), up);
  }

  static void silu_and_mul(const SiluMulArgs& a, int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* gate = static_cast<const T*>(a.x) + row * a.x_stride;
      const T* up = gate + a.d;
      T* out = static_cast<T*>(a.out) + row * a.out_stride;
      int64_t i = 0;
      for (; i + W <= a.d; i += W) Isa::store(out + i, silu_mul(Isa::load(gate + i), Isa::load(up + i)));
      for (; i < a.d; ++i) {
        const float g = to_float(gate[i]);
        out[i] = from_float<T>(round_to<T>(g / (1.f + std::exp(-g))) * to_float(up[i]));
      }
    }
  }
};

// Index of the largest value of a row: the first of equal maxima, and the first NaN if
// the row holds one (torch.argmax's convention).  Greedy sampling runs it over the
// logits of every sequence of a decode step.
template <class Isa, typename T>
struct ArgmaxRow {
  static int64_t row(const T* x, int64_t n) {
    int64_t best = 0;
    float bv = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < n; ++i) {
      const float v = to_float(x[i]);
      if (v != v) return i;
      if (v > bv) {
        bv = v;
        best = i;
      }
    }
    return best;
  }
};

#if defined(PAGEDSERVE_HAVE_AVX512)
// One pass for the maximum (stopping at the first chunk with a NaN), one for the first
// position that holds it; the second pass re-reads the row from L2.
template <typename T>
struct ArgmaxRow<Avx512, T> {
  static int64_t row(const T* x, int64_t n) {
    const int64_t nv = n / 16 * 16;
    __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t i = 0; i < nv; i += 16) {
      const __m512 v = Avx512::load(x + i);
      if (const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)) return i + __builtin_ctz(nan);
      vmax = _mm512_max_ps(vmax, v);
    }
    int64_t tail = -1;  // the tail's first maximum
    float tv = 0.f;
    for (int64_t i = nv; i < n; ++i) {
      const float v = to_float(x[i]);
      if (v != v) return i;
      if (tail < 0 || v > tv) {
        tv = v;
        tail = i;
      }
    }
    if (nv == 0) return tail < 0 ? 0 : tail;
    const float m = _mm512_reduce_max_ps(vmax);
    if (tail >= 0 && tv > m) return tail;
    const __m512 vm = _mm512_set1_ps(m);
    for (int64_t i = 0; i < nv; i += 16)
      if (const __mmask16 eq = _mm512_cmp_ps_mask(Avx512::load(x + i), vm, _CMP_EQ_OQ)) return i + __builtin_ctz(eq);
    return 0;  // not reached: m is one of the values
  }
};
#if defined(PAGEDSERVE_HAVE_AVX512BF16)
template <typename T>
struct ArgmaxRow<Avx512Bf16, T> : ArgmaxRow<Avx512, T> {};
#endif
#endif

template <class Isa, typename T>
void argmax_rows(const ArgmaxArgs& a, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r)
    a.out[r] = ArgmaxRow<Isa, T>::row(static_cast<const T*>(a.x) + r * a.x_stride, a.n);
}

template <class Isa>
EltFns elementwise_fns(DType dtype) {
  auto fns = [](auto tag) -> EltFns {
    using T = decltype(tag);
    using K = Elementwise<Isa, T>;
    return {&K::rms_norm,     &K::fused_add_rms_norm,  &K::rotary,
            &K::silu_and_mul, &argmax_rows<Isa, T>, &K::fused_add_rms_norm_f32res};
  };
  switch (dtype) {
    case DType::kFloat32: return fns(float{});
    case DType::kBFloat16: return fns(BF16{});
    case DType::kFloat16: return fns(F16{});
  }
  return {};
}

}  // namespace pagedserve_cpu
