"""Expert placement: ``device_map="experts=PLATFORM,*=PLATFORM"`` keeps every MoE layer's
routed experts on one platform and everything else on another.

The CPU is the only real device here, so the experts' platform is a plugin installed
through a real entry point: ``cpu-moe``, the host CPU with counted reference ops.  Its
``fused_moe`` must run every routed-expert step and nothing else of the model may run
on it; the outputs (greedy tokens and logprobs) must equal the one-platform run, with
chunked prefill and prefix caching on.  Tiny Qwen3-MoE and Qwen2-MoE (shared expert, a
dense layer) and Mixtral checkpoints come from transformers' own classes.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from plugin_dists import counted_cpu_platform, install_plugin

from pagedserve import LLM, SamplingParams
from pagedserve.config import DeviceConfig, device_map_classes
from pagedserve.testing.tiny_model import write_byte_tokenizer

transformers = pytest.importorskip("transformers")

PLUGIN = counted_cpu_platform("MoeCpuPlatform", "cpu-moe")

VOCAB = 259
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
CASES = {
    # (config class, model class, overrides, sparse layers)
    "qwen3moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(num_experts=5, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=24, norm_topk_prob=True),
        3,
    ),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2), 3),
    "qwen2moe-shared-dense": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=40,
            shared_expert_intermediate_size=72,
            mlp_only_layers=[1],
        ),
        2,
    ),
}
# A 16-token budget chunks the longer prompts; the second round hits the prefix cache.
ENGINE = dict(
    dtype="float32",
    block_size=4,
    kv_cache_memory="1MiB",
    max_model_len=128,
    max_num_batched_tokens=16,
    max_num_seqs=4,
    enable_prefix_caching=True,
    enable_chunked_prefill=True,
)
MAX_TOKENS = [6, 9, 4, 7, 5]


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    """The ``cpu-moe`` plugin as an installed distribution (entry point on sys.path)."""
    yield from install_plugin(tmp_path_factory, "psmoe_plugin", "cpu-moe", PLUGIN)


def build_checkpoint(path, case: str):
    config_cls, model_cls, overrides, _ = CASES[case]
    path.mkdir(parents=True, exist_ok=True)
    write_byte_tokenizer(path)
    config = getattr(transformers, config_cls)(**{**BASE, **overrides})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = getattr(transformers, model_cls)(config)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # wider than the default init: greedy choices are not near-ties
        for name, p in model.named_parameters():
            scale = 0.2 if "embed" in name else 0.08
            p.copy_(
                torch.randn(p.shape, generator=gen) * scale
                if p.dim() >= 2
                else 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
            )
    model.to(torch.float32).save_pretrained(path, safe_serialization=True)


def prompts() -> list[list[int]]:
    rng = random.Random(5)
    shared = [rng.randrange(3, VOCAB) for _ in range(21)]
    out = [shared + [rng.randrange(3, VOCAB) for _ in range(n)] for n in (2, 9)]
    return out + [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 13, 37)]


def two_rounds(llm: LLM) -> list[list[tuple[list[int], list[float]]]]:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0) for n in MAX_TOKENS]
    rounds = []
    for order in (slice(None), slice(None, None, -1)):
        outs = llm.generate(prompts()[order], params[order], use_tqdm=False)[order]
        rounds.append(
            [
                (o.outputs[0].token_ids, [e[t].logprob for t, e in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
                for o in outs
            ]
        )
    return rounds


@pytest.fixture(scope="module")
def checkpoints(plugin, tmp_path_factory):
    cache = {}

    def get(case: str):
        if case not in cache:
            path = tmp_path_factory.mktemp(case)
            build_checkpoint(path, case)
            cache[case] = (path, two_rounds(LLM(model=str(path), device="cpu", **ENGINE)))
        return cache[case]

    return get


@pytest.mark.parametrize("case", list(CASES))
def test_experts_on_another_platform_equal_one_platform(case, plugin, checkpoints, monkeypatch):
    path, want = checkpoints(case)
    sparse = CASES[case][3]
    plugin.CALLS.clear()
    llm = LLM(model=str(path), device_map="experts=cpu-moe,*=cpu", **ENGINE)
    assert plugin.CALLS["prepare_moe_weights"] == sparse  # the experts' platform packed them
    eng = llm.llm_engine
    model = eng.runner.model
    assert [p.name for p in eng.runner.layer_platforms] == ["cpu"] * 3
    assert model.expert_placement is not None and model.expert_placement.ops is eng.runner.experts.ops
    forwards = {"n": 0}
    forward = model.forward

    def counting(*args, **kwargs):
        forwards["n"] += 1
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", counting)
    plugin.CALLS.clear()
    got = two_rounds(llm)
    for round_, (g, w) in enumerate(zip(got, want)):
        for i, ((tokens, lps), (want_tokens, want_lps)) in enumerate(zip(g, w)):
            assert tokens == want_tokens, (round_, i)
            for j, (a, b) in enumerate(zip(lps, want_lps)):
                assert math.isclose(a, b, abs_tol=2e-4), (round_, i, j)
    # Only the routed experts ran on cpu-moe: fused_moe once per sparse layer and step.
    assert dict(plugin.CALLS) == {"fused_moe": forwards["n"] * sparse} and forwards["n"] > 0
    assert eng.kv.prefix_hits > 0
    eng.kv.pool.check_invariants()
    assert eng.kv.pool.num_in_use == 0


def test_class_form_parsing_and_normalisation():
    assert device_map_classes("cpu:2,cuda") == ("cpu:2,cuda", {})
    assert device_map_classes(" *=cuda , experts=cpu ") == ("cuda", {"experts": "cpu"})
    dc = DeviceConfig(device_map="*=cpu,experts=cpu-moe")
    assert dc.device_map == "experts=cpu-moe,*=cpu" and dc.device == "cpu"
    assert DeviceConfig(device_map=["experts=cpu-moe", "*=cpu"]).device_map == "experts=cpu-moe,*=cpu"


@pytest.mark.parametrize(
    "device_map,message",
    [
        ("attention=cpu,*=cpu", "unknown tensor class 'attention'"),
        ("experts=cpu", "add '*=PLATFORM'"),
        ("experts=cpu,*=cpu:2", "does not combine"),
        ("cpu:1,experts=cpu,*=cpu", "does not combine"),
        ("experts=cpu,experts=cpu,*=cpu", "twice"),
        ("experts=,*=cpu", "must name one platform"),
    ],
)
def test_malformed_class_maps_are_refused(device_map, message):
    with pytest.raises(ValueError, match="device_map") as err:
        DeviceConfig(device_map=device_map)
    assert message in str(err.value)


def test_unknown_platform_and_conflicting_device_are_refused(plugin, tiny_checkpoint_factory):
    path = tiny_checkpoint_factory(arch="llama", num_layers=2, num_heads=4, num_kv_heads=2)
    with pytest.raises(ValueError, match="unknown platform 'gpu9'"):
        LLM(model=str(path), device_map="experts=gpu9,*=cpu", **ENGINE)
    with pytest.raises(ValueError, match="conflicts with device_map"):
        LLM(model=str(path), device="cpu-moe", device_map="experts=cpu,*=cpu", **ENGINE)


def test_a_model_without_experts_is_refused_before_loading(plugin, tiny_checkpoint_factory, monkeypatch):
    from pagedserve.executor.model_runner import ModelRunner

    def no_load(*args, **kwargs):
        raise AssertionError("weights loaded before the map was checked")

    monkeypatch.setattr(ModelRunner, "load_weights", no_load)
    path = tiny_checkpoint_factory(arch="llama", num_layers=2, num_heads=4, num_kv_heads=2)
    with pytest.raises(ValueError, match="LlamaForCausalLM has none it can place"):
        LLM(model=str(path), device_map="experts=cpu-moe,*=cpu", **ENGINE)


@pytest.mark.parametrize(
    "extra,message",
    [
        (dict(tensor_parallel_size=2), "tensor/pipeline parallelism"),
        (dict(cpu_offload_gb=1), "cpu_offload_gb"),
        (dict(quantization="int8"), "quantization='int8' cannot be combined"),
    ],
)
def test_incompatible_settings_are_refused_by_rule(extra, message, plugin, checkpoints, monkeypatch):
    from pagedserve.executor.model_runner import ModelRunner

    monkeypatch.setattr(ModelRunner, "load_weights", lambda *a, **k: pytest.fail("weights loaded"))
    path, _ = checkpoints("qwen3moe")
    with pytest.raises(ValueError, match=message):
        LLM(model=str(path), device_map="experts=cpu-moe,*=cpu", **{**ENGINE, **extra})


def test_the_flag_keeps_the_classes(plugin):
    import argparse

    from pagedserve.entrypoints.cli.device_map_arg import device_map_arg

    assert device_map_arg("*=cpu, experts=cpu-moe") == "experts=cpu-moe,*=cpu"
    with pytest.raises(argparse.ArgumentTypeError, match="unknown platform 'gpu9'"):
        device_map_arg("experts=gpu9,*=cpu")


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake_keep_the_experts_placed(level, plugin, checkpoints):
    path, want = checkpoints("qwen3moe")
    llm = LLM(model=str(path), device_map="experts=cpu-moe,*=cpu", enable_sleep_mode=True, **ENGINE)
    llm.sleep(level)
    llm.wake_up()
    plugin.CALLS.clear()
    got = two_rounds(llm)
    assert [[t for t, _ in r] for r in got] == [[t for t, _ in r] for r in want]
    assert llm.llm_engine.runner.model.expert_placement is not None
    assert set(plugin.CALLS) == {"fused_moe"}  # rebuilt on waking, the experts still run on cpu-moe
