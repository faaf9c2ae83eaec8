// Recurrent-layer kernels on the CPU: the short causal convolution, Gated DeltaNet,
// Mamba 2's and Mamba 1's state-space scans and the gated RMSNorm.
//
// Specification: pagedserve/kernels/recurrent_reference.py.  Every op works on a varlen
// batch (the tokens of all sequences flattened, query_start_loc marking each sequence's
// slice) with one float32 state per sequence, updated in place.  A decode step is the
// same kernel with one token per sequence.
//
// The scans run the recursion token by token (the reference's chunked forms compute the
// same recursion in blocks, which pays on a GPU, not here): a work item owns a slice of
// one sequence's state that the tokens keep in L1, and the items run in parallel
// (at::parallel_for, torch's OpenMP pool):
//
//   gated_delta_rule   (sequence, value head, block of 64 value columns): the columns of
//                      the [dk, dv] state are independent given the token's k, q, g and
//                      beta, so a [dk, 64] slice (32 KiB at dk 128) is one item; per
//                      token one sweep for mem = S^T k, one updating S and reading o.
//   mamba2_ssd         (sequence, head): the [head_dim, d_state] state, per token one
//                      sweep updating each row and dotting it with C.
//   mamba1_scan        (sequence, block of 16 channels): each channel's [d_state] row
//                      with its own decays exp(dt * A[channel]).
//   causal_conv1d      (sequence, block of channels), tokens in order.
//
// Large inputs (x, q, k, v, B, C) are read in their dtype (float32, bf16, fp16) through
// their row strides (last dimension contiguous); per-token scalars (g, beta, dt), the
// parameters (A, D, the conv filter and bias) and the states are float32.  Arithmetic is
// float32; outputs are rounded to the input dtype once, as the reference's .to(dtype).
//
// The vector ISA is the best the build flags allow (vec.h: AVX-512, AVX2, or portable
// generic vectors), chosen at compile time like the MoE kernel; column tails run the
// same code on one lane (Lane1).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "vec.h"

namespace {

using namespace pagedserve_cpu;

#if defined(PAGEDSERVE_HAVE_AVX512)
using Isa = Avx512;
constexpr const char* kIsaName = "avx512";
#elif defined(PAGEDSERVE_HAVE_AVX2)
using Isa = Avx2;
constexpr const char* kIsaName = "avx2";
#else
using Isa = Scalar;
constexpr const char* kIsaName = "portable";
#endif

// One float lane with Isa's interface: the column tails of every kernel.
struct Lane1 {
  static constexpr int W = 1;
  using V = float;
  static V zero() { return 0.f; }
  static V set1(float x) { return x; }
  template <typename T>
  static V load(const T* p) {
    return to_float(*p);
  }
  template <typename T>
  static void store(T* p, V a) {
    *p = from_float<T>(a);
  }
  static V add(V a, V b) { return a + b; }
  static V sub(V a, V b) { return a - b; }
  static V mul(V a, V b) { return a * b; }
  static V div(V a, V b) { return a / b; }
  static V fma(V a, V b, V c) { return a * b + c; }
  static V exp(V a) { return std::exp(a); }
  static float reduce_add(V a) { return a; }
};

template <typename Ops>
inline typename Ops::V silu(typename Ops::V a) {
  return Ops::div(a, Ops::add(Ops::set1(1.f), Ops::exp(Ops::sub(Ops::zero(), a))));
}

inline float silu1(float a) { return a / (1.f + std::exp(-a)); }

template <typename T>
const T* cptr(const at::Tensor& t) {
  return reinterpret_cast<const T*>(t.data_ptr());
}
template <typename T>
T* mptr(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

void check_float(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous(), op, ": ", name, " must be contiguous float32");
}

void check_rows(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.stride(-1) == 1, op, ": the last dimension of ", name, " must be contiguous");
}

// query_start_loc: int32 [S + 1], nondecreasing, within [0, tokens].
std::vector<int64_t> starts_of(const at::Tensor& qsl, int64_t tokens, const char* op) {
  TORCH_CHECK(qsl.scalar_type() == at::kInt && qsl.is_contiguous() && qsl.dim() == 1 && qsl.size(0) >= 1, op,
              ": query_start_loc must be contiguous int32 [num_seqs + 1]");
  const int32_t* p = qsl.data_ptr<int32_t>();
  std::vector<int64_t> s(p, p + qsl.size(0));
  TORCH_CHECK(s.front() >= 0 && s.back() <= tokens, op, ": query_start_loc spans tokens ", s.front(), "..", s.back(),
              " of ", tokens);
  for (size_t i = 1; i < s.size(); ++i) TORCH_CHECK(s[i] >= s[i - 1], op, ": query_start_loc must not decrease");
  return s;
}

template <typename F>
void dispatch(const at::Tensor& t, const char* op, F&& f) {
  switch (t.scalar_type()) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(BF16{}); break;
    case at::kHalf: f(F16{}); break;
    default: TORCH_CHECK(false, op, ": unsupported dtype ", t.scalar_type());
  }
}

// ---- causal_conv1d / causal_conv1d_update ----------------------------------------------

constexpr int64_t kConvChannels = 64;

// One sequence's tokens [0, len) for channels [c0, c1): y_t = sum_j w[c, j] in(t - K + 1 + j)
// with K = width and in(i < 0) from prev ([c1 - c0, K - 1], oldest first); then the
// last K - 1 inputs go to state (float32 [dim, K - 1] of this sequence).
template <typename T>
void conv_seq(const T* x, int64_t xs, int64_t len, const float* wt /*[K, dim]*/, const float* w /*[dim, K]*/,
              const float* bias, float* state, bool has_state, int64_t dim, int64_t K, int64_t c0, int64_t c1,
              bool act, T* out) {
  const int64_t H = K - 1, nc = c1 - c0;
  std::vector<float> prev(nc * H + 1, 0.f);
  if (has_state)
    for (int64_t c = 0; c < nc; ++c)
      for (int64_t j = 0; j < H; ++j) prev[c * H + j] = state[(c0 + c) * H + j];
  auto input = [&](int64_t i, int64_t c) -> float {  // c relative to c0
    return i >= 0 ? to_float(x[i * xs + c0 + c]) : prev[c * H + (H + i)];
  };
  // Tokens whose window reaches into prev: one lane at a time.
  const int64_t head = std::min(len, H);
  for (int64_t t = 0; t < head; ++t)
    for (int64_t c = 0; c < nc; ++c) {
      float acc = 0.f;
      for (int64_t j = 0; j < K; ++j) acc += w[(c0 + c) * K + j] * input(t - H + j, c);
      if (bias != nullptr) acc += bias[c0 + c];
      out[t * dim + c0 + c] = from_float<T>(act ? silu1(acc) : acc);
    }
  auto body = [&](auto ops, int64_t c) {
    using Ops = decltype(ops);
    using V = typename Ops::V;
    const int64_t cc = c0 + c;
    const V b = bias != nullptr ? Ops::load(bias + cc) : Ops::zero();
    for (int64_t t = head; t < len; ++t) {
      V acc = Ops::zero();
      for (int64_t j = 0; j < K; ++j) acc = Ops::fma(Ops::load(wt + j * dim + cc), Ops::load(x + (t - H + j) * xs + cc), acc);
      acc = Ops::add(acc, b);
      Ops::store(out + t * dim + cc, act ? silu<Ops>(acc) : acc);
    }
  };
  int64_t c = 0;
  for (; c + Isa::W <= nc; c += Isa::W) body(Isa{}, c);
  for (; c < nc; ++c) body(Lane1{}, c);
  // The new window: the last H inputs of [prev, x].
  for (int64_t cr = 0; cr < nc; ++cr)
    for (int64_t j = 0; j < H; ++j) state[(c0 + cr) * H + j] = input(len - H + j, cr);
}

at::Tensor causal_conv1d(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                         const at::Tensor& conv_state, const at::Tensor& qsl, const at::Tensor& has_state,
                         bool silu_act) {
  const char* op = "causal_conv1d";
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && conv_state.dim() == 3, op, ": bad ranks");
  check_rows(x, op, "x");
  check_float(weight, op, "weight");
  check_float(conv_state, op, "conv_state");
  const int64_t T = x.size(0), dim = x.size(1), K = weight.size(1);
  const auto starts = starts_of(qsl, T, op);
  const int64_t S = int64_t(starts.size()) - 1;
  TORCH_CHECK(K >= 1 && weight.size(0) == dim && conv_state.size(0) == S && conv_state.size(1) == dim &&
                  conv_state.size(2) == K - 1,
              op, ": shapes do not fit: x ", x.sizes(), ", weight ", weight.sizes(), ", conv_state ",
              conv_state.sizes());
  const bool has_bias = bias.numel() > 0;
  if (has_bias) {
    check_float(bias, op, "bias");
    TORCH_CHECK(bias.numel() == dim, op, ": bias must have dim elements");
  }
  TORCH_CHECK(has_state.scalar_type() == at::kBool && has_state.is_contiguous() && has_state.numel() == S, op,
              ": has_state must be contiguous bool [num_seqs]");
  at::Tensor out = at::empty({T, dim}, x.options());
  const float* w = weight.data_ptr<float>();
  std::vector<float> wt(K * dim);
  for (int64_t c = 0; c < dim; ++c)
    for (int64_t j = 0; j < K; ++j) wt[j * dim + c] = w[c * K + j];
  const float* b = has_bias ? bias.data_ptr<float>() : nullptr;
  const bool* has = has_state.data_ptr<bool>();
  float* st = conv_state.data_ptr<float>();
  const int64_t blocks = (dim + kConvChannels - 1) / kConvChannels;
  dispatch(x, op, [&](auto tag) {
    using T = decltype(tag);
    const T* xp = cptr<T>(x);
    T* o = mptr<T>(out);
    const int64_t xs = x.stride(0);
    at::parallel_for(0, S * blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t s = item / blocks, c0 = (item % blocks) * kConvChannels, c1 = std::min(dim, c0 + kConvChannels);
        const int64_t t0 = starts[s];
        conv_seq<T>(xp + t0 * xs, xs, starts[s + 1] - t0, wt.data(), w, b, st + s * dim * (K - 1), has[s], dim, K, c0,
                    c1, silu_act, o + t0 * dim);
      }
    });
  });
  return out;
}

// out[i] = act(acc[i]) in T for i < n, vectorized (the activation's exp dominates a
// decode step's convolution).
template <typename T>
void activate_store(const float* acc, int64_t n, bool act, T* out) {
  auto run = [&](auto ops, int64_t i) {
    using Ops = decltype(ops);
    const typename Ops::V a = Ops::load(acc + i);
    Ops::store(out + i, act ? silu<Ops>(a) : a);
  };
  int64_t i = 0;
  for (; i + Isa::W <= n; i += Isa::W) run(Isa{}, i);
  for (; i < n; ++i) run(Lane1{}, i);
}

// One token per sequence, channels [c0, c1): y = w . [window, x] (+ bias), then the
// window shifts by one.  The filter width is KC when KC > 0 (compile-time, for the usual
// 3 and 4), else the run-time k.
template <typename T, int KC>
void conv_step(const T* x, const float* w, const float* b, float* win, int64_t k, int64_t c0, int64_t c1, bool act,
               T* out) {
  const int64_t K = KC > 0 ? KC : k, H = K - 1;
  float buf[kConvChannels];
  for (int64_t c = c0; c < c1; ++c) {
    float* sw = win + c * H;
    const float* wc = w + c * K;
    const float xv = to_float(x[c]);
    float acc = 0.f;
    for (int64_t j = 0; j < H; ++j) acc += sw[j] * wc[j];
    acc += xv * wc[H];
    if (b != nullptr) acc += b[c];
    for (int64_t j = 0; j + 1 < H; ++j) sw[j] = sw[j + 1];
    if (H > 0) sw[H - 1] = xv;
    buf[c - c0] = acc;
  }
  activate_store<T>(buf, c1 - c0, act, out + c0);
}

at::Tensor causal_conv1d_update(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                const at::Tensor& conv_state, bool silu_act) {
  const char* op = "causal_conv1d_update";
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && conv_state.dim() == 3, op, ": bad ranks");
  check_rows(x, op, "x");
  check_float(weight, op, "weight");
  check_float(conv_state, op, "conv_state");
  const int64_t S = x.size(0), dim = x.size(1), K = weight.size(1), H = K - 1;
  TORCH_CHECK(K >= 1 && weight.size(0) == dim && conv_state.size(0) == S && conv_state.size(1) == dim &&
                  conv_state.size(2) == H,
              op, ": shapes do not fit: x ", x.sizes(), ", weight ", weight.sizes(), ", conv_state ",
              conv_state.sizes());
  const bool has_bias = bias.numel() > 0;
  if (has_bias) {
    check_float(bias, op, "bias");
    TORCH_CHECK(bias.numel() == dim, op, ": bias must have dim elements");
  }
  at::Tensor out = at::empty({S, dim}, x.options());
  const float* w = weight.data_ptr<float>();
  const float* b = has_bias ? bias.data_ptr<float>() : nullptr;
  float* st = conv_state.data_ptr<float>();
  dispatch(x, op, [&](auto tag) {
    using T = decltype(tag);
    const T* xp = cptr<T>(x);
    T* o = mptr<T>(out);
    const int64_t xs = x.stride(0);
    const int64_t blocks = (dim + kConvChannels - 1) / kConvChannels;
    auto run = [&](auto kc) {  // the filter width as a compile-time constant (0: run-time K)
      at::parallel_for(0, S * blocks, 8, [&](int64_t begin, int64_t end) {
        for (int64_t item = begin; item < end; ++item) {
          const int64_t s = item / blocks, c0 = (item % blocks) * kConvChannels;
          const int64_t c1 = std::min(dim, c0 + kConvChannels);
          conv_step<T, decltype(kc)::value>(xp + s * xs, w, b, st + s * dim * H, K, c0, c1, silu_act, o + s * dim);
        }
      });
    };
    if (K == 4)
      run(std::integral_constant<int, 4>{});
    else if (K == 3)
      run(std::integral_constant<int, 3>{});
    else
      run(std::integral_constant<int, 0>{});
  });
  return out;
}

// ---- Gated DeltaNet ------------------------------------------------------------------------

constexpr int kGdnVectors = 4;  // value columns of one item: kGdnVectors * Isa::W

// q, k of every token, float32 [T, HK, dk]: L2-normalised when asked, q scaled by dk^-0.5.
template <typename T>
void gdn_prepare_qk(const at::Tensor& q, const at::Tensor& k, bool l2norm, std::vector<float>& qn,
                    std::vector<float>& kn) {
  const int64_t T_ = q.size(0), HK = q.size(1), dk = q.size(2);
  qn.resize(T_ * HK * dk);
  kn.resize(T_ * HK * dk);
  const T* qp = cptr<T>(q);
  const T* kp = cptr<T>(k);
  const float scale = static_cast<float>(std::pow(static_cast<double>(dk), -0.5));
  at::parallel_for(0, T_ * HK, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / HK, h = i % HK;
      const T* qs = qp + t * q.stride(0) + h * q.stride(1);
      const T* ks = kp + t * k.stride(0) + h * k.stride(1);
      float* qd = qn.data() + i * dk;
      float* kd = kn.data() + i * dk;
      float sq = 0.f, sk = 0.f;
      for (int64_t d = 0; d < dk; ++d) {
        qd[d] = to_float(qs[d]);
        kd[d] = to_float(ks[d]);
        sq += qd[d] * qd[d];
        sk += kd[d] * kd[d];
      }
      const float fq = l2norm ? 1.f / std::sqrt(sq + 1e-6f) : 1.f;
      const float fk = l2norm ? 1.f / std::sqrt(sk + 1e-6f) : 1.f;
      for (int64_t d = 0; d < dk; ++d) {
        qd[d] = (qd[d] * fq) * scale;
        kd[d] = kd[d] * fk;
      }
    }
  });
}

// Columns [c, c + NV * Ops::W) of one sequence's head state s [dk, dv] through tokens
// [t0, t1): per token S <- exp(g) S; delta = beta (v - S^T k); S += k delta^T; o = S^T q.
template <typename Ops, int NV, typename T>
void gdn_columns(float* s, int64_t dk, int64_t dv, int64_t c, int64_t t0, int64_t t1, int64_t h, int64_t kh,
                 int64_t HK, int64_t HV, const float* qn, const float* kn, const T* v, int64_t vs0, int64_t vs1,
                 const float* g, const float* beta, T* out) {
  using V = typename Ops::V;
  constexpr int W = Ops::W;
  for (int64_t t = t0; t < t1; ++t) {
    const float* kt = kn + (t * HK + kh) * dk;
    const float* qt = qn + (t * HK + kh) * dk;
    const V decay = Ops::set1(std::exp(g[t * HV + h]));
    V mem[NV];
    for (int u = 0; u < NV; ++u) mem[u] = Ops::zero();
    for (int64_t r = 0; r < dk; ++r) {
      const V kr = Ops::set1(kt[r]);
      const float* row = s + r * dv + c;
      for (int u = 0; u < NV; ++u) mem[u] = Ops::fma(kr, Ops::load(row + u * W), mem[u]);
    }
    const T* vt = v + t * vs0 + h * vs1 + c;
    const V bt = Ops::set1(beta[t * HV + h]);
    V delta[NV], o[NV];
    for (int u = 0; u < NV; ++u) {
      delta[u] = Ops::mul(Ops::sub(Ops::load(vt + u * W), Ops::mul(mem[u], decay)), bt);
      o[u] = Ops::zero();
    }
    for (int64_t r = 0; r < dk; ++r) {
      const V kr = Ops::set1(kt[r]), qr = Ops::set1(qt[r]);
      float* row = s + r * dv + c;
      for (int u = 0; u < NV; ++u) {
        const V sn = Ops::fma(kr, delta[u], Ops::mul(Ops::load(row + u * W), decay));
        Ops::store(row + u * W, sn);
        o[u] = Ops::fma(qr, sn, o[u]);
      }
    }
    T* ot = out + (t * HV + h) * dv + c;
    for (int u = 0; u < NV; ++u) Ops::store(ot + u * W, o[u]);
  }
}

at::Tensor gated_delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                            const at::Tensor& beta, const at::Tensor& state, const at::Tensor& qsl, bool l2norm) {
  const char* op = "gated_delta_rule";
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && g.dim() == 2 && beta.dim() == 2 && state.dim() == 4, op,
              ": bad ranks");
  check_rows(q, op, "q");
  check_rows(k, op, "k");
  check_rows(v, op, "v");
  check_float(g, op, "g");
  check_float(beta, op, "beta");
  check_float(state, op, "state");
  TORCH_CHECK(q.scalar_type() == v.scalar_type() && k.scalar_type() == v.scalar_type(), op,
              ": q, k and v must share a dtype");
  const int64_t T_ = v.size(0), HV = v.size(1), dv = v.size(2), HK = q.size(1), dk = q.size(2);
  const auto starts = starts_of(qsl, T_, op);
  const int64_t S = int64_t(starts.size()) - 1;
  TORCH_CHECK(q.sizes() == k.sizes() && q.size(0) == T_ && HK > 0 && HV % HK == 0 && g.size(0) == T_ &&
                  g.size(1) == HV && beta.sizes() == g.sizes() && state.size(0) == S && state.size(1) == HV &&
                  state.size(2) == dk && state.size(3) == dv,
              op, ": shapes do not fit: q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes(), ", g ", g.sizes(),
              ", state ", state.sizes());
  at::Tensor out = at::empty({T_, HV, dv}, v.options());
  constexpr int64_t cols = kGdnVectors * Isa::W;
  const int64_t blocks = (dv + cols - 1) / cols;
  dispatch(v, op, [&](auto tag) {
    using T = decltype(tag);
    std::vector<float> qn, kn;
    gdn_prepare_qk<T>(q, k, l2norm, qn, kn);
    const T* vp = cptr<T>(v);
    T* o = mptr<T>(out);
    const float* gp = g.data_ptr<float>();
    const float* bp = beta.data_ptr<float>();
    float* st = state.data_ptr<float>();
    const int64_t vs0 = v.stride(0), vs1 = v.stride(1), rep = HV / HK;
    at::parallel_for(0, S * HV * blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t sh = item / blocks, s = sh / HV, h = sh % HV;
        const int64_t c1 = std::min(dv, (item % blocks) * cols + cols);
        int64_t c = (item % blocks) * cols;
        float* sp = st + sh * dk * dv;
        const int64_t t0 = starts[s], t1 = starts[s + 1];
        for (; c + cols <= c1; c += cols)
          gdn_columns<Isa, kGdnVectors, T>(sp, dk, dv, c, t0, t1, h, h / rep, HK, HV, qn.data(), kn.data(), vp, vs0,
                                           vs1, gp, bp, o);
        for (; c + Isa::W <= c1; c += Isa::W)
          gdn_columns<Isa, 1, T>(sp, dk, dv, c, t0, t1, h, h / rep, HK, HV, qn.data(), kn.data(), vp, vs0, vs1, gp,
                                 bp, o);
        for (; c < c1; ++c)
          gdn_columns<Lane1, 1, T>(sp, dk, dv, c, t0, t1, h, h / rep, HK, HV, qn.data(), kn.data(), vp, vs0, vs1, gp,
                                   bp, o);
      }
    });
  });
  return out;
}

// ---- Mamba 2 (SSD) -------------------------------------------------------------------------

// The checks the Mamba scans share: x, B and C rows of one dtype; dt, A, D and the state float32.
void check_ssm(const char* op, const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
               const at::Tensor& C, const at::Tensor& D, const at::Tensor& state) {
  check_rows(x, op, "x");
  check_rows(B, op, "B");
  check_rows(C, op, "C");
  check_float(dt, op, "dt");
  check_float(A, op, "A");
  check_float(D, op, "D");
  check_float(state, op, "state");
  TORCH_CHECK(B.scalar_type() == x.scalar_type() && C.scalar_type() == x.scalar_type(), op,
              ": x, B and C must share a dtype");
}

// A token's B and C rows (n values each) as float32.
template <typename T>
inline void rows_to_float(const T* b, const T* c, int64_t n, float* bf, float* cf) {
  for (int64_t i = 0; i < n; ++i) {
    bf[i] = to_float(b[i]);
    cf[i] = to_float(c[i]);
  }
}

// Sum of a row of n floats times c (vectors, then a one-lane tail); the row is first
// updated in place: row = row * decay + u * b.
inline float update_dot(float* row, const float* b, const float* c, int64_t n, float decay, float u) {
  using V = Isa::V;
  const V dv = Isa::set1(decay), uv = Isa::set1(u);
  V acc = Isa::zero();
  int64_t i = 0;
  for (; i + Isa::W <= n; i += Isa::W) {
    const V sn = Isa::fma(uv, Isa::load(b + i), Isa::mul(Isa::load(row + i), dv));
    Isa::store(row + i, sn);
    acc = Isa::fma(sn, Isa::load(c + i), acc);
  }
  float sum = Isa::reduce_add(acc);
  for (; i < n; ++i) {
    row[i] = u * b[i] + row[i] * decay;
    sum += row[i] * c[i];
  }
  return sum;
}

at::Tensor mamba2_ssd(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
                      const at::Tensor& C, const at::Tensor& D, const at::Tensor& state, const at::Tensor& qsl) {
  const char* op = "mamba2_ssd";
  TORCH_CHECK(x.dim() == 3 && dt.dim() == 2 && B.dim() == 3 && C.dim() == 3 && state.dim() == 4, op, ": bad ranks");
  check_ssm(op, x, dt, A, B, C, D, state);
  const int64_t T_ = x.size(0), H = x.size(1), P = x.size(2), G = B.size(1), N = B.size(2);
  const auto starts = starts_of(qsl, T_, op);
  const int64_t S = int64_t(starts.size()) - 1;
  TORCH_CHECK(G > 0 && H % G == 0 && B.sizes() == C.sizes() && B.size(0) == T_ && dt.size(0) == T_ &&
                  dt.size(1) == H && A.numel() == H && D.numel() == H && state.size(0) == S && state.size(1) == H &&
                  state.size(2) == P && state.size(3) == N,
              op, ": shapes do not fit: x ", x.sizes(), ", dt ", dt.sizes(), ", B ", B.sizes(), ", state ",
              state.sizes());
  at::Tensor out = at::empty({T_, H, P}, x.options());
  dispatch(x, op, [&](auto tag) {
    using T = decltype(tag);
    const T* xp = cptr<T>(x);
    const T* bp = cptr<T>(B);
    const T* cp = cptr<T>(C);
    T* o = mptr<T>(out);
    const float* dtp = dt.data_ptr<float>();
    const float* ap = A.data_ptr<float>();
    const float* dp = D.data_ptr<float>();
    float* st = state.data_ptr<float>();
    const int64_t rep = H / G;
    at::parallel_for(0, S * H, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> bf(N), cf(N);
      for (int64_t item = begin; item < end; ++item) {
        const int64_t s = item / H, h = item % H, grp = h / rep;
        float* sp = st + item * P * N;
        for (int64_t t = starts[s]; t < starts[s + 1]; ++t) {
          const T* bt = bp + t * B.stride(0) + grp * B.stride(1);
          const T* ct = cp + t * C.stride(0) + grp * C.stride(1);
          rows_to_float(bt, ct, N, bf.data(), cf.data());
          const float dtv = dtp[t * H + h], decay = std::exp(dtv * ap[h]), d = dp[h];
          const T* xt = xp + t * x.stride(0) + h * x.stride(1);
          T* ot = o + (t * H + h) * P;
          for (int64_t p = 0; p < P; ++p) {
            const float xv = to_float(xt[p]);
            const float y = update_dot(sp + p * N, bf.data(), cf.data(), N, decay, dtv * xv);
            ot[p] = from_float<T>(y + d * xv);
          }
        }
      }
    });
  });
  return out;
}

// ---- Mamba 1 (selective scan) -------------------------------------------------------------

constexpr int64_t kScanChannels = 16;

at::Tensor mamba1_scan(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
                       const at::Tensor& C, const at::Tensor& D, const at::Tensor& state, const at::Tensor& qsl) {
  const char* op = "mamba1_scan";
  TORCH_CHECK(x.dim() == 2 && dt.dim() == 2 && A.dim() == 2 && B.dim() == 2 && C.dim() == 2 && state.dim() == 3, op,
              ": bad ranks");
  check_ssm(op, x, dt, A, B, C, D, state);
  const int64_t T_ = x.size(0), dim = x.size(1), N = A.size(1);
  const auto starts = starts_of(qsl, T_, op);
  const int64_t S = int64_t(starts.size()) - 1;
  TORCH_CHECK(dt.sizes() == x.sizes() && A.size(0) == dim && B.size(0) == T_ && B.size(1) == N &&
                  C.sizes() == B.sizes() && D.numel() == dim && state.size(0) == S && state.size(1) == dim &&
                  state.size(2) == N,
              op, ": shapes do not fit: x ", x.sizes(), ", A ", A.sizes(), ", B ", B.sizes(), ", state ",
              state.sizes());
  at::Tensor out = at::empty({T_, dim}, x.options());
  const int64_t blocks = (dim + kScanChannels - 1) / kScanChannels;
  dispatch(x, op, [&](auto tag) {
    using T = decltype(tag);
    const T* xp = cptr<T>(x);
    const T* bp = cptr<T>(B);
    const T* cp = cptr<T>(C);
    T* o = mptr<T>(out);
    const float* dtp = dt.data_ptr<float>();
    const float* ap = A.data_ptr<float>();
    const float* dp = D.data_ptr<float>();
    float* st = state.data_ptr<float>();
    at::parallel_for(0, S * blocks, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> bf(N), cf(N);
      for (int64_t item = begin; item < end; ++item) {
        const int64_t s = item / blocks, c0 = (item % blocks) * kScanChannels;
        const int64_t c1 = std::min(dim, c0 + kScanChannels);
        for (int64_t t = starts[s]; t < starts[s + 1]; ++t) {
          const T* bt = bp + t * B.stride(0);
          const T* ct = cp + t * C.stride(0);
          rows_to_float(bt, ct, N, bf.data(), cf.data());
          for (int64_t c = c0; c < c1; ++c) {
            const float dtv = dtp[t * dim + c], xv = to_float(xp[t * x.stride(0) + c]), u = dtv * xv;
            float* row = st + (s * dim + c) * N;
            const float* arow = ap + c * N;
            using V = Isa::V;
            const V dtvv = Isa::set1(dtv), uv = Isa::set1(u);
            V acc = Isa::zero();
            int64_t n = 0;
            for (; n + Isa::W <= N; n += Isa::W) {
              const V decay = Isa::exp(Isa::mul(dtvv, Isa::load(arow + n)));
              const V sn = Isa::fma(uv, Isa::load(bf.data() + n), Isa::mul(Isa::load(row + n), decay));
              Isa::store(row + n, sn);
              acc = Isa::fma(sn, Isa::load(cf.data() + n), acc);
            }
            float y = Isa::reduce_add(acc);
            for (; n < N; ++n) {
              row[n] = u * bf[n] + row[n] * std::exp(dtv * arow[n]);
              y += row[n] * cf[n];
            }
            o[t * dim + c] = from_float<T>(y + dp[c] * xv);
          }
        }
      }
    });
  });
  return out;
}

// ---- gated RMSNorm ---------------------------------------------------------------------------

at::Tensor rms_norm_gated(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& weight, double eps,
                          bool norm_before_gate, int64_t group_size) {
  const char* op = "rms_norm_gated";
  TORCH_CHECK(x.dim() == 2 && gate.dim() == 2 && x.sizes() == gate.sizes(), op, ": x and gate must be [n, d]");
  check_rows(x, op, "x");
  check_rows(gate, op, "gate");
  check_float(weight, op, "weight");
  TORCH_CHECK(gate.scalar_type() == x.scalar_type(), op, ": x and gate must share a dtype");
  const int64_t n = x.size(0), d = x.size(1);
  TORCH_CHECK(weight.numel() == d && group_size > 0 && d % group_size == 0, op, ": shapes do not fit");
  at::Tensor out = at::empty({n, d}, x.options());
  const float* w = weight.data_ptr<float>();
  const float e = static_cast<float>(eps);
  dispatch(x, op, [&](auto tag) {
    using T = decltype(tag);
    const T* xp = cptr<T>(x);
    const T* gp = cptr<T>(gate);
    T* o = mptr<T>(out);
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> h(d), sg(d);
      for (int64_t r = begin; r < end; ++r) {
        const T* xr = xp + r * x.stride(0);
        const T* gr = gp + r * gate.stride(0);
        for (int64_t i = 0; i < d; ++i) {
          sg[i] = silu1(to_float(gr[i]));
          h[i] = norm_before_gate ? to_float(xr[i]) : to_float(xr[i]) * sg[i];
        }
        for (int64_t g0 = 0; g0 < d; g0 += group_size) {
          float ss = 0.f;
          for (int64_t i = g0; i < g0 + group_size; ++i) ss += h[i] * h[i];
          const float inv = 1.f / std::sqrt(ss / static_cast<float>(group_size) + e);
          for (int64_t i = g0; i < g0 + group_size; ++i) {
            float y = (h[i] * inv) * w[i];
            if (norm_before_gate) y *= sg[i];
            o[r * d + i] = from_float<T>(y);
          }
        }
      }
    });
  });
  return out;
}

std::string isa() { return kIsaName; }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("causal_conv1d", &causal_conv1d, nogil, "varlen causal depthwise conv continuing each window (in place)");
  m.def("causal_conv1d_update", &causal_conv1d_update, nogil, "one token per sequence, window shifted in place");
  m.def("gated_delta_rule", &gated_delta_rule, nogil, "Gated DeltaNet over a varlen batch, token by token");
  m.def("mamba2_ssd", &mamba2_ssd, nogil, "Mamba 2 state-space scan over a varlen batch, token by token");
  m.def("mamba1_scan", &mamba1_scan, nogil, "Mamba 1 selective scan over a varlen batch, token by token");
  m.def("rms_norm_gated", &rms_norm_gated, nogil, "gated (grouped) RMSNorm");
  m.def("isa", &isa, "the vector instruction set compiled in");
}
