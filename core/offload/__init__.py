"""The memory hierarchy: host KV tier set-up, preemption cost model, weight offload."""

from pagedserve.offload.cost import PreemptionCostModel
from pagedserve.offload.kv_tier import allocate_host_kv_cache, apply_kv_transfers, build_kv_manager
from pagedserve.offload.weights import WeightStreamer, offload_weights

__all__ = ["PreemptionCostModel", "allocate_host_kv_cache", "apply_kv_transfers", "build_kv_manager",
           "WeightStreamer", "offload_weights"]
