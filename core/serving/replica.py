"""One data-parallel replica: an LLMEngine in its own process, driven by the router.

The replica connects back to the router (``multiprocessing.connection``: a local socket
for the mp backend, the router machine's address for Ray actors, HMAC-authenticated with
a per-server key) and runs the same loop as `AsyncLLMEngine`'s thread: apply queued adds
and aborts between steps, step, send the outputs.

Router -> replica messages:
    ("add", request_id, prompt, prompt_token_ids, params, priority, sent_at, cache_salt,
     pooling_params, lora_request)
    ("abort", [request_id, ...])
    ("stop",)
Replica -> router messages:
    ("hello", index, pid)                            on connecting
    ("ready", {"pid", "platform", "num_blocks", "weights", "kv_cache_groups"})
                                                     once, after the model is loaded
    ("events", [(request_id, kind, payload), ...], EngineStats)
        kind: "accepted" | "output" (a cumulative RequestOutput) | "invalid" (ValueError
        text: bad input) | "failed" (the step running it failed; text)
    ("fatal", text)                                  just before exiting on an error
A closed connection means the other side is gone: the replica then aborts its requests,
stops its engine and exits, so killing the router never leaves replicas behind.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import traceback
from dataclasses import replace
from multiprocessing.connection import Client, Connection

from pagedserve.config import EngineConfig
from pagedserve.serving.data_parallel import ReplicaSpec

__all__ = ["run_replica", "ReplicaLoop", "ReplicaActor", "replica_config"]

logger = logging.getLogger(__name__)


def replica_config(config: EngineConfig, spec: ReplicaSpec) -> EngineConfig:
    """The server's engine configuration with this replica's platform, threads and
    (when the host's memory is shared between replicas) memory share."""
    config = replace(config, device=replace(config.device, device=spec.device, threads=spec.threads))
    if spec.memory_utilization is not None:
        config = replace(config, cache=replace(config.cache, memory_utilization=spec.memory_utilization))
    return config


class ReplicaLoop:
    """Drains the router's commands between engine steps and sends every event back."""

    def __init__(self, engine, conn: Connection) -> None:
        self.engine = engine
        self.conn = conn

    def run(self) -> None:
        engine = self.engine
        while True:
            events: list[tuple] = []
            # Idle: sleep in poll until the router writes (or goes away).
            handled = self._drain(events, block=not engine.has_unfinished_requests())
            if handled is None:
                return
            if handled:
                # Callers learn at once that their request is queued, not a step later,
                # and the router sees the queue change even when an abort left it idle.
                self._send(events)
            if engine.has_unfinished_requests():
                events = []
                self._step(events)
                self._send(events)

    def _send(self, events: list[tuple]) -> None:
        self.conn.send(("events", events, self.engine.stats()))

    def _drain(self, events: list[tuple], block: bool) -> int | None:
        """Apply every queued command; how many, or None on "stop" or when the router is gone."""
        engine = self.engine
        handled = 0
        try:
            if not block and not self.conn.poll(0):
                return 0
            while True:
                msg = self.conn.recv()
                handled += 1
                kind = msg[0]
                if kind == "stop":
                    return None
                if kind == "abort":
                    engine.abort_request(msg[1])
                elif kind == "add":
                    _, rid, prompt, ids, params, priority, sent_at, salt, pooling, lora = msg
                    # Time spent in transit (one step at most) counts as queueing, as in
                    # AsyncLLMEngine; wall clocks agree across machines, monotonic ones do not.
                    arrival = time.monotonic() - max(0.0, time.time() - sent_at)
                    try:
                        engine.add_request(
                            rid,
                            prompt,
                            params,
                            prompt_token_ids=ids,
                            arrival_time=arrival,
                            priority=priority,
                            cache_salt=salt,
                            pooling_params=pooling,
                            lora_request=lora,
                        )
                        events.append((rid, "accepted", None))
                    except ValueError as e:
                        events.append((rid, "invalid", str(e)))
                if not self.conn.poll(0):
                    return handled
        except (EOFError, OSError):
            logger.warning("the router closed the connection; stopping")
            return None

    def _step(self, events: list[tuple]) -> None:
        """One engine step.  A request that failed on its own is failed alone; an exception
        out of step() is engine-wide and ends the replica (run_replica reports it, and the
        router fails this replica's requests and routes new ones to the others)."""
        for out in self.engine.step():
            if out.error is not None:
                events.append((out.request_id, "failed", f"this request failed: {out.error}"))
            else:
                events.append((out.request_id, "output", out))


def _select_device(spec: ReplicaSpec) -> None:
    """Make this process's accelerator index ``spec.device_index`` (like Worker.setup)."""
    import torch

    from pagedserve.platforms import select_platform

    if spec.on_host or not torch.accelerator.is_available():
        return
    platform, _ = select_platform(spec.device)
    accel = torch.accelerator.current_accelerator()
    if accel is None or accel.type != platform.device_type:
        return
    count = torch.accelerator.device_count()
    if spec.device_index >= count:
        raise RuntimeError(
            f"data-parallel replica {spec.index} needs {platform.name} device index "
            f"{spec.device_index}, but only {count} are visible (one device per replica)"
        )
    torch.accelerator.set_device_index(spec.device_index)


def _ready_info(engine) -> dict:
    """What the router learns of a loaded replica: its process, platform and KV blocks, the
    form of its weights (a quantization method's name, else "float") and its KV cache
    groups (layers with different attention windows keep one block table per group)."""
    from pagedserve.kv_cache.kv_groups import GroupedKVCacheManager

    method = getattr(engine.model_source, "method", None)
    return {
        "pid": os.getpid(),
        "platform": engine.platform.name,
        "num_blocks": engine.executor.num_blocks,
        "weights": method.name if method is not None else "float",
        "kv_cache_groups": len(engine.kv.groups) if isinstance(engine.kv, GroupedKVCacheManager) else 1,
    }


def run_replica(spec: ReplicaSpec, config: EngineConfig, address, authkey: bytes, log_level: str = "INFO") -> None:
    """Entry point of a replica process or actor: load, serve until told to stop."""
    logging.basicConfig(
        level=log_level.upper(), format=f"%(levelname)s %(asctime)s replica {spec.index} %(name)s: %(message)s"
    )
    # Ctrl-C reaches the whole process group; the router stops replicas in order.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if spec.device is not None:
        os.environ["PAGEDSERVE_TARGET_DEVICE"] = spec.device  # this replica's own platform
    conn = Client(address, authkey=authkey)
    conn.send(("hello", spec.index, os.getpid()))
    engine = None
    try:
        from pagedserve.engine import LLMEngine

        _select_device(spec)
        engine = LLMEngine(replica_config(config, spec))
        conn.send(("ready", _ready_info(engine)))
        ReplicaLoop(engine, conn).run()
    except Exception as e:
        logger.error("replica %d failed: %s", spec.index, traceback.format_exc())
        try:
            conn.send(("fatal", f"{type(e).__name__}: {e}"))
        except OSError:
            pass
        raise SystemExit(1) from None  # logged above once; the router reports the exit
    finally:
        if engine is not None:
            engine.abort_request(list(engine.groups))
            engine.shutdown()
        conn.close()


class ReplicaActor:
    """Body of a replica as a Ray actor (the data-parallel ``ray`` backend)."""

    def pid(self) -> int:
        return os.getpid()

    def run(self, spec: ReplicaSpec, config: EngineConfig, address, authkey: bytes, log_level: str) -> None:
        # Ray shows the actor only its own accelerator (index 0 in ReplicaSpec).
        run_replica(spec, config, address, authkey, log_level)
