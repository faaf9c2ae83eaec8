"""Weight offload (``cpu_offload_gb``): some layers' weights live in host memory and are
streamed to the device one layer ahead of their use.

The device keeps two staging layers.  While layer ``i`` (in staging slot ``i % 2``)
runs, the copy of the next offloaded layer into the other slot is already queued
through ``Platform.copy_async``: a platform with streams (CUDA, ROCm) runs it on a side
stream, overlapping the current layer's compute; the CPU platform copies synchronously.
The slot being filled was last read by the layer before the current one, whose work is
already queued when the copy starts, and ``copy_async`` orders the copy after it.

Device memory saved: the offloaded layers minus the two staging slots, so offloading
fewer than three layers saves nothing (it still works, for testing).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from pagedserve.config import EngineConfig

__all__ = ["WeightStreamer", "offload_weights"]


def _tensor_fields(layer: Any) -> list[str]:
    names = getattr(type(layer), "__slots__", None) or list(vars(layer))
    return [n for n in names if isinstance(getattr(layer, n, None), torch.Tensor)]


def _nbytes(layer: Any) -> int:
    return sum(getattr(layer, n).numel() * getattr(layer, n).element_size() for n in _tensor_fields(layer))


class WeightStreamer:
    """Moves the chosen layers' tensors to host memory and, called with the model's
    layer list, yields the layers in order with offloaded ones replaced by a device
    staging layer that holds their weights.

    platform: the Platform (device, copy_async / wait_copy, pin_memory_available).
    layers: the model's layer objects (tensor attributes are streamed; others, such as
        a missing bias, are shared as they are).
    budget_bytes: at most this many bytes of layer weights go to host, whole layers
        from the first one on (as vLLM's cpu_offload_gb does).
    """

    def __init__(self, platform, layers: Sequence[Any], budget_bytes: int) -> None:
        self.platform = platform
        self.offloaded: list[int] = []
        self.offloaded_bytes = 0
        for i, layer in enumerate(layers):
            size = _nbytes(layer)
            if self.offloaded_bytes + size > budget_bytes:
                break
            self.offloaded.append(i)
            self.offloaded_bytes += size
        self._index = {layer_idx: rank for rank, layer_idx in enumerate(self.offloaded)}
        self.slots: list[Any] = []
        self.num_layer_copies = 0
        if not self.offloaded:
            return
        pin = platform.pin_memory_available
        template = layers[self.offloaded[0]]
        for _ in range(min(2, len(self.offloaded))):
            slot = type(template)()
            for name in getattr(type(template), "__slots__", None) or list(vars(template)):
                value = getattr(template, name, None)
                if isinstance(value, torch.Tensor):
                    value = torch.empty_like(value, device=platform.device)
                setattr(slot, name, value)
            self.slots.append(slot)
        for i in self.offloaded:
            layer = layers[i]
            for name in _tensor_fields(layer):
                t = getattr(layer, name)
                # "cpu" is the host here whatever the platform: that is where offloaded
                # weights live.
                host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
                host.copy_(t)
                setattr(layer, name, host)

    def _start(self, layer: Any, slot: Any) -> Any:
        handle = None
        for name in _tensor_fields(layer):
            src = getattr(layer, name)
            dst = getattr(slot, name)
            if dst.shape != src.shape or dst.dtype != src.dtype:
                # Layers of one model normally share shapes; reallocate if not.
                dst = torch.empty(src.shape, dtype=src.dtype, device=self.platform.device)
                setattr(slot, name, dst)
            # Copies on one stream complete in order: waiting for the last is enough.
            handle = self.platform.copy_async(dst, src)
        self.num_layer_copies += 1
        return handle

    def __call__(self, layers: Sequence[Any]) -> Iterator[Any]:
        if not self.offloaded:
            yield from layers
            return
        order = self.offloaded
        pending = self._start(layers[order[0]], self.slots[0])
        for i, layer in enumerate(layers):
            rank = self._index.get(i)
            if rank is None:
                yield layer
                continue
            self.platform.wait_copy(pending)
            slot = self.slots[rank % len(self.slots)]
            if rank + 1 < len(order):
                # Prefetch the next offloaded layer while this one runs.
                pending = self._start(layers[order[rank + 1]], self.slots[(rank + 1) % len(self.slots)])
            yield slot


def offload_weights(config: EngineConfig, runner) -> WeightStreamer | None:
    """Keep ``cpu_offload_gb`` GB (10**9 bytes) of ``runner``'s layer weights in host
    memory, streamed during the forward; None when nothing is offloaded."""
    cpu_offload_gb = config.cache.cpu_offload_gb
    if cpu_offload_gb <= 0:
        return None
    config.validate()  # not with several ranks, nor with a device map
    with torch.inference_mode():  # the weights are inference tensors; so are the copies
        streamer = WeightStreamer(runner.platform, runner.model.layers, int(cpu_offload_gb * 1e9))
    runner.stream_layers(streamer)
    return streamer
