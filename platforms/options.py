"""The builtin platforms' environment switches, read once into an options object.

A platform reads its switches when it is created (``CpuPlatform().options``,
``CudaPlatform().options``) and hands them to whatever registers its ops or allocates
its memory; nothing reads them again at call time, so a process sees one consistent
set.  Booleans take one spelling everywhere (:func:`env_flag`), and an unrecognised
value is an error naming the variable rather than being silently taken for a default.
The full list of environment variables is in docs/platforms.md ("Environment").
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["env_flag", "env_choice", "env_int", "target_device", "CpuOptions", "GpuOptions"]

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def env_flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    """A boolean switch: 1/true/yes/on or 0/false/no/off (any case); unset or empty: ``default``."""
    raw = env.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"{name}={env[name]!r} is not a boolean: use one of {', '.join(_TRUE + _FALSE)}")


def env_choice(env: Mapping[str, str], name: str, default: str, choices: tuple[str, ...]) -> str:
    """One of ``choices`` (any case); unset or empty: ``default``."""
    raw = env.get(name, "").strip().lower() or default
    if raw not in choices:
        raise ValueError(f"{name}={env[name]!r} is not one of {', '.join(choices)}")
    return raw


def env_int(env: Mapping[str, str], name: str, default: int) -> int:
    """A non-negative integer; unset or empty: ``default``."""
    raw = env.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit():
        raise ValueError(f"{name}={env[name]!r} is not a non-negative integer")
    return int(raw)


def target_device(env: Mapping[str, str] | None = None) -> str | None:
    """The platform named by PAGEDSERVE_TARGET_DEVICE; None when it is unset, empty or
    "auto".  The one place that variable is read."""
    env = os.environ if env is None else env
    name = env.get("PAGEDSERVE_TARGET_DEVICE", "").strip()
    return None if name in ("", "auto") else name


@dataclass(frozen=True)
class CpuOptions:
    """Switches of the builtin cpu platform (docs/kernels_cpu.md)."""

    #: PAGEDSERVE_CPU_KERNELS: the native kernels (off: every op is the torch reference,
    #: quantized and packed ones included).
    native_kernels: bool = True
    #: PAGEDSERVE_QUANT_CPU_KERNELS: the native GGUF kernel alone.
    quant_kernels: bool = True
    #: PAGEDSERVE_CPU_ISA: run this compiled instruction set instead of the best one
    #: (avx512bf16, avx512, avx2, scalar; one that cannot run here is ignored with a warning).
    isa: str | None = None
    #: PAGEDSERVE_CPU_PREPACK: pack bf16 linear weights at load.
    prepack: bool = True
    #: PAGEDSERVE_CPU_TUNE: choose bf16 linear kernels by timing them on the model's
    #: shapes (platforms/cpu/tuning.py; off: the static order, native packed first).
    tune: bool = True
    #: PAGEDSERVE_CPU_TUNE_DUAL_MB: memory (MiB) for weights kept in a second layout
    #: where the tuned kernels of two layouts win different row counts (0: never).
    tune_dual_mb: int = 1024
    #: PAGEDSERVE_CPU_GGUF_REPACK: repack GGUF blocks at load for the tiled int8 GEMM
    #: (off: the row-by-row kernel on the file's blocks).
    gguf_repack: bool = True
    #: PAGEDSERVE_CPU_GGUF_AMX: repacked GGUF linears of at least ``GGUF_AMX_MIN_ROWS``
    #: rows on AMX int8 tiles where the CPU has them (bit for bit the VNNI kernel's
    #: result; off by default: 1.0-1.3x the VNNI kernel, docs/kernels_cpu.md).
    gguf_amx: bool = False
    #: PAGEDSERVE_CPU_GGUF_AMX_BF16: with measured dispatch on (``tune``), repacked GGUF
    #: Q4_0/Q4_1/Q8_0 linears may run on AMX-BF16 tiles at the row counts where that
    #: measures faster (platforms/cpu/tuned_gguf.py).  Off by default: the two kernels
    #: round differently, so a request's output would depend on how many rows its step
    #: ran with (a prefix-cache hit or another batch could change a greedy answer); off,
    #: the default GGUF path stays batch invariant.
    gguf_amx_bf16: bool = False
    #: PAGEDSERVE_CPU_KV_LAYOUT: "head" (each kv head's rows of a block together) or "token".
    kv_layout: str = "head"
    #: PAGEDSERVE_CPU_HUGE_PAGES: advise the KV caches onto transparent huge pages.
    huge_pages: bool = False
    #: PAGEDSERVE_CPU_WEIGHT_HUGE_PAGES: put the natively packed bf16 linear weights
    #: side by side on transparent huge pages (kernels/cpu/hugepages.py, HugePageArena).
    weight_huge_pages: bool = True
    #: PAGEDSERVE_CPU_AMX_ATTENTION: prefill attention on AMX tiles where the CPU has AMX,
    #: else on AVX-512 BF16 register tiles where it has those (platforms/cpu/attention_ops.py;
    #: off: the native kernel for every sequence).
    amx_attention: bool = True

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> CpuOptions:
        env = os.environ if env is None else env
        return cls(
            native_kernels=env_flag(env, "PAGEDSERVE_CPU_KERNELS", True),
            quant_kernels=env_flag(env, "PAGEDSERVE_QUANT_CPU_KERNELS", True),
            isa=env.get("PAGEDSERVE_CPU_ISA", "").strip().lower() or None,
            prepack=env_flag(env, "PAGEDSERVE_CPU_PREPACK", True),
            tune=env_flag(env, "PAGEDSERVE_CPU_TUNE", True),
            tune_dual_mb=env_int(env, "PAGEDSERVE_CPU_TUNE_DUAL_MB", 1024),
            gguf_repack=env_flag(env, "PAGEDSERVE_CPU_GGUF_REPACK", True),
            gguf_amx=env_flag(env, "PAGEDSERVE_CPU_GGUF_AMX", False),
            gguf_amx_bf16=env_flag(env, "PAGEDSERVE_CPU_GGUF_AMX_BF16", False),
            kv_layout=env_choice(env, "PAGEDSERVE_CPU_KV_LAYOUT", "head", ("head", "token")),
            huge_pages=env_flag(env, "PAGEDSERVE_CPU_HUGE_PAGES", False),
            weight_huge_pages=env_flag(env, "PAGEDSERVE_CPU_WEIGHT_HUGE_PAGES", True),
            amx_attention=env_flag(env, "PAGEDSERVE_CPU_AMX_ATTENTION", True),
        )


@dataclass(frozen=True)
class GpuOptions:
    """Switches of the builtin cuda and rocm platforms (docs/kernels.md)."""

    #: PAGEDSERVE_CUDA_KERNELS: "triton" or "cuda" (the CUDA C++ kernels; cuda platform only).
    kernels: str = "triton"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> GpuOptions:
        env = os.environ if env is None else env
        return cls(kernels=env_choice(env, "PAGEDSERVE_CUDA_KERNELS", "triton", ("triton", "cuda")))
