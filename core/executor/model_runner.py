"""ModelRunner: owns the model weights and the KV cache on one platform; runs a step."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from pagedserve.config import CacheConfig, SchedulerConfig
from pagedserve.distributed.parallel_state import ParallelContext
from pagedserve.executor.input_batch import prepare_inputs
from pagedserve.executor.sampler import Sampler, SamplerOutput
from pagedserve.models.llama import ArchConfig, LlamaForCausalLM
from pagedserve.offload.kv_tier import apply_kv_transfers
from pagedserve.platforms import OpRegistry, Platform
from pagedserve.scheduler import SchedulerOutput

__all__ = ["ModelRunner", "StepOutput", "resolve_dtype", "kv_bytes_per_block"]

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
}


def resolve_dtype(name: str, platform: Platform) -> torch.dtype:
    """"auto" is the platform's default dtype; others must be supported by it."""
    if name == "auto":
        return platform.default_dtype
    dtype = _DTYPES[name]
    if dtype not in platform.supported_dtypes:
        supported = ", ".join(str(d).replace("torch.", "") for d in platform.supported_dtypes)
        raise ValueError(f"dtype {name} is not supported on platform {platform.name!r} (supported: {supported})")
    return dtype


def kv_bytes_per_block(cfg: ArchConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem


@dataclass
class StepOutput:
    """Sampled tokens by request id (only requests whose chunk reached the end)."""

    sampled: dict[str, int]
    logprobs: dict[str, tuple[float, int, list[tuple[int, float]]]]


class ModelRunner:
    def __init__(self, platform: Platform, ops: OpRegistry, arch: ArchConfig, dtype: torch.dtype,
                 parallel: ParallelContext | None = None) -> None:
        self.platform = platform
        self.ops = ops
        self.arch = arch
        self.dtype = dtype
        self.device = platform.device
        self.model = LlamaForCausalLM(arch, ops, dtype, self.device, parallel)
        # This rank's share of the KV cache: its KV heads of its pipeline stage's layers.
        self.local_arch = replace(arch, num_kv_heads=self.model.num_kv_heads, num_layers=len(self.model.layers))
        self.sampler = Sampler()
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        #: The host KV tier's blocks, same layout (empty without kv_offload_memory).
        self.host_kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.block_size = 16
        self.num_blocks = 0

    def load_weights(self, weights) -> None:
        with torch.inference_mode():
            self.model.load_weights(weights)

    # -- KV cache -----------------------------------------------------------------------
    def determine_num_blocks(self, cache: CacheConfig, sched: SchedulerConfig, max_model_len: int) -> int:
        """Blocks that fit the KV budget; a clear error if not one max-length request fits."""
        per_block = kv_bytes_per_block(self.local_arch, cache.block_size, self.dtype)
        if cache.num_gpu_blocks_override is not None:
            budget = cache.num_gpu_blocks_override * per_block
        elif cache.kv_cache_memory is not None:
            budget = int(cache.kv_cache_memory)
        else:
            # memory_utilization covers weights and activations too.
            total = self.platform.total_memory()
            weights = self.model.weight_bytes()
            act = sched.max_num_batched_tokens * (self.arch.hidden_size * 12 + self.arch.intermediate_size * 6) \
                * 4 + sched.max_num_seqs * self.arch.vocab_size * 8
            util = cache.memory_utilization or self.platform.default_memory_utilization
            budget = int(total * util) - weights - act
        num_blocks = budget // per_block
        needed = -(-max_model_len // cache.block_size)
        if num_blocks < needed:
            raise ValueError(
                f"the KV cache budget ({max(budget, 0) / 2**20:.1f} MiB = {max(num_blocks, 0)} blocks of "
                f"{cache.block_size} tokens) cannot hold even one request of max_model_len={max_model_len} "
                f"tokens ({needed} blocks = {needed * per_block / 2**20:.1f} MiB); raise kv_cache_memory / "
                "memory_utilization or lower max_model_len")
        return int(num_blocks)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        a = self.local_arch
        self.kv_caches = [
            self.platform.allocate_kv_cache(num_blocks, block_size, a.num_kv_heads, a.head_dim, self.dtype)
            for _ in range(a.num_layers)
        ]

    # -- step --------------------------------------------------------------------------
    def execute(self, out: SchedulerOutput, block_ids: dict[str, list[int]]) -> StepOutput:
        with torch.inference_mode():
            if out.kv_transfers:
                # Spills, reloads and swaps decided by the scheduler: all before the forward.
                apply_kv_transfers(self.ops.swap_blocks, self.kv_caches, self.host_kv_caches, out.kv_transfers)
            inp = prepare_inputs(out, block_ids, self.block_size, self.device)
            hidden = self.model.forward(inp.input_ids, inp.meta, self.kv_caches)
            sampling_rows = [i for i, s in enumerate(out.scheduled) if s.samples]
            if not sampling_rows:
                return StepOutput({}, {})
            idx = inp.logits_indices[sampling_rows]
            logits = self.model.compute_logits(hidden.index_select(0, idx)).cpu()
            requests = [out.scheduled[i].request for i in sampling_rows]
            result: SamplerOutput = self.sampler(logits, requests)
        sampled = {r.request_id: t for r, t in zip(requests, result.token_ids)}
        logprobs = {r.request_id: lp for r, lp in zip(requests, result.logprobs) if lp is not None}
        return StepOutput(sampled, logprobs)
