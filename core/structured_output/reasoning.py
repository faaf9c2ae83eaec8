"""Reasoning formats the engine knows: where a model's reasoning section ends.

Constraints (structured outputs, tool calls) apply to the answer, so with a reasoning
parser configured a sequence's grammar starts after the section's end token.  The
text side (splitting ``reasoning_content`` from ``content``) lives in
pagedserve.entrypoints.openai.reasoning_parsers.
"""

from __future__ import annotations

from pagedserve.structured_params import REASONING_PARSERS

__all__ = ["REASONING_PARSERS", "reasoning_end_token_ids"]


def reasoning_end_token_ids(name: str, tokenizer) -> frozenset[int]:
    """The id of ``name``'s end marker in this vocabulary; ValueError if it is not one token."""
    end = REASONING_PARSERS[name][1]
    ids = tokenizer.encode(end, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(
            f"reasoning_parser={name!r} needs {end!r} to be one token of the model's vocabulary; "
            f"this tokenizer splits it into {len(ids)} tokens"
        )
    return frozenset(ids)
