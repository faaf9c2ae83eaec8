"""The small ``Platform`` base class every platform (builtin or third-party) subclasses."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

__all__ = ["Platform", "PlatformError"]


class PlatformError(RuntimeError):
    """A platform could not be discovered, loaded, detected or selected."""


class Platform:
    """One kind of hardware.  Subclasses override the class attributes and methods.

    Class attributes:
        name: the name users select (``--device NAME``).
        device_type: the torch device type tensors live on ("cpu", "cuda", ...).
        dist_backend: torch.distributed backend for collectives ("gloo", "nccl", ...).
        supported_dtypes: dtypes this platform can run models in.
        pin_memory_available: whether host tensors can be pinned for async copies.
        priority: auto-detection order among available builtin platforms (higher wins).
    """

    name: ClassVar[str] = ""
    device_type: ClassVar[str] = "cpu"
    dist_backend: ClassVar[str] = "gloo"
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32,)
    pin_memory_available: ClassVar[bool] = False
    priority: ClassVar[int] = 0

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        """(available, reason).  The reason is a sentence a user can act on."""
        return False, "is_available() not implemented"

    @property
    def device(self) -> torch.device:
        return torch.device(self.device_type)

    @property
    def default_dtype(self) -> torch.dtype:
        return self.supported_dtypes[0]

    def total_memory(self) -> int:
        """Bytes of memory the platform's device has."""
        raise NotImplementedError

    def free_memory(self) -> int:
        """Bytes of memory currently free on the platform's device."""
        raise NotImplementedError

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """Shape of one layer's key (and value) cache; the reference layout by default."""
        return (num_blocks, block_size, num_kv_heads, head_size)

    def allocate_kv_cache(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Allocate one layer's (key_cache, value_cache) on this platform's device."""
        shape = self.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
        k = torch.empty(shape, dtype=dtype, device=self.device)
        v = torch.empty(shape, dtype=dtype, device=self.device)
        return k, v

    def copy_blocks(
        self, src: torch.Tensor, dst: torch.Tensor, mapping: torch.Tensor, stream: Any = None
    ) -> None:
        """Copy KV blocks ``dst[mapping[:, 1]] = src[mapping[:, 0]]`` (possibly across pools)."""
        from pagedserve.kernels import reference

        reference.copy_blocks(src, dst, mapping)

    def synchronize(self) -> None:
        """Wait for all work queued on the device."""

    def describe(self) -> dict[str, Any]:
        """A few facts for `pagedserve platforms` (dtype, memory)."""
        info: dict[str, Any] = {"default_dtype": str(self.default_dtype).replace("torch.", "")}
        try:
            info["total_memory"] = self.total_memory()
        except Exception as exc:  # reported, not hidden: shown in the listing
            info["total_memory_error"] = f"{type(exc).__name__}: {exc}"
        return info
