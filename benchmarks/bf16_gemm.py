"""bf16 GEMM of the default model's layers: the native packed kernel against oneDNN.

For every linear shape of SmolLM2-135M (hidden 576, intermediate 1536, 9 q / 3 kv heads
of 64, vocabulary 49152) and row count, GFLOP/s and the fraction of the VDPBF16PS peak
of the threads used, for:

- ``native``: the CPU platform's path (the packed kernel of kernels/cpu/linear.h on a
  weight from ``pack_linear_weight``; the gate/up shape through the fused
  ``packed_linear_silu_and_mul``);
- ``oneDNN packed``: ``torch.ops.mkldnn._linear_pointwise`` on a weight reordered once
  (what dense_ops runs for shapes the native packing does not take);
- ``torch.matmul``: ``x @ w.T`` on the plain weight (oneDNN reorders it per call).

``--peak`` builds and runs benchmarks/vdpbf16ps_peak.c (a register-only VDPBF16PS loop)
first and uses its best GFLOP/s per core; otherwise ``--peak-gflops`` (per core).

    python benchmarks/bf16_gemm.py [--cpu-time] [--rows 1 4 16 64 128 256 512 2048]
                                   [--shapes qkv o gate_up down lm_head] [--peak]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from pagedserve.kernels.cpu import load_cpu_kernels

__all__ = ["SHAPES", "measure_peak", "bench_shape", "main"]

#: name -> (K, N, gated) of the default model's linear layers.
SHAPES = {
    "qkv": (576, 960, False),
    "o": (576, 576, False),
    "gate_up": (576, 3072, True),
    "down": (1536, 576, False),
    "lm_head": (576, 49152, False),
}


def measure_peak() -> float:
    """Best GFLOP/s of one core on the register-only VDPBF16PS loop."""
    src = Path(__file__).with_name("vdpbf16ps_peak.c")
    with tempfile.TemporaryDirectory() as tmp:
        exe = os.path.join(tmp, "peak")
        subprocess.run(["cc", "-O2", "-mavx512f", "-mavx512bw", "-mavx512bf16", str(src), "-o", exe], check=True)
        lines = subprocess.run([exe], check=True, capture_output=True, text=True).stdout.split("\n")
    return max(float(line.split()[1]) for line in lines if line.strip())


def _time(fn, clock, min_seconds: float = 0.2, min_reps: int = 3) -> float:
    """Smallest seconds of one call on ``clock`` (the least disturbed on a shared machine)."""
    fn()
    best, reps, start = float("inf"), 0, time.perf_counter()
    while reps < min_reps or time.perf_counter() - start < min_seconds:
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
        reps += 1
    return best


def bench_shape(native, name: str, rows: list[int], clock, peak: float) -> list[tuple]:
    """Rows of the table for one layer shape; ``peak``: GFLOP/s of the threads used."""
    from pagedserve.platforms.cpu import dense_ops

    k, n, gated = SHAPES[name]
    w = torch.randn(n, k).bfloat16()
    packed = native.pack_linear_weight(w)
    onednn = torch.ops.mkldnn._reorder_linear_weight(w, None)
    nat = native.packed_linear_silu_and_mul if gated else native.packed_linear
    assert packed is not None and dense_ops.onednn_available()
    out = []
    for m in rows:
        x = torch.randn(m, k).bfloat16()
        flop = 2.0 * m * n * k
        ts = (
            _time(lambda: nat(x, packed, None), clock),
            _time(lambda: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], ""), clock),
            _time(lambda: torch.matmul(x, w.t()), clock),
        )
        gf = [flop / t * 1e-9 for t in ts]
        out.append((name, m, *(f"{t * 1e6:.1f}" for t in ts), *(f"{g:.0f} ({100 * g / peak:.0f}%)" for g in gf)))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 128, 256, 512, 2048])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--cpu-time", action="store_true", help="one thread, process CPU time (shared machine)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--peak", action="store_true", help="measure the VDPBF16PS peak first")
    parser.add_argument("--peak-gflops", type=float, default=540.0, help="per-core peak when --peak is not given")
    args = parser.parse_args(argv)
    if args.cpu_time:
        args.threads = 1
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.cpu_time else time.perf_counter
    per_core = measure_peak() if args.peak else args.peak_gflops
    native = load_cpu_kernels()
    if native is None or not native.has_packed_linear:
        raise SystemExit("the native packed bf16 kernel is unavailable on this machine")
    threads = torch.get_num_threads()
    peak = per_core * threads
    timing = "CPU time" if args.cpu_time else "wall time"
    print(f"# {native.source}, {threads} thread(s), {timing}; peak {per_core:.0f} GFLOP/s per core")
    print(f"# load average {os.getloadavg()[0]:.1f}\n")
    header = ("shape", "rows", "native us", "oneDNN us", "matmul us", "native GF/s", "oneDNN GF/s", "matmul GF/s")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name in args.shapes:
        for row in bench_shape(native, name, args.rows, clock, peak):
            print("| " + " | ".join(str(v) for v in row) + " |", flush=True)


if __name__ == "__main__":
    main()
