// torch extension binding of pagedserve's CUDA kernels.
//
// Checks every tensor (device, dtype, shape, strides, alignment) and raises
// ValueError (TORCH_CHECK_VALUE) naming what is wrong, then calls the plain-pointer
// launch functions of pagedserve_cuda.h on the current CUDA stream.

#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <cstdint>

#include "pagedserve_cuda.h"

namespace {

ps_dtype_t to_ps_dtype(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return PS_FLOAT32;
    case at::kHalf:
      return PS_FLOAT16;
    case at::kBFloat16:
      return PS_BFLOAT16;
    default:
      TORCH_CHECK_VALUE(false, name, " has dtype ", t.scalar_type(), "; expected float32, float16 or bfloat16");
  }
  return PS_FLOAT32;  // unreachable
}

// The attention kernel's reading of a cache of `cache`'s dtype for a query of `query`'s.
ps_kv_dtype_t to_ps_kv_dtype(const at::Tensor& cache, const at::Tensor& query) {
  if (cache.scalar_type() == query.scalar_type()) return PS_KV_AS_QUERY;
  switch (cache.scalar_type()) {
    case at::kChar:
      return PS_KV_INT8;
    case at::kFloat8_e4m3fn:
      return PS_KV_FP8_E4M3;
    case at::kFloat8_e5m2:
      return PS_KV_FP8_E5M2;
    default:
      TORCH_CHECK_VALUE(false, "query, out, key_cache and value_cache must share one dtype, or the caches be int8, ",
                        "float8_e4m3fn or float8_e5m2; got ", query.scalar_type(), " and ", cache.scalar_type());
  }
  return PS_KV_AS_QUERY;  // unreachable
}

// 8-bit caches are read as 32-bit words: pointers and strides must be 4-byte multiples.
void check_words(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.stride(-1) == 1, name, " must have stride 1 in its last dimension, got strides ", t.strides());
  TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(t.data_ptr()) % 4 == 0, name, " must start on a 4-byte boundary");
  for (int64_t d = 0; d + 1 < t.dim(); ++d) {
    TORCH_CHECK_VALUE(t.stride(d) % 4 == 0, name, " stride ", t.stride(d), " of dim ", d,
                      " is not a multiple of 4 bytes");
  }
}

void check_on(const at::Tensor& t, const char* name, const at::Device& device) {
  TORCH_CHECK_VALUE(t.device() == device, name, " is on ", t.device(), " but the kernel runs on ", device);
}

void check_dim(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK_VALUE(t.dim() == dim, name, " must have ", dim, " dimensions, got shape ", t.sizes());
}

void check_int(const at::Tensor& t, const char* name, at::ScalarType type) {
  TORCH_CHECK_VALUE(t.scalar_type() == type, name, " must have dtype ", type, ", got ", t.scalar_type());
}

// The kernels issue 16-byte vector loads: pointers and row strides must allow them.
void check_vectorizable(const at::Tensor& t, const char* name) {
  const int64_t vec = 16 / t.element_size();
  TORCH_CHECK_VALUE(t.stride(-1) == 1, name, " must have stride 1 in its last dimension, got strides ", t.strides());
  TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name,
                    " must start on a 16-byte boundary (it is an offset view)");
  for (int64_t d = 0; d + 1 < t.dim(); ++d) {
    TORCH_CHECK_VALUE(t.stride(d) % vec == 0, name, " stride ", t.stride(d), " of dim ", d,
                      " is not a multiple of ", vec, " elements (16 bytes)");
  }
}

void check_rc(int rc, const char* what) {
  TORCH_CHECK(rc == PS_OK, what, " failed: ", ps_error_string(rc));
}

void* current_stream(const at::Device& device) {
  return static_cast<void*>(c10::cuda::getCurrentCUDAStream(device.index()).stream());
}

// Attention for decode-shaped batches; out must be preallocated like query.
void paged_attention_decode(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                            int64_t sliding_window, double soft_cap, const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK_VALUE(query.is_cuda(), "query must be a CUDA tensor, got device ", query.device());
  const at::Device device = query.device();
  check_dim(query, "query", 3);
  check_dim(out, "out", 3);
  check_dim(key_cache, "key_cache", 4);
  check_dim(value_cache, "value_cache", 4);
  check_dim(block_tables, "block_tables", 2);
  check_dim(seq_lens, "seq_lens", 1);
  check_dim(query_start_loc, "query_start_loc", 1);
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{out, "out"},
                                {key_cache, "key_cache"}, {value_cache, "value_cache"},
                                {block_tables, "block_tables"}, {seq_lens, "seq_lens"},
                                {query_start_loc, "query_start_loc"}}) {
    check_on(t, name, device);
  }
  const ps_dtype_t dtype = to_ps_dtype(query, "query");
  TORCH_CHECK_VALUE(out.scalar_type() == query.scalar_type() && key_cache.scalar_type() == value_cache.scalar_type(),
                    "query, out, key_cache and value_cache must share one dtype (the caches may be 8-bit, both "
                    "alike); got ", query.scalar_type(), ", ", out.scalar_type(), ", ", key_cache.scalar_type(), ", ",
                    value_cache.scalar_type());
  const ps_kv_dtype_t kv_dtype = to_ps_kv_dtype(key_cache, query);
  check_int(block_tables, "block_tables", at::kInt);
  check_int(seq_lens, "seq_lens", at::kInt);
  check_int(query_start_loc, "query_start_loc", at::kInt);
  TORCH_CHECK_VALUE(out.sizes() == query.sizes(), "out shape ", out.sizes(), " != query shape ", query.sizes());
  TORCH_CHECK_VALUE(key_cache.sizes() == value_cache.sizes(), "key_cache shape ", key_cache.sizes(),
                    " != value_cache shape ", value_cache.sizes());
  const int64_t num_heads = query.size(1);
  const int64_t head_size = query.size(2);
  const int64_t num_kv_heads = key_cache.size(2);
  // 8-bit rows: head_size values, then (int8 always, fp8 optionally) the row's float32 scale.
  const bool rows_scaled = kv_dtype != PS_KV_AS_QUERY && key_cache.size(3) == head_size + 4;
  if (kv_dtype == PS_KV_AS_QUERY) {
    TORCH_CHECK_VALUE(key_cache.size(3) == head_size, "cache head_size ", key_cache.size(3), " != query head_size ",
                      head_size);
  } else if (kv_dtype == PS_KV_INT8) {
    TORCH_CHECK_VALUE(rows_scaled, "an int8 cache needs rows of query head_size + 4 = ", head_size + 4, ", got ",
                      key_cache.size(3));
  } else {
    TORCH_CHECK_VALUE(rows_scaled || key_cache.size(3) == head_size, "an fp8 cache needs rows of query head_size ",
                      head_size, " or head_size + 4 (with their scale), got ", key_cache.size(3));
  }
  TORCH_CHECK_VALUE(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "num_heads=", num_heads,
                    " is not a multiple of num_kv_heads=", num_kv_heads);
  TORCH_CHECK_VALUE(ps_paged_attention_supports_head_size(static_cast<int>(head_size)),
                    "no CUDA paged-attention kernel for head_size ", head_size);
  const int64_t num_seqs = seq_lens.size(0);
  TORCH_CHECK_VALUE(block_tables.size(0) == num_seqs, "block_tables has ", block_tables.size(0), " rows for ",
                    num_seqs, " sequences");
  TORCH_CHECK_VALUE(query_start_loc.size(0) == num_seqs + 1, "query_start_loc has ", query_start_loc.size(0),
                    " entries; expected num_seqs + 1 = ", num_seqs + 1);
  TORCH_CHECK_VALUE(block_tables.stride(1) == 1, "block_tables must be contiguous in its last dimension");
  TORCH_CHECK_VALUE(seq_lens.is_contiguous() && query_start_loc.is_contiguous(),
                    "seq_lens and query_start_loc must be contiguous");
  check_vectorizable(query, "query");
  check_vectorizable(out, "out");
  if (kv_dtype == PS_KV_AS_QUERY) {
    check_vectorizable(key_cache, "key_cache");
    check_vectorizable(value_cache, "value_cache");
  } else {
    check_words(key_cache, "key_cache");
    check_words(value_cache, "value_cache");
  }
  TORCH_CHECK_VALUE(sliding_window >= 0 && sliding_window <= INT32_MAX,
                    "sliding_window must be in [1, 2^31) (0: none), got ", sliding_window);
  TORCH_CHECK_VALUE(soft_cap >= 0, "soft_cap must be > 0 (0: none), got ", soft_cap);

  ps_paged_attention_params p{};
  p.out = out.data_ptr();
  p.query = query.data_ptr();
  p.key_cache = key_cache.data_ptr();
  p.value_cache = value_cache.data_ptr();
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.query_start_loc = query_start_loc.data_ptr<int32_t>();
  p.num_seqs = static_cast<int>(num_seqs);
  p.num_heads = static_cast<int>(num_heads);
  p.num_kv_heads = static_cast<int>(num_kv_heads);
  p.head_size = static_cast<int>(head_size);
  p.block_size = static_cast<int>(key_cache.size(1));
  p.q_stride_token = query.stride(0);
  p.q_stride_head = query.stride(1);
  p.o_stride_token = out.stride(0);
  p.o_stride_head = out.stride(1);
  p.k_stride_block = key_cache.stride(0);
  p.k_stride_slot = key_cache.stride(1);
  p.k_stride_head = key_cache.stride(2);
  p.v_stride_block = value_cache.stride(0);
  p.v_stride_slot = value_cache.stride(1);
  p.v_stride_head = value_cache.stride(2);
  p.bt_stride_seq = block_tables.stride(0);
  p.scale = static_cast<float>(scale);
  p.dtype = dtype;
  p.sliding_window = static_cast<int>(sliding_window);
  p.soft_cap = static_cast<float>(soft_cap);
  p.kv_dtype = kv_dtype;
  p.kv_rows_scaled = rows_scaled ? 1 : 0;
  if (sinks.has_value()) {
    check_on(*sinks, "sinks", device);
    TORCH_CHECK_VALUE(sinks->scalar_type() == at::kFloat && sinks->dim() == 1 && sinks->size(0) == num_heads &&
                          sinks->is_contiguous(),
                      "sinks must be a contiguous float32 [num_heads=", num_heads, "] tensor");
    p.sinks = sinks->data_ptr<float>();
  }
  if (query.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(device);
  check_rc(ps_paged_attention_decode(&p, current_stream(device)), "paged_attention_decode");
}

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK_VALUE(key.is_cuda(), "key must be a CUDA tensor, got device ", key.device());
  const at::Device device = key.device();
  check_dim(key, "key", 3);
  check_dim(value, "value", 3);
  check_dim(key_cache, "key_cache", 4);
  check_dim(value_cache, "value_cache", 4);
  check_dim(slot_mapping, "slot_mapping", 1);
  check_on(value, "value", device);
  check_on(key_cache, "key_cache", device);
  check_on(value_cache, "value_cache", device);
  check_on(slot_mapping, "slot_mapping", device);
  const ps_dtype_t dtype = to_ps_dtype(key, "key");
  TORCH_CHECK_VALUE(value.scalar_type() == key.scalar_type() && key_cache.scalar_type() == key.scalar_type() &&
                        value_cache.scalar_type() == key.scalar_type(),
                    "key, value, key_cache and value_cache must share one dtype (the kernel copies, it does not "
                    "convert); got ", key.scalar_type(), ", ", value.scalar_type(), ", ", key_cache.scalar_type(),
                    ", ", value_cache.scalar_type());
  check_int(slot_mapping, "slot_mapping", at::kLong);
  TORCH_CHECK_VALUE(key.sizes() == value.sizes(), "key shape ", key.sizes(), " != value shape ", value.sizes());
  TORCH_CHECK_VALUE(key_cache.sizes() == value_cache.sizes(), "key_cache shape ", key_cache.sizes(),
                    " != value_cache shape ", value_cache.sizes());
  TORCH_CHECK_VALUE(key_cache.size(2) == key.size(1) && key_cache.size(3) == key.size(2), "key has ", key.size(1),
                    " heads of size ", key.size(2), " but the cache holds ", key_cache.size(2), " heads of size ",
                    key_cache.size(3));
  TORCH_CHECK_VALUE(slot_mapping.size(0) == key.size(0), "slot_mapping has ", slot_mapping.size(0),
                    " entries for ", key.size(0), " tokens");
  TORCH_CHECK_VALUE(slot_mapping.is_contiguous(), "slot_mapping must be contiguous");
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{key, "key"}, {value, "value"},
                                {key_cache, "key_cache"}, {value_cache, "value_cache"}}) {
    TORCH_CHECK_VALUE(t.stride(-1) == 1, name, " must have stride 1 in its last dimension, got strides ",
                      t.strides());
  }

  ps_reshape_and_cache_params p{};
  p.key = key.data_ptr();
  p.value = value.data_ptr();
  p.key_cache = key_cache.data_ptr();
  p.value_cache = value_cache.data_ptr();
  p.slot_mapping = slot_mapping.data_ptr<int64_t>();
  p.num_tokens = static_cast<int>(key.size(0));
  p.num_kv_heads = static_cast<int>(key.size(1));
  p.head_size = static_cast<int>(key.size(2));
  p.block_size = static_cast<int>(key_cache.size(1));
  p.key_stride_token = key.stride(0);
  p.key_stride_head = key.stride(1);
  p.value_stride_token = value.stride(0);
  p.value_stride_head = value.stride(1);
  p.kc_stride_block = key_cache.stride(0);
  p.kc_stride_slot = key_cache.stride(1);
  p.kc_stride_head = key_cache.stride(2);
  p.vc_stride_block = value_cache.stride(0);
  p.vc_stride_slot = value_cache.stride(1);
  p.vc_stride_head = value_cache.stride(2);
  p.dtype = dtype;
  const c10::cuda::CUDAGuard guard(device);
  check_rc(ps_reshape_and_cache(&p, current_stream(device)), "reshape_and_cache");
}

void check_block_pools(const at::Tensor& src, const at::Tensor& dst, const at::Tensor& mapping) {
  TORCH_CHECK_VALUE(src.dim() >= 1 && src.dim() == dst.dim(), "src and dst must be pools [num_blocks, ...] of one rank");
  TORCH_CHECK_VALUE(src.sizes().slice(1) == dst.sizes().slice(1), "src block shape ", src.sizes().slice(1),
                    " != dst block shape ", dst.sizes().slice(1));
  TORCH_CHECK_VALUE(src.scalar_type() == dst.scalar_type(), "src dtype ", src.scalar_type(), " != dst dtype ",
                    dst.scalar_type());
  TORCH_CHECK_VALUE(src.is_contiguous() && dst.is_contiguous(), "src and dst must be contiguous");
  check_dim(mapping, "mapping", 2);
  TORCH_CHECK_VALUE(mapping.size(1) == 2 && mapping.is_contiguous(), "mapping must be a contiguous [n, 2] tensor, got ",
                    mapping.sizes());
  check_int(mapping, "mapping", at::kLong);
}

// Whole-block copy within one device; mapping lives on that device.
void copy_blocks(const at::Tensor& src, at::Tensor& dst, const at::Tensor& mapping) {
  check_block_pools(src, dst, mapping);
  TORCH_CHECK_VALUE(src.is_cuda() && dst.device() == src.device() && mapping.device() == src.device(),
                    "copy_blocks needs src, dst and mapping on one CUDA device; got ", src.device(), ", ",
                    dst.device(), ", ", mapping.device());
  const int64_t block_bytes = src.numel() == 0 ? 0 : src.nbytes() / src.size(0);
  const c10::cuda::CUDAGuard guard(src.device());
  check_rc(ps_copy_blocks(src.data_ptr(), dst.data_ptr(), mapping.data_ptr<int64_t>(),
                          static_cast<int>(mapping.size(0)), block_bytes, current_stream(src.device())),
           "copy_blocks");
}

// Whole-block copy between host and device (or two devices); mapping lives on the host.
// The copies are queued on the current stream of the device involved.
void swap_blocks(const at::Tensor& src, at::Tensor& dst, const at::Tensor& mapping) {
  check_block_pools(src, dst, mapping);
  TORCH_CHECK_VALUE(mapping.device().is_cpu(), "swap_blocks needs mapping on the CPU, got ", mapping.device());
  TORCH_CHECK_VALUE(src.is_cuda() || dst.is_cuda(), "swap_blocks needs at least one CUDA tensor");
  cudaMemcpyKind kind;
  if (src.is_cuda() && dst.is_cuda()) {
    kind = cudaMemcpyDeviceToDevice;
  } else if (src.is_cuda()) {
    kind = cudaMemcpyDeviceToHost;
  } else {
    kind = cudaMemcpyHostToDevice;
  }
  const at::Device device = src.is_cuda() ? src.device() : dst.device();
  const int64_t block_bytes = src.numel() == 0 ? 0 : src.nbytes() / src.size(0);
  const c10::cuda::CUDAGuard guard(device);
  check_rc(ps_swap_blocks(src.data_ptr(), dst.data_ptr(), mapping.data_ptr<int64_t>(),
                          static_cast<int>(mapping.size(0)), block_bytes, static_cast<int>(kind),
                          current_stream(device)),
           "swap_blocks");
}

bool supports_head_size(int64_t head_size) {
  return ps_paged_attention_supports_head_size(static_cast<int>(head_size)) != 0;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pagedserve CUDA kernels (paged attention decode, KV-cache writes and block copies)";
  m.def("paged_attention_decode", &paged_attention_decode,
        "Paged attention for decode-shaped batches (caches in the query's dtype, or int8 / fp8)",
        py::arg("out"), py::arg("query"), py::arg("key_cache"), py::arg("value_cache"), py::arg("block_tables"),
        py::arg("seq_lens"), py::arg("query_start_loc"), py::arg("scale"), py::arg("sliding_window") = 0,
        py::arg("soft_cap") = 0.0, py::arg("sinks") = py::none());
  m.def("reshape_and_cache", &reshape_and_cache, "Write keys/values into the paged cache", py::arg("key"),
        py::arg("value"), py::arg("key_cache"), py::arg("value_cache"), py::arg("slot_mapping"));
  m.def("copy_blocks", &copy_blocks, "Copy whole KV blocks within one device", py::arg("src"), py::arg("dst"),
        py::arg("mapping"));
  m.def("swap_blocks", &swap_blocks, "Copy whole KV blocks between host and device", py::arg("src"),
        py::arg("dst"), py::arg("mapping"));
  m.def("supports_head_size", &supports_head_size, "Whether the decode kernel is compiled for a head size",
        py::arg("head_size"));
}
