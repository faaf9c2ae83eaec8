"""Checks of the quantized linear ops (``gguf_linear``, ``gguf_linear_silu_and_mul``,
``gguf_linear_stacked``, ``int8_linear``, ``w8a8_linear``, ``fp8_linear``) a platform overrides,
against :mod:`pagedserve.kernels.reference`.

Weights are random bytes in each stored format (GGUF blocks with realistic fp16 scales,
int8 and e4m3 values with per-channel or per-tensor scales), activations fresh
``torch.randn`` -- seeded per case like the other op checks.  These ops return new
tensors, so there is nothing to poison; an output with NaN where the reference has
numbers fails.  Kernels may round the weight to the activation dtype and, where the op's
contract allows it, quantize the activations (int8 per 32-value block for GGUF, e4m3
per row for FP8), so outputs are compared by their relative error -- the norm of the
difference over the reference's -- against the dtype's rounding plus that allowance, and
every element against a multiple of that bound times the reference's RMS (a single
wrong row or column shows).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedserve.kernels import quant_reference, reference
from pagedserve.testing.op_checks import Cases, _Case, _dtype_name, check_like
from pagedserve.testing.target import Target

__all__ = ["QUANT_CASES", "QUANT_TOLERANCES", "ACTIVATION_ALLOWANCE", "assert_close_relative"]

#: Relative error (Frobenius) allowed for output rounding, per activation dtype.
QUANT_TOLERANCES: dict[torch.dtype, float] = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 1e-2}
#: Extra relative error an op's contract allows for quantized activations.
ACTIVATION_ALLOWANCE: dict[str, float] = {
    "gguf_linear": 2.5e-2,
    # silu(gate) * up: the errors of both halves of the product add up.
    "gguf_linear_silu_and_mul": 3e-2,
    "fp8_linear": 6e-2,
}
#: Each element may differ by this many times the bound above, times the reference's RMS.
ELEMENT_FACTOR = 8.0


def assert_close_relative(what: str, got: object, want: torch.Tensor, dtype: torch.dtype, tol: float) -> None:
    """AssertionError naming ``what`` unless ``got`` has ``want``'s shape and dtype, no stray
    NaN, a relative error <= ``tol`` and every element within ``ELEMENT_FACTOR * tol * rms``."""
    g, w = check_like(what, got, want)
    if not torch.isfinite(g).all():
        bad = int((~torch.isfinite(g)).sum())
        raise AssertionError(f"{what}: {bad} of {g.numel()} elements are NaN or infinite")
    rms = w.pow(2).mean().sqrt().item()
    rel = ((g - w).norm() / w.norm()).item()
    if rel > tol:
        raise AssertionError(
            f"{what}: relative error {rel:.4g} exceeds {tol:g} ({_dtype_name(dtype)}); reference RMS {rms:.4g}"
        )
    err = (g - w).abs()
    worst = int(err.argmax())
    bound = ELEMENT_FACTOR * tol * rms
    if err.view(-1)[worst] > bound:
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), g.shape))
        raise AssertionError(
            f"{what}: element {idx} is {float(g[idx]):.6g}, reference {float(w[idx]):.6g}: "
            f"off by more than {bound:.4g} ({ELEMENT_FACTOR:g} x {tol:g} x the reference's RMS)"
        )


def _tol(op: str, dtype: torch.dtype) -> float:
    return QUANT_TOLERANCES[dtype] + ACTIVATION_ALLOWANCE.get(op, 0.0)


def _desc(m: int, k: int, n: int, bias: bool, prefix: str = "") -> str:
    return f"{prefix}{m}x{k}->{n}" + ("+bias" if bias else "")


def _random_gguf(c: _Case, type_name: str, n: int, k: int) -> torch.Tensor:
    """uint8 [n, k/block_values * block_bytes]: random quants with realistic fp16 scales
    (and minimums; a K-quant's super-block scales over its 6-bit or int8 sub-block scales)."""
    bb, nb = quant_reference.GGUF_BLOCK_BYTES[type_name], k // quant_reference.GGUF_BLOCK_VALUES[type_name]
    raw = c.randint(0, 256, n, nb, bb).to(torch.uint8)

    def half(at: int, values: torch.Tensor) -> None:
        raw[..., at : at + 2] = values.half().view(torch.uint8).reshape(n, nb, 2)

    if type_name in ("Q4_K", "Q5_K"):
        half(0, (torch.rand(n, nb, generator=c.gen) * 0.02 + 1e-3) / 32)  # d; times 6-bit scales
        half(2, (torch.rand(n, nb, generator=c.gen) * 0.02 + 1e-3) / 8)  # dmin; times 6-bit minimums
    elif type_name == "Q6_K":
        half(208, (torch.rand(n, nb, generator=c.gen) * 0.02 + 1e-3) / 64)  # d; times int8 scales
    elif type_name == "Q2_K":
        half(80, (torch.rand(n, nb, generator=c.gen) * 0.02 + 1e-3) / 8)  # d; times 4-bit scales
        half(82, (torch.rand(n, nb, generator=c.gen) * 0.02 + 1e-3) / 8)  # dmin; times 4-bit minimums
    elif type_name == "Q3_K":
        half(108, (torch.rand(n, nb, generator=c.gen) * 0.02 + 1e-3) / 32)  # d; times 6-bit scales - 32
    elif type_name == "IQ4_XS":
        half(0, (torch.rand(n, nb, generator=c.gen) * 0.02 + 1e-3) / 256)  # d; times (6-bit scales - 32) * levels
    else:
        half(0, torch.rand(n, nb, generator=c.gen) * 0.02 + 1e-3)
    if type_name in ("Q4_1", "Q5_1"):
        half(2, torch.randn(n, nb, generator=c.gen) * 0.05)
    return raw.reshape(n, -1)


def _channel_scales(c: _Case, n: int) -> torch.Tensor:
    return torch.rand(n, generator=c.gen) * 0.01 + 1e-3


#: (rows, in, out, bias) of the gguf_linear cases: decode and prefill row counts up to 300
#: (past the CPU's old dense threshold and the tiled kernel's row and column tiles),
#: outputs that are and are not multiples of 16 and 32 (repacked or not), odd block counts.
GGUF_SHAPES: tuple[tuple[int, int, int, bool], ...] = (
    (1, 64, 48, False),
    (7, 128, 40, True),
    (130, 64, 24, True),
    (2, 96, 16, False),
    (5, 160, 80, True),
    (33, 32, 112, False),
    (300, 96, 48, True),
)


#: (rows, in, out, bias) of the cases of the extended types (Q5_0, Q5_1 and the K-quants,
#: whose blocks hold 256 values: in a multiple of 256), for a gguf_linear that declares
#: them (the ``gguf_extended_types`` capability): batch sizes 1, 3, 5, 17, 64; outputs
#: of 3 and 5 groups of 16 (repacked: partial column tiles) and not a multiple of 16.
GGUF_EXTENDED_SHAPES: tuple[tuple[int, int, int, bool], ...] = (
    (1, 256, 48, False),
    (3, 512, 40, True),
    (5, 512, 80, True),
    (17, 256, 24, True),
    (64, 768, 16, False),
)


def _optional_types(t: Target) -> list[str]:
    """The types of GGUF_OPTIONAL_TYPES whose ``gguf_type:NAME`` the target's gguf_linear declares."""
    return [
        type_name
        for type_name in quant_reference.GGUF_OPTIONAL_TYPES
        if t.ops.has_capability("gguf_linear", quant_reference.gguf_type_capability(type_name))
    ]


def _gguf_cases(t: Target) -> list[tuple[str, tuple[tuple[int, int, int, bool], ...]]]:
    cases = [(type_name, GGUF_SHAPES) for type_name in quant_reference.GGUF_BASE_TYPES]
    if t.ops.has_capability("gguf_linear", "gguf_extended_types"):
        cases += [(type_name, GGUF_EXTENDED_SHAPES) for type_name in quant_reference.GGUF_EXTENDED_TYPES]
        # Q5_0 / Q5_1 rows of a multiple of 32 values only.
        cases += [(type_name, ((5, 96, 40, True), (17, 160, 16, False))) for type_name in ("Q5_0", "Q5_1")]
    # Each declared optional type: a 32-value type (IQ4_NL) the base types' shapes, a
    # 256-value one the K-quants'.
    for type_name in _optional_types(t):
        per = quant_reference.GGUF_BLOCK_VALUES[type_name]
        cases.append((type_name, GGUF_SHAPES if per == 32 else GGUF_EXTENDED_SHAPES))
    return cases


def _gguf_linear(t: Target, fn: Callable, dtype: torch.dtype, seed: int, prepare: Callable | None = None) -> Cases:
    """``fn`` on the blocks, or (``prepare``: the registry's ``prepare_gguf_weight``) on
    their prepared form, against the reference on the blocks."""
    for type_name, shapes in _gguf_cases(t):
        for m, k, n, bias in shapes:
            desc = _desc(m, k, n, bias, f"{type_name}-")

            def body(type_name=type_name, m=m, k=k, n=n, bias=bias, desc=desc) -> None:
                c = _Case(f"gguf_linear{desc}{dtype}", seed, t.device)
                data, x = _random_gguf(c, type_name, n, k), c.randn(m, k, dtype=dtype)
                b = c.randn(n, dtype=dtype) if bias else None
                weight = c.dev(data) if prepare is None else prepare(c.dev(data), type_name)
                got = fn(c.dev(x), weight, type_name, None if b is None else c.dev(b))
                want = reference.gguf_linear(x, data, type_name, b)
                assert_close_relative("gguf_linear", got, want, dtype, _tol("gguf_linear", dtype))

            yield desc, body
    if dtype == torch.float32 or not t.ops.has_capability("gguf_linear", "gguf_out_dtype"):
        return
    # out_dtype=float32 from narrower activations: the float32 sums, unrounded.
    for type_name, shapes in _gguf_cases(t):
        for m, k, n, bias in shapes[:2]:
            desc = _desc(m, k, n, bias, f"{type_name}-") + "-out-float32"

            def body32(type_name=type_name, m=m, k=k, n=n, bias=bias, desc=desc) -> None:
                c = _Case(f"gguf_linear{desc}{dtype}", seed, t.device)
                data, x = _random_gguf(c, type_name, n, k), c.randn(m, k, dtype=dtype)
                b = c.randn(n, dtype=dtype) if bias else None
                weight = c.dev(data) if prepare is None else prepare(c.dev(data), type_name)
                got = fn(c.dev(x), weight, type_name, None if b is None else c.dev(b), torch.float32)
                want = reference.gguf_linear(x, data, type_name, b, torch.float32)
                # The activations' quantization error stays; the bf16 rounding of y is gone.
                assert_close_relative(
                    "gguf_linear out_dtype=float32", got, want, torch.float32, _tol("gguf_linear", dtype)
                )

            yield desc, body32


#: (rows, in, d, bias) of the gguf_linear_silu_and_mul cases ([gate; up] of 2*d rows): d a
#: multiple of 16 (the CPU's gated tiled kernel, odd and even column-group counts) or not
#: (the two ops in sequence), decode and prefill row counts over partial row tiles.
GGUF_GATED_SHAPES: tuple[tuple[int, int, int, bool], ...] = (
    (1, 64, 48, False),
    (7, 128, 16, True),
    (130, 64, 32, False),
    (3, 96, 40, True),
    (300, 96, 80, True),
)
#: The same for the 256-value types (the K-quants: in a multiple of 256): the CPU's gated
#: K-quant tiles at 1 and 17 rows, a gate width that is not a multiple of 16.  One row
#: takes K 512: with K 256 the int8 activations' error of a single row (one draw shared by
#: every output) reaches 3.6% on random K-quant blocks, above the allowance.
GGUF_GATED_EXTENDED_SHAPES: tuple[tuple[int, int, int, bool], ...] = (
    (1, 512, 48, False),
    (17, 512, 32, True),
    (5, 256, 40, True),
)


def _gguf_linear_silu_and_mul(t: Target, fn: Callable, dtype: torch.dtype, seed: int) -> Cases:
    """``fn`` on [gate; up] blocks put through the registry's ``prepare_gguf_weight`` (the
    form the model hands it) against the reference's two ops on the blocks."""
    prepare = t.ops.get("prepare_gguf_weight")
    types = quant_reference.GGUF_BASE_TYPES
    if t.ops.has_capability("gguf_linear", "gguf_extended_types"):
        types += ("Q5_0", "Q5_1")  # the 32-value extended types (the CPU's tiled kernel takes them packed)
    types += tuple(x for x in _optional_types(t) if quant_reference.GGUF_BLOCK_VALUES[x] == 32)
    cases = [(type_name, GGUF_GATED_SHAPES) for type_name in types]
    # The 256-value types: the K-quants of the extended types, and the optional ones declared.
    ktypes = tuple(x for x in _optional_types(t) if quant_reference.GGUF_BLOCK_VALUES[x] == 256)
    if t.ops.has_capability("gguf_linear", "gguf_extended_types"):
        ktypes = ("Q4_K", "Q5_K", "Q6_K", *ktypes)
    cases += [(type_name, GGUF_GATED_EXTENDED_SHAPES) for type_name in ktypes]
    for type_name, shapes in cases:
        for m, k, d, bias in shapes:
            desc = _desc(m, k, 2 * d, bias, f"{type_name}-")

            def body(type_name=type_name, m=m, k=k, d=d, bias=bias, desc=desc) -> None:
                c = _Case(f"gguf_linear_silu_and_mul{desc}{dtype}", seed, t.device)
                data, x = _random_gguf(c, type_name, 2 * d, k), c.randn(m, k, dtype=dtype)
                b = c.randn(2 * d, dtype=dtype) if bias else None
                got = fn(c.dev(x), prepare(c.dev(data), type_name), type_name, None if b is None else c.dev(b))
                want = reference.gguf_linear_silu_and_mul(x, data, type_name, b)
                op = "gguf_linear_silu_and_mul"
                assert_close_relative(op, got, want, dtype, _tol(op, dtype))

            yield desc, body


#: (rows, in, bias) of the gguf_linear_stacked cases, each over every mix below (mixes with
#: a 256-value part: the second shapes).
GGUF_STACKED_SHAPES: tuple[tuple[int, int, bool], ...] = ((1, 64, False), (7, 96, True), (130, 64, True))
GGUF_STACKED_EXTENDED_SHAPES: tuple[tuple[int, int, bool], ...] = ((1, 256, False), (17, 512, True))


def _gguf_stacked_mixes(t: Target) -> list[tuple[tuple[str, int], ...]]:
    """Parts (type, rows) of the gguf_linear_stacked cases: a Q4_0 [q; k] beside a Q8_0 v
    and parts of rows not a multiple of 16; with the extended types, a Q5_K_M's Q5_1
    beside Q8_0, and Q5_0 parts on both sides of a Q8_0 one; with IQ4_NL, its [q; k]
    beside a Q8_0 v (llama-quantize's fallback for a tensor it cannot give IQ4_NL) and
    beside Q4_1 (whose activation sums are rounded differently) and beside Q5_0; a Q4_K_M's
    [q; k] Q4_K beside a Q6_K v, K-quants beside 32-value parts, and the optional 256-value
    types (Q2_K, Q3_K, IQ4_XS) beside a Q6_K."""
    mixes = [(("Q4_0", 32), ("Q8_0", 16)), (("Q8_0", 16), ("Q4_1", 24), ("Q4_0", 16))]
    extended = t.ops.has_capability("gguf_linear", "gguf_extended_types")
    if extended:
        mixes += [(("Q5_1", 48), ("Q8_0", 16)), (("Q5_0", 16), ("Q8_0", 32), ("Q5_0", 16))]
    if "IQ4_NL" in _optional_types(t):
        mixes += [(("IQ4_NL", 32), ("Q8_0", 16)), (("Q4_1", 16), ("IQ4_NL", 24))]
        if extended:
            mixes += [(("IQ4_NL", 48), ("Q5_0", 16))]
    if extended:
        mixes += [(("Q4_K", 32), ("Q6_K", 16)), (("Q5_K", 16), ("Q8_0", 16), ("Q4_1", 16))]
        mixes += [(("Q6_K", 16), ("Q5_0", 32), ("Q4_K", 16))]
        kopt = [x for x in _optional_types(t) if quant_reference.GGUF_BLOCK_VALUES[x] == 256]
        if kopt:
            mixes += [(*((x, 16) for x in kopt), ("Q6_K", 16))]
    return mixes


def _gguf_linear_stacked(t: Target, fn: Callable, dtype: torch.dtype, seed: int) -> Cases:
    """``fn`` on parts put through the registry's ``prepare_gguf_weight`` against the
    reference on the blocks (float32 output too, where ``gguf_linear`` takes it)."""
    prepare = t.ops.get("prepare_gguf_weight")
    out32 = dtype != torch.float32 and t.ops.has_capability("gguf_linear", "gguf_out_dtype")
    for mix in _gguf_stacked_mixes(t):
        wide = any(quant_reference.GGUF_BLOCK_VALUES[type_name] == 256 for type_name, _ in mix)
        for m, k, bias in GGUF_STACKED_EXTENDED_SHAPES if wide else GGUF_STACKED_SHAPES:
            n = sum(rows for _, rows in mix)
            desc = _desc(m, k, n, bias, "+".join(type_name for type_name, _ in mix) + "-")

            def body(mix=mix, m=m, k=k, n=n, bias=bias, desc=desc) -> None:
                c = _Case(f"gguf_linear_stacked{desc}{dtype}", seed, t.device)
                types = [type_name for type_name, _ in mix]
                data = [_random_gguf(c, type_name, rows, k) for type_name, rows in mix]
                x = c.randn(m, k, dtype=dtype)
                b = c.randn(n, dtype=dtype) if bias else None
                weights = [prepare(c.dev(d), type_name) for d, type_name in zip(data, types)]
                for out_dtype in (None, torch.float32) if out32 else (None,):
                    got = fn(c.dev(x), weights, types, None if b is None else c.dev(b), out_dtype)
                    want = reference.gguf_linear_stacked(x, data, types, b, out_dtype)
                    assert_close_relative(
                        f"gguf_linear_stacked out_dtype={out_dtype}",
                        got,
                        want,
                        out_dtype or dtype,
                        _tol("gguf_linear", dtype),
                    )

            yield desc, body


def _int8_cases(op: str) -> Callable[[Target, Callable, torch.dtype, int], Cases]:
    ref = getattr(reference, op)

    def cases(t: Target, fn: Callable, dtype: torch.dtype, seed: int) -> Cases:
        # Multiples of 8 (integer GEMMs want them); 1 and 7 rows as in decode batches.
        for m, k, n, bias in [(1, 64, 48, False), (7, 96, 40, True), (33, 128, 64, True)]:
            desc = _desc(m, k, n, bias)

            def body(m=m, k=k, n=n, bias=bias, desc=desc) -> None:
                c = _Case(f"{op}{desc}{dtype}", seed, t.device)
                qweight = c.randint(-127, 128, n, k).to(torch.int8)
                scale, x = _channel_scales(c, n), c.randn(m, k, dtype=dtype)
                b = c.randn(n, dtype=dtype) if bias else None
                got = fn(c.dev(x), c.dev(qweight), c.dev(scale), None if b is None else c.dev(b))
                assert_close_relative(op, got, ref(x, qweight, scale, b), dtype, _tol(op, dtype))

            yield desc, body

    return cases


def _fp8_linear(t: Target, fn: Callable, dtype: torch.dtype, seed: int) -> Cases:
    # Multiples of 16 (FP8 tensor-core GEMMs want them); per-channel and per-tensor scales.
    for m, k, n, per_channel, bias in [(1, 64, 48, True, False), (7, 128, 32, False, True), (33, 64, 64, True, True)]:
        desc = _desc(m, k, n, bias, "channel-" if per_channel else "tensor-")

        def body(m=m, k=k, n=n, per_channel=per_channel, bias=bias, desc=desc) -> None:
            c = _Case(f"fp8_linear{desc}{dtype}", seed, t.device)
            qweight = (c.randn(n, k) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
            scale = _channel_scales(c, n) if per_channel else _channel_scales(c, 1)[0]
            x = c.randn(m, k, dtype=dtype)
            b = c.randn(n, dtype=dtype) if bias else None
            got = fn(c.dev(x), c.dev(qweight), c.dev(scale), None if b is None else c.dev(b))
            want = reference.fp8_linear(x, qweight, scale, b)
            assert_close_relative("fp8_linear", got, want, dtype, _tol("fp8_linear", dtype))

        yield desc, body


def _gguf_embedding(t: Target, fn: Callable, dtype: torch.dtype, seed: int) -> Cases:
    """``fn`` on rows (repeated, out of order) of blocks put through the registry's
    ``prepare_gguf_weight``: exactly the reference's dequantized rows."""
    prepare = t.ops.get("prepare_gguf_weight")
    for type_name, shapes in _gguf_cases(t):
        k = shapes[0][1]
        for n in (48, 40):  # repacked (a multiple of 16) or not
            desc = f"{type_name}-{n}x{k}"

            def body(type_name=type_name, n=n, k=k, desc=desc) -> None:
                c = _Case(f"gguf_embedding{desc}{dtype}", seed, t.device)
                data = _random_gguf(c, type_name, n, k)
                ids = torch.tensor([n - 1, 0, 17, 17, 5, n // 2])
                got = fn(c.dev(ids), prepare(c.dev(data), type_name), type_name, dtype)
                want = reference.gguf_embedding(ids, data, type_name, dtype)
                if got.shape != want.shape or got.dtype != want.dtype or not torch.equal(got.cpu(), want):
                    raise AssertionError(f"gguf_embedding {desc}: rows differ from the reference's")

            yield desc, body


QUANT_CASES: dict[str, Callable[[Target, Callable, torch.dtype, int], Cases]] = {
    "gguf_embedding": _gguf_embedding,
    "gguf_linear": _gguf_linear,
    # A platform's prepare_gguf_weight is checked through its (or the reference's) gguf_linear.
    "prepare_gguf_weight": lambda t, fn, d, s: _gguf_linear(t, t.ops.get("gguf_linear"), d, s, prepare=fn),
    "gguf_linear_silu_and_mul": _gguf_linear_silu_and_mul,
    "gguf_linear_stacked": _gguf_linear_stacked,
    "int8_linear": _int8_cases("int8_linear"),
    "w8a8_linear": _int8_cases("w8a8_linear"),
    "fp8_linear": _fp8_linear,
}
