"""Every op a platform overrides, compared with :mod:`pagedserve.kernels.reference`.

Inputs are fresh random tensors (``torch.randn``, never zeros, seeded per case so a
failure reproduces); outputs an op writes in place are poisoned with NaN first, so an
element the op forgot to write cannot pass by accident.  The reference always runs on
the host from copies of the same inputs.  Tolerances are keyed by dtype.  The quantized
linear ops have their own cases (:mod:`pagedserve.testing.quant_op_checks`); both are
assembled into checks by :mod:`pagedserve.testing.op_suite`.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterator

import torch

from pagedserve.kernels import reference
from pagedserve.testing.attention_window_cases import (
    SINK_CASES,
    SPAN_CASES,
    WINDOW_BATCH,
    WINDOW_CASES,
    point_slid_out_at_nan_block,
    random_key_ends,
    random_sinks,
)
from pagedserve.testing.checks import CheckSkipped
from pagedserve.testing.target import Target

__all__ = ["TOLERANCES", "assert_matches", "OP_CASES", "PAGED_ATTENTION_BATCH"]

#: (atol, rtol) per dtype; the reference accumulates in float32 where it matters.
TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}

#: (context length, new tokens) per sequence of the mixed paged_attention batch: a
#: one-token prompt, a decode just past a block boundary, a whole prefill, a chunked
#: prefill continuing after cached context (as after a prefix-cache hit), a decode.
PAGED_ATTENTION_BATCH: tuple[tuple[int, int], ...] = ((1, 1), (17, 1), (20, 20), (45, 9), (33, 1))

NAN = float("nan")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class _Case:
    """Inputs of one case: a seeded generator and the target's device."""

    def __init__(self, case_id: str, seed: int, device: torch.device) -> None:
        self.gen = torch.Generator().manual_seed(zlib.crc32(case_id.encode()) ^ seed)
        self.device = device

    def randn(self, *shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
        """Host tensor of standard normal values (times ``scale``) in ``dtype``."""
        return (torch.randn(shape, generator=self.gen) * scale).to(dtype)

    def randperm(self, n: int) -> torch.Tensor:
        return torch.randperm(n, generator=self.gen)

    def randint(self, low: int, high: int, *shape: int) -> torch.Tensor:
        return torch.randint(low, high, shape, generator=self.gen)

    def dev(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of host tensor ``t`` on the target device (never aliasing the reference's input)."""
        return t.to(self.device, copy=True)


def check_like(what: str, got: object, want: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AssertionError naming ``what`` unless ``got`` is a tensor of ``want``'s shape and
    dtype; both as float32 CPU tensors."""
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"{what}: expected a tensor, got {type(got).__name__}")
    if tuple(got.shape) != tuple(want.shape):
        raise AssertionError(f"{what}: shape {tuple(got.shape)}, reference {tuple(want.shape)}")
    if got.dtype != want.dtype:
        raise AssertionError(f"{what}: dtype {_dtype_name(got.dtype)}, reference {_dtype_name(want.dtype)}")
    return got.detach().cpu().float(), want.detach().cpu().float()


def assert_matches(
    what: str, got: object, want: torch.Tensor, dtype: torch.dtype, *, exact: bool = False, equal_nan: bool = False
) -> None:
    """AssertionError naming ``what`` unless ``got`` equals ``want`` within ``dtype``'s tolerance.

    equal_nan: NaN is expected where the reference left the poison untouched.
    """
    g, w = check_like(what, got, want)
    stray_nan = torch.isnan(g) & ~torch.isnan(w)
    if stray_nan.any():
        raise AssertionError(
            f"{what}: {int(stray_nan.sum())} of {g.numel()} elements are NaN where the reference has "
            "numbers (an output poisoned with NaN was not fully written, or the op produced NaN)"
        )
    tol = dict(atol=0.0, rtol=0.0) if exact else TOLERANCES[dtype]
    close = torch.isclose(g, w, equal_nan=equal_nan, **tol)
    if not close.all():
        bad = ~close
        idx = tuple(int(i) for i in bad.nonzero()[0])
        err = (g - w).abs().nan_to_num(nan=math.inf)[bad].max()
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {g.numel()} elements differ from the reference beyond "
            f"atol={tol['atol']:g}, rtol={tol['rtol']:g} ({_dtype_name(dtype)}); max abs error {float(err):.4g}; "
            f"first at index {idx}: got {float(g[idx]):.6g}, reference {float(w[idx]):.6g}"
        )


# -- case generators: each yields (case description, body) ----------------------------------
Body = Callable[[], None]
Cases = Iterator[tuple[str, Body]]


def _silu_and_mul(t: Target, fn: Callable, dtype: torch.dtype, seed: int) -> Cases:
    for shape in [(1, 2 * 64), (7, 2 * 128), (2, 3, 2 * 96)]:
        desc = "x".join(map(str, shape))

        def body(shape=shape, desc=desc) -> None:
            c = _Case(f"silu_and_mul{desc}{dtype}", seed, t.device)
            x = c.randn(*shape, dtype=dtype, scale=2.0)
            assert_matches("silu_and_mul", fn(c.dev(x)), reference.silu_and_mul(x), dtype)

        yield desc, body


def _gelu_and_mul(t: Target, fn: Callable, dtype: torch.dtype, seed: int) -> Cases:
    for shape, approximate in [((1, 2 * 64), "tanh"), ((7, 2 * 96), "tanh"), ((3, 2 * 48), "none")]:
        desc = "x".join(map(str, shape)) + f"-{approximate}"

        def body(shape=shape, approximate=approximate, desc=desc) -> None:
            c = _Case(f"gelu_and_mul{desc}{dtype}", seed, t.device)
            x = c.randn(*shape, dtype=dtype, scale=2.0)
            assert_matches("gelu_and_mul", fn(c.dev(x), approximate), reference.gelu_and_mul(x, approximate), dtype)

        yield desc, body


def _layer_norm(t: Target, fn: Callable, dtype: torch.dtype, seed: int) -> Cases:
    for rows, d, with_bias in [(1, 64, True), (7, 96, True), (3, 48, False)]:
        desc = f"{rows}x{d}" + ("" if with_bias else "-nobias")

        def body(rows=rows, d=d, with_bias=with_bias, desc=desc) -> None:
            c = _Case(f"layer_norm{desc}{dtype}", seed, t.device)
            x = c.randn(rows, d, dtype=dtype, scale=3.0)
            w = c.randn(d, dtype=dtype, scale=0.5) + 1
            b = c.randn(d, dtype=dtype) if with_bias else None
            got = fn(c.dev(x), c.dev(w), None if b is None else c.dev(b), 1e-5)
            assert_matches("layer_norm", got, reference.layer_norm(x, w, b, 1e-5), dtype)

        yield desc, body


def _gelu(t: Target, fn: Callable, dtype: torch.dtype, seed: int) -> Cases:
    for shape, approximate in [((1, 64), "tanh"), ((7, 96), "tanh"), ((3, 48), "none")]:
        desc = "x".join(map(str, shape)) + f"-{approximate}"

        def body(shape=shape, approximate=approximate, desc=desc) -> None:
            c = _Case(f"gelu{desc}{dtype}", seed, t.device)
            x = c.randn(*shape, dtype=dtype, scale=2.0)
            assert_matches("gelu", fn(c.dev(x), approximate), reference.gelu(x, approximate), dtype)

        yield desc, body


#: (tokens, experts, top_k, hidden, intermediate, activation, renormalised) of the
#: fused_moe cases: top-1, top-2 and top-4; more experts than routed pairs (idle
#: experts); a single token; many tokens (several row tiles per expert); intermediate
#: sizes that are and are not multiples of 16, and odd ones; a hidden size a packed
#: kernel takes for w13 but not for w2; gelu.
FUSED_MOE_SHAPES: tuple[tuple[int, int, int, int, int, str, bool], ...] = (
    (9, 4, 2, 64, 96, "silu", False),
    (3, 8, 2, 32, 48, "silu", True),
    (1, 3, 1, 64, 32, "silu", False),
    (1, 8, 2, 64, 64, "silu", True),
    (70, 6, 2, 64, 40, "silu", True),
    (5, 4, 3, 40, 37, "gelu", False),
    (12, 8, 4, 48, 16, "gelu", True),
    (7, 5, 2, 40, 48, "silu", False),
)


#: GPT-OSS expert cases (the "swigluoai" activation, expert biases):
#: (tokens, experts, top_k, hidden, intermediate, biased, alpha, limit, x scale); a
#: limit small enough that both clamps bind (small limits, not large inputs: with
#: inputs of scale 3-8 the expert outputs reach tens, and one bf16 ulp of a gate sum
#: summed by the down projection exceeds the 2% bf16 tolerance between two correct
#: implementations that accumulate in different orders).
FUSED_MOE_OAI_SHAPES: tuple[tuple[int, int, int, int, int, bool, float, float, float], ...] = (
    (9, 4, 2, 64, 96, True, 1.702, 7.0, 1.0),
    (5, 6, 2, 40, 37, True, 1.702, 1.5, 1.0),
    (1, 3, 1, 64, 32, False, 1.0, 2.0, 2.0),
    (33, 8, 4, 48, 16, True, 1.702, 7.0, 1.0),
)


def _route(c: _Case, tokens: int, experts: int, top_k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, K], ids int64 [T, K]) as a softmax router would give them; the
    last expert never chosen when there are spare ones, so some expert is always idle."""
    pool = experts - 1 if experts > top_k + 1 else experts
    ids = torch.stack([c.randperm(pool)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=c.gen) * 0.9 + 0.05
    if renormalise:  # rows sum to 1; otherwise they need not (routers without it)
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids


def _poison_allocator(device: torch.device, dtype: torch.dtype, *numels: int) -> None:
    """Hand NaN-filled blocks of these sizes back to the allocator: an op that returns a
    fresh tensor (there is no output to poison in place) and forgets an element of it or
    of its scratch buffers then likely reads NaN rather than zeros (best effort: the
    allocator decides which block comes back)."""
    blocks = [torch.full((n,), NAN, dtype=dtype, device=device) for n in numels for _ in range(2)]
    del blocks


def _fused_moe(t: Target, fn: Callable, dtype: torch.dtype, seed: int, prepare: Callable | None = None) -> Cases:
    """``fused_moe`` on expert weights put through the registry's ``prepare_moe_weights``
    (the contract: the pair equals the reference on the plain weights)."""
    if prepare is None:  # a bare target (a kernel tested alone) has no registry
        prepare = t.ops.get("prepare_moe_weights") if hasattr(t, "ops") else reference.prepare_moe_weights
    for tokens, experts, top_k, hidden, inter, act, renorm in FUSED_MOE_SHAPES:
        desc = f"t{tokens}-e{experts}-k{top_k}-h{hidden}-i{inter}-{act}" + ("-renorm" if renorm else "")

        def body(
            tokens=tokens, experts=experts, top_k=top_k, hidden=hidden, inter=inter, act=act, renorm=renorm, desc=desc
        ) -> None:
            c = _Case(f"fused_moe{desc}{dtype}", seed, t.device)
            x = c.randn(tokens, hidden, dtype=dtype)
            w13 = c.randn(experts, 2 * inter, hidden, dtype=dtype, scale=hidden**-0.5)
            w2 = c.randn(experts, hidden, inter, dtype=dtype, scale=inter**-0.5)
            weights, ids = _route(c, tokens, experts, top_k, renorm)
            want = reference.fused_moe(x, w13, w2, weights, ids, act)
            pw13, pw2 = prepare(c.dev(w13), c.dev(w2))
            _poison_allocator(c.device, dtype, tokens * hidden, tokens * top_k * hidden, tokens * top_k * 2 * inter)
            got = fn(c.dev(x), pw13, pw2, c.dev(weights), c.dev(ids), act)
            assert_matches("fused_moe", got, want, dtype)
            # A second call on fresh inputs: the op allocates (or must fully overwrite) its
            # output, so stale values of the first call must not show through.
            x2 = c.randn(tokens, hidden, dtype=dtype)
            got = fn(c.dev(x2), pw13, pw2, c.dev(weights), c.dev(ids), act)
            assert_matches("fused_moe (second call)", got, reference.fused_moe(x2, w13, w2, weights, ids, act), dtype)

        yield desc, body
    yield from _fused_moe_oai(t, fn, dtype, seed, prepare)


def _fused_moe_oai(t: Target, fn: Callable, dtype: torch.dtype, seed: int, prepare: Callable) -> Cases:
    """GPT-OSS experts: swigluoai with (alpha, limit) and optional w13/w2 biases."""
    for tokens, experts, top_k, hidden, inter, biased, alpha, limit, scale in FUSED_MOE_OAI_SHAPES:
        desc = f"t{tokens}-e{experts}-k{top_k}-h{hidden}-i{inter}-swigluoai-a{alpha}-l{limit}" + (
            "-bias" if biased else ""
        )

        def body(
            tokens=tokens, experts=experts, top_k=top_k, hidden=hidden, inter=inter, biased=biased, alpha=alpha,
            limit=limit, scale=scale,
        ) -> None:  # fmt: skip
            if not all(_accepts(fn, k) for k in ("w13_bias", "w2_bias", "alpha", "limit")):
                raise CheckSkipped("fused_moe takes no expert biases / swigluoai: GPT-OSS fails on this platform")
            c = _Case(f"fused_moe-oai{tokens}-{experts}-{inter}-{biased}{dtype}", seed, t.device)
            x = c.randn(tokens, hidden, dtype=dtype, scale=scale)
            w13 = c.randn(experts, 2 * inter, hidden, dtype=dtype, scale=hidden**-0.5)
            w2 = c.randn(experts, hidden, inter, dtype=dtype, scale=inter**-0.5)
            b13 = c.randn(experts, 2 * inter, dtype=dtype, scale=0.3) if biased else None
            b2 = c.randn(experts, hidden, dtype=dtype, scale=0.3) if biased else None
            weights, ids = _route(c, tokens, experts, top_k, True)
            kw = {"alpha": alpha, "limit": limit}
            want = reference.fused_moe(x, w13, w2, weights, ids, "swigluoai", b13, b2, **kw)
            plain = reference.fused_moe(x, w13, w2, weights, ids, "swigluoai", **kw)
            assert not biased or not torch.allclose(want.float(), plain.float()), "the biases must matter"
            pw13, pw2 = prepare(c.dev(w13), c.dev(w2))
            biases = [None if b is None else c.dev(b) for b in (b13, b2)]
            got = fn(c.dev(x), pw13, pw2, c.dev(weights), c.dev(ids), "swigluoai", *biases, **kw)
            assert_matches("fused_moe (swigluoai)", got, want, dtype)

        yield desc, body


def _rms_norm(t: Target, fn: Callable, dtype: torch.dtype, seed: int) -> Cases:
    for n, hidden, eps in [(1, 64, 1e-6), (7, 128, 1e-5), (33, 96, 1e-5)]:
        desc = f"{n}x{hidden}"

        def body(n=n, hidden=hidden, eps=eps, desc=desc) -> None:
            c = _Case(f"rms_norm{desc}{dtype}", seed, t.device)
            x, w = c.randn(n, hidden, dtype=dtype, scale=3.0), (1 + c.randn(hidden, scale=0.1)).to(dtype)
            xd = c.dev(x)
            assert_matches("rms_norm", fn(xd, c.dev(w), eps), reference.rms_norm(x, w, eps), dtype)
            # Model code reuses x (the residual stream) after the norm.
            assert_matches("rms_norm must not modify its input x", xd, x, dtype, exact=True)

        yield desc, body


def _fused_add_rms_norm(t: Target, fn: Callable, dtype: torch.dtype, seed: int) -> Cases:
    for n, hidden in [(1, 64), (7, 128), (33, 96)]:
        desc = f"{n}x{hidden}"

        def body(n=n, hidden=hidden, desc=desc) -> None:
            c = _Case(f"fused_add_rms_norm{desc}{dtype}", seed, t.device)
            x, res = c.randn(n, hidden, dtype=dtype), c.randn(n, hidden, dtype=dtype, scale=2.0)
            w = (1 + c.randn(hidden, scale=0.1)).to(dtype)
            # The op may update x and residual in place: each side gets its own copies.
            got = fn(c.dev(x), c.dev(res), c.dev(w), 1e-5)
            want = reference.fused_add_rms_norm(x.clone(), res.clone(), w, 1e-5)
            if not isinstance(got, tuple) or len(got) != 2:
                raise AssertionError(f"fused_add_rms_norm: expected (normed, residual), got {type(got).__name__}")
            assert_matches("fused_add_rms_norm normed output", got[0], want[0], dtype)
            assert_matches("fused_add_rms_norm residual output", got[1], want[1], dtype)

        yield desc, body
    if dtype == torch.float32 or not t.ops.has_capability("fused_add_rms_norm", "float32_residual"):
        return
    # A float32 residual stream: x of dtype beside it, or x float32 with out_dtype=dtype.
    for n, hidden, x_dtype in [(1, 64, dtype), (7, 128, torch.float32), (33, 96, dtype), (5, 96, torch.float32)]:
        desc = f"{n}x{hidden}-float32-residual-x-{_dtype_name(x_dtype)}"

        def body32(n=n, hidden=hidden, x_dtype=x_dtype, desc=desc) -> None:
            c = _Case(f"fused_add_rms_norm{desc}{dtype}", seed, t.device)
            x, res = c.randn(n, hidden, dtype=x_dtype), c.randn(n, hidden, scale=2.0)
            w = (1 + c.randn(hidden, scale=0.1)).to(dtype)
            got = fn(c.dev(x), c.dev(res), c.dev(w), 1e-5, out_dtype=dtype)
            want = reference.fused_add_rms_norm(x.clone(), res.clone(), w, 1e-5, out_dtype=dtype)
            if not isinstance(got, tuple) or len(got) != 2:
                raise AssertionError(f"fused_add_rms_norm: expected (normed, residual), got {type(got).__name__}")
            assert_matches("fused_add_rms_norm (float32 residual) normed output", got[0], want[0], dtype)
            assert_matches("fused_add_rms_norm (float32 residual) residual", got[1], want[1], torch.float32)

        yield desc, body32


def _rope_cache(max_pos: int, rot: int, theta: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / theta ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def _rotary_embedding(t: Target, fn: Callable, dtype: torch.dtype, seed: int) -> Cases:
    for n, heads, kv_heads, head in [(1, 4, 2, 64), (7, 4, 1, 128), (19, 2, 2, 64)]:
        desc = f"t{n}-h{heads}kv{kv_heads}-d{head}"

        def body(n=n, heads=heads, kv_heads=kv_heads, head=head, desc=desc) -> None:
            c = _Case(f"rotary_embedding{desc}{dtype}", seed, t.device)
            cache = _rope_cache(256, head)
            pos = c.randint(0, 256, n)
            q, k = c.randn(n, heads, head, dtype=dtype), c.randn(n, kv_heads, head, dtype=dtype)
            got = fn(c.dev(pos), c.dev(q), c.dev(k), c.dev(cache))
            want = reference.rotary_embedding(pos, q.clone(), k.clone(), cache)
            if not isinstance(got, tuple) or len(got) != 2:
                raise AssertionError(f"rotary_embedding: expected (query, key), got {type(got).__name__}")
            assert_matches("rotary_embedding query", got[0], want[0], dtype)
            assert_matches("rotary_embedding key", got[1], want[1], dtype)

        yield desc, body


def _linear(t: Target, fn: Callable, dtype: torch.dtype, seed: int, prepare: Callable | None = None) -> Cases:
    """``linear`` on weights put through the registry's ``prepare_linear_weight`` (the
    contract: the pair equals the reference on the plain weight)."""
    streamed = prepare is None  # once, under ``linear`` rather than again under ``prepare_linear_weight``
    prepare = prepare or t.ops.get("prepare_linear_weight")
    # Output widths that are and are not multiples of 16 and an odd K: a platform may
    # pack only some shapes (the CPU's native packing needs N % 16 == 0, K % 2 == 0).
    for lead, k, m, bias in [
        ((1,), 64, 96, False),
        ((7,), 64, 128, True),
        ((33,), 128, 64, False),
        ((2, 3), 64, 48, True),
        ((50,), 96, 80, False),
        ((5,), 33, 70, True),
    ]:
        desc = f"{'x'.join(map(str, lead))}x{k}->{m}" + ("+bias" if bias else "")

        def body(lead=lead, k=k, m=m, bias=bias, desc=desc) -> None:
            c = _Case(f"linear{desc}{dtype}", seed, t.device)
            x, w = c.randn(*lead, k, dtype=dtype), c.randn(m, k, dtype=dtype, scale=k**-0.5)
            b = c.randn(m, dtype=dtype) if bias else None
            got = fn(c.dev(x), prepare(c.dev(w)), None if b is None else c.dev(b))
            assert_matches("linear", got, reference.linear(x, w, b), dtype)

        yield desc, body
    if streamed:
        yield from _linear_streamed(t, fn, dtype, seed)


def _linear_streamed(t: Target, fn: Callable, dtype: torch.dtype, seed: int, op: str = "linear") -> Cases:
    """``op`` (``linear`` or ``linear_silu_and_mul``) on a plain (never prepared) weight
    rewritten in place between calls: what weight offload (``cpu_offload_gb``) does to its
    device staging slots, inference tensors whose contents change under the same object.
    An op that caches derived state per weight tensor must notice, or keep such caches to
    prepared weights."""
    want_fn = getattr(reference, op)
    for lead, k, m in [((3,), 64, 96), ((17,), 96, 64)]:
        desc = f"streamed-weight {'x'.join(map(str, lead))}x{k}->{m}"

        def body(lead=lead, k=k, m=m, desc=desc) -> None:
            c = _Case(f"{op}{desc}{dtype}", seed, t.device)
            x = c.randn(*lead, k, dtype=dtype)
            weights = [c.randn(m, k, dtype=dtype, scale=k**-0.5) for _ in range(3)]
            with torch.inference_mode():
                slot = torch.empty_like(c.dev(weights[0]))  # one staging slot, as offload keeps
                for i, w in enumerate(weights + weights[:1]):
                    slot.copy_(c.dev(w))
                    assert_matches(
                        f"{op} after rewriting the weight in place ({i + 1} times)",
                        fn(c.dev(x), slot, None),
                        want_fn(x, w, None),
                        dtype,
                    )

        yield desc, body


def _linear_silu_and_mul(t: Target, fn: Callable, dtype: torch.dtype, seed: int) -> Cases:
    """``linear_silu_and_mul`` on a [gate; up] weight put through the registry's
    ``prepare_linear_weight``, against the reference on the plain weight: halves that
    are and are not multiples of 16 (and of 32), an odd K, bias, 2-D and 3-D x."""
    prepare = t.ops.get("prepare_linear_weight")
    for lead, k, d, bias in [
        ((1,), 64, 48, False),
        ((7,), 64, 64, True),
        ((33,), 128, 40, False),
        ((2, 3), 64, 16, True),
        ((13,), 33, 32, False),
    ]:
        desc = f"{'x'.join(map(str, lead))}x{k}->2x{d}" + ("+bias" if bias else "")

        def body(lead=lead, k=k, d=d, bias=bias, desc=desc) -> None:
            c = _Case(f"linear_silu_and_mul{desc}{dtype}", seed, t.device)
            x, w = c.randn(*lead, k, dtype=dtype, scale=2.0), c.randn(2 * d, k, dtype=dtype, scale=k**-0.5)
            b = c.randn(2 * d, dtype=dtype) if bias else None
            got = fn(c.dev(x), prepare(c.dev(w)), None if b is None else c.dev(b))
            assert_matches("linear_silu_and_mul", got, reference.linear_silu_and_mul(x, w, b), dtype)

        yield desc, body
    yield from _linear_streamed(t, fn, dtype, seed, op="linear_silu_and_mul")


def _embedding(t: Target, fn: Callable, dtype: torch.dtype, seed: int) -> Cases:
    for n, vocab, hidden in [(1, 50, 64), (9, 300, 128)]:
        desc = f"t{n}-v{vocab}x{hidden}"

        def body(n=n, vocab=vocab, hidden=hidden, desc=desc) -> None:
            c = _Case(f"embedding{desc}{dtype}", seed, t.device)
            ids = c.randint(0, vocab, n)
            ids[0] = vocab - 1  # the last row, where an off-by-one shows
            w = c.randn(vocab, hidden, dtype=dtype)
            assert_matches("embedding", fn(c.dev(ids), c.dev(w)), reference.embedding(ids, w), dtype, exact=True)

        yield desc, body


def _argmax(t: Target, fn: Callable, dtype: torch.dtype, seed: int) -> Cases:
    """Rows long and short (vector bodies and tails), with ties, -inf rows and NaNs."""
    for rows, n in [(1, 7), (5, 50), (3, 1000), (9, 49153)]:
        desc = f"{rows}x{n}"

        def body(rows=rows, n=n, desc=desc) -> None:
            c = _Case(f"argmax{desc}{dtype}", seed, t.device)
            x = c.randn(rows, n, dtype=dtype, scale=4.0)
            top = x.max()
            if rows > 1:  # the maximum twice, late then early: the first one wins
                x[1, n - 1] = x[1, n // 3] = top + 1
            if rows > 2:
                x[2] = float("-inf")
                x[2, n // 2] = top  # one finite value among -inf
            if rows > 3:
                x[3, n // 4] = NAN  # a NaN counts as the largest, and the first one wins
                x[3, n - 2] = NAN
                x[3, 0] = top + 2
            if rows > 4:
                x[4] = x[4, 0]  # all equal: index 0
            got = fn(c.dev(x))
            want = reference.argmax(x)
            if got.dtype != torch.int64 or tuple(got.shape) != (rows,):
                raise AssertionError(f"argmax: expected int64 [{rows}], got {got.dtype} {list(got.shape)}")
            if not torch.equal(got.cpu(), want):
                bad = (got.cpu() != want).nonzero().flatten().tolist()
                raise AssertionError(
                    f"argmax: rows {bad} differ: got {got.cpu()[bad].tolist()}, expected {want[bad].tolist()}"
                )

        yield desc, body


def _apply_token_bitmask(t: Target, fn: Callable, dtype: torch.dtype, seed: int) -> Cases:
    """Random masks (full, empty and mixed words), all rows or some (``indices``), and
    logits wider than the mask (vocabulary padding, which must end up -inf)."""
    for rows, vocab, words, some in ((1, 70, 3, False), (5, 1000, 32, True), (4, 129, 4, False), (3, 200, 5, True)):
        desc = f"[{rows}x{vocab}/{words}w{'/idx' if some else ''}]"
        c = _Case(f"apply_token_bitmask{desc}{dtype}", seed, t.device)

        def body(c=c, rows=rows, vocab=vocab, words=words, some=some) -> None:
            logits = c.randn(rows, vocab, dtype=dtype)
            sel = c.randperm(rows)[: max(1, rows // 2)].sort().values if some else torch.arange(rows)
            mask = c.randint(-(2**31), 2**31 - 1, len(sel), words).to(torch.int32)
            mask[0, 0] = -1  # a word of all-allowed
            if len(sel) > 1:
                mask[1, -1] = 0  # a word of none
            want = reference.apply_token_bitmask(logits.clone(), mask, sel if some else None)
            dev = c.dev(logits)
            got = fn(dev, c.dev(mask), c.dev(sel) if some else None)
            if got is not None and got.data_ptr() != dev.data_ptr():
                raise AssertionError("apply_token_bitmask must work in place and return logits")
            got, want = check_like("apply_token_bitmask", dev, want)
            if not torch.equal(got.isneginf(), want.isneginf()):
                bad = (got.isneginf() != want.isneginf()).nonzero()[:5].tolist()
                raise AssertionError(f"apply_token_bitmask: mask differs at (row, token) {bad}")
            keep = ~want.isneginf()
            if not torch.equal(got[keep], want[keep]):
                raise AssertionError("apply_token_bitmask changed allowed logits")

        yield desc, body


def _block_sizes(t: Target) -> list[int]:
    """Block sizes the kit checks: 16 and 32, and the platform's default block size."""
    return sorted({16, 32, int(t.platform.default_block_size)})


def _reshape_and_cache(t: Target, fn: Callable, dtype: torch.dtype, seed: int) -> Cases:
    for block_size in _block_sizes(t):
        for kv_heads, head in [(2, 64), (1, 128)]:
            desc = f"bs{block_size}-kv{kv_heads}-d{head}"

            def body(block_size=block_size, kv_heads=kv_heads, head=head, desc=desc) -> None:
                num_blocks, n = 6, 11
                if not t.reference_layout(num_blocks, block_size, kv_heads, head):
                    raise CheckSkipped(
                        "the platform declares its own KV layout; reshape_and_cache is "
                        "checked together with paged_attention"
                    )
                c = _Case(f"reshape_and_cache{desc}{dtype}", seed, t.device)
                k, v = c.randn(n, kv_heads, head, dtype=dtype), c.randn(n, kv_heads, head, dtype=dtype)
                # Distinct slots, never the last one (where a slot of -1 would land if
                # used as an index), and two tokens to skip.
                slots = c.randperm(num_blocks * block_size - 1)[:n]
                slots[2] = slots[7] = -1
                shape = (num_blocks, block_size, kv_heads, head)
                want_k, want_v = torch.full(shape, NAN, dtype=dtype), torch.full(shape, NAN, dtype=dtype)
                reference.reshape_and_cache(k, v, want_k, want_v, slots)
                kc, vc = t.platform.allocate_kv_cache(num_blocks, block_size, kv_heads, head, dtype)
                kc.fill_(NAN)
                vc.fill_(NAN)
                fn(c.dev(k), c.dev(v), kc, vc, c.dev(slots))
                assert_matches("reshape_and_cache key_cache", kc, want_k, dtype, exact=True, equal_nan=True)
                assert_matches("reshape_and_cache value_cache", vc, want_v, dtype, exact=True, equal_nan=True)

            yield desc, body


def _attention_inputs(
    c: _Case,
    dtype: torch.dtype,
    block_size: int,
    heads: int,
    kv_heads: int,
    head: int,
    batch: tuple[tuple[int, int], ...] = PAGED_ATTENTION_BATCH,
):
    """A mixed batch of (context, new tokens) over a reference-layout cache with scattered blocks."""
    ctx = [n for n, _ in batch]
    q_lens = [q for _, q in batch]
    per_seq = [math.ceil(n / block_size) for n in ctx]
    num_blocks = sum(per_seq) + 3
    perm = c.randperm(num_blocks).tolist()
    max_blocks = max(per_seq) + 1
    # Unused entries hold valid but wrong block ids: a kernel reading them gets garbage.
    tables = c.randint(0, num_blocks, len(ctx), max_blocks).to(torch.int32)
    for i, nb in enumerate(per_seq):
        tables[i, :nb] = torch.tensor([perm.pop() for _ in range(nb)], dtype=torch.int32)
    # Every slot holds random values, those past a sequence's end included.
    shape = (num_blocks, block_size, kv_heads, head)
    kc, vc = c.randn(*shape, dtype=dtype), c.randn(*shape, dtype=dtype)
    query = c.randn(sum(q_lens), heads, head, dtype=dtype)
    seq_lens = torch.tensor(ctx, dtype=torch.int32)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return query, kc, vc, tables, seq_lens, qsl, num_blocks


def _context_slots(tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """Slot of every context token of every sequence (in batch order)."""
    slots = []
    for i, n in enumerate(seq_lens.tolist()):
        pos = torch.arange(n)
        slots.append(tables[i].long()[pos // block_size] * block_size + pos % block_size)
    return torch.cat(slots)


def _accepts(fn: Callable, name: str) -> bool:
    import inspect

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True  # a builtin without a signature: let the call tell
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


#: Platform.kv_cache_dtypes names -> torch dtypes (pagedserve.kv_cache.kv_dtype).
_KV8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8}


def _paged_attention(t: Target, fn: Callable, dtype: torch.dtype, seed: int) -> Cases:
    shapes = [
        (block_size, heads, kv_heads, 64, {})
        for block_size in _block_sizes(t)
        for heads, kv_heads in [(4, 4), (4, 2), (8, 2)]
    ]
    shapes.append((16, 4, 1, 128, {}))
    # Windows shorter than the contexts (and than some prefill chunks); Gemma-2-style soft-cap.
    shapes += [
        (16, 4, 2, 64, {"sliding_window": 7}),
        (16, 8, 2, 64, {"sliding_window": 40}),
        (16, 4, 2, 64, {"soft_cap": 2.0}),
        (32, 4, 1, 64, {"sliding_window": 19, "soft_cap": 3.0}),
    ]
    # Contexts several windows long; slid-out table entries point at a NaN block.
    cases = [(shape, False) for shape in shapes] + [(shape, True) for shape in WINDOW_CASES + SINK_CASES]
    # Spans attending both ways in the mixed batch, and with windows over long contexts.
    cases += [(shape, False) for shape in SPAN_CASES[:1]] + [(shape, True) for shape in SPAN_CASES[1:]]
    for (block_size, heads, kv_heads, head, extra), slid_out in cases:
        desc = f"bs{block_size}-h{heads}kv{kv_heads}-d{head}" + "".join(f"-{k}{v}" for k, v in extra.items())
        if slid_out:
            desc += "-long-slidout-nan" if "sliding_window" in extra else "-long"

        def body(
            block_size=block_size, heads=heads, kv_heads=kv_heads, head=head, desc=desc, extra=extra, slid_out=slid_out
        ) -> None:
            missing = [k for k in extra if not _accepts(fn, k)]
            if missing:
                raise CheckSkipped(
                    f"paged_attention takes no {', '.join(missing)}: models with such layers fail on this platform"
                )
            c = _Case(f"paged_attention{desc}{dtype}", seed, t.device)
            query, kc, vc, tables, seq_lens, qsl, num_blocks = _attention_inputs(
                c, dtype, block_size, heads, kv_heads, head, WINDOW_BATCH if slid_out else PAGED_ATTENTION_BATCH
            )
            if "sinks" in extra:  # a spread stands for random per-head sink logits
                extra = {**extra, "sinks": c.dev(random_sinks(c.gen, heads, extra["sinks"]))}
            if "key_ends" in extra:  # a count stands for random spans of each sequence's queries
                extra = {**extra, "key_ends": c.dev(random_key_ends(c.gen, seq_lens, qsl, extra["key_ends"]))}
            scale = head**-0.5
            want = reference.paged_attention(query, kc, vc, tables, seq_lens, qsl, scale, **extra)
            slots = _context_slots(tables, seq_lens, block_size)
            if slid_out:
                window = extra.get("sliding_window")
                kc, vc, tables, null = point_slid_out_at_nan_block(kc, vc, tables, seq_lens, qsl, window)
                num_blocks += 1
                slots = torch.cat([slots, null * block_size + torch.arange(block_size)])
            pkc, pvc = t.platform.allocate_kv_cache(num_blocks, block_size, kv_heads, head, dtype)
            how = ""
            if t.reference_layout(num_blocks, block_size, kv_heads, head):
                pkc.copy_(kc)
                pvc.copy_(vc)
            else:
                # The platform's own layout: fill it through its own reshape_and_cache.
                how = " (cache written with the platform's reshape_and_cache)"
                pkc.copy_(torch.randn(pkc.shape, generator=c.gen).to(dtype))
                pvc.copy_(torch.randn(pvc.shape, generator=c.gen).to(dtype))
                flat = num_blocks * block_size
                keys = kc.reshape(flat, kv_heads, head)[slots]
                values = vc.reshape(flat, kv_heads, head)[slots]
                t.ops.reshape_and_cache(c.dev(keys), c.dev(values), pkc, pvc, c.dev(slots))
            args = (c.dev(query), pkc, pvc, c.dev(tables), c.dev(seq_lens), c.dev(qsl), scale)
            out = torch.full(query.shape, NAN, dtype=dtype, device=t.device)
            got = fn(*args, out=out, **extra)
            assert_matches("paged_attention return value (out=...)" + how, got, want, dtype)
            assert_matches("paged_attention out (poisoned with NaN before the call)" + how, out, want, dtype)
            assert_matches("paged_attention return value (out=None)" + how, fn(*args, **extra), want, dtype)

        yield desc, body

    # 8-bit KV caches the platform declares (Platform.kv_cache_dtypes, interface 1.5):
    # written by its own reshape_and_cache, read by its paged_attention, against the
    # reference write and attention on the same inputs.  An int8 cache's rows are
    # head_size + 4 wide (values, then the row's float32 scale).
    # An fp8 name covers both of its layouts: rows with their scales (the default) and
    # unscaled rows (kv_cache_scales="tensor").
    variants = []
    for kv_name in getattr(t.platform, "kv_cache_dtypes", ()):
        variants.append((kv_name, True))
        if kv_name.startswith("fp8"):
            variants.append((kv_name, False))
    for kv_name, row_scaled in variants:
        kv_dtype = _KV8_DTYPES.get(kv_name)
        for block_size, heads, kv_heads, head in [(16, 8, 2, 64), (16, 4, 1, 128)]:
            layout = "-rows" if row_scaled and kv_name.startswith("fp8") else ""
            desc = f"kv-{kv_name}{layout}-bs{block_size}-h{heads}kv{kv_heads}-d{head}"

            def body(block_size=block_size, heads=heads, kv_heads=kv_heads, head=head, desc=desc, kv_dtype=kv_dtype,
                     kv_name=kv_name, row_scaled=row_scaled) -> None:  # fmt: skip
                if kv_dtype is None:
                    raise AssertionError(f"the platform declares an unknown KV cache dtype {kv_name!r}")
                c = _Case(f"paged_attention{desc}{dtype}", seed, t.device)
                query, kc, vc, tables, seq_lens, qsl, num_blocks = _attention_inputs(
                    c, dtype, block_size, heads, kv_heads, head, PAGED_ATTENTION_BATCH
                )
                slots = _context_slots(tables, seq_lens, block_size)
                flat = num_blocks * block_size
                keys = kc.reshape(flat, kv_heads, head)[slots] * 8  # beyond e4m3's range now and then
                values = vc.reshape(flat, kv_heads, head)[slots]
                row = reference.kv_row_size(head, kv_dtype, row_scaled)
                if row_scaled:  # a few rows with an outlier (beyond e4m3's range): their scale only grows
                    keys[::5, :, 0] *= 20
                ref_shape = (*kc.shape[:3], row)
                rk = torch.zeros(ref_shape, dtype=torch.float32).to(kv_dtype)
                rv = torch.zeros(ref_shape, dtype=torch.float32).to(kv_dtype)
                reference.reshape_and_cache(keys, values, rk, rv, slots)
                scale = head**-0.5
                want = reference.paged_attention(query, rk, rv, tables, seq_lens, qsl, scale)
                pkc, pvc = t.platform.allocate_kv_cache(num_blocks, block_size, kv_heads, row, kv_dtype)
                assert pkc.dtype == kv_dtype, f"allocate_kv_cache gave {pkc.dtype} for {kv_dtype}"
                pkc.view(torch.uint8).zero_()  # as the reference caches, so unwritten rows compare equal
                pvc.view(torch.uint8).zero_()
                t.ops.reshape_and_cache(c.dev(keys), c.dev(values), pkc, pvc, c.dev(slots))
                if t.reference_layout(num_blocks, block_size, kv_heads, row):
                    written = pkc.cpu().view(torch.uint8)[tables.flatten().long()]
                    assert torch.equal(written, rk.view(torch.uint8)[tables.flatten().long()]), (
                        "reshape_and_cache into an 8-bit cache stored other bytes than the reference's "
                        "(quantize_kv_rows for rows with their scales, quantize_kv for unscaled fp8)"
                    )
                args = (c.dev(query), pkc, pvc, c.dev(tables), c.dev(seq_lens), c.dev(qsl), scale)
                out = torch.full(query.shape, NAN, dtype=dtype, device=t.device)
                got = fn(*args, out=out)
                what = f"a KV cache of {kv_name}" + (" with row scales" if row_scaled else " without scales")
                assert_matches(f"paged_attention over {what}", got, want, dtype)
                assert_matches(f"paged_attention out over {what} (NaN-poisoned)", out, want, dtype)

            yield desc, body


#: (context length, new tokens) per sequence of rotary_paged_attention's decode batch
#: (what the CPU fuses into one call): contexts inside one block, ending on a block's
#: last slot, one past it, and several blocks long.
ROTARY_DECODE_BATCH: tuple[tuple[int, int], ...] = ((1, 1), (16, 1), (17, 1), (33, 1), (70, 1), (5, 1))


def _rotary_paged_attention(t: Target, fn: Callable, dtype: torch.dtype, seed: int) -> Cases:
    """rotary_paged_attention against the reference (rotary, cache write, attention) on
    decode batches and on the mixed batch, rotary over the whole head and over part of
    it; the new tokens' cache slots and the output are poisoned with NaN first."""
    shapes = [
        (16, 4, 2, 64, 64, ROTARY_DECODE_BATCH, "decode"),
        (32, 8, 2, 64, 64, ROTARY_DECODE_BATCH, "decode"),
        (16, 4, 1, 128, 128, ROTARY_DECODE_BATCH, "decode"),
        (16, 4, 2, 64, 32, ROTARY_DECODE_BATCH, "decode-partial"),
        (16, 8, 2, 64, 64, PAGED_ATTENTION_BATCH, "mixed"),
    ]
    for block_size, heads, kv_heads, head, rot, batch, kind in shapes:
        desc = f"{kind}-bs{block_size}-h{heads}kv{kv_heads}-d{head}-rot{rot}"

        def body(block_size=block_size, heads=heads, kv_heads=kv_heads, head=head, rot=rot, batch=batch,
                 desc=desc) -> None:  # fmt: skip
            c = _Case(f"rotary_paged_attention{desc}{dtype}", seed, t.device)
            # Scattered blocks; table entries past each sequence's blocks name other blocks.
            query, kc, vc, tables, seq_lens, qsl, num_blocks = _attention_inputs(
                c, dtype, block_size, heads, kv_heads, head, batch
            )
            n = query.shape[0]
            key, value = c.randn(n, kv_heads, head, dtype=dtype), c.randn(n, kv_heads, head, dtype=dtype)
            # The new tokens: the last q_len positions of each sequence, and their slots.
            positions = torch.cat([torch.arange(ctx - q, ctx) for ctx, q in batch])
            slots = torch.cat(
                [_context_slots(tables[i : i + 1], seq_lens[i : i + 1], block_size)[ctx - q :]
                 for i, (ctx, q) in enumerate(batch)]
            )  # fmt: skip
            flat_k, flat_v = kc.view(-1, kv_heads, head), vc.view(-1, kv_heads, head)
            flat_k[slots] = NAN  # an op that attends before (or without) writing them reads NaN
            flat_v[slots] = NAN
            cos_sin = _rope_cache(256, rot)
            scale = head**-0.5
            want_kc, want_vc = kc.clone(), vc.clone()
            want = reference.rotary_paged_attention(
                positions, query.clone(), key.clone(), value.clone(), cos_sin, want_kc, want_vc, slots, tables,
                seq_lens, qsl, scale,
            )  # fmt: skip
            if not t.reference_layout(num_blocks, block_size, kv_heads, head):
                raise CheckSkipped("the platform declares its own KV layout; its caches are not filled here")
            for out_given in (True, False):
                pkc, pvc = t.platform.allocate_kv_cache(num_blocks, block_size, kv_heads, head, dtype)
                pkc.copy_(kc)
                pvc.copy_(vc)
                out = torch.full(query.shape, NAN, dtype=dtype, device=t.device)
                args = (c.dev(positions), c.dev(query), c.dev(key), c.dev(value), c.dev(cos_sin), pkc, pvc,
                        c.dev(slots), c.dev(tables), c.dev(seq_lens), c.dev(qsl), scale)  # fmt: skip
                got = fn(*args, out=out) if out_given else fn(*args)
                what = "rotary_paged_attention " + (
                    "out (poisoned with NaN before the call)" if out_given else "(out=None)"
                )
                assert_matches(what, out if out_given else got, want, dtype)
                if out_given:
                    assert_matches("rotary_paged_attention return value (out=...)", got, want, dtype)
                # The new keys (rotated) and values in the cache; every other slot untouched.
                assert_matches("rotary_paged_attention key_cache", pkc, want_kc, dtype, equal_nan=True)
                assert_matches("rotary_paged_attention value_cache", pvc, want_vc, dtype, exact=True, equal_nan=True)

        yield desc, body


def _mla_paged_attention(t: Target, fn: Callable, dtype: torch.dtype, seed: int) -> Cases:
    """Latent attention over a one-head cache pair: DeepSeek V2/V3's widths (512 + 64, in
    halves of 288), a small one, and an odd width whose second half is padded."""
    for block_size, heads, rank, rope in [(16, 4, 512, 64), (16, 8, 24, 8), (32, 3, 17, 6)]:
        desc = f"bs{block_size}-h{heads}-rank{rank}-rope{rope}"

        def body(block_size=block_size, heads=heads, rank=rank, rope=rope, desc=desc) -> None:
            c = _Case(f"mla_paged_attention{desc}{dtype}", seed, t.device)
            width = rank + rope
            half = -(-width // 2)
            _, kc, vc, tables, seq_lens, qsl, num_blocks = _attention_inputs(c, dtype, block_size, 1, 1, half)
            query = c.randn(int(qsl[-1]), heads, width, dtype=dtype, scale=0.3)
            scale = (width // 3) ** -0.5
            want = reference.mla_paged_attention(query, kc, vc, tables, seq_lens, qsl, scale, rank)
            pkc, pvc = t.platform.allocate_kv_cache(num_blocks, block_size, 1, half, dtype)
            how = ""
            if t.reference_layout(num_blocks, block_size, 1, half):
                pkc.copy_(kc)
                pvc.copy_(vc)
            else:
                how = " (cache written with the platform's reshape_and_cache)"
                pkc.copy_(torch.randn(pkc.shape, generator=c.gen).to(dtype))
                pvc.copy_(torch.randn(pvc.shape, generator=c.gen).to(dtype))
                slots = _context_slots(tables, seq_lens, block_size)
                flat = num_blocks * block_size
                keys, values = kc.reshape(flat, 1, half)[slots], vc.reshape(flat, 1, half)[slots]
                t.ops.reshape_and_cache(c.dev(keys), c.dev(values), pkc, pvc, c.dev(slots))
            args = (c.dev(query), pkc, pvc, c.dev(tables), c.dev(seq_lens), c.dev(qsl), scale, rank)
            out = torch.full((query.shape[0], heads, rank), NAN, dtype=dtype, device=t.device)
            got = fn(*args, out=out)
            assert_matches("mla_paged_attention return value (out=...)" + how, got, want, dtype)
            assert_matches("mla_paged_attention out (poisoned with NaN before the call)" + how, out, want, dtype)
            assert_matches("mla_paged_attention return value (out=None)" + how, fn(*args), want, dtype)

        yield desc, body


def _block_copy_cases(op: str, t: Target, fn: Callable, dtype: torch.dtype, seed: int) -> Cases:
    host = torch.device("cpu")
    if op == "copy_blocks":
        pools = [("same-pool", t.device, None), ("device->device", t.device, t.device)]
    else:
        pools = [("device->host", t.device, host), ("host->device", host, t.device)]
    for desc, src_dev, dst_dev in pools:

        def body(desc=desc, src_dev=src_dev, dst_dev=dst_dev) -> None:
            c = _Case(f"{op}{desc}{dtype}", seed, t.device)
            shape = (8, 16, 2, 64)
            src = c.randn(*shape, dtype=dtype)
            # Disjoint sources and destinations, unordered: a copy that follows the
            # mapping's order or mixes up its columns shows.
            mapping = torch.tensor([[0, 5], [3, 1], [6, 2], [4, 7]], dtype=torch.int64)
            if dst_dev is None:  # within one pool: src and dst are the same tensor
                want = src.clone()
                reference.copy_blocks(want, want, mapping)
                got = src.to(src_dev, copy=True)
                fn(got, got, mapping.to(src_dev))
            else:
                want = torch.full(shape, NAN, dtype=dtype)
                reference.copy_blocks(src, want, mapping)
                got = torch.full(shape, NAN, dtype=dtype, device=dst_dev)
                fn(src.to(src_dev, copy=True), got, mapping)
            assert_matches(f"{op} ({desc})", got, want, dtype, exact=True, equal_nan=True)

        yield desc, body


#: (rows, in, out, rank, slots, slot pattern) of the lora_linear cases: one decode row,
#: a mixed batch in no particular order, rows of one adapter, no adapter at all.
LORA_CASES = (
    (1, 64, 96, 8, 2, "mixed"),
    (37, 128, 192, 16, 3, "mixed"),
    (9, 64, 80, 4, 1, "one"),
    (5, 64, 64, 8, 2, "none"),
)


def _rejection_sample(t: Target, fn: Callable, dtype: torch.dtype, seed: int) -> Cases:
    """Speculative decoding's verification: token for token equal to the reference on
    random drafts and distributions (float32 probabilities whatever the model dtype),
    one-hot and real draft distributions, rows with 0 to K drafts.  The probabilities are
    float32 in every model dtype (the sampler widens logits first), so each dtype runs the
    same cases."""
    for batch, k, vocab, with_q in [(9, 3, 5, False), (9, 3, 300, True), (4, 5, 4099, True), (1, 1, 17, False)]:
        desc = f"b{batch}-k{k}-v{vocab}" + ("-q" if with_q else "")

        def body(batch=batch, k=k, vocab=vocab, with_q=with_q, desc=desc) -> None:
            c = _Case(f"rejection_sample{desc}", seed, t.device)
            num = torch.randint(0, k + 1, (batch,), generator=c.gen)
            target = torch.rand(batch, k + 1, vocab, generator=c.gen) ** 4
            target[target < 0.05] = 0.0
            target[:, :, 0] += 1e-3  # every row keeps some mass
            target /= target.sum(-1, keepdim=True)
            q = None
            if with_q:
                q = torch.rand(batch, k, vocab, generator=c.gen) ** 2
                q /= q.sum(-1, keepdim=True)
            drafts = torch.randint(0, vocab, (batch, k), generator=c.gen)
            # Half the drafts are the target's mode, so acceptances happen too.
            drafts = torch.where(torch.rand(batch, k, generator=c.gen) < 0.5, target[:, :k].argmax(-1), drafts)
            uniform, recover = torch.rand(batch, k, generator=c.gen), torch.rand(batch, k + 1, generator=c.gen)
            want = reference.rejection_sample(drafts, num, q, target, uniform, recover)
            got = fn(
                c.dev(drafts),
                c.dev(num),
                None if q is None else c.dev(q),
                c.dev(target),
                c.dev(uniform),
                c.dev(recover),
            )
            assert_matches("rejection_sample", got.cpu(), want, torch.int64, exact=True)

        yield desc, body


def _lora_linear(t: Target, fn: Callable, dtype: torch.dtype, seed: int) -> Cases:
    """Into a column slice of a wider output (as a fused projection's part), so that the
    op must honour strides and leave other columns and adapter-less rows bit-equal."""
    for rows, k, n, r, slots, pattern in LORA_CASES:
        desc = f"{rows}x{k}->{n} r{r} s{slots} {pattern}"

        def body(rows=rows, k=k, n=n, r=r, slots=slots, pattern=pattern, desc=desc) -> None:
            c = _Case(f"lora_linear{desc}{dtype}", seed, t.device)
            x = c.randn(rows, k, dtype=dtype)
            a = c.randn(slots, r, k, dtype=dtype, scale=0.2)
            b = c.randn(slots, n, r, dtype=dtype, scale=0.2)
            ids = {
                "mixed": c.randint(-1, slots, rows),
                "one": torch.full((rows,), slots - 1),
                "none": torch.full((rows,), -1),
            }[pattern].to(torch.int64)
            wide = c.randn(rows, n + 24, dtype=dtype)
            want = wide.clone()
            reference.lora_linear(want[:, 8 : 8 + n], x, a, b, ids)
            got = c.dev(wide)
            out = fn(got[:, 8 : 8 + n], c.dev(x), c.dev(a), c.dev(b), c.dev(ids))
            assert_matches(f"lora_linear ({desc}) return", out, want[:, 8 : 8 + n], dtype)
            assert_matches(f"lora_linear ({desc})", got, want, dtype)
            untouched = (ids < 0).nonzero().squeeze(1)
            assert_matches(
                f"lora_linear ({desc}) rows without adapter", got.cpu()[untouched], want[untouched], dtype, exact=True
            )

        yield desc, body


#: Op name -> its cases (assembled with the quantized ones by pagedserve.testing.op_suite).
OP_CASES: dict[str, Callable[[Target, Callable, torch.dtype, int], Cases]] = {
    "paged_attention": _paged_attention,
    "mla_paged_attention": _mla_paged_attention,
    "reshape_and_cache": _reshape_and_cache,
    "rms_norm": _rms_norm,
    "fused_add_rms_norm": _fused_add_rms_norm,
    "rotary_embedding": _rotary_embedding,
    "rotary_paged_attention": _rotary_paged_attention,
    "silu_and_mul": _silu_and_mul,
    "gelu_and_mul": _gelu_and_mul,
    "fused_moe": _fused_moe,
    # A platform's prepare_moe_weights is checked through its (or the reference's) fused_moe.
    "prepare_moe_weights": lambda t, fn, d, s: _fused_moe(t, t.ops.get("fused_moe"), d, s, prepare=fn),
    "layer_norm": _layer_norm,
    "gelu": _gelu,
    "linear": _linear,
    # A platform's prepare_linear_weight is checked through its (or the reference's) linear.
    "prepare_linear_weight": lambda t, fn, d, s: _linear(t, t.ops.get("linear"), d, s, prepare=fn),
    "linear_silu_and_mul": _linear_silu_and_mul,
    "embedding": _embedding,
    "argmax": _argmax,
    "apply_token_bitmask": _apply_token_bitmask,
    "copy_blocks": lambda t, fn, d, s: _block_copy_cases("copy_blocks", t, fn, d, s),
    "swap_blocks": lambda t, fn, d, s: _block_copy_cases("swap_blocks", t, fn, d, s),
    "lora_linear": _lora_linear,
    "rejection_sample": _rejection_sample,
}
