"""DecoderForCausalLM: what every decoder-only family shares -- tensor/pipeline
sharding, device-map placements, the weight-loading loop, the embedding and LM head,
and the walk over the layers.  A family supplies its layer holder, the checkpoint
names of one layer, how they become the holder's tensors, and one layer's forward.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, ClassVar

import torch

from pagedserve.config import RESIDUAL_DTYPES
from pagedserve.distributed.parallel_state import ParallelContext
from pagedserve.models.arch_config import ArchConfig
from pagedserve.models.layers import (
    AttentionShape,
    LayerPlacement,
    MRotaryEmbedding,
    RotaryEmbedding,
    ScaledKVCache,
    linear,
)
from pagedserve.models.rope import check_rope_scaling, mrope_interleaved, mrope_section
from pagedserve.quantization.base import QuantizedWeight

if TYPE_CHECKING:
    from pagedserve.executor.attention_metadata import AttentionMetadata

__all__ = ["DecoderForCausalLM", "even_slice", "shard_parts"]

logger = logging.getLogger(__name__)

KVCache = tuple[torch.Tensor, torch.Tensor]

# Checkpoint projection kinds by how tensor parallelism splits them (Mixtral's experts
# are w1/w3/w2, StarCoder2's MLP c_fc/c_proj).
_COLUMN = ("gate_proj", "up_proj", "c_fc", "w1", "w3")
_FUSED_COLUMN = ("gate_up_proj",)
_ROW = ("down_proj", "c_proj", "w2")


def even_slice(name: str, t: torch.Tensor, dim: int, rank: int, tp: int) -> torch.Tensor:
    """Part ``rank`` of ``tp`` equal parts of ``t`` along ``dim`` (a view)."""
    size = t.shape[dim]
    if size % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide dimension {dim} ({size}) of {name}")
    n = size // tp
    return t.narrow(dim, rank * n, n)


def shard_parts(name: str, t: torch.Tensor, sizes: list[int], rank: int, tp: int, dim: int = 0) -> torch.Tensor:
    """Part ``rank`` of ``tp`` of each of the consecutive parts of ``t`` along ``dim``
    (``sizes``), concatenated: a projection whose outputs fuse several head-split
    tensors (a recurrent layer's q/k/v, or x/B/C) keeps each one's share."""
    if sum(sizes) != t.shape[dim]:
        raise ValueError(f"{name}: dimension {dim} is {t.shape[dim]}, expected {sum(sizes)} ({sizes})")
    return torch.cat([even_slice(name, part, dim, rank, tp) for part in t.split(sizes, dim=dim)], dim=dim)


class DecoderForCausalLM:
    """Inference-only decoder-only LM.  ``ops`` is the platform's op registry.

    With a ``parallel`` context this object holds one rank's shard (Megatron-style):
    column-parallel q/k/v (heads split; KV heads replicated when fewer than ranks) and
    gate/up, row-parallel o_proj and down_proj followed by an all-reduce, a
    vocab-parallel embedding and LM head, and only this pipeline stage's layers.

    With ``placements`` (a device map; one rank only) consecutive runs of layers live on
    different devices and run with their own op registries: the embedding is on the
    first placement, the final norm and the LM head on the last, and the activations
    and step metadata move from one placement to the next.
    """

    #: The per-layer weight holder (a ``__slots__`` class constructible without arguments).
    layer_class: ClassVar[type]
    #: Holder attributes that are dense linear weights (packed by ``prepare_linear_weights``).
    linear_fields: ClassVar[tuple[str, ...]] = ()
    #: ``attention_bias`` when config.json does not say.
    default_attention_bias: ClassVar[bool] = False
    #: Whether ``_shard`` knows how to split this family's weights (the registry's column).
    tensor_parallel: ClassVar[bool] = True
    #: Whether this family's layers keep a float32 residual stream beside narrower
    #: activations when asked (``residual_dtype``; :meth:`set_residual_dtype`): they pass
    #: ``stream_dtype`` to ``layers.add_rms_norm`` and ``layers.residual_linear``.
    float32_residual: ClassVar[bool] = False

    @classmethod
    def pipeline_refusal(cls, hf: dict) -> str | None:
        """Why config.json ``hf`` cannot be split into pipeline stages, or None."""
        return None

    @classmethod
    def tensor_parallel_refusal(cls, hf: dict, tp: int) -> str | None:
        """Why config.json ``hf`` cannot be split over ``tp`` tensor-parallel ranks beyond
        the attention and MLP counts every family checks (a family's own counts: a
        recurrent layer's heads or channels), or None."""
        return None

    @classmethod
    def check_config(cls, cfg: ArchConfig) -> None:
        """Raise ValueError naming any feature of ``cfg`` this family does not implement."""
        check_rope_scaling(cfg.rope_scaling)

    def __init__(
        self,
        cfg: ArchConfig,
        ops,
        dtype: torch.dtype,
        device: torch.device,
        parallel: ParallelContext | None = None,
        placements: list[LayerPlacement] | None = None,
        max_positions: int | None = None,
    ) -> None:
        self.cfg = cfg
        self.dtype = dtype
        self.parallel = p = parallel or ParallelContext.single(device)
        tp = p.tp_size
        if tp > 1 and not self.tensor_parallel:
            raise ValueError(f"{cfg.architecture} does not support tensor parallelism yet")
        if cfg.num_heads % tp or cfg.intermediate_size % tp or (cfg.num_kv_heads % tp and tp % cfg.num_kv_heads):
            raise ValueError(
                f"tensor_parallel_size={tp} must divide the attention heads ({cfg.num_heads}) and "
                f"intermediate_size ({cfg.intermediate_size}), and divide or be a multiple of the "
                f"KV heads ({cfg.num_kv_heads})"
            )
        self.num_heads = cfg.num_heads // tp
        self.num_kv_heads = max(1, cfg.num_kv_heads // tp)
        # Vocab rows per rank; the last shard is zero-padded so all-gathers see equal shapes.
        self.vocab_shard = -(-cfg.vocab_size // tp)
        self.vocab_start = p.tp_rank * self.vocab_shard
        self.attn = AttentionShape(self.num_heads, self.num_kv_heads, cfg.head_dim, self.attention_scale())
        self.q_size, self.kv_size = self.attn.q_size, self.attn.kv_size
        self.layer_start, self.layer_end = p.layer_range(cfg.num_layers)
        if placements is None:
            placements = [LayerPlacement(self.layer_start, self.layer_end, ops, device, lambda t: t.to(device))]
        elif (
            p.world_size > 1
            or placements[0].start != 0
            or placements[-1].end != cfg.num_layers
            or any(a.start >= a.end for a in placements)
            or any(a.end != b.start for a, b in zip(placements, placements[1:]))
        ):
            raise ValueError("layer placements must cover the model's layers in order, on a single rank")
        self.placements = list(placements)
        #: The first placement embeds tokens; the last one holds the final norm and LM head.
        self.ops, self.device = placements[0].ops, placements[0].device
        self.head_ops, self.head_device = placements[-1].ops, placements[-1].device
        self._layer_device = [pl.device for pl in placements for _ in range(pl.start, pl.end)]
        self.layers = [self.layer_class() for _ in range(self.layer_end - self.layer_start)]
        #: Weight offload's (pagedserve.offload.weights, through set_layer_stream): maps the
        #: layer list to the layers to run, streaming host-resident weights one layer ahead.
        self.layer_stream = None
        #: Quantized formats some of whose tensor-parallel shards were dequantized (logged once).
        self._dequantized_shards: set[str] = set()
        self.embed: torch.Tensor | None = None
        self.norm: torch.Tensor | None = None
        self.lm_head: torch.Tensor | None = None
        #: Rows of the RoPE tables: the engine's max_model_len, never the checkpoint's
        #: (possibly absurd) max_position_embeddings.
        self.max_positions = min(max_positions or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.rope = self.make_rope([pl.device for pl in placements])
        #: A checkpoint's per-layer fp8 KV cache scales (``model.layers.N.self_attn.k_scale``
        #: / ``.v_scale``, vLLM's names), [k, v] by model-wide layer; read while loading.
        self.checkpoint_kv_scales: dict[int, list[float | None]] = {}
        #: Per-layer (k_scale, v_scale) applied around attention for a tensor-scaled fp8
        #: cache (set by the runner; None: none).
        self.kv_scales: dict[int, tuple[float, float]] | None = None
        #: The residual stream's dtype (what pipeline stages exchange), and the same when
        #: it differs from the activations' (float32 beside bf16/fp16), else None: what
        #: the layers pass as ``stream_dtype`` (set by :meth:`set_residual_dtype`).
        self.residual_dtype: torch.dtype = dtype
        self.stream_dtype: torch.dtype | None = None

    def state_bytes(self, cache_dtype: torch.dtype) -> int:
        """Bytes of one request's state in one recurrent-state layer on this rank (what a
        state group's pages must hold): ``self.state``, the family's
        :class:`~pagedserve.models.recurrent.StateLayout`, stored in the model's dtype
        whatever the KV cache's ``cache_dtype``."""
        state = getattr(self, "state", None)
        if state is None:
            raise TypeError(f"{type(self).__name__} has no recurrent-state layers")
        return state.nbytes(cache_dtype)

    def residual_refusal(self) -> str | None:
        """Why this model cannot keep a float32 residual stream beside its activations, or
        None: the family's layers do not (``float32_residual``), or an op registry's
        ``fused_add_rms_norm`` does not take a float32 residual (``float32_residual``)."""
        if not self.float32_residual:
            return f"{self.cfg.architecture}'s layers keep their residual stream in the model's dtype"
        for ops in {id(pl.ops): pl.ops for pl in self.placements}.values():
            has = getattr(ops, "has_capability", None)
            if has is None or not has("fused_add_rms_norm", "float32_residual"):
                return (
                    "the platform's fused_add_rms_norm does not take a float32 residual (capability float32_residual)"
                )
        return None

    def float32_sums(self) -> bool:
        """Whether the loaded o / down projections (``residual_fields``) return float32 sums
        (``QuantizedWeight.float32_accumulation``: GGUF blocks kept quantized; a file's
        float tensors beside them add to the stream in bf16)."""
        weights = [getattr(layer, name, None) for layer in self.layers for name in self.residual_fields]
        return any(isinstance(w, QuantizedWeight) and w.float32_accumulation for w in weights)

    #: Holder attributes of the projections that write into the residual stream.
    residual_fields: ClassVar[tuple[str, ...]] = ("o", "down")

    def set_residual_dtype(self, setting: str) -> None:
        """The residual stream's dtype from the ``residual_dtype`` setting: "model" keeps
        the model's dtype; "float32" keeps float32 (refused, naming why, where
        :meth:`residual_refusal` says so); "auto" is float32 where the model's dtype is
        narrower, the family and ops can, and the o / down projections sum in float32 (a
        GGUF model kept in blocks: docs/quantization.md), else the model's dtype.  The
        runner calls it before the weights load (the refusal) and again after ("auto")."""
        if setting not in RESIDUAL_DTYPES:
            raise ValueError(f"residual_dtype must be one of {', '.join(RESIDUAL_DTYPES)}; got {setting!r}")
        stream = self.dtype
        if self.dtype != torch.float32 and setting != "model":
            refusal = self.residual_refusal()
            if setting == "float32" and refusal is not None:
                raise ValueError(f"residual_dtype='float32' is not supported here: {refusal}")
            if setting == "float32" or (refusal is None and self.float32_sums()):
                stream = torch.float32
            elif refusal is not None and self.float32_sums():
                logger.info("residual_dtype='auto': the residual stream stays %s: %s", self.dtype, refusal)
        self.residual_dtype = stream
        self.stream_dtype = None if stream == self.dtype else stream

    def set_kv_scales(self, scales: dict[int, tuple[float, float]] | None) -> None:
        """The per-layer (k_scale, v_scale) of a tensor-scaled fp8 cache, by model-wide
        layer (None: none); the runner decides them when it sizes the KV cache."""
        self.kv_scales = scales

    #: Whether this family's attention reads row-scaled KV caches and per-layer scales
    #: (every family through layers.paged_attention; not latent attention).
    row_scaled_kv: ClassVar[bool] = True

    # -- family hooks -----------------------------------------------------------------------
    @classmethod
    def kv_cache_heads(cls, hf: dict) -> int:
        """KV heads the cache stores per token for config.json ``hf`` (before tensor
        parallelism): the checkpoint's key/value heads."""
        return hf.get("num_key_value_heads") or hf["num_attention_heads"]

    @classmethod
    def kv_head_dim(cls, hf: dict) -> int:
        """The attention (and KV cache) head size for config.json ``hf``."""
        return hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]

    def attention_scale(self) -> float:
        return self.cfg.head_dim**-0.5

    def make_rope(self, devices: list[torch.device]) -> RotaryEmbedding | None:
        cfg = self.cfg
        section = mrope_section(cfg.hf_config)
        if section is not None:  # Qwen-VL: 3-D positions for image tokens
            return MRotaryEmbedding(
                self.rotary_dim(),
                self.max_positions,
                cfg.rope_theta,
                cfg.rope_scaling,
                devices,
                section,
                mrope_interleaved(cfg.hf_config),
            )
        return RotaryEmbedding(self.rotary_dim(), self.max_positions, cfg.rope_theta, cfg.rope_scaling, devices)

    def rotary_dim(self) -> int:
        """Dims of each head that RoPE rotates: head_dim times ``partial_rotary_factor``
        (top-level, or in transformers 5's ``rope_parameters``)."""
        hf = self.cfg.hf_config
        params = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
        factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
        return int(self.cfg.head_dim * float(factor))

    def load_global(self, name: str, tensor: torch.Tensor) -> bool:
        """Take a checkpoint tensor outside the layers that the base does not know (e.g.
        a final norm's bias); False means it is unexpected."""
        return False

    def layer_weight_names(self, layer: int) -> frozenset[str]:
        """Checkpoint names (after ``model.layers.<i>.``) of model-wide layer ``layer``."""
        raise NotImplementedError

    def finish_layer(self, layer, weights: dict[str, torch.Tensor], param) -> None:
        """Fill holder ``layer`` from its checkpoint tensors; ``param(t)`` puts a tensor in
        the model dtype on the layer's device."""
        raise NotImplementedError

    def layer_forward(
        self,
        ops,
        placement: int,
        index: int,
        layer,
        kv_cache: KVCache,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decoder layer (model-wide ``index``); (x, residual) [n, hidden] in and out."""
        raise NotImplementedError

    # -- loading ----------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Consume (HF name, tensor) pairs; a layer is finished once all its tensors came."""
        pending: dict[int, dict[str, torch.Tensor]] = {}
        seen: set[str] = set()
        for name, tensor in weights:
            seen.add(name)
            if self._kv_scale(name, tensor):
                continue
            tensor = self._shard(name, tensor)
            if name == "model.embed_tokens.weight":
                self.embed = self._param(tensor)
            elif name == "model.norm.weight":
                self.norm = self._param(tensor, self.head_device)
            elif name == "lm_head.weight":
                self.lm_head = self._param(tensor, self.head_device)
            elif name.startswith("model.layers."):
                parts = name.split(".")
                idx = int(parts[2])
                if idx >= self.cfg.num_layers:
                    raise ValueError(f"weight {name!r} refers to layer {idx}, the model has {self.cfg.num_layers}")
                if not self.layer_start <= idx < self.layer_end:
                    continue  # another pipeline stage owns this layer
                if "rotary_emb.inv_freq" in name:
                    continue
                expected = self.layer_weight_names(idx)
                local = ".".join(parts[3:])
                if local not in expected:
                    raise ValueError(f"unexpected weight {name!r} in a {self.cfg.architecture} checkpoint")
                got = pending.setdefault(idx, {})
                got[local] = tensor
                if len(got) == len(expected):
                    self._finish(idx, pending.pop(idx))
            elif "rotary_emb.inv_freq" in name:
                continue
            elif name == "score.weight" and self.cfg.num_labels is not None:
                # A sequence-classification head: the engine applies it to the pooled
                # last-token state (ModelSource.tensor, pagedserve.pooling); no rank needs it.
                continue
            elif self.load_global(name, tensor):
                continue
            else:
                raise ValueError(f"unexpected weight {name!r} in a {self.cfg.architecture} checkpoint")
        if pending:
            idx, got = next(iter(pending.items()))
            missing = sorted(self.layer_weight_names(idx) - set(got))
            raise ValueError(f"layer {idx} is missing weights: {', '.join(missing)}")
        if self.embed is None or self.norm is None:
            raise ValueError("checkpoint lacks model.embed_tokens.weight or model.norm.weight")
        if self.lm_head is None:
            # A sequence-classification checkpoint has no LM head; the engine refuses to
            # generate with it, and the embeddings stand in for the runner's dummy steps.
            classifier = self.cfg.num_labels is not None
            if not classifier and not self.cfg.tie_word_embeddings and "lm_head.weight" not in seen:
                raise ValueError("checkpoint lacks lm_head.weight and does not tie word embeddings")
            # Tied: the same tensor, or a copy when the last placement is on another device.
            self.lm_head = self.embed if self.head_device == self.device else self._param(self.embed, self.head_device)

    def _kv_scale(self, name: str, tensor: torch.Tensor) -> bool:
        """Keep a checkpoint's per-layer KV cache scale (``model.layers.N.self_attn.k_scale``,
        ``.v_scale``, or an older ``.kv_scale`` for both); False for any other tensor."""
        parts = name.split(".")
        if len(parts) != 5 or parts[:2] != ["model", "layers"] or parts[3] != "self_attn":
            return False
        if parts[4] not in ("k_scale", "v_scale", "kv_scale"):
            return False
        if tensor.numel() != 1:
            raise ValueError(
                f"{name} must hold one value (a per-layer KV cache scale), got shape {tuple(tensor.shape)}"
            )
        value = float(tensor.float().reshape(()))
        if not value > 0 or value == float("inf"):
            raise ValueError(f"{name} = {value} is not a positive finite KV cache scale")
        pair = self.checkpoint_kv_scales.setdefault(int(parts[2]), [None, None])
        for i in {"k_scale": (0,), "v_scale": (1,), "kv_scale": (0, 1)}[parts[4]]:
            pair[i] = value
        return True

    def _finish(self, idx: int, weights: dict[str, torch.Tensor]) -> None:
        local = idx - self.layer_start
        dev = self._layer_device[local]
        self.finish_layer(self.layers[local], weights, lambda t: self._param(t, dev))

    def prepare_stacked_experts(self) -> None:
        """Each layer's stacked routed experts (``w13``/``w2`` tensors; families with MoE
        layers) through its placement's ``prepare_moe_weights``."""
        for pl in self.placements:
            for layer in self.layers[pl.start - self.layer_start : pl.end - self.layer_start]:
                if isinstance(getattr(layer, "w13", None), torch.Tensor):
                    layer.w13, layer.w2 = pl.ops.prepare_moe_weights(layer.w13, layer.w2)

    def prepare_linear_weights(self) -> None:
        """Hand every dense linear weight to its placement's ``prepare_linear_weight`` op
        (e.g. the CPU's one-time oneDNN packing); quantized weights take their own
        prepared form (``QuantizedWeight.prepared``, e.g. repacked GGUF blocks).
        A tied LM head gets a prepared copy when the op returns a new tensor, the plain
        embedding staying for token lookups, unless the quantized embedding reads its rows
        from the prepared form (then both are that one weight)."""
        for pl in self.placements:
            prepare = pl.ops.prepare_linear_weight
            for layer in self.layers[pl.start - self.layer_start : pl.end - self.layer_start]:
                for name in self.linear_fields:
                    w = getattr(layer, name)
                    if isinstance(w, torch.Tensor):
                        setattr(layer, name, prepare(w))
                    elif isinstance(w, QuantizedWeight):
                        setattr(layer, name, w.prepared())
        if isinstance(self.lm_head, torch.Tensor):
            self.lm_head = self.head_ops.prepare_linear_weight(self.lm_head)
        elif isinstance(self.lm_head, QuantizedWeight):
            tied = self.lm_head is self.embed
            self.lm_head = self.lm_head.prepared()
            # A tied head's prepared form is a new weight; where rows can be read from it,
            # the embedding shares it (no second copy of the vocabulary), else keeps its own.
            if tied and getattr(self.lm_head, "embeds_prepared", False):
                self.embed = self.lm_head

    def prepare_quantized_weights(self) -> None:
        """Only the quantized linear weights (and a quantized LM head) take their prepared
        form: under weight offload dense weights stay plain for the staging layers, while
        a prepared quantized weight streams as its tensors and multiplies as it does when
        resident."""
        for layer in self.layers:
            for name in self.linear_fields:
                w = getattr(layer, name)
                if isinstance(w, QuantizedWeight):
                    setattr(layer, name, w.prepared())
        if isinstance(self.lm_head, QuantizedWeight):
            self.lm_head = self.lm_head.prepared()

    def _shard(self, name: str, t: torch.Tensor | QuantizedWeight) -> torch.Tensor | QuantizedWeight:
        """This tensor-parallel rank's slice of checkpoint tensor ``name`` (a view)."""
        p = self.parallel
        if p.tp_size == 1:
            return t
        if isinstance(t, QuantizedWeight):
            return self._shard_quantized(name, t)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            pad = self.vocab_shard * p.tp_size - t.shape[0]
            if pad:
                t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])])
            return t[self.vocab_start : self.vocab_start + self.vocab_shard]
        if not name.startswith("model.layers."):
            return t
        return self.shard_layer_tensor(name.split(".", 3)[3], t)

    def _shard_quantized(self, name: str, w: QuantizedWeight) -> torch.Tensor | QuantizedWeight:
        """This rank's slice of quantized weight ``name``, kept in its format: the rows
        and columns the float path would keep (found by sharding index tensors the way
        ``_shard`` shards the float weight, so every family's split applies), whole rows
        (with their scales) of a column-parallel weight, whole blocks of each row of a
        row-parallel one.  Where the format cannot split there (a row-parallel shard
        that is not a whole number of GGUF blocks), this one weight is dequantized and
        sliced as a float, with a log line."""
        n, k = w.out_features, w.in_features
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            # Rows past the vocabulary select zero rows (the last shard's padding).
            rows, cols = torch.arange(self.vocab_start, self.vocab_start + self.vocab_shard), torch.arange(k)
        elif name.startswith("model.layers."):
            local = name.split(".", 3)[3]
            rows = self.shard_layer_tensor(local, torch.arange(n, dtype=torch.int32).view(n, 1).expand(n, k))[:, 0]
            cols = self.shard_layer_tensor(local, torch.arange(k, dtype=torch.int32).view(1, k).expand(n, k))[0]
        else:
            return w
        rows, cols = rows.long(), cols.long()
        start, stop = int(cols[0]), int(cols[-1]) + 1
        part: QuantizedWeight | None = None
        if torch.equal(cols, torch.arange(start, stop)):
            try:
                part = w if torch.equal(rows, torch.arange(n)) else w.select_rows(rows)
                if (start, stop) != (0, k):
                    part = part.select_columns(start, stop)
            except NotImplementedError:
                part = None
        if part is not None:
            return part
        kind = str(getattr(w, "type_name", type(w).__name__))
        if kind not in self._dequantized_shards:
            self._dequantized_shards.add(kind)
            logger.info(
                "%s: its %s shard for tensor_parallel_size=%d (input columns %d-%d of %d) is not whole blocks: "
                "dequantized to %s (and every other %s weight split the same way)",
                name,
                kind,
                self.parallel.tp_size,
                start,
                stop,
                k,
                self.dtype,
                kind,
            )
        return self._shard(name, w.dequantize(self.dtype))

    def shard_layer_tensor(self, local: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's slice of layer tensor ``local`` (the name after ``model.layers.<i>.``).

        Column-parallel projections keep this rank's output rows (of each part of a
        checkpoint-fused one, e.g. Phi-3's ``qkv_proj``), row-parallel ones this rank's
        input columns; a row-parallel bias stays whole (the model adds it once, after the
        all-reduce); everything else (norms, routers) is replicated.  Sizes come from the
        tensor itself, so experts and shared experts of any width split the same way."""
        kind, leaf = local.rsplit(".", 2)[-2:]
        r, tp = self.parallel.tp_rank, self.parallel.tp_size
        if kind == "q_proj":
            return self.q_rows(t)
        if kind in ("k_proj", "v_proj"):
            return self.kv_rows(t)
        if kind == "qkv_proj":
            hd = self.cfg.head_dim
            q, k, v = t.split([self.cfg.num_heads * hd, self.cfg.num_kv_heads * hd, self.cfg.num_kv_heads * hd])
            return torch.cat([self.q_rows(q), self.kv_rows(k), self.kv_rows(v)])
        if kind in _COLUMN:
            return even_slice(local, t, 0, r, tp)
        if kind in _FUSED_COLUMN:
            return torch.cat([even_slice(local, half, 0, r, tp) for half in t.chunk(2)])
        if kind == "o_proj" and leaf == "weight":
            return t[:, r * self.q_size : (r + 1) * self.q_size]
        if kind in _ROW and leaf == "weight":
            return even_slice(local, t, 1, r, tp)
        return t

    def q_rows(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's query heads of a [num_heads * head_dim, ...] tensor."""
        r = self.parallel.tp_rank
        return t[r * self.q_size : (r + 1) * self.q_size]

    def kv_rows(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's KV heads of a [num_kv_heads * head_dim, ...] tensor; with fewer KV
        heads than ranks each rank keeps the one KV head its query heads use."""
        p, cfg, hd = self.parallel, self.cfg, self.cfg.head_dim
        r = p.tp_rank
        first = r * self.num_kv_heads if cfg.num_kv_heads >= p.tp_size else r * cfg.num_kv_heads // p.tp_size
        return t[first * hd : (first + self.num_kv_heads) * hd]

    def _param(
        self, t: torch.Tensor | QuantizedWeight, device: torch.device | None = None
    ) -> torch.Tensor | QuantizedWeight:
        device = self.device if device is None else device
        if isinstance(t, QuantizedWeight):  # stays in its quantized form (pagedserve.quantization)
            return t.to(device)
        return t.to(device=device, dtype=self.dtype).contiguous()

    def weight_bytes(self) -> int:
        return sum(self.placement_weight_bytes())

    def placement_weight_bytes(self) -> list[int]:
        """Weight bytes held on each placement's device (embedding on the first, final
        norm and LM head on the last)."""
        out = []
        for i, pl in enumerate(self.placements):
            tensors = []
            if i == 0:
                tensors.append(self.embed)
            if i == len(self.placements) - 1:
                tensors.append(self.norm)
                if self.lm_head is not self.embed:
                    tensors.append(self.lm_head)
            for layer in self.layers[pl.start - self.layer_start : pl.end - self.layer_start]:
                for n in type(layer).__slots__:
                    t = getattr(layer, n, None)
                    tensors += t if isinstance(t, list) else [t]  # a list: one weight per expert
            out.append(sum(t.nbytes for t in tensors if isinstance(t, (torch.Tensor, QuantizedWeight))))
        return out

    # -- forward ------------------------------------------------------------------------------
    def set_layer_stream(self, stream) -> None:
        """Run the layers through ``stream`` (the layer list in, the layers to run out);
        None runs them as they are."""
        self.layer_stream = stream

    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
        embeds: tuple | None = None,
    ) -> torch.Tensor:
        """input_ids int64 [num_tokens] -> final hidden states [num_tokens, hidden].

        ``embeds`` (rows int64 [m], values [m, hidden][, deepstack]): embeddings that
        replace those of the tokens at ``rows`` (a vision-language model's image
        features); ``deepstack`` (Qwen3-VL), a list of [m, hidden]: entry ``i`` is added
        to the same rows' hidden states after decoder layer ``i``."""
        x = self.embed_tokens(input_ids)
        deepstack = None
        if embeds is not None:
            x = x.index_copy(0, embeds[0], embeds[1].to(x.dtype))
            if len(embeds) > 2 and embeds[2]:
                deepstack = (embeds[0], list(embeds[2]))
        x, residual = self.forward_layers(x, None, meta, kv_caches, deepstack)
        return self.final_norm(x, residual)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids int64 [n] -> [n, hidden]; vocab-parallel: rows outside this rank's
        shard are zeroed and the ranks' partial embeddings summed."""
        p = self.parallel
        if p.tp_size == 1:
            if isinstance(self.embed, QuantizedWeight):
                return self.embed.embedding(input_ids, self.dtype)
            return self.ops.embedding(input_ids, self.embed)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_shard)
        local = local.masked_fill(outside, 0)
        if isinstance(self.embed, QuantizedWeight):
            x = self.embed.embedding(local, self.dtype)
        else:
            x = self.ops.embedding(local, self.embed)
        return p.all_reduce(x.masked_fill(outside.unsqueeze(-1), 0))

    def forward_layers(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
        deepstack: tuple[torch.Tensor, list[torch.Tensor]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run this stage's layers; (x, residual) [num_tokens, hidden] in and out
        (residual None before the first layer), which is what pipeline stages exchange.
        Under a device map they come back on the last placement's device.  ``deepstack``
        (rows, per-layer additions): see :meth:`forward`."""
        if len(self.placements) == 1:
            layers = self.layers if self.layer_stream is None else self.layer_stream(self.layers)
            return self._run_layers(self.ops, 0, self.layer_start, layers, kv_caches, x, residual, meta, deepstack)
        base = self.layer_start
        for i, pl in enumerate(self.placements):
            x = pl.move(x)
            residual = None if residual is None else pl.move(residual)
            if deepstack is not None:
                deepstack = (pl.move(deepstack[0]), [pl.move(t) for t in deepstack[1]])
            lo, hi = pl.start - base, pl.end - base
            x, residual = self._run_layers(
                pl.ops, i, pl.start, self.layers[lo:hi], kv_caches[lo:hi], x, residual, meta.apply(pl.move), deepstack
            )
        return x, residual

    def _run_layers(
        self,
        ops,
        placement: int,
        first: int,
        layers: Iterable,
        kv_caches: list[KVCache],
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
        deepstack: tuple[torch.Tensor, list[torch.Tensor]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``layers`` (model-wide indices from ``first``) with the op registry ``ops``;
        every tensor on the same device."""
        scales = self.kv_scales
        for i, (layer, kv) in enumerate(zip(layers, kv_caches)):
            if scales is not None and first + i in scales:  # a tensor-scaled fp8 cache
                kv = ScaledKVCache(kv[0], kv[1], *scales[first + i])
            # Each layer attends through its KV cache group's block tables (one group: meta).
            layer_meta = meta.for_layer(first + i)
            x, residual = self.layer_forward(ops, placement, first + i, layer, kv, x, residual, layer_meta)
            if deepstack is not None and first + i < len(deepstack[1]):
                # The layer's hidden state is x + residual: adding to x adds to it.
                x = x.index_add(0, deepstack[0], deepstack[1][first + i].to(x.dtype))
        return x, residual

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if self.stream_dtype is not None:  # a float32 stream: the row in the model's dtype
            h, _ = self.head_ops.fused_add_rms_norm(x, residual, self.norm, self.cfg.rms_norm_eps, out_dtype=self.dtype)
            return h
        h, _ = self.head_ops.fused_add_rms_norm(x, residual, self.norm, self.cfg.rms_norm_eps)
        return h

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """hidden [n, hidden_size] -> logits [n, vocab] (float32, or the LM head's output
        dtype with ``float32=False``: float32 too for a quantized head that accumulates in
        float32, such as GGUF's), on the last placement's device."""
        if isinstance(self.lm_head, QuantizedWeight) and self.lm_head.float32_accumulation:
            # Its float32 sums come back unrounded (float32 logits whatever ``float32``).
            hidden = hidden.float()
        logits = linear(self.head_ops, hidden, self.lm_head)
        if float32:
            logits = logits.float()
        if self.parallel.tp_size > 1:
            logits = self.parallel.all_gather(logits)[:, : self.cfg.vocab_size]
        return logits
