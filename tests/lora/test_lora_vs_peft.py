"""Four random adapters and the base model mixed in one batch, with prefix caching and
preemption on: every sequence's greedy tokens and logprobs equal transformers + peft
with that adapter merged (teacher-forced over the engine's own tokens)."""

from __future__ import annotations

import pytest
import torch
from peft_adapters import logprobs_of, make_adapter, merged_model

from pagedserve import LLM, SamplingParams
from pagedserve.lora import LoRARequest

pytest.importorskip("peft")

# (rank, alpha, targets, rsLoRA): fused qkv in part and whole, gate_up, o/down.
ADAPTERS = [
    (8, 16, ("q_proj", "v_proj"), False),
    (16, 8, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), True),
    (4, 4, ("gate_proj", "down_proj"), False),
    (12, 24, ("k_proj", "o_proj", "up_proj"), False),
]
MAX_NEW = 12


@pytest.fixture(scope="module")
def setup(tiny_llama, tmp_path_factory):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    root = tmp_path_factory.mktemp("adapters")
    paths = [
        make_adapter(hf, root / f"a{i}", seed=100 + i, r=r, alpha=al, targets=t, rslora=rs)
        for i, (r, al, t, rs) in enumerate(ADAPTERS)
    ]
    return hf, paths


def check_against_peft(outs, prompts, loras, hf, paths, atol=2e-3):
    refs = {None: hf}
    for out, ids, lora in zip(outs, prompts, loras):
        key = None if lora is None else lora.lora_path
        if key not in refs:
            refs[key] = merged_model(hf, paths[lora.lora_int_id - 1])
        seq = out.outputs[0]
        lps = logprobs_of(refs[key], ids + list(seq.token_ids))
        for j, (tok, entry) in enumerate(zip(seq.token_ids, seq.logprobs)):
            row = lps[len(ids) - 1 + j]
            assert tok == int(row.argmax()) or row.max() - row[tok] < 1e-4, (key, j)
            assert abs(entry[tok].logprob - float(row[tok])) < atol, (key, j, entry[tok].logprob, float(row[tok]))


@pytest.mark.compat("lora", "single")
def test_mixed_batch_matches_peft(tiny_llama, setup):
    hf, paths = setup
    llm = LLM(
        model=str(tiny_llama),
        dtype="float32",
        enable_lora=True,
        max_loras=4,
        max_lora_rank=16,
        num_gpu_blocks_override=14,
        block_size=16,
        max_model_len=128,
        max_num_batched_tokens=64,
        enable_prefix_caching=True,
    )
    reqs = [LoRARequest(f"ad{i}", i + 1, str(p)) for i, p in enumerate(paths)]
    gen = torch.Generator().manual_seed(0)
    shared = torch.randint(3, 200, (40,), generator=gen).tolist()  # the same prompt under every adapter
    prompts, loras = [], []
    for lora in [None, *reqs]:
        prompts.append(shared)
        loras.append(lora)
        prompts.append(torch.randint(3, 200, (21,), generator=gen).tolist())
        loras.append(lora)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=1)
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    check_against_peft(outs, prompts, loras, hf, paths)
    engine = llm.llm_engine
    assert engine.scheduler.num_preemptions > 0  # the small KV pool forced recompute
    # Adapters change the output: the shared prompt continues differently under each.
    assert len({tuple(outs[i].outputs[0].token_ids) for i in range(0, 10, 2)}) > 2
    assert engine.kv.pool.num_in_use == 0

    # A second round: the shared prompt is cached per adapter, never across adapters.
    again = llm.generate([shared] * 5, params, use_tqdm=False, lora_request=[None, *reqs])
    for i in range(5):
        assert again[i].outputs[0].token_ids == outs[2 * i].outputs[0].token_ids
    assert engine.kv.pool.num_in_use == 0


def test_more_adapters_than_slots(tiny_llama, setup):
    """max_loras=2 with 4 adapters in flight: the scheduler holds back the others, slots
    are reused (LRU), results still equal peft."""
    hf, paths = setup
    llm = LLM(
        model=str(tiny_llama),
        dtype="float32",
        enable_lora=True,
        max_loras=2,
        max_cpu_loras=3,
        max_lora_rank=16,
        kv_cache_memory="8MiB",
    )
    reqs = [LoRARequest(f"ad{i}", i + 1, str(p)) for i, p in enumerate(paths)]
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 200, (9 + i,), generator=gen).tolist() for i in range(8)]
    loras = [reqs[i % 4] if i % 3 else None for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    check_against_peft(outs, prompts, loras, hf, paths)
    assert llm.llm_engine.lora.num_loads > 4  # the host LRU (3) evicted and reloaded
