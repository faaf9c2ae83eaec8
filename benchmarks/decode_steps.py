"""Real decode steps of the engine: wall and CPU time per step, and the step's bf16 GEMMs
in place against the same calls back to back.

    python benchmarks/decode_steps.py [MODEL] [--dtype auto] [--batch 1 4] [--threads 2]
        [--steps 96] [--first 24] [--repeat 3] [--gemms]
        [--variant NAME:KEY=VALUE,... ...]

Each (variant, batch) runs in a fresh process (the OpenMP runtime reads its settings once,
when torch loads), variants alternating within each repeat, so that the ratios of one
repeat share the machine's load.  A process loads MODEL on ``--threads`` threads, starts
``--batch`` requests of ``--prompt-len`` random tokens and then times decode steps
(``LLMEngine.step``):

    first    the ``--first`` decode steps right after the prompts' prefill, in a fresh
             engine (the first workload's figure)
    steady   the ``--steps`` steps after those

with per step the median wall time, the median process CPU time (all threads), their
ratio (cores used) and the voluntary context switches (a pool thread going to sleep and
being woken shows up there).

``--gemms`` (bf16 models with the native packed kernel): after the steady steps the native
``packed_linear`` / ``packed_linear_silu_and_mul`` calls of ``--gemm-steps`` engine steps
are timed in place (``--gemm-clock``: wall clock, or the calling thread's CPU time,
around each call), and each recorded step is replayed at once: the same calls on the
same weights and inputs, back to back.  In place / back to back per op kind says what
running between the model's other ops costs a GEMM (cold caches, sleeping pool threads,
the next weight's first lines); ``--flush-mb N`` also replays with an N MiB buffer read
between calls (a stand-in for the attention's KV reads).

Variants are ``NAME:KEY=VALUE,...`` environment settings, e.g. ``spin3k:`` (the default
``import pagedserve`` sets), ``spin300k:GOMP_SPINCOUNT=300000``,
``passive:OMP_WAIT_POLICY=PASSIVE``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time

#: (K, N) of the default model's weights -> op kind (N of gate/up is 2 x intermediate).
KINDS = {(576, 960): "qkv", (576, 576): "o", (576, 3072): "gate_up", (1536, 576): "down", (576, 49152): "lm_head"}


#: Options the parent passes on to each child process.
_CHILD_OPTIONS = ("dtype", "threads", "prompt_len", "first", "steps", "seed", "gemm_steps", "flush_mb", "gemm_clock")


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    name, _, settings = text.partition(":")
    return name, dict(item.split("=", 1) for item in filter(None, settings.split(",")))


def _kind(wp) -> str:
    k, n = int(wp.shape[1]) * 2, int(wp.shape[0]) * 16
    return KINDS.get((k, n), f"K={k},N={n}")


def _steps(eng, n: int) -> dict:
    wall, cpu, csw = [], [], []
    for _ in range(n):
        r0 = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
        t0, c0 = time.perf_counter(), time.process_time()
        eng.step()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        csw.append(resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - r0)
    w, c = statistics.median(wall), statistics.median(cpu)
    return {"wall_ms": w * 1e3, "cpu_ms": c * 1e3, "cores": sum(cpu) / sum(wall), "csw": statistics.median(csw)}


def _gemms(eng, steps: int, flush_mb: int, clock) -> dict:
    import torch

    mods = [m for name, m in sys.modules.items() if name.startswith("pagedserve_cpu_") and hasattr(m, "packed_linear")]
    if not mods:
        return {}
    rec: list = []
    saved = []

    def wrap(mod, name):
        fn = getattr(mod, name)
        saved.append((mod, name, fn))

        def timed(x, wp, bias, isa):
            t0 = clock()
            out = fn(x, wp, bias, isa)
            rec.append((_kind(wp), fn, x, wp, bias, isa, clock() - t0))
            return out

        setattr(mod, name, timed)

    for mod in mods:
        wrap(mod, "packed_linear")
        wrap(mod, "packed_linear_silu_and_mul")
    flush = torch.ones(max(flush_mb, 1) << 18, dtype=torch.float32)  # flush_mb MiB
    in_place: dict[str, list[float]] = {}
    replay: dict[str, list[float]] = {}
    flushed: dict[str, list[float]] = {}
    for _ in range(steps):
        rec.clear()
        eng.step()
        calls = list(rec)
        rec.clear()
        for into, do_flush in ((in_place, None), (replay, False), (flushed, True) if flush_mb else (None, None)):
            if into is None:
                continue
            per: dict[str, float] = {}
            for kind, fn, x, wp, bias, isa, dt in calls:
                if do_flush is None:
                    per[kind] = per.get(kind, 0.0) + dt
                    continue
                if do_flush:
                    flush.sum()
                t0 = clock()
                fn(x, wp, bias, isa)
                per[kind] = per.get(kind, 0.0) + clock() - t0
            for kind, s in per.items():
                into.setdefault(kind, []).append(s)
    for mod, name, fn in saved:
        setattr(mod, name, fn)
    out = {}
    for kind in in_place:
        a, b = in_place[kind], replay[kind]
        out[kind] = {
            "in_place_us": statistics.median(a) * 1e6,
            "back_to_back_us": statistics.median(b) * 1e6,
            "ratio": statistics.median(x / y for x, y in zip(a, b)),
        }
        if flush_mb:
            out[kind]["flushed_us"] = statistics.median(flushed[kind]) * 1e6
    total_a = [sum(v[i] for v in in_place.values()) for i in range(steps)]
    total_b = [sum(v[i] for v in replay.values()) for i in range(steps)]
    out["all"] = {
        "in_place_us": statistics.median(total_a) * 1e6,
        "back_to_back_us": statistics.median(total_b) * 1e6,
        "ratio": statistics.median(x / y for x, y in zip(total_a, total_b)),
    }
    if flush_mb:
        total_f = [sum(v[i] for v in flushed.values()) for i in range(steps)]
        out["all"]["flushed_us"] = statistics.median(total_f) * 1e6
    return out


def child(args) -> dict:
    from pagedserve import LLM, SamplingParams

    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        threads=args.threads,
        max_model_len=2048,
        kv_cache_memory="1GiB",
        seed=0,
        enable_prefix_caching=False,
    )
    eng = llm.llm_engine
    rng = random.Random(args.seed)
    params = SamplingParams(temperature=0, max_tokens=1 << 20, ignore_eos=True)
    for i in range(args.batch[0]):
        eng.add_request(f"r{i}", [rng.randrange(100, 49000) for _ in range(args.prompt_len)], params)
    sched = eng.scheduler
    while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
        eng.step()  # the prompts' prefill
    import pagedserve

    out = {
        "first": _steps(eng, args.first),
        "steady": _steps(eng, args.steps),
        "omp_set_by_pagedserve": pagedserve.OMP_WAIT_POLICY_SET,
    }
    if args.gemms:
        clock = time.thread_time if args.gemm_clock == "thread" else time.perf_counter
        out["gemms"] = _gemms(eng, args.gemm_steps, args.flush_mb, clock)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--first", type=int, default=24)
    p.add_argument("--steps", type=int, default=96)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gemms", action="store_true")
    p.add_argument("--gemm-steps", type=int, default=24)
    p.add_argument("--flush-mb", type=int, default=0)
    p.add_argument(
        "--gemm-clock",
        choices=["wall", "thread"],
        default="wall",
        help="clock around each GEMM call (thread: the calling thread's CPU time, for one thread on a busy machine)",
    )
    p.add_argument("--variant", action="append", default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return 0
    variants = [parse_variant(v) for v in args.variant or ["default:"]]
    print(f"# threads {args.threads}, load average {os.getloadavg()[0]:.1f}")
    print(
        "| variant | batch | repeat | first wall ms | first CPU ms | first cores | steady wall ms | steady CPU ms "
        "| steady cores | steady csw/step |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    for rep in range(args.repeat):
        order = variants if rep % 2 == 0 else variants[::-1]
        for batch in args.batch:
            for name, env in order:
                cmd = [sys.executable, __file__, "--child", "--batch", str(batch)]
                for opt in _CHILD_OPTIONS:
                    cmd += [f"--{opt.replace('_', '-')}", str(getattr(args, opt))]
                if args.model:
                    cmd.append(args.model)
                if args.gemms:
                    cmd.append("--gemms")
                res = subprocess.run(cmd, env={**base, **env}, capture_output=True, text=True)
                if res.returncode != 0:
                    print(res.stderr[-3000:], file=sys.stderr)
                    return 1
                r = json.loads(res.stdout.strip().splitlines()[-1])
                f, s = r["first"], r["steady"]
                print(
                    f"| {name} | {batch} | {rep} | {f['wall_ms']:.2f} | {f['cpu_ms']:.2f} | {f['cores']:.2f} | "
                    f"{s['wall_ms']:.2f} | {s['cpu_ms']:.2f} | {s['cores']:.2f} | {s['csw']:.0f} |",
                    flush=True,
                )
                for kind, g in r.get("gemms", {}).items():
                    extra = f", flushed {g['flushed_us']:.0f}" if "flushed_us" in g else ""
                    print(
                        f"|   gemm {kind} | | | in place {g['in_place_us']:.0f} us | back to back "
                        f"{g['back_to_back_us']:.0f} us{extra} | ratio {g['ratio']:.3f} | | | | |",
                        flush=True,
                    )
    print(f"# load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
