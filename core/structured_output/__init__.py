"""Structured outputs: output constrained by a JSON schema, regex, choice list, EBNF
grammar or structural tag, with xgrammar (see docs/structured_outputs.md)."""

from pagedserve.structured_output.backend import BACKENDS, XgrammarBackend, build_grammar
from pagedserve.structured_output.bitmask import GrammarBitmask, apply_grammar_bitmask, grammar_bitmask
from pagedserve.structured_output.manager import GrammarState, StructuredOutputManager
from pagedserve.structured_params import StructuredOutputsParams

__all__ = [
    "BACKENDS",
    "GrammarBitmask",
    "GrammarState",
    "StructuredOutputManager",
    "StructuredOutputsParams",
    "XgrammarBackend",
    "apply_grammar_bitmask",
    "build_grammar",
    "grammar_bitmask",
]
