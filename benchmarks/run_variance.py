"""Repeat the pagedserve half of a comparison workload and show why passes differ.

    python benchmarks/run_variance.py --workload fixed --repeat 3 \
        --variant default: --variant passive:OMP_WAIT_POLICY=passive

Each pass is a fresh process (benchmarks/engine_runner.py), as in compare_vllm.py.
Variants (``NAME:KEY=VALUE,KEY=VALUE``; an empty list of settings is the plain run)
run round-robin, so a change of machine load hits every variant alike.  One line per
pass: output tokens/s, wall and CPU seconds, the cores the process actually got (CPU
time over wall time), involuntary context switches, the engine's steps and tokens per
step, huge pages, clock and load (benchmarks/run_facts.py).  The JSON written holds
every pass's full facts.  ``--gguf`` runs the default model's own GGUF file (the default
path, dtype auto, no prefix caching: as compare_llamacpp.py's pagedserve-gguf); a
variant ``base:PYTHONPATH=<an older tree's package>`` puts two versions of pagedserve
side by side; ``--gguf-variants gguf`` runs the variant named ``gguf`` on the GGUF file
and the others on the bf16 folder (the two paths interleaved in one run).
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import statistics
import sys

_HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))

from engine_runner import add_common_arguments, launch, machine_info  # noqa: E402
from workloads import default_gguf_path, make_workload, prepare_model_dir, read_vocab_size  # noqa: E402


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """``NAME:K=V,K=V`` -> (NAME, {K: V}); ``NAME:`` is the plain environment."""
    name, _, settings = text.partition(":")
    env = {}
    for item in filter(None, settings.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise SystemExit(f"--variant {text!r}: {item!r} is not KEY=VALUE")
        env[key] = value
    return name or "default", env


def _line(variant: str, i: int, run: dict) -> str:
    f = run.get("facts", {})
    return (
        f"{variant:>12s} #{i}  {run['output_tokens_per_s']:7.1f} tok/s  wall {run['elapsed_s']:5.1f}s  "
        f"cpu {f.get('cpu_s', 0):5.1f}s  cores {f.get('cores_used') or 0:4.2f}  "
        f"invcsw {f.get('involuntary_switches', 0):6d}  steps {f.get('steps')}  "
        f"tok/step {f.get('mean_tokens_per_step') or 0:5.1f}  thp {f.get('anon_huge_kib_after')}kB  "
        f"MHz {','.join(f'{m:.0f}' for m in f.get('cpu_mhz_after', []))}  "
        f"load {f.get('loadavg', [0])[0]:.1f}->{f.get('loadavg_after', [0])[0]:.1f}"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(p)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--variant", action="append", default=None, help="NAME:KEY=VALUE,... (repeatable)")
    p.add_argument("--gguf", action="store_true", help="the default model's GGUF file (dtype auto)")
    p.add_argument(
        "--gguf-variants",
        default="",
        help="comma-separated variant names that run the GGUF file (the others the bf16 folder): "
        "the default GGUF path against the bf16 path in one interleaved run",
    )
    args = p.parse_args()
    variants = [parse_variant(v) for v in (args.variant or ["default:"])]
    model_dir = prepare_model_dir(args.model_dir)
    vocab = read_vocab_size(model_dir)
    make_workload(args.workload, vocab, args.seed, args.num_requests, args.input_len, args.output_len)
    spec = {
        "model_dir": str(model_dir),
        "vocab_size": vocab,
        "threads": args.threads,
        "seed": args.seed,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "kv_cache_gib": args.kv_cache_gib,
        "workloads": [
            {
                "name": args.workload,
                "seed": args.seed,
                "num_requests": args.num_requests,
                "input_len": args.input_len,
                "output_len": args.output_len,
            }
        ],
    }
    gguf_spec = dict(model=str(default_gguf_path()), dtype="auto", enable_prefix_caching=False)
    if args.gguf:
        spec.update(gguf_spec)
    gguf_variants = {v for v in args.gguf_variants.split(",") if v}
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.out or _HERE.parent / "bench_results" / f"run_variance-{args.workload}-{stamp}.json"
    report: dict = {"machine": machine_info(), "spec": spec, "passes": {name: [] for name, _ in variants}}
    for i in range(args.repeat):
        for name, env in variants:
            vspec = {**spec, **gguf_spec} if name in gguf_variants else spec
            result = launch(
                "pagedserve", sys.executable, vspec, out.with_name(f"{out.stem}-{name}.log"), env, args.timeout
            )
            run = result["runs"][0]
            report["passes"][name].append(run)
            print(_line(name, i, run), flush=True)
    for name, runs in report["passes"].items():
        rates = [r["output_tokens_per_s"] for r in runs]
        spread = max(rates) / min(rates)
        print(f"{name:>12s}: median {statistics.median(rates):.1f} tok/s, max/min {spread:.2f}", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
