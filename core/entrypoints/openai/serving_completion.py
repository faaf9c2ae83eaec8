"""POST /v1/completions: one engine request per prompt, answered whole or as SSE chunks."""

from __future__ import annotations

from collections.abc import AsyncIterator

from pagedserve.async_engine import EngineDeadError, RequestFailedError, RequestStream
from pagedserve.entrypoints.openai.protocol import CompletionRequest, normalize_prompts, to_sampling_params
from pagedserve.entrypoints.openai.serving_base import SSE_DONE, EventStream, OpenAIServing, merge_streams, sse
from pagedserve.entrypoints.openai.serving_beam import beam_search_response
from pagedserve.entrypoints.openai.serving_fields import completion_prompt, prompt_logprobs_json, response_id

__all__ = ["OpenAIServingCompletion"]

_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the completions API


class OpenAIServingCompletion(OpenAIServing):
    async def create(self, request: CompletionRequest) -> dict | EventStream:
        """A completion object, or an async iterator of SSE lines when `stream` is set."""
        model = self.model_name(request.model)
        raw = normalize_prompts(request.prompt)
        chars = 0
        for p in raw:
            if isinstance(p, str):
                self.check_prompt_chars(p + (request.suffix or ""), "prompt")
                chars += len(p) + len(request.suffix or "")
        prompts = await self.off_loop(chars, self._prompts, request, raw)
        d = self.generation_defaults
        default_max = min(_DEFAULT_MAX_TOKENS, d.get("max_tokens", _DEFAULT_MAX_TOKENS))
        params = [
            to_sampling_params(request, self.resolve_max_tokens(request.max_tokens, len(ids), default_max), d)
            for _, ids in prompts
        ]
        request_id = response_id("cmpl", request, self.new_id("cmpl"))
        if request.use_beam_search:
            return await beam_search_response(self, request, request_id, model, prompts, params, chat=False)
        streams = await self.submit(request_id, prompts, params, "prompt", request.priority, request.cache_salt)
        if request.stream:
            return EventStream(self._stream(request, request_id, model, streams), streams)
        return self._whole(request, request_id, model, await self.collect(streams))

    def _prompts(self, request: CompletionRequest, raw: list) -> list[tuple[str | None, list[int]]]:
        """(text, token ids) of every prompt, checked."""
        prompts = []
        for p in raw:
            text, ids = completion_prompt(self.tokenizer, request, p)
            prompts.append(self.validate_prompt(text, "prompt", prompt_token_ids=ids))
        return prompts

    def _echo(self, request: CompletionRequest, out) -> tuple[str, list[int], list[dict]]:
        """(text, token ids, logprob entries) echoed before a completion: the prompt, or nothing."""
        if not request.echo:
            return "", [], []
        text = (
            out.prompt
            if out.prompt is not None
            else self.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)
        )
        entries = [e or {} for e in (out.prompt_logprobs or [])]
        return text, list(out.prompt_token_ids), entries

    def _choice_logprobs(self, request: CompletionRequest, out, c, echo, done_tokens: int, offset: int):
        if request.logprobs is None or c.logprobs is None:
            return None
        ids, entries = c.token_ids[done_tokens:], c.logprobs[done_tokens:]
        if echo is not None:
            ids, entries = echo[1] + ids, echo[2] + entries
        return self.completion_logprobs(ids, entries, request.logprobs, offset, request.return_tokens_as_token_ids)

    def _whole(self, request: CompletionRequest, request_id: str, model: str, finals) -> dict:
        n = request.n
        choices = []
        prompt_tokens = completion_tokens = 0
        for i, out in enumerate(finals):
            prompt_tokens += len(out.prompt_token_ids)
            echo = self._echo(request, out)
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                logprobs = self._choice_logprobs(request, out, c, echo, 0, 0)
                choices.append(
                    {
                        "index": i * n + c.index,
                        "text": echo[0] + c.text,
                        "logprobs": logprobs,
                        "finish_reason": self.finish_reason(c.finish_reason),
                        "stop_reason": c.stop_reason,
                        "prompt_logprobs": prompt_logprobs_json(
                            out.prompt_logprobs if request.prompt_logprobs is not None else None, self.token_text
                        ),
                    }
                )
        choices.sort(key=lambda c: c["index"])
        return {
            "id": request_id,
            "object": "text_completion",
            "created": self.created(),
            "model": model,
            "choices": choices,
            "usage": self.usage(prompt_tokens, completion_tokens),
        }

    async def _stream(
        self, request: CompletionRequest, request_id: str, model: str, streams: list[RequestStream]
    ) -> AsyncIterator[str]:
        n = request.n
        created = self.created()
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        continuous = include_usage and request.stream_options.continuous_usage_stats
        sent_text: dict[int, int] = {}  # choice index -> characters sent
        sent_tokens: dict[int, int] = {}
        echo_chars: dict[int, int] = {}  # choice index -> characters of echoed prompt
        prompt_tokens: dict[int, int] = {}

        def chunk(choices: list[dict], usage: dict | None = None) -> str:
            body = {
                "id": request_id,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": choices,
            }
            if include_usage:
                if usage is None and continuous:
                    usage = self.usage(sum(prompt_tokens.values()), sum(sent_tokens.values()))
                body["usage"] = usage
            return sse(body)

        try:
            async for i, out in merge_streams(streams):
                prompt_tokens[i] = len(out.prompt_token_ids)
                choices = []
                for c in out.outputs:
                    index = i * n + c.index
                    done_chars = sent_text.get(index, 0)
                    done_tokens = sent_tokens.get(index, 0)
                    delta = c.text[done_chars:]
                    new_ids = c.token_ids[done_tokens:]
                    finish = self.finish_reason(c.finish_reason)
                    if not delta and finish is None and not (new_ids and request.logprobs is not None):
                        continue
                    # The echoed prompt goes out with a choice's first chunk.
                    echo = self._echo(request, out) if index not in sent_text else None
                    if echo is not None:
                        echo_chars[index] = len(echo[0])
                    logprobs = self._choice_logprobs(
                        request, out, c, echo, done_tokens, 0 if echo is not None else done_chars + echo_chars[index]
                    )
                    if echo is not None:
                        delta = echo[0] + delta
                    sent_text[index] = len(c.text)
                    sent_tokens[index] = len(c.token_ids)
                    choices.append(
                        {
                            "index": index,
                            "text": delta,
                            "logprobs": logprobs,
                            "finish_reason": finish,
                            "stop_reason": c.stop_reason if finish else None,
                        }
                    )
                if choices:
                    yield chunk(choices)
            if include_usage:
                yield chunk([], self.usage(sum(prompt_tokens.values()), sum(sent_tokens.values())))
        except (RequestFailedError, EngineDeadError) as e:
            yield self.stream_error(e)
        finally:
            for s in streams:
                s.abort()
        yield SSE_DONE
