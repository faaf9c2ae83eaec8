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

}  // namespace

const IsaKernels* isa_avx512bf16() {
  // 8-bit KV caches: the AVX-512 kernels (the q.k of an fp8 row runs in float32 anyway).
  static const IsaKernels kernels{"avx512bf16",           &attention_bf16,
                                  &elementwise_fns<Avx512Bf16>, &SkinnyLinearBf16::run,
                                  &PackedLinearBf16::run, &PackedLinearBf16::run_gated,
                                  &attention_kv8_fns<Avx512>};
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
