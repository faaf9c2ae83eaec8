"""Setting up the KV connector of the engine and running the host tier's block copies.

The host tier (``kv_offload_memory``) is the builtin device-layout KV connector
(interface 1.7, pagedserve.offload.connectors.HostTierConnector): its store mirrors the
device pool block for block (same per-layer shape, from the platform's
``kv_cache_shape``) so that one block index maps to one block in both, and copies go
through the op registry's ``swap_blocks`` (a platform may override it with an
asynchronous kernel).  Host tensors are pinned when the platform can pin.  Under a
device map each layer's store tensors take its own platform's layout and pinning, and
its copies run with its own platform's ``swap_blocks``.  A plugin's device-layout
connector (``kv_connector="NAME"``) takes the same path with its own storage; a content
store (1.6: ``host``, ``disk``, most plugins) gets the ConnectorKVCacheManager.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from pagedserve.config import EngineConfig
from pagedserve.kv_cache.connector import ConnectorKVCacheManager
from pagedserve.kv_cache.host_tier import IN, KVTransfers, TieredKVCacheManager
from pagedserve.kv_cache.kv_groups import GroupedKVCacheManager, kv_cache_groups
from pagedserve.kv_cache.manager import KVCacheManager
from pagedserve.kv_cache.sliding_window import kv_window_for_pool
from pagedserve.offload.connectors import (
    HostTierConnector,
    create_kv_connector,
    create_tier_connector,
    kv_fingerprint,
)
from pagedserve.offload.cost import PreemptionCostModel
from pagedserve.platforms import DeviceLayoutKVConnector, Platform

__all__ = ["build_kv_manager", "allocate_host_kv_cache", "apply_kv_transfers"]

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def allocate_host_kv_cache(
    platforms: Sequence[Platform],
    num_host_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    connector: DeviceLayoutKVConnector | None = None,
) -> KVCaches:
    """One (key, value) pair of store tensors per layer with ``num_host_blocks`` blocks,
    each in its layer's platform's layout (``platforms``: one per layer), allocated by
    ``connector`` (default: the builtin host tier's host memory)."""
    connector = connector if connector is not None else HostTierConnector(0)
    return [connector.allocate(p, num_host_blocks, block_size, num_kv_heads, head_dim, dtype) for p in platforms]


SwapBlocks = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


def apply_kv_transfers(
    swap_blocks: SwapBlocks | Sequence[SwapBlocks],
    device_caches: KVCaches,
    host_caches: KVCaches,
    transfers: KVTransfers,
    connector: DeviceLayoutKVConnector | None = None,
) -> None:
    """Run the recorded copies in order: one batched copy per run, layer and tensor,
    through ``connector``'s ``save_blocks``/``load_blocks`` (default: the builtin host
    tier's, i.e. ``swap_blocks(src, dst, mapping)``, which copies
    ``dst[m[:, 1]] = src[m[:, 0]]``); ``swap_blocks``: one function for every layer, or
    one per layer (its platform's, under a device map)."""
    connector = connector if connector is not None else HostTierConnector(0)
    per_layer = [swap_blocks] * len(device_caches) if callable(swap_blocks) else list(swap_blocks)
    for direction, pairs in transfers.runs:
        mapping = torch.tensor(pairs, dtype=torch.int64)
        for swap_blocks, (dk, dv), (hk, hv) in zip(per_layer, device_caches, host_caches):
            if direction == IN:
                connector.load_blocks(swap_blocks, hk, dk, mapping)
                connector.load_blocks(swap_blocks, hv, dv, mapping)
            else:
                connector.save_blocks(swap_blocks, dk, hk, mapping)
                connector.save_blocks(swap_blocks, dv, hv, mapping)


def build_kv_manager(
    config: EngineConfig,
    num_blocks: int,
    runner,
    sliding_window: int | None = None,
    max_model_len: int | None = None,
    windows: Sequence[int | None] | None = None,
) -> KVCacheManager | GroupedKVCacheManager:
    """The engine's KV cache manager and its connector: the plain manager; one backed by
    a device-layout connector (the host tier of ``kv_offload_memory`` bytes, or a
    plugin's device-layout ``kv_connector``), whose store tensors are allocated on
    ``runner``, the engine process's ModelRunner, here (unless every rank's worker did);
    or one backed by a content store (``kv_connector``).  ``sliding_window``: the plain
    manager frees blocks that slid out of it (the engine's rules refuse it with a host
    tier), when the pool can spare the null block for a request of ``max_model_len``
    tokens.

    The runner is not imported (it imports :func:`apply_kv_transfers` from here); this
    uses its public methods ``kv_block_bytes``, ``use_kv_connector``,
    ``allocate_host_kv_cache`` and ``weight_bytes`` and its ``layer_platforms``,
    ``kv_connector``, ``num_host_blocks`` and ``dtype``.  ``windows`` (each layer's):
    layers with different windows get one block table per KV cache group (kv_groups.py)
    when the runner laid its KV cache out in groups (``layer_groups``)."""
    cache = config.cache
    groups = kv_cache_groups(windows or [], cache.free_sliding_window_blocks)
    grouped = runner.layer_groups is not None
    # Under tensor/pipeline parallelism every rank's worker created its own tier connector.
    tier = runner.kv_connector if getattr(runner.kv_connector, "device_layout", False) else None
    if tier is None:
        tier = create_tier_connector(cache)
    if cache.kv_connector is not None and tier is None:
        if grouped:
            raise ValueError(
                f"kv_connector={cache.kv_connector!r} cannot be combined with a model whose layers have different "
                "attention windows (one block table per layer group) while free_sliding_window_blocks=True: set "
                "free_sliding_window_blocks=False"
            )
        return _connector_manager(config, num_blocks, runner)
    if grouped:
        windows = [g.window for g in groups]
        state_pages = getattr(runner, "state_pages", 0)  # recurrent-state groups' pages per request
        num_host_blocks, policy = _host_tier(config, runner, tier) if tier is not None else (0, None)
        return GroupedKVCacheManager(
            num_blocks,
            cache.block_size,
            cache.enable_prefix_caching,
            windows,
            state_pages,
            cache.state_checkpoint_interval,
            num_host_blocks=num_host_blocks,
            swap_policy=policy,
            connector=tier if num_host_blocks else None,
        )
    if tier is None:
        if max_model_len is not None:
            sliding_window = kv_window_for_pool(sliding_window, num_blocks, cache, config.scheduler, max_model_len)
        return KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching, sliding_window)
    num_host_blocks, policy = _host_tier(config, runner, tier)
    return TieredKVCacheManager(
        num_blocks,
        cache.block_size,
        cache.enable_prefix_caching,
        num_host_blocks=num_host_blocks,
        swap_policy=policy,
        connector=tier,
    )


def _host_tier(config: EngineConfig, runner, tier: DeviceLayoutKVConnector) -> tuple[int, PreemptionCostModel | None]:
    """(store blocks, swap policy) of the device-layout connector ``tier``: its tensors
    allocated on ``runner`` (unless every rank's worker did), the policy None under
    ``preemption_mode="recompute"``."""
    cache = config.cache
    config.validate()
    per_block = runner.kv_block_bytes(cache.block_size)
    # Under tensor/pipeline parallelism every rank's worker has allocated its own share
    # of the tier (the smallest rank's count of blocks); one process allocates here.
    num_host_blocks = runner.num_host_blocks or tier.num_blocks(per_block)
    if num_host_blocks < 1:
        setting = (
            f"kv_offload_memory={cache.kv_offload_memory}"
            if cache.kv_offload_memory is not None
            else f"kv_connector={cache.kv_connector!r} with kv_connector_memory={cache.kv_connector_memory}"
        )
        raise ValueError(
            f"{setting} bytes holds no KV block ({per_block} bytes each on a rank); raise it or leave it unset"
        )
    if not runner.num_host_blocks:
        runner.use_kv_connector(tier)
        runner.allocate_host_kv_cache(num_host_blocks)
    # Under a device map each layer copies and computes at its platform's rate: the
    # effective rate is the layer-weighted harmonic mean (one platform: its own).
    platforms = runner.layer_platforms

    def rate(attr: str) -> float:
        return len(platforms) / sum(1.0 / getattr(p, attr) for p in platforms)

    cost = PreemptionCostModel(
        mode=cache.preemption_mode,
        bytes_per_block=per_block,
        flops_per_token=2.0 * runner.weight_bytes() / torch.empty((), dtype=runner.dtype).element_size(),
        host_copy_bandwidth=rate("host_copy_bandwidth"),
        compute_flops=rate("compute_flops"),
    )
    return num_host_blocks, None if cache.preemption_mode == "recompute" else cost


def _connector_manager(config: EngineConfig, num_blocks: int, runner) -> ConnectorKVCacheManager:
    """A manager whose full blocks go to, and whose prefix misses come from, the
    ``kv_connector`` (keeps every block of a request: no freeing of slid-out blocks)."""
    cache, model = config.cache, config.model
    views = runner.kv_block_views()
    extra = {
        "dtype": str(runner.dtype),
        "kv_cache_dtype": cache.cache_dtype,
        # Blocks written with other per-layer scales hold other values (row scales ride in the rows).
        "kv_layer_scales": sorted((runner.kv_layer_scales or {}).items()),
        "block_size": cache.block_size,
        "quantization": model.quantization,
        "tensors": [(str(t.dtype), tuple(t.shape[1:])) for layer in views for t in layer],
    }
    fingerprint = kv_fingerprint(model.model, runner.arch.hf_config, extra)
    connector = create_kv_connector(cache.kv_connector, int(cache.kv_connector_memory), fingerprint)
    runner.use_kv_connector(connector)
    return ConnectorKVCacheManager(num_blocks, cache.block_size, connector, fingerprint, cache.enable_prefix_caching)
