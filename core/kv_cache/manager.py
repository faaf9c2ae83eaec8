"""KVCacheManager: per-request block tables on top of the BlockPool, with prefix caching.

Prefix caching: each *full* block of a request's tokens gets a chained hash over
(parent block's hash, the block's token ids, extra keys such as a cache salt).  A new
request walks its block hashes and reuses every leading block already cached; the hit
is confirmed by comparing the stored key, not only the hash.  The last prompt token is
always recomputed so that the model produces logits to sample from.

Sliding windows: with ``sliding_window`` set (every layer's window), the blocks of a
request that slid out of the window are freed before each allocation and their table
entries point at a reserved null block (the last block id, never allocated nor written);
see :mod:`pagedserve.kv_cache.sliding_window`.  Freed full blocks stay in the prefix
cache (evictable, like any unreferenced cached block).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pagedserve.kv_cache.block_hash import BlockHash, block_hashes, extend_block_hashes, hash_block
from pagedserve.kv_cache.block_pool import BlockPool, KVBlock
from pagedserve.kv_cache.sliding_window import first_visible_block, max_blocks_held
from pagedserve.request import Request

__all__ = ["KVCacheManager", "hash_block"]


class KVCacheManager:
    """Allocates KV blocks to requests; paired check/act via ``allocate_slots`` returning None."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        sliding_window: int | None = None,
        shared: tuple[BlockPool, KVBlock, int] | None = None,
        on_evict: Callable[[KVBlock], None] | None = None,
    ) -> None:
        """``shared``: (pool, null block, group index) when this manages one group of
        layers over a pool that several groups share (see kv_groups.py); the group index
        keys its prefix-cache entries apart from the other groups' ones.  ``on_evict``:
        see `BlockPool` (a pool of its own only)."""
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        if sliding_window is not None and (sliding_window < 1 or num_blocks < 2):
            raise ValueError(f"sliding_window={sliding_window} needs a window >= 1 and >= 2 blocks, got {num_blocks}")
        #: Every layer's window (None: keep every block of a running request).
        self.sliding_window = sliding_window
        # With a window the last block id is the null block that slid-out table entries
        # point at: outside the pool, so never allocated and never written.
        self._group: int | None = None
        if shared is not None:
            self.pool, self.null_block, self._group = shared
        else:
            pool_blocks = num_blocks - 1 if sliding_window is not None else num_blocks
            self.pool = BlockPool(pool_blocks, enable_caching=enable_prefix_caching, on_evict=on_evict)
            self.null_block: KVBlock | None = KVBlock(pool_blocks, ref_cnt=1) if sliding_window is not None else None
        #: Peak of blocks referenced by requests (pool.num_in_use), for measurements.
        self.peak_blocks_in_use = 0
        self.req_blocks: dict[str, list[KVBlock]] = {}
        # Leading table entries of each request that point at the null block.
        self._num_slid_out: dict[str, int] = {}
        # Hashes of the request's full blocks computed so far, and how many of its
        # blocks are registered in the cache.
        self._req_hashes: dict[str, list[BlockHash]] = {}
        self._num_cached: dict[str, int] = {}
        # Prefix-cache statistics (in tokens) for metrics.
        self.prefix_queries = 0
        self.prefix_hits = 0
        #: Tokens handed to the model (computed or recomputed), to measure reuse.
        self.num_scheduled_tokens = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def counters(self) -> dict[str, int | float]:
        """Further gauges and counters, named as ``EngineStats`` fields (none without a host tier)."""
        return {}

    # -- hashing --------------------------------------------------------------------------
    def _block_hashes(self, request: Request, num_tokens: int) -> list[BlockHash]:
        """Hashes of the request's full blocks within its first ``num_tokens`` tokens."""
        hashes = self._req_hashes.setdefault(request.request_id, [])
        # May hold more hashes than asked for (computed earlier for a longer span).
        return extend_block_hashes(
            hashes,
            request.all_token_ids,
            self.block_size,
            num_tokens // self.block_size,
            request.cache_salt,
            request.mm_spans,
        )

    def _lookup(self, h: BlockHash) -> KVBlock | None:
        if self._group is None:
            return self.pool.lookup(*h)
        return self.pool.lookup(hash((self._group, h[0])), (self._group, h[1]))

    def _register(self, block: KVBlock, h: BlockHash) -> None:
        if self._group is None:
            self.pool.cache_block(block, *h)
        else:
            self.pool.cache_block(block, hash((self._group, h[0])), (self._group, h[1]))

    def cached_run(self, request: Request, num_blocks: int) -> list[KVBlock | None]:
        """This group's cached block (None: a miss) for each of the request's first
        ``num_blocks`` full blocks."""
        return [self._lookup(h) for h in self._block_hashes(request, num_blocks * self.block_size)[:num_blocks]]

    # -- allocation -----------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Leading cached blocks of a new request and the number of tokens they hold."""
        if not self.enable_prefix_caching:
            return [], 0
        # Never the last token: its logits are needed.
        max_hit_tokens = request.num_tokens - 1
        hashes = self._block_hashes(request, max_hit_tokens)[: max_hit_tokens // self.block_size]
        blocks: list[KVBlock] = []
        for h in hashes:
            block = self._lookup(h)
            if block is None:
                break
            blocks.append(block)
        self.prefix_queries += request.num_tokens
        self.prefix_hits += len(blocks) * self.block_size
        return blocks, len(blocks) * self.block_size

    # -- hand-off of cached blocks between engines (disaggregated prefill/decode) ----------
    def cached_prefix(self, token_ids: Sequence[int], num_blocks: int, cache_salt: str | None = None) -> list[int]:
        """Block ids of the leading cached full blocks of ``token_ids`` (keyed by
        ``cache_salt``, as a request's are), at most ``num_blocks``; stops at the first
        block not cached."""
        ids = []
        for h, key in block_hashes(token_ids, self.block_size, num_blocks, cache_salt):
            block = self.pool.lookup(h, key)
            if block is None:
                break
            ids.append(block.block_id)
        return ids

    def adopt_prefix(
        self, token_ids: Sequence[int], num_blocks: int, cache_salt: str | None = None
    ) -> tuple[list[int], list[int]]:
        """Register free blocks in the prefix cache for the first ``num_blocks`` full
        blocks of ``token_ids`` (keyed by ``cache_salt``) that are not cached yet, as many
        as the free blocks allow: returns (their indices in the prompt, their block ids).

        The blocks stay unreferenced (evictable, tails first); their KV must be written
        before the next step can look them up.
        """
        hashes = block_hashes(token_ids, self.block_size, num_blocks, cache_salt)
        todo = [i for i, (h, key) in enumerate(hashes) if self.pool.lookup(h, key) is None]
        todo = todo[: max(0, self.pool.num_free_blocks)]
        if not todo:
            return [], []
        blocks = self.pool.get_new_blocks(len(todo))
        for block, i in zip(blocks, todo):
            self.pool.cache_block(block, *hashes[i])
        self.pool.free_blocks(reversed(blocks))
        return todo, [b.block_id for b in blocks]

    def can_fit(self, num_tokens: int, max_step_tokens: int | None = None) -> bool:
        """Whether a request of ``num_tokens`` could ever fit in an empty pool when no step
        computes more than ``max_step_tokens`` of its tokens (None: all at once)."""
        step = num_tokens if max_step_tokens is None else max_step_tokens
        return max_blocks_held(num_tokens, self.block_size, self.sliding_window, step) <= self.pool.num_blocks

    def num_blocks_held(self, request_id: str) -> int:
        """Pool blocks ``request_id`` references now (slid-out entries excluded)."""
        return sum(1 for b in self.req_blocks.get(request_id, ()) if b is not self.null_block)

    @property
    def num_blocks_in_use(self) -> int:
        """Pool blocks referenced by any request now."""
        return self.pool.num_in_use

    def _free_slid_out(self, request: Request, blocks: list[KVBlock]) -> int:
        """Free ``request``'s blocks that no query of its next step can see (pointing
        their entries at the null block); returns how many leading entries are null."""
        rid = request.request_id
        done = self._num_slid_out.get(rid, 0)
        if self.sliding_window is None:
            return done
        first = min(first_visible_block(request.num_computed_tokens, self.sliding_window, self.block_size), len(blocks))
        if first <= done:
            return done
        if self.enable_prefix_caching:
            # Register them first so that later prompts can still hit them until evicted.
            self._cache_full_blocks(request, blocks, request.num_computed_tokens)
        stale = blocks[done:first]
        blocks[done:first] = [self.null_block] * len(stale)
        self.pool.free_blocks(reversed(stale))
        self._num_slid_out[rid] = first
        return first

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[KVBlock] | None = None
    ) -> list[KVBlock] | None:
        """Make room for ``num_new_tokens`` more tokens of ``request``.

        ``computed_blocks`` are prefix-cache hits of a request scheduled for the first
        time (its ``num_computed_tokens`` must already count them).  Returns the newly
        allocated blocks, or None when the pool cannot supply them (changing nothing but
        the freeing of blocks that slid out of the window, which holds either way).
        """
        plan = self.plan_slots(request, num_new_tokens, computed_blocks)
        needed, revived = plan[0], plan[1]
        if needed > self.pool.num_free_blocks - revived:
            return None
        return self.commit_slots(request, num_new_tokens, plan)

    def plan_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[KVBlock] | None = None
    ) -> tuple[int, int, int, list[KVBlock]]:
        """(blocks to allocate, free-queue blocks that hits revive, leading null entries,
        the hits to take) for :meth:`allocate_slots`; frees the blocks that slid out."""
        computed_blocks = computed_blocks or []
        owned = self.req_blocks.get(request.request_id, [])
        lead = 0
        if owned:
            self._free_slid_out(request, owned)
        elif self.sliding_window is not None:
            # A (re)started request: hits and positions that already slid out are not taken.
            lead = first_visible_block(request.num_computed_tokens, self.sliding_window, self.block_size)
            computed_blocks = computed_blocks[lead:]
        total_tokens = request.num_computed_tokens + num_new_tokens
        needed = -(-total_tokens // self.block_size) - len(owned) - lead - len(computed_blocks)
        # Hits on unreferenced cached blocks take them out of the free queue.
        revived = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        return max(needed, 0), revived, lead, computed_blocks

    def commit_slots(
        self, request: Request, num_new_tokens: int, plan: tuple[int, int, int, list[KVBlock]], touch: bool = True
    ) -> list[KVBlock]:
        """Take the blocks :meth:`plan_slots` counted (the pool must have them); ``touch``
        False: the caller already took the hits out of the free queue."""
        needed, _, lead, computed_blocks = plan
        rid = request.request_id
        if touch:
            self.pool.touch(computed_blocks)
        new_blocks = self.pool.get_new_blocks(needed)
        blocks = self.req_blocks.setdefault(rid, [])
        if lead:
            blocks.extend([self.null_block] * lead)
            self._num_slid_out[rid] = lead
        blocks.extend(computed_blocks)
        blocks.extend(new_blocks)
        total_tokens = request.num_computed_tokens + num_new_tokens
        if self.enable_prefix_caching:
            self._cache_full_blocks(request, blocks, total_tokens)
        self.num_scheduled_tokens += num_new_tokens
        self.peak_blocks_in_use = max(self.peak_blocks_in_use, self.pool.num_in_use)
        return new_blocks

    def _cache_full_blocks(self, request: Request, blocks: list[KVBlock], num_tokens: int) -> None:
        # Tokens up to num_tokens are known now (prompt or sampled); their KV is
        # written by this step's forward, before any later lookup can see the hash.
        num_tokens = min(num_tokens, request.num_tokens)
        num_full = num_tokens // self.block_size
        hashes = self._block_hashes(request, num_tokens)
        start = self._num_cached.get(request.request_id, 0)
        for i in range(start, num_full):
            if blocks[i] is not self.null_block:  # a slid-out entry never registered stays a miss
                self._register(blocks[i], hashes[i])
        self._num_cached[request.request_id] = max(start, num_full)

    def trim(self, request: Request, num_tokens: int) -> None:
        """Free the request's blocks past its first ``num_tokens`` tokens (tail first):
        the slots of rejected draft tokens.  Those blocks never hold verified tokens, so
        none of them is in the prefix cache."""
        blocks = self.req_blocks.get(request.request_id)
        keep = -(-num_tokens // self.block_size)
        if not blocks or len(blocks) <= keep:
            return
        tail = [b for b in blocks[keep:] if b is not self.null_block]
        del blocks[keep:]
        self.pool.free_blocks(reversed(tail))

    def free(self, request: Request) -> None:
        """Release a finished, aborted or preempted request's blocks (tail first)."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self.pool.free_blocks(b for b in reversed(blocks) if b is not self.null_block)
        self._num_cached.pop(request.request_id, None)
        self._num_slid_out.pop(request.request_id, None)
        if request.is_finished:
            self._req_hashes.pop(request.request_id, None)

    # -- tiers (a manager with a host tier overrides these; see host_tier.py) ----------------
    def should_swap(self, request: Request) -> bool:
        """Whether to preempt ``request`` by swapping it out; never without a host tier."""
        return False

    def swap_out(self, request: Request) -> None:
        raise NotImplementedError("swap preemption needs a host KV tier (kv_offload_memory)")

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block hash of the device pool (its blocks' contents are
        gone, e.g. in sleep mode); False, and nothing forgotten, while a block is in use."""
        return self.pool.reset_prefix_cache()

    def state_step(self, request: Request) -> None:
        """Recurrent-state work of ``request`` this step (kv_groups.py): none here."""
        return None

    def take_transfers(self):
        """Block copies to run before the next forward (None: no host tier, no copies)."""
        return None

    def close(self) -> None:
        """Release what the manager holds outside the process (a KV connector's store)."""

    def flush_transfers(self):
        """With no step scheduled (every forward has run): every pending copy."""
        return self.take_transfers()

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]
