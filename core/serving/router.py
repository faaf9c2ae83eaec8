"""DataParallelRouter: N engine replicas, each in its own process, behind the interface
the OpenAI server uses from `AsyncLLMEngine`.

    router = DataParallelRouter(config, DataParallelConfig(size=2))   # starts and loads replicas
    router.start()                                   # inside the running event loop
    stream = await router.add_request("r1", "Hello", SamplingParams(max_tokens=8))
    async for out in stream: ...                     # cumulative RequestOutputs
    router.shutdown()

The router runs in the server's process and holds no model: it tokenizes and checks
prompts (with the engine's own `validate_prompt`, so bad input is a 400 before anything
is sent), picks a replica with `RoutingPolicy` (load, then prefix-cache affinity), and
relays commands and outputs.  Per replica, one thread writes commands to its connection
(the event loop never blocks on a socket) and one reads its events and hands them to the
event loop, where they land in the same `RequestStream`s as with `AsyncLLMEngine`.

Failures: a replica that exits closes its connection; the reader notices at once, the
replica's accepted requests fail with `RequestFailedError` naming it and its exit code,
requests it had not accepted yet are routed again to another replica, and new requests
only go to the replicas still alive (`/health` reports "degraded").  With no replica
left, requests get `EngineDeadError` (503).  A replica is not restarted.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from multiprocessing.connection import Connection
from typing import Any

from pagedserve.async_engine import (
    _ACCEPTED,
    AsyncLLMEngine,
    EngineDeadError,
    QueueFullError,
    RequestFailedError,
    RequestStream,
)
from pagedserve.config import EngineConfig
from pagedserve.config_rules import data_parallel_request_refusal
from pagedserve.engine import EngineStats
from pagedserve.engine.client import EngineCallbacks
from pagedserve.engine.input_processor import InputProcessor
from pagedserve.lora import LoRARequest, load_adapter, lora_cache_salt
from pagedserve.outputs import RequestOutput
from pagedserve.pooling import PoolingParams, classifier_labels
from pagedserve.sampling_params import SamplingParams
from pagedserve.serving.data_parallel import DataParallelConfig, ReplicaSpec, plan_replicas, resolve_platforms
from pagedserve.serving.replica_launcher import ReplicaStartError, create_launcher
from pagedserve.serving.routing_policy import NoReplicaAvailable, ReplicaLoad, RoutingPolicy

__all__ = ["DataParallelRouter", "ReplicaStatus", "ReplicaStartError"]

logger = logging.getLogger(__name__)

_NO_STATS = EngineStats(
    num_running=0,
    num_waiting=0,
    kv_cache_usage=0.0,
    prefix_cache_queries=0,
    prefix_cache_hits=0,
    num_preemptions=0,
    prompt_tokens=0,
    generation_tokens=0,
)


class _ReplicaLost(EngineDeadError):
    """The replica died before accepting the request: it is routed again."""


class _PromptCheck:
    """What `InputProcessor.validate_prompt` reads, so the router checks prompts with the
    engine's own code (same errors, same limits) without loading the model."""

    validate_prompt = InputProcessor.validate_prompt

    def __init__(self, tokenizer, arch, max_model_len: int, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.arch = arch
        self.vocab_size = arch.vocab_size
        self.max_model_len = max_model_len


@dataclass
class ReplicaStatus:
    """One replica as /metrics and /health show it."""

    index: int
    platform: str
    pid: int
    alive: bool
    exit_reason: str | None
    num_seqs: int  # sent and not finished, as the router counts them
    routed: int  # requests sent to it so far
    affinity_routed: int  # of which chosen for prefix-cache affinity
    stats: EngineStats  # its last report
    weights: str = "float"  # its quantization method's name, else "float"
    kv_cache_groups: int = 1  # block tables of its KV cache (layers with different windows)


class _Replica:
    def __init__(self, spec: ReplicaSpec, conn: Connection, info: dict) -> None:
        self.spec = spec
        self.index = spec.index
        self.conn = conn
        self.pid: int = info["pid"]
        self.platform: str = info["platform"]
        self.num_blocks: int = info["num_blocks"]
        self.weights: str = info.get("weights", "float")
        self.kv_cache_groups: int = info.get("kv_cache_groups", 1)
        self.alive = True
        self.exit_reason: str | None = None
        self.stats = _NO_STATS
        self.num_seqs = 0
        self.unaccepted = 0
        self.routed = 0
        self.affinity_routed = 0
        self.outbox: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self.writer = threading.Thread(target=self._write, name=f"pagedserve-dp-send-{self.index}", daemon=True)
        self.writer.start()
        self.reader: threading.Thread | None = None

    def describe(self) -> str:
        return f"{self.platform}, pid {self.pid}"

    def _write(self) -> None:
        while (msg := self.outbox.get()) is not None:
            try:
                self.conn.send(msg)
            except (OSError, ValueError):  # gone: its reader reports the death
                return


@dataclass
class _InFlight:
    replica: _Replica
    n: int
    accepted: bool = False


def _cache_key(cache_salt: str | None, lora_request: Any) -> str | None:
    """What besides the tokens keys a prompt's cached blocks in an engine (prefix affinity
    keys on the same; a bad ``lora_request`` is the replica's engine's to refuse)."""
    return lora_cache_salt(cache_salt, lora_request if isinstance(lora_request, LoRARequest) else None)


class DataParallelRouter(EngineCallbacks):
    """Routes requests over data-parallel replicas; an `EngineClient` like AsyncLLMEngine.

    Args:
        config: every replica's engine configuration (``device.threads`` is the server's
            thread budget, split by `plan_replicas`).
        dp: size, backend and per-replica platforms.
        policy: the routing policy (default: `RoutingPolicy` over the cache's block
            size, affinity only with prefix caching).
        startup_timeout_s: how long replicas may take to load (default: the parallel
            config's ``distributed_timeout_s``).
    """

    def __init__(
        self,
        config: EngineConfig,
        dp: DataParallelConfig,
        log_level: str = "info",
        policy: RoutingPolicy | None = None,
        startup_timeout_s: float | None = None,
    ) -> None:
        from pagedserve.loader import open_model
        from pagedserve.loader.tokenizer_source import engine_tokenizer
        from pagedserve.models.arch_config import ArchConfig

        par = config.parallel
        if par.world_size > 1 and par.distributed_executor_backend == "ray":
            raise ValueError(
                "the ranks of a data-parallel replica run as local processes: use "
                "--distributed-executor-backend mp with --data-parallel-size > 1"
            )
        self.config = config
        self.dp = dp
        source = open_model(config.model.model)
        arch = ArchConfig.from_hf(source.hf_config)
        self._eos_token_ids = frozenset(source.eos_token_ids)
        self._tokenizer = engine_tokenizer(config.model, source, arch.vocab_size)
        mml = config.model.max_model_len or arch.max_position_embeddings
        if mml > arch.max_position_embeddings:
            raise ValueError(
                f"max_model_len={mml} exceeds the model's max_position_embeddings ({arch.max_position_embeddings})"
            )
        self._check = _PromptCheck(self._tokenizer, arch, mml, config)
        self.max_queue_len = config.scheduler.max_queue_len
        platforms = resolve_platforms(dp.devices, check_available=dp.backend == "mp")
        # Affinity hashes prompts by blocks: the replicas' block size (each replica resolves
        # an unset one from its platform; the smallest of their defaults here).
        block_size = config.cache.block_size or min(p.default_block_size for p in platforms)
        self.policy = policy or RoutingPolicy(block_size, enable_affinity=config.cache.enable_prefix_caching)
        c = config.cache
        no_budget = c.kv_cache_memory is None and c.memory_utilization is None and c.num_gpu_blocks_override is None
        self.specs = plan_replicas(
            dp,
            [p.device_type for p in platforms],
            config.device.threads,
            par.world_size,
            one_accelerator_per_actor=dp.backend == "ray",
            default_utilization=[p.default_memory_utilization for p in platforms] if no_budget else None,
        )
        self._launcher = create_launcher(dp.backend, par.world_size)
        self._streams: dict[str, RequestStream] = {}
        self._inflight: dict[str, _InFlight] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False
        #: Called on the event loop with every RequestOutput, finished or not (metrics).
        self.on_request_output: Callable[[RequestOutput], None] | None = None
        #: Set when the last replica died; the server then stops and exits non-zero.
        self.fatal_error: BaseException | None = None
        self.on_engine_dead: Callable[[BaseException], None] | None = None
        timeout = startup_timeout_s if startup_timeout_s is not None else par.distributed_timeout_s
        ready = self._launcher.launch(self.specs, config, log_level, timeout)
        self._replicas = [_Replica(spec, *ready[spec.index]) for spec in self.specs]
        for r in self._replicas:
            logger.info(
                "data-parallel replica %d ready: %s, %s weights, %d KV blocks, %d thread(s)",
                r.index,
                r.describe(),
                r.weights,
                r.num_blocks,
                r.spec.threads,
            )

    # -- life cycle -----------------------------------------------------------------------------
    def start(self) -> None:
        """Start relaying replica events; call from the event loop that will consume."""
        if self._loop is not None:
            raise RuntimeError("DataParallelRouter is already started")
        self._loop = asyncio.get_running_loop()
        for r in self._replicas:
            r.reader = threading.Thread(target=self._read, args=(r,), name=f"pagedserve-dp-recv-{r.index}", daemon=True)
            r.reader.start()

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop every replica (they abort what runs), fail open streams; safe to call twice."""
        if self._closing:
            return
        self._closing = True
        for r in self._replicas:
            r.outbox.put(("stop",))
            r.outbox.put(None)
        self._launcher.stop(graceful_s=min(15.0, timeout or 15.0))
        for r in self._replicas:
            if r.reader is not None:
                r.reader.join(timeout=10)
            r.conn.close()
        logger.info("data-parallel replicas stopped")

    @property
    def is_running(self) -> bool:
        return self._loop is not None and not self._closing and any(r.alive for r in self._replicas)

    # -- what the server reads ------------------------------------------------------------------
    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        return self._check.max_model_len

    @property
    def queue_capacity(self) -> int | None:
        """The most sequences the replicas' waiting queues hold together (each prompt is
        routed on its own); None: unbounded."""
        return None if self.max_queue_len is None else self.max_queue_len * len(self._replicas)

    def validate(
        self, prompt: str | list[int] | None, prompt_token_ids: list[int] | None = None
    ) -> tuple[str | None, list[int]]:
        """Tokenize and check a prompt as a replica would (ValueError naming the limit)."""
        return self._check.validate_prompt(prompt, prompt_token_ids)

    def stats(self) -> EngineStats:
        """The replicas' statistics combined: fractions (``*_usage``) averaged over live
        replicas weighted by their KV blocks; queue lengths summed over live replicas;
        every other field (counters, sizes) summed over all replicas, a dead one with its
        last report, so that counters never go back."""
        live = [r for r in self._replicas if r.alive]
        blocks = sum(r.num_blocks for r in live)
        combined = {}
        for f in fields(EngineStats):
            name = f.name
            if name.endswith("_usage"):
                combined[name] = sum(getattr(r.stats, name) * r.num_blocks for r in live) / blocks if blocks else 0.0
            elif name in ("num_running", "num_waiting"):
                combined[name] = sum(getattr(r.stats, name) for r in live)
            elif name == "iteration_tokens_buckets":  # histogram counts: summed bucket by bucket
                rows = [getattr(r.stats, name) for r in self._replicas if getattr(r.stats, name)]
                combined[name] = tuple(map(sum, zip(*rows))) if rows else ()
            elif f.type in ("tuple[int, ...]", tuple):  # per-position counters: summed element-wise
                rows = [getattr(r.stats, name) for r in self._replicas]
                combined[name] = tuple(sum(c) for c in itertools.zip_longest(*rows, fillvalue=0))
            else:
                combined[name] = sum(getattr(r.stats, name) for r in self._replicas)
        return EngineStats(**combined)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The model's, as every replica's engine reads them (beam search steps go to
        whichever replica the policy picks: each step is a set of whole prompts)."""
        return self._eos_token_ids

    @property
    def classifier_labels(self) -> list[str] | None:
        """A sequence-classification model's labels (pagedserve.pooling), else None."""
        return classifier_labels(self._check.arch)

    @property
    def embedding_size(self) -> int:
        return self._check.arch.hidden_size

    @property
    def lora_enabled(self) -> bool:
        return self.config.lora.enable_lora

    def check_lora_adapter(self, path: str) -> None:
        """Load the adapter at ``path`` once here (ValueError when it cannot serve this
        model); each replica loads it again from the path on its first request."""
        load_adapter(path, self._check.arch, self.config.lora.max_lora_rank)

    def generation_defaults(self) -> dict:
        from pagedserve.loader.generation_config import load_generation_defaults
        from pagedserve.loader.model_path import resolve_model_path

        model = self.config.model
        return load_generation_defaults(model.generation_config, resolve_model_path(model.model))

    def replica_status(self) -> list[ReplicaStatus]:
        return [
            ReplicaStatus(
                r.index,
                r.platform,
                r.pid,
                r.alive,
                r.exit_reason,
                r.num_seqs,
                r.routed,
                r.affinity_routed,
                r.stats,
                r.weights,
                r.kv_cache_groups,
            )
            for r in self._replicas
        ]

    def health(self) -> tuple[int, dict]:
        """(HTTP status, body) of GET /health: 200 while one replica serves."""
        alive = sum(r.alive for r in self._replicas)
        status = "ok" if alive == len(self._replicas) else "degraded" if alive else "unavailable"
        body = {
            "status": status,
            "replicas_alive": alive,
            "replicas": len(self._replicas),
            "detail": [
                {"index": r.index, "platform": r.platform, "pid": r.pid, "alive": r.alive, "exit_reason": r.exit_reason}
                for r in self._replicas
            ],
        }
        return (200 if self.is_running else 503), body

    # -- requests -------------------------------------------------------------------------------
    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | None,
        params: SamplingParams,
        prompt_token_ids: list[int] | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        pooling_params: PoolingParams | None = None,
        lora_request: Any = None,
        multi_modal_data: dict | None = None,
    ) -> RequestStream:
        """Route a request and return its stream once its replica has accepted it.  The
        request's ``cache_salt``, embedding parameters (``pooling_params``) and adapter
        (``lora_request``) travel with it; the replica's engine checks them as one engine
        does (its ValueError fails the request).

        Raises ValueError (bad prompt, before anything is sent), QueueFullError (every
        live replica's waiting queue is full), EngineDeadError (no replica left).
        """
        if multi_modal_data is not None:
            raise ValueError(data_parallel_request_refusal("images"))
        if self._loop is None or self._closing:
            raise EngineDeadError("the engine is not running")
        text, ids = self.validate(prompt, prompt_token_ids)
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        # A salted prompt's or an adapter's blocks are their own in a replica's prefix
        # cache: affinity keys on both.
        hashes = self.policy.prefix_hashes(ids, _cache_key(cache_salt, lora_request))
        while True:
            r, reason = self._route(hashes)
            stream = RequestStream(request_id, self)
            self._streams[request_id] = stream
            self._inflight[request_id] = _InFlight(r, params.n)
            r.num_seqs += params.n
            r.unaccepted += params.n
            r.routed += 1
            r.affinity_routed += reason == "affinity"
            self.policy.record(hashes, r.index)
            r.outbox.put(
                ("add", request_id, text, ids, params, priority, time.time(), cache_salt, pooling_params, lora_request)
            )
            try:
                await stream._accepted
            except _ReplicaLost:
                self._streams.pop(request_id, None)
                continue  # died before accepting it: another replica takes it
            except BaseException:
                stream.abort()
                self._forget(request_id)
                raise
            return stream

    def _route(self, hashes: list[int]) -> tuple[_Replica, str]:
        def full(r: _Replica) -> bool:
            return self.max_queue_len is not None and r.unaccepted + r.stats.num_waiting >= self.max_queue_len

        loads = [
            ReplicaLoad(r.index, r.num_seqs, r.stats.kv_cache_usage, r.routed, r.alive and not full(r))
            for r in self._replicas
        ]
        try:
            choice = self.policy.choose(hashes, loads)
        except NoReplicaAvailable:
            if any(r.alive for r in self._replicas):
                raise QueueFullError(
                    f"the server's waiting queues are full on every replica (max_queue_len={self.max_queue_len} each)"
                ) from None
            why = "; ".join(f"replica {r.index} {r.exit_reason}" for r in self._replicas)
            raise EngineDeadError(f"every data-parallel replica has exited ({why})") from None
        return self._replicas[choice.replica], choice.reason

    # Add a request and yield its outputs: the engine's wrapper, over this add_request.
    generate = AsyncLLMEngine.generate

    def abort(self, request_id: str) -> None:
        """Abort a request (on the event loop; unknown or finished ids are ignored)."""
        inflight = self._inflight.get(request_id)
        if inflight is not None and inflight.replica.alive:
            inflight.replica.outbox.put(("abort", [request_id]))
        self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        inflight = self._inflight.pop(request_id, None)
        if inflight is not None:
            inflight.replica.num_seqs -= inflight.n
            if not inflight.accepted:
                inflight.replica.unaccepted -= inflight.n

    # -- events from replicas ---------------------------------------------------------------------
    def _read(self, r: _Replica) -> None:
        """Reader thread: relay r's events to the event loop until its connection closes."""
        fatal = None
        try:
            while True:
                msg = r.conn.recv()
                if msg[0] == "events":
                    self._call(self._dispatch, r, msg[1], msg[2])
                elif msg[0] == "fatal":
                    fatal = msg[1]
        except (EOFError, OSError):
            pass
        except Exception:  # noqa: BLE001 - an undecodable message: treat the replica as gone
            logger.exception("bad message from data-parallel replica %d", r.index)
        reason = self._launcher.exit_reason(r.index, wait_s=5.0) or "closed its connection"
        if fatal is not None:
            reason += f" after an error: {fatal}"
        self._call(self._replica_died, r, reason)

    def _call(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _dispatch(self, r: _Replica, events: list[tuple], stats: EngineStats) -> None:
        """On the event loop: route each event of replica r to its stream."""
        r.stats = stats
        for rid, kind, payload in events:
            if kind == "output" and self.on_request_output is not None:
                try:
                    self.on_request_output(payload)
                except Exception:  # noqa: BLE001 - metrics must never break serving
                    logger.exception("on_request_output callback failed")
            inflight = self._inflight.get(rid)
            stream = self._streams.get(rid)
            if inflight is None or inflight.replica is not r or stream is None:
                continue  # aborted meanwhile
            if kind == "accepted":
                inflight.accepted = True
                r.unaccepted -= inflight.n
                stream._post(_ACCEPTED)
            elif kind == "output":
                if payload.finished:
                    self._forget(rid)
                stream._post(payload)
            else:
                self._forget(rid)
                stream._post(ValueError(payload) if kind == "invalid" else RequestFailedError(payload))

    def _replica_died(self, r: _Replica, reason: str) -> None:
        """On the event loop: stop routing to r and fail (or re-route) its requests."""
        if not r.alive:
            return
        r.alive = False
        r.exit_reason = reason
        self.policy.forget_replica(r.index)
        left = sum(x.alive for x in self._replicas)
        if not self._closing:
            logger.error(
                "data-parallel replica %d (%s) %s; %d of %d replica(s) left",
                r.index,
                r.describe(),
                reason,
                left,
                len(self._replicas),
            )
        for rid, inflight in list(self._inflight.items()):
            if inflight.replica is not r:
                continue
            del self._inflight[rid]
            stream = self._streams.get(rid)
            if stream is None:
                continue
            if self._closing:
                err: Exception = EngineDeadError("the engine stopped: the server is shutting down")
            elif inflight.accepted:
                err = RequestFailedError(
                    f"data-parallel replica {r.index} ({r.describe()}) {reason} while running this request"
                )
            else:
                err = _ReplicaLost(f"data-parallel replica {r.index} {reason}")
            stream._post(err)
        r.num_seqs = r.unaccepted = 0
        if left == 0 and not self._closing:
            self.fatal_error = EngineDeadError(f"every data-parallel replica has died (the last: {reason})")
            if self.on_engine_dead is not None:
                self.on_engine_dead(self.fatal_error)
