"""Engine settings as command-line flags and ``LLM(**kwargs)``, generated from the config
dataclasses (:mod:`pagedserve.config`): one declaration per setting.

Each init field of a section of :class:`~pagedserve.config.EngineConfig` becomes a flag
spelled as vLLM spells it (field ``max_num_seqs`` -> ``--max-num-seqs``) and a keyword
argument of ``LLM`` with the flag's name (``max_num_seqs``).  The field's metadata says
the rest:

- ``help``: the flag's help text and the docs' description;
- ``flag``: another spelling (``policy`` -> ``--scheduling-policy``, and then the keyword
  ``scheduling_policy``); ``aliases``: more spellings (``--memory-utilization``), each
  long one also a keyword;
- ``choices``, ``metavar``; ``parse``: the flag's converter, a callable or the string
  ``"module:function"`` (imported when the parser is built);
- ``cli: False``: a keyword argument only (e.g. ``model``, which commands take as a
  positional argument).

Booleans are ``--x/--no-x`` pairs (``argparse.BooleanOptionalAction``).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import importlib
import inspect
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pagedserve.config import EngineConfig

__all__ = [
    "EngineArg",
    "engine_args",
    "add_engine_arguments",
    "engine_config_from_args",
    "engine_config_from_kwargs",
    "engine_signature",
    "settings_markdown",
    "default_kv_budget",
]

#: Namespace attribute listing the engine settings a parser defines (a command may leave
#: some out, e.g. `generate`'s --seed is the sampling seed).
_DEFINED = "_engine_arg_names"


@dataclass(frozen=True)
class EngineArg:
    """One engine setting: where it lives in EngineConfig and how users spell it."""

    section: str  # EngineConfig attribute: "model", "cache", ...
    field: str  # field of that section's dataclass
    name: str  # keyword argument and argparse dest, e.g. "gpu_memory_utilization"
    flags: tuple[str, ...]  # first the main spelling, then aliases
    keywords: tuple[str, ...]  # names LLM(**kwargs) accepts, ``name`` first
    type: type  # bool, int, float or str (what the flag converts to)
    default: Any
    help: str
    choices: tuple[str, ...] | None
    parse: Callable[[str], Any] | str | None
    metavar: str | None
    cli: bool


def _flag_type(hint: Any) -> type:
    """bool/int/float/str from an annotation; unions other than ``X | None`` read as str."""
    args = (
        [a for a in typing.get_args(hint) if a is not type(None)]
        if typing.get_origin(hint) in (typing.Union, types.UnionType)
        else [hint]
    )
    if len(args) == 1 and args[0] in (bool, int, float, str):
        return args[0]
    return str


def _keyword(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


@functools.cache
def engine_args() -> tuple[EngineArg, ...]:
    """Every engine setting, in EngineConfig's section and field order."""
    out: list[EngineArg] = []
    for section in dataclasses.fields(EngineConfig):
        cls = section.default_factory
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            meta = f.metadata
            flag = meta.get("flag", "--" + f.name.replace("_", "-"))
            flags = (flag, *meta.get("aliases", ()))
            keywords = tuple(dict.fromkeys(_keyword(x) for x in flags if x.startswith("--")))
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            choices = meta.get("choices")
            out.append(
                EngineArg(
                    section.name,
                    f.name,
                    keywords[0],
                    flags,
                    keywords,
                    _flag_type(hints[f.name]),
                    default,
                    meta.get("help", ""),
                    tuple(choices) if choices else None,
                    meta.get("parse"),
                    meta.get("metavar"),
                    meta.get("cli", True),
                )
            )
    names = [k for a in out for k in a.keywords]
    dup = {n for n in names if names.count(n) > 1}
    if dup:  # two sections spelling a setting alike would make flags ambiguous
        raise RuntimeError(f"engine settings spelled twice: {', '.join(sorted(dup))}")
    return tuple(out)


def _converter(arg: EngineArg) -> Callable[[str], Any]:
    parse = arg.parse
    if isinstance(parse, str):
        module, _, attr = parse.partition(":")
        parse = getattr(importlib.import_module(module), attr)
    if parse is None:
        return arg.type

    def convert(value: str) -> Any:
        try:
            return parse(value)
        except ValueError as e:  # argparse would print only "invalid value"
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = arg.name
    return convert


def add_engine_arguments(
    parser: argparse.ArgumentParser, *, exclude: Iterable[str] = (), defaults: Mapping[str, Any] | None = None
) -> None:
    """Add a flag for every engine setting to ``parser``, grouped by config section.

    exclude: settings (by name, e.g. "seed") the command defines differently itself.
    defaults: the command's own default for some settings (by name).
    """
    exclude, defaults = set(exclude), dict(defaults or {})
    known = {a.name for a in engine_args()}
    unknown = (exclude | set(defaults)) - known
    if unknown:
        raise ValueError(f"not engine settings: {', '.join(sorted(unknown))}")
    groups: dict[str, Any] = {}
    defined = []
    for arg in engine_args():
        if not arg.cli or arg.name in exclude:
            continue
        group = groups.get(arg.section)
        if group is None:
            group = groups[arg.section] = parser.add_argument_group(f"engine ({arg.section})")
        default = defaults.get(arg.name, arg.default)
        text = arg.help.replace("%", "%%")
        if arg.type is bool:
            text += " (default: on)" if default else " (default: off)"
        elif default is not None:
            text += " (default: %(default)s)"
        kwargs: dict[str, Any] = {"dest": arg.name, "default": default, "help": text}
        if arg.type is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = _converter(arg)
            if arg.choices:
                kwargs["choices"] = arg.choices
            if arg.metavar:
                kwargs["metavar"] = arg.metavar
        group.add_argument(*arg.flags, **kwargs)
        defined.append(arg.name)
    parser.set_defaults(**{_DEFINED: tuple(defined)})


def _build(values: Mapping[str, Any]) -> EngineConfig:
    """EngineConfig from setting name -> value (unnamed settings keep their defaults)."""
    sections: dict[str, dict[str, Any]] = {f.name: {} for f in dataclasses.fields(EngineConfig)}
    for arg in engine_args():
        if arg.name in values:
            sections[arg.section][arg.field] = values[arg.name]
    parts = {f.name: f.default_factory(**sections[f.name]) for f in dataclasses.fields(EngineConfig)}
    return EngineConfig(**parts)


def engine_config_from_args(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """EngineConfig from the flags :func:`add_engine_arguments` defined (``overrides``, by
    setting name, win; e.g. the positional ``model``)."""
    defined = getattr(args, _DEFINED, None)
    if defined is None:
        defined = [a.name for a in engine_args() if a.cli]
    values = {name: getattr(args, name) for name in defined if hasattr(args, name)}
    by_keyword = _by_keyword()
    for key, value in overrides.items():
        if key not in by_keyword:
            raise TypeError(f"{key!r} is not an engine setting{_closest(key, by_keyword)}")
        values[by_keyword[key].name] = value
    return _build(values)


def _by_keyword() -> dict[str, EngineArg]:
    return {k: a for a in engine_args() for k in a.keywords}


def _closest(key: str, names: Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(names), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def default_kv_budget(args: argparse.Namespace, budget: str) -> dict[str, Any]:
    """``{"kv_cache_memory": budget}`` unless the flags size the KV cache some way
    (offline commands use a fixed budget rather than a fraction of the machine)."""
    sized = any(
        getattr(args, name, None) is not None
        for name in ("kv_cache_memory", "gpu_memory_utilization", "num_gpu_blocks_override")
    )
    return {} if sized else {"kv_cache_memory": budget}


def engine_config_from_kwargs(**kwargs: Any) -> EngineConfig:
    """EngineConfig from ``LLM``'s keyword arguments (any spelling a flag has).

    TypeError for an unknown name, naming the closest setting; ValueError when two
    spellings of one setting disagree.
    """
    by_keyword = _by_keyword()
    values: dict[str, Any] = {}
    given: dict[str, str] = {}
    for key, value in kwargs.items():
        arg = by_keyword.get(key)
        if arg is None:
            raise TypeError(f"LLM() got an unexpected keyword argument {key!r}{_closest(key, by_keyword)}")
        if arg.name in values and value is not None and values[arg.name] is not None and values[arg.name] != value:
            raise ValueError(f"{given[arg.name]} and {key} (its alias) disagree: {values[arg.name]!r} != {value!r}")
        if arg.name not in values or values[arg.name] is None:
            values[arg.name], given[arg.name] = value, key
    return _build(values)


def engine_signature(first: Iterable[inspect.Parameter] = ()) -> inspect.Signature:
    """A signature listing every setting's keyword (main spelling, with its default)."""
    params = list(first)
    taken = {p.name for p in params}
    for arg in engine_args():
        if arg.name not in taken:
            params.append(inspect.Parameter(arg.name, inspect.Parameter.KEYWORD_ONLY, default=arg.default))
    return inspect.Signature(params)


def settings_markdown() -> str:
    """The settings table of docs/engine_settings.md (regenerate with
    ``python -m pagedserve.entrypoints.engine_args``)."""
    lines = ["| `LLM(...)` keyword | flag | default | description |", "|---|---|---|---|"]
    for arg in engine_args():
        if not arg.cli:
            flags = "(keyword only)"
        elif arg.type is bool:
            flags = f"`{arg.flags[0]}` / `--no-{arg.flags[0][2:]}`"
        else:
            flags = " ".join(f"`{f}`" for f in arg.flags)
        keywords = ", ".join(f"`{k}`" for k in arg.keywords)
        choices = f" One of: {', '.join(arg.choices)}." if arg.choices else ""
        text = arg.help.replace("|", "\\|")
        lines.append(f"| {keywords} | {flags} | `{arg.default!r}` | {text}.{choices} `{arg.section}.{arg.field}` |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(settings_markdown(), end="")
