"""examples/hello_platform: a separately pip-installed distribution adds a platform and
an op to pagedserve without any change to pagedserve itself."""

from __future__ import annotations

import shutil
import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest
import torch

from pagedserve.kernels import reference
from pagedserve.platforms import discover


@pytest.fixture
def hello_src(repo_root: Path, monkeypatch: pytest.MonkeyPatch):
    """The example's source tree importable in this process (no install)."""
    monkeypatch.syspath_prepend(str(repo_root / "examples" / "hello_platform"))
    yield
    for mod in [m for m in sys.modules if m == "hello_platform" or m.startswith("hello_platform.")]:
        del sys.modules[mod]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 2), (7, 64), (2, 3, 2 * 96)])
def test_hello_silu_and_mul_matches_the_reference(hello_src, shape, dtype):
    from hello_platform.ops import silu_and_mul

    x = torch.randn(shape).mul_(4).to(dtype)
    got, want = silu_and_mul(x), reference.silu_and_mul(x)
    assert got.dtype == dtype and got.shape == (*shape[:-1], shape[-1] // 2)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_hello_registers_through_the_hooks(hello_src, clean_env):
    import hello_platform

    from pagedserve.platforms import PlatformRegistry

    reg = PlatformRegistry(clean_env)
    reg.register_plugin(hello_platform, "hello", "hello-platform 0.1.0")
    assert reg.failures == [] and reg.platforms["hello"].probe()[0]
    platform = reg.select("hello").cls()
    assert platform.total_memory() > 0
    ops = reg.resolve_ops(platform)
    assert ops.silu_and_mul is hello_platform.ops.silu_and_mul
    assert ops.source("silu_and_mul") == "hello_platform"


def _make_venv(path: Path) -> Path:
    """A throwaway venv that also sees this interpreter's packages (torch, pagedserve).

    ``--system-site-packages`` exposes the *base* interpreter's site-packages; when the
    tests themselves run inside a venv, torch and the editable pagedserve live in that
    venv instead, so a .pth file adds its site directories too (``addsitedir`` also runs
    their .pth files, which is how the editable install of pagedserve is found).
    """
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(path)
    python = path / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    dirs = [d for d in site.getsitepackages() if Path(d).is_dir()]
    lines = [f"import site; site.addsitedir({d!r})" for d in dirs]
    Path(purelib, "_pagedserve_test_parent_env.pth").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return python


def test_pip_installed_hello_platform_is_discovered(tmp_path, repo_root, cli, cli_json, clean_env):
    # --no-build-isolation builds with this environment's setuptools (no network).
    pytest.importorskip("setuptools", minversion="77", reason="building hello-platform offline needs setuptools>=77")
    # Build from a copy: setuptools leaves build/ and *.egg-info next to the sources.
    src = shutil.copytree(repo_root / "examples" / "hello_platform", tmp_path / "hello_platform_src")
    python = _make_venv(tmp_path / "venv")
    install = subprocess.run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--no-cache-dir",
            "--disable-pip-version-check",
            "-q",
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert install.returncode == 0, install.stdout + install.stderr

    rc, data = cli_json("platforms", python=str(python), cwd=tmp_path)
    assert rc == 0, data
    rows = {p["name"]: p for p in data["platforms"]}
    assert rows["hello"]["origin"] == "hello-platform 0.1.0"
    assert rows["hello"]["available"] is True and rows["hello"]["default_dtype"] == "float32"
    assert {"cpu", "cuda", "rocm"} <= set(rows)
    assert data["selected"] == "hello"  # the single available third-party platform

    proc = cli("platforms", "--ops", env={"PAGEDSERVE_TARGET_DEVICE": "hello"}, python=str(python), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == "ops on platform 'hello':"
    silu = next(line for line in proc.stdout.splitlines() if line.startswith("silu_and_mul"))
    assert silu.split()[1:] == ["hello_platform", "hello_platform.ops.silu_and_mul"]
    others = [line.split()[1] for line in proc.stdout.splitlines()[2:] if line and not line.startswith("silu")]
    assert others and set(others) == {"reference"}

    # Only the throwaway venv has it: this interpreter's discovery is unchanged...
    assert "hello" not in discover(clean_env).platforms
    # ...and pagedserve's own sources do not know about it.
    for pkg in ("core", "platforms", "kernels"):
        for path in (repo_root / pkg).rglob("*.py"):
            assert "hello_platform" not in path.read_text(encoding="utf-8"), path
