"""`pagedserve platforms`: every discovered platform, whether it is available and why not.

    pagedserve platforms                 a table: one row per platform and per failed plugin
    pagedserve platforms --json          the same facts for machines
    pagedserve platforms --ops           which implementation each op resolves to on the
                                         selected platform (--device NAME to choose one),
                                         and the measured choices of tuned ops: per op,
                                         shape and row bucket, the chosen candidate and
                                         every candidate's time, as cached on this machine
    pagedserve platforms --ops --tune    tune first on the default model's dense shapes
    pagedserve platforms --ops --model PATH
                                         also whether that model's attention runs a native
                                         kernel or falls back to the torch reference (why)
    pagedserve platforms check [NAME]    run the conformance kit (pagedserve.testing) on
                                         a platform and print a pass/fail report

The exit status is 0 when a platform can be selected and 1 otherwise (the reason is
printed), so scripts can use the command as a preflight check; for ``check``, 0 when
every check passes and 1 otherwise.  Listing imports only the platform layer (torch,
pluggy): never the engine, models or transformers; ``check`` runs the engine.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from typing import Any

__all__ = ["add_parser", "run", "run_check", "collect", "human_bytes"]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the ``platforms`` subcommand."""
    parser = subparsers.add_parser(
        "platforms",
        help="list discovered platforms, their availability and resolved ops",
        description=(
            "List every platform found through the 'pagedserve.platforms' entry-point "
            "group (builtin and third-party), whether it is available and why not, and "
            "plugins that failed to load.  Honours PAGEDSERVE_TARGET_DEVICE and "
            "PAGEDSERVE_PLUGINS.  Exits non-zero when no platform can be selected."
        ),
    )
    parser.add_argument(
        "--device",
        metavar="NAME",
        default=None,
        help="platform to select (like PAGEDSERVE_TARGET_DEVICE); default: auto-detect",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--ops", action="store_true", help="show which implementation each op resolves to on the selected platform"
    )
    parser.add_argument(
        "--tune",
        action="store_true",
        help="with --ops: first tune the tuned ops on the default model's dense linear shapes "
        "(bf16, hidden 576, intermediate 1536, vocabulary 49152); cached per machine",
    )
    # `check` is a positional action rather than a nested subcommand, so the options
    # above keep working in either position (`platforms --json check cpu`).
    parser.add_argument(
        "action",
        nargs="?",
        choices=["check"],
        metavar="check",
        help="check NAME: run the conformance kit on platform NAME (default: --device, "
        "PAGEDSERVE_TARGET_DEVICE, else auto-detection)",
    )
    parser.add_argument("name", nargs="?", metavar="NAME", help="platform for `check`")
    parser.add_argument(
        "--skip-engine", action="store_true", help="check: skip the end-to-end greedy comparison with the cpu reference"
    )
    parser.add_argument(
        "--model",
        metavar="PATH",
        default=None,
        help="check: checkpoint folder for the engine check (default: a tiny random Llama); "
        "with --ops: say whether this model's attention runs a native kernel",
    )
    parser.add_argument("--seed", type=int, default=0, help="check: seed of the random inputs (default 0)")
    parser.add_argument(
        "--only",
        metavar="PREFIXES",
        default=None,
        help="check: run only checks whose id starts with one of these comma-separated "
        "prefixes (e.g. op:linear,platform:)",
    )
    parser.add_argument("--failures-only", action="store_true", help="check: list only checks that did not pass")
    return parser


def human_bytes(n: int | None) -> str:
    """1536 -> '1.5 KiB'; None -> '-'."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


@dataclass
class Report:
    """Everything the command prints, as plain data (the --json output is its dict)."""

    platforms: list[dict[str, Any]] = field(default_factory=list)
    failures: list[dict[str, str]] = field(default_factory=list)
    requested: str | None = None
    selected: str | None = None
    error: str | None = None
    ops: list[dict[str, str]] | None = None
    tuning: list[dict[str, Any]] | None = None
    #: The platform's op_report() (native coverage, counted calls, fallbacks), where it has one.
    native: dict[str, Any] | None = None
    #: With --model: {"model", "head_size", "dtype", "attention": "native" or "reference", "reason"}.
    model_attention: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "platforms": self.platforms,
            "failures": self.failures,
            "requested": self.requested,
            "selected": self.selected,
            "error": self.error,
        }
        if self.ops is not None:
            out["ops"] = self.ops
        if self.tuning is not None:
            out["tuning"] = self.tuning
        if self.native is not None:
            out["native"] = self.native
        if self.model_attention is not None:
            out["model_attention"] = self.model_attention
        return out


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _platform_row(info: Any) -> dict[str, Any]:
    """Facts about one discovered platform; a raising platform method is reported in the row."""
    ok, reason = info.probe()
    row: dict[str, Any] = {
        "name": info.name,
        "plugin": info.plugin,
        "origin": info.origin,
        "builtin": info.builtin,
        "available": ok,
        "reason": reason,
        "default_dtype": None,
        "default_block_size": getattr(info.cls, "default_block_size", None),
        "total_memory": None,
    }
    try:
        platform = info.cls()
        if ok:
            facts = dict(platform.describe())
            if "total_memory_error" in facts:
                row["error"] = facts.pop("total_memory_error")
            row.update(facts)
        else:
            # Memory of a device that is not usable means nothing (and asking for it
            # may try to initialise a driver that is not there).
            row["default_dtype"] = _dtype_name(platform.default_dtype)
    except Exception as exc:  # shown in the row: a third-party platform may be half-built
        row["error"] = f"{type(exc).__name__}: {exc}"
    if row["total_memory"] is not None:
        row["total_memory_human"] = human_bytes(row["total_memory"])
    return row


#: (out, in) of the default model's (SmolLM2-135M) dense linear layers: fused qkv, o,
#: fused gate/up (also the gated op), down, LM head.
DEFAULT_MODEL_LINEARS = ((960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576))
GATED_SHAPE = (3072, 576)


def tune_default_shapes(ops: Any) -> None:
    """Run the registry's ``prepare_linear_weight`` (and ``linear_silu_and_mul``, tuned at
    its first call) on random bf16 weights of the default model's shapes: a tuning
    platform times its candidates there and caches the plans."""
    import torch

    with torch.inference_mode():
        for n, k in DEFAULT_MODEL_LINEARS:
            w = ops.prepare_linear_weight(torch.randn(n, k, dtype=torch.bfloat16) * 0.05)
            if (n, k) == GATED_SHAPE:
                ops.linear_silu_and_mul(torch.randn(1, k, dtype=torch.bfloat16), w)


def tuning_rows(ops: Any) -> list[dict[str, Any]] | None:
    """The measured choices of every op whose implementation carries ``tuning_report()``;
    None when no op does (a platform that tunes nothing)."""
    rows: list[dict[str, Any]] | None = None
    seen: set[int] = set()
    for name, _ in ops.table():
        report = getattr(ops.get(name), "tuning_report", None)
        if report is not None and id(report) not in seen:
            seen.add(id(report))
            rows = (rows or []) + list(report())
    return rows


def model_attention(platform: Any, model: str) -> dict[str, Any] | None:
    """Whether ``model``'s paged attention runs a native kernel of ``platform`` in the
    platform's default dtype (None when the platform cannot say)."""
    check = getattr(platform, "attention_fallback", None)
    if check is None:
        return None
    from pagedserve.loader import open_model
    from pagedserve.models.arch_config import ArchConfig

    arch = ArchConfig.from_hf(open_model(model).hf_config)
    reason = check(arch.head_dim, platform.default_dtype)
    return {
        "model": model,
        "head_size": arch.head_dim,
        "dtype": _dtype_name(platform.default_dtype),
        "attention": "native" if reason is None else "reference",
        "reason": reason,
    }


def collect(
    device: str | None = None,
    want_ops: bool = False,
    env: dict[str, str] | None = None,
    tune: bool = False,
    model: str | None = None,
) -> Report:
    """Discover, describe and try to select; never raises a PlatformError (it is reported)."""
    from pagedserve.platforms import PlatformError, discover

    report = Report()
    try:
        registry = discover(env)
    except PlatformError as exc:
        report.error = str(exc)
        return report
    report.platforms = [_platform_row(info) for info in registry.platforms.values()]
    report.failures = [{"plugin": f.plugin, "origin": f.origin, "error": f.error} for f in registry.failures]
    try:
        report.requested = registry.requested_name(device)
        info = registry.select(device)
        report.selected = info.name
        if want_ops:
            platform = info.cls()
            ops = registry.resolve_ops(platform)
            report.ops = [
                {"op": name, "source": source, "implementation": _qualname(ops.get(name))}
                for name, source in ops.table()
            ]
            if tune:
                tune_default_shapes(ops)
            report.tuning = tuning_rows(ops)
            op_report = getattr(platform, "op_report", None)
            report.native = op_report() if op_report is not None else None
            if model is not None:
                report.model_attention = model_attention(platform, model)
    except PlatformError as exc:
        report.error = str(exc)
    return report


def _qualname(fn: Any) -> str:
    module = getattr(fn, "__module__", None) or "?"
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    return f"{module}.{name}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    """Left-aligned columns; the last column is not padded (reasons can be long)."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]
    lines = []
    for r in [header, *rows]:
        cells = [c.ljust(w) for c, w in zip(r, widths)] + [r[-1]]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _format_text(report: Report, show_ops: bool) -> str:
    out: list[str] = []
    if show_ops:
        if report.ops is not None:
            out.append(f"ops on platform {report.selected!r}:")
            out.append(
                _table(
                    ["OP", "SOURCE", "IMPLEMENTATION"],
                    [[o["op"], o["source"], o["implementation"]] for o in report.ops],
                )
            )
            if report.tuning is not None:
                out.append(_format_tuning(report.tuning))
            if report.native is not None:
                out.append(_format_native(report.native))
            if report.model_attention is not None:
                m = report.model_attention
                how = "a native kernel" if m["reason"] is None else f"the torch reference (slow): {m['reason']}"
                out.append(f"\n{m['model']}: paged attention (head size {m['head_size']}, {m['dtype']}) runs {how}")
        return "\n".join(out)
    rows: list[list[str]] = []
    for p in report.platforms:
        mark = "*" if p["name"] == report.selected else " "
        reason = p["reason"] + (f" [error: {p['error']}]" if p.get("error") else "")
        rows.append(
            [
                f"{mark} {p['name']}",
                p["origin"],
                "yes" if p["available"] else "no",
                p["default_dtype"] or "-",
                str(p["default_block_size"] or "-"),
                human_bytes(p["total_memory"]),
                reason,
            ]
        )
    for f in report.failures:
        rows.append([f"! {f['plugin']}", f["origin"], "failed", "-", "-", "-", f["error"]])
    out.append(_table(["  PLATFORM", "ORIGIN", "AVAILABLE", "DTYPE", "BLOCK", "MEMORY", "REASON"], rows))
    if report.selected is not None:
        how = "requested" if report.requested else "auto-detected"
        out.append(f"\nselected: {report.selected} ({how})")
    return "\n".join(out)


def _format_native(native: dict[str, Any]) -> str:
    """Native coverage, and the counted calls and fallbacks of this process."""
    if not native["native"]:
        return "\nnative kernels: not loaded; every op runs the torch reference"
    sizes = ", ".join(str(h) for h in native["attention_head_sizes"])
    lines = [
        f"\nnative paged attention: head sizes {sizes} (float32, bfloat16, float16); any other "
        "shape falls back to the torch reference, logged once per reason"
    ]
    for reason, calls in native["fallbacks"].items():
        lines.append(f"  fell back: {reason} ({calls} calls)")
    return "\n".join(lines)


def _format_tuning(rows: list[dict[str, Any]]) -> str:
    """The measured choices: one line per op, shape and row bucket."""
    if not rows:
        return (
            "\nmeasured choices: none cached on this machine yet (loading a model tunes its "
            "shapes; `pagedserve platforms --ops --tune` tunes the default model's)"
        )

    def machine(r: dict[str, Any]) -> str:
        slowdown = r.get("slowdown")
        return "-" if slowdown is None else f"{slowdown:.2f}x" + (" slow" if r.get("slow") else "")

    body = [
        [
            r["op"],
            r["key"],
            str(r["rows"]),
            r["chosen"],
            machine(r),
            "  ".join(f"{n} {t:g}" for n, t in r["times_us"].items()),
        ]
        for r in rows
    ]
    note = ""
    if any(r.get("slow") for r in rows):
        note = (
            "\n(slow: timed while this machine ran slower than its best; timed again at the next load "
            "that finds it at full speed, the smaller figures kept)"
        )
    return (
        "\nmeasured choices (cached on this machine; times in us, fastest first; MACHINE: how much "
        "slower the machine ran while the plan was timed than at its best):\n"
        + _table(["OP", "SHAPE", "ROWS", "CHOSEN", "MACHINE", "TIMES"], body)
        + note
    )


def run_check(args: argparse.Namespace) -> int:
    """`pagedserve platforms check [NAME]`: the conformance report; 1 unless every check passed."""
    from pagedserve.testing import ConformanceReport, run_conformance

    name = args.name or args.device
    if args.name and args.device and args.name != args.device:
        print(
            f"pagedserve platforms check: error: NAME {args.name!r} and --device {args.device!r} disagree",
            file=sys.stderr,
        )
        return 2

    def progress(result: Any) -> None:
        if not args.failures_only or result.status != "passed":
            print(ConformanceReport.format_result(result), flush=True)

    only = [p.strip() for p in args.only.split(",") if p.strip()] if args.only else None
    report = run_conformance(
        name,
        engine=not args.skip_engine,
        model=args.model,
        seed=args.seed,
        only=only,
        progress=None if args.json else progress,
    )
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(("\n" if report.results else "") + report.format(lines=False))
    if report.error is not None:
        print(f"pagedserve platforms check: error: {report.error}", file=sys.stderr)
    return 0 if report.ok else 1


def run(args: argparse.Namespace) -> int:
    """Print the listing (or the op table); 1 when no platform can be selected."""
    if getattr(args, "action", None) == "check":
        return run_check(args)
    report = collect(
        device=args.device,
        want_ops=args.ops,
        tune=getattr(args, "tune", False),
        model=getattr(args, "model", None) if args.ops else None,
    )
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        text = _format_text(report, show_ops=args.ops)
        if text:
            print(text)
    if report.error is not None:
        print(f"pagedserve platforms: error: {report.error}", file=sys.stderr)
        return 1
    return 0
