"""Where the time of a whole benchmark workload goes, op by op, prefill steps apart from decode steps.

    python benchmarks/profile_workload.py --workload mixed [--model-dir DIR]

Runs one workload of benchmarks/workloads.py (the same requests, seeds and engine
settings as compare_vllm.py) through pagedserve with every op of the registry wrapped
in a wall-clock timer.  A step is a "prefill" step when any of its requests is still
in its prompt ("mixed" when decodes ride along), else a "decode" step.  Prints seconds
per op for each kind, the rest of
the model runner's step (Python, input preparation, sampling) as "else", and decode
steps grouped by batch size, each split into the ops, the runner outside its ops and
the engine's step outside the runner (scheduling, detokenization, stop checks,
outputs).  ``--async-scheduling`` profiles that setting (docs/async_scheduling.md).
``--num-requests``/``--output-len`` shrink the workload for a quick look (``--input-len``
sets the prompt length of "fixed": ``--workload fixed --num-requests 1 --input-len 1024
--output-len 1`` is one 1024-token prefill).  ``--gguf`` profiles the default model's
own GGUF file (the default path: blocks kept, ``dtype`` auto) instead of the bf16
folder (``--gguf FILE``: another .gguf, e.g. a Q4_K_M), and times its quantized linear
layers by kind ("gguf qkv", "gguf o", "gguf gate_up+silu" or "gguf gate_up", "gguf
down", "gguf lm_head": they hold their ops from load, outside the registry's timers; a
fused projection that mixes block types runs as one stacked call, "gguf qkv
Q4_K+Q4_K+Q6_K", and where it cannot, its parts are timed apart, e.g. "gguf qkv
Q8_0"), then prints those linears by row count per call (wall and process CPU seconds:
on a loaded machine the CPU seconds are what compares); ``--unfused-mlp`` runs its MLPs
as gguf_linear then silu_and_mul, as before the fused op.  On the bf16 folder the
dense linears are tabled by weight shape and rows per call (seconds and GFLOP/s; the
LM head is the ``576->49152`` row of the default model), and ``paged_attention`` by
step kind with its query-key pairs (prompt chunks apart from decodes) and nanoseconds
per pair and layer.  ``--clock cpu`` times everything in process CPU seconds instead of
wall-clock seconds (with ``--threads 1`` that is the one compute thread's time, which a
loaded machine inflates far less than wall time).  The timers
cost a few microseconds per op call, so the workload runs slightly slower than in
compare_vllm.py.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pathlib
import pstats
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from profile_decode import time_ops  # noqa: E402
from workloads import WORKLOADS, default_gguf_path, make_workload  # noqa: E402

#: A plain token id for the warm-up prompt (the first ids are special tokens).
MIN_ID = 100
#: Upper bounds of the row-count buckets of the linears' tables.
ROW_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096)


def _timed(fn, name: str, record, by_rows=None):
    def timed(*a, **kw):
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            return fn(*a, **kw)
        finally:
            wall = time.perf_counter() - t0
            record(name, wall)
            if by_rows is not None:
                rows = a[0].shape[0]
                bucket = next((b for b in ROW_BUCKETS if rows <= b), ROW_BUCKETS[-1])
                by_rows[name, bucket] += (1, wall, time.process_time() - c0)

    return timed


class _Cell(tuple):
    """(calls, wall seconds, CPU seconds), added element-wise."""

    def __new__(cls, v=(0, 0.0, 0.0)):
        return super().__new__(cls, v)

    def __add__(self, other):
        return _Cell(tuple(a + b for a, b in zip(self, other)))


def time_gguf_weights(model, record, unfused_mlp: bool = False, by_rows=None) -> None:
    """Wrap the ops each GGUF linear weight of ``model`` holds in timers named by layer
    kind (a mixed-type fusion's parts apart, named with their type); ``unfused_mlp``
    drops the [gate; up] weights' fused op (gguf_linear, then the registry's
    silu_and_mul).  ``by_rows``: a defaultdict(_Cell) that also gets each call's time
    under (name, row bucket)."""
    from pagedserve.quantization import GGUFWeight, StackedWeight

    weights = [(f, getattr(layer, f)) for layer in model.layers for f in model.linear_fields]
    weights.append(("lm_head", getattr(model, "lm_head", None)))
    for field, weight in weights:
        stacked = getattr(weight, "_stacked_op", None) if isinstance(weight, StackedWeight) else None
        if stacked is not None:
            # The parts in one native call (their own ops then run only as a fallback).
            types = "+".join(p.type_name for p in weight.parts)
            weight._stacked_op = _timed(stacked, f"gguf {field} {types}", record, by_rows)
        parts = [(f"gguf {field} {p.type_name}", p) for p in weight.parts] if isinstance(weight, StackedWeight) else []
        for name, w in parts or [(f"gguf {field}", weight)]:
            if not isinstance(w, GGUFWeight):
                continue
            if field == "gate_up" and unfused_mlp:
                w.gated_op = None
            w.op = _timed(w.op, name, record, by_rows)
            if w.gated_op is not None:
                w.gated_op = _timed(w.gated_op, f"{name}+silu", record, by_rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="mixed", choices=WORKLOADS)
    p.add_argument(
        "--model-dir",
        default=str(pathlib.Path.home() / ".cache/pagedserve-bench/SmolLM2-135M-Instruct-bf16"),
        help="bf16 checkpoint folder (benchmarks/README.md makes it)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--num-requests", type=int, default=None, help="override the workload's size")
    p.add_argument("--output-len", type=int, default=None, help="override the workload's output length")
    p.add_argument("--input-len", type=int, default=None, help="override the prompt length of fixed/short")
    p.add_argument(
        "--gguf",
        nargs="?",
        const="default",
        default=None,
        metavar="FILE",
        help="a .gguf instead of the bf16 folder (alone: the default model's GGUF file)",
    )
    p.add_argument("--unfused-mlp", action="store_true", help="GGUF: gate/up GEMM, then silu_and_mul (as before)")
    p.add_argument("--async-scheduling", action="store_true", help="overlap output processing with the forward")
    p.add_argument("--cprofile", type=int, default=0, help="also print cProfile's N most costly functions (slower)")
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="time ops and steps in wall-clock or process CPU seconds",
    )
    args = p.parse_args(argv)

    from pagedserve import LLM, SamplingParams
    from pagedserve.executor import model_runner

    if args.gguf:
        args.model_dir = str(default_gguf_path()) if args.gguf == "default" else args.gguf
    llm = LLM(
        model=args.model_dir,
        dtype="auto" if args.gguf else "bfloat16",
        threads=args.threads,
        max_model_len=2048,
        max_num_seqs=256,
        max_num_batched_tokens=2048,
        kv_cache_memory="4GiB",
        seed=args.seed,
        async_scheduling=args.async_scheduling,
    )
    # Warm up outside the timers (first-call allocations, and ops tuned at their first
    # call: paged_attention where it has candidates), as `pagedserve bench throughput` does.
    llm.generate([[MIN_ID] * 16], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    ops = llm.llm_engine.ops
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    kind = ["decode"]
    spent: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    op_total = [0.0]

    timer_calls = [0]

    def record(name: str, seconds: float) -> None:
        spent[kind[0]].update({name: seconds})
        op_total[0] += seconds
        timer_calls[0] += 1

    time_ops(ops, record, clock)
    by_rows: dict[tuple[str, int], _Cell] = collections.defaultdict(_Cell)
    dense: dict[tuple[str, int], list] = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    attn: dict[str, list] = collections.defaultdict(lambda: [0, 0.0, 0, 0])
    if args.gguf:
        time_gguf_weights(llm.llm_engine.runner.model, record, args.unfused_mlp, by_rows)
    else:
        # Quantized weights were handed their op at load: give them the timed one.
        for w in _quantized_weights(llm.llm_engine.runner.model):
            if w.op is not None and hasattr(ops, w.op.__name__):
                w.op = ops.get(w.op.__name__)
        time_dense(ops, clock, dense)
    time_attention(ops, clock, attn, kind)

    steps: list[tuple[str, int, float, float]] = []  # (kind, requests, seconds, of which in ops)
    execute = model_runner.ModelRunner.execute

    def timed_execute(self, out, block_ids):
        kind[0] = step_kind(out.scheduled)
        t0, ops0 = clock(), op_total[0]
        try:
            return execute(self, out, block_ids)
        finally:
            steps.append((kind[0], len(out.scheduled), clock() - t0, op_total[0] - ops0))

    model_runner.ModelRunner.execute = timed_execute
    # The engine's whole step (scheduling, output processing, detokenization) around the runner.
    engine_step = [0.0]
    outside: dict[int, float] = {}  # runner step index -> engine time outside the runner
    step = type(llm.llm_engine).step

    def timed_step(self):
        t0, ran = clock(), len(steps)
        try:
            return step(self)
        finally:
            seconds = clock() - t0
            engine_step[0] += seconds
            if len(steps) > ran:
                outside[ran] = seconds - steps[ran][2]

    type(llm.llm_engine).step = timed_step
    w = make_workload(
        args.workload,
        llm.llm_engine.runner.arch.vocab_size,
        args.seed,
        args.num_requests,
        args.input_len,
        args.output_len,
    )
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in w.requests]
    profiler = cProfile.Profile() if args.cprofile else None
    t0, c0 = time.perf_counter(), time.process_time()
    if profiler is not None:
        profiler.enable()
    outs = llm.generate([r.prompt_token_ids for r in w.requests], params, use_tqdm=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    if profiler is not None:
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.cprofile)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(
        f"{args.workload}: {tokens} output tokens in {wall:.2f} s = {tokens / wall:.1f} tokens/s "
        f"(with op timers), {cpu:.2f} CPU s = {tokens / cpu:.1f} tokens per CPU s, {len(steps)} steps\n"
    )
    in_runner = sum(s[2] for s in steps)
    in_ops = sum(sum(c.values()) for c in spent.values())
    if args.clock == "cpu":
        wall = cpu  # the rows below are in CPU seconds
    # What the op timers themselves cost (mostly "runner outside ops"): a timed op call
    # reads the clock twice, and the dense and attention tables' wrappers twice more.
    t0 = clock()
    for _ in range(1000):
        clock()
    per_read = (clock() - t0) / 1001
    print(
        f"op timers: {timer_calls[0]} timed calls, about {per_read * 1e6:.2f} us per clock read: "
        f"~{timer_calls[0] * 4 * per_read:.2f} {args.clock} s of the run are the timers' own\n"
    )
    print(
        f"{args.clock} {wall:.2f} s: engine steps {engine_step[0]:.2f} s (model runner {in_runner:.2f} s, of which ops "
        f"{in_ops:.2f} s); runner outside ops {in_runner - in_ops:.2f} s, engine outside the runner "
        f"{engine_step[0] - in_runner:.2f} s, outside the engine's steps {wall - engine_step[0]:.2f} s\n"
    )
    names = ops.names() + sorted({n for c in spent.values() for n in c} - set(ops.names()))
    used = [n for n in names if spent["prefill"][n] + spent["decode"][n] >= 0.005]
    print("| steps | count | seconds | " + " | ".join(used) + " | else |")
    print("|---|---:|---:|" + "---:|" * (len(used) + 1))
    for k in STEP_KINDS:
        total = sum(s for kk, _, s, _ in steps if kk == k)
        cells = [f"{spent[k][n]:.2f}" for n in used]
        rest = total - sum(spent[k].values())
        print(f"| {k} | {sum(1 for s in steps if s[0] == k)} | {total:.2f} | " + " | ".join(cells) + f" | {rest:.2f} |")
    print("\ndecode steps by batch size:\n")
    print("| batch | steps | ms per step | ops | runner outside ops | engine outside runner | ops share | tokens/s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    buckets: dict[int, list[tuple[int, float, float, float]]] = collections.defaultdict(list)
    for i, (k, n, s, o) in enumerate(steps):
        if k == "decode":
            buckets[n // 8 * 8].append((n, s, o, outside.get(i, 0.0)))
    for b in sorted(buckets):
        rows = buckets[b]
        secs, in_ops, out = (sum(r[j] for r in rows) for j in (1, 2, 3))
        ms = [1000 * x / len(rows) for x in (secs + out, in_ops, secs - in_ops, out)]
        print(
            f"| {max(b, 1)}-{b + 7} | {len(rows)} | {ms[0]:.1f} | {ms[1]:.1f} | {ms[2]:.1f} | {ms[3]:.1f} "
            f"| {in_ops / (secs + out):.1%} | {sum(r[0] for r in rows) / (secs + out):.0f} |"
        )
    if by_rows:
        print_by_rows(by_rows)
    if dense:
        print_dense(dense, args.clock)
    print_attention(attn, args.clock)
    return 0


STEP_KINDS = ("prefill", "mixed", "decode")


def step_kind(scheduled) -> str:
    """ "prefill": every request of the step is in its prompt; "mixed": prompt chunks and
    decodes; "decode": no request in its prompt."""
    chunks = sum(1 for s in scheduled if s.request.num_computed_tokens < s.request.num_prompt_tokens)
    if not chunks:
        return "decode"
    return "prefill" if chunks == len(scheduled) else "mixed"


def time_dense(ops, clock, dense: dict) -> None:
    """Wrap the registry's bf16 ``linear`` and ``linear_silu_and_mul`` so that each call
    adds (calls, seconds, FLOP, weight bytes) to ``dense[("op K->N", row bucket)]``; N is
    the output width (gated: the d-wide product of a [gate; up] weight of 2d rows)."""

    def wrap(name: str, gated: bool):
        fn = ops.get(name)

        def timed(x, weight, bias=None, **kw):
            t0 = clock()
            y = fn(x, weight, bias, **kw)
            seconds = clock() - t0
            rows, k, n = x.numel() // x.shape[-1], x.shape[-1], y.shape[-1]
            bucket = next((b for b in ROW_BUCKETS if rows <= b), ROW_BUCKETS[-1])
            cell = dense[f"{name} {k}->{n}", bucket]
            cell[0] += 1
            cell[1] += seconds
            cell[2] += 2.0 * rows * k * n * (2 if gated else 1)
            cell[3] += 2.0 * k * n * (2 if gated else 1)
            return y

        ops.register(name, timed, source=ops.source(name))

    wrap("linear", False)
    wrap("linear_silu_and_mul", True)


def time_attention(ops, clock, attn: dict, kind: list) -> None:
    """Wrap ``paged_attention`` so that each call adds (calls, seconds, prompt-chunk
    query-key pairs, decode pairs) to ``attn[step kind]`` (pairs counted causally)."""
    fn = ops.get("paged_attention")
    memo: list = [None, (0, 0)]  # the step's seq_lens tensor, its pairs (every layer alike)

    def timed(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, *a, **kw):
        t0 = clock()
        out = fn(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, *a, **kw)
        seconds = clock() - t0
        if memo[0] is not seq_lens:
            qsl, ctx = query_start_loc.tolist(), seq_lens.tolist()
            chunk = decode = 0
            for i, c in enumerate(ctx):
                q = qsl[i + 1] - qsl[i]
                pairs = q * (c - q + 1) + q * (q - 1) // 2
                if q > 1:
                    chunk += pairs
                else:
                    decode += pairs
            memo[0], memo[1] = seq_lens, (chunk, decode)
        cell = attn[kind[0]]
        cell[0] += 1
        cell[1] += seconds
        cell[2] += memo[1][0]
        cell[3] += memo[1][1]
        return out

    ops.register("paged_attention", timed, source=ops.source("paged_attention"))


def print_dense(dense: dict, clock: str) -> None:
    """The bf16 linears by shape and rows per call: calls / seconds / GFLOP/s / GB/s of
    weights (each call reads its whole weight)."""
    names = sorted({n for n, _ in dense}, key=lambda n: (n.split()[0], int(n.split()[1].split("->")[0])))
    buckets = sorted({b for _, b in dense})
    print(f"\ndense linears by rows per call (calls / {clock} s / GFLOP/s / weight GB/s):\n")
    print("| op | " + " | ".join(f"rows <= {b}" for b in buckets) + f" | total {clock} s | GFLOP/s |")
    print("|---|" + "---:|" * (len(buckets) + 2))

    def cell(c) -> str:
        rate = max(c[1], 1e-9) * 1e9
        return f"{c[0]} / {c[1]:.2f} / {c[2] / rate:.0f} / {c[3] / rate:.1f}" if c[0] else ""

    for n in names:
        cells = [dense.get((n, b), [0, 0.0, 0.0, 0.0]) for b in buckets]
        tot = [sum(c[i] for c in cells) for i in range(4)]
        print(
            f"| {n} | "
            + " | ".join(cell(c) for c in cells)
            + f" | {tot[1]:.2f} | {tot[2] / max(tot[1], 1e-9) / 1e9:.0f} |"
        )
    by_b = [[sum(dense.get((n, b), [0, 0.0, 0.0, 0.0])[i] for n in names) for i in range(4)] for b in buckets]
    tot = [sum(c[i] for c in by_b) for i in range(4)]
    print(
        "| all | " + " | ".join(cell(c) for c in by_b) + f" | {tot[1]:.2f} | {tot[2] / max(tot[1], 1e-9) / 1e9:.0f} |"
    )


def print_attention(attn: dict, clock: str) -> None:
    """paged_attention by step kind: calls, seconds, query-key pairs, ns per pair."""
    print(f"\npaged_attention by step kind ({clock} s; pairs summed over layers):\n")
    print("| steps | calls | seconds | prompt-chunk pairs (M) | decode pairs (M) | ns per pair |")
    print("|---|---:|---:|---:|---:|---:|")
    for k in STEP_KINDS:
        if k in attn:
            calls, s, chunk, decode = attn[k]
            print(
                f"| {k} | {calls} | {s:.2f} | {chunk / 1e6:.1f} | {decode / 1e6:.1f} "
                f"| {1e9 * s / max(chunk + decode, 1):.1f} |"
            )


def print_by_rows(by_rows: dict) -> None:
    """The GGUF linears' calls, wall and CPU seconds by row count per call."""
    names = sorted({n for n, _ in by_rows})
    buckets = sorted({b for _, b in by_rows})
    print("\nGGUF linears by rows per call (calls / wall s / CPU s):\n")
    print("| op | " + " | ".join(f"rows <= {b}" for b in buckets) + " | total CPU s |")
    print("|---|" + "---:|" * (len(buckets) + 1))
    for n in names:
        cells = [by_rows.get((n, b), _Cell()) for b in buckets]
        text = [f"{c[0]} / {c[1]:.2f} / {c[2]:.2f}" if c[0] else "" for c in cells]
        print(f"| {n} | " + " | ".join(text) + f" | {sum(c[2] for c in cells):.2f} |")
    totals = [sum((by_rows.get((n, b), _Cell()) for n in names), _Cell()) for b in buckets]
    print(
        "| all | "
        + " | ".join(f"{c[0]} / {c[1]:.2f} / {c[2]:.2f}" for c in totals)
        + f" | {sum(c[2] for c in totals):.2f} |"
    )


def _quantized_weights(model) -> list:
    """Every weight of ``model`` that carries its own op (GGUF blocks; a stack's parts)."""
    found, todo = (
        [],
        [model.lm_head, *(getattr(layer, n, None) for layer in model.layers for n in type(layer).__slots__)],
    )
    while todo:
        w = todo.pop()
        if isinstance(w, list):
            todo += w
        elif hasattr(w, "parts"):
            todo += w.parts
        elif hasattr(w, "op") and hasattr(w, "apply"):
            found.append(w)
    return found


if __name__ == "__main__":
    sys.exit(main())
