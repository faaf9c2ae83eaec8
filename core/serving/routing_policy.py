"""Where a data-parallel router sends a request: load first, prefix-cache affinity when it pays.

    policy = RoutingPolicy(block_size=16)
    hashes = policy.prefix_hashes(prompt_token_ids)
    choice = policy.choose(hashes, [ReplicaLoad(0, num_seqs=3, kv_usage=0.2), ReplicaLoad(1, 1, 0.1)])
    policy.record(hashes, choice.replica)

Pure: no processes, no clocks, no I/O.  The router builds a `ReplicaLoad` per replica
from its own bookkeeping and the replicas' reported statistics, and asks.

Load.  A replica's score is ``num_seqs + kv_weight * kv_usage``: the sequences it holds
(waiting + running, counted by the router, so requests still in transit count too) plus
a penalty for a full KV cache (a replica near 1.0 will queue or preempt new work).
Join-the-shortest-queue adapts to replicas of different speed without knowing their
speed: a fast replica (a GPU beside CPU replicas) finishes sooner, holds fewer
sequences, and so receives more requests.  Ties go to the replica that was sent the
fewest requests so far, so an idle server still spreads its traffic.

Affinity.  A prompt's full blocks are hashed as a chain (each hash covers the block and
every block before it, with the engines' prefix-cache hash,
:mod:`pagedserve.kv_cache.block_hash`).  After each routing decision
every hash of the prompt is remembered with the chosen replica (a bounded LRU map).  A
new prompt is looked up deepest block first: the replica that last served its longest
known prefix holds those blocks in its prefix cache (unless evicted since), and is
preferred when its score is within ``margin`` of the least-loaded replica's.  Past that
margin, waiting in a longer queue costs more than recomputing the prefix, so load wins.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from pagedserve.kv_cache.block_hash import block_hashes

__all__ = ["ReplicaLoad", "RoutingChoice", "RoutingPolicy", "NoReplicaAvailable"]


class NoReplicaAvailable(RuntimeError):
    """Every replica is dead or refuses new requests (full waiting queue)."""


@dataclass(frozen=True)
class ReplicaLoad:
    """What the policy knows of one replica at decision time.

    num_seqs: sequences sent to it and not finished (waiting + running + in transit).
    kv_usage: fraction of its KV-cache blocks in use, from its last report (0..1).
    routed: requests sent to it so far (tie-breaker).
    available: alive and accepting requests.
    """

    index: int
    num_seqs: int
    kv_usage: float = 0.0
    routed: int = 0
    available: bool = True


@dataclass(frozen=True)
class RoutingChoice:
    replica: int
    reason: str  # "affinity" or "load"
    matched_blocks: int = 0  # full prompt blocks the chosen replica served last (affinity)


class RoutingPolicy:
    """Least-loaded routing with prefix-cache affinity.

    Args:
        block_size: tokens per KV block (the replicas' ``block_size``).
        margin: how much higher (in score units, about one sequence each) the affinity
            replica's score may be than the least-loaded one's and still win.
        kv_weight: score added by a completely full KV cache.
        min_blocks: shortest known prefix, in full blocks, that earns affinity.
        max_blocks: prompt blocks hashed (the affinity key covers at most this prefix).
        capacity: prefix hashes remembered (least recently used are dropped).
        enable_affinity: False routes by load only (e.g. without prefix caching).
    """

    def __init__(
        self,
        block_size: int,
        margin: float = 4.0,
        kv_weight: float = 4.0,
        min_blocks: int = 1,
        max_blocks: int = 64,
        capacity: int = 65536,
        enable_affinity: bool = True,
    ) -> None:
        if block_size < 1 or min_blocks < 1 or max_blocks < min_blocks or capacity < 1:
            raise ValueError("RoutingPolicy needs block_size >= 1 and 1 <= min_blocks <= max_blocks, capacity >= 1")
        if margin < 0 or kv_weight < 0:
            raise ValueError("RoutingPolicy margin and kv_weight must be >= 0")
        self.block_size = block_size
        self.margin = margin
        self.kv_weight = kv_weight
        self.min_blocks = min_blocks
        self.max_blocks = max_blocks
        self.capacity = capacity
        self.enable_affinity = enable_affinity
        self._last_replica: OrderedDict[int, int] = OrderedDict()  # prefix hash -> replica

    def score(self, load: ReplicaLoad) -> float:
        return load.num_seqs + self.kv_weight * min(max(load.kv_usage, 0.0), 1.0)

    def prefix_hashes(self, token_ids: Sequence[int], key: str | None = None) -> list[int]:
        """Chained hashes of the prompt's full blocks, at most ``max_blocks`` (``key``:
        what else keys the blocks in an engine's cache, a cache salt or an adapter).

        The block holding the last prompt token is left out: an engine always computes
        that token, so only the blocks before it can be prefix-cache hits.
        """
        if not self.enable_affinity:
            return []
        n = min((len(token_ids) - 1) // self.block_size, self.max_blocks)
        return [h for h, _ in block_hashes(token_ids, self.block_size, max(n, 0), key)]

    def choose(self, prefix_hashes: Sequence[int], loads: Sequence[ReplicaLoad]) -> RoutingChoice:
        """The replica for a prompt with these prefix hashes; NoReplicaAvailable if none."""
        candidates = {load.index: load for load in loads if load.available}
        if not candidates:
            raise NoReplicaAvailable("no data-parallel replica is available")
        best = min(candidates.values(), key=lambda load: (self.score(load), load.routed, load.index))
        ceiling = self.score(best) + self.margin
        for depth in range(len(prefix_hashes), self.min_blocks - 1, -1):
            replica = self._last_replica.get(prefix_hashes[depth - 1])
            load = candidates.get(replica) if replica is not None else None
            if load is not None and self.score(load) <= ceiling:
                return RoutingChoice(replica, "affinity", depth)
        return RoutingChoice(best.index, "load")

    def record(self, prefix_hashes: Sequence[int], replica: int) -> None:
        """Remember that ``replica`` now holds these prefixes (called after dispatch)."""
        table = self._last_replica
        for h in prefix_hashes:
            table[h] = replica
            table.move_to_end(h)
        while len(table) > self.capacity:
            table.popitem(last=False)

    def forget_replica(self, replica: int) -> None:
        """Drop every prefix remembered for ``replica`` (it died: its cache is gone)."""
        for h in [h for h, r in self._last_replica.items() if r == replica]:
            del self._last_replica[h]

    def __len__(self) -> int:
        return len(self._last_replica)
