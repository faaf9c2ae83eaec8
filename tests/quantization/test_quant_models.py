"""End to end: quantized checkpoints and load-time quantization through ``LLM``.

Bounds: GPTQ/AWQ checkpoints must compute what their dequantized weights compute (log
probabilities within 1e-3 in float32, identical greedy tokens); every method's perplexity
on the text set stays within the stated factor of the float model's, and its greedy tokens
agree with the float model's for the stated fraction (tiny random models have flat
distributions, so the agreement bound for 4-bit is loose on purpose).
"""

from __future__ import annotations

import pytest
from test_quant_support import TEXTS, agreement, greedy, perplexity, sequence_logprobs, write_quantized_pair

from pagedserve import LLM
from pagedserve.quantization import AWQWeight, Fp8Weight, GPTQWeight, Int8Weight, W8A8Weight

PROMPTS = ["Hello there", "The quick brown", [5, 9, 33, 70, 12]]
# (method, perplexity ratio bound vs float, greedy agreement lower bound)
LOAD_TIME = [("int8", 1.02, 0.5), ("w8a8", 1.05, 0.4), ("fp8", 1.10, 0.3)]


def make_llm(model, **kw) -> LLM:
    return LLM(model=str(model), dtype="float32", kv_cache_memory="4MiB", max_model_len=256, **kw)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint_factory):
    # hidden 128 / intermediate 256: multiples of the 32-row groups and 8-column packs.
    return tiny_checkpoint_factory(hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2)


@pytest.fixture(scope="module")
def float_ref(tiny):
    llm = make_llm(tiny)
    out = {"greedy": greedy(llm, PROMPTS), "ppl": perplexity(llm), "bytes": llm.llm_engine.runner.model.weight_bytes()}
    llm.shutdown()
    return out


@pytest.mark.compat("quant_int8", "single")
@pytest.mark.compat("quant_fp8", "single")
@pytest.mark.parametrize("method,ppl_bound,agree_bound", LOAD_TIME)
def test_quant_load_time_methods(tiny, float_ref, method, ppl_bound, agree_bound):
    llm = make_llm(tiny, quantization=method)
    layer = llm.llm_engine.runner.model.layers[0]
    kind = {"int8": Int8Weight, "w8a8": W8A8Weight, "fp8": Fp8Weight}[method]
    assert type(layer.qkv) is kind and type(layer.down) is kind
    assert llm.llm_engine.runner.model.weight_bytes() < float_ref["bytes"]
    ppl = perplexity(llm)
    assert ppl < float_ref["ppl"] * ppl_bound, (method, ppl, float_ref["ppl"])
    assert agreement(greedy(llm, PROMPTS), float_ref["greedy"]) >= agree_bound


@pytest.mark.compat("quant_gptq_awq", "single")
@pytest.mark.parametrize("method,act_order", [("gptq", True), ("gptq", False), ("awq", False)])
def test_quant_int4_checkpoint(tiny, float_ref, tmp_path, method, act_order):
    qdir, fake = write_quantized_pair(tiny, tmp_path / method, method, group_size=32, act_order=act_order)
    llm = make_llm(qdir)  # method chosen from quantization_config
    assert type(llm.llm_engine.runner.model.layers[0].gate_up) is (GPTQWeight if method == "gptq" else AWQWeight)
    ref = make_llm(fake)
    ids = llm.get_tokenizer().encode(TEXTS[0])
    lp, lp_ref = sequence_logprobs(llm, ids), sequence_logprobs(ref, ids)
    assert (lp - lp_ref).abs().max().item() < 1e-3
    assert greedy(llm, PROMPTS) == greedy(ref, PROMPTS)
    # 4 bits with 32-row groups on a random model: a bounded perplexity cost.
    assert perplexity(llm) < float_ref["ppl"] * 1.25
    assert llm.llm_engine.runner.model.weight_bytes() < 0.5 * float_ref["bytes"]


def test_quant_refusals(tiny, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="unknown quantization method 'int3'.*known: none, auto"):
        make_llm(tiny, quantization="int3")
    with pytest.raises(ValueError, match="needs a .gguf file"):
        make_llm(tiny, quantization="gguf")
    from pagedserve.quantization.int8 import Int8Method

    monkeypatch.setattr(Int8Method, "platforms", ("cuda", "rocm"))
    with pytest.raises(ValueError, match="not supported on platform 'cpu'; platforms that can run it: cuda, rocm"):
        make_llm(tiny, quantization="int8")
    monkeypatch.undo()
    qdir, _ = write_quantized_pair(tiny, tmp_path / "awq", "awq")
    with pytest.raises(ValueError, match="awq-quantized; quantization='gptq' cannot load it"):
        make_llm(qdir, quantization="gptq")
    with pytest.raises(ValueError, match="quantization='none' cannot load a pre-quantized checkpoint"):
        make_llm(qdir, quantization="none")
    with pytest.raises(ValueError, match="tensor/pipeline parallelism"):
        make_llm(tiny, quantization="w8a8", tensor_parallel_size=2)  # int8, fp8, gguf: sharded
