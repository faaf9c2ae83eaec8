"""Load benchmark of a running server; same as `pagedserve bench serve`.

pagedserve serve &                       # in another terminal
python benchmarks/serve.py --num-prompts 32 --input-len 128 --output-len 64 --request-rate 4
"""

import sys

from pagedserve.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "serve", *sys.argv[1:]]))
