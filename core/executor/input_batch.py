"""Build one step's model inputs from a SchedulerOutput, vectorised with numpy."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

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
    out: SchedulerOutput,
    block_ids: dict[str, list[int]] | dict[str, list[list[int]]],
    block_size: int,
    device: torch.device,
    layer_groups: Sequence[int] | None = None,
    state_groups: frozenset[int] = frozenset(),
) -> ModelInput:
    """Positions, slot mapping, block tables, seq lens and query offsets for one step.

    ``block_ids``: per request its block ids, or with KV cache groups (``layer_groups``:
    each model layer's group) one list per group; each group gets its own block tables
    and slot mapping; a recurrent-state group (``state_groups``) gets its requests' state
    pages as block tables and no slots (-1).  One Python iteration per *request* (to read its token slice and
    block lists); everything per token is numpy arithmetic.
    """
    reqs = out.scheduled
    if layer_groups is None and reqs:
        decode = _decode_inputs(reqs, block_ids, block_size, device)
        if decode is not None:
            return decode
    num_new = np.fromiter((s.num_new_tokens for s in reqs), dtype=np.int64, count=len(reqs))
    computed = np.fromiter((s.request.num_computed_tokens for s in reqs), dtype=np.int64, count=len(reqs))
    qsl = np.zeros(len(reqs) + 1, dtype=np.int64)
    np.cumsum(num_new, out=qsl[1:])
    total = int(qsl[-1])

    num_groups = 1 if layer_groups is None else max(layer_groups) + 1
    tokens: list[int] = []
    tables: list[list[list[int]]] = [[] for _ in range(num_groups)]
    for s, c, n in zip(reqs, computed.tolist(), num_new.tolist()):
        ids = s.request.all_token_ids[c : c + n]
        tokens.extend(ids)
        if len(ids) < n:  # draft tokens to verify follow the known ones
            tokens.extend(s.spec_token_ids[: n - len(ids)])
        blocks = block_ids[s.request.request_id]
        for g in range(num_groups):
            tables[g].append(blocks if layer_groups is None else blocks[g])

    req_idx = np.repeat(np.arange(len(reqs)), num_new)
    positions = computed[req_idx] + (np.arange(total) - qsl[:-1][req_idx])
    seq_lens = (computed + num_new).astype(np.int32)

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device)

    metas = []
    for g, group_tables in enumerate(tables):
        block_tables = np.zeros((len(reqs), max(len(b) for b in group_tables)), dtype=np.int32)
        for i, b in enumerate(group_tables):
            block_tables[i, : len(b)] = b
        if g in state_groups:
            slots = np.full(total, -1, dtype=np.int64)
        else:
            slots = (
                block_tables[req_idx, positions // block_size].astype(np.int64) * block_size + positions % block_size
            )
        metas.append((t(slots), t(block_tables)))
    meta = AttentionMetadata(
        positions=t(positions),
        slot_mapping=metas[0][0],
        block_tables=metas[0][1],
        seq_lens=t(seq_lens),
        query_start_loc=t(qsl.astype(np.int32)),
    )
    if layer_groups is not None:
        groups = [replace(meta, slot_mapping=sm, block_tables=bt) for sm, bt in metas]
        for g in state_groups:
            groups[g].state_copies, groups[g].state_captures = _state_work(reqs, g)
        meta.layer_groups, meta.groups = tuple(layer_groups), groups
    return ModelInput(
        input_ids=torch.tensor(tokens, dtype=torch.int64, device=device),
        meta=meta,
        logits_indices=t(qsl[1:] - 1),
        request_ids=[s.request.request_id for s in reqs],
    )


def _state_work(reqs: Sequence, group: int) -> tuple[tuple, tuple]:
    """(copies, captures) of recurrent-state group ``group`` this step, by batch row
    (AttentionMetadata.state_copies / state_captures), from each request's StateStep."""
    copies, captures = [], []
    for row, s in enumerate(reqs):
        step = s.state
        if step is None:
            continue
        if group in step.copy_from:
            copies.append((row, step.copy_from[group]))
        captures.extend((row, offset, pages[group]) for offset, pages in step.captures if group in pages)
    return tuple(copies), tuple(captures)


def _decode_inputs(reqs: Sequence, block_ids: dict, block_size: int, device: torch.device) -> ModelInput | None:
    """prepare_inputs for a step where every request decodes one known token (one KV
    cache group), or None for any other step.  The same tensors, built from one Python
    pass over the requests: at decode batch sizes each numpy call of the general path
    costs more than the per-request arithmetic it vectorises (~40 calls a step)."""
    tokens: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    tables: list[list[int]] = []
    for s in reqs:
        r = s.request
        c = r.num_computed_tokens
        if s.num_new_tokens != 1 or c >= len(r.all_token_ids):  # a chunk, or a draft token
            return None
        blocks = block_ids[r.request_id]
        tokens.append(r.all_token_ids[c])
        positions.append(c)
        slots.append(blocks[c // block_size] * block_size + c % block_size)
        tables.append(blocks)
    n = len(reqs)
    block_tables = np.zeros((n, max(len(b) for b in tables)), dtype=np.int32)
    for i, b in enumerate(tables):
        block_tables[i, : len(b)] = b
    pos = torch.tensor(positions, dtype=torch.int64, device=device)
    meta = AttentionMetadata(
        positions=pos,
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=torch.from_numpy(block_tables).to(device),
        seq_lens=(pos + 1).to(torch.int32),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=device),
    )
    return ModelInput(
        input_ids=torch.tensor(tokens, dtype=torch.int64, device=device),
        meta=meta,
        logits_indices=torch.arange(n, dtype=torch.int64, device=device),
        request_ids=[s.request.request_id for s in reqs],
    )
