// Multi-head latent attention over the paged latent cache (the op `mla_paged_attention`).
//
// Specification: pagedserve/kernels/reference.py (mla_paged_attention).  Every cached
// token is one vector of L = kv_lora_rank + rope values, its first D in the key cache and
// the rest in the value cache (one KV head each, [num_blocks, block_size, 1, D], read
// through strides).  For query token t of sequence i (position p = ctx - q_len + t) and
// head h: score_j = scale * q[t, h] . entry_j over keys j <= p, softmax, and
// out[t, h] = sum_j prob_j * entry_j[:kv_lora_rank].
//
// Tokens run in parallel (at::parallel_for); each loads every visible key's vector once
// per pass and uses it for all heads (the latent is shared by them): one pass for the
// scores of every head, a float32 softmax, one pass accumulating the weighted latents.
// Query, caches and output share one dtype (float32, bfloat16 or float16); arithmetic is
// float32.

#include <torch/extension.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

// Eight independent partial sums, so that the compiler vectorizes the dot product
// without reassociating floating point on its own.
inline float dot(const float* a, const float* b, int64_t n) {
  float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t d = 0;
  for (; d + 8 <= n; d += 8)
    for (int k = 0; k < 8; ++k) part[k] += a[d + k] * b[d + k];
  float s = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
  for (; d < n; ++d) s += a[d] * b[d];
  return s;
}

template <typename scalar_t>
void attend_token(int64_t tok, int64_t seq, int64_t pos, const scalar_t* q, const scalar_t* kc, const scalar_t* vc,
                  const int32_t* table, int64_t H, int64_t L, int64_t D, int64_t R, int64_t bs,
                  const int64_t* q_stride, const int64_t* c_stride, float scale, scalar_t* out,
                  const int64_t* o_stride, std::vector<float>& qf, std::vector<float>& entry,
                  std::vector<float>& scores, std::vector<float>& acc) {
  const int64_t n_keys = pos + 1;
  qf.resize(H * L);
  entry.resize(L);
  scores.resize(H * n_keys);
  acc.assign(H * R, 0.0f);
  for (int64_t h = 0; h < H; ++h)
    for (int64_t d = 0; d < L; ++d)
      qf[h * L + d] = static_cast<float>(q[tok * q_stride[0] + h * q_stride[1] + d * q_stride[2]]);
  auto load = [&](int64_t j, int64_t width) {
    const int64_t block = table[j / bs], off = j % bs;
    const int64_t base = block * c_stride[0] + off * c_stride[1];
    const int64_t from_k = std::min(width, D);
    for (int64_t d = 0; d < from_k; ++d) entry[d] = static_cast<float>(kc[base + d * c_stride[3]]);
    for (int64_t d = D; d < width; ++d) entry[d] = static_cast<float>(vc[base + (d - D) * c_stride[3]]);
  };
  for (int64_t j = 0; j < n_keys; ++j) {
    load(j, L);
    for (int64_t h = 0; h < H; ++h) {
      scores[h * n_keys + j] = dot(qf.data() + h * L, entry.data(), L) * scale;
    }
  }
  for (int64_t h = 0; h < H; ++h) {
    float* sh = scores.data() + h * n_keys;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n_keys; ++j) m = std::max(m, sh[j]);
    float sum = 0.0f;
    for (int64_t j = 0; j < n_keys; ++j) {
      sh[j] = std::exp(sh[j] - m);
      sum += sh[j];
    }
    const float inv = 1.0f / sum;
    for (int64_t j = 0; j < n_keys; ++j) sh[j] *= inv;
  }
  for (int64_t j = 0; j < n_keys; ++j) {
    load(j, R);
    for (int64_t h = 0; h < H; ++h) {
      const float p = scores[h * n_keys + j];
      float* ah = acc.data() + h * R;
      for (int64_t d = 0; d < R; ++d) ah[d] += p * entry[d];
    }
  }
  for (int64_t h = 0; h < H; ++h)
    for (int64_t d = 0; d < R; ++d)
      out[tok * o_stride[0] + h * o_stride[1] + d * o_stride[2]] = static_cast<scalar_t>(acc[h * R + d]);
  (void)seq;
}

torch::Tensor mla_paged_attention(const torch::Tensor& query, const torch::Tensor& key_cache,
                                  const torch::Tensor& value_cache, const torch::Tensor& block_tables,
                                  const torch::Tensor& seq_lens, const torch::Tensor& query_start_loc, double scale,
                                  int64_t kv_lora_rank, torch::Tensor out) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && value_cache.dim() == 4, "mla_paged_attention: bad ranks");
  TORCH_CHECK(key_cache.strides() == value_cache.strides() && key_cache.sizes() == value_cache.sizes(),
              "mla_paged_attention: key and value caches must share shape and strides");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32 &&
                  query_start_loc.scalar_type() == torch::kInt32,
              "mla_paged_attention: block tables, lengths and offsets must be int32");
  const auto bt = block_tables.contiguous();
  const auto lens = seq_lens.contiguous();
  const auto qsl = query_start_loc.contiguous();
  const int64_t H = query.size(1), L = query.size(2), D = key_cache.size(3), R = kv_lora_rank;
  const int64_t bs = key_cache.size(1), S = lens.size(0), max_blocks = bt.size(1);
  const int32_t* lens_p = lens.data_ptr<int32_t>();
  const int32_t* qsl_p = qsl.data_ptr<int32_t>();
  const int32_t* bt_p = bt.data_ptr<int32_t>();
  // Token -> (sequence, position).
  const int64_t T = query.size(0);
  std::vector<int64_t> seq_of(T, -1), pos_of(T, 0);
  for (int64_t i = 0; i < S; ++i) {
    const int64_t start = qsl_p[i], end = qsl_p[i + 1], ctx = lens_p[i];
    for (int64_t t = start; t < end; ++t) {
      seq_of[t] = i;
      pos_of[t] = ctx - (end - start) + (t - start);
    }
  }
  const int64_t q_stride[3] = {query.stride(0), query.stride(1), query.stride(2)};
  const int64_t c_stride[4] = {key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), key_cache.stride(3)};
  const int64_t o_stride[3] = {out.stride(0), out.stride(1), out.stride(2)};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "mla_paged_attention", [&] {
    const scalar_t* q = query.data_ptr<scalar_t>();
    const scalar_t* kc = key_cache.data_ptr<scalar_t>();
    const scalar_t* vc = value_cache.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> qf, entry, scores, acc;
      for (int64_t t = begin; t < end; ++t) {
        if (seq_of[t] < 0) continue;  // a token outside every sequence: left as it is
        attend_token<scalar_t>(t, seq_of[t], pos_of[t], q, kc, vc, bt_p + seq_of[t] * max_blocks, H, L, D, R, bs,
                               q_stride, c_stride, static_cast<float>(scale), o, o_stride, qf, entry, scores, acc);
      }
    });
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("mla_paged_attention", &mla_paged_attention, "latent (MLA) attention over the paged latent cache",
        py::arg("query"), py::arg("key_cache"), py::arg("value_cache"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("query_start_loc"), py::arg("scale"), py::arg("kv_lora_rank"), py::arg("out"));
}
