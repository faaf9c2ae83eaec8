"""Paged attention on AMX tiles (kernels/cpu/attention_amx.cpp) and the CPU platform's
attention candidates (platforms/cpu/attention_ops.py) against kernels/reference.py, on
fresh random inputs, outputs poisoned with NaN first.  The AMX tests are skipped, with
the reason, on CPUs without AMX; the candidates that exist everywhere run everywhere."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import reference
from pagedserve.kernels.cpu.attention_amx import amx_unavailable_reason, load_amx_attention
from pagedserve.kernels.cpu.prefill_attn import bf16_prefill_unavailable_reason
from pagedserve.platforms.cpu.attention_ops import attention_candidates, make_prefill_split, sdpa_paged_attention
from tests.kernels.paged_attention_checks import (
    BF16,
    MIXED,
    check,
    check_default_model_prefill_chunk,
    check_deterministic_across_calls_and_threads,
    check_mixed_batch,
    check_rejects_bad_block_ids,
    check_unsupported_features_run_the_fallback,
    gen_for,
    load_or_skip,
    over_mixed_batch_shapes,
)
from tests.kernels.test_cpu_kernels import assert_close, make_batch


@pytest.fixture(scope="module")
def amx():
    return load_or_skip(amx_unavailable_reason, load_amx_attention, "AMX attention", "AMX")


@over_mixed_batch_shapes
def test_amx_mixed_batch(amx, head_size, block_size, heads):
    check_mixed_batch(amx.paged_attention, (), head_size, block_size, heads, "amx")


@pytest.mark.parametrize("head_major", [False, True], ids=["token-major", "head-major"])
@pytest.mark.parametrize("threads", [1, 2])
def test_amx_default_model_prefill_chunk(amx, head_major, threads):
    check_default_model_prefill_chunk(amx.paged_attention, "", head_major, threads)


def test_amx_is_deterministic_across_calls_and_threads(amx):
    check_deterministic_across_calls_and_threads(amx.paged_attention, "")


def test_amx_refuses_nothing_it_cannot_do(amx):
    """Windows, soft caps, sinks, fp32 and head size 80 run the reference, not the tiles."""
    check_unsupported_features_run_the_fallback(amx.paged_attention, "")


def test_amx_rejects_bad_block_ids(amx):
    check_rejects_bad_block_ids(amx.paged_attention, "")


# ---- candidates (no AMX needed) -------------------------------------------------------


@pytest.mark.parametrize("min_tokens", [1, 8, 10_000])
def test_prefill_split_routes_runs_of_sequences(min_tokens):
    """The split gives each run of sequences to one function and the union is exact."""
    calls: list[tuple[str, int]] = []

    def tagged(name):
        def fn(*args, **kwargs):
            calls.append((name, args[4].shape[0]))
            return reference.paged_attention(*args, **kwargs)

        return fn

    split = make_prefill_split(tagged("prefill"), tagged("decode"), min_tokens)
    args = make_batch([(1, 30), (1, 9), (12, 50), (20, 20), (1, 64), (9, 70)], 9, 3, 64, 16, BF16, gen_for("split"))
    check(split, args, what=f"split min_tokens={min_tokens}")
    if min_tokens == 8:
        assert calls == [("decode", 2), ("prefill", 2), ("decode", 1), ("prefill", 1)]
    else:
        assert len(calls) == 1


def test_sdpa_candidate_matches_reference():
    args = make_batch(MIXED, 9, 3, 64, 16, BF16, gen_for("sdpa"), head_major=True)
    check(sdpa_paged_attention, args, what="sdpa")


def test_every_candidate_matches_reference(cpu_kernels):
    """Each candidate the platform could choose, on one mixed batch of the default model's heads."""
    candidates = attention_candidates(cpu_kernels)
    assert "native" in candidates and "sdpa" in candidates
    assert ("amx" in candidates) == (amx_unavailable_reason() is None)
    args = make_batch(MIXED, 9, 3, 64, 16, BF16, gen_for("candidates"), head_major=True)
    for name, fn in candidates.items():
        check(fn, args, what=name)


# ---- end to end -----------------------------------------------------------------------

ENGINE_SCRIPT = r"""
import json, sys
from pagedserve import LLM, SamplingParams
from pagedserve.kernels.cpu import attention_amx

calls = [0]
plain = attention_amx.AmxAttention.paged_attention
def counted(self, *args, **kwargs):
    calls[0] += 1
    return plain(self, *args, **kwargs)
attention_amx.AmxAttention.paged_attention = counted

llm = LLM(model=sys.argv[1], dtype="bfloat16", kv_cache_memory="16MiB", max_num_batched_tokens=96,
          long_prefill_token_threshold=48)
prompts = ["the quick brown fox jumps over the lazy dog " * k for k in (1, 3, 7)] + ["abc"]
params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
rounds = []
for _ in range(2):  # the second round continues after prefix-cache hits
    outs = llm.generate(prompts, params, use_tqdm=False)
    got = [o.outputs[0] for o in outs]
    rounds.append([[g.token_ids, [e[t].logprob for t, e in zip(g.token_ids, g.logprobs)]] for g in got])
print("RESULT" + json.dumps({"calls": calls[0], "rounds": rounds}))
"""


@pytest.mark.slow
def test_engine_greedy_unchanged_with_amx(amx, tiny_checkpoint_factory, tmp_path):
    """A tiny random Llama with the default model's head size, bf16, chunked prefills
    and prefix hits: greedy tokens equal and logprobs close with the AMX prefill on and
    off (each engine in its own process, since the platform reads its switch once)."""
    import json
    import os
    import subprocess
    import sys

    path = tiny_checkpoint_factory(hidden_size=192, num_heads=3, num_kv_heads=1, head_dim=64, num_layers=2)
    results = {}
    for on in ("1", "0"):
        env = {**os.environ, "PAGEDSERVE_CPU_AMX_ATTENTION": on}
        proc = subprocess.run(
            [sys.executable, "-c", ENGINE_SCRIPT, str(path)], env=env, capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
        results[on] = json.loads(line[len("RESULT") :])
    assert results["1"]["calls"] > 0 and results["0"]["calls"] == 0
    for r_on, r_off in zip(results["1"]["rounds"], results["0"]["rounds"]):
        for (tok_on, lp_on), (tok_off, lp_off) in zip(r_on, r_off):
            assert tok_on == tok_off
            assert lp_on == pytest.approx(lp_off, abs=2e-2)


def test_platform_registers_amx_prefill_where_amx_exists(cpu_kernels):
    from pagedserve.platforms.cpu.ops import register_cpu_ops
    from pagedserve.platforms.ops import OpRegistry
    from pagedserve.platforms.options import CpuOptions

    assert CpuOptions.from_env({}).amx_attention
    off = CpuOptions.from_env({"PAGEDSERVE_CPU_AMX_ATTENTION": "0"})
    assert not off.amx_attention
    ops, ops_off, ops_tuned = OpRegistry(), OpRegistry(), OpRegistry()
    # The static rule (measured dispatch off; with it on, platforms/cpu/tuned_attention.py,
    # tests/platforms/test_platform_cpu_tuned_attention.py).
    register_cpu_ops(ops, CpuOptions.from_env({"PAGEDSERVE_CPU_TUNE": "0"}))
    register_cpu_ops(ops_off, off)
    register_cpu_ops(ops_tuned, CpuOptions.from_env({}))
    assert ops_off.source("paged_attention") == cpu_kernels.source
    has_amx = amx_unavailable_reason() is None
    # Without AMX, the AVX-512 BF16 tiling where the CPU has it (tests/kernels/test_cpu_prefill_attn.py).
    has_bf16 = not has_amx and bf16_prefill_unavailable_reason() is None
    want = "+amx-prefill" if has_amx else "+bf16-prefill" if has_bf16 else ""
    assert ops.source("paged_attention") == cpu_kernels.source + want
    tiles = "amx" if has_amx else "bf16_tiles"
    tuned = f"+tuned({','.join(sorted([tiles, 'native', 'sdpa']))})" if has_amx or has_bf16 else ""
    assert ops_tuned.source("paged_attention") == cpu_kernels.source + tuned


def test_amx_build_is_gated_on_the_cpu_flags(monkeypatch, tmp_path):
    """Without AMX nothing is built or loaded; with it, its own extension with AMX flags."""
    from pagedserve.kernels import build
    from pagedserve.kernels.cpu import attention_amx

    zen = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"})
    amx_cpu = zen | {"amx_tile", "amx_bf16", "amx_int8"}
    flags = build.auto_cpu_arch_flags(amx_cpu)
    assert "amx_tile" in amx_unavailable_reason(zen, build.auto_cpu_arch_flags(zen))
    assert amx_unavailable_reason(amx_cpu, flags) is None
    assert "AVX-512 BF16" in amx_unavailable_reason(amx_cpu, ["-mavx2", "-mfma"])

    seen = []

    def fake_load_extension(spec, label="", verbose=False):
        seen.append(spec)
        raise build.KernelBuildError("no build in this test")

    monkeypatch.setattr(build, "load_extension", fake_load_extension)
    monkeypatch.setenv("PAGEDSERVE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(attention_amx, "amx_unavailable_reason", lambda: "the CPU lacks amx_tile")
    attention_amx.load_amx_attention.cache_clear()
    try:
        assert attention_amx.load_amx_attention() is None and not seen  # silently, nothing built
        monkeypatch.setattr(attention_amx, "amx_unavailable_reason", lambda: None)
        attention_amx.load_amx_attention.cache_clear()
        with pytest.warns(UserWarning, match="no build in this test"):
            assert attention_amx.load_amx_attention() is None
    finally:
        attention_amx.load_amx_attention.cache_clear()
    (spec,) = seen
    assert spec.directory.parent == tmp_path and [s.name for s in spec.sources] == ["attention_amx.cpp"]
    assert {"-mamx-tile", "-mamx-bf16"} <= set(spec.cflags)


def test_amx_strided_query_and_out(amx):
    """The query as a view of a fused qkv projection and out as a view of a wider buffer,
    as the model hands them over."""
    q, k, v, bt, sl, qsl = make_batch([(40, 90), (1, 33), (12, 12)], 9, 3, 64, 16, BF16, gen_for("strided"))
    qkv = torch.randn(q.shape[0], 15, 64).to(BF16)
    qkv[:, :9] = q
    wide = torch.full((q.shape[0], 12, 64), float("nan"), dtype=BF16)
    got = amx.paged_attention(qkv[:, :9], k, v, bt, sl, qsl, 0.125, wide[:, 2:11])
    expected = reference.paged_attention(q.float(), k.float(), v.float(), bt, sl, qsl, 0.125)
    assert_close(got, expected, BF16, "strided")
    assert wide[:, :2].isnan().all() and wide[:, 11:].isnan().all()
