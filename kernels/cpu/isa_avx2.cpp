// AVX2 + FMA + F16C kernels.  Compiled to nothing when the flags do not enable AVX2.
#include "kernels.h"
#include "vec.h"

#if defined(PAGEDSERVE_HAVE_AVX2)
#include "attention.h"
#include "elementwise.h"

namespace pagedserve_cpu {
const IsaKernels* isa_avx2() {
  static const IsaKernels kernels{"avx2", &attention_fns<Avx2>, &elementwise_fns<Avx2>};
  return &kernels;
}
}  // namespace pagedserve_cpu
#else
namespace pagedserve_cpu {
const IsaKernels* isa_avx2() { return nullptr; }
}  // namespace pagedserve_cpu
#endif
