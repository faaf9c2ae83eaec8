// Device helpers shared by pagedserve's CUDA kernels: dtype conversion and 16-byte
// vector loads.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "pagedserve_cuda.h"

namespace pagedserve {

constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Elements of T in one 16-byte load: the widest single load a thread can issue.
template <typename T>
struct VecWidth {
  static constexpr int value = 16 / sizeof(T);
};

// Load 16 bytes at `ptr` (16-byte aligned) and widen them to float.
template <typename T>
__device__ __forceinline__ void load_vec_as_float(const T* ptr, float* dst) {
  const uint4 raw = __ldg(reinterpret_cast<const uint4*>(ptr));
  const T* elems = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < VecWidth<T>::value; ++i) dst[i] = to_float(elems[i]);
}

__host__ __device__ constexpr int next_pow2(int n) { return n <= 1 ? 1 : 2 * next_pow2((n + 1) / 2); }

// Turn the launch status into this interface's return code (0 or a cudaError_t).
inline int launch_status() { return static_cast<int>(cudaGetLastError()); }

}  // namespace pagedserve
