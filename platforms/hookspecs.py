"""pluggy hook specifications of pagedserve's platform interface.

A platform plugin is any importable object (usually a module) whose functions are
marked with :data:`hookimpl`.  It is found through the entry-point group
``pagedserve.platforms``; the builtin cpu, cuda and rocm platforms use the same path.

Hook implementations may accept any subset of a hook's arguments (pluggy passes
arguments by name), so new arguments can be added to a spec without breaking
plugins written for an older version of it.

The hooks, the ``Platform`` class and the op contracts together form the platform
interface, versioned as :data:`PLATFORM_INTERFACE_VERSION` ("MAJOR.MINOR").  Within a
major version nothing a plugin provides or calls is removed, renamed or given a new
meaning; a minor version only adds (an opt-in hook argument, a hook, a ``Platform``
member with a default, an op that defaults to its reference, an op capability) or stops
calling a ``Platform`` member (a plugin that still defines it keeps working).  A plugin
declares the version it targets (see ``Platform.interface_version``) and is refused, by
name, when it needs another major version or a newer minor one than this core provides.
"""

from __future__ import annotations

import pluggy

PROJECT_NAME = "pagedserve"
ENTRY_POINT_GROUP = "pagedserve.platforms"

#: The platform interface version this core provides ("MAJOR.MINOR"): bump the minor
#: version for every addition, the major version for anything else (docs/platforms.md).
PLATFORM_INTERFACE_VERSION = "1.10"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

__all__ = ["hookspec", "hookimpl", "PROJECT_NAME", "ENTRY_POINT_GROUP", "PLATFORM_INTERFACE_VERSION"]


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


@hookspec
def pagedserve_register_kv_connectors(register):
    """Register KV connectors (interface 1.6): stores of KV cache blocks by content
    (:class:`pagedserve.platforms.interface.KVConnector`).

    :param register: call ``register(name, factory)`` once per connector; the engine's
        ``kv_connector="NAME[:ARG]"`` setting calls ``factory(arg=ARG or None,
        max_bytes=kv_connector_memory, fingerprint=...)`` (``fingerprint``: a hex string
        naming the engine's KV layout, also covered by every key) and expects a
        ``KVConnector``.  The builtin names ``host`` and ``disk`` cannot be taken.

    Interface 1.7: the factory may return a
    :class:`pagedserve.platforms.interface.DeviceLayoutKVConnector` (a tier of block
    slots laid out as the device's KV cache, one store per rank, that carries swap
    preemption and spills as the builtin host tier does), and any connector may set
    ``save_mode = "on-evict"``.  Register the class itself (or a factory with a true
    ``device_layout`` attribute) so that the engine can tell a device-layout connector
    before creating one: with tensor/pipeline parallelism only those are accepted.
    """
