"""Data parallelism: N independent engine replicas behind one router.

`DataParallelConfig` holds the flags (`--data-parallel-size`, `--data-parallel-backend`,
`--data-parallel-devices`); `plan_replicas` turns it into one `ReplicaSpec` per replica:
its platform, its accelerator index and its CPU threads.  The router
(`pagedserve.serving.router`) starts the replicas and routes requests to them.

Threads.  With data parallelism ``--threads`` is the budget of CPU threads of the whole
server (default: the cores this process may run on).  Replicas whose platform computes
on the host share it: each gets an even share (the first ones one more when it does not
divide), split again between the ranks of a tensor/pipeline-parallel replica, at least
one thread each.  A replica on an accelerator gets one host thread: its model runs on the
device, and OpenMP teams that spin on cores the host replicas compute on would slow
them down.

Memory.  ``--kv-cache-memory`` and ``--gpu-memory-utilization`` apply to each replica
(as they apply to each rank).  Without either, a platform's default fraction of its
device's memory is used; host replicas share one memory, so that default is divided
between them (and between their ranks).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["DataParallelConfig", "ReplicaSpec", "plan_replicas", "resolve_platforms", "usable_cores", "DP_BACKENDS"]

DP_BACKENDS = ("mp", "ray")


@dataclass
class DataParallelConfig:
    """size: replicas; backend: "mp" (local processes) or "ray" (Ray actors, one machine
    or many); devices: one platform name per replica (None = the engine's ``--device``)."""

    size: int = 1
    backend: str = "mp"
    devices: list[str | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.size}")
        if self.backend not in DP_BACKENDS:
            raise ValueError(f"data_parallel_backend must be one of {', '.join(DP_BACKENDS)}, got {self.backend!r}")
        if not self.devices:
            self.devices = [None] * self.size
        if len(self.devices) != self.size:
            raise ValueError(
                f"--data-parallel-devices names {len(self.devices)} platform(s) "
                f"({','.join(d or 'auto' for d in self.devices)}) for data_parallel_size={self.size}; "
                "give exactly one per replica"
            )

    @staticmethod
    def parse_devices(value: str | None) -> list[str | None]:
        """``"cuda,cpu,cpu"`` -> ``["cuda", "cpu", "cpu"]``; None or "" -> []; "auto" -> None."""
        if not value:
            return []
        names = [v.strip() for v in value.split(",")]
        if any(not n for n in names):
            raise ValueError(f"--data-parallel-devices {value!r} has an empty entry")
        return [None if n == "auto" else n for n in names]


@dataclass(frozen=True)
class ReplicaSpec:
    """How one replica runs (picklable: it is sent to the replica's process).

    device: platform name (None: PAGEDSERVE_TARGET_DEVICE or auto-detection).
    on_host: its platform computes on the host CPU (shares the cores).
    device_index: which accelerator of its machine it uses (ignored on the host).
    threads: CPU threads of each of its processes.
    memory_utilization: its share of host memory when the user set no KV budget (host
        replicas only), else None (the configured or platform default applies).
    """

    index: int
    device: str | None
    on_host: bool
    device_index: int
    threads: int
    memory_utilization: float | None = None


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def resolve_platforms(devices: list[str | None], check_available: bool, env: dict[str, str] | None = None) -> list:
    """The Platform class of each replica; PlatformError naming every known platform
    (and whether it is available here) for an unknown or unusable name.

    ``check_available`` is False when replicas may run on other machines (Ray): then a
    name only has to be known here.
    """
    from pagedserve.platforms import PlatformError, discover

    env = dict(os.environ if env is None else env)
    if any(d is not None for d in devices):
        # Per-replica names replace PAGEDSERVE_TARGET_DEVICE (each replica sets its own).
        env.pop("PAGEDSERVE_TARGET_DEVICE", None)
    registry = discover(env)

    def listing() -> str:
        rows = []
        for name, info in sorted(registry.platforms.items()):
            ok, reason = info.probe()
            rows.append(f"{name} ({'available' if ok else 'not available: ' + reason})")
        return "; ".join(rows) or "none discovered"

    classes: dict[str | None, type] = {}
    for name in devices:
        if name in classes:
            continue
        if name is not None and name not in registry.platforms:
            raise PlatformError(f"unknown platform {name!r} in --data-parallel-devices; platforms: {listing()}")
        if check_available or name is None:
            try:
                info = registry.select(name)
            except PlatformError as exc:
                raise PlatformError(f"--data-parallel-devices: {exc}") from None
        else:
            info = registry.platforms[name]
        classes[name] = info.cls
    return [classes[d] for d in devices]


def plan_replicas(
    dp: DataParallelConfig,
    device_types: list[str],
    threads: int | None,
    ranks_per_replica: int,
    cores: Callable[[], int] = usable_cores,
    one_accelerator_per_actor: bool = False,
    default_utilization: list[float] | None = None,
) -> list[ReplicaSpec]:
    """One ReplicaSpec per replica (see the module docstring for the rules).

    ``device_types[i]`` is the torch device type of replica i's platform ("cpu" means the
    host).  Accelerator replicas of the same platform take consecutive device indices,
    unless ``one_accelerator_per_actor`` (Ray shows each actor only its own device: 0).
    ``default_utilization[i]`` is replica i's platform default memory fraction, given
    only when the user set no KV budget (it is then shared by the host replicas).
    """
    on_host = [t == "cpu" for t in device_types]
    if ranks_per_replica > 1 and not all(on_host):
        raise ValueError(
            "tensor/pipeline-parallel data-parallel replicas run on host (cpu) platforms only in "
            "this version: with accelerator replicas use --tensor-parallel-size 1 "
            "--pipeline-parallel-size 1"
        )
    host = [i for i, h in enumerate(on_host) if h]
    budget = threads if threads is not None else cores()
    share = {}
    for k, i in enumerate(host):
        per_replica = budget // len(host) + (1 if k < budget % len(host) else 0)
        share[i] = max(1, per_replica // ranks_per_replica)
    next_index: dict[str | None, int] = {}
    specs = []
    for i, (name, h) in enumerate(zip(dp.devices, on_host)):
        index = 0
        if not h and not one_accelerator_per_actor:
            index = next_index.get(name, 0)
            next_index[name] = index + 1
        util = None
        if h and default_utilization is not None and len(host) * ranks_per_replica > 1:
            util = default_utilization[i] / (len(host) * ranks_per_replica)
        specs.append(ReplicaSpec(i, name, h, index, share.get(i, 1), util))
    return specs
