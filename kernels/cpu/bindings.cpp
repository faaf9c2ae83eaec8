// torch bindings of the native CPU kernels: argument checks, dispatch on dtype, head
// size and instruction set, and threading.
//
// Threads come from torch's own pool (at::parallel_for, OpenMP in torch's CPU
// builds), so there is one OpenMP runtime in the process and torch.set_num_threads()
// governs these kernels as it governs matmuls.
// Narrow includes (not torch/extension.h, which pulls in the whole C++ frontend)
// cut the compile of this file from about a minute to a quarter of that.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <sched.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <set>
#include <thread>
#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "attention_plan.h"
#include "kernels.h"

namespace pagedserve_cpu {
namespace {

// Best first: the Python side picks the first one the running CPU supports.
const std::vector<const IsaKernels*>& compiled() {
  static const std::vector<const IsaKernels*> isas = [] {
    std::vector<const IsaKernels*> v;
    for (const IsaKernels* k : {isa_avx512bf16(), isa_avx512(), isa_avx2(), isa_scalar()})
      if (k != nullptr) v.push_back(k);
    return v;
  }();
  return isas;
}

const IsaKernels& isa_at(int64_t index) {
  const auto& isas = compiled();
  TORCH_CHECK(index >= 0 && index < int64_t(isas.size()), "pagedserve: no compiled instruction set #", index);
  return *isas[index];
}

DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kHalf: return DType::kFloat16;
    case at::kFloat8_e4m3fn: return DType::kFloat8E4M3;
    case at::kFloat8_e5m2: return DType::kFloat8E5M2;
    case at::kChar: return DType::kInt8;
    default: TORCH_CHECK(false, "pagedserve: native CPU kernels do not support dtype ", t.scalar_type());
  }
}

void check_lastdim(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.numel() == 0 || t.stride(-1) == 1, name, " must be contiguous in its last dimension");
}

// f(i) for i in [0, n), indices handed out dynamically to torch's threads.
template <class F>
void parallel_dynamic(int64_t n, const F& f) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1) {
    for (int64_t i = 0; i < n; ++i) f(i);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n;
         i = next.fetch_add(1, std::memory_order_relaxed))
      f(i);
  });
}

// Row kernels: static split, enough rows per thread that decode batches run inline
// without waking the pool.  Up to kSerialElems elements (an rms_norm of 227 rows of
// 576, rotary on 170 tokens of 12 heads x 64) a row kernel takes 2-30 us on one
// core; a parallel region then saves a few us on an idle machine but costs a
// wake-up of the sleeping pool thread, and on a shared machine a barrier that
// waits for a descheduled thread: at 64 rows x 576, 1-6 ms on average against
// 0.1 ms inline (docs/kernels_cpu.md, "Threads").  Rows are independent, so the
// split never changes a result.
constexpr int64_t kSerialElems = int64_t(1) << 17;

template <class F>
void parallel_rows(int64_t rows, int64_t cols, const F& f) {
  const int64_t grain = std::max<int64_t>(1, kSerialElems / std::max<int64_t>(cols, 1));
  at::parallel_for(0, rows, grain, f);
}

// One paged-attention call with every argument checked, ready to run: the int32
// metadata (and sinks, key ends) it reads, held for the call's duration.
struct AttentionCall {
  at::Tensor bt, sl, qsl, sinks, key_ends;
  AttnParams p;
  AttnFns fns;
  AttnItemFn item;
  int num_seqs;
  int64_t head_size;
  at::TensorOptions float_options;
};

AttentionCall prepare_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                                const at::Tensor& block_tables_in, const at::Tensor& seq_lens_in,
                                const at::Tensor& query_start_loc_in, double scale, at::Tensor out, int64_t isa,
                                int64_t sliding_window, double soft_cap, const std::optional<at::Tensor>& sinks_in,
                                const std::optional<at::Tensor>& key_ends_in) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(),
              "query and out must both be [num_tokens, num_heads, head_size]");
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes(),
              "key_cache and value_cache must be [num_blocks, block_size, num_kv_heads, head_size]");
  const bool fp8 = key_cache.scalar_type() == at::kFloat8_e4m3fn || key_cache.scalar_type() == at::kFloat8_e5m2;
  const bool int8 = key_cache.scalar_type() == at::kChar;  // int8 rows + a float32 scale each
  const bool kv8 = key_cache.scalar_type() != query.scalar_type() && (fp8 || int8);
  TORCH_CHECK((kv8 || key_cache.scalar_type() == query.scalar_type()) &&
                  value_cache.scalar_type() == key_cache.scalar_type() && out.scalar_type() == query.scalar_type(),
              "query and out must share one dtype, and the caches that dtype or one 8-bit dtype");
  check_lastdim(query, "query");
  check_lastdim(key_cache, "key_cache");
  check_lastdim(value_cache, "value_cache");
  check_lastdim(out, "out");
  const int num_heads = query.size(1), head_size = query.size(2), num_kv_heads = key_cache.size(2);
  // A row-scaled row carries its float32 scale's 4 bytes: always int8, fp8 when that wide.
  const bool scaled = int8 || (fp8 && key_cache.size(3) == head_size + 4);
  const int row = head_size + (scaled ? 4 : 0);
  TORCH_CHECK(key_cache.size(3) == row, "cache rows of ", key_cache.size(3), " elements for query head_size ", head_size,
              int8 ? " (int8: head_size + 4)" : "");
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "num_heads=", num_heads,
              " is not a multiple of num_kv_heads=", num_kv_heads);
  AttentionCall c;
  c.bt = block_tables_in.to(at::kInt).contiguous();
  c.sl = seq_lens_in.to(at::kInt).contiguous();
  c.qsl = query_start_loc_in.to(at::kInt).contiguous();
  const at::Tensor &bt = c.bt, &sl = c.sl, &qsl = c.qsl;
  TORCH_CHECK(bt.dim() == 2 && sl.dim() == 1 && qsl.dim() == 1 && qsl.size(0) == sl.size(0) + 1 &&
                  bt.size(0) >= sl.size(0),
              "expected block_tables [num_seqs, max_blocks], seq_lens [num_seqs], query_start_loc [num_seqs + 1]");
  c.num_seqs = sl.size(0);
  const IsaKernels& kernels = isa_at(isa);
  TORCH_CHECK(!kv8 || kernels.attention_kv8 != nullptr, "pagedserve: instruction set ", kernels.name,
              " has no attention kernel for 8-bit KV caches");
  DType kv_dtype = kv8 ? dtype_of(key_cache) : DType::kFloat32;
  if (fp8 && scaled)
    kv_dtype = key_cache.scalar_type() == at::kFloat8_e4m3fn ? DType::kFloat8E4M3Scaled : DType::kFloat8E5M2Scaled;
  c.fns = kv8 ? kernels.attention_kv8(dtype_of(query), kv_dtype, head_size) : kernels.attention(dtype_of(query), head_size);
  TORCH_CHECK(c.fns.item != nullptr, "pagedserve: no native attention kernel for head_size ", head_size);
  TORCH_CHECK_VALUE(sliding_window >= 0, "sliding_window must be >= 1 (0: none), got ", sliding_window);
  TORCH_CHECK_VALUE(soft_cap >= 0, "soft_cap must be > 0 (0: none), got ", soft_cap);
  c.item = soft_cap > 0 ? c.fns.item_soft_cap : c.fns.item;
  if (sinks_in.has_value()) {
    c.sinks = sinks_in->to(at::kFloat).contiguous();
    TORCH_CHECK_VALUE(c.sinks.dim() == 1 && c.sinks.size(0) == num_heads, "sinks must be [num_heads=", num_heads,
                      "], got ", c.sinks.sizes());
  }

  c.p = AttnParams{
      query.data_ptr(), query.stride(0), query.stride(1),
      key_cache.data_ptr(), value_cache.data_ptr(),
      key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
      value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
      bt.data_ptr<int32_t>(), bt.size(1), sl.data_ptr<int32_t>(), qsl.data_ptr<int32_t>(),
      out.data_ptr(), out.stride(0), out.stride(1),
      num_heads, num_kv_heads, int32_t(key_cache.size(1)), head_size, float(scale),
      int32_t(std::min<int64_t>(sliding_window, INT32_MAX)), float(soft_cap)};
  if (c.sinks.defined()) c.p.sinks = c.sinks.data_ptr<float>();
  if (key_ends_in.has_value()) {
    c.key_ends = key_ends_in->to(at::kInt).contiguous();
    TORCH_CHECK_VALUE(c.key_ends.dim() == 1 && c.key_ends.size(0) == query.size(0), "key_ends must be [num_tokens=",
                      query.size(0), "], got ", c.key_ends.sizes());
    c.p.key_ends = c.key_ends.data_ptr<int32_t>();
  }
  validate_attention(c.p, c.num_seqs, bt.size(1), key_cache.size(0), query.size(0));
  c.head_size = head_size;
  c.float_options = query.options().dtype(at::kFloat);
  return c;
}

void run_attention(const AttentionCall& c) {
  const AttnPlan plan = plan_attention(c.p, c.num_seqs, at::get_num_threads());
  at::Tensor partials;
  float* pp = nullptr;
  if (plan.partial_rows > 0) {
    partials = at::empty({plan.partial_rows, c.head_size + 2}, c.float_options);
    pp = partials.data_ptr<float>();
  }
  const AttnItemFn item = c.item;
  parallel_dynamic(plan.work.size(), [&](int64_t i) { item(c.p, plan.work[i], pp); });
  parallel_dynamic(plan.merges.size(), [&](int64_t i) { c.fns.merge(c.p, plan.merges[i], pp); });
}

void paged_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                     const at::Tensor& block_tables_in, const at::Tensor& seq_lens_in,
                     const at::Tensor& query_start_loc_in, double scale, at::Tensor out, int64_t isa,
                     int64_t sliding_window, double soft_cap, const std::optional<at::Tensor>& sinks_in,
                     const std::optional<at::Tensor>& key_ends_in) {
  run_attention(prepare_attention(query, key_cache, value_cache, block_tables_in, seq_lens_in, query_start_loc_in,
                                  scale, out, isa, sliding_window, soft_cap, sinks_in, key_ends_in));
}

// A checked cache write: the int64 slots it reads, held for the call's duration.
struct CacheWrite {
  at::Tensor slots;
};

CacheWrite prepare_cache_write(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                               const at::Tensor& value_cache, const at::Tensor& slot_mapping_in) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(), "key and value must be [num_tokens, num_kv_heads, head_size]");
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes() &&
                  key_cache.size(2) == key.size(1) && key_cache.size(3) == key.size(2),
              "caches must be [num_blocks, block_size, num_kv_heads, head_size] matching key");
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() && value.scalar_type() == value_cache.scalar_type(),
              "key/value must have their cache's dtype");
  check_lastdim(key, "key");
  check_lastdim(value, "value");
  check_lastdim(key_cache, "key_cache");
  check_lastdim(value_cache, "value_cache");
  CacheWrite w{slot_mapping_in.to(at::kLong).contiguous()};
  const int64_t num_tokens = key.size(0);
  TORCH_CHECK(w.slots.numel() == num_tokens, "slot_mapping has ", w.slots.numel(), " entries for ", num_tokens,
              " tokens");
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  const int64_t* sm = w.slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t)  // check everything before writing anything
    TORCH_CHECK(sm[t] < num_slots, "slot ", sm[t], " out of range for a cache of ", num_slots, " slots");
  return w;
}

void run_cache_write(const CacheWrite& w, const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                     at::Tensor& value_cache) {
  const int64_t num_tokens = key.size(0), heads = key.size(1), block_size = key_cache.size(1);
  const int64_t* sm = w.slots.data_ptr<int64_t>();
  const int64_t elem = key.element_size(), row_bytes = key.size(2) * elem;
  auto copy = [&](const at::Tensor& src, at::Tensor& dst, int64_t t, int64_t slot) {
    const char* s = static_cast<const char*>(src.data_ptr()) + t * src.stride(0) * elem;
    char* d = static_cast<char*>(dst.data_ptr()) +
              ((slot / block_size) * dst.stride(0) + (slot % block_size) * dst.stride(1)) * elem;
    for (int64_t h = 0; h < heads; ++h)
      std::memcpy(d + h * dst.stride(2) * elem, s + h * src.stride(1) * elem, row_bytes);
  };
  parallel_rows(num_tokens, heads * key.size(2), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      if (sm[t] < 0) continue;  // padding token
      copy(key, key_cache, t, sm[t]);
      copy(value, value_cache, t, sm[t]);
    }
  });
}

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache, at::Tensor value_cache,
                       const at::Tensor& slot_mapping_in) {
  run_cache_write(prepare_cache_write(key, value, key_cache, value_cache, slot_mapping_in), key, value, key_cache,
                  value_cache);
}

EltFns elementwise(const at::Tensor& x, int64_t isa) { return isa_at(isa).elementwise(dtype_of(x)); }

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, int64_t isa) {
  check_lastdim(x, "x");
  const int64_t hidden = x.size(-1);
  TORCH_CHECK(weight.numel() == hidden && weight.scalar_type() == x.scalar_type(),
              "weight must be [hidden] in x's dtype");
  const at::Tensor x2 = x.reshape({-1, hidden}), w = weight.contiguous();
  at::Tensor out = at::empty(x2.sizes(), x.options());
  const RmsNormArgs a{x2.data_ptr(), x2.stride(0), w.data_ptr(), out.data_ptr(), out.stride(0), hidden, float(eps)};
  const auto fn = elementwise(x, isa).rms_norm;
  parallel_rows(x2.size(0), hidden, [&](int64_t b, int64_t e) { fn(a, b, e); });
  return out.view(x.sizes());
}

void fused_add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps, int64_t isa) {
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && x.sizes() == residual.sizes() &&
                  x.scalar_type() == residual.scalar_type() && x.device().is_cpu(),
              "x and residual must be contiguous CPU tensors of one shape and dtype");
  const int64_t hidden = x.size(-1), rows = hidden ? x.numel() / hidden : 0;
  TORCH_CHECK(weight.numel() == hidden && weight.scalar_type() == x.scalar_type(),
              "weight must be [hidden] in x's dtype");
  const at::Tensor w = weight.contiguous();
  const AddRmsNormArgs a{x.data_ptr(), hidden, residual.data_ptr(), hidden, w.data_ptr(), hidden, float(eps)};
  const auto fn = elementwise(x, isa).fused_add_rms_norm;
  parallel_rows(rows, hidden, [&](int64_t b, int64_t e) { fn(a, b, e); });
}

// The float32 residual stream: residual (float32, in place) <- x + residual, with x of
// out's dtype or float32; out <- rms_norm(residual) * weight computed in float32, rounded
// once to out's dtype (weight's).  out may be x (same dtype).
void fused_add_rms_norm_f32res(const at::Tensor& x, at::Tensor residual, const at::Tensor& weight, at::Tensor out,
                               double eps, int64_t isa) {
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && out.is_contiguous() && x.sizes() == residual.sizes() &&
                  out.sizes() == x.sizes() && x.device().is_cpu() && residual.device().is_cpu() &&
                  out.device().is_cpu(),
              "x, residual and out must be contiguous CPU tensors of one shape");
  TORCH_CHECK(residual.scalar_type() == at::kFloat, "the residual must be float32");
  TORCH_CHECK(x.scalar_type() == out.scalar_type() || x.scalar_type() == at::kFloat,
              "x must be float32 or of out's dtype");
  const int64_t hidden = x.size(-1), rows = hidden ? x.numel() / hidden : 0;
  TORCH_CHECK(weight.numel() == hidden && weight.scalar_type() == out.scalar_type(),
              "weight must be [hidden] in out's dtype");
  const at::Tensor w = weight.contiguous();
  const AddRmsNormF32Args a{x.data_ptr(), x.scalar_type() == at::kFloat, residual.data_ptr<float>(), w.data_ptr(),
                            out.data_ptr(), hidden, float(eps)};
  const auto fn = elementwise(out, isa).fused_add_rms_norm_f32res;
  parallel_rows(rows, hidden, [&](int64_t b, int64_t e) { fn(a, b, e); });
}

// A checked rotary call: the int64 positions it reads, held for the call's duration.
struct RotaryCall {
  at::Tensor positions;
  RotaryArgs args;
  RowsFn<RotaryArgs> fn;
};

RotaryCall prepare_rotary(const at::Tensor& positions_in, at::Tensor& query, at::Tensor& key,
                          const at::Tensor& cos_sin_cache, int64_t isa) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && key.size(0) == query.size(0) && key.size(2) == query.size(2) &&
                  key.scalar_type() == query.scalar_type(),
              "query [num_tokens, num_heads, head_size] and key [num_tokens, num_kv_heads, head_size] expected");
  check_lastdim(query, "query");
  check_lastdim(key, "key");
  TORCH_CHECK(cos_sin_cache.dim() == 2 && cos_sin_cache.scalar_type() == at::kFloat && cos_sin_cache.is_contiguous(),
              "cos_sin_cache must be a contiguous float32 [max_position, rotary_dim] tensor");
  const int64_t rot = cos_sin_cache.size(1), num_tokens = query.size(0), max_pos = cos_sin_cache.size(0);
  TORCH_CHECK(rot % 2 == 0 && rot <= query.size(2), "rotary_dim ", rot, " must be even and <= head_size");
  RotaryCall c;
  c.positions = positions_in.to(at::kLong).contiguous();
  TORCH_CHECK(c.positions.numel() == num_tokens, "one position per token expected");
  const int64_t* pos = c.positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "position ", pos[t], " outside the cos/sin cache of ", max_pos);
  c.args = RotaryArgs{pos, query.data_ptr(), query.stride(0), query.stride(1), int32_t(query.size(1)),
                      key.data_ptr(), key.stride(0), key.stride(1), int32_t(key.size(1)),
                      int32_t(query.size(2)), int32_t(rot), cos_sin_cache.data_ptr<float>(), rot};
  c.fn = elementwise(query, isa).rotary;
  return c;
}

void run_rotary(const RotaryCall& c) {
  const RotaryArgs& a = c.args;
  const auto fn = c.fn;
  parallel_rows(c.positions.numel(), int64_t(a.num_q_heads + a.num_k_heads) * a.rot_dim,
                [&](int64_t b, int64_t e) { fn(a, b, e); });
}

void rotary_embedding(const at::Tensor& positions_in, at::Tensor query, at::Tensor key,
                      const at::Tensor& cos_sin_cache, int64_t isa) {
  run_rotary(prepare_rotary(positions_in, query, key, cos_sin_cache, isa));
}

// rotary_embedding, reshape_and_cache and paged_attention in one call (see
// reference.rotary_paged_attention): every argument of the three is checked before
// anything is written; then query and key are rotated in place, key and value written
// into the cache, and the attention runs over it.  The rotation and the write are row
// kernels that run inline at decode sizes (kSerialElems), so a decode step's call opens
// the attention's parallel region(s) and no other.  Same kernels as the three separate
// calls: the same results, bit for bit.
void rotary_paged_attention(const at::Tensor& positions, at::Tensor query, at::Tensor key, const at::Tensor& value,
                            const at::Tensor& cos_sin_cache, at::Tensor key_cache, at::Tensor value_cache,
                            const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                            at::Tensor out, int64_t isa) {
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type(),
              "rotary_paged_attention: the KV cache must be of the keys' dtype (8-bit caches take the separate ops)");
  TORCH_CHECK(key.dim() == 3 && key.size(1) == key_cache.size(2),
              "key must be [num_tokens, num_kv_heads, head_size] matching the cache");
  TORCH_CHECK(query.data_ptr() != key.data_ptr(), "query and key must not share storage");
  const RotaryCall rot = prepare_rotary(positions, query, key, cos_sin_cache, isa);
  const CacheWrite write = prepare_cache_write(key, value, key_cache, value_cache, slot_mapping);
  const AttentionCall attn = prepare_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                               scale, out, isa, 0, 0.0, std::nullopt, std::nullopt);
  run_rotary(rot);
  run_cache_write(write, key, value, key_cache, value_cache);
  run_attention(attn);
}

at::Tensor silu_and_mul(const at::Tensor& x, int64_t isa) {
  check_lastdim(x, "x");
  const int64_t d = x.size(-1) / 2;
  TORCH_CHECK(x.size(-1) == 2 * d, "the last dimension of x must be even");
  const at::Tensor x2 = x.reshape({-1, 2 * d});
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = d;
  at::Tensor out = at::empty(shape, x.options());
  const SiluMulArgs a{x2.data_ptr(), x2.stride(0), out.data_ptr(), d, d};
  const auto fn = elementwise(x, isa).silu_and_mul;
  parallel_rows(x2.size(0), 2 * d, [&](int64_t b, int64_t e) { fn(a, b, e); });
  return out;
}

// weight's rows picked by token ids (see reference.embedding): one copy per row, inline
// at decode sizes (torch's index_select opens a parallel region for 64 rows).  An id
// outside [0, vocab) raises IndexError, as torch's does.
at::Tensor embedding(const at::Tensor& ids_in, const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.device().is_cpu(),
              "weight must be a contiguous CPU [vocab, hidden] tensor");
  TORCH_CHECK(ids_in.dim() == 1 && ids_in.device().is_cpu(), "token ids must be a 1-D CPU tensor");
  const at::Tensor ids = ids_in.to(at::kLong).contiguous();
  const int64_t n = ids.numel(), vocab = weight.size(0), hidden = weight.size(1);
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK_INDEX(id[i] >= 0 && id[i] < vocab, "embedding: token id ", id[i], " outside the vocabulary of ", vocab);
  at::Tensor out = at::empty({n, hidden}, weight.options());
  const int64_t row = hidden * weight.element_size();
  const char* src = static_cast<const char*>(weight.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  parallel_rows(n, hidden, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) std::memcpy(dst + r * row, src + id[r] * row, row);
  });
  return out;
}

// Index of the largest value of each row of a 2-D tensor (see ArgmaxRow).
at::Tensor argmax(const at::Tensor& x, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0, "x must be [rows, n] with n > 0, got ", x.sizes());
  check_lastdim(x, "x");
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  const ArgmaxArgs a{x.data_ptr(), x.stride(0), x.size(1), out.data_ptr<int64_t>()};
  const auto fn = elementwise(x, isa).argmax;
  parallel_rows(x.size(0), x.size(1), [&](int64_t b, int64_t e) { fn(a, b, e); });
  return out;
}

// Structured outputs: logits of disallowed tokens to -inf, in place (see
// reference.apply_token_bitmask).  Memory-bound and branch-light: one pass over the
// row, a word of the mask per 32 logits; whole words of allowed tokens are skipped.
template <typename T>
void bitmask_rows(T* logits, int64_t stride, int64_t vocab, const int32_t* mask, int64_t words,
                  const int64_t* rows, int64_t b, int64_t e) {
  const T neg_inf = T(-std::numeric_limits<float>::infinity());
  for (int64_t i = b; i < e; ++i) {
    T* row = logits + (rows != nullptr ? rows[i] : i) * stride;
    const int32_t* m = mask + i * words;
    for (int64_t w = 0; w * 32 < vocab; ++w) {
      const int64_t base = w * 32, n = std::min<int64_t>(32, vocab - base);
      const uint32_t bits = w < words ? uint32_t(m[w]) : 0u;  // past the mask: padding, disallowed
      if (bits == 0xffffffffu && n == 32) continue;
      for (int64_t j = 0; j < n; ++j)
        if (!((bits >> j) & 1u)) row[base + j] = neg_inf;
    }
  }
}

void apply_token_bitmask(at::Tensor& logits, const at::Tensor& bitmask, const c10::optional<at::Tensor>& indices) {
  TORCH_CHECK(logits.dim() == 2 && bitmask.dim() == 2, "logits [rows, vocab] and bitmask [n, words] expected");
  TORCH_CHECK(bitmask.scalar_type() == at::kInt && bitmask.is_contiguous(), "bitmask must be contiguous int32");
  check_lastdim(logits, "logits");
  const int64_t n = bitmask.size(0);
  const int64_t* rows = nullptr;
  at::Tensor idx;
  if (indices.has_value() && indices->defined()) {
    idx = indices->to(at::kLong).contiguous();
    TORCH_CHECK(idx.numel() == n, "indices must have one entry per bitmask row");
    rows = idx.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i)
      TORCH_CHECK(rows[i] >= 0 && rows[i] < logits.size(0), "indices[", i, "] = ", rows[i], " is out of range");
  } else {
    TORCH_CHECK(n == logits.size(0), "without indices the bitmask needs one row per logits row");
  }
  const int64_t vocab = logits.size(1), words = bitmask.size(1), stride = logits.stride(0);
  const int32_t* mask = bitmask.data_ptr<int32_t>();
  auto run = [&](auto* ptr) {
    at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) { bitmask_rows(ptr, stride, vocab, mask, words, rows, b, e); });
  };
  switch (logits.scalar_type()) {
    case at::kFloat: run(logits.data_ptr<float>()); break;
    case at::kBFloat16: run(logits.data_ptr<at::BFloat16>()); break;
    case at::kHalf: run(logits.data_ptr<at::Half>()); break;
    default: TORCH_CHECK(false, "apply_token_bitmask: unsupported dtype ", logits.scalar_type());
  }
}

bool has_linear(int64_t isa) { return isa_at(isa).linear_bf16 != nullptr; }
bool has_kv8_attention(int64_t isa) { return isa_at(isa).attention_kv8 != nullptr; }

// The linear kernels' optional bias: a contiguous bf16 [n] tensor, or undefined.
at::Tensor bf16_bias(const c10::optional<at::Tensor>& bias, int64_t n) {
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  TORCH_CHECK(bias->numel() == n && bias->scalar_type() == at::kBFloat16, "bias must be bfloat16 [", n, "]");
  return bias->contiguous();
}

// y = x . w^T (+ bias) for a few bf16 rows of x (decode); see linear.h.
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, int64_t isa) {
  const LinearFn fn = isa_at(isa).linear_bf16;
  TORCH_CHECK(fn != nullptr, "pagedserve: instruction set ", isa_at(isa).name, " has no bf16 linear kernel");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [m, k] and weight [n, k] expected, got ",
              x.sizes(), " and ", w.sizes());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 && x.device().is_cpu() &&
                  w.device().is_cpu(),
              "x and weight must be bfloat16 CPU tensors");
  check_lastdim(x, "x");
  check_lastdim(w, "weight");
  const int64_t m = x.size(0), n = w.size(0), k = x.size(1);
  const at::Tensor bc = bf16_bias(bias, n);
  const void* b = bc.defined() ? bc.data_ptr() : nullptr;
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return out;
  const LinearArgs a{x.data_ptr(), x.stride(0), w.data_ptr(), w.stride(0), b, out.data_ptr(), n, m, n, k};
  // Whole tiles of 4 weight rows per thread, about 64 rows at least (a dispatch costs
  // microseconds; a tile of 64 x 576 weights a few hundred nanoseconds).
  const int64_t tiles = (n + 3) / 4;
  at::parallel_for(0, tiles, 16, [&](int64_t t0, int64_t t1) { fn(a, t0 * 4, std::min(n, t1 * 4)); });
  return out;
}

bool has_packed_linear(int64_t isa) { return isa_at(isa).packed_linear_bf16 != nullptr; }

// y = x . w^T (+ bias) with w packed [n/16, k/2, 16, 2] bf16 (see linear.h), any m;
// gated: silu(y[:, :n/2]) * y[:, n/2:].
at::Tensor packed_linear_impl(const at::Tensor& x, const at::Tensor& wp, const c10::optional<at::Tensor>& bias,
                              int64_t isa, bool gated) {
  const PackedLinearFn fn = gated ? isa_at(isa).packed_linear_silu_bf16 : isa_at(isa).packed_linear_bf16;
  TORCH_CHECK(fn != nullptr, "pagedserve: instruction set ", isa_at(isa).name, " has no packed bf16 linear kernel");
  TORCH_CHECK(x.dim() == 2 && wp.dim() == 4 && wp.size(2) == 16 && wp.size(3) == 2 && x.size(1) == 2 * wp.size(1),
              "x [m, k] and a packed weight [n/16, k/2, 16, 2] expected, got ", x.sizes(), " and ", wp.sizes());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && wp.scalar_type() == at::kBFloat16 && x.device().is_cpu() &&
                  wp.device().is_cpu() && wp.is_contiguous(),
              "x and the packed weight must be bfloat16 CPU tensors, the weight contiguous");
  TORCH_CHECK(!gated || wp.size(0) % 2 == 0, "a gated weight [gate; up] needs n/16 even, got n = ", wp.size(0) * 16);
  check_lastdim(x, "x");
  const int64_t m = x.size(0), n = wp.size(0) * 16, k = x.size(1);
  const int64_t n_out = gated ? n / 2 : n, blocks = n_out / 16;
  const at::Tensor bc = bf16_bias(bias, n);
  const void* b = bc.defined() ? bc.data_ptr() : nullptr;
  at::Tensor out = at::empty({m, n_out}, x.options());
  if (m == 0 || n == 0) return out;
  const PackedLinearArgs a{x.data_ptr(), x.stride(0), wp.data_ptr(), b, out.data_ptr(), n_out, m, n, k};
  // Work items: tiles of 4 weight blocks (64 columns; gated: 32 output columns), and row
  // chunks too when there are few tiles per thread.
  const int64_t per_tile = gated ? 2 : 4;
  const int64_t tiles = (blocks + per_tile - 1) / per_tile, threads = at::get_num_threads();
  int64_t chunks = 1;
  while (chunks * 2 <= (m + 5) / 6 && tiles * chunks < 8 * threads) chunks *= 2;
  if (chunks == 1 && threads > 1 && tiles >= threads && tiles % threads != 0) {
    // Up to 11 rows the call streams its weights and whole tiles split unevenly (the
    // default model's o and down projections: 9 tiles, 5 against 4): each thread takes
    // an equal run of 16-column blocks instead, its last tile possibly narrower.
    // Columns are computed alike whatever tile holds them: the output is the same.
    // (Fewer tiles than threads: a weight too small to be worth waking more threads.)
    const int64_t parts = std::min(threads, blocks);
    at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) fn(a, 0, m, blocks * p / parts, blocks * (p + 1) / parts);
    });
    return out;
  }
  const int64_t rows_per = ((m + chunks - 1) / chunks + 5) / 6 * 6;
  at::parallel_for(0, tiles * chunks, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / chunks, c = i % chunks;
      const int64_t mb = c * rows_per, me = std::min(m, mb + rows_per);
      if (mb < me) fn(a, mb, me, t * per_tile, std::min(blocks, t * per_tile + per_tile));
    }
  });
  return out;
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& wp, const c10::optional<at::Tensor>& bias,
                         int64_t isa) {
  return packed_linear_impl(x, wp, bias, isa, false);
}

// silu(x . gate^T) * (x . up^T) for a packed [gate; up] weight (see linear.h).
at::Tensor packed_linear_silu_and_mul(const at::Tensor& x, const at::Tensor& wp,
                                      const c10::optional<at::Tensor>& bias, int64_t isa) {
  return packed_linear_impl(x, wp, bias, isa, true);
}

// Pins thread i of torch's OpenMP pool (the calling thread is thread 0) to core
// cpus[i]; torch.set_num_threads(len(cpus)) must come first.  Returns the core each
// thread runs on afterwards (-1 where the kernel refused the mask).
std::vector<int64_t> bind_threads(const std::vector<int64_t>& cpus) {
  const int64_t n = int64_t(cpus.size());
  TORCH_CHECK(n >= 1 && n == at::get_num_threads(), "bind_threads: ", n, " cores for ", at::get_num_threads(),
              " threads");
  std::vector<int64_t> on(n, -1);
  at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(int(cpus[i]), &set);
      if (sched_setaffinity(0, sizeof set, &set) == 0) on[i] = sched_getcpu();
    }
  });
  return on;
}

// The core each of torch's n pool threads runs on (thread order), to check a binding.
std::vector<int64_t> thread_cpus() {
  const int64_t n = at::get_num_threads();
  std::vector<int64_t> on(n, -1);
  at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) on[i] = sched_getcpu();
  });
  return on;
}

// How many distinct threads run the items of a parallel_dynamic over n items (a check
// that the pool really spawns: see the -fopenmp note in kernels/build.py).
int64_t parallel_thread_count(int64_t n) {
  std::mutex mu;
  std::set<std::thread::id> ids;
  parallel_dynamic(n, [&](int64_t) {
    // Long enough that one thread cannot drain the queue before the others start.
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    std::lock_guard<std::mutex> lock(mu);
    ids.insert(std::this_thread::get_id());
  });
  return int64_t(ids.size());
}

std::vector<std::string> compiled_isa_names() {
  std::vector<std::string> names;
  for (const IsaKernels* k : compiled()) names.emplace_back(k->name);
  return names;
}

std::vector<int> supported_head_sizes() { return {std::begin(kHeadSizes), std::end(kHeadSizes)}; }

// Which compiler-visible features this build has: shown by `--verbose`.
std::map<std::string, bool> build_features() {
  std::map<std::string, bool> f;
#if defined(__AVX512F__)
  f["avx512f"] = true;
#endif
#if defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
  f["avx512bw/vl/dq"] = true;
#endif
#if defined(__AVX512BF16__)
  f["avx512bf16"] = true;
#endif
#if defined(__AVX512VNNI__)
  f["avx512vnni"] = true;
#endif
#if defined(__AVX2__)
  f["avx2"] = true;
#endif
#if defined(__FMA__)
  f["fma"] = true;
#endif
#if defined(__F16C__)
  f["f16c"] = true;
#endif
#if defined(_OPENMP)
  f["openmp"] = true;
#endif
  return f;
}

}  // namespace
}  // namespace pagedserve_cpu

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace k = pagedserve_cpu;
  m.doc() = "pagedserve native CPU kernels";
  // Kernels that take only tensors and numbers run without the GIL (arguments are
  // converted before the release, results after it), so the server's event loop runs
  // beside a long forward pass.  Never on a function that touches Python objects.
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("paged_attention", &k::paged_attention, nogil, "varlen causal paged attention (writes out)");
  m.def("reshape_and_cache", &k::reshape_and_cache, nogil, "write key/value rows into the paged cache");
  m.def("rms_norm", &k::rms_norm, nogil, "RMSNorm over the last dimension");
  m.def("fused_add_rms_norm", &k::fused_add_rms_norm, nogil, "residual += x; x = rms_norm(residual), in place");
  m.def("fused_add_rms_norm_f32res", &k::fused_add_rms_norm_f32res, nogil,
        "float32 residual += x; out = rms_norm(residual) * weight rounded once to out's dtype");
  m.def("rotary_embedding", &k::rotary_embedding, nogil, "neox rotary embedding of query and key, in place");
  m.def("rotary_paged_attention", &k::rotary_paged_attention, nogil,
        "rotary_embedding, reshape_and_cache and paged_attention in one call (writes out)");
  m.def("silu_and_mul", &k::silu_and_mul, nogil, "silu(x[..., :d]) * x[..., d:]");
  m.def("embedding", &k::embedding, nogil, "rows of weight [vocab, hidden] picked by 1-D token ids");
  m.def("argmax", &k::argmax, nogil, "index of the largest value of each row (first of ties, NaN first)");
  m.def("apply_token_bitmask", &k::apply_token_bitmask, nogil, "logits of tokens a bitmask disallows to -inf, in place");
  m.def("compiled_isas", &k::compiled_isa_names, "instruction sets compiled in, best first");
  m.def("supported_head_sizes", &k::supported_head_sizes, "head sizes of the attention kernel");
  m.def("linear", &k::linear, nogil, "bf16 x . weight^T (+ bias) for few rows of x");
  m.def("packed_linear", &k::packed_linear, nogil, "bf16 x . weight^T (+ bias), weight packed [n/16, k/2, 16, 2]");
  m.def("packed_linear_silu_and_mul", &k::packed_linear_silu_and_mul, nogil,
        "silu(x . gate^T) * (x . up^T) for a packed weight [gate; up]");
  m.def("has_packed_linear", &k::has_packed_linear, "whether an instruction set has the packed linear kernel");
  m.def("has_linear", &k::has_linear, "whether an instruction set has the bf16 linear kernel");
  m.def("has_kv8_attention", &k::has_kv8_attention,
        "whether an instruction set's attention reads 8-bit float KV caches (float32/bf16 queries)");
  m.def("bind_threads", &k::bind_threads, "pin OpenMP thread i to core cpus[i]");
  m.def("thread_cpus", &k::thread_cpus, "the core each OpenMP thread runs on");
  m.def("parallel_thread_count", &k::parallel_thread_count, "threads that ran a parallel loop of n items");
  m.def("build_features", &k::build_features, "compiler feature macros seen by this build");
}
