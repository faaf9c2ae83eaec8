"""Setting up the host KV tier and running its block copies.

The host pool mirrors the device pool block for block (same per-layer shape, from the
platform's ``kv_cache_shape``) so that one block index maps to one block in both, and
copies go through the op registry's ``swap_blocks`` (a platform may override it with
an asynchronous kernel).  Host tensors are pinned when the platform can pin.  Under a
device map each layer's host tensors take its own platform's layout and pinning, and
its copies run with its own platform's ``swap_blocks``.
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
from pagedserve.offload.connectors import create_kv_connector, kv_fingerprint
from pagedserve.offload.cost import PreemptionCostModel
from pagedserve.platforms import Platform

__all__ = ["build_kv_manager", "allocate_host_kv_cache", "apply_kv_transfers"]

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def allocate_host_kv_cache(
    platforms: Sequence[Platform],
    num_host_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
) -> KVCaches:
    """One (key, value) pair of host tensors per layer with ``num_host_blocks`` blocks,
    each in its layer's platform's layout (``platforms``: one per layer)."""

    def alloc(platform: Platform) -> torch.Tensor:
        shape = platform.kv_cache_shape(num_host_blocks, block_size, num_kv_heads, head_dim)
        # Zeroed so that a (buggy) read of a never-written block is deterministic.
        return torch.zeros(shape, dtype=dtype, device="cpu", pin_memory=platform.pin_memory_available)

    return [(alloc(p), alloc(p)) for p in platforms]


SwapBlocks = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


def apply_kv_transfers(
    swap_blocks: SwapBlocks | Sequence[SwapBlocks],
    device_caches: KVCaches,
    host_caches: KVCaches,
    transfers: KVTransfers,
) -> None:
    """Run the recorded copies in order: one batched ``swap_blocks`` per run, layer and
    tensor.  ``swap_blocks(src, dst, mapping)`` copies ``dst[m[:, 1]] = src[m[:, 0]]``;
    one function for every layer, or one per layer (its platform's, under a device map)."""
    per_layer = [swap_blocks] * len(device_caches) if callable(swap_blocks) else list(swap_blocks)
    for direction, pairs in transfers.runs:
        mapping = torch.tensor(pairs, dtype=torch.int64)
        for swap_blocks, (dk, dv), (hk, hv) in zip(per_layer, device_caches, host_caches):
            if direction == IN:
                swap_blocks(hk, dk, mapping)
                swap_blocks(hv, dv, mapping)
            else:
                swap_blocks(dk, hk, mapping)
                swap_blocks(dv, hv, mapping)


def build_kv_manager(
    config: EngineConfig,
    num_blocks: int,
    runner,
    sliding_window: int | None = None,
    max_model_len: int | None = None,
    windows: Sequence[int | None] | None = None,
) -> KVCacheManager | GroupedKVCacheManager:
    """The plain manager, or one with a host tier of ``kv_offload_memory`` bytes (whose
    host KV tensors are allocated on ``runner``, the engine process's ModelRunner, here).
    ``sliding_window``: the plain manager frees blocks that slid out of it (the engine's
    rules refuse it with a host tier), when the pool can spare the null block for a
    request of ``max_model_len`` tokens.

    The runner is not imported (it imports :func:`apply_kv_transfers` from here); this
    uses its public methods ``kv_block_bytes``, ``allocate_host_kv_cache`` and
    ``weight_bytes`` and its ``layer_platforms``, ``num_host_blocks`` and ``dtype``.  ``windows`` (each layer's):
    layers with different windows get one block table per KV cache group (kv_groups.py)
    when the runner laid its KV cache out in groups (``layer_groups``)."""
    cache = config.cache
    groups = kv_cache_groups(windows or [], cache.free_sliding_window_blocks)
    grouped = runner.layer_groups is not None
    if cache.kv_connector is not None:
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
        num_host_blocks, policy = _host_tier(config, runner) if cache.kv_offload_memory is not None else (0, None)
        return GroupedKVCacheManager(
            num_blocks,
            cache.block_size,
            cache.enable_prefix_caching,
            windows,
            state_pages,
            cache.state_checkpoint_interval,
            num_host_blocks=num_host_blocks,
            swap_policy=policy,
        )
    if cache.kv_offload_memory is None:
        if max_model_len is not None:
            sliding_window = kv_window_for_pool(sliding_window, num_blocks, cache, config.scheduler, max_model_len)
        return KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching, sliding_window)
    num_host_blocks, policy = _host_tier(config, runner)
    return TieredKVCacheManager(
        num_blocks, cache.block_size, cache.enable_prefix_caching, num_host_blocks=num_host_blocks, swap_policy=policy
    )


def _host_tier(config: EngineConfig, runner) -> tuple[int, PreemptionCostModel | None]:
    """(host blocks, swap policy) of the ``kv_offload_memory`` tier: its host KV tensors
    allocated on ``runner`` (unless every rank's worker did), the policy None under
    ``preemption_mode="recompute"``."""
    cache = config.cache
    config.validate()
    per_block = runner.kv_block_bytes(cache.block_size)
    # Under tensor/pipeline parallelism every rank's worker has allocated its own share
    # of the host tier (the smallest rank's count of blocks); one process allocates here.
    num_host_blocks = runner.num_host_blocks or int(cache.kv_offload_memory) // per_block
    if num_host_blocks < 1:
        raise ValueError(
            f"kv_offload_memory={cache.kv_offload_memory} bytes holds no KV block "
            f"({per_block} bytes each on a rank); raise it or leave it unset"
        )
    if not runner.num_host_blocks:
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
