"""Measured dispatch: an op's candidate implementations timed on real shapes, the fastest
chosen per row-count bucket, the choice cached on disk per machine.

Which implementation of an op is fastest depends on the CPU, not only on its ISA flags:
on an Intel Xeon with AMX oneDNN's tiles beat the native AVX-512 BF16 GEMM from a
handful of rows, on AMD Zen the native kernel wins at every row count.  So the CPU
platform times the candidates once, on the model's own shapes, and dispatches on that.

The API (generic: any op with named candidates of one signature can use it)::

    tuner = Tuner(TuningCache.default())           # or Tuner(None): in memory only
    plan = tuner.tune(
        "linear",                                  # the op
        "N=960,K=576,bfloat16",                    # its shape / dtype key
        {"native_packed": runner_a, "onednn": runner_b},
        buckets=(1, 4, 16, 64, 256, 512),          # row counts that matter
    )
    plan.choose(rows)                              # -> a candidate name
    plan.times                                     # {bucket: {candidate: seconds}}

A runner is ``runner(bucket) -> Callable[[], object] | None``: it prepares inputs of
``bucket`` rows (query tokens per sequence, for an attention op) and returns the call to
time, or None when the candidate cannot run that bucket.  A later op (paged attention,
bucketed by query tokens per sequence) registers the same way: one key per head
configuration and dtype, its candidates' runners, its own buckets.

Timing is robust on a small shared machine and cheap (:func:`measure`): every
candidate is warmed up, then timed in interleaved rounds (load that comes and goes hits
all alike), the minimum of the rounds is the figure (the least disturbed run), and a
candidate already ``PRUNE_RATIO`` times slower than the best after its warm-up is not
timed further at that bucket, and one ``DROP_RATIO`` times slower at two buckets in a
row not at the larger buckets.  Cheap calls get up to ``MAX_ROUNDS`` rounds, slow ones ``MIN_ROUNDS``.

A minimum is only as good as its least disturbed sample, and on a virtual machine whose
host is busy every sample can be disturbed for minutes: a vCPU the host does not run
leaves the other thread of every two-thread call waiting (figures 3-28x the calls' real
time were cached so, and two of them chose the slower kernel).  So each plan also
records how fast the machine ran while it was timed: :func:`machine_probe`, one fixed
float32 matmul on the same threads (the faster of a probe before and one after: a
passing disturbance is no matter, the minima of the rounds already escape it; one that
lasts through the plan shows in both).  The
cache keeps the fastest probe it has seen per thread count, and every process probes
once when it first tunes or reads a plan; a plan whose probe was more than
``SLOW_PROBE_RATIO`` times the fastest is *slow*: while the machine runs at full speed
again it is timed again (at most ``MAX_RETIMES`` times), keeping per bucket and
candidate the smaller figure of old and new (a disturbance only ever makes a call look
slower).

The cache file (:class:`TuningCache`) lives under the kernel cache root
(kernels/build.py) in ``tuning/``, one file per machine identity: the CPU model name, its
flags that matter, torch's version and its thread count (:func:`machine_identity`); a
different CPU or torch never reads another's figures.  Inside, entries are keyed by op,
shape key and candidate names (with the build of each native candidate where the op
names it: ``native_packed@pagedserve_cpu_<hash>``), so a new candidate set, or a kernel
whose sources or flags changed, retunes.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

__all__ = [
    "BUCKETS",
    "MAX_RETIMES",
    "SLOW_PROBE_RATIO",
    "machine_probe",
    "TUNE_SLICE_ROWS",
    "timing_threads",
    "Plan",
    "Runner",
    "Tuner",
    "TuningCache",
    "machine_identity",
    "measure",
    "plan_rows",
]

log = logging.getLogger(__name__)

#: Row counts timed by default: decode batches of 1-256 sequences and a prefill chunk.
BUCKETS: tuple[int, ...] = (1, 4, 16, 64, 256, 512)
#: A candidate this many times slower than the best after warm-up is not timed further.
PRUNE_RATIO = 3.0
#: A candidate this many times slower than the best at two buckets in a row is not timed
#: at the larger buckets (absent there: it cannot be chosen).
DROP_RATIO = 4.0
#: After the warm-up, candidates this far apart (every other one's best warm-up call this
#: many times the best one's) are not timed in rounds: the order cannot change.
CLEAR_RATIO = 2.5
#: Output rows of a weight that the linear candidates are timed on: a larger weight (an
#: LM head) is timed on a slice of that many rows (the per-row work is the same).
TUNE_SLICE_ROWS = 8192
#: Timed rounds per candidate: at least MIN_ROUNDS (all a call slower than SLOW_CALL_S
#: gets), more for cheap calls while a round costs under ROUND_BUDGET_S / rounds.
MIN_ROUNDS, MAX_ROUNDS = 3, 15
SLOW_CALL_S = 0.02
ROUND_BUDGET_S = 0.02
#: A first call faster than this gets two timed warm-up calls (slower: it is the figure).
WARM_RETIME_S = 0.1
#: A plan timed while the probe took more than this many times the fastest probe on
#: record is timed again (on a quiet 2-core Zen 4, probes a few seconds apart: median
#: 1.1-1.2x the fastest, a tenth of them near 2x: hence the faster of two per plan; one
#: thread of two descheduled throughout: about 2x).
SLOW_PROBE_RATIO = 1.5
#: A slow plan is timed again at this many later loads at most (a machine that is never
#: quiet does not pay for timing at every start-up).
MAX_RETIMES = 3
#: Calls of the machine probe after three untimed ones; its figure is their minimum.
PROBE_ROUNDS = 8
#: Bumped when the meaning of cached figures changes (2: two timed warm-up calls before
#: pruning; plans timed before could hold one disturbed sample as a candidate's figure;
#: 3: candidates dropped from larger buckets only after two slow buckets; 4: drop ratio
#: 4, no rounds for clear winners, large weights timed on a slice; 5: each plan records
#: the machine probe it was timed at, slow plans are timed again: plans before could
#: hold figures taken while a thread was descheduled throughout).
FORMAT = 5

#: runner(bucket) -> the call to time (inputs of ``bucket`` rows prepared), or None.
Runner = Callable[[int], Callable[[], object] | None]


@dataclass
class Plan:
    """One op's choice per bucket for one shape key.

    times[bucket][candidate]: seconds of one call (the minimum of the timed rounds);
    a candidate that could not run a bucket is absent from it.  probe: the machine
    probe's seconds while it was timed (0: not probed); slowdown: that over the fastest
    probe on record at its thread count (None: unknown)."""

    op: str
    key: str
    buckets: tuple[int, ...]
    times: dict[int, dict[str, float]]
    threads: int = 0  # torch threads the candidates ran with (0: unknown)
    cached: bool = False
    seconds: float = 0.0  # spent timing (0 when read from the cache)
    probe: float = 0.0
    retimes: int = 0  # times it was timed again because it was slow
    slowdown: float | None = field(default=None, compare=False)
    chosen: dict[int, str] = field(init=False)

    def __post_init__(self) -> None:
        self.chosen = {b: min(t, key=t.__getitem__) for b, t in self.times.items() if t}

    @property
    def slow(self) -> bool:
        """Timed while the machine ran ``SLOW_PROBE_RATIO`` times slower than its best."""
        return self.slowdown is not None and self.slowdown > SLOW_PROBE_RATIO

    def merged(self, fresh: Plan) -> Plan:
        """This plan timed again as ``fresh``: per bucket and candidate the smaller figure
        (a disturbance only makes a call look slower) and the faster probe.  Figures
        taken on another thread count do not compare: then ``fresh`` replaces them."""
        retimes = self.retimes + 1
        if fresh.threads != self.threads:
            return replace(fresh, retimes=retimes)
        times = {}
        for b in self.buckets:
            old, new = self.times.get(b, {}), fresh.times.get(b, {})
            times[b] = {c: min(old.get(c, float("inf")), new.get(c, float("inf"))) for c in old.keys() | new.keys()}
        probes = [p for p in (self.probe, fresh.probe) if p > 0]
        return Plan(
            self.op,
            self.key,
            self.buckets,
            times,
            threads=self.threads,
            seconds=fresh.seconds,
            probe=min(probes) if probes else 0.0,
            retimes=retimes,
        )

    def choose(self, rows: int) -> str:
        """The fastest candidate for ``rows``: that of the smallest bucket >= rows (the
        largest bucket past them)."""
        i = min(bisect.bisect_left(self.buckets, rows), len(self.buckets) - 1)
        return self.chosen[self.buckets[i]]

    def to_json(self) -> dict:
        return {
            "buckets": list(self.buckets),
            "threads": self.threads,
            "times": {str(b): t for b, t in self.times.items()},
            "probe": self.probe,
            "retimes": self.retimes,
        }

    @classmethod
    def from_json(cls, op: str, key: str, data: Mapping) -> Plan:
        times = {int(b): {str(n): float(s) for n, s in t.items()} for b, t in data["times"].items()}
        buckets = tuple(int(b) for b in data["buckets"])
        return cls(
            op,
            key,
            buckets,
            times,
            threads=int(data.get("threads", 0)),
            cached=True,
            probe=float(data.get("probe", 0.0)),
            retimes=int(data.get("retimes", 0)),
        )


def measure(
    calls: Mapping[str, Callable[[], object]],
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    """Seconds of one call of each of ``calls``: a warm-up, then interleaved rounds (the
    order rotating each round); the minimum per candidate.  Candidates ``PRUNE_RATIO``
    times slower than the best warm-up keep their (best) warm-up time.

    On a loaded 2-core machine a call that needs both threads often waits a scheduler
    slice (~20 ms) for one: more rounds for cheap calls (up to ``MAX_ROUNDS`` within
    ``ROUND_BUDGET_S``) make one undisturbed sample likely; slow calls get ``MIN_ROUNDS``.
    Where one candidate is ``CLEAR_RATIO`` times faster than every other after the
    warm-up, no rounds are timed (a disturbed sample only ever makes a call look slower,
    so the order of figures that far apart does not change)."""
    warm: dict[str, list[float]] = {}
    for name, call in calls.items():
        t0 = clock()
        call()  # first call: primitive creation, page faults
        first = clock() - t0
        warm[name] = [first]
        if first < WARM_RETIME_S:
            # Two timed warm-up calls: pruning on one sample would drop a candidate
            # whose only call waited for the CPU.
            warm[name] = []
            for _ in range(2):
                t0 = clock()
                call()
                warm[name].append(clock() - t0)
    samples: dict[str, list[float]] = {n: list(w) for n, w in warm.items()}
    best = min(min(w) for w in warm.values())
    live = [n for n in calls if min(warm[n]) <= best * PRUNE_RATIO]
    first = min(warm, key=lambda n: min(warm[n]))
    if all(min(w) > best * CLEAR_RATIO for n, w in warm.items() if n != first):
        # Far apart already (or alone): rounds would only refine figures that cannot
        # change the order.
        return {n: min(s) for n, s in samples.items()}
    fit = int(ROUND_BUDGET_S / max(best * len(live), 1e-9))
    if best > WARM_RETIME_S:
        n_rounds = 1  # calls of a tenth of a second and more: a second sample each
    elif best > SLOW_CALL_S:
        n_rounds = MIN_ROUNDS
    else:
        n_rounds = max(MIN_ROUNDS, min(MAX_ROUNDS, fit))
    for r in range(n_rounds):
        order = live[r % len(live) :] + live[: r % len(live)]
        for name in order:
            t0 = clock()
            calls[name]()
            samples[name].append(clock() - t0)
    return {n: min(s) for n, s in samples.items()}


def machine_probe(clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds of one fixed float32 matmul (128 x 512 by 512 x 512) on torch's threads,
    the minimum of ``PROBE_ROUNDS`` calls: how fast the machine runs this process now.
    A thread descheduled throughout about doubles it."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(128, 512, generator=gen), torch.randn(512, 512, generator=gen)
    for _ in range(3):  # wake the pool's threads, warm the caches
        torch.mm(a, b)
    best = float("inf")
    for _ in range(PROBE_ROUNDS):
        t0 = clock()
        torch.mm(a, b)
        best = min(best, clock() - t0)
    return best


def timing_threads() -> int:
    """torch's thread count, or 1 while the machine is busy (1-minute load average at
    least the CPUs this process may run on): then a call that needs every thread mostly
    measures its wait for a descheduled one (whole scheduler slices of ~4-20 ms on a
    shared 2-core machine), while one thread's call runs undisturbed within its slice and
    ranks the candidates as they rank with more threads (docs/kernels_cpu.md)."""
    threads = torch.get_num_threads()
    try:
        cpus = len(os.sched_getaffinity(0))
        busy = os.getloadavg()[0] >= cpus
    except (AttributeError, OSError):
        busy = False
    return 1 if busy and threads > 1 else threads


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_identity() -> dict[str, str]:
    """What the figures depend on: CPU model, its matrix/vector flags, torch, threads."""
    from pagedserve.kernels import build

    flags = sorted(f for f in build.read_cpu_features() if f.startswith(("amx", "avx512", "avx2")))
    return {
        "cpu": _cpu_model(),
        "flags": " ".join(flags),
        "torch": torch.__version__,
        "threads": str(torch.get_num_threads()),
        "format": str(FORMAT),
    }


class TuningCache:
    """Plans on disk, one JSON file per machine identity (see the module docstring)."""

    def __init__(self, path: Path, identity: Mapping[str, str]) -> None:
        self.path = path
        self.identity = dict(identity)
        self._entries: dict[str, dict] | None = None
        self._probes: dict[str, float] = {}

    @classmethod
    def default(cls, identity: Mapping[str, str] | None = None, root: Path | None = None) -> TuningCache:
        """The file for this machine under the kernel cache root's ``tuning/``."""
        from pagedserve.kernels import build

        identity = machine_identity() if identity is None else identity
        digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
        root = build.kernel_cache_root() if root is None else root
        return cls(root / "tuning" / f"cpu-{digest}.json", identity)

    @staticmethod
    def entry_key(op: str, key: str, candidates: Sequence[str]) -> str:
        return f"{op}|{key}|{','.join(sorted(candidates))}"

    def entries(self) -> dict[str, dict]:
        if self._entries is None:
            self._entries = {}
            try:
                data = json.loads(self.path.read_text())
            except (OSError, ValueError):
                data = None
            # The identity is also checked inside: a hash collision or a copied file
            # never hands one machine's figures to another.
            if isinstance(data, dict) and data.get("identity") == self.identity:
                self._entries = dict(data.get("entries", {}))
                self._probes = {str(t): float(s) for t, s in data.get("probes", {}).items()}
        return self._entries

    def best_probe(self, threads: int) -> float | None:
        """The fastest machine probe on record at ``threads`` threads."""
        self.entries()
        return self._probes.get(str(threads))

    def note_probe(self, threads: int, seconds: float) -> bool:
        """Record a probe; True when it is the fastest at its thread count (not written
        until the next :meth:`put` or :meth:`save`)."""
        best = self.best_probe(threads)
        if seconds <= 0 or (best is not None and best <= seconds):
            return False
        self._probes[str(threads)] = seconds
        return True

    def judge(self, plan: Plan) -> Plan:
        """Set ``plan.slowdown`` from the fastest probe on record at its thread count."""
        best = self.best_probe(plan.threads)
        plan.slowdown = plan.probe / best if plan.probe > 0 and best else None
        return plan

    def get(self, op: str, key: str, candidates: Sequence[str]) -> Plan | None:
        data = self.entries().get(self.entry_key(op, key, candidates))
        return None if data is None else self.judge(Plan.from_json(op, key, data))

    def put(self, plan: Plan, candidates: Sequence[str]) -> None:
        """Record ``plan`` and rewrite the file atomically (a failure only logs: the
        plan still holds for this process)."""
        self.entries()[self.entry_key(plan.op, plan.key, candidates)] = plan.to_json()
        self.judge(plan)
        self.save()

    def save(self) -> None:
        """Rewrite the file atomically (a failure only logs)."""
        self.entries()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(
                    {"identity": self.identity, "entries": self._entries, "probes": self._probes},
                    f,
                    indent=1,
                    sort_keys=True,
                )
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("pagedserve: tuning cache %s not written: %s", self.path, exc)

    def plans(self) -> list[Plan]:
        """Every cached plan (for ``pagedserve platforms --ops``)."""
        out = []
        for entry, data in sorted(self.entries().items()):
            op, key, _ = entry.split("|", 2)
            out.append(self.judge(Plan.from_json(op, key, data)))
        return out


class Tuner:
    """Times candidates once per (op, shape key) and remembers the plans (in this
    process and, with a ``cache``, on disk)."""

    def __init__(
        self,
        cache: TuningCache | None,
        clock: Callable[[], float] = time.perf_counter,
        threads: int | Callable[[], int] | None = None,
        probe: Callable[[], float] | None = None,
    ) -> None:
        """``threads``: torch threads to time with (None: :func:`timing_threads`).
        ``probe``: how fast the machine runs now, in seconds of a fixed call on torch's
        threads (None: :func:`machine_probe` with the default clock, else no probe)."""
        self.cache = cache
        self.clock = clock
        self.threads = timing_threads if threads is None else threads
        if probe is None and clock is time.perf_counter:
            probe = machine_probe
        self.probe = probe
        self.plans: dict[tuple[str, str, tuple[str, ...]], Plan] = {}
        self.seconds = 0.0  # spent timing in this process
        self._probed: dict[int, float] = {}  # this process's first probe per thread count

    def tune(
        self,
        op: str,
        key: str,
        candidates: Mapping[str, Runner],
        buckets: Sequence[int] = BUCKETS,
        builds: Mapping[str, str] | None = None,
    ) -> Plan:
        """The plan of ``op`` on ``key``: from memory, the cache, or timed now.

        ``builds``: candidate -> the build of the native code it runs (the kernel
        extension's name, which hashes its sources and flags).  The cache files its
        figures under those too, so a changed kernel is timed again rather than
        dispatched on the figures of the one before."""
        names = sorted(candidates)
        found = self.plans.get((op, key, tuple(names)))
        builds = builds or {}
        filed = sorted(f"{n}@{builds[n]}" if builds.get(n) else n for n in names)
        if found is None and self.cache is not None:
            found = self.cache.get(op, key, filed)
            if found is not None and found.buckets != tuple(buckets):
                found = None
            if found is not None and found.retimes < MAX_RETIMES and self._slow_now(found):
                # Timed while the machine ran slower than it does now: timed again, the
                # smaller of old and new figures kept (module docstring).
                log.info(
                    "pagedserve: %s %s was timed while the machine ran %.1fx slower than its best; timing it again",
                    op,
                    key,
                    found.slowdown,
                )
                found = found.merged(self._time(op, key, candidates, tuple(buckets)))
                self.cache.put(found, filed)
        if found is None:
            found = self._time(op, key, candidates, tuple(buckets))
            if self.cache is not None:
                self.cache.put(found, filed)
        self.plans[(op, key, tuple(names))] = found
        return found

    def _probe(self, threads: int) -> float:
        """The machine probe on ``threads`` threads (0.0 without a probe), noted in the cache."""
        if self.probe is None:
            return 0.0
        saved = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            seconds = self.probe()
        finally:
            torch.set_num_threads(saved)
        if self.cache is not None:
            self.cache.note_probe(threads, seconds)
        return seconds

    def _slow_now(self, plan: Plan) -> bool:
        """Whether cached ``plan`` was timed on a slower machine than this process finds
        now (probed once per process and thread count; a better probe is saved)."""
        if self.probe is None or self.cache is None or plan.probe <= 0:
            return False
        threads = self.threads() if callable(self.threads) else self.threads
        if threads != plan.threads:
            return False
        if threads not in self._probed:
            self._probed[threads] = self._probe(threads)
            if self._probed[threads] <= (self.cache.best_probe(threads) or 0.0):
                self.cache.save()  # the fastest probe yet: later processes judge by it
        self.cache.judge(plan)
        now = self._probed[threads] / (self.cache.best_probe(threads) or self._probed[threads])
        # Timing again now would only help if the machine is itself at full speed.
        return plan.slow and now <= SLOW_PROBE_RATIO

    def _time(self, op: str, key: str, candidates: Mapping[str, Runner], buckets: tuple[int, ...]) -> Plan:
        t0 = time.perf_counter()
        threads = self.threads() if callable(self.threads) else self.threads
        saved = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            before = self._probe(threads)
            times = self._time_buckets(op, key, candidates, buckets)
            probe = min(before, self._probe(threads))
        finally:
            torch.set_num_threads(saved)
        seconds = time.perf_counter() - t0
        self.seconds += seconds
        plan = Plan(op, key, buckets, times, threads=threads, seconds=seconds, probe=probe)
        log.info("pagedserve: tuned %s %s in %.2f s (%d threads): %s", op, key, seconds, threads, plan.chosen)
        return plan

    def _time_buckets(
        self, op: str, key: str, candidates: Mapping[str, Runner], buckets: tuple[int, ...]
    ) -> dict[int, dict[str, float]]:
        times: dict[int, dict[str, float]] = {}
        dropped: set[str] = set()
        strikes: dict[str, int] = {}
        for b in sorted(buckets):
            calls = {}
            for name, runner in candidates.items():
                call = None if name in dropped else runner(b)
                if call is not None:
                    calls[name] = call
            times[b] = measure(calls, self.clock) if calls else {}
            if not times[b]:
                raise ValueError(f"tuning {op} {key}: no candidate runs {b} rows")
            best = min(times[b].values())
            # Hopeless at two row counts in a row: not timed at larger ones (the native
            # kernel's seconds-long calls on a 49152-row LM head at 512 rows on AMX
            # machines); two, so one figure spoilt by load does not drop a candidate.
            for n, t in times[b].items():
                strikes[n] = strikes.get(n, 0) + 1 if t > best * DROP_RATIO else 0
            dropped.update(n for n, k in strikes.items() if k >= 2)
        return times

    def report(self) -> list[dict]:
        """One row per op, key and bucket: the choice and every candidate's time (us)."""
        return plan_rows(self.plans.values())


def plan_rows(plans) -> list[dict]:
    """Rows of :meth:`Tuner.report` for ``plans``; ``slowdown``: the machine probe while
    the plan was timed over the fastest on record (None: unknown), ``slow`` whether that
    is over ``SLOW_PROBE_RATIO`` (the plan is timed again at a quiet load)."""
    rows = []
    for plan in plans:
        for b in plan.buckets:
            t = plan.times.get(b, {})
            rows.append(
                {
                    "op": plan.op,
                    "key": plan.key,
                    "rows": b,
                    "chosen": plan.chosen.get(b, "-"),
                    "times_us": {n: round(s * 1e6, 1) for n, s in sorted(t.items(), key=lambda kv: kv[1])},
                    "cached": plan.cached,
                    "slowdown": None if plan.slowdown is None else round(plan.slowdown, 2),
                    "slow": plan.slow,
                    "retimes": plan.retimes,
                }
            )
    return rows


def geometric_mean(values: Sequence[float]) -> float:
    return statistics.geometric_mean(values) if values else float("inf")
