// Device helpers shared by pagedserve's CUDA kernels: dtype conversion, 16-byte
// vector loads and 8-bit KV values.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
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

// One 8-bit KV value (kernels/reference.py) as its exact float32 value: int8 as an
// integer; fp8 through float16, which holds every e4m3fn and e5m2 value (NaN and e5m2's
// infinities included).  cuda_fp8.h converts with one instruction on sm_89+ and in
// integer code before.  `fmt` is uniform across the thread block.
__device__ __forceinline__ float kv8_to_float(uint32_t byte, ps_kv_dtype_t fmt) {
  if (fmt == PS_KV_INT8) return static_cast<float>(static_cast<int8_t>(byte));
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(byte),
                                                fmt == PS_KV_FP8_E4M3 ? __NV_E4M3 : __NV_E5M2);
  return __half2float(__half(h));
}

// Load N consecutive 8-bit KV values at `ptr` (4-byte aligned: rows of head_size + 4
// bytes are no more) as 32-bit words and widen them to float.
template <int N>
__device__ __forceinline__ void load_kv8_as_float(const uint8_t* ptr, ps_kv_dtype_t fmt, float* dst) {
  static_assert(N % 4 == 0, "8-bit KV values are loaded four at a time");
#pragma unroll
  for (int w = 0; w < N / 4; ++w) {
    const uint32_t word = __ldg(reinterpret_cast<const unsigned int*>(ptr) + w);
#pragma unroll
    for (int i = 0; i < 4; ++i) dst[4 * w + i] = kv8_to_float((word >> (8 * i)) & 0xffu, fmt);
  }
}

// The float32 scale stored at `ptr` (4-byte aligned), after a row's 8-bit values.
__device__ __forceinline__ float load_row_scale(const uint8_t* ptr) {
  return __ldg(reinterpret_cast<const float*>(ptr));
}

__host__ __device__ constexpr int next_pow2(int n) { return n <= 1 ? 1 : 2 * next_pow2((n + 1) / 2); }

// Turn the launch status into this interface's return code (0 or a cudaError_t).
inline int launch_status() { return static_cast<int>(cudaGetLastError()); }

}  // namespace pagedserve
