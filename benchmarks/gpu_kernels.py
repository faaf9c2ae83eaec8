"""Build, check and time pagedserve's GPU kernels (Triton and CUDA C++) in one command.

    python benchmarks/gpu_kernels.py                 # everything
    python benchmarks/gpu_kernels.py --quick         # fewer sizes
    python benchmarks/gpu_kernels.py --no-e2e        # skip the end-to-end tokens/s line

Steps: (1) build the CUDA extension (CUDA machines only; ROCm runs the Triton kernels
alone); (2) check every kernel against kernels/reference.py on random inputs, attention also
with sliding windows and soft-caps (slid-out block-table entries point at a NaN block), and
8-bit KV caches (int8 and fp8, with and without row scales) written by Triton and read by
Triton and the CUDA decode kernel; (3) measure the device's copy bandwidth with a large
device-to-device copy; (4) time decode attention at batch 1..256 and contexts 1k..32k (GQA
8:1, head 128, bf16), and over each 8-bit cache, and print achieved bandwidth (bytes of K/V
read per call / time) as a share of the copy bandwidth; (5) check the recurrent layers'
Triton kernels (decode steps and prefill forms) against kernels/recurrent_reference.py and
time them beside it at the shapes of Qwen3.5, Granite 4 and Jamba
(benchmarks/gpu_recurrent.py); (6) optionally run
`pagedserve.LLM` on the default model for tokens/s.

Exits with status 2 and a message on a machine without a GPU; status 1 if a kernel
disagrees with the reference.
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import sys
import time
from collections.abc import Callable

import torch

from pagedserve.kernels import reference

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from gpu_recurrent import check_recurrent, time_recurrent  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 32, 4, 128, 16


def _time_ms(fn: Callable[[], object], warmup: int = 3, iters: int = 20) -> float:
    """Median milliseconds per call, measured with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def copy_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + written per second)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), warmup=3, iters=10)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def decode_batch(
    batch: int,
    context: int,
    dtype: torch.dtype,
    device: str = "cuda",
    num_heads: int = NUM_HEADS,
    num_kv_heads: int = NUM_KV_HEADS,
    head_size: int = HEAD_SIZE,
    block_size: int = BLOCK_SIZE,
) -> tuple:
    """Random decode inputs: ``batch`` sequences of ``context`` tokens, one query each."""
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.randn(shape, dtype=dtype, device=device)
    value_cache = torch.randn(shape, dtype=dtype, device=device)
    block_tables = torch.randperm(num_blocks, device=device, dtype=torch.int64).to(torch.int32)
    block_tables = block_tables.view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
    query = torch.randn(batch, num_heads, head_size, dtype=dtype, device=device)
    return query, key_cache, value_cache, block_tables, seq_lens, qsl, head_size**-0.5


def mixed_batch(device: str = "cuda", dtype: torch.dtype = torch.bfloat16) -> tuple:
    """A prefill chunk after a prefix hit, a fresh prefill and three decodes."""
    seqs = [(37, 300), (64, 64), (1, 1000), (1, 17), (1, 250)]
    blocks = [-(-c // BLOCK_SIZE) for _, c in seqs]
    num_blocks = sum(blocks)
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    key_cache = torch.randn(shape, dtype=dtype, device=device)
    value_cache = torch.randn(shape, dtype=dtype, device=device)
    perm = torch.randperm(num_blocks).tolist()
    bt = torch.zeros(len(seqs), max(blocks), dtype=torch.int32)
    for i, n in enumerate(blocks):
        bt[i, :n] = torch.tensor([perm.pop() for _ in range(n)])
    q_lens = [q for q, _ in seqs]
    query = torch.randn(sum(q_lens), NUM_HEADS, HEAD_SIZE, dtype=dtype, device=device)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    sl = torch.tensor([c for _, c in seqs], dtype=torch.int32, device=device)
    return query, key_cache, value_cache, bt.to(device), sl, qsl, HEAD_SIZE**-0.5


def with_nan_slid_out(args: tuple, window: int) -> tuple:
    """``args`` with a NaN-filled null block appended to both caches and every block-table
    entry that slid out of its sequence's window pointed at it (what the KV manager
    leaves after freeing those blocks): a kernel that reads one returns NaN."""
    query, key_cache, value_cache, tables, seq_lens, qsl, scale = args
    null = key_cache.shape[0]
    nan = torch.full_like(key_cache[:1], float("nan"))
    key_cache, value_cache = torch.cat([key_cache, nan]), torch.cat([value_cache, nan])
    tables = tables.clone()
    block_size = key_cache.shape[1]
    q_lens = (qsl[1:] - qsl[:-1]).tolist()
    for i, ctx in enumerate(seq_lens.tolist()):
        tables[i, : max(0, ctx - q_lens[i] - window + 1) // block_size] = null
    return query, key_cache, value_cache, tables, seq_lens, qsl, scale


#: Window / soft-cap / sink variants checked (Gemma 2: window 4096 and cap 50; here
#: shorter windows so that blocks slide out of the test contexts).  ``sinks`` is the
#: spread of random per-head sink logits (GPT-OSS); 30 dominates every score.
WINDOW_CASES: tuple[dict, ...] = (
    {"sliding_window": 512},
    {"soft_cap": 30.0},
    {"sliding_window": 200, "soft_cap": 30.0},
    {"sinks": 2.0},
    {"sliding_window": 128, "sinks": 30.0},
)


def check_window_kernels(cuda_ext, device: str = "cuda") -> bool:
    """Sliding window and soft-cap in every GPU attention kernel against the reference,
    with slid-out table entries pointing at a NaN block."""
    from pagedserve.kernels.triton import attention

    ok = True
    tol = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}
    for dtype in (torch.bfloat16, torch.float32):
        tag = str(dtype).replace("torch.", "")
        for label, base in (
            ("mixed batch", mixed_batch(device, dtype)),
            ("decode 4 x 3000", decode_batch(4, 3000, dtype, device)),
        ):
            for extra in WINDOW_CASES:
                args = with_nan_slid_out(base, extra.get("sliding_window", 1 << 30))
                if "sinks" in extra:
                    gen = torch.Generator().manual_seed(5)
                    extra = {
                        **extra,
                        "sinks": (torch.randn(args[0].shape[1], generator=gen) * extra["sinks"]).to(device),
                    }
                expected = reference.paged_attention(*args, **extra)
                what = f"{tag} {label} " + " ".join(k if k == "sinks" else f"{k}={v}" for k, v in extra.items())
                for splits in (1, 4):
                    out = torch.full_like(args[0], float("nan"))
                    attention.paged_attention_fixed_splits(*args, num_splits=splits, out=out, **extra)
                    ok &= _compare(f"triton attention {what} splits={splits}", out, expected, tol[dtype])
                if cuda_ext is not None:
                    out = torch.full_like(args[0], float("nan"))
                    cuda_ext.paged_attention_decode(
                        out, *args, extra.get("sliding_window", 0), extra.get("soft_cap", 0.0), extra.get("sinks")
                    )
                    ok &= _compare(f"cuda attention {what}", out, expected, tol[dtype])
    return ok


def _compare(name: str, got: torch.Tensor, expected: torch.Tensor, tol: float) -> bool:
    """Pass when |got - expected| <= tol * (1 + |expected|) everywhere (and no NaN)."""
    diff = (got.float() - expected.float()).abs()
    err = diff.max().item()
    ok = bool(torch.isfinite(got).all()) and bool((diff <= tol * (1 + expected.float().abs())).all())
    print(f"  {'PASS' if ok else 'FAIL'}  {name:<48} max|err| = {err:.2e} (tol {tol:.0e})")
    return ok


def check_kernels(cuda_ext, device: str = "cuda") -> bool:
    """Every kernel against the reference; prints one line per check."""
    from pagedserve.kernels.triton import attention, cache

    ok = True
    tol = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        tag = str(dtype).replace("torch.", "")
        for label, args in (
            ("mixed batch", mixed_batch(device, dtype)),
            ("decode 4 x 3000", decode_batch(4, 3000, dtype, device)),
        ):
            expected = reference.paged_attention(*args)
            for splits in (1, 4):
                out = torch.full_like(args[0], float("nan"))
                attention.paged_attention_fixed_splits(*args, num_splits=splits, out=out)
                ok &= _compare(f"triton attention {tag} {label} splits={splits}", out, expected, tol[dtype])
            if cuda_ext is not None and label.startswith("decode"):
                out = torch.full_like(args[0], float("nan"))
                cuda_ext.paged_attention_decode(out, *args)
                ok &= _compare(f"cuda attention {tag} {label}", out, expected, tol[dtype])
        key = torch.randn(77, NUM_KV_HEADS, HEAD_SIZE, dtype=dtype, device=device)
        value = torch.randn_like(key)
        kc = torch.randn(8, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, dtype=dtype, device=device)
        vc = torch.randn_like(kc)
        slots = torch.randperm(8 * BLOCK_SIZE, device=device)[:77]
        slots[::7] = -1
        exp_k, exp_v = kc.clone(), vc.clone()
        reference.reshape_and_cache(key, value, exp_k, exp_v, slots)
        impls = [("triton", cache.reshape_and_cache)]
        if cuda_ext is not None:
            impls.append(("cuda", cuda_ext.reshape_and_cache))
        for name, fn in impls:
            k, v = kc.clone(), vc.clone()
            fn(key, value, k, v, slots)
            ok &= _compare(f"{name} reshape_and_cache {tag}", torch.cat([k, v]), torch.cat([exp_k, exp_v]), 0.0)
    if cuda_ext is not None:
        from pagedserve.kernels.cuda import ops

        pool = torch.randn(16, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, dtype=torch.bfloat16, device=device)
        host = torch.randn(16, *pool.shape[1:], dtype=pool.dtype).pin_memory()
        mapping = torch.tensor([[0, 5], [3, 9], [7, 15]])
        for name, src, dst in (
            ("copy_blocks (device)", pool, pool.clone()),
            ("swap_blocks (device -> host)", pool, host.clone().pin_memory()),
            ("swap_blocks (host -> device)", host, pool.clone()),
        ):
            expected = dst.clone()
            reference.copy_blocks(src, expected, mapping)
            ops.copy_blocks(src, dst, mapping)
            ok &= _compare(f"cuda {name}", dst.cpu(), expected.cpu(), 0.0)
    return ok


#: 8-bit KV caches (kernels/reference.py): name -> (cache dtype, rows carry a float32 scale).
KV8_CASES: dict[str, tuple[torch.dtype, bool]] = {
    "int8 rows": (torch.int8, True),
    "fp8_e4m3 rows": (torch.float8_e4m3fn, True),
    "fp8_e5m2 rows": (torch.float8_e5m2, True),
    "fp8_e4m3": (torch.float8_e4m3fn, False),
    "fp8_e5m2": (torch.float8_e5m2, False),
}


def kv8_caches(args: tuple, kv_dtype: torch.dtype, rows: bool, scale_keys: float = 8.0) -> tuple:
    """``args`` with both caches rewritten as 8-bit caches by the reference write (keys
    spread wider, every fifth row with an outlier far beyond e4m3's range)."""
    query, key_cache, value_cache, tables, seq_lens, qsl, scale = args
    num_blocks, block_size, kv_heads, head = key_cache.shape
    keys = key_cache.float().flatten(0, 1) * scale_keys
    keys[::5, :, 0] *= 40
    values = value_cache.float().flatten(0, 1)
    shape = (num_blocks, block_size, kv_heads, head + 4 if rows else head)
    # Written on the host: the reference's 8-bit tensor ops need not exist on the device.
    k8, v8 = torch.zeros(shape, dtype=kv_dtype), torch.zeros(shape, dtype=kv_dtype)
    reference.reshape_and_cache(keys.cpu(), values.cpu(), k8, v8, torch.arange(keys.shape[0]))
    return query, k8.to(key_cache.device), v8.to(key_cache.device), tables, seq_lens, qsl, scale


def reference_on_host(args: tuple, **extra) -> torch.Tensor:
    """reference.paged_attention on host copies of ``args`` (a float32 query), returned
    on the query's device."""
    host = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
    host[0] = host[0].float()
    extra = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in extra.items()}
    return reference.paged_attention(*host, **extra).to(args[0].device)


def check_kv8_kernels(cuda_ext, device: str = "cuda") -> bool:
    """int8 and fp8 KV caches: the Triton write stores the reference's bytes; Triton
    attention (single pass, split-KV, with a window and soft cap over a NaN block) and
    the CUDA C++ decode kernel read them as the reference does."""
    from pagedserve.kernels.triton import attention, cache

    ok = True
    tol = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}
    for name, (kv_dtype, rows) in KV8_CASES.items():
        key = torch.randn(77, NUM_KV_HEADS, HEAD_SIZE, device=device) * 100
        value = torch.randn_like(key)
        shape = (8, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE + 4 if rows else HEAD_SIZE)
        init = torch.randint(0, 256, shape, dtype=torch.uint8, device=device).view(kv_dtype)
        slots = torch.randperm(8 * BLOCK_SIZE, device=device)[:77]
        slots[::7] = -1
        for dtype in (torch.bfloat16, torch.float32):
            exp_k, exp_v, k, v = init.cpu().clone(), init.cpu().clone(), init.clone(), init.clone()
            reference.reshape_and_cache(key.to(dtype).cpu(), value.to(dtype).cpu(), exp_k, exp_v, slots.cpu())
            cache.reshape_and_cache(key.to(dtype), value.to(dtype), k, v, slots)
            same = torch.equal(k.view(torch.uint8).cpu(), exp_k.view(torch.uint8)) and torch.equal(
                v.view(torch.uint8).cpu(), exp_v.view(torch.uint8)
            )
            print(f"  {'PASS' if same else 'FAIL'}  triton reshape_and_cache {name} from {dtype} (bytes)")
            ok &= same
        for dtype in (torch.bfloat16, torch.float32):
            tag = f"{name} {str(dtype).replace('torch.', '')}"
            for label, base in (
                ("mixed batch", mixed_batch(device, dtype)),
                ("decode 4 x 3000", decode_batch(4, 3000, dtype, device)),
            ):
                args = kv8_caches(base, kv_dtype, rows)
                expected = reference_on_host(args)
                for splits in (1, 4):
                    out = torch.full_like(args[0], float("nan"))
                    attention.paged_attention_fixed_splits(*args, num_splits=splits, out=out)
                    ok &= _compare(f"triton attention {tag} {label} splits={splits}", out, expected, tol[dtype])
                if cuda_ext is not None and label.startswith("decode"):
                    out = torch.full_like(args[0], float("nan"))
                    cuda_ext.paged_attention_decode(out, *args)
                    ok &= _compare(f"cuda attention {tag} {label}", out, expected, tol[dtype])
            extra = {"sliding_window": 200, "soft_cap": 30.0}
            base = decode_batch(4, 3000, dtype, device)
            query, k8, v8, _, seq_lens, qsl, scale = kv8_caches(base, kv_dtype, rows)
            expected = reference_on_host((query, k8, v8, *base[3:6], scale), **extra)
            # Slid-out table entries point at an appended block of NaN bytes (NaN scales when scaled).
            tables = with_nan_slid_out(base, extra["sliding_window"])[3]
            nan_block = torch.full_like(k8[:1].view(torch.uint8), 0x7F)
            if rows:
                nan_block[..., HEAD_SIZE:] = torch.tensor([float("nan")]).view(torch.uint8).to(device)
            k8, v8 = (torch.cat([c.view(torch.uint8), nan_block]).view(kv_dtype) for c in (k8, v8))
            args = (query, k8, v8, tables, seq_lens, qsl, scale)
            out = torch.full_like(query, float("nan"))
            attention.paged_attention_fixed_splits(*args, num_splits=1, out=out, **extra)
            ok &= _compare(f"triton attention {tag} window+cap", out, expected, tol[dtype])
            if cuda_ext is not None:
                out = torch.full_like(query, float("nan"))
                cuda_ext.paged_attention_decode(out, *args, extra["sliding_window"], extra["soft_cap"])
                ok &= _compare(f"cuda attention {tag} window+cap", out, expected, tol[dtype])
    return ok


def time_kv8_decode(cuda_ext, copy_gbs: float) -> None:
    """Decode attention at batch 32 x 4096 keys over each 8-bit cache next to bf16."""
    from pagedserve.kernels.triton import attention

    base = decode_batch(32, 4096, torch.bfloat16)
    rows = [("bf16", base)] + [(name, kv8_caches(base, *spec)) for name, spec in KV8_CASES.items()]
    for name, args in rows:
        kv_bytes = args[1].numel() * args[1].element_size() * 2
        cells = []
        impls = [("triton", lambda a=args: attention.paged_attention(*a))]
        if cuda_ext is not None:
            impls.append(("cuda", lambda a=args: cuda_ext.paged_attention_decode(torch.empty_like(a[0]), *a)))
        for impl, fn in impls:
            ms = _time_ms(fn)
            cells.append(f"{impl} {ms:7.3f} ms ({kv_bytes / (ms * 1e-3) / 1e9 / copy_gbs:4.0%} of copy bw)")
        print(f"  {name:<14} " + "   ".join(cells))


def _decode_row(cuda_ext, copy_gbs: float, batch: int, context: int, sms: int) -> str:
    """One table row: Triton (heuristic and single pass) and CUDA decode timings."""
    from pagedserve.kernels.triton import attention

    args = decode_batch(batch, context, torch.bfloat16)
    out = torch.empty_like(args[0])
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_SIZE * args[1].element_size()
    splits = attention.choose_num_splits(
        batch,
        batch,
        NUM_KV_HEADS,
        args[3].shape[1] * BLOCK_SIZE,
        sms,
        block_q=max(1, 16 // (NUM_HEADS // NUM_KV_HEADS)),
    )

    def share(ms: float) -> tuple[float, float]:
        gbs = kv_bytes / (ms * 1e-3) / 1e9
        return gbs, 100.0 * gbs / copy_gbs

    t_auto = _time_ms(lambda: attention.paged_attention(*args, out=out))
    t_one = _time_ms(lambda: attention.paged_attention_fixed_splits(*args, num_splits=1, out=out))
    g_auto, p_auto = share(t_auto)
    line = (
        f"{batch:>5} {context:>7} {kv_bytes / 2**20:>8.0f} | {t_auto * 1e3:>7.1f}us {g_auto:>6.0f}"
        f" {p_auto:>5.1f} {splits:>6} | {t_one * 1e3:>7.1f}us {share(t_one)[1]:>5.1f} |"
    )
    if cuda_ext is not None:
        t_cuda = _time_ms(lambda: cuda_ext.paged_attention_decode(out, *args))
        line += f" {t_cuda * 1e3:>7.1f}us {share(t_cuda)[1]:>5.1f}"
    else:
        line += f" {'n/a':>9} {'':>5}"
    return line


def time_decode(cuda_ext, copy_gbs: float, batches: list[int], contexts: list[int], mem_budget: int) -> None:
    header = (
        f"{'batch':>5} {'context':>7} {'KV MiB':>8} | {'triton':>9} {'GB/s':>6} {'%copy':>5} {'splits':>6} |"
        f" {'1-pass':>9} {'%copy':>5} | {'cuda':>9} {'%copy':>5}"
    )
    print(header)
    print("-" * len(header))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for batch in batches:
        for context in contexts:
            kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_SIZE * 2
            if kv_bytes > mem_budget:
                print(f"{batch:>5} {context:>7} {kv_bytes / 2**20:>8.0f} | skipped: over the memory budget")
                continue
            print(_decode_row(cuda_ext, copy_gbs, batch, context, sms), flush=True)
            torch.cuda.empty_cache()


def time_cache_writes(cuda_ext, copy_gbs: float) -> None:
    from pagedserve.kernels.triton import cache

    print(f"{'tokens':>7} | {'triton':>9} {'%copy':>5} | {'cuda':>9} {'%copy':>5}")
    for tokens in (256, 2048, 16384):
        key = torch.randn(tokens, NUM_KV_HEADS, HEAD_SIZE, dtype=torch.bfloat16, device="cuda")
        value = torch.randn_like(key)
        kc = torch.empty(tokens // BLOCK_SIZE + 1, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, dtype=key.dtype, device="cuda")
        vc = torch.empty_like(kc)
        slots = torch.randperm(tokens, device="cuda")
        moved = 2 * 2 * key.numel() * key.element_size()  # read new K/V, write them into the cache
        line = f"{tokens:>7} |"
        impls = [cache.reshape_and_cache] + ([cuda_ext.reshape_and_cache] if cuda_ext is not None else [])
        for fn in impls:
            ms = _time_ms(functools.partial(fn, key, value, kc, vc, slots))
            line += f" {ms * 1e3:>7.1f}us {100 * moved / (ms * 1e-3) / 1e9 / copy_gbs:>5.1f} |"
        print(line)


def end_to_end(num_prompts: int, max_tokens: int) -> None:
    try:
        from pagedserve import LLM, SamplingParams
    except ImportError as exc:
        print(f"end-to-end: skipped, pagedserve.LLM is not importable ({exc})")
        return
    try:
        llm = LLM(device="cuda")
        prompts = [f"Write a short story about the number {i}." for i in range(num_prompts)]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate(prompts[:2], params)  # warm up (kernel compilation)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
    except Exception as exc:  # reported, not hidden: the kernel table above stands on its own
        print(f"end-to-end: failed: {type(exc).__name__}: {exc}")
        return
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(
        f"end-to-end: {num_prompts} prompts, {generated} generated tokens in {elapsed:.2f}s = "
        f"{generated / elapsed:.0f} tokens/s (default model, greedy)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer batch sizes and contexts")
    parser.add_argument("--no-cuda-ext", action="store_true", help="skip building the CUDA C++ extension")
    parser.add_argument("--no-e2e", action="store_true", help="skip the end-to-end tokens/s line")
    parser.add_argument(
        "--mem-fraction",
        type=float,
        default=0.5,
        help="largest share of free GPU memory one KV cache may take (default 0.5)",
    )
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print(
            f"No GPU: torch {torch.__version__} sees no CUDA/ROCm device (torch.version.cuda="
            f"{torch.version.cuda}, hip={getattr(torch.version, 'hip', None)}). This benchmark needs a GPU; "
            "the kernels' CPU checks are `pytest tests/kernels` (Triton interpreter).",
            file=sys.stderr,
        )
        return 2
    props = torch.cuda.get_device_properties(0)
    print(
        f"device: {props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB; "
        f"torch {torch.__version__}"
    )
    try:
        import triton

        print(f"triton {triton.__version__}")
    except ImportError:
        print("triton is not installed: pip install triton", file=sys.stderr)
        return 2

    cuda_ext = None
    if args.no_cuda_ext or not torch.version.cuda:
        print("CUDA C++ extension: skipped" + ("" if torch.version.cuda else " (not a CUDA build of torch)"))
    else:
        from pagedserve.kernels.cuda.build import build_cuda_extension

        start = time.perf_counter()
        try:
            cuda_ext = build_cuda_extension(verbose=True)
            print(f"CUDA C++ extension: ready in {time.perf_counter() - start:.1f}s")
        except Exception as exc:  # shown, then the Triton kernels are still checked and timed
            print(f"CUDA C++ extension: build failed: {type(exc).__name__}: {exc}", file=sys.stderr)

    print("\n== correctness against kernels/reference.py")
    ok = check_kernels(cuda_ext)
    print("\n== sliding window and soft-cap (slid-out blocks point at a NaN block)")
    ok &= check_window_kernels(cuda_ext)
    print("\n== recurrent layers' Triton kernels against kernels/recurrent_reference.py")
    ok &= check_recurrent(_compare)
    print("\n== 8-bit KV caches (int8 and fp8 rows with their scales, unscaled fp8)")
    ok &= check_kv8_kernels(cuda_ext)

    copy_gbs = copy_bandwidth_gbs()
    print(f"\n== device copy bandwidth: {copy_gbs:.0f} GB/s (read + write of a 1 GiB copy)")
    batches = [1, 16, 256] if args.quick else [1, 8, 32, 64, 128, 256]
    contexts = [1024, 32768] if args.quick else [1024, 4096, 16384, 32768]
    free, _ = torch.cuda.mem_get_info()
    print(
        f"\n== decode attention, bf16, {NUM_HEADS} query / {NUM_KV_HEADS} KV heads, head {HEAD_SIZE}, "
        f"block {BLOCK_SIZE}; bandwidth = K/V bytes read per call / time"
    )
    time_decode(cuda_ext, copy_gbs, batches, contexts, int(free * args.mem_fraction))
    print("\n== reshape_and_cache, bf16")
    time_cache_writes(cuda_ext, copy_gbs)
    print("\n== recurrent layers' ops, bf16 activations, float32 states: Triton and the torch reference")
    time_recurrent(_time_ms, args.quick)
    print("\n== decode attention over 8-bit caches, batch 32 x 4096 keys (bandwidth: cache bytes read)")
    time_kv8_decode(cuda_ext, copy_gbs)
    if not args.no_e2e:
        print()
        end_to_end(num_prompts=64, max_tokens=128)
    if not ok:
        print("\nSome kernels disagree with the reference (FAIL lines above).", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
