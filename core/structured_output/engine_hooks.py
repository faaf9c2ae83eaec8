"""What the engine calls: building the manager from the config, and a sequence's
grammar step after each sampled token."""

from __future__ import annotations

import logging

from pagedserve.request import Request, RequestStatus
from pagedserve.structured_output.limits import GrammarLimits, set_process_limits
from pagedserve.structured_output.manager import StructuredOutputManager
from pagedserve.structured_output.reasoning import reasoning_end_token_ids

__all__ = ["build_structured_output_manager", "check_grammar_failed", "finish_by_grammar"]

logger = logging.getLogger(__name__)


def build_structured_output_manager(config, tokenizer, arch, eos_token_ids) -> StructuredOutputManager:
    """The engine's manager; ValueError for an unknown backend or an unusable reasoning parser."""
    so = config.structured_outputs
    end_ids = reasoning_end_token_ids(so.reasoning_parser, tokenizer) if so.reasoning_parser else None
    # The bitmask spans the logits, which may be wider than the tokenizer's vocabulary.
    limits = GrammarLimits(so.max_grammar_bytes, so.max_grammar_items, so.max_grammar_repetition)
    # The server checks request constraints against the same limits before queuing them.
    set_process_limits(limits)
    return StructuredOutputManager(
        so.backend,
        tokenizer,
        arch.vocab_size,
        sorted(eos_token_ids),
        end_ids,
        limits=limits,
        compile_timeout=so.grammar_compile_timeout,
        max_whitespace=so.max_json_whitespace,
    )


def finish_by_grammar(request: Request, token: int) -> RequestStatus | None:
    """Feed ``token`` to the sequence's matcher; FINISHED_STOPPED once the grammar is complete.

    Stop checks on the token itself (EOS, max_tokens) have already run; a grammar that
    has just been completed by a non-stop token also ends the sequence.
    """
    state = request.structured
    if not state.accept(token):
        # Only possible when the mask was not applied to this token (e.g. a stop token
        # forced by min_tokens handling); the output is then unconstrained past here.
        logger.warning("request %s: token %d is not allowed by its grammar", request.request_id, token)
        return None
    if state.failed is not None or state.is_terminated:
        request.stop_reason = None
        return RequestStatus.FINISHED_STOPPED
    return None


def check_grammar_failed(request: Request) -> None:
    """ValueError naming the constraint when the sequence's grammar failed to compile (or
    ran past its deadline): the request then fails with that error instead of ending
    with empty text."""
    state = request.structured
    if state is not None and state.failed is not None:
        raise ValueError(
            state.failed if state.failed.startswith("structured_outputs") else f"structured_outputs: {state.failed}"
        )
