"""KV connectors: the builtin ``host`` and ``disk`` stores, the builtin host tier
(``kv_offload_memory``: a device-layout connector, interface 1.7), plugin lookup, and the
copies between a connector and the KV cache (bookkeeping: pagedserve.kv_cache.connector
for content stores, pagedserve.kv_cache.host_tier for device-layout ones).

``disk`` keeps one file per block in a directory, with an index, bounded in size with
LRU eviction, so that a prefix computed by one process is a hit in the next:

* file ``<key>.kvb``: magic ``PSKV1\\n``, payload length (8 bytes, little endian), the
  payload's SHA-256 (32 bytes), then the payload: the block's tensors as safetensors
  (``"0"``, ``"1"``, ... in the cache's order).
* writes go to a temporary file in the same directory, flushed and fsync'ed, then
  renamed over the final name (atomic on POSIX), so a reader sees a whole file or none;
  a file whose magic, length or checksum does not match (a torn write from a crash, a
  damaged disk, a foreign file) is deleted and reported as a miss, never loaded.
* ``index.json``: the blocks in LRU order (oldest first) with their sizes, rewritten the
  same way every 64 saves and at close.  On opening, the directory is the truth: indexed
  entries whose file is gone are dropped, block files the index does not list (saved
  after its last rewrite) are added by modification time, leftover temporary files are
  removed, and the store is cut to its size bound.  A block another process saved in
  the same directory later is found by its file name when first looked up.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import struct
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from pagedserve.config_rules import BUILTIN_KV_CONNECTORS, kv_connector_refusal
from pagedserve.kv_cache.connector import ConnectorTransfers
from pagedserve.platforms import DeviceLayoutKVConnector, KVConnector, PlatformError, discover
from pagedserve.platforms.interface import SAVE_MODES

__all__ = [
    "HostTierConnector",
    "HostKVConnector",
    "DiskKVConnector",
    "BUILTIN_CONNECTORS",
    "create_kv_connector",
    "create_tier_connector",
    "is_device_layout_connector",
    "check_kv_connector",
    "apply_connector_transfers",
    "kv_fingerprint",
]

logger = logging.getLogger(__name__)

MAGIC = b"PSKV1\n"
_HEADER = struct.Struct("<6sQ32s")
_SUFFIX = ".kvb"
_INDEX = "index.json"
_INDEX_EVERY = 64


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class HostTierConnector(DeviceLayoutKVConnector):
    """The builtin host tier (``kv_offload_memory``): ``max_bytes`` of block slots per
    rank in host memory, laid out as each layer's platform lays out its KV cache, pinned
    when the platform can pin, copied by the platform's ``swap_blocks``.  Every default
    of :class:`DeviceLayoutKVConnector` is this tier's behaviour; the class names it."""


class HostKVConnector(KVConnector):
    """Blocks in host memory, at most ``max_bytes``, least recently used evicted first:
    the host tier's role of a second-level prefix cache, as a connector (one process)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = int(max_bytes)
        self._blocks: collections.OrderedDict[str, list[torch.Tensor]] = collections.OrderedDict()
        self._bytes = 0
        self.counts = collections.Counter()

    def contains(self, key: str) -> bool:
        return key in self._blocks

    def save(self, key: str, tensors: list[torch.Tensor]) -> None:
        size = _nbytes(tensors)
        if key in self._blocks or size > self.max_bytes:
            return
        while self._bytes + size > self.max_bytes:
            _, old = self._blocks.popitem(last=False)
            self._bytes -= _nbytes(old)
            self.counts["evicted"] += 1
        self._blocks[key] = tensors
        self._bytes += size
        self.counts["saved"] += 1

    def load(self, key: str) -> list[torch.Tensor] | None:
        tensors = self._blocks.get(key)
        if tensors is None:
            return None
        self._blocks.move_to_end(key)
        self.counts["loaded"] += 1
        return tensors

    def stats(self) -> dict[str, int]:
        return {"blocks": len(self._blocks), "bytes": self._bytes, **self.counts}


class DiskKVConnector(KVConnector):
    """Blocks as files in ``path`` (created if missing), at most ``max_bytes`` of them;
    see the module docstring for the format and the crash-safety rules."""

    def __init__(self, path: str | os.PathLike, max_bytes: int) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.max_bytes = int(max_bytes)
        self.counts = collections.Counter()
        self._lru: collections.OrderedDict[str, int] = collections.OrderedDict()  # key -> file bytes
        self._bytes = 0
        self._unindexed = 0
        self._open()

    # -- index -------------------------------------------------------------------------------
    def _file(self, key: str) -> Path:
        return self.path / f"{key}{_SUFFIX}"

    def _open(self) -> None:
        for tmp in self.path.glob(".*.tmp"):  # a write a crash interrupted
            tmp.unlink(missing_ok=True)
            self.counts["torn_temp_files_removed"] += 1
        on_disk = {}
        for f in self.path.glob(f"*{_SUFFIX}"):
            try:
                st = f.stat()
            except FileNotFoundError:
                continue
            on_disk[f.name[: -len(_SUFFIX)]] = (st.st_size, st.st_mtime_ns)
        indexed: list[str] = []
        try:
            data = json.loads((self.path / _INDEX).read_text(encoding="utf-8"))
            indexed = [k for k, _ in data["entries"] if isinstance(k, str)]
        except (OSError, ValueError, KeyError, TypeError):
            pass  # no index, or a damaged one: the directory listing alone
        for key in indexed:
            if key in on_disk and key not in self._lru:
                self._lru[key] = on_disk[key][0]
        for key in sorted(set(on_disk) - set(self._lru), key=lambda k: on_disk[k][1]):
            self._lru[key] = on_disk[key][0]
        self._bytes = sum(self._lru.values())
        self._evict(0)

    def _write_index(self) -> None:
        text = json.dumps({"version": 1, "entries": list(self._lru.items())})
        self._atomic_write(self.path / _INDEX, text.encode())
        self._unindexed = 0

    def _atomic_write(self, final: Path, data: bytes) -> None:
        tmp = self.path / f".{final.name}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)

    def _evict(self, room: int) -> None:
        while self._lru and self._bytes + room > self.max_bytes:
            key, size = self._lru.popitem(last=False)
            self._bytes -= size
            self._file(key).unlink(missing_ok=True)
            self.counts["evicted"] += 1

    def _forget(self, key: str) -> None:
        size = self._lru.pop(key, None)
        if size is not None:
            self._bytes -= size
        self._file(key).unlink(missing_ok=True)

    # -- KVConnector ---------------------------------------------------------------------------
    def contains(self, key: str) -> bool:
        if key in self._lru:
            return True
        try:  # saved by another process sharing the directory since this one opened it
            size = self._file(key).stat().st_size
        except OSError:
            return False
        self._lru[key] = size
        self._bytes += size
        self._evict(0)
        return key in self._lru

    def save(self, key: str, tensors: list[torch.Tensor]) -> None:
        if key in self._lru:
            return
        payload = st_save({str(i): t.contiguous() for i, t in enumerate(tensors)})
        data = _HEADER.pack(MAGIC, len(payload), hashlib.sha256(payload).digest()) + payload
        if len(data) > self.max_bytes:
            return
        self._evict(len(data))
        try:
            self._atomic_write(self._file(key), data)
        except OSError as exc:  # a full or read-only disk: the block is simply not kept
            self.counts["save_errors"] += 1
            logger.warning("KV connector 'disk': could not write a block to %s: %s", self.path, exc)
            return
        self._lru[key] = len(data)
        self._bytes += len(data)
        self.counts["saved"] += 1
        self._unindexed += 1
        if self._unindexed >= _INDEX_EVERY:
            self._write_index()

    def load(self, key: str) -> list[torch.Tensor] | None:
        if key not in self._lru:
            return None
        try:
            data = self._file(key).read_bytes()
        except OSError:
            self._forget(key)
            self.counts["missing"] += 1
            return None
        tensors = self._verified(data)
        if tensors is None:
            logger.warning("KV connector 'disk': block file %s is damaged (torn or corrupt); ignored", key)
            self._forget(key)
            self.counts["corrupt"] += 1
            return None
        self._lru.move_to_end(key)
        self.counts["loaded"] += 1
        return tensors

    @staticmethod
    def _verified(data: bytes) -> list[torch.Tensor] | None:
        if len(data) < _HEADER.size:
            return None
        magic, length, digest = _HEADER.unpack_from(data)
        payload = data[_HEADER.size :]
        if magic != MAGIC or length != len(payload) or hashlib.sha256(payload).digest() != digest:
            return None
        try:
            named = st_load(payload)
        except Exception:  # noqa: BLE001 - a checksummed payload that still does not parse
            return None
        return [named[str(i)] for i in range(len(named))]

    def stats(self) -> dict[str, int]:
        return {"blocks": len(self._lru), "bytes": self._bytes, **self.counts}

    def close(self) -> None:
        self._write_index()


#: The builtin connectors: name -> factory(arg, max_bytes, fingerprint).
BUILTIN_CONNECTORS = {
    "host": lambda arg, max_bytes, fingerprint: HostKVConnector(max_bytes),
    "disk": lambda arg, max_bytes, fingerprint: DiskKVConnector(_disk_path(arg), max_bytes),
}


def _disk_path(arg: str | None) -> str:
    if not arg:
        raise ValueError("kv_connector='disk' needs a directory: kv_connector='disk:/path/to/dir'")
    return arg


def create_kv_connector(spec: str, max_bytes: int, fingerprint: str) -> KVConnector:
    """The connector ``spec`` ("NAME" or "NAME:ARG") names: a builtin, or one a plugin
    registers through ``pagedserve_register_kv_connectors``."""
    name, _, arg = spec.partition(":")
    if name in BUILTIN_CONNECTORS:
        return BUILTIN_CONNECTORS[name](arg or None, max_bytes, fingerprint)
    try:
        plugins = discover().kv_connectors()
    except PlatformError as exc:
        raise ValueError(f"kv_connector={spec!r}: {exc}") from None
    if name not in plugins:
        known = ", ".join(sorted({*BUILTIN_CONNECTORS, *plugins}))
        raise ValueError(f"kv_connector={spec!r}: no connector named {name!r} (available: {known})")
    factory, plugin = plugins[name]
    connector = factory(arg=arg or None, max_bytes=max_bytes, fingerprint=fingerprint)
    if not isinstance(connector, KVConnector):
        raise ValueError(f"kv_connector {name!r} of plugin {plugin!r} returned {connector!r}, not a KVConnector")
    if connector.save_mode not in SAVE_MODES:
        raise ValueError(
            f"kv_connector {name!r} of plugin {plugin!r} has save_mode={connector.save_mode!r}; "
            f"expected one of {', '.join(SAVE_MODES)}"
        )
    if connector.device_layout and not isinstance(connector, DeviceLayoutKVConnector):
        raise ValueError(
            f"kv_connector {name!r} of plugin {plugin!r} sets device_layout without subclassing "
            "DeviceLayoutKVConnector (interface 1.7)"
        )
    return connector


def create_tier_connector(cache) -> DeviceLayoutKVConnector | None:
    """The device-layout connector of the engine's cache settings (``cache``: its
    CacheConfig), created in the calling process (every rank creates its own): the
    builtin host tier of ``kv_offload_memory`` bytes, or a plugin's device-layout
    ``kv_connector`` of ``kv_connector_memory`` bytes; None for neither (no connector,
    or a content store, which rank 0 alone creates with the layout's fingerprint)."""
    if cache.kv_offload_memory is not None:
        return HostTierConnector(int(cache.kv_offload_memory))
    if cache.kv_connector is None or not is_device_layout_connector(cache.kv_connector):
        return None
    connector = create_kv_connector(cache.kv_connector, int(cache.kv_connector_memory), "")
    if not connector.device_layout:
        raise ValueError(f"kv_connector={cache.kv_connector!r} declared device_layout but returned a content store")
    return connector


def is_device_layout_connector(spec: str) -> bool:
    """Whether the connector ``spec`` names is a device-layout tier (interface 1.7), told
    from its registration before one is created: a factory (a DeviceLayoutKVConnector
    subclass, or a function) with a true ``device_layout`` attribute.  The builtin
    ``host`` and ``disk`` are stores by content; a name no plugin registers is not one
    (creating it names the available connectors)."""
    name = spec.partition(":")[0]
    if name in BUILTIN_CONNECTORS:
        return False
    try:
        return discover().kv_connector_is_device_layout(name)
    except PlatformError as exc:
        raise ValueError(f"kv_connector={spec!r}: {exc}") from None


def check_kv_connector(config) -> None:
    """ValueError for a plugin's ``kv_connector`` the settings (``config``: EngineConfig)
    cannot use, by the rules the builtin connectors are checked with when the settings
    are (config_rules.kv_connector_refusal), now that its kind can be told; called by
    the engine before weights load."""
    spec = config.cache.kv_connector
    if spec is None or spec.partition(":")[0] in BUILTIN_KV_CONNECTORS:
        return
    refusal = kv_connector_refusal(config, is_device_layout_connector(spec))
    if refusal is not None:
        raise ValueError(refusal)


def apply_connector_transfers(
    caches: Sequence[Sequence[torch.Tensor]], connector: KVConnector, transfers: ConnectorTransfers
) -> None:
    """Run a step's connector work, saves first: a block's tensors are every tensor of
    every layer's cache entry (``caches``: per layer, its tensors -- key, value, and any
    other -- each indexed by block id first) at that block id."""
    flat = [t for layer in caches for t in layer]
    for block_id, key in transfers.saves:
        connector.save(key, [t[block_id].to("cpu", copy=True) for t in flat])
    for block_id, key, tensors in transfers.loads:
        if len(tensors) != len(flat) or any(
            src.shape != dst[block_id].shape or src.dtype != dst.dtype for src, dst in zip(tensors, flat)
        ):
            raise RuntimeError(
                f"KV connector block {key[:12]}... does not match this engine's KV cache "
                f"({len(tensors)} tensors for {len(flat)}; shapes or dtypes differ)"
            )
        for src, dst in zip(tensors, flat):
            dst[block_id].copy_(src)


def kv_fingerprint(model: str | None, hf_config: dict, extra: dict) -> str:
    """A hex digest of what makes KV blocks interchangeable: the model (its folder's
    files by name, size and modification time, or the file's), its config, and
    ``extra`` (dtypes, block size, the cache's per-block tensor shapes, quantization)."""
    files: list = []
    if model is not None and os.path.isdir(model):
        for entry in sorted(os.scandir(model), key=lambda e: e.name):
            if entry.is_file():
                st = entry.stat()
                files.append((entry.name, st.st_size, st.st_mtime_ns))
    elif model is not None and os.path.isfile(model):
        st = os.stat(model)
        files.append((os.path.abspath(model), st.st_size, st.st_mtime_ns))
    text = json.dumps({"model": model, "files": files, "config": hf_config, **extra}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()
