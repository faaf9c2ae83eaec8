"""The facts that explain one benchmark run: threads, OpenMP runtime, huge pages, load,
CPU time, context switches, clock speed, and the engine's steps and batch sizes.

Two passes of the same workload on the same commit can differ by 1.5x on a small
shared machine; these facts, recorded next to each result, say which of the usual
causes was at work (docs/benchmarks.md, "Run-to-run variance").  Standard library
only at import time; torch is imported inside the functions that need it.
"""

from __future__ import annotations

import os
import re
import resource
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RunClock", "engine_step_facts", "process_facts"]

#: Environment variables that change how OpenMP, MKL or malloc behave.
_ENV_PREFIXES = ("OMP_", "KMP_", "GOMP_", "MKL_", "MALLOC_", "LD_PRELOAD", "PAGEDSERVE_CPU_")


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError:
        return None


def _selected(text: str | None) -> str | None:
    """The bracketed choice of a sysfs setting such as ``always [madvise] never``."""
    if text is None:
        return None
    m = re.search(r"\[([^\]]+)\]", text)
    return m.group(1) if m else text.strip()


def _kib(text: str | None, key: str) -> int | None:
    if text is None:
        return None
    m = re.search(rf"^{key}:\s+(\d+) kB", text, re.M)
    return int(m.group(1)) if m else None


def openmp_runtimes() -> list[str]:
    """OpenMP runtimes mapped into this process (two would mean two thread pools)."""
    maps = _read("/proc/self/maps") or ""
    libs = {line.split()[-1] for line in maps.splitlines() if re.search(r"lib(g|i|)omp[^/]*\.so", line)}
    return sorted(libs)


def cpu_mhz() -> list[float]:
    """Each core's current clock in MHz as /proc/cpuinfo reports it."""
    text = _read("/proc/cpuinfo") or ""
    return [float(v) for v in re.findall(r"^cpu MHz\s*:\s*([\d.]+)", text, re.M)]


def process_facts() -> dict[str, Any]:
    """Threads, OpenMP runtime, huge pages and load of this process, now."""
    import torch

    import pagedserve

    smaps = _read("/proc/self/smaps_rollup")
    meminfo = _read("/proc/meminfo")
    return {
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "os_threads": len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else None,
        "affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "openmp_runtimes": openmp_runtimes(),
        # GOMP_SPINCOUNT chosen by `import pagedserve` (pagedserve/__init__.py).
        "omp_wait_policy_set_by_pagedserve": getattr(pagedserve, "OMP_WAIT_POLICY_SET", None),
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(_ENV_PREFIXES)},
        "thp_enabled": _selected(_read("/sys/kernel/mm/transparent_hugepage/enabled")),
        "thp_defrag": _selected(_read("/sys/kernel/mm/transparent_hugepage/defrag")),
        "anon_huge_kib": _kib(smaps, "AnonHugePages"),
        "rss_kib": _kib(smaps, "Rss"),
        "mem_free_kib": _kib(meminfo, "MemFree"),
        "anon_huge_kib_system": _kib(meminfo, "AnonHugePages"),
        "cpu_mhz": cpu_mhz(),
        "loadavg": os.getloadavg(),
    }


@dataclass
class RunClock:
    """Wall time, this process's CPU time and its context switches over a region.

    CPU time over wall time is the cores this process actually got: about the thread
    count when it ran alone, less when other processes took turns on its cores.
    Involuntary context switches count how often the kernel took a core away.
    """

    wall0: float = field(default_factory=time.perf_counter)
    usage0: resource.struct_rusage = field(default_factory=lambda: resource.getrusage(resource.RUSAGE_SELF))

    def stop(self) -> dict[str, Any]:
        wall = time.perf_counter() - self.wall0
        u = resource.getrusage(resource.RUSAGE_SELF)
        cpu = (u.ru_utime - self.usage0.ru_utime) + (u.ru_stime - self.usage0.ru_stime)
        return {
            "wall_s": wall,
            "cpu_s": cpu,
            "cores_used": cpu / wall if wall > 0 else None,
            "involuntary_switches": u.ru_nivcsw - self.usage0.ru_nivcsw,
            "voluntary_switches": u.ru_nvcsw - self.usage0.ru_nvcsw,
            "minor_faults": u.ru_minflt - self.usage0.ru_minflt,
            "cpu_mhz_after": cpu_mhz(),
            "loadavg_after": os.getloadavg(),
        }


def engine_step_facts(before: Any, after: Any) -> dict[str, Any]:
    """Steps and tokens per step between two ``LLMEngine.stats()`` snapshots.

    The same requests scheduled into a different number of steps (a different batch
    composition) would explain a different speed; with the same steps it is not the
    scheduler.
    """
    b = before.iteration_tokens_buckets
    a = after.iteration_tokens_buckets
    steps = (a[-1] if a else 0) - (b[-1] if b else 0)
    tokens = after.iteration_tokens_sum - before.iteration_tokens_sum
    return {
        "steps": steps,
        "batched_tokens": tokens,
        "mean_tokens_per_step": tokens / steps if steps else None,
        "preemptions": after.num_preemptions - before.num_preemptions,
    }
