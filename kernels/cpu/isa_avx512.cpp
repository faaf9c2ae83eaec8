// AVX-512 kernels; with -mavx512bf16 also the variant whose bf16 attention uses
// VDPBF16PS for q.k.  Compiled to nothing when the flags do not enable AVX-512.
#include "kernels.h"
#include "vec.h"

#if defined(PAGEDSERVE_HAVE_AVX512)
#include "attention.h"
#include "elementwise.h"
#include "linear.h"

namespace pagedserve_cpu {

const IsaKernels* isa_avx512() {
  static const IsaKernels kernels{
      "avx512", &attention_fns<Avx512>, &elementwise_fns<Avx512>, nullptr, nullptr, nullptr,
      &attention_kv8_fns<Avx512>};
  return &kernels;
}

#if defined(PAGEDSERVE_HAVE_AVX512BF16)
namespace {

template <typename KT>
constexpr DType kv8_dtype() {
  if constexpr (std::is_same_v<KT, FP8E4M3>) return DType::kFloat8E4M3;
  if constexpr (std::is_same_v<KT, FP8E5M2>) return DType::kFloat8E5M2;
  if constexpr (std::is_same_v<KT, I8S>) return DType::kInt8;
  if constexpr (std::is_same_v<KT, FP8E4M3S>) return DType::kFloat8E4M3Scaled;
  return DType::kFloat8E5M2Scaled;
}

template <int D>
AttnFns bf16_dot_fns() {
  using K = Attention<Avx512Bf16, BF16, D, QkBf16Dot<D>>;
  using KCap = Attention<Avx512Bf16, BF16, D, QkBf16Dot<D>, true>;
  return {&K::item, &K::merge, &KCap::item};
}

// Only bf16 attention differs from the plain AVX-512 kernels.
AttnFns attention_bf16(DType dtype, int head_size) {
  if (dtype != DType::kBFloat16) return attention_fns<Avx512Bf16>(dtype, head_size);
  switch (head_size) {
    case 64: return bf16_dot_fns<64>();
    case 80: return bf16_dot_fns<80>();
    case 96: return bf16_dot_fns<96>();
    case 128: return bf16_dot_fns<128>();
    case 256: return bf16_dot_fns<256>();
    default: return {};
  }
}

template <int D, typename KT, class Qk>
AttnFns kv8_qk_fns() {
  using K = Attention<Avx512Bf16, BF16, D, Qk, false, KT>;
  using KCap = Attention<Avx512Bf16, BF16, D, Qk, true, KT>;
  return {&K::item, &K::merge, &KCap::item};
}

template <int D, typename KT>
AttnFns kv8_bf16_fns() {
  if constexpr (std::is_same_v<KT, I8S>) {
    if (kv8_bf16_supported() && kv8_vnni_supported()) return kv8_qk_fns<D, KT, QkI8Bf16Dot<D>>();
  } else {
    if (kv8_bf16_supported()) return kv8_qk_fns<D, KT, QkBf16Dot<D>>();
  }
  return attention_kv8_fns<Avx512>(DType::kBFloat16, kv8_dtype<KT>(), D);
}

// 8-bit KV caches with a bf16 query (head sizes of whole 32-value vectors): K rows (and
// fp8 V rows) converted to bf16 once per span and read with VDPBF16PS
// (kv8_rows_to_bf16, AVX512-VBMI); int8 V rows in place with VPDPWSSD (PvI8Wssd,
// AVX512-VNNI).  A float32 query, head size 80 and CPUs without those extensions take
// the AVX-512 kernel (rows widened to float32 in registers).
AttnFns attention_kv8_bf16(DType dtype, DType kv_dtype, int head_size) {
  if (dtype != DType::kBFloat16) return attention_kv8_fns<Avx512>(dtype, kv_dtype, head_size);
  auto by_head = [&](auto kv_tag) -> AttnFns {
    using KT = decltype(kv_tag);
    switch (head_size) {
      case 64: return kv8_bf16_fns<64, KT>();
      case 96: return kv8_bf16_fns<96, KT>();
      case 128: return kv8_bf16_fns<128, KT>();
      case 256: return kv8_bf16_fns<256, KT>();
      default: return attention_kv8_fns<Avx512>(dtype, kv_dtype, head_size);
    }
  };
  switch (kv_dtype) {
    case DType::kFloat8E4M3: return by_head(FP8E4M3{});
    case DType::kFloat8E5M2: return by_head(FP8E5M2{});
    case DType::kInt8: return by_head(I8S{});
    case DType::kFloat8E4M3Scaled: return by_head(FP8E4M3S{});
    case DType::kFloat8E5M2Scaled: return by_head(FP8E5M2S{});
    default: return {};
  }
}

}  // namespace

const IsaKernels* isa_avx512bf16() {
  static const IsaKernels kernels{"avx512bf16",           &attention_bf16,
                                  &elementwise_fns<Avx512Bf16>, &SkinnyLinearBf16::run,
                                  &PackedLinearBf16::run, &PackedLinearBf16::run_gated,
                                  &attention_kv8_bf16};
  return &kernels;
}
#else
const IsaKernels* isa_avx512bf16() { return nullptr; }
#endif

}  // namespace pagedserve_cpu

#else
namespace pagedserve_cpu {
const IsaKernels* isa_avx512() { return nullptr; }
const IsaKernels* isa_avx512bf16() { return nullptr; }
}  // namespace pagedserve_cpu
#endif
