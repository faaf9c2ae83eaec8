"""Quantized weights and their methods: GGUF blocks, INT8 (W8A16, W8A8), FP8, GPTQ, AWQ.

See docs/quantization.md.  ``quantize_source`` wraps a checkpoint so that its linear
weights load as :class:`QuantizedWeight` objects, which the model calls through
``weight.apply(x, bias)``.
"""

from pagedserve.quantization.base import QuantizationMethod, QuantizedWeight, is_linear_weight
from pagedserve.quantization.fp8 import Fp8Method, Fp8Weight
from pagedserve.quantization.gguf import GGUFMethod, GGUFWeight, StackedWeight
from pagedserve.quantization.int4 import AWQMethod, AWQWeight, GPTQMethod, GPTQWeight
from pagedserve.quantization.int8 import Int8Method, Int8Weight, W8A8Method, W8A8Weight
from pagedserve.quantization.registry import (
    METHODS,
    QuantizedSource,
    get_method_class,
    quantize_source,
    register_method,
    resolve_quantization,
)

__all__ = [
    "METHODS",
    "QuantizationMethod",
    "QuantizedWeight",
    "QuantizedSource",
    "is_linear_weight",
    "GGUFMethod",
    "GGUFWeight",
    "StackedWeight",
    "Int8Method",
    "Int8Weight",
    "W8A8Method",
    "W8A8Weight",
    "Fp8Method",
    "Fp8Weight",
    "GPTQMethod",
    "GPTQWeight",
    "AWQMethod",
    "AWQWeight",
    "get_method_class",
    "quantize_source",
    "register_method",
    "resolve_quantization",
]
