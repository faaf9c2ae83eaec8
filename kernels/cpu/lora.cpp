// Batched multi-LoRA delta (Punica-style SGMV) on the CPU: see
// kernels/lora_reference.py, the specification.
//
// y[i, :] += B[s] @ (A[s] @ x[i, :]) for every row i with s = slots[i] >= 0.
// Rows are independent (each writes its own row of y), so they are split across
// threads; one row's rank-r intermediate stays in registers/L1 and the adapter's A/B
// (a few tens of KiB) stay in cache across the rows of the same adapter.  Products are
// accumulated in float32 whatever the storage dtype; y may be a strided view (a column
// slice of a fused projection's output).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace {

constexpr int64_t TILE = 8;  // rows of one adapter sharing each load of A and B

// One tile of up to TILE rows of the same slot: the shrink reads each row of A once
// for the whole tile, the expand each row of B once.
template <typename T>
void lora_tile(T* yp, int64_t ys0, int64_t ys1, const T* xp, const T* as, const T* bs, const int64_t* rows,
               int64_t m, int64_t k, int64_t r, int64_t out, std::vector<float>& xf, std::vector<float>& t) {
  for (int64_t i = 0; i < m; ++i) {
    const T* xi = xp + rows[i] * k;
    float* xo = xf.data() + i * k;
    for (int64_t c = 0; c < k; ++c) xo[c] = static_cast<float>(xi[c]);
  }
  std::vector<float> af(std::max(k, r));
  for (int64_t j = 0; j < r; ++j) {
    const T* aj = as + j * k;
    for (int64_t c = 0; c < k; ++c) af[c] = static_cast<float>(aj[c]);
    for (int64_t i = 0; i < m; ++i) {
      const float* xo = xf.data() + i * k;
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t c = 0; c < k; ++c) acc += af[c] * xo[c];
      t[i * r + j] = acc;
    }
  }
  for (int64_t o = 0; o < out; ++o) {
    const T* bo = bs + o * r;
    for (int64_t j = 0; j < r; ++j) af[j] = static_cast<float>(bo[j]);
    for (int64_t i = 0; i < m; ++i) {
      const float* ti = t.data() + i * r;
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t j = 0; j < r; ++j) acc += af[j] * ti[j];
      T* y = yp + rows[i] * ys0 + o * ys1;
      // As the reference: the delta rounded to y's dtype, then added.
      *y = static_cast<T>(static_cast<float>(*y) + static_cast<float>(static_cast<T>(acc)));
    }
  }
}

template <typename T>
void lora_rows(const torch::Tensor& y, const torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& b,
               const int64_t* slots) {
  const int64_t n = x.size(0), k = x.size(1), r = a.size(1), out = b.size(1), num_slots = a.size(0);
  // Rows grouped by slot (stable), then cut into tiles: the work items.
  std::vector<int64_t> order;
  order.reserve(n);
  std::vector<std::pair<int64_t, int64_t>> tiles;  // (start in order, slot)
  for (int64_t s = 0; s < num_slots; ++s) {
    const int64_t first = static_cast<int64_t>(order.size());
    for (int64_t i = 0; i < n; ++i)
      if (slots[i] == s) order.push_back(i);
    for (int64_t p = first; p < static_cast<int64_t>(order.size()); p += TILE) tiles.emplace_back(p, s);
  }
  if (tiles.empty()) return;
  const int64_t total = static_cast<int64_t>(order.size());
  T* yp = y.data_ptr<T>();
  const T* xp = x.data_ptr<T>();
  const T* ap = a.data_ptr<T>();
  const T* bp = b.data_ptr<T>();
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, TILE * (k + out) * r));
  at::parallel_for(0, static_cast<int64_t>(tiles.size()), grain, [&](int64_t lo, int64_t hi) {
    std::vector<float> xf(TILE * k), t(TILE * r);
    for (int64_t w = lo; w < hi; ++w) {
      const auto [start, s] = tiles[w];
      int64_t m = std::min<int64_t>(TILE, total - start);
      // A tile never crosses into the next slot's rows.
      while (m > 1 && slots[order[start + m - 1]] != s) --m;
      lora_tile<T>(yp, y.stride(0), y.stride(1), xp, ap + s * r * k, bp + s * out * r, order.data() + start, m,
                   k, r, out, xf, t);
    }
  });
}

torch::Tensor lora_linear(torch::Tensor y, torch::Tensor x, torch::Tensor a, torch::Tensor b, torch::Tensor slots) {
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && a.dim() == 3 && b.dim() == 3 && slots.dim() == 1,
              "lora_linear: y [n, out], x [n, in], lora_a [slots, r, in], lora_b [slots, out, r], slots [n]");
  TORCH_CHECK(x.size(0) == y.size(0) && slots.size(0) == x.size(0), "lora_linear: row counts differ");
  TORCH_CHECK(a.size(2) == x.size(1) && b.size(1) == y.size(1) && b.size(2) == a.size(1) && a.size(0) == b.size(0),
              "lora_linear: lora_a/lora_b shapes do not fit x and y");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && a.scalar_type() == y.scalar_type() &&
              b.scalar_type() == y.scalar_type(), "lora_linear: y, x, lora_a and lora_b must share a dtype");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64, "lora_linear: token_slots must be int64");
  auto xc = x.contiguous();
  auto ac = a.contiguous();
  auto bc = b.contiguous();
  auto sc = slots.contiguous();
  const int64_t* sp = sc.data_ptr<int64_t>();
  const int64_t num_slots = a.size(0);
  for (int64_t i = 0; i < sc.size(0); ++i) {
    TORCH_CHECK(sp[i] >= -1 && sp[i] < num_slots, "lora_linear: slot ", sp[i], " of row ", i,
                " is outside [-1, ", num_slots, ")");
  }
  switch (y.scalar_type()) {
    case torch::kFloat: lora_rows<float>(y, xc, ac, bc, sp); break;
    case torch::kBFloat16: lora_rows<at::BFloat16>(y, xc, ac, bc, sp); break;
    case torch::kHalf: lora_rows<at::Half>(y, xc, ac, bc, sp); break;
    default: TORCH_CHECK(false, "lora_linear: unsupported dtype ", y.scalar_type());
  }
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lora_linear", &lora_linear, "y += B[slot] @ (A[slot] @ x) per row, in place (slot -1: none)");
}
