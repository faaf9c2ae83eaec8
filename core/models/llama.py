"""The Llama family (Llama 2/3, Mistral without sliding window, SmolLM2) and Qwen2,
written against the op registry so that every platform runs the same model code.

Weights are fused at load: q/k/v into one [q+2kv, hidden] matrix (plus bias for
Qwen2), gate/up into one [2*intermediate, hidden] matrix.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from typing import Any

import torch

from pagedserve.distributed.parallel_state import ParallelContext
from pagedserve.models.rope import rope_cos_sin_cache
from pagedserve.quantization.base import QuantizedWeight

__all__ = ["ArchConfig", "LlamaForCausalLM", "AttentionMetadata", "LayerPlacement", "SUPPORTED_ARCHITECTURES"]

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass
class ArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool

    @classmethod
    def from_hf(cls, cfg: dict) -> ArchConfig:
        archs = cfg.get("architectures") or [cfg.get("model_type", "?")]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if arch == "MistralForCausalLM" and cfg.get("sliding_window") not in (None, 0) and \
                cfg["sliding_window"] < cfg.get("max_position_embeddings", 0):
            raise ValueError("Mistral checkpoints with a sliding window are not supported")
        if cfg.get("use_sliding_window"):
            raise ValueError("Qwen2 checkpoints with use_sliding_window=true are not supported")
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        rope_theta = cfg.get("rope_theta")
        rope_scaling = cfg.get("rope_scaling")
        params = cfg.get("rope_parameters")  # newer transformers keep theta and scaling here
        if isinstance(params, dict):
            rope_theta = params.get("rope_theta", rope_theta)
            if params.get("rope_type", "default") != "default":
                rope_scaling = params
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
        )


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, built once per step and shared by every layer.

    positions: int64 [num_tokens]; slot_mapping: int64 [num_tokens]
    block_tables: int32 [num_seqs, max_blocks]; seq_lens: int32 [num_seqs]
    query_start_loc: int32 [num_seqs + 1]
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor

    def apply(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> AttentionMetadata:
        """The same metadata with ``fn`` applied to every tensor (a device move)."""
        return AttentionMetadata(*(fn(getattr(self, f.name)) for f in fields(self)))


@dataclass(frozen=True)
class LayerPlacement:
    """Decoder layers ``[start, end)`` (model-wide indices) run with the op registry
    ``ops`` on ``device``; ``move`` brings a tensor from another placement's device to
    ``device`` (the platform's ``to_device``).  A device map gives one per segment."""

    start: int
    end: int
    ops: Any
    device: torch.device
    move: Callable[[torch.Tensor], torch.Tensor]


class _Layer:
    __slots__ = ("input_norm", "post_norm", "qkv", "qkv_bias", "o", "gate_up", "down")


class LlamaForCausalLM:
    """Inference-only Llama/Qwen2.  ``ops`` is the platform's op registry.

    With a ``parallel`` context this object holds one rank's shard (Megatron-style):
    column-parallel qkv (heads split; KV heads replicated when fewer than ranks) and
    gate_up, row-parallel o_proj and down_proj followed by an all-reduce, a
    vocab-parallel embedding and LM head, and only this pipeline stage's layers.

    With ``placements`` (a device map; one rank only) consecutive runs of layers live on
    different devices and run with their own op registries: the embedding is on the
    first placement, the final norm and the LM head on the last, and the activations
    and step metadata move from one placement to the next.
    """

    def __init__(self, cfg: ArchConfig, ops, dtype: torch.dtype, device: torch.device,
                 parallel: ParallelContext | None = None,
                 placements: list[LayerPlacement] | None = None, max_positions: int | None = None) -> None:
        self.cfg = cfg
        self.dtype = dtype
        self.parallel = p = parallel or ParallelContext.single(device)
        tp = p.tp_size
        if cfg.num_heads % tp or cfg.intermediate_size % tp or \
                (cfg.num_kv_heads % tp and tp % cfg.num_kv_heads):
            raise ValueError(f"tensor_parallel_size={tp} must divide the attention heads ({cfg.num_heads}) and "
                             f"intermediate_size ({cfg.intermediate_size}), and divide or be a multiple of the "
                             f"KV heads ({cfg.num_kv_heads})")
        self.num_heads = cfg.num_heads // tp
        self.num_kv_heads = max(1, cfg.num_kv_heads // tp)
        # Vocab rows per rank; the last shard is zero-padded so all-gathers see equal shapes.
        self.vocab_shard = -(-cfg.vocab_size // tp)
        self.vocab_start = p.tp_rank * self.vocab_shard
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.layer_start, self.layer_end = p.layer_range(cfg.num_layers)
        if placements is None:
            placements = [LayerPlacement(self.layer_start, self.layer_end, ops, device, lambda t: t.to(device))]
        elif p.world_size > 1 or placements[0].start != 0 or placements[-1].end != cfg.num_layers or \
                any(a.start >= a.end for a in placements) or \
                any(a.end != b.start for a, b in zip(placements, placements[1:])):
            raise ValueError("layer placements must cover the model's layers in order, on a single rank")
        self.placements = list(placements)
        #: The first placement embeds tokens; the last one holds the final norm and LM head.
        self.ops, self.device = placements[0].ops, placements[0].device
        self.head_ops, self.head_device = placements[-1].ops, placements[-1].device
        self._layer_device = [pl.device for pl in placements for _ in range(pl.start, pl.end)]
        self.layers = [_Layer() for _ in range(self.layer_end - self.layer_start)]
        #: Set by weight offload (pagedserve.offload.weights): maps the layer list to the
        #: layers to run, streaming host-resident weights to the device one layer ahead.
        self.layer_stream = None
        self.embed: torch.Tensor | None = None
        self.norm: torch.Tensor | None = None
        self.lm_head: torch.Tensor | None = None
        # The RoPE table covers the positions the engine runs (max_model_len), not every
        # position the model could take: a model may claim billions.
        max_pos = min(max_positions or cfg.max_position_embeddings, cfg.max_position_embeddings)
        cos_sin = rope_cos_sin_cache(cfg.head_dim, max_pos, cfg.rope_theta, cfg.rope_scaling)
        self.cos_sin = cos_sin.to(self.device)
        self._cos_sins = [self.cos_sin] + [cos_sin.to(pl.device) for pl in placements[1:]]

    # -- loading ----------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Consume (HF name, tensor) pairs; fuse q/k/v and gate/up."""
        pending: dict[int, dict[str, torch.Tensor]] = {}
        seen: set[str] = set()
        for name, tensor in weights:
            seen.add(name)
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
                idx -= self.layer_start
                pending.setdefault(idx, {})[".".join(parts[3:])] = tensor
                if len(pending[idx]) == self._weights_per_layer():
                    self._finish_layer(idx, pending.pop(idx))
            elif "rotary_emb.inv_freq" in name:
                continue
            else:
                raise ValueError(f"unexpected weight {name!r} in a {self.cfg.architecture} checkpoint")
        if pending:
            idx, got = next(iter(pending.items()))
            raise ValueError(f"layer {idx} is missing weights (found only {sorted(got)})")
        if self.embed is None or self.norm is None:
            raise ValueError("checkpoint lacks model.embed_tokens.weight or model.norm.weight")
        if self.lm_head is None:
            if not self.cfg.tie_word_embeddings and "lm_head.weight" not in seen:
                raise ValueError("checkpoint lacks lm_head.weight and does not tie word embeddings")
            # Tied: the same tensor, or a copy when the last placement is on another device.
            self.lm_head = self.embed if self.head_device == self.device else self._param(self.embed, self.head_device)

    def prepare_linear_weights(self) -> None:
        """Hand every dense linear weight to its placement's ``prepare_linear_weight`` op
        (e.g. the CPU's one-time oneDNN packing); quantized weights keep their own form.
        A tied LM head gets a prepared copy when the op returns a new tensor, the plain
        embedding staying for token lookups."""
        for pl in self.placements:
            prepare = pl.ops.prepare_linear_weight
            for layer in self.layers[pl.start - self.layer_start:pl.end - self.layer_start]:
                for name in ("qkv", "o", "gate_up", "down"):
                    w = getattr(layer, name)
                    if isinstance(w, torch.Tensor):
                        setattr(layer, name, prepare(w))
        if isinstance(self.lm_head, torch.Tensor):
            self.lm_head = self.head_ops.prepare_linear_weight(self.lm_head)

    def _shard(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """This tensor-parallel rank's slice of checkpoint tensor ``name`` (a view)."""
        p, cfg = self.parallel, self.cfg
        if p.tp_size == 1:
            return t
        r, hd = p.tp_rank, cfg.head_dim
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            pad = self.vocab_shard * p.tp_size - t.shape[0]
            if pad:
                t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])])
            return t[self.vocab_start:self.vocab_start + self.vocab_shard]
        kind = name.rsplit(".", 2)[-2] if name.startswith("model.layers.") else ""
        if kind == "q_proj":
            return t[r * self.q_size:(r + 1) * self.q_size]
        if kind in ("k_proj", "v_proj"):
            # Fewer KV heads than ranks: each rank keeps the one KV head its query heads use.
            first = r * self.num_kv_heads if cfg.num_kv_heads >= p.tp_size else r * cfg.num_kv_heads // p.tp_size
            return t[first * hd:(first + self.num_kv_heads) * hd]
        if kind in ("gate_proj", "up_proj"):
            n = cfg.intermediate_size // p.tp_size
            return t[r * n:(r + 1) * n]
        if kind == "o_proj":
            return t[:, r * self.q_size:(r + 1) * self.q_size]
        if kind == "down_proj":
            n = cfg.intermediate_size // p.tp_size
            return t[:, r * n:(r + 1) * n]
        return t

    def _weights_per_layer(self) -> int:
        return 9 + (3 if self.cfg.attention_bias else 0)

    def _param(self, t: torch.Tensor | QuantizedWeight,
               device: torch.device | None = None) -> torch.Tensor | QuantizedWeight:
        device = self.device if device is None else device
        if isinstance(t, QuantizedWeight):  # stays in its quantized form (pagedserve.quantization)
            return t.to(device)
        return t.to(device=device, dtype=self.dtype).contiguous()

    def _finish_layer(self, idx: int, w: dict[str, torch.Tensor]) -> None:
        layer = self.layers[idx]
        dev = self._layer_device[idx]

        def param(t):
            return self._param(t, dev)

        layer.input_norm = param(w["input_layernorm.weight"])
        layer.post_norm = param(w["post_attention_layernorm.weight"])
        a = "self_attn."
        layer.qkv = param(_fuse([w[a + "q_proj.weight"], w[a + "k_proj.weight"], w[a + "v_proj.weight"]]))
        layer.qkv_bias = None
        if self.cfg.attention_bias:
            layer.qkv_bias = param(torch.cat([w[a + "q_proj.bias"], w[a + "k_proj.bias"], w[a + "v_proj.bias"]]))
        layer.o = param(w[a + "o_proj.weight"])
        layer.gate_up = param(_fuse([w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"]]))
        layer.down = param(w["mlp.down_proj.weight"])

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
            for layer in self.layers[pl.start - self.layer_start:pl.end - self.layer_start]:
                tensors += [layer.input_norm, layer.post_norm, layer.qkv, layer.o, layer.gate_up, layer.down]
                if layer.qkv_bias is not None:
                    tensors.append(layer.qkv_bias)
            out.append(sum(t.nbytes for t in tensors if t is not None))
        return out

    # -- forward ------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """input_ids int64 [num_tokens] -> final hidden states [num_tokens, hidden]."""
        x, residual = self.forward_layers(self.embed_tokens(input_ids), None, meta, kv_caches)
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
        x = self.ops.embedding(local.masked_fill(outside, 0), self.embed)
        return p.all_reduce(x.masked_fill(outside.unsqueeze(-1), 0))

    def forward_layers(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run this stage's layers; (x, residual) [num_tokens, hidden] in and out
        (residual None before the first layer), which is what pipeline stages exchange.
        Under a device map they come back on the last placement's device."""
        if len(self.placements) == 1:
            layers = self.layers if self.layer_stream is None else self.layer_stream(self.layers)
            return self._run_layers(self.ops, self.cos_sin, layers, kv_caches, x, residual, meta)
        base = self.layer_start
        for pl, cos_sin in zip(self.placements, self._cos_sins):
            x = pl.move(x)
            residual = None if residual is None else pl.move(residual)
            lo, hi = pl.start - base, pl.end - base
            x, residual = self._run_layers(pl.ops, cos_sin, self.layers[lo:hi], kv_caches[lo:hi], x, residual,
                                           meta.apply(pl.move))
        return x, residual

    def _run_layers(self, ops, cos_sin: torch.Tensor, layers: Iterable[_Layer],
                    kv_caches: list[tuple[torch.Tensor, torch.Tensor]], x: torch.Tensor,
                    residual: torch.Tensor | None, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """``layers`` with the op registry ``ops``; every tensor on the same device."""
        cfg = self.cfg
        n = x.shape[0]
        for layer, (k_cache, v_cache) in zip(layers, kv_caches):
            if residual is None:
                residual = x
                h = ops.rms_norm(x, layer.input_norm, cfg.rms_norm_eps)
            else:
                h, residual = ops.fused_add_rms_norm(x, residual, layer.input_norm, cfg.rms_norm_eps)
            qkv = _linear(ops, h, layer.qkv, layer.qkv_bias)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(n, self.num_heads, cfg.head_dim)
            k = k.view(n, self.num_kv_heads, cfg.head_dim)
            v = v.view(n, self.num_kv_heads, cfg.head_dim)
            q, k = ops.rotary_embedding(meta.positions, q, k, cos_sin)
            ops.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
            attn = ops.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                       meta.query_start_loc, self.scale)
            x = self.parallel.all_reduce(_linear(ops, attn.view(n, self.q_size), layer.o))
            h, residual = ops.fused_add_rms_norm(x, residual, layer.post_norm, cfg.rms_norm_eps)
            if not isinstance(layer.gate_up, torch.Tensor):  # quantized, or with LoRA
                h = ops.silu_and_mul(layer.gate_up.apply(h, None))
            else:
                h = ops.linear_silu_and_mul(h, layer.gate_up)
            x = self.parallel.all_reduce(_linear(ops, h, layer.down))
        return x, residual

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        h, _ = self.head_ops.fused_add_rms_norm(x, residual, self.norm, self.cfg.rms_norm_eps)
        return h

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """hidden [n, hidden_size] -> logits [n, vocab] (float32, or the LM head's output
        dtype with ``float32=False``), on the last placement's device."""
        logits = _linear(self.head_ops, hidden, self.lm_head)
        if float32:
            logits = logits.float()
        if self.parallel.tp_size > 1:
            logits = self.parallel.all_gather(logits)[:, :self.cfg.vocab_size]
        return logits


def _fuse(parts: list[torch.Tensor | QuantizedWeight]) -> torch.Tensor | QuantizedWeight:
    """Stack weights along the output dimension, quantized ones in their own format."""
    if isinstance(parts[0], QuantizedWeight):
        return type(parts[0]).concat(parts)
    return torch.cat(parts)


def _linear(ops, x: torch.Tensor, w: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``ops.linear``, or the weight's own ``apply`` (quantized, or wrapped with LoRA)."""
    if not isinstance(w, torch.Tensor):
        return w.apply(x, bias)
    return ops.linear(x, w, bias)
