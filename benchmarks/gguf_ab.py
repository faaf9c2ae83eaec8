"""Two or more GGUF files on the same offline workloads, interleaved, CPU seconds beside wall.

    python benchmarks/gguf_ab.py A.gguf B.gguf [--workloads fixed,mixed] [--passes 2]
    python benchmarks/gguf_ab.py FILE --setting residual_dtype --values model,auto

With ``--setting NAME --values A,B`` the variants are each file under each value of that
engine setting (an ``LLM`` keyword), e.g. the float32 residual stream against the model's
dtype on one file.

The workloads are `pagedserve bench throughput`'s (the same seeded requests, greedy, EOS
ignored): "fixed" 64 x (128 in + 128 out), "mixed" 32 prompts of 16-1024 tokens with
16-512 outputs (`--max-model-len 2048 --kv-cache-memory 1GiB`, as docs/quantization.md
quotes them). Each (pass, workload, file) runs in a fresh process, files alternating
within a pass (A B, then B A in the next pass), and reports the output tokens/s and the
CPU seconds of the whole process (all threads) over the timed `generate`. On a loaded
machine the wall-clock figures move with the load; the CPU seconds per output token
(and their ratio between files in the same pass) are what compares. Prints a table and
writes bench_results/gguf_ab-<time>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent

WORKLOADS = {
    "fixed": dict(num=64, input_len=128, output_len=128, mixed=False, max_model_len=512),
    "mixed": dict(num=32, input_len=0, output_len=0, mixed=True, max_model_len=2048),
}


def child(model: str, workload: str, seed: int, threads: int | None, settings: dict | None = None) -> dict:
    """One timed run of ``workload`` on ``model`` (engine ``settings``) in this process."""
    from pagedserve import LLM, SamplingParams
    from pagedserve.entrypoints.cli.bench_throughput import make_workload
    from pagedserve.loader import open_model

    spec = WORKLOADS[workload]
    vocab = open_model(model).hf_config["vocab_size"]
    work = make_workload(spec["num"], spec["input_len"], spec["output_len"], spec["mixed"], seed, vocab)
    llm = LLM(
        model=model, max_model_len=spec["max_model_len"], kv_cache_memory="1GiB", threads=threads, **(settings or {})
    )
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in work]
    llm.generate([work[0][0][:16]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate([p for p, _ in work], params, use_tqdm=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"wall_s": wall, "cpu_s": cpu, "tokens": tokens, "prompt_tokens": sum(len(p) for p, _ in work)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--workloads", default="fixed,mixed")
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--setting", default=None, help="an engine setting (LLM keyword) whose --values are compared")
    p.add_argument("--values", default=None, help="comma-separated values of --setting, one variant each")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if (args.setting is None) != (args.values is None):
        p.error("--setting and --values go together")
    if args.child:
        settings = {args.setting: args.values} if args.setting else None
        print("RESULT " + json.dumps(child(args.files[0], args.child, args.seed, args.threads, settings)), flush=True)
        return 0
    # Variants: (file, value of --setting or None), labelled "file" or "file[setting=value]".
    values = args.values.split(",") if args.values else [None]
    variants = [(f, v) for f in args.files for v in values]

    def label(f: str, v: str | None) -> str:
        return pathlib.Path(f).name + ("" if v is None else f"[{args.setting}={v}]")

    rows = []
    for pass_no in range(args.passes):
        for workload in args.workloads.split(","):
            order = variants if pass_no % 2 == 0 else list(reversed(variants))
            for f, v in order:
                cmd = [sys.executable, __file__, f, "--child", workload, "--seed", str(args.seed)]
                if args.threads:
                    cmd += ["--threads", str(args.threads)]
                if v is not None:
                    cmd += ["--setting", args.setting, "--values", v]
                load = os.getloadavg()[0]
                proc = subprocess.run(cmd, capture_output=True, text=True)
                line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
                if proc.returncode or line is None:
                    raise SystemExit(f"{f} {workload} failed:\n{proc.stderr[-3000:]}")
                r = json.loads(line[len("RESULT ") :]) | {
                    "file": label(f, v),
                    "workload": workload,
                    "pass": pass_no + 1,
                }
                r["load_before"] = load
                rows.append(r)
                print(
                    f"pass {pass_no + 1} {workload:5s} {label(f, v)}: {r['tokens'] / r['wall_s']:.1f} tok/s, "
                    f"{r['cpu_s']:.1f} CPU s ({1000 * r['cpu_s'] / r['tokens']:.2f} CPU ms/token), load {load:.1f}",
                    flush=True,
                )
    base = label(*variants[0])
    print("\n| workload | pass | file | tok/s | CPU s | CPU ms/token | CPU ratio vs first file |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for r in rows:
        ref = next(x for x in rows if x["file"] == base and x["workload"] == r["workload"] and x["pass"] == r["pass"])
        print(
            f"| {r['workload']} | {r['pass']} | {r['file']} | {r['tokens'] / r['wall_s']:.1f} "
            f"| {r['cpu_s']:.1f} | {1000 * r['cpu_s'] / r['tokens']:.2f} | {r['cpu_s'] / ref['cpu_s']:.2f}x |"
        )
    out = ROOT / "bench_results" / f"gguf_ab-{datetime.datetime.now():%Y%m%d-%H%M%S}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
