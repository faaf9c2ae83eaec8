"""The native CPU kernel for GGUF blocks (kernels/cpu/quant_gguf.cpp, the tiled
kernel on repacked weights in quant_gguf_packed.cpp, Q5_0/Q5_1 and the K-quants in
quant_gguf_kquant.cpp, tiled on repacked Q4_K / Q5_K / Q6_K in quant_gguf_kpacked.cpp, Q2_K in
quant_gguf_q2k.cpp, Q3_K row by row and tiled in quant_gguf_q3k.cpp, IQ4_NL's row kernel in
quant_gguf_iq4nl.cpp, IQ4_XS row by row and tiled in quant_gguf_iq4xs.cpp): built just in time
by :func:`pagedserve.kernels.build.load_extension`, into the same persistent cache (and
under the same build lock), as a separate extension so that it never invalidates the
main CPU kernels' build.

The CPU platform loads it unless PAGEDSERVE_QUANT_CPU_KERNELS=0 (read once, into
:class:`pagedserve.platforms.options.CpuOptions`); nothing here reads the environment
but the compiler (CXX) and the arch flags, as every build does.
"""

from __future__ import annotations

import functools
import warnings
from types import ModuleType

from pagedserve.kernels import build

__all__ = ["load_quant_kernels", "quant_build_spec"]

SOURCES: tuple[str, ...] = (
    "quant_gguf.cpp",
    "quant_gguf_packed.cpp",
    "quant_gguf_kquant.cpp",
    "quant_gguf_kpacked.cpp",
    "quant_gguf_q2k.cpp",
    "quant_gguf_q3k.cpp",
    "quant_gguf_iq4nl.cpp",
    "quant_gguf_iq4xs.cpp",
)
#: Headers of the main kernels the gated epilogue includes (its SiLU-and-mul), and
#: IQ4_NL's table (quant_gguf_iq4nl.h, IQ4_XS's too), the GGUF files' shared helpers
#: (quant_gguf_common.h), the tiled kernels' gated epilogue (quant_gguf_gated.h) and their
#: tiling and work split (quant_gguf_tiles.h).
HEADERS: tuple[str, ...] = (
    "elementwise.h",
    "kernels.h",
    "vec.h",
    "quant_gguf_iq4nl.h",
    "quant_gguf_common.h",
    "quant_gguf_gated.h",
    "quant_gguf_tiles.h",
)


def quant_build_spec() -> build.ExtensionSpec:
    """The build of the quantized CPU kernels for this machine (VNNI added where present)."""
    arch, origin = build.cpu_arch_flags()
    features = build.read_cpu_features()
    # The main kernels do not use VNNI, so their automatic flags leave it out.
    if "-mavx512vl" in arch and "avx512_vnni" in features and "-mavx512vnni" not in arch:
        arch = [*arch, "-mavx512vnni"]
    # Q5_x's tiled kernel moves its top bits with gf2p8affineqb in short tiles where the CPU has it.
    if "-mavx512vnni" in arch and "gfni" in features and "-mgfni" not in arch:
        arch = [*arch, "-mgfni"]
    return build.cpu_extension_spec("quant", SOURCES, arch, origin, headers=HEADERS)


@functools.lru_cache(maxsize=1)
def load_quant_kernels() -> ModuleType | None:
    """The compiled module (``gguf_linear``, ``gguf_linear_out``, ``gguf_linear_silu_out``,
    ``gguf_linear_multi_out``, ``isa``, ``has_packed``, ``has_packed_gated``, ``has_kpacked``,
    ``has_kpacked_gated``, ``pack_weight``), or
    None with a warning saying why."""
    try:
        return build.load_extension(quant_build_spec(), "quantized CPU kernels")[0]
    except build.KernelBuildError as exc:
        warnings.warn(f"quantized CPU kernels unavailable ({exc}); using the torch reference", stacklevel=2)
        return None
