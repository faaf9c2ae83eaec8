"""The platform under test: selected exactly as the engine would select it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.platforms import Platform, PlatformInfo, PlatformRegistry, discover
from pagedserve.platforms.ops import OpRegistry

__all__ = ["Target", "select_target", "CHECKED_DTYPES"]

#: Dtypes the kit generates inputs in (a platform's other supported dtypes are not checked).
CHECKED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class Target:
    """A selected platform, its instance and its resolved ops.

    discovered: True when the registry came from entry-point discovery, so that the
        engine (which discovers on its own) can select the same platform by name.
    """

    info: PlatformInfo
    platform: Platform
    ops: OpRegistry
    registry: PlatformRegistry
    discovered: bool

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def device(self) -> torch.device:
        return self.platform.device

    def overridden_ops(self) -> dict[str, str]:
        """Op name -> source for every op that does not resolve to the reference."""
        return {name: src for name, src in self.ops.table() if src != "reference"}

    def dtypes(self) -> list[torch.dtype]:
        """The platform's supported dtypes the kit can check, in the platform's order."""
        return [d for d in self.platform.supported_dtypes if d in CHECKED_DTYPES]

    def reference_layout(self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> bool:
        """Whether the platform keeps the reference KV layout for these sizes."""
        shape = tuple(self.platform.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size))
        return shape == (num_blocks, block_size, num_kv_heads, head_size)


def select_target(
    name: str | None = None, registry: PlatformRegistry | None = None, env: dict[str, str] | None = None
) -> Target:
    """Select platform ``name`` (None: as the engine would auto-select) and resolve its ops.

    ``registry`` lets tests check a plugin registered in-process (the engine check is
    then skipped, since the engine discovers plugins through entry points only).
    Raises :class:`pagedserve.platforms.PlatformError` when it cannot be selected.
    """
    discovered = registry is None
    reg = discover(env) if registry is None else registry
    info = reg.select(name)
    platform = info.cls()
    return Target(info, platform, reg.resolve_ops(platform), reg, discovered)
