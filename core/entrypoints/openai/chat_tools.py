"""The chat endpoint's share of tools, reasoning and chat_template_kwargs: what the
template gets, the constraint a tool choice adds, and how the answer is shaped."""

from __future__ import annotations

from typing import Any

from pagedserve.entrypoints.openai.chat_output import ChatOutput
from pagedserve.entrypoints.openai.errors import ApiError
from pagedserve.entrypoints.openai.reasoning_parsers import get_reasoning_parser
from pagedserve.entrypoints.openai.tool_parsers.harmony import HarmonyReasoning
from pagedserve.entrypoints.openai.tools import ToolOptions, plan_tools
from pagedserve.sampling_params import SamplingParams

__all__ = ["ChatToolsMixin"]

# Template variables a request may not set through chat_template_kwargs.
_RESERVED = frozenset({"messages", "add_generation_prompt", "tools"})


class ChatToolsMixin:
    """Mixed into OpenAIServingChat; ``tool_options`` is given to its constructor."""

    tool_options: ToolOptions = ToolOptions()

    def template_kwargs(self, request: Any) -> dict[str, Any]:
        """The template variables tool calling adds (``tools``), beyond chat_template_kwargs."""
        bad = sorted(_RESERVED & set(request.chat_template_kwargs or {}))
        if bad:
            raise ApiError(400, f"'chat_template_kwargs' may not set {', '.join(bad)}.", param="chat_template_kwargs")
        plan = plan_tools(request, self.tool_options)
        return {"tools": plan.tools} if plan.tools else {}

    def constrain_tools(self, request: Any, params: SamplingParams) -> None:
        """A "required" or named tool choice constrains the output to the calls' schema; a
        tool-call parser that reads special tokens (Harmony, Kimi-K2) keeps them in the text."""
        plan = plan_tools(request, self.tool_options)
        if plan.parser is not None and plan.parser.special_tokens or self.tool_options.tool_call_parser == "openai":
            params.skip_special_tokens = False  # Harmony replies are read by their markers in every mode
        if plan.constraint is None:
            return
        if request.use_beam_search:
            raise ApiError(
                400, f"tool_choice {plan.mode!r} cannot be combined with 'use_beam_search'.", param="tool_choice"
            )
        if params.structured_outputs is not None:
            raise ApiError(
                400,
                f"tool_choice {plan.mode!r} cannot be combined with response_format or structured_outputs.",
                param="tool_choice",
            )
        if params.min_tokens > 0:
            raise ApiError(
                400,
                f"'min_tokens' must be 0 with tool_choice {plan.mode!r} (the calls' grammar decides "
                "where the output ends).",
                param="min_tokens",
            )
        params.structured_outputs = plan.constraint

    def reasoning_name(self) -> str | None:
        """The reasoning format the answers are split by: --reasoning-parser, or Harmony's
        analysis channel when the tool-call parser is ``openai`` (GPT-OSS)."""
        opts = self.tool_options
        return opts.reasoning_parser or ("openai_gptoss" if opts.tool_call_parser == "openai" else None)

    def chat_output(self, request: Any) -> ChatOutput:
        opts = self.tool_options
        name = self.reasoning_name()
        reasoning = (
            None if name is None else HarmonyReasoning() if name == "openai_gptoss" else get_reasoning_parser(name)
        )
        return ChatOutput(plan_tools(request, opts), reasoning)
