"""What one OpenMP parallel region costs, by wait policy: row ops timed call by call.

    python benchmarks/omp_regions.py [--rows 64 300] [--calls 3000]
        [--policy default:GOMP_SPINCOUNT=300000 --policy passive:OMP_WAIT_POLICY=PASSIVE]

Each policy (``NAME:KEY=VALUE,...``) runs in a fresh process, since the OpenMP runtime
reads its settings once when torch loads.  In each, the native row ops (default model
sizes: hidden 576, 9 + 3 heads of 64, bf16) run ``calls`` times back to back on 1 and
on 2 threads; the table gives the mean, median and p90 microseconds per call.  The
mean is what a run pays; on a shared machine it is far above the median when a region
waits for a descheduled thread (docs/kernels_cpu.md, "Threads").  Rows past the
inline threshold (kSerialElems, 2^17 elements) are split over the threads.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def parse_policy(text: str) -> tuple[str, dict[str, str]]:
    name, _, settings = text.partition(":")
    return name, dict(item.split("=", 1) for item in filter(None, settings.split(",")))


def child(rows: list[int], calls: int) -> list[dict]:
    import torch

    import pagedserve  # noqa: F401  (its import sets the default wait policy, as in a real run)
    from pagedserve.kernels.cpu import load_cpu_kernels

    native = load_cpu_kernels()
    out = []
    for n in rows:
        x = torch.randn(n, 576).bfloat16()
        res = torch.randn(n, 576).bfloat16()
        w = torch.randn(576).bfloat16()
        q, k = torch.randn(n, 9, 64).bfloat16(), torch.randn(n, 3, 64).bfloat16()
        pos = torch.randint(0, 2048, (n,))
        cos_sin = torch.randn(2048, 64)
        ops = {
            "rms_norm": lambda: native.rms_norm(x, w, 1e-5),
            "fused_add_rms_norm": lambda: native.fused_add_rms_norm(x, res, w, 1e-5),
            "rotary_embedding": lambda: native.rotary_embedding(pos, q, k, cos_sin),
        }
        for threads in (2, 1):
            torch.set_num_threads(threads)
            for name, fn in ops.items():
                fn()
                samples = []
                for _ in range(calls):
                    t0 = time.perf_counter()
                    fn()
                    samples.append(time.perf_counter() - t0)
                samples.sort()
                out.append(
                    {
                        "op": name,
                        "rows": n,
                        "threads": threads,
                        "mean_us": statistics.fmean(samples) * 1e6,
                        "median_us": samples[len(samples) // 2] * 1e6,
                        "p90_us": samples[len(samples) * 9 // 10] * 1e6,
                    }
                )
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[64, 300])
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--policy", action="append", default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.rows, args.calls)))
        return 0
    policies = [
        parse_policy(t) for t in args.policy or ["default:GOMP_SPINCOUNT=300000", "passive:OMP_WAIT_POLICY=PASSIVE"]
    ]
    print(f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'policy':>10s} {'op':>20s} {'rows':>5s} {'thr':>3s} {'mean us':>10s} {'median us':>10s} {'p90 us':>10s}")
    for name, env in policies:
        base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
        cmd = [sys.executable, __file__, "--child", "--calls", str(args.calls), "--rows", *map(str, args.rows)]
        res = subprocess.run(cmd, env={**base, **env}, capture_output=True, text=True, check=True)
        for r in json.loads(res.stdout.strip().splitlines()[-1]):
            print(
                f"{name:>10s} {r['op']:>20s} {r['rows']:5d} {r['threads']:3d} "
                f"{r['mean_us']:10.1f} {r['median_us']:10.1f} {r['p90_us']:10.1f}",
                flush=True,
            )
    print(f"load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
