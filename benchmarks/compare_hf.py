"""pagedserve against transformers' static-batching `generate` on the same seeded workload.

    python benchmarks/compare_hf.py --workload fixed

Both run from pagedserve's environment, each in a fresh process, on the same bf16
checkpoint folder and thread count. transformers pads every batch to its longest prompt
and runs every row for the batch's longest output (only each row's own tokens count as
output); by default the whole workload is one batch (--hf-batch-size to split it).
Reports start-up (process start to first generated token), output tokens/s and the
pagedserve/transformers ratios; writes the full result to --out (default
bench_results/compare_hf-<workload>-<time>.json).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from engine_runner import add_common_arguments, add_rounds_argument, run_comparison  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(p)
    add_rounds_argument(p)
    p.add_argument(
        "--hf-batch-size", type=int, default=None, help="transformers batch size (default: every request in one batch)"
    )
    p.add_argument("--python", default=sys.executable, help="python with pagedserve and transformers")
    args = p.parse_args(argv)
    run_comparison(args, "transformers", {"pagedserve": args.python, "transformers": args.python}, "compare_hf")
    return 0


if __name__ == "__main__":
    sys.exit(main())
