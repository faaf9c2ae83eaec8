"""POST /v1/chat/completions: render the conversation with the chat template, generate,
answer with a chat.completion object or chat.completion.chunk SSE events."""

from __future__ import annotations

from collections.abc import AsyncIterator

from pagedserve.async_engine import EngineDeadError, RequestFailedError, RequestStream
from pagedserve.engine.request_options import truncate_prompt
from pagedserve.entrypoints.openai.chat_tools import ChatToolsMixin
from pagedserve.entrypoints.openai.errors import ApiError
from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest, chat_messages, to_sampling_params
from pagedserve.entrypoints.openai.serving_base import SSE_DONE, EventStream, OpenAIServing, sse
from pagedserve.entrypoints.openai.serving_beam import beam_search_response
from pagedserve.entrypoints.openai.serving_fields import (
    chat_prompt_text,
    echo_prefix,
    prompt_logprobs_json,
    response_id,
)
from pagedserve.entrypoints.openai.tools import ToolOptions
from pagedserve.multimodal.chat import chat_media, has_image_parts
from pagedserve.multimodal.limits import MediaLimits
from pagedserve.multimodal.processor import MultiModalInputs

__all__ = ["OpenAIServingChat"]


class OpenAIServingChat(ChatToolsMixin, OpenAIServing):
    def __init__(self, *args, tool_options: ToolOptions | None = None, **kwargs) -> None:
        """`OpenAIServing`'s arguments, and the tool-call options (--tool-call-parser ...)."""
        super().__init__(*args, **kwargs)
        if tool_options is not None:
            # --tool-call-parser auto: the parser the chat template's format calls for.
            self.tool_options = tool_options.resolved(self.chat_template or self.tokenizer.chat_template)

    def render(self, request: ChatCompletionRequest) -> tuple[str, list[int]]:
        """The prompt text and token ids of the conversation."""
        text, ids, _ = self.render_with_images(request)
        return text, ids

    def mm_processor(self):
        """The engine's image processor (a vision-language model with images on), else None."""
        inner = getattr(self.engine, "engine", None)  # the LLMEngine behind an AsyncLLMEngine
        return getattr(getattr(inner, "input_processor", None), "mm_processor", None)

    def image_messages(self, request: ChatCompletionRequest) -> tuple[list, list]:
        """(the messages with each image part as the model's placeholder text, the
        images in order); a 400 naming the part of a bad image."""
        messages, images, _ = self.media_messages(request)
        return messages, images

    def media_messages(self, request: ChatCompletionRequest) -> tuple[list, list, list]:
        """(the messages with each image and video part as the model's placeholder text,
        the images in order, the videos in order); a 400 naming the part of a bad one."""
        messages = list(request.messages or ())
        if not has_image_parts([m.content for m in messages]):
            return messages, [], []
        mm = self.mm_processor()
        try:
            converted, images, videos = chat_media(
                [{"content": m.content} for m in messages],
                mm.limits if mm is not None else MediaLimits(),
                mm.placeholder if mm is not None else None,
                mm.video_placeholder if mm is not None else None,
            )
        except ValueError as e:
            where = str(e).split("'")[1] if str(e).startswith("'") else "messages"
            raise ApiError(400, str(e), param=where) from None
        updated = [m.model_copy(update={"content": c["content"]}) for m, c in zip(messages, converted)]
        return updated, images, videos

    def render_with_images(self, request: ChatCompletionRequest) -> tuple[str, list[int], MultiModalInputs | None]:
        """The prompt text and token ids of the conversation; with images, the ids are
        the processor's (placeholders expanded) and the images come processed."""
        plain, images, videos = self.media_messages(request)
        messages = chat_messages(plain)
        text = chat_prompt_text(self.tokenizer, request, messages, self.chat_template, self.template_kwargs(request))
        self.check_prompt_chars(text, "messages")
        if images or videos:
            if request.truncate_prompt_tokens is not None:
                raise ApiError(
                    400, "truncate_prompt_tokens cannot be combined with images.", param="truncate_prompt_tokens"
                )
            # The processor runs here, on the request's worker thread, not on the engine's.
            try:
                ids, items = self.mm_processor().process(text, images, bool(request.add_special_tokens), videos=videos)
            except ValueError as e:
                raise ApiError(400, str(e), param="messages") from None
            text, ids = self.validate_prompt(text, "messages", prompt_token_ids=ids)
            return text, ids, MultiModalInputs(ids, items)
        # The template already wrote any BOS it wants (unless add_special_tokens says otherwise).
        ids = self.tokenizer.encode(text, add_special_tokens=bool(request.add_special_tokens))
        kept = truncate_prompt(ids, request.truncate_prompt_tokens)
        if len(kept) < len(ids):
            text, ids = self.tokenizer.decode(kept, skip_special_tokens=False), kept
        return (*self.validate_prompt(text, "messages", prompt_token_ids=ids), None)

    async def create(self, request: ChatCompletionRequest) -> dict | EventStream:
        model = self.model_name(request.model)
        chars = sum(
            len(m.content) if isinstance(m.content, str) else len(str(m.content)) for m in request.messages or ()
        )
        text, ids, images = await self.off_loop(chars, self.render_with_images, request)
        field = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        requested = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        d = self.generation_defaults
        params = to_sampling_params(
            request, self.resolve_max_tokens(requested, len(ids), d.get("max_tokens"), field), d
        )
        self.constrain_tools(request, params)
        request_id = response_id("chatcmpl", request, self.new_id("chatcmpl"))
        if request.use_beam_search:
            if images:
                raise ApiError(400, "use_beam_search cannot be combined with images yet.", param="use_beam_search")
            return await beam_search_response(self, request, request_id, model, [(text, ids)], [params], chat=True)
        extra = {"multi_modal_data": images} if images else None
        streams = await self.submit(
            request_id, [(text, ids)], [params], "messages", request.priority, request.cache_salt, extra
        )
        # (Only an echoed message's text is read: images are not decoded a second time.)
        echo = echo_prefix(request, chat_messages(self.image_messages(request)[0])) if request.echo else ""
        if request.stream:
            return EventStream(self._stream(request, request_id, model, streams[0], echo), streams)
        return self._whole(request, request_id, model, (await self.collect(streams))[0], echo)

    def _logprobs(self, request: ChatCompletionRequest, token_ids, entries) -> dict | None:
        if not request.logprobs or entries is None:
            return None
        return {
            "content": self.chat_logprobs(
                token_ids, entries, request.top_logprobs or 0, request.return_tokens_as_token_ids
            )
        }

    def _whole(self, request: ChatCompletionRequest, request_id: str, model: str, out, echo: str = "") -> dict:
        shaper = self.chat_output(request)
        choices = []
        for c in out.outputs:
            message, finish = shaper.message(c.text, self.finish_reason(c.finish_reason))
            if echo:
                message["content"] = echo + (message.get("content") or "")
            choices.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": self._logprobs(request, c.token_ids, c.logprobs),
                    "finish_reason": finish,
                    "stop_reason": c.stop_reason,
                }
            )
        completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        body = {
            "id": request_id,
            "object": "chat.completion",
            "created": self.created(),
            "model": model,
            "choices": choices,
            "usage": self.usage(len(out.prompt_token_ids), completion_tokens),
        }
        if request.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs, self.token_text)
        return body

    async def _stream(
        self, request: ChatCompletionRequest, request_id: str, model: str, stream: RequestStream, echo: str = ""
    ) -> AsyncIterator[str]:
        created = self.created()
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        shaper = self.chat_output(request)
        states = [shaper.stream() for _ in range(request.n)]
        continuous = include_usage and request.stream_options.continuous_usage_stats
        sent_tokens = [0] * request.n
        prompt_tokens = 0

        def chunk(choices: list[dict], usage: dict | None = None) -> str:
            body = {
                "id": request_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": choices,
            }
            if include_usage:
                if usage is None and continuous:
                    usage = self.usage(prompt_tokens, sum(sent_tokens))
                body["usage"] = usage
            return sse(body)

        try:
            # OpenAI opens every choice with the assistant role and empty content.
            yield chunk(
                [
                    {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                    for i in range(request.n)
                ]
            )
            if echo:
                yield chunk(
                    [
                        {"index": i, "delta": {"content": echo}, "logprobs": None, "finish_reason": None}
                        for i in range(request.n)
                    ]
                )
            async for out in stream:
                prompt_tokens = len(out.prompt_token_ids)
                choices = []
                for c in out.outputs:
                    i = c.index
                    new_ids = c.token_ids[sent_tokens[i] :]
                    finish = self.finish_reason(c.finish_reason)
                    delta = states[i].delta(c.text, finish is not None, finish)
                    if finish is not None:
                        finish = shaper.finish_reason(finish, states[i].called)
                    if not delta and finish is None and not (new_ids and request.logprobs):
                        continue
                    logprobs = self._logprobs(
                        request, new_ids, None if c.logprobs is None else c.logprobs[sent_tokens[i] :]
                    )
                    sent_tokens[i] = len(c.token_ids)
                    choices.append(
                        {
                            "index": i,
                            "delta": delta,
                            "logprobs": logprobs,
                            "finish_reason": finish,
                            "stop_reason": c.stop_reason if finish else None,
                        }
                    )
                if choices:
                    yield chunk(choices)
            if include_usage:
                yield chunk([], self.usage(prompt_tokens, sum(sent_tokens)))
        except (RequestFailedError, EngineDeadError) as e:
            yield self.stream_error(e)
        finally:
            stream.abort()
        yield SSE_DONE
