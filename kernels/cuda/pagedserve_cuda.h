/*
 * C interface of pagedserve's CUDA kernels.
 *
 * The .cu files implement these functions with plain pointers and element strides so
 * that they compile with nvcc alone; binding.cpp checks torch tensors and calls them.
 * Nothing here includes CUDA or torch headers: streams travel as `void*`
 * (a cudaStream_t).
 *
 * Every function returns 0 on success, a negative PS_ERR_* code for an argument the
 * kernels do not support, or a positive cudaError_t from the launch.
 * ps_error_string() turns any of them into a message.
 */
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  PS_FLOAT32 = 0,
  PS_FLOAT16 = 1,
  PS_BFLOAT16 = 2,
} ps_dtype_t;

/* How the attention kernel reads a KV cache: in the query's dtype, or 8-bit values
 * (int8, fp8 e4m3fn, fp8 e5m2; kernels/reference.py) widened exactly to float32. */
typedef enum {
  PS_KV_AS_QUERY = 0,
  PS_KV_INT8 = 1,
  PS_KV_FP8_E4M3 = 2,
  PS_KV_FP8_E5M2 = 3,
} ps_kv_dtype_t;

enum {
  PS_OK = 0,
  PS_ERR_UNSUPPORTED_HEAD_SIZE = -1,
  PS_ERR_UNSUPPORTED_DTYPE = -2,
  PS_ERR_BAD_ARGUMENT = -3,
};

/* Paged attention for decode-shaped batches (see paged_attention.cu).
 * sliding_window > 0: the query at position q sees keys q - sliding_window < k <= q,
 * and block-table entries before the first block a sequence's queries see are never
 * read (they may name freed blocks).  soft_cap > 0: scaled scores s become
 * soft_cap * tanh(s / soft_cap) before the softmax.  0 turns either off.
 * Layouts (element strides; the last dimension of every tensor is contiguous):
 *   query, out:             [num_tokens, num_heads, head_size]
 *   key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_size]
 *   block_tables:           int32 [num_seqs, >= max blocks of any sequence]
 *   seq_lens:               int32 [num_seqs]
 *   query_start_loc:        int32 [num_seqs + 1]
 * query, out and both caches share one dtype (kv_dtype PS_KV_AS_QUERY); every pointer
 * and every stride times the element size is a multiple of 16 bytes.  Or the caches
 * hold 8-bit values (kv_dtype PS_KV_INT8 / PS_KV_FP8_E4M3 / PS_KV_FP8_E5M2; strides in
 * bytes, the cache pointers and strides multiples of 4 bytes): rows of head_size values
 * (kv_rows_scaled 0, fp8 only), or of head_size values followed by the 4 bytes of the
 * row's float32 scale (kv_rows_scaled 1, int8 always), read as values * scale. */
typedef struct {
  void* out;
  const void* query;
  const void* key_cache;
  const void* value_cache;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
  int num_seqs;
  int num_heads;
  int num_kv_heads;
  int head_size;
  int block_size;
  int64_t q_stride_token, q_stride_head;
  int64_t o_stride_token, o_stride_head;
  int64_t k_stride_block, k_stride_slot, k_stride_head;
  int64_t v_stride_block, v_stride_slot, v_stride_head;
  int64_t bt_stride_seq;
  float scale;
  ps_dtype_t dtype;
  int sliding_window;
  float soft_cap;
  /* float32 [num_heads] sink logits in each softmax denominator (no value), or NULL. */
  const float* sinks;
  ps_kv_dtype_t kv_dtype;
  int kv_rows_scaled;
} ps_paged_attention_params;

int ps_paged_attention_decode(const ps_paged_attention_params* p, void* stream);

/* 1 if ps_paged_attention_decode has a kernel for this head size, else 0. */
int ps_paged_attention_supports_head_size(int head_size);

/* Write keys/values into the paged cache (see cache_kernels.cu).
 *   key, value:             [num_tokens, num_kv_heads, head_size]
 *   key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_size]
 *   slot_mapping:           int64 [num_tokens]; -1 skips the token.
 * All four tensors share one dtype (a copy, no conversion). */
typedef struct {
  const void* key;
  const void* value;
  void* key_cache;
  void* value_cache;
  const int64_t* slot_mapping;
  int num_tokens;
  int num_kv_heads;
  int head_size;
  int block_size;
  int64_t key_stride_token, key_stride_head;
  int64_t value_stride_token, value_stride_head;
  int64_t kc_stride_block, kc_stride_slot, kc_stride_head;
  int64_t vc_stride_block, vc_stride_slot, vc_stride_head;
  ps_dtype_t dtype;
} ps_reshape_and_cache_params;

int ps_reshape_and_cache(const ps_reshape_and_cache_params* p, void* stream);

/* Copy whole blocks within one device: dst[mapping[i][1]] = src[mapping[i][0]].
 * src and dst are contiguous pools of equally sized blocks (block_bytes each);
 * mapping is int64 [num_pairs, 2] in device memory.  No destination block may also
 * be a source block of the same call. */
int ps_copy_blocks(const void* src, void* dst, const int64_t* mapping, int num_pairs,
                   int64_t block_bytes, void* stream);

/* Copy whole blocks between host and device (or two devices) with cudaMemcpyAsync.
 * mapping is int64 [num_pairs, 2] in host memory; kind is a cudaMemcpyKind value. */
int ps_swap_blocks(const void* src, void* dst, const int64_t* mapping, int num_pairs,
                   int64_t block_bytes, int kind, void* stream);

/* A message for a return code of the functions above. */
const char* ps_error_string(int code);

#ifdef __cplusplus
}
#endif
