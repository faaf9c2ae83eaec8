"""Launch-time checks shared by the Triton kernels.

Kernels receive raw pointers and strides, so a wrong dtype, device or layout shows up
as silent garbage or an illegal memory access.  The launchers call these helpers first
and raise ``ValueError`` naming the argument and what is wrong with it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

__all__ = [
    "FLOAT_DTYPES",
    "KV_DTYPES",
    "FP8_DTYPES",
    "KV_FLOAT",
    "KV_INT8",
    "KV_E4M3",
    "KV_E5M2",
    "KvLayout",
    "kv_layout",
    "interpreter_enabled",
    "next_power_of_2",
    "check_tensor",
    "check_same_device",
]

#: Activation and KV-cache dtypes the Triton kernels accept.
FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
#: The 8-bit float KV-cache dtypes, in both layouts (kernels/reference.py).
FP8_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e5m2)
#: KV-cache dtypes of the attention and cache-write kernels: the float ones, int8 rows of
#: head_size values followed by their float32 scale, and fp8 rows with or without that
#: scale (kernels/reference.py).
KV_DTYPES: tuple[torch.dtype, ...] = (*FLOAT_DTYPES, torch.int8, *FP8_DTYPES)

#: How the kernels read and write a cache's values (their KV_FMT constexpr): as the
#: element type itself (float caches, int8), or fp8 bytes decoded and encoded with integer
#: operations, which the interpreter and GPUs without fp8 conversions run alike.
KV_FLOAT = 0
KV_INT8 = 1
KV_E4M3 = 2
KV_E5M2 = 3
_KV_FMT = {torch.int8: KV_INT8, torch.float8_e4m3fn: KV_E4M3, torch.float8_e5m2: KV_E5M2}
#: Bytes of a row's float32 scale after its values (kernels/reference.py KV_SCALE_BYTES).
_SCALE_BYTES = 4


@dataclass(frozen=True)
class KvLayout:
    """How one KV cache is handed to a kernel.

    fmt: KV_FLOAT, KV_INT8, KV_E4M3 or KV_E5M2.
    rows_scaled: each row's head_size values are followed by their float32 scale.
    values: the tensor the kernel reads and writes values through (fp8 caches as uint8).
    scales: the cache as float32, where the kernel reads each row's scale (the values
        tensor when rows carry no scale; the kernel then reads none).
    """

    fmt: int
    rows_scaled: bool
    values: torch.Tensor
    scales: torch.Tensor


def kv_layout(name: str, cache: torch.Tensor, head_size: int) -> KvLayout:
    """The layout of KV ``cache`` ``[num_blocks, block_size, num_kv_heads, row]`` for keys of
    ``head_size``: int8 rows are ``head_size + 4`` wide; fp8 rows ``head_size + 4`` (with
    their scale) or ``head_size`` (unscaled); float rows ``head_size``.  Raises ValueError
    naming ``name`` for any other row width, or a scaled row whose head_size is not a
    multiple of 4 (the scale is read as an aligned float32)."""
    row = cache.shape[-1]
    fmt = _KV_FMT.get(cache.dtype, KV_FLOAT)
    scaled = fmt == KV_INT8 or (fmt != KV_FLOAT and row == head_size + _SCALE_BYTES)
    if fmt == KV_INT8 and (row != head_size + _SCALE_BYTES or head_size % 4):
        raise ValueError(
            f"{name} has rows of {row}, but an int8 cache needs rows of query head_size + 4 = {head_size + 4} "
            "(head_size a multiple of 4)"
        )
    if scaled and head_size % 4:
        raise ValueError(f"{name}: a row-scaled cache needs head_size a multiple of 4, got {head_size}")
    if not scaled and row != head_size:
        if fmt == KV_FLOAT:
            raise ValueError(f"query head_size {head_size} != cache head_size {row} ({name})")
        raise ValueError(
            f"{name} has rows of {row}; query head_size {head_size} needs fp8 rows of {head_size} (unscaled) "
            f"or {head_size + 4} (each row's float32 scale after its values)"
        )
    values = cache.view(torch.uint8) if fmt in (KV_E4M3, KV_E5M2) else cache
    return KvLayout(fmt, scaled, values, cache.view(torch.float32) if scaled else values)


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
