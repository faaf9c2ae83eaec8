"""The KV hand-off between engines of a disaggregated prefill/decode pair: a prompt's
cached prefix blocks read out of one engine and adopted by another (serving/disagg.py)."""

from __future__ import annotations

import torch

__all__ = ["KVHandoff"]


class KVHandoff:
    """Reads and writes a prompt's cached prefix blocks through the KV manager and runner."""

    def __init__(self, kv, runner) -> None:
        self.kv = kv
        self.runner = runner

    def export_prefix_kv(self, token_ids: list[int], cache_salt: str | None = None) -> torch.Tensor:
        """KV of the prompt's leading cached full blocks (keyed by ``cache_salt``: a
        request's salt, with its adapter folded in), never the block of its last token:
        [num_layers, 2, num_blocks, *per-block shape] (see ModelRunner.read_kv_blocks)."""
        num_blocks = (len(token_ids) - 1) // self.kv.block_size
        return self.runner.read_kv_blocks(self.kv.cached_prefix(token_ids, num_blocks, cache_salt))

    def import_prefix_kv(self, token_ids: list[int], kv: torch.Tensor, cache_salt: str | None = None) -> int:
        """Cache ``kv`` (as export_prefix_kv returns it) as the prompt's leading blocks under
        ``cache_salt``, as many as free blocks allow; returns how many were added (the rest
        is recomputed)."""
        rows, block_ids = self.kv.adopt_prefix(token_ids, kv.shape[2], cache_salt)
        if block_ids:
            # Adopting may have evicted cached blocks, whose copies to a host tier or KV
            # connector are queued for the next step: they must read the old KV first.
            pending = self.kv.flush_transfers()
            if pending:
                self.runner.run_kv_transfers(pending)
            self.runner.write_kv_blocks(block_ids, kv, rows)
        return len(block_ids)

    def empty_prefix_kv(self, num_blocks: int) -> torch.Tensor:
        """A buffer to receive ``num_blocks`` blocks of export_prefix_kv into."""
        return self.runner.empty_kv_blocks(num_blocks)
