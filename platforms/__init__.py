"""Platform discovery and selection.

Every platform, builtin or third-party, is a pluggy plugin named by an entry point in
the group ``pagedserve.platforms``.  Discovery loads those entry points, registers them
with one :class:`pluggy.PluginManager`, checks them with ``check_pending()`` and asks
each for its platform classes.  Nothing here initialises a device: availability is
probed only when a listing or a selection asks for it.

Environment:
    PAGEDSERVE_TARGET_DEVICE  platform name to use (like ``--device``); unset = auto.
    PAGEDSERVE_PLUGINS        comma-separated allow-list of plugin (entry-point or
                              distribution) names; unset = all.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from dataclasses import dataclass, field
from importlib import metadata

import pluggy

from pagedserve.platforms import hookspecs
from pagedserve.platforms.hookspecs import ENTRY_POINT_GROUP, PLATFORM_INTERFACE_VERSION, PROJECT_NAME, hookimpl
from pagedserve.platforms.interface import (
    DeviceLayoutKVConnector,
    KVConnector,
    Platform,
    PlatformError,
    check_interface_version,
)
from pagedserve.platforms.ops import OpRegistry
from pagedserve.platforms.options import target_device

__all__ = [
    "Platform",
    "KVConnector",
    "DeviceLayoutKVConnector",
    "PlatformError",
    "PlatformInfo",
    "PluginFailure",
    "PlatformRegistry",
    "OpRegistry",
    "hookimpl",
    "discover",
    "select_platform",
    "current_platform",
    "resolve_ops",
    "BUILTIN_ORDER",
    "PLATFORM_INTERFACE_VERSION",
    "PLUGIN_VERSION_ATTRIBUTE",
]

_log = logging.getLogger(__name__)

#: Auto-detection order of the builtin platforms.
BUILTIN_ORDER = ("cuda", "rocm", "cpu")
_BUILTIN_DIST = "pagedserve"

#: Module (or object) attribute through which a plugin that registers no platform --
#: say, a kernels-only add-on -- declares the interface version it targets.
PLUGIN_VERSION_ATTRIBUTE = "PAGEDSERVE_INTERFACE_VERSION"


@dataclass
class PluginFailure:
    """A plugin that failed to import or to register its platforms."""

    plugin: str
    origin: str
    error: str

    def message(self) -> str:
        return f"platform plugin {self.plugin!r} (from {self.origin}) failed: {self.error}"


@dataclass
class PlatformInfo:
    """One discovered platform and what its detection said."""

    name: str
    cls: type[Platform]
    plugin: str
    origin: str  # "builtin" or "<distribution> <version>"
    _probe: tuple[bool, str] | None = field(default=None, repr=False)
    detection_error: str | None = None

    @property
    def builtin(self) -> bool:
        return self.origin == "builtin"

    def probe(self) -> tuple[bool, str]:
        """(available, reason), computed once; a raising probe is reported, not hidden."""
        if self._probe is None:
            try:
                ok, reason = self.cls.is_available()
                self._probe = (bool(ok), str(reason))
            except Exception as exc:
                self.detection_error = f"{type(exc).__name__}: {exc}"
                self._probe = (False, f"detection raised {self.detection_error}")
        return self._probe


def _normalize(name: str) -> str:
    """PEP 503 normalisation, so that "My_Plugin" and "my-plugin" name one distribution."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _allow_list(env: dict[str, str]) -> set[str] | None:
    raw = env.get("PAGEDSERVE_PLUGINS", "").strip()
    if not raw:
        return None
    return {_normalize(p.strip()) for p in raw.split(",") if p.strip()}


def _dist_name(ep: metadata.EntryPoint) -> str | None:
    dist = getattr(ep, "dist", None)
    return None if dist is None else (dist.metadata["Name"] or None)


def _origin(ep: metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    name = _dist_name(ep)
    if dist is None or name is None:
        return "unknown distribution"
    if _normalize(name) == _BUILTIN_DIST:
        return "builtin"
    return f"{name} {dist.version}"


class PlatformRegistry:
    """The result of one discovery: plugins, their platforms and their failures."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.env = dict(os.environ if env is None else env)
        self.pm = pluggy.PluginManager(PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self.platforms: dict[str, PlatformInfo] = {}
        self.failures: list[PluginFailure] = []
        #: Platform names a failed plugin also claimed: never selected, even explicitly.
        self.contested: set[str] = set()
        self._origins: dict[str, str] = {}

    # -- discovery -----------------------------------------------------------------
    def load_entry_points(self) -> None:
        allow = _allow_list(self.env)
        seen: set[str] = set()
        # Builtins first, so a third-party plugin that claims "cpu" is the one rejected
        # as a duplicate, whatever order sys.path lists the distributions in.
        eps = sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: _origin(ep) != "builtin")
        for ep in eps:
            origin = _origin(ep)
            # Match the real distribution name ("pagedserve" allows every builtin),
            # not the display origin, which says "builtin".
            dist_name = _normalize(_dist_name(ep) or "")
            if allow is not None and _normalize(ep.name) not in allow and dist_name not in allow:
                continue
            if ep.name in seen:
                # The same distribution visible twice on sys.path (e.g. an editable
                # install plus a build dir) is harmless; two different ones are not.
                if self._origins.get(ep.name) == origin:
                    continue
                self.failures.append(
                    PluginFailure(
                        ep.name, origin, f"plugin name {ep.name!r} is also declared by {self._origins[ep.name]}"
                    )
                )
                continue
            seen.add(ep.name)
            self._origins[ep.name] = origin
            try:
                plugin = ep.load()
            except Exception as exc:
                self.failures.append(PluginFailure(ep.name, origin, f"import raised {type(exc).__name__}: {exc}"))
                continue
            self.register_plugin(plugin, ep.name, origin)
        self.pm.check_pending()

    def register_plugin(self, plugin: object, name: str, origin: str = "test") -> None:
        """Register one plugin object (a module or an instance) and collect its platforms.

        A plugin that cannot be registered (bad hook signature, misspelt hook name, a
        raising or invalid ``pagedserve_register_platforms``, a platform name another
        plugin already claimed) is recorded in :attr:`failures` and contributes
        nothing -- neither platforms nor ops -- so one broken plugin never hides the
        listing of the others.
        """
        self._origins.setdefault(name, origin)
        declared = getattr(plugin, PLUGIN_VERSION_ATTRIBUTE, None)
        if declared is not None:
            # Checked before its hooks are registered: a plugin for another interface
            # version must not contribute half of itself.
            try:
                check_interface_version(declared, f"plugin {name!r}")
            except PlatformError as exc:
                self.failures.append(PluginFailure(name, origin, str(exc)))
                return
        try:
            self.pm.register(plugin, name=name)
            # Unknown pagedserve_* hooks (usually a typo) fail here, named, rather than
            # being silently never called.
            self.pm.check_pending()
        except Exception as exc:  # pluggy.PluginValidationError, ValueError (name taken)
            self._drop(plugin, [])
            self.failures.append(PluginFailure(name, origin, f"registration raised {type(exc).__name__}: {exc}"))
            return
        impls = [i for i in self.pm.hook.pagedserve_register_platforms.get_hookimpls() if i.plugin is plugin]
        added: list[str] = []

        def register(cls: type[Platform]) -> None:
            if not (isinstance(cls, type) and issubclass(cls, Platform)):
                raise PlatformError(f"plugin {name!r} registered {cls!r}, which is not a Platform subclass")
            if not cls.name:
                raise PlatformError(f"plugin {name!r} registered {cls.__qualname__} without a name")
            check_interface_version(cls.interface_version, f"platform {cls.name!r} ({cls.__qualname__})")
            if cls.name in self.platforms:
                self.contested.add(cls.name)
                other = self.platforms[cls.name]
                raise PlatformError(
                    f"two plugins claim the platform name {cls.name!r}: {other.plugin!r} "
                    f"({other.origin}) and {name!r} ({origin})"
                )
            self.platforms[cls.name] = PlatformInfo(cls.name, cls, name, origin)
            added.append(cls.name)

        for impl in impls:
            try:
                impl.function(**({"register": register} if "register" in impl.argnames else {}))
            except PlatformError as exc:
                self._drop(plugin, added)
                self.failures.append(PluginFailure(name, origin, str(exc)))
                return
            except Exception as exc:
                self._drop(plugin, added)
                self.failures.append(
                    PluginFailure(name, origin, f"pagedserve_register_platforms raised {type(exc).__name__}: {exc}")
                )
                return

    def _drop(self, plugin: object, platform_names: list[str]) -> None:
        """Forget a plugin that failed, and the platforms it managed to register."""
        for platform_name in platform_names:
            del self.platforms[platform_name]
        if self.pm.is_registered(plugin):
            self.pm.unregister(plugin)

    # -- selection -----------------------------------------------------------------
    def requested_name(self, device: str | None) -> str | None:
        """The explicitly requested platform name, or None for auto-detection.

        "auto" (or empty) means "no request" for both sources, so ``--device auto``
        does not conflict with PAGEDSERVE_TARGET_DEVICE.
        """
        env_name = target_device(self.env)
        if device is not None:
            device = device.strip() or None
        if device == "auto":
            device = None
        if device and env_name and device != env_name:
            raise PlatformError(
                f"conflicting platform requests: device={device!r} but "
                f"PAGEDSERVE_TARGET_DEVICE={env_name!r}; unset one of them"
            )
        return device or env_name

    def select(self, device: str | None = None) -> PlatformInfo:
        """The PlatformInfo to use: requested by name, else auto-detected."""
        name = self.requested_name(device)
        if name in ("auto", ""):
            name = None
        failed = "\n  ".join(f.message() for f in self.failures)
        if name is None and self.failures:
            # Auto-detection never guesses past a broken plugin: it might be the one meant.
            raise PlatformError(
                f"platform plugins failed to load:\n  {failed}\n"
                "Fix or uninstall them, exclude them with PAGEDSERVE_PLUGINS=<allowed,names>, "
                "or choose a platform with --device / PAGEDSERVE_TARGET_DEVICE."
            )
        if name is not None:
            info = self.platforms.get(name)
            if info is None:
                known = ", ".join(sorted(self.platforms)) or "none"
                hint = ""
                if _allow_list(self.env) is not None:
                    hint = f" (discovery limited by PAGEDSERVE_PLUGINS={self.env['PAGEDSERVE_PLUGINS']!r})"
                if self.failures:
                    hint += f"; platform plugins that failed to load:\n  {failed}"
                raise PlatformError(f"unknown platform {name!r}; known platforms: {known}{hint}")
            if name in self.contested:
                raise PlatformError(f"platform {name!r} is claimed by more than one plugin:\n  {failed}")
            if self.failures:
                # An explicit choice of a healthy platform goes on (as vLLM does), loudly.
                _log.warning(
                    "platform %r selected explicitly; ignoring platform plugins that failed to load:\n  %s",
                    name,
                    failed,
                )
            ok, reason = info.probe()
            if info.detection_error:
                raise PlatformError(f"platform {name!r} (from {info.origin}) {reason}")
            if not ok:
                raise PlatformError(f"platform {name!r} is not available: {reason}")
            return info
        available = [p for p in self.platforms.values() if p.probe()[0]]
        broken = [p for p in self.platforms.values() if p.detection_error]
        if broken:
            msg = "; ".join(f"{p.name!r} (from {p.origin}): {p.detection_error}" for p in broken)
            raise PlatformError(f"platform detection raised: {msg}")
        third_party = [p for p in available if not p.builtin]
        if len(third_party) == 1:
            return third_party[0]
        if len(third_party) > 1:
            names = ", ".join(sorted(p.name for p in third_party))
            raise PlatformError(
                f"several third-party platforms are available ({names}); choose one with "
                "--device or PAGEDSERVE_TARGET_DEVICE"
            )
        for builtin in BUILTIN_ORDER:
            info = self.platforms.get(builtin)
            if info is not None and info.probe()[0]:
                return info
        reasons = "; ".join(f"{p.name}: {p.probe()[1]}" for p in self.platforms.values())
        raise PlatformError(f"no platform is available ({reasons or 'no platforms discovered'})")

    def kv_connectors(self) -> dict[str, tuple[object, str]]:
        """Every registered plugin's KV connectors (interface 1.6): name -> (factory,
        plugin name); PlatformError for a bad or twice-registered name."""
        found: dict[str, tuple[object, str]] = {}
        for impl in self.pm.hook.pagedserve_register_kv_connectors.get_hookimpls():

            def register(name: str, factory, plugin: str = impl.plugin_name) -> None:
                if not isinstance(name, str) or not name or ":" in name:
                    raise PlatformError(f"plugin {plugin!r} registered a KV connector named {name!r}")
                if name in found:
                    raise PlatformError(
                        f"two plugins register the KV connector {name!r}: {found[name][1]!r} and {plugin!r}"
                    )
                found[name] = (factory, plugin)

            impl.function(**({"register": register} if "register" in impl.argnames else {}))
        return found

    def kv_connector_is_device_layout(self, name: str) -> bool:
        """Whether the plugin KV connector ``name`` registered a device-layout factory
        (interface 1.7: a ``DeviceLayoutKVConnector`` subclass, or a factory with a true
        ``device_layout`` attribute), told before one is created; False for a name no
        plugin registered.  PlatformError as :meth:`kv_connectors`."""
        found = self.kv_connectors().get(name)
        return found is not None and bool(getattr(found[0], "device_layout", False))

    def resolve_ops(self, platform: Platform) -> OpRegistry:
        """The op registry for ``platform``: references, then every plugin's overrides.

        Order (a later registration of the same op wins): the plugin that provides
        ``platform``, then the other builtin plugins, then third-party plugins in
        discovery order.  So an add-on plugin can replace a platform's own kernel --
        whatever order sys.path lists their distributions in.
        """
        ops = OpRegistry()
        info = self.platforms.get(platform.name)
        owner = info.plugin if info is not None and isinstance(platform, info.cls) else None

        def rank(impl: pluggy.HookImpl) -> int:
            if impl.plugin_name == owner:
                return 0
            return 1 if self._origins.get(impl.plugin_name) == "builtin" else 2

        # get_hookimpls() is in registration order; sorted() is stable.
        for impl in sorted(self.pm.hook.pagedserve_register_ops.get_hookimpls(), key=rank):
            kwargs = {"platform": platform, "ops": ops}
            try:
                impl.function(**{k: v for k, v in kwargs.items() if k in impl.argnames})
            except Exception as exc:
                origin = self._origins.get(impl.plugin_name, "unknown distribution")
                raise PlatformError(
                    f"platform plugin {impl.plugin_name!r} (from {origin}) failed in "
                    f"pagedserve_register_ops: {type(exc).__name__}: {exc}"
                ) from exc
        return ops


def discover(env: dict[str, str] | None = None) -> PlatformRegistry:
    """Load every allowed plugin of the ``pagedserve.platforms`` group."""
    reg = PlatformRegistry(env)
    reg.load_entry_points()
    return reg


def resolve_ops(platform: Platform, env: dict[str, str] | None = None) -> OpRegistry:
    """Discover plugins and resolve the ops for an already-built ``platform``.

    Prefer :meth:`PlatformRegistry.resolve_ops` on the registry that selected the
    platform; this convenience discovers again.
    """
    return discover(env).resolve_ops(platform)


def select_platform(device: str | None = None, env: dict[str, str] | None = None) -> tuple[Platform, OpRegistry]:
    """Discover, select and instantiate a platform; return it with its resolved ops."""
    reg = discover(env)
    info = reg.select(device)
    platform = info.cls()
    return platform, reg.resolve_ops(platform)


@functools.lru_cache(maxsize=8)
def _cached_platform(device: str | None, target: str | None, plugins: str | None) -> tuple[Platform, OpRegistry]:
    return select_platform(device)


def current_platform(device: str | None = None) -> Platform:
    """The platform this process uses (cached per request and environment)."""
    env = os.environ
    return _cached_platform(device, target_device(env), env.get("PAGEDSERVE_PLUGINS"))[0]
