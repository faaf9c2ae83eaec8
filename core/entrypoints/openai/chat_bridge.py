"""Run a request of another API (Responses, Anthropic Messages) as a chat completion.

The other API converts its body into a chat-completions body; `start_chat` sends that
through the chat endpoint's own path (chat template, tools and tool_choice constraints,
structured outputs, generation defaults, context limits, submission), so both answer
exactly what /v1/chat/completions would.  The caller shapes the engine's outputs with
``run.shaper`` (reasoning split, tool-call parsing).  Errors keep the chat layer's
status and text with the fields renamed into the caller's API (``rename``).
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import ValidationError

from pagedserve.async_engine import RequestStream
from pagedserve.entrypoints.openai.chat_output import ChatOutput
from pagedserve.entrypoints.openai.errors import ApiError
from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest, to_sampling_params
from pagedserve.entrypoints.openai.serving_chat import OpenAIServingChat

__all__ = ["ChatRun", "start_chat", "renamed_error"]


@dataclass
class ChatRun:
    request: ChatCompletionRequest
    request_id: str
    prompt_token_ids: list[int]
    stream: RequestStream
    shaper: ChatOutput


def renamed_error(e: ApiError, rename: dict[str, str]) -> ApiError:
    """``e`` with its param (and the quoted field names in its message) in the caller's API.
    ``rename`` maps a chat field (or a prefix such as ``messages``) to the caller's."""
    param, message = e.param, e.message
    for chat_name, name in rename.items():
        if param is not None and (param == chat_name or param.startswith((chat_name + ".", chat_name + "["))):
            param = name if chat_name == "messages" else name + param[len(chat_name) :]
        message = message.replace(f"'{chat_name}'", f"'{name}'")
    return ApiError(e.status, message, param=param, code=e.code, type=e.type, headers=e.headers)


async def start_chat(chat: OpenAIServingChat, body: dict, request_id: str, rename: dict[str, str]) -> ChatRun:
    """Queue ``body`` (a chat-completions body, n=1) on the engine; ApiError as chat would."""
    try:
        try:
            request = ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            err = e.errors(include_url=False)[0]
            where = ".".join(str(p) for p in err["loc"])
            raise ApiError(400, f"Invalid value for '{where}': {err['msg']}.", param=where) from None
        chat.model_name(request.model)  # sets the request's LoRA adapter, if the name is one
        # Images are decoded and processed off the event loop, as for chat completions.
        chars = sum(len(m.content) if isinstance(m.content, str) else len(str(m.content)) for m in request.messages)
        text, ids, images = await chat.off_loop(chars, chat.render_with_images, request)
        max_tokens = chat.resolve_max_tokens(
            request.max_completion_tokens, len(ids), chat.generation_defaults.get("max_tokens"), "max_completion_tokens"
        )
        params = to_sampling_params(request, max_tokens, chat.generation_defaults)
        chat.constrain_tools(request, params)
        extra = {"multi_modal_data": images} if images else None
        (stream,) = await chat.submit(request_id, [(text, ids)], [params], "messages", extra=extra)
    except ApiError as e:
        raise renamed_error(e, rename) from None
    return ChatRun(request, request_id, ids, stream, chat.chat_output(request))
