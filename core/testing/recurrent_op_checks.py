"""Conformance cases of the recurrent-layer ops (kernels/recurrent_reference.py): each
overriding implementation against the reference on fresh random inputs, its outputs and
its in-place state updates both compared.  Varlen batches mix a one-token sequence, a
fresh sequence (no state), and sequences longer than a scan chunk continuing a state.
Each op also runs at odd shapes (head and state sizes that are not a multiple of a
vector, more columns or channels than one work item of a native kernel takes, grouped
heads), and the allocator is handed NaN-filled blocks first (the ops return fresh
tensors: an element a kernel forgets then likely reads NaN).  States are float32
whatever the model dtype; outputs are compared in the dtype's tolerance, states in
float32's scaled by the same factor."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedserve.kernels import reference
from pagedserve.testing.op_checks import TOLERANCES, Cases, _Case, _poison_allocator, assert_matches
from pagedserve.testing.target import Target

__all__ = ["RECURRENT_CASES"]

#: Tokens of each sequence of a varlen case: one token, a short chunk, one past a scan chunk.
LENS = (1, 9, 70)


def _qsl(c: _Case, lens: tuple[int, ...]) -> torch.Tensor:
    out = torch.zeros(len(lens) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lens).cumsum(0)
    return c.dev(out)


def _poison(c: _Case, dtype: torch.dtype, *shapes: tuple[int, ...]) -> None:
    _poison_allocator(c.device, dtype, *(math.prod(s) for s in shapes))


def _state_check(what: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """Compare float32 states within the tolerance of the model dtype the inputs came in."""
    tol = TOLERANCES[dtype]
    g, w = got.detach().cpu(), want.detach().cpu()
    if g.shape != w.shape or not torch.allclose(g, w, atol=tol["atol"] * 10, rtol=tol["rtol"] * 10):
        err = float((g - w).abs().nan_to_num(nan=float("inf")).max()) if g.shape == w.shape else float("nan")
        raise AssertionError(f"{what}: the updated state differs from the reference (max abs error {err:.4g})")


def _causal_conv1d(t: Target, fn: Callable, dtype: torch.dtype, seed: int) -> Cases:
    for dim, width, bias in [(24, 4, True), (40, 3, False), (70, 2, True)]:
        desc = f"dim{dim}-width{width}{'-bias' if bias else ''}"

        def body(dim=dim, width=width, bias=bias, desc=desc) -> None:
            c = _Case(f"causal_conv1d{desc}{dtype}", seed, t.device)
            x = c.randn(sum(LENS), dim, dtype=dtype)
            w, b = c.randn(dim, width, dtype=dtype), c.randn(dim, dtype=dtype) if bias else None
            state = c.randn(len(LENS), dim, width - 1)
            has = torch.tensor([True, False, True])
            want_state = state.clone()
            want = reference.causal_conv1d(x, w, b, want_state, _qsl(c, LENS).cpu(), has, "silu")
            got_state = c.dev(state)
            _poison(c, dtype, x.shape)
            got = fn(c.dev(x), c.dev(w), None if b is None else c.dev(b), got_state, _qsl(c, LENS), c.dev(has), "silu")
            assert_matches("causal_conv1d", got, want, dtype)
            _state_check("causal_conv1d", got_state, want_state, dtype)

        yield desc, body


def _causal_conv1d_update(t: Target, fn: Callable, dtype: torch.dtype, seed: int) -> Cases:
    for seqs, dim, width in [(1, 24, 4), (5, 40, 4), (3, 70, 3)]:
        desc = f"{seqs}seqs-dim{dim}"

        def body(seqs=seqs, dim=dim, width=width, desc=desc) -> None:
            c = _Case(f"causal_conv1d_update{desc}{dtype}", seed, t.device)
            x, w, b = c.randn(seqs, dim, dtype=dtype), c.randn(dim, width, dtype=dtype), c.randn(dim, dtype=dtype)
            state = c.randn(seqs, dim, width - 1)
            want_state = state.clone()
            want = reference.causal_conv1d_update(x, w, b, want_state, "silu")
            got_state = c.dev(state)
            _poison(c, dtype, x.shape)
            assert_matches("causal_conv1d_update", fn(c.dev(x), c.dev(w), c.dev(b), got_state, "silu"), want, dtype)
            _state_check("causal_conv1d_update", got_state, want_state, dtype)

        yield desc, body


#: (key heads, value heads, dk, dv) of the Gated DeltaNet cases: the base shape, and odd
#: head sizes with more value columns than a native work item's 64 and two value heads
#: per key head.
GDN_SHAPES = {"": (2, 4, 16, 24), "-odd": (1, 2, 33, 80)}


def _gdn_inputs(c: _Case, tokens: int, seqs: int, dtype: torch.dtype, shape: str = "") -> list[torch.Tensor]:
    hk, hv, dk, dv = GDN_SHAPES[shape]
    q, k = c.randn(tokens, hk, dk, dtype=dtype), c.randn(tokens, hk, dk, dtype=dtype)
    v = c.randn(tokens, hv, dv, dtype=dtype)
    g = -F.softplus(c.randn(tokens, hv))
    beta = torch.sigmoid(c.randn(tokens, hv))
    return [q, k, v, g, beta, c.randn(seqs, hv, dk, dv, scale=0.3)]


def _gated_delta_rule(t: Target, fn: Callable, dtype: torch.dtype, seed: int) -> Cases:
    for chunk, shape in [(16, ""), (64, ""), (64, "-odd")]:
        desc = f"chunk{chunk}{shape}"

        def body(chunk=chunk, shape=shape, desc=desc) -> None:
            c = _Case(f"gated_delta_rule{desc}{dtype}", seed, t.device)
            q, k, v, g, beta, state = _gdn_inputs(c, sum(LENS), len(LENS), dtype, shape)
            state[1] = 0  # a fresh sequence
            want_state = state.clone()
            want = reference.gated_delta_rule(q, k, v, g, beta, want_state, _qsl(c, LENS).cpu(), True, chunk)
            got_state = c.dev(state)
            args = [c.dev(a) for a in (q, k, v, g, beta)]
            _poison(c, dtype, v.shape)
            got = fn(*args, got_state, _qsl(c, LENS), True, chunk)
            assert_matches("gated_delta_rule", got, want, dtype)
            _state_check("gated_delta_rule", got_state, want_state, dtype)

        yield desc, body


#: (heads, head_dim, groups, d_state) of the Mamba 2 cases: the base shape, and an odd
#: head size with a state wider than one vector plus a tail.
SSD_SHAPES = {"": (4, 16, 2, 8), "-odd": (6, 5, 3, 24)}


def _ssd_inputs(c: _Case, tokens: int, seqs: int, dtype: torch.dtype, shape: str = "") -> list[torch.Tensor]:
    heads, head_dim, groups, n = SSD_SHAPES[shape]
    x = c.randn(tokens, heads, head_dim, dtype=dtype)
    dt = F.softplus(c.randn(tokens, heads))
    A = -(c.randn(heads).abs() + 0.1)
    B, C = c.randn(tokens, groups, n, dtype=dtype), c.randn(tokens, groups, n, dtype=dtype)
    return [x, dt, A, B, C, c.randn(heads), c.randn(seqs, heads, head_dim, n, scale=0.3)]


#: (channels, d_state) of the Mamba 1 cases: the base shape, and more channels than a
#: native work item's 16 with a state of one vector plus a tail.
SCAN_SHAPES = {"": (24, 8), "-odd": (37, 20)}


def _scan_inputs(c: _Case, tokens: int, seqs: int, dtype: torch.dtype, shape: str = "") -> list[torch.Tensor]:
    dim, n = SCAN_SHAPES[shape]
    x, dt = c.randn(tokens, dim, dtype=dtype), F.softplus(c.randn(tokens, dim))
    A = -(c.randn(dim, n).abs() + 0.1)
    B, C = c.randn(tokens, n, dtype=dtype), c.randn(tokens, n, dtype=dtype)
    return [x, dt, A, B, C, c.randn(dim), c.randn(seqs, dim, n, scale=0.3)]


InputsFn = Callable[[_Case, int, int, torch.dtype, str], list[torch.Tensor]]


def _ssm_varlen(op: str, inputs: InputsFn, cases: list[tuple[int, str]]):
    """The cases of a Mamba varlen op (``mamba2_ssd``, ``mamba1_scan``): the LENS batch,
    its second sequence starting from a zero state, per (chunk, shape)."""
    want_fn = getattr(reference, op)

    def gen(t: Target, fn: Callable, dtype: torch.dtype, seed: int) -> Cases:
        for chunk, shape in cases:
            desc = f"chunk{chunk}{shape}"

            def body(chunk=chunk, shape=shape, desc=desc) -> None:
                c = _Case(f"{op}{desc}{dtype}", seed, t.device)
                x, dt, A, B, C, D, state = inputs(c, sum(LENS), len(LENS), dtype, shape)
                state[1] = 0
                want_state = state.clone()
                want = want_fn(x, dt, A, B, C, D, want_state, _qsl(c, LENS).cpu(), chunk)
                got_state = c.dev(state)
                _poison(c, dtype, x.shape)
                got = fn(*[c.dev(a) for a in (x, dt, A, B, C, D)], got_state, _qsl(c, LENS), chunk)
                assert_matches(op, got, want, dtype)
                _state_check(op, got_state, want_state, dtype)

            yield desc, body

    return gen


def _step(op: str, inputs: InputsFn, flags: tuple = (), out: int = 0):
    """The cases of a decode step (``gated_delta_rule_recurrent``, ``mamba2_ssd_step``,
    ``mamba1_scan_step``): one token per sequence, per (sequences, shape).  ``inputs``
    returns the op's tensors, the state last; ``flags`` follow the state in the call;
    the output has the shape of input ``out``."""
    want_fn = getattr(reference, op)

    def gen(t: Target, fn: Callable, dtype: torch.dtype, seed: int) -> Cases:
        for seqs, shape in [(1, ""), (6, ""), (5, "-odd")]:
            desc = f"{seqs}seqs{shape}"

            def body(seqs=seqs, shape=shape, desc=desc) -> None:
                c = _Case(f"{op}{desc}{dtype}", seed, t.device)
                *ins, state = inputs(c, seqs, seqs, dtype, shape)
                want_state = state.clone()
                want = want_fn(*ins, want_state, *flags)
                got_state = c.dev(state)
                _poison(c, dtype, ins[out].shape)
                got = fn(*[c.dev(a) for a in ins], got_state, *flags)
                assert_matches(op, got, want, dtype)
                _state_check(op, got_state, want_state, dtype)

            yield desc, body

    return gen


_mamba2_ssd = _ssm_varlen("mamba2_ssd", _ssd_inputs, [(8, ""), (256, ""), (32, "-odd")])
_gated_delta_rule_recurrent = _step("gated_delta_rule_recurrent", _gdn_inputs, flags=(True,), out=2)
_mamba2_ssd_step = _step("mamba2_ssd_step", _ssd_inputs)
_mamba1_scan = _ssm_varlen("mamba1_scan", _scan_inputs, [(4, ""), (16, ""), (16, "-odd")])
_mamba1_scan_step = _step("mamba1_scan_step", _scan_inputs)


def _rms_norm_gated(t: Target, fn: Callable, dtype: torch.dtype, seed: int) -> Cases:
    for before, group, d in [(True, None, 64), (False, 16, 64), (True, 12, 36)]:
        desc = f"{'norm-then-gate' if before else 'gate-then-norm'}-group{group}" + ("" if d == 64 else f"-d{d}")

        def body(before=before, group=group, d=d, desc=desc) -> None:
            c = _Case(f"rms_norm_gated{desc}{dtype}", seed, t.device)
            x, z = c.randn(7, d, dtype=dtype, scale=2.0), c.randn(7, d, dtype=dtype)
            w = (1 + c.randn(d, scale=0.1)).to(dtype)
            want = reference.rms_norm_gated(x, z, w, 1e-5, before, group)
            _poison(c, dtype, x.shape)
            assert_matches("rms_norm_gated", fn(c.dev(x), c.dev(z), c.dev(w), 1e-5, before, group), want, dtype)

        yield desc, body


RECURRENT_CASES: dict[str, Callable[[Target, Callable, torch.dtype, int], Cases]] = {
    "causal_conv1d": _causal_conv1d,
    "causal_conv1d_update": _causal_conv1d_update,
    "gated_delta_rule": _gated_delta_rule,
    "gated_delta_rule_recurrent": _gated_delta_rule_recurrent,
    "mamba2_ssd": _mamba2_ssd,
    "mamba2_ssd_step": _mamba2_ssd_step,
    "mamba1_scan": _mamba1_scan,
    "mamba1_scan_step": _mamba1_scan_step,
    "rms_norm_gated": _rms_norm_gated,
}
