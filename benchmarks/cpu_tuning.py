"""Measured dispatch on this CPU: what the tuner picks, what it costs, what it gains.

1. The tuning cost for the default model's bf16 linear shapes (hidden 576,
   intermediate 1536, vocabulary 49152): cold (an empty cache in a temporary folder)
   and cached (a second tuner on the same file), in seconds.
2. The plan: per shape and row bucket the chosen candidate, every candidate's time
   and the speedup of the choice over the static choice (``native_packed`` where the
   native packed kernel is built, else ``onednn``).
3. With --gguf, the same shapes as Q4_1 GGUF blocks (the default model's format): the
   tiled int8 kernel on repacked blocks against the weight dequantized once to bf16 and
   packed for oneDNN (AMX tiles where the CPU has them), per row count, timed as the
   tuner times (tuning.measure, interleaved rounds, minimum).

    python benchmarks/cpu_tuning.py [--gguf] [--rows 1 4 16 64 256 512] [--threads N]
    python benchmarks/cpu_tuning.py --gguf-only --threads 1 --cpu-time   # kernels alone

``--cpu-time`` times the calling thread's CPU time (``time.thread_time``; with one
thread the kernels run on it), which a loaded machine's waits do not inflate.

Timings follow platforms/cpu/tuning.py: under load (1-minute load average at least the
CPUs) they run on one thread (``timing_threads``); the header says which.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

from pagedserve.kernels.cpu import load_cpu_kernels
from pagedserve.platforms.cpu.tuned_linear import TunedLinear
from pagedserve.platforms.cpu.tuning import BUCKETS, Tuner, TuningCache, machine_identity, measure, timing_threads

__all__ = ["DEFAULT_SHAPES", "tune_cost", "gguf_candidates", "main"]

#: (out, in) of the default model's dense linear layers: qkv, o, gate/up, down, LM head.
DEFAULT_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576))


def _tuned(native, root: Path, buckets: tuple[int, ...]) -> TunedLinear:
    tuner = Tuner(TuningCache.default(root=root))
    return TunedLinear(tuner, native, native.linear, native.silu_and_mul, 1 << 30, buckets)


def tune_cost(native, root: Path, buckets: tuple[int, ...]) -> tuple[list[tuple[float, float]], TunedLinear]:
    """([(timing seconds, load wall seconds: packing included) cold, then cached], the
    cold tuner) for one weight of each of DEFAULT_SHAPES, the gated op included (its
    first call on the gate/up shape)."""
    weights = [torch.randn(n, k, dtype=torch.bfloat16) * 0.05 for n, k in DEFAULT_SHAPES]
    out = []
    for _ in range(2):
        tl = _tuned(native, root, buckets)
        t0 = time.perf_counter()
        prepared = [tl.prepare(w) for w in weights]
        tl.linear_silu_and_mul(torch.randn(1, 576, dtype=torch.bfloat16), prepared[2])
        out.append((tl.tuner.seconds, time.perf_counter() - t0, tl))
    return [(s, w) for s, w, _ in out], out[0][2]


def plan_table(tl: TunedLinear, static: str) -> list[str]:
    lines = [
        "| op | shape | rows | chosen | chosen us | static us | speedup | all candidates (us) |",
        "|---|---|---:|---|---:|---:|---:|---|",
    ]
    for plan in tl.tuner.plans.values():
        for b in plan.buckets:
            t = plan.times[b]
            ref = static if static in t else ("native_fused" if "native_fused" in t else min(t, key=t.get))
            best = plan.chosen[b]
            others = ", ".join(f"{n} {s * 1e6:.0f}" for n, s in sorted(t.items(), key=lambda kv: kv[1]))
            lines.append(
                f"| {plan.op} | {plan.key} | {b} | {best} | {t[best] * 1e6:.1f} | {t[ref] * 1e6:.1f} "
                f"| {t[ref] / t[best]:.2f}x | {others} |"
            )
    return lines


def _random_q41(n: int, k: int) -> torch.Tensor:
    raw = torch.randint(0, 256, (n, k // 32, 20), dtype=torch.uint8)
    raw[..., 0:2] = (torch.rand(n, k // 32) * 0.02 + 1e-3).half().view(torch.uint8).reshape(n, -1, 2)
    raw[..., 2:4] = (torch.randn(n, k // 32) * 0.05).half().view(torch.uint8).reshape(n, -1, 2)
    return raw.reshape(n, -1)


#: The clock of the GGUF table (--cpu-time: time.thread_time).
_CLOCK = time.perf_counter


def _measure_as_tuner(calls) -> dict[str, float]:
    """tuning.measure on the thread count the tuner would time with now."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1 if _CLOCK is time.thread_time else timing_threads())
    try:
        return measure(calls, clock=_CLOCK)
    finally:
        torch.set_num_threads(saved)


def gguf_candidates(rows: list[int]) -> list[str]:
    """The GGUF kernels on repacked blocks (the tiled int8 kernel on AVX-512 VNNI, and
    where built the AMX int8 one and the AMX-BF16 one that dequantizes per column pair)
    against the weight dequantized once to bf16 through oneDNN (what the bf16 path runs)."""
    from pagedserve.kernels import quant_reference as qref
    from pagedserve.kernels.cpu.quant_gguf_amx import load_gguf_amx
    from pagedserve.kernels.cpu.quant_native import load_quant_kernels

    quant, amx = load_quant_kernels(), load_gguf_amx()
    if quant is None or not quant.has_packed():
        return ["(the tiled GGUF kernel is unavailable here)"]
    q41 = qref.GGUF_TYPE_IDS["Q4_1"]
    lines = [
        "| shape | rows | int8 VNNI us | int8 AMX us | AMX-BF16 us | bf16 oneDNN us | oneDNN / best GGUF |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for n, k in DEFAULT_SHAPES:
        raw = _random_q41(n, k)
        packed = quant.pack_weight(raw, q41)
        dense = torch.ops.mkldnn._reorder_linear_weight(qref.dequantize_gguf(raw, "Q4_1").bfloat16().contiguous(), None)
        for m in rows:
            x = torch.randn(m, k, dtype=torch.bfloat16)
            calls = {
                "int8": lambda: quant.gguf_linear_out(x, packed, q41, None),
                "onednn": lambda: torch.ops.mkldnn._linear_pointwise(x, dense, None, "none", [], ""),
            }
            if amx is not None:
                calls["amx"] = lambda: amx.gguf_linear_out(x, packed, q41, None)
                calls["amx_bf16"] = lambda: amx.gguf_bf16_linear_out(x, packed, q41, None)
            t = _measure_as_tuner(calls)
            a, b = t.get("amx", float("nan")), t.get("amx_bf16", float("nan"))
            best = min(v for c, v in t.items() if c != "onednn")
            lines.append(
                f"| {n}x{k} | {m} | {t['int8'] * 1e6:.1f} | {a * 1e6:.1f} | {b * 1e6:.1f} | {t['onednn'] * 1e6:.1f} "
                f"| {t['onednn'] / best:.2f} |"
            )
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=list(BUCKETS))
    parser.add_argument("--gguf", action="store_true", help="also the GGUF int8 kernel vs dequantized bf16 oneDNN")
    parser.add_argument("--gguf-only", action="store_true", help="only the GGUF table")
    parser.add_argument("--cpu-time", action="store_true", help="GGUF table: one thread, its CPU time")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cpu_time:
        global _CLOCK
        _CLOCK = time.thread_time
    if args.gguf_only:
        print(f"# {machine_identity()['cpu']}, load average {os.getloadavg()[0]:.1f}, clock {_CLOCK.__name__}\n")
        print("\n".join(gguf_candidates(args.rows)))
        return
    native = load_cpu_kernels()
    if native is None:
        raise SystemExit("the native CPU kernels are unavailable here")
    ident = machine_identity()
    print(f"# {ident['cpu']} ({ident['flags']}), torch {ident['torch']}, {ident['threads']} threads")
    print(f"# load average {os.getloadavg()[0]:.1f}; timing threads now: {timing_threads()}\n")
    with tempfile.TemporaryDirectory() as tmp:
        ((cold, cold_wall), (cached, cached_wall)), tl = tune_cost(native, Path(tmp), tuple(args.rows))
    print(
        f"the default model's bf16 shapes: timing {cold:.2f} s cold, {cached:.3f} s cached; "
        f"prepare wall (packing included) {cold_wall:.2f} s cold, {cached_wall:.2f} s cached\n"
    )
    static = "native_packed" if native.has_packed_linear else "onednn"
    print("\n".join(plan_table(tl, static)))
    if args.gguf:
        print("\nQ4_1 GGUF layers: tiled int8 kernel vs the weight dequantized to bf16 for oneDNN:\n")
        print("\n".join(gguf_candidates(args.rows)))


if __name__ == "__main__":
    main()
