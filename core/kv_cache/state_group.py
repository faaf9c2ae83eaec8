"""The recurrent-state KV cache group: a fixed number of pages per request.

A layer with a recurrent state (Gated DeltaNet, Mamba 2, a short convolution) keeps, per
request, its last few inputs (the convolution window) and a fixed-size state matrix,
whatever the number of tokens: nothing grows with the sequence.  In a model that mixes
such layers with attention (Qwen3.5, Qwen3-Next, Granite 4) they form KV cache groups of
their own (:func:`pagedserve.kv_cache.kv_groups.kv_cache_groups`) over the one shared
page pool: when a request starts, each state group takes ``pages`` pages from the pool
(enough for one layer's state in the page of its slot's key and value tensors; the model
reads and writes the state there, see ``pagedserve.models.recurrent``), and gives them
back when the request finishes or is preempted.  A page is a page: the split between
attention blocks and state pages follows the requests.

The state of a request is valid only for exactly its ``num_computed_tokens``: the first
chunk of a request starts from a zero state (the model zeroes it), later chunks and
decode steps continue it.  So preemption recomputes from scratch, ``n`` samples each run
their own prompt, and what would rewind or share a state (prefix-cache hits, speculative
drafts, a host-tier swap) is refused by ``config_rules.check_recurrent_state``.
"""

from __future__ import annotations

from pagedserve.kv_cache.block_pool import BlockPool, KVBlock
from pagedserve.request import Request

__all__ = ["StateGroupManager"]


class StateGroupManager:
    """One state group's pages per request, over a pool shared with other groups.

    The interface :class:`~pagedserve.kv_cache.kv_groups.GroupedKVCacheManager` calls on
    each group: ``plan_slots``/``commit_slots`` (paired check/act), ``cached_run``,
    ``trim``, ``free``, ``block_ids``, ``num_blocks_held``, ``req_blocks``.
    """

    def __init__(self, pool: BlockPool, pages: int) -> None:
        if pages < 1:
            raise ValueError(f"a recurrent-state group needs >= 1 page per request, got {pages}")
        self.pool = pool
        #: Pages each request holds while it runs.
        self.pages = pages
        self.req_blocks: dict[str, list[KVBlock]] = {}

    def num_blocks_held(self, request_id: str) -> int:
        return len(self.req_blocks.get(request_id, ()))

    def cached_run(self, request: Request, num_blocks: int) -> list[KVBlock | None]:
        """A state is never in the prefix cache: every block a miss."""
        return [None] * num_blocks

    def plan_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[KVBlock] | None = None
    ) -> tuple[int, int, int, list[KVBlock]]:
        """(pages to take, 0, 0, []): ``pages`` for a request that holds none, else none."""
        if computed_blocks:
            raise ValueError("a recurrent-state group has no prefix-cache hits to take")
        return (0 if request.request_id in self.req_blocks else self.pages), 0, 0, []

    def commit_slots(
        self, request: Request, num_new_tokens: int, plan: tuple[int, int, int, list[KVBlock]], touch: bool = True
    ) -> list[KVBlock]:
        needed = plan[0]
        if not needed:
            return []
        new = self.pool.get_new_blocks(needed)
        self.req_blocks[request.request_id] = new
        return new

    def trim(self, request: Request, num_tokens: int) -> None:
        """Nothing to give back: the pages hold the state, not tokens (no drafts run here)."""

    def free(self, request: Request) -> None:
        """Release a finished, aborted or preempted request's pages."""
        self.pool.free_blocks(reversed(self.req_blocks.pop(request.request_id, [])))

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]
