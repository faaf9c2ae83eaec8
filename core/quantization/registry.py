"""The method registry and the choice of method for a checkpoint.

``quantization`` (``LLM(quantization=...)``, ``--quantization``):

- None / "auto": from the checkpoint: ``quantization_config.quant_method`` of a Hugging
  Face folder; a .gguf is dequantized (its greedy output then equals transformers' on the
  same file); pass "gguf" to keep Q4_0/Q4_1/Q8_0 blocks (int8 activations in the dot
  products change some greedy choices; speed gains so far are within measurement noise).
- "none": no quantization (a .gguf is dequantized to the model dtype, as before).
- a method name: that method ("int8", "w8a8", "fp8" quantize a float checkpoint at load).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from pagedserve.quantization.base import QuantizationMethod, QuantizedWeight
from pagedserve.quantization.fp8 import Fp8Method
from pagedserve.quantization.gguf import GGUF_KEPT_TYPES, GGUFMethod
from pagedserve.quantization.int4 import AWQMethod, GPTQMethod
from pagedserve.quantization.int8 import Int8Method, W8A8Method

__all__ = ["METHODS", "GGUF_DEFAULT_PLATFORMS", "register_method", "get_method_class", "resolve_quantization",
           "QuantizedSource", "quantize_source"]

METHODS: dict[str, type[QuantizationMethod]] = {}

#: Platforms where a quantized .gguf stays in blocks when quantization is left unset: none
#: until a quiet-machine measurement shows a clear decode win (docs/quantization.md).
GGUF_DEFAULT_PLATFORMS: tuple[str, ...] = ()

#: quant_method values of Hugging Face configs that need a kernel we lack: refused by name.
_HF_ALIASES = {"awq": "awq", "gptq": "gptq", "fp8": "fp8"}


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
        raise ValueError(f"unknown quantization method {name!r}; known: none, auto, "
                         f"{', '.join(sorted(METHODS))}") from None


def _from_checkpoint(source, platform_name: str) -> tuple[str | None, dict[str, Any]]:
    if source.format == "gguf":
        kept = set(source._gguf.tensor_types().values()) & set(GGUF_KEPT_TYPES)
        return ("gguf" if kept and platform_name in GGUF_DEFAULT_PLATFORMS else None), {}
    qcfg = source.hf_config.get("quantization_config")
    if not qcfg:
        return None, {}
    method = str(qcfg.get("quant_method", "")).lower()
    if method not in _HF_ALIASES:
        raise ValueError(f"checkpoint {source.path} is quantized with quant_method={method!r}, which is not "
                         f"supported; supported: {', '.join(sorted(_HF_ALIASES))}")
    if method == "fp8":
        raise ValueError("pre-quantized fp8 checkpoints are not supported yet; load the float checkpoint "
                         "with quantization='fp8' to quantize at load")
    return _HF_ALIASES[method], dict(qcfg)


def resolve_quantization(requested: str | None, source, platform_name: str, dtype: torch.dtype,
                         world_size: int = 1, cpu_offload_gb: float = 0.0) -> QuantizationMethod | None:
    """The method to load ``source`` with on platform ``platform_name``, or None.

    Raises ValueError for an unknown method, one the platform cannot run (naming the
    platforms that can), or one that does not fit the checkpoint.
    """
    name = (requested or "auto").lower()
    qcfg: dict[str, Any] = {}
    auto_name, auto_cfg = _from_checkpoint(source, platform_name)
    if name == "none":
        if source.format == "hf" and source.hf_config.get("quantization_config"):
            raise ValueError("quantization='none' cannot load a pre-quantized checkpoint "
                             f"({source.hf_config['quantization_config'].get('quant_method')})")
        return None
    if name == "auto":
        if auto_name is None or (auto_name == "gguf" and (world_size > 1 or cpu_offload_gb)):
            return None  # a .gguf then loads dequantized, as it always could
        name, qcfg = auto_name, auto_cfg
    else:
        cls = get_method_class(name)
        if auto_name in ("awq", "gptq") and auto_name != name:
            raise ValueError(f"checkpoint is {auto_name}-quantized; quantization={name!r} cannot load it")
        # int8/w8a8/fp8 on a .gguf re-quantize its dequantized weights (measured in the benchmark).
        qcfg = auto_cfg if auto_name == name else {}
    cls = get_method_class(name)
    if platform_name not in cls.platforms:
        raise ValueError(f"quantization={name!r} is not supported on platform {platform_name!r}; "
                         f"platforms that can run it: {', '.join(cls.platforms)}")
    if world_size > 1:
        raise ValueError(f"quantization={name!r} does not support tensor/pipeline parallelism yet "
                         f"(world size {world_size}); use quantization='none' or one rank")
    if cpu_offload_gb:
        raise ValueError(f"quantization={name!r} cannot be combined with cpu_offload_gb yet")
    return cls(platform_name, dtype, qcfg)


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


def quantize_source(source, requested: str | None, platform_name: str, dtype: torch.dtype,
                    world_size: int = 1, cpu_offload_gb: float = 0.0):
    """``source`` itself, or wrapped so that its weights load quantized (see the module doc)."""
    method = resolve_quantization(requested, source, platform_name, dtype, world_size, cpu_offload_gb)
    return source if method is None else QuantizedSource(source, method)
