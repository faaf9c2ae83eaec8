"""The memory hierarchy: host KV tier set-up, preemption cost model, weight offload,
and device maps (layers split across platforms)."""

from pagedserve.offload.cost import PreemptionCostModel
from pagedserve.offload.device_map import (
    Segment,
    check_device_map_platforms,
    resolve_device_map,
    resolve_expert_segment,
)
from pagedserve.offload.kv_tier import allocate_host_kv_cache, apply_kv_transfers, build_kv_manager
from pagedserve.offload.weights import WeightStreamer, offload_weights

__all__ = [
    "PreemptionCostModel",
    "allocate_host_kv_cache",
    "apply_kv_transfers",
    "build_kv_manager",
    "WeightStreamer",
    "offload_weights",
    "Segment",
    "check_device_map_platforms",
    "resolve_device_map",
    "resolve_expert_segment",
]
