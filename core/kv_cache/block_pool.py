"""BlockPool: reference-counted KV blocks, an LRU free queue and the prefix-cache map.

A block is in exactly one of three states:
    free        ref_cnt == 0, no hash            (in the free queue)
    cached      ref_cnt == 0, has a hash         (in the free queue AND the cache map;
                                                 reusable on a hit, evictable in LRU order)
    in use      ref_cnt > 0                      (owned by one or more requests)
The free queue is a doubly linked list so a cached block can leave its middle in O(1)
when a prefix hit revives it; new blocks are taken from its head (least recently freed).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

__all__ = ["KVBlock", "BlockPool", "FreeBlockQueue"]


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    #: Chained hash of (parent hash, token ids, extra keys); None while not cached.
    block_hash: int | None = None
    #: What the hash covers, kept to confirm a hit (hash values can collide).
    hash_key: tuple | None = field(default=None, repr=False)
    prev: KVBlock | None = field(default=None, repr=False)
    next: KVBlock | None = field(default=None, repr=False)
    in_free_queue: bool = False


class FreeBlockQueue:
    """Doubly linked list of blocks with ref_cnt == 0; head = next to evict."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self.head: KVBlock | None = None
        self.tail: KVBlock | None = None
        self.size = 0
        for b in blocks:
            self.append(b)

    def append(self, block: KVBlock) -> None:
        block.prev, block.next = self.tail, None
        if self.tail is None:
            self.head = block
        else:
            self.tail.next = block
        self.tail = block
        block.in_free_queue = True
        self.size += 1

    def remove(self, block: KVBlock) -> None:
        if block.prev is None:
            self.head = block.next
        else:
            block.prev.next = block.next
        if block.next is None:
            self.tail = block.prev
        else:
            block.next.prev = block.prev
        block.prev = block.next = None
        block.in_free_queue = False
        self.size -= 1

    def popleft(self) -> KVBlock:
        block = self.head
        if block is None:
            raise RuntimeError("no free KV blocks")
        self.remove(block)
        return block

    def __iter__(self):
        b = self.head
        while b is not None:
            yield b
            b = b.next


class BlockPool:
    """All KV blocks of one engine and the map from block hash to cached block."""

    def __init__(
        self, num_blocks: int, enable_caching: bool = True, on_evict: Callable[[KVBlock], None] | None = None
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[int, KVBlock] = {}
        self.num_evictions = 0
        #: Called with a cached block just before eviction forgets its hash (a host
        #: tier spills the block's KV there).
        self.on_evict = on_evict

    # -- queries ----------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now: truly free plus cached-but-unreferenced."""
        return self.free_queue.size

    @property
    def num_cached_unreferenced(self) -> int:
        return sum(1 for b in self.cached.values() if b.ref_cnt == 0)

    @property
    def num_in_use(self) -> int:
        return self.num_blocks - self.free_queue.size

    def usage(self) -> float:
        """Fraction of blocks referenced by requests."""
        return self.num_in_use / self.num_blocks

    def lookup(self, block_hash: int, hash_key: tuple) -> KVBlock | None:
        """The cached block for this hash, if its key really matches."""
        block = self.cached.get(block_hash)
        if block is None or block.hash_key != hash_key:
            return None
        return block

    # -- state changes ------------------------------------------------------------------
    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take ``n`` blocks from the head of the free queue (evicting cached ones)."""
        if n > self.free_queue.size:
            raise RuntimeError(f"asked for {n} KV blocks, only {self.free_queue.size} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                if self.on_evict is not None:
                    self.on_evict(block)
                self._uncache(block)
                self.num_evictions += 1
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on blocks found through a prefix hit."""
        for block in blocks:
            if block.ref_cnt == 0 and block.in_free_queue:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; callers pass chain tails first so
        that, among cached blocks, tails are evicted before the prefixes they extend."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise RuntimeError(f"KV block {block.block_id} freed more often than taken")
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_block(self, block: KVBlock, block_hash: int, hash_key: tuple) -> None:
        """Register a full block under its hash (first writer wins on duplicates)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            return
        block.block_hash = block_hash
        block.hash_key = hash_key
        self.cached[block_hash] = block

    def uncache(self, block: KVBlock) -> None:
        """Forget an unreferenced block's hash (it stays free, no longer a hit)."""
        if block.ref_cnt:
            raise RuntimeError(f"KV block {block.block_id} is in use: its hash cannot be forgotten")
        self._uncache(block)

    def _uncache(self, block: KVBlock) -> None:
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.block_hash = None
        block.hash_key = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use."""
        if self.num_in_use:
            return False
        for block in list(self.cached.values()):
            self._uncache(block)
        return True

    def check_invariants(self) -> None:
        """free + cached-unreferenced + in-use == total, and the queue holds exactly
        the blocks with ref_cnt == 0."""
        in_queue = set(id(b) for b in self.free_queue)
        zero = {id(b) for b in self.blocks if b.ref_cnt == 0}
        if in_queue != zero:
            raise AssertionError("free queue does not hold exactly the unreferenced blocks")
        free_uncached = sum(1 for b in self.blocks if b.ref_cnt == 0 and b.block_hash is None)
        total = free_uncached + self.num_cached_unreferenced + self.num_in_use
        if total != self.num_blocks:
            raise AssertionError(f"block accounting broken: {total} != {self.num_blocks}")
