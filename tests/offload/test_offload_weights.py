"""Weight offload (cpu_offload_gb): greedy outputs unchanged, weights really streamed from
their host copies every forward, and the byte budget respected.  On this machine the CPU
platform plays both tiers, so "device" staging slots and host copies are CPU tensors."""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.quantization.base import QuantizedWeight

SHAPE = dict(arch="llama", num_heads=4, num_kv_heads=2, num_layers=4)
ENGINE = dict(dtype="float32", block_size=8, kv_cache_memory="4MiB", max_model_len=128)


def layer_bytes(layer) -> int:
    names = ("input_norm", "post_norm", "qkv", "o", "gate_up", "down")
    return sum(getattr(layer, n).numel() * getattr(layer, n).element_size() for n in names)


def prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, 259) for _ in range(n)] for n in (5, 17, 30)]


PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def generate(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), PARAMS, use_tqdm=False)]


@pytest.fixture(scope="module")
def setup(tiny_checkpoint_factory):
    path = tiny_checkpoint_factory(**SHAPE)
    base = LLM(model=str(path), **ENGINE)
    per_layer = layer_bytes(base.llm_engine.runner.model.layers[0])
    return path, generate(base), per_layer


@pytest.mark.parametrize("num_offloaded", [1, 3, 4])
def test_outputs_identical_and_budget_respected(num_offloaded, setup):
    path, expected, per_layer = setup
    gb = (num_offloaded * per_layer + per_layer // 2) / 1e9  # room for num_offloaded, not one more
    llm = LLM(model=str(path), **ENGINE, cpu_offload_gb=gb)
    streamer = llm.llm_engine.weight_streamer
    assert streamer.offloaded == list(range(num_offloaded))
    assert streamer.offloaded_bytes == num_offloaded * per_layer <= gb * 1e9
    steps = 0
    runner = llm.llm_engine.runner
    execute = runner.execute

    def counting(*a, **k):
        nonlocal steps
        steps += 1
        return execute(*a, **k)

    runner.execute = counting
    assert generate(llm) == expected
    # Every forward streamed every offloaded layer once.
    assert streamer.num_layer_copies == steps * num_offloaded
    # Offloaded layers keep only their host copies; the forward runs on staging slots.
    slot_ptrs = {s.qkv.data_ptr() for s in streamer.slots}
    for i in streamer.offloaded:
        assert runner.model.layers[i].qkv.data_ptr() not in slot_ptrs


def test_weights_come_from_the_host_copy_each_forward(setup):
    path, expected, per_layer = setup
    llm = LLM(model=str(path), **ENGINE, cpu_offload_gb=2.5 * per_layer / 1e9)
    streamer = llm.llm_engine.weight_streamer
    assert generate(llm) == expected
    # Scribbling on the staging slots between steps changes nothing: each forward copies anew.
    with torch.inference_mode():
        for slot in streamer.slots:
            slot.gate_up.fill_(7.0)
    assert generate(llm) == expected
    # Changing the host copy does change the outputs: it is what the forward uses.
    with torch.inference_mode():
        llm.llm_engine.runner.model.layers[1].gate_up.mul_(-3.0)
    assert generate(llm) != expected


def test_no_offload_by_default_and_budget_below_one_layer(setup):
    path, expected, per_layer = setup
    assert LLM(model=str(path), **ENGINE).llm_engine.weight_streamer is None
    llm = LLM(model=str(path), **ENGINE, cpu_offload_gb=per_layer / 2 / 1e9)
    assert llm.llm_engine.weight_streamer.offloaded == []
    assert generate(llm) == expected
    with pytest.raises(ValueError, match="cpu_offload_gb"):
        LLM(model=str(path), **ENGINE, cpu_offload_gb=-1.0)


def _quantized_bytes(layer) -> int:
    total = 0
    for name in ("input_norm", "post_norm", "qkv", "o", "gate_up", "down"):
        w = getattr(layer, name)
        total += sum(t.numel() * t.element_size() for t in (w.tensors() if isinstance(w, QuantizedWeight) else [w]))
    return total


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_quantized_layers_stream_their_quantized_bytes(method, setup):
    """Offloaded quantized layers keep their integers and scales (not a float copy) on the
    host, stream them into staging weights of the same kind, and answer as resident ones."""
    path = setup[0]
    resident = LLM(model=str(path), **ENGINE, quantization=method)
    expected = generate(resident)
    layers = resident.llm_engine.runner.model.layers
    per_layer = _quantized_bytes(layers[0])
    assert per_layer < setup[2] / 3  # int8/fp8 weights with float norms: well under the float32 layer
    llm = LLM(model=str(path), **ENGINE, quantization=method, cpu_offload_gb=2.5 * per_layer / 1e9)
    streamer = llm.llm_engine.weight_streamer
    assert streamer.offloaded == [0, 1] and streamer.offloaded_bytes == 2 * per_layer
    runner = llm.llm_engine.runner
    for i in streamer.offloaded:
        w = runner.model.layers[i].gate_up
        assert isinstance(w, QuantizedWeight) and w.qweight.itemsize == 1
    assert generate(llm) == expected
    assert streamer.num_layer_copies > 0
    # The forward reads the host copy: scaling one layer's quantized scales changes the outputs.
    with torch.inference_mode():
        runner.model.layers[1].gate_up.scale.mul_(-3.0)
    assert generate(llm) != expected
