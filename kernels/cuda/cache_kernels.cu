// KV-cache kernels in CUDA C++: reshape_and_cache, copy_blocks and swap_blocks, plus
// the error strings of the whole C interface.

#include <cuda_runtime.h>
#include <stdint.h>

#include "common.cuh"
#include "pagedserve_cuda.h"

namespace pagedserve {
namespace {

constexpr int kCacheThreads = 256;

// One block per token.  The kernel moves elements without converting them, so it is
// instantiated on storage types of the element width (fp16 and bf16 share uint16_t).
template <typename T>
__global__ void __launch_bounds__(kCacheThreads)
    reshape_and_cache_kernel(ps_reshape_and_cache_params p) {
  const int64_t token = blockIdx.x;
  const int64_t slot = p.slot_mapping[token];
  if (slot < 0) return;  // padding token
  const int64_t block = slot / p.block_size;
  const int64_t offset = slot % p.block_size;
  const T* __restrict__ key = static_cast<const T*>(p.key);
  const T* __restrict__ value = static_cast<const T*>(p.value);
  T* __restrict__ key_cache = static_cast<T*>(p.key_cache);
  T* __restrict__ value_cache = static_cast<T*>(p.value_cache);
  const int n = p.num_kv_heads * p.head_size;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int h = i / p.head_size;
    const int d = i % p.head_size;
    key_cache[block * p.kc_stride_block + offset * p.kc_stride_slot + h * p.kc_stride_head + d] =
        key[token * p.key_stride_token + h * p.key_stride_head + d];
    value_cache[block * p.vc_stride_block + offset * p.vc_stride_slot + h * p.vc_stride_head + d] =
        value[token * p.value_stride_token + h * p.value_stride_head + d];
  }
}

// One block per (src, dst) pair; V is uint4 when every block starts 16-byte aligned.
template <typename V>
__global__ void __launch_bounds__(kCacheThreads)
    copy_blocks_kernel(const V* __restrict__ src, V* __restrict__ dst, const int64_t* __restrict__ mapping,
                       int64_t block_elems) {
  const int64_t src_block = mapping[2 * static_cast<int64_t>(blockIdx.x)];
  const int64_t dst_block = mapping[2 * static_cast<int64_t>(blockIdx.x) + 1];
  const V* s = src + src_block * block_elems;
  V* d = dst + dst_block * block_elems;
  for (int64_t i = threadIdx.x; i < block_elems; i += blockDim.x) d[i] = s[i];
}

}  // namespace
}  // namespace pagedserve

extern "C" int ps_reshape_and_cache(const ps_reshape_and_cache_params* p, void* stream) {
  using namespace pagedserve;
  if (p == nullptr || p->block_size <= 0 || p->num_tokens < 0) return PS_ERR_BAD_ARGUMENT;
  if (p->num_tokens == 0) return PS_OK;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (p->dtype) {
    case PS_FLOAT32:
      reshape_and_cache_kernel<uint32_t><<<p->num_tokens, kCacheThreads, 0, s>>>(*p);
      break;
    case PS_FLOAT16:
    case PS_BFLOAT16:
      reshape_and_cache_kernel<uint16_t><<<p->num_tokens, kCacheThreads, 0, s>>>(*p);
      break;
    default:
      return PS_ERR_UNSUPPORTED_DTYPE;
  }
  return launch_status();
}

extern "C" int ps_copy_blocks(const void* src, void* dst, const int64_t* mapping, int num_pairs,
                              int64_t block_bytes, void* stream) {
  using namespace pagedserve;
  if (num_pairs < 0 || block_bytes < 0) return PS_ERR_BAD_ARGUMENT;
  if (num_pairs == 0 || block_bytes == 0) return PS_OK;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const bool vec16 = block_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(dst) % 16 == 0;
  if (vec16) {
    copy_blocks_kernel<uint4><<<num_pairs, kCacheThreads, 0, s>>>(
        static_cast<const uint4*>(src), static_cast<uint4*>(dst), mapping, block_bytes / 16);
  } else {
    copy_blocks_kernel<uint8_t><<<num_pairs, kCacheThreads, 0, s>>>(
        static_cast<const uint8_t*>(src), static_cast<uint8_t*>(dst), mapping, block_bytes);
  }
  return launch_status();
}

extern "C" int ps_swap_blocks(const void* src, void* dst, const int64_t* mapping, int num_pairs,
                              int64_t block_bytes, int kind, void* stream) {
  if (num_pairs < 0 || block_bytes < 0 || kind < cudaMemcpyHostToHost || kind > cudaMemcpyDefault) {
    return PS_ERR_BAD_ARGUMENT;
  }
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const char* src_bytes = static_cast<const char*>(src);
  char* dst_bytes = static_cast<char*>(dst);
  for (int i = 0; i < num_pairs; ++i) {
    const int64_t src_block = mapping[2 * i];
    const int64_t dst_block = mapping[2 * i + 1];
    const cudaError_t err = cudaMemcpyAsync(dst_bytes + dst_block * block_bytes, src_bytes + src_block * block_bytes,
                                            block_bytes, static_cast<cudaMemcpyKind>(kind), s);
    if (err != cudaSuccess) return static_cast<int>(err);
  }
  return PS_OK;
}

extern "C" const char* ps_error_string(int code) {
  switch (code) {
    case PS_OK:
      return "success";
    case PS_ERR_UNSUPPORTED_HEAD_SIZE:
      return "no kernel compiled for this head size";
    case PS_ERR_UNSUPPORTED_DTYPE:
      return "unsupported dtype (expected float32, float16 or bfloat16; attention caches also int8 or fp8)";
    case PS_ERR_BAD_ARGUMENT:
      return "invalid argument (shape, count or copy kind)";
    default:
      return code > 0 ? cudaGetErrorString(static_cast<cudaError_t>(code)) : "unknown error";
  }
}
