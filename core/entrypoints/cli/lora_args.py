"""Server flags of multi-LoRA serving (docs/lora.md).  The engine settings
(``--enable-lora``, ``--max-loras``, ``--max-lora-rank``, ``--max-cpu-loras``) come from
``pagedserve.config.LoRAConfig``; these are the HTTP side."""

from __future__ import annotations

import argparse

__all__ = ["add_lora_server_arguments", "lora_modules_from_args", "check_lora_modules"]


def add_lora_server_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("LoRA adapters (docs/lora.md)")
    group.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="adapters to serve, each name=path or a JSON object "
        '\'{"name": ..., "path": ...}\'; a request picks one by its `model` '
        "(needs --enable-lora)",
    )
    group.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter",
    )


def lora_modules_from_args(args: argparse.Namespace, enable_lora: bool) -> list[tuple[str, str]]:
    """The (name, path) pairs of ``--lora-modules``; ValueError on a bad entry, a repeated
    name, or adapters without --enable-lora."""
    from pagedserve.lora.registry import parse_lora_module

    pairs = [parse_lora_module(v) for v in (getattr(args, "lora_modules", None) or [])]
    names = [n for n, _ in pairs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"--lora-modules names {dup} more than once")
    if (pairs or getattr(args, "allow_runtime_lora_updating", False)) and not enable_lora:
        raise ValueError("--lora-modules and --allow-runtime-lora-updating need --enable-lora")
    return pairs


def check_lora_modules(engine, modules: list[tuple[str, str]]) -> None:
    """Read every ``--lora-modules`` adapter once against ``engine``'s model; SystemExit
    naming the first that cannot be served."""
    from pagedserve.lora import load_adapter

    for name, path in modules:
        try:
            load_adapter(path, engine.arch, engine.config.lora.max_lora_rank)
        except ValueError as exc:
            raise SystemExit(f"pagedserve serve: --lora-modules {name}: {exc}") from None
