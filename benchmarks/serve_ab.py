"""Interleaved A/B of `pagedserve serve` configurations under the same Poisson load.

    python benchmarks/serve_ab.py --config cap0="--long-prefill-token-threshold 0" --config default=
    python benchmarks/serve_ab.py --config old=@/tmp/old-tree --config new= --request-rates 1 --repeats 3

Each --config is NAME=FLAGS: extra `pagedserve serve` flags on top of the settings of
serve_sweep.py (default GGUF model, 2048-token budget, no prefix caching), or NAME=@DIR to
run another source tree of pagedserve (DIR holds a `pagedserve` package laid out as
installed, put first on PYTHONPATH: how a change is compared with the code before it).
The configurations run in turn, one server at a time, and the whole round repeats
`--repeats` times, so on a shared machine every configuration sees the same spread of
background load; each row records the load average at its start.  Per rate and run it
prints p50/p99 TTFT, p99 ITL, output tokens/s, whether the rate was kept up with, and
the p99 / max latency of GET /health while loaded (how long the event loop was held up),
then the median of each over the repeats.  Writes bench_results/serve_ab-<time>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from serve_sweep import warm_up  # noqa: E402
from servers import ServerProcess, free_port, pagedserve_cmd  # noqa: E402
from workloads import default_gguf_path  # noqa: E402

_HERE = pathlib.Path(__file__).resolve().parent
SETTINGS = {"max_model_len": 2048, "max_num_seqs": 256, "max_num_batched_tokens": 2048, "kv_cache_memory": "4GiB"}
METRICS = ("ttft50", "ttft99", "itl99", "tok_s", "health99", "health_max")


def parse_config(text: str) -> tuple[str, list[str], str | None]:
    """NAME=FLAGS or NAME=@DIR -> (name, extra flags, source tree or None)."""
    name, sep, rest = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--config expects NAME=FLAGS or NAME=@DIR, got {text!r}")
    if rest.startswith("@"):
        tree = pathlib.Path(rest[1:])
        if not (tree / "pagedserve" / "__init__.py").is_file():
            raise argparse.ArgumentTypeError(f"{tree} holds no pagedserve package")
        return name, [], str(tree)
    return name, rest.split(), None


def run_one(args, name: str, flags: list[str], tree: str | None, rep: int, out: pathlib.Path) -> list[dict]:
    port = free_port()
    settings = {**SETTINGS, "seed": args.seed}
    cmd = pagedserve_cmd(args.python, str(args.gguf), port, args.threads, settings, None) + flags
    env = {"PYTHONPATH": tree} if tree else {}
    json_out = out.with_name(f"{out.stem}-{name}-{rep}.json")
    with ServerProcess(name, cmd, port, out.with_name(f"{out.stem}-{name}-{rep}-server.log"), env) as srv:
        warm_up(srv.url, "openai")
        bench = [args.python, "-m", "pagedserve.entrypoints.cli", "bench", "serve", "--url", srv.url]
        bench += ["--dataset", "mixed", "--request-rates", args.request_rates, "--num-prompts", str(args.num_prompts)]
        bench += ["--seed", str(args.seed), "--probe-interval", "0.1", "--json-out", str(json_out)]
        load = os.getloadavg()[0]
        proc = subprocess.run(bench, env={**os.environ, "HF_HUB_OFFLINE": "1"}, text=True, capture_output=True)
    if proc.returncode != 0 or not json_out.is_file():
        raise RuntimeError(f"bench serve against {name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = []
    for r in json.loads(json_out.read_text())["rates"]:
        probe = r.get("health_probe_s") or {}
        rows.append(
            {
                "config": name,
                "repeat": rep,
                "rate": r["request_rate"],
                "load": load,
                "ttft50": r["ttft_s"]["p50"] * 1e3,
                "ttft99": r["ttft_s"]["p99"] * 1e3,
                "itl99": r["itl_s"]["p99"] * 1e3,
                "tok_s": r["output_tokens_per_s"],
                "keeps_up": r["keeps_up"],
                "health99": probe.get("p99", float("nan")) * 1e3,
                "health_max": probe.get("max", float("nan")) * 1e3,
            }
        )
    json_out.unlink()
    return rows


def print_row(row: dict) -> None:
    cells = " ".join(f"{k} {row[k]:8.1f}" for k in METRICS)
    print(f"{row['config']:>14s} #{row['repeat']} rate {row['rate']:g} load {row['load']:4.1f}  {cells}", flush=True)


def print_medians(rows: list[dict], names: list[str]) -> None:
    print("\nmedians over the repeats (ms; tok_s in tokens/s)")
    for rate in sorted({r["rate"] for r in rows}):
        for name in names:
            mine = [r for r in rows if r["config"] == name and r["rate"] == rate]
            if mine:
                cells = " ".join(f"{k} {statistics.median(r[k] for r in mine):8.1f}" for k in METRICS)
                kept = sum(r["keeps_up"] for r in mine)
                print(f"{name:>14s} rate {rate:g}  {cells}  kept up {kept}/{len(mine)}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=parse_config, action="append", required=True, help="NAME=FLAGS or NAME=@DIR")
    p.add_argument("--request-rates", default="1", help="req/s, increasing (bench serve --request-rates)")
    p.add_argument("--num-prompts", type=int, default=24, help="requests per rate")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--python", default=sys.executable, help="the Python that runs pagedserve")
    p.add_argument("--gguf", type=pathlib.Path, default=None, help="default: the default model's GGUF file")
    p.add_argument("--out", type=pathlib.Path, default=None)
    args = p.parse_args(argv)
    args.gguf = args.gguf or default_gguf_path()
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.out or _HERE.parent / "bench_results" / f"serve_ab-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for rep in range(args.repeats):
        for name, flags, tree in args.config:
            for row in run_one(args, name, flags, tree, rep, out):
                rows.append(row)
                print_row(row)
            out.write_text(json.dumps({"settings": vars(args), "rows": rows}, indent=1, default=str))
    print_medians(rows, [c[0] for c in args.config])
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
