"""KV cache groups: one block table per group of layers with the same window.

Hybrid models (Gemma 2's alternating window / full attention, Gemma 3's 5 local : 1
global, Qwen2's ``max_window_layers``) mix layers that need every key with layers that
need only the last ``W``.  Their layers are split into groups of one attention type and
window (:func:`kv_cache_groups`), every group holding the same number of layers
(``group_size``; a type's last group may hold fewer, its missing layers are padding).

Memory: one shared pool of pages.  A page is ``block_size`` tokens of ``group_size``
layers, and the KV tensors are ``group_size`` per-layer tensors ("slots"); layer ``j`` of
every group uses slot ``j``.  So one block id means one page of whichever group
allocated it, each layer still sees an ordinary ``[num_blocks, block_size, heads,
head_dim]`` cache, and each request has one block table per group, which its layers get
through the attention metadata (:meth:`AttentionMetadata.for_layer`).  Windowed groups
free the blocks that slid out of their window; the full-attention group keeps them.
This is vLLM's scheme; it beats one pool per group because the split between groups
follows the requests (short prompts need about as many full as windowed blocks, long
generations mostly full ones) instead of a ratio fixed at start-up.

:class:`GroupedKVCacheManager` coordinates one :class:`KVCacheManager` per group over the
shared pool: allocation is all groups or none, and a prefix hit must be valid in every
group (see :meth:`GroupedKVCacheManager.get_computed_blocks`).

Layers with a recurrent state (window :data:`RECURRENT_STATE`: Gated DeltaNet, Mamba 1
and 2, short convolutions) form groups of their own whose requests hold a fixed number of
pages each, their state (:mod:`pagedserve.kv_cache.state_group`); those groups exist
whatever ``free_sliding_window_blocks`` says.  Their prefix-cache entries are checkpoints
of the state every ``state_checkpoint_interval`` blocks, and a prefix hit must end at
one.  Layers that keep nothing per request (window :data:`NO_KV_CACHE`: Nemotron-H's MLP
layers) are in no group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedserve.config_rules import NO_KV_CACHE, RECURRENT_STATE
from pagedserve.kv_cache.block_pool import BlockPool, KVBlock
from pagedserve.kv_cache.host_tier import IN, OUT, KVTransfers, SwapPolicy
from pagedserve.kv_cache.manager import KVCacheManager
from pagedserve.kv_cache.sliding_window import first_visible_block, max_blocks_held, uniform_window
from pagedserve.kv_cache.state_group import StateGroupManager, StateStep
from pagedserve.request import Request

__all__ = [
    "KVGroup",
    "kv_cache_groups",
    "layer_slots",
    "GroupedKVCacheManager",
    "grouped_blocks_for_one_request",
    "RECURRENT_STATE",
    "NO_KV_CACHE",
]

#: A layer's window: tokens it attends to (None: all), RECURRENT_STATE, or NO_KV_CACHE.
Window = int | str | None


@dataclass(frozen=True)
class KVGroup:
    """Layers (model-wide indices) that share one block table; ``window`` None: full
    attention, RECURRENT_STATE: a fixed number of state pages per request."""

    window: Window
    layers: tuple[int, ...]

    @property
    def is_state(self) -> bool:
        return self.window == RECURRENT_STATE


def kv_cache_groups(windows: Sequence[Window], free_slid_out: bool = True) -> list[KVGroup]:
    """The KV cache groups of a model whose layer ``i`` has window ``windows[i]``.

    One group of every layer when the layers share one window (or none), or when
    ``free_slid_out`` is off (every block is kept, one table serves all layers).
    Otherwise one group per type and window, split to ``group_size`` layers each: the
    fewest layers of a type, or the most when they differ by less than 25% (little
    padding), as vLLM chooses.  Full-attention groups come first, recurrent-state ones
    last; with ``free_slid_out`` off the attention layers of a model with recurrent
    layers are one full-attention type (every block kept).
    """
    # Layers that keep nothing per request (Nemotron-H's MLP layers) belong to no group.
    kept = [(i, w) for i, w in enumerate(windows) if w != NO_KV_CACHE]
    ws = [w for _, w in kept]
    every = tuple(i for i, _ in kept)
    if ws and all(w == RECURRENT_STATE for w in ws):
        return [KVGroup(RECURRENT_STATE, every)]
    if RECURRENT_STATE in ws and not free_slid_out:
        kept = [(i, w if w == RECURRENT_STATE else None) for i, w in kept]
        ws = [w for _, w in kept]
        free_slid_out = True
    if not free_slid_out or not ws or all(w == ws[0] for w in ws):
        window = uniform_window(ws) if free_slid_out else None
        return [KVGroup(window, every)]
    by_window: dict[Window, list[int]] = {}
    for i, w in kept:
        by_window.setdefault(w, []).append(i)
    sizes = [len(v) for v in by_window.values()]
    size = max(sizes) if max(sizes) < 1.25 * min(sizes) else min(sizes)
    order = sorted(by_window, key=lambda w: (w == RECURRENT_STATE, w is not None, 0 if isinstance(w, str) else w or 0))
    return [KVGroup(w, tuple(by_window[w][i : i + size])) for w in order for i in range(0, len(by_window[w]), size)]


def layer_slots(groups: Sequence[KVGroup], num_layers: int | None = None) -> tuple[list[int], list[int]]:
    """(group index, slot index) of each of ``num_layers`` model layers (None: the layers
    of ``groups``): the slot is the layer's place in its group, the KV tensor it shares
    with the same place of every other group.  A layer in no group (it keeps no KV) gets
    (0, 0), which it never reads."""
    n = sum(len(g.layers) for g in groups) if num_layers is None else num_layers
    group_of, slot_of = [0] * n, [0] * n
    for gi, g in enumerate(groups):
        for j, layer in enumerate(g.layers):
            group_of[layer], slot_of[layer] = gi, j
    return group_of, slot_of


def group_blocks_held(window: Window, num_tokens: int, block_size: int, max_step_tokens: int, state_pages: int) -> int:
    """Most pages one request of ``num_tokens`` tokens holds at once in a group of ``window``."""
    if window == RECURRENT_STATE:
        return state_pages
    return max_blocks_held(num_tokens, block_size, window, max_step_tokens)


def grouped_blocks_for_one_request(
    groups: Sequence[KVGroup], block_size: int, max_model_len: int, max_step_tokens: int, state_pages: int = 0
) -> int:
    """Pages a pool needs for one request of ``max_model_len`` tokens: each group's most
    blocks held at once (``state_pages`` in a recurrent-state group), plus the null block."""
    return 1 + sum(group_blocks_held(g.window, max_model_len, block_size, max_step_tokens, state_pages) for g in groups)


class GroupedKVCacheManager:
    """Block tables per KV cache group over one pool; the interface of KVCacheManager.

    ``block_ids`` gives one list per group (group order of :func:`kv_cache_groups`).
    ``state_pages``: pages per request of each recurrent-state group (and per checkpoint);
    ``state_checkpoint_interval``: blocks between the checkpoints of their states.

    ``num_host_blocks`` > 0: a host tier of that many pages for swap preemption
    (``swap_policy`` decides when it is cheaper than recompute).  A swap-out copies
    every page a request still reads, in every group (a windowed group's visible
    blocks, a state group's state pages), to host pages and frees them; allocate_slots
    swaps it back in to fresh device pages, each group's table rebuilt as before
    (leading null blocks where blocks slid out).  The host tier does not spill prefix
    cache blocks (evicted blocks and checkpoints are dropped, as without it).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        windows: Sequence[Window],
        state_pages: int = 0,
        state_checkpoint_interval: int = 4,
        num_host_blocks: int = 0,
        swap_policy: SwapPolicy | None = None,
        connector: object = None,
    ):
        if num_blocks < 2:
            raise ValueError(f"KV cache groups need >= 2 blocks (one is the null block), got {num_blocks}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        #: Not one window for every layer: see ``windows``.
        self.sliding_window = None
        self.windows = list(windows)
        self.pool = BlockPool(num_blocks - 1, enable_caching=enable_prefix_caching, on_evict=self._on_evict)
        self.null_block = KVBlock(num_blocks - 1, ref_cnt=1)
        self.state_pages = state_pages
        self.groups = [
            StateGroupManager(self.pool, state_pages, i, block_size, state_checkpoint_interval)
            if w == RECURRENT_STATE
            else KVCacheManager(
                num_blocks, block_size, enable_prefix_caching, w, shared=(self.pool, self.null_block, i)
            )
            for i, w in enumerate(self.windows)
        ]
        self.state_groups = [g for g in self.groups if isinstance(g, StateGroupManager)]
        self.peak_blocks_in_use = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.num_scheduled_tokens = 0
        self.host = BlockPool(num_host_blocks, enable_caching=False) if num_host_blocks > 0 else None
        #: The device-layout KV connector whose slots ``host`` indexes (host_tier.py), or None.
        self.connector = connector
        self.swap_policy = swap_policy
        self._transfers = KVTransfers()
        # Host pages a pending copy reads or writes: one reference each until taken.
        self._pinned: list[KVBlock] = []
        # Host copies of swapped-out requests (one reference each), per group.
        self._swapped: dict[str, list[list[KVBlock]]] = {}
        self.num_swap_outs = 0
        self.num_swap_ins = 0
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0
        self.num_swapped_in_tokens = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def counters(self) -> dict[str, int | float]:
        """Further gauges and counters, named as ``EngineStats`` fields (none without a host tier)."""
        if self.host is None:
            return {}
        return {
            "host_kv_cache_blocks": self.host.num_blocks,
            "host_kv_cache_usage": self.host.usage(),
            "num_swap_outs": self.num_swap_outs,
            "num_swap_ins": self.num_swap_ins,
            "kv_blocks_swapped_out": self.num_swapped_out_blocks,
            "kv_blocks_swapped_in": self.num_swapped_in_blocks,
        }

    @property
    def num_blocks_in_use(self) -> int:
        return self.pool.num_in_use

    @property
    def req_blocks(self) -> dict[str, list[list[KVBlock]]]:
        """Per request holding blocks: its block list in each group."""
        rids = dict.fromkeys(r for g in self.groups for r in g.req_blocks)
        return {r: [g.req_blocks.get(r, []) for g in self.groups] for r in rids}

    def num_blocks_held(self, request_id: str) -> int:
        return sum(g.num_blocks_held(request_id) for g in self.groups)

    def group_blocks_held(self, request_id: str) -> list[int]:
        return [g.num_blocks_held(request_id) for g in self.groups]

    def can_fit(self, num_tokens: int, max_step_tokens: int | None = None) -> bool:
        step = num_tokens if max_step_tokens is None else max_step_tokens
        need = sum(group_blocks_held(w, num_tokens, self.block_size, step, self.state_pages) for w in self.windows)
        return need <= self.pool.num_blocks

    # -- prefix caching -------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[list[KVBlock]], int]:
        """Per group the hits of a new request, and the tokens they hold.

        A hit of ``n`` blocks is valid when every full-attention group has all of the
        first ``n`` blocks cached, every windowed group has the blocks from the first
        one a query after them still sees (``first_visible_block(n * block_size)``) to
        the ``n``-th (vLLM's sliding-window hit rule), and every recurrent-state group
        has a checkpoint at the end of block ``n``; the longest ``n`` valid in every
        group wins.  A windowed group's entries before that point are the null block; a
        state group's hit is its checkpoint's pages.
        """
        empty: list[list[KVBlock]] = [[] for _ in self.groups]
        if not self.enable_prefix_caching:
            return empty, 0
        bs = self.block_size
        max_hit = (request.num_tokens - 1) // bs  # never the last token: its logits are needed
        runs = [g.cached_run(request, max_hit) for g in self.groups]
        # trailing[g][i]: cached blocks in a row ending at block i - 1 of group g.
        trailing = []
        for run in runs:
            t = [0] * (len(run) + 1)
            for i, b in enumerate(run):
                t[i + 1] = t[i] + 1 if b is not None else 0
            trailing.append(t)
        n = max_hit
        while n > 0:
            ok = True
            for w, t, run in zip(self.windows, trailing, runs):
                if w == RECURRENT_STATE:
                    if run[n - 1] is None:
                        ok = False
                        break
                    continue
                first = 0 if w is None else first_visible_block(n * bs, w, bs)
                if t[n] < n - first:
                    ok = False
                    break
            if ok:
                break
            n -= 1
        self.prefix_queries += request.num_tokens
        self.prefix_hits += n * bs
        if n == 0:
            return empty, 0
        out = []
        for w, run in zip(self.windows, runs):
            if w == RECURRENT_STATE:
                out.append(list(run[n - 1]))
                continue
            first = 0 if w is None else first_visible_block(n * bs, w, bs)
            out.append([self.null_block] * first + run[first:n])
        return out, n * bs

    def cached_prefix(self, token_ids: Sequence[int], num_blocks: int, cache_salt: str | None = None) -> list[int]:
        raise ValueError(
            "the disaggregated prefill/decode hand-off sends one block list per request; a model with "
            "KV cache groups (layers with different windows) has one per group: set "
            "free_sliding_window_blocks=False to hand off its KV"
        )

    adopt_prefix = cached_prefix

    # -- allocation -----------------------------------------------------------------------
    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[list[KVBlock]] | None = None
    ) -> list[KVBlock] | None:
        """Room for ``num_new_tokens`` more tokens in every group, or None (and nothing
        taken but the slid-out blocks freed) when the pool cannot supply all of them."""
        hits = computed_blocks or [[] for _ in self.groups]
        plans = [g.plan_slots(request, num_new_tokens, h) for g, h in zip(self.groups, hits)]
        if sum(p[0] for p in plans) > self.pool.num_free_blocks - sum(p[1] for p in plans):
            return None
        # Every group's hits leave the free queue before any group takes new blocks from
        # it: otherwise one group could evict (and reuse) a block another group hit.
        for p in plans:
            self.pool.touch(p[3])
        news = [g.commit_slots(request, num_new_tokens, p, touch=False) for g, p in zip(self.groups, plans)]
        swapped = self._swapped.pop(request.request_id, None)
        if swapped is not None:
            self._swap_in(request, swapped, news)
        new = [b for n in news for b in n]
        if self.enable_prefix_caching and self.state_groups:
            self._plan_checkpoints(request, num_new_tokens)
        self.num_scheduled_tokens += num_new_tokens
        self.peak_blocks_in_use = max(self.peak_blocks_in_use, self.pool.num_in_use)
        return new

    def _plan_checkpoints(self, request: Request, num_new_tokens: int) -> None:
        """Pages for the state checkpoints at the boundaries this step's tokens of
        ``request`` reach that some state group lacks, as long as the pool has them free
        (a checkpoint is an optimisation: without room, none is written)."""
        first = self.state_groups[0]
        for tokens, h in first.boundaries(request, num_new_tokens):
            missing = [g for g in self.state_groups if g.checkpoint(h) is None and not g.pending(h)]
            if not missing:
                continue
            if self.pool.num_free_blocks < self.state_pages * len(missing):
                return
            for g in missing:
                g.add_capture(request, tokens, h, self.pool.get_new_blocks(self.state_pages))

    def state_step(self, request: Request) -> StateStep | None:
        """The state-page work of ``request``'s chunk in the step being scheduled (call
        before its ``num_computed_tokens`` advance): checkpoint pages to copy into its
        own (a prefix hit), checkpoints to write."""
        if not self.state_groups:
            return None
        step = StateStep()
        # Keyed by (offset, its rank among the group's captures there): a checkpoint and
        # a draft position may want the state at the same offset.
        caps: dict[tuple[int, int], dict[int, tuple[int, ...]]] = {}
        for g in self.state_groups:
            src, captures = g.step_work(request)
            if src is not None:
                step.copy_from[g.group] = src
            seen: dict[int, int] = {}
            for offset, pages in captures:
                j = seen[offset] = seen.get(offset, -1) + 1
                caps.setdefault((offset, j), {})[g.group] = pages
        step.captures = [(offset, pages) for (offset, _), pages in sorted(caps.items())]
        return step if step.copy_from or step.captures else None

    def _on_evict(self, block: KVBlock) -> None:
        for g in self.state_groups:
            g.forget_siblings(block)

    def trim(self, request: Request, num_tokens: int) -> None:
        for g in self.groups:
            g.trim(request, num_tokens)

    def free(self, request: Request) -> None:
        for g in self.groups:
            g.free(request)
        swapped = self._swapped.pop(request.request_id, None)
        if swapped:
            self.host.free_blocks(reversed([b for blocks in swapped for b in blocks]))

    def block_ids(self, request_id: str) -> list[list[int]]:
        return [g.block_ids(request_id) for g in self.groups]

    # -- swap preemption (a host tier of num_host_blocks pages) ------------------------------
    def _live_blocks(self, request: Request) -> list[list[KVBlock]]:
        """Per group, the pages of ``request`` that its computed tokens still need: a
        token group's blocks from the first one a query still sees to the last computed
        one, a state group's state pages."""
        rid, done = request.request_id, request.num_computed_tokens
        n = -(-done // self.block_size)
        out = []
        for w, g in zip(self.windows, self.groups):
            blocks = g.req_blocks.get(rid, [])
            if w == RECURRENT_STATE:
                out.append(list(blocks))
                continue
            first = 0 if w is None else first_visible_block(done, w, self.block_size)
            live = blocks[first:n]
            if any(b is self.null_block for b in live):
                raise AssertionError(f"request {rid}: a visible block of window {w} was freed")
            out.append(live)
        return out

    def should_swap(self, request: Request) -> bool:
        """Whether to preempt ``request`` by swap-out rather than by recompute."""
        if self.host is None or self.swap_policy is None or request.num_computed_tokens == 0:
            return False
        if not any(request.request_id in g.req_blocks for g in self.groups):
            return False
        n = sum(len(b) for b in self._live_blocks(request))
        return self.swap_policy(n, request.num_computed_tokens) and self.host.num_free_blocks >= n

    def swap_out(self, request: Request) -> None:
        """Copy every group's live pages of ``request`` to host pages and free its device
        pages; its ``num_computed_tokens`` stays, and allocate_slots swaps it back in.
        (Only a request not scheduled in the current step is preempted, so it has no
        pending checkpoint work.)"""
        if self.host is None:
            raise NotImplementedError("swap preemption needs a host KV tier (kv_offload_memory)")
        host_blocks = []
        for blocks in self._live_blocks(request):
            hbs = self.host.get_new_blocks(len(blocks))
            for b, hb in zip(blocks, hbs):
                self._transfers.add(OUT, b.block_id, hb.block_id)
            # A second reference pins each while its copy is pending, even if the request
            # is aborted before then.
            self.host.touch(hbs)
            self._pinned.extend(hbs)
            self.num_swapped_out_blocks += len(hbs)
            host_blocks.append(hbs)
        for g in self.groups:
            g.free(request)
        self._swapped[request.request_id] = host_blocks
        self.num_swap_outs += 1

    def _swap_in(self, request: Request, swapped: list[list[KVBlock]], news: list[list[KVBlock]]) -> None:
        """Copy a swapped-out request's host pages into the first of the device pages
        each group just allocated for it (its table: leading null blocks, then these)."""
        for gi, (sources, new) in enumerate(zip(swapped, news)):
            if len(new) < len(sources):
                rid = request.request_id
                raise AssertionError(
                    f"request {rid}: group {gi}: {len(sources)} pages to swap in, {len(new)} allocated"
                )
            for src, dst in zip(sources, new):
                self._transfers.add(IN, src.block_id, dst.block_id)
            self._pinned.extend(sources)  # their reference is released once the copy is taken
            self.num_swapped_in_blocks += len(sources)
        self.num_swapped_in_tokens += request.num_computed_tokens
        self.num_swap_ins += 1

    def is_swapped(self, request_id: str) -> bool:
        return request_id in self._swapped

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block hash of the device pool (its blocks' contents are
        gone, e.g. in sleep mode); False, and nothing forgotten, while a block is in use."""
        return self.pool.reset_prefix_cache()

    def take_transfers(self) -> KVTransfers | None:
        """The step is handed out: its state checkpoints are cached and the pages held
        for it released (state_group.py, "Timing"); the host tier's copies decided since
        the last call (run before the next forward) are returned and their pins released."""
        for g in self.state_groups:
            g.end_step()
        transfers, self._transfers = self._transfers, KVTransfers()
        pinned, self._pinned = self._pinned, []
        if pinned:
            self.host.free_blocks(reversed(pinned))
        return transfers or None

    def flush_transfers(self):
        return self.take_transfers()

    def close(self) -> None:
        if self.connector is not None:
            self.connector.close()

    def check_invariants(self) -> None:
        """The device pool consistent; with a host tier, it too, and every host reference
        accounted for by a swapped-out request or a pending copy."""
        self.pool.check_invariants()
        if self.host is None:
            return
        self.host.check_invariants()
        refs: dict[int, int] = {}
        for b in [b for blocks in self._swapped.values() for bs in blocks for b in bs] + self._pinned:
            refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for b in self.host.blocks:
            if b.ref_cnt != refs.get(b.block_id, 0):
                raise AssertionError(
                    f"host page {b.block_id}: ref_cnt {b.ref_cnt}, {refs.get(b.block_id, 0)} known holders"
                )
