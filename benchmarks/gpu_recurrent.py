"""The recurrent layers' Triton kernels on a GPU (kernels/triton/recurrent.py, decode
steps; kernels/triton/recurrent_prefill.py, prefill forms): checked against
kernels/recurrent_reference.py, then timed beside it.  Used by benchmarks/gpu_kernels.py;
runs alone too:

    python benchmarks/gpu_recurrent.py [--quick]

Shapes of published models (bf16 activations, float32 states, as the models call them):
Qwen3.5-0.8B's Gated DeltaNet (16 key and 16 value heads of 128; its q/k/v convolution
over 6144 channels, width 4), Granite-4.0-H-Tiny's Mamba 2 (48 heads of 64, one group,
d_state 128; convolution over 3328 channels with bias) and Jamba-1.5-Mini's Mamba 1 (8192
channels, d_state 16).  Prefill: one long sequence and a batch of shorter ones; decode:
one token for each of 1 and 64 sequences.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedserve.kernels import recurrent_reference as ref

DTYPE = torch.bfloat16
TOL = {torch.float32: 1e-3, torch.bfloat16: 3e-2}


def _qsl(lens: list[int], device: str) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)


def gdn_args(lens: list[int], device: str = "cuda", dtype: torch.dtype = DTYPE) -> tuple:
    n, hk, hv, d = sum(lens), 16, 16, 128
    q, k = (torch.randn(n, hk, d, device=device).to(dtype) for _ in range(2))
    v = torch.randn(n, hv, d, device=device).to(dtype)
    g, beta = -F.softplus(torch.randn(n, hv, device=device)), torch.rand(n, hv, device=device)
    return q, k, v, g, beta, torch.randn(len(lens), hv, d, d, device=device) * 0.1


def ssd_args(lens: list[int], device: str = "cuda", dtype: torch.dtype = DTYPE) -> tuple:
    n, heads, p, groups, d_state = sum(lens), 48, 64, 1, 128
    x = torch.randn(n, heads, p, device=device).to(dtype)
    dt = F.softplus(torch.randn(n, heads, device=device) - 2)
    B, C = (torch.randn(n, groups, d_state, device=device).to(dtype) for _ in range(2))
    A, D = -torch.rand(heads, device=device) - 0.1, torch.randn(heads, device=device)
    return x, dt, A, B, C, D, torch.randn(len(lens), heads, p, d_state, device=device) * 0.1


def scan_args(lens: list[int], device: str = "cuda", dtype: torch.dtype = DTYPE) -> tuple:
    n, dim, d_state = sum(lens), 8192, 16
    x = torch.randn(n, dim, device=device).to(dtype)
    dt = F.softplus(torch.randn(n, dim, device=device) - 2)
    B, C = (torch.randn(n, d_state, device=device).to(dtype) for _ in range(2))
    A, D = -torch.rand(dim, d_state, device=device) - 0.1, torch.randn(dim, device=device)
    return x, dt, A, B, C, D, torch.randn(len(lens), dim, d_state, device=device) * 0.1


def conv_args(lens: list[int], dim: int, bias: bool, device: str = "cuda", dtype: torch.dtype = DTYPE) -> tuple:
    x = torch.randn(sum(lens), dim, device=device).to(dtype)
    w = torch.randn(dim, 4, device=device).to(dtype)
    b = torch.randn(dim, device=device).to(dtype) if bias else None
    return x, w, b, torch.randn(len(lens), dim, 3, device=device)


def prefill_cases(lens: list[int], device: str = "cuda", dtype: torch.dtype = DTYPE) -> list[tuple[str, str, tuple]]:
    """(label, op, args) of the prefill ops over sequences of ``lens`` tokens, states last."""
    qsl = _qsl(lens, device)
    has = torch.arange(len(lens), device=device) % 2 == 0  # every other sequence continues a state
    cases = [("Qwen3.5 DeltaNet", "gated_delta_rule", (*gdn_args(lens, device, dtype), qsl))]
    cases.append(("Granite 4 Mamba 2", "mamba2_ssd", (*ssd_args(lens, device, dtype), qsl)))
    cases.append(("Jamba Mamba 1", "mamba1_scan", (*scan_args(lens, device, dtype), qsl)))
    for label, dim, bias in (("Qwen3.5 conv", 6144, False), ("Granite 4 conv", 3328, True)):
        cases.append((label, "causal_conv1d", (*conv_args(lens, dim, bias, device, dtype), qsl, has, "silu")))
    return cases


def decode_cases(seqs: int, device: str = "cuda", dtype: torch.dtype = DTYPE) -> list[tuple[str, str, tuple]]:
    """(label, op, args) of the decode steps for ``seqs`` sequences."""
    ones = [1] * seqs
    return [
        ("Qwen3.5 DeltaNet", "gated_delta_rule_recurrent", gdn_args(ones, device, dtype)),
        ("Granite 4 Mamba 2", "mamba2_ssd_step", ssd_args(ones, device, dtype)),
        ("Jamba Mamba 1", "mamba1_scan_step", scan_args(ones, device, dtype)),
        ("Qwen3.5 conv", "causal_conv1d_update", (*conv_args(ones, 6144, False, device, dtype), "silu")),
    ]


def triton_recurrent_ops() -> dict[str, Callable]:
    from pagedserve.kernels.triton import recurrent, recurrent_prefill

    return {
        "gated_delta_rule_recurrent": recurrent.gated_delta_rule_recurrent_triton,
        "mamba2_ssd_step": recurrent.mamba2_ssd_step_triton,
        "mamba1_scan_step": recurrent.mamba1_scan_step_triton,
        "causal_conv1d_update": recurrent.causal_conv1d_update_triton,
        **recurrent_prefill.PREFILL_KERNELS,
    }


def _state_index(op: str) -> int:
    return 3 if op.startswith("causal_conv1d") else 5 if op.startswith("gated_delta_rule") else 6


def _with_state_copy(op: str, args: tuple) -> tuple:
    i = _state_index(op)
    return (*args[:i], args[i].clone(), *args[i + 1 :])


def check_recurrent(compare: Callable[[str, torch.Tensor, torch.Tensor, float], bool], device: str = "cuda") -> bool:
    """Every Triton recurrent op against the reference (outputs and updated states) at
    the benchmark's shapes, bf16 and float32, in a varlen batch with a one-token sequence."""
    ops = triton_recurrent_ops()
    ok = True
    for dtype in (torch.bfloat16, torch.float32):
        tag = str(dtype).replace("torch.", "")
        cases = prefill_cases([300, 1, 77], device, dtype) + decode_cases(5, device, dtype)
        for label, op, args in cases:
            want_args, got_args = _with_state_copy(op, args), _with_state_copy(op, args)
            want = getattr(ref, op)(*want_args)
            got = ops[op](*got_args)
            i = _state_index(op)
            ok &= compare(f"triton {op} {tag} ({label})", got, want, TOL[dtype])
            ok &= compare(f"triton {op} {tag} state", got_args[i], want_args[i], TOL[dtype])
    return ok


def time_recurrent(time_ms: Callable[[Callable[[], object]], float], quick: bool = False) -> None:
    """Milliseconds per call of each Triton kernel and of the torch reference (same inputs;
    states are updated in place by both, which changes no timing)."""
    ops = triton_recurrent_ops()
    shapes = [("prefill 1 x 4096", prefill_cases([4096]))]
    if not quick:
        shapes.append(("prefill 8 x 512", prefill_cases([512] * 8)))
    shapes += [(f"decode x{n}", decode_cases(n)) for n in ((1, 64) if not quick else (64,))]
    print(f"{'batch':<17} {'op':<27} {'model':<18} | {'triton':>9} | {'reference':>10} | {'speed-up':>8}")
    for shape, cases in shapes:
        for label, op, args in cases:
            t_triton = time_ms(lambda op=op, args=args: ops[op](*args))
            t_ref = time_ms(lambda op=op, args=args: getattr(ref, op)(*args))
            print(
                f"{shape:<17} {op:<27} {label:<18} | {t_triton:>7.3f}ms | {t_ref:>8.3f}ms | {t_ref / t_triton:>7.1f}x",
                flush=True,
            )
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    import argparse

    from gpu_kernels import _compare, _time_ms

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("No GPU: this benchmark needs one (the CPU checks are pytest tests/kernels).", file=sys.stderr)
        return 2
    print("== recurrent ops: correctness against kernels/recurrent_reference.py")
    ok = check_recurrent(_compare)
    print("\n== recurrent ops: time per call")
    time_recurrent(_time_ms, args.quick)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
