"""Transparent huge pages for the KV cache on CPU.

Paged attention reads the cache block by block in the order of the block tables,
which is close to random over a cache of gigabytes.  With 4 KiB pages nearly every
block costs TLB misses (expensive page walks, more so in virtual machines); 2 MiB
pages remove most of them.  Linux backs a mapping with huge pages when it is advised
to (``/sys/kernel/mm/transparent_hugepage/enabled`` = ``madvise`` or ``always``), and
the advice must come before the pages are first touched: call :func:`advise_huge_pages`
right after ``torch.empty``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

import torch

__all__ = ["HUGE_PAGE_BYTES", "advise_huge_pages", "empty_huge_pages"]

HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = 14


@functools.lru_cache(maxsize=1)
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask Linux to back the 2 MiB-aligned part of ``tensor``'s storage with huge pages.

    Returns whether the advice was taken (False off Linux, for small or non-CPU
    tensors, or when the kernel refuses).  Never changes the tensor's contents.
    """
    fn = _madvise()
    nbytes = tensor.untyped_storage().nbytes()
    if fn is None or tensor.device.type != "cpu" or nbytes < HUGE_PAGE_BYTES:
        return False
    start = tensor.untyped_storage().data_ptr()
    first = (start + HUGE_PAGE_BYTES - 1) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    last = (start + nbytes) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if last <= first:
        return False
    return fn(first, last - first, _MADV_HUGEPAGE) == 0


def empty_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype)`` on the CPU, advised to use huge pages."""
    t = torch.empty(shape, dtype=dtype)
    advise_huge_pages(t)
    return t
