"""Every request field of vLLM's completions and chat completions APIs, and what this
server does with it.

The lists follow vLLM's ``CompletionRequest`` / ``ChatCompletionRequest``
(vllm/entrypoints/openai/protocol.py) plus a few OpenAI fields vLLM lacks.  Each field
is ``honoured`` (implemented) or ``refused`` (a non-default value is a 400 naming it).
A field this server's request models do not declare
arrives in ``model_extra`` and is refused by :func:`refuse_unimplemented` whenever its
value differs from vLLM's default, so no listed field is ever silently ignored.  Fields
in neither list are ignored, as vLLM and OpenAI's clients expect.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from pagedserve.entrypoints.openai.errors import ApiError

__all__ = [
    "COMPLETION_FIELDS",
    "CHAT_FIELDS",
    "MAX_TEMPERATURE",
    "Field",
    "check_temperature",
    "refuse_unimplemented",
    "used",
]

MAX_TEMPERATURE = 2.0  # OpenAI's range for completions, chat and responses

HONOURED, REFUSED = "honoured", "refused"


class Field:
    """One request field: its status, vLLM's default and a one-line meaning."""

    __slots__ = ("status", "default", "meaning")

    def __init__(self, status: str, default: Any, meaning: str) -> None:
        self.status, self.default, self.meaning = status, default, meaning


_SHARED: dict[str, Field] = {
    "model": Field(HONOURED, None, "a served model name (404 otherwise)"),
    "frequency_penalty": Field(HONOURED, 0.0, "penalty per earlier occurrence of a token, [-2, 2]"),
    "logit_bias": Field(HONOURED, None, "token id -> bias added to its logit, clamped to [-100, 100]"),
    "max_tokens": Field(HONOURED, None, "tokens to generate at most"),
    "n": Field(HONOURED, 1, "completions per prompt (1-128)"),
    "presence_penalty": Field(HONOURED, 0.0, "penalty for any earlier occurrence of a token, [-2, 2]"),
    "seed": Field(HONOURED, None, "per-request sampling seed, int64"),
    "stop": Field(HONOURED, None, "strings that end the completion"),
    "stream": Field(HONOURED, False, "server-sent events"),
    "stream_options": Field(
        HONOURED,
        None,
        "include_usage: a last chunk with the usage; with continuous_usage_stats also the usage so far on every chunk",
    ),
    "temperature": Field(HONOURED, None, "sampling temperature, [0, 2] (0 = greedy)"),
    "top_p": Field(HONOURED, None, "nucleus sampling mass, (0, 1]"),
    "user": Field(HONOURED, None, "end-user id for the operator's logs; no effect on the output"),
    "best_of": Field(HONOURED, None, "samples drawn; the n with the highest cumulative logprob are returned"),
    "use_beam_search": Field(
        HONOURED, False, "beam search with beam width n (not with stream or sampling fields it does not use)"
    ),
    "top_k": Field(HONOURED, None, "sample among the k most likely tokens"),
    "min_p": Field(HONOURED, None, "drop tokens below min_p x the top token's probability"),
    "repetition_penalty": Field(HONOURED, None, "divide logits of tokens already seen, (0, 10]"),
    "length_penalty": Field(HONOURED, 1.0, "beam-search score = cum_logprob / length ** length_penalty"),
    "stop_token_ids": Field(HONOURED, None, "token ids that end the completion"),
    "include_stop_str_in_output": Field(HONOURED, False, "keep the matched stop string in the text"),
    "ignore_eos": Field(HONOURED, False, "do not stop at the end-of-sequence token"),
    "min_tokens": Field(HONOURED, 0, "tokens generated before EOS / stop tokens may end the completion"),
    "skip_special_tokens": Field(HONOURED, True, "leave special tokens out of the text"),
    "spaces_between_special_tokens": Field(
        HONOURED,
        True,
        "false: special tokens joined to the text as the tokenizer decodes them "
        "(what fast tokenizers always do, as in vLLM)",
    ),
    "truncate_prompt_tokens": Field(HONOURED, None, "keep only the last k prompt tokens"),
    "allowed_token_ids": Field(HONOURED, None, "only these token ids may be generated"),
    "prompt_logprobs": Field(HONOURED, None, "logprobs of every prompt token (with k alternatives)"),
    "bad_words": Field(HONOURED, None, "words never generated"),
    "echo": Field(
        HONOURED,
        False,
        "completions: the prompt before the completion; chat: the last assistant message before the reply",
    ),
    "add_special_tokens": Field(HONOURED, None, "add the tokenizer's BOS/EOS to the prompt"),
    "response_format": Field(HONOURED, None, "text, json_object, json_schema or structural_tag constrained output"),
    "guided_json": Field(HONOURED, None, "output follows a JSON schema"),
    "guided_regex": Field(HONOURED, None, "output follows a regex"),
    "guided_choice": Field(HONOURED, None, "output is one of the choices"),
    "guided_grammar": Field(HONOURED, None, "output follows an EBNF grammar"),
    "guided_decoding_backend": Field(HONOURED, None, "structured-output backend: auto or xgrammar (400 otherwise)"),
    "guided_whitespace_pattern": Field(REFUSED, None, "whitespace pattern of guided JSON"),
    "structured_outputs": Field(
        HONOURED, None, "output constraint: json, regex, choice, grammar, json_object or structural_tag"
    ),
    "priority": Field(HONOURED, 0, "lower is served first under --scheduling-policy priority"),
    "request_id": Field(HONOURED, None, "used in the response id"),
    "logits_processors": Field(REFUSED, None, "custom logits processors by qualified name"),
    "return_tokens_as_token_ids": Field(HONOURED, None, "logprob tokens written 'token_id:<id>'"),
    "cache_salt": Field(
        HONOURED, None, "salts the request's prefix-cache hashes: only requests with the same salt share cached blocks"
    ),
    "kv_transfer_params": Field(REFUSED, None, "disaggregated-serving KV transfer"),
    "vllm_xargs": Field(REFUSED, None, "extra arguments for custom extensions"),
    "mm_processor_kwargs": Field(REFUSED, None, "multimodal processor arguments"),
}

COMPLETION_FIELDS: dict[str, Field] = {
    **_SHARED,
    "prompt": Field(HONOURED, None, "a string, strings, token ids or lists of token ids"),
    "prompt_embeds": Field(REFUSED, None, "prompt embeddings instead of tokens"),
    "multi_modal_data": Field(
        REFUSED, None, "images or videos of a completion (send them as chat image_url / video_url parts)"
    ),
    "logprobs": Field(HONOURED, None, "logprobs of the k most likely tokens per position (0-20)"),
    "suffix": Field(
        HONOURED, None, "text after the completion (fill-in-the-middle; 400 if the model has no FIM tokens)"
    ),
}

CHAT_FIELDS: dict[str, Field] = {
    **_SHARED,
    "messages": Field(HONOURED, None, "the conversation"),
    "logprobs": Field(HONOURED, False, "return logprobs of the generated tokens"),
    "top_logprobs": Field(HONOURED, None, "alternatives per position with logprobs (0-20)"),
    "max_completion_tokens": Field(HONOURED, None, "tokens to generate at most"),
    "tools": Field(HONOURED, None, "tool definitions, shown to the chat template"),
    "tool_choice": Field(HONOURED, None, "none, auto (needs --enable-auto-tool-choice), required or a named function"),
    "parallel_tool_calls": Field(HONOURED, None, "false: at most one tool call per reply"),
    "reasoning_effort": Field(REFUSED, None, "reasoning effort of reasoning models"),
    "include_reasoning": Field(REFUSED, True, "return the reasoning content"),
    "structural_tag": Field(REFUSED, None, "vLLM's old top-level structural tag (use response_format)"),
    "add_generation_prompt": Field(HONOURED, True, "end the prompt with the assistant turn's header"),
    "continue_final_message": Field(
        HONOURED, False, "continue the last (assistant) message (needs add_generation_prompt: false)"
    ),
    "documents": Field(HONOURED, None, "documents passed to the chat template (RAG templates)"),
    "chat_template": Field(HONOURED, None, "a Jinja chat template for this request"),
    "chat_template_kwargs": Field(HONOURED, None, "extra variables for the chat template"),
    "functions": Field(REFUSED, None, "OpenAI's deprecated function definitions"),
    "function_call": Field(REFUSED, None, "OpenAI's deprecated function choice"),
    "modalities": Field(REFUSED, None, "output modalities other than text"),
    "audio": Field(REFUSED, None, "audio output"),
    "prediction": Field(REFUSED, None, "predicted output"),
    "web_search_options": Field(REFUSED, None, "web search"),
}


def used(value: Any, default: Any) -> bool:
    """Whether a field's value differs from its default (empty lists and dicts count as unset)."""
    if value is None or value == default:
        return False
    return not (isinstance(value, (list, dict, str)) and not value and not default)


def refuse_unimplemented(request: BaseModel, table: dict[str, Field]) -> None:
    """400 naming the first listed field the request models do not implement and the
    request sets to something other than vLLM's default."""
    for name, value in (request.model_extra or {}).items():
        f = table.get(name)
        if f is not None and used(value, f.default):
            raise ApiError(
                400, f"'{name}' is refused: '{name}' ({f.meaning}) is not supported by this server.", param=name
            )


def check_temperature(request: BaseModel) -> None:
    """400 unless temperature is in OpenAI's range (sampling and beam search alike)."""
    temperature = getattr(request, "temperature", None)
    if temperature is not None and not 0.0 <= temperature <= MAX_TEMPERATURE:
        bad = f"'temperature' must be between 0 and {MAX_TEMPERATURE:g}, got {temperature}."
        raise ApiError(400, bad, param="temperature")
