"""LoRAManager: adapters in host memory and device slots, and the per-step row -> slot map.

The model's fused projections (qkv, gate_up) and o/down are wrapped once by
:class:`LoRALinear`, which adds the batched ``lora_linear`` op after the base linear.
Each wrapped projection owns stacked weights for ``max_loras`` slots:
``a`` [slots, parts * max_rank, in] and ``b`` [slots, out, parts * max_rank], where a
fused projection's parts (q, k, v) take their own rank block of ``a`` and a
block-diagonal block of ``b``, so one op call covers the fused output and a part the
adapter does not target contributes exact zeros.

Under tensor parallelism each rank holds its shard of every adapter, cut as the base
weights are: a column-parallel projection (q/k/v, gate/up) keeps the whole ``A`` and the
rows of ``B`` of its output rows (its heads, KV heads replicated as the base's are); a
row-parallel one (o, down) keeps the columns of ``A`` of its input columns and the whole
``B``, and its delta joins the rank's partial output before the all-reduce, so the sum
over ranks is the full delta.  A pipeline stage holds its own layers' adapters.  Rank 0
decides every step's slot writes and row -> slot map (:meth:`LoRAManager.plan`, plain
data in the step's broadcast); every rank applies them (:meth:`LoRAManager.apply`),
reading the adapters from their paths into its own host cache.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagedserve.lora.adapter import TARGET_MODULES as _BLOCK
from pagedserve.lora.adapter import LoRAAdapter, load_adapter, module_shapes
from pagedserve.lora.request import LoRARequest

__all__ = ["LoRAManager", "LoRALinear", "LoRAStep", "GROUPS"]

#: The model's (fused) linear attributes and the PEFT modules each one stacks, in order.
GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


#: The projections whose input is split under tensor parallelism (row-parallel).
_ROW_PARALLEL = ("o_proj", "down_proj")


@dataclass
class LoRAStep:
    """One forward's adapters, as plain data (it travels in a distributed step's broadcast).

    writes: (slot, adapter) pairs to fill before the forward, in order; slots: each
    scheduled request's slot (-1: the base model), in batch order; tokens: each one's
    token rows in the forward.
    """

    writes: list[tuple[int, LoRARequest]]
    slots: list[int]
    tokens: list[int]


class _StepState:
    """What every wrapped linear reads in a step: token_slots, per device of the layers,
    int64 [num_tokens], or None (no row has an adapter: the op is not called at all)."""

    __slots__ = ("token_slots",)

    def __init__(self) -> None:
        self.token_slots: dict[torch.device, torch.Tensor] | None = None


class LoRALinear:
    """A linear weight (dense or quantized) plus the adapters' deltas; the model calls
    ``apply(x, bias)`` as it does for quantized weights.  ``device``: where the layer
    runs (the key of its row -> slot map)."""

    __slots__ = ("base", "ops", "a", "b", "state", "device")

    def __init__(
        self, base: Any, ops: Any, a: torch.Tensor, b: torch.Tensor, state: _StepState, device: torch.device
    ) -> None:
        self.base, self.ops, self.a, self.b, self.state, self.device = base, ops, a, b, state, device

    def over(self, base: Any) -> LoRALinear:
        """The same adapters over another copy of the base weight (a streamed layer's)."""
        return LoRALinear(base, self.ops, self.a, self.b, self.state, self.device)

    @property
    def nbytes(self) -> int:
        return self.base.nbytes

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [n, in] -> [n, out]: the base linear, plus each row's adapter delta."""
        if isinstance(self.base, torch.Tensor):
            y = self.ops.linear(x, self.base, bias)
        else:
            y = self.base.apply(x, bias)
        slots = self.state.token_slots
        if slots is None:
            return y
        return self.ops.lora_linear(y, x, self.a, self.b, slots[self.device])


class LoRAManager:
    """Loaded adapters of one model: an LRU of up to ``max_cpu_loras`` in host memory and
    an LRU of up to ``max_loras`` in device slots, filled on demand each step."""

    def __init__(self, arch: Any, max_loras: int, max_lora_rank: int, max_cpu_loras: int | None = None) -> None:
        self.arch = arch
        self.max_loras = max_loras
        self.max_rank = max_lora_rank
        self.max_cpu_loras = max(max_cpu_loras or max_loras, max_loras)
        self._host: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, LRU first
        self._free_slots = list(range(max_loras))
        self.state = _StepState()
        self._stacks: list[dict[str, LoRALinear]] = []
        self._model: Any = None
        self._devices: list[torch.device] = []
        #: This rank's (sharded) (in, out) of every targetable linear.
        self._shapes = module_shapes(arch)
        #: Local layers whose weights weight offload streams: wrapped as they stream in.
        self._streamed: frozenset[int] = frozenset()
        self.num_loads = 0  # adapters read from disk (host-cache misses)
        self.num_slot_writes = 0  # adapters copied into a device slot

    @classmethod
    def attach(cls, config: Any, runner: Any) -> LoRAManager | None:
        """With ``config.enable_lora`` (a LoRAConfig): a manager wrapping ``runner``'s
        model, handed to ``runner.use_lora``; else None."""
        if not config.enable_lora:
            return None
        if runner.lora_manager is not None:  # a distributed rank 0 attaches at its set-up
            return runner.lora_manager
        manager = cls(runner.arch, config.max_loras, config.max_lora_rank, config.max_cpu_loras)
        manager.wrap_model(runner.model)
        runner.use_lora(manager)
        return manager

    # -- model -----------------------------------------------------------------------------
    def wrap_model(self, model: Any) -> None:
        """Wrap every layer's qkv, o, gate_up and down of ``model`` (one rank's shard: its
        pipeline stage's layers, its tensor-parallel slices) in :class:`LoRALinear` with
        zeroed slot weights.  Layers that weight offload streams (``model.layer_stream``
        set before) are wrapped each time they stream in, on their staging copy."""
        for layer, _, _ in self._layers(model):
            missing = [attr for attr in GROUPS if getattr(layer, attr, None) is None]
            if missing:  # e.g. mixture-of-experts layers, or StarCoder2's plain MLP
                raise ValueError(
                    f"enable_lora: LoRA adapters are not supported for {self.arch.architecture} yet "
                    f"(its layers have no {', '.join(missing)} projection to adapt)"
                )
        self._model = model
        self._shapes = self._local_shapes(model)
        stream = model.layer_stream
        self._streamed = frozenset(getattr(stream, "offloaded", ()))
        r = self.max_rank
        for idx, (layer, pl_ops, device) in enumerate(self._layers(model)):
            if device not in self._devices:
                self._devices.append(device)
            stacks = {}
            for attr, parts in GROUPS.items():
                fan_in = self._shapes[parts[0]][0]
                fan_out = sum(self._shapes[p][1] for p in parts)
                a = torch.zeros(self.max_loras, len(parts) * r, fan_in, dtype=model.dtype, device=device)
                b = torch.zeros(self.max_loras, fan_out, len(parts) * r, dtype=model.dtype, device=device)
                wrapped = LoRALinear(getattr(layer, attr), pl_ops, a, b, self.state, device)
                if idx not in self._streamed:
                    setattr(layer, attr, wrapped)
                stacks[attr] = wrapped
            self._stacks.append(stacks)
        if self._streamed:
            model.set_layer_stream(lambda layers: self._wrap_streamed(stream(layers)))

    def _wrap_streamed(self, layers: Iterable[Any]) -> Iterator[Any]:
        """The streamed layers with adapters over their staging copies' weights."""
        for idx, layer in enumerate(layers):
            if idx not in self._streamed:
                yield layer
                continue
            view = type(layer)()
            for name in type(layer).__slots__:
                setattr(view, name, getattr(layer, name, None))
            for attr, wrapped in self._stacks[idx].items():
                setattr(view, attr, wrapped.over(getattr(layer, attr)))
            yield view

    def _local_shapes(self, model: Any) -> dict[str, tuple[int, int]]:
        """(in, out) of each targetable linear on this rank: the full shapes cut as the
        model cuts its weights (on the meta device: no memory)."""
        full = module_shapes(self.arch)
        if model.parallel.tp_size == 1:
            return full
        local = {}
        for name, (fan_in, fan_out) in full.items():
            w = torch.empty(fan_out, fan_in, device="meta")
            out, inp = model.shard_layer_tensor(f"{_BLOCK[name]}.{name}.weight", w).shape
            local[name] = (inp, out)
        return local

    def _shard(self, name: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (A, B) of module ``name``: the input columns of A for a
        row-parallel projection, the output rows of B for a column-parallel one."""
        model = self._model
        if model.parallel.tp_size == 1:
            return a, b
        key = f"{_BLOCK[name]}.{name}.weight"
        if name in _ROW_PARALLEL:
            return model.shard_layer_tensor(key, a), b
        return a, model.shard_layer_tensor(key, b)

    @staticmethod
    def _layers(model: Any):
        for pl in model.placements:
            for layer in model.layers[pl.start - model.layer_start : pl.end - model.layer_start]:
                yield layer, pl.ops, pl.device

    def slot_bytes(self) -> int:
        return sum(w.a.nbytes + w.b.nbytes for stacks in self._stacks for w in stacks.values())

    # -- adapters --------------------------------------------------------------------------
    def add_adapter(self, lora: LoRARequest) -> LoRAAdapter:
        """The adapter of ``lora`` in host memory, read from disk on a miss (ValueError
        naming the problem if it cannot be loaded); evicts the least recently used one."""
        adapter = self._host.get(lora.lora_int_id)
        if adapter is not None and adapter.path == str(Path(lora.lora_path)):
            self._host.move_to_end(lora.lora_int_id)
            return adapter
        adapter = load_adapter(lora.lora_path, self.arch, self.max_rank)
        self.num_loads += 1
        self.remove_adapter(lora.lora_int_id)
        self._host[lora.lora_int_id] = adapter
        while len(self._host) > self.max_cpu_loras:
            old = next(iter(self._host))
            self.remove_adapter(old)
        return adapter

    def remove_adapter(self, lora_int_id: int) -> bool:
        """Forget an adapter (host and slot); True if it was loaded."""
        slot = self._slot_of.pop(lora_int_id, None)
        if slot is not None:
            self._free_slots.append(slot)
        return self._host.pop(lora_int_id, None) is not None

    def list_adapters(self) -> list[int]:
        return list(self._host)

    def _activate(self, lora: LoRARequest, pinned: set[int], writes: list[tuple[int, LoRARequest]]) -> int:
        """The device slot of ``lora``; a new one (the LRU slot not in ``pinned``) is
        appended to ``writes`` to be filled."""
        slot = self._slot_of.get(lora.lora_int_id)
        if slot is not None:
            self._slot_of.move_to_end(lora.lora_int_id)
            self.add_adapter(lora)  # refresh its host LRU position
            return slot
        self.add_adapter(lora)  # read and checked now: a bad adapter fails before any write
        if not self._free_slots:
            victim = next((i for i in self._slot_of if i not in pinned), None)
            if victim is None:
                raise RuntimeError(f"more than max_loras={self.max_loras} adapters in one step")
            self._free_slots.append(self._slot_of.pop(victim))
        slot = self._free_slots.pop()
        self._slot_of[lora.lora_int_id] = slot
        writes.append((slot, lora))
        return slot

    def _write_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        r = self.max_rank
        first = self._model.layer_start  # a pipeline stage's first layer
        for idx, stacks in enumerate(self._stacks):
            mods = adapter.weights.get(first + idx, {})
            for attr, parts in GROUPS.items():
                w = stacks[attr]
                w.a[slot].zero_()
                w.b[slot].zero_()
                off = 0
                for j, name in enumerate(parts):
                    n = self._shapes[name][1]
                    if name in mods:
                        a, b = self._shard(name, *mods[name])
                        w.a[slot, j * r : j * r + a.shape[0]].copy_(a)
                        w.b[slot, off : off + n, j * r : j * r + a.shape[0]].copy_(b)
                    off += n

    # -- steps -----------------------------------------------------------------------------
    def plan(self, rows: Sequence[tuple[LoRARequest | None, int]], pinned: set[int] | None = None) -> LoRAStep | None:
        """Decide a forward's slots: ``rows`` is (adapter or None, tokens) per scheduled
        request, in batch order; ``pinned``: adapter ids no slot write may evict (default:
        those of ``rows``; a step split in micro-batches pins the whole step's).  None
        when no row has an adapter (no op runs)."""
        if all(lora is None for lora, _ in rows):
            return None
        if pinned is None:
            pinned = {lora.lora_int_id for lora, _ in rows if lora is not None}
        writes: list[tuple[int, LoRARequest]] = []
        slots = [-1 if lora is None else self._activate(lora, pinned, writes) for lora, _ in rows]
        return LoRAStep(writes, slots, [n for _, n in rows])

    def apply(self, step: LoRAStep | None) -> None:
        """Fill ``step``'s slots (each adapter read from this process's host cache, or
        its path) and set the row -> slot map for the next forward."""
        if step is None:
            self.state.token_slots = None
            return
        for slot, lora in step.writes:
            self._write_slot(slot, self.add_adapter(lora))
            self.num_slot_writes += 1
        counts = torch.tensor(step.tokens, dtype=torch.int64)
        slots = torch.repeat_interleave(torch.tensor(step.slots, dtype=torch.int64), counts)
        self.state.token_slots = {device: slots.to(device) for device in self._devices}

    def begin_step(self, rows: Sequence[tuple[LoRARequest | None, int]], device: torch.device | None = None) -> None:
        """Map this step's rows to slots (one process: :meth:`plan` then :meth:`apply`);
        ``rows`` as for :meth:`plan`.  No adapter anywhere: no op runs."""
        self.apply(self.plan(rows))

    def end_step(self) -> None:
        self.state.token_slots = None
