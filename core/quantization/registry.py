"""The method registry and the choice of method for a checkpoint.

``quantization`` (``LLM(quantization=...)``, ``--quantization``):

- None / "auto": from the checkpoint: ``quantization_config.quant_method`` of a Hugging
  Face folder; a .gguf keeps its blocks where the platform's ``gguf_linear`` prefers
  them (with tensor/pipeline parallelism too: ``SHARDED_METHODS`` are sharded in their
  quantized form), else it is dequantized (its greedy output then equals transformers'
  on the same file); pass "gguf" to keep Q4_0/Q4_1/Q8_0 blocks (int8 activations in the dot
  products change some greedy choices; speed gains so far are within measurement noise).
- "none": no quantization (a .gguf is dequantized to the model dtype, as before).
- a method name: that method ("int8", "w8a8", "fp8" quantize a float checkpoint at load).

A method runs on a platform when the platform's op registry has the ops it needs
(``QuantizationMethod.required_ops``; pagedserve's own default to their references, so
they run everywhere) and, for a method limited to named platforms
(``QuantizationMethod.platforms``), when the platform is one of them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from pagedserve.platforms.ops import PREFERS_QUANTIZED
from pagedserve.quantization.base import QuantizationMethod, QuantizedWeight
from pagedserve.quantization.fp8 import Fp8Method
from pagedserve.quantization.gguf import GGUFMethod, gguf_kept_types
from pagedserve.quantization.int4 import AWQMethod, GPTQMethod
from pagedserve.quantization.int8 import Int8Method, W8A8Method

if TYPE_CHECKING:
    from pagedserve.platforms import OpRegistry, Platform

__all__ = [
    "METHODS",
    "SHARDED_METHODS",
    "gguf_kept_by_default",
    "register_method",
    "get_method_class",
    "unsupported_reason",
    "resolve_quantization",
    "QuantizedSource",
    "quantize_source",
]

METHODS: dict[str, type[QuantizationMethod]] = {}

#: quant_method values of Hugging Face configs that need a kernel we lack: refused by name.
_HF_ALIASES = {"awq": "awq", "gptq": "gptq", "fp8": "fp8"}

#: Methods whose weights tensor/pipeline parallelism shards in their quantized form
#: (``QuantizedWeight.select_rows`` / ``select_columns``; DecoderForCausalLM._shard).
SHARDED_METHODS: tuple[str, ...] = ("gguf", "int8", "w8a8", "fp8", "gptq", "awq")


def register_method(cls: type[QuantizationMethod]) -> type[QuantizationMethod]:
    """Add a method (usable as a decorator by plugins)."""
    METHODS[cls.name] = cls
    return cls


for _cls in (GGUFMethod, Int8Method, W8A8Method, Fp8Method, GPTQMethod, AWQMethod):
    register_method(_cls)


def get_method_class(name: str) -> type[QuantizationMethod]:
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(
            f"unknown quantization method {name!r}; known: none, auto, {', '.join(sorted(METHODS))}"
        ) from None


def unsupported_reason(cls: type[QuantizationMethod], platform: Platform, ops: Any) -> str | None:
    """Why method ``cls`` cannot run on ``platform`` with op registry ``ops`` (the end of
    a sentence), or None when it can."""
    if cls.platforms is not None and platform.name not in cls.platforms:
        return f"platforms that can run it: {', '.join(cls.platforms)}"
    missing = [op for op in cls.required_ops if not hasattr(ops, op)]
    if missing:
        return (
            f"it needs the op(s) {', '.join(missing)}, which no plugin registers for this platform "
            "(a platform or kernels plugin provides an op through pagedserve_register_ops)"
        )
    return None


def gguf_kept_by_default(ops: OpRegistry) -> bool:
    """Whether a quantized .gguf stays in blocks when quantization is left unset: where
    the platform's ``gguf_linear`` declares PREFERS_QUANTIZED (the native CPU kernel,
    which decodes the default model 1.3-1.8x faster than bf16 at batch 1-4;
    docs/quantization.md, "Default on CPU")."""
    return ops.has_capability("gguf_linear", PREFERS_QUANTIZED)


def _from_checkpoint(source, ops: Any) -> tuple[str | None, dict[str, Any]]:
    if source.format == "gguf":
        kept = set(source._gguf.tensor_types().values()) & set(gguf_kept_types(ops))
        return ("gguf" if kept and gguf_kept_by_default(ops) else None), {}
    qcfg = source.hf_config.get("quantization_config")
    if not qcfg:
        return None, {}
    method = str(qcfg.get("quant_method", "")).lower()
    if method == "mxfp4" and (source.hf_config.get("architectures") or [None])[0] == "GptOssForCausalLM":
        return None, {}  # GPT-OSS dequantizes its MXFP4 experts at load (pagedserve.models.mxfp4)
    if method not in _HF_ALIASES:
        raise ValueError(
            f"checkpoint {source.path} is quantized with quant_method={method!r}, which is not "
            f"supported; supported: {', '.join(sorted(_HF_ALIASES))}"
        )
    if method == "fp8":
        raise ValueError(
            "pre-quantized fp8 checkpoints are not supported yet; load the float checkpoint "
            "with quantization='fp8' to quantize at load"
        )
    return _HF_ALIASES[method], dict(qcfg)


def resolve_quantization(
    requested: str | None,
    source,
    platform: Platform,
    ops: OpRegistry,
    dtype: torch.dtype,
    world_size: int = 1,
    cpu_offload_gb: float = 0.0,
    device_map: str | None = None,
) -> QuantizationMethod | None:
    """The method to load ``source`` with on ``platform``, whose resolved ops are ``ops``, or None.

    Raises ValueError for an unknown method, one the platform cannot run (naming the
    platforms that can, or the ops it lacks), or one that does not fit the checkpoint.
    """
    name = (requested or "auto").lower()
    qcfg: dict[str, Any] = {}
    auto_name, auto_cfg = _from_checkpoint(source, ops)
    if name == "none":
        if source.format == "hf" and source.hf_config.get("quantization_config"):
            raise ValueError(
                "quantization='none' cannot load a pre-quantized checkpoint "
                f"({source.hf_config['quantization_config'].get('quant_method')})"
            )
        return None
    if name == "auto":
        if auto_name is None or (auto_name == "gguf" and device_map):
            return None  # a .gguf then loads dequantized, as it always could
        name, qcfg = auto_name, auto_cfg
    else:
        cls = get_method_class(name)
        if auto_name in ("awq", "gptq") and auto_name != name:
            raise ValueError(f"checkpoint is {auto_name}-quantized; quantization={name!r} cannot load it")
        # int8/w8a8/fp8 on a .gguf re-quantize its dequantized weights (measured in the benchmark).
        qcfg = auto_cfg if auto_name == name else {}
    cls = get_method_class(name)
    reason = unsupported_reason(cls, platform, ops)
    if reason is not None:
        raise ValueError(f"quantization={name!r} is not supported on platform {platform.name!r}; {reason}")
    if world_size > 1 and name not in SHARDED_METHODS:
        raise ValueError(
            f"quantization={name!r} does not support tensor/pipeline parallelism yet "
            f"(world size {world_size}); use quantization='none' or one rank, or one of "
            f"{', '.join(SHARDED_METHODS)}, which are sharded in their quantized form"
        )
    return cls(ops, dtype, qcfg)


class QuantizedSource:
    """A :class:`~pagedserve.loader.ModelSource` whose ``weights()`` go through a method.

    Everything else (config, tokenizer, ...) is the wrapped source's.
    """

    def __init__(self, source, method: QuantizationMethod) -> None:
        self._source = source
        self.method = method

    def __getattr__(self, name: str) -> Any:
        return getattr(self._source, name)

    def plain_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._source.weights()

    def weights(self) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        return self.method.weights(self)

    def __repr__(self) -> str:
        return f"QuantizedSource({self._source!r}, method={self.method.name!r})"


def quantize_source(
    source,
    requested: str | None,
    platform: Platform,
    ops: OpRegistry,
    dtype: torch.dtype,
    world_size: int = 1,
    cpu_offload_gb: float = 0.0,
    device_map: str | None = None,
):
    """``source`` itself, or wrapped so that its weights load quantized with ``ops``
    (see the module doc)."""
    method = resolve_quantization(requested, source, platform, ops, dtype, world_size, cpu_offload_gb, device_map)
    return source if method is None else QuantizedSource(source, method)
