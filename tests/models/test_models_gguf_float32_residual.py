"""The float32 residual stream of GGUF models run in bfloat16 (``residual_dtype``).

On a GGUF file kept in blocks with bf16 activations, ``residual_dtype="auto"`` keeps the
residual stream in float32 and the o / down projections write their float32 sums into
it (docs/quantization.md, "Quality: KL divergence").  Checked here, on tiny random
checkpoints of the families that run GGUF (Llama, Qwen3, Gemma 3) written as llama.cpp
writes them: which dtype each setting resolves to, that the stream and the projections'
outputs really are float32 in every layer, and that the model's full next-token
distributions are closer to transformers' float32 run of the file's weights than with
the stream in bf16 (the setting "model").
"""

from __future__ import annotations

import copy

import pytest
import torch
from gguf_convert import quantization_roundtrip, write_gguf_like_llama_cpp
from test_models_vs_hf import VOCAB, build_checkpoint

from pagedserve import LLM, SamplingParams
from pagedserve.quantization.gguf import GGUFWeight

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)

#: GGUF architecture -> (test_models_vs_hf case, overrides): six layers, so that six
#: times two bf16 roundings of the stream add up.
FAMILIES = {
    "llama": ("llama-head24", dict(num_hidden_layers=6)),
    "qwen3": ("qwen3-qknorm-head40", dict(num_hidden_layers=6)),
    "gemma3": (
        "gemma3-window-local-rope",
        dict(num_hidden_layers=6, layer_types=None, query_pre_attn_scalar=24, final_logit_softcapping=7.0),
    ),
}
PROMPT_LEN = 48


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """arch -> (Q8_0 .gguf path, transformers model on the file's weights)."""
    out = {}

    def get(arch: str):
        if arch not in out:
            case, overrides = FAMILIES[arch]
            folder = tmp_path_factory.mktemp(arch)
            model = build_checkpoint(folder, case, vocab_size=VOCAB + 1, **overrides)
            path = write_gguf_like_llama_cpp(folder / "q8_0.gguf", model, arch, "Q8_0")
            model = copy.deepcopy(model)
            quantization_roundtrip(model, arch, "Q8_0")
            out[arch] = (path, model, folder)
        return out[arch]

    return get


def _prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(n)
    return [torch.randint(3, VOCAB, (PROMPT_LEN,), generator=gen).tolist() for _ in range(n)]


def _engine(path, residual_dtype: str, dtype: str = "bfloat16") -> LLM:
    return LLM(
        model=str(path),
        dtype=dtype,
        kv_cache_memory="16MiB",
        quantization="gguf",
        residual_dtype=residual_dtype,
        enable_prefix_caching=False,
    )


def _mean_kl(llm: LLM, model, prompts: list[list[int]]) -> float:
    """Mean KL(transformers float32 || engine) over every prompt position."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=-1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    total, count = 0.0, 0
    with torch.inference_mode():
        for p, out in zip(prompts, outs):
            ref = torch.log_softmax(model(input_ids=torch.tensor([p])).logits[0, :-1].float(), -1)
            got = out.prompt_logprob_rows.float()[:, : ref.shape[-1]]
            total += float((ref.exp() * (ref - got)).sum())
            count += ref.shape[0]
    return total / count


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_float32_stream_is_closer_to_float32(arch, files):
    path, model, _ = files(arch)
    prompts = _prompts(4)
    auto = _engine(path, "auto")
    runner = auto.llm_engine.runner
    assert runner.model.residual_dtype == torch.float32 and runner.model.stream_dtype == torch.float32
    assert isinstance(runner.model.layers[0].o, GGUFWeight)
    kl_auto = _mean_kl(auto, model, prompts)
    del auto
    bf16 = _engine(path, "model")
    assert bf16.llm_engine.runner.model.residual_dtype == torch.bfloat16
    kl_bf16 = _mean_kl(bf16, model, prompts)
    print(f"{arch}: mean KL float32 stream {kl_auto:.3g}, bf16 stream {kl_bf16:.3g}")
    assert kl_auto < kl_bf16


def test_every_layer_streams_float32(files, monkeypatch):
    """The residual reaching each norm is float32, and so are the o / down outputs."""
    path, _, _ = files("llama")
    llm = _engine(path, "auto")
    ops = llm.llm_engine.runner.model.ops
    seen: list[tuple[torch.dtype, torch.dtype, torch.dtype | None]] = []
    inner = ops.fused_add_rms_norm

    def spy(x, residual, weight, eps, out_dtype=None):
        seen.append((x.dtype, residual.dtype, out_dtype))
        return inner(x, residual, weight, eps, out_dtype=out_dtype)

    monkeypatch.setattr(ops, "fused_add_rms_norm", spy)
    llm.generate([_prompts(1)[0]], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    layers = len(llm.llm_engine.runner.model.layers)
    # Per forward: the post-attention norm of every layer, the input norm of layers 1..,
    # the final norm: 2 * layers calls, each a float32 x (o / down sums) and stream.
    assert len(seen) == 3 * 2 * layers
    assert set(seen) == {(torch.float32, torch.float32, torch.bfloat16)}


def test_settings_resolve(files):
    path, _, folder = files("llama")
    assert _engine(path, "model").llm_engine.runner.model.stream_dtype is None
    f32 = _engine(path, "auto", dtype="float32").llm_engine.runner.model
    assert f32.residual_dtype == torch.float32 and f32.stream_dtype is None  # already float32
    # A dense checkpoint: "auto" keeps the model's dtype, "float32" is taken as asked.
    dense = LLM(model=str(folder), dtype="bfloat16", kv_cache_memory="16MiB").llm_engine.runner.model
    assert dense.residual_dtype == torch.bfloat16
    forced = LLM(model=str(folder), dtype="bfloat16", kv_cache_memory="16MiB", residual_dtype="float32")
    assert forced.llm_engine.runner.model.residual_dtype == torch.float32
    with pytest.raises(ValueError, match="residual_dtype must be one of"):
        LLM(model=str(path), residual_dtype="bfloat16")


def test_family_without_it_refuses_float32(tmp_path):
    build_checkpoint(tmp_path, "olmo2-postnorm")
    with pytest.raises(ValueError, match="residual_dtype='float32' is not supported here: Olmo2ForCausalLM"):
        LLM(model=str(tmp_path), dtype="bfloat16", kv_cache_memory="16MiB", residual_dtype="float32")
    auto = LLM(model=str(tmp_path), dtype="bfloat16", kv_cache_memory="16MiB")
    assert auto.llm_engine.runner.model.residual_dtype == torch.bfloat16
