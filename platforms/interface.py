"""The small ``Platform`` base class every platform (builtin or third-party) subclasses."""

from __future__ import annotations

import os
import re
from typing import Any, ClassVar

import torch

from pagedserve.platforms.hookspecs import PLATFORM_INTERFACE_VERSION

__all__ = [
    "Platform",
    "KVConnector",
    "DeviceLayoutKVConnector",
    "SAVE_MODES",
    "PlatformError",
    "PLATFORM_INTERFACE_VERSION",
    "FIRST_INTERFACE_VERSION",
    "parse_interface_version",
    "check_interface_version",
]

#: What a plugin that declares no version targets: plugins written before versioning
#: existed were written against 1.0.  Never changes (unlike PLATFORM_INTERFACE_VERSION),
#: so that an undeclared plugin is refused once the core moves to another major version.
FIRST_INTERFACE_VERSION = "1.0"


class PlatformError(RuntimeError):
    """A platform could not be discovered, loaded, detected or selected."""


def parse_interface_version(version: object) -> tuple[int, int]:
    """``"1.2"`` -> ``(1, 2)``; PlatformError for anything that is not "MAJOR.MINOR"."""
    m = re.fullmatch(r"(\d+)\.(\d+)", version) if isinstance(version, str) else None
    if m is None:
        raise PlatformError(
            f"interface version {version!r} is not a 'MAJOR.MINOR' string such as {PLATFORM_INTERFACE_VERSION!r}"
        )
    return int(m.group(1)), int(m.group(2))


def check_interface_version(targeted: object, what: str, provided: str = PLATFORM_INTERFACE_VERSION) -> None:
    """Raise PlatformError unless a plugin targeting ``targeted`` runs on interface ``provided``.

    Compatible means the same major version and a minor version no newer than the
    core's: minor versions only add, so a plugin for 1.0 runs on 1.3, but a plugin for
    1.3 may use what 1.0 lacks.  ``what`` names the plugin or platform in the message.
    """
    core_major, core_minor = parse_interface_version(provided)
    try:
        major, minor = parse_interface_version(targeted)
    except PlatformError:
        raise PlatformError(
            f"{what} declares interface version {targeted!r}, which is not a "
            f"'MAJOR.MINOR' string (this pagedserve provides interface {provided})"
        ) from None
    head = f"{what} targets pagedserve platform interface {targeted}, but this pagedserve provides interface {provided}"
    if major > core_major or (major == core_major and minor > core_minor):
        raise PlatformError(
            f"{head}; upgrade pagedserve, or use a release of the plugin that "
            f"targets {core_major}.{core_minor} or older"
        )
    if major < core_major:
        raise PlatformError(
            f"{head}; major versions are incompatible: use a release of the plugin built for interface {core_major}.x"
        )


class Platform:
    """One kind of hardware.  Subclasses override the class attributes and methods.

    Only what the core calls is here (interface 1.3 dropped ``priority``, never read;
    ``copy_blocks``, which the ``copy_blocks``/``swap_blocks`` ops do; ``free_memory``
    and ``synchronize``, which only the conformance kit called).  A 1.x plugin that
    still defines them keeps working: they are simply not called.

    Class attributes:
        name: the name users select (``--device NAME``).
        device_type: the torch device type tensors live on ("cpu", "cuda", ...).
        dist_backend: torch.distributed backend for collectives ("gloo", "nccl", ...).
        supported_dtypes: dtypes this platform can run models in.
        pin_memory_available: whether host tensors can be pinned for async copies.
        default_memory_utilization: the memory fraction used when the user gives none.
        default_block_size: tokens per KV-cache block when the user gives none.
        interface_version: the platform interface version ("MAJOR.MINOR") the class was
            written against; checked against PLATFORM_INTERFACE_VERSION when it is
            registered.  Undeclared means FIRST_INTERFACE_VERSION.
    """

    name: ClassVar[str] = ""
    device_type: ClassVar[str] = "cpu"
    dist_backend: ClassVar[str] = "gloo"
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32,)
    pin_memory_available: ClassVar[bool] = False
    #: Fraction of total_memory() the engine uses when the user sets neither
    #: kv_cache_memory nor memory_utilization.
    default_memory_utilization: ClassVar[float] = 0.9
    interface_version: ClassVar[str] = FIRST_INTERFACE_VERSION
    #: Prompt tokens one request computes per step when the user sets no
    #: long_prefill_token_threshold (0: a prompt may take the whole step budget), and
    #: of all requests together while some request decodes when the user sets no
    #: max_prefill_tokens_with_decodes.  A device whose prompt chunk of a full budget
    #: takes long next to a decode step caps it, to bound the inter-token latency of
    #: the decodes sharing the step.
    default_long_prefill_token_threshold: ClassVar[int] = 0
    #: Tokens per KV-cache block when the user sets no block_size (interface 1.10): a
    #: power of two.  A larger block makes each KV head's rows of a block one longer
    #: contiguous run, which a device whose attention streams scattered blocks reads
    #: faster; a smaller one caches prompt prefixes at a finer grain and wastes less of
    #: each sequence's last block.  Where a device map spans several platforms the
    #: engine takes the smallest of theirs.
    default_block_size: ClassVar[int] = 16
    #: Order-of-magnitude figures for the swap-vs-recompute preemption cost model:
    #: bytes/s of a host<->device block copy and FLOP/s of a forward pass.
    host_copy_bandwidth: ClassVar[float] = 5e9
    compute_flops: ClassVar[float] = 5e10
    #: Quantized KV cache dtypes (interface 1.5) that every ``paged_attention`` and
    #: ``reshape_and_cache`` this platform registers reads and writes: "fp8_e4m3"
    #: (``torch.float8_e4m3fn``) and/or "fp8_e5m2" (``torch.float8_e5m2``) caches, with
    #: kernels/reference.py's semantics (saturating cast on write, scale 1.0), and/or
    #: "int8" (``torch.int8`` rows of ``head_size + 4``: the values then a float32 scale
    #: per token and head, computed on write; ``allocate_kv_cache`` then receives that row
    #: size as ``head_size``).  The engine refuses ``kv_cache_dtype`` values not listed
    #: here before the weights load.  Empty: the KV cache is kept in the model's dtype only.
    kv_cache_dtypes: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        """(available, reason).  The reason is a sentence a user can act on."""
        return False, "is_available() not implemented"

    @property
    def device(self) -> torch.device:
        return torch.device(self.device_type)

    @property
    def default_dtype(self) -> torch.dtype:
        return self.supported_dtypes[0]

    def total_memory(self) -> int:
        """Bytes of memory the platform's device has."""
        raise NotImplementedError

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        """Shape of one layer's key (and value) cache; the reference layout by default."""
        return (num_blocks, block_size, num_kv_heads, head_size)

    def allocate_kv_cache(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Allocate one layer's (key_cache, value_cache) on this platform's device."""
        shape = self.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
        k = torch.empty(shape, dtype=dtype, device=self.device)
        v = torch.empty(shape, dtype=dtype, device=self.device)
        return k, v

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        """Start ``dst.copy_(src)`` (host <-> device) so that it can overlap compute;
        returns a handle for ``wait_copy``.  Here: a plain synchronous copy; a platform
        with streams copies on a side stream after the work already queued."""
        dst.copy_(src)
        return None

    def wait_copy(self, handle: Any) -> None:
        """Make work queued from now on wait for the copy behind ``handle``."""

    def release_memory(self) -> None:
        """Give the device memory the core has just dropped (sleep mode: the weights and
        the KV cache) back to the device, where an allocator keeps freed blocks for reuse
        (interface 1.6).  Here: nothing; a platform with a caching allocator empties it."""

    def configure_threads(self, threads: int | None, cpu_bind: list[int] | None = None) -> None:
        """Host threads for the model: ``threads`` of torch's pool (None: leave torch's
        choice); ``cpu_bind``: the process runs on these cores only and ``threads``
        defaults to their number.  Here: process affinity (Linux) and the pool size; the
        CPU platform also pins each pool thread to one core.  ValueError names cores this
        process may not use."""
        if cpu_bind:
            allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
            if allowed is None:
                raise ValueError("cpu_bind needs a platform with sched_setaffinity (Linux)")
            missing = sorted(set(cpu_bind) - allowed)
            if missing:
                raise ValueError(
                    f"cpu_bind names cores {missing} outside this process's allowed cores {sorted(allowed)}"
                )
            os.sched_setaffinity(0, set(cpu_bind))
            threads = threads or len(cpu_bind)
        if threads:
            torch.set_num_threads(threads)

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (possibly on another platform's device) on this platform's device.

        Used where a device map hands activations and step metadata from one platform's
        layers to the next.  Here: ``tensor.to(self.device)`` (``tensor`` itself when it
        is already there), staged through host memory when both sides are accelerators
        of different device types, which torch cannot copy between directly.
        """
        dev = self.device
        if tensor.device.type not in ("cpu", dev.type) and dev.type != "cpu":
            tensor = tensor.cpu()
        return tensor.to(dev)

    def describe(self) -> dict[str, Any]:
        """A few facts for `pagedserve platforms` (dtype, memory)."""
        info: dict[str, Any] = {
            "default_dtype": str(self.default_dtype).replace("torch.", ""),
            "default_block_size": self.default_block_size,
        }
        try:
            info["total_memory"] = self.total_memory()
        except Exception as exc:  # reported, not hidden: shown in the listing
            info["total_memory_error"] = f"{type(exc).__name__}: {exc}"
        return info


#: The KV connector save modes (interface 1.7; see ``KVConnector.save_mode``).
SAVE_MODES = ("write-through", "on-evict")


class KVConnector:
    """A store of KV cache blocks keyed by their content (interface 1.6).

    The engine saves each full block its prefix cache registers and, when a new prompt's
    prefix misses in the device cache, looks the following blocks up here and loads the
    leading run it finds instead of recomputing them.  A plugin provides connectors
    through the ``pagedserve_register_kv_connectors`` hook; the builtin ones are ``host``
    (host memory) and ``disk`` (a directory).

    ``key`` is a hex SHA-256 string that covers the block's tokens, every token before
    it (and a cache salt), and the engine's KV layout: model, dtype, cache dtype, block
    size and the block's tensor shapes.  Equal keys mean interchangeable blocks, in this
    process or another one.  A block is a list of CPU tensors: every tensor the cache has
    for that block (per layer its key and value, and whatever else a cache format adds,
    such as scales), in the cache's order.  Calls come from the engine's thread, one at
    a time.

    Interface 1.7 adds two class attributes (their defaults are 1.6's behaviour):
    ``save_mode`` -- ``"write-through"``: every full block is saved as the prefix cache
    registers it; ``"on-evict"``: a block is saved only when the device cache's LRU
    evicts it (a workload that fits on the device saves nothing) -- and
    ``device_layout``, true only for a :class:`DeviceLayoutKVConnector`.
    """

    #: When the engine saves full blocks (interface 1.7): one of :data:`SAVE_MODES`.
    save_mode: ClassVar[str] = "write-through"
    #: True for a :class:`DeviceLayoutKVConnector` (interface 1.7).
    device_layout: ClassVar[bool] = False

    def contains(self, key: str) -> bool:
        """Whether ``load(key)`` is expected to succeed (a cheap index lookup)."""
        raise NotImplementedError

    def save(self, key: str, tensors: list[torch.Tensor]) -> None:
        """Keep the block (the tensors are the connector's to keep); a full store evicts
        or drops, never raises for lack of room."""
        raise NotImplementedError

    def load(self, key: str) -> list[torch.Tensor] | None:
        """The block saved under ``key`` (CPU tensors, the saved dtypes and shapes), or
        None when it is missing or unreadable: a damaged block must never be returned."""
        raise NotImplementedError

    def stats(self) -> dict[str, int]:
        """Counters for logs and tests (blocks, bytes, hits, ...)."""
        return {}

    def close(self) -> None:
        """Persist what needs persisting; the engine calls it once, at shutdown."""


class DeviceLayoutKVConnector(KVConnector):
    """A KV connector that is a tier of block slots in the device's layout (interface 1.7).

    The builtin host tier (``kv_offload_memory``) is one: its slots are host memory.  A
    plugin's (a CXL memory node, a file on an NVMe drive mapped into memory, ...) gets the
    same roles through ``kv_connector="NAME"``: spills of blocks the device cache evicts
    (``save_mode`` is ``"on-evict"``), prefix hits reloaded from them, and swap
    preemption.  The connector supplies storage and copies; the engine keeps the index:

    * **Slots, per rank.**  Every rank creates its own connector (with tensor/pipeline
      parallelism each holds its KV heads of its stage's layers) and :meth:`allocate`
      gives, per layer (or KV cache group slot), a key and a value tensor of ``num_blocks``
      slots shaped as ``platform.kv_cache_shape`` says, so that one block index means
      the same block in the device cache and in the store, and one slot index means one
      block on every rank (every rank gets the smallest rank's :meth:`num_blocks`).
    * **Entries, kept by the engine on rank 0.**  Two kinds share the slots: *content*
      entries (a block's prefix-cache hash; evicted least recently used first to make
      room) and *handle* entries (a swapped-out request's blocks, by request and block
      index; never evicted until the request takes them back or is aborted).  The
      store has no eviction of its own: a slot keeps what was last copied into it.
    * **Copies, planned on rank 0 and run on every rank.**  Before each forward every
      rank runs the step's copies against its own slots, in order, batched: one
      :meth:`save_blocks` or :meth:`load_blocks` per run of copies, layer and tensor,
      which by default is the platform's ``swap_blocks`` op (an asynchronous kernel
      where the platform has one).

    The 1.6 methods ``contains``/``save``/``load`` address blocks by content key and are
    not called for a device-layout connector: the engine looks blocks up in its index.
    """

    device_layout: ClassVar[bool] = True
    save_mode: ClassVar[str] = "on-evict"

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = int(max_bytes)

    def num_blocks(self, bytes_per_block: int) -> int:
        """Slots this rank's store holds for blocks of ``bytes_per_block`` bytes (its
        share of one block: its layers, its KV heads).  Here: ``max_bytes`` of them."""
        return self.max_bytes // bytes_per_block

    def allocate(
        self,
        platform: Platform,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's (key, value) slots, ``platform.kv_cache_shape(num_blocks, ...)``
        each, in ``dtype``, where ``platform``'s ``swap_blocks`` copies to and from them.
        Here: host memory, pinned when the platform can pin, zeroed (a read of a slot
        never written is deterministic)."""
        shape = platform.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)

        def alloc() -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device="cpu", pin_memory=platform.pin_memory_available)

        return alloc(), alloc()

    def save_blocks(self, swap_blocks: Any, device: torch.Tensor, store: torch.Tensor, mapping: torch.Tensor) -> None:
        """Copy device blocks ``mapping[:, 0]`` of one layer's key or value cache into
        slots ``mapping[:, 1]`` of the matching tensor :meth:`allocate` returned
        (``mapping``: int64 ``[n, 2]`` on the CPU).  Here: ``swap_blocks(device, store,
        mapping)``, the platform's op."""
        swap_blocks(device, store, mapping)

    def load_blocks(self, swap_blocks: Any, store: torch.Tensor, device: torch.Tensor, mapping: torch.Tensor) -> None:
        """Copy slots ``mapping[:, 0]`` into device blocks ``mapping[:, 1]``.  Here:
        ``swap_blocks(store, device, mapping)``."""
        swap_blocks(store, device, mapping)

    def contains(self, key: str) -> bool:
        raise TypeError(f"{type(self).__name__} is a device-layout KV connector: the engine indexes its slots")

    def save(self, key: str, tensors: list[torch.Tensor]) -> None:
        raise TypeError(f"{type(self).__name__} is a device-layout KV connector: blocks move by save_blocks")

    def load(self, key: str) -> list[torch.Tensor] | None:
        raise TypeError(f"{type(self).__name__} is a device-layout KV connector: blocks move by load_blocks")
