"""The engine at the head sizes the native CPU attention implements (64, 80, 96, 128,
256): outputs equal transformers', and the op counters of kernels/cpu/native.py show
that a native kernel ran every attention call (none fell back to the torch
reference).  A head size outside that list falls back, is logged once and shows in
``pagedserve platforms --ops --model``."""

from __future__ import annotations

import logging
import random

import pytest
from hf_reference import engine_token_logprobs, hf_greedy, hf_token_logprobs, load_hf

from pagedserve import LLM, SamplingParams
from pagedserve.entrypoints.cli.platforms_cmd import collect
from pagedserve.kernels.cpu import native

pytestmark = pytest.mark.usefixtures("cpu_kernels")

NATIVE_HEAD_SIZES = (64, 80, 96, 128, 256)


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (3, 19, 40)]


def _attention_calls() -> dict[str, int]:
    return {k: v for k, v in native.OP_CALLS.items() if k.startswith("paged_attention:")}


def _delta(before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in _attention_calls().items() if v != before.get(k, 0)}


def test_native_head_sizes_are_what_this_suite_covers(cpu_kernels):
    # The list above is the kernel's: a head size added to or dropped from the kernel
    # must come with this suite's update.
    assert tuple(sorted(cpu_kernels.head_sizes)) == NATIVE_HEAD_SIZES


@pytest.mark.parametrize("head_dim", NATIVE_HEAD_SIZES)
def test_engine_at_native_head_size_runs_native_attention(head_dim, tiny_checkpoint_factory):
    path = tiny_checkpoint_factory(arch="llama", hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=head_dim)
    prompts = _prompts(259)
    n = 8
    # Chunked prefill (small token budget) and batched decode: both kinds of step.
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=16, block_size=8)
    before = _attention_calls()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    ran = _delta(before)
    assert ran.get("paged_attention:native", 0) > 0, ran
    assert set(ran) <= {"paged_attention:native", "paged_attention:amx"}, ran

    hf = load_hf(path)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, n) for p in prompts]
    # Teacher-forced: per-position logprobs of a fixed sequence, tie-free.
    seq = prompts[2] + outs[2].outputs[0].token_ids
    got = llm.generate([seq], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    ours = engine_token_logprobs(got.prompt_logprobs, seq)
    ref = hf_token_logprobs(hf, seq)
    assert max(abs(a - b) for a, b in zip(ours, ref)) < 1e-3


@pytest.mark.parametrize("head_dim", [64, 128])
def test_bf16_engine_runs_native_or_amx_attention(head_dim, tiny_checkpoint_factory):
    # The served dtype: prefill may go to the AMX tiles (or, without AMX, the AVX-512
    # BF16 tiling), decode to the native kernel.
    path = tiny_checkpoint_factory(arch="llama", hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=head_dim)
    prompts = _prompts(259)
    llm = LLM(model=str(path), dtype="bfloat16", kv_cache_memory="16MiB")
    before = _attention_calls()
    seq = prompts[2]
    out = llm.generate([seq], SamplingParams(max_tokens=6, prompt_logprobs=0, ignore_eos=True), use_tqdm=False)[0]
    ran = _delta(before)
    tiles = ran.get("paged_attention:amx", 0) + ran.get("paged_attention:bf16_prefill", 0)
    assert ran.get("paged_attention:native", 0) + tiles > 0, ran
    assert "paged_attention:reference" not in ran, ran
    assert ran.get("paged_attention:native", 0) > 0, ran  # the decode steps
    ours = engine_token_logprobs(out.prompt_logprobs, seq)
    ref = hf_token_logprobs(load_hf(path), seq)
    # bf16 against float32: bounded by bf16 rounding of the activations.
    assert max(abs(a - b) for a, b in zip(ours, ref)) < 0.15


def test_fallback_head_size_is_counted_logged_once_and_reported(tiny_llama, monkeypatch, caplog):
    monkeypatch.setattr(native, "FALLBACKS", {})
    caplog.set_level(logging.WARNING, logger=native.logger.name)
    llm = LLM(model=str(tiny_llama), dtype="float32", kv_cache_memory="16MiB")  # head size 16
    before = _attention_calls()
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for _ in range(2):
        llm.generate([[5, 6, 7], [8, 9]], params, use_tqdm=False)
    ran = _delta(before)
    assert ran.get("paged_attention:reference", 0) > 0 and "paged_attention:native" not in ran, ran
    reason = "paged_attention: head size 16 (native: 64, 80, 96, 128, 256)"
    assert native.FALLBACKS.get(reason, 0) == ran["paged_attention:reference"]
    logged = [r for r in caplog.records if "head size 16" in r.getMessage()]
    assert len(logged) == 1, [r.getMessage() for r in logged]

    report = collect(device="cpu", want_ops=True, model=str(tiny_llama))
    assert report.model_attention["attention"] == "reference"
    assert "head size 16" in report.model_attention["reason"]
    assert reason in report.native["fallbacks"]


def test_platforms_ops_reports_native_attention_for_a_native_head_size(tiny_checkpoint_factory):
    path = tiny_checkpoint_factory(arch="llama", hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=64)
    report = collect(device="cpu", want_ops=True, model=str(path))
    assert report.model_attention["attention"] == "native" and report.model_attention["reason"] is None
    assert report.native["attention_head_sizes"] == list(NATIVE_HEAD_SIZES)
