"""LoRAManager: adapters in host memory and device slots, and the per-step row -> slot map.

The model's fused projections (qkv, gate_up) and o/down are wrapped once by
:class:`LoRALinear`, which adds the batched ``lora_linear`` op after the base linear.
Each wrapped projection owns stacked weights for ``max_loras`` slots:
``a`` [slots, parts * max_rank, in] and ``b`` [slots, out, parts * max_rank], where a
fused projection's parts (q, k, v) take their own rank block of ``a`` and a
block-diagonal block of ``b``, so one op call covers the fused output and a part the
adapter does not target contributes exact zeros.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from pagedserve.lora.adapter import LoRAAdapter, load_adapter, module_shapes
from pagedserve.lora.request import LoRARequest

__all__ = ["LoRAManager", "LoRALinear", "GROUPS"]

#: The model's (fused) linear attributes and the PEFT modules each one stacks, in order.
GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


class _StepState:
    """What every wrapped linear reads in a step: token_slots int64 [num_tokens] or None
    (no row has an adapter: the op is not called at all)."""

    __slots__ = ("token_slots",)

    def __init__(self) -> None:
        self.token_slots: torch.Tensor | None = None


class LoRALinear:
    """A linear weight (dense or quantized) plus the adapters' deltas; the model calls
    ``apply(x, bias)`` as it does for quantized weights."""

    __slots__ = ("base", "ops", "a", "b", "state")

    def __init__(self, base: Any, ops: Any, a: torch.Tensor, b: torch.Tensor, state: _StepState) -> None:
        self.base, self.ops, self.a, self.b, self.state = base, ops, a, b, state

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
        return self.ops.lora_linear(y, x, self.a, self.b, slots)


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
        self.num_loads = 0  # adapters read from disk (host-cache misses)

    @classmethod
    def attach(cls, config: Any, runner: Any) -> LoRAManager | None:
        """With ``config.enable_lora`` (a LoRAConfig): a manager wrapping ``runner``'s
        model, handed to ``runner.use_lora``; else None."""
        if not config.enable_lora:
            return None
        manager = cls(runner.arch, config.max_loras, config.max_lora_rank, config.max_cpu_loras)
        manager.wrap_model(runner.model)
        runner.use_lora(manager)
        return manager

    # -- model -----------------------------------------------------------------------------
    def wrap_model(self, model: Any) -> None:
        """Wrap every layer's qkv, o, gate_up and down of ``model`` (a LlamaForCausalLM on
        one rank) in :class:`LoRALinear` with zeroed slot weights."""
        for layer, _, _ in self._layers(model):
            missing = [attr for attr in GROUPS if getattr(layer, attr, None) is None]
            if missing:  # e.g. mixture-of-experts layers, or StarCoder2's plain MLP
                raise ValueError(
                    f"enable_lora: LoRA adapters are not supported for {self.arch.architecture} yet "
                    f"(its layers have no {', '.join(missing)} projection to adapt)"
                )
        shapes = module_shapes(self.arch)
        r = self.max_rank
        for layer, pl_ops, device in self._layers(model):
            stacks = {}
            for attr, parts in GROUPS.items():
                fan_in = shapes[parts[0]][0]
                fan_out = sum(shapes[p][1] for p in parts)
                a = torch.zeros(self.max_loras, len(parts) * r, fan_in, dtype=model.dtype, device=device)
                b = torch.zeros(self.max_loras, fan_out, len(parts) * r, dtype=model.dtype, device=device)
                wrapped = LoRALinear(getattr(layer, attr), pl_ops, a, b, self.state)
                setattr(layer, attr, wrapped)
                stacks[attr] = wrapped
            self._stacks.append(stacks)

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

    def _activate(self, lora: LoRARequest, pinned: set[int]) -> int:
        """The device slot holding ``lora``, filling the LRU slot not in ``pinned``."""
        slot = self._slot_of.get(lora.lora_int_id)
        if slot is not None:
            self._slot_of.move_to_end(lora.lora_int_id)
            self.add_adapter(lora)  # refresh its host LRU position
            return slot
        adapter = self.add_adapter(lora)
        if not self._free_slots:
            victim = next((i for i in self._slot_of if i not in pinned), None)
            if victim is None:
                raise RuntimeError(f"more than max_loras={self.max_loras} adapters in one step")
            self._free_slots.append(self._slot_of.pop(victim))
        slot = self._free_slots.pop()
        self._write_slot(slot, adapter)
        self._slot_of[lora.lora_int_id] = slot
        return slot

    def _write_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        r = self.max_rank
        shapes = module_shapes(self.arch)
        for idx, stacks in enumerate(self._stacks):
            mods = adapter.weights.get(idx, {})
            for attr, parts in GROUPS.items():
                w = stacks[attr]
                w.a[slot].zero_()
                w.b[slot].zero_()
                off = 0
                for j, name in enumerate(parts):
                    n = shapes[name][1]
                    if name in mods:
                        a, b = mods[name]
                        w.a[slot, j * r : j * r + a.shape[0]].copy_(a)
                        w.b[slot, off : off + n, j * r : j * r + a.shape[0]].copy_(b)
                    off += n

    # -- steps -----------------------------------------------------------------------------
    def begin_step(self, rows: Sequence[tuple[LoRARequest | None, int]], device: torch.device) -> None:
        """Map this step's rows to slots: ``rows`` is (adapter or None, tokens) per
        scheduled request, in batch order.  No adapter anywhere: no op runs."""
        if all(lora is None for lora, _ in rows):
            self.state.token_slots = None
            return
        pinned = {lora.lora_int_id for lora, _ in rows if lora is not None}
        per_row = [-1 if lora is None else self._activate(lora, pinned) for lora, _ in rows]
        counts = torch.tensor([n for _, n in rows], dtype=torch.int64)
        slots = torch.repeat_interleave(torch.tensor(per_row, dtype=torch.int64), counts)
        self.state.token_slots = slots.to(device)

    def end_step(self) -> None:
        self.state.token_slots = None
