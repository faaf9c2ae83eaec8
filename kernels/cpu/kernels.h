// Plain-C++ interface between the torch bindings (bindings.cpp) and the kernels
// compiled once per instruction set (isa_*.cpp).  Nothing here includes torch, so
// the per-ISA translation units compile quickly and carry no torch inline code.
#pragma once

#include <cstdint>

namespace pagedserve_cpu {

enum class DType : int32_t {
  kFloat32 = 0,
  kBFloat16 = 1,
  kFloat16 = 2,
  kFloat8E4M3 = 3,
  kFloat8E5M2 = 4,
  kInt8 = 5,  // a KV cache of int8 rows, each followed by its float32 scale
  kFloat8E4M3Scaled = 6,  // 8-bit float KV rows, each followed by its float32 scale
  kFloat8E5M2Scaled = 7,
};

// Head sizes the attention kernel is instantiated for.
constexpr int kHeadSizes[] = {64, 80, 96, 128, 256};

// One call of paged attention.  Strides are in elements; the last dimension of
// query, caches and out is contiguous.
struct AttnParams {
  const void* query;  // [num_tokens, num_heads, head_size]
  int64_t q_stride_tok, q_stride_head;
  const void* key_cache;  // [num_blocks, block_size, num_kv_heads, head_size]
  const void* value_cache;
  int64_t kc_stride_block, kc_stride_tok, kc_stride_head;
  int64_t vc_stride_block, vc_stride_tok, vc_stride_head;
  const int32_t* block_tables;  // [num_seqs, bt_stride]
  int64_t bt_stride;
  const int32_t* seq_lens;         // [num_seqs]
  const int32_t* query_start_loc;  // [num_seqs + 1]
  void* out;                       // [num_tokens, num_heads, head_size]
  int64_t o_stride_tok, o_stride_head;
  int32_t num_heads, num_kv_heads, block_size, head_size;
  float scale;
  // The query at position q sees keys k with q - sliding_window < k <= q; 0: no window.
  // Table entries before the first block any query of a sequence sees are never read
  // (their blocks may have been freed; kernels/reference.py has the contract).
  int32_t sliding_window = 0;
  // Scaled scores s become soft_cap * tanh(s / soft_cap) before the softmax; 0: none.
  float soft_cap = 0.f;
  // float32 [num_heads] per-head sink logits joining each softmax's denominator with
  // no value (GPT-OSS); nullptr: none.  Applied once per output row, when the row's
  // (max, sum) is final: in finish() or, for split contexts, in merge().
  const float* sinks = nullptr;
  // int32 [num_tokens]: query token t sees keys k < key_ends[t] instead of k <= its
  // position (a span attending both ways: Gemma 3's image tokens); nullptr: causal.
  // Each lies in [position + 1, seq_len]; the window still bounds keys from below.
  const int32_t* key_ends = nullptr;
};

// One unit of work: query tokens [tok_begin, tok_end) of a sequence (indices within
// its query range) against keys [ctx_begin, ctx_end) of kv heads [kv_begin, kv_end).  A work item
// with partial_row >= 0 writes (max, sum, unnormalised acc) rows to the partials
// buffer instead of the output; an AttnMerge then combines the splits.
struct AttnWork {
  int32_t seq, kv_begin, kv_end, tok_begin, tok_end, ctx_begin, ctx_end;
  int64_t partial_row;
  int64_t cost;  // estimated (query row x key) pairs, for scheduling only
};

struct AttnMerge {
  int32_t seq, kv_begin, kv_end, tok_begin, tok_end;
  int64_t first_row;   // split s occupies rows first_row + s * rows ...
  int32_t num_splits;  // ... where rows = kv heads * tokens * group
};

using AttnItemFn = void (*)(const AttnParams&, const AttnWork&, float* partials);
using AttnMergeFn = void (*)(const AttnParams&, const AttnMerge&, const float* partials);

struct AttnFns {
  AttnItemFn item = nullptr;
  AttnMergeFn merge = nullptr;
  AttnItemFn item_soft_cap = nullptr;  // item with AttnParams::soft_cap applied
};

// Row-wise element kernels; each processes rows [begin, end).
struct RmsNormArgs {
  const void* x;  // [rows, hidden]
  int64_t x_stride;
  const void* weight;  // [hidden], same dtype as x
  void* out;
  int64_t out_stride;
  int64_t hidden;
  float eps;
};

struct AddRmsNormArgs {  // residual <- x + residual; x <- rms_norm(residual)
  void* x;
  int64_t x_stride;
  void* residual;
  int64_t res_stride;
  const void* weight;
  int64_t hidden;
  float eps;
};

// A float32 residual stream beside activations of the storage type T: residual (float32)
// <- x + residual, with x of T or float32 (x_f32); out (T) <- the normalised row times
// weight (T), computed in float32 and rounded once.  out may be x when x is of T.
struct AddRmsNormF32Args {
  const void* x;
  bool x_f32;
  float* residual;
  const void* weight;
  void* out;
  int64_t hidden;
  float eps;
};

struct RotaryArgs {  // rows are tokens; query and key rotated in place
  const int64_t* positions;
  void* query;
  int64_t q_stride_tok, q_stride_head;
  int32_t num_q_heads;
  void* key;
  int64_t k_stride_tok, k_stride_head;
  int32_t num_k_heads;
  int32_t head_size, rot_dim;
  const float* cos_sin;  // [max_position, rot_dim] = cat(cos, sin)
  int64_t cs_stride;
};

struct SiluMulArgs {
  const void* x;  // [rows, 2 * d]
  int64_t x_stride;
  void* out;  // [rows, d]
  int64_t out_stride;
  int64_t d;
};

struct ArgmaxArgs {  // out[row] = index of the largest value of x[row, :n]
  const void* x;  // [rows, n]
  int64_t x_stride;
  int64_t n;
  int64_t* out;  // [rows]
};

template <class Args>
using RowsFn = void (*)(const Args&, int64_t begin, int64_t end);

struct EltFns {
  RowsFn<RmsNormArgs> rms_norm = nullptr;
  RowsFn<AddRmsNormArgs> fused_add_rms_norm = nullptr;
  RowsFn<RotaryArgs> rotary = nullptr;
  RowsFn<SiluMulArgs> silu_and_mul = nullptr;
  RowsFn<ArgmaxArgs> argmax = nullptr;
  RowsFn<AddRmsNormF32Args> fused_add_rms_norm_f32res = nullptr;
};

// y = x . w^T (+ bias) for a few rows of x, all bf16; columns [n_begin, n_end).
struct LinearArgs {
  const void* x;  // [m, k], rows x_stride apart
  int64_t x_stride;
  const void* w;  // [n, k], rows w_stride apart
  int64_t w_stride;
  const void* bias;  // [n] or nullptr
  void* out;         // [m, n], rows out_stride apart
  int64_t out_stride;
  int64_t m, n, k;
};

using LinearFn = void (*)(const LinearArgs&, int64_t n_begin, int64_t n_end);

// y = x . w^T (+ bias), bf16, with w packed as [n/16][k/2][16][2] (see linear.h);
// rows [m_begin, m_end) x 16-column blocks [nb_begin, nb_end).  The gated kernel
// writes silu(y[:, :n/2]) * y[:, n/2:] instead, out being [m, n/2].
struct PackedLinearArgs {
  const void* x;  // [m, k], rows x_stride apart
  int64_t x_stride;
  const void* w;     // packed, n % 16 == 0 and k % 2 == 0
  const void* bias;  // [n] or nullptr
  void* out;         // [m, n], rows out_stride apart
  int64_t out_stride;
  int64_t m, n, k;
};

using PackedLinearFn = void (*)(const PackedLinearArgs&, int64_t m_begin, int64_t m_end, int64_t nb_begin,
                                int64_t nb_end);

// The kernels of one instruction set.
struct IsaKernels {
  const char* name;
  AttnFns (*attention)(DType dtype, int head_size);
  EltFns (*elementwise)(DType dtype);
  LinearFn linear_bf16 = nullptr;  // only where the CPU multiplies bf16 natively
  PackedLinearFn packed_linear_bf16 = nullptr;  // likewise
  PackedLinearFn packed_linear_silu_bf16 = nullptr;  // likewise; blocks of the d-wide output
  // Attention of a float32 or bf16 query over an 8-bit float KV cache (kv_dtype
  // kFloat8E4M3 or kFloat8E5M2; or kInt8 / kFloat8E4M3Scaled / kFloat8E5M2Scaled rows
  // times their scales), converted to float32 in registers; AVX-512 only.
  AttnFns (*attention_kv8)(DType dtype, DType kv_dtype, int head_size) = nullptr;
};

// Each returns nullptr when the build flags did not enable that instruction set.
const IsaKernels* isa_avx512bf16();
const IsaKernels* isa_avx512();
const IsaKernels* isa_avx2();
const IsaKernels* isa_scalar();

}  // namespace pagedserve_cpu
