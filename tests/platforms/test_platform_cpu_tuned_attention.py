"""Measured dispatch of paged_attention (platforms/cpu/tuned_attention.py): the split of
a mixed batch into runs of the candidate its query-token bucket chose (fake candidates,
injected plans), numerics against kernels/reference.py on fresh random mixed batches
(output poisoned with NaN first), the per-machine cache, and the off switch."""

from __future__ import annotations

import zlib

import pytest
import torch

from pagedserve.kernels import reference
from pagedserve.kernels.cpu import load_cpu_kernels
from pagedserve.kernels.cpu.attention_amx import amx_unavailable_reason
from pagedserve.kernels.cpu.prefill_attn import bf16_prefill_unavailable_reason
from pagedserve.platforms.cpu.attention_ops import WHOLE_BATCH, attention_candidates
from pagedserve.platforms.cpu.tuned_attention import OP, TunedAttention, head_key, synthetic_batch
from pagedserve.platforms.cpu.tuning import Plan, Tuner, TuningCache
from pagedserve.platforms.ops import OpRegistry
from pagedserve.platforms.options import CpuOptions
from tests.kernels.test_cpu_kernels import assert_close, make_batch

BF16 = torch.bfloat16
BUCKETS = (1, 2, 4, 8, 16, 64, 512)
IDENTITY = {"cpu": "Fake CPU 9000", "flags": "amx_tile", "torch": "2.x", "threads": "2", "format": "3"}


def gen_for(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def plan_for(key: str, fastest: dict[int, str], names: list[str]) -> Plan:
    """A plan in which ``fastest[bucket]`` wins that bucket (the others 2x slower)."""
    times = {b: {n: (1.0 if n == fastest[b] else 2.0) for n in names} for b in BUCKETS}
    return Plan(OP, key, BUCKETS, times)


class Fake:
    """A candidate that records its calls and writes its id into every output row."""

    def __init__(self, ident: float, calls: list) -> None:
        self.ident, self.calls = ident, calls

    def __call__(self, query, key_cache, value_cache, block_tables, seq_lens, qsl, scale, out=None, **kw):
        assert not kw, "the split passes no windows, soft caps or sinks"
        assert qsl[0] == 0 and qsl[-1] == query.shape[0] and len(qsl) == seq_lens.shape[0] + 1
        assert block_tables.shape[0] == seq_lens.shape[0]
        self.calls.append((self.ident, seq_lens.tolist(), (qsl[1:] - qsl[:-1]).tolist()))
        out.fill_(self.ident)
        return out


def fake_tuned(fastest: dict[int, str], args) -> tuple[TunedAttention, list]:
    calls: list = []
    fakes = {"a": Fake(1.0, calls), "b": Fake(2.0, calls), "c": Fake(3.0, calls)}
    static = Fake(9.0, calls)
    tuned = TunedAttention(Tuner(None), fakes, static=static)
    tuned.plans[head_key(args[0], args[1])] = plan_for(head_key(args[0], args[1]), fastest, list(fakes))
    return tuned, calls


# decodes, a short chunk, a prefill, decodes, speculative 3-token steps, a long chunk
MIXED = [(1, 37), (1, 90), (9, 300), (600, 700), (1, 20), (3, 40), (3, 60), (70, 200), (2, 33)]
FASTEST = {1: "a", 2: "a", 4: "b", 8: "b", 16: "c", 64: "c", 512: "c"}


def expected_ident(q_len: int) -> float:
    bucket = next((b for b in BUCKETS if q_len <= b), BUCKETS[-1])
    return {"a": 1.0, "b": 2.0, "c": 3.0}[FASTEST[bucket]]


def test_mixed_batch_runs_go_to_their_buckets_choice():
    args = make_batch(MIXED, 4, 2, 64, 16, BF16, gen_for("fake"))
    tuned, calls = fake_tuned(FASTEST, args)
    out = torch.full_like(args[0], float("nan"))
    assert tuned.paged_attention(*args, 0.125, out) is out
    qsl = args[5].tolist()
    for i, (q, _) in enumerate(MIXED):
        assert (out[qsl[i] : qsl[i + 1]] == expected_ident(q)).all(), f"sequence {i} ({q} tokens)"
    # Maximal runs of consecutive sequences with one choice, one call each, in order.
    assert calls == [
        (1.0, [37, 90], [1, 1]),
        (3.0, [300, 700], [9, 600]),
        (1.0, [20], [1]),
        (2.0, [40, 60], [3, 3]),
        (3.0, [200], [70]),
        (1.0, [33], [2]),
    ]


def test_one_choice_is_one_call_on_the_whole_batch_and_decodes_skip_the_metadata():
    args = make_batch([(9, 40), (12, 50), (16, 16)], 4, 2, 64, 16, BF16, gen_for("one"))
    tuned, calls = fake_tuned(FASTEST, args)
    tuned.paged_attention(*args, 0.125, torch.empty_like(args[0]))
    assert calls == [(3.0, [40, 50, 16], [9, 12, 16])]
    decode = make_batch([(1, 40)] * 5, 4, 2, 64, 16, BF16, gen_for("decode"))
    tuned, calls = fake_tuned(FASTEST, decode)
    tuned.paged_attention(*decode, 0.125, torch.empty_like(decode[0]))
    assert calls == [(1.0, [40] * 5, [1] * 5)]


def test_decode_steps_of_a_routed_cache_go_straight_to_its_kernel():
    """The registry's op remembers a decode step's kernel per KV cache tensor: later decode
    steps on that cache call it without building the head key; another cache, a prefill
    chunk, or a window go the full way (and the static op)."""
    decode = make_batch([(1, 40)] * 5, 4, 2, 64, 16, BF16, gen_for("fast"))
    tuned, calls = fake_tuned(FASTEST, decode)
    op = tuned.op()
    keys: list = []
    full = tuned.route

    def counted(query, key_cache):
        keys.append(query.shape)  # (not the tensor: the test drops one below)
        return full(query, key_cache)

    tuned.route = counted  # type: ignore[method-assign]
    for _ in range(3):
        out = torch.full_like(decode[0], float("nan"))
        assert op(*decode, 0.125, out) is out and (out == 1.0).all()
    assert len(keys) == 1 and len(calls) == 3  # routed once; every step ran the 1-token bucket's kernel
    other = (decode[0], decode[1].clone(), *decode[2:])  # a new cache tensor: routed anew
    op(*other, 0.125, torch.empty_like(decode[0]))
    assert len(keys) == 2 and len(tuned._decode) == 2
    del other  # its cache tensor goes, and its entry with it
    assert len(tuned._decode) == 1
    mixed = make_batch([(9, 40), (1, 30)], 4, 2, 64, 16, BF16, gen_for("fast-mixed"))
    op(mixed[0], decode[1], decode[2], *mixed[3:], 0.125, torch.empty_like(mixed[0]))
    assert len(keys) == 3  # not a decode step: the full route
    seen: list = []
    tuned.static = lambda *a, **kw: seen.append(kw) or a[7]
    op(*decode, 0.125, torch.empty_like(decode[0]), sliding_window=8)
    assert seen == [{"sliding_window": 8, "soft_cap": None, "sinks": None}]


@pytest.mark.parametrize("extra", [{"sliding_window": 8}, {"soft_cap": 30.0}, {"sinks": "sinks"}, {"dtype": "fp32"}])
def test_what_is_not_tuned_runs_the_static_op(extra):
    args = make_batch(MIXED, 4, 2, 64, 16, BF16, gen_for("static"))
    if extra.pop("dtype", None):
        args = tuple(a.float() if a.is_floating_point() else a for a in args)
    if extra.get("sinks"):
        extra["sinks"] = torch.zeros(4)
    calls: list = []
    seen: list = []

    def static(*a, **kw):
        seen.append(kw)
        return a[7]

    tuned = TunedAttention(Tuner(None), {"a": Fake(1.0, calls)}, static=static)
    tuned.paged_attention(*args, 0.125, torch.empty_like(args[0]), **extra)
    assert not calls and len(seen) == 1 and not tuned.plans


# -- numerics: real candidates against the reference ------------------------------------


@pytest.fixture(scope="module")
def candidates():
    native = load_cpu_kernels()
    if native is None:
        pytest.skip("the native CPU kernels are not built here")
    found = attention_candidates(native)
    return {n: found[n] for n in WHOLE_BATCH if n in found}


def check(fn, args) -> None:
    scale = args[0].shape[-1] ** -0.5
    expected = reference.paged_attention(*(a.float() if a.is_floating_point() else a for a in args), scale)
    out = torch.full_like(args[0], float("nan"))
    assert fn(*args, scale, out) is out
    assert_close(out, expected, BF16, "tuned paged_attention")


# A chunk after a prefix hit, decodes around it, a prefill from scratch, short steps.
REAL = [(1, 37), (40, 300), (1, 700), (3, 50), (130, 130), (0, 20), (8, 77), (1, 9), (600, 1100)]


@pytest.mark.parametrize(
    "heads,head_size,block_size,head_major",
    [((9, 3), 64, 16, True), ((8, 2), 128, 16, False), ((4, 4), 64, 32, True), ((16, 1), 96, 8, False)],
    ids=["gqa3-head", "gqa4-d128-token", "mha-bs32", "mqa-d96-bs8"],
)
def test_every_mix_of_candidates_matches_the_reference(candidates, heads, head_size, block_size, head_major):
    """Injected plans send neighbouring buckets to different candidates, so every pair of
    candidates meets inside one batch."""
    names = sorted(candidates)
    args = make_batch(REAL, *heads, head_size, block_size, BF16, gen_for(heads, head_size), head_major=head_major)
    key = head_key(args[0], args[1])
    for shift in range(len(names)):
        tuned = TunedAttention(Tuner(None), candidates, static=candidates["native"])
        tuned.plans[key] = plan_for(key, {b: names[(i + shift) % len(names)] for i, b in enumerate(BUCKETS)}, names)
        check(tuned.op(), args)


def test_tuned_on_first_call_and_cached(candidates, tmp_path):
    """The default model's heads: tuned for real at the first call (fresh plan, written to
    the cache), read back by a second process' worth of objects without timing."""
    args = make_batch(REAL, 9, 3, 64, 16, BF16, gen_for("real"), head_major=True)
    cache = TuningCache(tmp_path / "t.json", IDENTITY)
    tuned = TunedAttention(Tuner(cache, threads=1), candidates, static=candidates["native"])
    check(tuned.op(), args)
    plan = tuned.plans[head_key(args[0], args[1])]
    assert not plan.cached and plan.buckets == BUCKETS and set(plan.chosen.values()) <= set(candidates)
    again = TunedAttention(Tuner(TuningCache(tmp_path / "t.json", IDENTITY)), candidates, static=candidates["native"])
    check(again.op(), args)
    assert again.plans[head_key(args[0], args[1])].cached and again.tuner.seconds == 0.0
    rows = again.op().tuning_report()
    assert {r["op"] for r in rows} == {OP} and [r["rows"] for r in rows] == list(BUCKETS)


def test_synthetic_batch_is_valid_for_the_reference():
    for layout in ("head", "token"):
        args = synthetic_batch(4, 3, 40, 8, 2, 64, 16, BF16, layout)
        assert head_key(args[0], args[1]).endswith(layout)
        assert reference.paged_attention(*args[:7]).isfinite().all()


# -- registration and the off switch ------------------------------------------------------


def _table(env: dict[str, str]) -> dict[str, str]:
    from pagedserve.platforms.cpu.ops import register_cpu_ops

    ops = OpRegistry()
    register_cpu_ops(ops, CpuOptions.from_env(env))
    return dict(ops.table())


def test_off_switch():
    if load_cpu_kernels() is None:
        pytest.skip("the native CPU kernels are not built here")
    on, off = _table({}), _table({"PAGEDSERVE_CPU_TUNE": "0"})
    no_amx = _table({"PAGEDSERVE_CPU_AMX_ATTENTION": "0"})
    assert "+" not in no_amx["paged_attention"]
    if amx_unavailable_reason() is None:
        assert on["paged_attention"].endswith("+tuned(amx,native,sdpa)")
        assert off["paged_attention"].endswith("+amx-prefill")
    elif bf16_prefill_unavailable_reason() is None:
        # No AMX: the AVX-512 BF16 tiling takes the AMX kernel's place.
        assert on["paged_attention"].endswith("+tuned(bf16_tiles,native,sdpa)")
        assert off["paged_attention"].endswith("+bf16-prefill")
    else:
        # One candidate that matters: nothing to time, the native kernel as before.
        assert on["paged_attention"] == off["paged_attention"] == no_amx["paged_attention"]
