"""Adapters where the layers are not plain resident weights of one device, and under
speculative decoding: weight offload (``cpu_offload_gb``: offloaded layers run on
staging copies that the adapters must follow), a device map across two platforms (each
segment's adapters and row -> slot map on its device, run with its own ops), and n-gram
and self-quantized drafts (the verifier's rows of a request under its adapter).  The base
model and two adapters in one batch equal transformers + peft with the adapter merged,
as the single-process engine does (test_lora_vs_peft.py).
"""

from __future__ import annotations

import pytest
import torch
from peft_adapters import make_adapter
from plugin_dists import counted_cpu_platform, install_plugin
from test_lora_vs_peft import check_against_peft

from pagedserve import LLM, SamplingParams
from pagedserve.lora import LoRARequest

pytest.importorskip("peft")

SHAPE = dict(arch="llama", num_layers=4, num_heads=4, num_kv_heads=2)
ENGINE = dict(dtype="float32", block_size=8, kv_cache_memory="4MiB", max_model_len=128)
LORA = dict(enable_lora=True, max_loras=2, max_lora_rank=8)
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# A second host platform whose ops are counted reference ops: a segment that ran its
# layers with the CPU platform's ops instead would leave the count at zero.
PLUGIN = counted_cpu_platform("CountedCpuPlatform", "cpu-lora")


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    """The ``cpu-lora`` platform as an installed distribution (entry point on sys.path)."""
    yield from install_plugin(tmp_path_factory, "pslora_plugin", "cpu-lora", PLUGIN)


@pytest.fixture(scope="module")
def setup(tiny_checkpoint_factory, tmp_path_factory):
    import transformers

    path = tiny_checkpoint_factory(**SHAPE)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    root = tmp_path_factory.mktemp("adapters")
    paths = [
        make_adapter(hf, root / "a1", seed=7, r=8, alpha=16, targets=ALL),
        make_adapter(hf, root / "a2", seed=8, r=4, alpha=8, targets=("q_proj", "v_proj", "o_proj", "down_proj")),
    ]
    loras = [LoRARequest(f"a{i + 1}", i + 1, str(p)) for i, p in enumerate(paths)]
    gen = torch.Generator().manual_seed(5)
    motif = torch.randint(3, 200, (6,), generator=gen).tolist()
    # Repeated motifs give the n-gram proposer matches to draft from.
    prompts = [motif * 4, torch.randint(3, 200, (19,), generator=gen).tolist(), motif * 3 + [7, 9]]
    prompts = prompts + prompts
    per_prompt = [None, loras[0], loras[1], loras[0], loras[1], None]
    layer_bytes = sum(p.numel() * p.element_size() for p in hf.model.layers[0].parameters())
    return path, hf, paths, prompts, per_prompt, layer_bytes


def run(setup, **kw):
    path, hf, paths, prompts, loras, _ = setup
    llm = LLM(model=str(path), **ENGINE, **LORA, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1)
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    check_against_peft(outs, prompts, loras, hf, paths)
    return llm


@pytest.mark.compat("lora", "cpu_offload")
def test_weight_offload(setup):
    llm = run(setup, cpu_offload_gb=2.5 * setup[-1] / 1e9)  # two of the four layers
    streamer = llm.llm_engine.weight_streamer
    assert streamer.offloaded == [0, 1] and streamer.num_layer_copies > 0


@pytest.mark.compat("lora", "device_map")
def test_device_map_across_platforms(setup, plugin):
    plugin.CALLS.clear()
    llm = run(setup, device="cpu", device_map="cpu:1,cpu-lora")
    assert [s.platform.name for s in llm.llm_engine.runner.segments] == ["cpu", "cpu-lora"]
    assert plugin.CALLS["lora_linear"] > 0  # the second segment's adapters ran with its ops


def test_ngram_speculative_decoding(setup):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}
    llm = run(setup, speculative_config=spec)
    decoder = llm.llm_engine.spec
    assert decoder.num_drafts > 0 and decoder.num_accepted_tokens > 0


def test_self_quantized_speculative_decoding(setup):
    spec = {"method": "self_quantized", "num_speculative_tokens": 2, "quantization": "int8"}
    llm = run(setup, speculative_config=spec)
    decoder = llm.llm_engine.spec
    assert decoder.num_drafts > 0 and decoder.num_accepted_tokens > 0
