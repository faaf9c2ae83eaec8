"""The native CPU kernel of ``rejection_sample`` (kernels/cpu/rejection_sample.cpp):
built just in time through :mod:`pagedserve.kernels.build` into the same persistent
cache, as a separate extension so that it never invalidates the main CPU kernels' build.

PAGEDSERVE_CPU_KERNELS=0 disables it with the other native CPU kernels (the torch
reference then runs).
"""

from __future__ import annotations

import functools
import hashlib
import json
import platform
import sys
import time
import warnings
from types import ModuleType

import torch

from pagedserve.kernels import build, reference

__all__ = ["load_spec_kernels", "spec_build_spec", "rejection_sample", "SOURCE"]

SOURCES: tuple[str, ...] = ("rejection_sample.cpp",)
#: How ``pagedserve platforms --ops`` names this implementation.
SOURCE = "cpu-native-spec"


def spec_build_spec() -> build.CpuBuildSpec:
    """The build for this machine (no instruction-set flags: the kernel is scalar and
    memory-bound; the hash keeps builds of different sources apart)."""
    cflags = tuple(build.BASE_CFLAGS)
    compiler = build.os.environ.get("CXX", "c++")
    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update(name.encode())
        digest.update((build.CPU_DIR / name).read_bytes())
    digest.update(json.dumps([cflags, compiler, torch.__version__, sys.version_info[:2], platform.machine()]).encode())
    name = f"pagedserve_spec_{digest.hexdigest()[:16]}"
    return build.CpuBuildSpec(name=name, directory=build.kernel_cache_root() / name,
                              sources=tuple(build.CPU_DIR / s for s in SOURCES), cflags=cflags,
                              arch_flags=(), arch_origin="portable", compiler=compiler)


@functools.lru_cache(maxsize=1)
def load_spec_kernels() -> ModuleType | None:
    """The compiled module, or None with a warning saying why."""
    spec = spec_build_spec()
    try:
        if spec.so_path.is_file() and spec.stamp_path.is_file():
            return build._import_built(spec)
        build._check_toolchain(spec)
        build._wait_for_other_build(spec.directory / "lock")
        if spec.so_path.is_file() and spec.stamp_path.is_file():
            return build._import_built(spec)
        build._log(f"compiling the speculative-decoding CPU kernel into {spec.directory} (once per machine)")
        start = time.perf_counter()
        module = build._compile(spec, verbose=False)
        spec.stamp_path.write_text(json.dumps({"name": spec.name, "cflags": list(spec.cflags),
                                               "seconds": round(time.perf_counter() - start, 1)}))
        return module
    except build.KernelBuildError as exc:
        warnings.warn(f"speculative-decoding CPU kernel unavailable ({exc}); using the torch reference",
                      stacklevel=2)
        return None


def rejection_sample(draft_token_ids: torch.Tensor, num_draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                     target_probs: torch.Tensor, uniform: torch.Tensor, recover_uniform: torch.Tensor) -> torch.Tensor:
    """``reference.rejection_sample`` through the native kernel (CPU float32 inputs;
    anything else goes to the reference)."""
    tensors = [draft_token_ids, num_draft_tokens, target_probs, uniform, recover_uniform]
    if draft_probs is not None:
        tensors.append(draft_probs)
    if any(t.device.type != "cpu" for t in tensors) or target_probs.dtype != torch.float32 \
            or (draft_probs is not None and draft_probs.dtype != torch.float32):
        return reference.rejection_sample(draft_token_ids, num_draft_tokens, draft_probs, target_probs, uniform,
                                          recover_uniform)
    module = load_spec_kernels()  # built on first use, not when the platform is chosen
    if module is None:
        return reference.rejection_sample(draft_token_ids, num_draft_tokens, draft_probs, target_probs, uniform,
                                          recover_uniform)
    return module.rejection_sample(draft_token_ids, num_draft_tokens, draft_probs, target_probs, uniform,
                                   recover_uniform)
