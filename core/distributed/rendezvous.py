"""The multi-node rendezvous: a TCPStore on the head node that every rank joins.

torch's ``tcp://`` init method waits for all ranks and then fails with a bare timeout.
Here each rank first marks itself in the store (``pagedserve/joined/<rank>``) and rank 0
waits for those marks, so a node that never joins is named, with its ranks, within
``distributed_timeout_s``.  The same store then carries the process group and, while
the engine runs, each worker node's heartbeat counter (pagedserve.distributed.multinode).
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import TYPE_CHECKING

import torch.distributed as dist

from pagedserve.distributed.lifecycle import WorkerStartupError

if TYPE_CHECKING:  # parallel_state imports this module when it forms a multi-node group
    from pagedserve.distributed.parallel_state import DistInit

__all__ = [
    "RendezvousError",
    "join_rendezvous",
    "connect_store",
    "node_of",
    "node_ranks",
    "describe_nodes",
    "HEARTBEAT_KEY",
]

_JOINED = "pagedserve/joined/{}"
_LAYOUT = "pagedserve/layout"
_MISMATCH = "pagedserve/mismatch"  # one key: a mismatched node's ranks may not be ones the head expects
HEARTBEAT_KEY = "pagedserve/heartbeat/{}"


class RendezvousError(WorkerStartupError):
    """A rank or node did not reach (or join) the rendezvous in time."""


def node_of(init: DistInit, rank: int) -> int:
    """The node that runs ``rank``."""
    return rank // (init.world_size // init.nnodes)


def node_ranks(init: DistInit, node: int) -> list[int]:
    k = init.world_size // init.nnodes
    return list(range(node * k, (node + 1) * k))


def describe_nodes(init: DistInit, ranks: list[int]) -> str:
    """``node 1 (ranks 2, 3)`` for every node some of ``ranks`` belong to."""
    nodes: dict[int, list[int]] = {}
    for r in sorted(ranks):
        nodes.setdefault(node_of(init, r), []).append(r)
    return "; ".join(
        f"node {n} (rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))})" for n, rs in nodes.items()
    )


def connect_store(init: DistInit, is_master: bool, who: str) -> dist.TCPStore:
    """The head's store (hosted when ``is_master``); a RuntimeError naming the address
    when it cannot be reached within the timeout."""
    try:
        return dist.TCPStore(
            init.master_addr,
            init.master_port,
            init.world_size,
            is_master=is_master,
            timeout=timedelta(seconds=init.timeout_s),
            wait_for_workers=False,
        )
    except (RuntimeError, OSError) as e:
        what = "could not listen on" if is_master else "could not reach the head node's rendezvous at"
        raise RendezvousError(
            f"{who} {what} {init.master_addr}:{init.master_port} within "
            f"{init.timeout_s:g} s (distributed_timeout_s): {e}"
        ) from e


def _layout(init: DistInit) -> str:
    return (
        f"tensor_parallel_size={init.tp_size}, pipeline_parallel_size={init.pp_size}, "
        f"nnodes={init.nnodes}, backend={init.backend}"
    )


def join_rendezvous(init: DistInit, rank: int) -> dist.TCPStore:
    """Join as ``rank``; rank 0 hosts the store and returns once every rank joined.

    Rank 0 publishes its parallel layout; a rank started with another one is refused by
    name on both sides instead of forming a broken group."""
    who = f"rank {rank} (node {node_of(init, rank)})"
    store = connect_store(init, rank == 0, who)
    if rank == 0:
        store.set(_LAYOUT, _layout(init))
    else:
        head = store.get(_LAYOUT).decode()  # waits for the head, up to the store's timeout
        if head != _layout(init):
            message = f"{who} was started with {_layout(init)}; the head node with {head}"
            store.set(_MISMATCH, message)
            raise RendezvousError(f"{message}: every node needs the same parallel settings")
    store.set(_JOINED.format(rank), "1")
    if rank == 0:
        _await_ranks(store, init)
    return store


def _await_ranks(store: dist.TCPStore, init: DistInit) -> None:
    missing = list(range(1, init.world_size))
    deadline = time.monotonic() + init.timeout_s
    while True:
        missing = [r for r in missing if not store.check([_JOINED.format(r)])]
        if not missing:
            return
        if store.check([_MISMATCH]):
            raise RendezvousError(f"{store.get(_MISMATCH).decode()}: every node needs the same parallel settings")
        if time.monotonic() >= deadline:
            raise RendezvousError(
                f"{describe_nodes(init, missing)} did not join the rendezvous at {init.master_addr}:"
                f"{init.master_port} within {init.timeout_s:g} s (distributed_timeout_s): start `pagedserve serve "
                f"--nnodes {init.nnodes} --node-rank N --master-addr {init.master_addr} --master-port "
                f"{init.master_port}` with the same model and parallel settings on each of them, and check "
                "that they can reach this address"
            )
        time.sleep(0.05)
