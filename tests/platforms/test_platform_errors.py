"""Broken plugins and bad requests fail loudly, naming the plugin, its distribution and
the exception -- and never take the listing of the healthy platforms down with them."""

from __future__ import annotations

import pytest

from pagedserve.platforms import PlatformError, discover

RAISES_AT_IMPORT = """
raise RuntimeError("vendor SDK not found at /opt/acme")
"""

RAISES_IN_IS_AVAILABLE = """
from pagedserve.platforms import Platform, hookimpl


class FlakyPlatform(Platform):
    name = "flaky"

    @classmethod
    def is_available(cls):
        raise OSError("driver ioctl failed")


@hookimpl
def pagedserve_register_platforms(register):
    register(FlakyPlatform)
"""

RAISES_IN_REGISTER = """
from pagedserve.platforms import hookimpl

ops_called = []


@hookimpl
def pagedserve_register_platforms(register):
    raise ValueError("unsupported firmware 0x2a")


@hookimpl
def pagedserve_register_ops(platform, ops):
    ops_called.append(platform.name)
"""

MISSPELT_HOOK = """
from pagedserve.platforms import hookimpl


@hookimpl
def pagedserve_register_platform(register):  # missing "s"
    pass
"""

NOT_A_PLATFORM = """
from pagedserve.platforms import hookimpl


class Gadget:
    name = "gadget"


@hookimpl
def pagedserve_register_platforms(register):
    register(Gadget)
"""

RAISES_IN_OPS = """
from pagedserve.platforms import hookimpl


@hookimpl
def pagedserve_register_ops(platform, ops):
    raise KeyError("kernel table corrupt")
"""


def _one_failure(reg):
    assert len(reg.failures) == 1, reg.failures
    return reg.failures[0]


def test_plugin_that_raises_at_import(make_dist, clean_env):
    make_dist("acme-broken", {"acme_broken": RAISES_AT_IMPORT}, version="2.3", entry_points={"acme": "acme_broken"})
    reg = discover(clean_env)
    failure = _one_failure(reg)
    assert (failure.plugin, failure.origin) == ("acme", "acme-broken 2.3")
    assert "RuntimeError: vendor SDK not found at /opt/acme" in failure.error
    # The healthy platforms are still listed...
    assert {"cpu", "cuda", "rocm"} <= set(reg.platforms)
    # ...but nothing is selected silently past a broken plugin.
    with pytest.raises(PlatformError) as err:
        reg.select()
    msg = str(err.value)
    assert "'acme'" in msg and "acme-broken 2.3" in msg and "vendor SDK not found" in msg
    assert "PAGEDSERVE_PLUGINS" in msg  # tells the user how to get going again
    # Excluding it by the allow-list is that way.
    assert discover({**clean_env, "PAGEDSERVE_PLUGINS": "cpu"}).select().name == "cpu"


def test_plugin_whose_is_available_raises(make_dist, clean_env):
    make_dist("flaky-dist", {"flaky_plugin": RAISES_IN_IS_AVAILABLE})
    reg = discover(clean_env)
    assert reg.failures == []  # it loaded fine; it is detection that breaks
    ok, reason = reg.platforms["flaky"].probe()
    assert not ok and "OSError: driver ioctl failed" in reason
    with pytest.raises(PlatformError, match=r"'flaky' \(from flaky-dist 0\.1\).*OSError: driver ioctl failed"):
        reg.select()  # auto-detection probes every platform
    with pytest.raises(PlatformError, match=r"'flaky' \(from flaky-dist 0\.1\).*OSError: driver ioctl failed"):
        reg.select("flaky")
    # An explicit request for another platform does not probe this one.
    assert reg.select("cpu").name == "cpu"


def test_plugin_whose_register_hook_raises(make_dist, clean_env):
    make_dist("firmware-dist", {"firmware_plugin": RAISES_IN_REGISTER})
    reg = discover(clean_env)
    failure = _one_failure(reg)
    assert (failure.plugin, failure.origin) == ("firmware_plugin", "firmware-dist 0.1")
    assert "pagedserve_register_platforms raised ValueError: unsupported firmware 0x2a" in failure.error
    with pytest.raises(PlatformError, match="firmware_plugin.*firmware-dist 0.1.*unsupported firmware"):
        reg.select()
    # A failed plugin contributes nothing, not even op overrides.
    import firmware_plugin

    reg.resolve_ops(reg.platforms["cpu"].cls())
    assert firmware_plugin.ops_called == []


def test_misspelt_hook_is_reported_not_ignored(make_dist, clean_env):
    make_dist("typo-dist", {"typo_plugin": MISSPELT_HOOK})
    failure = _one_failure(discover(clean_env))
    assert failure.plugin == "typo_plugin" and "pagedserve_register_platform" in failure.error


def test_registering_something_that_is_not_a_platform(make_dist, clean_env):
    make_dist("gadget-dist", {"gadget_plugin": NOT_A_PLATFORM})
    reg = discover(clean_env)
    failure = _one_failure(reg)
    assert "not a Platform subclass" in failure.error and failure.origin == "gadget-dist 0.1"
    assert "gadget" not in reg.platforms


def test_duplicate_platform_names_are_rejected(make_dist, plugin_src, clean_env):
    make_dist("twin-one", {"twin_one": plugin_src("twin")})
    make_dist("twin-two", {"twin_two": plugin_src("twin")})
    reg = discover(clean_env)
    failure = _one_failure(reg)
    assert "two plugins claim the platform name 'twin'" in failure.error
    assert "twin-one 0.1" in failure.message() and "twin-two 0.1" in failure.message()
    with pytest.raises(PlatformError, match="two plugins claim the platform name 'twin'"):
        reg.select("twin")


def test_a_third_party_plugin_cannot_take_a_builtin_name(make_dist, plugin_src, clean_env):
    # Prepended to sys.path, so importlib.metadata lists it before pagedserve itself.
    make_dist("impostor", {"impostor_cpu": plugin_src("cpu")})
    reg = discover(clean_env)
    failure = _one_failure(reg)
    assert failure.origin == "impostor 0.1" and "'cpu'" in failure.error
    assert reg.platforms["cpu"].builtin


def test_ops_hook_that_raises_names_the_plugin(make_dist, clean_env):
    make_dist("badops-dist", {"badops_plugin": RAISES_IN_OPS})
    reg = discover(clean_env)
    platform = reg.select("cpu").cls()
    with pytest.raises(
        PlatformError, match=r"'badops_plugin' \(from badops-dist 0\.1\).*KeyError.*kernel table corrupt"
    ):
        reg.resolve_ops(platform)


def test_unknown_device_lists_the_known_ones(clean_env):
    with pytest.raises(PlatformError, match=r"unknown platform 'tpu'; known platforms: cpu, cuda, rocm"):
        discover(clean_env).select("tpu")


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_unknown_device_from_the_environment(clean_env, device):
    reg = discover({**clean_env, "PAGEDSERVE_TARGET_DEVICE": "tpu"})
    if device == "auto":  # "auto" is no request, so the environment's name stands
        with pytest.raises(PlatformError, match="unknown platform 'tpu'"):
            reg.select(device)
    else:
        with pytest.raises(PlatformError, match="conflicting"):
            reg.select(device)


def test_conflicting_device_and_environment(clean_env):
    reg = discover({**clean_env, "PAGEDSERVE_TARGET_DEVICE": "cuda"})
    with pytest.raises(PlatformError) as err:
        reg.select("cpu")
    msg = str(err.value)
    assert "conflicting" in msg and "device='cpu'" in msg and "PAGEDSERVE_TARGET_DEVICE='cuda'" in msg


def test_explicit_healthy_platform_starts_past_a_broken_plugin(make_dist, clean_env, caplog):
    """Auto-detection refuses to guess past a broken plugin, but an explicit, healthy
    choice starts, with a warning that names the broken plugin."""
    make_dist("acme-broken", {"acme_broken": RAISES_AT_IMPORT}, version="2.3", entry_points={"acme": "acme_broken"})
    reg = discover(clean_env)
    with pytest.raises(PlatformError, match="vendor SDK not found"):
        reg.select()
    with caplog.at_level("WARNING", logger="pagedserve.platforms"):
        assert reg.select("cpu").name == "cpu"
    assert "acme-broken 2.3" in caplog.text and "vendor SDK not found" in caplog.text
    assert discover({**clean_env, "PAGEDSERVE_TARGET_DEVICE": "cpu"}).select().name == "cpu"
    # Asking for the broken plugin's platform itself names the failure.
    with pytest.raises(PlatformError, match="(?s)unknown platform 'acme'.*vendor SDK not found"):
        discover(clean_env).select("acme")
