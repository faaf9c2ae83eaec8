"""End to end, float32, tiny random checkpoints: the host KV tier and swap preemption
change how much is computed, never what is generated."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.executor.model_runner import kv_bytes_per_block
from pagedserve.offload.cost import PreemptionCostModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))
from hf_reference import hf_greedy, load_hf  # noqa: E402

SHAPE = dict(arch="llama", num_heads=4, num_kv_heads=2)
VOCAB = 259


def shared_prefix_rounds(seed: int, n_prefixes: int = 4, prefix_len: int = 24) -> list[list[list[int]]]:
    """Two rounds of prompts over the same prefixes with different 3-token suffixes."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, VOCAB) for _ in range(prefix_len)] for _ in range(n_prefixes)]
    return [[p + [rng.randrange(3, VOCAB) for _ in range(3)] for p in prefixes] for _ in range(2)]


# 16 device blocks of 4 tokens (64 tokens) for prefixes of 24 tokens: the first round's
# prefixes are evicted from the device by the time the second round asks for them.
SMALL_DEVICE = dict(
    dtype="float32",
    block_size=4,
    num_gpu_blocks_override=16,
    max_model_len=64,
    max_num_batched_tokens=64,
    max_num_seqs=2,
)


def run_rounds(path, rounds, **kwargs):
    llm = LLM(model=str(path), **SMALL_DEVICE, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs, computed = [], []
    kv = llm.llm_engine.kv
    for prompts in rounds:
        before = kv.num_scheduled_tokens
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        computed.append(kv.num_scheduled_tokens - before)
    return llm, outs, computed


def test_spilled_prefixes_are_reloaded_not_recomputed(tiny_checkpoint_factory):
    path = tiny_checkpoint_factory(**SHAPE)
    rounds = shared_prefix_rounds(1)
    _, base_outs, base_computed = run_rounds(path, rounds)
    llm, outs, computed = run_rounds(path, rounds, kv_offload_memory="256KiB")
    assert outs == base_outs
    kv = llm.llm_engine.kv
    assert kv.num_spilled_blocks > 0 and kv.num_reloaded_tokens > 0
    # Round two: every 24-token prefix (6 blocks) comes back from host or device; only
    # the 3-token suffixes and the 3 decode steps per request are computed.
    assert computed[1] == 4 * (3 + 3)
    assert base_computed[1] > computed[1] + 3 * 24  # without the tier most prefixes are recomputed
    kv.check_invariants()
    assert kv.pool.num_in_use == 0 and all(b.ref_cnt == 0 for b in kv.host.blocks)
    # The same outputs as transformers.
    model = load_hf(path)
    assert outs[1] == [hf_greedy(model, p, 4) for p in rounds[1]]


def make_prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, VOCAB) for _ in range(13)]
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 5, 17, 30)]
    prompts += [shared + [rng.randrange(3, VOCAB) for _ in range(n)] for n in (2, 9)]
    return prompts


# ~11 blocks of 8 tokens for 6 requests of up to ~45 tokens: preemption is forced.
PREEMPTING = dict(
    dtype="float32", max_num_batched_tokens=64, block_size=8, num_gpu_blocks_override=11, max_model_len=88
)
MAX_NEW = [12, 20, 7, 16, 10, 14]


@pytest.fixture(scope="module")
def preempting_reference(tiny_checkpoint_factory):
    path = tiny_checkpoint_factory(**SHAPE)
    model = load_hf(path)
    prompts = make_prompts(7)
    return path, prompts, [hf_greedy(model, p, n) for p, n in zip(prompts, MAX_NEW)]


@pytest.mark.compat("preemption_swap", "single")
@pytest.mark.parametrize("mode", ["swap", "recompute", "auto"])
def test_swap_preemption_gives_identical_outputs(mode, preempting_reference):
    path, prompts, expected = preempting_reference
    llm = LLM(model=str(path), **PREEMPTING, kv_offload_memory="1MiB", preemption_mode=mode)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_NEW]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    eng = llm.llm_engine
    assert eng.scheduler.num_preemptions > 0
    if mode == "swap":
        assert eng.kv.num_swap_outs == eng.scheduler.num_preemptions
        assert eng.kv.num_swapped_in_tokens > 0
    if mode == "recompute":
        assert eng.kv.num_swap_outs == 0
    eng.kv.check_invariants()
    assert eng.kv.pool.num_in_use == 0 and all(b.ref_cnt == 0 for b in eng.kv.host.blocks)


def test_swap_computes_fewer_tokens_than_recompute(preempting_reference):
    path, prompts, _ = preempting_reference
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_NEW]
    computed = {}
    for mode in ("swap", "recompute"):
        # No prefix caching: a recomputed request really recomputes everything.
        llm = LLM(
            model=str(path), **PREEMPTING, kv_offload_memory="1MiB", preemption_mode=mode, enable_prefix_caching=False
        )
        llm.generate(prompts, params, use_tqdm=False)
        computed[mode] = llm.llm_engine.kv.num_scheduled_tokens
    useful = sum(len(p) for p in prompts) + sum(n - 1 for n in MAX_NEW)
    assert computed["swap"] == useful
    assert computed["recompute"] > useful


def test_abort_while_swapped_out_leaks_nothing(preempting_reference):
    path, prompts, _ = preempting_reference
    llm = LLM(model=str(path), **PREEMPTING, kv_offload_memory="1MiB", preemption_mode="swap")
    eng = llm.llm_engine
    for i, (p, n) in enumerate(zip(prompts, MAX_NEW)):
        eng.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    swapped_seen = False
    for _ in range(200):
        eng.step()
        eng.kv.check_invariants()
        if eng.kv._swapped:
            swapped_seen = True
            eng.abort_request(list(eng.groups))
            break
    assert swapped_seen
    assert not eng.has_unfinished_requests()
    eng.kv.take_transfers()
    eng.kv.check_invariants()
    assert eng.kv.pool.num_in_use == 0 and all(b.ref_cnt == 0 for b in eng.kv.host.blocks)
    # The engine keeps working afterwards.
    out = llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_host_tier_respects_its_memory_limit(tiny_checkpoint_factory):
    path = tiny_checkpoint_factory(**SHAPE)
    limit = 100_000
    llm = LLM(model=str(path), **SMALL_DEVICE, kv_offload_memory=limit)
    runner = llm.llm_engine.runner
    per_block = kv_bytes_per_block(runner.arch, 4, runner.dtype)
    host_bytes = sum(t.numel() * t.element_size() for pair in runner.host_kv_caches for t in pair)
    assert llm.llm_engine.kv.host.num_blocks == limit // per_block
    assert host_bytes == (limit // per_block) * per_block <= limit
    with pytest.raises(ValueError, match="holds no KV block"):
        LLM(model=str(path), **SMALL_DEVICE, kv_offload_memory=per_block - 1)
    with pytest.raises(ValueError, match="needs a host KV tier"):
        LLM(model=str(path), **SMALL_DEVICE, preemption_mode="swap")


def test_cost_model_compares_copy_time_with_recompute_time():
    m = PreemptionCostModel(
        "auto", bytes_per_block=1000, flops_per_token=1e6, host_copy_bandwidth=1e9, compute_flops=1e10
    )
    # swap: 2 * 10 blocks * 1000 B / 1e9 B/s = 20 us; recompute 160 tokens: 16 ms.
    assert m(10, 160)
    # A compute-rich platform with a slow link recomputes instead.
    fast = PreemptionCostModel("auto", 1000, 1e6, host_copy_bandwidth=1e6, compute_flops=1e14)
    assert not fast(10, 160)
    assert PreemptionCostModel("swap", 1000, 1e6, 1e6, 1e14)(10, 160)
    assert not PreemptionCostModel("recompute", 1000, 1e6, 1e9, 1e10)(10, 160)


def test_generate_cli_takes_the_offload_flags(tiny_checkpoint_factory, capsys):
    import json

    from pagedserve.entrypoints.cli import main

    path = tiny_checkpoint_factory(**SHAPE)
    argv = [
        "generate",
        str(path),
        "-p",
        "hello",
        "--max-tokens",
        "3",
        "--dtype",
        "float32",
        "--json",
        "--kv-cache-memory",
        "1MiB",
        "--kv-offload-memory",
        "1MiB",
        "--preemption-mode",
        "swap",
        "--cpu-offload-gb",
        "0.001",
    ]
    assert main(argv) == 0
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("{")]
    assert len(json.loads(line)["token_ids"]) == 3
