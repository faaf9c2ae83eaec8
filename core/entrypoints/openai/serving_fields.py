"""Request fields that shape prompts and responses rather than sampling: suffix
(fill-in-the-middle), add_special_tokens, truncate_prompt_tokens, echo, prompt_logprobs,
return_tokens_as_token_ids, request_id, and chat template options."""

from __future__ import annotations

from typing import Any

from pagedserve.engine.client import EngineClient
from pagedserve.engine.request_options import continue_final_message, truncate_prompt
from pagedserve.entrypoints.openai.errors import ApiError
from pagedserve.entrypoints.openai.request_fields import CHAT_FIELDS, COMPLETION_FIELDS

__all__ = [
    "field_named",
    "salt_kwargs",
    "generation_defaults",
    "completion_prompt",
    "fim_text",
    "prompt_logprobs_json",
    "response_id",
    "chat_prompt_text",
    "echo_prefix",
]

# StarCoder-style fill-in-the-middle tokens (prefix-suffix-middle order).
_FIM = ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")
_KNOWN = set(COMPLETION_FIELDS) | set(CHAT_FIELDS)


def field_named(message: str, default: str | None) -> str | None:
    """The request field an engine error message starts with, else ``default``."""
    first = message.split(" ", 1)[0]
    return first if first in _KNOWN else default


def fim_text(tokenizer: Any, prompt: str, suffix: str) -> str:
    """The fill-in-the-middle prompt; 400 naming `suffix` if the vocabulary has no FIM tokens."""
    backend = getattr(tokenizer, "backend", None)
    if backend is None or any(backend.token_to_id(t) is None for t in _FIM):
        raise ApiError(
            400,
            "'suffix' needs a model with fill-in-the-middle tokens ("
            + ", ".join(_FIM)
            + "); this model's vocabulary has none.",
            param="suffix",
        )
    pre, suf, mid = _FIM
    return f"{pre}{prompt}{suf}{suffix}{mid}"


def completion_prompt(tokenizer: Any, request: Any, prompt: str | list[int]) -> tuple[str | None, list[int]]:
    """(text, token ids) of one completions prompt after suffix, add_special_tokens and
    truncate_prompt_tokens; the text is None for token-id prompts."""
    if isinstance(prompt, str):
        text = fim_text(tokenizer, prompt, request.suffix) if request.suffix else prompt
        ids = tokenizer.encode(text, add_special_tokens=request.add_special_tokens is not False)
    else:
        if request.suffix:
            raise ApiError(400, "'suffix' needs a text prompt.", param="suffix")
        text, ids = None, list(prompt)
    kept = truncate_prompt(ids, request.truncate_prompt_tokens)
    if len(kept) < len(ids):
        text = None if text is None else tokenizer.decode(kept, skip_special_tokens=False)
    return text, kept


def response_id(prefix: str, request: Any, fallback: str) -> str:
    """``prefix-<request_id>`` when the body names one (vLLM's request_id), else ``fallback``."""
    return f"{prefix}-{request.request_id}" if request.request_id else fallback


def prompt_logprobs_json(entries: list | None, token_text) -> list | None:
    """vLLM's prompt_logprobs: per prompt token None (the first) or {id: {logprob, rank,
    decoded_token}}."""
    if entries is None:
        return None
    return [
        None
        if e is None
        else {
            str(tid): {"logprob": max(lp.logprob, -9999.0), "rank": lp.rank, "decoded_token": token_text(tid)}
            for tid, lp in e.items()
        }
        for e in entries
    ]


def chat_prompt_text(
    tokenizer: Any,
    request: Any,
    messages: list[dict],
    default_template: str | None,
    extra_kwargs: dict[str, Any] | None = None,
) -> str:
    """Render the conversation with the request's template options (and ``extra_kwargs``,
    e.g. the request's ``tools``).

    continue_final_message (with add_generation_prompt false) leaves the last message
    open: the text is cut right after its content, as vLLM and transformers do.
    """
    if request.continue_final_message and request.add_generation_prompt:
        raise ApiError(
            400, "'continue_final_message' needs 'add_generation_prompt': false.", param="continue_final_message"
        )
    kwargs = dict(request.chat_template_kwargs or {})
    if request.documents is not None:
        kwargs["documents"] = request.documents
    for reserved in ("messages", "add_generation_prompt"):
        if reserved in kwargs:
            raise ApiError(400, f"'chat_template_kwargs' may not set '{reserved}'.", param="chat_template_kwargs")
    kwargs.update(extra_kwargs or {})
    try:
        text = tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=request.add_generation_prompt,
            chat_template=request.chat_template or default_template,
            **kwargs,
        )
    except ValueError as e:  # no template, or it raised (e.g. roles out of order)
        param = "chat_template" if request.chat_template else "messages"
        raise ApiError(400, str(e), param=param) from None
    if request.continue_final_message:
        try:
            text = continue_final_message(text, messages)
        except ValueError as e:
            raise ApiError(400, str(e), param="continue_final_message") from None
    return text


def echo_prefix(request: Any, messages: list[dict]) -> str:
    """Chat echo: the last message's content when it is the assistant's (the reply's role)."""
    if request.echo and messages and messages[-1]["role"] == "assistant":
        return messages[-1]["content"] or ""
    return ""


def salt_kwargs(engine: EngineClient, cache_salt: str | None) -> dict[str, str]:
    """add_request keywords for a request's cache_salt (which salts its prefix-cache hashes)."""
    if cache_salt is None:
        return {}
    if not cache_salt:
        raise ApiError(400, "'cache_salt' must be a non-empty string.", param="cache_salt")
    return {"cache_salt": cache_salt}


def generation_defaults(engine: Any) -> dict[str, Any]:
    """The generation_config.json sampling defaults of the engine behind the server: read
    from the LLMEngine, or (data-parallel router) from the engine config's model."""
    return engine.generation_defaults()
