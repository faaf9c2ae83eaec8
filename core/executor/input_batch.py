"""Build one step's model inputs from a SchedulerOutput, vectorised with numpy."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.executor.attention_metadata import AttentionMetadata
from pagedserve.scheduler import SchedulerOutput

__all__ = ["ModelInput", "prepare_inputs"]


@dataclass
class ModelInput:
    """input_ids int64 [num_tokens]; logits_indices int64 [num_seqs] (last token of each
    scheduled request); request_ids in batch order."""

    input_ids: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    request_ids: list[str]


def prepare_inputs(
    out: SchedulerOutput, block_ids: dict[str, list[int]], block_size: int, device: torch.device
) -> ModelInput:
    """Positions, slot mapping, block tables, seq lens and query offsets for one step.

    One Python iteration per *request* (to read its token slice and block list);
    everything per token is numpy arithmetic.
    """
    reqs = out.scheduled
    num_new = np.fromiter((s.num_new_tokens for s in reqs), dtype=np.int64, count=len(reqs))
    computed = np.fromiter((s.request.num_computed_tokens for s in reqs), dtype=np.int64, count=len(reqs))
    qsl = np.zeros(len(reqs) + 1, dtype=np.int64)
    np.cumsum(num_new, out=qsl[1:])
    total = int(qsl[-1])

    tokens: list[int] = []
    tables = []
    for s, c, n in zip(reqs, computed.tolist(), num_new.tolist()):
        ids = s.request.all_token_ids[c : c + n]
        tokens.extend(ids)
        if len(ids) < n:  # draft tokens to verify follow the known ones
            tokens.extend(s.spec_token_ids[: n - len(ids)])
        tables.append(block_ids[s.request.request_id])
    max_blocks = max(len(t) for t in tables)
    block_tables = np.zeros((len(reqs), max_blocks), dtype=np.int32)
    for i, t in enumerate(tables):
        block_tables[i, : len(t)] = t

    req_idx = np.repeat(np.arange(len(reqs)), num_new)
    positions = computed[req_idx] + (np.arange(total) - qsl[:-1][req_idx])
    slot_mapping = block_tables[req_idx, positions // block_size].astype(np.int64) * block_size + positions % block_size
    seq_lens = (computed + num_new).astype(np.int32)

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device)

    meta = AttentionMetadata(
        positions=t(positions),
        slot_mapping=t(slot_mapping),
        block_tables=t(block_tables),
        seq_lens=t(seq_lens),
        query_start_loc=t(qsl.astype(np.int32)),
    )
    return ModelInput(
        input_ids=torch.tensor(tokens, dtype=torch.int64, device=device),
        meta=meta,
        logits_indices=t(qsl[1:] - 1),
        request_ids=[s.request.request_id for s in reqs],
    )
