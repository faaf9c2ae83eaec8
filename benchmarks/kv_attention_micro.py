"""Native CPU decode attention alone over bf16 and 8-bit caches, against memory bandwidth.

Decode batches (one query token per sequence) of the default model's attention shapes
(9 query heads, 3 KV heads, head size 64, block size 16; CPU head-major storage), each
cache kind holding its own random rows.  Every (batch, context) point gets enough
distinct layers (own caches, own shuffled block tables) that one sweep reads at least
``--min-mib`` of bf16 KV, far beyond the last-level cache, as a decode step over a
model's layers does.  The kinds are timed interleaved, sample by sample, and each
sample's time is divided by the first kind's of the same sample: only those same-run
ratios mean anything on a shared machine.  ``--clock cpu`` times process CPU seconds
(all threads' together) instead of wall time: on a machine loaded by other work the
wall time mostly measures how much of the cores this process was given.

Cache kinds: ``bf16``, ``int8`` (rows with their float32 scales), ``fp8_e4m3`` and
``fp8_e5m2`` (rows with their scales, the engine's default layout), ``fp8_e4m3@tensor``
(unscaled rows, scale 1.0); ``KIND/ISA`` runs that kind on the kernels of instruction set
ISA (``int8/avx512``: the float32 in-register 8-bit kernel, for an A/B against
``avx512bf16``'s); ``KIND:base`` runs it on another build of the kernels, ``--base-so``
(say the one a checkout of main built), for a before/after in one process.  GB/s counts
the KV bytes a call must read (every visible key and value row once, scales included);
``--roofline-gbps`` (a read bandwidth measured with ``benchmarks/stream_bw.c`` at the
same thread count) adds the fraction of it reached.

    python benchmarks/kv_attention_micro.py --batch 32 64 --contexts 128 960 4096 \\
        --threads 1 2 --kinds bf16,int8,fp8_e4m3,int8/avx512,fp8_e4m3/avx512
    python benchmarks/kv_attention_micro.py --clock cpu --threads 1 --kinds bf16:base,bf16 \\
        --base-so ~/.cache/pagedserve/kernels/pagedserve_cpu_<key>/pagedserve_cpu_<key>.so
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from pagedserve.kernels import reference
from pagedserve.kernels.cpu import load_cpu_kernels
from pagedserve.kernels.cpu.native import NativeCpuKernels

HEADS, KV_HEADS, HEAD, BLOCK = 9, 3, 64, 16


def head_major(t: torch.Tensor) -> torch.Tensor:
    """The CPU platform's storage: each KV head's rows of a block together."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def make_cache(kind: str, blocks: int, gen: torch.Generator) -> torch.Tensor:
    """Random rows [blocks, BLOCK, KV_HEADS, row] of one cache kind, head-major."""
    x = torch.randn(blocks, BLOCK, KV_HEADS, HEAD, generator=gen, dtype=torch.bfloat16)
    if kind == "bf16":
        return head_major(x)
    if kind == "int8":
        return head_major(reference.quantize_kv_rows(x, torch.int8))
    fp8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
    if kind in fp8:
        return head_major(reference.quantize_kv_rows(x, fp8[kind]))
    if kind == "fp8_e4m3@tensor":
        return head_major(reference.quantize_kv(x, torch.float8_e4m3fn))
    raise SystemExit(f"unknown cache kind {kind!r}")


def load_base_kernels(path: str, isa: str) -> NativeCpuKernels:
    """Another build of the CPU kernels (its .so, by path), bound to instruction set isa."""
    so = Path(path).expanduser()
    name = so.name.split(".")[0]
    spec = importlib.util.spec_from_file_location(name, so)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {so}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return NativeCpuKernels(module, isa)


def row_bytes(cache: torch.Tensor) -> int:
    return cache.shape[-1] * cache.element_size()


def run_point(
    batch: int, ctx: int, specs: list[tuple[str, str | None, bool]], args, kernels_by_isa, roof_gbps: float | None
) -> list[tuple]:
    gen = torch.Generator().manual_seed(batch * 100003 + ctx)
    per_seq = math.ceil(ctx / BLOCK)
    bf16_layer = batch * ctx * KV_HEADS * 2 * HEAD * 2
    layers = max(1, min(args.max_layers, math.ceil(args.min_mib * 2**20 / bf16_layer)))
    nb = batch * per_seq + 1
    q = torch.randn(batch, HEADS, HEAD, generator=gen, dtype=torch.bfloat16)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    kinds = sorted({k for k, _, _ in specs})
    data = {}
    for kind in kinds:
        data[kind] = [
            (
                make_cache(kind, nb, gen),
                make_cache(kind, nb, gen),
                torch.randperm(nb - 1, generator=gen)[: batch * per_seq].view(batch, per_seq).int(),
            )
            for _ in range(layers)
        ]
    out = torch.empty_like(q)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    times: dict[int, list[float]] = {i: [] for i in range(len(specs))}

    def sweep(i: int) -> float:
        kind, isa, base = specs[i]
        k = kernels_by_isa[isa, base]
        t0 = clock()
        for kc, vc, tables in data[kind]:
            k.paged_attention(q, kc, vc, tables, seq_lens, qsl, HEAD**-0.5, out)
        return (clock() - t0) / layers

    for i in range(len(specs)):  # warm-up (first-touch, scratch growth)
        sweep(i)
    for _ in range(args.samples):
        for i in range(len(specs)):
            times[i].append(sweep(i))
    rows = []
    for i, (kind, isa, base) in enumerate(specs):
        ts = times[i]
        ratios = sorted(a / b for a, b in zip(ts, times[0]))
        kc = data[kind][0][0]
        nbytes = batch * ctx * KV_HEADS * 2 * row_bytes(kc)
        med = statistics.median(ts)
        gbps = nbytes / med / 1e9
        name = (kind if isa is None else f"{kind}/{isa}") + (":base" if base else "")
        roof = f"{gbps / roof_gbps:.2f}" if roof_gbps else "-"
        rows.append(
            (
                name,
                batch,
                ctx,
                layers,
                f"{med * 1e6:.0f}",
                f"{gbps:.1f}",
                roof,
                f"{statistics.median(ratios):.2f}",
                f"{ratios[len(ratios) // 4]:.2f}-{ratios[(3 * len(ratios)) // 4]:.2f}",
            )
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 960])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument(
        "--kinds", default="bf16,int8,fp8_e4m3", help="KIND[/ISA][:base],...; the first is the one ratios divide by"
    )
    parser.add_argument("--isa", default=None, help="instruction set of kinds without /ISA (default: the best)")
    parser.add_argument("--samples", type=int, default=9)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall", help="wall time or process CPU time")
    parser.add_argument("--min-mib", type=float, default=256.0, help="bf16 KV read per sweep of the layers")
    parser.add_argument("--max-layers", type=int, default=30)
    parser.add_argument(
        "--roofline-gbps", type=float, nargs="+", default=None, help="measured read GB/s, one per --threads entry"
    )
    parser.add_argument("--base-so", default=None, help="another build of the CPU kernels (.so) for KIND:base")
    args = parser.parse_args(argv)
    specs: list[tuple[str, str | None, bool]] = []
    for item in args.kinds.split(","):
        item, _, tag = item.partition(":")
        if tag not in ("", "base"):
            raise SystemExit(f"unknown tag {tag!r} in {item}:{tag} (only :base)")
        kind, _, isa = item.partition("/")
        specs.append((kind, isa or args.isa, tag == "base"))
    if any(base for _, _, base in specs) and args.base_so is None:
        raise SystemExit("KIND:base needs --base-so")
    kernels_by_isa = {}
    for _, isa, base in specs:
        if (isa, base) not in kernels_by_isa:
            own = load_cpu_kernels(isa=isa)
            kernels_by_isa[isa, base] = load_base_kernels(args.base_so, own.isa) if base else own
    print("kernels:", {f"{isa}{':base' if base else ''}": k.isa for (isa, base), k in kernels_by_isa.items()})
    unit = "us/call" if args.clock == "wall" else "CPU us/call"
    header = ("kind", "batch", "ctx", "layers", unit, "GB/s", "of roof", "ratio", "quartiles")
    for t, threads in enumerate(args.threads):
        torch.set_num_threads(threads)
        roof = args.roofline_gbps[t] if args.roofline_gbps else None
        print(f"\nthreads {threads}")
        print(" | ".join(header))
        for batch in args.batch:
            for ctx in args.contexts:
                for row in run_point(batch, ctx, specs, args, kernels_by_isa, roof):
                    print(" | ".join(str(c) for c in row), flush=True)


if __name__ == "__main__":
    main()
