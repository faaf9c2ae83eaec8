"""Each GGUF block type's tiled GEMM against Q4_1's on the default model's layer shapes.

    python benchmarks/gguf_types_micro.py [--types Q4_1 Q5_0 Q8_0 Q4_K Q6_K] [--rows 1 16 64 256]
                                          [--shapes qkv o gate_up down] [--rounds 9] [--layers 30]
                                          [--dims HIDDEN INTER [--kv KV]] [--fusion]

One thread, CPU time (``time.thread_time``) of ``--layers`` calls on distinct weights (read
from memory, as in a decode step), repacked at load as the model repacks them, bf16
activations and outputs; gate_up through the gated kernel (``gguf_linear_silu_out``) as
the model runs it, the others through ``gguf_linear_out``.  The types take turns call set
by call set (round r: every type once, the order rotated each round), so a drift in the
machine's speed reaches them alike; each type's figure is the median over the rounds of
microseconds per call, and its ratio to Q4_1 the median of the per-round ratios (with
their minimum and maximum).  K-quant blocks hold 256 values, so they take only the shapes
whose input is a multiple of 256 (of the default model's, the down projection).  Two pseudo-types
set other paths beside them: ``BF16``, the dense path a type without a kept kernel takes
(the first other type's random weights dequantized at load to bf16 and put through the
CPU platform's ``prepare_linear_weight``, then its ``linear`` / ``linear_silu_and_mul``:
the model's own ops for a dequantized .gguf), and ``TYPE/rows`` (the row kernel on the
file's blocks, not repacked; not on gate_up).

``--only TYPE`` times one type alone (``--rounds`` passes of every shape and row count),
for whole-process comparisons of two types, each its own process.  ``--dims HIDDEN INTER``
replaces the default model's shapes by a layer of those sizes (qkv HIDDEN -> HIDDEN + 2 KV,
``--kv`` default HIDDEN / 4; o; gate_up HIDDEN -> 2 INTER; down INTER -> HIDDEN): ``--dims
2048 8192`` is a Llama-3.2-1B-like layer, where the K-quants fit every projection.

``--fusion`` times the fused calls against the unfused ones instead, interleaved as above:
gate_up of ``--gate-type`` (default Q4_K) through the gated kernel (``gguf_linear_silu_out``)
against ``gguf_linear_out`` then the CPU platform's ``silu_and_mul`` (the [M, 2 INTER]
intermediate written and read back), and qkv of ``--qkv-types`` (q, k, v; default Q4_K Q4_K
Q6_K, a Q4_K_M's: adjacent parts of one type fused as the model fuses them) through one
``gguf_linear_multi_out`` against ``gguf_linear_out`` per part and ``torch.cat`` (what the
stacked op does for parts it cannot take).  ``--before SO`` loads a
second build of the quantized kernels (another checkout's ``pagedserve_quant_*.so``) beside
this one: every type then also runs on it as ``TYPE@before`` (the same blocks, packed by
that build), in the same rounds, for before/after ratios in one process.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

__all__ = ["SHAPES", "random_blocks", "prepare", "bench", "main"]

#: The default model's linear layers (in, out), [gate; up] as one gated weight (the default
#: ``--shapes``), and two of a 1-2B model's (inputs a multiple of 256, as every linear of the
#: 7-70B files that hold IQ4_XS / K-quants throughout): ``d2048`` 2048 -> 2048 and
#: ``up2048`` 2048 -> 8192, through the plain GEMM (use ``--layers 8`` or so: 30 bf16 copies
#: of the second take 1 GB).
MODEL_SHAPES: dict[str, tuple[int, int]] = {
    "qkv": (576, 960),
    "o": (576, 576),
    "gate_up": (576, 3072),
    "down": (1536, 576),
}
SHAPES: dict[str, tuple[int, int]] = {**MODEL_SHAPES, "d2048": (2048, 2048), "up2048": (2048, 8192)}


def random_blocks(type_name: str, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """uint8 [n, row bytes] of ``type_name``: random quants (every bit pattern of the
    quants, K-quant sub-block scales included) with fp16 block scales of realistic size."""
    from pagedserve.kernels import quant_reference as qref

    bb, per = qref.GGUF_BLOCK_BYTES[type_name], qref.GGUF_BLOCK_VALUES[type_name]
    raw = torch.randint(0, 256, (n, k // per, bb), dtype=torch.uint8, generator=gen)
    halves = {
        "Q6_K": [208],
        "Q3_K": [108],
        "Q4_K": [0, 2],
        "Q5_K": [0, 2],
        "Q4_1": [0, 2],
        "Q5_1": [0, 2],
        "Q2_K": [80, 82],
    }.get(type_name, [0])
    for at in halves:
        scale = (torch.rand(n, k // per, generator=gen) * 0.02 + 1e-3) / (32 if per == 256 else 1)
        raw[..., at : at + 2] = scale.half().view(torch.uint8).reshape(n, -1, 2)
    return raw.reshape(n, -1)


def prepare(quant, type_name: str, n: int, k: int, layers: int, gen: torch.Generator) -> list[torch.Tensor]:
    """``layers`` random weights [n, k] of ``type_name``, repacked for the tiled kernel."""
    from pagedserve.kernels import quant_reference as qref

    tid = qref.GGUF_TYPE_IDS[type_name]
    return [quant.pack_weight(random_blocks(type_name, n, k, gen), tid) for _ in range(layers)]


def load_module(path: str):
    """A built quantized-kernel extension (``pagedserve_quant_*.so``) imported under its own name."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(Path(path).name.split(".")[0], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dense_ops():
    """The CPU platform's op registry (its bf16 ``linear`` for the dense candidate)."""
    from pagedserve.testing.target import select_target

    return select_target("cpu").ops


#: The dense candidate's name among ``--types``.
DENSE = "BF16"


def row_path(t: str) -> bool:
    """Whether a column runs the row kernel (``Q3_K/rows``, ``Q3_K/rows@before``)."""
    return t.split("@")[0].endswith("/rows")


def base_type(t: str) -> str:
    """The ggml type of a column of the table (``Q4_K@before``, ``Q3_K/rows``: Q4_K, Q3_K)."""
    return t.split("@")[0].split("/")[0]


def applies(type_name: str, shape: str) -> bool:
    from pagedserve.kernels import quant_reference as qref

    if type_name == DENSE:
        return True
    if row_path(type_name) and shape == "gate_up":  # no gated row kernel
        return False
    type_name = base_type(type_name)
    return SHAPES[shape][0] % qref.GGUF_BLOCK_VALUES[type_name] == 0


def bench(
    quant,
    types: list[str],
    shapes: list[str],
    rows: list[int],
    rounds: int,
    layers: int,
    seed: int = 0,
    before=None,
) -> list[dict]:
    """One dict per (shape, rows, type): median us per call over ``rounds`` and, for types
    other than the first, the median / min / max of the per-round ratios to the first.
    ``before``: a second kernel module; ``TYPE@before`` entries of ``types`` run on it."""
    from pagedserve.kernels import quant_reference as qref

    def module(t: str):
        return before if t.endswith("@before") else quant

    gen = torch.Generator().manual_seed(seed)
    out = []
    for shape in shapes:
        k, n = SHAPES[shape]
        here = [t for t in types if applies(t, shape)]
        if not here:
            continue
        bases = {t: base_type(t) for t in here if t != DENSE}
        quantized = list(dict.fromkeys(bases.values()))
        raw = {b: [random_blocks(b, n, k, gen) for _ in range(layers)] for b in quantized}
        weights = {
            t: raw[bases[t]]
            if row_path(t)
            else [module(t).pack_weight(r, qref.GGUF_TYPE_IDS[bases[t]]) for r in raw[bases[t]]]
            for t in bases
        }
        if DENSE in here:
            ops = dense_ops()
            source = raw[quantized[0]] if quantized else [random_blocks("Q8_0", n, k, gen) for _ in range(layers)]
            name = quantized[0] if quantized else "Q8_0"
            weights[DENSE] = [
                ops.prepare_linear_weight(qref.dequantize_gguf(r, name).bfloat16().contiguous()) for r in source
            ]
        for m in rows:
            x = torch.randn(m, k, generator=gen).bfloat16()

            def calls(t: str) -> None:
                if t == DENSE:
                    fn = ops.linear_silu_and_mul if shape == "gate_up" else ops.linear
                    for w in weights[t]:
                        fn(x, w)
                    return
                tid = qref.GGUF_TYPE_IDS[base_type(t)]
                mod = module(t)
                fn = mod.gguf_linear_silu_out if shape == "gate_up" else mod.gguf_linear_out
                for w in weights[t]:
                    fn(x, w, tid)

            times: dict[str, list[float]] = {t: [] for t in here}
            for t in here:  # warm-up
                calls(t)
            for r in range(rounds):
                order = here[r % len(here) :] + here[: r % len(here)]
                for t in order:
                    t0 = time.thread_time()
                    calls(t)
                    times[t].append((time.thread_time() - t0) / layers * 1e6)
            base = times[here[0]]
            for t in here:
                ratios = [a / b for a, b in zip(times[t], base)]
                row = dict(
                    shape=f"{shape} {k}->{n}",
                    rows=m,
                    type=t,
                    us=statistics.median(times[t]),
                    ratio=statistics.median(ratios),
                    lo=min(ratios),
                    hi=max(ratios),
                )
                if t + "@before" in times:  # this build / the other, round by round
                    vs = [a / b for a, b in zip(times[t], times[t + "@before"])]
                    row.update(vs_before=statistics.median(vs), vs_lo=min(vs), vs_hi=max(vs))
                out.append(row)
    return out


def set_dims(hidden: int, inter: int, kv: int | None = None) -> None:
    """SHAPES for a layer of hidden size ``hidden``, MLP size ``inter`` and ``kv`` key/value
    columns (default hidden / 4)."""
    kv = hidden // 4 if kv is None else kv
    SHAPES.clear()
    SHAPES.update(
        {
            "qkv": (hidden, hidden + 2 * kv),
            "o": (hidden, hidden),
            "gate_up": (hidden, 2 * inter),
            "down": (inter, hidden),
        }
    )


def fusion_bench(
    quant, gate_type: str, qkv_types: list[str], rows: list[int], rounds: int, layers: int, seed: int = 0
) -> list[dict]:
    """One dict per (call, rows, variant): median us per call and the median / min / max of
    the per-round ratios fused / unfused (see the module docstring)."""
    from pagedserve.kernels import quant_reference as qref
    from pagedserve.testing.target import select_target

    silu_and_mul = select_target("cpu").ops.get("silu_and_mul")
    gen = torch.Generator().manual_seed(seed)
    hidden, n_gate_up = SHAPES["gate_up"]
    n_q = SHAPES["o"][1]
    kv = (SHAPES["qkv"][1] - n_q) // 2
    # q, k, v rows; adjacent parts of one type as one weight (the model's fusion).
    parts: list[list] = []
    for t, n in zip(qkv_types, (n_q, kv, kv)):
        if parts and parts[-1][0] == t:
            parts[-1][1] += n
        else:
            parts.append([t, n])
    gid = qref.GGUF_TYPE_IDS[gate_type]
    gate_w = [quant.pack_weight(random_blocks(gate_type, n_gate_up, hidden, gen), gid) for _ in range(layers)]
    qkv_ids = [qref.GGUF_TYPE_IDS[t] for t, _ in parts]
    qkv_w = [
        [quant.pack_weight(random_blocks(t, n, hidden, gen), qref.GGUF_TYPE_IDS[t]) for t, n in parts]
        for _ in range(layers)
    ]
    qkv_name = "+".join(f"{t}x{n}" for t, n in parts)
    variants = {
        f"gate_up {gate_type} {hidden}->{n_gate_up}": {
            "fused": lambda x: [quant.gguf_linear_silu_out(x, w, gid) for w in gate_w],
            "unfused": lambda x: [silu_and_mul(quant.gguf_linear_out(x, w, gid)) for w in gate_w],
        },
        f"qkv {qkv_name} {hidden}->{SHAPES['qkv'][1]}": {
            "fused": lambda x: [quant.gguf_linear_multi_out(x, ws, qkv_ids) for ws in qkv_w],
            "unfused": lambda x: [
                torch.cat([quant.gguf_linear_out(x, w, i) for w, i in zip(ws, qkv_ids)], dim=-1) for ws in qkv_w
            ],
        },
    }
    out = []
    for call, fns in variants.items():
        names = list(fns)
        for m in rows:
            x = torch.randn(m, hidden, generator=gen).bfloat16()
            times: dict[str, list[float]] = {v: [] for v in names}
            for v in names:  # warm-up
                fns[v](x)
            for r in range(rounds):
                for v in names[r % 2 :] + names[: r % 2]:
                    t0 = time.thread_time()
                    fns[v](x)
                    times[v].append((time.thread_time() - t0) / layers * 1e6)
            ratios = [a / b for a, b in zip(times["fused"], times["unfused"])]
            out.append(
                dict(
                    call=call,
                    rows=m,
                    fused=statistics.median(times["fused"]),
                    unfused=statistics.median(times["unfused"]),
                    ratio=statistics.median(ratios),
                    lo=min(ratios),
                    hi=max(ratios),
                )
            )
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--types", nargs="+", default=["Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"])
    p.add_argument("--rows", nargs="+", type=int, default=[1, 16, 64, 256])
    p.add_argument("--shapes", nargs="+", default=list(MODEL_SHAPES), choices=list(SHAPES))
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--only", default=None, help="time this one type alone (whole-process comparisons)")
    p.add_argument("--before", default=None, help="a second build's .so: each type also runs on it as TYPE@before")
    p.add_argument("--dims", nargs=2, type=int, default=None, metavar=("HIDDEN", "INTER"), help="layer sizes")
    p.add_argument("--kv", type=int, default=None, help="with --dims: key/value columns (default HIDDEN / 4)")
    p.add_argument("--fusion", action="store_true", help="fused against unfused gate_up and qkv calls")
    p.add_argument("--gate-type", default="Q4_K")
    p.add_argument("--qkv-types", nargs=3, default=["Q4_K", "Q4_K", "Q6_K"], metavar=("Q", "K", "V"))
    args = p.parse_args()
    if args.dims:
        set_dims(*args.dims, args.kv)
    from pagedserve.kernels.cpu.quant_native import load_quant_kernels

    torch.set_num_threads(args.threads)
    quant = load_quant_kernels()
    if quant is None or not quant.has_packed():
        raise SystemExit("the tiled GGUF kernel is unavailable on this machine")
    if args.fusion:
        print(
            f"torch {torch.__version__}, {args.threads} thread(s), {args.layers} layers, {args.rounds} rounds, CPU time"
        )
        print("| call | rows | fused us | unfused us | fused / unfused (min-max) |")
        print("|---|---:|---:|---:|---:|")
        for r in fusion_bench(quant, args.gate_type, args.qkv_types, args.rows, args.rounds, args.layers):
            spread = f"{r['lo']:.2f}-{r['hi']:.2f}"
            print(
                f"| {r['call']} | {r['rows']} | {r['fused']:.1f} | {r['unfused']:.1f} | {r['ratio']:.3f} ({spread}) |"
            )
        return 0
    before = load_module(args.before) if args.before else None
    if before is not None:
        args.types = [x for t in args.types for x in (t, t + "@before")]
    if args.only:
        res = bench(quant, [args.only], args.shapes, args.rows, args.rounds, args.layers)
        total = sum(r["us"] * args.layers * args.rounds for r in res) * 1e-6
        print(f"{args.only}: {total:.3f} s of calls")
        return 0
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.layers} layers, {args.rounds} rounds, CPU time")
    print(
        f"| shape | rows | {' | '.join(args.types)} | {' | '.join(t + ' / ' + args.types[0] for t in args.types[1:])} |"
    )
    print("|---|---:|" + "---:|" * (2 * len(args.types) - 1))
    res = bench(quant, args.types, args.shapes, args.rows, args.rounds, args.layers, before=before)
    for shape in dict.fromkeys(r["shape"] for r in res):
        for m in args.rows:
            row = {r["type"]: r for r in res if r["shape"] == shape and r["rows"] == m}
            us = " | ".join(f"{row[t]['us']:.1f}" if t in row else "" for t in args.types)
            ratio = " | ".join(
                f"{row[t]['ratio']:.2f}x ({row[t]['lo']:.2f}-{row[t]['hi']:.2f})"
                if t in row and args.types[0] in row
                else ""
                for t in args.types[1:]
            )
            print(f"| {shape} | {m} | {us} | {ratio} |")
    if before is not None:
        print("\nthis build / --before, medians of the per-round ratios (min-max):")
        for r in res:
            if "vs_before" in r:
                spread = f"{r['vs_lo']:.2f}-{r['vs_hi']:.2f}"
                print(f"| {r['shape']} | {r['rows']} | {r['type']} | {r['vs_before']:.3f} ({spread}) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
