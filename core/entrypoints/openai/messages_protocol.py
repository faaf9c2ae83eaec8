"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens): the request
model, what the server does with each field, and the translation of a request into the
chat-completions request that renders, samples and parses it.

Every top-level field of Anthropic's ``MessageCreateParams`` is in ``MESSAGES_FIELDS``,
honoured or refused; a field in neither list is refused too, as Anthropic's API does.
Content blocks: text, tool_use (assistant), tool_result (user; string or text-block
content) and earlier thinking blocks (left out of the prompt, as Anthropic does); image
and document blocks need a multimodal model, which this server does not run (400).  A
final assistant turn is a prefill: the answer continues it.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict

from pagedserve.entrypoints.openai.errors import ApiError
from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest
from pagedserve.entrypoints.openai.request_fields import HONOURED, REFUSED, Field

__all__ = ["MessagesRequest", "CountTokensRequest", "MESSAGES_FIELDS", "to_chat_request", "thinking_enabled"]

MESSAGES_FIELDS: dict[str, Field] = {
    "model": Field(HONOURED, None, "a served model name (404 otherwise)"),
    "messages": Field(HONOURED, None, "the conversation: user and assistant turns of text, tool_use, tool_result"),
    "max_tokens": Field(HONOURED, None, "tokens to generate at most (required, at least 1)"),
    "system": Field(HONOURED, None, "the system prompt, a string or text blocks"),
    "stop_sequences": Field(HONOURED, None, "strings that end the message (stop_reason stop_sequence)"),
    "stream": Field(HONOURED, False, "Anthropic's server-sent events"),
    "temperature": Field(HONOURED, None, "sampling temperature, [0, 1]"),
    "top_p": Field(HONOURED, None, "nucleus sampling mass, (0, 1]"),
    "top_k": Field(HONOURED, None, "sample among the k most likely tokens"),
    "metadata": Field(HONOURED, None, "user_id, for the operator's logs; no effect on the output"),
    "tools": Field(HONOURED, None, "custom tools with an input_schema (server tools are refused)"),
    "tool_choice": Field(
        HONOURED, None, "auto (needs --enable-auto-tool-choice), any, tool or none; disable_parallel_tool_use"
    ),
    "thinking": Field(HONOURED, None, "enabled/adaptive: thinking blocks from the server's --reasoning-parser"),
    "output_config": Field(HONOURED, None, "format: a json_schema the text follows (effort is refused)"),
    "cache_control": Field(
        HONOURED, None, "ephemeral: prompt prefixes are cached by the KV prefix cache (automatic here)"
    ),
    "service_tier": Field(HONOURED, None, "auto or standard_only: this server has one tier"),
    "speed": Field(HONOURED, None, "standard (fast is refused)"),
    "container": Field(REFUSED, None, "a code-execution container"),
    "diagnostics": Field(REFUSED, None, "request diagnostics"),
    "inference_geo": Field(REFUSED, None, "where inference runs"),
    "user_profile_id": Field(REFUSED, None, "a user profile"),
    "workspace_id": Field(REFUSED, None, "a workspace"),
    "mcp_servers": Field(REFUSED, None, "remote MCP servers"),
    "context_management": Field(REFUSED, None, "server-side context editing"),
}

# Tool fields beyond name, description and input_schema (custom tools only).
_TOOL_REFUSED = ("allowed_callers", "defer_loading", "eager_input_streaming", "input_examples")


class MessagesRequest(BaseModel):
    """POST /v1/messages."""

    # Extra fields are kept so that they can be refused by name.
    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    messages: list[Any]
    max_tokens: int
    system: str | list[Any] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None
    service_tier: str | None = None
    speed: str | None = None


class CountTokensRequest(MessagesRequest):
    """POST /v1/messages/count_tokens: the same fields, no max_tokens needed."""

    max_tokens: int | None = None  # type: ignore[assignment]


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param)


def _text_of_blocks(blocks: Any, where: str) -> str:
    """The text of a string or a list of text blocks."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise _bad(where, f"'{where}' must be a string or a list of text blocks.")
    texts = []
    for j, b in enumerate(blocks):
        at = f"{where}[{j}]"
        if not isinstance(b, dict) or b.get("type") != "text":
            kind = b.get("type") if isinstance(b, dict) else type(b).__name__
            raise _bad(at, f"'{at}': only text blocks are supported here; got {kind!r}.")
        _check_block_fields(b, at, ("type", "text"))
        if not isinstance(b.get("text"), str):
            raise _bad(f"{at}.text", f"'{at}.text' must be a string.")
        texts.append(b["text"])
    return "\n".join(texts)


def _check_block_fields(block: dict, where: str, known: tuple[str, ...]) -> None:
    """400 for a block field this server does not act on (cache_control is accepted)."""
    for key, value in block.items():
        if key in known or key == "cache_control" or value is None:
            continue
        if key == "citations" and not value:
            continue
        raise _bad(f"{where}.{key}", f"'{where}.{key}' is not supported by this server.")


def _media_block(kind: str, where: str) -> ApiError:
    return _bad(where, f"'{where}': {kind} blocks need a multimodal model; this server's model takes text only.")


def _chat_messages(request: MessagesRequest) -> list[dict]:
    out: list[dict] = []
    if request.system is not None:
        text = _text_of_blocks(request.system, "system")
        if text:
            out.append({"role": "system", "content": text})
    if not request.messages:
        raise _bad("messages", "'messages' must contain at least one message.")
    for i, m in enumerate(request.messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise _bad(f"{where}.role", f"'{where}.role' must be 'user' or 'assistant'.")
        extra = set(m) - {"role", "content"}
        if extra:
            key = sorted(extra)[0]
            raise _bad(f"{where}.{key}", f"'{where}.{key}' is not a message field.")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise _bad(f"{where}.content", f"'{where}.content' must be a string or a list of content blocks.")
        if m["role"] == "user":
            out.extend(_user_blocks(content, f"{where}.content"))
        else:
            out.append(_assistant_blocks(content, f"{where}.content"))
    return out


def _user_blocks(blocks: list, where: str) -> list[dict]:
    """tool_result blocks become tool turns (first, as the calls they answer came last);
    the text and image blocks one user turn (images as chat image_url parts, which the
    chat layer checks and refuses for a text-only model)."""
    tools, texts, parts = [], [], []
    for j, b in enumerate(blocks):
        at = f"{where}[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            texts.append(_text_of_blocks([b], where))
            parts.append({"type": "text", "text": texts[-1]})
        elif kind == "image":
            parts.append({"type": "image_url", "image_url": {"url": _image_source_url(b, at)}})
        elif kind == "tool_result":
            _check_block_fields(b, at, ("type", "tool_use_id", "content", "is_error"))
            if not isinstance(b.get("tool_use_id"), str):
                raise _bad(f"{at}.tool_use_id", f"'{at}.tool_use_id' must be a string.")
            result = b.get("content", "")
            text = "" if result is None else _text_of_blocks(result, f"{at}.content")
            if b.get("is_error"):
                text = f"Error: {text}"
            tools.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": text})
        elif kind == "document":
            raise _media_block(kind, at)
        else:
            raise _bad(at, f"'{at}': content blocks of type {kind!r} are not supported in a user turn.")
    if len(parts) > len(texts):  # with images: the parts in order
        return [*tools, {"role": "user", "content": parts}]
    return tools + ([{"role": "user", "content": "\n".join(texts)}] if texts else [])


def _image_source_url(block: dict, where: str) -> str:
    """An Anthropic image block's source as a chat image URL: base64 data as a data URI,
    a URL as it is (remote URLs are refused later: nothing is fetched)."""
    _check_block_fields(block, where, ("type", "source"))
    src = block.get("source")
    kind = src.get("type") if isinstance(src, dict) else None
    if kind == "base64" and isinstance(src.get("media_type"), str) and isinstance(src.get("data"), str):
        return f"data:{src['media_type']};base64,{src['data']}"
    if kind == "url" and isinstance(src.get("url"), str):
        return src["url"]
    raise _bad(f"{where}.source", f"'{where}.source' must be a base64 or url image source.")


def _assistant_blocks(blocks: list, where: str) -> dict:
    texts, calls = [], []
    for j, b in enumerate(blocks):
        at = f"{where}[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            texts.append(_text_of_blocks([b], where))
        elif kind == "tool_use":
            _check_block_fields(b, at, ("type", "id", "name", "input"))
            if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                raise _bad(at, f"'{at}' must have a string 'id' and 'name'.")
            if not isinstance(b.get("input"), dict):
                raise _bad(f"{at}.input", f"'{at}.input' must be an object.")
            calls.append(
                {
                    "id": b["id"],
                    "type": "function",
                    "function": {"name": b["name"], "arguments": json.dumps(b["input"], ensure_ascii=False)},
                }
            )
        elif kind in ("thinking", "redacted_thinking"):
            continue  # earlier reasoning is not shown to the model again
        elif kind in ("image", "document"):
            raise _media_block(kind, at)
        else:
            raise _bad(at, f"'{at}': content blocks of type {kind!r} are not supported in an assistant turn.")
    msg: dict = {"role": "assistant", "content": "".join(texts)}
    if calls:
        msg["tool_calls"] = calls
    return msg


def _chat_tools(tools: list | None) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("tools", "'tools' must be a list.")
    out = []
    for i, t in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(t, dict):
            raise _bad(at, f"'{at}' must be an object.")
        if t.get("type") not in (None, "custom"):
            raise _bad(f"{at}.type", f"'{at}': server tool {t.get('type')!r} is not supported; only custom tools are.")
        for key in _TOOL_REFUSED:
            if t.get(key) not in (None, False, [], {}):
                raise _bad(f"{at}.{key}", f"'{at}.{key}' is not supported by this server.")
        unknown = set(t) - {"type", "name", "description", "input_schema", "cache_control", "strict", *_TOOL_REFUSED}
        if unknown:
            key = sorted(unknown)[0]
            raise _bad(f"{at}.{key}", f"'{at}.{key}' is not a tool field.")
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise _bad(f"{at}.name", f"'{at}.name' must be a non-empty string.")
        schema = t.get("input_schema")
        if not isinstance(schema, dict):
            raise _bad(f"{at}.input_schema", f"'{at}.input_schema' must be a JSON schema object.")
        fn: dict = {"name": t["name"], "parameters": schema}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(request: MessagesRequest) -> tuple[Any, bool | None]:
    """(chat tool_choice, parallel_tool_calls) of Anthropic's tool_choice."""
    choice = request.tool_choice
    if choice is None:
        return None, None
    kind = choice.get("type")
    known = {"type", "disable_parallel_tool_use"} | ({"name"} if kind == "tool" else set())
    if set(choice) - known:
        key = sorted(set(choice) - known)[0]
        raise _bad(f"tool_choice.{key}", f"'tool_choice.{key}' is not a field of a {kind!r} tool choice.")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", None
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise _bad("tool_choice.name", "'tool_choice.name' must name a tool.")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise _bad("tool_choice.type", f"'tool_choice.type' must be auto, any, tool or none; got {kind!r}.")


def thinking_enabled(request: MessagesRequest, reasoning_parser: str | None) -> bool:
    """Whether the request asks for thinking; 400 when the server cannot split it off."""
    t = request.thinking
    if t is None:
        return False
    kind = t.get("type")
    if kind == "disabled":
        return False
    if kind not in ("enabled", "adaptive"):
        raise _bad("thinking.type", f"'thinking.type' must be enabled, adaptive or disabled; got {kind!r}.")
    if reasoning_parser is None:
        raise _bad(
            "thinking",
            "'thinking' needs a reasoning model served with --reasoning-parser (or GPT-OSS with --tool-call-parser "
            "openai).",
        )
    if t.get("display") not in (None, "summarized"):
        raise _bad("thinking.display", "'thinking.display' may only be 'summarized' (the thinking is returned).")
    if kind == "enabled":
        budget = t.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
            raise _bad("thinking.budget_tokens", "'thinking.budget_tokens' must be a positive integer.")
        if request.max_tokens is not None and budget >= request.max_tokens:
            raise _bad("thinking.budget_tokens", "'thinking.budget_tokens' must be less than 'max_tokens'.")
    return True


def _refuse_fields(request: MessagesRequest) -> None:
    for name in request.model_extra or {}:
        f = MESSAGES_FIELDS.get(name)
        what = f" ({f.meaning})" if f is not None else ""
        raise _bad(name, f"'{name}'{what} is not supported by this server.")
    if request.temperature is not None and not 0.0 <= request.temperature <= 1.0:
        raise _bad("temperature", f"'temperature' must be between 0 and 1, got {request.temperature}.")
    if request.top_k is not None and request.top_k < 0:
        raise _bad("top_k", f"'top_k' must be at least 0, got {request.top_k}.")
    if request.metadata is not None and set(request.metadata) - {"user_id"}:
        key = sorted(set(request.metadata) - {"user_id"})[0]
        raise _bad(f"metadata.{key}", f"'metadata.{key}' is not a metadata field (only user_id is).")
    if request.cache_control is not None and request.cache_control.get("type") != "ephemeral":
        raise _bad("cache_control", "'cache_control.type' must be 'ephemeral'.")
    if request.service_tier not in (None, "auto", "standard_only"):
        raise _bad("service_tier", "'service_tier' must be auto or standard_only.")
    if request.speed not in (None, "standard"):
        raise _bad("speed", f"'speed' {request.speed!r} is not supported: this server runs at one speed, standard.")


def _response_format(config: dict | None) -> dict | None:
    if config is None:
        return None
    if config.get("effort") is not None:
        raise _bad("output_config.effort", "'output_config.effort' is not supported by this server.")
    if set(config) - {"effort", "format"}:
        key = sorted(set(config) - {"effort", "format"})[0]
        raise _bad(f"output_config.{key}", f"'output_config.{key}' is not supported by this server.")
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise _bad("output_config.format", "'output_config.format' must be a json_schema format with a 'schema'.")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def to_chat_request(request: MessagesRequest, reasoning_parser: str | None) -> ChatCompletionRequest:
    """The chat-completions request that renders, samples and parses ``request``; 400s name
    the Anthropic field."""
    _refuse_fields(request)
    thinking = thinking_enabled(request, reasoning_parser)
    choice, parallel = _chat_tool_choice(request)
    tools = _chat_tools(request.tools)
    if choice is not None and not tools:
        raise _bad("tool_choice", "'tool_choice' needs 'tools'.")
    body: dict[str, Any] = {
        "model": request.model,
        "messages": _chat_messages(request),
        "max_tokens": request.max_tokens,
        "stop": request.stop_sequences or None,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "stream": request.stream,
        "tools": tools or None,
        "tool_choice": choice,
        "parallel_tool_calls": parallel,
        "response_format": _response_format(request.output_config),
    }
    last = body["messages"][-1]
    if last["role"] == "assistant":
        # A final assistant turn is a prefill: the answer continues it.
        if last.get("tool_calls"):
            where = f"messages[{len(request.messages) - 1}]"
            raise _bad(where, f"'{where}': a final assistant turn with tool_use blocks cannot be continued.")
        body["continue_final_message"], body["add_generation_prompt"] = True, False
    if reasoning_parser is not None:
        # Templates of reasoning models read enable_thinking (others ignore it).
        body["chat_template_kwargs"] = {"enable_thinking": thinking}
    return ChatCompletionRequest.model_validate(body)
