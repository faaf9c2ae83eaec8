"""The CPU platform's KV allocation: huge-page advice before first touch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedserve.platforms.cpu.platform import CpuPlatform

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
