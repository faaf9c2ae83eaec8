"""fp8 KV caches with per-layer scales: a checkpoint's ``k_scale``/``v_scale`` tensors
(vLLM's names) or an older vLLM ``kv_cache_scales`` JSON file (quantization_param_path),
on tiny random float32 checkpoints.

The cache stores ``k / k_scale`` and ``v / v_scale`` (checked on the cache's own values
against a run at scale 1.0), attention undoes both (a power-of-two scale changes no
output beyond rounding, while the cache's values differ by that factor), a realistic
calibrated scale stays within the fp8 bounds of the float32 cache, and the settings that
cannot work are refused with clear messages.
"""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve import LLM, SamplingParams
from pagedserve.executor.model_runner import check_kv_scales

pytestmark = pytest.mark.timeout(600)

VOCAB = 259
# Per layer (k_scale, v_scale): powers of two, so that dividing by them is exact.
POW2 = {0: (0.25, 4.0), 1: (2.0, 0.5)}


@pytest.fixture(scope="module")
def path(tiny_checkpoint_factory):
    return tiny_checkpoint_factory(arch="llama", num_heads=4, num_kv_heads=2)


def with_scales(src, dst, scales: dict[int, tuple[float, float]], names=("k_scale", "v_scale")):
    """A copy of checkpoint ``src`` in ``dst`` whose safetensors also carry per-layer scales."""
    shutil.copytree(src, dst)
    (file,) = dst.glob("*.safetensors")
    tensors = load_file(file)
    for layer, (k, v) in scales.items():
        tensors[f"model.layers.{layer}.self_attn.{names[0]}"] = torch.tensor(k, dtype=torch.float32)
        if len(names) > 1:
            tensors[f"model.layers.{layer}.self_attn.{names[1]}"] = torch.tensor([v], dtype=torch.float32)
    save_file(tensors, file, metadata={"format": "pt"})
    return dst


def prompts(seed=3, lengths=(40, 70, 9)):
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


def prompt_rows(llm: LLM, ps) -> list[torch.Tensor]:
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=-1)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    return [o.prompt_logprob_rows for o in outs]


def max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


KW = dict(dtype="float32", kv_cache_memory="8MiB", enable_prefix_caching=False)


def test_checkpoint_scales_divide_the_cache_and_attention_undoes_them(path, tmp_path):
    scaled_path = with_scales(path, tmp_path / "scaled", POW2)
    one = LLM(model=str(path), kv_cache_dtype="fp8_e4m3", kv_cache_scales="tensor", **KW)
    llm = LLM(model=str(scaled_path), kv_cache_dtype="fp8_e4m3", **KW)  # auto: the checkpoint's scales
    runner = llm.llm_engine.runner
    assert not runner.kv_row_scaled and runner.kv_layer_scales == POW2
    assert runner.kv_caches[0][0].shape[-1] == runner.local_arch.head_dim  # rows without their scales
    for engine in (one, llm):  # unwritten rows read as 0 below
        for kv in engine.llm_engine.runner.kv_caches:
            for t in kv:
                t.view(torch.uint8).zero_()
    ps = prompts()
    want, got = prompt_rows(one, ps), prompt_rows(llm, ps)
    # The same prompts, the same slots: the cache holds k / k_scale where scale 1.0 holds k
    # (exactly for values that stay normal in both; e4m3 has 3 mantissa bits).
    for layer, (ks, vs) in POW2.items():
        for t, s in ((0, ks), (1, vs)):
            a = one.llm_engine.runner.kv_caches[layer][t].float()
            b = runner.kv_caches[layer][t].float() * s
            normal = (a.abs() >= 2**-5) & (a.abs() <= 400) & (b.abs() >= 2**-5 * s) & (b.abs() <= 400 * s)
            assert normal.sum() > 1000
            if layer == 0:  # the same keys and values: the same fp8 values
                assert torch.equal(a[normal], b[normal]), (layer, t)
            else:  # its inputs passed through layer 0's (differently rounded) attention
                close = torch.isclose(a[normal], b[normal], rtol=2**-3, atol=0)
                assert close.float().mean() > 0.98, (layer, t)
    # ...and attention undoes the scales (scores 4x or 0.5x, values 4x or 0.5x if it did
    # not): outputs as at scale 1.0 up to the rounding of values near e4m3's subnormals.
    diff = max_diff(want, got)
    assert diff < 0.02, diff


def test_row_scales_ignore_checkpoint_scales_and_auto_dtype_loads_them(path, tmp_path):
    scaled_path = with_scales(path, tmp_path / "scaled", POW2)
    row = LLM(model=str(scaled_path), kv_cache_dtype="fp8_e4m3", kv_cache_scales="row", **KW)
    runner = row.llm_engine.runner
    assert runner.kv_row_scaled and runner.kv_layer_scales is None and runner.model.kv_scales is None
    assert runner.kv_caches[0][0].shape[-1] == runner.local_arch.head_dim + 4
    # A model-dtype cache loads the checkpoint (its scales are not weights) and gives the
    # checkpoint's outputs.
    plain = LLM(model=str(path), **KW)
    with_ = LLM(model=str(scaled_path), **KW)
    ps = prompts(4, (30,))
    assert max_diff(prompt_rows(plain, ps), prompt_rows(with_, ps)) == 0


def test_an_older_kv_scale_name_sets_both(path, tmp_path):
    scaled_path = with_scales(path, tmp_path / "kv", {0: (0.5, 0.5), 1: (2.0, 2.0)}, names=("kv_scale",))
    llm = LLM(model=str(scaled_path), kv_cache_dtype="fp8_e5m2", **KW)
    assert llm.llm_engine.runner.kv_layer_scales == {0: (0.5, 0.5), 1: (2.0, 2.0)}


def test_a_scale_file_gives_calibrated_scales(path, tmp_path):
    """Scales from the file (absmax / 448 of the keys and values the model produces here,
    rounded up), not powers of two: within the fp8 bounds of the float32 cache."""
    ps = prompts(5, (60, 33))
    ref = LLM(model=str(path), **KW)
    for kv in ref.llm_engine.runner.kv_caches:  # unwritten rows read as 0 below
        for t in kv:
            t.zero_()
    want = prompt_rows(ref, ps)
    amax = max(t.abs().max().item() for kv in ref.llm_engine.runner.kv_caches for t in kv)
    scale = amax * 1.5 / 448
    doc = {
        "model_type": "llama",
        "kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {"0": {"0": scale, "1": scale}}},
    }
    file = tmp_path / "kv_cache_scales.json"
    file.write_text(json.dumps(doc))
    llm = LLM(model=str(path), kv_cache_dtype="fp8", quantization_param_path=str(file), **KW)
    runner = llm.llm_engine.runner
    assert not runner.kv_row_scaled and runner.kv_layer_scales == {0: (scale, scale), 1: (scale, scale)}
    for kv in runner.kv_caches:
        for t in kv:
            t.view(torch.uint8).zero_()
    got = prompt_rows(llm, ps)
    diff = max_diff(want, got)
    assert 0 < diff < 0.25, diff  # the e4m3 bound of tests/kv_cache/test_kv_cache_dtype_engine.py
    # The file's scales reach the cache: its largest stored value is near 448 / 1.5.
    stored = max(t.float().abs().max().item() for kv in runner.kv_caches for t in kv)
    assert 448 / 1.5 / 1.2 < stored <= 448 / 1.5 * 1.2


def test_scale_settings_that_cannot_work_are_refused(path, tmp_path):
    with pytest.raises(ValueError, match="kv_cache_scales='tensor' applies to an fp8 KV cache"):
        LLM(model=str(path), kv_cache_dtype="int8", kv_cache_scales="tensor", **KW)
    with pytest.raises(ValueError, match="kv_cache_scales must be 'auto', 'row' or 'tensor'"):
        LLM(model=str(path), kv_cache_dtype="fp8", kv_cache_scales="layer", **KW)
    with pytest.raises(ValueError, match="is not a file"):
        LLM(model=str(path), kv_cache_dtype="fp8", quantization_param_path=str(tmp_path / "none.json"), **KW)
    file = tmp_path / "s.json"
    file.write_text("{}")
    with pytest.raises(ValueError, match="quantization_param_path gives per-layer fp8 KV cache scales"):
        LLM(model=str(path), kv_cache_dtype="fp8", kv_cache_scales="row", quantization_param_path=str(file), **KW)
    with pytest.raises(ValueError, match="no kv_cache.scaling_factor table"):
        LLM(model=str(path), kv_cache_dtype="fp8", quantization_param_path=str(file), **KW)
    file.write_text(json.dumps({"kv_cache": {"scaling_factor": {"0": {"0": -1.0}}}}))
    with pytest.raises(ValueError, match="invalid layers or scales"):
        LLM(model=str(path), kv_cache_dtype="fp8", quantization_param_path=str(file), **KW)
    half = with_scales(path, tmp_path / "half", {0: (0.5, 0.5)}, names=("k_scale",))
    with pytest.raises(ValueError, match="only one of k_scale and v_scale for layer 0"):
        LLM(model=str(half), kv_cache_dtype="fp8", **KW)
    bad = with_scales(path, tmp_path / "bad", {0: (0.0, 1.0)})
    with pytest.raises(ValueError, match="not a positive finite KV cache scale"):
        LLM(model=str(bad), kv_cache_dtype="fp8", **KW)


def test_latent_attention_refuses_row_scales_before_loading():
    from pagedserve.config import CacheConfig

    for kw in (dict(cache_dtype="int8"), dict(cache_dtype="fp8", kv_cache_scales="row")):
        with pytest.raises(ValueError, match="latent attention reads no per-row scales"):
            check_kv_scales(CacheConfig(**kw), "DeepseekV2ForCausalLM")
    check_kv_scales(CacheConfig(cache_dtype="fp8"), "DeepseekV2ForCausalLM")  # auto: per-layer scale 1.0
    check_kv_scales(CacheConfig(cache_dtype="int8"), "LlamaForCausalLM")
