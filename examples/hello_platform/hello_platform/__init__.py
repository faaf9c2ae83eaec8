"""hello_platform: the smallest complete pagedserve platform plugin.

It declares one platform, ``hello``, that runs on the host CPU, and overrides one op
(``silu_and_mul``) with its own implementation; every other op falls back to the
torch reference.  pagedserve finds it through the entry point declared in
``pyproject.toml`` -- nothing in pagedserve names it.
"""

from __future__ import annotations

from hello_platform.platform import HelloPlatform
from pagedserve.platforms import hookimpl

__all__ = ["HelloPlatform", "pagedserve_register_platforms", "pagedserve_register_ops"]


@hookimpl
def pagedserve_register_platforms(register):
    # Import-light on purpose: this runs for every `pagedserve` command.
    register(HelloPlatform)


@hookimpl
def pagedserve_register_ops(platform, ops):
    # Called for every selected platform; only touch our own so that installing this
    # plugin never changes what runs on cpu, cuda or rocm.
    if isinstance(platform, HelloPlatform):
        from hello_platform.ops import silu_and_mul

        ops.register("silu_and_mul", silu_and_mul, source="hello_platform")
