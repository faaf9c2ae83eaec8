"""Serving latency against request rate: pagedserve, vLLM and llama.cpp behind the same client.

    python benchmarks/serve_sweep.py                                  # the full sweep
    python benchmarks/serve_sweep.py --engines pagedserve-gguf,llamacpp --request-rates 1,4 --num-prompts 8
    python benchmarks/serve_sweep.py --from-json bench_results/serve_sweep-....json   # redraw

Starts each server in turn on 127.0.0.1, warms it up with one request, and runs
`pagedserve bench serve --request-rates ...` against it with the same prompts and seeds
(Poisson arrivals; by default the mixed length distribution of workloads.py, 16-1024
prompt and 16-512 output tokens): per rate p50/p99 TTFT, inter-token latency and e2e
latency, throughput, the achieved rate and the saturation rate (see
`pagedserve.entrypoints.cli.bench_stats`). Engines (--engines):

    pagedserve-gguf   pagedserve serve on the default GGUF file
    pagedserve-bf16   pagedserve serve on the bf16 folder of compare_vllm.py
    vllm              vLLM's OpenAI server on the same bf16 folder (--vllm-python; the
                      environment variables of benchmarks/README.md)
    llamacpp          llama-server on the GGUF file (-t --threads, -np --llama-parallel
                      slots of 2048 tokens, continuous batching)

Writes bench_results/serve_sweep-<time>.json and a plot of p99 TTFT and p99 ITL against
the rate (--plot, default docs/img/serve_latency.png). Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pathlib
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from engine_runner import machine_info, vllm_env  # noqa: E402
from servers import (  # noqa: E402
    DEFAULT_LLAMA_SERVER,
    DEFAULT_VLLM_PYTHON,
    ServerProcess,
    free_port,
    llama_server_cmd,
    pagedserve_cmd,
    vllm_cmd,
)
from workloads import default_gguf_path, prepare_model_dir  # noqa: E402

_HERE = pathlib.Path(__file__).resolve().parent
ENGINES = ("pagedserve-gguf", "pagedserve-bf16", "vllm", "llamacpp")
# Slot context of llama-server: the mixed workload's longest request is 1024 + 512 tokens.
LLAMA_SLOT_CTX = 2048


def server_for(engine: str, args, port: int) -> tuple[list[str], dict[str, str], str]:
    """(command, extra environment, bench serve --backend) of one engine."""
    settings = {
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
    }
    if engine == "llamacpp":
        cmd = llama_server_cmd(args.llama_server, args.gguf, port, args.threads, args.llama_parallel, LLAMA_SLOT_CTX)
        return cmd, {}, "llamacpp"
    if engine == "vllm":
        return (
            vllm_cmd(args.vllm_python, args.model_dir, port, settings, args.seed),
            vllm_env(args.threads, args.kv_cache_gib),
            "openai",
        )
    settings["kv_cache_memory"] = f"{args.kv_cache_gib}GiB"
    settings["seed"] = args.seed
    model, dtype = (str(args.gguf), None) if engine == "pagedserve-gguf" else (str(args.model_dir), "bfloat16")
    return pagedserve_cmd(args.pagedserve_python, model, port, args.threads, settings, dtype), {}, "openai"


def warm_up(url: str, backend: str) -> None:
    """One short request, so that first-call costs (vLLM's compile, allocations) stay out of the sweep."""
    import httpx

    from pagedserve.entrypoints.cli.bench_serve import _request

    model = None
    if backend == "openai":
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    path, body = _request(backend, model, list(range(1000, 1032)), 8)
    body["stream"] = False
    body.pop("stream_options", None)
    r = httpx.post(url + path, json=body, timeout=600)
    r.raise_for_status()


def run_engine(engine: str, args, out: pathlib.Path) -> dict:
    port = free_port()
    cmd, env, backend = server_for(engine, args, port)
    json_out = out.with_name(f"{out.stem}-{engine}.json")
    with ServerProcess(engine, cmd, port, out.with_name(f"{out.stem}-{engine}-server.log"), env) as srv:
        print(f"{engine}: healthy after {srv.startup_s:.1f} s; warming up", flush=True)
        warm_up(srv.url, backend)
        bench = [args.pagedserve_python, "-m", "pagedserve.entrypoints.cli", "bench", "serve", "--url", srv.url]
        bench += ["--backend", backend, "--dataset", args.dataset, "--request-rates", args.request_rates]
        bench += ["--num-prompts", str(args.num_prompts), "--seed", str(args.seed), "--probe-interval", "0"]
        bench += ["--input-len", str(args.input_len), "--output-len", str(args.output_len)]
        bench += ["--timeout", str(args.timeout), "--json-out", str(json_out)]
        load = os.getloadavg()
        proc = subprocess.run(bench, env={**os.environ, "HF_HUB_OFFLINE": "1"}, text=True, capture_output=True)
    log = out.with_name(f"{out.stem}-{engine}-bench.log")
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not json_out.is_file():
        raise RuntimeError(
            f"bench serve against {engine} failed (exit {proc.returncode}); see {log}:\n{proc.stderr[-3000:]}"
        )
    print("".join(line for line in proc.stdout.splitlines(True) if not line.startswith("RESULT ")), flush=True)
    result = json.loads(json_out.read_text())
    json_out.unlink()
    return {"engine": engine, "server_command": cmd, "startup_s": srv.startup_s, "loadavg_before": load, **result}


def _num(v) -> float:
    """JSON's null (no samples) and "inf" back to floats."""
    return math.nan if v is None else float(v)


def print_summary(report: dict) -> None:
    engines = report["engines"]
    print("\np99 TTFT (s) / p99 ITL (ms) per rate")
    print(f"{'rate':>6s}" + "".join(f"{e:>24s}" for e in engines))
    for i, rate in enumerate(next(iter(engines.values()))["rates"]):
        cells = []
        for e in engines.values():
            row = e["rates"][i]
            mark = "" if row["keeps_up"] else "*"
            cells.append(f"{_num(row['ttft_s']['p99']):9.2f} / {_num(row['itl_s']['p99']) * 1e3:7.1f}{mark:1s}")
        print(f"{_num(rate['request_rate']):6.2f}" + "".join(f"{c:>24s}" for c in cells))
    print("(* not kept up with)")
    for name, e in engines.items():
        sat = e["saturation_rate"]
        print(f"saturation rate {name:16s} {'below the lowest rate' if sat is None else f'{sat:g} req/s'}")


def plot(report: dict, path: pathlib.Path) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, e in report["engines"].items():
        rows = [r for r in e["rates"] if math.isfinite(_num(r["request_rate"]))]
        x = [_num(r["request_rate"]) for r in rows]
        for ax, key, scale in ((axes[0], "ttft_s", 1.0), (axes[1], "itl_s", 1e3)):
            y = [_num(r[key]["p99"]) * scale for r in rows]
            (line,) = ax.plot(x, y, marker="o", label=name)
            over = [(a, b) for a, b, r in zip(x, y, rows) if not r["keeps_up"]]
            if over:  # rates the engine did not keep up with: hollow markers
                ax.plot(*zip(*over), "o", mfc="white", color=line.get_color())
    rates = sorted({_num(r["request_rate"]) for e in report["engines"].values() for r in e["rates"]} - {math.inf})
    for ax, title in zip(axes, ("p99 time to first token (s)", "p99 inter-token latency (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(rates, [f"{r:g}" for r in rates])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_yscale("log")
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend()
    w, m = report["workload"], report["machine"]
    fig.suptitle(
        f"{w['dataset']} workload, {w['num_prompts']} requests per rate, seed {w['seed']}; {m['cpu']}, "
        f"{report['threads']} threads, {m['date'][:10]} (hollow: rate not kept up with)",
        fontsize=9,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, of {', '.join(ENGINES)}")
    p.add_argument("--request-rates", default="0.25,0.5,1,1.5,2,3", help="req/s, increasing")
    p.add_argument("--num-prompts", type=int, default=64, help="requests per rate")
    p.add_argument("--dataset", default="mixed", choices=("mixed", "fixed"))
    p.add_argument("--input-len", type=int, default=128, help="--dataset fixed only")
    p.add_argument("--output-len", type=int, default=128, help="--dataset fixed only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-gib", type=float, default=4.0)
    p.add_argument("--llama-parallel", type=int, default=64, help="llama-server slots (-np)")
    p.add_argument("--llama-server", default=DEFAULT_LLAMA_SERVER)
    p.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    p.add_argument("--pagedserve-python", default=sys.executable)
    p.add_argument("--gguf", type=pathlib.Path, default=None, help="default: the default model's GGUF file")
    p.add_argument("--model-dir", type=pathlib.Path, default=None, help="bf16 folder (default: converted once)")
    p.add_argument("--timeout", type=float, default=1800.0, help="per-request timeout (s)")
    p.add_argument("--out", type=pathlib.Path, default=None)
    p.add_argument("--plot", type=pathlib.Path, default=_HERE.parent / "docs" / "img" / "serve_latency.png")
    p.add_argument("--from-json", type=pathlib.Path, default=None, help="only redraw a saved sweep")
    args = p.parse_args(argv)
    args.engines = args.engines.split(",")
    if unknown := set(args.engines) - set(ENGINES):
        p.error(f"unknown engines {sorted(unknown)}; expected some of {', '.join(ENGINES)}")
    if "llamacpp" in args.engines and not pathlib.Path(args.llama_server).is_file():
        p.error(f"--llama-server {args.llama_server} does not exist (build it: benchmarks/README.md)")
    if "vllm" in args.engines and not pathlib.Path(args.vllm_python).is_file():
        p.error(f"--vllm-python {args.vllm_python} does not exist (see benchmarks/README.md)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        report = json.loads(args.from_json.read_text())
        print_summary(report)
        plot(report, args.plot)
        return 0
    args.gguf = args.gguf or default_gguf_path()
    if {"pagedserve-bf16", "vllm"} & set(args.engines):
        args.model_dir = prepare_model_dir(args.model_dir)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.out or _HERE.parent / "bench_results" / f"serve_sweep-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "machine": machine_info(),
        "threads": args.threads,
        "settings": {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()},
        "engines": {},
    }
    for engine in args.engines:
        print(f"=== {engine}", flush=True)
        report["engines"][engine] = run_engine(engine, args, out)
        report["workload"] = report["engines"][engine]["workload"]
        out.write_text(json.dumps(report, indent=1) + "\n")  # kept after each engine, in case a later one fails
    report["loadavg_end"] = os.getloadavg()
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")
    print_summary(report)
    plot(report, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
