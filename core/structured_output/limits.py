"""Bounds on a constraint checked before xgrammar sees it.

A JSON schema, regex or grammar can be small to send and huge to compile (16k-leaf
schemas, 200,000-string enums, ``(x{1000}){1000}``, ``minItems: 10000000``): building
the grammar runs on the engine thread and compiling it takes a core and memory for as
long as it takes, since xgrammar cannot cancel a compile.  These checks are linear in
the constraint's text and refuse such constraints with a ValueError that names the
field, the value and the setting, before any grammar work.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pagedserve.structured_params import StructuredOutputsParams

__all__ = ["GrammarLimits", "check_limits", "process_limits", "repetition_product", "set_process_limits"]

#: JSON schema keywords whose value is a repetition count in the compiled grammar.
_COUNT_KEYWORDS = ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties")
#: Keywords whose values are JSON data, not subschemas (their size still counts in bytes).
_DATA = frozenset({"enum", "const", "default", "examples"})
_QUANTIFIER = re.compile(r"\{\s*(\d+)\s*(,\s*(\d*)\s*)?\}")


@dataclass(frozen=True)
class GrammarLimits:
    """The settings of StructuredOutputsConfig that bound one constraint (see config.py)."""

    max_bytes: int = 65536
    max_items: int = 4096
    max_repetition: int = 1000


_process_limits = GrammarLimits()


def set_process_limits(limits: GrammarLimits) -> None:
    """The limits of the engine in this process, which the server's request validation
    (``build_grammar`` without explicit limits) also applies."""
    global _process_limits
    _process_limits = limits


def process_limits() -> GrammarLimits:
    return _process_limits


def _too_big(field: str, what: str, value: int, setting: str, limit: int) -> ValueError:
    flag = "--" + setting.replace("_", "-")
    return ValueError(f"{field}: {what} {value} exceeds {setting}={limit} ({flag})")


def repetition_product(text: str, quoted: bool = False) -> int:
    """The largest product of nested counted repetitions (``{m}``, ``{m,}``, ``{m,n}``)
    in a regex, or in an EBNF grammar with ``quoted`` (string literals skipped).

    ``(x{1000}){1000}`` gives 1,000,000: what the compiled automaton unrolls.
    """
    levels = [1]  # the largest product seen inside each open group
    atom = 1  # the product inside the atom just read (a closed group's, else 1)
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            atom, i = 1, i + 2
            continue
        if c == "[":
            i = _skip_class(text, i)
            atom = 1
            continue
        if quoted and c in "\"'":
            i = _skip_string(text, i, c)
            atom = 1
            continue
        if c == "(":
            levels.append(1)
            atom = 1
        elif c == ")":
            atom = levels.pop() if len(levels) > 1 else 1
            levels[-1] = max(levels[-1], atom)
        elif c == "{" and (m := _QUANTIFIER.match(text, i)):
            upper = m[3] if m[2] and m[3] else m[1]
            levels[-1] = max(levels[-1], int(upper) * atom)
            i = m.end()
            continue
        else:
            atom = 1
        i += 1
    return max(levels)


def _skip_class(text: str, i: int) -> int:
    # A character class: "]" first (or after "^") is literal; escapes skip a character.
    j = i + 1
    if j < len(text) and text[j] == "^":
        j += 1
    if j < len(text) and text[j] == "]":
        j += 1
    while j < len(text) and text[j] != "]":
        j += 2 if text[j] == "\\" else 1
    return j + 1


def _skip_string(text: str, i: int, quote: str) -> int:
    j = i + 1
    while j < len(text) and text[j] != quote:
        j += 2 if text[j] == "\\" else 1
    return j + 1


def _check_regex(field: str, regex: str, limits: GrammarLimits, quoted: bool = False) -> None:
    product = repetition_product(regex, quoted)
    if product > limits.max_repetition:
        raise _too_big(field, "nested repetition count", product, "max_grammar_repetition", limits.max_repetition)


def _check_schema(field: str, schema: Any, limits: GrammarLimits) -> None:
    """Walk a JSON schema (any JSON): subschema count, enum sizes, counts, patterns."""
    nodes = 0
    stack: list[tuple[str, Any]] = [("", schema)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, list):
            stack.extend((f"{path}/{i}", v) for i, v in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        nodes += 1
        if nodes > limits.max_items:
            raise _too_big(field, "number of subschemas (at least)", nodes, "max_grammar_items", limits.max_items)
        for key in _COUNT_KEYWORDS:
            value = node.get(key)
            if isinstance(value, int | float) and value > limits.max_repetition:
                where = f"{key} at {path or '/'}"
                raise _too_big(field, where, int(value), "max_grammar_repetition", limits.max_repetition)
        enum = node.get("enum")
        if isinstance(enum, list) and len(enum) > limits.max_items:
            raise _too_big(field, f"size of enum at {path or '/'}", len(enum), "max_grammar_items", limits.max_items)
        if isinstance(node.get("pattern"), str):
            _check_regex(f"{field} pattern at {path or '/'}", node["pattern"], limits)
        stack.extend((f"{path}/{k}", v) for k, v in node.items() if isinstance(v, dict | list) and k not in _DATA)


def check_limits(params: StructuredOutputsParams, limits: GrammarLimits) -> None:
    """ValueError naming the field when ``params`` exceeds ``limits`` (see module doc)."""
    kind = params.kind
    field = f"structured_outputs.{kind}"
    value = getattr(params, kind)
    if kind == "json_object":
        return
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    size = len(text.encode())
    if size > limits.max_bytes:
        raise _too_big(field, "size in bytes", size, "max_grammar_bytes", limits.max_bytes)
    if kind == "choice" and len(value) > limits.max_items:
        raise _too_big(field, "number of choices", len(value), "max_grammar_items", limits.max_items)
    if kind == "regex":
        _check_regex(field, value, limits)
    elif kind == "grammar":
        rules = value.count("::=")
        if rules > limits.max_items:
            raise _too_big(field, "number of rules", rules, "max_grammar_items", limits.max_items)
        _check_regex(field, value, limits, quoted=True)
    elif kind in ("json", "structural_tag"):
        try:
            schema = json.loads(value) if isinstance(value, str) else value
        except ValueError:
            return  # build_grammar reports bad JSON
        _check_schema(field, schema, limits)
