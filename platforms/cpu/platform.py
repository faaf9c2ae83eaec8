"""CpuPlatform: host memory, gloo, bf16 where the CPU has native bf16 arithmetic."""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Any

import torch

from pagedserve.kernels.build import read_cpu_features
from pagedserve.platforms.interface import Platform
from pagedserve.platforms.options import CpuOptions

__all__ = ["CpuPlatform", "cpu_flags"]


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags from /proc/cpuinfo (empty where it does not exist)."""
    return read_cpu_features()


def _meminfo(key: str) -> int | None:
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class CpuPlatform(Platform):
    interface_version = "1.5"
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    pin_memory_available = False
    # Host memory is shared with the OS and every other process: take a modest share
    # by default (vLLM's CPU backend likewise defaults to a fixed 4 GiB).
    default_memory_utilization = 0.25
    # A 2048-token prompt chunk costs several decode steps on a CPU: 512 prompt tokens per
    # request, and of all requests together while some decode.  Smaller chunks lowered
    # p99 ITL but added prefill steps to the longest prompts, whose p99 TTFT rose
    # (docs/serving.md#latency-under-load).
    default_long_prefill_token_threshold = 512
    # Decode attention streams each kv head's rows of a block as one contiguous run
    # (head-major storage, allocate_kv_cache), and longer runs read faster; but end to end
    # on Zen 4 (loaded) no larger block was faster on both workloads: 32 tokens 1.03-1.04x
    # on the mixed one, 0.96-0.97x on the fixed one; 64 and 128 no faster on either
    # (docs/benchmarks.md, "Zen 4 KV block size"), and each costs prefix-cache granularity
    # and last-block memory: 16.
    default_block_size = 16
    # Every paged_attention candidate reads fp8 and int8 caches (the reference by
    # dequantizing; the native kernel reads fp8 rows in registers with AVX-512 and
    # otherwise runs on the touched blocks dequantized: kernels/cpu/native.py; the AMX
    # and tuned dispatch send every non-bf16 cache to the native kernel).
    kv_cache_dtypes = ("fp8_e4m3", "fp8_e5m2", "int8")

    def __init__(self, options: CpuOptions | None = None) -> None:
        #: The environment switches, read once here (PAGEDSERVE_CPU_*; platforms/options.py).
        self.options = CpuOptions.from_env() if options is None else options

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        return True, "the host CPU is always available"

    def release_memory(self) -> None:
        """Return the heap pages freed tensors leave to the OS (glibc's ``malloc_trim``):
        torch's CPU tensors come from malloc, which otherwise keeps them for reuse and
        the process's resident memory would not shrink."""
        try:
            libc = ctypes.CDLL("libc.so.6")
        except OSError:  # not glibc: nothing to trim
            return
        libc.malloc_trim(0)

    @property
    def supported_dtypes(self) -> tuple[torch.dtype, ...]:  # type: ignore[override]
        # fp16 matmuls have no fast path on most CPUs: bf16 where the CPU does bf16
        # natively, fp32 otherwise (fp16 still accepted for storage-bound use).
        if "avx512_bf16" in cpu_flags() or "amx_bf16" in cpu_flags():
            return (torch.bfloat16, torch.float32, torch.float16)
        return (torch.float32, torch.bfloat16, torch.float16)

    def total_memory(self) -> int:
        total = _meminfo("MemTotal")
        if total is None:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return total

    def configure_threads(self, threads: int | None, cpu_bind: list[int] | None = None) -> None:
        """See Platform.configure_threads; with ``cpu_bind`` each OpenMP thread of torch's
        pool is pinned to its own core (thread i to the i-th core listed, the calling
        thread being thread 0), as vLLM's CPU backend does, so threads neither migrate
        nor share a core."""
        super().configure_threads(threads, cpu_bind)
        if not cpu_bind:
            return
        from pagedserve.kernels.cpu import load_cpu_kernels

        native = load_cpu_kernels()
        if native is None:  # the loader warned why; the process-wide affinity still holds
            return
        on = native.module.bind_threads(list(cpu_bind))
        if any(c < 0 for c in on):
            raise ValueError(f"cpu_bind: the kernel refused to pin threads to cores {list(cpu_bind)} (got {on})")

    def allocate_kv_cache(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Key and value caches with each kv head's rows of a block stored together.

        The tensors have the reference shape ``[num_blocks, block_size, num_kv_heads,
        head_size]`` (every op, reference or native, indexes them as usual), but their
        storage is ``[num_blocks, num_kv_heads, block_size, head_size]``: a view with
        strides.  The native attention kernel reads strides, and this way each head of a
        block is one contiguous run of ``block_size * head_size`` values, which the
        memory system streams much better than rows interleaved with the other heads'
        (decode attention 1.1-1.3x faster on the default model's shapes,
        docs/kernels_cpu.md).  ``PAGEDSERVE_CPU_KV_LAYOUT=token`` keeps the plain
        token-major storage.

        Plain pages by default.  ``PAGEDSERVE_CPU_HUGE_PAGES=1`` advises the caches onto
        transparent huge pages before first touch (kernels/cpu/hugepages.py), which
        spares TLB misses where the machine grants huge pages cheaply; on the benchmark
        machine the first touch of a huge page (kernel compaction) cost 2 s per GiB
        against 0.35 s for 4 KiB pages, and decode attention ran no faster."""
        from pagedserve.kernels.cpu.hugepages import advise_huge_pages

        shape = self.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
        head_major = (
            len(shape) == 4
            and shape == (num_blocks, block_size, num_kv_heads, head_size)
            and self.options.kv_layout == "head"
        )
        storage = (num_blocks, num_kv_heads, block_size, head_size) if head_major else shape
        caches = (torch.empty(storage, dtype=dtype), torch.empty(storage, dtype=dtype))
        if self.options.huge_pages:
            for t in caches:
                advise_huge_pages(t)
        if head_major:
            caches = tuple(t.transpose(1, 2) for t in caches)
        return caches

    def op_report(self) -> dict[str, Any]:
        """Where the native kernels apply and what ran in this process: ``{"native":
        whether the native kernels are loaded, "attention_head_sizes": the native
        attention's head sizes, "calls": {"<op>:<implementation>": calls}, "fallbacks":
        {"<op>: <reason>": calls}}`` (counters of kernels/cpu/native.py).  Shown by
        ``pagedserve platforms --ops``."""
        from pagedserve.kernels.cpu import native

        kernels = native.load_cpu_kernels(preferred_isa=self.options.isa) if self.options.native_kernels else None
        return {
            "native": kernels is not None,
            "attention_head_sizes": sorted(kernels.head_sizes) if kernels is not None else [],
            **native.op_report(),
        }

    def attention_fallback(self, head_size: int, dtype: torch.dtype) -> str | None:
        """Why paged attention of this head size and dtype runs the torch reference here,
        or None when a native kernel takes it."""
        report = self.op_report()
        if not report["native"]:
            return "native CPU kernels off or not built (PAGEDSERVE_CPU_KERNELS, build errors above)"
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return f"dtype {str(dtype).removeprefix('torch.')} (native: float32, bfloat16, float16)"
        if head_size not in report["attention_head_sizes"]:
            sizes = ", ".join(str(h) for h in report["attention_head_sizes"])
            return f"head size {head_size} (native: {sizes})"
        return None
