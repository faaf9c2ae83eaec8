"""Native CPU kernels (C++, AVX-512 / AVX2, threads from torch's OpenMP pool).

Nothing is compiled at import: :func:`load_cpu_kernels` builds or loads them when
the CPU platform registers its ops.  See docs/kernels_cpu.md.
"""

from pagedserve.kernels.cpu.hugepages import advise_huge_pages, empty_huge_pages
from pagedserve.kernels.cpu.native import (
    ISA_ORDER,
    NATIVE_OPS,
    NativeCpuKernels,
    choose_isa,
    load_cpu_kernels,
)

__all__ = [
    "ISA_ORDER",
    "NATIVE_OPS",
    "NativeCpuKernels",
    "advise_huge_pages",
    "choose_isa",
    "empty_huge_pages",
    "load_cpu_kernels",
]
