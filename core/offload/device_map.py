"""Device maps: one model's decoder layers split across platforms (``device_map``).

``"cuda:20,cpu"`` runs the first 20 layers on the ``cuda`` platform and the rest on
``cpu``, in the spirit of llama.cpp's ``-ngl``; ``"cpu:0-14,cuda:15-29"`` gives
explicit inclusive ranges (syntax in :func:`pagedserve.config.parse_device_map`).
Each segment is a run of consecutive layers with its own ``Platform`` and op registry:
its weights and KV cache live on that platform's device, its layers run that
platform's kernels, and activations move between segments through
``Platform.to_device``.  The embedding goes with the first segment, the final norm
and LM head with the last.

A map by tensor class, ``"experts=cpu,*=cuda"``, runs every layer on the ``*``
platform except the routed experts of each MoE layer, which live on (and run with the
``fused_moe`` of) the ``experts`` platform: only the hidden states cross to it and the
experts' output back (:func:`resolve_expert_segment`, ``place_experts`` of the MoE
families in pagedserve.models.moe).

The block manager is shared, so every layer has the same number of KV blocks: the
runner sizes one block count that fits every device (see
``ModelRunner.determine_num_blocks``), and each platform allocates its layers' tensors
in its own layout (``kv_cache_shape``/``allocate_kv_cache``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from pagedserve.config import device_map_classes, device_map_layers, parse_device_map
from pagedserve.platforms import OpRegistry, Platform, PlatformRegistry, discover

__all__ = [
    "Segment",
    "resolve_device_map",
    "resolve_expert_segment",
    "check_device_map_platforms",
    "device_map_platform_classes",
]


@dataclass
class Segment:
    """Decoder layers ``[start, end)`` on ``platform``, run with ``ops``."""

    platform: Platform
    ops: OpRegistry
    start: int
    end: int

    @property
    def num_layers(self) -> int:
        return self.end - self.start


def _registry() -> PlatformRegistry:
    # Each platform is named by the map itself; PAGEDSERVE_TARGET_DEVICE (which the
    # engine config already checked against the map's first platform) would otherwise
    # conflict with every other name.  PAGEDSERVE_PLUGINS still limits discovery.
    return discover({k: v for k, v in os.environ.items() if k != "PAGEDSERVE_TARGET_DEVICE"})


def check_device_map_platforms(device_map: str, registry: PlatformRegistry | None = None) -> PlatformRegistry:
    """ValueError unless every platform the map names is known and available; the
    message lists the platforms that are."""
    reg = registry or _registry()
    names = dict.fromkeys(e.platform for e in parse_device_map(device_map))
    names.update(dict.fromkeys(device_map_classes(device_map)[1].values()))
    for name in names:
        info = reg.platforms.get(name)
        if info is not None and info.probe()[0]:
            continue
        available = ", ".join(sorted(p.name for p in reg.platforms.values() if p.probe()[0])) or "none"
        if info is None:
            raise ValueError(
                f"device_map={device_map!r} names the unknown platform {name!r}; available platforms: {available}"
            )
        raise ValueError(
            f"device_map={device_map!r}: platform {name!r} is not available ({info.probe()[1]}); "
            f"available platforms: {available}"
        )
    return reg


def device_map_platform_classes(device_map: str) -> list[type[Platform]]:
    """The platform classes of the map's layer segments (each once; a routed-experts
    platform holds no KV cache and is left out); ValueError as
    :func:`check_device_map_platforms`."""
    reg = check_device_map_platforms(device_map)
    names = dict.fromkeys(e.platform for e in parse_device_map(device_map))
    return [reg.platforms[name].cls for name in names]


def resolve_device_map(
    device_map: str, num_layers: int, primary: Platform, primary_ops: OpRegistry, dtype: torch.dtype
) -> list[Segment]:
    """The segments of ``device_map`` for a model of ``num_layers`` decoder layers.

    ``primary`` (with ``primary_ops``) is the engine's platform, the map's first; it is
    reused for every segment of the same name, and other platforms are instantiated
    and get their ops resolved once each.  ValueError for layer counts or ranges that
    do not fit the model, unknown or unavailable platforms, and a ``dtype`` some
    segment's platform does not support.
    """
    spans = device_map_layers(parse_device_map(device_map), num_layers)
    if spans[0][0] != primary.name:
        raise ValueError(
            f"device_map={device_map!r} starts with {spans[0][0]!r}, but the engine runs on {primary.name!r}"
        )
    reg = check_device_map_platforms(device_map)
    platforms: dict[str, tuple[Platform, OpRegistry]] = {primary.name: (primary, primary_ops)}
    return [Segment(*_instance(device_map, name, reg, platforms, dtype), start, end) for name, start, end in spans]


def _instance(
    device_map: str, name: str, reg: PlatformRegistry, platforms: dict[str, tuple[Platform, OpRegistry]], dtype
) -> tuple[Platform, OpRegistry]:
    """Platform ``name`` and its ops, made once per map; ValueError for a dtype it lacks."""
    if name not in platforms:
        platform = reg.select(name).cls()
        platforms[name] = (platform, reg.resolve_ops(platform))
    platform, ops = platforms[name]
    if dtype not in platform.supported_dtypes:
        supported = ", ".join(str(d).replace("torch.", "") for d in platform.supported_dtypes)
        raise ValueError(
            f"device_map={device_map!r}: platform {name!r} does not support dtype "
            f"{str(dtype).replace('torch.', '')} (supported: {supported}); pass a dtype every "
            "platform of the map supports"
        )
    return platform, ops


def resolve_expert_segment(
    device_map: str, segments: list[Segment], dtype: torch.dtype, model_cls: type, hf_config: dict
) -> Segment | None:
    """Where the map puts the routed experts (all layers), or None when it does not.

    ``segments`` are :func:`resolve_device_map`'s (their platforms are reused by name).
    ValueError, before any weight loads, when ``model_cls`` (for the checkpoint's
    ``hf_config``) has no routed experts the map could place.
    """
    classes = device_map_classes(device_map)[1]
    if "experts" not in classes:
        return None
    name = classes["experts"]
    if not getattr(model_cls, "places_experts", lambda hf: False)(hf_config):
        raise ValueError(
            f"device_map={device_map!r} places the routed experts, but {model_cls.__name__} has none it can "
            "place (expert placement serves Mixtral, Qwen2-MoE and Qwen3-MoE); drop 'experts=' from the map"
        )
    platforms = {s.platform.name: (s.platform, s.ops) for s in segments}
    reg = check_device_map_platforms(device_map)
    platform, ops = _instance(device_map, name, reg, platforms, dtype)
    return Segment(platform, ops, segments[0].start, segments[-1].end)
