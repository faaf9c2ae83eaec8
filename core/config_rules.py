"""Rules across configuration sections, checked before any model or worker work.

Each section of :class:`~pagedserve.config.EngineConfig` checks its own fields in its
``__post_init__``; the rules here combine sections ("X is not supported with
tensor/pipeline parallelism").  ``EngineConfig`` runs them on construction and
``LLMEngine`` once more before it opens the model, so that a bad combination fails in
milliseconds with one message naming both settings, never after weights are loaded or
workers spawned.  Rules that need the model's shape (heads, layers) are in
:func:`check_parallel_fits_model`, run as soon as the checkpoint's config is read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedserve.config import EngineConfig

__all__ = [
    "check_engine_config",
    "check_parallel_fits_model",
    "check_multimodal",
    "check_sliding_window_cache",
    "check_kv_cache_groups",
    "check_recurrent_state",
    "resolve_block_size",
    "RECURRENT_STATE_BLOCK_SIZE",
    "RECURRENT_STATE",
    "NO_KV_CACHE",
    "check_prompt_fits_step",
    "check_logprobs_limit",
    "check_data_parallel",
    "check_disaggregated",
    "disaggregated_request_refusal",
    "RULES",
]

# quantization values that load float weights (or decide from the checkpoint): only an
# explicit method is known to conflict before the checkpoint is opened.
_NOT_A_METHOD = (None, "auto", "none")
# quantization methods that tensor/pipeline parallelism shards in their quantized form
# (pagedserve.quantization.registry.SHARDED_METHODS; a test keeps the two equal); w8a8
# only with pipeline parallelism (below).
_SHARDED_METHODS = ("gguf", "int8", "w8a8", "fp8", "gptq", "awq")


def _parallel(cfg: EngineConfig) -> str:
    par = cfg.parallel
    return f"tensor_parallel_size={par.tensor_parallel_size}, pipeline_parallel_size={par.pipeline_parallel_size}"


def _device_map_rule(cfg: EngineConfig) -> str | None:
    dm, par = cfg.device.device_map, cfg.parallel
    if dm is None:
        return None
    if par.world_size > 1:
        return (
            f"device_map={dm!r} cannot be combined with tensor/pipeline parallelism ({_parallel(cfg)}): "
            "a device map splits one rank's layers; use one of the two"
        )
    if par.distributed_executor_backend not in (None, "uni"):
        return (
            f"device_map={dm!r} runs in the engine's process; distributed_executor_backend="
            f"{par.distributed_executor_backend!r} is not supported with it"
        )
    if cfg.cache.cpu_offload_gb:
        return (
            f"device_map={dm!r} cannot be combined with cpu_offload_gb={cfg.cache.cpu_offload_gb}: place "
            "layers on the host platform with the map instead (e.g. 'cuda:20,cpu'), where they run rather "
            "than being streamed"
        )
    q = cfg.model.quantization
    # DeviceConfig normalises the map to "platform[:count|:first-last],..." or "class=platform,...".
    platforms = {segment.split("=")[-1].split(":")[0].strip() for segment in str(dm).split(",")}
    if q not in _NOT_A_METHOD and len(platforms) > 1:
        return (
            f"quantization={q!r} cannot be combined with device_map={dm!r}, which places layers on "
            f"{len(platforms)} platforms ({', '.join(sorted(platforms))}): quantized weights run on one "
            "platform; use quantization='none' or a map onto one platform"
        )
    return None


def _uni_backend_rule(cfg: EngineConfig) -> str | None:
    par = cfg.parallel
    if par.distributed_executor_backend == "uni" and par.world_size > 1:
        return (
            f"distributed_executor_backend='uni' runs one rank, but tensor_parallel_size * "
            f"pipeline_parallel_size = {par.world_size}; use 'mp' or 'ray'"
        )
    return None


def _single_rank_features(cfg: EngineConfig) -> str | None:
    """Features wired up for one rank only."""
    if cfg.parallel.world_size == 1:
        return None
    used = [
        (cfg.device.cpu_bind is not None, f"cpu_bind={cfg.device.cpu_bind!r}", "every rank would pin the same cores"),
        (
            bool(cfg.cache.cpu_offload_gb),
            f"cpu_offload_gb={cfg.cache.cpu_offload_gb}",
            "weight streaming runs on one rank",
        ),
        (
            cfg.model.quantization not in _NOT_A_METHOD + _SHARDED_METHODS,
            f"quantization={cfg.model.quantization!r}",
            "its quantized weights are not sharded; use quantization='none' or one rank, or one of "
            "gguf, int8, fp8 (w8a8 with pipeline parallelism only)",
        ),
    ]
    if cfg.model.quantization == "w8a8" and cfg.parallel.tensor_parallel_size > 1:
        used.append(
            (
                True,
                "quantization='w8a8'",
                "each rank would quantize its half of a row-parallel projection's activations with "
                "its own per-token scale, which changes the outputs of one process by up to ~3e-2 in "
                "logprobs; use quantization='int8' (weight-only), pipeline parallelism, or one rank",
            )
        )
    for on, setting, why in used:
        if on:
            return f"{setting} is not supported with tensor/pipeline parallelism yet ({_parallel(cfg)}): {why}"
    return None


def _multinode_rule(cfg: EngineConfig) -> str | None:
    par = cfg.parallel
    if par.nnodes == 1:
        if par.headless or par.node_rank:
            return "headless / node_rank > 0 need nnodes > 1 (a single node runs the API server itself)"
        return None
    if par.world_size % par.nnodes:
        return (
            f"nnodes={par.nnodes} must divide tensor_parallel_size * pipeline_parallel_size = "
            f"{par.world_size} ({_parallel(cfg)}): every node runs the same number of ranks"
        )
    if par.distributed_executor_backend not in (None, "mp"):
        return (
            f"nnodes={par.nnodes} starts one process per node itself; distributed_executor_backend="
            f"{par.distributed_executor_backend!r} cannot be combined with it (Ray places ranks on its own)"
        )
    if par.master_port is None:
        return (
            f"nnodes={par.nnodes} needs master_port (or distributed_init_method tcp://HOST:PORT): every node "
            "must find the head node's rendezvous at the same address"
        )
    return None


#: Every cross-section rule: a function returning the error message, or None.
RULES: list[Callable[[EngineConfig], str | None]] = [
    _device_map_rule,
    _uni_backend_rule,
    _single_rank_features,
    _multinode_rule,
]


def check_engine_config(cfg: EngineConfig) -> None:
    """ValueError with the first rule ``cfg`` breaks."""
    for rule in RULES:
        message = rule(cfg)
        if message is not None:
            raise ValueError(message)


def check_multimodal(cfg: EngineConfig, multimodal: dict | None) -> None:
    """ValueError when images of a vision-language checkpoint (``multimodal``: its config
    beyond the language model, None for a text model) are on with a setting they do not
    work with yet.  Checked when the checkpoint's config is read, before weights load."""
    limits = cfg.model.limit_mm_per_prompt or {}
    # The vision side is off with image=0 unless videos are asked for (config.vision_inputs_on).
    if not multimodal or (limits.get("image", 1) == 0 and not limits.get("video", 0)):
        return
    arch = multimodal.get("architecture", "this vision-language model")
    off = "or serve the language model alone with limit_mm_per_prompt={'image': 0} (--limit-mm-per-prompt image=0)"
    conflicts = [
        (cfg.parallel.world_size > 1, _parallel(cfg), "the vision encoder runs on one rank only"),
        (
            cfg.speculative.speculative_config is not None,
            "speculative_config",
            "drafts do not see image embeddings",
        ),
        (
            cfg.device.device_map is not None,
            f"device_map={cfg.device.device_map!r}",
            "the vision encoder is not placed",
        ),
        (
            cfg.model.quantization not in _NOT_A_METHOD,
            f"quantization={cfg.model.quantization!r}",
            "the vision tower's weights would be quantized like the decoder's",
        ),
        (
            bool(cfg.cache.cpu_offload_gb),
            f"cpu_offload_gb={cfg.cache.cpu_offload_gb}",
            "weights are streamed per layer",
        ),
    ]
    for on, setting, why in conflicts:
        if on:
            raise ValueError(f"images of {arch} cannot be combined with {setting} yet ({why}); drop {setting} {off}")


def check_parallel_fits_model(cfg: EngineConfig, arch: Any) -> None:
    """ValueError when the ranks cannot split this model (``arch``: its ArchConfig).

    Checked when the checkpoint's config is read, before weights load or workers start.
    """
    tp, pp = cfg.parallel.tensor_parallel_size, cfg.parallel.pipeline_parallel_size
    if tp > 1 and not getattr(arch, "tensor_parallel", True):
        raise ValueError(f"{arch.architecture} does not support tensor parallelism (tensor_parallel_size={tp})")
    if arch.num_heads % tp or arch.intermediate_size % tp or (arch.num_kv_heads % tp and tp % arch.num_kv_heads):
        raise ValueError(
            f"tensor_parallel_size={tp} must divide the attention heads ({arch.num_heads}) and "
            f"intermediate_size ({arch.intermediate_size}), and divide or be a multiple of the "
            f"KV heads ({arch.num_kv_heads})"
        )
    refusal = getattr(arch, "tensor_parallel_refusal", None)
    why = refusal(tp) if tp > 1 and refusal is not None else None
    if why:  # the family's own counts (a recurrent layer's heads, groups or channels)
        raise ValueError(f"tensor_parallel_size={tp} cannot split {arch.architecture}: {why}")
    for key in ("moe_intermediate_size", "shared_expert_intermediate_size"):  # experts split the same way
        size = arch.hf_config.get(key)
        if size and size % tp:
            raise ValueError(f"tensor_parallel_size={tp} must divide the experts' {key} ({size})")
    quant = arch.hf_config.get("quantization_config") or {}
    if tp > 1 and str(quant.get("quant_method", "")).lower() == "mxfp4" and (arch.intermediate_size // 32) % tp:
        raise ValueError(
            f"tensor_parallel_size={tp} cannot split this checkpoint's MXFP4 experts (quant_method='mxfp4'): "
            f"each rank keeps whole blocks of 32 values and intermediate_size ({arch.intermediate_size}) is "
            f"{arch.intermediate_size // 32} blocks; use a tensor_parallel_size that divides "
            f"{arch.intermediate_size // 32}"
        )
    if pp > arch.num_layers:
        raise ValueError(f"pipeline_parallel_size={pp} exceeds the model's {arch.num_layers} layers")
    why = getattr(arch, "pipeline_refusal", None) if pp > 1 else None
    if why:
        raise ValueError(f"pipeline_parallel_size={pp} cannot split {arch.architecture}: {why}")


def _device_tier(cfg: EngineConfig, device_layout_connector: bool) -> str | None:
    """The setting that gives the engine a device-layout KV tier (the host tier of
    ``kv_offload_memory``, or a plugin's device-layout ``kv_connector``: interface 1.7),
    as the refusals name it; None without one."""
    if cfg.cache.kv_offload_memory is not None:
        return "kv_offload_memory (a host KV tier)"
    if device_layout_connector and cfg.cache.kv_connector is not None:
        return f"kv_connector={cfg.cache.kv_connector!r} (a device-layout KV tier)"
    return None


def check_sliding_window_cache(
    cfg: EngineConfig, window: int | None, device_layout_connector: bool = False
) -> int | None:
    """The window by which the KV manager frees slid-out blocks (``window``: the one
    every layer of the model shares, or None), None when freeing is off; ValueError for
    a setting that cannot work with freed blocks (``device_layout_connector``: whether
    the settings' ``kv_connector`` is a plugin's device-layout tier, which is held to
    the host tier's rules).

    Checked when the checkpoint's config is read, before weights load.
    """
    if window is None or not cfg.cache.free_sliding_window_blocks:
        return None
    tier = _device_tier(cfg, device_layout_connector)
    if tier is not None:
        unset = "kv_offload_memory" if cfg.cache.kv_offload_memory is not None else "kv_connector"
        raise ValueError(
            f"{tier} cannot be combined with freeing the KV blocks that slid out "
            f"of this model's {window}-token attention window (host swap-in and reload assume every block of "
            "a request is held); set free_sliding_window_blocks=False (--no-free-sliding-window-blocks) "
            f"or leave {unset} unset"
        )
    return window


#: The "window" of a layer that keeps a fixed-size recurrent state (Gated DeltaNet, Mamba 2,
#: short convolutions) instead of a growing key/value list: its KV cache group holds a
#: fixed number of pages per request (pagedserve.kv_cache.state_group).
RECURRENT_STATE = "recurrent"
#: The "window" of a layer that keeps nothing per request (an MLP-only layer of a
#: one-mixer-per-layer model such as Nemotron-H): it belongs to no KV cache group.
NO_KV_CACHE = "no_kv"


#: The KV block size of a model with recurrent-state layers when the user sets none:
#: its prefix-cache checkpoints fall every ``state_checkpoint_interval`` blocks, and
#: each state layer group's pages are blocks, so a platform's larger default would
#: coarsen both.
RECURRENT_STATE_BLOCK_SIZE = 16


def resolve_block_size(
    cfg: EngineConfig, platform_defaults: Sequence[int], windows: Sequence[int | str | None] = ()
) -> tuple[EngineConfig, str]:
    """``cfg`` with ``cache.block_size`` set, and how it was chosen (for the log).

    The user's block size always wins.  Otherwise the platform's
    ``default_block_size``; ``platform_defaults`` holds one per platform the model's
    layers run on (several under a device map: the smallest, so that no platform gets
    blocks larger than it asked for); and at most :data:`RECURRENT_STATE_BLOCK_SIZE`
    for a model with recurrent-state layers (``windows``: each layer's, as
    ``layer_windows`` gives them).  Resolved before anything sizes the KV cache; every
    rank and every instance built from the returned config uses the same value.  ``cfg``
    itself is left as it is (a config may be used again on another platform).
    """
    import dataclasses

    if cfg.cache.block_size is not None:
        return cfg, f"block_size={cfg.cache.block_size} (set)"
    if not platform_defaults:
        raise ValueError("resolve_block_size needs the default block size of at least one platform")
    size = min(platform_defaults)
    how = (
        f"the platform's default {size}"
        if len(set(platform_defaults)) == 1
        else f"the smallest platform default {size}"
    )
    if RECURRENT_STATE in windows and size > RECURRENT_STATE_BLOCK_SIZE:
        how = (
            f"{RECURRENT_STATE_BLOCK_SIZE} for a model with recurrent-state layers (prefix-cache checkpoints every "
            f"state_checkpoint_interval blocks; the platform's default is {size})"
        )
        size = RECURRENT_STATE_BLOCK_SIZE
    if size < 1 or size & (size - 1):
        raise ValueError(f"a platform's default_block_size must be a power of two >= 1, got {size}")
    cache = dataclasses.replace(cfg.cache, block_size=size)
    return dataclasses.replace(cfg, cache=cache), f"block_size={size}: {how}"


def check_kv_cache_groups(
    cfg: EngineConfig, windows: list[int | str | None], device_layout_connector: bool = False
) -> None:
    """ValueError for a setting that KV cache groups (layers with different windows whose
    slid-out blocks are freed: Gemma 2/3, Qwen2 ``max_window_layers``; layers with a
    recurrent state) cannot serve.

    Checked when the checkpoint's config is read, before weights load.
    """
    if RECURRENT_STATE in windows:
        check_recurrent_state(cfg)
        return
    if not cfg.cache.free_sliding_window_blocks or len(set(windows)) < 2:
        return
    spec = cfg.speculative.speculative_config
    tier = _device_tier(cfg, device_layout_connector)
    used = [
        (
            tier is not None and cfg.cache.preemption_mode == "recompute",
            f"{tier} with preemption_mode='recompute' (the device-layout tier of "
            "KV cache groups serves swap preemption only)",
        ),
        (spec is not None and spec.method != "ngram", f"speculative_config method={getattr(spec, 'method', None)!r}"),
    ]
    for on, setting in used:
        if on:
            raise ValueError(
                f"{setting} cannot be combined with freeing the KV blocks that slid out of the windowed layers of "
                "a model whose layers have different attention windows (one block table per layer group); set "
                "free_sliding_window_blocks=False (--no-free-sliding-window-blocks) to keep every block"
            )


def check_recurrent_state(cfg: EngineConfig) -> None:
    """ValueError for a setting that a model with recurrent-state layers (Qwen3.5 and
    Qwen3-Next's Gated DeltaNet, Mamba 2 hybrids) cannot serve: its state holds every
    token computed so far and cannot be rewound.  Tensor parallelism splits each layer's
    heads or channels and its state with them (each family's counts are checked by
    :func:`check_parallel_fits_model`); pipeline stages hold whole layers.  Its own
    speculative verification steps keep the state after each draft position and keep the
    accepted one (kv_cache/state_group.py); a draft model's state could not be kept so.

    Checked when the checkpoint's config is read, before weights load.
    """
    spec = cfg.speculative.speculative_config
    used = [
        (
            cfg.cache.kv_offload_memory is not None and cfg.cache.preemption_mode == "recompute",
            f"kv_offload_memory={cfg.cache.kv_offload_memory} with preemption_mode='recompute'",
            "the host KV tier of KV cache groups serves swap preemption only (no prefix spill); set "
            "preemption_mode='auto' or 'swap', or leave kv_offload_memory unset",
        ),
        (
            spec is not None and spec.method == "self_quantized",
            "speculative_config method='self_quantized'",
            "its draft (the model itself, quantized) would keep a recurrent state of its own, which drafting "
            "cannot rewind past rejected tokens; use method 'ngram', or 'draft_model' with a draft without "
            "recurrent layers",
        ),
    ]
    for on, setting, why in used:
        if on:
            raise ValueError(f"{setting} cannot be combined with a model that has recurrent-state layers: {why}")


def check_prompt_fits_step(scheduler: Any, num_prompt_tokens: int) -> None:
    """ValueError at admission for a prompt the scheduler could never run: with chunked
    prefill off a prompt is scheduled whole, so it must fit one step's token budget."""
    if not scheduler.enable_chunked_prefill and num_prompt_tokens > scheduler.max_num_batched_tokens:
        raise ValueError(
            f"prompt has {num_prompt_tokens} tokens, more than max_num_batched_tokens="
            f"{scheduler.max_num_batched_tokens}; with chunked prefill disabled a prompt must fit one "
            "step (raise max_num_batched_tokens or enable chunked prefill)"
        )


def check_logprobs_limit(model: Any, params: Any) -> None:
    """ValueError when a request asks for more log-probabilities than ``max_logprobs``."""
    asked = getattr(params, "logprobs", None)
    if asked is not None and asked > model.max_logprobs:
        raise ValueError(f"logprobs={asked} is more than this engine's max_logprobs={model.max_logprobs}")


def _speculative_rule(cfg: EngineConfig) -> str | None:
    """Speculative decoding drafts and verifies in the engine's process (rank 0): the
    target's forward runs on every rank (or streams offloaded layers, or crosses a device
    map) and returns the verification rows' logits; only verified tokens are hashed, so
    the host KV tier never holds a draft.  self_quantized needs the target's float weights."""
    spec = cfg.speculative.speculative_config
    if spec is None:
        return None
    name = f"speculative_config method={spec.method!r}"
    par = cfg.parallel
    if spec.draft_tp > 1:
        dtp = f"draft_tensor_parallel_size={spec.draft_tp}"
        if spec.draft_tp != par.tensor_parallel_size:
            return (
                f"{name} {dtp} must be 1 (the draft whole in the engine's process) or the target's "
                f"tensor_parallel_size={par.tensor_parallel_size} (sharded over the same ranks)"
            )
        if par.pipeline_parallel_size > 1:
            return (
                f"{name} {dtp} cannot be combined with pipeline_parallel_size={par.pipeline_parallel_size}: "
                "every draft token would cross the pipeline stages; use draft_tensor_parallel_size=1"
            )
        if spec.quantization not in _NOT_A_METHOD:
            return (
                f"{name} {dtp}: the draft's quantization={spec.quantization!r} is not sharded yet; use "
                "draft_tensor_parallel_size=1 (the quantized draft whole on rank 0) or a float draft"
            )
    q = cfg.model.quantization
    if spec.method == "self_quantized" and q not in _NOT_A_METHOD:
        return (
            f"{name} drafts with the {spec.quantization!r} copy of the target for its float weights; "
            f"quantization={q!r} would quantize the target too (leave it unset or 'none')"
        )
    return None


RULES.append(_speculative_rule)


def _async_scheduling_rule(cfg: EngineConfig) -> str | None:
    """Async scheduling overlaps output processing with the next forward of one rank's
    runner; its output stage (engine/async_pipeline.py) files one token per request and
    step, not a verification step's accepted drafts."""
    if not cfg.scheduler.async_scheduling:
        return None
    if cfg.speculative.speculative_config is not None:
        return (
            "async_scheduling cannot be combined with speculative_config yet: its output stage takes one token "
            "per request and step, a verification step gives the accepted drafts too; leave async_scheduling "
            "off to speculate"
        )
    if cfg.parallel.world_size > 1 or cfg.parallel.distributed_executor_backend not in (None, "uni"):
        return (
            "async_scheduling is not supported with tensor/pipeline parallelism or worker processes "
            f"yet ({_parallel(cfg)}, distributed_executor_backend={cfg.parallel.distributed_executor_backend!r})"
        )
    return None


RULES.append(_async_scheduling_rule)


def _sleep_mode_rule(cfg: EngineConfig) -> str | None:
    """Sleep drops the model's weights and rebuilds the model on waking (engine sleep in
    core/engine/llm_engine.py): what holds the model's tensors beside it cannot follow."""
    if not cfg.model.enable_sleep_mode:
        return None
    spec = cfg.speculative.speculative_config
    used = [
        (cfg.lora.enable_lora, "enable_lora", "adapters wrap the model's layers; serve adapters without sleep mode"),
        (
            bool(cfg.cache.cpu_offload_gb),
            f"cpu_offload_gb={cfg.cache.cpu_offload_gb}",
            "weight offload streams the layers from its own host copies; use cpu_offload_gb=0",
        ),
        (
            spec is not None,
            f"speculative_config method={getattr(spec, 'method', None)!r}",
            "a draft model keeps its own weights and KV cache; speculate without sleep mode",
        ),
    ]
    for on, setting, why in used:
        if on:
            return f"enable_sleep_mode cannot be combined with {setting} yet: {why}"
    return None


RULES.append(_sleep_mode_rule)


#: The builtin KV connectors (pagedserve.offload.connectors): stores by content.  Whether
#: a plugin's connector is a device-layout tier (platform interface 1.7) is known from its
#: registration only, which this module cannot import (no torch here):
#: pagedserve.offload.connectors.check_kv_connector applies the same rules to it before
#: weights load.
BUILTIN_KV_CONNECTORS = ("host", "disk")


def kv_connector_refusal(cfg: EngineConfig, device_layout: bool) -> str | None:
    """Why the settings cannot use their ``kv_connector`` (None: they can), given whether
    it is a device-layout tier, which keeps one store per rank and carries swap
    preemption without prefix caching; a store by content does neither."""
    c = cfg.cache.kv_connector
    if c is None:
        return None
    if cfg.parallel.world_size > 1 and not device_layout:
        return (
            f"kv_connector={c!r} is not supported with tensor/pipeline parallelism yet ({_parallel(cfg)}): "
            "each rank's KV shard would need its own saves and loads; use one rank"
        )
    if cfg.cache.kv_offload_memory is not None:
        return (
            f"kv_connector={c!r} cannot be combined with kv_offload_memory={cfg.cache.kv_offload_memory} yet: "
            "use kv_connector='host' for a host-memory prefix store, or the host tier alone"
        )
    if not cfg.cache.enable_prefix_caching and not device_layout:
        return f"kv_connector={c!r} saves and finds blocks through the prefix cache: it needs enable_prefix_caching"
    if cfg.cache.preemption_mode == "swap" and not device_layout:
        return f"preemption_mode='swap' needs a host KV tier: kv_connector={c!r} is a store by content"
    return None


def _kv_connector_rule(cfg: EngineConfig) -> str | None:
    c = cfg.cache.kv_connector
    if c is not None and c.partition(":")[0] not in BUILTIN_KV_CONNECTORS:
        # A plugin's connector: its kind is checked before weights load (see above).
        return kv_connector_refusal(cfg, device_layout=True)
    return kv_connector_refusal(cfg, device_layout=False)


RULES.append(_kv_connector_rule)


def check_data_parallel(cfg: EngineConfig, size: int) -> None:
    """ValueError for a setting that ``size`` data-parallel replicas behind one router
    cannot serve (``cfg``: each replica's configuration).  Checked before replicas start."""
    if size > 1 and cfg.parallel.nnodes > 1:
        raise ValueError(
            f"nnodes={cfg.parallel.nnodes} cannot be combined with data_parallel_size={size} yet (a replica's "
            "ranks span nodes, the router starts replicas on this node only); use one or the other"
        )
    if size > 1 and cfg.model.enable_sleep_mode:
        raise ValueError(
            f"enable_sleep_mode cannot be combined with data_parallel_size={size} yet (the router does not "
            "put its replicas to sleep); use data_parallel_size=1"
        )


#: Requests the data-parallel router refuses (by what they ask for), each with its message.
DATA_PARALLEL_REQUEST_REFUSALS: dict[str, str] = {
    "images": (
        "requests with images are not supported with data parallelism (data_parallel_size > 1) yet: the router's "
        "prefix hashes do not cover images; serve images with data_parallel_size=1"
    ),
}


def data_parallel_request_refusal(what: str) -> str:
    """The message the data-parallel router refuses a request asking for ``what`` with
    (a key of :data:`DATA_PARALLEL_REQUEST_REFUSALS`)."""
    return DATA_PARALLEL_REQUEST_REFUSALS[what]


def check_disaggregated(cfg: EngineConfig, windows: list[int | None] | None = None) -> None:
    """ValueError for a setting that disaggregated prefill/decode cannot serve (``windows``:
    the model's per-layer attention windows when known).  Checked before either instance
    loads weights: the decode instance receives whole prompt blocks through its prefix cache."""
    if not cfg.cache.enable_prefix_caching:
        raise ValueError(
            "disaggregated decode needs enable_prefix_caching=True: the prompt's KV blocks are handed over "
            "through the decode instance's prefix cache, so enable_prefix_caching=False cannot be combined "
            "with it (leave it on)"
        )
    if cfg.parallel.world_size > 1:
        raise ValueError(
            f"disaggregated prefill/decode instances are single-rank: tensor/pipeline parallelism "
            f"({_parallel(cfg)}) cannot be combined with them yet; use one rank per instance"
        )
    if cfg.model.enable_sleep_mode:
        raise ValueError(
            "enable_sleep_mode cannot be combined with disaggregated prefill/decode yet: the prefill instance "
            "runs in a process of its own that has no sleep command, and DisaggregatedLLM no sleep/wake_up; "
            "sleep a single instance (LLM) instead"
        )
    if cfg.cache.kv_connector is not None:
        raise ValueError(
            f"kv_connector={cfg.cache.kv_connector!r} cannot be combined with disaggregated prefill/decode yet: "
            "the decode instance adopts the prompt blocks handed over without saving them to the connector's "
            "store, so its store never holds a prompt's prefix; use kv_connector on a single instance (LLM)"
        )
    if windows is not None and cfg.cache.free_sliding_window_blocks and len(set(windows)) > 1:
        raise ValueError(
            "disaggregated prefill/decode hands over one block list per prompt; a model whose layers have "
            "different attention windows (KV cache groups) with free_sliding_window_blocks=True cannot be "
            "combined with it: set free_sliding_window_blocks=False"
        )


#: Requests a disaggregated prefill/decode pair refuses (by what they ask for), each with its message.
_DISAGGREGATED_REQUEST_REFUSALS: dict[str, str] = {
    "pooling": (
        "embedding requests (LLM.embed, pooling_params) cannot be combined with disaggregated prefill/decode: "
        "an embedding is the prompt's pass alone, with no decode phase to hand its KV to; embed on one "
        "instance (an LLM, or the decode instance DisaggregatedLLM.llm)"
    ),
}


def disaggregated_request_refusal(what: str) -> str:
    """The message ``DisaggregatedLLM`` refuses a request asking for ``what`` with (a key
    of ``_DISAGGREGATED_REQUEST_REFUSALS``: "pooling")."""
    return _DISAGGREGATED_REQUEST_REFUSALS[what]
