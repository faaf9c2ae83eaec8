"""The native CPU kernels of the recurrent-layer ops (kernels/cpu/recurrent.cpp):
``causal_conv1d`` and its decode step, Gated DeltaNet (``gated_delta_rule`` and its
decode step), Mamba 2's ``mamba2_ssd`` and Mamba 1's ``mamba1_scan`` (each with its
decode step) and ``rms_norm_gated``.  Built just in time by
:func:`pagedserve.kernels.build.load_extension` into the shared kernel cache, as a
separate extension so that it never invalidates the main CPU kernels' build (the
arrangement of :mod:`pagedserve.kernels.cpu.moe_native`).

Each function here has its reference's signature and semantics
(:mod:`pagedserve.kernels.recurrent_reference`, states float32 and updated in place).
Inputs the kernels do not take go to the reference: a non-CPU tensor, a dtype other than
float32/bf16/fp16 or inputs of mixed dtypes, a state that is not contiguous float32,
shapes that do not fit (the reference then says what is wrong).  The scans run the
recursion token by token, so ``chunk_size`` changes nothing but the reference's
rounding.

The CPU platform registers these only where its options allow native kernels
(``CpuOptions.native_kernels``) and a compiler exists; nothing here reads the
environment but the build (CXX, the arch flags).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from types import ModuleType

import torch

from pagedserve.kernels import build
from pagedserve.kernels import recurrent_reference as ref

__all__ = [
    "SOURCE",
    "SOURCES",
    "HEADERS",
    "OPS",
    "recurrent_build_spec",
    "load_recurrent_kernels",
    "causal_conv1d",
    "causal_conv1d_update",
    "gated_delta_rule",
    "gated_delta_rule_recurrent",
    "mamba2_ssd",
    "mamba2_ssd_step",
    "mamba1_scan",
    "mamba1_scan_step",
    "rms_norm_gated",
]

SOURCES: tuple[str, ...] = ("recurrent.cpp",)
HEADERS: tuple[str, ...] = ("vec.h",)
#: How ``pagedserve platforms --ops`` names this implementation.
SOURCE = "cpu-native-recurrent"

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ACTIVATIONS = {"silu": True, "swish": True, None: False}


def recurrent_build_spec() -> build.ExtensionSpec:
    """The build of the recurrent-layer CPU kernels for this machine (the main kernels'
    arch flags: AVX-512, AVX2 or the portable vectors of vec.h)."""
    arch, origin = build.cpu_arch_flags()
    return build.cpu_extension_spec("recurrent", SOURCES, arch, origin, headers=HEADERS)


@functools.lru_cache(maxsize=1)
def load_recurrent_kernels() -> ModuleType | None:
    """The compiled module, or None with a warning saying why."""
    try:
        spec = recurrent_build_spec()
        bad = build.unsupported_arch_flags(list(spec.arch_flags), build.read_cpu_features())
        if bad:
            raise build.KernelBuildError(
                f"this CPU lacks the instructions of {' '.join(bad)} (from {spec.arch_origin})"
            )
        return build.load_extension(spec, "recurrent-layer CPU kernels")[0]
    except build.KernelBuildError as exc:
        warnings.warn(f"recurrent-layer CPU kernels unavailable ({exc}); using the torch reference", stacklevel=2)
        return None


def _cpu(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or t.device.type == "cpu" for t in tensors)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a contiguous last dimension (the kernels read rows through strides)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32).contiguous()


def _state_ok(state: torch.Tensor, shape: tuple[int, ...]) -> bool:
    return state.dtype == torch.float32 and state.is_contiguous() and tuple(state.shape) == shape


def _big_ok(*tensors: torch.Tensor) -> bool:
    """Activation tensors of one supported dtype."""
    return tensors[0].dtype in _DTYPES and all(t.dtype == tensors[0].dtype for t in tensors)


def _module() -> ModuleType | None:
    return load_recurrent_kernels()  # built on first use, not when the platform is chosen


def _one_per_seq(n: int) -> torch.Tensor:
    return torch.arange(n + 1, dtype=torch.int32)


def _qsl(query_start_loc: torch.Tensor) -> torch.Tensor:
    return query_start_loc.to(torch.int32).contiguous()


def _conv_ok(x, weight, bias, conv_state, activation, seqs: int) -> bool:
    """The convolutions' inputs the kernels take, besides the devices and query_start_loc."""
    return (
        activation in _ACTIVATIONS
        and x.dim() == 2
        and weight.dim() == 2
        and weight.shape[0] == x.shape[1]
        and weight.shape[1] >= 1
        and (bias is None or tuple(bias.shape) == (x.shape[1],))
        and _big_ok(x)
        and _state_ok(conv_state, (seqs, x.shape[1], weight.shape[1] - 1))
    )


def causal_conv1d(x, weight, bias, conv_state, query_start_loc, has_state, activation="silu"):
    """``recurrent_reference.causal_conv1d`` through the native kernel."""
    args = (x, weight, bias, conv_state, query_start_loc, has_state, activation)
    ok = (
        _cpu(x, weight, bias, conv_state, query_start_loc, has_state)
        and query_start_loc.dim() == 1
        and has_state.numel() == query_start_loc.numel() - 1
        and _conv_ok(x, weight, bias, conv_state, activation, query_start_loc.numel() - 1)
    )
    module = _module() if ok else None
    if module is None:
        return ref.causal_conv1d(*args)
    b = torch.empty(0) if bias is None else _f32(bias)
    has = has_state.to(torch.bool).contiguous()
    return module.causal_conv1d(
        _rows(x), _f32(weight), b, conv_state, _qsl(query_start_loc), has, _ACTIVATIONS[activation]
    )


def causal_conv1d_update(x, weight, bias, conv_state, activation="silu"):
    """``recurrent_reference.causal_conv1d_update`` through the native kernel."""
    args = (x, weight, bias, conv_state, activation)
    ok = _cpu(x, weight, bias, conv_state) and x.dim() == 2
    ok = ok and _conv_ok(x, weight, bias, conv_state, activation, x.shape[0])
    module = _module() if ok else None
    if module is None:
        return ref.causal_conv1d_update(*args)
    b = torch.empty(0) if bias is None else _f32(bias)
    return module.causal_conv1d_update(_rows(x), _f32(weight), b, conv_state, _ACTIVATIONS[activation])


def _gdn_ok(q, k, v, g, beta, state, seqs: int) -> bool:
    return (
        _cpu(q, k, v, g, beta, state)
        and q.dim() == 3
        and v.dim() == 3
        and tuple(k.shape) == tuple(q.shape)
        and q.shape[0] == v.shape[0]
        and q.shape[1] > 0
        and v.shape[1] % q.shape[1] == 0
        and tuple(g.shape) == tuple(v.shape[:2])
        and tuple(beta.shape) == tuple(v.shape[:2])
        and _big_ok(q, k, v)
        and _state_ok(state, (seqs, v.shape[1], q.shape[2], v.shape[2]))
    )


def gated_delta_rule(q, k, v, g, beta, state, query_start_loc, use_qk_l2norm=True, chunk_size=64):
    """``recurrent_reference.gated_delta_rule`` through the native kernel (token by token:
    ``chunk_size`` only shapes the reference's arithmetic)."""
    args = (q, k, v, g, beta, state, query_start_loc, use_qk_l2norm, chunk_size)
    ok = query_start_loc.dim() == 1 and _gdn_ok(q, k, v, g, beta, state, query_start_loc.numel() - 1)
    module = _module() if ok and _cpu(query_start_loc) else None
    if module is None:
        return ref.gated_delta_rule(*args)
    return module.gated_delta_rule(
        _rows(q), _rows(k), _rows(v), _f32(g), _f32(beta), state, _qsl(query_start_loc), bool(use_qk_l2norm)
    )


def gated_delta_rule_recurrent(q, k, v, g, beta, state, use_qk_l2norm=True):
    """``recurrent_reference.gated_delta_rule_recurrent`` through the native kernel."""
    args = (q, k, v, g, beta, state, use_qk_l2norm)
    module = _module() if q.dim() == 3 and _gdn_ok(q, k, v, g, beta, state, q.shape[0]) else None
    if module is None:
        return ref.gated_delta_rule_recurrent(*args)
    qsl = _one_per_seq(q.shape[0])
    return module.gated_delta_rule(_rows(q), _rows(k), _rows(v), _f32(g), _f32(beta), state, qsl, bool(use_qk_l2norm))


def _ssm(kernel, x, dt, A, B, C, D, state, qsl: torch.Tensor) -> torch.Tensor:
    """A Mamba scan kernel on its layouts: x, B, C by rows; dt, A, D contiguous float32."""
    return kernel(_rows(x), _f32(dt), _f32(A), _rows(B), _rows(C), _f32(D), state, qsl)


def _ssd_ok(x, dt, A, B, C, D, state, seqs: int) -> bool:
    return (
        _cpu(x, dt, A, B, C, D, state)
        and x.dim() == 3
        and B.dim() == 3
        and tuple(C.shape) == tuple(B.shape)
        and B.shape[0] == x.shape[0]
        and B.shape[1] > 0
        and x.shape[1] % B.shape[1] == 0
        and tuple(dt.shape) == tuple(x.shape[:2])
        and tuple(A.shape) == (x.shape[1],)
        and tuple(D.shape) == (x.shape[1],)
        and _big_ok(x, B, C)
        and _state_ok(state, (seqs, x.shape[1], x.shape[2], B.shape[2]))
    )


def mamba2_ssd(x, dt, A, B, C, D, state, query_start_loc, chunk_size=256):
    """``recurrent_reference.mamba2_ssd`` through the native kernel (token by token)."""
    args = (x, dt, A, B, C, D, state, query_start_loc, chunk_size)
    ok = query_start_loc.dim() == 1 and _cpu(query_start_loc)
    ok = ok and _ssd_ok(x, dt, A, B, C, D, state, query_start_loc.numel() - 1)
    module = _module() if ok else None
    if module is None:
        return ref.mamba2_ssd(*args)
    return _ssm(module.mamba2_ssd, x, dt, A, B, C, D, state, _qsl(query_start_loc))


def mamba2_ssd_step(x, dt, A, B, C, D, state):
    """``recurrent_reference.mamba2_ssd_step`` through the native kernel."""
    args = (x, dt, A, B, C, D, state)
    module = _module() if x.dim() == 3 and _ssd_ok(x, dt, A, B, C, D, state, x.shape[0]) else None
    if module is None:
        return ref.mamba2_ssd_step(*args)
    return _ssm(module.mamba2_ssd, x, dt, A, B, C, D, state, _one_per_seq(x.shape[0]))


def _scan_ok(x, dt, A, B, C, D, state, seqs: int) -> bool:
    return (
        _cpu(x, dt, A, B, C, D, state)
        and x.dim() == 2
        and A.dim() == 2
        and tuple(dt.shape) == tuple(x.shape)
        and A.shape[0] == x.shape[1]
        and tuple(B.shape) == (x.shape[0], A.shape[1])
        and tuple(C.shape) == tuple(B.shape)
        and tuple(D.shape) == (x.shape[1],)
        and _big_ok(x, B, C)
        and _state_ok(state, (seqs, x.shape[1], A.shape[1]))
    )


def mamba1_scan(x, dt, A, B, C, D, state, query_start_loc, chunk_size=16):
    """``recurrent_reference.mamba1_scan`` through the native kernel (token by token)."""
    args = (x, dt, A, B, C, D, state, query_start_loc, chunk_size)
    ok = query_start_loc.dim() == 1 and _cpu(query_start_loc)
    ok = ok and _scan_ok(x, dt, A, B, C, D, state, query_start_loc.numel() - 1)
    module = _module() if ok else None
    if module is None:
        return ref.mamba1_scan(*args)
    return _ssm(module.mamba1_scan, x, dt, A, B, C, D, state, _qsl(query_start_loc))


def mamba1_scan_step(x, dt, A, B, C, D, state):
    """``recurrent_reference.mamba1_scan_step`` through the native kernel."""
    args = (x, dt, A, B, C, D, state)
    module = _module() if _scan_ok(x, dt, A, B, C, D, state, x.shape[0]) else None
    if module is None:
        return ref.mamba1_scan_step(*args)
    return _ssm(module.mamba1_scan, x, dt, A, B, C, D, state, _one_per_seq(x.shape[0]))


def rms_norm_gated(x, gate, weight, eps, norm_before_gate=True, group_size=None):
    """``recurrent_reference.rms_norm_gated`` through the native kernel."""
    args = (x, gate, weight, eps, norm_before_gate, group_size)
    size = x.shape[-1] if group_size is None else group_size
    ok = (
        _cpu(x, gate, weight)
        and x.dim() == 2
        and tuple(gate.shape) == tuple(x.shape)
        and tuple(weight.shape) == (x.shape[1],)
        and isinstance(size, int)
        and size > 0
        and x.shape[1] % size == 0
        and _big_ok(x, gate)
    )
    module = _module() if ok else None
    if module is None:
        return ref.rms_norm_gated(*args)
    return module.rms_norm_gated(_rows(x), _rows(gate), _f32(weight), float(eps), bool(norm_before_gate), int(size))


#: op name -> native implementation, as the CPU platform registers them.
OPS: dict[str, Callable[..., torch.Tensor]] = {
    "causal_conv1d": causal_conv1d,
    "causal_conv1d_update": causal_conv1d_update,
    "gated_delta_rule": gated_delta_rule,
    "gated_delta_rule_recurrent": gated_delta_rule_recurrent,
    "mamba2_ssd": mamba2_ssd,
    "mamba2_ssd_step": mamba2_ssd_step,
    "mamba1_scan": mamba1_scan,
    "mamba1_scan_step": mamba1_scan_step,
    "rms_norm_gated": rms_norm_gated,
}
