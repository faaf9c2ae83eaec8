"""Gemma 4 (text, ``Gemma4ForCausalLM``), as transformers implements it, with the
released checkpoints' per-layer embeddings, KV sharing and MoE block.

What differs from Gemma 3: RMSNorm weights multiply as ``w`` (not ``1 + w``); values
get an RMSNorm without weight, queries and keys a per-head one, and the attention scale
is 1; full-attention layers have their own head size (``per_layer_config`` /
``global_head_dim``, 512 against 256 at the published sizes) and may have their own KV
head count (``num_global_key_value_heads`` with ``attention_k_eq_v``, which also makes
those layers' values the key projection's output, before the key norm and RoPE); the
full layers' RoPE is "proportional" (only the first ``partial_rotary_factor`` of the
frequencies rotate, with exponents over the whole head size; the rest stay still); and
each layer's output (the whole residual stream) is multiplied by its ``layer_scalar``.
Sandwich norms, GeGLU, scaled embeddings and final-logit soft-capping are Gemma 2/3's.

Per-layer embeddings (PLE, ``hidden_size_per_layer_input`` P > 0: E2B/E4B): once per
step every token gets ``[num_layers, P]`` inputs, ``(norm(proj(embedding) / sqrt(hidden))
+ table[token] * sqrt(P)) / sqrt(2)``, from a ``[vocab, num_layers * P]`` table (kept in
the checkpoint's dtype when that is narrower) and a projection of the token's scaled
embedding; each layer ends with ``stream += norm(proj(act(gate(stream)) * input_i))``.
They depend on the token alone, so chunked prefill, prefix caching and preemption need
nothing more.

KV sharing (``num_kv_shared_layers``): the last layers each read the keys and values of
the last earlier layer of their attention type (gemma4_config.kv_sources): they have no
k/v projections, write nothing and get no KV cache of their own (their cache "window" is
``NO_KV_CACHE``, so the KV cache groups leave them out); they attend over their source's
cache with their source's block tables.

The MoE block (``enable_moe_block``): beside the dense MLP, a router (a weightless norm
of the stream times ``scale / sqrt(hidden)``, softmax, top-k, renormalised, times
``per_expert_scale``) and experts run through the ``fused_moe`` op; the two outputs are
normed and summed before the post-feed-forward norm.

The paged cache has one head size and KV head count for every layer: the largest of
each.  A layer with smaller heads zero-pads its queries, keys and values (the scores do
not change; the output is sliced back) and a layer with fewer KV heads repeats each so
that every query head still reads its own -- exact, at the cost of KV memory on the
sliding layers (half their cache is padding at the published sizes).

Tensor parallelism splits each layer by its own shape: a rank keeps ``heads / tp`` query
heads of that layer's head size and ``kv / tp`` of its KV heads (or, with fewer KV heads
than ranks, the one its query heads read, replicated as the other families do); the
cache holds ``max(kv) / tp`` heads (at least one) per rank.  ``o_proj`` and ``down_proj``
are row-parallel, summed over the ranks before their norms; the MoE block's experts are
split by intermediate rows (``gate_up_proj`` rows of each half, ``down_proj`` columns)
and their sum reduced apart from the dense MLP's, as each has its own norm.  Routers,
norms, layer scalars and the per-layer embeddings (table, projection, and each layer's
gate and projection) stay whole on every rank: they act on the whole stream.  A
KV-sharing layer reads its source layer's shard of the cache on the same rank.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from pagedserve.models.arch_config import ArchConfig
from pagedserve.models.decoder import DecoderForCausalLM, KVCache, even_slice
from pagedserve.models.gemma4_config import (
    MOE_ACTIVATIONS,
    check_gemma4_config,
    kv_sources,
    layer_shapes,
    layer_types,
)
from pagedserve.models.layers import (
    RotaryEmbedding,
    ScaledKVCache,
    fuse,
    gated_mlp,
    head_rms_norm,
    layer_windows,
    linear,
    paged_attention,
    route_topk,
)

if TYPE_CHECKING:
    from pagedserve.executor.attention_metadata import AttentionMetadata

__all__ = ["Gemma4ForCausalLM", "Gemma4Layer", "ProportionalRotaryEmbedding"]

_DEFAULT_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}

_PLE_NAMES = {
    "model.embed_tokens_per_layer.weight": "ple_table",
    "model.per_layer_model_projection.weight": "ple_projection",
    "model.per_layer_projection_norm.weight": "ple_norm",
}


#: Layer tensors whose split depends on the layer's head size and KV heads.
_PER_LAYER_SHAPED = frozenset(f"self_attn.{p}_proj.weight" for p in "qkvo")


class ProportionalRotaryEmbedding(RotaryEmbedding):
    """transformers' "proportional" RoPE over a whole head of ``head_dim``: frequency i is
    ``base ** (-2i / head_dim) / factor`` for the first ``int(fraction * head_dim / 2)``
    pairs and zero (no rotation) for the rest."""

    def __init__(self, head_dim: int, max_position: int, base: float, fraction: float, factor: float, devices) -> None:
        self.rotary_dim = head_dim
        rotated = int(fraction * head_dim // 2)
        inv_freq = torch.zeros(head_dim // 2)
        inv_freq[:rotated] = 1.0 / (base ** (torch.arange(0, 2 * rotated, 2, dtype=torch.int64).float() / head_dim))
        inv_freq = inv_freq / factor
        freqs = torch.outer(torch.arange(max_position, dtype=torch.int64).float(), inv_freq)
        table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        self.tables = [table.to(d) for d in devices]


class Gemma4Layer:
    """One layer: the four sandwich norms [hidden], q/k norms [head], q/k/v or q/k
    (``attention_k_eq_v``; q alone on a KV-sharing layer), o, gate_up, down, the layer
    scalar (a Python float); with PLE its gate [P, hidden], projection [hidden, P] and
    norm [hidden]; with the MoE block the router [E, hidden], its scale [hidden], the
    per-expert scale [E], w13 [E, 2 * I, hidden], w2 [E, hidden, I] and three norms."""

    __slots__ = (
        "input_norm",
        "post_attn_norm",
        "pre_ff_norm",
        "post_ff_norm",
        "q",
        "k",
        "v",
        "q_norm",
        "k_norm",
        "o",
        "gate_up",
        "down",
        "scalar",
        "ple_gate",
        "ple_proj",
        "post_ple_norm",
        "router",
        "router_scale",
        "expert_scale",
        "w13",
        "w2",
        "post_ff_norm_1",
        "pre_ff_norm_2",
        "post_ff_norm_2",
    )


class Gemma4ForCausalLM(DecoderForCausalLM):
    layer_class = Gemma4Layer
    linear_fields = ("q", "k", "v", "o", "gate_up", "down", "ple_gate", "ple_proj")

    @classmethod
    def kv_cache_heads(cls, hf: dict[str, Any]) -> int:
        return max(kv for _, kv in layer_shapes(hf, hf["num_hidden_layers"]))

    @classmethod
    def kv_head_dim(cls, hf: dict[str, Any]) -> int:
        return max(d for d, _ in layer_shapes(hf, hf["num_hidden_layers"]))

    @classmethod
    def pipeline_refusal(cls, hf: dict[str, Any]) -> str | None:
        if int(hf.get("hidden_size_per_layer_input") or 0):
            return "per-layer embeddings (hidden_size_per_layer_input > 0) are computed from the token ids on one stage"
        if int(hf.get("num_kv_shared_layers") or 0):
            return "KV-sharing layers (num_kv_shared_layers > 0) read the cache of an earlier layer on the same stage"
        return None

    @classmethod
    def tensor_parallel_refusal(cls, hf: dict[str, Any], tp: int) -> str | None:
        n = int(hf["num_hidden_layers"])
        for i, ((_, kv), kind) in enumerate(zip(layer_shapes(hf, n), layer_types(hf, n))):
            if kv % tp and tp % kv:
                return (
                    f"layer {i} ({kind}) has {kv} KV heads: the ranks must divide them or be a multiple of them "
                    "(num_key_value_heads, num_global_key_value_heads or per_layer_config)"
                )
        return None

    @classmethod
    def check_config(cls, cfg: ArchConfig) -> None:
        super().check_config(cfg)
        hf = cfg.hf_config
        if cfg.attention_bias:
            raise ValueError(f"{cfg.architecture}: attention_bias=true is not supported")
        check_gemma4_config(hf, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads)
        layer_windows({**hf, "layer_types": layer_types(hf, cfg.num_layers)}, cfg.num_layers)
        for kind, params in cls._rope_params(hf).items():
            rope_type = params.get("rope_type", "default")
            if rope_type not in ("default", "proportional"):
                raise ValueError(
                    f"{cfg.architecture}: {kind} rope_type {rope_type!r} is not supported (default, proportional)"
                )

    @staticmethod
    def _rope_params(hf: dict[str, Any]) -> dict[str, dict[str, Any]]:
        params = hf.get("rope_parameters")
        params = params if isinstance(params, dict) else {}
        return {kind: {**default, **(params.get(kind) or {})} for kind, default in _DEFAULT_ROPE.items()}

    def __init__(self, cfg: ArchConfig, *args, **kwargs) -> None:
        hf = cfg.hf_config
        self.layer_types = layer_types(hf, cfg.num_layers)
        self.shapes = layer_shapes(hf, cfg.num_layers)
        super().__init__(cfg, *args, **kwargs)
        self.activation = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
        typed = {**hf, "layer_types": self.layer_types}
        #: Each layer's KV cache kind (the runner groups layers by it): a KV-sharing layer has none.
        self.windows = layer_windows(typed, cfg.num_layers)
        #: Each layer's attention window (None: full), a KV-sharing layer's its source's.
        self.attn_windows = layer_windows({**typed, "num_kv_shared_layers": 0}, cfg.num_layers)
        self.kv_sources = kv_sources(hf, cfg.num_layers)
        for i, src in enumerate(self.kv_sources):
            here = self.layer_start <= i < self.layer_end
            if here and src is not None and not any(pl.start <= src and i < pl.end for pl in self.placements):
                raise ValueError(
                    f"layer {i} reads the KV cache of layer {src} (num_kv_shared_layers), which this "
                    "pipeline stage or device-map segment does not hold: keep them on one"
                )
        self.final_soft_cap: float | None = hf.get("final_logit_softcapping")
        self.k_eq_v = bool(hf.get("attention_k_eq_v"))
        self.embed_scale = torch.tensor(cfg.hidden_size**0.5, dtype=self.dtype)
        self.ple_size = int(hf.get("hidden_size_per_layer_input") or 0)
        self.ple_table: torch.Tensor | None = None
        self.ple_projection: torch.Tensor | None = None
        self.ple_norm: torch.Tensor | None = None
        self.ple_scale = torch.tensor(self.ple_size**0.5, dtype=self.dtype)
        #: The step's per-layer inputs [n, num_layers, P] while ``forward`` runs the layers.
        self._per_layer_inputs: torch.Tensor | None = None
        #: The token ids of the last ``embed_tokens`` (with PLE), for ``forward_layers``.
        self._embedded_ids: torch.Tensor | None = None
        self.moe = bool(hf.get("enable_moe_block"))
        self.top_k = int(hf.get("top_k_experts") or 0)
        r, tp = self.parallel.tp_rank, self.parallel.tp_size
        #: Per layer, this rank's (head size, KV heads, first KV head of the checkpoint's).
        self.local_shapes = [(d, max(1, kv // tp), r * kv // tp) for d, kv in self.shapes]
        for i, (_, kv, _) in enumerate(self.local_shapes):
            if self.num_kv_heads % kv or self.num_heads % self.num_kv_heads:
                raise ValueError(
                    f"layer {i}: {kv} KV heads per rank do not divide the cache's {self.num_kv_heads} "
                    f"(tensor_parallel_size={tp})"
                )
        #: The model-wide layer whose tensor ``_shard`` is splitting (shard_layer_tensor's names lack it).
        self._shard_layer: int | None = None

    def attention_scale(self) -> float:
        return 1.0

    def make_rope(self, devices: list[torch.device]) -> RotaryEmbedding:
        """One table per layer type, each over its layers' head size."""
        params, pos = self._rope_params(self.cfg.hf_config), self.max_positions
        self.ropes: dict[str, RotaryEmbedding] = {}
        for kind in set(self.layer_types):
            p = params[kind]
            head = next(d for (d, _), t in zip(self.shapes, self.layer_types) if t == kind)
            if p.get("rope_type", "default") == "proportional":
                fraction, factor = float(p.get("partial_rotary_factor", 1.0)), float(p.get("factor", 1.0))
                rope = ProportionalRotaryEmbedding(head, pos, float(p["rope_theta"]), fraction, factor, devices)
            else:
                rope = RotaryEmbedding(head, pos, float(p["rope_theta"]), None, devices)
            self.ropes[kind] = rope
        return self.ropes[self.layer_types[-1]]

    # -- loading ------------------------------------------------------------------------------
    def _uses_v(self, layer: int) -> bool:
        return not (self.k_eq_v and self.layer_types[layer] == "full_attention")

    def layer_weight_names(self, layer: int) -> frozenset[str]:
        names = {
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
            "pre_feedforward_layernorm.weight",
            "post_feedforward_layernorm.weight",
            "layer_scalar",
            "self_attn.q_proj.weight",
            "self_attn.o_proj.weight",
            "self_attn.q_norm.weight",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
        }
        if self.kv_sources[layer] is None:
            names |= {"self_attn.k_proj.weight", "self_attn.k_norm.weight"}
            if self._uses_v(layer):
                names.add("self_attn.v_proj.weight")
        if self.ple_size:
            names |= {"per_layer_input_gate.weight", "per_layer_projection.weight", "post_per_layer_input_norm.weight"}
        if self.moe:
            names |= {
                "router.proj.weight",
                "router.scale",
                "router.per_expert_scale",
                "experts.gate_up_proj",
                "experts.down_proj",
                "post_feedforward_layernorm_1.weight",
                "pre_feedforward_layernorm_2.weight",
                "post_feedforward_layernorm_2.weight",
            }
        return frozenset(names)

    def finish_layer(self, layer: Gemma4Layer, w: dict[str, Any], param) -> None:
        a = "self_attn."

        def opt(name: str):
            return param(w[name]) if name in w else None

        layer.input_norm = param(w["input_layernorm.weight"])
        layer.post_attn_norm = param(w["post_attention_layernorm.weight"])
        layer.pre_ff_norm = param(w["pre_feedforward_layernorm.weight"])
        layer.post_ff_norm = param(w["post_feedforward_layernorm.weight"])
        layer.scalar = float(w["layer_scalar"].float().reshape(-1)[0])
        layer.q = param(w[a + "q_proj.weight"])
        layer.k, layer.v, layer.k_norm = opt(a + "k_proj.weight"), opt(a + "v_proj.weight"), opt(a + "k_norm.weight")
        layer.q_norm = param(w[a + "q_norm.weight"])
        layer.o = param(w[a + "o_proj.weight"])
        layer.gate_up = param(fuse([w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"]]))
        layer.down = param(w["mlp.down_proj.weight"])
        layer.ple_gate = opt("per_layer_input_gate.weight")
        layer.ple_proj = opt("per_layer_projection.weight")
        layer.post_ple_norm = opt("post_per_layer_input_norm.weight")
        layer.router = opt("router.proj.weight")
        layer.router_scale = opt("router.scale")
        layer.expert_scale = opt("router.per_expert_scale")
        layer.w13, layer.w2 = opt("experts.gate_up_proj"), opt("experts.down_proj")
        layer.post_ff_norm_1 = opt("post_feedforward_layernorm_1.weight")
        layer.pre_ff_norm_2 = opt("pre_feedforward_layernorm_2.weight")
        layer.post_ff_norm_2 = opt("post_feedforward_layernorm_2.weight")

    def _shard(self, name: str, t):
        """The base's, with the model-wide layer of ``name`` known to ``shard_layer_tensor``
        while it splits (its names lack the index; the head size and KV heads are per layer)."""
        self._shard_layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        try:
            return super()._shard(name, t)
        finally:
            self._shard_layer = None

    def shard_layer_tensor(self, local: str, t: torch.Tensor) -> torch.Tensor:
        """The attention projections by this layer's head size and KV heads, the stacked
        experts by intermediate rows; the rest as every family (see the module docstring)."""
        r, tp = self.parallel.tp_rank, self.parallel.tp_size
        if local in _PER_LAYER_SHAPED:
            if self._shard_layer is None:
                raise RuntimeError(f"{local}: split outside _shard, without its layer's head size and KV heads")
            d, kv, first = self.local_shapes[self._shard_layer]
            q = self.num_heads * d
            if local == "self_attn.q_proj.weight":
                return t[r * q : (r + 1) * q]
            if local == "self_attn.o_proj.weight":
                return t[:, r * q : (r + 1) * q]
            return t[first * d : (first + kv) * d]  # k_proj, v_proj
        if local == "experts.gate_up_proj":  # [E, 2 * I, hidden]: gate rows, then up rows
            return torch.cat([even_slice(local, half, 1, r, tp) for half in t.chunk(2, dim=1)], dim=1)
        if local == "experts.down_proj":  # [E, hidden, I]
            return even_slice(local, t, 2, r, tp)
        if "." not in local:  # layer_scalar
            return t
        return super().shard_layer_tensor(local, t)

    def load_global(self, name: str, tensor: torch.Tensor) -> bool:
        field = _PLE_NAMES.get(name)
        if field is None or not self.ple_size:
            return False
        if field == "ple_table" and tensor.dtype.itemsize <= self.dtype.itemsize:
            # vocab x layers x P values (4.7 GB in bf16 at E2B): not widened to a wider model dtype.
            setattr(self, field, tensor.to(self.device).contiguous())
        else:
            setattr(self, field, self._param(tensor))
        return True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(weights)
        missing = [n for n, f in _PLE_NAMES.items() if self.ple_size and getattr(self, f) is None]
        if missing:
            raise ValueError(f"checkpoint lacks {', '.join(missing)} (hidden_size_per_layer_input > 0)")

    def prepare_linear_weights(self) -> None:
        super().prepare_linear_weights()
        self.prepare_stacked_experts()

    def placement_weight_bytes(self) -> list[int]:
        out = super().placement_weight_bytes()
        out[0] += sum(t.nbytes for t in (self.ple_table, self.ple_projection, self.ple_norm) if t is not None)
        return out

    # -- forward ------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
        embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if not self.ple_size:
            return super().forward(input_ids, meta, kv_caches, embeds)
        x = self.embed_tokens(input_ids)
        ids = input_ids
        if embeds is not None:
            x = x.index_copy(0, embeds[0], embeds[1].to(x.dtype))
            # As transformers: an image token's table row is the pad token's.
            pad = int(self.cfg.hf_config.get("pad_token_id") or 0)
            ids = input_ids.index_fill(0, embeds[0], pad)
        self._embedded_ids = None
        self._per_layer_inputs = self.per_layer_inputs(ids, x)
        try:
            x, residual = self.forward_layers(x, None, meta, kv_caches)
        finally:
            self._per_layer_inputs = None
        return self.final_norm(x, residual)

    def forward_layers(self, x, residual, meta, kv_caches, deepstack=None):
        """The base's; with PLE and no per-layer inputs yet (the other tensor-parallel
        ranks embed the tokens and run the layers without ``forward``: distributed.worker),
        they are computed from the ids and output of the last ``embed_tokens`` first."""
        if not self.ple_size or self._per_layer_inputs is not None:
            return super().forward_layers(x, residual, meta, kv_caches, deepstack)
        ids, self._embedded_ids = self._embedded_ids, None
        if ids is None or residual is not None or ids.shape[0] != x.shape[0]:
            raise RuntimeError("per-layer embeddings: run the layers on the output of embed_tokens")
        self._per_layer_inputs = self.per_layer_inputs(ids, x)
        try:
            return super().forward_layers(x, residual, meta, kv_caches, deepstack)
        finally:
            self._per_layer_inputs = None

    def per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """input_ids int64 [n], x [n, hidden] (the scaled embeddings) -> the per-layer
        inputs [n, num_layers, P] in the model dtype."""
        n, layers, p = input_ids.shape[0], self.cfg.num_layers, self.ple_size
        proj = linear(self.ops, x, self.ple_projection) * self.cfg.hidden_size**-0.5
        proj = self.ops.rms_norm(proj.reshape(n * layers, p), self.ple_norm, self.cfg.rms_norm_eps)
        rows = self.ple_table.index_select(0, input_ids).to(self.dtype) * self.ple_scale.to(x.device)
        return (proj.view(n, layers, p) + rows.view(n, layers, p)) * 2.0**-0.5

    def _run_layers(self, ops, placement, first, layers, kv_caches, x, residual, meta, deepstack=None):
        """The base walk, with a KV-sharing layer given its source layer's cache and block
        tables (the source is on the same placement: checked at construction).  Gemma 4
        has no DeepStack features (``deepstack`` is always None here)."""
        assert deepstack is None, "Gemma 4 takes no DeepStack features"
        kv_caches = list(kv_caches)
        scales = self.kv_scales
        for i, (layer, kv) in enumerate(zip(layers, kv_caches)):
            index = first + i
            src = self.kv_sources[index]
            if src is not None:
                kv = kv_caches[src - first]
            owner = index if src is None else src
            if scales is not None and owner in scales:  # a tensor-scaled fp8 cache: the owner's scales
                kv = ScaledKVCache(kv[0], kv[1], *scales[owner])
            layer_meta = meta.for_layer(index if src is None else src)
            x, residual = self.layer_forward(ops, placement, index, layer, kv, x, residual, layer_meta)
        return x, residual

    def attention(
        self, ops, placement: int, index: int, layer: Gemma4Layer, h: torch.Tensor, kv_cache: KVCache, meta
    ) -> torch.Tensor:
        """h [n, hidden] normed -> [n, heads * this layer's head size]."""
        n, heads, eps = h.shape[0], self.num_heads, self.cfg.rms_norm_eps
        d, kv, _ = self.local_shapes[index]
        cache_d, cache_kv = self.cfg.head_dim, self.num_kv_heads
        rope = self.ropes[self.layer_types[index]]
        q = head_rms_norm(ops, linear(ops, h, layer.q).view(n, heads, d), layer.q_norm, eps).contiguous()
        window = self.attn_windows[index]
        if layer.k is None:  # a KV-sharing layer: its source wrote the keys and values
            q, _ = rope(ops, placement, meta.positions, q, q[:, :1].contiguous())
            if d < cache_d:
                q = torch.nn.functional.pad(q, (0, cache_d - d))
            k_cache, v_cache = kv_cache
            # A tensor-scaled fp8 cache holds k / k_scale and v / v_scale (layers.paged_attention).
            k_scale = getattr(kv_cache, "k_scale", 1.0)
            v_scale = getattr(kv_cache, "v_scale", 1.0)
            extra = {} if window is None else {"sliding_window": window}
            out = ops.paged_attention(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, k_scale, **extra
            )
            if v_scale != 1.0:
                out = out * v_scale
            return out.view(n, heads, cache_d)[..., :d].reshape(n, heads * d)
        k_raw = linear(ops, h, layer.k).view(n, kv, d)
        v = k_raw if layer.v is None else linear(ops, h, layer.v).view(n, kv, d)
        k = head_rms_norm(ops, k_raw, layer.k_norm, eps)
        v = head_rms_norm(ops, v, torch.ones(d, dtype=v.dtype, device=v.device), eps)
        q, k = rope(ops, placement, meta.positions, q, k.contiguous())
        if kv < cache_kv:  # each KV head once per cache head its query heads read
            k, v = (t.repeat_interleave(cache_kv // kv, dim=1) for t in (k, v))
        if d < cache_d:
            q, k, v = (torch.nn.functional.pad(t, (0, cache_d - d)) for t in (q, k, v))
        out = paged_attention(ops, q, k.contiguous(), v.contiguous(), kv_cache, meta, 1.0, window)
        return out.view(n, heads, cache_d)[..., :d].reshape(n, heads * d)

    def feed_forward(self, ops, layer: Gemma4Layer, stream: torch.Tensor) -> torch.Tensor:
        """The dense MLP, plus the MoE block when the model has one: [n, hidden] -> [n, hidden]
        before the post-feed-forward norm (summed over the tensor-parallel ranks)."""
        eps, p = self.cfg.rms_norm_eps, self.parallel
        h = gated_mlp(ops, ops.rms_norm(stream, layer.pre_ff_norm, eps), layer.gate_up, layer.down, self.activation)
        if layer.w13 is None:
            return p.all_reduce(h)
        ones = torch.ones(stream.shape[-1], dtype=stream.dtype, device=stream.device)
        routed = ops.rms_norm(stream, ones, eps) * layer.router_scale * self.cfg.hidden_size**-0.5
        weights, ids = route_topk(linear(ops, routed, layer.router), self.top_k, renormalize=True)
        weights = weights * layer.expert_scale[ids]
        x2 = ops.rms_norm(stream, layer.pre_ff_norm_2, eps)
        experts = ops.fused_moe(x2, layer.w13, layer.w2, weights, ids, MOE_ACTIVATIONS[self.activation])
        if p.tp_size > 1:  # both partial sums in one reduction; each is normed on its own
            h, experts = (t.contiguous() for t in p.all_reduce(torch.cat([h, experts], dim=-1)).chunk(2, dim=-1))
        return ops.rms_norm(h, layer.post_ff_norm_1, eps) + ops.rms_norm(experts, layer.post_ff_norm_2, eps)

    def layer_forward(
        self,
        ops,
        placement: int,
        index: int,
        layer: Gemma4Layer,
        kv_cache: KVCache,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        eps = self.cfg.rms_norm_eps
        stream = x if residual is None else x + residual
        h = linear(
            ops,
            self.attention(ops, placement, index, layer, ops.rms_norm(stream, layer.input_norm, eps), kv_cache, meta),
            layer.o,
        )
        h = self.parallel.all_reduce(h)  # row-parallel o_proj
        stream = stream + ops.rms_norm(h, layer.post_attn_norm, eps)
        h = ops.rms_norm(self.feed_forward(ops, layer, stream), layer.post_ff_norm, eps)
        if layer.ple_gate is not None:
            if self._per_layer_inputs is None:
                raise RuntimeError("per-layer embeddings: run the layers through forward()")
            stream = stream + h
            ple = self.placements[placement].move(self._per_layer_inputs[:, index])
            g = linear(ops, stream, layer.ple_gate)
            if self.activation == "silu":
                g = torch.nn.functional.silu(g)
            else:
                g = ops.gelu(g, "tanh" if self.activation == "gelu_pytorch_tanh" else "none")
            h = ops.rms_norm(linear(ops, g * ple, layer.ple_proj), layer.post_ple_norm, eps)
        # The scalar multiplies the whole stream: handed on as (x, residual), both scaled.
        return h * layer.scalar, stream * layer.scalar

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = super().embed_tokens(input_ids)
        if self.ple_size:  # the per-layer inputs of a forward_layers that follows (see there)
            self._embedded_ids = input_ids
        return x * self.embed_scale.to(x.device)

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        logits = super().compute_logits(hidden, float32)
        if self.final_soft_cap is not None:
            logits = torch.tanh(logits / self.final_soft_cap) * self.final_soft_cap
        return logits
