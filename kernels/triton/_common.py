"""Launch-time checks shared by the Triton kernels.

Kernels receive raw pointers and strides, so a wrong dtype, device or layout shows up
as silent garbage or an illegal memory access.  The launchers call these helpers first
and raise ``ValueError`` naming the argument and what is wrong with it.
"""

from __future__ import annotations

import os

import torch

__all__ = [
    "FLOAT_DTYPES",
    "KV_DTYPES",
    "interpreter_enabled",
    "next_power_of_2",
    "check_tensor",
    "check_same_device",
]

#: Activation and KV-cache dtypes the Triton kernels accept.
FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
#: KV-cache dtypes of the attention and cache-write kernels: the float ones, and int8
#: rows of head_size values followed by their float32 scale (kernels/reference.py).
KV_DTYPES: tuple[torch.dtype, ...] = (*FLOAT_DTYPES, torch.int8)


def interpreter_enabled() -> bool:
    """True when Triton runs kernels in its numpy interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (and >= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: int,
    dtypes: tuple[torch.dtype, ...],
    last_dim_contiguous: bool = False,
    contiguous: bool = False,
) -> torch.Tensor:
    """Validate one launcher argument; returns it typed as a tensor.

    Raises ValueError when ``t`` is not a tensor, has the wrong rank or dtype, or (when
    asked) is not contiguous in its last dimension / overall.
    """
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{name} has dtype {str(t.dtype).replace('torch.', '')}; expected one of {allowed}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (strides {t.stride()} for shape {tuple(t.shape)})")
    # The kernels vectorise along the last dimension; a strided last dim would also
    # make the padded-head masking read the wrong elements.
    if last_dim_contiguous and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have stride 1 in its last dimension, got strides {t.stride()}")
    return t


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    """All tensors on one device that Triton can run on; returns that device.

    CPU tensors are accepted only under the interpreter, where Triton executes kernels
    with numpy on host memory.
    """
    devices = {name: t.device for name, t in tensors.items()}
    first_name, device = next(iter(devices.items()))
    for name, dev in devices.items():
        if dev != device:
            raise ValueError(f"{name} is on {dev} but {first_name} is on {device}; all tensors must share a device")
    if device.type == "cpu" and not interpreter_enabled():
        raise ValueError(
            "the Triton kernels need GPU tensors; CPU tensors only work under the Triton "
            "interpreter (set TRITON_INTERPRET=1 before importing triton)"
        )
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"the Triton kernels do not run on device type {device.type!r}")
    return device
