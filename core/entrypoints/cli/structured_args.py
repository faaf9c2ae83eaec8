"""Server flags of tool calling (vLLM's spellings).

``--structured-outputs-config`` and ``--reasoning-parser`` are engine settings
(:class:`pagedserve.config.StructuredOutputsConfig`), flags of every command.
"""

from __future__ import annotations

import argparse

__all__ = ["add_tool_arguments", "tool_options"]


def add_tool_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("tool calling")
    g.add_argument(
        "--enable-auto-tool-choice", action="store_true", help='allow tool_choice "auto" (needs --tool-call-parser)'
    )
    g.add_argument(
        "--tool-call-parser",
        default=None,
        choices=[
            "auto",
            "hermes",
            "llama3_json",
            "mistral",
            "pythonic",
            "qwen3_coder",
            "deepseek_v3",
            "granite",
            "kimi_k2",
            "openai",
        ],
        help="how tool calls are read from the model's output under tool_choice auto (auto: chosen from the "
        "chat template; openai: GPT-OSS's Harmony format)",
    )


def tool_options(args: argparse.Namespace, reasoning_parser: str | None):
    """The ToolOptions of the flags and the engine's reasoning parser (the setting)."""
    from pagedserve.entrypoints.openai.tools import ToolOptions

    return ToolOptions(
        enable_auto_tool_choice=getattr(args, "enable_auto_tool_choice", False),
        tool_call_parser=getattr(args, "tool_call_parser", None),
        reasoning_parser=reasoning_parser,
    )
