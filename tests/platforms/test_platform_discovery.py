"""Discovery and selection of third-party platforms through real entry points."""

from __future__ import annotations

import sys

import pytest
import torch

from pagedserve.kernels import reference
from pagedserve.platforms import PlatformError, discover, select_platform


@pytest.fixture
def acme(make_dist, plugin_src):
    """An installed distribution "acme-accel" 0.1 whose plugin "acme" provides platform "acme"."""
    make_dist(
        "acme-accel", {"acme_accel": plugin_src("acme", source="acme-kernels")}, entry_points={"acme": "acme_accel"}
    )


def test_listed_with_distribution_name_and_version(acme, clean_env):
    reg = discover(clean_env)
    assert reg.failures == []
    info = reg.platforms["acme"]
    assert info.origin == "acme-accel 0.1"
    assert info.plugin == "acme"
    assert not info.builtin
    assert info.probe() == (True, "fake device present")
    # The plugin is the module the entry point names, imported by discovery itself.
    assert info.cls.__module__ == "acme_accel" and "acme_accel" in sys.modules
    # Builtins come through the same entry-point path, from the pagedserve distribution.
    assert {n: reg.platforms[n].origin for n in ("cpu", "cuda", "rocm")} == dict.fromkeys(
        ("cpu", "cuda", "rocm"), "builtin"
    )


def test_selectable_by_device_argument(acme, clean_env):
    platform, ops = select_platform(device="acme", env=clean_env)
    assert type(platform).__name__ == "AcmePlatform" and platform.name == "acme"
    assert ops.source("silu_and_mul") == "acme-kernels"


def test_selectable_by_env_variable(acme, clean_env):
    platform, _ = select_platform(env={**clean_env, "PAGEDSERVE_TARGET_DEVICE": "acme"})
    assert platform.name == "acme"
    # The same request through both channels is not a conflict.
    assert discover({**clean_env, "PAGEDSERVE_TARGET_DEVICE": "acme"}).select("acme").name == "acme"


def test_auto_detect_picks_the_single_available_third_party_platform(acme, clean_env):
    assert discover(clean_env).select().name == "acme"
    assert discover({**clean_env, "PAGEDSERVE_TARGET_DEVICE": "auto"}).select().name == "acme"


def test_auto_detect_ignores_an_unavailable_third_party_platform(make_dist, plugin_src, clean_env):
    make_dist("sleepy", {"sleepy_plugin": plugin_src("sleepy", available=False, reason="no sleepy card")})
    reg = discover(clean_env)
    assert reg.platforms["sleepy"].probe() == (False, "no sleepy card")
    assert reg.select().name == reg.select(None).name != "sleepy"
    with pytest.raises(PlatformError, match="platform 'sleepy' is not available: no sleepy card"):
        reg.select("sleepy")


def test_auto_detect_refuses_to_guess_between_two_third_party_platforms(acme, make_dist, plugin_src, clean_env):
    make_dist("zeta-accel", {"zeta_accel": plugin_src("zeta")})
    with pytest.raises(PlatformError, match=r"several third-party platforms are available \(acme, zeta\)"):
        discover(clean_env).select()
    assert discover(clean_env).select("zeta").name == "zeta"


@pytest.mark.parametrize("allow", ["cpu,cuda,rocm", "pagedserve", " cpu , rocm "])
def test_allow_list_excludes_the_plugin(acme, clean_env, allow):
    env = {**clean_env, "PAGEDSERVE_PLUGINS": allow}
    reg = discover(env)
    assert "acme" not in reg.platforms
    assert "acme_accel" not in sys.modules  # excluded plugins are not even imported
    assert reg.select().name == "cpu"
    with pytest.raises(PlatformError, match=r"unknown platform 'acme'.*PAGEDSERVE_PLUGINS"):
        reg.select("acme")


@pytest.mark.parametrize("allow", ["acme", "acme-accel", "Acme_Accel"])
def test_allow_list_admits_by_plugin_or_distribution_name(acme, clean_env, allow):
    reg = discover({**clean_env, "PAGEDSERVE_PLUGINS": allow})
    assert set(reg.platforms) == {"acme"}


def test_register_ops_override_lands_in_the_resolved_registry(acme, clean_env):
    reg = discover(clean_env)
    platform = reg.select("acme").cls()
    ops = reg.resolve_ops(platform)
    plugin = sys.modules["acme_accel"]
    assert ops.silu_and_mul is plugin.silu_and_mul
    assert ops.get("silu_and_mul") is plugin.silu_and_mul
    assert dict(ops.table()) == {**dict.fromkeys(reference.OP_NAMES, "reference"), "silu_and_mul": "acme-kernels"}
    # And it is a correct implementation of the op, not just a registered name.
    x = torch.randn(5, 2 * 24)
    torch.testing.assert_close(ops.silu_and_mul(x), reference.silu_and_mul(x))


def test_ops_override_is_scoped_to_its_platform(acme, clean_env):
    reg = discover(clean_env)
    cpu_ops = reg.resolve_ops(reg.select("cpu").cls())
    assert cpu_ops.source("silu_and_mul") != "acme-kernels"
    assert cpu_ops.silu_and_mul is not sys.modules["acme_accel"].silu_and_mul


ADDON = """
from pagedserve.platforms import hookimpl


def fast_silu_and_mul(x):
    raise NotImplementedError  # identity is what the test checks


@hookimpl
def pagedserve_register_ops(platform, ops):
    if platform.name in ("acme", "cpu"):
        ops.register("silu_and_mul", fast_silu_and_mul, source="addon")
"""


@pytest.mark.parametrize("addon_first", [True, False])
def test_an_addon_plugin_overrides_a_platforms_own_op_whatever_the_order(plugin_src, clean_env, addon_first):
    """A kernels-only plugin beats the platform's own registration, independent of the
    order in which plugins were registered (i.e. of sys.path order)."""
    import types

    import pagedserve.platforms.cpu as cpu_plugin
    from pagedserve.platforms import PlatformRegistry

    acme_mod = types.ModuleType("acme_inline")
    exec(plugin_src("acme", source="acme-kernels"), acme_mod.__dict__)
    addon_mod = types.ModuleType("addon_inline")
    exec(ADDON, addon_mod.__dict__)

    reg = PlatformRegistry(clean_env)
    plugins = [
        ("addon", addon_mod, "acme-addon 1.0"),
        ("acme", acme_mod, "acme-accel 0.1"),
        ("cpu", cpu_plugin, "builtin"),
    ]
    for name, mod, origin in plugins if addon_first else reversed(plugins):
        reg.register_plugin(mod, name, origin)
    assert reg.failures == []
    for device in ("acme", "cpu"):
        ops = reg.resolve_ops(reg.select(device).cls())
        assert ops.source("silu_and_mul") == "addon"
        assert ops.silu_and_mul is addon_mod.fast_silu_and_mul
