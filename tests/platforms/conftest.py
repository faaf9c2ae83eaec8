"""Fixtures for the platform-layer tests: throwaway distributions found through real
entry points, a clean environment, and a runner for the `pagedserve` command.

Helpers are handed out as fixtures (not imported from this file) so the tests work
under any pytest import mode and next to other directories' conftest.py files.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

#: A complete third-party plugin module: one platform, one op override for it.
PLUGIN_TEMPLATE = """
import torch

from pagedserve.platforms import Platform, hookimpl


class {cls}(Platform):
    name = {name!r}
    device_type = "cpu"
    supported_dtypes = (torch.float32,)

    @classmethod
    def is_available(cls):
        return {available!r}, {reason!r}

    def total_memory(self):
        return 3 * 1024**3

    def free_memory(self):
        return 1024**3


def silu_and_mul(x):
    d = x.shape[-1] // 2
    gate = x[..., :d].float()
    return (gate * torch.sigmoid(gate) * x[..., d:].float()).to(x.dtype)


@hookimpl
def pagedserve_register_platforms(register):
    register({cls})


@hookimpl
def pagedserve_register_ops(platform, ops):
    if isinstance(platform, {cls}):
        ops.register("silu_and_mul", silu_and_mul, source={source!r})
"""


def plugin_source(
    name: str, *, available: bool = True, reason: str = "fake device present", source: str | None = None
) -> str:
    """Source of a plugin module providing platform ``name`` (see PLUGIN_TEMPLATE)."""
    cls = "".join(part.capitalize() for part in name.replace("-", "_").split("_")) + "Platform"
    return PLUGIN_TEMPLATE.format(
        cls=cls, name=name, available=available, reason=reason, source=source or f"{name}-kernels"
    )


MakeDist = Callable[..., Path]


@pytest.fixture
def make_dist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[MakeDist]:
    """Create an installed-looking distribution in a fresh directory on sys.path.

    ``make_dist("acme-accel", {"acme_accel": source}, entry_points={"acme": "acme_accel"})``
    writes ``acme_accel.py`` and ``acme_accel-0.1.dist-info/`` (METADATA and
    entry_points.txt with a ``[pagedserve.platforms]`` section) -- exactly what pip
    leaves behind -- so discovery goes through importlib.metadata, not a test hook.
    Everything is undone afterwards (sys.path, sys.modules, import caches).
    """
    modules: list[str] = []

    def make(
        dist: str,
        modules_src: dict[str, str],
        *,
        version: str = "0.1",
        entry_points: dict[str, str] | None = None,
    ) -> Path:
        site = tmp_path / f"site-{dist}-{len(modules)}"
        site.mkdir()
        for mod, src in modules_src.items():
            (site / f"{mod}.py").write_text(textwrap.dedent(src), encoding="utf-8")
            modules.append(mod)
        eps = entry_points if entry_points is not None else {m: m for m in modules_src}
        info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n", encoding="utf-8")
        lines = ["[pagedserve.platforms]", *(f"{k} = {v}" for k, v in eps.items()), ""]
        (info / "entry_points.txt").write_text("\n".join(lines), encoding="utf-8")
        monkeypatch.syspath_prepend(str(site))
        # The path finders and importlib.metadata cache directory listings keyed on the
        # directory's mtime; a coarse-mtime filesystem could hide files written within
        # the same tick, so drop the caches explicitly rather than rely on timing.
        importlib.invalidate_caches()
        return site

    yield make
    for mod in modules:
        sys.modules.pop(mod, None)
    importlib.invalidate_caches()


@pytest.fixture
def clean_env() -> dict[str, str]:
    """An environment without platform-selection variables (the user's must not leak in)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")}


@pytest.fixture
def plugin_src() -> Callable[..., str]:
    """``plugin_src("acme", available=False, reason=...)``: source of a plugin module."""
    return plugin_source


@pytest.fixture
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture
def cli() -> Callable[..., subprocess.CompletedProcess[str]]:
    """``cli("platforms", "--ops", env={...})``: run the command in a fresh interpreter."""
    return run_cli


@pytest.fixture
def cli_json() -> Callable[..., tuple[int, dict]]:
    """``rc, data = cli_json("platforms", ...)``: the same, with --json parsed."""
    return run_cli_json


def run_cli(
    *args: str, env: dict[str, str] | None = None, python: str | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``pagedserve ARGS`` in a fresh interpreter (the real process boundary)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_") and k != "PYTHONPATH"}
    base.update(env or {})
    cmd = [python or sys.executable, "-m", "pagedserve.entrypoints.cli", *args]
    return subprocess.run(cmd, env=base, cwd=cwd, capture_output=True, text=True, timeout=120)


def run_cli_json(*args: str, **kwargs) -> tuple[int, dict]:
    proc = run_cli(*args, "--json", **kwargs)
    try:
        return proc.returncode, json.loads(proc.stdout)
    except json.JSONDecodeError as exc:
        raise AssertionError(f"not JSON (rc={proc.returncode}):\n{proc.stdout}\n{proc.stderr}") from exc
