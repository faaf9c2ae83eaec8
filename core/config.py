"""Engine configuration: one small dataclass per concern, validated on construction."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedserve.config_rules import BUILTIN_KV_CONNECTORS, check_engine_config
from pagedserve.structured_params import BACKENDS, REASONING_PARSERS, structured_outputs_fields

__all__ = [
    "parse_limit_mm_per_prompt",
    "images_per_prompt",
    "videos_per_prompt",
    "vision_inputs_on",
    "ModelConfig",
    "CacheConfig",
    "SchedulerConfig",
    "ParallelConfig",
    "DeviceConfig",
    "SpeculativeDecodingConfig",
    "LoRAConfig",
    "EngineConfig",
    "StructuredOutputsConfig",
    "DeviceMapEntry",
    "parse_memory",
    "FP8_KV_CACHE_DTYPES",
    "parse_device_map",
    "device_map_layers",
    "DEVICE_MAP_CLASSES",
    "device_map_classes",
    "normalize_device_map",
]

#: The residual_dtype setting's values (ModelConfig.residual_dtype; models/decoder.py).
RESIDUAL_DTYPES: tuple[str, ...] = ("auto", "float32", "model")

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


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


@dataclass(frozen=True)
class DeviceMapEntry:
    """One segment of a device map as written: a platform and which layers it runs.

    ``count`` layers (None with no range: the layers the other segments leave), or the
    inclusive range ``first``-``last``.
    """

    platform: str
    count: int | None = None
    first: int | None = None
    last: int | None = None

    def __str__(self) -> str:
        if self.first is not None:
            return f"{self.platform}:{self.first}-{self.last}"
        return self.platform if self.count is None else f"{self.platform}:{self.count}"


# The KV cache is kept in the model's dtype ("auto" or that dtype's name, checked against
# the resolved dtype by the engine) or in an 8-bit float whose support the engine checks
# against the platform's declared KV dtypes (pagedserve.kv_cache.kv_dtype).
_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
_SEGMENT = re.compile(r"(?P<name>[^:,\s]+)(?::(?:(?P<first>\d+)-(?P<last>\d+)|(?P<count>\d+)))?")


#: Tensor classes a device map can place apart from their layers (``experts=cpu,*=cuda``):
#: ``experts`` is every MoE layer's routed experts (shared experts and the router stay
#: with their layer).
DEVICE_MAP_CLASSES = ("experts",)
_PLATFORM = re.compile(r"[^:,=\s]+")


def device_map_classes(value: str) -> tuple[str, dict[str, str]]:
    """A device map split into its layer map and its tensor classes' platforms.

    The per-layer form (``"cuda:20,cpu"``) has no classes: ``(value, {})``.  The class
    form ``"experts=cpu,*=cuda"`` gives ``("cuda", {"experts": "cpu"})``: ``*`` (every
    tensor no class names) is required and is the engine's platform.  A class takes a
    whole platform: layer counts or ranges inside the class form are refused (the two
    forms do not combine).  ValueError naming the bad item.
    """
    if "=" not in value:
        return value, {}
    known = ", ".join((*DEVICE_MAP_CLASSES, "*"))
    classes: dict[str, str] = {}
    for part in (p.strip() for p in value.split(",")):
        name, sep, platform = (s.strip() for s in part.partition("="))
        if not sep:
            raise ValueError(
                f"device_map={value!r}: {part!r} is not CLASS=PLATFORM; a map by tensor class names every "
                f"item's class ({known}), e.g. 'experts=cpu,*=cuda', and does not combine with layer counts"
            )
        if name not in (*DEVICE_MAP_CLASSES, "*"):
            raise ValueError(f"device_map={value!r}: unknown tensor class {name!r} (known: {known})")
        if name in classes:
            raise ValueError(f"device_map={value!r} places the tensor class {name!r} twice")
        if not _PLATFORM.fullmatch(platform):
            raise ValueError(
                f"device_map={value!r}: {part!r} must name one platform (e.g. 'experts=cpu'); layer counts "
                "and ranges belong to the per-layer form ('cuda:20,cpu'), which does not combine with "
                "tensor classes"
            )
        classes[name] = platform
    if "*" not in classes:
        raise ValueError(
            f"device_map={value!r} places no platform for the other tensors; add '*=PLATFORM' "
            "(the engine's platform, e.g. 'experts=cpu,*=cuda')"
        )
    main = classes.pop("*")
    return main, {c: classes[c] for c in DEVICE_MAP_CLASSES if c in classes}


def parse_device_map(value: str | Sequence[str | tuple[str, int | None]]) -> tuple[DeviceMapEntry, ...]:
    """Syntax of a device map (docs/memory.md); ValueError naming the bad segment.

    ``"cuda:20,cpu"``: the first 20 decoder layers on cuda, the rest on cpu (at most one
    segment without a count takes the rest).  ``"cpu:0-14,cpu-ref:15-29"``: inclusive
    layer ranges, which must then be given for every segment (returned in layer order).
    A sequence of segment strings or ``(platform, count)`` pairs means the same as the
    comma-joined string.  A map by tensor class (:func:`device_map_classes`) gives the
    entry of its ``*`` platform, which runs every layer.
    """
    if isinstance(value, str):
        parts = device_map_classes(value)[0].split(",")
    else:
        parts = []
        for item in value:
            if isinstance(item, tuple) and len(item) == 2:
                item = str(item[0]) if item[1] is None else f"{item[0]}:{item[1]}"
            if not isinstance(item, str):
                raise ValueError(f"device_map item {item!r} is neither a segment string nor a (platform, count) pair")
            parts.append(item)
    parts = [p.strip() for p in parts]
    if not parts or parts == [""]:
        raise ValueError("device_map is empty; write e.g. 'cuda:20,cpu' or 'cpu:0-14,cuda:15-29'")
    entries = []
    for part in parts:
        m = _SEGMENT.fullmatch(part)
        if m is None:
            raise ValueError(
                f"device_map segment {part!r} is not PLATFORM, PLATFORM:COUNT or PLATFORM:FIRST-LAST "
                "(e.g. 'cuda:20,cpu' or 'cpu:0-14,cuda:15-29')"
            )
        if m["first"] is not None:
            first, last = int(m["first"]), int(m["last"])
            if last < first:
                raise ValueError(f"device_map segment {part!r}: the range {first}-{last} is reversed")
            entries.append(DeviceMapEntry(m["name"], first=first, last=last))
        elif m["count"] is not None:
            count = int(m["count"])
            if count < 1:
                raise ValueError(
                    f"device_map segment {part!r} places no layers (a count is a number of layers, "
                    "not a device index; it must be >= 1)"
                )
            entries.append(DeviceMapEntry(m["name"], count=count))
        else:
            entries.append(DeviceMapEntry(m["name"]))
    ranged = [e for e in entries if e.first is not None]
    if ranged and len(ranged) != len(entries):
        raise ValueError(
            f"device_map {','.join(map(str, entries))!r} mixes layer ranges with counts; "
            "give a range for every segment or none"
        )
    rest = [e for e in entries if e.first is None and e.count is None]
    if len(rest) > 1:
        raise ValueError(
            f"device_map {','.join(map(str, entries))!r}: only one segment may omit its layer count "
            f"(it takes the rest), got {len(rest)}: {', '.join(e.platform for e in rest)}"
        )
    if ranged:  # in layer order, so that the first entry is the one with layer 0
        entries = sorted(entries, key=lambda e: e.first)
        _check_ranges(entries, None)
    return tuple(entries)


def normalize_device_map(value: str | Sequence[str | tuple[str, int | None]]) -> str:
    """A device map's canonical string: ``"cpu:20,cuda"`` or ``"experts=cpu,*=cuda"``
    (classes first, ``*`` last); ValueError as :func:`parse_device_map`."""
    if not isinstance(value, str) and any(isinstance(i, str) and "=" in i for i in value):
        value = ",".join(value)
    entries = parse_device_map(value)
    classes = device_map_classes(value)[1] if isinstance(value, str) else {}
    layers = [f"*={entries[0].platform}"] if classes else list(map(str, entries))
    return ",".join([*(f"{c}={p}" for c, p in classes.items()), *layers])


def _layers(a: int, b: int) -> str:
    return f"layer {a}" if a == b else f"layers {a}-{b}"


def _check_ranges(entries: Sequence[DeviceMapEntry], num_layers: int | None) -> list[tuple[str, int, int]]:
    """Ranged segments sorted into ``(platform, start, end)``: no overlap, no gap, from
    layer 0 and (when ``num_layers`` is known) to the model's last layer."""
    text = ",".join(map(str, entries))
    spans = sorted(((e.first, e.last + 1, e) for e in entries), key=lambda t: t[0])
    pos = 0
    for start, end, e in spans:
        if start < pos:
            other = next(o for s, t, o in spans if o is not e and s < end and start < t)
            raise ValueError(f"device_map {text!r}: segments {other} and {e} overlap")
        if start > pos:
            raise ValueError(f"device_map {text!r} places no platform for {_layers(pos, start - 1)}")
        pos = end
    if num_layers is not None and pos > num_layers:
        raise ValueError(
            f"device_map {text!r} places layers up to {pos - 1}, but the model has "
            f"{num_layers} layers (0-{num_layers - 1})"
        )
    if num_layers is not None and pos < num_layers:
        raise ValueError(
            f"device_map {text!r} places no platform for {_layers(pos, num_layers - 1)} "
            f"(the model has {num_layers} layers)"
        )
    return [(e.platform, start, end) for start, end, e in spans]


def device_map_layers(entries: Sequence[DeviceMapEntry], num_layers: int) -> list[tuple[str, int, int]]:
    """``(platform, start, end)`` per segment, in layer order, covering ``[0, num_layers)``.

    ValueError when counts do not add up to the model's layers, when ranges overlap,
    leave layers out or go past the last layer, or when a segment gets no layer.
    """
    text = ",".join(map(str, entries))
    if entries and entries[0].first is not None:
        return _check_ranges(entries, num_layers)
    counted = sum(e.count for e in entries if e.count is not None)
    has_rest = any(e.count is None for e in entries)
    if counted > num_layers or (counted < num_layers and not has_rest):
        hint = "; give every layer a platform, or leave one segment's count out so that it takes the rest"
        raise ValueError(
            f"device_map {text!r} places {counted} layers, but the model has {num_layers}"
            + (hint if counted < num_layers else "")
        )
    if has_rest and counted == num_layers:
        rest = next(e for e in entries if e.count is None)
        raise ValueError(
            f"device_map {text!r}: the counts already place all {num_layers} layers, so "
            f"{rest.platform!r} (the rest) would get none; drop it"
        )
    out, pos = [], 0
    for e in entries:
        n = e.count if e.count is not None else num_layers - counted
        out.append((e.platform, pos, pos + n))
        pos += n
    return out


#: Modalities of multimodal inputs (``limit_mm_per_prompt`` keys).
MODALITIES = ("image", "video")
#: Images per prompt when ``limit_mm_per_prompt`` is unset.
DEFAULT_IMAGES_PER_PROMPT = 4
#: Videos per prompt when ``limit_mm_per_prompt`` names none and images are on.
DEFAULT_VIDEOS_PER_PROMPT = 1


def parse_limit_mm_per_prompt(value: str | dict | None) -> dict[str, int] | None:
    """``{"image": 2}`` from a dict, vLLM's JSON spelling ``'{"image": 2}'`` or the short
    ``image=2[,...]``; None stays None (the default).  ValueError naming an unknown
    modality or a negative count."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("{"):
            try:
                value = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"limit_mm_per_prompt {text!r} is not valid JSON: {e}") from e
        else:
            pairs = [p.split("=", 1) for p in text.split(",") if p.strip()]
            if not pairs or any(len(p) != 2 for p in pairs):
                raise ValueError(f"limit_mm_per_prompt {text!r}: use JSON like '{{\"image\": 2}}' or image=2")
            value = {k.strip(): v.strip() for k, v in pairs}
    if not isinstance(value, dict):
        raise ValueError(f"limit_mm_per_prompt must be a mapping like {{'image': 2}}, got {value!r}")
    out: dict[str, int] = {}
    for k, v in value.items():
        if k not in MODALITIES:
            raise ValueError(f"limit_mm_per_prompt: unknown modality {k!r} (supported: {', '.join(MODALITIES)})")
        try:
            n = int(v)
        except (TypeError, ValueError):
            raise ValueError(f"limit_mm_per_prompt[{k!r}] must be an integer, got {v!r}") from None
        if n < 0:
            raise ValueError(f"limit_mm_per_prompt[{k!r}] must be >= 0, got {n}")
        out[k] = n
    return out


def images_per_prompt(model: ModelConfig) -> int:
    """Most images a prompt may have under ``model.limit_mm_per_prompt`` (0: images off)."""
    limits = model.limit_mm_per_prompt or {}
    return int(limits.get("image", DEFAULT_IMAGES_PER_PROMPT))


def videos_per_prompt(model: ModelConfig) -> int:
    """Most videos a prompt may have: ``limit_mm_per_prompt["video"]``, else one when
    images are on and none when they are off (``image=0`` alone serves the language
    model alone)."""
    limits = model.limit_mm_per_prompt or {}
    if "video" in limits:
        return int(limits["video"])
    return DEFAULT_VIDEOS_PER_PROMPT if images_per_prompt(model) > 0 else 0


def vision_inputs_on(model: ModelConfig) -> bool:
    """Whether a vision-language model's vision side loads (images or videos are on)."""
    return images_per_prompt(model) > 0 or videos_per_prompt(model) > 0


def _help(text: str, **extra) -> dict:
    """Field metadata: ``help`` is the flag's help text and the docs' description; the
    optional keys (``flag``, ``aliases``, ``choices``, ``parse``, ``metavar``, ``cli``)
    are read by :mod:`pagedserve.entrypoints.engine_args`."""
    return {"help": text, **extra}


@dataclass
class ModelConfig:
    """Which model and how to run it.  ``model=None`` is the default model alias."""

    model: str | None = field(
        default=None,
        metadata=_help(
            "the model: a Hugging Face checkpoint folder, a .gguf file, or the default model's alias "
            "(smollm2-135m-instruct, used when unset); commands take it as their positional MODEL",
            cli=False,
        ),
    )
    dtype: str = field(
        default="auto",
        metadata=_help("weights and activations dtype: auto (the platform's default), float32, bfloat16 or float16"),
    )
    max_model_len: int | None = field(
        default=None,
        metadata=_help("context length (prompt plus output) in tokens; default: the model's max_position_embeddings"),
    )
    residual_dtype: str = field(
        default="auto",
        metadata=_help(
            "dtype of the residual stream between decoder layers: auto (float32 beside bf16/fp16 activations "
            "where the o and down projections are GGUF blocks kept quantized, which write their float32 sums "
            "into it; else the model's dtype), float32, or model (docs/quantization.md)",
            choices=list(RESIDUAL_DTYPES),
        ),
    )
    seed: int = field(default=0, metadata=_help("seed of the engine's random state"))
    tokenizer: str | None = field(
        default=None,
        metadata=_help(
            "a tokenizer other than the model's: a folder with tokenizer.json, a .gguf file, or the default "
            "model's alias"
        ),
    )
    chat_template: str | None = field(
        default=None,
        metadata=_help(
            "Jinja2 chat template text overriding the model's (`serve --chat-template` also reads a file)", cli=False
        ),
    )
    served_model_name: str | None = field(
        default=None,
        metadata=_help("the name clients use for the model (`serve --served-model-name` takes several)", cli=False),
    )
    quantization: str | None = field(
        default=None,
        metadata=_help(
            "none, auto (from the checkpoint; default), gguf, int8, w8a8, fp8, gptq, awq (docs/quantization.md)"
        ),
    )
    max_logprobs: int = field(
        default=20,
        metadata=_help(
            "most log-probabilities a request may ask for per token (logprobs, top_logprobs); more is refused"
        ),
    )
    generation_config: str = field(
        default="auto",
        metadata=_help(
            "sampling defaults: 'auto' (the checkpoint's generation_config.json), 'ignore', or a folder holding one"
        ),
    )
    pooling: str | None = field(
        default=None,
        metadata=_help(
            "how embeddings pool the final hidden states: last, mean or cls; default: the checkpoint's "
            "sentence-transformers config, else last",
            choices=["last", "mean", "cls"],
        ),
    )
    enable_sleep_mode: bool = field(
        default=False,
        metadata=_help(
            "allow LLM.sleep()/wake_up() and the server's POST /sleep, POST /wake_up and GET /is_sleeping: "
            "free the weights and the KV cache between jobs (docs/memory.md)"
        ),
    )

    limit_mm_per_prompt: dict | str | None = field(
        default=None,
        metadata=_help(
            "most images (and videos) per prompt of a vision-language model, JSON like '{\"image\": 2}' or "
            "image=2,video=1; image=0 serves its language model alone (the vision weights are not loaded); "
            "default: 4 images and 1 video (no video with image=0)",
            parse="pagedserve.config:parse_limit_mm_per_prompt",
        ),
    )
    allowed_local_media_path: str | None = field(
        default=None,
        metadata=_help("a folder whose files chat requests may name as file:// image URLs; unset: none may"),
    )

    def __post_init__(self) -> None:
        self.limit_mm_per_prompt = parse_limit_mm_per_prompt(self.limit_mm_per_prompt)
        if self.dtype not in ("auto", "float32", "float", "bfloat16", "float16", "half", "fp32", "bf16", "fp16"):
            raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16; got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.residual_dtype not in RESIDUAL_DTYPES:
            raise ValueError(f"residual_dtype must be one of {', '.join(RESIDUAL_DTYPES)}; got {self.residual_dtype!r}")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs}")
        if self.pooling not in (None, "last", "mean", "cls"):
            raise ValueError(f"pooling must be 'last', 'mean' or 'cls', got {self.pooling!r}")


#: --kv-cache-dtype values of vLLM's fp8 family (the last two are not implemented here).
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla")


@dataclass
class CacheConfig:
    """Paged KV cache settings.

    kv_cache_memory takes precedence over memory_utilization (vLLM's
    gpu_memory_utilization), and num_gpu_blocks_override over both.  The memory
    hierarchy (kv_offload_memory, preemption_mode, cpu_offload_gb) is described in
    docs/memory.md.
    """

    block_size: int | None = field(
        default=None,
        metadata=_help(
            "tokens per KV-cache block (a power of two); default: the platform's (`pagedserve platforms`: 16 on "
            "the builtin platforms; at most 16 for models with recurrent-state layers; docs/memory.md)"
        ),
    )
    kv_cache_memory: int | str | None = field(
        default=None,
        metadata=_help("bytes for KV-cache blocks, e.g. 4GiB; takes precedence over --gpu-memory-utilization"),
    )
    memory_utilization: float | None = field(
        default=None,
        metadata=_help(
            "fraction of the device's memory for weights, activations and KV cache (default: the platform's)",
            flag="--gpu-memory-utilization",
            aliases=["--memory-utilization"],
        ),
    )
    enable_prefix_caching: bool = field(default=True, metadata=_help("reuse the KV blocks of shared prompt prefixes"))
    state_checkpoint_interval: int = field(
        default=4,
        metadata=_help(
            "blocks between the prefix-cache checkpoints of a recurrent state (hybrid models: Qwen3.5, Granite 4, "
            "Jamba, ...): a cached prefix of such a model ends at a multiple of this many blocks; each checkpoint "
            "takes a request's state pages (docs/models.md)"
        ),
    )
    num_gpu_blocks_override: int | None = field(
        default=None,
        metadata=_help(
            "this many KV-cache blocks, whatever the memory budget says (on any platform)",
            aliases=["--num-kv-blocks-override"],
        ),
    )
    cache_dtype: str = field(
        default="auto",
        metadata=_help(
            "KV-cache dtype: auto (the model's dtype), fp8_e4m3 (alias fp8), fp8_e5m2 or int8 (with a scale per "
            "token and head): 8-bit keys and values, about twice the blocks of a bf16 cache, where the platform's "
            "attention reads them (docs/memory.md)",
            flag="--kv-cache-dtype",
        ),
    )
    kv_cache_scales: str = field(
        default="auto",
        metadata=_help(
            "scales of an fp8 KV cache: row (a float32 scale per token and KV head, computed on write and kept "
            "in the block), tensor (one per layer: the checkpoint's k_scale/v_scale or --quantization-param-path, "
            "else 1.0; twice the blocks of bf16) or auto (tensor when per-layer scales are given, else row); "
            "int8 always uses row scales (docs/memory.md)",
            choices=["auto", "row", "tensor"],
        ),
    )
    quantization_param_path: str | None = field(
        default=None,
        metadata=_help(
            "a JSON file of per-layer fp8 KV cache scales (older vLLM's kv_cache_scales format: "
            '{"kv_cache": {"scaling_factor": {"TP_RANK": {"LAYER": SCALE}}}}), used with kv_cache_scales '
            "tensor or auto"
        ),
    )
    kv_offload_memory: int | str | None = field(
        default=None,
        metadata=_help(
            "host memory for a second tier of KV blocks, e.g. 8GiB: evicted prefix-cache blocks spill there "
            "and preempted requests may swap there (docs/memory.md)"
        ),
    )
    kv_connector: str | None = field(
        default=None,
        metadata=_help(
            "a KV store below the device cache: 'host' (host memory), 'disk:DIR' (block files in DIR, kept "
            "across restarts) -- stores by content: full blocks saved, prefix misses loaded -- or a plugin's "
            "'NAME[:ARG]', a store by content or a device-layout tier like kv_offload_memory's (docs/memory.md)"
        ),
    )
    kv_connector_memory: int | str = field(
        default="4GiB", metadata=_help("the most bytes the kv_connector keeps (least recently used dropped first)")
    )
    preemption_mode: str = field(
        default="auto",
        metadata=_help(
            "auto (swap or recompute by a cost model), swap (whenever the host tier has room) or recompute",
            choices=["auto", "swap", "recompute"],
        ),
    )
    cpu_offload_gb: float = field(
        default=0.0, metadata=_help("GB (10**9 bytes) of layer weights kept in host memory and streamed to the device")
    )
    free_sliding_window_blocks: bool = field(
        default=True,
        metadata=_help(
            "free a request's KV blocks once they slide out of the attention window of every layer "
            "(one window on all layers), or of a group of layers with one window (one block table per "
            "group where layers differ, as in Gemma 2/3; docs/models.md)"
        ),
    )

    def __post_init__(self) -> None:
        if self.block_size is not None and (self.block_size < 1 or self.block_size & (self.block_size - 1)):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.memory_utilization is not None and not 0.0 < self.memory_utilization <= 1.0:
            raise ValueError(f"memory_utilization must be in (0, 1], got {self.memory_utilization}")
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_memory(self.kv_cache_memory, "kv_cache_memory")
        if self.state_checkpoint_interval < 1:
            raise ValueError(f"state_checkpoint_interval must be >= 1 block, got {self.state_checkpoint_interval}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override}")
        if self.cache_dtype in FP8_KV_CACHE_DTYPES and self.cache_dtype not in _CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype={self.cache_dtype!r} is not implemented: the quantized KV caches are "
                "'fp8_e4m3' (alias 'fp8'), 'fp8_e5m2' and 'int8'"
            )
        self._check_kv_scales()
        if self.kv_offload_memory is not None:
            self.kv_offload_memory = parse_memory(self.kv_offload_memory, "kv_offload_memory")
        self.kv_connector_memory = parse_memory(self.kv_connector_memory, "kv_connector_memory")
        if self.kv_connector is not None and not self.kv_connector.partition(":")[0]:
            raise ValueError(f"kv_connector must be NAME or NAME:ARG, got {self.kv_connector!r}")
        if self.preemption_mode not in ("auto", "swap", "recompute"):
            raise ValueError(f"preemption_mode must be 'auto', 'swap' or 'recompute', got {self.preemption_mode!r}")
        # A plugin's kv_connector may be a device-layout tier (checked before weights load).
        plugin_connector = self.kv_connector is not None and self.kv_connector.partition(":")[0] not in (
            BUILTIN_KV_CONNECTORS
        )
        if self.preemption_mode == "swap" and self.kv_offload_memory is None and not plugin_connector:
            raise ValueError("preemption_mode='swap' needs a host KV tier: set kv_offload_memory")
        if not self.cpu_offload_gb >= 0:
            raise ValueError(f"cpu_offload_gb must be >= 0, got {self.cpu_offload_gb}")
        if self.cache_dtype not in _CACHE_DTYPES:
            raise ValueError(
                f"cache_dtype={self.cache_dtype!r} is not supported: the KV cache is kept in the "
                f"model's dtype or an 8-bit type, so cache_dtype must be 'auto' or one of "
                f"{', '.join(repr(n) for n in _CACHE_DTYPES[1:])}"
            )

    def _check_kv_scales(self) -> None:
        if self.kv_cache_scales not in ("auto", "row", "tensor"):
            raise ValueError(f"kv_cache_scales must be 'auto', 'row' or 'tensor', got {self.kv_cache_scales!r}")
        fp8 = self.cache_dtype in ("fp8", "fp8_e4m3", "fp8_e5m2")
        if self.kv_cache_scales == "tensor" and not fp8:
            raise ValueError(
                f"kv_cache_scales='tensor' applies to an fp8 KV cache, not kv_cache_dtype={self.cache_dtype!r} "
                "(int8 always keeps a scale per row); use kv_cache_dtype='fp8_e4m3' or 'fp8_e5m2'"
            )
        if self.quantization_param_path is not None:
            if not fp8 or self.kv_cache_scales == "row":
                raise ValueError(
                    "quantization_param_path gives per-layer fp8 KV cache scales: it needs kv_cache_dtype "
                    f"'fp8_e4m3' or 'fp8_e5m2' and kv_cache_scales 'tensor' or 'auto' (got {self.cache_dtype!r}, "
                    f"{self.kv_cache_scales!r})"
                )
            if not os.path.isfile(self.quantization_param_path):
                raise ValueError(f"quantization_param_path {self.quantization_param_path!r} is not a file")


@dataclass
class SchedulerConfig:
    """Continuous batching: one token budget per step."""

    max_num_seqs: int = field(default=256, metadata=_help("most sequences running in one step"))
    max_num_batched_tokens: int = field(
        default=2048, metadata=_help("token budget of one step (prompt chunks plus decodes)")
    )
    enable_chunked_prefill: bool = field(
        default=True,
        metadata=_help(
            "split long prompts across steps; when off a prompt is scheduled whole, and prompts longer than "
            "--max-num-batched-tokens are refused"
        ),
    )
    long_prefill_token_threshold: int | None = field(
        default=None,
        metadata=_help(
            "most prompt tokens one request computes in a step, so a long prompt does not stall the running "
            "decodes for a whole budget (0: no cap; default: the platform's, docs/serving.md)"
        ),
    )
    max_prefill_tokens_with_decodes: int | None = field(
        default=None,
        metadata=_help(
            "most prompt tokens of all requests together in a step while some request decodes, so a step's "
            "length (every decode's inter-token gap) stays bounded (0: no cap; default: the platform's "
            "long-prefill cap, docs/serving.md)"
        ),
    )
    policy: str = field(
        default="fcfs",
        metadata=_help(
            "fcfs (arrival order) or priority (lower value first; preempts the lowest priority)",
            flag="--scheduling-policy",
            choices=["fcfs", "priority"],
        ),
    )
    delay_factor: float = field(
        default=0.0,
        metadata=_help(
            "hold new prompts up to this many times the last step's latency so arrivals batch",
            flag="--scheduler-delay-factor",
        ),
    )
    max_queue_len: int | None = field(
        default=None,
        metadata=_help(
            "answer 503 while this many sequences wait to be scheduled (default: unbounded); a request of "
            "more sequences than that (prompts x n; per replica under data parallelism) is a 400, since no "
            "retry could queue it"
        ),
    )
    async_scheduling: bool = field(
        default=False,
        metadata=_help(
            "detokenize and stop-check one step's tokens while the next step's forward runs "
            "(outputs unchanged; docs/async_scheduling.md)"
        ),
    )

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")
        if self.long_prefill_token_threshold and not self.enable_chunked_prefill:
            raise ValueError(
                "long_prefill_token_threshold splits prompts across steps: it needs enable_chunked_prefill"
            )
        if self.max_prefill_tokens_with_decodes is not None and self.max_prefill_tokens_with_decodes < 0:
            raise ValueError(
                f"max_prefill_tokens_with_decodes must be >= 0, got {self.max_prefill_tokens_with_decodes}"
            )
        if self.max_prefill_tokens_with_decodes and not self.enable_chunked_prefill:
            raise ValueError(
                "max_prefill_tokens_with_decodes splits prompts across steps: it needs enable_chunked_prefill"
            )
        if self.delay_factor < 0:
            raise ValueError(f"scheduler delay_factor must be >= 0, got {self.delay_factor}")
        if self.max_queue_len is not None and self.max_queue_len < 1:
            raise ValueError(f"max_queue_len must be >= 1, got {self.max_queue_len}")


@dataclass
class LoRAConfig:
    """Multi-LoRA serving (docs/lora.md): adapters of the base model mixed in one batch."""

    enable_lora: bool = field(default=False, metadata=_help("serve LoRA adapters (PEFT format) next to the base model"))
    max_loras: int = field(default=1, metadata=_help("most distinct adapters in one batch (device slots)"))
    max_lora_rank: int = field(default=16, metadata=_help("largest adapter rank accepted (<= 64)"))
    max_cpu_loras: int | None = field(
        default=None, metadata=_help("adapters kept loaded in host memory (default: max_loras; at least max_loras)")
    )

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if not 1 <= self.max_lora_rank <= 64:
            raise ValueError(f"max_lora_rank must be in [1, 64], got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras={self.max_cpu_loras} must be >= max_loras={self.max_loras}")


@dataclass
class ParallelConfig:
    """Ranks: ``world_size`` = tensor_parallel_size * pipeline_parallel_size."""

    tensor_parallel_size: int = field(
        default=1, metadata=_help("ranks each layer's weights are split across", aliases=["-tp"])
    )
    pipeline_parallel_size: int = field(
        default=1, metadata=_help("pipeline stages the layers are split into", aliases=["-pp"])
    )
    distributed_executor_backend: str | None = field(
        default=None,
        metadata=_help(
            "how ranks run: uni (one process), mp (local worker processes) or ray (Ray actors); default: uni "
            "for one rank, else mp",
            choices=["uni", "mp", "ray"],
        ),
    )
    distributed_timeout_s: float = field(
        default=300.0,
        metadata=_help("seconds a collective (or the start-up rendezvous) may wait for a rank before failing"),
    )
    # Multi-node without Ray (docs/distributed.md): one `pagedserve serve` per node.
    nnodes: int = field(
        default=1, metadata=_help("nodes the ranks are spread over (each runs world_size / nnodes ranks)")
    )
    node_rank: int = field(
        default=0, metadata=_help("this node's index: 0 is the head (rank 0, serves HTTP), others run workers only")
    )
    master_addr: str | None = field(
        default=None,
        metadata=_help("address of the head node's rendezvous (multi-node); default: node_ip_address, else 127.0.0.1"),
    )
    master_port: int | None = field(
        default=None,
        metadata=_help("TCP port of the head node's rendezvous (multi-node: required, the same on every node)"),
    )
    distributed_init_method: str | None = field(
        default=None, metadata=_help("tcp://HOST:PORT: master_addr and master_port in one setting")
    )
    node_ip_address: str | None = field(
        default=None,
        metadata=_help(
            "this node's IP address; on the head node it is the rendezvous address unless master_addr is set"
        ),
    )
    headless: bool = field(
        default=False, metadata=_help("run this node's workers only, no API server (implied by node_rank > 0)")
    )

    def __post_init__(self) -> None:
        if self.distributed_init_method is not None:
            self.master_addr, self.master_port = _parse_init_method(
                self.distributed_init_method, self.master_addr, self.master_port
            )
        if self.nnodes < 1:
            raise ValueError(f"nnodes must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes={self.nnodes}), got {self.node_rank}")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be a TCP port (1-65535), got {self.master_port}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size must be >= 1, got {self.pipeline_parallel_size}")
        if self.distributed_executor_backend not in (None, "uni", "mp", "ray"):
            raise ValueError(
                f"distributed_executor_backend must be 'uni', 'mp' or 'ray', got {self.distributed_executor_backend!r}"
            )
        if self.distributed_timeout_s <= 0:
            raise ValueError(f"distributed_timeout_s must be > 0, got {self.distributed_timeout_s}")

    @property
    def world_size(self) -> int:
        """Ranks in all: tensor_parallel_size * pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def rendezvous_addr(self) -> str:
        """Where the head node's rendezvous listens (multi-node); node_ip_address is this
        node's own address, so it stands for the head's only on the head."""
        own = self.node_ip_address if self.node_rank == 0 else None
        return self.master_addr or own or "127.0.0.1"


def _parse_init_method(method: str, addr: str | None, port: int | None) -> tuple[str, int]:
    """``tcp://HOST:PORT`` -> (HOST, PORT); it must agree with master_addr/master_port if set."""
    from urllib.parse import urlsplit

    url = urlsplit(method)
    try:
        url_port = url.port
    except ValueError:
        url_port = None
    if url.scheme != "tcp" or not url.hostname or url_port is None:
        raise ValueError(f"distributed_init_method must be tcp://HOST:PORT, got {method!r}")
    if (addr is not None and addr != url.hostname) or (port is not None and port != url_port):
        raise ValueError(
            f"distributed_init_method={method!r} disagrees with master_addr={addr!r} / "
            f"master_port={port!r}: give one or the other"
        )
    return url.hostname, url_port


def parse_cpu_list(text: str) -> list[int]:
    """``"0-3,8,10-11"`` -> ``[0, 1, 2, 3, 8, 10, 11]`` (Linux cpu-list syntax, as taskset
    and vLLM's VLLM_CPU_OMP_THREADS_BIND take it); ValueError naming a malformed part."""
    cpus: list[int] = []
    for part in str(text).split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()) or (sep and int(hi) < int(lo)):
            raise ValueError(f"cpu_bind={text!r}: {part!r} is not a core number or an ascending range like 0-3")
        cpus.extend(range(int(lo), int(hi if sep else lo) + 1))
    if len(set(cpus)) != len(cpus):
        raise ValueError(f"cpu_bind={text!r} names a core twice")
    return cpus


@dataclass
class DeviceConfig:
    """Platform selection (None = PAGEDSERVE_TARGET_DEVICE or auto-detect) and threads.

    device_map: decoder layers split across platforms, or tensor classes placed apart
        ("experts=cpu,*=cuda") (docs/memory.md); normalised to its string form.  Its
        first platform (the ``*`` one of a map by class) is the engine's platform
        (``device`` may only repeat it): it embeds the tokens and its default dtype is
        what ``dtype="auto"`` picks.
    """

    device: str | None = field(
        default=None, metadata=_help("platform name (default: PAGEDSERVE_TARGET_DEVICE or auto-detect)")
    )
    threads: int | None = field(default=None, metadata=_help("CPU threads for the model"))
    device_map: str | Sequence[str | tuple[str, int | None]] | None = field(
        default=None,
        metadata=_help(
            "decoder layers split across platforms: 'cuda:20,cpu' (the first 20 layers on cuda, the rest on cpu) "
            "or inclusive ranges 'cpu:0-14,cuda:15-29'; or by tensor class: 'experts=cpu,*=cuda' (every MoE "
            "layer's routed experts on cpu, the rest on cuda) (docs/memory.md)",
            parse="pagedserve.entrypoints.cli.device_map_arg:device_map_arg",
            metavar="MAP",
        ),
    )
    #: Host cores for the model's threads, e.g. "0-3": thread i runs on the i-th core
    #: listed (the platform's ``configure_threads``); threads defaults to their number.
    cpu_bind: str | None = field(
        default=None,
        metadata=_help(
            "pin the model's threads to these host cores, one each, e.g. 0-3 (threads defaults to their number)",
            metavar="CPUS",
        ),
    )
    #: ``cpu_bind`` parsed: the cores, in thread order (None without it).
    bind_cores: list[int] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        self.bind_cores = None if self.cpu_bind is None else parse_cpu_list(self.cpu_bind)
        if self.bind_cores is not None:
            cpus = self.bind_cores
            if self.threads is not None and self.threads != len(cpus):
                raise ValueError(
                    f"threads={self.threads} but cpu_bind={self.cpu_bind!r} lists {len(cpus)} cores "
                    "(one thread per core; leave threads unset)"
                )
        if self.device_map is None:
            return
        self.device_map = normalize_device_map(self.device_map)
        first = parse_device_map(self.device_map)[0].platform
        from pagedserve.platforms.options import target_device  # platform selection's one reader

        for source, name in (("device", self.device), ("PAGEDSERVE_TARGET_DEVICE", target_device())):
            name = (name or "").strip()
            if name not in ("", "auto", first):
                raise ValueError(
                    f"{source}={name!r} conflicts with device_map={self.device_map!r}, whose first "
                    f"platform {first!r} is the engine's platform; unset {source} or start the map "
                    f"with {name!r}"
                )
        self.device = first


@dataclass
class StructuredOutputsConfig:
    """Structured outputs (docs/structured_outputs.md), vLLM's ``structured_outputs_config``.

    backend: "auto" or "xgrammar" (set by the ``structured_outputs_config`` keyword and
    ``--structured-outputs-config`` flag, which take the whole section).  reasoning_parser:
    the model's reasoning format ("deepseek_r1", "qwen3"); constraints then apply after
    its ``</think>``.
    """

    backend: str = field(
        default="auto",
        metadata=_help(
            'structured outputs settings: JSON such as {"backend": "xgrammar"} (backend: auto or xgrammar; '
            "reasoning_parser as below); the keyword also takes a dict, a StructuredOutputsConfig or a backend name",
            flag="--structured-outputs-config",
            parse="pagedserve.structured_params:parse_structured_outputs_config",
            metavar="JSON",
        ),
    )
    reasoning_parser: str | None = field(
        default=None,
        metadata=_help(
            "reasoning format of the model: its reasoning section goes to reasoning_content and constraints "
            "(structured outputs, tool calls) apply after it",
            choices=list(REASONING_PARSERS),
        ),
    )

    max_grammar_bytes: int = field(
        default=65536,
        metadata=_help(
            "largest constraint (JSON schema, regex, grammar, choices, structural tag) in bytes; "
            "a larger one is refused with a 400 before it is compiled"
        ),
    )
    max_grammar_items: int = field(
        default=4096,
        metadata=_help("most subschemas of a JSON schema, values of an enum, choices or grammar rules in a constraint"),
    )
    max_grammar_repetition: int = field(
        default=1000,
        metadata=_help(
            "largest repetition count in a constraint: minItems/maxItems/minLength/maxLength/minProperties/"
            "maxProperties, and the product of nested {m,n} counts of a regex, pattern or grammar"
        ),
    )
    grammar_compile_timeout: float = field(
        default=10.0,
        metadata=_help(
            "seconds a constraint may take to compile; past it the request fails with an error naming "
            "the constraint, and the same constraint is refused at once afterwards (0: no deadline)"
        ),
    )
    max_json_whitespace: int = field(
        default=20,
        metadata=_help(
            "most whitespace characters in a row between the tokens of constrained JSON (json_schema, "
            "json_object, tool calls), so a small model cannot fill its budget with newlines (-1: unbounded)"
        ),
    )

    def __post_init__(self) -> None:
        # `structured_outputs_config` (the flag's JSON, a dict or a config) fills both fields.
        self.backend, self.reasoning_parser = structured_outputs_fields(self.backend, self.reasoning_parser)
        if self.backend not in BACKENDS:
            raise ValueError(
                f"structured_outputs_config.backend must be one of {', '.join(BACKENDS)}; got {self.backend!r}"
            )
        for name in ("max_grammar_bytes", "max_grammar_items", "max_grammar_repetition"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1; got {getattr(self, name)}")
        if self.grammar_compile_timeout < 0:
            raise ValueError(f"grammar_compile_timeout must be >= 0; got {self.grammar_compile_timeout}")
        if self.max_json_whitespace < -1:
            raise ValueError(f"max_json_whitespace must be >= 0, or -1 (unbounded); got {self.max_json_whitespace}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}; got {self.reasoning_parser!r}"
            )


@dataclass
class SpeculativeDecodingConfig:
    """Speculative decoding (docs/speculative.md): off unless ``speculative_config`` is set."""

    speculative_config: Any = field(
        default=None,
        metadata=_help(
            'speculative decoding as a JSON object, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'; '
            'methods: ngram, draft_model (with "model"), self_quantized (docs/speculative.md)',
            parse="pagedserve.spec_config:speculative_config_arg",
            metavar="JSON",
        ),
    )

    def __post_init__(self) -> None:
        from pagedserve.spec_config import parse_speculative_config

        self.speculative_config = parse_speculative_config(self.speculative_config)


@dataclass
class EngineConfig:
    """Every engine setting, one dataclass per concern.

    Construction checks each section and every rule across sections (e.g. features not
    supported with tensor/pipeline parallelism; see ``pagedserve.config_rules``), so a bad
    combination fails before any model or worker work.
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    speculative: SpeculativeDecodingConfig = field(default_factory=SpeculativeDecodingConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """ValueError naming the first pair of settings that cannot be combined."""
        check_engine_config(self)
