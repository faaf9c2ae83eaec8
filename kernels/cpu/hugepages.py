"""Transparent huge pages for the KV cache and the packed weights on CPU.

Paged attention reads the cache block by block in the order of the block tables,
which is close to random over a cache of gigabytes.  With 4 KiB pages nearly every
block costs TLB misses (expensive page walks, more so in virtual machines); 2 MiB
pages remove most of them.  Linux backs a mapping with huge pages when it is advised
to (``/sys/kernel/mm/transparent_hugepage/enabled`` = ``madvise`` or ``always``), and
the advice must come before the pages are first touched: call :func:`advise_huge_pages`
right after ``torch.empty``.

Packed bf16 weights (kernels/cpu/native.py) are read in full at every decode step, a
64-column tile as 4 streams 18 KiB apart: with 4 KiB pages a column tile touches ~20
pages, and in a virtual machine each TLB miss is a two-level page walk.
:class:`HugePageArena` puts them side by side in 2 MiB-aligned slabs advised onto huge
pages (a weight of its own would waste most of its last huge page: 0.6 MiB of weight
in a 2 MiB page).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import sys
import weakref

import torch

__all__ = ["HUGE_PAGE_BYTES", "HugePageArena", "advise_huge_pages", "empty_huge_pages"]

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


@functools.lru_cache(maxsize=1)
def _libc_trim():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def _malloc_trim() -> None:
    fn = _libc_trim()
    if fn is not None:
        fn(0)


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


class HugePageArena:
    """Tensors carved one after another out of 2 MiB-aligned slabs advised onto
    transparent huge pages, for data that lives as long as a model and is read in full
    (packed weights).

    A slab is ``slab_bytes`` of address space (a tensor that does not fit in what is
    left and is larger than a quarter of that gets a new slab of its own size); only the
    pages its tensors touch take memory, so the unused end of a slab costs at most one
    huge page.  The arena keeps no slab alive:
    it remembers the latest tensor it carved through a weak reference and carves the
    next one from that tensor's storage, so a slab is freed with its last tensor (a model
    dropped for sleep mode frees its weights' memory as before).  Each tensor starts at
    a multiple of ``align`` bytes.  Where the advice is refused (not Linux, THP
    ``never``) the slabs are ordinary memory.
    """

    def __init__(self, slab_bytes: int = 64 << 20, align: int = 64) -> None:
        if slab_bytes % HUGE_PAGE_BYTES or align <= 0 or HUGE_PAGE_BYTES % align:
            raise ValueError("slab_bytes must be whole huge pages and align divide one")
        self.slab_bytes = slab_bytes
        self.align = align
        self._last: weakref.ref | None = None  # the latest tensor carved
        self._next = 0  # byte offset of the first free byte of its storage
        self._end = 0  # byte offset of the slab's end in that storage
        #: Slabs allocated so far (for tests and reports).
        self.slabs = 0

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous CPU tensor of ``shape`` and ``dtype`` in a slab."""
        shape = tuple(int(s) for s in shape)
        nbytes = math.prod(shape) * dtype.itemsize
        last = self._last() if self._last is not None else None
        start = -(-self._next // self.align) * self.align
        if last is None or start + nbytes > self._end:
            storage, start = self._new_slab(max(nbytes, 1))
        else:
            storage = last.untyped_storage()
        t = torch.empty(0, dtype=dtype).set_(storage, start // dtype.itemsize, shape)
        self._next = start + nbytes
        self._last = weakref.ref(t)
        return t

    def _new_slab(self, nbytes: int) -> tuple[torch.UntypedStorage, int]:
        # Packing at load frees each plain weight once its packed copy is in a slab, and
        # slabs do not reuse malloc's heap: hand the freed heap pages back first, or the
        # process keeps ~half the weights' size resident in holes nothing refills.
        _malloc_trim()
        size = self.slab_bytes if nbytes <= self.slab_bytes // 4 else -(-nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
        raw = torch.empty(size + HUGE_PAGE_BYTES, dtype=torch.uint8)  # room to align the start
        ptr = raw.data_ptr()
        start = -(-ptr // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES - ptr
        fn = _madvise()
        if fn is not None:
            fn(ptr + start, size, _MADV_HUGEPAGE)
        self._end = start + size
        self.slabs += 1
        return raw.untyped_storage(), start
