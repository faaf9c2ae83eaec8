"""The native CPU kernel of ``rejection_sample`` (kernels/cpu/rejection_sample.cpp):
built just in time through :mod:`pagedserve.kernels.build` into the same persistent
cache, as a separate extension so that it never invalidates the main CPU kernels' build.

The CPU platform registers it only where its options allow native kernels
(``CpuOptions.native_kernels``: PAGEDSERVE_CPU_KERNELS=0 turns it off with the others);
nothing here reads the environment.
"""

from __future__ import annotations

import functools
import warnings
from types import ModuleType

import torch

from pagedserve.kernels import build, reference

__all__ = ["load_spec_kernels", "spec_build_spec", "rejection_sample", "SOURCE"]

SOURCES: tuple[str, ...] = ("rejection_sample.cpp",)
#: How ``pagedserve platforms --ops`` names this implementation.
SOURCE = "cpu-native-spec"


def spec_build_spec() -> build.ExtensionSpec:
    """The build for this machine (no instruction-set flags: the kernel is scalar and
    memory-bound)."""
    return build.cpu_extension_spec("spec", SOURCES)


@functools.lru_cache(maxsize=1)
def load_spec_kernels() -> ModuleType | None:
    """The compiled module, or None with a warning saying why (built through the one
    native build path, :func:`pagedserve.kernels.build.load_extension`, with its lock)."""
    try:
        return build.load_extension(spec_build_spec(), "the speculative-decoding CPU kernel")[0]
    except build.KernelBuildError as exc:
        warnings.warn(f"speculative-decoding CPU kernel unavailable ({exc}); using the torch reference", stacklevel=2)
        return None


def rejection_sample(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    uniform: torch.Tensor,
    recover_uniform: torch.Tensor,
) -> torch.Tensor:
    """``reference.rejection_sample`` through the native kernel (CPU float32 inputs;
    anything else goes to the reference)."""
    tensors = [draft_token_ids, num_draft_tokens, target_probs, uniform, recover_uniform]
    if draft_probs is not None:
        tensors.append(draft_probs)
    if (
        any(t.device.type != "cpu" for t in tensors)
        or target_probs.dtype != torch.float32
        or (draft_probs is not None and draft_probs.dtype != torch.float32)
    ):
        return reference.rejection_sample(
            draft_token_ids, num_draft_tokens, draft_probs, target_probs, uniform, recover_uniform
        )
    module = load_spec_kernels()  # built on first use, not when the platform is chosen
    if module is None:
        return reference.rejection_sample(
            draft_token_ids, num_draft_tokens, draft_probs, target_probs, uniform, recover_uniform
        )
    return module.rejection_sample(
        draft_token_ids, num_draft_tokens, draft_probs, target_probs, uniform, recover_uniform
    )
