"""A platform plugin installed for a test module as pip leaves one: its module plus a
dist-info declaring the ``pagedserve.platforms`` entry point, on sys.path until the
module's tests end, so that discovery goes through importlib.metadata as for a real
plugin.  ``counted_cpu_platform`` is the usual second platform: the host CPU whose ops
are the reference ops, each call counted in the module's ``CALLS``."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from types import ModuleType

import pytest

__all__ = ["counted_cpu_platform", "install_plugin"]

_COUNTED_CPU_PLATFORM = """
from collections import Counter

import torch

from pagedserve.kernels import reference
from pagedserve.platforms import Platform, hookimpl

CALLS = Counter()


class {cls}(Platform):
    name = "{name}"
    device_type = "cpu"
    supported_dtypes = (torch.float32,)

    @classmethod
    def is_available(cls):
        return True, "the host CPU"

    def total_memory(self):
        return 8 * 1024**3

    def free_memory(self):
        return 4 * 1024**3


def counted(name, fn):
    def op(*args, **kwargs):
        CALLS[name] += 1
        return fn(*args, **kwargs)
    return op


@hookimpl
def pagedserve_register_platforms(register):
    register({cls})


@hookimpl
def pagedserve_register_ops(platform, ops):
    if isinstance(platform, {cls}):
        for name in reference.OP_NAMES:
            ops.register(name, counted(name, getattr(reference, name)), source="{name}")
"""


def counted_cpu_platform(cls: str, name: str) -> str:
    """Source of a plugin module registering platform ``name`` (class ``cls``): the host
    CPU with counted reference ops (``CALLS``)."""
    return _COUNTED_CPU_PLATFORM.format(cls=cls, name=name)


def install_plugin(tmp_path_factory, module: str, platform: str, source: str) -> Iterator[ModuleType]:
    """For a module-scoped fixture (``yield from``): module ``module`` of ``source``
    installed as the distribution ``module`` (underscores as dashes) whose entry point
    names it for ``platform``; yields the imported module, and undoes everything after
    (sys.path, the platform-selection variables, sys.modules, import caches)."""
    site = tmp_path_factory.mktemp("site")
    (site / f"{module}.py").write_text(source, encoding="utf-8")
    info = site / f"{module}-0.1.dist-info"
    info.mkdir()
    dist = module.replace("_", "-")
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n", encoding="utf-8")
    (info / "entry_points.txt").write_text(f"[pagedserve.platforms]\n{platform} = {module}\n", encoding="utf-8")
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(site))
        mp.delenv("PAGEDSERVE_TARGET_DEVICE", raising=False)
        mp.delenv("PAGEDSERVE_PLUGINS", raising=False)
        importlib.invalidate_caches()
        yield importlib.import_module(module)
    sys.modules.pop(module, None)
    importlib.invalidate_caches()
