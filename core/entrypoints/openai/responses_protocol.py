"""The request of POST /v1/responses and its translation into a chat-completions body.

Every field of OpenAI's ``ResponseCreateParams`` is listed in `RESPONSES_FIELDS` as
honoured or refused; a refused field set to anything but its default is a 400 naming it.
Fields in no list are ignored, as on the other endpoints.

Input items become chat messages: a ``message`` item keeps its role (``developer`` is a
system turn) and its text parts, and a user message its ``input_image`` parts (as chat
``image_url`` parts: a data URI or an allowed file URL; ``detail`` "auto" only);
``function_call`` items become the ``tool_calls`` of an
assistant turn (consecutive calls share one turn, after any assistant text before them);
a ``function_call_output`` is a ``tool`` turn answering its ``call_id``; ``reasoning``
items of earlier output are left out of the prompt, as chat templates leave out earlier
turns' reasoning.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel, ConfigDict

from pagedserve.entrypoints.openai.errors import ApiError
from pagedserve.entrypoints.openai.request_fields import HONOURED, REFUSED, Field, refuse_unimplemented
from pagedserve.entrypoints.openai.structured import checked_params

__all__ = [
    "ResponsesRequest",
    "RESPONSES_FIELDS",
    "LOGPROBS_INCLUDE",
    "chat_body",
    "items_of",
    "check_request",
    "located",
]

LOGPROBS_INCLUDE = "message.output_text.logprobs"

RESPONSES_FIELDS: dict[str, Field] = {
    "model": Field(HONOURED, None, "a served model name (404 otherwise)"),
    "input": Field(HONOURED, None, "a string (one user message) or a list of input items"),
    "instructions": Field(HONOURED, None, "a system message before the input (not inherited by later responses)"),
    "max_output_tokens": Field(HONOURED, None, "tokens to generate at most; hitting it makes the response incomplete"),
    "temperature": Field(HONOURED, None, "sampling temperature, [0, 2] (0 = greedy)"),
    "top_p": Field(HONOURED, None, "nucleus sampling mass, (0, 1]"),
    "tools": Field(HONOURED, None, "function tools (other tool types: 400)"),
    "tool_choice": Field(HONOURED, None, "none, auto (needs --enable-auto-tool-choice), required or a function"),
    "parallel_tool_calls": Field(HONOURED, None, "false: at most one function call"),
    "text": Field(HONOURED, None, "format: text, json_object or json_schema (structured outputs); verbosity medium"),
    "reasoning": Field(
        HONOURED, None, "effort: the chat template's reasoning_effort; summary: auto (no summarizer: none)"
    ),
    "include": Field(HONOURED, None, f"{LOGPROBS_INCLUDE} only"),
    "top_logprobs": Field(HONOURED, None, f"alternatives per token (0-20) with {LOGPROBS_INCLUDE}"),
    "store": Field(HONOURED, True, "keep the response for GET, input_items and previous_response_id"),
    "stream": Field(HONOURED, False, "server-sent events"),
    "stream_options": Field(HONOURED, None, "include_obfuscation: a random 'obfuscation' field on delta events"),
    "previous_response_id": Field(HONOURED, None, "continue the conversation of a stored response"),
    "metadata": Field(HONOURED, None, "up to 16 string pairs, stored and echoed"),
    "user": Field(HONOURED, None, "end-user id, echoed; no effect on the output"),
    "safety_identifier": Field(HONOURED, None, "end-user id, echoed; no effect on the output"),
    "prompt_cache_key": Field(
        HONOURED, None, "echoed; prefix caching is automatic and shared by every request with the same prefix"
    ),
    "service_tier": Field(HONOURED, None, "auto or default (one tier)"),
    "truncation": Field(HONOURED, None, "disabled only: a conversation longer than the context is a 400"),
    "background": Field(HONOURED, None, "generate after answering; poll GET, cancel with POST .../cancel"),
    "background_options": Field(REFUSED, None, "options of background responses"),
    "access_programs": Field(REFUSED, None, "OpenAI access programs"),
    "context_management": Field(REFUSED, None, "server-side context compaction"),
    "conversation": Field(REFUSED, None, "the Conversations API"),
    "image": Field(REFUSED, None, "image context settings"),
    "max_tool_calls": Field(REFUSED, None, "a limit on built-in tool calls"),
    "moderation": Field(REFUSED, None, "moderation of input and output"),
    "prompt": Field(REFUSED, None, "stored prompt templates"),
    "prompt_cache_options": Field(REFUSED, None, "explicit prompt cache settings"),
    "prompt_cache_retention": Field(REFUSED, None, "prompt cache retention policy"),
}


class ResponsesRequest(BaseModel):
    """POST /v1/responses (the honoured fields; refused ones arrive in ``model_extra``)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    input: str | list[Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    store: bool | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    truncation: str | None = None
    background: bool | None = None


_EFFORTS = (None, "none", "minimal", "low", "medium", "high", "xhigh")


def _refuse(field: str, why: str) -> ApiError:
    return ApiError(400, f"'{field}' {why}", param=field)


def check_request(r: ResponsesRequest) -> None:
    """400 for every value this server does not implement, naming the field."""
    refuse_unimplemented(r, RESPONSES_FIELDS)
    if r.background and r.store is False:
        raise _refuse("store", "must be true for a background response (it is read back with GET).")
    if r.background and r.stream:
        raise _refuse("stream", "cannot be combined with 'background' (poll GET /v1/responses/{id} instead).")
    if r.truncation not in (None, "disabled"):
        raise _refuse("truncation", f"must be 'disabled' (the only mode implemented), got {r.truncation!r}.")
    if r.service_tier not in (None, "auto", "default"):
        raise _refuse("service_tier", f"must be 'auto' or 'default', got {r.service_tier!r}.")
    extra_include = sorted(set(r.include or ()) - {LOGPROBS_INCLUDE})
    if extra_include:
        raise _refuse("include", f"may only name {LOGPROBS_INCLUDE!r}; got {', '.join(map(repr, extra_include))}.")
    if r.top_logprobs is not None and LOGPROBS_INCLUDE not in (r.include or ()):
        raise _refuse("top_logprobs", f"needs 'include': [{LOGPROBS_INCLUDE!r}].")
    if r.top_logprobs is not None and not 0 <= r.top_logprobs <= 20:
        raise _refuse("top_logprobs", f"must be between 0 and 20, got {r.top_logprobs}.")
    if r.metadata is not None and (
        len(r.metadata) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in r.metadata.items())
    ):
        raise _refuse("metadata", "may hold 16 pairs at most, keys of 64 and values of 512 characters at most.")
    unknown = sorted(set(r.stream_options or {}) - {"include_obfuscation"})
    if unknown:
        raise _refuse("stream_options", f"has unknown field(s) {', '.join(unknown)}.")
    if r.stream_options and not r.stream:
        raise _refuse("stream_options", "needs 'stream': true.")
    reasoning = r.reasoning or {}
    unknown = sorted(set(reasoning) - {"effort", "summary", "generate_summary"})
    if unknown:
        raise _refuse("reasoning", f"has unknown field(s) {', '.join(unknown)}.")
    if reasoning.get("effort") not in _EFFORTS:
        raise _refuse(
            "reasoning.effort", f"must be one of {', '.join(map(str, _EFFORTS[1:]))}; got {reasoning['effort']!r}."
        )
    for key in ("summary", "generate_summary"):
        if reasoning.get(key) not in (None, "auto"):
            raise _refuse(
                f"reasoning.{key}",
                f"must be 'auto' (no summarizer: the reasoning text is returned as is); got {reasoning[key]!r}.",
            )
    text = r.text or {}
    unknown = sorted(set(text) - {"format", "verbosity"})
    if unknown:
        raise _refuse("text", f"has unknown field(s) {', '.join(unknown)}.")
    if text.get("verbosity") not in (None, "medium"):
        raise _refuse("text.verbosity", f"must be 'medium' (the model's own), got {text['verbosity']!r}.")


# -- input items -> chat messages ---------------------------------------------------------------
def items_of(value: str | list[Any] | None, field: str = "input") -> list[dict]:
    """The input as a list of items (a string is one user message)."""
    if value is None:
        raise ApiError(400, f"Missing required parameter: '{field}'.", param=field)
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise ApiError(400, f"'{field}[{i}]' must be an object.", param=f"{field}[{i}]")
    return list(value)


_TEXT_PARTS = {"input_text", "output_text", "text"}


def _part_text(part: Any, where: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "refusal" and isinstance(part.get("refusal"), str):
        return part["refusal"]
    if kind not in _TEXT_PARTS:
        raise ApiError(400, f"'{where}': only text content parts are supported, got {kind!r}.", param=where)
    if not isinstance(part.get("text"), str):
        raise ApiError(400, f"'{where}.text' must be a string.", param=f"{where}.text")
    return part["text"]


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"'{where}' must be a string or a list of content parts.", param=where)
    return "\n".join(_part_text(part, f"{where}[{j}]") for j, part in enumerate(content))


def _has_images(content: Any) -> bool:
    return isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "input_image" for p in content)


def _image_part(part: dict, where: str) -> dict:
    """An ``input_image`` part as a chat ``image_url`` part (the URL is checked and the
    image decoded where chat images are: a data URI, or a file URL under
    --allowed-local-media-path)."""
    unknown = sorted(set(part) - {"type", "image_url", "detail", "file_id"})
    if unknown:
        raise ApiError(400, f"'{where}' has unknown field(s) {', '.join(unknown)}.", param=where)
    if part.get("file_id") is not None:
        raise ApiError(
            400,
            f"'{where}.file_id': uploaded files are not supported (no Files API); send 'image_url' as a "
            "data URI (data:image/png;base64,...) or a file:// URL under --allowed-local-media-path.",
            param=f"{where}.file_id",
        )
    url = part.get("image_url")
    if not isinstance(url, str) or not url:
        raise ApiError(400, f"'{where}.image_url' must be a non-empty string (a data URI or URL).", param=where)
    detail = part.get("detail")
    if detail not in (None, "auto"):
        raise ApiError(
            400,
            f"'{where}.detail' {detail!r} is not supported: the model's image processor picks the resolution "
            "('auto' only).",
            param=f"{where}.detail",
        )
    return {"type": "image_url", "image_url": {"url": url}}


def _message(item: dict, where: str) -> dict:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise ApiError(400, f"'{where}.role' must be user, assistant, system or developer.", param=f"{where}.role")
    content = item.get("content")
    if not _has_images(content):
        return {"role": role, "content": _text_of(content, f"{where}.content")}
    # input_image parts: chat content parts (text and image_url), in order.
    parts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if isinstance(part, dict) and part.get("type") == "input_image":
            if role != "user":
                raise ApiError(400, f"'{at}': images are accepted in user messages only.", param=at)
            parts.append(_image_part(part, at))
        else:
            parts.append({"type": "text", "text": _part_text(part, at)})
    return {"role": role, "content": parts}


def _function_call(item: dict, where: str) -> dict:
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise ApiError(400, f"'{where}.{key}' must be a string.", param=f"{where}.{key}")
    try:
        json.loads(item["arguments"] or "{}")
    except ValueError:
        raise ApiError(400, f"'{where}.arguments' is not JSON.", param=f"{where}.arguments") from None
    return {
        "id": item["call_id"],
        "type": "function",
        "function": {"name": item["name"], "arguments": item["arguments"]},
    }


def chat_messages_of(
    items: list[dict], instructions: str | None, field: str = "input", origins: list[str] | None = None
) -> list[dict]:
    """Chat-completions messages of ``items`` (see the module docstring).  ``origins``,
    when given, receives each message's place in the request (``input[3]``,
    ``instructions``), so that an error the chat layer finds in ``messages[i]`` can
    name it (:func:`located`)."""
    messages: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    where_of = ["instructions"] if instructions else []
    for i, item in enumerate(items):
        where = f"{field}[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call = _function_call(item, where)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise ApiError(400, f"'{where}.call_id' must be a string.", param=f"{where}.call_id")
            output = _text_of(item.get("output"), f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        elif kind == "reasoning":
            continue
        else:
            raise ApiError(
                400,
                f"'{where}.type' {kind!r} is not supported (message, function_call, function_call_output, reasoning).",
                param=f"{where}.type",
            )
        where_of += [where] * (len(messages) - len(where_of))
    if not any(m["role"] != "system" for m in messages):
        raise ApiError(400, f"'{field}' must hold at least one message or function call output.", param=field)
    if origins is not None:
        origins[:] = where_of
    return messages


def located(e: ApiError, origins: list[str], field: str = "input") -> ApiError:
    """A chat-layer error about ``messages[i]...`` (an image part's, say) naming the
    request item message ``i`` came from (``origins`` of :func:`chat_messages_of`)."""
    param = e.param or ""
    match = re.match(r"messages\[(\d+)\](.*)", param)
    if match is None:
        if param != "messages":
            return e
        new = field
    else:
        i, rest = int(match.group(1)), match.group(2)
        new = origins[i] + rest if i < len(origins) else field
    message = e.message.replace(f"'{param}'", f"'{new}'")
    return ApiError(e.status, message, param=new, code=e.code, type=e.type, headers=e.headers)


# -- tools, tool_choice, text.format -> chat fields ---------------------------------------------
def _chat_tools(tools: list[Any]) -> list[dict]:
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise ApiError(
                400, f"'tools[{i}].type' {kind!r} is not supported: only function tools are.", param=f"tools[{i}].type"
            )
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise ApiError(400, f"'tools[{i}].name' must be a non-empty string.", param=f"tools[{i}].name")
        if t.get("parameters") is not None:
            if not isinstance(t["parameters"], dict):
                raise ApiError(
                    400, f"'tools[{i}].parameters' must be a JSON schema object.", param=f"tools[{i}].parameters"
                )
            checked_params({"json": t["parameters"]}, f"tools[{i}].parameters")  # a schema that cannot compile
        fn = {"name": t["name"]}
        for key in ("description", "parameters", "strict"):
            if t.get(key) is not None:
                fn[key] = t[key]
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    kind = choice.get("type") if isinstance(choice, dict) else None
    raise ApiError(
        400, f"'tool_choice' must be none, auto, required or a function; got type {kind!r}.", param="tool_choice"
    )


def _response_format(fmt: Any) -> dict | None:
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise ApiError(400, "'text.format.type' must be text, json_object or json_schema.", param="text.format.type")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    if not isinstance(fmt.get("schema"), dict):
        raise ApiError(400, "'text.format.schema' must be a JSON schema object.", param="text.format.schema")
    return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "response"), "schema": fmt["schema"]}}


# Chat fields as the Responses API names them, for errors of the chat layer.
RENAME = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format.json_schema": "text.format.schema",
    "response_format": "text.format",
    "logprobs": "include",
    "chat_template_kwargs": "reasoning.effort",
}


def chat_body(r: ResponsesRequest, model: str, messages: list[dict]) -> dict:
    """The chat-completions body that generates this response."""
    body: dict[str, Any] = {"model": model, "messages": messages, "max_completion_tokens": r.max_output_tokens}
    for key in ("temperature", "top_p", "parallel_tool_calls"):
        if getattr(r, key) is not None:
            body[key] = getattr(r, key)
    if r.tools:
        body["tools"] = _chat_tools(r.tools)
    if r.tool_choice is not None:
        body["tool_choice"] = _chat_tool_choice(r.tool_choice)
    fmt = _response_format((r.text or {}).get("format"))
    if fmt is not None:
        body["response_format"] = fmt
    if LOGPROBS_INCLUDE in (r.include or ()):
        body["logprobs"] = True
        body["top_logprobs"] = r.top_logprobs or 0
    effort = (r.reasoning or {}).get("effort")
    if effort is not None:
        body["chat_template_kwargs"] = {"reasoning_effort": effort}
    return body
