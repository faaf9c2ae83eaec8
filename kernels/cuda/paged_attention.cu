// Paged attention for decode-shaped batches, in CUDA C++.
//
// One thread block per (query head, sequence).  Keys are visited in the reference
// cache layout [num_blocks, block_size, num_kv_heads, head_size] through the block
// table, one physical-block lookup per key, so any block size works.
//
// Inside a warp, a "key group" of TPK lanes owns one key at a time: each lane holds
// 16-byte vectors of the head dimension (coalesced along head_size), the partial dot
// products are summed with shuffles, and every key group keeps its own online-softmax
// state (running max m, running sum l, float32 accumulator).  At the end the key
// groups of a warp are merged with shuffles and the warps through shared memory,
// each merge rescaling by exp(m_part - m_total).
//
// A sequence with q_len > 1 is handled by walking its query tokens one after another
// (each with its causal limit), so every batch is computed correctly; the launcher in
// Python sends only decode-shaped batches here because that walk is slow for long
// prefills.  Grouped-query attention reads the KV head of each query head; the query
// heads sharing it run in neighbouring blocks and mostly hit L2.
//
// Sliding window: each query token's key loop starts at its window's first key, so
// keys (and block-table entries) that slid out are never read.  Soft-cap: the scaled
// score passes through soft_cap * tanh(score / soft_cap); the flag is uniform across
// the thread block, so the branch costs nothing measurable when it is off.  Sinks
// (GPT-OSS): a per-head logit joins the final merge's max and denominator, once, with
// no value; the key loop is unchanged.  kSinks is a template flag: the extra live
// value spilled a register in the sm_90 build, and layers without sinks keep today's code.
//
// 8-bit caches (kKv8; int8, fp8 e4m3fn or e5m2, kernels/reference.py): each lane loads
// its VEC bytes as 32-bit words and widens them exactly (common.cuh), so the lane layout
// is the query dtype's.  With row scales, the key's scale multiplies the reduced score
// and the value's the probability that weights its row: one multiply per key each.

#include <math.h>

#include "common.cuh"
#include "pagedserve_cuda.h"

namespace pagedserve {
namespace {

constexpr int kNumWarps = 4;
constexpr int kNumThreads = kNumWarps * 32;

template <typename T, int HEAD_SIZE, bool kSinks, bool kKv8>
__global__ void __launch_bounds__(kNumThreads)
    paged_attention_decode_kernel(ps_paged_attention_params p) {
  constexpr int VEC = VecWidth<T>::value;
  static_assert(HEAD_SIZE % VEC == 0, "head_size must be a multiple of a 16-byte vector");
  constexpr int NUM_VECS = HEAD_SIZE / VEC;
  constexpr int TPK = next_pow2(NUM_VECS) < 32 ? next_pow2(NUM_VECS) : 32;  // lanes per key
  constexpr int VPT = (NUM_VECS + TPK - 1) / TPK;                            // vectors per lane
  constexpr int KEYS_PER_WARP = 32 / TPK;
  constexpr int KEYS_PER_ITER = KEYS_PER_WARP * kNumWarps;
  constexpr int ELEMS = VPT * VEC;

  const int head = blockIdx.x;
  const int seq = blockIdx.y;
  const int kv_head = head / (p.num_heads / p.num_kv_heads);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int key_slot = lane / TPK;
  const int sub = lane % TPK;

  const T* __restrict__ query = static_cast<const T*>(p.query);
  const T* __restrict__ key_cache = static_cast<const T*>(p.key_cache);
  const T* __restrict__ value_cache = static_cast<const T*>(p.value_cache);
  const uint8_t* __restrict__ key_cache8 = static_cast<const uint8_t*>(p.key_cache);
  const uint8_t* __restrict__ value_cache8 = static_cast<const uint8_t*>(p.value_cache);
  const ps_kv_dtype_t kv_dtype = p.kv_dtype;
  const bool rows_scaled = kKv8 && p.kv_rows_scaled != 0;
  T* __restrict__ out = static_cast<T*>(p.out);

  const int q_begin = p.query_start_loc[seq];
  const int q_len = p.query_start_loc[seq + 1] - q_begin;
  const int context_len = p.seq_lens[seq] - q_len;
  const int32_t* __restrict__ block_table = p.block_tables + static_cast<int64_t>(seq) * p.bt_stride_seq;

  __shared__ float s_acc[kNumWarps][HEAD_SIZE];
  __shared__ float s_m[kNumWarps];
  __shared__ float s_l[kNumWarps];

  for (int t = 0; t < q_len; ++t) {
    const int64_t token = q_begin + t;
    const int kv_limit = context_len + t + 1;  // causal: keys [kv_start, kv_limit) are visible
    const int kv_start = p.sliding_window > 0 ? max(0, kv_limit - p.sliding_window) : 0;

    float q[ELEMS];
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int v = sub + i * TPK;
      if (v < NUM_VECS) {
        load_vec_as_float(query + token * p.q_stride_token + head * p.q_stride_head + v * VEC, &q[i * VEC]);
#pragma unroll
        for (int e = 0; e < VEC; ++e) q[i * VEC + e] *= p.scale;
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) q[i * VEC + e] = 0.f;
      }
    }

    float m = -INFINITY;
    float l = 0.f;
    float acc[ELEMS];
#pragma unroll
    for (int e = 0; e < ELEMS; ++e) acc[e] = 0.f;

    const int num_iters = (kv_limit - kv_start + KEYS_PER_ITER - 1) / KEYS_PER_ITER;
    for (int it = 0; it < num_iters; ++it) {
      const int j = kv_start + it * KEYS_PER_ITER + warp * KEYS_PER_WARP + key_slot;
      const bool valid = j < kv_limit;
      int64_t k_base = 0;
      int64_t v_base = 0;
      float score = 0.f;
      float k_scale = 1.f;
      if (valid) {
        const int64_t block = block_table[j / p.block_size];
        const int64_t slot = j % p.block_size;
        k_base = block * p.k_stride_block + slot * p.k_stride_slot + kv_head * p.k_stride_head;
        v_base = block * p.v_stride_block + slot * p.v_stride_slot + kv_head * p.v_stride_head;
#pragma unroll
        for (int i = 0; i < VPT; ++i) {
          const int v = sub + i * TPK;
          if (v < NUM_VECS) {
            float k[VEC];
            if constexpr (kKv8) {
              load_kv8_as_float<VEC>(key_cache8 + k_base + v * VEC, kv_dtype, k);
            } else {
              load_vec_as_float(key_cache + k_base + v * VEC, k);
            }
#pragma unroll
            for (int e = 0; e < VEC; ++e) score += q[i * VEC + e] * k[e];
          }
        }
        if (rows_scaled) k_scale = load_row_scale(key_cache8 + k_base + HEAD_SIZE);
      }
      // Every lane runs the shuffles (invalid keys contribute 0 and are skipped below);
      // xor offsets below TPK stay inside one key group.
#pragma unroll
      for (int mask = TPK / 2; mask > 0; mask >>= 1) score += __shfl_xor_sync(kFullMask, score, mask);
      // Every lane of the key group read the same row scale (1 without scales).
      score *= k_scale;
      if (p.soft_cap > 0.f) score = p.soft_cap * tanhf(score / p.soft_cap);

      if (valid) {
        const float m_new = fmaxf(m, score);
        const float alpha = __expf(m - m_new);  // m = -inf on the first key gives 0
        const float prob = __expf(score - m_new);
        l = l * alpha + prob;
        // The value row's scale folds into the weight of its row (not into l).
        const float weight = rows_scaled ? prob * load_row_scale(value_cache8 + v_base + HEAD_SIZE) : prob;
#pragma unroll
        for (int i = 0; i < VPT; ++i) {
          const int v = sub + i * TPK;
          if (v < NUM_VECS) {
            float val[VEC];
            if constexpr (kKv8) {
              load_kv8_as_float<VEC>(value_cache8 + v_base + v * VEC, kv_dtype, val);
            } else {
              load_vec_as_float(value_cache + v_base + v * VEC, val);
            }
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc[i * VEC + e] = acc[i * VEC + e] * alpha + weight * val[e];
          }
        }
        m = m_new;
      }
    }

    // Merge the key groups of this warp: lanes owning the same dims are TPK apart.
#pragma unroll
    for (int mask = TPK; mask < 32; mask <<= 1) {
      const float m_o = __shfl_xor_sync(kFullMask, m, mask);
      const float l_o = __shfl_xor_sync(kFullMask, l, mask);
      const float m_new = fmaxf(m, m_o);
      // A group that saw no key has m = -inf; guard so -inf - -inf never makes NaN.
      const float a = (m == -INFINITY) ? 0.f : __expf(m - m_new);
      const float b = (m_o == -INFINITY) ? 0.f : __expf(m_o - m_new);
      l = l * a + l_o * b;
#pragma unroll
      for (int e = 0; e < ELEMS; ++e) {
        const float acc_o = __shfl_xor_sync(kFullMask, acc[e], mask);
        acc[e] = acc[e] * a + acc_o * b;
      }
      m = m_new;
    }

    // Merge the warps through shared memory.
    if (key_slot == 0) {
#pragma unroll
      for (int i = 0; i < VPT; ++i) {
        const int v = sub + i * TPK;
        if (v < NUM_VECS) {
#pragma unroll
          for (int e = 0; e < VEC; ++e) s_acc[warp][v * VEC + e] = acc[i * VEC + e];
        }
      }
      if (sub == 0) {
        s_m[warp] = m;
        s_l[warp] = l;
      }
    }
    __syncthreads();

    float m_total = -INFINITY;
#pragma unroll
    for (int w = 0; w < kNumWarps; ++w) m_total = fmaxf(m_total, s_m[w]);
    if (kSinks) m_total = fmaxf(m_total, p.sinks[head]);
    float weight[kNumWarps];
    float l_total = 0.f;
#pragma unroll
    for (int w = 0; w < kNumWarps; ++w) {
      weight[w] = (s_m[w] == -INFINITY) ? 0.f : __expf(s_m[w] - m_total);
      l_total += s_l[w] * weight[w];
    }
    if (kSinks) l_total += __expf(p.sinks[head] - m_total);
    const float inv_l = l_total > 0.f ? 1.f / l_total : 0.f;
    T* out_row = out + token * p.o_stride_token + head * p.o_stride_head;
    for (int d = threadIdx.x; d < HEAD_SIZE; d += kNumThreads) {
      float o = 0.f;
#pragma unroll
      for (int w = 0; w < kNumWarps; ++w) o += s_acc[w][d] * weight[w];
      out_row[d] = from_float<T>(o * inv_l);
    }
    // The next query token of this sequence reuses the shared buffers.
    __syncthreads();
  }
}

template <typename T, int HEAD_SIZE, bool kKv8>
void launch_sinks(const ps_paged_attention_params& p, cudaStream_t stream) {
  const dim3 grid(p.num_heads, p.num_seqs);
  if (p.sinks != nullptr)
    paged_attention_decode_kernel<T, HEAD_SIZE, true, kKv8><<<grid, kNumThreads, 0, stream>>>(p);
  else
    paged_attention_decode_kernel<T, HEAD_SIZE, false, kKv8><<<grid, kNumThreads, 0, stream>>>(p);
}

template <typename T, int HEAD_SIZE>
int launch(const ps_paged_attention_params& p, cudaStream_t stream) {
  if (p.kv_dtype == PS_KV_AS_QUERY)
    launch_sinks<T, HEAD_SIZE, false>(p, stream);
  else
    launch_sinks<T, HEAD_SIZE, true>(p, stream);
  return launch_status();
}

// Head sizes with a compiled kernel; each is one instantiation per dtype.
#define PS_FOR_EACH_HEAD_SIZE(X) X(64) X(80) X(96) X(112) X(128) X(192) X(256)

template <typename T>
int dispatch_head_size(const ps_paged_attention_params& p, cudaStream_t stream) {
  switch (p.head_size) {
#define PS_CASE(HS) \
  case HS:          \
    return launch<T, HS>(p, stream);
    PS_FOR_EACH_HEAD_SIZE(PS_CASE)
#undef PS_CASE
    default:
      return PS_ERR_UNSUPPORTED_HEAD_SIZE;
  }
}

}  // namespace
}  // namespace pagedserve

extern "C" int ps_paged_attention_supports_head_size(int head_size) {
  switch (head_size) {
#define PS_CASE(HS) \
  case HS:          \
    return 1;
    PS_FOR_EACH_HEAD_SIZE(PS_CASE)
#undef PS_CASE
    default:
      return 0;
  }
}

extern "C" int ps_paged_attention_decode(const ps_paged_attention_params* p, void* stream) {
  using namespace pagedserve;
  if (p == nullptr || p->num_kv_heads <= 0 || p->num_heads % p->num_kv_heads != 0 || p->block_size <= 0 ||
      p->sliding_window < 0 || !(p->soft_cap >= 0.f)) {
    return PS_ERR_BAD_ARGUMENT;
  }
  // Row scales belong to 8-bit caches, and an int8 cache always has them.
  switch (p->kv_dtype) {
    case PS_KV_AS_QUERY:
      if (p->kv_rows_scaled) return PS_ERR_BAD_ARGUMENT;
      break;
    case PS_KV_INT8:
      if (!p->kv_rows_scaled) return PS_ERR_BAD_ARGUMENT;
      break;
    case PS_KV_FP8_E4M3:
    case PS_KV_FP8_E5M2:
      break;
    default:
      return PS_ERR_UNSUPPORTED_DTYPE;
  }
  if (p->num_seqs == 0 || p->num_heads == 0) return PS_OK;
  if (p->num_seqs > 65535) return PS_ERR_BAD_ARGUMENT;  // gridDim.y limit
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (p->dtype) {
    case PS_FLOAT32:
      return dispatch_head_size<float>(*p, s);
    case PS_FLOAT16:
      return dispatch_head_size<__half>(*p, s);
    case PS_BFLOAT16:
      return dispatch_head_size<__nv_bfloat16>(*p, s);
    default:
      return PS_ERR_UNSUPPORTED_DTYPE;
  }
}
