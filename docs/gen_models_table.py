"""Regenerate the supported-architectures table of docs/models.md from the model registry.

python docs/gen_models_table.py          # rewrite the table in place
python docs/gen_models_table.py --check  # exit 1 if docs/models.md is stale
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from pagedserve.models import model_entries

BEGIN = "<!-- BEGIN GENERATED: supported architectures (docs/gen_models_table.py) -->"
END = "<!-- END GENERATED -->"
DOC = pathlib.Path(__file__).with_name("models.md")


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def render_table() -> str:
    """The Markdown table, one row per registered architecture."""
    rows = [
        "| Architecture | model_type | safetensors | GGUF `general.architecture` | quantized | tensor parallel "
        "| notes |",
        "|---|---|---|---|---|---|---|",
    ]
    for e in model_entries():
        gguf = ", ".join(f"`{g}`" for g in e.gguf) or "no"
        rows.append(
            f"| `{e.architecture}` | `{e.model_type}` | yes | {gguf} | {_yes(e.quantized)} | "
            f"{_yes(e.tensor_parallel)} | {e.notes} |"
        )
    return "\n".join(rows)


def updated(text: str) -> str:
    """``text`` with the part between the markers replaced by the current table."""
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[:start] + "\n" + render_table() + "\n" + text[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if docs/models.md is out of date")
    args = parser.parse_args(argv)
    text = DOC.read_text(encoding="utf-8")
    new = updated(text)
    if args.check:
        if new != text:
            print(f"{DOC} is out of date; run python docs/gen_models_table.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
