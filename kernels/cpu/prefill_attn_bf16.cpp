// Paged attention of prefill chunks on AVX-512 BF16 register tiles (CPUs without AMX).
//
// A separate extension (kernels/cpu/prefill_attn.py), compiled with the main kernels'
// arch flags and built only where the CPU has AVX-512 BF16.  It is the AMX kernel's
// scheme (kernels/cpu/attention_amx.cpp) with VDPBF16PS on zmm registers in place of
// the tiles:
//   1. pack: each (sequence, kv head)'s keys and values, read once through the block
//      table, into VNNI order (keys: per 16-key chunk, D/2 rows of 16 keys x a pair of
//      head dimensions; values: per 32-key chunk, 16 rows (pairs of keys) of D x 2),
//      zero past the context to a multiple of 32 keys;
//   2. items (sequence, kv head, tile of kRows query rows, the (token, query head)
//      pairs of one kv head's group): per span of kSpanKeys keys, S = Q K^T as
//      register tiles of 6 rows x 64 keys (one broadcast query pair times four 16-key
//      vectors per VDPBF16PS row), online softmax in float32 (causal mask, scale), P
//      rounded to bf16, O = P V as tiles of 6 rows x 64 head dimensions, acc = acc *
//      alpha + O.
// The native kernel (kernels/cpu/attention.h) computes each score as a 16-lane dot
// product and a horizontal reduction per query row and reads V through on-the-fly
// interleaves for at most 4 rows; here every product is a lane-parallel VDPBF16PS
// whose operands are loaded once per 6 rows, and the packing is shared by all query
// tiles of a sequence, so it pays off for prefill chunks.  Decodes (3 rows against a
// full pack of their context) stay on the native kernel (platforms/cpu/attention_ops.py).
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec.h"

namespace {

using pagedserve_cpu::Avx512;
using pagedserve_cpu::BF16;
using pagedserve_cpu::kNegInf;

constexpr int kSub = 6;          // rows of one register tile
constexpr int kRows = 2 * kSub;  // query rows per item
constexpr int kSpanKeys = 64;    // keys per online-softmax step (a multiple of 32)

struct Params {
  const BF16* query;
  int64_t q_tok, q_head;
  const BF16* kc;
  const BF16* vc;
  int64_t k_block, k_tok, k_head, v_block, v_tok, v_head;
  const int32_t* tables;
  int64_t bt_stride;
  const int32_t* seq_lens;
  const int32_t* qsl;
  BF16* out;
  int64_t o_tok, o_head;
  int num_heads, num_kv_heads, block_size;
  float scale;
};

// The layouts of attention_amx.cpp's Packed (see the file comment).
template <int D>
void pack(const Params& p, int seq, int h, int k0, int k1, int ctx, BF16* kp, BF16* vp) {
  const int32_t* table = p.tables + seq * p.bt_stride;
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37,
                                      5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  auto row = [&](const BF16* cache, int64_t sb, int64_t st, int64_t sh, int k) -> const BF16* {
    return cache + int64_t(table[k / p.block_size]) * sb + int64_t(k % p.block_size) * st + h * sh;
  };
  alignas(64) BF16 zero[D] = {};
  for (int k = k0; k < k1; ++k) {  // keys: a scatter of 32-bit pairs
    const uint32_t* src = reinterpret_cast<const uint32_t*>(k < ctx ? row(p.kc, p.k_block, p.k_tok, p.k_head, k) : zero);
    uint32_t* dst = reinterpret_cast<uint32_t*>(kp + int64_t(k / 16) * 16 * D) + k % 16;
    for (int dp = 0; dp < D / 2; ++dp) dst[dp * 16] = src[dp];
  }
  for (int k = k0; k < k1; k += 2) {  // values: rows k, k + 1 interleaved
    const BF16* a = k < ctx ? row(p.vc, p.v_block, p.v_tok, p.v_head, k) : zero;
    const BF16* b = k + 1 < ctx ? row(p.vc, p.v_block, p.v_tok, p.v_head, k + 1) : zero;
    BF16* dst = vp + int64_t(k / 32) * 32 * D + int64_t((k % 32) / 2) * 2 * D;
    for (int d = 0; d < D; d += 32) {
      const __m512i x = _mm512_loadu_si512(a + d), y = _mm512_loadu_si512(b + d);
      _mm512_storeu_si512(dst + 2 * d, _mm512_permutex2var_epi16(x, lo, y));
      _mm512_storeu_si512(dst + 2 * d + 32, _mm512_permutex2var_epi16(x, hi, y));
    }
  }
}

struct Item {
  int seq, h, r0;
  int64_t cost;
};

inline __m512bh pair_of(const BF16* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return (__m512bh)_mm512_set1_epi32(v);
}

template <int D>
struct Bf16Attention {
  static_assert(D % 32 == 0, "head size must be a multiple of 32");
  static constexpr int NV = D / 16;

  struct Scratch {
    alignas(64) BF16 q[kRows * D];
    alignas(64) float s[kRows * kSpanKeys];
    alignas(64) BF16 pr[kRows * kSpanKeys];
    alignas(64) float acc[kRows * D];
    float m[kRows], l[kRows], alpha[kRows];
    int pos[kRows];
  };

  // The calling thread's scratch.  Not inlined: with the thread_local's address known
  // inside item(), GCC specialised scores() and values() on it and looked the TLS slot
  // up in every call, spilling all 24 accumulators around the lookup.
  [[gnu::noinline]] static Scratch& scratch() {
    static thread_local Scratch sc;
    return sc;
  }

  // S rows [r0, r0 + kSub) x the NC 16-key chunks from chunk c0 of the packed keys.
  template <int NC>
  static void scores(Scratch& sc, int r0, const BF16* kp, int c0) {
    __m512 acc[kSub][NC];
#pragma GCC unroll 6
    for (int r = 0; r < kSub; ++r)
#pragma GCC unroll 4
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_setzero_ps();
    const BF16* k = kp + int64_t(c0) * 16 * D;
    const BF16* q = sc.q + r0 * D;
    for (int dp = 0; dp < D / 2; ++dp) {
      __m512bh kv[NC];
#pragma GCC unroll 4
      for (int c = 0; c < NC; ++c) kv[c] = (__m512bh)_mm512_loadu_si512(k + c * 16 * D + dp * 32);
#pragma GCC unroll 6
      for (int r = 0; r < kSub; ++r) {
        const __m512bh qp = pair_of(q + r * D + 2 * dp);
#pragma GCC unroll 4
        for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], qp, kv[c]);
      }
    }
#pragma GCC unroll 6
    for (int r = 0; r < kSub; ++r)
#pragma GCC unroll 4
      for (int c = 0; c < NC; ++c) _mm512_storeu_ps(sc.s + (r0 + r) * kSpanKeys + 16 * c, acc[r][c]);
  }

  // acc[r0, r0 + kSub) columns [16 * d0, 16 * (d0 + ND)) = acc * alpha + P V over the
  // n2 32-key chunks from chunk c0 of the packed values.
  template <int ND>
  static void values(Scratch& sc, int r0, const BF16* vp, int c0, int n2, int d0) {
    __m512 o[kSub][ND];
#pragma GCC unroll 6
    for (int r = 0; r < kSub; ++r)
#pragma GCC unroll 4
      for (int c = 0; c < ND; ++c) o[r][c] = _mm512_setzero_ps();
    for (int i = 0; i < n2; ++i) {
      const BF16* v = vp + int64_t(c0 + i) * 32 * D + d0 * 32;
      const BF16* pr = sc.pr + r0 * kSpanKeys + 32 * i;
      for (int kq = 0; kq < 16; ++kq) {  // pairs of keys
        __m512bh vv[ND];
#pragma GCC unroll 4
        for (int c = 0; c < ND; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(v + kq * 2 * D + 32 * c);
#pragma GCC unroll 6
        for (int r = 0; r < kSub; ++r) {
          const __m512bh pp = pair_of(pr + r * kSpanKeys + 2 * kq);
#pragma GCC unroll 4
          for (int c = 0; c < ND; ++c) o[r][c] = _mm512_dpbf16_ps(o[r][c], pp, vv[c]);
        }
      }
    }
#pragma GCC unroll 6
    for (int r = 0; r < kSub; ++r) {
      const __m512 va = _mm512_set1_ps(sc.alpha[r0 + r]);
      float* a = sc.acc + (r0 + r) * D + d0 * 16;
#pragma GCC unroll 4
      for (int c = 0; c < ND; ++c)
        _mm512_storeu_ps(a + 16 * c, _mm512_fmadd_ps(_mm512_loadu_ps(a + 16 * c), va, o[r][c]));
    }
  }

  // Lanes [0, n) of a 16-lane vector (none for n <= 0).
  static __mmask16 keep(int n) {
    return n >= 16 ? __mmask16(0xffff) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1u);
  }

  // exp(x) for x <= 0, as attention_amx.cpp's (the reference's Cephes polynomial with
  // VSCALEFPS; x below -100 flushes to 0).
  static __m512 exp_nonpos(__m512 x) {
    using namespace pagedserve_cpu::expc;
    x = _mm512_max_ps(x, _mm512_set1_ps(-100.f));
    const __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(kC1), x);
    r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(kC2), r);
    __m512 y = _mm512_set1_ps(kP0);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(kP1));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(kP2));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(kP3));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(kP4));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(kP5));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(y, fx);
  }

  // Online softmax of the span's raw scores (keys j0 .. j0 + 32 * n2) for every row, as
  // attention_amx.cpp's: probabilities (bf16) into sc.pr, the rescale into sc.alpha.
  static void softmax(Scratch& sc, int j0, int n2, float scale) {
    const __m512 vscale = _mm512_set1_ps(scale);
    const int w = 32 * n2;
    for (int r = 0; r < kRows; ++r) {
      const int limit = sc.pos[r] - j0 + 1;  // keys of the span this row sees
      const float* s = sc.s + r * kSpanKeys;
      BF16* pr = sc.pr + r * kSpanKeys;
      if (limit <= 0) {
        std::fill_n(reinterpret_cast<uint16_t*>(pr), w, uint16_t(0));
        sc.alpha[r] = 1.f;
        continue;
      }
      const bool full = limit >= w;
      __m512 vmax = _mm512_set1_ps(kNegInf);
      for (int c = 0; c < w; c += 16)
        vmax = full ? _mm512_max_ps(vmax, _mm512_loadu_ps(s + c))
                    : _mm512_mask_max_ps(vmax, keep(limit - c), vmax, _mm512_loadu_ps(s + c));
      const float m_new = std::max(sc.m[r], _mm512_reduce_max_ps(vmax) * scale);
      const __m512 vm = _mm512_set1_ps(m_new);
      __m512 vsum = _mm512_setzero_ps();
      for (int c = 0; c < w; c += 16) {
        __m512 e = exp_nonpos(_mm512_fmsub_ps(_mm512_loadu_ps(s + c), vscale, vm));
        if (!full) e = _mm512_maskz_mov_ps(keep(limit - c), e);
        vsum = _mm512_add_ps(vsum, e);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + c), (__m256i)_mm512_cvtneps_pbh(e));
      }
      const float alpha = sc.m[r] == kNegInf ? 0.f : std::exp(sc.m[r] - m_new);
      sc.alpha[r] = alpha;
      sc.l[r] = sc.l[r] * alpha + _mm512_reduce_add_ps(vsum);
      sc.m[r] = m_new;
    }
  }

  static void item(const Params& p, const Item& it, const BF16* kp, const BF16* vp) {
    Scratch& sc = scratch();
    const int G = p.num_heads / p.num_kv_heads;
    const int q0 = p.qsl[it.seq], q_len = p.qsl[it.seq + 1] - q0;
    const int first_pos = p.seq_lens[it.seq] - q_len;
    const int rows = std::min(kRows, q_len * G - it.r0);
    // A second register tile only where the item has rows for it.
    const int subs = rows > kSub ? 2 : 1;
    const int used = subs * kSub;
    for (int r = 0; r < used; ++r) {
      const int rr = it.r0 + std::min(r, rows - 1);  // padding rows repeat the last one
      const int t = rr / G, g = rr % G;
      std::memcpy(sc.q + r * D, p.query + int64_t(q0 + t) * p.q_tok + int64_t(it.h * G + g) * p.q_head,
                  D * sizeof(BF16));
      sc.pos[r] = first_pos + t;
      sc.m[r] = kNegInf;
      sc.l[r] = 0.f;
    }
    for (int r = used; r < kRows; ++r) sc.pos[r] = -1;  // softmax skips them
    std::fill_n(sc.acc, used * D, 0.f);
    const int key_end = sc.pos[used - 1] + 1;
    for (int j0 = 0; j0 < key_end; j0 += kSpanKeys) {
      const int n2 = (std::min(kSpanKeys, key_end - j0) + 31) / 32;
      for (int s = 0; s < subs; ++s) {
        if (n2 == 2)
          scores<4>(sc, s * kSub, kp, j0 / 16);
        else
          scores<2>(sc, s * kSub, kp, j0 / 16);
      }
      softmax(sc, j0, n2, p.scale);
      for (int s = 0; s < subs; ++s) {
        int d0 = 0;
        for (; d0 + 4 <= NV; d0 += 4) values<4>(sc, s * kSub, vp, j0 / 32, n2, d0);
        if (d0 < NV) values<2>(sc, s * kSub, vp, j0 / 32, n2, d0);  // D % 32 == 0: 2 left
      }
    }
    for (int r = 0; r < rows; ++r) {
      const int rr = it.r0 + r, t = rr / G, g = rr % G;
      BF16* o = p.out + int64_t(q0 + t) * p.o_tok + int64_t(it.h * G + g) * p.o_head;
      const __m512 inv = _mm512_set1_ps(1.f / sc.l[r]);
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v)
        Avx512::store(o + 16 * v, _mm512_mul_ps(_mm512_loadu_ps(sc.acc + r * D + 16 * v), inv));
    }
  }
};

template <class F>
void parallel_dynamic(int64_t n, const F& f) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  std::atomic<int64_t> next{0};
  auto run = [&] {
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n; i = next.fetch_add(1, std::memory_order_relaxed))
      f(i);
  };
  if (threads <= 1) {
    run();
    return;
  }
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { run(); });
}

template <int D>
void run(const Params& p, int num_seqs) {
  const int G = p.num_heads / p.num_kv_heads;
  std::vector<int64_t> offset(num_seqs + 1, 0);  // packed keys of sequence s start at offset[s]
  for (int s = 0; s < num_seqs; ++s) {
    const int q_len = p.qsl[s + 1] - p.qsl[s];
    offset[s + 1] = offset[s] + (q_len > 0 ? (p.seq_lens[s] + 31) / 32 * 32 : 0);
  }
  const int64_t per_head = offset[num_seqs] * D;
  // Reused across calls (grown, never shrunk): fresh pages would cost a fault each.
  static thread_local std::vector<BF16> kbuf, vbuf;
  if (kbuf.size() < size_t(per_head) * p.num_kv_heads) {
    kbuf.resize(size_t(per_head) * p.num_kv_heads);
    vbuf.resize(size_t(per_head) * p.num_kv_heads);
  }
  // Pass 1: pack, in pieces of up to 256 keys.
  constexpr int kPiece = 256;
  struct Piece {
    int seq, h, k0, k1;
  };
  std::vector<Piece> pieces;
  for (int s = 0; s < num_seqs; ++s) {
    const int n = int(offset[s + 1] - offset[s]);
    for (int h = 0; h < p.num_kv_heads; ++h)
      for (int k = 0; k < n; k += kPiece) pieces.push_back({s, h, k, std::min(n, k + kPiece)});
  }
  // Plain pointers: inside the parallel regions below, the name of a thread_local
  // would mean each worker's own (empty) buffer.
  BF16* const kdata = kbuf.data();
  BF16* const vdata = vbuf.data();
  const int64_t* const off = offset.data();
  auto kp = [=](int s, int h) { return kdata + h * per_head + off[s] * D; };
  auto vp = [=](int s, int h) { return vdata + h * per_head + off[s] * D; };
  parallel_dynamic(int64_t(pieces.size()), [&](int64_t i) {
    const Piece& pc = pieces[i];
    pack<D>(p, pc.seq, pc.h, pc.k0, pc.k1, p.seq_lens[pc.seq], kp(pc.seq, pc.h), vp(pc.seq, pc.h));
  });
  // Pass 2: row tiles, costliest first.
  std::vector<Item> items;
  for (int s = 0; s < num_seqs; ++s) {
    const int q_len = p.qsl[s + 1] - p.qsl[s], first_pos = p.seq_lens[s] - q_len;
    for (int h = 0; h < p.num_kv_heads; ++h)
      for (int r0 = 0; r0 < q_len * G; r0 += kRows)
        items.push_back({s, h, r0, int64_t(first_pos + std::min(q_len, (r0 + kRows) / G + 1))});
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  parallel_dynamic(int64_t(items.size()), [&](int64_t i) {
    const Item& it = items[i];
    Bf16Attention<D>::item(p, it, kp(it.seq, it.h), vp(it.seq, it.h));
  });
}

void paged_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                     double scale, at::Tensor out) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query and out must be [num_tokens, num_heads, head_size]");
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes(), "caches must be 4-d and alike");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&query, &key_cache, &value_cache, &out})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->stride(-1) == 1 && t->device().is_cpu(),
                "bf16 prefill attention: bf16 CPU tensors with unit last stride");
  const int num_heads = query.size(1), head_size = query.size(2), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_size && num_heads % num_kv_heads == 0, "head shapes do not match");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt && block_tables.is_contiguous() &&
                  seq_lens.is_contiguous() && query_start_loc.is_contiguous(),
              "metadata must be contiguous int32");
  const int num_seqs = seq_lens.size(0);
  TORCH_CHECK(query_start_loc.size(0) == num_seqs + 1 && block_tables.size(0) >= num_seqs, "metadata sizes");
  Params p{reinterpret_cast<const BF16*>(query.data_ptr()), query.stride(0), query.stride(1),
           reinterpret_cast<const BF16*>(key_cache.data_ptr()), reinterpret_cast<const BF16*>(value_cache.data_ptr()),
           key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
           value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
           block_tables.data_ptr<int32_t>(), block_tables.stride(0), seq_lens.data_ptr<int32_t>(),
           query_start_loc.data_ptr<int32_t>(), reinterpret_cast<BF16*>(out.data_ptr()), out.stride(0),
           out.stride(1), num_heads, num_kv_heads, int(key_cache.size(1)), float(scale)};
  const int64_t nb = key_cache.size(0);
  for (int s = 0; s < num_seqs; ++s) {  // never read through a bad table entry
    const int q_len = p.qsl[s + 1] - p.qsl[s], ctx = p.seq_lens[s];
    TORCH_CHECK_VALUE(q_len >= 0 && ctx >= q_len, "sequence ", s, ": seq_len ", ctx, " < its ", q_len, " query tokens");
    if (q_len == 0) continue;
    const int n_blocks = (ctx + p.block_size - 1) / p.block_size;
    TORCH_CHECK_VALUE(n_blocks <= block_tables.size(1), "sequence ", s, " needs ", n_blocks, " blocks");
    for (int b = 0; b < n_blocks; ++b) {
      const int32_t id = p.tables[s * p.bt_stride + b];
      TORCH_CHECK_VALUE(id >= 0 && id < nb, "sequence ", s, ": block id ", id, " out of range");
    }
  }
  TORCH_CHECK_VALUE(p.qsl[0] >= 0 && p.qsl[num_seqs] <= query.size(0), "query_start_loc outside the query");
  switch (head_size) {
    case 64: return run<64>(p, num_seqs);
    case 96: return run<96>(p, num_seqs);
    case 128: return run<128>(p, num_seqs);
    case 256: return run<256>(p, num_seqs);
    default: TORCH_CHECK(false, "bf16 prefill attention: no kernel for head_size ", head_size);
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("head_sizes", [] { return std::vector<int>{64, 96, 128, 256}; });
  m.def("paged_attention", &paged_attention, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "varlen causal paged attention on AVX-512 BF16 register tiles (writes out)");
}
