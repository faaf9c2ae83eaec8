"""Native CPU kernels vs the torch references.

Paged attention on decode batches (the default model's attention shape: 9 query
heads, 3 kv heads, head size 64, bf16, block size 16, shuffled block tables) and, with
--ops, the row-wise ops at decode and prefill sizes of the same model (hidden 576,
intermediate 1536); with --linear, one decode step's bf16 linear layers through torch's
GEMM, oneDNN and the native kernels; with --moe, fused_moe (reference vs native); with
--gguf, the same layers on Q4_1 GGUF blocks (the default model's format) through the
row-by-row int8 kernel and the tiled one on repacked weights, against the packed bf16
kernel, in GOP/s and as a fraction of the int8 VNNI peak (``--int8-peak``, GOP/s; by
default estimated from /proc/cpuinfo); with --gguf-mlp, the 30 gated MLPs' first halves
on Q4_1 [gate; up] blocks, gguf_linear then silu_and_mul against the fused
gguf_linear_silu_and_mul, the two alternating; with --gguf-types, every GGUF block type
with a CPU kernel (Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K on the file's blocks and repacked,
Q8_0 repacked) on the default model's gate_up (576 -> 3072; K-quants need K a multiple of 256, so
they take 768 -> 3072) and down (1536 -> 576) layers; with --window, attention with a sliding window
(512) and a soft-cap (50) at decode and prefill shapes; with --candidates, every
paged_attention implementation of the CPU platform (native, AMX tiles where the CPU has
them, torch SDPA over gathered K/V) on prefill chunks, decode batches and a mixed step.  Prints one table per kind with
the speedup (reference / native).

    python benchmarks/cpu_kernels.py [--seqs 1 4 16 64] [--contexts 128 512 2048]
                                     [--dtype bf16] [--isa avx2] [--ops] [--threads N]
                                     [--huge-pages] [--cpu-time] [--prefill] [--linear]
                                     [--token-major] [--layers 30] [--moe] [--window]
                                     [--gguf] [--rows 1 4 16 64 256] [--int8-peak GOPS]
                                     [--no-row-kernel] [--gguf-mlp] [--gguf-types] [--candidates]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from pagedserve.kernels import reference
from pagedserve.kernels.cpu import load_cpu_kernels
from pagedserve.kernels.cpu.hugepages import empty_huge_pages

__all__ = [
    "time_call",
    "attention_inputs",
    "prefill_inputs",
    "bench_attention",
    "bench_prefill",
    "bench_attention_candidates",
    "mixed_inputs",
    "bench_window",
    "bench_ops",
    "bench_linear",
    "bench_moe",
    "bench_gguf_linear",
    "bench_gguf_types",
    "int8_peak_gops",
    "main",
]

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def time_call(
    fn: Callable[[], object],
    min_seconds: float = 0.3,
    min_reps: int = 5,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Median seconds of one call on ``clock``, after a warm-up call."""
    fn()
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < min_reps or time.perf_counter() - start < min_seconds:
        t0 = clock()
        fn()
        samples.append(clock() - t0)
        if len(samples) >= 1000:
            break
    return statistics.median(samples)


def attention_inputs(
    num_seqs: int,
    context: int,
    dtype: torch.dtype,
    num_heads: int = 9,
    num_kv_heads: int = 3,
    head_size: int = 64,
    block_size: int = 16,
    huge_pages: bool = False,
    token_major: bool = False,
    layers: int = 1,
) -> tuple:
    """A decode batch: one query token per sequence, ``context`` keys each, blocks shuffled.

    The caches are laid out as the CPU platform allocates them (reference-shaped views
    of head-major storage) unless ``token_major``; ``layers`` (key, value) pairs are
    made, so a timed loop over them reads its KV from memory as a decode step does.
    Returns (query, [(key_cache, value_cache)] * layers, block_tables, seq_lens,
    query_start_loc)."""
    blocks_per_seq = (context + block_size - 1) // block_size
    num_blocks = num_seqs * blocks_per_seq
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    storage = shape if token_major else (num_blocks, num_kv_heads, block_size, head_size)

    def cache() -> torch.Tensor:
        t = empty_huge_pages(storage, dtype) if huge_pages else torch.empty(storage, dtype=dtype)
        t.copy_(torch.randn(storage))
        return t if token_major else t.transpose(1, 2)

    caches = [(cache(), cache()) for _ in range(layers)]
    block_tables = torch.randperm(num_blocks).to(torch.int32).view(num_seqs, blocks_per_seq)
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int32)
    query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int32)
    query = torch.randn(num_seqs, num_heads, head_size).to(dtype)
    return query, caches, block_tables, seq_lens, query_start_loc


def bench_attention(
    native,
    seqs: list[int],
    contexts: list[int],
    dtype: torch.dtype,
    huge_pages: bool = False,
    clock: Callable[[], float] = time.perf_counter,
    token_major: bool = False,
    layers: int = 1,
) -> list[tuple]:
    """Per layer: reference us (first layer), native us (mean over ``layers``) and the
    KV bytes the native kernel read per second."""
    rows = []
    for n in seqs:
        for ctx in contexts:
            query, caches, *meta = attention_inputs(
                n, ctx, dtype, huge_pages=huge_pages, token_major=token_major, layers=layers
            )
            out = torch.empty_like(query)
            scale = query.shape[-1] ** -0.5
            t_native = (
                time_call(
                    lambda: [native.paged_attention(query, k, v, *meta, scale, out) for k, v in caches], clock=clock
                )
                / layers
            )
            k0, v0 = caches[0]
            t_ref = time_call(
                lambda: reference.paged_attention(query, k0, v0, *meta, scale, out),
                min_seconds=0.2,
                min_reps=3,
                clock=clock,
            )
            kv_bytes = 2 * n * ctx * k0.shape[2] * k0.shape[3] * k0.element_size()
            rows.append((n, ctx, t_ref * 1e6, t_native * 1e6, t_ref / t_native, kv_bytes / t_native / 1e9))
    return rows


def prefill_inputs(q_len: int, context: int, dtype: torch.dtype, block_size: int = 16) -> tuple[torch.Tensor, ...]:
    """One prefill chunk: the last ``q_len`` of ``context`` positions (a prefix-cache
    continuation when q_len < context), default-model heads, blocks shuffled."""
    query, caches, block_tables, seq_lens, _ = attention_inputs(1, context, dtype, block_size=block_size)
    ((key_cache, value_cache),) = caches
    query = torch.randn(q_len, *query.shape[1:]).to(dtype)
    query_start_loc = torch.tensor([0, q_len], dtype=torch.int32)
    return query, key_cache, value_cache, block_tables, seq_lens, query_start_loc


def bench_prefill(
    native, shapes: list[tuple[int, int]], dtype: torch.dtype, clock: Callable[[], float] = time.perf_counter
) -> list[tuple]:
    rows = []
    for q_len, ctx in shapes:
        args = prefill_inputs(q_len, ctx, dtype)
        out = torch.empty_like(args[0])
        t_native = time_call(lambda: native.paged_attention(*args, 0.125, out), clock=clock)
        t_ref = time_call(lambda: reference.paged_attention(*args, 0.125, out), clock=clock)
        rows.append((q_len, ctx, t_ref * 1e6, t_native * 1e6, t_ref / t_native))
    return rows


def mixed_inputs(prefill: tuple[int, int], decodes: int, context: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """One (q_len, context) prefill chunk after ``decodes`` decode sequences of
    ``context`` keys each: a step of the mixed workload (decodes first, as scheduled)."""
    q_len, ctx = prefill
    seqs = [(1, context)] * decodes + [(q_len, ctx)]
    block = 16
    need = [(c + block - 1) // block for _, c in seqs]
    query, ((kc, vc),), *_ = attention_inputs(1, sum(need) * block, dtype, block_size=block)
    ids = torch.randperm(kc.shape[0]).to(torch.int32)
    tables = torch.zeros(len(seqs), max(need), dtype=torch.int32)
    start = 0
    for i, n in enumerate(need):
        tables[i, :n] = ids[start : start + n]
        start += n
    q_lens = torch.tensor([q for q, _ in seqs])
    query = torch.randn(int(q_lens.sum()), *query.shape[1:]).to(dtype)
    seq_lens = torch.tensor([c for _, c in seqs], dtype=torch.int32)
    qsl = torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)]).to(torch.int32)
    return query, kc, vc, tables, seq_lens, qsl


def bench_attention_candidates(
    native, dtype: torch.dtype, clock: Callable[[], float] = time.perf_counter, rounds: int = 5
) -> list[tuple]:
    """Every paged_attention candidate of the CPU platform (platforms/cpu/attention_ops.py)
    on the default model's heads: prefill chunks, decode batches and a mixed step.  The
    candidates alternate within each round; medians of the rounds.  The first row is
    the header."""
    from pagedserve.platforms.cpu.attention_ops import attention_candidates

    candidates = attention_candidates(native)
    cases = [
        (f"prefill {q}x{c}", prefill_inputs(q, c, dtype)) for q, c in [(16, 1024), (128, 1024), (512, 512), (512, 1024)]
    ]
    for n, c in [(64, 128), (64, 1024)]:
        query, ((kc, vc),), *meta = attention_inputs(n, c, dtype)
        cases.append((f"decode {n}x{c}", (query, kc, vc, *meta)))
    cases.append(("mixed 32x512+512x1024", mixed_inputs((512, 1024), 32, 512, dtype)))
    rows = []
    for label, args in cases:
        out = torch.empty_like(args[0])
        times: dict[str, list[float]] = {name: [] for name in candidates}
        for _ in range(rounds):
            for name, fn in candidates.items():
                times[name].append(time_call(lambda: fn(*args, 0.125, out), min_seconds=0.05, min_reps=3, clock=clock))
        med = {name: statistics.median(t) * 1e6 for name, t in times.items()}
        best = min(med, key=med.__getitem__)
        rows.append((label, *(f"{med[name]:.0f}" for name in candidates), best, f"{med['native'] / med[best]:.2f}"))
    return [("case", *candidates, "fastest", "native/fastest"), *rows]


def _op_cases(tokens: int, dtype: torch.dtype) -> dict[str, tuple[Callable, Callable]]:
    """name -> (reference call, native call factory inputs) for one batch size."""
    hidden, inter, heads, kv_heads, head = 576, 1536, 9, 3, 64
    x = torch.randn(tokens, hidden).to(dtype)
    res = torch.randn(tokens, hidden).to(dtype)
    w = torch.randn(hidden).to(dtype)
    gate_up = torch.randn(tokens, 2 * inter).to(dtype)
    q = torch.randn(tokens, heads, head).to(dtype)
    k = torch.randn(tokens, kv_heads, head).to(dtype)
    pos = torch.randint(0, 2048, (tokens,))
    freqs = torch.outer(torch.arange(2048).float(), 1.0 / 10000 ** (torch.arange(0, head, 2).float() / head))
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    kv = torch.randn(tokens, kv_heads, head).to(dtype)
    cache = torch.empty(tokens // 16 + 8, 16, kv_heads, head, dtype=dtype)
    slots = torch.randperm(cache.shape[0] * 16)[:tokens]
    return {
        "rms_norm": (lambda o: o.rms_norm(x, w, 1e-5)),
        "fused_add_rms_norm": (lambda o: o.fused_add_rms_norm(x, res, w, 1e-5)),
        "rotary_embedding": (lambda o: o.rotary_embedding(pos, q, k, cos_sin)),
        "silu_and_mul": (lambda o: o.silu_and_mul(gate_up)),
        "reshape_and_cache": (lambda o: o.reshape_and_cache(kv, kv, cache, cache, slots)),
    }


def bench_ops(
    native, token_counts: list[int], dtype: torch.dtype, clock: Callable[[], float] = time.perf_counter
) -> list[tuple]:
    rows = []
    for tokens in token_counts:
        for name, call in _op_cases(tokens, dtype).items():
            t_ref = time_call(lambda: call(reference), clock=clock)
            t_native = time_call(lambda: call(native), clock=clock)
            rows.append((name, tokens, t_ref * 1e6, t_native * 1e6, t_ref / t_native))
    return rows


#: (in, out, per model) of the default model's linear layers: fused qkv, o, fused
#: gate_up, down (x 30 layers) and the LM head.
MODEL_LINEARS = ((576, 960, 30), (576, 576, 30), (576, 3072, 30), (1536, 576, 30), (576, 49152, 1))


def bench_linear(native, rows: list[int], clock: Callable[[], float] = time.perf_counter) -> list[tuple]:
    """Every bf16 linear layer of one decode step of the default model, each layer with
    its own weights (30 of each, as in the model: read from memory, not from cache):
    torch's GEMM on plain weights, the native op on plain weights (the skinny kernel up
    to LINEAR_MAX_ROWS rows), oneDNN on its packed weights, and the native packed
    kernel (what the CPU platform runs where it is built)."""
    from pagedserve.platforms.cpu import dense_ops

    layers = [[torch.randn(n, k).bfloat16() for _ in range(count)] for k, n, count in MODEL_LINEARS]
    onednn = [[dense_ops.prepare_linear_weight(w) for w in ws] for ws in layers]
    nat = [[native.pack_linear_weight(w) for w in ws] for ws in layers] if native.has_packed_linear else None
    onednn_linear = dense_ops.make_linear(reference.linear)
    out = []
    for m in rows:
        xs = [torch.randn(m, ws[0].shape[1]).bfloat16() for ws in layers]

        def step(fn, weights) -> float:
            return time_call(lambda: [fn(x, w) for x, ws in zip(xs, weights) for w in ws], clock=clock) * 1e3

        t_ref = step(reference.linear, layers)
        t_skinny = step(native.linear, layers)
        t_onednn = step(onednn_linear, onednn)
        t_nat = step(native.packed_linear, nat) if nat is not None else float("nan")
        out.append((m, t_ref, t_skinny, t_onednn, t_nat, t_onednn / t_nat))
    return out


#: (experts, top_k, hidden, intermediate) of the fused_moe cases: the tiny Qwen3-MoE of
#: benchmarks/moe_vs_dense.py and a wider one whose experts (50 MB bf16) leave the cache.
MOE_SHAPES = ((8, 2, 512, 256), (16, 2, 1024, 512))


def bench_moe(tokens: list[int], dtype: torch.dtype, clock: Callable[[], float] = time.perf_counter) -> list[tuple]:
    """fused_moe: the reference (a torch GEMM per active expert) against the native
    kernel on plain weights and on weights put through the CPU's prepare_moe_weights
    (packed where the build has the bf16 micro-kernels), with GFLOP/s of the native ones
    (2 * T * K * 3 * H * I flops per call)."""
    from pagedserve.platforms.cpu import moe_ops

    out = []
    gen = torch.Generator().manual_seed(0)
    for experts, top_k, hidden, inter in MOE_SHAPES:
        w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5).to(dtype)
        w2 = (torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5).to(dtype)
        p13, p2 = moe_ops.prepare_moe_weights(w13, w2)
        for t in tokens:
            x = torch.randn(t, hidden, generator=gen).to(dtype)
            logits = torch.randn(t, experts, generator=gen)
            weights, ids = torch.topk(torch.softmax(logits, -1), top_k)
            flops = 2 * t * top_k * 3 * hidden * inter
            t_ref = time_call(lambda: reference.fused_moe(x, w13, w2, weights, ids), clock=clock)
            t_nat = time_call(lambda: moe_ops.fused_moe(x, w13, w2, weights, ids), clock=clock)
            t_pack = time_call(lambda: moe_ops.fused_moe(x, p13, p2, weights, ids), clock=clock)
            out.append(
                (
                    f"E{experts} k{top_k} H{hidden} I{inter}",
                    t,
                    t_ref * 1e6,
                    t_nat * 1e6,
                    t_pack * 1e6,
                    flops / t_pack / 1e9,
                    t_ref / t_pack,
                )
            )
    return out


def int8_peak_gops() -> float:
    """An estimate of the int8 VNNI peak in GOP/s (multiply and add counted apart): cores
    x the clock /proc/cpuinfo reports x 2 512-bit vpdpbusd per cycle (64 products each:
    Zen 4/5 and recent Intel server cores; 1 per cycle on cores with one 512-bit FMA pipe
    would halve it) x 2 operations per product."""
    mhz = [float(line.split(":")[1]) for line in open("/proc/cpuinfo") if line.startswith("cpu MHz")]
    return torch.get_num_threads() * max(mhz) * 1e-3 * 2 * 64 * 2


def bench_gguf_linear(
    native,
    rows: list[int],
    peak: float,
    clock: Callable[[], float] = time.perf_counter,
    row_kernel: bool = True,
) -> list[tuple]:
    """The layers of ``bench_linear`` (30 of each, the LM head once) as Q4_1 GGUF blocks:
    the packed bf16 kernel, the row-by-row int8 kernel on the file's blocks (NaN where
    ``row_kernel`` is false) and the tiled int8 kernel on repacked weights, each with a
    bf16 output as the model gets it, each whole decode step in ms and GOP/s, the tiled
    kernel also as a fraction of ``peak`` (GOP/s)."""
    from pagedserve.kernels.cpu.quant_native import load_quant_kernels
    from pagedserve.kernels.quant_reference import GGUF_TYPE_IDS

    quant = load_quant_kernels()
    if quant is None or not quant.has_packed():
        raise SystemExit("the tiled GGUF kernel is unavailable on this machine")
    q41 = GGUF_TYPE_IDS["Q4_1"]

    def random_q41(n: int, k: int) -> torch.Tensor:
        raw = torch.randint(0, 256, (n, k // 32, 20), dtype=torch.uint8)
        raw[..., 0:2] = (torch.rand(n, k // 32) * 0.02 + 1e-3).half().view(torch.uint8).reshape(n, -1, 2)
        raw[..., 2:4] = (torch.randn(n, k // 32) * 0.05).half().view(torch.uint8).reshape(n, -1, 2)
        return raw.reshape(n, -1)

    bf16 = [[native.pack_linear_weight(torch.randn(n, k).bfloat16()) for _ in range(c)] for k, n, c in MODEL_LINEARS]
    raw = [[random_q41(n, k) for _ in range(c)] for k, n, c in MODEL_LINEARS]
    packed = [[quant.pack_weight(w, q41) for w in ws] for ws in raw]
    params = sum(k * n * c for k, n, c in MODEL_LINEARS)
    out = []
    for m in rows:
        xs = [torch.randn(m, k).bfloat16() for k, _, _ in MODEL_LINEARS]

        def step(fn, weights) -> float:
            return time_call(lambda: [fn(x, w) for x, ws in zip(xs, weights) for w in ws], clock=clock)

        t_bf16 = step(native.packed_linear, bf16)
        t_rows = step(lambda x, w: quant.gguf_linear_out(x, w, q41), raw) if row_kernel else float("nan")
        t_tiled = step(lambda x, w: quant.gguf_linear_out(x, w, q41), packed)
        gops = [2 * m * params / t * 1e-9 for t in (t_bf16, t_rows, t_tiled)]
        out.append((m, t_bf16 * 1e3, t_rows * 1e3, t_tiled * 1e3, *gops, gops[2] / peak * 100, t_bf16 / t_tiled))
    return out


#: (in, out) of --gguf-types: the default model's gate_up and down layers (30 of each).
GGUF_TYPE_SHAPES = ((576, 3072), (1536, 576))


def random_gguf_blocks(type_name: str, n: int, k: int) -> torch.Tensor:
    """uint8 [n, row bytes] of ``type_name``: random quants with realistic fp16 scales."""
    from pagedserve.kernels import quant_reference as qref

    bb, per = qref.GGUF_BLOCK_BYTES[type_name], qref.GGUF_BLOCK_VALUES[type_name]
    raw = torch.randint(0, 256, (n, k // per, bb), dtype=torch.uint8)
    for at in [208] if type_name == "Q6_K" else [0] if type_name in ("Q4_0", "Q5_0", "Q8_0") else [0, 2]:
        scale = (torch.rand(n, k // per) * 0.02 + 1e-3) / (32 if per == 256 else 1)
        raw[..., at : at + 2] = scale.half().view(torch.uint8).reshape(n, -1, 2)
    return raw.reshape(n, -1)


def bench_gguf_types(rows: list[int], clock: Callable[[], float] = time.perf_counter, layers: int = 30) -> list[tuple]:
    """``layers`` copies of each of GGUF_TYPE_SHAPES (read from memory, as in a decode step)
    in each block type the CPU kernel takes, bf16 activations and outputs: ms per
    ``layers`` calls, for each row count.  K-quants take K rounded up to 256 (768 for 576)."""
    from pagedserve.kernels import quant_reference as qref
    from pagedserve.kernels.cpu.quant_native import load_quant_kernels

    quant = load_quant_kernels()
    if quant is None:
        raise SystemExit("the GGUF CPU kernel is unavailable on this machine")
    # Each type on its tiled kernel (repacked at load) and on the row kernel (the file's blocks).
    variants = [("Q4_1 tiled", "Q4_1", True), ("Q4_1", "Q4_1", False), ("Q8_0 tiled", "Q8_0", True)]
    for t in qref.GGUF_EXTENDED_TYPES:
        variants += [(f"{t} tiled", t, True), (t, t, False)]
    out = []
    for k0, n in GGUF_TYPE_SHAPES:
        times: dict[tuple[str, int], float] = {}
        for label, type_name, packed in variants:
            per = qref.GGUF_BLOCK_VALUES[type_name]
            k = -(-k0 // per) * per
            tid = qref.GGUF_TYPE_IDS[type_name]
            ws = [random_gguf_blocks(type_name, n, k) for _ in range(layers)]
            if packed:
                if not quant.has_packed() or (per == 256 and not quant.has_kpacked(tid)):
                    continue
                ws = [quant.pack_weight(w, tid) for w in ws]
            for m in rows:
                x = torch.randn(m, k).bfloat16()
                times[label, m] = time_call(lambda: [quant.gguf_linear_out(x, w, tid) for w in ws], clock=clock) * 1e3
        labels = [v[0] for v in variants if (v[0], rows[0]) in times]
        for m in rows:
            out.append((f"{k0}->{n}", m, *(times[label, m] for label in labels)))
    return [tuple(["shape", "rows", *labels])] + out


def bench_gguf_stacked(
    rows: list[int], clock: Callable[[], float] = time.perf_counter, layers: int = 15
) -> list[tuple]:
    """A Q4_K_M's mixed q/k/v (the default model's: [q; k] Q5_0 576 + 192 rows, v Q8_0 192
    rows, K 576) in ``layers`` copies: as two repacked weights (two kernel calls, outputs
    concatenated), as the same two in one ``gguf_linear_stacked`` call (a StackedWeight
    on the CPU), and as one Q8_0 weight holding the same values (``widen_blocks``); and a
    Q5_K_M's ([q; k] Q5_1) two calls and one stacked call.  bf16 activations: ms per
    ``layers`` calls."""
    from pagedserve.kernels import quant_reference as qref
    from pagedserve.platforms.cpu import quant_ops
    from pagedserve.quantization.gguf import GGUFWeight, StackedWeight, widen_blocks

    stacked_op = quant_ops.make_gguf_linear_stacked(quant_ops.gguf_linear)

    def weight(t: str, data: torch.Tensor) -> GGUFWeight:
        return GGUFWeight(
            t, data, 576, quant_ops.gguf_linear, quant_ops.prepare_gguf_weight, op_out_dtype=True, stacked_op=stacked_op
        ).prepared()

    two, widened, two51 = [], [], []
    for _ in range(layers):
        qk, v = random_gguf_blocks("Q5_0", 768, 576), random_gguf_blocks("Q8_0", 192, 576)
        two.append(StackedWeight([weight("Q5_0", qk), weight("Q8_0", v)]))
        widened.append(weight("Q8_0", torch.cat([widen_blocks(qk, "Q5_0", "Q8_0"), v])))
        two51.append(StackedWeight([weight("Q5_1", random_gguf_blocks("Q5_1", 768, 576)), weight("Q8_0", v)]))
    assert qref.GGUF_BLOCK_BYTES["Q8_0"] == 34
    out = []
    for m in rows:
        x = torch.randn(m, 576).bfloat16()
        t_two = time_call(lambda: [torch.cat([p.apply(x) for p in w.parts], dim=-1) for w in two], clock=clock)
        t_stacked = time_call(lambda: [w.apply(x) for w in two], clock=clock)
        t_one = time_call(lambda: [w.apply(x) for w in widened], clock=clock)
        t_two51 = time_call(lambda: [torch.cat([p.apply(x) for p in w.parts], dim=-1) for w in two51], clock=clock)
        t_stacked51 = time_call(lambda: [w.apply(x) for w in two51], clock=clock)
        out.append((m, *(t * 1e3 for t in (t_two, t_stacked, t_one, t_two51, t_stacked51))))
    return out


def bench_gguf_mlp(native, rows: list[int], clock: Callable[[], float] = time.perf_counter) -> list[tuple]:
    """The default model's 30 gate/up layers (576 -> 2 x 1536, each its own Q4_1 weight,
    repacked) with bf16 activations: ``gguf_linear_out`` then the native ``silu_and_mul``
    (the unfused path) and ``gguf_linear_silu_out`` (the fused op), alternating calls of
    each whole set, 7 pairs; median ms of each and the median of the per-pair ratios."""
    from pagedserve.kernels.cpu.quant_native import load_quant_kernels
    from pagedserve.kernels.quant_reference import GGUF_TYPE_IDS

    quant = load_quant_kernels()
    if quant is None or not quant.has_packed_gated():
        raise SystemExit("the gated tiled GGUF kernel is unavailable on this machine")
    q41, silu_and_mul = GGUF_TYPE_IDS["Q4_1"], native.ops()["silu_and_mul"]
    k, n, count = 576, 3072, 30
    raw = torch.randint(0, 256, (count, n, k // 32, 20), dtype=torch.uint8)
    raw[..., 0:2] = (torch.rand(count, n, k // 32) * 0.02 + 1e-3).half().view(torch.uint8).reshape(count, n, -1, 2)
    raw[..., 2:4] = (torch.randn(count, n, k // 32) * 0.05).half().view(torch.uint8).reshape(count, n, -1, 2)
    packed = [quant.pack_weight(w.reshape(n, -1), q41) for w in raw]
    out = []
    for m in rows:
        x = torch.randn(m, k).bfloat16()
        calls = {
            "unfused": lambda: [silu_and_mul(quant.gguf_linear_out(x, w, q41)) for w in packed],
            "fused": lambda: [quant.gguf_linear_silu_out(x, w, q41) for w in packed],
        }
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(7):
            for name, fn in calls.items():
                times[name].append(time_call(fn, min_seconds=0.05, min_reps=3, clock=clock))
        ratio = statistics.median(u / f for u, f in zip(times["unfused"], times["fused"]))
        gops = 2 * m * k * n * count * 1e-9
        med = {name: statistics.median(v) for name, v in times.items()}
        out.append((m, med["unfused"] * 1e3, med["fused"] * 1e3, gops / med["fused"], ratio))
    return out


def bench_window(
    native,
    dtype: torch.dtype,
    window: int = 512,
    soft_cap: float = 50.0,
    clock: Callable[[], float] = time.perf_counter,
) -> list[tuple]:
    """Sliding-window / soft-cap attention (default-model heads, head-major cache):
    decodes of 4 sequences at context 2048 and one prefill chunk of 512 tokens at
    context 2048, without either, with the window, the cap, and both."""
    rows = []
    query, ((kc, vc),), *meta = attention_inputs(4, 2048, dtype)
    decode = (query, kc, vc, *meta)
    prefill = prefill_inputs(512, 2048, dtype)
    scale = query.shape[-1] ** -0.5
    variants = [("none", {}), (f"W={window}", {"sliding_window": window})]
    variants += [(f"cap={soft_cap:g}", {"soft_cap": soft_cap})]
    variants += [(f"W={window} cap={soft_cap:g}", {"sliding_window": window, "soft_cap": soft_cap})]
    for shape, args in (("decode 4 x 2048", decode), ("prefill 512 @ 2048", prefill)):
        out = torch.empty_like(args[0])
        for label, extra in variants:
            t_native = time_call(lambda: native.paged_attention(*args, scale, out, **extra), clock=clock)
            t_ref = time_call(
                lambda: reference.paged_attention(*args, scale, out, **extra), min_seconds=0.2, min_reps=3, clock=clock
            )
            rows.append((shape, label, t_ref * 1e6, t_native * 1e6, t_ref / t_native))
    return rows


def _print_table(header: tuple[str, ...], rows: list[tuple]) -> None:
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---:" for _ in header) + "|")
    for r in rows:
        cells = [
            (f"{c:.1f}x" if "speedup" in header[i] else f"{c:.1f}") if isinstance(c, float) else str(c)
            for i, c in enumerate(r)
        ]
        print("| " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--isa", default=None, help="force an instruction set (avx512bf16, avx512, avx2, scalar)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--huge-pages", action="store_true", help="allocate the KV caches with huge pages")
    parser.add_argument(
        "--token-major", action="store_true", help="token-major KV storage instead of the CPU platform's head-major one"
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=1,
        help="decode attention over this many layers' caches per timed call (from memory, "
        "as in a decode step, rather than from cache)",
    )
    parser.add_argument(
        "--cpu-time", action="store_true", help="one thread, timed in process CPU time (robust on a busy machine)"
    )
    parser.add_argument("--prefill", action="store_true", help="also time prefill chunks")
    parser.add_argument(
        "--candidates", action="store_true", help="also time every paged_attention candidate (native, AMX, SDPA)"
    )
    parser.add_argument(
        "--window", action="store_true", help="also time sliding-window / soft-cap attention (decode and prefill)"
    )
    parser.add_argument("--ops", action="store_true", help="also time the row-wise ops")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 512], help="batch sizes for --ops")
    parser.add_argument(
        "--linear", action="store_true", help="also time one decode step's bf16 linear layers (torch GEMM vs native)"
    )
    parser.add_argument(
        "--rows", type=int, nargs="+", default=[1, 4, 16, 32, 64, 256], help="batch sizes for --linear and --gguf"
    )
    parser.add_argument(
        "--gguf", action="store_true", help="time the same layers on Q4_1 GGUF blocks (int8 kernels) against bf16"
    )
    parser.add_argument("--int8-peak", type=float, default=None, help="int8 peak GOP/s for --gguf (default: estimated)")
    parser.add_argument("--no-row-kernel", action="store_true", help="--gguf: leave out the (slow) row-by-row kernel")
    parser.add_argument("--gguf-mlp", action="store_true", help="--rows: gated MLP halves, fused vs unfused")
    parser.add_argument(
        "--gguf-types", action="store_true", help="--rows: the default model's layers in every GGUF type with a kernel"
    )
    parser.add_argument(
        "--gguf-stacked",
        action="store_true",
        help="--rows: mixed q/k/v, two calls vs one stacked call vs one widened weight",
    )
    parser.add_argument("--skip-attention", action="store_true", help="leave out the paged_attention table")
    parser.add_argument("--moe", action="store_true", help="also time fused_moe (reference vs native)")
    parser.add_argument("--moe-tokens", type=int, nargs="+", default=[1, 16, 64, 256], help="batch sizes for --moe")
    args = parser.parse_args(argv)
    if args.cpu_time:
        args.threads = 1
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.cpu_time else time.perf_counter
    native = load_cpu_kernels(isa=args.isa)
    if native is None:
        raise SystemExit("native CPU kernels are unavailable (see the warning above)")
    dtype = DTYPES[args.dtype]
    timing = "CPU time" if args.cpu_time else "wall time"
    print(f"# {native.source}, {args.dtype}, {torch.get_num_threads()} threads, {timing}, torch {torch.__version__}")
    pages = "huge pages" if args.huge_pages else "4 KiB pages"
    layout = "token-major" if args.token_major else "head-major"
    if not args.skip_attention:
        print(
            f"\npaged_attention, decode (9 heads, 3 kv heads, head 64, block 16, {layout} cache, {pages}, "
            f"{args.layers} layer(s)):\n"
        )
        _print_table(
            ("seqs", "context", "reference us", "native us", "speedup", "native KV GB/s"),
            bench_attention(
                native, args.seqs, args.contexts, dtype, args.huge_pages, clock, args.token_major, args.layers
            ),
        )
    if args.prefill:
        print("\npaged_attention, one prefill chunk (the last q_len of context positions):\n")
        _print_table(
            ("q_len", "context", "reference us", "native us", "speedup"),
            bench_prefill(native, [(128, 128), (512, 512), (256, 1024), (2048, 2048)], dtype, clock),
        )
    if args.candidates:
        print("\npaged_attention candidates, us (9 heads, 3 kv heads, head 64, block 16, head-major cache):\n")
        header, *rows = bench_attention_candidates(native, dtype, clock)
        _print_table(header, rows)
    if args.window:
        print("\npaged_attention with a sliding window and soft-cap (9 heads, 3 kv heads, head 64, block 16):\n")
        _print_table(
            ("batch", "variant", "reference us", "native us", "speedup"), bench_window(native, dtype, clock=clock)
        )
    if args.ops:
        print("\nrow-wise ops (hidden 576, intermediate 1536):\n")
        _print_table(
            ("op", "tokens", "reference us", "native us", "speedup"), bench_ops(native, args.tokens, dtype, clock)
        )
    if args.linear:
        print("\nbf16 linear layers of one decode step of the default model (weights 268 MB, each layer its own):\n")
        _print_table(
            ("rows", "torch ms", "skinny ms", "oneDNN packed ms", "native packed ms", "native/oneDNN speedup"),
            bench_linear(native, args.rows, clock),
        )
    if args.moe:
        print(f"\nfused_moe ({args.dtype}; prepared: weights through the CPU's prepare_moe_weights):\n")
        _print_table(
            ("shape", "tokens", "reference us", "native us", "native prepared us", "GFLOP/s", "speedup"),
            bench_moe(args.moe_tokens, dtype, clock),
        )

    if args.gguf:
        peak = args.int8_peak or int8_peak_gops()
        print(f"\nQ4_1 GGUF linear layers of one decode step of the default model (int8 peak {peak:.0f} GOP/s):\n")
        _print_table(
            (
                "rows",
                "bf16 packed ms",
                "int8 rows ms",
                "int8 tiled ms",
                "bf16 GOP/s",
                "int8 rows GOP/s",
                "int8 tiled GOP/s",
                "tiled % int8 peak",
                "tiled/bf16 speedup",
            ),
            bench_gguf_linear(native, args.rows, peak, clock, row_kernel=not args.no_row_kernel),
        )
    if args.gguf_mlp:
        print("\n30 gated MLP first halves, Q4_1 [gate; up] 576 -> 2 x 1536, bf16 activations:\n")
        _print_table(
            ("rows", "unfused ms", "fused ms", "fused GOP/s", "unfused / fused (median of pairs)"),
            bench_gguf_mlp(native, args.rows, clock),
        )
    if args.gguf_stacked:
        print(
            "\n15 mixed q/k/v layers ([q; k] Q5_0 or Q5_1 + v Q8_0): two calls, one stacked call,"
            " one widened Q8_0 weight, bf16:\n"
        )
        cols = (
            "rows",
            "Q5_0+Q8_0 two calls ms",
            "one stacked call",
            "one Q8_0 weight",
            "Q5_1+Q8_0 two calls",
            "one stacked call",
        )
        _print_table(cols, bench_gguf_stacked(args.rows, clock))
    if args.gguf_types:
        print("\n30 layers per shape in each GGUF block type, bf16 activations, ms (K-quants: K 768 for 576):\n")
        header, *rows = bench_gguf_types(args.rows, clock)
        _print_table(header, rows)


if __name__ == "__main__":
    main()
