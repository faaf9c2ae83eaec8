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

Quantized weights (``QuantizedWeight`` holders: int8, fp8, GGUF blocks, GPTQ/AWQ) stream
as they are: their tensors (packed integers, blocks, scales) go to host memory and back
byte for byte, never a dequantized copy.  A weight holding something else than tensors
and plain values (an opaque repacked form) stays resident; the staging layer then refers
to it as it streams the rest of its layer.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from pagedserve.config import EngineConfig
from pagedserve.quantization.base import QuantizedWeight

__all__ = ["WeightStreamer", "offload_weights"]

_PLAIN = (int, float, bool, str, bytes, type(None), torch.dtype, torch.Size, torch.device)


def _names(obj: Any) -> list[str]:
    slots = [n for cls in type(obj).__mro__ for n in getattr(cls, "__slots__", ())]
    return slots or list(vars(obj))


def _streamable(value: Any) -> bool:
    """A tensor, or a quantized weight made only of tensors, quantized weights (lists of
    them) and plain values or functions (its ops)."""
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, QuantizedWeight):
        return all(_plain_or_streamable(getattr(value, n, None)) for n in _names(value))
    return False


def _plain_or_streamable(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_plain_or_streamable(v) for v in value)
    return isinstance(value, _PLAIN) or callable(value) and not isinstance(value, QuantizedWeight) or _streamable(value)


def _tensor_fields(layer: Any) -> list[str]:
    """The fields of ``layer`` that stream: tensors and quantized weights."""
    return [n for n in _names(layer) if _streamable(getattr(layer, n, None))]


def _tensors(value: Any) -> list[torch.Tensor]:
    """Every tensor of a streamable value, in a fixed order (a staging copy of the same
    structure lists its own in the same order)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, QuantizedWeight):
        return [t for n in _names(value) for t in _tensors(getattr(value, n, None))]
    return []


def _rebuild(value: Any, make: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` with every tensor replaced by ``make(tensor)`` (quantized weights are
    shallow-copied, their plain values and ops shared)."""
    if isinstance(value, torch.Tensor):
        return make(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_rebuild(v, make) for v in value)
    if isinstance(value, QuantizedWeight):
        out = copy.copy(value)
        for n in _names(value):
            if hasattr(value, n):
                setattr(out, n, _rebuild(getattr(value, n), make))
        return out
    return value


def _next(buffers: Iterator[torch.Tensor], _like: torch.Tensor) -> torch.Tensor:
    return next(buffers)


def _same_layout(a: Any, b: Any) -> bool:
    ta, tb = _tensors(a), _tensors(b)
    return (
        type(a) is type(b)
        and len(ta) == len(tb)
        and all(x.shape == y.shape and x.dtype == y.dtype for x, y in zip(ta, tb))
    )


def _nbytes(layer: Any) -> int:
    return sum(t.numel() * t.element_size() for n in _tensor_fields(layer) for t in _tensors(getattr(layer, n)))


class WeightStreamer:
    """Moves the chosen layers' tensors to host memory and, called with the model's
    layer list, yields the layers in order with offloaded ones replaced by a device
    staging layer that holds their weights.

    platform: the Platform (device, copy_async / wait_copy, pin_memory_available).
    layers: the model's layer objects (tensor and quantized-weight attributes are
        streamed; others, such as a missing bias, are shared as they are).
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
        #: Per offloaded layer, the fields that stream (the rest stay resident).
        self._streamed = {i: _tensor_fields(layers[i]) for i in self.offloaded}
        self.slots: list[Any] = []
        self.num_layer_copies = 0
        if not self.offloaded:
            return
        pin = platform.pin_memory_available
        first = self.offloaded[0]
        template, streamed = layers[first], set(self._streamed[first])
        on_device = lambda t: torch.empty_like(t, device=platform.device)  # noqa: E731
        for _ in range(min(2, len(self.offloaded))):
            slot = type(template)()
            for name in _names(template):
                value = getattr(template, name, None)
                setattr(slot, name, _rebuild(value, on_device) if name in streamed else value)
            self.slots.append(slot)

        def to_host(t: torch.Tensor) -> torch.Tensor:
            # "cpu" is the host here whatever the platform: that is where offloaded
            # weights live.
            host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            host.copy_(t)
            return host

        for i in self.offloaded:
            layer = layers[i]
            for name in self._streamed[i]:
                setattr(layer, name, _rebuild(getattr(layer, name), to_host))

    def _start(self, index: int, layer: Any, slot: Any) -> Any:
        handle = None
        streamed = self._streamed[index]
        for name in _names(layer):
            src = getattr(layer, name, None)
            if name not in streamed:
                setattr(slot, name, src)  # resident: the layer's own (or None)
                continue
            dst = getattr(slot, name, None)
            if not _same_layout(dst, src):
                # Layers of one model normally share shapes; reallocate if not.
                dst = _rebuild(src, lambda t: torch.empty(t.shape, dtype=t.dtype, device=self.platform.device))
            elif isinstance(src, QuantizedWeight):
                # The slot's buffers under this layer's own plain values (its block type...).
                dst = _rebuild(src, functools.partial(_next, iter(_tensors(dst))))
            setattr(slot, name, dst)
            # Copies on one stream complete in order: waiting for the last is enough.
            for d, s in zip(_tensors(dst), _tensors(src)):
                handle = self.platform.copy_async(d, s)
        self.num_layer_copies += 1
        return handle

    def __call__(self, layers: Sequence[Any]) -> Iterator[Any]:
        if not self.offloaded:
            yield from layers
            return
        order = self.offloaded
        pending = self._start(order[0], layers[order[0]], self.slots[0])
        for i, layer in enumerate(layers):
            rank = self._index.get(i)
            if rank is None:
                yield layer
                continue
            self.platform.wait_copy(pending)
            slot = self.slots[rank % len(self.slots)]
            if rank + 1 < len(order):
                # Prefetch the next offloaded layer while this one runs.
                nxt = order[rank + 1]
                pending = self._start(nxt, layers[nxt], self.slots[(rank + 1) % len(self.slots)])
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
