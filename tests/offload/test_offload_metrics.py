"""Host KV tier counters in EngineStats and on /metrics: they move on workloads that
spill, reload and swap, agree with the tier's own bookkeeping, and stay zero without a
tier."""

from __future__ import annotations

import random

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedserve import LLM, SamplingParams
from pagedserve.entrypoints.openai.metrics import ServerMetrics

SHAPE = dict(arch="llama", num_heads=4, num_kv_heads=2)
VOCAB = 259

HOST_METRICS = {
    "pagedserve:host_kv_cache_blocks": ("gauge", "host_kv_cache_blocks"),
    "pagedserve:host_kv_cache_usage_perc": ("gauge", "host_kv_cache_usage"),
    "pagedserve:host_kv_cache_cached_blocks": ("gauge", "host_kv_cache_cached_blocks"),
    "pagedserve:host_prefix_cache_hits": ("counter", "host_prefix_cache_hits"),
    "pagedserve:kv_blocks_spilled_to_host": ("counter", "kv_blocks_spilled"),
    "pagedserve:kv_spills_dropped": ("counter", "kv_spills_dropped"),
    "pagedserve:kv_blocks_reloaded_from_host": ("counter", "kv_blocks_reloaded"),
    "pagedserve:num_swap_outs": ("counter", "num_swap_outs"),
    "pagedserve:num_swap_ins": ("counter", "num_swap_ins"),
    "pagedserve:kv_blocks_swapped_out": ("counter", "kv_blocks_swapped_out"),
    "pagedserve:kv_blocks_swapped_in": ("counter", "kv_blocks_swapped_in"),
}


def scrape(engine) -> dict[str, tuple[str, float]]:
    """{family name: (type, value)} of the host-tier families on the server's /metrics text."""
    text = ServerMetrics(engine.stats, "tiny").render().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        if fam.name in HOST_METRICS:
            (sample,) = [s for s in fam.samples if not s.name.endswith("_created")]
            assert sample.labels == {"model_name": "tiny", "engine": "0"}
            out[fam.name] = (fam.type, sample.value)
    return out


def assert_metrics_match_stats(engine) -> None:
    stats, scraped = engine.stats(), scrape(engine)
    assert scraped == {
        name: (kind, pytest.approx(getattr(stats, field))) for name, (kind, field) in HOST_METRICS.items()
    }


# 16 device blocks of 4 tokens for prefixes of 24 tokens: the first round's prefixes are
# evicted (and spilled) before the second round asks for them again.
SMALL_DEVICE = dict(
    dtype="float32",
    block_size=4,
    num_gpu_blocks_override=16,
    max_model_len=64,
    max_num_batched_tokens=64,
    max_num_seqs=2,
)


def shared_prefix_rounds() -> list[list[list[int]]]:
    rng = random.Random(1)
    prefixes = [[rng.randrange(3, VOCAB) for _ in range(24)] for _ in range(4)]
    return [[p + [rng.randrange(3, VOCAB) for _ in range(3)] for p in prefixes] for _ in range(2)]


def test_spill_and_reload_counters_move(tiny_checkpoint_factory):
    path = tiny_checkpoint_factory(**SHAPE)
    llm = LLM(model=str(path), **SMALL_DEVICE, kv_offload_memory="256KiB")
    eng, kv = llm.llm_engine, llm.llm_engine.kv
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    start = eng.stats()
    assert start.host_kv_cache_blocks == kv.host.num_blocks > 0
    assert (start.kv_blocks_spilled, start.kv_blocks_reloaded, start.host_prefix_cache_hits) == (0, 0, 0)
    rounds = shared_prefix_rounds()
    llm.generate(rounds[0], params, use_tqdm=False)
    first = eng.stats()
    llm.generate(rounds[1], params, use_tqdm=False)
    second = eng.stats()
    assert 0 < first.kv_blocks_spilled <= second.kv_blocks_spilled == kv.num_spilled_blocks
    assert second.host_kv_cache_cached_blocks == len(kv.host.cached) > 0
    # Round two's prefixes came back from host: every reloaded block is 4 prompt tokens
    # found there (and counted among all prefix-cache hits).
    assert first.kv_blocks_reloaded == 0 < second.kv_blocks_reloaded
    assert second.kv_blocks_reloaded * 4 == kv.num_reloaded_tokens == second.host_prefix_cache_hits
    assert second.prefix_cache_hits >= second.host_prefix_cache_hits
    assert second.host_kv_cache_usage == 0.0  # nothing swapped out or pending once idle
    assert_metrics_match_stats(eng)


def test_swap_counters_move(tiny_checkpoint_factory):
    path = tiny_checkpoint_factory(**SHAPE)
    # ~11 blocks of 8 tokens for 6 requests of up to ~45 tokens: preemption is forced.
    llm = LLM(
        model=str(path),
        dtype="float32",
        max_num_batched_tokens=64,
        block_size=8,
        num_gpu_blocks_override=11,
        max_model_len=88,
        kv_offload_memory="1MiB",
        preemption_mode="swap",
    )
    eng = llm.llm_engine
    rng = random.Random(7)
    for i, n in enumerate((1, 5, 17, 30, 15, 22)):
        prompt = [rng.randrange(3, VOCAB) for _ in range(n)]
        eng.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=12 + i, ignore_eos=True))
    usage_while_swapped = []
    while eng.has_unfinished_requests():
        eng.step()
        if eng.kv._swapped:
            usage_while_swapped.append(eng.stats().host_kv_cache_usage)
            assert_metrics_match_stats(eng)
    stats = eng.stats()
    assert stats.num_swap_outs == stats.num_preemptions > 0
    assert stats.num_swap_ins == stats.num_swap_outs  # every swapped request resumed
    assert stats.kv_blocks_swapped_out > 0 and stats.kv_blocks_swapped_in >= stats.kv_blocks_swapped_out
    assert usage_while_swapped and min(usage_while_swapped) > 0
    assert stats.host_kv_cache_usage == 0.0
    assert_metrics_match_stats(eng)


def test_without_a_host_tier_everything_is_zero(tiny_checkpoint_factory):
    path = tiny_checkpoint_factory(**SHAPE)
    llm = LLM(model=str(path), **SMALL_DEVICE)
    llm.generate(shared_prefix_rounds()[0], SamplingParams(max_tokens=2), use_tqdm=False)
    assert {name: v for name, (_, v) in scrape(llm.llm_engine).items()} == dict.fromkeys(HOST_METRICS, 0.0)
