"""The Llama family (Llama 2/3, Mistral without sliding window, SmolLM2) and Qwen2,
written against the op registry so that every platform runs the same model code.

Weights are fused at load: q/k/v into one [q+2kv, hidden] matrix (plus bias for
Qwen2), gate/up into one [2*intermediate, hidden] matrix.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from pagedserve.distributed.parallel_state import ParallelContext
from pagedserve.models.rope import rope_cos_sin_cache
from pagedserve.quantization.base import QuantizedWeight

__all__ = ["ArchConfig", "LlamaForCausalLM", "AttentionMetadata", "SUPPORTED_ARCHITECTURES"]

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


class _Layer:
    __slots__ = ("input_norm", "post_norm", "qkv", "qkv_bias", "o", "gate_up", "down")


class LlamaForCausalLM:
    """Inference-only Llama/Qwen2.  ``ops`` is the platform's op registry.

    With a ``parallel`` context this object holds one rank's shard (Megatron-style):
    column-parallel qkv (heads split; KV heads replicated when fewer than ranks) and
    gate_up, row-parallel o_proj and down_proj followed by an all-reduce, a
    vocab-parallel embedding and LM head, and only this pipeline stage's layers.
    """

    def __init__(self, cfg: ArchConfig, ops, dtype: torch.dtype, device: torch.device,
                 parallel: ParallelContext | None = None) -> None:
        self.cfg = cfg
        self.ops = ops
        self.dtype = dtype
        self.device = device
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
        self.layers = [_Layer() for _ in range(self.layer_end - self.layer_start)]
        #: Set by weight offload (pagedserve.offload.weights): maps the layer list to the
        #: layers to run, streaming host-resident weights to the device one layer ahead.
        self.layer_stream = None
        self.embed: torch.Tensor | None = None
        self.norm: torch.Tensor | None = None
        self.lm_head: torch.Tensor | None = None
        max_pos = cfg.max_position_embeddings
        self.cos_sin = rope_cos_sin_cache(cfg.head_dim, max_pos, cfg.rope_theta, cfg.rope_scaling).to(device)

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
                self.norm = self._param(tensor)
            elif name == "lm_head.weight":
                self.lm_head = self._param(tensor)
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
            self.lm_head = self.embed

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

    def _param(self, t: torch.Tensor | QuantizedWeight) -> torch.Tensor | QuantizedWeight:
        if isinstance(t, QuantizedWeight):  # stays in its quantized form (pagedserve.quantization)
            return t.to(self.device)
        return t.to(device=self.device, dtype=self.dtype).contiguous()

    def _finish_layer(self, idx: int, w: dict[str, torch.Tensor]) -> None:
        layer = self.layers[idx]
        layer.input_norm = self._param(w["input_layernorm.weight"])
        layer.post_norm = self._param(w["post_attention_layernorm.weight"])
        a = "self_attn."
        layer.qkv = self._param(_fuse([w[a + "q_proj.weight"], w[a + "k_proj.weight"], w[a + "v_proj.weight"]]))
        layer.qkv_bias = None
        if self.cfg.attention_bias:
            layer.qkv_bias = self._param(torch.cat([w[a + "q_proj.bias"], w[a + "k_proj.bias"], w[a + "v_proj.bias"]]))
        layer.o = self._param(w[a + "o_proj.weight"])
        layer.gate_up = self._param(_fuse([w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"]]))
        layer.down = self._param(w["mlp.down_proj.weight"])

    def weight_bytes(self) -> int:
        tensors = [self.embed, self.norm]
        if self.lm_head is not self.embed:
            tensors.append(self.lm_head)
        for layer in self.layers:
            tensors += [layer.input_norm, layer.post_norm, layer.qkv, layer.o, layer.gate_up, layer.down]
            if layer.qkv_bias is not None:
                tensors.append(layer.qkv_bias)
        return sum(t.nbytes for t in tensors if t is not None)

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
        (residual None before the first layer), which is what pipeline stages exchange."""
        ops, cfg = self.ops, self.cfg
        n = x.shape[0]
        layers = self.layers if self.layer_stream is None else self.layer_stream(self.layers)
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
            q, k = ops.rotary_embedding(meta.positions, q, k, self.cos_sin)
            ops.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
            attn = ops.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                       meta.query_start_loc, self.scale)
            x = self.parallel.all_reduce(_linear(ops, attn.view(n, self.q_size), layer.o))
            h, residual = ops.fused_add_rms_norm(x, residual, layer.post_norm, cfg.rms_norm_eps)
            x = self.parallel.all_reduce(_linear(ops, ops.silu_and_mul(_linear(ops, h, layer.gate_up)), layer.down))
        return x, residual

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        h, _ = self.ops.fused_add_rms_norm(x, residual, self.norm, self.cfg.rms_norm_eps)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden_size] -> float32 logits [n, vocab]."""
        logits = _linear(self.ops, hidden, self.lm_head).float()
        if self.parallel.tp_size > 1:
            logits = self.parallel.all_gather(logits)[:, :self.cfg.vocab_size]
        return logits


def _fuse(parts: list[torch.Tensor | QuantizedWeight]) -> torch.Tensor | QuantizedWeight:
    """Stack weights along the output dimension, quantized ones in their own format."""
    if isinstance(parts[0], QuantizedWeight):
        return type(parts[0]).concat(parts)
    return torch.cat(parts)


def _linear(ops, x: torch.Tensor, w: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``ops.linear``, or the quantized weight's own kernel."""
    if isinstance(w, QuantizedWeight):
        return w.apply(x, bias)
    return ops.linear(x, w, bias)
