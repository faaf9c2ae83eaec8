// Fused mixture-of-experts MLP on the CPU; the specification is `fused_moe` of
// kernels/reference.py:
//
//   out[t] = sum_k w[t, k] * w2[e] @ (act(gate_e @ x[t]) * (up_e @ x[t])),  e = ids[t, k].
//
// 1. route: a counting sort of the T*K (token, slot) pairs by expert gives every expert
//    a contiguous range of rows; x's rows are gathered into that order once.
// 2. up: per active expert one GEMM of its rows by w13[e] ([2I, H]); the gate and up
//    sums are rounded to the dtype (as the reference's linear), then act(gate) * up.
// 3. down: per active expert one GEMM of those rows by w2[e] ([H, I]) -> y in the dtype.
// 4. combine: out[t] = sum_k w[t, k] * y[row of (t, k)] in float32, rounded once; a
//    token writes only its own output row, so no atomics.
//
// Steps 2 and 3 are cut into (expert, row chunk, column chunk) work items handed to the
// OpenMP threads dynamically (experts receive uneven row counts): at batch 1 the columns
// of the two or so active experts are split, at batch 64 rows and experts are.
//
// bf16 weights packed at load ([E, N/16, K/2, 16, 2], the layout of linear.h) run the
// packed VDPBF16PS micro-kernels of linear.h, w13 through the gated one when the
// activation is silu and I % 16 == 0.  Plain weights of any dtype run a register-blocked
// dot-product tile over the vector ISA of vec.h (float32 accumulation).
//
// GPT-OSS's experts (plain weights only): optional biases b13 [E, 2I] and b2 [E, H]
// are added to the float32 sums before the rounding (a biased linear), and the
// "swigluoai" activation replaces act(gate) * up by
// (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = clamp(gate, max=limit).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "linear.h"
#include "vec.h"

namespace {

using namespace pagedserve_cpu;

#if defined(PAGEDSERVE_HAVE_AVX512BF16)
using Isa = Avx512Bf16;
constexpr bool kHavePacked = true;
#elif defined(PAGEDSERVE_HAVE_AVX512)
using Isa = Avx512;
constexpr bool kHavePacked = false;
#elif defined(PAGEDSERVE_HAVE_AVX2)
using Isa = Avx2;
constexpr bool kHavePacked = false;
#else
using Isa = Scalar;
constexpr bool kHavePacked = false;
#endif

using V = Isa::V;
constexpr int kW = Isa::W;
constexpr int kTileM = 4;
constexpr int kTileN = Isa::kMaxAccRegs >= 16 ? 4 : 2;  // accumulators: kTileM * kTileN
constexpr int64_t kRowChunk = 48;                        // rows of one work item (a multiple of 6 and 4)
enum Activation : int64_t { kSilu = 0, kGelu = 1, kSwigluOai = 2 };

inline float activate(float g, int64_t act) {
  if (act == kSilu) return g / (1.f + std::exp(-g));
  // GELU, tanh approximation (torch's approximate="tanh").
  constexpr float kBeta = 0.7978845608028654f, kKappa = 0.044715f;
  return 0.5f * g * (1.f + std::tanh(kBeta * (g + kKappa * g * g * g)));
}

// s[i * kTileN + j] = x row i . w row j over k (float32 sums); rows past mb / nb repeat
// the last one, so a partial tile costs only its own rows.
template <typename T, int MB>
void dot_tile(const T* const* xr, const T* const* wr, int64_t k, float* s) {
  V acc[MB * kTileN];
  for (auto& a : acc) a = Isa::zero();
  int64_t c = 0;
  for (; c + kW <= k; c += kW) {
    V wv[kTileN];
    for (int j = 0; j < kTileN; ++j) wv[j] = Isa::load(wr[j] + c);
    for (int i = 0; i < MB; ++i) {
      const V xv = Isa::load(xr[i] + c);
      for (int j = 0; j < kTileN; ++j) acc[i * kTileN + j] = Isa::fma(xv, wv[j], acc[i * kTileN + j]);
    }
  }
  for (int t = 0; t < MB * kTileN; ++t) s[t] = Isa::reduce_add(acc[t]);
  for (; c < k; ++c)
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < kTileN; ++j) s[i * kTileN + j] += to_float(xr[i][c]) * to_float(wr[j][c]);
}

template <typename T>
void dot_block(const T* const* xr, int mb, const T* const* wr, int64_t k, float* s) {
  switch (mb) {
    case 1: dot_tile<T, 1>(xr, wr, k, s); break;
    case 2: dot_tile<T, 2>(xr, wr, k, s); break;
    case 3: dot_tile<T, 3>(xr, wr, k, s); break;
    default: dot_tile<T, 4>(xr, wr, k, s); break;
  }
}

// One unit of work: rows [r0, r1) (sorted order, all of expert e) x output columns [c0, c1).
struct Item {
  int64_t e, r0, r1, c0, c1;
};

// Work items over every active expert's rows x `cols` columns, columns cut into chunks
// of 16-column blocks sized so that the threads get several items each.
std::vector<Item> plan_items(const std::vector<int64_t>& offsets, int64_t cols, int threads) {
  const int64_t blocks = (cols + 15) / 16;
  int64_t row_chunks = 0;
  for (size_t e = 0; e + 1 < offsets.size(); ++e) row_chunks += (offsets[e + 1] - offsets[e] + kRowChunk - 1) / kRowChunk;
  const int64_t target = 4 * int64_t(threads);
  const int64_t chunk = std::clamp<int64_t>(row_chunks * blocks / std::max<int64_t>(target, 1), 1, std::max<int64_t>(blocks, 1));
  std::vector<Item> items;
  for (size_t e = 0; e + 1 < offsets.size(); ++e)
    for (int64_t r0 = offsets[e]; r0 < offsets[e + 1]; r0 += kRowChunk)
      for (int64_t b = 0; b < blocks; b += chunk)
        items.push_back({int64_t(e), r0, std::min(r0 + kRowChunk, offsets[e + 1]), b * 16, std::min((b + chunk) * 16, cols)});
  return items;
}

template <class Fn>
void run_items(const std::vector<Item>& items, const Fn& fn) {
  const int64_t n = int64_t(items.size());
  if (n == 0) return;
  at::internal::lazy_init_num_threads();
  const int threads = int(std::min<int64_t>(at::get_num_threads(), n));
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
  for (int64_t i = 0; i < n; ++i) fn(items[i]);
}

struct Moe {
  int64_t tokens, top_k, experts, hidden, inter, act;
  int threads;
  const void* b13 = nullptr;  // [E, 2I] in the dtype, or none
  const void* b2 = nullptr;   // [E, H] in the dtype, or none
  float alpha = 1.702f, limit = 7.f;
};

// act(gate) * up of one element from the rounded gate and up sums.
template <typename T>
inline T gated(const Moe& m, float g, float u) {
  if (m.act == kSwigluOai) {
    g = std::min(g, m.limit);
    u = std::clamp(u, -m.limit, m.limit);
    // Rounded after each step as the reference (and transformers) compute it in the dtype.
    const float sig = round_to<T>(1.f / (1.f + std::exp(-round_to<T>(g * m.alpha))));
    return from_float<T>(round_to<T>(u + 1.f) * round_to<T>(g * sig));
  }
  return from_float<T>(round_to<T>(activate(g, m.act)) * u);
}

template <typename T>
inline float bias_at(const void* b, int64_t i) {
  return b == nullptr ? 0.f : to_float(static_cast<const T*>(b)[i]);
}

// Step 2 on plain weights: act[r, c] for c in [c0, c1) from gate rows c and up rows I + c.
template <typename T>
void up_plain(const Moe& m, const Item& it, const T* xs, const T* w13, T* act) {
  const int64_t H = m.hidden, I = m.inter;
  const T* we = w13 + it.e * 2 * I * H;
  float sg[kTileM * kTileN], su[kTileM * kTileN];
  for (int64_t n0 = it.c0; n0 < it.c1; n0 += kTileN) {
    const int nb = int(std::min<int64_t>(kTileN, it.c1 - n0));
    const T *wg[kTileN], *wu[kTileN];
    for (int j = 0; j < kTileN; ++j) {
      wg[j] = we + (n0 + std::min(j, nb - 1)) * H;
      wu[j] = wg[j] + I * H;
    }
    for (int64_t r = it.r0; r < it.r1; r += kTileM) {
      const int mb = int(std::min<int64_t>(kTileM, it.r1 - r));
      const T* xr[kTileM];
      for (int i = 0; i < kTileM; ++i) xr[i] = xs + (r + std::min(i, mb - 1)) * H;
      dot_block<T>(xr, mb, wg, H, sg);
      dot_block<T>(xr, mb, wu, H, su);
      for (int i = 0; i < mb; ++i)
        for (int j = 0; j < nb; ++j) {
          const int64_t c = n0 + j;
          const float g = round_to<T>(sg[i * kTileN + j] + bias_at<T>(m.b13, it.e * 2 * I + c));
          const float u = round_to<T>(su[i * kTileN + j] + bias_at<T>(m.b13, it.e * 2 * I + I + c));
          act[(r + i) * I + c] = gated<T>(m, g, u);
        }
    }
  }
}

// Step 3 on plain weights: y[r, c] = act row r . w2[e] row c.
template <typename T>
void down_plain(const Moe& m, const Item& it, const T* act, const T* w2, T* y) {
  const int64_t H = m.hidden, I = m.inter;
  const T* we = w2 + it.e * H * I;
  float s[kTileM * kTileN];
  for (int64_t n0 = it.c0; n0 < it.c1; n0 += kTileN) {
    const int nb = int(std::min<int64_t>(kTileN, it.c1 - n0));
    const T* wr[kTileN];
    for (int j = 0; j < kTileN; ++j) wr[j] = we + (n0 + std::min(j, nb - 1)) * I;
    for (int64_t r = it.r0; r < it.r1; r += kTileM) {
      const int mb = int(std::min<int64_t>(kTileM, it.r1 - r));
      const T* xr[kTileM];
      for (int i = 0; i < kTileM; ++i) xr[i] = act + (r + std::min(i, mb - 1)) * I;
      dot_block<T>(xr, mb, wr, I, s);
      for (int i = 0; i < mb; ++i)
        for (int j = 0; j < nb; ++j)
          y[(r + i) * H + n0 + j] = from_float<T>(s[i * kTileN + j] + bias_at<T>(m.b2, it.e * H + n0 + j));
    }
  }
}

#if defined(PAGEDSERVE_HAVE_AVX512BF16)
// The packed micro-kernels of linear.h over rows [it.r0, it.r1) of one expert whose rows
// start at `first`: x rows of K values, weight [N/16, K/2, 16, 2], out rows of out_stride.
void packed_item(const Item& it, int64_t first, const BF16* x, int64_t k, const BF16* w, int64_t n, BF16* out,
                 int64_t out_stride, bool gated) {
  PackedLinearArgs a{x + first * k, k, w, nullptr, out + first * out_stride, out_stride, 0, n, k};
  a.m = it.r1 - first;
  if (gated)
    PackedLinearBf16::run_gated(a, it.r0 - first, it.r1 - first, it.c0 / 16, it.c1 / 16);
  else
    PackedLinearBf16::run(a, it.r0 - first, it.r1 - first, it.c0 / 16, it.c1 / 16);
}
#endif

template <typename T>
void moe_forward(const Moe& m, const std::vector<int64_t>& offsets, const T* xs, const torch::Tensor& w13,
                 const torch::Tensor& w2, T* act, T* h, T* y) {
  const int64_t H = m.hidden, I = m.inter;
  const bool p13 = w13.dim() == 5, p2 = w2.dim() == 5;
  const T* w13p = static_cast<const T*>(w13.data_ptr());
  const T* w2p = static_cast<const T*>(w2.data_ptr());
  if (!p13) {
    run_items(plan_items(offsets, I, m.threads), [&](const Item& it) { up_plain<T>(m, it, xs, w13p, act); });
  }
#if defined(PAGEDSERVE_HAVE_AVX512BF16)
  if constexpr (std::is_same_v<T, BF16>) {
    if (p13 && m.act == kSilu && I % 16 == 0) {
      run_items(plan_items(offsets, I, m.threads), [&](const Item& it) {
        packed_item(it, offsets[it.e], xs, H, w13p + it.e * 2 * I * H, 2 * I, act, I, true);
      });
    } else if (p13) {  // the 2I-wide product, then act(gate) * up per row
      run_items(plan_items(offsets, 2 * I, m.threads), [&](const Item& it) {
        packed_item(it, offsets[it.e], xs, H, w13p + it.e * 2 * I * H, 2 * I, h, 2 * I, false);
      });
      at::parallel_for(0, offsets.back(), 16, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r)
          for (int64_t c = 0; c < I; ++c) {
            const float g = to_float(h[r * 2 * I + c]), u = to_float(h[r * 2 * I + I + c]);
            act[r * I + c] = from_float<T>(round_to<T>(activate(g, m.act)) * u);
          }
      });
    }
    if (p2) {
      run_items(plan_items(offsets, H, m.threads), [&](const Item& it) {
        packed_item(it, offsets[it.e], act, I, w2p + it.e * H * I, H, y, H, false);
      });
    }
  }
#endif
  if (!p2) {
    run_items(plan_items(offsets, H, m.threads), [&](const Item& it) { down_plain<T>(m, it, act, w2p, y); });
  }
}

// Step 4: out[t] = sum_k w[t, k] * y[pos[t, k]] (float32), rounded to T once.
template <typename T>
void combine(const Moe& m, const T* y, const float* w, const int64_t* pos, T* out) {
  const int64_t H = m.hidden, K = m.top_k;
  at::parallel_for(0, m.tokens, std::max<int64_t>(1, 4096 / std::max<int64_t>(H * K, 1)), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      T* o = out + t * H;
      int64_t c = 0;
      for (; c + kW <= H; c += kW) {
        V acc = Isa::zero();
        for (int64_t k = 0; k < K; ++k) acc = Isa::fma(Isa::set1(w[t * K + k]), Isa::load(y + pos[t * K + k] * H + c), acc);
        Isa::store(o + c, acc);
      }
      for (; c < H; ++c) {
        float acc = 0.f;
        for (int64_t k = 0; k < K; ++k) acc += w[t * K + k] * to_float(y[pos[t * K + k] * H + c]);
        o[c] = from_float<T>(acc);
      }
    }
  });
}

template <typename T>
torch::Tensor run_moe(const Moe& m, const torch::Tensor& x, const torch::Tensor& w13, const torch::Tensor& w2,
                      const torch::Tensor& weights, const torch::Tensor& ids) {
  const int64_t H = m.hidden, I = m.inter, P = m.tokens * m.top_k;
  auto out = torch::empty({m.tokens, H}, x.options());
  if (m.tokens == 0) return out;
  // Step 1: counting sort of the (token, slot) pairs by expert.
  const int64_t* idp = ids.data_ptr<int64_t>();
  std::vector<int64_t> offsets(m.experts + 1, 0), pos(P), token_of(P);
  for (int64_t p = 0; p < P; ++p) {
    TORCH_CHECK(idp[p] >= 0 && idp[p] < m.experts, "fused_moe: topk_ids holds expert ", idp[p], " (token ",
                p / m.top_k, "), outside [0, ", m.experts, ")");
    ++offsets[idp[p] + 1];
  }
  for (int64_t e = 0; e < m.experts; ++e) offsets[e + 1] += offsets[e];
  std::vector<int64_t> cursor(offsets.begin(), offsets.end() - 1);
  for (int64_t p = 0; p < P; ++p) {
    const int64_t row = cursor[idp[p]]++;
    pos[p] = row;
    token_of[row] = p / m.top_k;
  }
  auto xs = torch::empty({P, H}, x.options());
  auto act = torch::empty({P, I}, x.options());
  auto y = torch::empty({P, H}, x.options());
  const bool needs_h = w13.dim() == 5 && !(m.act == kSilu && I % 16 == 0);
  auto h = needs_h ? torch::empty({P, 2 * I}, x.options()) : torch::Tensor();
  const T* xp = static_cast<const T*>(x.data_ptr());
  T* xsp = static_cast<T*>(xs.data_ptr());
  at::parallel_for(0, P, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) std::memcpy(xsp + r * H, xp + token_of[r] * H, H * sizeof(T));
  });
  moe_forward<T>(m, offsets, xsp, w13, w2, static_cast<T*>(act.data_ptr()),
                 needs_h ? static_cast<T*>(h.data_ptr()) : nullptr, static_cast<T*>(y.data_ptr()));
  combine<T>(m, static_cast<const T*>(y.data_ptr()), weights.data_ptr<float>(), pos.data(),
             static_cast<T*>(out.data_ptr()));
  return out;
}

// x [T, H]; w13 [E, 2I, H] or packed [E, 2I/16, H/2, 16, 2]; w2 [E, H, I] or packed
// [E, H/16, I/2, 16, 2]; topk_weights float32 [T, K]; topk_ids int64 [T, K].
torch::Tensor fused_moe(torch::Tensor x, torch::Tensor w13, torch::Tensor w2, torch::Tensor weights,
                        torch::Tensor ids, int64_t activation, std::optional<torch::Tensor> b13,
                        std::optional<torch::Tensor> b2, double alpha, double limit) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "fused_moe: x must be a contiguous [T, H] tensor");
  TORCH_CHECK(w13.is_contiguous() && w2.is_contiguous(), "fused_moe: expert weights must be contiguous");
  TORCH_CHECK((w13.dim() == 3 || w13.dim() == 5) && (w2.dim() == 3 || w2.dim() == 5),
              "fused_moe: w13/w2 must be [E, N, K] or packed [E, N/16, K/2, 16, 2]");
  TORCH_CHECK(w13.scalar_type() == x.scalar_type() && w2.scalar_type() == x.scalar_type(),
              "fused_moe: x, w13 and w2 must share a dtype");
  TORCH_CHECK(weights.scalar_type() == torch::kFloat && weights.is_contiguous() && weights.dim() == 2,
              "fused_moe: topk_weights must be contiguous float32 [T, K]");
  TORCH_CHECK(ids.scalar_type() == torch::kLong && ids.is_contiguous() && ids.sizes() == weights.sizes(),
              "fused_moe: topk_ids must be contiguous int64 of topk_weights' shape");
  TORCH_CHECK(activation == kSilu || activation == kGelu || activation == kSwigluOai,
              "fused_moe: activation code ", activation);
  const bool packed = w13.dim() == 5 || w2.dim() == 5;
  TORCH_CHECK(!packed || (activation != kSwigluOai && !b13.has_value() && !b2.has_value()),
              "fused_moe: expert biases and swigluoai need plain (unpacked) expert weights");
  TORCH_CHECK(!packed || (kHavePacked && x.scalar_type() == torch::kBFloat16),
              "fused_moe: packed expert weights need bf16 and the AVX-512 BF16 build");
  Moe m{};
  m.tokens = x.size(0);
  m.top_k = ids.size(1);
  m.experts = w13.size(0);
  m.hidden = x.size(1);
  m.inter = w13.dim() == 5 ? w13.size(1) * 8 : w13.size(1) / 2;
  m.act = activation;
  m.threads = at::get_num_threads();
  m.alpha = float(alpha);
  m.limit = float(limit);
  if (b13.has_value()) {
    TORCH_CHECK(b13->scalar_type() == x.scalar_type() && b13->is_contiguous() && b13->dim() == 2 &&
                    b13->size(0) == m.experts && b13->size(1) == 2 * m.inter,
                "fused_moe: w13_bias must be contiguous [E, 2I] in x's dtype, got ", b13->sizes());
    m.b13 = b13->data_ptr();
  }
  if (b2.has_value()) {
    TORCH_CHECK(b2->scalar_type() == x.scalar_type() && b2->is_contiguous() && b2->dim() == 2 &&
                    b2->size(0) == m.experts && b2->size(1) == m.hidden,
                "fused_moe: w2_bias must be contiguous [E, H] in x's dtype, got ", b2->sizes());
    m.b2 = b2->data_ptr();
  }
  const int64_t w13_k = w13.dim() == 5 ? w13.size(2) * 2 : w13.size(2);
  const int64_t w2_n = w2.dim() == 5 ? w2.size(1) * 16 : w2.size(1);
  const int64_t w2_k = w2.dim() == 5 ? w2.size(2) * 2 : w2.size(2);
  TORCH_CHECK(ids.size(0) == m.tokens && w13_k == m.hidden && w2.size(0) == m.experts && w2_n == m.hidden &&
                  w2_k == m.inter && (w13.dim() == 5 || w13.size(1) % 2 == 0),
              "fused_moe: shapes do not fit: x ", x.sizes(), ", w13 ", w13.sizes(), ", w2 ", w2.sizes(),
              ", topk_ids ", ids.sizes());
  switch (x.scalar_type()) {
    case torch::kFloat: return run_moe<float>(m, x, w13, w2, weights, ids);
    case torch::kBFloat16: return run_moe<BF16>(m, x, w13, w2, weights, ids);
    case torch::kHalf: return run_moe<F16>(m, x, w13, w2, weights, ids);
    default: TORCH_CHECK(false, "fused_moe: unsupported dtype ", x.scalar_type());
  }
}

bool has_packed() { return kHavePacked; }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fused_moe", &fused_moe, "mixture-of-experts MLP over routed tokens (reference.fused_moe)");
  m.def("has_packed", &has_packed, "whether bf16 expert weights packed [E, N/16, K/2, 16, 2] run natively");
}
