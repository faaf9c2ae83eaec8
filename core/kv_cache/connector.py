"""KV connector bookkeeping: the prefix cache extended by a store of blocks by content.

``ConnectorKVCacheManager`` is a ``KVCacheManager`` whose full blocks are also saved to a
KV connector (``pagedserve.platforms.KVConnector``: host memory, a directory, or a
plugin's store) and whose prefix lookups continue there after the device cache misses:

* **Save (write-through).**  A block registered in the prefix cache while scheduling
  step N is written by step N's forward, so its save is handed to the runner with step
  N+1's copies (or at the next idle step, ``flush_transfers``), which run before that
  step's forward: the device block cannot have been overwritten yet.  Blocks the
  connector already holds are not saved again.
* **Save on evict** (a connector whose ``save_mode`` is ``"on-evict"``, interface 1.7).
  A registered block's key is remembered instead, and the block is saved only when the
  device pool's LRU evicts it (``BlockPool.on_evict``, while a step is scheduled): its
  forward has run, and the save runs with that step's copies, before any load or
  forward can overwrite it.  A workload that fits on the device saves nothing.
* **Load.**  ``get_computed_blocks`` takes the device hits, then asks the connector for
  the following blocks (up to the last prompt token, always recomputed) and keeps the
  leading run it returns; ``allocate_slots`` gives them the first new device blocks and
  records the writes, run before the forward.  The block's tensors are read here, at
  lookup, so a block the store cannot return (evicted, damaged) is a miss, never a
  half-computed prefix.

No torch here: the connector's blocks pass through as opaque objects; the runner moves
the bytes (pagedserve.offload.connectors.apply_connector_transfers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedserve.kv_cache.block_hash import extend_content_keys
from pagedserve.kv_cache.block_pool import KVBlock
from pagedserve.kv_cache.manager import KVCacheManager
from pagedserve.request import Request

__all__ = ["ConnectorTransfers", "ConnectorKVCacheManager"]


@dataclass
class ConnectorTransfers:
    """Connector work to run before a step's forward, saves first: ``saves`` are
    (device block id, key) of blocks written by earlier forwards (a block saved and
    then reused by a load in the same step is read before it is overwritten);
    ``loads`` are (device block id, key, the connector's tensors)."""

    saves: list[tuple[int, str]] = field(default_factory=list)
    loads: list[tuple[int, str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.saves or self.loads)


class ConnectorKVCacheManager(KVCacheManager):
    """A ``KVCacheManager`` backed by ``connector`` (see the module docstring).

    ``seed``: the engine's KV layout fingerprint, covered by every key.
    Counters: ``num_loaded_blocks`` / ``num_loaded_tokens`` (prefix blocks loaded from
    the connector instead of computed), ``num_saved_blocks``, ``connector_prefix_hits``.
    """

    def __init__(
        self, num_blocks: int, block_size: int, connector: Any, seed: str, enable_prefix_caching: bool = True
    ) -> None:
        self.on_evict_saves = getattr(connector, "save_mode", "write-through") == "on-evict"
        super().__init__(
            num_blocks, block_size, enable_prefix_caching, on_evict=self._evicted if self.on_evict_saves else None
        )
        self.connector = connector
        self.seed = seed
        # On-evict saves: each registered device block's content key; saves of blocks
        # evicted while this step is scheduled (their forwards have run).
        self._block_keys: dict[int, tuple[int, str]] = {}  # block id -> (its hash, its key)
        self._evicted_saves: list[tuple[int, str]] = []
        self._keys: dict[str, list[str]] = {}
        # Per waiting request: (index of its first connector hit, the hits' (key, tensors)).
        self._hits: dict[str, tuple[int, list[tuple[str, Any]]]] = {}
        self._saves: list[tuple[int, str]] = []  # registered this schedule: written by its forward
        self._ready: list[tuple[int, str]] = []  # registered earlier: their forward has run
        self._loads: list[tuple[int, str, Any]] = []
        self._queued: set[str] = set()  # keys with a save pending
        self.num_loaded_blocks = 0
        self.num_loaded_tokens = 0
        self.num_saved_blocks = 0
        self.connector_prefix_hits = 0

    def _content_keys(self, request: Request, num_blocks: int) -> list[str]:
        keys = self._keys.setdefault(request.request_id, [])
        return extend_content_keys(
            keys, request.all_token_ids, self.block_size, num_blocks, self.seed, request.cache_salt
        )

    def counters(self) -> dict[str, int | float]:
        """The connector's counters, named as ``EngineStats`` fields."""
        return {
            "kv_connector_blocks_loaded": self.num_loaded_blocks,
            "kv_connector_blocks_saved": self.num_saved_blocks,
        }

    # -- lookup ------------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        blocks, num_tokens = super().get_computed_blocks(request)
        if not self.enable_prefix_caching:
            return blocks, num_tokens
        rid, first = request.request_id, len(blocks)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        cached = self._hits.get(rid)
        if cached is not None and cached[0] == first:
            hits = cached[1]  # looked up on an earlier try that could not be scheduled
        else:
            hits = []
            for key in self._content_keys(request, max_hit_blocks)[first:max_hit_blocks]:
                tensors = self.connector.load(key) if self.connector.contains(key) else None
                if tensors is None:
                    break
                hits.append((key, tensors))
            self._hits[rid] = (first, hits)
        if not hits:
            del self._hits[rid]
            return blocks, num_tokens
        self.prefix_hits += len(hits) * self.block_size
        self.connector_prefix_hits += len(hits) * self.block_size
        return blocks, num_tokens + len(hits) * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[KVBlock] | None = None
    ) -> list[KVBlock] | None:
        rid = request.request_id
        hits = self._hits.get(rid, (0, []))[1]
        new = super().allocate_slots(request, num_new_tokens, computed_blocks)
        if new is None or not hits:
            return new
        if len(new) < len(hits):
            raise AssertionError(f"request {rid}: {len(hits)} blocks to load, {len(new)} allocated")
        # Loaded blocks come first among the new ones: they follow the device hits.
        for (key, tensors), block in zip(hits, new):
            self._loads.append((block.block_id, key, tensors))
        del self._hits[rid]
        self.num_loaded_blocks += len(hits)
        self.num_loaded_tokens += len(hits) * self.block_size
        return new

    # -- write-through -----------------------------------------------------------------------
    def _cache_full_blocks(self, request: Request, blocks: list[KVBlock], num_tokens: int) -> None:
        start = self._num_cached.get(request.request_id, 0)
        super()._cache_full_blocks(request, blocks, num_tokens)
        end = self._num_cached.get(request.request_id, 0)
        if end <= start:
            return
        keys = self._content_keys(request, end)
        if self.on_evict_saves:
            for i in range(start, end):
                if blocks[i].block_hash is not None:  # registered (first writer of its hash)
                    self._block_keys[blocks[i].block_id] = (blocks[i].block_hash, keys[i])
            return
        loaded = {key for _, key, _ in self._loads}
        for i, key in enumerate(keys[start:end], start):
            if key in self._queued or key in loaded or self.connector.contains(key):
                continue
            self._saves.append((blocks[i].block_id, key))
            self._queued.add(key)

    def _evicted(self, block: KVBlock) -> None:
        """On-evict saves: the device pool is about to forget ``block``'s hash."""
        entry = self._block_keys.pop(block.block_id, None)
        if entry is None or entry[0] != block.block_hash:  # registered under another hash since
            return
        key = entry[1]
        if key in self._queued or self.connector.contains(key):
            return
        self._evicted_saves.append((block.block_id, key))
        self._queued.add(key)

    def free(self, request: Request) -> None:
        super().free(request)
        self._hits.pop(request.request_id, None)
        if request.is_finished:
            self._keys.pop(request.request_id, None)

    # -- per step ----------------------------------------------------------------------------
    def take_transfers(self) -> ConnectorTransfers | None:
        """Called once per scheduled step: the saves of blocks earlier forwards wrote and
        this schedule's loads; this schedule's saves wait for its forward."""
        out = ConnectorTransfers(self._ready + self._evicted_saves, self._loads)
        self._ready, self._saves, self._loads, self._evicted_saves = self._saves, [], [], []
        self._queued.difference_update(key for _, key in out.saves)
        self.num_saved_blocks += len(out.saves)
        return out or None

    def flush_transfers(self) -> ConnectorTransfers | None:
        """With no step scheduled (every forward has run): every pending save."""
        out = ConnectorTransfers(self._ready + self._saves + self._evicted_saves, self._loads)
        self._ready, self._saves, self._loads, self._evicted_saves = [], [], [], []
        self._queued.clear()
        self.num_saved_blocks += len(out.saves)
        return out or None

    def close(self) -> None:
        self.connector.close()

    def reset_prefix_cache(self) -> bool:
        # Saves not yet run read blocks whose contents the caller is about to drop.
        if self._ready or self._saves or self._loads or self._evicted_saves:
            raise RuntimeError("flush_transfers() before resetting the prefix cache: saves are pending")
        if not super().reset_prefix_cache():
            return False
        self._block_keys.clear()
        return True
