"""`pagedserve simulate calibrate`: measure this machine and write a hardware profile.

Everything is measured on the model the profile is for (``--model``; default: the default
model, Q4_1 GGUF), loaded by a real engine, so its linear layers are exactly the ops and
weights the engine runs on this platform: the registry's ``gguf_linear`` (and its fused
``gguf_linear_silu_and_mul``) on blocks put through ``prepare_gguf_weight`` for a GGUF
model, ``linear`` on weights put through ``prepare_linear_weight`` for a bf16 one -- and,
where the platform picks an implementation per row count, the one it picks.

* matmul throughput by batch size: one decoder layer's projections (qkv, o and the
  model's own MLP forward) at 1 to 2048 rows -> ``matmul_curve[fmt]``, and the LM head
  (``compute_logits``) at 1 to 256 rows -> ``matmul_curve["lm_head:" + fmt]``, where
  ``fmt`` is the weight format the planner reads from the model's config (``q4_1``,
  ``bfloat16``, ...);
* memory bandwidth: a large tensor copy;
* attention: ``paged_attention`` on a decode batch (bytes of K/V read per second ->
  ``attention_bandwidth``) and on one 2048-token prefill (FLOP/s -> ``attention_flops``);
* in-engine efficiency and step overhead: a few real engine steps of that model.
  Prefill steps of 128, 512 and 2048 tokens set the matmul efficiency (the share of the
  micro-benchmarked matmul rate the whole forward reaches) and the per-token overhead
  by least squares; decode steps at 1, 16 and 64 sequences set ``step_overhead_s + S x
  per_seq_overhead_s`` (what the compute terms leave unexplained: input preparation,
  sampling, Python).

The curves and the fit are recorded per format in ``calibrated[fmt]`` with the ops that
ran; calibrating a second model of another format into the same file adds its entry
(same machine and threads), so one ``cpu-local`` can price both a GGUF and a bf16 model.
It takes one to two minutes and writes ``cpu-local`` (docs/simulate.md says where).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import pathlib
import platform as pyplatform
import time
from collections.abc import Callable
from typing import Any

from pagedserve.simulate.hardware import LM_HEAD_PREFIX, HardwareProfile, local_profile_path

__all__ = ["run_calibration", "calibrate", "merge_calibrations", "machine_id"]

# Dense in rows: kernels switch strategy at row thresholds (e.g. the CPU GGUF kernel
# dequantizes to a dense GEMM from 128 rows), and interpolation must not bridge a switch.
_ROWS = [1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 512, 1024, 2048]
# The LM head multiplies only the sampling rows: one per sequence of a step.
_HEAD_ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 256]


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


def _describe(weight, ops, dtype, gated: bool = False) -> str:
    """Which registry op multiplies with ``weight`` (and its implementation), and how the
    weight was prepared, as the model's forward calls it."""
    import torch

    sources = dict(ops.table())

    def op(name: str) -> str:
        return f"{name} [{sources.get(name, 'absent')}]"

    if isinstance(weight, torch.Tensor):
        prep = op("prepare_linear_weight") if "prepare_linear_weight" in sources else "as loaded"
        main = op("linear_silu_and_mul" if gated else "linear")
        return f"{main} on {str(dtype).replace('torch.', '')} weights ({prep})"
    type_name = getattr(weight, "type_name", None)
    if type_name is not None:  # GGUF blocks
        fused = gated and getattr(weight, "gated_op", None) is not None
        prep = op("prepare_gguf_weight") if getattr(weight, "packed", None) is not None else "blocks as loaded"
        return f"{op('gguf_linear_silu_and_mul' if fused else 'gguf_linear')} on {type_name} blocks ({prep})"
    return f"{type(weight).__name__}.apply"


def _layer_linears(engine) -> tuple[Callable[[int], Callable[[], Any]], dict[str, str]]:
    """A factory of one middle decoder layer's projections at ``m`` rows (qkv, o and the
    model's own MLP forward, on the engine's prepared weights), and what each runs."""
    import torch

    model = engine.runner.model
    layer = model.layers[len(model.layers) // 2]
    index = model.layer_start + len(model.layers) // 2
    ops, dtype = model.ops, engine.dtype
    if not all(hasattr(layer, f) for f in ("qkv", "o")) or not hasattr(model, "mlp_forward"):
        raise ValueError(
            f"calibration times a Llama-style decoder layer (fused qkv, o and an MLP forward); "
            f"{type(model).__name__} has none: calibrate with a Llama-family model of the same weight format"
        )
    from pagedserve.models.layers import linear

    hidden, q_size = model.cfg.hidden_size, model.q_size
    mlp = {f: getattr(layer, f) for f in ("gate_up", "down", "fc", "proj") if getattr(layer, f, None) is not None}
    what = {"qkv": _describe(layer.qkv, ops, dtype), "o": _describe(layer.o, ops, dtype)}
    what.update({f: _describe(w, ops, dtype, gated=f == "gate_up") for f, w in mlp.items()})

    def at(m: int) -> Callable[[], Any]:
        h = torch.randn(m, hidden, dtype=dtype) * 0.5
        a = torch.randn(m, q_size, dtype=dtype) * 0.5
        bias = getattr(layer, "qkv_bias", None)

        def run() -> None:
            linear(ops, h, layer.qkv, bias)
            linear(ops, a, layer.o)
            model.mlp_forward(ops, index, layer, h)

        return run

    return at, what


def _model_curves(torch, engine, spec, fmt: str, clock: Clock, rows: list[int], head_rows: list[int]):
    """(curves by key, ops by projection): the layer's linears and the LM head, measured."""
    at, what = _layer_linears(engine)
    model = engine.runner.model
    what["lm_head"] = "compute_logits: " + _describe(model.lm_head, model.head_ops, engine.dtype)
    layer_flops = 2.0 * spec.layer_params_active / spec.num_layers
    head_flops = 2.0 * spec.embedding_params
    curves: dict[str, list[list[float]]] = {fmt: [], LM_HEAD_PREFIX + fmt: []}
    with torch.inference_mode():
        for m in rows:
            sec = _timeit(at(m), clock, min_time=0.04)
            curves[fmt].append([float(m), layer_flops * m / sec])
        for m in head_rows:
            h = torch.randn(m, model.cfg.hidden_size, dtype=engine.dtype) * 0.5
            sec = _timeit(lambda h=h: model.compute_logits(h), clock, min_time=0.04)
            curves[LM_HEAD_PREFIX + fmt].append([float(m), head_flops * m / sec])
    return curves, what


def _memory_bandwidth(torch, clock: Clock) -> float:
    src = torch.randn(32 * 2**20)  # 128 MiB: far beyond any cache
    dst = torch.empty_like(src)
    sec = _timeit(lambda: dst.copy_(src), clock, min_time=0.1, max_reps=20)
    return 2 * src.numel() * 4 / sec  # read + write


def _attention(torch, platform, ops, dtype, clock: Clock, bs: int) -> tuple[float, float]:
    """(decode K/V bytes/s, prefill FLOP/s) of paged_attention, default-model head shapes,
    over blocks of ``bs`` tokens (the engine's)."""
    heads, kv_heads, d = 9, 3, 64
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


def _build_engine(model: str | None, device: str | None, threads: int | None):
    """A real engine of ``model``: its weights loaded and prepared as for serving."""
    from pagedserve.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig
    from pagedserve.engine import LLMEngine

    return LLMEngine(
        EngineConfig(
            model=ModelConfig(model=model),
            cache=CacheConfig(kv_cache_memory="512MiB"),
            device=DeviceConfig(device=device, threads=threads),
        )
    )


def _engine_steps(engine, clock: Clock = time.perf_counter):
    """Measured (scheduled batch, seconds) of real engine steps of the engine's model."""
    from pagedserve.sampling_params import SamplingParams
    from pagedserve.simulate.cost_model import StepBatch

    samples: list[tuple[StepBatch, float]] = []
    # Decode batches from one sequence to the 64 of the fixed benchmark, ten steps each:
    # a line through three medians is steadier than through two.
    params = SamplingParams(max_tokens=11, ignore_eos=True, temperature=0.0)
    for rnd, nseq in enumerate([1, 16, 64]):
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
        # The platform may split a long prompt into chunks (the CPU's 512 tokens a step):
        # each step is recorded with the tokens it computed over the context it reached.
        req = engine.scheduler.requests[f"cal-prefill-{n}"]
        while engine.has_unfinished_requests():
            before = req.num_computed_tokens
            t0 = clock()
            engine.step()
            sec = clock() - t0
            done = req.num_computed_tokens
            if done - before > 1:
                samples.append((StepBatch([done - before], [done], int(done >= n)), sec))
    return samples


def _fit_overhead(profile: HardwareProfile, samples, spec=None) -> None:
    """Fit the in-engine matmul efficiency and per-token overhead (prefill steps of several
    lengths) and the fixed and per-sequence overheads (decode steps at two batch sizes) so
    that the cost model of ``spec`` (default: the default model) matches the measured
    engine steps."""
    from pagedserve.simulate.cost_model import CostModel
    from pagedserve.simulate.model_spec import ModelSpec, load_model_config

    spec = spec or ModelSpec.from_config(load_model_config(None))
    cost = CostModel(spec, profile, dtype="bfloat16")
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
        # least squares line through the per-batch-size medians: overhead = step + S x per_seq
        s_mean, y_mean = sum(med) / len(med), sum(med.values()) / len(med)
        sxx = sum((s - s_mean) ** 2 for s in med)
        slope = sum((s - s_mean) * (y - y_mean) for s, y in med.items()) / sxx if sxx > 0 else 0.0
        per_seq = max(0.0, slope)
        profile.step_overhead_s = max(0.0, y_mean - per_seq * s_mean)
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


def machine_id(platform_name: str, threads: int, timer: str) -> str:
    """What must match for two calibrations to share a profile: CPU model, platform,
    threads and clock."""
    cpu = pyplatform.processor() or pyplatform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{cpu}; {platform_name}; {threads} threads; {timer} time"


def calibrate(
    device: str | None = None,
    threads: int | None = None,
    log=print,
    timer: str = "wall",
    model: str | None = None,
    rows: list[int] | None = None,
) -> HardwareProfile:
    """Measure this machine running ``model`` (default: the default model); ``timer``
    "cpu" reads process CPU time (one thread only); ``rows`` overrides the row counts of
    the matmul curve (a shorter run)."""
    import torch

    if timer not in TIMERS:
        raise ValueError(f"timer must be one of {', '.join(TIMERS)}, got {timer!r}")
    if timer == "cpu" and threads != 1:
        raise ValueError("--timer cpu measures one thread's work: use it with --threads 1")
    clock = TIMERS[timer]

    from pagedserve.simulate.model_spec import ModelSpec, load_model_config

    spec = ModelSpec.from_config(load_model_config(model), name=model or "smollm2-135m-instruct")
    fmt = spec.weight_format
    t0 = time.perf_counter()
    engine = _build_engine(model, device, threads)
    try:
        platform, ops, dtype = engine.platform, engine.ops, engine.dtype
        torch.manual_seed(0)
        rows = rows or _ROWS
        curves, what = _model_curves(torch, engine, spec, fmt, clock, rows, [r for r in _HEAD_ROWS if r <= rows[-1]])
        log(f"  {spec.name}: {fmt} weights; linears run " + "; ".join(f"{k}: {v}" for k, v in what.items()))
        log(
            f"  matmul ({fmt}): {curves[fmt][0][1] / 1e9:.1f} GFLOP/s at 1 row, {curves[fmt][-1][1] / 1e9:.1f} at "
            f"{int(curves[fmt][-1][0])} rows ({time.perf_counter() - t0:.0f} s)"
        )
        bw = _memory_bandwidth(torch, clock)
        att_bw, att_flops = _attention(torch, platform, ops, dtype, clock, int(engine.config.cache.block_size))
        log(
            f"  memory {bw / 1e9:.1f} GB/s; attention {att_bw / 1e9:.1f} GB/s decode, {att_flops / 1e9:.1f} GFLOP/s "
            f"prefill ({time.perf_counter() - t0:.0f} s)"
        )
        samples = _engine_steps(engine, clock)
    finally:
        engine.shutdown()
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    peak = max(p[1] for c in curves.values() for p in c)
    nthreads = torch.get_num_threads()
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
        long_prefill_token_threshold=int(platform.default_long_prefill_token_threshold),
        block_size=int(engine.config.cache.block_size),
        description=f"measured by `pagedserve simulate calibrate` on {platform.name} "
        f"({nthreads} threads, {timer} time) at {time.strftime('%Y-%m-%d %H:%M:%S')}",
        sources=[
            "rates measured through the platform's ops on the model's own prepared weights (docs/simulate.md); "
            "interconnect (TP/PP over local processes) assumed at a tenth of the copy bandwidth, not measured"
        ],
    )
    _fit_overhead(profile, samples, spec)
    profile.calibrated[fmt] = {
        "model": spec.name,
        "machine": machine_id(platform.name, nthreads, timer),
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "ops": what,
        "efficiency_matmul": profile.eff("matmul"),
        "step_overhead_s": profile.step_overhead_s,
        "per_seq_overhead_s": profile.per_seq_overhead_s,
        "per_token_overhead_s": profile.per_token_overhead_s,
    }
    log(
        f"  in-engine matmul efficiency {profile.eff('matmul'):.2f}; step overhead "
        f"{profile.step_overhead_s * 1e3:.2f} ms + {profile.per_seq_overhead_s * 1e6:.0f} us/seq + "
        f"{profile.per_token_overhead_s * 1e6:.0f} us/token ({time.perf_counter() - t0:.0f} s)"
    )
    return profile


def merge_calibrations(old: HardwareProfile, new: HardwareProfile, log=print) -> HardwareProfile:
    """``new`` plus the formats ``old`` calibrated on the same machine that ``new`` lacks
    (their curves and fits); machine-wide rates (memory, attention) are ``new``'s.
    Neither argument is changed."""
    new = copy.deepcopy(new)
    mine = {e["machine"] for e in new.calibrated.values()}
    for fmt, entry in old.calibrated.items():
        if fmt in new.calibrated:
            continue
        if entry.get("machine") not in mine:
            log(f"  dropping the {fmt} calibration of {old.name}: measured on {entry.get('machine')}, not here")
            continue
        new.calibrated[fmt] = entry
        for key in (fmt, LM_HEAD_PREFIX + fmt):
            if key in old.matmul_curve:
                new.matmul_curve[key] = old.matmul_curve[key]
        log(f"  keeping the {fmt} calibration ({entry.get('model')}, {entry.get('when')})")
    new.peak_flops = {k: max(v, old.peak_flops.get(k, 0.0)) for k, v in new.peak_flops.items()}
    return new


def run_calibration(args: argparse.Namespace) -> int:
    out = pathlib.Path(args.out).expanduser() if args.out else local_profile_path()
    print(f"calibrating this machine on {args.model or 'the default model'} (one to two minutes) -> {out}")
    profile = calibrate(args.device, args.threads, timer=args.timer, model=args.model)
    if out.is_file():
        try:
            old = HardwareProfile.from_dict(json.loads(out.read_text(encoding="utf-8")))
        except ValueError as e:  # an unreadable or older file is replaced
            print(f"  replacing {out}: {e}")
        else:
            profile = merge_calibrations(old, profile)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile.to_dict(), indent=1) + "\n", encoding="utf-8")
    print(
        f"wrote {out} (formats: {', '.join(sorted(profile.calibrated))}); use --hardware "
        f"{'cpu-local' if not args.out else out}"
    )
    return 0
