"""POST /v1/chat/completions: render the conversation with the chat template, generate,
answer with a chat.completion object or chat.completion.chunk SSE events."""

from __future__ import annotations

from collections.abc import AsyncIterator

from pagedserve.async_engine import EngineDeadError, RequestFailedError, RequestStream
from pagedserve.entrypoints.openai.errors import ApiError
from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest, chat_messages, to_sampling_params
from pagedserve.entrypoints.openai.serving_base import SSE_DONE, EventStream, OpenAIServing, sse
from pagedserve.entrypoints.openai.chat_tools import ChatToolsMixin

__all__ = ["OpenAIServingChat"]


class OpenAIServingChat(ChatToolsMixin, OpenAIServing):
    def render(self, request: ChatCompletionRequest) -> tuple[str, list[int]]:
        """The prompt text and token ids of the conversation."""
        messages = chat_messages(request.messages)
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=request.add_generation_prompt,
                                                      chat_template=self.chat_template,
                                                      **self.template_kwargs(request))
        except ValueError as e:  # no template, or it raised (e.g. roles out of order)
            raise ApiError(400, str(e), param="messages") from None
        # The template already wrote any BOS it wants.
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return self.validate_prompt(text, "messages", prompt_token_ids=ids)

    async def create(self, request: ChatCompletionRequest) -> dict | EventStream:
        model = self.model_name(request.model)
        text, ids = self.render(request)
        field = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        requested = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        params = to_sampling_params(request, self.resolve_max_tokens(requested, len(ids), None, field))
        self.constrain_tools(request, params)
        request_id = self.new_id("chatcmpl")
        streams = await self.submit(request_id, [(text, ids)], [params], "messages")
        if request.stream:
            return EventStream(self._stream(request, request_id, model, streams[0]), streams)
        return self._whole(request, request_id, model, (await self.collect(streams))[0])

    def _logprobs(self, request: ChatCompletionRequest, token_ids, entries) -> dict | None:
        if not request.logprobs or entries is None:
            return None
        return {"content": self.chat_logprobs(token_ids, entries, request.top_logprobs or 0)}

    def _whole(self, request: ChatCompletionRequest, request_id: str, model: str, out) -> dict:
        shaper = self.chat_output(request)
        choices = []
        for c in out.outputs:
            message, finish = shaper.message(c.text, self.finish_reason(c.finish_reason))
            choices.append({"index": c.index, "message": message,
                            "logprobs": self._logprobs(request, c.token_ids, c.logprobs),
                            "finish_reason": finish, "stop_reason": c.stop_reason})
        completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        return {"id": request_id, "object": "chat.completion", "created": self.created(), "model": model,
                "choices": choices, "usage": self.usage(len(out.prompt_token_ids), completion_tokens)}

    async def _stream(self, request: ChatCompletionRequest, request_id: str, model: str,
                      stream: RequestStream) -> AsyncIterator[str]:
        created = self.created()
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        shaper = self.chat_output(request)
        states = [shaper.stream() for _ in range(request.n)]
        sent_tokens = [0] * request.n
        prompt_tokens = 0

        def chunk(choices: list[dict], usage: dict | None = None) -> str:
            body = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": choices}
            if include_usage:
                body["usage"] = usage
            return sse(body)

        try:
            # OpenAI opens every choice with the assistant role and empty content.
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for i in range(request.n)])
            async for out in stream:
                prompt_tokens = len(out.prompt_token_ids)
                choices = []
                for c in out.outputs:
                    i = c.index
                    new_ids = c.token_ids[sent_tokens[i]:]
                    finish = self.finish_reason(c.finish_reason)
                    delta = states[i].delta(c.text, finish is not None, finish)
                    if finish is not None:
                        finish = shaper.finish_reason(finish, states[i].called)
                    if not delta and finish is None and not (new_ids and request.logprobs):
                        continue
                    logprobs = self._logprobs(request, new_ids,
                                              None if c.logprobs is None else c.logprobs[sent_tokens[i]:])
                    sent_tokens[i] = len(c.token_ids)
                    choices.append({"index": i, "delta": delta,
                                    "logprobs": logprobs, "finish_reason": finish,
                                    "stop_reason": c.stop_reason if finish else None})
                if choices:
                    yield chunk(choices)
            if include_usage:
                yield chunk([], self.usage(prompt_tokens, sum(sent_tokens)))
        except (RequestFailedError, EngineDeadError) as e:
            yield self.stream_error(e)
        finally:
            stream.abort()
        yield SSE_DONE
