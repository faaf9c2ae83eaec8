"""`pagedserve platforms`: as a real subprocess for the builtins, in-process for plugins
written into a temporary directory (so those tests need no subprocess per case)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from pagedserve.entrypoints import cli as cli_main
from pagedserve.entrypoints.cli.platforms_cmd import human_bytes
from pagedserve.kernels import reference

CPU_ONLY_TORCH = not torch.version.cuda and not getattr(torch.version, "hip", None)


def test_json_lists_the_builtins(cli_json):
    rc, data = cli_json("platforms")
    assert rc == 0, data
    rows = {p["name"]: p for p in data["platforms"]}
    assert {"cpu", "cuda", "rocm"} <= set(rows)
    assert rows["cpu"]["available"] is True and rows["cpu"]["origin"] == "builtin"
    assert rows["cpu"]["total_memory"] > 0 and rows["cpu"]["default_dtype"] in ("float32", "bfloat16")
    assert data["error"] is None and data["failures"] == []
    if CPU_ONLY_TORCH:
        assert data["selected"] == "cpu"
        for gpu in ("cuda", "rocm"):
            assert rows[gpu]["available"] is False and "CPU-only build" in rows[gpu]["reason"]
            assert rows[gpu]["total_memory"] is None


def test_ops_lists_every_op(cli, cli_json):
    rc, data = cli_json("platforms", "--ops", "--device", "cpu")
    assert rc == 0, data
    assert [o["op"] for o in data["ops"]] == list(reference.OP_NAMES)
    for o in data["ops"]:
        if o["source"] == "reference":
            assert o["implementation"] == f"pagedserve.kernels.reference.{o['op']}"
    text = cli("platforms", "--ops", env={"PAGEDSERVE_TARGET_DEVICE": "cpu"})
    assert text.returncode == 0, text.stderr
    # The op table ends at the first blank line (the measured choices follow it).
    table = text.stdout.split("\n\n", 1)[0]
    listed = {line.split()[0] for line in table.splitlines()[2:] if line.strip()}
    assert listed == set(reference.OP_NAMES)
    assert "measured choices" in text.stdout


def test_failed_selection_exits_non_zero_with_the_message(cli):
    proc = cli("platforms", "--device", "tpu")
    assert proc.returncode == 1
    assert "unknown platform 'tpu'; known platforms: cpu, cuda, rocm" in proc.stderr
    assert "cpu" in proc.stdout  # the listing is still printed: it is the diagnosis


def test_the_command_stays_light(cli):
    """Listing platforms must not pull in the engine, the models or transformers."""
    code = (
        "import sys; from pagedserve.entrypoints.cli import main; rc = main(['platforms', '--ops']); "
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] == 'transformers' "
        "or m.startswith(('pagedserve.engine', 'pagedserve.models', 'pagedserve.executor', "
        "'pagedserve.scheduler', 'pagedserve.loader'))); "
        "print('HEAVY', heavy); sys.exit(rc)"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "HEAVY []" in proc.stdout


# -- in-process, with throwaway plugin distributions ------------------------------------

BROKEN = 'raise ImportError("libacme.so.3: cannot open shared object file")\n'


def _main(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli_main.main(["platforms", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture
def env(monkeypatch):
    for key in ("PAGEDSERVE_TARGET_DEVICE", "PAGEDSERVE_PLUGINS"):
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def test_third_party_row_and_ops(make_dist, plugin_src, env, capsys):
    make_dist(
        "acme-accel",
        {"acme_accel": plugin_src("acme", source="acme-kernels")},
        version="1.2.0",
        entry_points={"acme": "acme_accel"},
    )
    rc, out, err = _main(capsys, "--json")
    assert rc == 0, err
    data = json.loads(out)
    row = next(p for p in data["platforms"] if p["name"] == "acme")
    assert row["origin"] == "acme-accel 1.2.0" and row["available"] is True
    assert row["default_dtype"] == "float32" and row["total_memory_human"] == "3.0 GiB"
    assert data["selected"] == "acme"

    rc, out, _ = _main(capsys)
    acme_line = next(line for line in out.splitlines() if " acme " in line)
    assert acme_line.startswith("* acme") and "acme-accel 1.2.0" in acme_line and "3.0 GiB" in acme_line
    assert "selected: acme (auto-detected)" in out

    env.setenv("PAGEDSERVE_TARGET_DEVICE", "acme")
    rc, out, _ = _main(capsys, "--ops")
    assert rc == 0
    silu = next(line for line in out.splitlines() if line.startswith("silu_and_mul"))
    assert silu.split()[1:] == ["acme-kernels", "acme_accel.silu_and_mul"]


def test_failed_plugin_gets_a_row_and_a_non_zero_exit(make_dist, env, capsys):
    make_dist("acme-broken", {"acme_broken": BROKEN}, version="0.9", entry_points={"acme": "acme_broken"})
    rc, out, err = _main(capsys)
    assert rc == 1
    row = next(line for line in out.splitlines() if line.startswith("! acme"))
    assert "acme-broken 0.9" in row and "failed" in row and "ImportError: libacme.so.3" in row
    assert "acme-broken 0.9" in err and "libacme.so.3" in err

    rc, out, _ = _main(capsys, "--json")
    data = json.loads(out)
    assert rc == 1 and data["selected"] is None and "libacme.so.3" in data["error"]
    assert data["failures"] == [
        {
            "plugin": "acme",
            "origin": "acme-broken 0.9",
            "error": "import raised ImportError: libacme.so.3: cannot open shared object file",
        }
    ]

    env.setenv("PAGEDSERVE_PLUGINS", "pagedserve")  # the way out the error message suggests
    assert _main(capsys)[0] == 0


def test_conflicting_requests(env, capsys):
    env.setenv("PAGEDSERVE_TARGET_DEVICE", "cpu")
    rc, _, err = _main(capsys, "--device", "rocm")
    assert rc == 1 and "conflicting" in err


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (None, "-"),
        (0, "0 B"),
        (1023, "1023 B"),
        (1536, "1.5 KiB"),
        (3 * 1024**3, "3.0 GiB"),
        (5 * 1024**5, "5120.0 TiB"),
    ],
)
def test_human_bytes(n, text):
    assert human_bytes(n) == text
