"""GGUF files of the hybrid families (Qwen3.5 dense and MoE, LFM2, Granite 4, Nemotron-H) against
transformers: a tiny random checkpoint from transformers' config class
(test_models_hybrid_vs_hf's cases), written as llama.cpp's converter writes it
(``gguf_convert``: A = -exp(A_log), squeezed convolutions, Qwen3.5's (1 + w) norms and
value heads reordered from grouped to tiled, Mamba 2's [heads, 1] / [groups, d] shapes,
Granite's split expert and shared-MLP projections and interleaved q/k rows), loads
through ``LLM`` and gives transformers' greedy tokens and logprobs: on the original
checkpoint (F32 files), on the weights the file holds (Q8_0 dequantized at load), and
close to them with the blocks kept.

Shapes: Qwen3.5's key and value heads of 32 (llama.cpp's runtime takes one size for
both; 32 makes a value head whole Q8_0 blocks, so ``out_proj``'s reordered columns keep
their blocks), two value heads per key head (the reorder is not the identity).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from gguf_convert import quantization_roundtrip, write_gguf_like_llama_cpp
from test_models_hybrid_vs_hf import VOCAB, _prompts, build_checkpoint, hf_reference

from pagedserve import LLM, SamplingParams
from pagedserve.loader import open_model
from pagedserve.quantization.gguf import GGUFWeight

transformers = pytest.importorskip("transformers")

_QWEN_HEADS = dict(linear_key_head_dim=32, linear_value_head_dim=32)

#: GGUF architecture -> (test_models_hybrid_vs_hf case, overrides, HF architecture).
HYBRID_GGUF_CASES: dict[str, tuple[str, dict, str]] = {
    "qwen35": ("qwen3_5-deltanet-gated-attn", _QWEN_HEADS, "Qwen3_5ForCausalLM"),
    "qwen35moe": ("qwen3_5moe-experts-every-layer", _QWEN_HEADS, "Qwen3_5MoeForCausalLM"),
    # llama.cpp's Qwen3-Next has no dense-MLP layers (no ffn_gate/up/down tensors).
    "qwen3next": ("qwen3next-moe-shared-expert", dict(mlp_only_layers=[]), "Qwen3NextForCausalLM"),
    "lfm2": ("lfm2-shortconv-bias-attn", {}, "Lfm2ForCausalLM"),
    "granitehybrid": ("granite4-mamba2-moe-nope", {}, "GraniteMoeHybridForCausalLM"),
    "nemotron_h": ("nemotronh-mamba2-mlp-attn", {}, "NemotronHForCausalLM"),
    "jamba": ("jamba-mamba1-moe-attn", {}, "JambaForCausalLM"),
}
MAX_NEW = 6
#: Chunks of 8 tokens (state carried across steps) on pages of 4; a max_model_len, since
#: llama.cpp writes a context of 2**20 for Granite 4 without RoPE.
COMMON = dict(dtype="float32", kv_cache_memory="16MiB", max_model_len=256, enable_prefix_caching=False)
ENGINE = dict(COMMON, max_num_batched_tokens=8, block_size=4)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """(arch, type) -> (checkpoint folder, gguf path, prompts, expected tokens and
    logprobs, first step's logprob vectors)."""
    models: dict[str, tuple] = {}
    cache: dict[tuple[str, str], tuple] = {}

    def get(arch: str, linear_type: str):
        if arch not in models:
            case, overrides, _ = HYBRID_GGUF_CASES[arch]
            folder = tmp_path_factory.mktemp(arch)
            models[arch] = (folder, build_checkpoint(folder, case, vocab_size=VOCAB + 1, **overrides))
        key = (arch, linear_type)
        if key not in cache:
            folder, model = models[arch]
            path = write_gguf_like_llama_cpp(folder / f"{linear_type}.gguf", model, arch, linear_type)
            if linear_type != "F32":
                model = copy.deepcopy(model)
                quantization_roundtrip(model, arch, linear_type)
            prompts = _prompts(len(arch))[1:3]  # 19 and 31 tokens
            with torch.inference_mode():
                first = [torch.log_softmax(model(input_ids=torch.tensor([p])).logits[0, -1], -1) for p in prompts]
            cache[key] = (folder, path, prompts, [hf_reference(model, p, MAX_NEW) for p in prompts], first)
        return cache[key]

    return get


@pytest.mark.parametrize("arch", list(HYBRID_GGUF_CASES))
def test_hybrid_gguf_weights_equal_the_checkpoints(arch, written):
    """Every tensor of the F32 file comes back under the name and with the values the
    safetensors checkpoint has (the (1 + w) norms and A = -exp(A_log) to float32 rounding)."""
    folder, path, *_ = written(arch, "F32")
    ours = dict(open_model(path).weights())
    theirs = dict(open_model(folder).weights())
    assert set(ours) == set(theirs)
    for name, t in theirs.items():
        assert ours[name].shape == t.shape, name
        if name.endswith("A_log") or (arch.startswith("qwen3") and name.endswith("norm.weight")):
            torch.testing.assert_close(ours[name], t.float(), rtol=1e-6, atol=1e-6, msg=name)
        else:
            assert torch.equal(ours[name], t.float()), name


@pytest.mark.parametrize("arch", list(HYBRID_GGUF_CASES))
def test_hybrid_f32_gguf_matches_transformers(arch, written):
    _check(arch, "F32", written)


@pytest.mark.parametrize(
    "arch", ["qwen35", pytest.param("lfm2", marks=pytest.mark.slow), "granitehybrid", "nemotron_h"]
)
def test_hybrid_q8_0_gguf_dequantized_matches_transformers(arch, written):
    _check(arch, "Q8_0", written)


def _check(arch: str, linear_type: str, written) -> None:
    _, path, prompts, expected, _ = written(arch, linear_type)
    llm = LLM(model=str(path), quantization="none", **ENGINE)
    assert llm.llm_engine.arch.architecture == HYBRID_GGUF_CASES[arch][2]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    for i, (out, (tokens, logprobs)) in enumerate(zip(llm.generate(prompts, params, use_tqdm=False), expected)):
        got = out.outputs[0]
        assert got.token_ids == tokens, f"prompt {i}"
        for j, (tok, entry, ref) in enumerate(zip(got.token_ids, got.logprobs, logprobs)):
            assert math.isclose(entry[tok].logprob, ref, abs_tol=2e-4), (i, j, entry[tok].logprob, ref)
    assert llm.llm_engine.kv.pool.num_in_use == 0


@pytest.mark.compat("quant_gguf", "single")
@pytest.mark.parametrize(
    "arch",
    [
        "qwen35",
        "lfm2",
        "granitehybrid",
        "qwen3next",
        *(pytest.param(a, marks=pytest.mark.slow) for a in ("qwen35moe", "nemotron_h", "jamba")),
    ],
)
def test_hybrid_q8_0_blocks_stay_quantized_and_close(arch, written):
    """Blocks kept (``quantization="gguf"``) for the recurrent layers' projections too
    (Qwen3.5's value-head reorder moved as stored rows and whole column blocks): the
    first greedy token and its logprob stay close to transformers on the file's weights."""
    _, path, prompts, _, first = written(arch, "Q8_0")
    llm = LLM(model=str(path), quantization="gguf", **COMMON)
    layers = llm.llm_engine.runner.model.layers
    recurrent = next(layer for layer in layers if getattr(layer, "in_proj", None) is not None)
    assert isinstance(recurrent.in_proj, GGUFWeight)
    # Qwen3-Next's case has 4 value heads of 12: out_proj's rows of 48 are not whole blocks (F32 in the file).
    assert isinstance(recurrent.out_proj, GGUFWeight) == (arch != "qwen3next")
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, logprobs=0), use_tqdm=False)
    for out, reference in zip(outs, first):
        tok = out.outputs[0].token_ids[0]
        assert float(reference[tok]) >= float(reference.max()) - 0.05
        assert math.isclose(out.outputs[0].logprobs[0][tok].logprob, float(reference[tok]), abs_tol=0.05)


@pytest.mark.parametrize("arch", ["nemotron_h_moe", "falcon-h1", "lfm2moe"])
def test_hybrid_gguf_not_implemented_is_refused_by_name(arch, tmp_path):
    import gguf

    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=f"GGUF of {arch} is not supported yet; load the Hugging Face checkpoint"):
        LLM(model=str(path), dtype="float32", kv_cache_memory="16MiB")


@pytest.mark.parametrize(
    ("pre", "pieces"),
    [
        ("qwen35", ["ae\u0301b", " ", "7"]),  # Qwen3.5: a letter's combining mark stays with it
        ("qwen2", ["ae", "\u0301b", " ", "7"]),
        ("lfm2", ["ae", "\u0301b", " ", "7"]),  # llama.cpp splits LFM2 as Llama 3
    ],
)
def test_hybrid_pre_tokenizers_split_as_llama_cpp(pre, pieces):
    from pagedserve.loader.gguf_tokenizer import build_gguf_tokenizer, bytes_to_unicode

    spelling = bytes_to_unicode()
    metadata = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": [spelling[b] for b in range(256)],
        "tokenizer.ggml.merges": [],
    }
    backend = build_gguf_tokenizer(metadata)
    got = [piece for piece, _ in backend.pre_tokenizer.pre_tokenize_str("ae\u0301b 7")]
    decoded = ["".join(chr(b) for b in bytes({v: k for k, v in spelling.items()}[c] for c in p)) for p in got]
    assert [d.encode("latin-1").decode("utf-8") for d in decoded] == pieces
