"""``models.recurrent.run_segmented``: a recurrent core run in segments ending at a step's
state captures (checkpoints, draft positions) gives the outputs of one unsegmented run,
and each capture's pages hold the row's state after exactly its offset (a toy core: a
running sum per row, over the state tensors run_segmented reads once and writes once)."""

from __future__ import annotations

import torch

from pagedserve.executor.attention_metadata import AttentionMetadata
from pagedserve.models.recurrent import StateLayout, run_segmented

LAYOUT = StateLayout([(4,)])  # the running sum of a row's rows of x
PAGE_SHAPE = (2, 1, 4)  # 8 values per key page: one page per state


def core_fn(calls: list[list[int]]):
    def core(
        xs: tuple[torch.Tensor, ...], meta: AttentionMetadata, states: list[torch.Tensor]
    ) -> tuple[torch.Tensor, ...]:
        x, w = xs
        qsl = meta.query_start_loc.tolist()
        calls.append([qsl[i + 1] - qsl[i] for i in range(len(qsl) - 1)])
        (state,) = states
        assert state.shape[0] == len(qsl) - 1
        out = torch.empty_like(x)
        for i in range(len(qsl) - 1):
            seg = x[qsl[i] : qsl[i + 1]]
            out[qsl[i] : qsl[i + 1]] = state[i] + seg.cumsum(0)
            state[i] += seg.sum(0)
        return out, x * w  # a second, per-token output

    return core


kv: tuple[torch.Tensor, torch.Tensor] = ()  # set by the test


def meta_for(qlens, computed, tables, copies=(), captures=()) -> AttentionMetadata:
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    n = int(qsl[-1])
    return AttentionMetadata(
        positions=torch.cat([torch.arange(c, c + q) for c, q in zip(computed, qlens)]),
        slot_mapping=torch.zeros(n, dtype=torch.int64),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        seq_lens=torch.tensor([c + q for c, q in zip(computed, qlens)], dtype=torch.int32),
        query_start_loc=qsl,
        state_copies=tuple(copies),
        state_captures=tuple(captures),
    )


def test_segments_match_one_run_and_checkpoints_hold_the_state_at_their_offsets():
    global kv
    torch.manual_seed(0)
    pages = 16
    kv = (torch.full((pages, *PAGE_SHAPE), float("nan")), torch.full((pages, *PAGE_SHAPE), float("nan")))
    hit = torch.randn(4)  # a checkpoint (page 9) row 0 continues from
    LAYOUT.write(kv, torch.tensor([[9]]), [hit.view(1, 4)])
    qlens, computed, tables = [7, 5, 1], [3, 0, 6], [[1], [2], [3]]
    LAYOUT.write(kv, torch.tensor([[3]]), [torch.randn(1, 4)])  # row 2 continues its own state
    x, w = torch.randn(sum(qlens), 4), torch.randn(sum(qlens), 4)
    # Row 1 wants its state after 3 tokens twice (a checkpoint and a draft position).
    captures = [(0, 2, (10,)), (0, 5, (11,)), (0, 7, (12,)), (1, 3, (13,)), (1, 3, (14,))]

    # The reference: one unsegmented run from the same pages, states taken token by token.
    saved = (kv[0].clone(), kv[1].clone())
    LAYOUT.write(kv, torch.tensor([[1]]), [hit.view(1, 4)])
    row2 = LAYOUT.read(kv, torch.tensor([[3]]), torch.tensor([True]))[0][0]
    want_calls: list[list[int]] = []
    want = run_segmented(core_fn(want_calls), (x, w), kv, meta_for(qlens, computed, tables), LAYOUT)
    assert want_calls == [qlens]
    kv = saved

    calls: list[list[int]] = []
    got = run_segmented(core_fn(calls), (x, w), kv, meta_for(qlens, computed, tables, [(0, (9,))], captures), LAYOUT)
    assert calls == [[2, 3, 1], [3, 2], [2]]  # rows 0, 1 split at their checkpoints; row 2 whole
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-6)
    states = {
        page: LAYOUT.read(kv, torch.tensor([[page]]), torch.tensor([True]))[0][0] for page in (10, 11, 12, 13, 14, 3, 1)
    }
    torch.testing.assert_close(states[10], hit + x[0:2].sum(0))
    torch.testing.assert_close(states[11], hit + x[0:5].sum(0))
    torch.testing.assert_close(states[12], hit + x[0:7].sum(0))
    torch.testing.assert_close(states[13], x[7:10].sum(0))
    torch.testing.assert_close(states[14], x[7:10].sum(0))
    torch.testing.assert_close(states[3], row2 + x[12])
    torch.testing.assert_close(states[1], hit + x[0:7].sum(0))  # each row's own pages: its chunk's end
    assert torch.isnan(kv[0][15:]).all()  # nothing else written


def test_no_checkpoint_work_is_one_plain_call():
    global kv
    torch.manual_seed(1)
    kv = (torch.randn(4, *PAGE_SHAPE), torch.randn(4, *PAGE_SHAPE))
    x, w = torch.randn(6, 4), torch.randn(6, 4)
    calls: list[list[int]] = []
    out, prod = run_segmented(core_fn(calls), (x, w), kv, meta_for([6], [0], [[1]]), LAYOUT)
    assert calls == [[6]]
    torch.testing.assert_close(out, x.cumsum(0))
    torch.testing.assert_close(prod, x * w)
