"""pluggy hook specifications of pagedserve's platform interface.

A platform plugin is any importable object (usually a module) whose functions are
marked with :data:`hookimpl`.  It is found through the entry-point group
``pagedserve.platforms``; the builtin cpu, cuda and rocm platforms use the same path.

Hook implementations may accept any subset of a hook's arguments (pluggy passes
arguments by name), so new arguments can be added to a spec without breaking
plugins written for an older version of it.
"""

from __future__ import annotations

import pluggy

PROJECT_NAME = "pagedserve"
ENTRY_POINT_GROUP = "pagedserve.platforms"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

__all__ = ["hookspec", "hookimpl", "PROJECT_NAME", "ENTRY_POINT_GROUP"]


@hookspec
def pagedserve_register_platforms(register):
    """Register platform classes.

    :param register: call ``register(PlatformClass)`` once per platform this plugin
        provides.  ``PlatformClass`` subclasses :class:`pagedserve.platforms.Platform`.
        Must be import-light: no device initialisation, no kernel builds.
    """


@hookspec
def pagedserve_register_ops(platform, ops):
    """Override named ops for a platform.

    Called once when ``platform`` has been selected, for every plugin (so a plugin can
    also contribute ops to another plugin's platform).  Call order, where a later
    registration of the same op wins: the plugin providing ``platform``, then the other
    builtin plugins, then third-party plugins in discovery order.

    :param platform: the selected :class:`Platform` instance.
    :param ops: the :class:`pagedserve.platforms.ops.OpRegistry`; call
        ``ops.register(name, fn, source=...)`` to override an op.  Every op defaults to
        the torch reference in ``pagedserve.kernels.reference``.
    """
