// Speculative decoding's verification of sampled rows (the op `rejection_sample`).
//
// Specification: pagedserve/kernels/spec_reference.py.  Row i's drafts are accepted
// while uniform * q(d) < p(d); at the first rejection one token is drawn from the
// residual max(p - q, 0) (q one-hot on d without draft probabilities), after the last
// draft a bonus token from p, both by inverse CDF with recover_uniform: the first token
// whose running float64 sum, in vocabulary order, exceeds u * total.  Everything is
// computed in the reference's order and precision so that the outputs agree bit for bit.
// Rows run in parallel (at::parallel_for); each row is one pass over the vocabulary per
// drafted position at most.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <optional>

namespace {

// Inverse CDF over weights w[t] = residual(t): first t with running sum > u * total; the
// last positive weight when rounding leaves none.
template <typename Weight>
int64_t inverse_cdf(Weight weight, int64_t V, double u) {
  double total = 0.0;
  for (int64_t t = 0; t < V; ++t) total += static_cast<double>(weight(t));
  const double threshold = u * total;
  double cum = 0.0;
  int64_t last_positive = -1;
  for (int64_t t = 0; t < V; ++t) {
    const float w = weight(t);
    cum += static_cast<double>(w);
    if (cum > threshold) return t;
    if (w > 0.0f) last_positive = t;
  }
  return last_positive;
}

void sample_row(int64_t i, int64_t K, int64_t V, const int64_t* draft_ids, int64_t n, const float* draft_probs,
                const float* target, const float* uniform, const float* recover, int64_t* out) {
  for (int64_t j = 0; j <= n; ++j) {
    const float* p = target + (i * (K + 1) + j) * V;
    const double ru = static_cast<double>(recover[i * (K + 1) + j]);
    if (j == n) {  // every draft accepted: the bonus token
      out[i * (K + 1) + j] = inverse_cdf([p](int64_t t) { return p[t]; }, V, ru);
      return;
    }
    const int64_t d = draft_ids[i * K + j];
    const float* q = draft_probs ? draft_probs + (i * K + j) * V : nullptr;
    const double q_d = q ? static_cast<double>(q[d]) : 1.0;
    if (static_cast<double>(uniform[i * K + j]) * q_d < static_cast<double>(p[d])) {
      out[i * (K + 1) + j] = d;
      continue;
    }
    auto residual = [p, q, d](int64_t t) -> float {
      if (q) return std::max(p[t] - q[t], 0.0f);
      return t == d ? 0.0f : p[t];
    };
    bool any = false;
    for (int64_t t = 0; t < V && !any; ++t) any = residual(t) > 0.0f;
    out[i * (K + 1) + j] = any ? inverse_cdf(residual, V, ru) : inverse_cdf([p](int64_t t) { return p[t]; }, V, ru);
    return;
  }
}

torch::Tensor rejection_sample(torch::Tensor draft_ids, torch::Tensor num_draft, std::optional<torch::Tensor> draft_probs,
                               torch::Tensor target_probs, torch::Tensor uniform, torch::Tensor recover_uniform) {
  TORCH_CHECK(draft_ids.dim() == 2 && draft_ids.scalar_type() == torch::kInt64, "draft_token_ids: int64 [B, K]");
  const int64_t B = draft_ids.size(0), K = draft_ids.size(1);
  TORCH_CHECK(target_probs.dim() == 3 && target_probs.size(0) == B && target_probs.size(1) == K + 1 &&
                  target_probs.scalar_type() == torch::kFloat32,
              "target_probs: float32 [B, K + 1, V]");
  const int64_t V = target_probs.size(2);
  TORCH_CHECK(num_draft.scalar_type() == torch::kInt64 && num_draft.numel() == B, "num_draft_tokens: int64 [B]");
  TORCH_CHECK(uniform.scalar_type() == torch::kFloat32 && uniform.numel() == B * K, "uniform: float32 [B, K]");
  TORCH_CHECK(recover_uniform.scalar_type() == torch::kFloat32 && recover_uniform.numel() == B * (K + 1),
              "recover_uniform: float32 [B, K + 1]");
  auto ids = draft_ids.contiguous();
  auto num = num_draft.contiguous();
  auto target = target_probs.contiguous();
  auto u = uniform.contiguous();
  auto ru = recover_uniform.contiguous();
  torch::Tensor q;
  if (draft_probs.has_value()) {
    q = draft_probs->contiguous();
    TORCH_CHECK(q.scalar_type() == torch::kFloat32 && q.dim() == 3 && q.size(0) == B && q.size(1) == K &&
                    q.size(2) == V,
                "draft_probs: float32 [B, K, V]");
  }
  const int64_t* n_ptr = num.data_ptr<int64_t>();
  for (int64_t i = 0; i < B; ++i) TORCH_CHECK(n_ptr[i] >= 0 && n_ptr[i] <= K, "num_draft_tokens out of [0, K]");
  auto out = torch::full({B, K + 1}, -1, torch::kInt64);
  const int64_t* ids_ptr = ids.data_ptr<int64_t>();
  const float* q_ptr = q.defined() ? q.data_ptr<float>() : nullptr;
  const float* t_ptr = target.data_ptr<float>();
  const float* u_ptr = u.data_ptr<float>();
  const float* ru_ptr = ru.data_ptr<float>();
  int64_t* o_ptr = out.data_ptr<int64_t>();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      sample_row(i, K, V, ids_ptr, n_ptr[i], q_ptr, t_ptr, u_ptr, ru_ptr, o_ptr);
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rejection_sample", &rejection_sample, "speculative decoding: verify drafts against target probabilities",
        py::arg("draft_token_ids"), py::arg("num_draft_tokens"), py::arg("draft_probs"), py::arg("target_probs"),
        py::arg("uniform"), py::arg("recover_uniform"));
}
