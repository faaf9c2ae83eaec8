// Portable kernels (plain loops the compiler vectorises for whatever the flags
// allow): the path for CPUs and architectures without a hand-written one.
#include "attention.h"
#include "elementwise.h"
#include "kernels.h"
#include "vec.h"

namespace pagedserve_cpu {
const IsaKernels* isa_scalar() {
  static const IsaKernels kernels{"scalar", &attention_fns<Scalar>, &elementwise_fns<Scalar>};
  return &kernels;
}
}  // namespace pagedserve_cpu
