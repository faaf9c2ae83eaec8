"""Host KV tier: a second, larger pool of KV blocks in host memory -- or in any store a
device-layout KV connector supplies (interface 1.7; the host tier is the builtin one).

It serves two purposes:

* **Second-level prefix cache.**  When LRU eviction takes a cached (hash-registered,
  unreferenced) device block, its KV *spills* to a host block registered under the same
  hash.  A later prefix lookup that misses on device but hits on host allocates fresh
  device blocks and *reloads* them instead of recomputing those tokens.
* **Swap preemption.**  A preempted request may keep its KV by copying its blocks to
  host (swap-out) and copying them back when it resumes (swap-in) instead of
  recomputing its whole context.

This module is the connector's index, kept on rank 0 (no torch): which store slot holds
which block.  Two kinds of entries share the slots: *content* entries (a block's
prefix-cache hash; LRU-evicted for room) and *handle* entries (a swapped-out request's
blocks, by request and block index: ``_swapped``; never evicted until swap-in or abort).
Every copy is recorded in a ``KVTransfers`` list, which the scheduler hands to the
executor once per step and every rank runs, in order, against its own store before
that step's forward (pagedserve.offload.kv_tier.apply_kv_transfers).  Host blocks read or written by a pending copy are
pinned (hold a reference) until the copies are taken, so no later decision in the same
step can reuse them.  The host pool is a ``BlockPool`` like the device one, so host
eviction is LRU too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedserve.kv_cache.block_pool import BlockPool, KVBlock
from pagedserve.kv_cache.manager import KVCacheManager
from pagedserve.request import Request

__all__ = ["KVTransfers", "TieredKVCacheManager", "SwapPolicy"]

#: ``(num_blocks, num_tokens) -> True`` when swapping a request of that size out and
#: back in is cheaper than recomputing it (see pagedserve.offload.cost).
SwapPolicy = Callable[[int, int], bool]

OUT = "out"  # device -> host
IN = "in"  # host -> device


@dataclass
class KVTransfers:
    """Block copies to run before a step's forward, in the order they were decided.

    ``runs`` is a list of ``(direction, [(src_block, dst_block), ...])``; direction
    ``"out"`` copies device blocks to host blocks, ``"in"`` host blocks to device
    blocks.  Consecutive copies in the same direction share one run so that the
    executor issues one batched copy per run and layer.  Order matters: a device block
    spilled and then reused in the same step must be read before it is overwritten.
    """

    runs: list[tuple[str, list[tuple[int, int]]]] = field(default_factory=list)

    def add(self, direction: str, src: int, dst: int) -> None:
        if self.runs and self.runs[-1][0] == direction:
            self.runs[-1][1].append((src, dst))
        else:
            self.runs.append((direction, [(src, dst)]))

    def num_blocks(self, direction: str) -> int:
        return sum(len(pairs) for d, pairs in self.runs if d == direction)

    def __bool__(self) -> bool:
        return bool(self.runs)


class TieredKVCacheManager(KVCacheManager):
    """A ``KVCacheManager`` backed by a host pool of ``num_host_blocks`` blocks.

    Token accounting for tests and metrics: ``num_scheduled_tokens`` (base class) counts
    every token given to the model (computed or recomputed); ``num_reloaded_tokens`` counts prefix
    tokens reloaded from host instead of being recomputed; ``num_swapped_in_tokens``
    those restored by swap-in.  Block and request counters (``num_spilled_blocks``,
    ``num_reloaded_blocks``, ``num_swap_outs``/``num_swap_ins``, ...) feed the engine's
    statistics through :meth:`counters`.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        num_host_blocks: int = 1,
        swap_policy: SwapPolicy | None = None,
        connector: Any = None,
    ) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching, on_evict=self._spill)
        #: The device-layout KV connector whose slots ``host`` indexes (opaque here; the
        #: runners copy through it), closed with the manager; None in bookkeeping tests.
        self.connector = connector
        self.host = BlockPool(num_host_blocks, enable_caching=True)
        self.swap_policy = swap_policy
        self._transfers = KVTransfers()
        # Host blocks a pending copy reads or writes: one reference each until taken.
        self._pinned: list[KVBlock] = []
        # Host prefix hits found by get_computed_blocks, consumed by allocate_slots.
        self._host_hits: dict[str, list[KVBlock]] = {}
        # Host copies of swapped-out requests (one reference each), first block first.
        self._swapped: dict[str, list[KVBlock]] = {}
        self.num_reloaded_tokens = 0
        self.num_swapped_in_tokens = 0
        self.num_spilled_blocks = 0
        self.num_spills_dropped = 0
        self.num_swap_outs = 0
        #: Prompt tokens found on host by prefix lookups (also in ``prefix_hits``).
        self.host_prefix_hits = 0
        self.num_reloaded_blocks = 0
        self.num_swap_ins = 0
        self.num_swapped_out_blocks = 0  # copied to host (blocks already there are shared)
        self.num_swapped_in_blocks = 0

    # -- spill on eviction ----------------------------------------------------------------
    def _spill(self, block: KVBlock) -> None:
        """Called by the device pool just before a cached block is evicted."""
        if block.block_hash is None:
            return
        hit = self.host.lookup(block.block_hash, block.hash_key)
        if hit is not None:
            # Already on host (reloaded earlier, or swapped): refresh its LRU position.
            self.host.touch([hit])
            self.host.free_blocks([hit])
            return
        if self.host.num_free_blocks == 0:
            self.num_spills_dropped += 1
            return
        dst = self.host.get_new_blocks(1)[0]  # its reference is the pin
        self.host.cache_block(dst, block.block_hash, block.hash_key)
        self._pinned.append(dst)
        self._transfers.add(OUT, block.block_id, dst.block_id)
        self.num_spilled_blocks += 1

    # -- prefix lookup across both tiers -----------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Device hits as before, extended by the host hits that follow them; the
        returned token count includes both (host hits are reloaded by allocate_slots)."""
        blocks, num_tokens = super().get_computed_blocks(request)
        rid = request.request_id
        self._host_hits.pop(rid, None)
        if not self.enable_prefix_caching:
            return blocks, num_tokens
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._req_hashes.get(rid, [])[len(blocks) : max_hit_blocks]
        hits: list[KVBlock] = []
        for h, key in hashes:
            hb = self.host.lookup(h, key)
            if hb is None:
                break
            hits.append(hb)
        if hits:
            self._host_hits[rid] = hits
            self.prefix_hits += len(hits) * self.block_size
            self.host_prefix_hits += len(hits) * self.block_size
        return blocks, num_tokens + len(hits) * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[KVBlock] | None = None
    ) -> list[KVBlock] | None:
        rid = request.request_id
        swapped = self._swapped.get(rid)
        sources = swapped if swapped is not None else self._host_hits.get(rid, [])
        if sources and swapped is None:
            # Hold the host hits so that spills caused by this allocation cannot evict them.
            self.host.touch(sources)
        new = super().allocate_slots(request, num_new_tokens, computed_blocks)
        if new is None:
            if sources and swapped is None:
                self.host.free_blocks(reversed(sources))
            return None
        if sources:
            if len(new) < len(sources):
                raise AssertionError(f"request {rid}: {len(sources)} blocks to reload, {len(new)} allocated")
            # Reloaded blocks come first among the new ones: they follow the device hits.
            for src, dst in zip(sources, new):
                self._transfers.add(IN, src.block_id, dst.block_id)
            self._pinned.extend(sources)
            reloaded = len(sources) * self.block_size
            if swapped is not None:
                del self._swapped[rid]
                self.num_swapped_in_tokens += min(reloaded, request.num_computed_tokens)
                self.num_swapped_in_blocks += len(sources)
                self.num_swap_ins += 1
            else:
                del self._host_hits[rid]
                self.num_reloaded_tokens += reloaded
                self.num_reloaded_blocks += len(sources)
        return new

    # -- swap preemption -------------------------------------------------------------------
    def should_swap(self, request: Request) -> bool:
        """Whether to preempt ``request`` by swap-out rather than by recompute."""
        n = -(-request.num_computed_tokens // self.block_size)
        if n == 0 or self.swap_policy is None or request.request_id not in self.req_blocks:
            return False
        if not self.swap_policy(n, request.num_computed_tokens):
            return False
        # Conservative room check: every block may need a fresh host block.
        return self.host.num_free_blocks >= n

    def swap_out(self, request: Request) -> None:
        """Copy the request's computed blocks to host and free its device blocks; its
        ``num_computed_tokens`` stays, and allocate_slots swaps it back in."""
        rid = request.request_id
        n = -(-request.num_computed_tokens // self.block_size)
        host_blocks: list[KVBlock] = []
        for block in self.req_blocks[rid][:n]:
            hb = None
            if block.block_hash is not None:
                hb = self.host.lookup(block.block_hash, block.hash_key)
            if hb is not None:
                self.host.touch([hb])  # already on host: share it
            else:
                hb = self.host.get_new_blocks(1)[0]
                if block.block_hash is not None:
                    self.host.cache_block(hb, block.block_hash, block.hash_key)
                self._transfers.add(OUT, block.block_id, hb.block_id)
                self.num_swapped_out_blocks += 1
                # A second reference pins it while the copy is pending, even if the
                # request is aborted before then.
                self.host.touch([hb])
                self._pinned.append(hb)
            host_blocks.append(hb)
        super().free(request)
        self._swapped[rid] = host_blocks
        self.num_swap_outs += 1

    def is_swapped(self, request_id: str) -> bool:
        return request_id in self._swapped

    def free(self, request: Request) -> None:
        super().free(request)
        rid = request.request_id
        self._host_hits.pop(rid, None)
        swapped = self._swapped.pop(rid, None)
        if swapped:
            self.host.free_blocks(reversed(swapped))

    # -- statistics -------------------------------------------------------------------------
    def counters(self) -> dict[str, int | float]:
        """The host tier's gauges and counters, named as ``EngineStats`` fields."""
        host = self.host
        return {
            "host_kv_cache_blocks": host.num_blocks,
            "host_kv_cache_usage": host.usage(),
            "host_kv_cache_cached_blocks": len(host.cached),
            "host_prefix_cache_hits": self.host_prefix_hits,
            "kv_blocks_spilled": self.num_spilled_blocks,
            "kv_spills_dropped": self.num_spills_dropped,
            "kv_blocks_reloaded": self.num_reloaded_blocks,
            "num_swap_outs": self.num_swap_outs,
            "num_swap_ins": self.num_swap_ins,
            "kv_blocks_swapped_out": self.num_swapped_out_blocks,
            "kv_blocks_swapped_in": self.num_swapped_in_blocks,
        }

    def close(self) -> None:
        if self.connector is not None:
            self.connector.close()

    # -- per step ---------------------------------------------------------------------------
    def take_transfers(self) -> KVTransfers | None:
        """The copies decided since the last call (executed before the next forward);
        releases the pins they held."""
        transfers, self._transfers = self._transfers, KVTransfers()
        pinned, self._pinned = self._pinned, []
        self.host.free_blocks(reversed(pinned))
        return transfers or None

    def check_invariants(self) -> None:
        """Both pools consistent, and every host reference accounted for by a swapped
        request or a pending copy (nothing leaked across tiers)."""
        self.pool.check_invariants()
        self.host.check_invariants()
        refs: dict[int, int] = {}
        for blocks in (*self._swapped.values(), self._pinned):
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for b in self.host.blocks:
            if b.ref_cnt != refs.get(b.block_id, 0):
                raise AssertionError(
                    f"host block {b.block_id}: ref_cnt {b.ref_cnt}, {refs.get(b.block_id, 0)} known holders"
                )
