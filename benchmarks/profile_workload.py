"""Where the time of a whole benchmark workload goes, op by op, prefill steps apart from decode steps.

    python benchmarks/profile_workload.py --workload mixed [--model-dir DIR]

Runs one workload of benchmarks/workloads.py (the same requests, seeds and engine
settings as compare_vllm.py) through pagedserve with every op of the registry wrapped
in a wall-clock timer.  A step is a "prefill" step when any of its requests is still
in its prompt, else a "decode" step.  Prints seconds per op for each kind, the rest of
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
down", "gguf lm_head": they hold their ops from load, outside the registry's timers; the
parts of a fused projection that mixes block types are timed apart, e.g. "gguf qkv
Q8_0"), then prints those linears by row count per call (wall and process CPU seconds:
on a loaded machine the CPU seconds are what compares); ``--unfused-mlp`` runs its MLPs
as gguf_linear then silu_and_mul, as before the fused op.  The timers
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

#: Upper bounds of the row-count buckets of the GGUF linears' table.
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
    ops = llm.llm_engine.ops
    kind = ["decode"]
    spent: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    op_total = [0.0]

    def record(name: str, seconds: float) -> None:
        spent[kind[0]].update({name: seconds})
        op_total[0] += seconds

    time_ops(ops, record)
    by_rows: dict[tuple[str, int], _Cell] = collections.defaultdict(_Cell)
    if args.gguf:
        time_gguf_weights(llm.llm_engine.runner.model, record, args.unfused_mlp, by_rows)
    else:
        # Quantized weights were handed their op at load: give them the timed one.
        for w in _quantized_weights(llm.llm_engine.runner.model):
            if w.op is not None and hasattr(ops, w.op.__name__):
                w.op = ops.get(w.op.__name__)

    steps: list[tuple[str, int, float, float]] = []  # (kind, requests, seconds, of which in ops)
    execute = model_runner.ModelRunner.execute

    def timed_execute(self, out, block_ids):
        kind[0] = "prefill" if any(s.num_new_tokens > 1 for s in out.scheduled) else "decode"
        t0, ops0 = time.perf_counter(), op_total[0]
        try:
            return execute(self, out, block_ids)
        finally:
            steps.append((kind[0], len(out.scheduled), time.perf_counter() - t0, op_total[0] - ops0))

    model_runner.ModelRunner.execute = timed_execute
    # The engine's whole step (scheduling, output processing, detokenization) around the runner.
    engine_step = [0.0]
    outside: dict[int, float] = {}  # runner step index -> engine time outside the runner
    step = type(llm.llm_engine).step

    def timed_step(self):
        t0, ran = time.perf_counter(), len(steps)
        try:
            return step(self)
        finally:
            seconds = time.perf_counter() - t0
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
    t0 = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    outs = llm.generate([r.prompt_token_ids for r in w.requests], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    if profiler is not None:
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.cprofile)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(
        f"{args.workload}: {tokens} output tokens in {wall:.2f} s = {tokens / wall:.1f} tokens/s "
        f"(with op timers), {len(steps)} steps\n"
    )
    in_runner = sum(s[2] for s in steps)
    in_ops = sum(sum(c.values()) for c in spent.values())
    print(
        f"wall {wall:.2f} s: engine steps {engine_step[0]:.2f} s (model runner {in_runner:.2f} s, of which ops "
        f"{in_ops:.2f} s); runner outside ops {in_runner - in_ops:.2f} s, engine outside the runner "
        f"{engine_step[0] - in_runner:.2f} s, outside the engine's steps {wall - engine_step[0]:.2f} s\n"
    )
    names = ops.names() + sorted({n for c in spent.values() for n in c} - set(ops.names()))
    used = [n for n in names if spent["prefill"][n] + spent["decode"][n] >= 0.005]
    print("| steps | count | seconds | " + " | ".join(used) + " | else |")
    print("|---|---:|---:|" + "---:|" * (len(used) + 1))
    for k in ("prefill", "decode"):
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
    return 0


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
