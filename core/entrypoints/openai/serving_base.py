"""What completions and chat completions share: model names, context limits, submitting
prompts to the AsyncLLMEngine, merging their streams, logprob token strings, SSE framing."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from pagedserve.async_engine import EngineDeadError, QueueFullError, RequestFailedError, RequestStream
from pagedserve.engine.client import EngineClient
from pagedserve.engine.llm_engine import EngineSleepingError
from pagedserve.entrypoints.openai.errors import ApiError, error_body
from pagedserve.entrypoints.openai.serving_fields import field_named, generation_defaults, salt_kwargs
from pagedserve.entrypoints.openai.serving_lora import REQUEST_LORA
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

__all__ = ["OpenAIServing", "EventStream", "merge_streams", "sse", "SSE_DONE", "clamp_logprob"]

SSE_DONE = "data: [DONE]\n\n"
_MIN_LOGPROB = -9999.0  # JSON has no -Infinity
#: Requests whose prompt text has at least this many characters are tokenized in a worker
#: thread (the tokenizer releases the GIL): a megabyte prompt takes seconds to tokenize,
#: and the event loop keeps serving the other requests meanwhile.
THREAD_TOKENIZE_CHARS = 8192


def sse(obj: dict) -> str:
    return "data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False) + "\n\n"


def clamp_logprob(value: float) -> float:
    return value if value > _MIN_LOGPROB else _MIN_LOGPROB


class EventStream:
    """SSE lines of a streamed response plus the engine streams behind them.

    `abort` is for the server to call when the response ends however it ends: an async
    generator that never started cannot clean up after itself.
    """

    def __init__(self, events: AsyncIterator[str], streams: Sequence[RequestStream]) -> None:
        self.events = events
        self.streams = list(streams)

    def abort(self) -> None:
        for s in self.streams:
            s.abort()


async def merge_streams(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they arrive, tagged with the stream's index."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    pending = {asyncio.ensure_future(s.__anext__()): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                try:
                    out = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(streams[i].__anext__())] = i
                yield i, out
    finally:
        for task in pending:
            task.cancel()


class OpenAIServing:
    """Shared state of the OpenAI endpoints.

    Args:
        engine: the running engine client (AsyncLLMEngine or DataParallelRouter).
        served_model_names: names a request's `model` may use; the first is reported.
        chat_template: overrides the model's chat template (text, already read).
        request_logger: a RequestLogger (--enable-log-requests) told of every request queued.
        lora: the served LoRA adapters (serving_lora.LoRAServing) with --enable-lora.
    """

    def __init__(
        self,
        engine: EngineClient,
        served_model_names: list[str],
        chat_template: str | None = None,
        request_logger=None,
        lora=None,
    ) -> None:
        self.engine = engine
        self.request_logger = request_logger
        self.lora = lora
        self.served_model_names = list(served_model_names)
        self.chat_template = chat_template
        self.tokenizer = engine.tokenizer
        self._token_text: dict[int, str] = {}
        self.generation_defaults: dict = generation_defaults(engine)
        self._max_prompt_chars: int | None = None

    # -- request checks -----------------------------------------------------------------------
    def model_name(self, requested: str | None) -> str:
        """The model a response reports; 404 for a model this server does not serve."""
        REQUEST_LORA.set(None)
        if requested is None or requested == "":
            return self.served_model_names[0]
        if requested not in self.served_model_names and self.lora is not None and self.lora.resolve(requested):
            REQUEST_LORA.set(self.lora.resolve(requested))  # read by submit() of this request
            return requested
        if requested not in self.served_model_names:
            raise ApiError(404, f"The model `{requested}` does not exist.", param="model", code="model_not_found")
        return requested

    def resolve_max_tokens(
        self, requested: int | None, prompt_len: int, default: int | None, field: str = "max_tokens"
    ) -> int:
        """Tokens to generate: the request's, or `default`, within the context window."""
        limit = self.engine.max_model_len
        room = limit - prompt_len
        if requested is None:
            return room if default is None else min(default, room)
        if requested < 1:
            raise ApiError(400, f"'{field}' must be at least 1, got {requested}.", param=field)
        if requested > room:
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens (max_model_len). However, you "
                f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the "
                f"completion). Please reduce the length of the prompt or '{field}'.",
                param=field,
            )
        return requested

    def max_prompt_chars(self) -> int | None:
        """The most characters a text prompt can have and still fit in max_model_len
        tokens: max_model_len times the longest vocabulary entry (4 times that where the
        tokenizer has a normalizer, which may shorten the text); None when the tokenizer
        does not list its vocabulary."""
        if self._max_prompt_chars is None:
            backend = getattr(self.tokenizer, "backend", None)
            vocab = backend.get_vocab(with_added_tokens=True) if hasattr(backend, "get_vocab") else None
            if not vocab:
                self._max_prompt_chars = 0
            else:
                slack = 1 if getattr(backend, "normalizer", None) is None else 4
                self._max_prompt_chars = self.engine.max_model_len * max(len(t) for t in vocab) * slack
        return self._max_prompt_chars or None

    def check_prompt_chars(self, text: str, param: str) -> None:
        """400 for a text prompt too long to fit in max_model_len tokens, before it is
        tokenized (tokenizing megabytes takes seconds)."""
        limit = self.max_prompt_chars()
        if limit is not None and len(text) > limit:
            raise ApiError(
                400,
                f"The prompt has {len(text)} characters: more than can fit in this model's maximum context "
                f"length of {self.engine.max_model_len} tokens (at most {limit} characters). Please reduce the "
                "length of the prompt.",
                param=param,
            )

    @staticmethod
    async def off_loop(chars: int, fn, *args):
        """``fn(*args)``, in a worker thread when ``chars`` (the prompt text's length) is
        at least THREAD_TOKENIZE_CHARS, so that tokenizing it does not stall other requests."""
        if chars < THREAD_TOKENIZE_CHARS:
            return fn(*args)
        return await asyncio.to_thread(fn, *args)

    def validate_prompt(
        self, prompt: str | list[int], param: str, prompt_token_ids: list[int] | None = None
    ) -> tuple[str | None, list[int]]:
        try:
            return self.engine.validate(prompt, prompt_token_ids)
        except ValueError as e:
            raise ApiError(400, str(e), param=param) from None

    # -- engine -------------------------------------------------------------------------------
    @staticmethod
    def new_id(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"

    async def submit(
        self,
        request_id: str,
        prompts: list[tuple[str | None, list[int]]],
        params: list[SamplingParams],
        param: str,
        priority: int = 0,
        cache_salt: str | None = None,
        extra: dict | None = None,
    ) -> list[RequestStream]:
        """Queue every prompt (all or none); engine refusals become HTTP errors.  ``extra``:
        more add_request keywords (an embedding request's pooling_params)."""
        limit = self.engine.queue_capacity
        wanted = sum(sp.n for sp in params)
        if limit is not None and wanted > limit:
            # More sequences than the waiting queue ever holds: no retry can succeed, so this
            # is the request's fault (400), not a full queue (503), and nothing is queued.
            raise ApiError(
                400,
                f"this request asks for {wanted} sequences ({len(prompts)} prompts, n each); the server's "
                f"waiting queue holds at most {limit} (max_queue_len)",
                param="n" if any(sp.n > 1 for sp in params) else param,
            )
        streams: list[RequestStream] = []
        salt = salt_kwargs(self.engine, cache_salt)
        if REQUEST_LORA.get() is not None:
            salt["lora_request"] = REQUEST_LORA.get()
        try:
            for i, ((text, ids), sp) in enumerate(zip(prompts, params)):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                if self.request_logger is not None:
                    self.request_logger.received(rid, text, ids, sp)
                streams.append(
                    await self.engine.add_request(
                        rid, text, sp, prompt_token_ids=ids, priority=priority, **salt, **(extra or {})
                    )
                )
        except BaseException as e:
            for s in streams:
                s.abort()
            if isinstance(e, QueueFullError):
                raise ApiError(503, str(e), code="queue_full", headers={"Retry-After": "1"}) from None
            if isinstance(e, EngineDeadError):
                raise ApiError(503, str(e), code="engine_unavailable") from None
            if isinstance(e, EngineSleepingError):  # sleep mode: POST /wake_up first
                raise ApiError(503, str(e), code="engine_sleeping") from None
            if isinstance(e, ValueError):
                raise ApiError(400, str(e), param=field_named(str(e), param)) from None
            raise
        return streams

    @staticmethod
    async def collect(streams: Sequence[RequestStream]) -> list[RequestOutput]:
        """The final output of every stream (aborting the others if one fails)."""
        finals: list[RequestOutput | None] = [None] * len(streams)
        try:
            async for i, out in merge_streams(streams):
                finals[i] = out
        except (RequestFailedError, EngineDeadError) as e:
            if isinstance(e, RequestFailedError) and "ValueError: structured_outputs" in str(e):
                # The constraint could not be compiled (deadline): the request's fault, not the server's.
                raise ApiError(400, str(e), param="structured_outputs") from None
            raise ApiError(500, str(e), type="internal_server_error") from None
        finally:
            for s in streams:
                s.abort()
        if any(f is None or not f.finished for f in finals):
            raise ApiError(500, "a request ended without a final output", type="internal_server_error")
        return finals  # type: ignore[return-value]

    @staticmethod
    def stream_error(e: Exception) -> str:
        return sse(error_body(str(e), "internal_server_error"))

    @staticmethod
    def finish_reason(reason: str | None) -> str | None:
        # "abort" only reaches a client when the server shuts down under it.
        return "stop" if reason == "abort" else reason

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    @staticmethod
    def created() -> int:
        return int(time.time())

    # -- logprobs -----------------------------------------------------------------------------
    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text

    def top_entries(self, entry: dict[int, Any], top_n: int) -> list[tuple[int, float]]:
        """The `top_n` most likely tokens of one position, best first."""
        ranked = sorted(
            ((r.rank, tid, r.logprob) for tid, r in entry.items() if r.rank is not None and r.rank <= top_n)
        )
        return [(tid, lp) for _, tid, lp in ranked[:top_n]]

    def token_label(self, token_id: int, as_ids: bool | None) -> str:
        """A logprob token as text, or ``token_id:<id>`` (return_tokens_as_token_ids)."""
        return f"token_id:{token_id}" if as_ids else self.token_text(token_id)

    def completion_logprobs(
        self, token_ids: list[int], entries: list[dict[int, Any]], top_n: int, offset: int, as_ids: bool | None = False
    ) -> dict[str, list]:
        """The completions API's logprobs object for these tokens; text_offset starts at `offset`."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, entry in zip(token_ids, entries):
            text = self.token_label(tid, as_ids)
            out["tokens"].append(text)
            out["token_logprobs"].append(clamp_logprob(entry[tid].logprob) if tid in entry else None)
            top: dict[str, float] = {}
            for t, lp in self.top_entries(entry, top_n):
                # Distinct ids can share a text (byte fallbacks all read "\ufffd"): keep the best.
                top.setdefault(self.token_label(t, as_ids), clamp_logprob(lp))
            out["top_logprobs"].append(top)
            out["text_offset"].append(offset)
            offset += len(text)
        return out

    def chat_logprobs(
        self, token_ids: list[int], entries: list[dict[int, Any]], top_n: int, as_ids: bool | None = False
    ) -> list[dict]:
        """The chat API's `logprobs.content` list for these tokens."""
        content = []
        for tid, entry in zip(token_ids, entries):
            text = self.token_label(tid, as_ids)
            content.append(
                {
                    "token": text,
                    "logprob": clamp_logprob(entry[tid].logprob) if tid in entry else _MIN_LOGPROB,
                    "bytes": list(text.encode("utf-8")),
                    "top_logprobs": [
                        {
                            "token": self.token_label(t, as_ids),
                            "logprob": clamp_logprob(lp),
                            "bytes": list(self.token_label(t, as_ids).encode("utf-8")),
                        }
                        for t, lp in self.top_entries(entry, top_n)
                    ],
                }
            )
        return content
