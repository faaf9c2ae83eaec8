"""Structure checks that `make test` enforces: import layers, no import cycles, lint.

- ``lint-imports`` checks the contracts of ``[tool.importlinter]`` in pyproject.toml (the
  layers drawn in docs/architecture.md).
- No import cycle among pagedserve modules.  Every executed import statement counts as
  an edge: at module level and inside a function (a lazy import that only defers a
  cycle to run time is still one).  Imports under ``if TYPE_CHECKING:`` do not: they
  are never executed and only name types for annotations.
- ``ruff check`` with the rules of ``[tool.ruff]``, and ``ruff format --check``.

setuptools installs three folders (core/, platforms/, kernels/) as one package;
import-linter and grimp read a package from one folder, so the checks run on a copy of
the sources laid out as installed.  Each check is also run once on a copy with a
violation planted, so that a check that cannot fail fails here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("importlinter")
pytest.importorskip("grimp")

ROOT = Path(__file__).resolve().parents[1]
#: Source folder -> where setuptools installs it inside the package (pyproject package-dir).
PACKAGE_DIRS = {"core": "", "platforms": "platforms", "kernels": "kernels"}

CYCLES_SCRIPT = textwrap.dedent("""
    import sys

    import grimp

    graph = grimp.build_graph("pagedserve", include_external_packages=False, exclude_type_checking_imports=True,
                              cache_dir=None)
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.find_modules_directly_imported_by(v)):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    sys.setrecursionlimit(10000)
    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    for component in cycles:
        print("import cycle among: " + ", ".join(component))
        for a in component:
            for b in sorted(graph.find_modules_directly_imported_by(a) & set(component)):
                lines = [d["line_number"] for d in graph.get_import_details(importer=a, imported=b)]
                print(f"    {a} -> {b} (line {', '.join(map(str, lines))})")
    print(f"{len(graph.modules)} modules, {len(cycles)} import cycles")
    sys.exit(1 if cycles else 0)
""")


def _copy_sources(dest: Path) -> Path:
    """The package as installed, under ``dest``; returns the folder to put on sys.path."""
    for folder, sub in PACKAGE_DIRS.items():
        target = dest / "pagedserve" / sub
        for path in (ROOT / folder).rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            out = target / path.relative_to(ROOT / folder)
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, out)
    return dest


def _run(code_or_args: list[str], tree: Path) -> subprocess.CompletedProcess:
    # PYTHONPATH puts the copy ahead of the editable install (whose finder comes last).
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run(
        [sys.executable, *code_or_args], cwd=tree, env=env, capture_output=True, text=True, timeout=300
    )


def _lint_imports(tree: Path) -> subprocess.CompletedProcess:
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return _run(["-c", code, str(ROOT / "pyproject.toml"), "--no-cache"], tree)


def _find_cycles(tree: Path) -> subprocess.CompletedProcess:
    return _run(["-c", CYCLES_SCRIPT], tree)


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    return _copy_sources(tmp_path_factory.mktemp("structure"))


@pytest.fixture(scope="module")
def broken_tree(tmp_path_factory) -> Path:
    """A copy with layer violations (kernels importing platforms; inside the engine, the
    client interface importing the engine) and an import cycle."""
    tree = _copy_sources(tmp_path_factory.mktemp("structure-broken"))
    with open(tree / "pagedserve" / "kernels" / "reference.py", "a") as f:
        f.write("\nfrom pagedserve.platforms import Platform  # planted layer violation\n")
    with open(tree / "pagedserve" / "engine" / "client.py", "a") as f:
        f.write("\nfrom pagedserve.engine.llm_engine import LLMEngine  # planted layer violation\n")
    with open(tree / "pagedserve" / "kv_cache" / "block_hash.py", "a") as f:
        f.write("\n\ndef _planted():\n    from pagedserve.scheduler import Scheduler  # planted cycle\n")
    return tree


def test_import_layers(tree):
    proc = _lint_imports(tree)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout


def test_no_import_cycles(tree):
    proc = _find_cycles(tree)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert " 0 import cycles" in proc.stdout


def test_ruff_check():
    pytest.importorskip("ruff")
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ruff_format_check():
    """Every file is formatted as `ruff format` writes it (run it to fix)."""
    pytest.importorskip("ruff")
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "--no-cache", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_checks_can_fail(broken_tree):
    layers = _lint_imports(broken_tree)
    assert layers.returncode != 0
    assert "pagedserve.kernels.reference -> pagedserve.platforms" in layers.stdout
    assert "pagedserve.engine.client -> pagedserve.engine.llm_engine" in layers.stdout
    cycles = _find_cycles(broken_tree)
    assert cycles.returncode == 1, cycles.stdout + cycles.stderr
    assert "pagedserve.kv_cache.block_hash -> pagedserve.scheduler" in cycles.stdout
