"""fp8 (e4m3fn and e5m2) bytes to and from float32 inside Triton kernels, in integer ops.

The KV-cache kernels read and write fp8 caches through a uint8 view: Triton's
interpreter has no exact fp8 conversion (its casts round half away from zero and do not
saturate), and GPUs before sm_89 have no fp8 instructions, so the conversions are
written out here once, bit for bit as torch's (c10 ``fp8e4m3fn_from_fp32_value`` /
``fp8e5m2_from_fp32_value``): round to nearest even, NaN to ``0x7F`` with the sign.
Callers clamp to the format's largest finite value first (reference.quantize_kv and
quantize_kv_rows do), so nothing encodes to inf.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["fp8_to_float32", "float32_to_fp8", "E4M3_MAX", "E5M2_MAX"]

#: The formats' largest finite values (torch.finfo(...).max).
E4M3_MAX = 448.0
E5M2_MAX = 57344.0


@triton.jit
def fp8_to_float32(b, E5M2: tl.constexpr):
    """fp8 bytes (uint8, any shape) -> their exact float32 values (NaN, and e5m2's infs, kept).

    Both formats are widened through float16, which holds every fp8 value exactly: an
    e5m2 byte is the upper byte of a float16; an e4m3 byte's exponent and mantissa,
    shifted into a float16, give the value times 2^-8 (subnormals included), and e4m3fn
    has no inf, only the NaN 0x7F / 0xFF.
    """
    bits = b.to(tl.int32)
    if E5M2:
        half = bits << 8
    else:
        half = ((bits & 0x80) << 8) | ((bits & 0x7F) << 7)
    x = half.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    if not E5M2:
        x = tl.where((bits & 0x7F) == 0x7F, float("nan"), x * 256.0)
    return x


@triton.jit
def float32_to_fp8(y, E5M2: tl.constexpr):
    """float32 ``y`` (any shape) -> fp8 bytes as int32 in [0, 255]: round to nearest even,
    saturated at the largest finite value (no inf), NaN -> 0x7F with y's sign."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    is_nan = y != y
    y = tl.where(is_nan, 0.0, y)  # its byte is set below; no NaN reaches the integer casts
    if E5M2:
        a = tl.minimum(tl.abs(y), 57344.0)
        u = a.to(tl.int32, bitcast=True)
        # Normal: rebias the exponent (127 -> 15, i.e. minus 112 << 23) and round the
        # 23-bit mantissa to 2 bits, half to even.
        normal = (u - 939524096 + 0xFFFFF + ((u >> 21) & 1)) >> 21
        # Below 2^-14 (113 << 23): multiples of 2^-16; the float add rounds half to even
        # (the minimum keeps larger values, which take the normal path, out of int32 overflow).
        sub = ((tl.minimum(a, 6.103515625e-05) * 65536.0 + 12582912.0) - 12582912.0).to(tl.int32)
        mag = tl.where(u < 947912704, sub, normal)
    else:
        a = tl.minimum(tl.abs(y), 448.0)
        u = a.to(tl.int32, bitcast=True)
        # Normal: exponent 127 -> 7 (minus 120 << 23), mantissa to 3 bits, half to even.
        normal = (u - 1006632960 + 0x7FFFF + ((u >> 20) & 1)) >> 20
        # Below 2^-6 (121 << 23): multiples of 2^-9 (8 * 2^-9 is the byte of 2^-6).
        sub = ((tl.minimum(a, 0.015625) * 512.0 + 12582912.0) - 12582912.0).to(tl.int32)
        mag = tl.where(u < 1015021568, sub, normal)
    mag = tl.where(is_nan, 0x7F, mag)
    return mag | sign
