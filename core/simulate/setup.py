"""From command-line flags to a ready Simulator: engine settings, KV-cache sizing, the
cost model.  Engine flags use the spellings of `pagedserve serve` (vLLM's)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from pagedserve.config import CacheConfig, SchedulerConfig
from pagedserve.kv_cache.kv_dtype import kv_row_size
from pagedserve.simulate.cost_model import CostModel
from pagedserve.simulate.hardware import HardwareProfile, load_profile
from pagedserve.simulate.model_spec import ModelSpec, load_model_config
from pagedserve.simulate.simulator import Simulator

__all__ = ["add_engine_arguments", "Plan", "build_plan"]

_QUANT_FORMATS = {"int8": "int8", "w8a8": "w8a8", "fp8": "fp8", "gptq": "gptq", "awq": "awq", "int4": "int4"}


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine (as `pagedserve serve`)")
    g.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float16", "float32"],
        help="activation dtype (auto: bfloat16)",
    )
    g.add_argument(
        "--quantization",
        default=None,
        help="weight format: none, auto (the config's; default), int8, w8a8, fp8, gptq, awq, int4",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8"],
        help="KV cache dtype",
    )
    g.add_argument(
        "--kv-cache-scales",
        default="auto",
        choices=["auto", "row", "tensor"],
        help="fp8 KV cache scales: row (a float32 scale per row, the engine's default) or tensor (per layer)",
    )
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    g.add_argument("--scheduler-delay-factor", type=float, default=0.0)
    g.add_argument(
        "--block-size", type=int, default=None, help="tokens per KV block (default: the hardware profile's platform's)"
    )
    g.add_argument(
        "--kv-cache-memory",
        default=None,
        help="KV-cache budget over all layers of one device, e.g. 4GiB (default: from --hardware)",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        "--memory-utilization",
        dest="memory_utilization",
        type=float,
        default=None,
        help="fraction of device memory for weights, activations and KV cache",
    )
    g.add_argument("--num-gpu-blocks-override", type=int, default=None)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    g.add_argument("--kv-offload-memory", default=None, help="host-memory KV tier, e.g. 8GiB")
    g.add_argument("--preemption-mode", default="auto", choices=["auto", "swap", "recompute"])
    g.add_argument(
        "--cpu-offload-gb",
        type=float,
        default=0.0,
        help="GB of layer weights kept in host memory and streamed every step",
    )
    g.add_argument(
        "--experts-hardware",
        default=None,
        metavar="PROFILE",
        help="the routed experts of every MoE layer in host memory, run on this host profile (e.g. cpu-generic) "
        "while the rest runs on --hardware: what `serve --device-map experts=cpu,*=cuda` does",
    )


@dataclass
class Plan:
    model: ModelSpec
    hardware: HardwareProfile
    cost: CostModel
    cache: CacheConfig
    scheduler: SchedulerConfig
    num_blocks: int
    num_host_blocks: int
    max_model_len: int

    def simulator(self, seed: int = 0) -> Simulator:
        return Simulator(
            self.cost,
            self.cache,
            self.scheduler,
            self.num_blocks,
            self.max_model_len,
            self.num_host_blocks,
            seed=seed,
            vocab_size=self.model.vocab_size,
        )

    def describe(self) -> dict:
        m = self.model
        return {
            "model": m.name,
            "hardware": self.hardware.name,
            "weight_format": m.weight_format,
            "total_params": m.total_params,
            "active_params": m.layer_params_active + m.embedding_params * (1 if m.tie_word_embeddings else 2),
            "weight_bytes_per_device": self.cost.weight_bytes_per_device(),
            "experts_hardware": self.cost.experts_hw.name if self.cost.experts_hw else None,
            "expert_bytes_on_host": self.cost.expert_bytes_on_host(),
            "kv_bytes_per_block_per_device": self.cost.kv_bytes_per_block(),
            "num_kv_blocks": self.num_blocks,
            "num_host_kv_blocks": self.num_host_blocks,
            "max_model_len": self.max_model_len,
            "tensor_parallel_size": self.cost.tp,
            "pipeline_parallel_size": self.cost.pp,
            "max_num_seqs": self.scheduler.max_num_seqs,
            "max_num_batched_tokens": self.scheduler.max_num_batched_tokens,
            "block_size": self.cache.block_size,
            "enable_prefix_caching": self.cache.enable_prefix_caching,
        }


def _weight_format(spec: ModelSpec, quantization: str | None, dtype: str) -> ModelSpec:
    q = (quantization or "auto").lower()
    if q in ("auto", "gguf"):
        return spec
    if q == "none":
        return spec.with_format(dtype)
    if q not in _QUANT_FORMATS:
        raise ValueError(f"--quantization {quantization!r}: one of none, auto, {', '.join(_QUANT_FORMATS)}")
    return spec.with_format(_QUANT_FORMATS[q])


def build_plan(args: argparse.Namespace) -> Plan:
    """Validate the flags and size the KV cache as the engine would on that hardware."""
    hw = load_profile(args.hardware)
    dtype = "bfloat16" if args.dtype == "auto" else args.dtype
    spec = ModelSpec.from_config(load_model_config(args.model), name=args.model or "smollm2-135m-instruct")
    spec = _weight_format(spec, args.quantization, dtype)
    # A calibrated profile prices each weight format with what was measured for it.
    hw = hw.for_format(spec.weight_format)
    block_size = args.block_size or hw.block_size  # unset: the platform's default, as the engine resolves it
    cache = CacheConfig(
        block_size=block_size,
        kv_cache_memory=args.kv_cache_memory,
        memory_utilization=args.memory_utilization,
        enable_prefix_caching=args.enable_prefix_caching,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        cache_dtype=args.kv_cache_dtype,
        kv_cache_scales=getattr(args, "kv_cache_scales", "auto"),
        kv_offload_memory=args.kv_offload_memory,
        preemption_mode=args.preemption_mode,
        cpu_offload_gb=args.cpu_offload_gb,
    )
    sched = SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=args.enable_chunked_prefill,
        policy=args.scheduling_policy,
        delay_factor=args.scheduler_delay_factor,
    )
    experts_hw = None
    if getattr(args, "experts_hardware", None):
        experts_hw = load_profile(args.experts_hardware).for_format(spec.weight_format)
    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    if spec.num_heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide the model's {spec.num_heads} attention heads")
    cost = CostModel(
        spec,
        hw,
        dtype=dtype,
        kv_dtype_bytes=_kv_dtype_bytes(args.kv_cache_dtype, spec.head_dim, getattr(args, "kv_cache_scales", "auto")),
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        block_size=block_size,
        cpu_offload_bytes=args.cpu_offload_gb * 1e9 / (tp * pp),
        experts_hw=experts_hw,
    )
    if experts_hw is not None and cost.expert_bytes_on_host() > experts_hw.memory_bytes:
        raise ValueError(
            f"--experts-hardware {experts_hw.name}: the routed experts' {cost.expert_bytes_on_host() / 1e9:.1f} GB "
            f"do not fit its {experts_hw.memory_bytes / 1e9:.1f} GB of memory"
        )
    if experts_hw is not None and args.cpu_offload_gb:
        raise ValueError(
            "--experts-hardware cannot be combined with --cpu-offload-gb (as device_map and cpu_offload_gb)"
        )
    mml = args.max_model_len or spec.max_position_embeddings
    if mml > spec.max_position_embeddings:
        raise ValueError(
            f"max_model_len={mml} exceeds the model's max_position_embeddings ({spec.max_position_embeddings})"
        )
    num_blocks = _num_device_blocks(spec, hw, cost, cache, sched, args.cpu_offload_gb)
    per_block = cost.kv_bytes_per_block()
    needed = -(-mml // cache.block_size)
    if num_blocks < needed:
        raise ValueError(
            f"the KV cache ({num_blocks} blocks of {cache.block_size} tokens) cannot hold one request "
            f"of max_model_len={mml} tokens ({needed} blocks); raise --kv-cache-memory or lower "
            "--max-model-len"
        )
    num_host = 0
    if cache.kv_offload_memory is not None:
        if tp * pp > 1:
            raise ValueError("kv_offload_memory is not supported with tensor/pipeline parallelism yet")
        num_host = int(int(cache.kv_offload_memory) // per_block)
        if num_host < 1:
            raise ValueError(
                f"kv_offload_memory={cache.kv_offload_memory} bytes holds no KV block ({per_block:.0f} bytes each)"
            )
    if args.cpu_offload_gb * 1e9 > spec.weight_bytes(dtype):
        raise ValueError(
            f"--cpu-offload-gb {args.cpu_offload_gb} exceeds the model's "
            f"{spec.weight_bytes(dtype) / 1e9:.1f} GB of weights"
        )
    return Plan(spec, hw, cost, cache, sched, num_blocks, num_host, mml)


def _num_device_blocks(
    spec: ModelSpec,
    hw: HardwareProfile,
    cost: CostModel,
    cache: CacheConfig,
    sched: SchedulerConfig,
    cpu_offload_gb: float,
) -> int:
    """KV blocks per device, as the engine sizes them (explicit count or budget, else what
    memory x utilization leaves after the weights and the activation workspace)."""
    per_block = cost.kv_bytes_per_block()
    if cache.num_gpu_blocks_override is not None:
        return cache.num_gpu_blocks_override
    if cache.kv_cache_memory is not None:
        return int(int(cache.kv_cache_memory) // per_block)
    util = cache.memory_utilization or hw.default_memory_utilization
    act = (
        sched.max_num_batched_tokens * (spec.hidden_size * 12 + spec.dense_mlp_params // spec.hidden_size * 2) * 4
        + sched.max_num_seqs * spec.vocab_size * 8
    )
    weights = cost.weight_bytes_per_device() - cpu_offload_gb * 1e9 / (cost.tp * cost.pp)
    budget = hw.memory_bytes * util - weights - act
    if budget <= 0:
        raise ValueError(
            f"{spec.name} does not fit {hw.name}: {weights / 1e9:.1f} GB of weights per device (+ "
            f"{act / 1e9:.1f} GB activations) vs {hw.memory_bytes * util / 1e9:.1f} GB usable; raise "
            "--tensor-parallel-size/--pipeline-parallel-size or quantize"
        )
    return int(budget // per_block)


def _kv_dtype_bytes(name: str, head_dim: int, scales: str = "auto") -> float | None:
    """Bytes per cached value of ``--kv-cache-dtype``: None (the model's dtype), 1 + 4 /
    head_dim for a row-scaled cache (int8, and fp8 unless ``scales`` is "tensor": each
    row's float32 scale rides in the block; "auto" prices row scales, the engine's choice
    without a checkpoint's per-layer scales), 1 for fp8 with per-layer scales."""
    if name == "auto":
        return None
    torch_name = "int8" if name == "int8" else "float8_e4m3fn"
    return kv_row_size(head_dim, torch_name, scales != "tensor") / head_dim
