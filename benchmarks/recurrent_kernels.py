"""The recurrent-layer ops on the CPU: native kernels (kernels/cpu/recurrent.cpp) against
the torch references (kernels/recurrent_reference.py), and one model end to end.

Ops, at the shapes of published models (bf16 activations, float32 states, as the models
call them):

- Qwen3.5-0.8B's Gated DeltaNet: 16 key and 16 value heads of 128, its q/k/v
  convolution over 6144 channels (width 4, no bias);
- Granite-4.0-H-Tiny's Mamba 2: 48 heads of 64, one group, d_state 128, its convolution
  over 3328 channels (width 4, bias), SSD chunk 256;
- Jamba-1.5-Mini's Mamba 1: 8192 channels, d_state 16 (its convolution is the same op).

Decode steps at batch 1, 16 and 64; prefill of one 512-token sequence.  One thread by
default.  Each pair is timed in interleaved rounds (reference, native, reference, ...);
the figures are the medians of the per-call CPU seconds of the calling thread (with one
thread the kernels and torch's ops run on it), robust to a loaded machine, and the wall
medians beside them.

``--e2e`` runs a tiny random Qwen3.5 (Qwen3.5-0.8B's DeltaNet shapes, narrow otherwise)
through ``LLM`` in fresh processes, the recurrent ops native or the references
alternating: decode tokens/s and CPU seconds per output token.

    python benchmarks/recurrent_kernels.py [--threads 1] [--rounds 7] [--only gdn,mamba2,mamba1,conv]
                                           [--e2e] [--e2e-rounds 3] [--requests 16] [--output-len 64]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedserve.kernels import recurrent_reference as ref

DTYPE = torch.bfloat16
BATCHES = (1, 16, 64)
PREFILL = 512


def interleaved(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, tuple[float, float]]:
    """{name: (median CPU seconds, median wall seconds)} of one call, the calls alternating."""
    for fn in fns.values():  # warm-up (and the native build's first load)
        fn()
    cpu: dict[str, list[float]] = {n: [] for n in fns}
    wall: dict[str, list[float]] = {n: [] for n in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            c0, w0 = time.thread_time(), time.perf_counter()
            fn()
            cpu[name].append(time.thread_time() - c0)
            wall[name].append(time.perf_counter() - w0)
    return {n: (statistics.median(cpu[n]), statistics.median(wall[n])) for n in fns}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def gdn_cases(decode: bool, tokens: int, seqs: int, g: torch.Generator):
    hk, hv, dk, dv = 16, 16, 128, 128
    q = torch.randn(tokens, hk, dk, generator=g).to(DTYPE)
    k = torch.randn(tokens, hk, dk, generator=g).to(DTYPE)
    v = torch.randn(tokens, hv, dv, generator=g).to(DTYPE)
    gg = -F.softplus(torch.randn(tokens, hv, generator=g))
    beta = torch.sigmoid(torch.randn(tokens, hv, generator=g))
    state = torch.randn(seqs, hv, dk, dv, generator=g) * 0.1
    qsl = torch.tensor([0, tokens], dtype=torch.int32)
    if decode:
        return "gated_delta_rule_recurrent", (q, k, v, gg, beta), state, ()
    return "gated_delta_rule", (q, k, v, gg, beta), state, (qsl, True, 64)


def mamba2_cases(decode: bool, tokens: int, seqs: int, g: torch.Generator):
    heads, hd, groups, n = 48, 64, 1, 128
    x = torch.randn(tokens, heads, hd, generator=g).to(DTYPE)
    dt = F.softplus(torch.randn(tokens, heads, generator=g) - 2)
    A = -(torch.rand(heads, generator=g) * 4 + 0.5)
    B = torch.randn(tokens, groups, n, generator=g).to(DTYPE)
    C = torch.randn(tokens, groups, n, generator=g).to(DTYPE)
    D = torch.randn(heads, generator=g)
    state = torch.randn(seqs, heads, hd, n, generator=g) * 0.1
    qsl = torch.tensor([0, tokens], dtype=torch.int32)
    if decode:
        return "mamba2_ssd_step", (x, dt, A, B, C, D), state, ()
    return "mamba2_ssd", (x, dt, A, B, C, D), state, (qsl, 256)


def mamba1_cases(decode: bool, tokens: int, seqs: int, g: torch.Generator):
    dim, n = 8192, 16
    x = torch.randn(tokens, dim, generator=g).to(DTYPE)
    dt = F.softplus(torch.randn(tokens, dim, generator=g) - 2)
    A = -(torch.rand(dim, n, generator=g) * 4 + 0.5)
    B = torch.randn(tokens, n, generator=g).to(DTYPE)
    C = torch.randn(tokens, n, generator=g).to(DTYPE)
    D = torch.randn(dim, generator=g)
    state = torch.randn(seqs, dim, n, generator=g) * 0.1
    qsl = torch.tensor([0, tokens], dtype=torch.int32)
    if decode:
        return "mamba1_scan_step", (x, dt, A, B, C, D), state, ()
    return "mamba1_scan", (x, dt, A, B, C, D), state, (qsl, 16)


def conv_cases(decode: bool, tokens: int, seqs: int, g: torch.Generator, dim: int = 6144, bias: bool = False):
    width = 4
    x = torch.randn(tokens, dim, generator=g).to(DTYPE)
    w = torch.randn(dim, width, generator=g).to(DTYPE)
    b = torch.randn(dim, generator=g).to(DTYPE) if bias else None
    state = torch.randn(seqs, dim, width - 1, generator=g)
    if decode:
        return "causal_conv1d_update", (x, w, b), state, ("silu",)
    qsl = torch.tensor([0, tokens], dtype=torch.int32)
    return "causal_conv1d", (x, w, b), state, (qsl, torch.ones(1, dtype=torch.bool), "silu")


FAMILIES = {
    "gdn": ("Qwen3.5-0.8B DeltaNet", gdn_cases),
    "conv": ("Qwen3.5-0.8B conv (6144 ch)", conv_cases),
    "mamba2": ("Granite-4-tiny Mamba 2", mamba2_cases),
    "conv-granite": (
        "Granite-4-tiny conv (3328 ch, bias)",
        lambda d, t, s, g: conv_cases(d, t, s, g, dim=3328, bias=True),
    ),
    "mamba1": ("Jamba-1.5-Mini Mamba 1", mamba1_cases),
}


def bench_ops(args: argparse.Namespace) -> list[dict]:
    from pagedserve.kernels.cpu import recurrent_native as native

    if native.load_recurrent_kernels() is None:
        raise SystemExit("the recurrent-layer CPU kernels did not build (see the warning above)")
    rows = []
    for fam in args.only:
        label, make = FAMILIES[fam]
        shapes = [(True, b, b) for b in BATCHES] + [(False, PREFILL, 1)]
        for decode, tokens, seqs in shapes:
            op, inputs, state, rest = make(decode, tokens, seqs, _gen(0))
            states = {"reference": state.clone(), "native": state.clone()}
            impls = {"reference": getattr(ref, op), "native": native.OPS[op]}
            calls = {n: (lambda n=n: impls[n](*inputs, states[n], *rest)) for n in impls}
            rounds = args.rounds if decode else max(3, args.rounds // 2)
            t = interleaved(calls, rounds)
            rows.append(
                dict(
                    family=label,
                    op=op,
                    shape=f"decode x{seqs}" if decode else f"prefill {tokens}",
                    ref_cpu_ms=t["reference"][0] * 1e3,
                    native_cpu_ms=t["native"][0] * 1e3,
                    ref_wall_ms=t["reference"][1] * 1e3,
                    native_wall_ms=t["native"][1] * 1e3,
                    speedup_cpu=t["reference"][0] / max(t["native"][0], 1e-9),
                )
            )
            r = rows[-1]
            print(
                f"| {r['family']} | `{op}` | {r['shape']} | {r['ref_cpu_ms']:.3f} | {r['native_cpu_ms']:.3f} "
                f"| {r['speedup_cpu']:.1f}x | {r['ref_wall_ms']:.3f} / {r['native_wall_ms']:.3f} |",
                flush=True,
            )
    return rows


# -- end to end ----------------------------------------------------------------------------------


def build_model(path: Path) -> Path:
    """A tiny random Qwen3.5: 4 layers (3 DeltaNet, 1 gated attention), hidden 512, its
    DeltaNet layers at Qwen3.5-0.8B's shapes (16 + 16 heads of 128, conv width 4)."""
    import transformers

    from pagedserve.testing.tiny_model import write_byte_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    vocab = write_byte_tokenizer(path)
    config = transformers.Qwen3_5TextConfig(
        vocab_size=vocab,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    transformers.Qwen3_5ForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path


def e2e_child(path: str, variant: str, requests: int, output_len: int, threads: int) -> None:
    """One engine run in this (fresh) process; prints one JSON line."""
    if variant == "reference":
        from pagedserve.kernels.cpu import recurrent_native

        # Registered in place of the native kernels when the platform installs its ops.
        for name in list(recurrent_native.OPS):
            recurrent_native.OPS[name] = getattr(ref, name)
    from pagedserve import LLM, SamplingParams

    llm = LLM(model=path, dtype="bfloat16", threads=threads, enable_prefix_caching=False)
    prompts = [[3 + (7 * i + j) % 250 for j in range(16)] for i in range(requests)]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    c0, w0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - w0
    c1 = resource.getrusage(resource.RUSAGE_SELF)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    cpu = (c1.ru_utime + c1.ru_stime) - (c0.ru_utime + c0.ru_stime)
    print(json.dumps(dict(variant=variant, tokens=tokens, wall=wall, cpu=cpu)))


def bench_e2e(args: argparse.Namespace) -> dict:
    results: dict[str, list[dict]] = {"reference": [], "native": []}
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(Path(tmp) / "qwen3_5-tiny")
        for _ in range(args.e2e_rounds):
            for variant in ("reference", "native"):
                cmd = [
                    sys.executable,
                    __file__,
                    "--e2e-child",
                    str(path),
                    variant,
                    str(args.requests),
                    str(args.output_len),
                    str(args.threads),
                ]
                proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ), check=False)
                if proc.returncode != 0:
                    raise SystemExit(proc.stderr[-3000:])
                results[variant].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    summary = {}
    for variant, runs in results.items():
        summary[variant] = dict(
            tok_per_s=statistics.median(r["tokens"] / r["wall"] for r in runs),
            cpu_ms_per_token=statistics.median(1e3 * r["cpu"] / r["tokens"] for r in runs),
            runs=len(runs),
        )
    print(json.dumps(summary, indent=1))
    return summary


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--e2e-child":
        e2e_child(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--only", default=",".join(FAMILIES), help="comma-separated: " + ",".join(FAMILIES))
    p.add_argument("--e2e", action="store_true", help="also the end-to-end decode of a tiny Qwen3.5")
    p.add_argument("--e2e-only", action="store_true")
    p.add_argument("--e2e-rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--output-len", type=int, default=64)
    args = p.parse_args()
    args.only = [f for f in args.only.split(",") if f]
    torch.set_num_threads(args.threads)
    print(f"threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}", flush=True)
    if not args.e2e_only:
        print("| model | op | shape | reference CPU ms | native CPU ms | speedup | wall ms ref / native |")
        print("|---|---|---|---|---|---|---|")
        bench_ops(args)
    if args.e2e or args.e2e_only:
        bench_e2e(args)


if __name__ == "__main__":
    main()
