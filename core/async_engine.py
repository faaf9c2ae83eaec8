"""AsyncLLMEngine: the synchronous LLMEngine driven by one background thread, for asyncio.

    engine = AsyncLLMEngine(LLMEngine(config))
    engine.start()                                   # inside a running event loop
    stream = await engine.add_request("r1", "Hello", SamplingParams(max_tokens=8))
    async for out in stream: ...                     # cumulative RequestOutputs

One thread owns the `LLMEngine` (which is not thread-safe) and runs its step loop.
Requests and aborts reach it through a thread-safe queue that it drains between steps,
so a new request joins the running batch at the next step; outputs go back to the event
loop with one `loop.call_soon_threadsafe` per step and land in per-request asyncio
queues.  The model forward releases the GIL inside torch's kernels, so the event loop
keeps serving HTTP while a step runs (docs/serving.md has the measurements).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from pagedserve.engine import EngineStats, LLMEngine
from pagedserve.engine.client import EngineCallbacks
from pagedserve.engine.llm_engine import EngineSleepingError
from pagedserve.engine.step_trace import StepTrace
from pagedserve.engine.step_trace import now as trace_now
from pagedserve.lora import load_adapter
from pagedserve.outputs import RequestOutput
from pagedserve.pooling import EmbeddingRequestOutput, PoolingParams, classifier_labels
from pagedserve.sampling_params import SamplingParams

__all__ = [
    "AsyncLLMEngine",
    "RequestStream",
    "QueueFullError",
    "EngineDeadError",
    "RequestFailedError",
    "EngineStepError",
]

logger = logging.getLogger(__name__)


#: How long the engine thread waits for a command when no request can run.
_IDLE_WAIT_S = 0.005


class QueueFullError(RuntimeError):
    """The waiting queue holds ``max_queue_len`` requests already."""


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (shutdown or a fatal error)."""


class RequestFailedError(RuntimeError):
    """The engine failed while running this request; other requests are unaffected."""


class EngineStepError(EngineDeadError):
    """A step failed for the whole batch: the engine stopped (see `AsyncLLMEngine.fatal_error`)."""


@dataclass
class _Add:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int
    cache_salt: str | None = None
    pooling_params: PoolingParams | None = None
    lora_request: Any = None
    multi_modal_data: dict | None = None


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _Call:
    """Run ``fn(engine)`` on the engine thread between steps; its result or error goes
    to ``future`` (sleep mode)."""

    fn: Callable[[LLMEngine], Any]
    future: concurrent.futures.Future


_STOP = object()
_ACCEPTED = object()  # posted to a stream once the engine has queued its request


class RequestStream:
    """The outputs of one request as an async iterator of cumulative `RequestOutput`s.

    Outputs are cumulative, so a consumer that falls behind skips straight to the newest
    one instead of replaying every step.  Leaving the iteration early (or calling
    `abort`) aborts the request in the engine and frees its KV blocks.
    """

    def __init__(self, request_id: str, engine: AsyncLLMEngine) -> None:
        self.request_id = request_id
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._accepted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.finished = False

    def _post(self, item: object) -> None:
        """Called on the event loop thread with an output, an error or _ACCEPTED."""
        if item is _ACCEPTED:
            if not self._accepted.done():
                self._accepted.set_result(None)
            return
        if isinstance(item, BaseException) and not self._accepted.done():
            self._accepted.set_exception(item)
            return
        self._queue.put_nowait(item)  # type: ignore[arg-type]

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
            while not self._queue.empty() and isinstance(item, RequestOutput) and not item.finished:
                item = self._queue.get_nowait()
        except BaseException:
            self.abort()  # cancelled (client gone): the engine must not keep computing
            raise
        if isinstance(item, BaseException):
            self.finished = True
            self._engine._forget(self.request_id)
            raise item
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        """Abort the request if it is still running (idempotent)."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


class AsyncLLMEngine(EngineCallbacks):
    """Runs an `LLMEngine` in a background thread and serves many asyncio callers.

    Args:
        engine: the engine; from now on only the background thread touches it (except
            for the read-only prompt validation and tokenizer).
        max_queue_len: refuse new requests (QueueFullError) while this many sequences
            wait to be scheduled; default `engine.config.scheduler.max_queue_len`.
    """

    def __init__(self, engine: LLMEngine, max_queue_len: int | None = None) -> None:
        self.engine = engine
        self.max_queue_len = max_queue_len if max_queue_len is not None else engine.config.scheduler.max_queue_len
        self._commands: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._lock = threading.Lock()
        self._pending_adds = 0  # sent to the thread, not yet in the engine's waiting queue
        self._stats = engine.stats()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead: BaseException | None = None
        self._engine_stopped = False
        #: The error that stopped the engine thread, or None (running, or shut down on request).
        self.fatal_error: BaseException | None = None
        #: Called on the event loop once if the engine thread dies of an error (the server
        #: then turns unhealthy and exits non-zero).
        self.on_engine_dead: Callable[[BaseException], None] | None = None
        #: Called on the event loop with every RequestOutput, finished or not (metrics).
        self.on_request_output: Callable[[RequestOutput], None] | None = None

    # -- properties read by the server (immutable after construction) ----------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def queue_capacity(self) -> int | None:
        """The most sequences the waiting queue holds (``max_queue_len``); None: unbounded."""
        return self.max_queue_len

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.engine.eos_token_ids

    @property
    def classifier_labels(self) -> list[str] | None:
        """A sequence-classification model's labels (pagedserve.pooling), else None."""
        return classifier_labels(self.engine.arch)

    @property
    def embedding_size(self) -> int:
        return self.engine.arch.hidden_size

    @property
    def lora_enabled(self) -> bool:
        return self.engine.lora is not None

    def check_lora_adapter(self, path: str) -> None:
        """Load the adapter at ``path`` once (ValueError when it cannot serve this model)."""
        load_adapter(path, self.engine.arch, self.engine.config.lora.max_lora_rank)

    def generation_defaults(self) -> dict[str, Any]:
        return dict(self.engine.default_sampling_params)

    def stats(self) -> EngineStats:
        """The engine's statistics as of its last step (thread-safe snapshot)."""
        return self._stats

    def replica_status(self) -> list:
        return []  # one engine, no replicas

    def health(self) -> tuple[int, dict | None]:
        return (200 if self.is_running else 503), None

    # -- life cycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; must be called from the event loop that will consume."""
        if self._thread is not None:
            raise RuntimeError("AsyncLLMEngine is already started")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="pagedserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Abort everything in flight, stop the engine thread and join it, then stop the
        engine's worker processes (also after the thread died of an error)."""
        thread = self._thread
        if thread is not None and thread.is_alive():
            self._commands.put(_STOP)
            thread.join(timeout)
            if thread.is_alive():
                logger.error("engine thread did not stop within %.0f s", timeout)
                return
        if not self._engine_stopped:
            self._engine_stopped = True
            # Worker processes or actors of a multi-rank engine go with it.
            self.engine.shutdown()

    # -- requests -----------------------------------------------------------------------------
    def validate(
        self, prompt: str | list[int] | None, prompt_token_ids: list[int] | None = None
    ) -> tuple[str | None, list[int]]:
        """Tokenize and check a prompt without queueing it (ValueError naming the limit)."""
        return self.engine.validate_prompt(prompt, prompt_token_ids)

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
        """Queue a request and return its stream once the engine thread has accepted it.

        With ``pooling_params`` it is an embedding request: its stream yields one
        EmbeddingRequestOutput (``params`` is ignored).

        Raises ValueError (bad prompt, before anything is queued), QueueFullError,
        EngineDeadError.
        """
        if self._dead is not None or self._thread is None:
            raise EngineDeadError("the engine is not running")
        self.engine.check_awake()  # EngineSleepingError (the engine thread checks again)
        text, ids = self.validate(prompt, prompt_token_ids)
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in use")
            if self.max_queue_len is not None and self._pending_adds + self._stats.num_waiting >= self.max_queue_len:
                raise QueueFullError(f"the server's waiting queue is full (max_queue_len={self.max_queue_len})")
            self._pending_adds += params.n
        stream = RequestStream(request_id, self)
        self._streams[request_id] = stream
        self._commands.put(
            _Add(
                request_id,
                text,
                ids,
                params,
                time.monotonic(),
                priority,
                cache_salt,
                pooling_params,
                lora_request,
                multi_modal_data,
            )
        )
        try:
            await stream._accepted
        except BaseException:
            # Refused by the engine (its error is re-raised), or the caller was cancelled.
            stream.abort()
            self._forget(request_id)
            raise
        return stream

    async def generate(
        self,
        request_id: str,
        prompt: str | list[int] | None,
        params: SamplingParams,
        prompt_token_ids: list[int] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Convenience wrapper: add a request and yield its outputs."""
        stream = await self.add_request(request_id, prompt, params, prompt_token_ids)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    # -- sleep mode ------------------------------------------------------------------------------
    @property
    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping

    async def sleep(self, level: int = 1) -> None:
        """``LLMEngine.sleep`` on the engine thread, between steps (ValueError: not enabled,
        a bad level, requests in flight)."""
        await self._call(lambda engine: engine.sleep(level))

    async def wake_up(self) -> None:
        await self._call(lambda engine: engine.wake_up())

    async def _call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        if self._dead is not None or self._thread is None:
            raise EngineDeadError("the engine is not running")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(_Call(fn, future))
        return await asyncio.wrap_future(future)

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe; unknown or finished ids are ignored)."""
        self._forget(request_id)
        self._commands.put(_Abort([request_id]))

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    # -- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            idle = False
            while True:
                events: list[tuple[str, object]] = []
                block = not engine.has_unfinished_requests()
                if not self._handle_commands(block, events, _IDLE_WAIT_S if idle else 0.0):
                    break
                # Callers learn at once that their request is queued, not a step later.
                self._publish(events)
                if engine.has_unfinished_requests():
                    events = []
                    self._step(events)
                    self._publish(events)
                    if not engine.has_unfinished_requests():
                        engine.flush_kv_transfers()  # a KV connector's saves of the last step
                # Nothing runs, yet requests wait (for their grammar's compile, say): poll
                # gently instead of spinning a core and the GIL away from the server.
                idle = not events and self._stats.num_running == 0
        except BaseException as e:  # noqa: BLE001 - reported to every waiting caller below
            logger.critical("engine thread died; failing every request and stopping", exc_info=e)
            self._dead = self.fatal_error = e
        finally:
            if self._dead is None:
                self._dead = EngineDeadError("the engine has shut down")
            err = EngineDeadError(f"the engine stopped: {self._dead}")
            ids = engine.request_ids()
            try:
                engine.abort_request(ids)
            except Exception:  # noqa: BLE001 - best effort while dying; already logged
                logger.exception("aborting requests at shutdown failed")
            self._publish([(rid, err) for rid in list(self._streams)])
            if self.fatal_error is not None and self._loop is not None and self.on_engine_dead is not None:
                try:
                    self._loop.call_soon_threadsafe(self.on_engine_dead, self.fatal_error)
                except RuntimeError:  # the loop is closed: the process is going anyway
                    pass

    def _handle_commands(self, block: bool, events: list[tuple[str, object]], wait_s: float = 0.0) -> bool:
        """Apply queued adds and aborts (waiting for one up to ``wait_s``); False when asked to stop."""
        commands = [self._commands.get()] if block else []
        if not block and wait_s > 0:
            try:
                commands.append(self._commands.get(timeout=wait_s))
            except queue.Empty:
                pass
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                break
        added = 0
        for cmd in commands:
            if cmd is _STOP:
                for later in commands:  # a sleep or wake-up queued behind the stop
                    if isinstance(later, _Call) and not later.future.done():
                        later.future.set_exception(EngineDeadError("the engine has shut down"))
                return False
            if isinstance(cmd, _Abort):
                self.engine.abort_request(cmd.request_ids)
            elif isinstance(cmd, _Add):
                added += cmd.params.n
                try:
                    self.engine.add_request(
                        cmd.request_id,
                        cmd.prompt,
                        cmd.params,
                        prompt_token_ids=cmd.prompt_token_ids,
                        arrival_time=cmd.arrival_time,
                        priority=cmd.priority,
                        cache_salt=cmd.cache_salt,
                        pooling_params=cmd.pooling_params,
                        lora_request=cmd.lora_request,
                        multi_modal_data=cmd.multi_modal_data,
                    )
                    events.append((cmd.request_id, _ACCEPTED))
                except (ValueError, EngineSleepingError) as e:
                    events.append((cmd.request_id, e))
            elif isinstance(cmd, _Call):
                try:
                    cmd.future.set_result(cmd.fn(self.engine))
                except Exception as e:  # noqa: BLE001 - handed to the caller
                    cmd.future.set_exception(e)
        # Snapshot and counter change together so the queue bound never under-counts.
        stats = self.engine.stats()
        with self._lock:
            self._stats = stats
            self._pending_adds -= added
        return True

    def _step(self, events: list[tuple[str, object]]) -> None:
        """One engine step.  A request that fails on its own (its output carries `error`)
        fails alone; an exception out of `step()` is engine-wide: it propagates and stops
        the engine, since a half-applied step leaves no state worth serving from."""
        try:
            outputs = self.engine.step()
        except Exception as e:
            raise EngineStepError(f"the engine failed during a step: {type(e).__name__}: {e}") from e
        for out in outputs:
            if out.error is not None:
                events.append((out.request_id, RequestFailedError(f"this request failed: {out.error}")))
            else:
                events.append((out.request_id, out))
        self._stats = self.engine.stats()

    def _publish(self, events: list[tuple[str, object]]) -> None:
        if not events or self._loop is None:
            return
        trace = self.engine.step_trace
        try:
            if trace is None:
                self._loop.call_soon_threadsafe(self._dispatch, events)
            else:
                self._loop.call_soon_threadsafe(self._dispatch_traced, events, trace, trace_now())
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _dispatch_traced(self, events: list[tuple[str, object]], trace: StepTrace, t_post: float) -> None:
        t_loop = trace_now()
        self._dispatch(events)
        trace.dispatch(t_post, t_loop, sum(isinstance(item, RequestOutput) for _, item in events))

    def _dispatch(self, events: list[tuple[str, object]]) -> None:
        """On the event loop: route each output or error to its stream."""
        for rid, item in events:
            if isinstance(item, RequestOutput) and self.on_request_output is not None:
                try:
                    self.on_request_output(item)
                except Exception:  # noqa: BLE001 - metrics must never break serving
                    logger.exception("on_request_output callback failed")
            stream = self._streams.get(rid)
            if stream is None:
                continue
            stream._post(item)
            if isinstance(item, (RequestOutput, EmbeddingRequestOutput)) and item.finished:
                self._streams.pop(rid, None)
