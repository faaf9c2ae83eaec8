"""Two builds of the native CPU kernels on the decode step's bf16 GEMMs, interleaved.

A kernel change is measured against the build before it in one process: both extension
files are loaded side by side (their symbols are hidden, so they cannot bind to each
other), and each round times one call of A and one of B (the order alternating) on the
same weights and activations. The figures to quote are the median per-round ratio B/A
and its spread; the per-call medians say how fast, on a shared machine only roughly.

Shapes (the default model, SmolLM2-135M: hidden 576, intermediate 1536, 9/3 heads of
64, vocabulary 49152): ``step`` is every bf16 GEMM of one decode step, 30 layers each
with its own weights (qkv, o, the gated gate/up through ``packed_linear_silu_and_mul``,
down) and the LM head, 268 MB read from memory per step; ``qkv``, ``o``, ``gate_up``,
``down``, ``lm_head`` one weight each (the small ones stay in L2/L3 between calls).

Outputs of A and B are compared as well (``same`` says whether they are bitwise equal).
For ``step``, a row per op kind follows the step's row (``step:qkv``, ...: the calls of
that kind within the same steps, timed apart), with the weight GB/s of each.

``--huge-pages`` puts the weights in a huge-page arena as the CPU platform does
(kernels/cpu/hugepages.py; ``b``: only B's copy, which with ``--a`` and ``--b`` the same
build measures what the huge pages alone are worth; ``none``: both on plain pages;
default ``both``).

    python benchmarks/decode_gemm_ab.py --a OLD.so [--b NEW.so] [--rows 1 4 16 64]
        [--threads 1 2] [--shapes step lm_head] [--rounds 15] [--peak-gflops 233] [--cpu-time]
        [--huge-pages both|b|none]

``--b`` defaults to the build of the current sources (compiled first if needed). An
older build is the ``.so`` in its folder of the kernel cache
(``~/.cache/pagedserve/kernels/pagedserve_cpu_<key>/``): build it from the older sources
(``pagedserve build-kernels``) and note its path before changing them.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

__all__ = ["SHAPES", "load_so", "make_weights", "main"]

#: name -> (K, N, gated, copies in one decode step)
SHAPES: dict[str, tuple[int, int, bool, int]] = {
    "qkv": (576, 960, False, 30),
    "o": (576, 576, False, 30),
    "gate_up": (576, 3072, True, 30),
    "down": (1536, 576, False, 30),
    "lm_head": (576, 49152, False, 1),
}


def load_so(path: str | os.PathLike) -> ModuleType:
    """Import one built CPU-kernel extension from its file (module name = the file's stem)."""
    path = Path(path).resolve()
    name = path.name.split(".")[0]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def _pack(w: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    return w.contiguous().view(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def make_weights(shape: str, seed: int = 0, arena=None) -> list[tuple[str, torch.Tensor, bool]]:
    """(op kind, packed weight, gated) of ``shape`` (``step``: every GEMM of a decode
    step, in the order a step runs them: per layer qkv, o, gate/up, down; then the LM
    head), packed into ``arena`` (a HugePageArena) when given."""
    gen = torch.Generator().manual_seed(seed)
    names = list(SHAPES) if shape == "step" else [shape]
    by_name: dict[str, list[tuple[str, torch.Tensor, bool]]] = {}
    for name in names:
        k, n, gated, copies = SHAPES[name]
        for _ in range(copies if shape == "step" else 1):
            wp = _pack((torch.randn(n, k, generator=gen) * 0.05).bfloat16())
            if arena is not None:
                wp = arena.empty(wp.shape, wp.dtype).copy_(wp)
            by_name.setdefault(name, []).append((name, wp, gated))
    layers = max(len(v) for v in by_name.values())
    return [w for i in range(layers) for ws in by_name.values() for w in ws[i : i + 1]]


def _runner(module: ModuleType, weights, x_by_k: dict[int, torch.Tensor], clock):
    """run() -> (outputs, seconds per op kind) of one pass over ``weights``."""
    isa = list(module.compiled_isas()).index("avx512bf16")
    plain, gated_fn = module.packed_linear, module.packed_linear_silu_and_mul

    def run() -> tuple[list[torch.Tensor], dict[str, float]]:
        outs, per = [], {}
        for name, wp, gated in weights:
            t0 = clock()
            outs.append((gated_fn if gated else plain)(x_by_k[wp.shape[1] * 2], wp, None, isa))
            per[name] = per.get(name, 0.0) + clock() - t0
        return outs, per

    return run


def _flop(weights, rows: int, kind: str | None = None) -> float:
    return sum(2.0 * rows * wp.shape[0] * 16 * wp.shape[1] * 2 for name, wp, _ in weights if kind in (None, name))


def _bytes(weights, kind: str | None = None) -> float:
    return sum(wp.numel() * wp.element_size() for name, wp, _ in weights if kind in (None, name))


def _summary(ta: list[float], tb: list[float], flop: float, nbytes: float) -> dict:
    ratios = [b / a for a, b in zip(ta, tb)]
    return {
        "a_ms": statistics.median(ta) * 1e3,
        "b_ms": statistics.median(tb) * 1e3,
        "a_best_ms": min(ta) * 1e3,
        "b_best_ms": min(tb) * 1e3,
        "ratio": statistics.median(ratios),
        "ratio_lo": min(ratios),
        "ratio_hi": max(ratios),
        "flop": flop,
        "bytes": nbytes,
    }


def compare(
    mod_a,
    mod_b,
    shape: str,
    rows: int,
    rounds: int,
    clock=time.perf_counter,
    seed: int = 0,
    huge_pages: str = "both",
) -> dict:
    """Per-round ratios B/A of ``shape`` at ``rows``; for ``step`` also per op kind
    (``result["kinds"]``).  ``huge_pages``: whose weights sit in a huge-page arena
    (``both``, ``b``, ``none``)."""
    from pagedserve.kernels.cpu.hugepages import HugePageArena

    weights_a = make_weights(shape, seed, HugePageArena() if huge_pages == "both" else None)
    weights_b = weights_a if huge_pages != "b" else make_weights(shape, seed, HugePageArena())
    gen = torch.Generator().manual_seed(seed + rows)
    x_by_k = {k: torch.randn(rows, k, generator=gen).bfloat16() for k in (576, 1536)}
    run_a, run_b = _runner(mod_a, weights_a, x_by_k, clock), _runner(mod_b, weights_b, x_by_k, clock)
    (out_a, _), (out_b, _) = run_a(), run_b()
    same = all(torch.equal(p, q) for p, q in zip(out_a, out_b))
    del out_a, out_b
    kinds = list(dict.fromkeys(name for name, _, _ in weights_a))
    ta: dict[str | None, list[float]] = {k: [] for k in (None, *kinds)}
    tb: dict[str | None, list[float]] = {k: [] for k in (None, *kinds)}
    for r in range(rounds):
        for name in "ab" if r % 2 == 0 else "ba":
            fn, into = (run_a, ta) if name == "a" else (run_b, tb)
            t0 = clock()
            _, per = fn()
            into[None].append(clock() - t0)
            for kind in kinds:
                into[kind].append(per[kind])
    out = _summary(ta[None], tb[None], _flop(weights_a, rows), _bytes(weights_a))
    out["same"] = same
    if shape == "step":
        out["kinds"] = {k: _summary(ta[k], tb[k], _flop(weights_a, rows, k), _bytes(weights_a, k)) for k in kinds}
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", required=True, help="the .so of build A (the older one)")
    parser.add_argument("--b", default=None, help="the .so of build B (default: the current sources' build)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--shapes", nargs="+", choices=["step", *SHAPES], default=["step"])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--peak-gflops", type=float, default=None, help="per-core peak, for a %% column")
    parser.add_argument(
        "--huge-pages",
        choices=["both", "b", "none"],
        default="both",
        help="weights in a huge-page arena: both builds' (default, as the CPU platform packs "
        "them), only B's (with --a and --b the same build: the huge pages' own effect), neither",
    )
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time in process CPU seconds (steadier on a busy machine; with 2 threads set "
        "OMP_WAIT_POLICY=passive so that waiting threads do not count)",
    )
    args = parser.parse_args(argv)
    mod_a = load_so(args.a)
    if args.b is None:
        from pagedserve.kernels import build

        mod_b, _ = build.load_cpu_extension()
    else:
        mod_b = load_so(args.b)
    clock = time.process_time if args.cpu_time else time.perf_counter
    print(
        f"# A {mod_a.__name__}  B {mod_b.__name__}; {'CPU' if args.cpu_time else 'wall'} time; "
        f"huge pages: {args.huge_pages}; load average {os.getloadavg()[0]:.1f}"
    )
    print(
        "| shape | threads | rows | A ms (median) | B ms (median) | B/A median | B/A min-max "
        "| B GFLOP/s | B weight GB/s | same |"
    )
    print("|---|---:|---:|---:|---:|---:|---|---:|---:|---|")

    def row(name: str, threads: int, rows: int, r: dict, same: str) -> None:
        gf = r["flop"] / (r["b_ms"] * 1e-3) * 1e-9
        gbs = r["bytes"] / (r["b_ms"] * 1e-3) * 1e-9
        pct = f" ({100 * gf / (args.peak_gflops * threads):.0f}%)" if args.peak_gflops else ""
        print(
            f"| {name} | {threads} | {rows} | {r['a_ms']:.2f} | {r['b_ms']:.2f} | {r['ratio']:.3f} | "
            f"{r['ratio_lo']:.2f}-{r['ratio_hi']:.2f} | {gf:.0f}{pct} | {gbs:.1f} | {same} |",
            flush=True,
        )

    for threads in args.threads:
        torch.set_num_threads(threads)
        for shape in args.shapes:
            for rows in args.rows:
                r = compare(mod_a, mod_b, shape, rows, args.rounds, clock, huge_pages=args.huge_pages)
                row(shape, threads, rows, r, "yes" if r["same"] else "NO")
                for kind, rk in r.get("kinds", {}).items():
                    row(f"{shape}:{kind}", threads, rows, rk, "")
    print(f"# load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
