"""The long native CPU kernels run without the GIL.

The server runs the engine on one thread and its event loop on another; a kernel that
held the GIL for a whole prefill-sized call would stall token delivery for that long.
Each test runs one large kernel call on a worker thread while the main thread ticks a
Python loop, and checks that the main thread kept ticking during the call: with the GIL
held, its longest gap between ticks would be about the whole call.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch
from native_build import native_build_failed, require_native

from pagedserve.kernels import build
from pagedserve.kernels.cpu.quant_native import load_quant_kernels, quant_build_spec

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def module():
    try:
        mod, _ = build.load_cpu_extension()
    except build.KernelBuildError as exc:
        native_build_failed("the native CPU kernels", exc)
    return mod


@pytest.fixture
def one_thread():
    """One torch thread, so the ticking thread has a core of its own on small machines."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def longest_tick_gap(call: Callable[[], object]) -> tuple[float, float]:
    """(seconds the call took on a worker thread, longest gap between main-thread ticks meanwhile)."""
    span: list[float] = []

    def work() -> None:
        t0 = time.perf_counter()
        call()
        span.extend((t0, time.perf_counter()))

    ticks = []
    worker = threading.Thread(target=work)
    worker.start()
    while worker.is_alive():
        ticks.append(time.perf_counter())
    worker.join()
    start, end = span
    inside = [start] + [t for t in ticks if start <= t <= end] + [end]
    return end - start, max(b - a for a, b in zip(inside, inside[1:]))


def check_released(make_call: Callable[[int], Callable[[], object]]) -> None:
    """``make_call(scale)`` builds a call whose work grows with scale; doubled until a call
    lasts long enough to tell a held GIL from scheduling noise."""
    for scale in (1, 2, 4, 8, 16):
        call = make_call(scale)
        call()  # first-call costs (allocations, thread pool) out of the way
        took, gap = longest_tick_gap(call)
        if took > 0.1:
            break
    assert took > 0.1, f"the largest call took only {took * 1e3:.1f} ms: too short to tell"
    # Holding the GIL, the gap is the whole call; released, it is scheduling noise.
    assert gap < 0.5 * took, f"the main thread stalled {gap * 1e3:.0f} ms during a {took * 1e3:.0f} ms kernel call"


def test_paged_attention_releases_gil(module, one_thread):
    torch.manual_seed(0)
    heads, head_size, block_size = 8, 64, 16
    isa = 0 if module.compiled_isas() else pytest.skip("no instruction set compiled")

    def make_call(scale: int):
        tokens = 512 * scale
        blocks = tokens // block_size
        q = torch.randn(tokens, heads, head_size)
        k_cache = torch.randn(blocks, block_size, heads, head_size)
        v_cache = torch.randn(blocks, block_size, heads, head_size)
        block_tables = torch.randperm(blocks, dtype=torch.int32)[None]
        seq_lens = torch.tensor([tokens], dtype=torch.int32)
        qsl = torch.tensor([0, tokens], dtype=torch.int32)
        out = torch.full_like(q, float("nan"))

        def call():
            module.paged_attention(
                q, k_cache, v_cache, block_tables, seq_lens, qsl, 0.125, out, isa, 0, 0.0, None, None
            )
            assert not out.isnan().any()

        return call

    check_released(make_call)


def test_gguf_linear_releases_gil(one_thread):
    mod = require_native(load_quant_kernels, quant_build_spec, "the quantized CPU kernels")
    torch.manual_seed(0)
    k, n = 2048, 2048
    q8_0, block_bytes = 8, 34  # GGUF type id of Q8_0: an fp16 scale and 32 int8 per block
    weight = torch.randint(0, 256, (n, k // 32 * block_bytes), dtype=torch.uint8)
    scales = (torch.rand(n, k // 32) * 0.01 + 0.001).half().view(torch.uint8).view(n, k // 32, 2)
    weight.view(n, k // 32, block_bytes)[:, :, :2] = scales

    def make_call(scale: int):
        x = torch.randn(128 * scale, k)

        def call():
            y = mod.gguf_linear(x, weight, q8_0)
            assert y.shape == (x.shape[0], n) and torch.isfinite(y).all()

        return call

    check_released(make_call)
