"""Offline throughput benchmark; same as `pagedserve bench throughput`.

python benchmarks/throughput.py --num-prompts 64 --input-len 128 --output-len 128
"""

import sys

from pagedserve.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "throughput", *sys.argv[1:]]))
