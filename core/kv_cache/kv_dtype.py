"""KV cache dtypes: the model's dtype, or an 8-bit type the platform's attention reads.

``kv_cache_dtype`` ("auto", the model dtype's name, or one of :data:`QUANTIZED_KV_DTYPES`)
becomes the torch dtype of every layer's key and value cache.

Rows of a quantized cache carry their own scale (**row scales**, the default) or share
a per-layer one (**tensor scales**, fp8 only), by ``kv_cache_scales``
(:func:`resolve_kv_scales`):

* ``row``: a float32 scale per token and KV head, computed on write, sits after the
  row's values inside the block: each row is ``head_dim`` 8-bit values then the scale's
  4 bytes (:func:`kv_row_size`), ``absmax / 127`` for int8, ``absmax / 448`` (e4m3) or
  ``absmax / 57344`` (e5m2) for fp8 (kernels/reference.py, ``quantize_kv_rows``).
  Blocks therefore move as plain bytes with their scales, and no value saturates.
* ``tensor`` (fp8): rows of ``head_dim`` values cast with one scale per layer and for
  keys and values each, vLLM's fp8 KV cache: the checkpoint's ``k_scale``/``v_scale``
  (or a ``quantization_param_path`` JSON file), else 1.0 (values beyond the format's
  range saturate).  Twice the blocks of a bf16 cache instead of ``2 d / (d + 4)`` times.
* ``auto``: ``tensor`` when per-layer scales are given (checkpoint or file), else ``row``.

A platform lists the names its attention implementations read in
``Platform.kv_cache_dtypes`` (interface 1.5; an fp8 name means both layouts); the engine
refuses any other before the weights load (:func:`check_kv_cache_dtype`).
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
    "KV_SCALE_MODES",
    "resolve_kv_scales",
]

#: The quantized KV cache dtypes pagedserve implements: canonical name -> the torch
#: dtype's name (this package stays free of torch; the runner resolves it).
QUANTIZED_KV_DTYPES: dict[str, str] = {
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
    "int8": "int8",
}
#: Bytes of the float32 scale each row of a row-scaled KV cache carries after its values.
KV_SCALE_BYTES = 4
#: Torch dtype names of the KV caches whose rows always carry that scale.
SCALED_KV_DTYPES = frozenset({"int8"})
#: Torch dtype names of the 8-bit float caches (row scales or a per-layer scale).
FP8_KV_DTYPES = frozenset({"float8_e4m3fn", "float8_e5m2"})
#: ``kv_cache_scales`` values.
KV_SCALE_MODES = ("auto", "row", "tensor")
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


def kv_row_size(head_dim: int, torch_dtype_name: str, row_scaled: bool | None = None) -> int:
    """The last dimension of a KV cache whose torch dtype is named ``torch_dtype_name``:
    ``head_dim + 4`` for a row-scaled cache (the row's float32 scale), else ``head_dim``.
    ``row_scaled``: whether an fp8 cache has row scales (None: yes, the default); int8
    always has, other dtypes never."""
    if torch_dtype_name in SCALED_KV_DTYPES or (torch_dtype_name in FP8_KV_DTYPES and row_scaled is not False):
        return head_dim + KV_SCALE_BYTES
    return head_dim


def resolve_kv_scales(
    mode: str, torch_dtype_name: str, layer_scales: dict[int, tuple[float, float]] | None
) -> tuple[bool, dict[int, tuple[float, float]] | None]:
    """(whether the cache's rows carry their scales, the per-layer (k_scale, v_scale) to
    apply around attention or None) for ``kv_cache_scales=mode``, the cache's torch dtype
    name and the per-layer scales given (checkpoint or file; None: none given)."""
    if torch_dtype_name in SCALED_KV_DTYPES:
        return True, None
    if torch_dtype_name not in FP8_KV_DTYPES:
        return False, None
    if mode == "row" or (mode == "auto" and not layer_scales):
        return True, None
    return False, layer_scales or None
