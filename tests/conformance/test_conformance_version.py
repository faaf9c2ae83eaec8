"""The versioned plugin interface: a plugin for an incompatible interface version is a
named PluginFailure (shown by `pagedserve platforms`), and hook implementations that
take only some of a hook's arguments keep working as specs grow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pluggy
import pytest
import torch

from pagedserve.kernels import reference
from pagedserve.platforms import (
    PLATFORM_INTERFACE_VERSION,
    Platform,
    PlatformError,
    PlatformRegistry,
    hookimpl,
    hookspecs,
)
from pagedserve.platforms.interface import FIRST_INTERFACE_VERSION, check_interface_version

PLATFORM_PLUGIN = """
import torch
from pagedserve.platforms import Platform, hookimpl


class VersionedPlatform(Platform):
    name = "versioned"
    supported_dtypes = (torch.float32,)
    {declaration}

    @classmethod
    def is_available(cls):
        return True, "always"

    def total_memory(self):
        return 1024**3

    def free_memory(self):
        return 1024**3


@hookimpl
def pagedserve_register_platforms(register):
    register(VersionedPlatform)
"""


def platform_plugin(version: str | None) -> types.ModuleType:
    declaration = "" if version is None else f"interface_version = {version!r}"
    module = types.ModuleType("versioned_plugin")
    exec(PLATFORM_PLUGIN.format(declaration=declaration), module.__dict__)
    return module


def register(plugin: object, name: str = "versioned") -> PlatformRegistry:
    reg = PlatformRegistry(env={})
    reg.register_plugin(plugin, name, "versioned-platform 0.3")
    return reg


def test_the_core_declares_a_major_minor_version():
    major, minor = PLATFORM_INTERFACE_VERSION.split(".")
    assert major.isdigit() and minor.isdigit()
    assert hookspecs.PLATFORM_INTERFACE_VERSION == PLATFORM_INTERFACE_VERSION
    assert Platform.interface_version == FIRST_INTERFACE_VERSION == "1.0"


@pytest.mark.parametrize("version", [None, "1.0", PLATFORM_INTERFACE_VERSION])
def test_compatible_platforms_register(version):
    reg = register(platform_plugin(version))
    assert reg.failures == [] and "versioned" in reg.platforms
    assert reg.select("versioned").cls.interface_version == (version or "1.0")


@pytest.mark.parametrize(
    ("version", "advice"),
    [
        ("2.0", "upgrade pagedserve"),
        ("1.99", "upgrade pagedserve"),  # a newer minor than the core: it may use what 1.0 lacks
        ("0.9", "major versions are incompatible"),
    ],
)
def test_incompatible_platforms_are_named_failures(version, advice):
    reg = register(platform_plugin(version))
    assert reg.platforms.get("versioned") is None
    [failure] = reg.failures
    assert failure.plugin == "versioned" and failure.origin == "versioned-platform 0.3"
    assert (
        f"platform 'versioned' (VersionedPlatform) targets pagedserve platform interface {version}, "
        f"but this pagedserve provides interface {PLATFORM_INTERFACE_VERSION}"
    ) in failure.error
    assert advice in failure.error
    with pytest.raises(PlatformError, match=f"interface {version}"):
        reg.select("versioned")


@pytest.mark.parametrize("version", ["one", "1", "1.0.0", "v1.0"])
def test_malformed_versions_are_named_failures(version):
    [failure] = register(platform_plugin(version)).failures
    assert f"declares interface version {version!r}, which is not a 'MAJOR.MINOR' string" in failure.error


def test_a_newer_core_minor_runs_older_plugins():
    check_interface_version("1.0", "p", provided="1.3")
    check_interface_version("1.3", "p", provided="1.3")
    with pytest.raises(
        PlatformError, match="targets pagedserve platform interface 1.4, but this pagedserve provides interface 1.3"
    ):
        check_interface_version("1.4", "p", provided="1.3")
    with pytest.raises(PlatformError, match="built for interface 2.x"):
        check_interface_version("1.3", "p", provided="2.0")


# -- plugins without a platform declare their version as a module attribute --------------


def ops_plugin(version: str | None, seen: list[str]) -> types.ModuleType:
    """A kernels-only add-on whose hook takes only ``ops`` (a subset of the spec's arguments)."""
    module = types.ModuleType("addon")
    if version is not None:
        module.PAGEDSERVE_INTERFACE_VERSION = version

    def silu_and_mul(x):
        d = x.shape[-1] // 2
        return torch.nn.functional.silu(x[..., :d]) * x[..., d:]

    @hookimpl
    def pagedserve_register_ops(ops):
        seen.append("ops")
        ops.register("silu_and_mul", silu_and_mul, source="addon")

    @hookimpl
    def pagedserve_register_platforms():  # takes nothing: registers no platform
        seen.append("platforms")

    module.pagedserve_register_ops = pagedserve_register_ops
    module.pagedserve_register_platforms = pagedserve_register_platforms
    return module


def registry_with(plugin: object) -> PlatformRegistry:
    """A platform-providing plugin plus the add-on ``plugin``."""
    reg = PlatformRegistry(env={})
    reg.register_plugin(platform_plugin(None), "versioned", "versioned-platform 0.3")
    reg.register_plugin(plugin, "addon", "addon 1.0")
    return reg


def test_hooks_taking_a_subset_of_the_arguments_still_work():
    seen: list[str] = []
    reg = registry_with(ops_plugin("1.0", seen))
    assert reg.failures == []
    ops = reg.resolve_ops(reg.select("versioned").cls())
    assert seen == ["platforms", "ops"]
    assert ops.source("silu_and_mul") == "addon"
    x = torch.randn(3, 8)
    torch.testing.assert_close(ops.silu_and_mul(x), reference.silu_and_mul(x))


def test_an_ops_plugin_for_another_major_version_contributes_nothing():
    seen: list[str] = []
    reg = registry_with(ops_plugin("2.0", seen))
    [failure] = reg.failures
    assert failure.plugin == "addon"
    assert failure.error.startswith(
        "plugin 'addon' targets pagedserve platform interface 2.0, but this "
        f"pagedserve provides interface {PLATFORM_INTERFACE_VERSION}"
    )
    # Refused before its hooks were registered: no half-registered plugin.
    assert reg.pm.get_plugin("addon") is None and seen == []


def test_pluggy_lets_a_spec_grow_without_breaking_older_implementations():
    """The mechanism behind the minor-version promise: a spec that gains an argument
    still calls implementations written against the old argument list."""

    class GrownSpecs:
        @hookspecs.hookspec
        def pagedserve_register_ops(self, platform, ops, interface_version):
            """The 1.0 hook with an argument added in a later minor version."""

    calls: list[tuple] = []

    class OldPlugin:
        @hookimpl
        def pagedserve_register_ops(self, platform, ops):
            calls.append((platform, ops))

    class NewPlugin:
        @hookimpl
        def pagedserve_register_ops(self, ops, interface_version):
            calls.append((ops, interface_version))

    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(GrownSpecs)
    pm.register(OldPlugin())
    pm.register(NewPlugin())
    pm.check_pending()
    pm.hook.pagedserve_register_ops(platform="p", ops="o", interface_version="1.1")
    assert sorted(calls) == sorted([("p", "o"), ("o", "1.1")])


# -- the listing shows a version mismatch ---------------------------------------------------


def test_pagedserve_platforms_shows_the_version_mismatch(tmp_path: Path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "versioned_plugin.py").write_text(
        PLATFORM_PLUGIN.format(declaration='interface_version = "2.0"'), encoding="utf-8"
    )
    info = site / "versioned_platform-0.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: versioned-platform\nVersion: 0.3\n")
    (info / "entry_points.txt").write_text("[pagedserve.platforms]\nversioned = versioned_plugin\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_") and k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "platforms"]
    proc = subprocess.run([*cmd, "--json"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1  # a failed plugin blocks selection
    [failure] = json.loads(proc.stdout)["failures"]
    assert failure["plugin"] == "versioned" and failure["origin"] == "versioned-platform 0.3"
    assert "interface 2.0" in failure["error"] and f"interface {PLATFORM_INTERFACE_VERSION}" in failure["error"]
    text = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    row = next(line for line in text.stdout.splitlines() if line.startswith("! versioned"))
    assert "failed" in row and "targets pagedserve platform interface 2.0" in row
