"""`pagedserve simulate calibrate`: measure this machine and write a hardware profile.

Everything is measured through the platform's real ops (as the engine resolves them):

* matmul throughput by batch size: ``linear`` (bfloat16 weights, prepared by
  ``prepare_linear_weight``) and, where the platform has it, ``gguf_linear`` (Q4_1
  blocks, the default model's format) over one decoder layer's shapes of the default
  model, at 1 to 512 rows -> ``matmul_curve``;
* memory bandwidth: a large tensor copy;
* attention: ``paged_attention`` on a decode batch (bytes of K/V read per second ->
  ``attention_bandwidth``) and on one 2048-token prefill (FLOP/s -> ``attention_flops``);
* in-engine efficiency and step overhead: a few real engine steps of the default model.
  Prefill steps of 128, 512 and 2048 tokens set ``efficiency.matmul`` (the share of the
  micro-benchmarked matmul rate the whole forward reaches) and ``per_token_overhead_s``
  by least squares; decode steps at one and 32 sequences set ``step_overhead_s + S x
  per_seq_overhead_s`` (what the compute terms leave unexplained: input preparation,
  sampling, Python).

It takes about a minute and writes ``cpu-local`` (docs/simulate.md says where).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time
from collections.abc import Callable

from pagedserve.simulate.hardware import HardwareProfile, local_profile_path

__all__ = ["run_calibration", "calibrate"]

# One decoder layer of the default model (SmolLM2-135M): qkv, o, gate+up, down.
_LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
# Dense in rows: kernels switch strategy at row thresholds (e.g. the CPU GGUF kernel
# dequantizes to a dense GEMM from 128 rows), and interpolation must not bridge a switch.
_ROWS = [1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 512, 1024, 2048]


#: The clock measurements are read on: wall time, or this process's CPU time -- on a
#: machine shared with other work, a one-thread run's CPU time is the wall time it would
#: take on an idle machine (the load only stretches the wall clock).
TIMERS = {"wall": time.perf_counter, "cpu": time.process_time}
Clock = Callable[[], float]


def _timeit(fn, clock: Clock, min_time: float = 0.05, max_reps: int = 200) -> float:
    """Seconds per call: best of three rounds after a warm-up call."""
    fn()
    reps, t = 1, 0.0
    while reps < max_reps:
        t0 = clock()
        for _ in range(reps):
            fn()
        t = clock() - t0
        if t >= min_time:
            break
        reps *= 2
    best = t / reps
    for _ in range(2):
        t0 = clock()
        for _ in range(reps):
            fn()
        best = min(best, (clock() - t0) / reps)
    return best


def _q4_1_blocks(torch, n: int, k: int):
    """Valid random Q4_1 rows ``uint8 [n, k/32 * 20]``: fp16 scale and min, then 16 bytes of nibbles."""
    blocks = torch.randint(0, 256, (n, k // 32, 20), dtype=torch.uint8)
    scale_min = (torch.rand(n, k // 32, 2) * 0.01 + 0.001).to(torch.float16)
    blocks[:, :, :4] = scale_min.view(torch.uint8).reshape(n, k // 32, 4)
    return blocks.reshape(n, k // 32 * 20)


def _matmul_curve(torch, ops, dtype, fmt: str, clock: Clock) -> list[list[float]]:
    if fmt == "q4_1":
        weights = [_q4_1_blocks(torch, n, k) for n, k in _LAYER_SHAPES]

        def layer(x_by_k):
            for (_, k), w in zip(_LAYER_SHAPES, weights):
                ops.gguf_linear(x_by_k[k], w, "Q4_1", None)
    else:
        weights = [ops.prepare_linear_weight(torch.randn(n, k, dtype=dtype) * 0.05) for n, k in _LAYER_SHAPES]

        def layer(x_by_k):
            for (_, k), w in zip(_LAYER_SHAPES, weights):
                ops.linear(x_by_k[k], w, None)

    flops_per_row = 2 * sum(n * k for n, k in _LAYER_SHAPES)
    curve = []
    for m in _ROWS:
        xs = {k: torch.randn(m, k, dtype=dtype) for _, k in _LAYER_SHAPES}
        sec = _timeit(lambda xs=xs: layer(xs), clock, min_time=0.04)
        curve.append([float(m), flops_per_row * m / sec])
    return curve


def _memory_bandwidth(torch, clock: Clock) -> float:
    src = torch.randn(32 * 2**20)  # 128 MiB: far beyond any cache
    dst = torch.empty_like(src)
    sec = _timeit(lambda: dst.copy_(src), clock, min_time=0.1, max_reps=20)
    return 2 * src.numel() * 4 / sec  # read + write


def _attention(torch, platform, ops, dtype, clock: Clock) -> tuple[float, float]:
    """(decode K/V bytes/s, prefill FLOP/s) of paged_attention, default-model head shapes."""
    heads, kv_heads, d, bs = 9, 3, 64, 16
    nseq, ctx = 32, 1024
    blocks_per = ctx // bs
    num_blocks = nseq * blocks_per + 64
    shape = platform.kv_cache_shape(num_blocks, bs, kv_heads, d)
    kc, vc = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    tables = torch.randperm(num_blocks)[: nseq * blocks_per].to(torch.int32).reshape(nseq, blocks_per)
    q = torch.randn(nseq, heads, d, dtype=dtype)
    seq_lens = torch.full((nseq,), ctx, dtype=torch.int32)
    qsl = torch.arange(nseq + 1, dtype=torch.int32)
    out = torch.empty_like(q)
    sec = _timeit(lambda: ops.paged_attention(q, kc, vc, tables, seq_lens, qsl, d**-0.5, out), clock)
    elem = torch.empty((), dtype=dtype).element_size()
    bw = (2 * nseq * ctx * kv_heads * d * elem + 2 * q.numel() * elem) / sec
    n = 2048  # a full step's budget of prefill
    qp = torch.randn(n, heads, d, dtype=dtype)
    one = tables.reshape(1, -1)[:, : n // bs].contiguous()
    sec = _timeit(
        lambda: ops.paged_attention(
            qp, kc, vc, one, torch.tensor([n], dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32), d**-0.5
        ),
        clock,
        min_time=0.05,
    )
    flops = 4 * heads * d * n * (n + 1) / 2
    return bw, flops / sec


def _engine_steps(device: str | None, threads: int | None, clock: Clock = time.perf_counter):
    """Measured (scheduled batch, seconds) of real engine steps of the default model."""
    from pagedserve.config import CacheConfig, DeviceConfig, EngineConfig
    from pagedserve.engine import LLMEngine
    from pagedserve.sampling_params import SamplingParams
    from pagedserve.simulate.cost_model import StepBatch

    engine = LLMEngine(
        EngineConfig(cache=CacheConfig(kv_cache_memory="512MiB"), device=DeviceConfig(device=device, threads=threads))
    )
    samples: list[tuple[StepBatch, float]] = []
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)
    for rnd, nseq in enumerate([1, 32]):
        for i in range(nseq):
            engine.add_request(
                f"cal-{rnd}-{i}",
                None,
                params,
                prompt_token_ids=[100 + (7 * i + j + 131 * rnd) % 40000 for j in range(32)],
            )
        while engine.has_unfinished_requests():
            batch = [(r.num_tokens - r.num_computed_tokens, r.num_tokens) for r in engine.scheduler.running]
            t0 = clock()
            engine.step()
            sec = clock() - t0
            # after the first (prefill) step, every step decodes all the running requests
            if len(batch) == nseq and all(q == 1 for q, _ in batch):
                samples.append((StepBatch([1] * nseq, [c for _, c in batch], nseq), sec))
    for n in (128, 512, 2048):  # prefill steps alone: they set the in-engine matmul efficiency
        engine.add_request(
            f"cal-prefill-{n}",
            None,
            SamplingParams(max_tokens=1, ignore_eos=True),
            prompt_token_ids=[100 + (3 * j + n) % 40000 for j in range(n)],
        )
        t0 = clock()
        engine.step()
        samples.append((StepBatch([n], [n], 1), clock() - t0))
        while engine.has_unfinished_requests():
            engine.step()
    engine.shutdown()
    return samples


def _fit_overhead(profile: HardwareProfile, samples) -> None:
    """Fit the in-engine matmul efficiency and per-token overhead (prefill steps of several
    lengths) and the fixed and per-sequence overheads (decode steps at two batch sizes) so
    that the cost model matches the measured engine steps."""
    from pagedserve.simulate.cost_model import CostModel
    from pagedserve.simulate.model_spec import ModelSpec, load_model_config

    cost = CostModel(ModelSpec.from_config(load_model_config(None)), profile, dtype="bfloat16")
    decodes = [(b, sec) for b, sec in samples if all(q == 1 for q in b.q_lens)]
    prefills = [(b, sec) for b, sec in samples if len(b.q_lens) == 1 and b.q_lens[0] > 1]

    def median(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2]

    for _ in range(4):  # alternate: prefill terms given the overheads, overheads given those
        if prefills:
            _fit_prefill(profile, cost, prefills)
        by_s: dict[int, list[float]] = {}
        for b, sec in decodes:
            parts = cost.breakdown(b)
            explained = sum(parts.values()) - parts["overhead"] + profile.per_token_overhead_s * b.num_tokens
            by_s.setdefault(len(b.q_lens), []).append(sec - explained)
        med = {s: median(v) for s, v in by_s.items()}
        s_lo, s_hi = min(med), max(med)
        per_seq = max(0.0, (med[s_hi] - med[s_lo]) / (s_hi - s_lo)) if s_hi > s_lo else 0.0
        profile.step_overhead_s = max(0.0, med[s_lo] - per_seq * s_lo)
        profile.per_seq_overhead_s = per_seq


def _fit_prefill(profile: HardwareProfile, cost, prefills) -> None:
    """Least squares over prefill steps: time - other terms = matmul time / eff + per_token x T."""
    rows = []
    for b, sec in prefills:
        parts = cost.breakdown(b)
        mm = (parts["linear"] + parts["lm_head"]) * profile.eff("matmul")  # at efficiency 1
        rest = sum(parts.values()) - parts["linear"] - parts["lm_head"] - profile.per_token_overhead_s * b.num_tokens
        rows.append((mm, float(b.num_tokens), sec - rest))
    sxx = sum(x * x for x, _, _ in rows)
    stt = sum(t * t for _, t, _ in rows)
    sxt = sum(x * t for x, t, _ in rows)
    sxy = sum(x * y for x, _, y in rows)
    sty = sum(t * y for _, t, y in rows)
    det = sxx * stt - sxt * sxt
    inv_eff, per_token = ((sxy * stt - sxt * sty) / det, (sxx * sty - sxt * sxy) / det) if det > 0 else (0.0, -1.0)
    if per_token < 0:
        inv_eff, per_token = sxy / sxx, 0.0
    if inv_eff < 1.0:  # faster than the micro-benchmark: keep its rate, explain the rest per token
        inv_eff, per_token = 1.0, max(0.0, sum(t * (y - x) for x, t, y in rows) / stt)
    profile.efficiency["matmul"] = 1.0 / inv_eff
    profile.per_token_overhead_s = per_token


def calibrate(device: str | None = None, threads: int | None = None, log=print, timer: str = "wall") -> HardwareProfile:
    """Measure this machine; ``timer`` "cpu" reads process CPU time (one thread only)."""
    import torch

    if timer not in TIMERS:
        raise ValueError(f"timer must be one of {', '.join(TIMERS)}, got {timer!r}")
    if timer == "cpu" and threads != 1:
        raise ValueError("--timer cpu measures one thread's work: use it with --threads 1")
    clock = TIMERS[timer]

    from pagedserve.platforms import select_platform

    platform, ops = select_platform(device)
    platform.configure_threads(threads, None)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if torch.bfloat16 in platform.supported_dtypes else platform.default_dtype
    t0 = time.perf_counter()
    curves = {"bfloat16": _matmul_curve(torch, ops, dtype, "bfloat16", clock)}
    if "gguf_linear" in dict(ops.table()):
        curves["q4_1"] = _matmul_curve(torch, ops, dtype, "q4_1", clock)
    log(
        f"  matmul: bf16 {curves['bfloat16'][-1][1] / 1e9:.1f} GFLOP/s at {int(curves['bfloat16'][-1][0])} rows "
        f"({time.perf_counter() - t0:.0f} s)"
    )
    bw = _memory_bandwidth(torch, clock)
    att_bw, att_flops = _attention(torch, platform, ops, dtype, clock)
    log(
        f"  memory {bw / 1e9:.1f} GB/s; attention {att_bw / 1e9:.1f} GB/s decode, {att_flops / 1e9:.1f} GFLOP/s "
        f"prefill ({time.perf_counter() - t0:.0f} s)"
    )
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    peak = max(p[1] for c in curves.values() for p in c)
    profile = HardwareProfile(
        name="cpu-local",
        memory_bytes=float(mem),
        memory_bandwidth=bw,
        peak_flops={"bfloat16": peak, "float16": peak, "float32": peak / 2},
        interconnect_bandwidth=bw / 10,
        interconnect_latency_s=5e-5,
        host_bandwidth=bw / 2,
        efficiency={"matmul": 1.0, "memory": 1.0, "attention": 1.0, "interconnect": 1.0, "host": 1.0},
        matmul_curve=curves,
        attention_bandwidth=att_bw,
        attention_flops=att_flops,
        default_memory_utilization=0.5,
        description=f"measured by `pagedserve simulate calibrate` on {platform.name} "
        f"({torch.get_num_threads()} threads, {timer} time) at {time.strftime('%Y-%m-%d %H:%M:%S')}",
        sources=[
            "rates measured through the platform's ops (docs/simulate.md); interconnect (TP/PP over "
            "local processes) assumed at a tenth of the copy bandwidth, not measured"
        ],
    )
    _fit_overhead(profile, _engine_steps(device, threads, clock))
    log(
        f"  in-engine matmul efficiency {profile.eff('matmul'):.2f}; step overhead "
        f"{profile.step_overhead_s * 1e3:.2f} ms + {profile.per_seq_overhead_s * 1e6:.0f} us/seq + "
        f"{profile.per_token_overhead_s * 1e6:.0f} us/token ({time.perf_counter() - t0:.0f} s)"
    )
    return profile


def run_calibration(args: argparse.Namespace) -> int:
    out = pathlib.Path(args.out).expanduser() if args.out else local_profile_path()
    print(f"calibrating this machine (about a minute) -> {out}")
    profile = calibrate(args.device, args.threads, timer=args.timer)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile.to_dict(), indent=1) + "\n", encoding="utf-8")
    print(f"wrote {out}; use --hardware {'cpu-local' if not args.out else out}")
    return 0
