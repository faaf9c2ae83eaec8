"""The swap-vs-recompute preemption cost model.

Preempting a request that has ``T`` computed tokens in ``B`` KV blocks costs either

    swap:       2 * B * bytes_per_block / host_copy_bandwidth     (out now, in later)
    recompute:  T * flops_per_token / compute_flops               (its prefill again)

with ``flops_per_token ~= 2 * parameters`` (one multiply-add per weight; attention's
own term is left out, which favours recompute slightly for long contexts).
``host_copy_bandwidth`` and ``compute_flops`` are per-platform constants on the
``Platform`` class (see docs/memory.md for the values and where they come from).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PreemptionCostModel"]


@dataclass(frozen=True)
class PreemptionCostModel:
    """Decides, per preemption, whether swapping beats recomputing.

    mode: "auto" (compare the two estimates), "swap" (always) or "recompute" (never).
    bytes_per_block: KV bytes of one block over all layers (keys and values).
    flops_per_token: forward FLOPs per token, about 2 * the number of weights.
    host_copy_bandwidth: bytes/s of a host<->device copy.
    compute_flops: FLOP/s the platform sustains in a forward pass.
    """

    mode: str
    bytes_per_block: int
    flops_per_token: float
    host_copy_bandwidth: float
    compute_flops: float

    def swap_seconds(self, num_blocks: int) -> float:
        return 2 * num_blocks * self.bytes_per_block / self.host_copy_bandwidth

    def recompute_seconds(self, num_tokens: int) -> float:
        return num_tokens * self.flops_per_token / self.compute_flops

    def __call__(self, num_blocks: int, num_tokens: int) -> bool:
        """True when the request should be swapped out rather than recomputed."""
        if self.mode == "swap":
            return True
        if self.mode == "recompute":
            return False
        return self.swap_seconds(num_blocks) < self.recompute_seconds(num_tokens)
