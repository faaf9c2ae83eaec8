"""KV cache dtypes: the model's dtype, or an 8-bit type the platform's attention reads.

``kv_cache_dtype`` ("auto", the model dtype's name, or one of :data:`QUANTIZED_KV_DTYPES`)
becomes the torch dtype of every layer's key and value cache.  An fp8 cache holds the
keys and values cast (round to nearest even, saturating at the format's largest finite
value) with a per-layer scale of 1.0, vLLM's default when a checkpoint carries no
``k_scale``/``v_scale``: e4m3 keeps 3 mantissa bits over [-448, 448], e5m2 2 bits over
[-57344, 57344].  Checkpoint scales are not read (docs/memory.md).

An ``int8`` cache keeps a float32 scale per token and KV head beside its values, inside
the block: each row is ``head_dim`` int8 values then the scale's 4 bytes
(:func:`kv_row_size`), the scale computed on write (``absmax / 127``;
kernels/reference.py).  Blocks therefore move as plain bytes with their scales.

A platform lists the names its attention implementations read in
``Platform.kv_cache_dtypes`` (interface 1.5); the engine refuses any other before the
weights load (:func:`check_kv_cache_dtype`).
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "QUANTIZED_KV_DTYPES",
    "KV_DTYPE_ALIASES",
    "KV_SCALE_BYTES",
    "canonical_kv_dtype",
    "check_kv_cache_dtype",
    "kv_cache_dtype",
    "kv_row_size",
]

#: The quantized KV cache dtypes pagedserve implements: canonical name -> the torch
#: dtype's name (this package stays free of torch; the runner resolves it).
QUANTIZED_KV_DTYPES: dict[str, str] = {
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
    "int8": "int8",
}
#: Bytes of the float32 scale each row of an int8 KV cache carries after its values.
KV_SCALE_BYTES = 4
#: Torch dtype names of the KV caches whose rows carry that scale.
SCALED_KV_DTYPES = frozenset({"int8"})
#: Other accepted spellings (vLLM's "fp8" is e4m3).
KV_DTYPE_ALIASES: dict[str, str] = {"fp8": "fp8_e4m3"}


def canonical_kv_dtype(name: str) -> str:
    """``name`` with an alias resolved ("fp8" -> "fp8_e4m3")."""
    return KV_DTYPE_ALIASES.get(name, name)


def check_kv_cache_dtype(name: str, model_dtype: str, platforms: Iterable) -> None:
    """ValueError unless ``name`` is "auto", ``model_dtype`` (a torch dtype's name such as
    "bfloat16"), or a quantized dtype
    every platform in ``platforms`` declares in ``kv_cache_dtypes``; the message names
    the platform and the dtype."""
    canon = canonical_kv_dtype(name)
    if canon in QUANTIZED_KV_DTYPES:
        for platform in platforms:
            declared = tuple(getattr(platform, "kv_cache_dtypes", ()))
            if canon not in declared:
                have = ", ".join(repr(d) for d in declared) or "none"
                raise ValueError(
                    f"kv_cache_dtype={name!r} is not supported on platform {platform.name!r}: its attention "
                    f"implementations read no {canon} KV cache (quantized KV dtypes it declares: {have}); "
                    "use kv_cache_dtype='auto'"
                )
        return
    if name != "auto" and name != model_dtype:
        model = model_dtype
        raise ValueError(
            f"cache_dtype={name!r} differs from the model's dtype {model}: the KV cache is kept in the "
            f"model's dtype or a quantized one (use cache_dtype='auto', {model!r} or one of "
            f"{', '.join(repr(n) for n in QUANTIZED_KV_DTYPES)})"
        )


def kv_cache_dtype(name: str, model_dtype: str) -> str:
    """The torch dtype's name of the KV cache for ``kv_cache_dtype=name`` (checked already)."""
    return QUANTIZED_KV_DTYPES.get(canonical_kv_dtype(name), model_dtype)


def kv_row_size(head_dim: int, torch_dtype_name: str) -> int:
    """The last dimension of a KV cache whose torch dtype is named ``torch_dtype_name``:
    ``head_dim``, or ``head_dim + 4`` for int8 (the row's float32 scale)."""
    return head_dim + KV_SCALE_BYTES if torch_dtype_name in SCALED_KV_DTYPES else head_dim
