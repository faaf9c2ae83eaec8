"""Measured dispatch (platforms/cpu/tuning.py, tuned_linear.py): selection per bucket
with fake candidates of known speed on an injected clock, the per-machine cache, the
off switch, and every candidate the tuner can dispatch against kernels/reference.py."""

from __future__ import annotations

import json
import pathlib
import tempfile

import pytest
import torch

from pagedserve.kernels import reference
from pagedserve.kernels.cpu import load_cpu_kernels
from pagedserve.platforms.cpu import dense_ops
from pagedserve.platforms.cpu.tuned_linear import CANDIDATE_LAYOUT, TunedLinear, choose_layouts
from pagedserve.platforms.cpu.tuning import Plan, Tuner, TuningCache, measure, plan_rows
from pagedserve.platforms.ops import OpRegistry
from pagedserve.platforms.options import CpuOptions

BUCKETS = (1, 4, 16, 64)
IDENTITY = {"cpu": "Fake CPU 9000", "flags": "amx_tile avx512_bf16", "torch": "2.x", "threads": "2", "format": "3"}


class FakeClock:
    """A clock that only moves when a fake candidate 'runs'."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def fake_candidates(clock: FakeClock, costs: dict[str, dict[int, float]], calls: dict[str, int] | None = None):
    """Runners whose call advances ``clock`` by costs[name][bucket] (absent: cannot run)."""

    def runner(name: str):
        def make(bucket: int):
            if bucket not in costs[name]:
                return None

            def call():
                clock.now += costs[name][bucket]
                if calls is not None:
                    calls[name] = calls.get(name, 0) + 1

            return call

        return make

    return {name: runner(name) for name in costs}


def test_the_fastest_candidate_wins_each_bucket():
    clock = FakeClock()
    costs = {
        "small": {1: 1.0, 4: 2.0, 16: 9.0, 64: 40.0},
        "large": {1: 3.0, 4: 3.0, 16: 5.0, 64: 10.0},
        "narrow": {1: 0.5, 4: 2.5},  # runs only few rows (like the skinny kernel)
    }
    plan = Tuner(None, clock=clock, threads=1).tune("op", "k", fake_candidates(clock, costs), BUCKETS)
    assert plan.chosen == {1: "narrow", 4: "small", 16: "large", 64: "large"}
    assert plan.times[1] == {"small": 1.0, "large": 3.0, "narrow": 0.5}
    assert "narrow" not in plan.times[16]
    # rows between buckets take the next bucket up; past the last, the last
    assert [plan.choose(r) for r in (1, 2, 4, 5, 16, 17, 64, 1000)] == [
        "narrow",
        "small",
        "small",
        "large",
        "large",
        "large",
        "large",
        "large",
    ]


def test_a_hopeless_candidate_is_not_timed_at_larger_buckets():
    clock = FakeClock()
    calls: dict[str, int] = {}
    costs = {
        "fast": {b: 1.0 for b in BUCKETS},
        "hopeless": {1: 9.0, 4: 9.0, 16: 0.5, 64: 0.5},  # 9x behind at two buckets in a row
        "one_slow_figure": {1: 9.0, 4: 1.5, 16: 9.0, 64: 0.5},  # never twice in a row: kept
    }
    plan = Tuner(None, clock=clock, threads=1).tune("op", "k", fake_candidates(clock, costs, calls), BUCKETS)
    assert plan.times[4] == {"fast": 1.0, "hopeless": 9.0, "one_slow_figure": 1.5}
    assert all("hopeless" not in plan.times[b] for b in (16, 64))
    assert plan.chosen[64] == "one_slow_figure"


def test_a_disturbed_sample_does_not_decide_and_hopeless_candidates_are_pruned():
    clock = FakeClock()
    counts: dict[str, int] = {}
    # Binary fractions: the fake clock's differences are exact.
    costs = {"a": 2.0**-17, "b": 2.0**-16, "slow": 2.0**-13}

    def call(name: str):
        def run():
            counts[name] = counts.get(name, 0) + 1
            # a's first timed warm-up call and its first round wait for the CPU (31 ms):
            # neither prunes it nor decides its figure
            clock.now += costs[name] + (2.0**-5 if name == "a" and counts[name] in (2, 4) else 0.0)

        return run

    times = measure({n: call(n) for n in costs}, clock)
    assert times == costs  # the minimum of the rounds; the pruned keeps its warm-up figure
    assert counts["slow"] == 3 and counts["a"] > 4  # the warm-up calls only, then pruned


def test_cache_is_reused_on_the_same_machine_only(tmp_path):
    clock = FakeClock()
    costs = {"x": {1: 1.0, 4: 1.0}, "y": {1: 2.0, 4: 0.5}}
    cache = TuningCache.default(identity=IDENTITY, root=tmp_path)
    first = Tuner(cache, clock=clock, threads=1).tune("linear", "N=8,K=8", fake_candidates(clock, costs), (1, 4))
    assert not first.cached and first.chosen == {1: "x", 4: "y"}

    def never(bucket):
        raise AssertionError("a cached plan must not be timed again")

    again = Tuner(TuningCache.default(identity=IDENTITY, root=tmp_path)).tune(
        "linear", "N=8,K=8", {"x": never, "y": never}, (1, 4)
    )
    assert again.cached and again.chosen == first.chosen and again.times == first.times

    other_cpu = dict(IDENTITY, cpu="Another CPU")
    other = TuningCache.default(identity=other_cpu, root=tmp_path)
    assert other.path != cache.path and other.get("linear", "N=8,K=8", ["x", "y"]) is None
    # A file copied onto another machine's name is not trusted either: the identity
    # inside must match.
    other.path.write_text(cache.path.read_text())
    assert TuningCache(other.path, other_cpu).get("linear", "N=8,K=8", ["x", "y"]) is None
    # Another candidate set or another op retunes.
    assert cache.get("linear", "N=8,K=8", ["x", "y", "z"]) is None
    assert json.loads(cache.path.read_text())["identity"] == IDENTITY


def test_a_rebuilt_kernel_is_timed_again(tmp_path):
    """A candidate's build (the native extension's name, a hash of its sources) files its
    figures: the same build reads them back, another one times the candidates again."""
    clock = FakeClock()
    costs = {"native": {1: 1.0, 4: 3.0}, "other": {1: 2.0, 4: 2.0}}
    calls: dict[str, int] = {}

    def tune(build: str) -> Plan:
        tuner = Tuner(TuningCache.default(identity=IDENTITY, root=tmp_path), clock=clock, threads=1)
        return tuner.tune("linear", "N=8,K=8", fake_candidates(clock, costs, calls), (1, 4), {"native": build})

    assert not tune("pagedserve_cpu_aaaa").cached
    timed = dict(calls)
    assert tune("pagedserve_cpu_aaaa").cached and calls == timed
    costs["native"] = {1: 5.0, 4: 0.5}  # the rebuilt kernel is slower at 1 row, faster at 4
    rebuilt = tune("pagedserve_cpu_bbbb")
    assert not rebuilt.cached and calls["native"] > timed["native"]
    assert rebuilt.chosen == {1: "other", 4: "native"}
    assert tune("pagedserve_cpu_aaaa").chosen == {1: "native", 4: "other"}  # both stay filed


def _plan(times: dict[int, dict[str, float]]) -> Plan:
    return Plan("linear", "k", tuple(sorted(times)), times)


def test_layouts_one_when_it_wins_everywhere_two_when_buckets_disagree():
    everywhere = _plan({b: {"native_packed": 1.0, "onednn": 2.0, "torch": 2.0} for b in BUCKETS})
    assert choose_layouts(everywhere, CANDIDATE_LAYOUT, dual=True) == ("native", None)
    split = _plan(
        {
            1: {"native_packed": 1.0, "onednn": 3.0, "torch": 4.0},
            4: {"native_packed": 2.0, "onednn": 3.0, "torch": 4.0},
            16: {"native_packed": 9.0, "onednn": 3.0, "torch": 4.0},
            64: {"native_packed": 40.0, "onednn": 8.0, "torch": 9.0},
        }
    )
    assert choose_layouts(split, CANDIDATE_LAYOUT, dual=True) == ("onednn", "native")
    assert choose_layouts(split, CANDIDATE_LAYOUT, dual=False) == ("onednn", None)


def test_small_weights_are_not_timed():
    tl = TunedLinear(Tuner(None, threads=1), None, reference.linear, reference.silu_and_mul, dual_bytes=0)
    w = torch.randn(64, 64).bfloat16()
    assert not hasattr(tl.prepare(w), "_pagedserve_route") and not tl.tuner.plans


def test_off_switch_and_settings():
    assert CpuOptions.from_env({}).tune is True
    assert CpuOptions.from_env({"PAGEDSERVE_CPU_TUNE": "0"}).tune is False
    assert CpuOptions.from_env({"PAGEDSERVE_CPU_TUNE_DUAL_MB": "64"}).tune_dual_mb == 64
    with pytest.raises(ValueError, match="PAGEDSERVE_CPU_TUNE"):
        CpuOptions.from_env({"PAGEDSERVE_CPU_TUNE": "maybe"})
    with pytest.raises(ValueError, match="PAGEDSERVE_CPU_TUNE_DUAL_MB"):
        CpuOptions.from_env({"PAGEDSERVE_CPU_TUNE_DUAL_MB": "-1"})


def _registry(tune: bool) -> OpRegistry:
    from pagedserve.platforms.cpu.ops import register_cpu_ops

    ops = OpRegistry()
    register_cpu_ops(ops, CpuOptions(tune=tune))
    return ops


def test_off_switch_keeps_the_static_order():
    if load_cpu_kernels() is None and not dense_ops.onednn_available():
        pytest.skip("neither native kernels nor oneDNN here: nothing to tune")
    off = dict(_registry(False).table())
    assert not off["linear"].startswith("cpu-tuned")
    assert dict(_registry(True).table())["linear"].startswith("cpu-tuned")


# -- numerics: every candidate the tuner can dispatch, against the reference ----------


def _tuned(native) -> TunedLinear:
    return TunedLinear(
        Tuner(None, threads=1), native, reference.linear, reference.silu_and_mul, dual_bytes=1 << 30, min_elements=1
    )


def _force(tl: TunedLinear, op: str, n: int, k: int, names: list[str], fastest: dict[int, str]) -> None:
    """Put a plan into ``tl``'s tuner in which ``fastest[bucket]`` wins that bucket."""
    times = {b: {c: (1.0 if c == fastest[b] else 5.0) for c in names} for b in tl.buckets}
    plan = Plan(op, f"N={n},K={k},bfloat16", tl.buckets, times)
    tl.tuner.plans[(op, plan.key, tuple(sorted(names)))] = plan


def _check_linear(tl: TunedLinear, w: torch.Tensor, prepared: torch.Tensor, gen: torch.Generator) -> None:
    n, k = w.shape
    for rows in (1, 3, 16, 70, 600):
        x = torch.randn(rows, k, generator=gen).bfloat16()
        b = torch.randn(n, generator=gen).bfloat16()
        want = reference.linear(x.float(), w.float(), b.float())
        got = tl.linear(x, prepared, b)
        assert got.shape == (rows, n) and got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=1.6e-2)
        gated = tl.linear_silu_and_mul(x, prepared, b)
        if rows == 1:  # no rows, and a 3-D input, take the same dispatch
            assert tl.linear(x[:0], prepared, b).shape == (0, n)
            torch.testing.assert_close(tl.linear(x[None], prepared, b)[0].float(), want, atol=2e-2, rtol=1.6e-2)
        want_gated = reference.silu_and_mul(reference.linear(x.float(), w.float(), b.float()))
        torch.testing.assert_close(gated.float(), want_gated, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("mixed", [False, True], ids=["one-candidate", "split-by-rows"])
def test_every_dispatched_candidate_matches_the_reference(mixed):
    native = load_cpu_kernels()
    native = native if native is not None and native.has_packed_linear else None
    tl = _tuned(native)
    n, k = 96, 160
    names = sorted(c for c in tl.kernels if CANDIDATE_LAYOUT[c] in tl._available(n, k))
    gen = torch.Generator().manual_seed(7)
    w = (torch.randn(n, k, generator=gen) / k**0.5).bfloat16()
    pairs = [(a, b) for a in names for b in names if a != b] if mixed else [(c, c) for c in names]
    for small, large in pairs:
        tl.tuner.plans.clear()
        # (a skinny kernel forced past 4 rows hands them to torch: still checked)
        fastest = {b: (small if b <= 4 else large) for b in tl.buckets}
        _force(tl, "linear", n, k, names, fastest)
        prepared = tl.prepare(w)
        route = prepared._pagedserve_route
        # The gated op: each of its candidates in turn (its plan forced as well).
        gated_names = sorted(tl._gated_kernels(route))
        for g in gated_names:
            tl.tuner.plans.pop(("linear_silu_and_mul", route.key, tuple(gated_names)), None)
            route.gated = None
            _force(tl, "linear_silu_and_mul", n, k, gated_names, {b: g for b in tl.buckets})
            _check_linear(tl, w, prepared, gen)


def test_far_apart_candidates_get_no_rounds():
    """After the warm-up a winner ``CLEAR_RATIO`` ahead of every other candidate is not
    timed further (the order cannot change); close candidates are."""
    clock = FakeClock()
    calls: dict[str, int] = {}
    far = fake_candidates(clock, {"fast": {1: 2.0**-14}, "slow": {1: 2.0**-12}}, calls)  # 4x apart
    assert measure({n: r(1) for n, r in far.items()}, clock) == {"fast": 2.0**-14, "slow": 2.0**-12}
    assert calls == {"fast": 3, "slow": 3}  # the first call and two timed warm-up calls only
    calls.clear()
    close = fake_candidates(clock, {"a": {1: 2.0**-14}, "b": {1: 1.5 * 2.0**-14}}, calls)
    measure({n: r(1) for n, r in close.items()}, clock)
    assert calls["a"] > 3 and calls["b"] > 3


def test_a_large_weight_is_timed_on_a_slice():
    """Output rows past ``slice_rows`` are not timed: the plan's key names the rows timed,
    the timed calls see that many, and the prepared weight runs whole."""
    native = load_cpu_kernels()
    native = native if native is not None and native.has_packed_linear else None
    seen: list[int] = []
    tl = TunedLinear(
        Tuner(None, threads=1), native, reference.linear, reference.silu_and_mul, dual_bytes=0, slice_rows=64
    )
    torch_linear = tl.kernels["torch"]
    tl.kernels["torch"] = lambda x, w, b=None: (seen.append(w.shape[0]), torch_linear(x, w, b))[1]
    gen = torch.Generator().manual_seed(3)
    w = (torch.randn(512, 160, generator=gen) / 160**0.5).bfloat16()
    prepared = tl.prepare(w)
    (plan,) = tl.tuner.plans.values()
    assert plan.key == "N=512,K=160,bfloat16,timed_rows=64"
    assert seen and set(seen) == {64}
    x = torch.randn(20, 160, generator=gen).bfloat16()
    want = reference.linear(x.float(), w.float())
    torch.testing.assert_close(tl.linear(x, prepared).float(), want, atol=2e-2, rtol=1.6e-2)


# -- plans timed while the machine ran slow ------------------------------------------


class Host:
    """A fake machine on the fake clock: while ``busy`` (a thread descheduled by the host)
    every call takes ``slowdown[name]`` times its cost, and the machine probe 2x its own."""

    PROBE = 2.0**-12

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.busy = False
        self.slowdown: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.probes = 0

    def probe(self) -> float:
        self.probes += 1
        return self.PROBE * (2.0 if self.busy else 1.0)

    def candidates(self, costs: dict[str, float]):
        def runner(name: str):
            def make(bucket: int):
                def call():
                    self.calls[name] = self.calls.get(name, 0) + 1
                    self.clock.now += costs[name] * (self.slowdown.get(name, 1.0) if self.busy else 1.0)

                return call

            return make

        return {name: runner(name) for name in costs}


def _load(host: Host, root, costs, identity=IDENTITY) -> Plan:
    tuner = Tuner(TuningCache.default(identity=identity, root=root), clock=host.clock, threads=2, probe=host.probe)
    return tuner.tune("linear", "N=8,K=8", host.candidates(costs), (1, 4))


def test_a_plan_timed_on_a_slow_machine_is_timed_again_when_it_runs_at_full_speed(tmp_path, caplog):
    """A busy host makes the native kernel's two-thread calls wait (3x), oneDNN's less:
    the first plan picks oneDNN.  A later load on the same busy machine keeps it (timing
    again would measure the same disturbance); the first load that probes the machine at
    full speed finds the plan 2x slow, times it again and keeps the smaller figures
    (native wins); after that the plan is read untimed."""
    costs = {"native": 2.0**-14, "onednn": 1.5 * 2.0**-14}  # binary fractions: exact figures
    host = Host(FakeClock())
    host.busy, host.slowdown = True, {"native": 3.0, "onednn": 1.25}

    first = _load(host, tmp_path, costs)
    assert first.chosen == {1: "onednn", 4: "onednn"} and first.probe == 2 * Host.PROBE
    assert first.slowdown == 1.0 and not first.slow  # nothing faster on record yet

    calls = dict(host.calls)
    still_busy = _load(host, tmp_path, costs)
    assert still_busy.cached and host.calls == calls and still_busy.chosen == first.chosen

    host.busy = False
    with caplog.at_level("INFO", logger="pagedserve.platforms.cpu.tuning"):
        quiet = _load(host, tmp_path, costs)
    assert "2.0x slower than its best; timing it again" in caplog.text
    assert host.calls["native"] > calls["native"]
    assert quiet.chosen == {1: "native", 4: "native"} and quiet.times[1] == costs
    assert quiet.retimes == 1 and quiet.probe == Host.PROBE and not quiet.slow

    calls, probes = dict(host.calls), host.probes
    again = _load(host, tmp_path, costs)
    assert again.cached and again.chosen == quiet.chosen and host.calls == calls
    assert host.probes == probes + 1  # one probe per process, none for the plan
    rows = {r["rows"]: r for r in plan_rows([first, again])}
    assert rows[1]["slowdown"] == 1.0 and not rows[1]["slow"]


def test_a_slow_plan_is_timed_again_at_most_max_retimes():
    """A machine that is only briefly at full speed at each load (the probe quiet, the
    calls disturbed) times a slow plan again at MAX_RETIMES loads, then no more."""
    from pagedserve.platforms.cpu.tuning import MAX_RETIMES

    class Flaky(Host):
        fresh = True

        def probe(self) -> float:
            self.probes += 1
            # quiet: a later process's first probe only (the first process is busy throughout)
            quiet, self.fresh = self.fresh and self.probes > 1, False
            return self.PROBE * (1.0 if quiet else 2.0)

    host = Flaky(FakeClock())
    host.busy, host.slowdown = True, {"a": 2.0, "b": 2.0}
    costs = {"a": 2.0**-14, "b": 1.25 * 2.0**-14}
    with tempfile.TemporaryDirectory() as root:
        timed = []
        for _ in range(MAX_RETIMES + 2):
            host.fresh = True
            before = sum(host.calls.values())
            plan = _load(host, pathlib.Path(root), costs, dict(IDENTITY, cpu="Flaky CPU"))
            timed.append(sum(host.calls.values()) > before)
    assert timed == [True] * (MAX_RETIMES + 1) + [False]
    assert plan.retimes == MAX_RETIMES


def test_machine_probe_times_a_real_call():
    from pagedserve.platforms.cpu.tuning import machine_probe

    ticks = iter(range(1000))
    # On a clock that advances one unit per read, every call takes exactly one unit.
    assert machine_probe(clock=lambda: float(next(ticks))) == 1.0


def test_a_plan_timed_again_keeps_the_smaller_figures_of_the_same_thread_count():
    old = Plan("op", "k", (1, 4), {1: {"a": 2.0, "b": 1.0}, 4: {"a": 3.0}}, threads=2, probe=2.0, retimes=1)
    fresh = Plan("op", "k", (1, 4), {1: {"a": 0.5, "b": 1.5}, 4: {"a": 4.0, "b": 1.0}}, threads=2, probe=1.0)
    merged = old.merged(fresh)
    assert merged.times == {1: {"a": 0.5, "b": 1.0}, 4: {"a": 3.0, "b": 1.0}}
    assert merged.chosen == {1: "a", 4: "b"} and merged.probe == 1.0 and merged.retimes == 2
    one_thread = Plan("op", "k", (1, 4), {1: {"a": 9.0}, 4: {"a": 9.0}}, threads=1, probe=1.0)
    replaced = old.merged(one_thread)
    assert replaced.times == one_thread.times and replaced.threads == 1 and replaced.retimes == 2
