"""The recurrent-state KV cache group: a fixed number of pages per request, and state
checkpoints at block boundaries for prefix caching.

A layer with a recurrent state (Gated DeltaNet, Mamba 1 and 2, a short convolution)
keeps, per request, its last few inputs (the convolution window) and a fixed-size state
matrix, whatever the number of tokens: nothing grows with the sequence.  In a model that
mixes such layers with attention (Qwen3.5, Qwen3-Next, Granite 4, Nemotron-H, Jamba,
LFM2) they form KV cache groups of their own
(:func:`pagedserve.kv_cache.kv_groups.kv_cache_groups`) over the one shared page pool:
when a request starts, each state group takes ``pages`` pages from the pool (enough for
one layer's state in the page of its slot's key and value tensors; the model reads and
writes the state there, see ``pagedserve.models.recurrent``), and gives them back when
the request finishes or is preempted.  A page is a page: the split between attention
blocks and state pages follows the requests.

The state of a request is valid only for exactly its ``num_computed_tokens``: the first
chunk of a request starts from a zero state (the model zeroes it), later chunks and
decode steps continue it.

Prefix caching.  A state cannot be rewound, so a cached prefix needs the state *at* its
end.  Every ``interval`` blocks (``CacheConfig.state_checkpoint_interval``) a request
that computes across the boundary writes a checkpoint: a copy of its state there, in
``pages`` fresh pages of each state group, registered in the pool's prefix cache under
the boundary's block hash (the same chain as the attention blocks: parent hash, token
ids, cache salt, images), page ``j`` under ``(group, "state", j, hash)``.  A checkpoint
is immutable and unreferenced once written: reusable on a hit, evicted in LRU order like
any cached block (evicting one of its pages forgets its siblings too, see
:meth:`StateGroupManager.forget_siblings`).  A new request's hit is the longest prefix
of ``n`` blocks that every attention group has cached and every state group has a
checkpoint at (:meth:`GroupedKVCacheManager.get_computed_blocks`); its state groups copy
the checkpoint into the request's own pages before its first chunk, and the request goes
on from there in its own pages.  Boundaries are ``interval`` blocks apart (blocks of 16
tokens by default), so prompts a few blocks long hit too.

Capturing a boundary inside a chunk.  A chunk of prefill usually spans several
boundaries.  The scheduler does not cut chunks there (each cut would be one more step
through every layer); instead the step's metadata lists, per request, the offsets in its
chunk where a checkpoint is due, and each recurrent layer runs the part of it that
carries state (its convolution and scan) in segments that end at those offsets
(``models.recurrent.run_segmented``), on its state tensors (read from the pages once
and written back once), writing them into the checkpoint's pages after each segment.
The segments compute exactly what chunks ending there would (the layer's own
chunked-prefill path, which tests check against transformers), and only that part is
split: the projections, attention and MLP work of the step stays one batch.  A
boundary at the end of a chunk (every boundary a decode step crosses) costs one more
page write.

Speculative decoding.  A step that verifies ``k`` draft tokens of a request computes
its known token(s) and the drafts in one chunk, but the request keeps only the state
after its last accepted token.  So the chunk also captures the state after each of
its first ``k`` positions that may end the accepted run (offsets ``m .. m + k - 1`` of
a chunk of ``m`` known tokens), in ``k`` sets of ``pages`` fresh pages taken with the
step's slots (:meth:`StateGroupManager.commit_slots`); the layers write them like
checkpoints (``models.recurrent.run_segmented``).  When the drafts are verified,
:meth:`StateGroupManager.trim` hands the request the pages of the state at its
``num_computed_tokens`` (its own pages when every draft was accepted: they hold the
state at the chunk's end) and frees the rest, without copying a page.  Drafts are
optional: when the pool lacks those pages the scheduler drops them.

Timing.  Pages of a checkpoint are taken when its step is scheduled and written by that
step's forward; they are registered and their reference dropped when the scheduler hands
the step out (:meth:`StateGroupManager.end_step`, from ``take_transfers``), so that no
request scheduled in the same step can hit a checkpoint its forward has not written.  A
hit's checkpoint pages are referenced from the scheduling of its step until that step is
handed out: no later step's forward runs before the copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedserve.kv_cache.block_hash import BlockHash, extend_block_hashes
from pagedserve.kv_cache.block_pool import BlockPool, KVBlock
from pagedserve.request import Request

__all__ = ["StateGroupManager", "StateStep", "state_page_key"]


def state_page_key(group: int, page: int, h: BlockHash) -> BlockHash:
    """(hash, key) of page ``page`` of group ``group``'s checkpoint at the block of hash ``h``."""
    key = (group, "state", page, h[1])
    return hash((group, "state", page, h[0])), key


@dataclass
class StateStep:
    """One request's state-page work in one step, per recurrent-state group index:
    ``copy_from``: the checkpoint pages to copy into its own pages before its chunk (a
    prefix hit); ``captures``: (offset in its chunk, pages per group) where its state at
    that many tokens into the chunk is to be written."""

    copy_from: dict[int, tuple[int, ...]] = field(default_factory=dict)
    captures: list[tuple[int, dict[int, tuple[int, ...]]]] = field(default_factory=list)


class StateGroupManager:
    """One state group's pages per request, over a pool shared with other groups, and
    its checkpoints.

    The interface :class:`~pagedserve.kv_cache.kv_groups.GroupedKVCacheManager` calls on
    each group: ``plan_slots``/``commit_slots`` (paired check/act), ``cached_run``,
    ``trim``, ``free``, ``block_ids``, ``num_blocks_held``, ``req_blocks``.
    """

    def __init__(self, pool: BlockPool, pages: int, group: int = 0, block_size: int = 16, interval: int = 1) -> None:
        if pages < 1:
            raise ValueError(f"a recurrent-state group needs >= 1 page per request, got {pages}")
        if interval < 1:
            raise ValueError(f"a state checkpoint interval must be >= 1 block, got {interval}")
        self.pool = pool
        #: Pages each request holds while it runs (and each checkpoint holds).
        self.pages = pages
        #: This group's index among the manager's groups (keys its checkpoints apart).
        self.group = group
        self.block_size = block_size
        #: Blocks between checkpoints.
        self.interval = interval
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self._req_hashes: dict[str, list[BlockHash]] = {}
        # This step's work, until end_step: hits to copy (pages referenced), checkpoints
        # being written (pages held, with the hash they will be registered under).
        self._copy_from: dict[str, list[KVBlock]] = {}
        self._captures: dict[str, list[tuple[int, BlockHash, list[KVBlock]]]] = {}
        # Drafts being verified, until trim: (tokens computed after the position, the
        # pages that state is written into) for each position that may end the
        # accepted run but the chunk's last.
        self._spec: dict[str, list[tuple[int, list[KVBlock]]]] = {}
        #: Checkpoints written so far (for measurements).
        self.num_checkpoints = 0

    def num_blocks_held(self, request_id: str) -> int:
        return len(self.req_blocks.get(request_id, ()))

    # -- checkpoints ------------------------------------------------------------------------
    def block_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """The request's chain of block hashes, at least ``num_blocks`` long."""
        hashes = self._req_hashes.setdefault(request.request_id, [])
        return extend_block_hashes(
            hashes, request.all_token_ids, self.block_size, num_blocks, request.cache_salt, request.mm_spans
        )

    def checkpoint(self, h: BlockHash) -> list[KVBlock] | None:
        """The pages of the cached checkpoint at the end of the block of hash ``h``, or None."""
        out = []
        for j in range(self.pages):
            block = self.pool.lookup(*state_page_key(self.group, j, h))
            if block is None:
                return None
            out.append(block)
        return out

    def cached_run(self, request: Request, num_blocks: int) -> list[list[KVBlock] | None]:
        """Per block ``i`` of the request's first ``num_blocks`` full blocks: the
        checkpoint at its end (a boundary every ``interval`` blocks), or None."""
        hashes = self.block_hashes(request, num_blocks)
        run: list[list[KVBlock] | None] = [None] * num_blocks
        for i in range(self.interval - 1, num_blocks, self.interval):
            run[i] = self.checkpoint(hashes[i])
        return run

    def boundaries(self, request: Request, num_new_tokens: int) -> list[tuple[int, BlockHash]]:
        """(tokens, block hash) of each checkpoint boundary the request's next
        ``num_new_tokens`` tokens reach, after its computed ones (known tokens only)."""
        start = request.num_computed_tokens
        end = min(start + num_new_tokens, request.num_tokens)
        step = self.interval * self.block_size
        bounds = range((start // step + 1) * step, end + 1, step)
        if not bounds:
            return []
        hashes = self.block_hashes(request, bounds[-1] // self.block_size)
        return [(b, hashes[b // self.block_size - 1]) for b in bounds]

    def add_capture(self, request: Request, tokens: int, h: BlockHash, pages: list[KVBlock]) -> None:
        """Write the request's state at ``tokens`` computed tokens into ``pages`` (taken
        from the pool by the caller) this step, and cache them under ``h`` afterwards."""
        self._captures.setdefault(request.request_id, []).append((tokens, h, pages))

    def pending(self, h: BlockHash) -> bool:
        """Whether a checkpoint at ``h`` is being written this step."""
        return any(c[1][0] == h[0] and c[1][1] == h[1] for caps in self._captures.values() for c in caps)

    def step_work(self, request: Request) -> tuple[tuple[int, ...] | None, list[tuple[int, tuple[int, ...]]]]:
        """(pages to copy from, [(offset in the chunk, pages to write)]) of ``request`` this step."""
        src = self._copy_from.get(request.request_id)
        caps = [
            (tokens - request.num_computed_tokens, tuple(b.block_id for b in pages))
            for tokens, _, pages in self._captures.get(request.request_id, ())
        ]
        caps += [
            (tokens - request.num_computed_tokens, tuple(b.block_id for b in pages))
            for tokens, pages in self._spec.get(request.request_id, ())
        ]
        return (tuple(b.block_id for b in src) if src else None), caps

    def end_step(self) -> None:
        """The step is handed out: cache the checkpoints it writes (first writer wins)
        and drop the references held for it (hits' and new checkpoints' pages)."""
        for caps in self._captures.values():
            for _, h, pages in caps:
                for j, block in enumerate(pages):
                    self.pool.cache_block(block, *state_page_key(self.group, j, h))
                if all(b.block_hash is not None for b in pages):
                    self.num_checkpoints += 1
                self.pool.free_blocks(reversed(pages))
        for pages in self._copy_from.values():
            self.pool.free_blocks(reversed(pages))
        self._captures.clear()
        self._copy_from.clear()

    def forget_siblings(self, block: KVBlock) -> None:
        """``block``, a page of a checkpoint, is being evicted: forget the checkpoint's
        other pages too (they stay free), since a checkpoint missing a page is no hit."""
        key = block.hash_key
        if not (isinstance(key, tuple) and len(key) == 4 and key[0] == self.group and key[1] == "state"):
            return
        h = (hash(key[3]), key[3])
        for j in range(self.pages):
            if j == key[2]:
                continue
            sib = self.pool.lookup(*state_page_key(self.group, j, h))
            if sib is not None and sib.ref_cnt == 0:
                self.pool.uncache(sib)

    # -- allocation -----------------------------------------------------------------------
    def plan_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[KVBlock] | None = None
    ) -> tuple[int, int, int, list[KVBlock]]:
        """(pages to take, free-queue pages the hit revives, 0, the hit's checkpoint pages):
        ``pages`` for a request that holds none, else none; plus ``pages`` for each draft
        token the chunk verifies (the states it may end at, see "Speculative decoding")."""
        hit = list(computed_blocks or [])
        if hit and request.request_id in self.req_blocks:
            raise ValueError("a running request has no prefix-cache hit to take")
        needed = 0 if request.request_id in self.req_blocks else self.pages
        needed += self.pages * _num_drafts(request, num_new_tokens)
        return needed, sum(1 for b in hit if b.ref_cnt == 0), 0, hit

    def commit_slots(
        self, request: Request, num_new_tokens: int, plan: tuple[int, int, int, list[KVBlock]], touch: bool = True
    ) -> list[KVBlock]:
        needed, _, _, hit = plan
        if hit:
            if touch:
                self.pool.touch(hit)
            self._copy_from[request.request_id] = hit  # referenced until end_step
        if not needed:
            return []
        rid = request.request_id
        if rid in self._spec:
            raise ValueError(f"request {rid}: drafts of an earlier step are still unverified")
        new = self.pool.get_new_blocks(needed)
        k = _num_drafts(request, num_new_tokens)
        if rid not in self.req_blocks:
            self.req_blocks[rid] = new[: self.pages]
        if k:
            # The state after the chunk's known tokens and a drafts, for a < k; the
            # request's own pages get the state after the whole chunk (all accepted).
            first = request.num_computed_tokens + num_new_tokens - k
            spec = new[len(new) - k * self.pages :]
            self._spec[rid] = [(first + a, spec[a * self.pages : (a + 1) * self.pages]) for a in range(k)]
        return new

    def trim(self, request: Request, num_tokens: int) -> None:
        """The drafts of the request's chunk are verified, it has ``num_tokens`` computed
        tokens and its accepted drafts are appended to its tokens: it keeps the pages
        that hold its state there (the chunk's capture at that position, or its own
        pages when every draft was accepted) and the others are freed; the state at a
        checkpoint boundary an accepted draft crossed (before the last one) is cached as
        that boundary's checkpoint."""
        spec = self._spec.pop(request.request_id, None)
        if spec is None:
            return
        rid = request.request_id
        free: list[KVBlock] = []
        kept = False
        step = self.interval * self.block_size
        for tokens, pages in spec:
            if tokens == num_tokens:
                free += self.req_blocks[rid]
                self.req_blocks[rid] = pages
                kept = True
                continue
            if tokens < num_tokens and tokens % step == 0 and self.pool.enable_caching:
                # An accepted draft crossed a checkpoint boundary: its state there is a checkpoint.
                h = self.block_hashes(request, tokens // self.block_size)[tokens // self.block_size - 1]
                if self.checkpoint(h) is None:
                    for j, block in enumerate(pages):
                        self.pool.cache_block(block, *state_page_key(self.group, j, h))
                    self.num_checkpoints += all(b.block_hash is not None for b in pages)
            free += pages
        if not kept and num_tokens != spec[-1][0] + 1:
            raise AssertionError(
                f"request {rid}: no state captured at {num_tokens} tokens (drafts verified from {spec[0][0]})"
            )
        self.pool.free_blocks(reversed(free))

    def free(self, request: Request) -> None:
        """Release a finished, aborted or preempted request's pages (and the checkpoints
        it was to write this step, never cached: its forward may not run)."""
        rid = request.request_id
        self.pool.free_blocks(reversed(self.req_blocks.pop(rid, [])))
        for _, pages in self._spec.pop(rid, []):
            self.pool.free_blocks(reversed(pages))
        for _, _, pages in self._captures.pop(rid, []):
            self.pool.free_blocks(reversed(pages))
        hit = self._copy_from.pop(rid, None)
        if hit:
            self.pool.free_blocks(reversed(hit))
        if request.is_finished:
            self._req_hashes.pop(rid, None)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]


def _num_drafts(request: Request, num_new_tokens: int) -> int:
    """Draft tokens among the ``num_new_tokens`` scheduled of ``request`` (the scheduler
    schedules a request's drafts whole, after all of its known tokens)."""
    known = request.num_tokens - request.num_computed_tokens
    return max(0, min(len(request.spec_token_ids), num_new_tokens - known))
