"""The CPU platform's KV allocation and packed weights: huge-page advice before first touch."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from pagedserve.kernels import reference
from pagedserve.kernels.cpu.hugepages import HUGE_PAGE_BYTES, HugePageArena
from pagedserve.platforms.cpu.platform import CpuPlatform
from pagedserve.platforms.ops import OpRegistry
from pagedserve.platforms.options import CpuOptions

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _vm_flags(ptr: int) -> list[str]:
    """VmFlags of the mapping of this process holding address ``ptr`` ("hg": huge pages advised)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= ptr < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    return []


def _thp_mode() -> str | None:
    try:
        text = THP.read_text()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")]


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="transparent huge pages are off here")
def test_kv_cache_is_backed_by_huge_pages_when_asked(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CPU_HUGE_PAGES", "1")
    k, v = CpuPlatform().allocate_kv_cache(
        num_blocks=512, block_size=16, num_kv_heads=4, head_size=64, dtype=torch.bfloat16
    )
    assert k.shape == v.shape == (512, 16, 4, 64)
    for t in (k, v):
        # The advice covers the 2 MiB-aligned middle of the storage.  (Whether the kernel
        # then finds free huge pages is up to the machine: AnonHugePages is not checked.)
        middle = t.data_ptr() + t.untyped_storage().nbytes() // 2
        assert "hg" in _vm_flags(middle)
        t.normal_()


def test_huge_page_advice_is_opt_in(monkeypatch):
    calls = []
    import pagedserve.kernels.cpu.hugepages as hp

    monkeypatch.setattr(hp, "advise_huge_pages", lambda t: calls.append(t) or True)
    monkeypatch.delenv("PAGEDSERVE_CPU_HUGE_PAGES", raising=False)
    k, v = CpuPlatform().allocate_kv_cache(64, 16, 2, 64, torch.float32)
    assert calls == [] and k.shape == (64, 16, 2, 64)
    monkeypatch.setenv("PAGEDSERVE_CPU_HUGE_PAGES", "0")
    CpuPlatform().allocate_kv_cache(64, 16, 2, 64, torch.float32)
    assert calls == []
    monkeypatch.setenv("PAGEDSERVE_CPU_HUGE_PAGES", "1")
    CpuPlatform().allocate_kv_cache(64, 16, 2, 64, torch.float32)
    assert len(calls) == 2


def test_arena_carves_aligned_disjoint_tensors():
    arena = HugePageArena(slab_bytes=4 * HUGE_PAGE_BYTES)
    shapes = [(5, 3, 16, 2), (1,), (7, 9), (900, 288, 16, 2), (2, 2)]  # the fourth: a slab of its own
    ts = [arena.empty(s, torch.bfloat16) for s in shapes]
    assert arena.slabs == 2
    for i, (t, shape) in enumerate(zip(ts, shapes)):
        assert t.shape == shape and t.is_contiguous() and t.dtype == torch.bfloat16
        assert t.data_ptr() % 64 == 0
        t.fill_(i + 1)
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t in ts)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "tensors overlap"
    for i, t in enumerate(ts):
        assert bool((t == i + 1).all())
    big = arena.empty((3 * HUGE_PAGE_BYTES,), torch.uint8)  # more than is left: a new slab
    assert big.nbytes == 3 * HUGE_PAGE_BYTES and arena.slabs == 3


def test_arena_keeps_no_slab_alive():
    """A slab lives as long as its tensors (sleep mode frees a dropped model's weights)."""
    arena = HugePageArena(slab_bytes=HUGE_PAGE_BYTES)
    t = arena.empty((1000,), torch.float32)
    storage_ptr = t.untyped_storage().data_ptr()
    u = arena.empty((10,), torch.float32)
    assert u.untyped_storage().data_ptr() == storage_ptr and arena.slabs == 1
    del t, u
    gc.collect()
    assert arena._last() is None
    arena.empty((10,), torch.float32)
    assert arena.slabs == 2


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="transparent huge pages are off here")
def test_arena_slabs_are_advised():
    t = HugePageArena().empty((1 << 20,), torch.bfloat16)
    assert "hg" in _vm_flags(t.data_ptr())


@pytest.mark.parametrize("on", [True, False], ids=["arena", "plain"])
def test_prepared_bf16_weights_in_the_arena(on):
    """The registry's prepare_linear_weight puts natively packed weights in the kernels'
    huge-page arena (unless PAGEDSERVE_CPU_WEIGHT_HUGE_PAGES=0); ``linear`` on them
    matches the reference, and the same weight packed outside the arena bit for bit."""
    from pagedserve.platforms.cpu.ops import register_cpu_ops

    ops = OpRegistry()
    register_cpu_ops(ops, CpuOptions(tune=False, weight_huge_pages=on))
    prepare, linear = ops.get("prepare_linear_weight"), ops.get("linear")
    gen = torch.Generator().manual_seed(11)
    weights = [(torch.randn(n, k, generator=gen) / k**0.5).bfloat16() for n, k in ((96, 64), (48, 160), (960, 576))]
    prepared = [prepare(w) for w in weights]
    if prepared[0].dim() != 4:
        pytest.skip("no native packed bf16 kernel here (AVX-512 BF16)")
    storages = {p.untyped_storage().data_ptr() for p in prepared}
    assert len(storages) == (1 if on else len(weights))  # side by side in one slab
    if on and _thp_mode() in ("madvise", "always"):
        assert "hg" in _vm_flags(prepared[-1].data_ptr())
    native = linear  # the static order: the native packed kernel on 4-D weights
    for w, p in zip(weights, prepared):
        plain = w.contiguous().view(w.shape[0] // 16, 16, w.shape[1] // 2, 2).permute(0, 2, 1, 3).contiguous()
        assert torch.equal(p, plain)
        x = torch.randn(13, w.shape[1], generator=gen).bfloat16()
        got = native(x, p)
        want = reference.linear(x.float(), w.float()).bfloat16()
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=1.6e-2)


def test_tuned_weights_go_to_the_arena_and_timing_copies_do_not():
    """The measured dispatch's kept native weight is carved from the arena right after the
    previous one (no hole left by the copy it timed), and runs like the reference."""
    from pagedserve.kernels.cpu import load_cpu_kernels
    from pagedserve.platforms.cpu.tuned_linear import TunedLinear
    from pagedserve.platforms.cpu.tuning import Plan, Tuner

    native = load_cpu_kernels()
    if native is None or not native.has_packed_linear:
        pytest.skip("no native packed bf16 kernel here (AVX-512 BF16)")
    native.weight_arena = arena = HugePageArena()
    tl = TunedLinear(
        Tuner(None, threads=1), native, reference.linear, reference.silu_and_mul, dual_bytes=0, min_elements=1
    )
    gen = torch.Generator().manual_seed(5)
    first = arena.empty((1000,), torch.bfloat16)
    w = (torch.randn(96, 64, generator=gen) / 8).bfloat16()
    names = sorted(tl.kernels)
    times = {b: {c: (1.0 if c == "native_packed" else 5.0) for c in names} for b in tl.buckets}
    tl.tuner.plans[("linear", "N=96,K=64,bfloat16", tuple(names))] = Plan(
        "linear", "N=96,K=64,bfloat16", tl.buckets, times
    )
    prepared = tl.prepare(w)  # cached plan: packed once, into the arena
    assert prepared.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
    assert prepared.data_ptr() == first.data_ptr() + 2048  # 2000 bytes rounded up to 64
    w2 = (torch.randn(48, 160, generator=gen) / 13).bfloat16()
    prepared2 = tl.prepare(w2)  # timed now: the timing copies stay outside the arena
    if prepared2.dim() == 4:
        assert prepared2.data_ptr() == prepared.data_ptr() + prepared.nbytes
    for weight, p in ((w, prepared), (w2, prepared2)):
        x = torch.randn(7, weight.shape[1], generator=gen).bfloat16()
        want = reference.linear(x.float(), weight.float())
        torch.testing.assert_close(tl.linear(x, p).float(), want, atol=2e-2, rtol=1.6e-2)
