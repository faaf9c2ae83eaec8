"""Every GGUF architecture against transformers: a tiny random checkpoint from transformers'
config class, written as llama.cpp's converter writes it (``gguf_convert``), loads
through ``LLM`` and gives transformers' greedy tokens and logprobs on the original
checkpoint (F32 files) or on the weights the file holds (Q8_0 files, dequantized by
``gguf.quants``): tight when pagedserve dequantizes at load, close when it keeps the
blocks and multiplies with the ``gguf_linear`` kernel.

Shapes are those of test_models_vs_hf, adjusted only where a GGUF cannot carry a setting
(llama.cpp stores no query_pre_attn_scalar, no StarCoder2 or Mixtral window, no
Qwen-MoE dense layers, no untied Gemma 2 LM head) and where llama.cpp fixes one (SmolLM3's NoPE period of 4).
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from gguf_convert import quantization_roundtrip, write_gguf_like_llama_cpp
from test_models_vs_hf import CASES, ENGINES, VOCAB, _prompts, build_checkpoint, hf_reference

from pagedserve import LLM, SamplingParams
from pagedserve.kernels.quant_reference import dequantize_gguf
from pagedserve.loader import open_model
from pagedserve.loader.gguf_checkpoint import GGUFBlocks, GGUFCheckpoint
from pagedserve.models import gguf_architectures
from pagedserve.quantization.gguf import GGUFWeight

transformers = pytest.importorskip("transformers")

#: GGUF architecture -> (test_models_vs_hf case, overrides that make it representable).
GGUF_CASES: dict[str, tuple[str, dict]] = {
    "llama": ("llama-head24", {}),
    "qwen2": ("qwen2-bias-yarn", {}),
    "qwen3": ("qwen3-qknorm-head40", {}),
    # llama.cpp drops Gemma 2's LM head: the published models tie it.
    "gemma2": ("gemma2-window-softcap", dict(query_pre_attn_scalar=24, tie_word_embeddings=True)),
    # Six layers: llama.cpp's default Gemma 3 pattern (five local, one global).
    "gemma3": (
        "gemma3-window-local-rope",
        dict(num_hidden_layers=6, layer_types=None, query_pre_attn_scalar=24, final_logit_softcapping=7.0),
    ),
    "phi3": ("phi3-partial-rotary-window", {}),
    "olmo2": ("olmo2-postnorm", {}),
    "granite": ("granite-multipliers", {}),
    "starcoder2": ("starcoder2-layernorm-window", dict(sliding_window=None)),
    "glm4": ("glm4-interleaved-partial-rope", {}),
    "smollm3": ("smollm3-nope", dict(num_hidden_layers=4, no_rope_layer_interval=4)),
    "qwen3moe": ("qwen3moe-qknorm", {}),
    "qwen2moe": ("qwen2moe-shared-dense-layer", dict(mlp_only_layers=[])),
    "mixtral": ("mixtral-top2-window", dict(sliding_window=None)),
    # v_head_dim 16: o_proj's rows are whole Q8_0 blocks; kv_b_proj's (kv_lora_rank 24)
    # are not, so it is F32 in the file as attn_k_b/attn_v_b and in transformers alike.
    "deepseek2": ("deepseekv2-lite-mla", dict(v_head_dim=16)),
}
MAX_NEW = 6


def test_every_gguf_architecture_is_covered():
    from test_models_gguf_hybrid import HYBRID_GGUF_CASES  # the hybrid families' own tests

    assert set(gguf_architectures()) | {"mixtral"} == set(GGUF_CASES) | set(HYBRID_GGUF_CASES)


def _file_arch(arch: str) -> str:
    return "llama" if arch == "mixtral" else arch


#: Q8_0 files of these run in the quick suite (norm shift, fused, stacked experts with the
#: Llama permutation, a shared expert, blocks dequantized); the others are marked slow.
QUICK_Q8_0 = ("gemma3", "phi3", "mixtral", "qwen2moe", "glm4", "deepseek2")


#: MoE families whose Q8_0 test files keep every expert tensor in blocks.
EXPERT_BLOCKS_KEPT = ("qwen3moe", "mixtral", "deepseek2")


def _q8_0_params() -> list:
    return [a if a in QUICK_Q8_0 else pytest.param(a, marks=pytest.mark.slow) for a in GGUF_CASES]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """(arch, type) -> (gguf path, prompts, expected greedy tokens and logprobs, the
    first step's full logprob vectors)."""
    models: dict[str, tuple] = {}
    cache: dict[tuple[str, str], tuple] = {}

    def get(arch: str, linear_type: str):
        if arch not in models:
            case, overrides = GGUF_CASES[arch]
            folder = tmp_path_factory.mktemp(arch)
            models[arch] = (folder, build_checkpoint(folder, case, vocab_size=VOCAB + 1, **overrides))
        key = (arch, linear_type)
        if key not in cache:
            folder, model = models[arch]
            path = write_gguf_like_llama_cpp(folder / f"{linear_type}.gguf", model, _file_arch(arch), linear_type)
            if linear_type != "F32":
                model = copy.deepcopy(model)
                quantization_roundtrip(model, arch, linear_type)
            # Both longer than every window; the second shares the first's 11-token prefix.
            prompts = _prompts(len(arch))[3:5]
            with torch.inference_mode():
                first = [torch.log_softmax(model(input_ids=torch.tensor([p])).logits[0, -1], -1) for p in prompts]
            cache[key] = (path, prompts, [hf_reference(model, p, MAX_NEW) for p in prompts], first)
        return cache[key]

    return get


@pytest.mark.parametrize("arch", list(GGUF_CASES))
def test_f32_gguf_matches_transformers(arch, written):
    _check_dequantized(arch, "F32", written)


@pytest.mark.parametrize("arch", _q8_0_params())
def test_q8_0_gguf_dequantized_matches_transformers(arch, written):
    _check_dequantized(arch, "Q8_0", written)


def _check_dequantized(arch: str, linear_type: str, written) -> None:
    """Dequantized at load: transformers' tokens and logprobs on the weights the file holds."""
    path, prompts, expected, _ = written(arch, linear_type)
    llm = LLM(
        model=str(path), dtype="float32", kv_cache_memory="16MiB", quantization="none", **ENGINES["chunked+prefix"]
    )
    assert llm.llm_engine.arch.architecture == CASES[GGUF_CASES[arch][0]][1]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    for i, (out, (tokens, logprobs)) in enumerate(zip(llm.generate(prompts, params, use_tqdm=False), expected)):
        got = out.outputs[0]
        assert got.token_ids == tokens, f"prompt {i}"
        for j, (tok, entry, ref) in enumerate(zip(got.token_ids, got.logprobs, logprobs)):
            assert math.isclose(entry[tok].logprob, ref, abs_tol=2e-4), (i, j, entry[tok].logprob, ref)
    assert llm.llm_engine.kv.pool.num_in_use == 0


@pytest.mark.compat("quant_gguf", "single")
@pytest.mark.parametrize("arch", _q8_0_params())
def test_q8_0_blocks_stay_quantized_and_close(arch, written):
    """Blocks kept (``quantization="gguf"``; the kernel quantizes activations to int8 too):
    the first greedy token and its logprob stay close to transformers on the file's weights."""
    path, prompts, _, first = written(arch, "Q8_0")
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory="16MiB", quantization="gguf")
    layer = llm.llm_engine.runner.model.layers[0]
    assert isinstance(layer.o, GGUFWeight) and isinstance(getattr(layer, "qkv", None) or layer.q, GGUFWeight)
    if arch == "glm4":  # stored q/k rows: the fused output is reordered at run time
        assert layer.qkv_order is not None
    if arch == "deepseek2":  # stored rope rows of q and kv_a: reordered at run time; kv_b absorbed in float
        assert isinstance(layer.kv_a, GGUFWeight) and layer.q_order is not None and layer.kv_a_order is not None
        assert isinstance(layer.w_uk, torch.Tensor) and isinstance(layer.w_uv, torch.Tensor)
    if arch in EXPERT_BLOCKS_KEPT:  # one GGUFWeight per expert (models.quantized_experts)
        layer = llm.llm_engine.runner.model.layers[-1]
        experts = [*layer.w13, *layer.w2]
        assert len(layer.w13) == len(layer.w2) > 1 and all(isinstance(w, GGUFWeight) for w in experts)
    elif arch == "qwen2moe":  # down_exps rows of 40 values stay F32: the layer's experts all come dequantized
        assert isinstance(layer.w13, torch.Tensor)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, logprobs=0), use_tqdm=False)
    for out, reference in zip(outs, first):
        tok = out.outputs[0].token_ids[0]
        # int8 activations move logprobs by ~1e-2: a greedy choice may flip between
        # near-tied tokens, never to one transformers ranks clearly lower.
        assert float(reference[tok]) >= float(reference.max()) - 0.05
        assert math.isclose(out.outputs[0].logprobs[0][tok].logprob, float(reference[tok]), abs_tol=0.05)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2moe"])
def test_expert_blocks_are_each_experts_rows_of_the_stacked_tensor(arch, written):
    """Kept expert blocks dequantize to exactly what dequantizing the stacked tensor gives
    that expert; a layer whose expert tensors are not all of a kept type (Qwen2-MoE's
    down_exps rows of 40 values stay F32) comes dequantized, every expert of it."""
    checkpoint = GGUFCheckpoint(written(arch, "Q8_0")[0])
    floats = dict(checkpoint.weights())
    kept = dict(checkpoint.weights(keep_quantized=("Q8_0",)))
    experts = [name for name in floats if ".experts." in name]
    assert experts and set(kept) == set(floats)
    for name in experts:
        if arch == "qwen2moe":
            assert isinstance(kept[name], torch.Tensor) and torch.equal(kept[name], floats[name]), name
            continue
        blocks = kept[name]
        assert isinstance(blocks, GGUFBlocks) and blocks.shape == tuple(floats[name].shape), name
        assert torch.equal(dequantize_gguf(blocks.data, "Q8_0").float(), floats[name]), name


@pytest.mark.parametrize("arch", ["gemma3", "phi3", "qwen2moe", "mixtral"])
def test_gguf_weights_equal_the_original_checkpoint(arch, tmp_path):
    """F32 files give back every original tensor (norm shifts, permutations and expert
    stacking undone) under the names a safetensors export has."""
    case, overrides = GGUF_CASES[arch]
    model = build_checkpoint(tmp_path, case, vocab_size=VOCAB + 1, **overrides)
    path = write_gguf_like_llama_cpp(tmp_path / "m.gguf", model, _file_arch(arch))
    ours = dict(open_model(path).weights())
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("lm_head") or "lm_head.weight" in ours}
    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix, half = name[: -len("gate_up_proj")], t.shape[1] // 2
            g, u = ("w1", "w3") if arch == "mixtral" else ("gate_proj", "up_proj")
            for e in range(t.shape[0]):
                p = prefix.replace("mlp.", "block_sparse_moe.") if arch == "mixtral" else prefix
                assert torch.equal(ours[f"{p}{e}.{g}.weight"], t[e, :half]), (name, e)
                assert torch.equal(ours[f"{p}{e}.{u}.weight"], t[e, half:]), (name, e)
        elif name.endswith("mlp.experts.down_proj"):
            p = name[: -len("down_proj")]
            p = p.replace("mlp.", "block_sparse_moe.") if arch == "mixtral" else p
            for e in range(t.shape[0]):
                assert torch.equal(ours[f"{p}{e}.{'w2' if arch == 'mixtral' else 'down_proj'}.weight"], t[e])
        elif arch.startswith("gemma") and name.endswith("norm.weight"):
            # Stored as 1 + w: w comes back to float32 rounding, 1 + w bit for bit.
            assert torch.equal(ours[name] + 1.0, t + 1.0), name
        else:
            hf = name.replace("mlp.gate.", "block_sparse_moe.gate.") if arch == "mixtral" else name
            assert torch.equal(ours[hf], t), name


REFUSED = {
    "phi3-longrope": ("phi3", {}, {"rope_factors_long.weight": np.ones(4, np.float32)}, "longrope"),
    "glm4-mrope": ("glm4", {"rope.dimension_sections": [2, 2, 2, 0]}, {}, "M-RoPE"),
    "olmo3-window": ("olmo2", {"attention.sliding_window": 16}, {}, "sliding-window attention"),
    "sigmoid-router": ("qwen3moe", {"expert_gating_func": 2}, {}, "expert gating function 2"),
    "expert-scale": ("qwen2moe", {"expert_weights_scale": 2.5}, {}, "expert_weights_scale=2.5"),
    "yarn-ext-factor": ("qwen2", {"rope.scaling.yarn_ext_factor": 0.5}, {}, "YaRN extrapolation factor"),
    "unknown-tensor": ("gemma2", {}, {"blk.0.attn_sinks.weight": np.ones(4, np.float32)}, "no Hugging Face"),
    "unknown-rope-type": ("qwen3", {"rope.scaling.type": "ntk-by-parts"}, {}, "ntk-by-parts"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_unimplemented_gguf_features_are_refused_by_name(name, tmp_path):
    arch, extra, tensors, message = REFUSED[name]
    case, overrides = GGUF_CASES[arch]
    model = build_checkpoint(tmp_path, case, vocab_size=VOCAB + 1, **overrides)
    path = write_gguf_like_llama_cpp(tmp_path / "m.gguf", model, arch, extra=extra, extra_tensors=tensors)
    with pytest.raises(ValueError, match=message):
        LLM(model=str(path), dtype="float32", kv_cache_memory="16MiB")


def test_metadata_llama_cpp_fills_in(tmp_path):
    """A sliding_window_pattern array overrides Gemma 2's every-other-layer default; the
    query scale and the soft-caps follow llama.cpp when the file is silent."""
    case, overrides = GGUF_CASES["gemma2"]
    model = build_checkpoint(tmp_path, case, vocab_size=VOCAB + 1, **overrides)
    path = write_gguf_like_llama_cpp(
        tmp_path / "m.gguf", model, "gemma2", extra={"attention.sliding_window_pattern": [False, True, True]}
    )
    config = open_model(path).hf_config
    assert config["layer_types"] == ["full_attention", "sliding_attention", "sliding_attention"]
    assert config["query_pre_attn_scalar"] == 24 and config["sliding_window"] == 5
    assert (config["attn_logit_softcapping"], config["final_logit_softcapping"]) == (3.0, 5.0)
    assert config["tie_word_embeddings"] is True and config["architectures"] == ["Gemma2ForCausalLM"]


@pytest.mark.parametrize("split_kv_b", [True, False], ids=["attn_k_b+attn_v_b", "attn_kv_b"])
def test_deepseek2_low_rank_query_and_yarn_match_transformers(split_kv_b, tmp_path):
    """The low-rank query, YaRN with DeepSeek's mscale (the file's yarn_log_multiplier) and
    both kv_b_proj layouts llama.cpp's converters have written: the weights come back bit
    for bit and the tokens and logprobs are transformers'.  (The converter stores no expert
    groups, so the routing is greedy.)"""
    case = "deepseekv2-qlora-grouped-yarn"
    model = build_checkpoint(tmp_path, case, vocab_size=VOCAB + 1, topk_method="greedy", n_group=None, topk_group=None)
    path = write_gguf_like_llama_cpp(tmp_path / "m.gguf", model, "deepseek2", split_kv_b=split_kv_b)
    source = open_model(path)
    config = source.hf_config
    assert config["rope_scaling"]["mscale_all_dim"] == pytest.approx(0.707)
    assert (config["q_lora_rank"], config["kv_lora_rank"], config["qk_nope_head_dim"], config["v_head_dim"]) == (
        20,
        16,
        12,
        32,
    )
    ours = dict(source.weights())
    for name, t in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                assert torch.equal(ours[f"{name[: -len('gate_up_proj')]}{e}.gate_proj.weight"], t[e, :half])
                assert torch.equal(ours[f"{name[: -len('gate_up_proj')]}{e}.up_proj.weight"], t[e, half:])
        elif name.endswith("mlp.experts.down_proj"):
            assert all(
                torch.equal(ours[f"{name[: -len('down_proj')]}{e}.down_proj.weight"], t[e]) for e in range(len(t))
            )
        else:
            assert torch.equal(ours[name], t), name
    prompts = _prompts(11)[3:5]
    expected = [hf_reference(model, p, MAX_NEW) for p in prompts]
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory="16MiB", **ENGINES["chunked+prefix"])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    for out, (tokens, logprobs) in zip(llm.generate(prompts, params, use_tqdm=False), expected):
        got = out.outputs[0]
        assert got.token_ids == tokens
        for tok, entry, ref in zip(got.token_ids, got.logprobs, logprobs):
            assert math.isclose(entry[tok].logprob, ref, abs_tol=2e-4)
    assert llm.llm_engine.kv.pool.num_in_use == 0


DEEPSEEK2_REFUSED = {
    "sigmoid-router": ({"expert_gating_func": 2}, {}, "expert gating function 2"),
    "v3-score-bias": ({}, {"blk.1.exp_probs_b.bias": np.zeros(4, np.float32)}, "exp_probs_b"),
    "half-of-split-kv_b": ({}, {"blk.0.attn_kv_b.weight": np.ones((4, 24), np.float32)}, "attn_kv_b"),
}


@pytest.mark.parametrize("name", list(DEEPSEEK2_REFUSED))
def test_deepseek2_features_not_implemented_are_refused_by_name(name, tmp_path):
    extra, tensors, message = DEEPSEEK2_REFUSED[name]
    case, overrides = GGUF_CASES["deepseek2"]
    model = build_checkpoint(tmp_path, case, vocab_size=VOCAB + 1, **overrides)
    path = write_gguf_like_llama_cpp(tmp_path / "m.gguf", model, "deepseek2", extra=extra, extra_tensors=tensors)
    with pytest.raises(ValueError, match=message):
        LLM(model=str(path), dtype="float32", kv_cache_memory="16MiB")


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("quantization", ["none", None])
def test_deepseek2_split_kv_b_file_on_two_tensor_parallel_ranks(quantization, written):
    """A Q8_0 file whose kv_b_proj comes put back together from attn_k_b/attn_v_b, sharded
    per head over two ranks.  Dequantized (``quantization="none"``): transformers' tokens
    and logprobs on the weights the file holds.  Blocks kept (the default for a .gguf):
    each rank's expert down_proj shard is not whole blocks, so it comes dequantized beside
    the kept gate/up blocks (a partly quantized layer of experts); the first greedy token
    and its logprob stay close, as with blocks kept on one rank."""
    import torch.distributed as dist

    path, prompts, expected, first = written("deepseek2", "Q8_0")
    llm = LLM(
        model=str(path),
        dtype="float32",
        kv_cache_memory="16MiB",
        max_num_batched_tokens=8,
        block_size=4,
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
        quantization=quantization,
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
        outs = llm.generate(prompts, params, use_tqdm=False)
        if quantization == "none":
            for out, (tokens, logprobs) in zip(outs, expected):
                got = out.outputs[0]
                assert got.token_ids == tokens
                for tok, entry, ref in zip(got.token_ids, got.logprobs, logprobs):
                    assert math.isclose(entry[tok].logprob, ref, abs_tol=2e-4)
        else:
            layer = llm.llm_engine.runner.model.layers[-1]  # rank 0's last (MoE) layer
            assert len(layer.w13) == len(layer.w2) > 1
            assert all(isinstance(w, GGUFWeight) for w in layer.w13)
            assert all(isinstance(w, torch.Tensor) for w in layer.w2)
            for out, reference in zip(outs, first):
                tok = out.outputs[0].token_ids[0]
                assert float(reference[tok]) >= float(reference.max()) - 0.05
                assert math.isclose(out.outputs[0].logprobs[0][tok].logprob, float(reference[tok]), abs_tol=0.05)
    finally:
        llm.shutdown()
    assert not dist.is_initialized()
