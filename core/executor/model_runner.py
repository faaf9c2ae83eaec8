"""ModelRunner: owns the model weights and the KV cache on one platform; runs a step."""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from pagedserve.config import CacheConfig, SchedulerConfig
from pagedserve.distributed.parallel_state import ParallelContext
from pagedserve.executor.input_batch import ModelInput, prepare_inputs
from pagedserve.executor.sample_step import StepOutput, finish_step, plan_step, run_head
from pagedserve.executor.sampler import Sampler
from pagedserve.kv_cache import kv_dtype
from pagedserve.kv_cache.connector import ConnectorTransfers
from pagedserve.kv_cache.kv_groups import grouped_blocks_for_one_request, kv_cache_groups, layer_slots
from pagedserve.kv_cache.sliding_window import blocks_for_one_request
from pagedserve.models.arch_config import ArchConfig
from pagedserve.models.layers import LayerPlacement
from pagedserve.models.registry import resolve_model_class, resolve_vision_class
from pagedserve.multimodal.encoder_cache import EncoderCache
from pagedserve.offload.connectors import HostTierConnector, apply_connector_transfers
from pagedserve.offload.device_map import Segment
from pagedserve.offload.kv_tier import allocate_host_kv_cache, apply_kv_transfers
from pagedserve.platforms import OpRegistry, Platform
from pagedserve.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)

__all__ = [
    "ModelRunner",
    "StepOutput",
    "resolve_dtype",
    "check_cache_dtype",
    "check_kv_scales",
    "load_kv_scale_file",
    "kv_bytes_per_block",
    "kv_cache_torch_dtype",
    "draft_kv_blocks",
]

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(name: str, platform: Platform) -> torch.dtype:
    """ "auto" is the platform's default dtype; others must be supported by it."""
    if name == "auto":
        return platform.default_dtype
    dtype = _DTYPES[name]
    if dtype not in platform.supported_dtypes:
        supported = ", ".join(str(d).replace("torch.", "") for d in platform.supported_dtypes)
        raise ValueError(f"dtype {name} is not supported on platform {platform.name!r} (supported: {supported})")
    return dtype


def check_cache_dtype(cache_dtype: str, dtype: torch.dtype, platforms: Sequence[Platform] = ()) -> None:
    """The KV cache is kept in the model's dtype (``cache_dtype`` "auto" or its name) or
    in a quantized dtype every one of ``platforms`` declares (pagedserve.kv_cache.kv_dtype)."""
    kv_dtype.check_kv_cache_dtype(cache_dtype, dtype_name(dtype), platforms)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def kv_cache_torch_dtype(cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's torch dtype for ``cache_dtype`` (checked) and the model's ``dtype``."""
    return getattr(torch, kv_dtype.kv_cache_dtype(cache_dtype, dtype_name(dtype)))


def kv_bytes_per_block(cfg: ArchConfig, block_size: int, dtype: torch.dtype, row_scaled: bool | None = None) -> int:
    """Bytes of one KV block over ``cfg``'s layers (a row-scaled cache's scales included)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * kv_row_size(cfg.head_dim, dtype, row_scaled) * elem


def kv_row_size(head_dim: int, dtype: torch.dtype, row_scaled: bool | None = None) -> int:
    """The last dimension of a KV cache of ``dtype``: ``head_dim``, or ``head_dim + 4`` for
    a row-scaled cache (int8; fp8 unless ``row_scaled`` is False: each row's float32
    scale; pagedserve.kv_cache.kv_dtype)."""
    return kv_dtype.kv_row_size(head_dim, dtype_name(dtype), row_scaled)


def check_kv_scales(cache: CacheConfig, architecture: str) -> None:
    """ValueError, before weights load, for a row-scaled KV cache with a model family
    whose attention reads no row scales (latent attention: DeepSeek V2/V3)."""
    if getattr(resolve_model_class(architecture), "row_scaled_kv", True):
        return
    name = kv_dtype.canonical_kv_dtype(cache.cache_dtype)
    if name == "int8" or (name in ("fp8_e4m3", "fp8_e5m2") and cache.kv_cache_scales == "row"):
        raise ValueError(
            f"kv_cache_dtype={cache.cache_dtype!r} with row scales cannot serve {architecture}: its latent "
            "attention reads no per-row scales; use an fp8 kv_cache_dtype with kv_cache_scales='tensor' or "
            "'auto', or kv_cache_dtype='auto'"
        )


def load_kv_scale_file(path: str, tp_rank: int, num_layers: int) -> dict[int, tuple[float, float]]:
    """Per-layer (k_scale, v_scale) from an older vLLM ``kv_cache_scales`` JSON file
    (``{"kv_cache": {"scaling_factor": {"TP_RANK": {"LAYER": SCALE}}}}``: one scale for
    keys and values alike); this rank's entry, else rank 0's."""
    import json

    with open(path) as f:
        try:
            doc = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"quantization_param_path {path!r} is not JSON: {e}") from None
    try:
        by_rank = doc["kv_cache"]["scaling_factor"]
        table = by_rank.get(str(tp_rank), by_rank.get("0", by_rank.get(0)))
        if not isinstance(table, dict):
            raise KeyError(str(tp_rank))
        scales = {int(layer): float(v) for layer, v in table.items()}
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(
            f"quantization_param_path {path!r} has no kv_cache.scaling_factor table of per-layer scales "
            f"for tensor-parallel rank {tp_rank} or 0 ({type(e).__name__}: {e})"
        ) from None
    bad = [f"{layer}: {v}" for layer, v in scales.items() if not 0 < v < float("inf") or not 0 <= layer < num_layers]
    if bad:
        raise ValueError(f"quantization_param_path {path!r}: invalid layers or scales ({', '.join(bad[:5])})")
    return {layer: (v, v) for layer, v in scales.items()}


def draft_kv_blocks(target: ModelRunner, draft: ModelRunner) -> int:
    """KV blocks for a speculative draft model beside ``target`` (whose cache is
    allocated): as many as the target's, but at most the bytes of this rank's target KV
    cache, so that a draft loaded whole beside one shard or stage of the target does not
    multiply the rank's KV memory (a request that finds no draft block gets no draft)."""
    bs = target.block_size
    budget = target.num_blocks * target.kv_block_bytes(bs)
    return max(1, min(target.num_blocks, budget // draft.kv_block_bytes(bs)))


def _host_copy(t, pin: bool):
    """A host-memory copy of a checkpoint tensor (or a quantized weight, which moves as one)."""
    if not isinstance(t, torch.Tensor):
        return t.to(torch.device("cpu"))
    t = t.to("cpu", copy=True)
    return t.pin_memory() if pin else t


def _layer_in(name: str, first: int, last: int) -> bool:
    """Whether checkpoint tensor ``name`` belongs to layers [first, last), or to no layer."""
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
        return first <= int(parts[2]) < last
    return True


class ModelRunner:
    """One rank's model and KV cache.

    ``segments`` (a device map, see pagedserve.offload.device_map) splits the layers
    across platforms: ``platform``/``ops`` are then the first segment's, which embeds
    the tokens and receives the step's inputs; each layer's weights, KV cache and
    kernels are its segment's.  Without it every layer is on ``platform``.
    """

    def __init__(
        self,
        platform: Platform,
        ops: OpRegistry,
        arch: ArchConfig,
        dtype: torch.dtype,
        parallel: ParallelContext | None = None,
        segments: list[Segment] | None = None,
        max_model_len: int | None = None,
        vision: bool = False,
        experts: Segment | None = None,
        residual_dtype: str = "auto",
    ) -> None:
        self.platform = platform
        self.ops = ops
        self.arch = arch
        self.dtype = dtype
        #: The KV cache's dtype: the model's, or an 8-bit float (set from the cache
        #: config by determine_num_blocks).
        self.kv_dtype = dtype
        #: Whether the KV cache's rows carry a float32 scale each (int8; fp8 by
        #: kv_cache_scales), and the per-layer (k, v) scales of a tensor-scaled fp8 cache
        #: (None: none, or 1.0); set by determine_num_blocks.
        self.kv_row_scaled = False
        self.kv_layer_scales: dict[int, tuple[float, float]] | None = None
        self.device = platform.device
        self.parallel = parallel
        self.max_model_len = max_model_len
        self._placed = segments is not None  # a device map: the model gets its placements
        self.segments = segments
        #: A map by tensor class: where the routed experts live and run (else None).
        self.experts = experts
        #: The ``residual_dtype`` setting (resolved by the model once its weights load).
        self.residual_dtype = residual_dtype
        self.model = self._build_model()
        #: A vision-language model's vision side (``vision``: images are on), else None;
        #: its outputs by image, while prompts are prefilled.
        self.vision = None
        self.encoder_cache = EncoderCache()
        #: M-RoPE models: per request its prompt's positions [3, prompt len] and the delta of later tokens.
        self._mrope: dict[str, tuple[np.ndarray, int]] = {}
        if vision and arch.multimodal:
            vision_cls = resolve_vision_class(arch.multimodal["architecture"])
            if vision_cls is None:
                raise ValueError(
                    f"images are not supported for {arch.multimodal['architecture']} yet; serve its language "
                    "model alone with limit_mm_per_prompt={'image': 0} (--limit-mm-per-prompt image=0)"
                )
            self.vision = vision_cls(arch, ops, dtype, self.device)
        if segments is None:
            segments = [Segment(platform, ops, self.model.layer_start, self.model.layer_end)]
        self.segments = segments
        #: Per local layer: the platform that holds it and the ops it runs with.
        self.layer_platforms = [s.platform for s in segments for _ in range(s.num_layers)]
        self.layer_ops = [s.ops for s in segments for _ in range(s.num_layers)]
        # This rank's share of the KV cache: its KV heads of its pipeline stage's layers.
        self.local_arch = replace(arch, num_kv_heads=self.model.num_kv_heads, num_layers=len(self.model.layers))
        self.sampler = Sampler()
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        #: The device-layout KV connector's blocks on this rank (the host tier's with
        #: kv_offload_memory), in the device cache's layout; empty without one.
        self.host_kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_host_blocks = 0
        self.block_size = platform.default_block_size  # allocate_kv_cache sets the engine's
        self.num_blocks = 0
        #: With KV cache groups (kv_groups.py): each model layer's group, and each local
        #: layer's KV tensor ("slot"); None: one group, one tensor per layer.
        self.layer_groups: list[int] | None = None
        self.layer_slots: list[int] | None = None
        #: Pages per request of each recurrent-state KV cache group (0: none; kv_cache/state_group.py).
        self.state_pages = 0
        #: The recurrent-state groups' indices (their block tables list state pages, not tokens).
        self.state_groups: frozenset[int] = frozenset()
        #: With KV cache groups: the platform that allocates each slot tensor.
        self.slot_platforms: list[Platform] = []
        #: Set by pagedserve.lora.LoRAManager.attach with enable_lora.
        self.lora_manager = None
        #: The KV connector blocks are saved to and loaded from (the host tier's with
        #: kv_offload_memory, a kv_connector's), else None.
        self.kv_connector = None
        #: Sleep level 1: the host copy of the weights that wake_up loads.
        self._host_weights: list[tuple[str, Any]] | None = None

    def _build_model(self):
        """The model object, its weights not loaded yet."""
        placements = None
        if self._placed:
            placements = [
                LayerPlacement(s.start, s.end, s.ops, s.platform.device, s.platform.to_device) for s in self.segments
            ]
        model = resolve_model_class(self.arch.architecture)(
            self.arch, self.ops, self.dtype, self.device, self.parallel, placements, max_positions=self.max_model_len
        )
        if self.experts is not None:
            e = self.experts
            model.place_experts(LayerPlacement(e.start, e.end, e.ops, e.platform.device, e.platform.to_device))
        model.set_residual_dtype(self.residual_dtype)  # refuses an impossible "float32" before any weight loads
        return model

    def load_weights(self, weights, prepare: bool = True) -> None:
        """Load (HF name, tensor) pairs; ``prepare``: then put dense linear weights in the
        form each platform's ``linear`` runs fastest (``prepare_linear_weight``).  Dense
        weights streamed by weight offload stay plain (``prepare=False``); quantized ones
        take their prepared form either way."""
        with torch.inference_mode():
            vision: list[tuple[str, torch.Tensor]] = []
            self.model.load_weights(self._split_vision(weights, vision))
            self.model.set_residual_dtype(self.residual_dtype)  # "auto" looks at the loaded projections
            if self.vision is not None:
                self.vision.load_weights(vision)
            if prepare:
                self.model.prepare_linear_weights()
            else:
                self.model.prepare_quantized_weights()

    def _split_vision(self, weights, vision: list) -> Iterator[tuple[str, torch.Tensor]]:
        """The language model's weights; a vision-language checkpoint's vision tensors go
        to ``vision`` (or are skipped when images are off)."""
        from pagedserve.loader.hf_checkpoint import VISION_PREFIXES

        for name, t in weights:
            if self.arch.multimodal and name.startswith(VISION_PREFIXES):
                if self.vision is not None:
                    vision.append((name, t))
                continue
            yield name, t

    # -- KV cache -----------------------------------------------------------------------
    def determine_num_blocks(
        self,
        cache: CacheConfig,
        sched: SchedulerConfig,
        max_model_len: int,
        agree: Callable[[int], int] | None = None,
    ) -> int:
        """Blocks that fit the KV budget; a clear error if not one max-length request fits.

        Every layer gets the same number of blocks (block ids are shared by all layers).
        ``kv_cache_memory`` is the budget over all layers; with a ``memory_utilization``
        budget each device (segments on one torch device share its memory) fits as many
        blocks of its own layers as its memory allows, and the smallest count is used.

        Layers with different windows get KV cache groups (kv_groups.py) when the budget
        holds one max-length request in them; otherwise one group keeps every block.
        ``agree``: the minimum over ranks (they must all choose the same layout).
        """
        platforms = list({id(p): p for p in self.layer_platforms}.values())
        check_cache_dtype(cache.cache_dtype, self.dtype, platforms)  # each segment's platform
        self.kv_dtype = kv_cache_torch_dtype(cache.cache_dtype, self.dtype)
        self._resolve_kv_scales(cache)
        windows = getattr(self.model, "windows", None) or [None] * self.arch.num_layers
        groups = kv_cache_groups(windows, cache.free_sliding_window_blocks)
        has_state = any(g.is_state for g in groups)
        if has_state:
            # A state page is one slot's key and value pages, taken as bytes: an 8-bit cache's
            # (rows with their scales) hold a state in the model's dtype over more pages.
            page = kv_bytes_per_block(
                replace(self.local_arch, num_layers=1), cache.block_size, self.kv_dtype, self.kv_row_scaled
            )
            self.state_pages = -(-self.model.state_bytes(self.kv_dtype) // page)
        if len(groups) > 1 or has_state:
            self._use_groups(groups)
            num_blocks = self._kv_budget(cache, sched)[2]
            num_blocks = num_blocks if agree is None else agree(num_blocks)
            bs, step = cache.block_size, sched.max_num_batched_tokens
            need = grouped_blocks_for_one_request(groups, bs, max_model_len, step, self.state_pages)
            if num_blocks >= need:
                return int(num_blocks)
            if has_state:
                per_block = self.kv_block_bytes(bs)
                raise ValueError(
                    f"the KV cache budget ({max(num_blocks, 0)} pages of {per_block / 2**10:.1f} KiB) cannot hold "
                    f"even one request of max_model_len={max_model_len} tokens: its attention blocks and "
                    f"{self.state_pages} recurrent-state pages per state layer group need {need} pages; raise "
                    "kv_cache_memory / memory_utilization or lower max_model_len"
                )
            self.layer_groups = self.layer_slots = None  # too small for groups: keep every block
        needed = blocks_for_one_request(cache, sched, max_model_len, windows)
        budget, per_block, num_blocks, where = self._kv_budget(cache, sched)
        if num_blocks < needed:
            raise ValueError(
                f"the KV cache budget{where} ({max(budget, 0) / 2**20:.1f} MiB = {max(num_blocks, 0)} blocks of "
                f"{cache.block_size} tokens) cannot hold even one request of max_model_len={max_model_len} "
                f"tokens ({needed} blocks = {needed * per_block / 2**20:.1f} MiB); raise kv_cache_memory / "
                "memory_utilization or lower max_model_len"
            )
        return int(num_blocks)

    def _resolve_kv_scales(self, cache: CacheConfig) -> None:
        """Row scales or per-layer scales for the KV cache (pagedserve.kv_cache.kv_dtype):
        per-layer ones come from ``quantization_param_path``, else the checkpoint."""
        given: dict[int, tuple[float, float]] | None = None
        if cache.quantization_param_path is not None:
            tp_rank = self.parallel.tp_rank if self.parallel is not None else 0
            given = load_kv_scale_file(cache.quantization_param_path, tp_rank, self.arch.num_layers)
        elif getattr(self.model, "checkpoint_kv_scales", None):
            given = {}
            for layer, (k, v) in self.model.checkpoint_kv_scales.items():
                if k is None or v is None:
                    raise ValueError(f"the checkpoint has only one of k_scale and v_scale for layer {layer}")
                given[layer] = (k, v)
        if not getattr(self.model, "row_scaled_kv", True) and cache.kv_cache_scales == "auto":
            mode = "tensor"  # latent attention reads unscaled rows only
        else:
            mode = cache.kv_cache_scales
        self.kv_row_scaled, self.kv_layer_scales = kv_dtype.resolve_kv_scales(mode, dtype_name(self.kv_dtype), given)
        if given and self.kv_row_scaled and self.kv_dtype.is_floating_point and self.kv_dtype.itemsize == 1:
            logger.info("fp8 KV cache with row scales computed on write: the per-layer k/v scales given are not used")
        if self.kv_layer_scales is not None and not getattr(self.model, "row_scaled_kv", True):
            raise ValueError("per-layer KV cache scales are not applied by latent attention (DeepSeek V2/V3)")
        self.model.set_kv_scales(self.kv_layer_scales)

    def _kv_budget(self, cache: CacheConfig, sched: SchedulerConfig) -> tuple[int, int, int, str]:
        """(KV bytes, bytes per block, blocks, " on <platforms>") in the current layout."""
        per_block = self.kv_block_bytes(cache.block_size)
        where = ""
        if cache.num_gpu_blocks_override is not None:
            budget = cache.num_gpu_blocks_override * per_block
        elif cache.kv_cache_memory is not None:
            budget = int(cache.kv_cache_memory)
        else:
            budget, per_block, where = self._memory_budget(cache, sched)
        return budget, per_block, budget // per_block, where

    def _use_groups(self, groups: list) -> None:
        """Each model layer's group, and each local layer's slot tensor (a pipeline stage
        allocates only the slots its layers use; under a device map each segment has
        its own slot tensors, allocated by its platform, so no tensor spans two)."""
        self.state_groups = frozenset(i for i, g in enumerate(groups) if g.is_state)
        group_of, slot_of = layer_slots(groups, self.arch.num_layers)
        self.layer_groups = group_of
        self.layer_slots, self.slot_platforms = [], []
        for seg in self.segments:
            part = slot_of[seg.start : seg.end]
            used = sorted(set(part))
            base = len(self.slot_platforms)
            self.layer_slots += [base + used.index(s) for s in part]
            self.slot_platforms += [seg.platform] * len(used)

    @property
    def num_kv_tensors(self) -> int:
        """KV (key, value) pairs this rank allocates: one per layer, or one per slot."""
        return len(self.model.layers) if self.layer_slots is None else len(self.slot_platforms)

    def _memory_budget(self, cache: CacheConfig, sched: SchedulerConfig) -> tuple[int, int, str]:
        """(KV bytes, bytes per block of the layers they hold, " on <platforms>") of the
        device that fits the fewest blocks under ``memory_utilization``."""
        # memory_utilization covers weights and activations too.
        act = (
            sched.max_num_batched_tokens * (self.arch.hidden_size * 12 + self.arch.intermediate_size * 6) * 4
            + sched.max_num_seqs * self.arch.vocab_size * 8
        )
        groups: dict[str, list[tuple[Segment, int]]] = {}
        per_segment = self.model.placement_weight_bytes()
        if self.vision is not None:  # the vision side sits with the embedding, on the first device
            per_segment[0] += self.vision.weight_bytes()
        for seg, weights in zip(self.segments, per_segment):
            groups.setdefault(str(seg.platform.device), []).append((seg, weights))
        best = None
        for members in groups.values():
            platform = members[0][0].platform
            util = cache.memory_utilization or platform.default_memory_utilization
            budget = int(platform.total_memory() * util) - sum(w for _, w in members) - act
            num_layers = sum(s.num_layers for s, _ in members) if self.layer_slots is None else self.num_kv_tensors
            layers = replace(self.local_arch, num_layers=num_layers)
            per_block = kv_bytes_per_block(layers, cache.block_size, self.kv_dtype, self.kv_row_scaled)
            if best is None or budget // per_block < best[0] // best[1]:
                names = ", ".join(dict.fromkeys(s.platform.name for s, _ in members))
                best = (budget, per_block, f" on {names}" if len(self.segments) > 1 else "")
        return best

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """One (key, value) pair per layer, allocated by the layer's platform in its layout."""
        self.block_size = block_size
        self.num_blocks = num_blocks
        a = self.local_arch
        platforms = self.layer_platforms if self.layer_slots is None else self.slot_platforms
        self.kv_caches = [
            platform.allocate_kv_cache(
                num_blocks,
                block_size,
                a.num_kv_heads,
                kv_row_size(a.head_dim, self.kv_dtype, self.kv_row_scaled),
                self.kv_dtype,
            )
            for platform in platforms
        ]
        if self.layer_slots is not None:
            # KV cache groups: a layer's cache is its slot's tensor (its segment's own).
            self.kv_caches = [self.kv_caches[s] for s in self.layer_slots]
        # The last block is the null block of a sliding-window manager (never written by
        # requests, never read by a conforming kernel); zeroed once so that a kernel that
        # still gathers it under its window mask adds exact zeros, not NaN garbage.
        for k, v in self.kv_caches:
            k[-1].zero_()
            v[-1].zero_()

    def kv_block_bytes(self, block_size: int) -> int:
        """Bytes of one KV block over this rank's layers (its KV heads, its stage), or
        over its slots with KV cache groups."""
        layers = replace(self.local_arch, num_layers=self.num_kv_tensors)
        return kv_bytes_per_block(layers, block_size, self.kv_dtype, self.kv_row_scaled)

    def allocate_host_kv_cache(self, num_host_blocks: int) -> None:
        """The device-layout KV connector's blocks on this rank (the host tier's, unless
        :meth:`use_kv_connector` gave another): per layer a (key, value) pair allocated by
        the connector in its platform's layout, so that one block index means the same
        block in both."""
        a = self.local_arch
        if not getattr(self.kv_connector, "device_layout", False):
            self.kv_connector = HostTierConnector(0)  # the builtin host tier: host memory
        # With KV cache groups one pair per slot tensor (the layers of a slot share it).
        self.host_kv_caches = allocate_host_kv_cache(
            self.layer_platforms if self.layer_slots is None else self.slot_platforms,
            num_host_blocks,
            self.block_size,
            a.num_kv_heads,
            kv_row_size(a.head_dim, self.kv_dtype, self.kv_row_scaled),
            self.kv_dtype,
            self.kv_connector,
        )
        self.num_host_blocks = num_host_blocks

    def _kv_views(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The KV caches as the hand-off moves them: an 8-bit float cache as its bytes
        (uint8 views: collectives and index_copy_ take them on every backend)."""
        if self.kv_dtype.itemsize == 1 and self.kv_dtype.is_floating_point:
            return [(k.view(torch.uint8), v.view(torch.uint8)) for k, v in self.kv_caches]
        return self.kv_caches

    def read_kv_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """Copy of the KV of ``block_ids``: [num_layers, 2 (key, value), len(block_ids),
        *the platform's per-block shape], on this runner's device; an 8-bit float cache's
        as its bytes (uint8)."""
        index = torch.tensor(list(block_ids), dtype=torch.int64, device=self.device)
        return torch.stack(
            [torch.stack([k.index_select(0, index), v.index_select(0, index)]) for k, v in self._kv_views()]
        ).contiguous()

    def write_kv_blocks(self, block_ids: Sequence[int], kv: torch.Tensor, rows: Sequence[int]) -> None:
        """Write ``kv[:, :, rows]`` (shaped as :meth:`read_kv_blocks` returns) into ``block_ids``;
        ValueError when ``kv`` comes from a cache of another dtype."""
        views = self._kv_views()
        if kv.dtype != views[0][0].dtype:
            raise ValueError(
                f"KV blocks of dtype {str(kv.dtype).removeprefix('torch.')} cannot be written into this "
                f"engine's {str(self.kv_dtype).removeprefix('torch.')} KV cache: both engines of a hand-off "
                "need the same dtype and kv_cache_dtype"
            )
        if tuple(kv.shape[3:]) != tuple(views[0][0].shape[1:]):
            raise ValueError(
                f"KV blocks shaped {tuple(kv.shape[3:])} cannot be written into this engine's KV cache blocks "
                f"{tuple(views[0][0].shape[1:])}: both engines of a hand-off need the same model, block size, "
                "kv_cache_dtype and kv_cache_scales (rows with or without their scales)"
            )
        dst = torch.tensor(list(block_ids), dtype=torch.int64, device=self.device)
        src = torch.tensor(list(rows), dtype=torch.int64, device=kv.device)
        for layer, (k, v) in enumerate(views):
            k.index_copy_(0, dst, kv[layer, 0].index_select(0, src).to(k.device))
            v.index_copy_(0, dst, kv[layer, 1].index_select(0, src).to(v.device))

    def empty_kv_blocks(self, num_blocks: int) -> torch.Tensor:
        """An uninitialised buffer shaped as :meth:`read_kv_blocks` returns for ``num_blocks``."""
        k = self._kv_views()[0][0]
        return torch.empty(len(self.kv_caches), 2, num_blocks, *k.shape[1:], dtype=k.dtype, device=self.device)

    # -- sleep mode ---------------------------------------------------------------------------
    @property
    def is_sleeping(self) -> bool:
        return self.model is None

    def sleep(self, level: int, weights: Iterable[tuple[str, Any]] | None = None) -> None:
        """Drop this rank's weights and KV cache (sleep mode) and hand the memory back
        (``Platform.release_memory``).  Level 1 first keeps a host-memory copy of
        ``weights`` (the checkpoint's (name, tensor) pairs, those of this rank's layers),
        which :meth:`wake_up` loads; level 2 keeps nothing.  The host KV tier's blocks are
        host memory and stay, with their contents."""
        if self.model is None:
            raise RuntimeError("the model runner is already asleep")
        if level == 1:
            if weights is None:
                raise ValueError("sleep level 1 needs the weights to keep a host copy of")
            first, last = self.segments[0].start, self.segments[-1].end
            pin = self.platform.pin_memory_available
            self._host_weights = [(n, _host_copy(t, pin)) for n, t in weights if _layer_in(n, first, last)]
        self.model = None
        self.kv_caches = []
        gc.collect()
        experts = [self.experts.platform] if self.experts is not None else []
        for platform in {id(p): p for p in [*self.layer_platforms, *experts]}.values():
            platform.release_memory()

    def wake_up(self, reload: Callable[[], Iterable[tuple[str, Any]]]) -> None:
        """Rebuild the model from the level-1 host copy, else from ``reload()`` (the
        checkpoint's weights, read again), and allocate an empty KV cache of the same
        number of blocks."""
        if self.model is not None:
            raise RuntimeError("the model runner is not asleep")
        weights = self._host_weights if self._host_weights is not None else reload()
        self.model = self._build_model()
        self.model.set_kv_scales(self.kv_layer_scales)
        with torch.inference_mode():
            # A vision side stays resident while asleep: only the language model reloads.
            self.model.load_weights(self._split_vision(weights, []))
            self.model.prepare_linear_weights()
        self._host_weights = None
        self.allocate_kv_cache(self.num_blocks, self.block_size)

    def run_kv_transfers(self, transfers) -> None:
        """Run the KV connector's work of a step: a device-layout connector's (the host
        tier's) recorded copies (KVTransfers) between the device cache and this rank's
        store, or a content store's saves and loads (ConnectorTransfers)."""
        if isinstance(transfers, ConnectorTransfers):
            apply_connector_transfers(self._kv_views(), self.kv_connector, transfers)
        elif self.layer_slots is None:
            apply_kv_transfers(
                [o.swap_blocks for o in self.layer_ops],
                self.kv_caches,
                self.host_kv_caches,
                transfers,
                self.kv_connector,
            )
        else:
            # KV cache groups: one copy per slot tensor, through the first layer that uses it.
            first = {}
            for layer, slot in enumerate(self.layer_slots):
                first.setdefault(slot, layer)
            layers = [first[s] for s in range(len(self.slot_platforms))]
            apply_kv_transfers(
                [self.layer_ops[i].swap_blocks for i in layers],
                [self.kv_caches[i] for i in layers],
                self.host_kv_caches,
                transfers,
                self.kv_connector,
            )

    def use_kv_connector(self, connector) -> None:
        """Save and load blocks through ``connector`` (a KVConnector; see run_kv_transfers):
        a device-layout one before :meth:`allocate_host_kv_cache` allocates its store."""
        self.kv_connector = connector

    def kv_block_views(self) -> list[tuple[torch.Tensor, ...]]:
        """Per layer, the KV cache's tensors as a block's bytes move (an 8-bit float
        cache as uint8), each indexed by block id first."""
        return self._kv_views()

    # -- weights ---------------------------------------------------------------------------
    def weight_bytes(self) -> int:
        """Bytes of this rank's model weights (with a vision side's)."""
        return self.model.weight_bytes() + (self.vision.weight_bytes() if self.vision is not None else 0)

    def stream_layers(self, stream: Callable[[Sequence[Any]], Iterator[Any]] | None) -> None:
        """Run the layers through ``stream`` (weight offload's WeightStreamer: the layer
        list in, the layers to run out); None runs the model's own layers."""
        self.model.set_layer_stream(stream)

    def use_lora(self, manager) -> None:
        """Give each forward's rows their adapter slots through ``manager`` (a LoRAManager
        that has wrapped this runner's model)."""
        self.lora_manager = manager

    # -- step --------------------------------------------------------------------------
    def _forward(self, out: SchedulerOutput, block_ids: dict[str, list[int]]) -> tuple[ModelInput, torch.Tensor]:
        """The step's inputs and forward: its final hidden states ``[num_tokens, hidden]``
        (after the final norm) on the last segment's device.  Call in inference mode."""
        if out.kv_transfers:
            # Spills, reloads and swaps decided by the scheduler: all before the forward.
            self.run_kv_transfers(out.kv_transfers)
        inp = prepare_inputs(out, block_ids, self.block_size, self.device, self.layer_groups, self.state_groups)
        if self.vision is not None and getattr(self.vision, "uses_mrope", False):
            pos = self._mrope_positions(out)
            groups = [replace(g, positions=pos) for g in inp.meta.groups]  # KV cache groups' metadata too
            inp = replace(inp, meta=replace(inp.meta, positions=pos, groups=groups))
        if self.vision is not None and getattr(self.vision, "bidirectional_images", False):
            ends = self._image_key_ends(out)
            if ends is not None:
                groups = [replace(g, key_ends=ends) for g in inp.meta.groups]
                inp = replace(inp, meta=replace(inp.meta, key_ends=ends, groups=groups))
        if self.lora_manager is not None:  # each row's adapter slot, for this forward only
            self.lora_manager.begin_step(
                [(s.request.lora_request, s.num_new_tokens) for s in out.scheduled], self.device
            )
        try:
            embeds = self._image_embeds(out) if self.vision is not None else None
            if embeds is None:
                return inp, self.model.forward(inp.input_ids, inp.meta, self.kv_caches)
            return inp, self.model.forward(inp.input_ids, inp.meta, self.kv_caches, embeds)
        finally:
            if self.lora_manager is not None:
                self.lora_manager.end_step()

    def _image_embeds(self, out: SchedulerOutput) -> tuple | None:
        """(batch rows, embeddings) of the image tokens this step computes: each image's
        encoder output comes from the encoder cache (encoded the first time), and a
        request that prefilled an image's last token releases it.  A vision side with
        ``deepstack_layers`` k > 0 (Qwen3-VL) encodes [tokens, (1 + k) * hidden]: the
        embeddings, then the features added after each of the first k decoder layers
        (cached together, so chunks and other requests read them all); they come third."""
        rows, values = [], []
        base = 0
        cache = self.encoder_cache
        for s in out.scheduled:
            r = s.request
            start, end = r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens
            for item in r.mm_items:
                lo, hi = max(start, item.offset), min(end, item.end)
                if lo >= hi:
                    continue
                emb = cache.get(item, r.request_id, self.vision.embed_image)
                if emb.shape[0] != item.length:
                    raise ValueError(
                        f"the vision model gives {emb.shape[0]} embeddings for an image with {item.length} tokens"
                    )
                rows.append(torch.arange(base + lo - start, base + hi - start, dtype=torch.int64))
                values.append(emb[lo - item.offset : hi - item.offset])
                if hi == item.end:
                    cache.release(item.hash, r.request_id)
            base += s.num_new_tokens
        if not rows:
            return None
        index, values = torch.cat(rows).to(self.device), torch.cat(values)
        layers = getattr(self.vision, "deepstack_layers", 0)
        if not layers:
            return index, values
        parts = values.view(values.shape[0], layers + 1, -1).unbind(1)
        return index, parts[0], list(parts[1:])

    def _image_key_ends(self, out: SchedulerOutput) -> torch.Tensor | None:
        """``key_ends`` int32 [num_tokens] of a step with image tokens that attend to each
        other both ways (Gemma 3): each one sees keys up to its image's end (the
        scheduler computes an image's tokens in one step), every other token up to its
        own position; None when the step computes no image token (causal)."""
        parts, images = [], False
        for s in out.scheduled:
            r = s.request
            start, end = r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens
            ends = np.arange(start + 1, end + 1, dtype=np.int32)
            for item in r.mm_items:
                lo, hi = max(start, item.offset), min(end, item.end)
                if lo >= hi:
                    continue
                if item.end > end:
                    raise RuntimeError(
                        f"request {r.request_id!r}: a step computes tokens {start}-{end} of an image at "
                        f"{item.offset}-{item.end}, whose tokens must be computed together"
                    )
                ends[lo - start : hi - start] = item.end
                images = True
            parts.append(ends)
        if not images:
            return None
        return torch.from_numpy(np.concatenate(parts)).to(self.device)

    def _mrope_positions(self, out: SchedulerOutput) -> torch.Tensor:
        """M-RoPE positions int64 [3, num_tokens] of the step's tokens: a prompt token's
        from its request's table (image tokens on their grid), a later token's its index
        plus the request's delta.  Indexed by token, so chunks, prefix-cache hits and
        recomputation after preemption read the same positions."""
        parts = []
        for s in out.scheduled:
            r = s.request
            known = self._mrope.get(r.request_id)
            if known is None:
                known = self.vision.mrope_positions(len(r.prompt_token_ids), r.mm_items)
                self._mrope[r.request_id] = known
            table, delta = known
            idx = np.arange(r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens)
            pos = np.repeat((idx + delta)[None], 3, axis=0)
            inside = idx < table.shape[1]
            pos[:, inside] = table[:, idx[inside]]
            parts.append(pos)
        return torch.from_numpy(np.concatenate(parts, axis=1)).to(self.device)

    def forget(self, request_id: str) -> None:
        """A finished or aborted request: drop its holds on encoder outputs (and its
        M-RoPE positions)."""
        self.encoder_cache.forget(request_id)
        self._mrope.pop(request_id, None)

    def forward_logits(
        self, out: SchedulerOutput, block_ids: dict[str, list[int]], num_logits: list[int]
    ) -> torch.Tensor:
        """Run the step's forward; logits of the last ``num_logits[i]`` tokens of each
        scheduled request, in batch order: ``[sum(num_logits), vocab]`` in the model's
        dtype on the device (speculative decoding verifies drafts with them)."""
        with torch.inference_mode():
            _, hidden = self._forward(out, block_ids)
            ends = np.cumsum([s.num_new_tokens for s in out.scheduled])
            rows = [np.arange(e - k, e) for e, k in zip(ends.tolist(), num_logits) if k]
            idx = torch.from_numpy(np.concatenate(rows)) if rows else torch.empty(0, dtype=torch.int64)
            return self.model.compute_logits(hidden.index_select(0, self._to_head(idx)), float32=False)

    def execute(self, out: SchedulerOutput, block_ids: dict[str, list[int]]) -> StepOutput:
        """Run one step: forward, then the tail every executor shares (sample_step.py)."""
        with torch.inference_mode():
            inp, hidden = self._forward(out, block_ids)
            plan = plan_step(out.scheduled, inp.logits_indices, self.arch.vocab_size)
            head = run_head(self.model, hidden, plan.rows, self._to_head)
            return finish_step(self.sampler, self.model.head_ops, plan, head)

    def take_row_errors(self) -> dict[str, str]:
        """Requests whose own sampling failed since the last call (Sampler.take_row_errors)."""
        return self.sampler.take_row_errors()

    def _to_head(self, t: torch.Tensor) -> torch.Tensor:
        # The final hidden states are on the last segment's device.
        return self.segments[-1].platform.to_device(t)
