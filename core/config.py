"""Engine configuration: one small dataclass per concern, validated on construction."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

__all__ = [
    "ModelConfig",
    "CacheConfig",
    "SchedulerConfig",
    "ParallelConfig",
    "DeviceConfig",
    "EngineConfig",
    "parse_memory",
]

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_memory(value: int | float | str, name: str = "memory") -> int:
    """Bytes from an int or a string such as "4GiB", "512 MB", "1.5g"."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a byte count or a string like '4GiB', got {value!r}")
    if isinstance(value, (int, float)):
        n = int(value)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{name} must be a byte count or a string like '4GiB', got {value!r}")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return n


@dataclass
class ModelConfig:
    """Which model and how to run it.  ``model=None`` is the default model alias."""

    model: str | None = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    max_model_len: int | None = None
    seed: int = 0
    tokenizer: str | None = None
    chat_template: str | None = None
    served_model_name: str | None = None
    quantization: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "float", "bfloat16", "float16", "half", "fp32", "bf16", "fp16"):
            raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16; got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")


@dataclass
class CacheConfig:
    """Paged KV cache settings.

    kv_cache_memory: bytes (or "4GiB") for KV blocks; takes precedence over
    memory_utilization, the fraction of the platform's memory the engine may use
    with weights included (vLLM's gpu_memory_utilization).

    Memory hierarchy (docs/memory.md):
    kv_offload_memory: bytes (or "8GiB") of host memory for a second tier of KV blocks:
        evicted prefix-cache blocks spill there and are reloaded instead of recomputed,
        and preempted requests may be swapped there.  None: no host tier.
    preemption_mode: "auto" (swap or recompute by a cost model; recompute without a
        host tier), "swap" (whenever the host tier has room) or "recompute".
    cpu_offload_gb: GB (10**9 bytes) of layer weights kept in host memory and streamed
        to the device layer by layer during the forward.
    """

    block_size: int = 16
    kv_cache_memory: int | str | None = None
    memory_utilization: float | None = None  # None: the platform's default
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None
    cache_dtype: str = "auto"
    kv_offload_memory: int | str | None = None
    preemption_mode: str = "auto"  # auto | swap | recompute
    cpu_offload_gb: float = 0.0

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.memory_utilization is not None and not 0.0 < self.memory_utilization <= 1.0:
            raise ValueError(f"memory_utilization must be in (0, 1], got {self.memory_utilization}")
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_memory(self.kv_cache_memory, "kv_cache_memory")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override}")
        if self.kv_offload_memory is not None:
            self.kv_offload_memory = parse_memory(self.kv_offload_memory, "kv_offload_memory")
        if self.preemption_mode not in ("auto", "swap", "recompute"):
            raise ValueError(f"preemption_mode must be 'auto', 'swap' or 'recompute', got {self.preemption_mode!r}")
        if self.preemption_mode == "swap" and self.kv_offload_memory is None:
            raise ValueError("preemption_mode='swap' needs a host KV tier: set kv_offload_memory")
        if not self.cpu_offload_gb >= 0:
            raise ValueError(f"cpu_offload_gb must be >= 0, got {self.cpu_offload_gb}")


@dataclass
class SchedulerConfig:
    """Continuous batching: one token budget per step."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # fcfs | priority
    delay_factor: float = 0.0
    max_queue_len: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if self.delay_factor < 0:
            raise ValueError(f"scheduler delay_factor must be >= 0, got {self.delay_factor}")
        if self.max_queue_len is not None and self.max_queue_len < 1:
            raise ValueError(f"max_queue_len must be >= 1, got {self.max_queue_len}")


@dataclass
class ParallelConfig:
    """Ranks = tensor_parallel_size * pipeline_parallel_size.

    distributed_executor_backend: "uni" (one process), "mp" (local worker processes) or
    "ray" (Ray actors); None picks "uni" for one rank and "mp" otherwise.
    distributed_timeout_s: how long a collective (or the start-up rendezvous) may wait
    for a rank before failing instead of hanging.
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    distributed_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size must be >= 1, got {self.pipeline_parallel_size}")
        if self.distributed_executor_backend not in (None, "uni", "mp", "ray"):
            raise ValueError("distributed_executor_backend must be 'uni', 'mp' or 'ray', "
                             f"got {self.distributed_executor_backend!r}")
        if self.distributed_timeout_s <= 0:
            raise ValueError(f"distributed_timeout_s must be > 0, got {self.distributed_timeout_s}")


@dataclass
class DeviceConfig:
    """Platform selection (None = PAGEDSERVE_TARGET_DEVICE or auto-detect) and threads."""

    device: str | None = None
    threads: int | None = None

    def __post_init__(self) -> None:
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
