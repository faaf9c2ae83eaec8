"""Flags of structured outputs, tool calling and reasoning (vLLM's spellings)."""

from __future__ import annotations

import argparse
import json

__all__ = ["add_structured_output_arguments", "structured_outputs_config", "tool_options"]


def add_structured_output_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("structured outputs and tools")
    g.add_argument("--structured-outputs-config", default=None,
                   help='JSON object, e.g. \'{"backend": "xgrammar"}\' (backends: auto, xgrammar)')
    g.add_argument("--reasoning-parser", default=None, choices=["deepseek_r1", "qwen3"],
                   help="split <think> sections into reasoning_content; constraints apply after them")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='allow tool_choice "auto" (needs --tool-call-parser)')
    g.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json", "mistral", "pythonic"],
                   help="how tool calls are read from the model's output under tool_choice auto")


def structured_outputs_config(args: argparse.Namespace):
    """The StructuredOutputsConfig of the flags; ValueError naming a bad one."""
    from pagedserve.config import StructuredOutputsConfig

    raw = getattr(args, "structured_outputs_config", None)
    fields: dict = {}
    if raw:
        try:
            fields = json.loads(raw)
        except ValueError as e:
            raise ValueError(f"--structured-outputs-config is not JSON: {e}") from None
        if not isinstance(fields, dict) or set(fields) - {"backend", "reasoning_parser"}:
            raise ValueError('--structured-outputs-config must be an object with "backend" (and optionally '
                             f'"reasoning_parser"); got {raw!r}')
    if getattr(args, "reasoning_parser", None):
        fields["reasoning_parser"] = args.reasoning_parser
    return StructuredOutputsConfig(**fields)


def tool_options(args: argparse.Namespace):
    from pagedserve.entrypoints.openai.tools import ToolOptions

    return ToolOptions(enable_auto_tool_choice=getattr(args, "enable_auto_tool_choice", False),
                       tool_call_parser=getattr(args, "tool_call_parser", None),
                       reasoning_parser=getattr(args, "reasoning_parser", None))
