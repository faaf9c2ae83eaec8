"""Tensor/pipeline parallelism over several nodes without Ray: one process per node.

    node 0 (head):  pagedserve serve --tensor-parallel-size 4 --nnodes 2 --node-rank 0 \\
                        --master-addr 10.0.0.1 --master-port 29500
    node 1:         pagedserve serve --tensor-parallel-size 4 --nnodes 2 --node-rank 1 \\
                        --master-addr 10.0.0.1 --master-port 29500        (headless)

Node ``r`` runs ranks ``[r * k, (r + 1) * k)``, ``k = world_size / nnodes``.  The head
node is an ordinary engine whose MultiprocExecutor starts only its own ranks 1..k-1 and
hosts the rendezvous (pagedserve.distributed.rendezvous) on the given address; a worker
node runs :func:`run_headless`: its k ranks as local worker processes, plus a heartbeat
counter in the head's store.  The head reads the counters (:class:`RemoteNodeWatch`), so
a step that fails because a node died says which node.
"""

from __future__ import annotations

import logging
import time

import torch.multiprocessing as mp

from pagedserve.config import EngineConfig
from pagedserve.distributed.parallel_state import DistInit
from pagedserve.distributed.rendezvous import HEARTBEAT_KEY, connect_store, describe_nodes, node_ranks
from pagedserve.distributed.worker import default_threads, run_worker_process

__all__ = ["RemoteNodeWatch", "run_headless", "multinode_init", "serve_node"]

logger = logging.getLogger(__name__)

HEARTBEAT_S = 0.5
#: A node whose counter has not moved for this long is reported dead.
STALE_S = 3.0


def multinode_init(config: EngineConfig, backend: str) -> DistInit:
    """The DistInit every node derives from the same settings."""
    par = config.parallel
    return DistInit(
        master_addr=par.rendezvous_addr,
        master_port=par.master_port,
        world_size=par.world_size,
        tp_size=par.tensor_parallel_size,
        pp_size=par.pipeline_parallel_size,
        backend=backend,
        timeout_s=par.distributed_timeout_s,
        nnodes=par.nnodes,
    )


class RemoteNodeWatch:
    """Head side: which worker nodes stopped beating (their process is gone)."""

    def __init__(self, init: DistInit) -> None:
        self.init = init
        self.seen: dict[int, tuple[int, float]] = {}  # node -> (counter, when it last moved)

    def dead(self, store) -> list[str]:
        """A line per worker node whose heartbeat stopped, naming its ranks."""
        if store is None:
            return []
        lines, now = [], time.monotonic()
        for node in range(1, self.init.nnodes):
            try:
                count = store.add(HEARTBEAT_KEY.format(node), 0)
            except RuntimeError:
                return []  # our own store is closing (shutdown)
            last = self.seen.get(node)
            if last is None or count != last[0]:
                self.seen[node] = (count, now)
            elif now - last[1] > STALE_S:
                lines.append(
                    f"{describe_nodes(self.init, node_ranks(self.init, node))} stopped: no heartbeat "
                    f"for {now - last[1]:.1f} s (its `pagedserve serve --node-rank {node}` process or "
                    "machine is gone)"
                )
        return lines


def serve_node(config: EngineConfig, data_parallel: bool) -> int | None:
    """``pagedserve serve`` with nnodes > 1: a worker node's exit status after running
    :func:`run_headless`, or None on the head node (which serves as usual)."""
    par = config.parallel
    if data_parallel:
        raise SystemExit("pagedserve serve: --nnodes cannot be combined with --data-parallel-size yet")
    try:
        config.validate()
    except ValueError as e:
        raise SystemExit(f"pagedserve serve: {e}") from None
    if par.node_rank == 0 and not par.headless:
        return None
    if par.node_rank == 0:
        raise SystemExit("pagedserve serve: --headless on node 0: the head node runs rank 0 and the API server")
    try:
        return run_headless(config)
    except RuntimeError as e:  # the head's rendezvous could not be reached
        raise SystemExit(f"pagedserve serve: {e}") from None


def run_headless(config: EngineConfig) -> int:
    """A worker node: run this node's ranks until the head stops them; the exit status
    (0 when the head shut the engine down, 1 when a rank or the head failed)."""
    from pagedserve.platforms import select_platform

    par = config.parallel
    platform, _ = select_platform(config.device.device)
    init = multinode_init(config, platform.dist_backend)
    ranks = node_ranks(init, par.node_rank)
    logger.info(
        "node %d of %d: ranks %s, rendezvous at %s:%s",
        par.node_rank,
        par.nnodes,
        ranks,
        init.master_addr,
        init.master_port,
    )
    ctx = mp.get_context("spawn")
    threads = default_threads(config, len(ranks))
    procs = [
        ctx.Process(
            target=run_worker_process,
            args=(config, rank, init, threads, i),
            name=f"pagedserve-worker-{rank}",
            daemon=True,
        )
        for i, rank in enumerate(ranks)
    ]
    for p in procs:
        p.start()
    try:
        return _supervise(init, par.node_rank, ranks, procs)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join(timeout=5)


def _supervise(init: DistInit, node: int, ranks: list[int], procs: list) -> int:
    """Beat while the ranks run; the exit status once they stopped."""
    store = connect_store(init, False, f"node {node}")
    key = HEARTBEAT_KEY.format(node)
    while True:
        exited = [(r, p.exitcode) for r, p in zip(ranks, procs) if p.exitcode is not None]
        if exited and len(exited) == len(procs) and all(code == 0 for _, code in exited):
            logger.info("node %d: the head node stopped the engine; exiting", node)
            return 0
        failed = [(r, code) for r, code in exited if code != 0]
        if failed:
            logger.error(
                "node %d: rank(s) %s exited with code(s) %s; stopping this node",
                node,
                ", ".join(str(r) for r, _ in failed),
                ", ".join(str(c) for _, c in failed),
            )
            return 1
        try:
            store.add(key, 1)
        except RuntimeError:
            # The head is gone (or closing after a clean shutdown: its ranks exit at once).
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and any(p.exitcode is None for p in procs):
                time.sleep(0.1)
            if all(p.exitcode == 0 for p in procs):
                return 0
            logger.error(
                "node %d: the head node's rendezvous at %s:%s is gone", node, init.master_addr, init.master_port
            )
            return 1
        time.sleep(HEARTBEAT_S)
