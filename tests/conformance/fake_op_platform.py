"""A fake CPU platform whose plugin registers a given set of ops, and the conformance
kit's op checks run on it: the harness of the op-set conformance tests."""

from __future__ import annotations

import types
from collections.abc import Callable

import torch

from pagedserve.platforms import Platform, PlatformRegistry, hookimpl
from pagedserve.testing import ConformanceReport, run_conformance


def fake_platform(platform_name: str) -> type[Platform]:
    """A host-backed platform named ``platform_name`` (float32 and bfloat16)."""

    class FakePlatform(Platform):
        name = platform_name
        device_type = "cpu"
        supported_dtypes = (torch.float32, torch.bfloat16)

        @classmethod
        def is_available(cls):
            return True, "the host"

        def total_memory(self):
            return 8 * 1024**3

        def free_memory(self):
            return 2 * 1024**3

    return FakePlatform


def check_ops(platform_cls: type[Platform], impls: dict[str, Callable], only: list[str]) -> ConformanceReport:
    """Run the conformance checks ``only`` on ``platform_cls`` with ``impls`` registered by a
    plugin ``<name>_plugin`` (version ``<name> 0.1``) as source ``<name>-kernels``."""
    name = platform_cls.name
    module = types.ModuleType(f"{name}_plugin")

    @hookimpl
    def pagedserve_register_platforms(register):
        register(platform_cls)

    @hookimpl
    def pagedserve_register_ops(platform, ops):
        if isinstance(platform, platform_cls):
            for op, fn in impls.items():
                ops.register(op, fn, source=f"{name}-kernels")

    module.pagedserve_register_platforms = pagedserve_register_platforms
    module.pagedserve_register_ops = pagedserve_register_ops
    reg = PlatformRegistry(env={})
    reg.register_plugin(module, name, f"{name} 0.1")
    assert reg.failures == []
    return run_conformance(name, registry=reg, engine=False, only=only)
