"""The shape of a model as the cost model needs it, read from a Hugging Face ``config.json``.

No weights and no torch: only the fields every decoder-only config spells one of a few
ways (``hidden_size``/``n_embd``/``d_model``, ...).  Handles grouped-query attention,
an explicit ``head_dim``, tied embeddings, gated and plain MLPs, and mixture-of-experts
layers (``num_local_experts``/``num_experts``/``n_routed_experts`` with
``num_experts_per_tok``, optional shared experts and leading dense layers).  A
``text_config`` (multimodal wrappers) is read in place of the top level.
"""

from __future__ import annotations

import json
import pathlib
from collections import Counter
from dataclasses import dataclass, replace
from importlib import resources
from typing import Any

__all__ = ["ModelSpec", "load_model_config", "DEFAULT_MODEL_CONFIG", "WEIGHT_BYTES", "UNMODELED_ARCHITECTURES"]

#: The default model's config (SmolLM2-135M-Instruct, as its GGUF metadata reads).
DEFAULT_MODEL_CONFIG = "smollm2-135m-instruct.json"

#: Bytes per weight of each storage format (ggml block formats include their scales:
#: Q4_0 = 18 bytes / 32 weights, Q4_1 = 20, Q8_0 = 34; GPTQ/AWQ int4 with group-128 scales).
WEIGHT_BYTES: dict[str, float] = {
    "float32": 4.0,
    "bfloat16": 2.0,
    "float16": 2.0,
    "int8": 1.0,
    "w8a8": 1.0,
    "fp8": 1.0,
    "int4": 0.5 + 4 / 128,
    "gptq": 0.5 + 4 / 128,
    "awq": 0.5 + 4 / 128,
    "q4_0": 18 / 32,
    "q4_1": 20 / 32,
    "q8_0": 34 / 32,
}

#: Which peak FLOP/s a weight format multiplies at: weight-only formats dequantize
#: to the activation dtype; w8a8/fp8 use the 8-bit tensor units.
COMPUTE_KIND: dict[str, str] = {"w8a8": "int8", "fp8": "fp8"}

# Families whose MLP is up -> act -> down (two matrices), not gated (three).
_PLAIN_MLP = {
    "gpt2",
    "gpt_neox",
    "gptj",
    "opt",
    "falcon",
    "bloom",
    "phi",
    "starcoder2",
    "gpt_bigcode",
    "mpt",
    "codegen",
}


def _first(cfg: dict[str, Any], *names: str, default: Any = None) -> Any:
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    return default


def load_model_config(model: str | None) -> dict[str, Any]:
    """A config dict from a ``config.json`` file, a folder holding one, a ``.gguf`` file
    (its metadata), or None for the default model's shipped config."""
    if model is None:
        text = resources.files("pagedserve.simulate").joinpath("models", DEFAULT_MODEL_CONFIG).read_text()
        return json.loads(text)
    path = pathlib.Path(model).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".gguf" and path.is_file():
        # metadata only (no tensor data is read); this path imports torch with the loader
        from pagedserve.loader.gguf_checkpoint import GGUFCheckpoint

        ckpt = GGUFCheckpoint(path)
        cfg = ckpt.hf_config()
        kinds = Counter(t.lower() for t in ckpt.tensor_types().values() if t != "F32")
        if kinds:
            fmt = kinds.most_common(1)[0][0]
            if fmt in WEIGHT_BYTES:
                cfg["quantization_config"] = {"quant_method": "gguf", "weight_format": fmt}
        return cfg
    if not path.is_file():
        raise ValueError(
            f"--model {model!r}: no config.json there (give a Hugging Face config.json, "
            "a folder holding one, or a .gguf file)"
        )
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"--model {model!r} is not valid JSON: {e}") from e


#: Families the planner cannot price yet, by architecture: their per-request state or
#: per-layer shapes are not in :class:`ModelSpec` (a plan would be silently wrong).
UNMODELED_ARCHITECTURES: dict[str, str] = {
    **dict.fromkeys(
        (
            "Qwen3_5ForCausalLM",
            "Qwen3_5MoeForCausalLM",
            "Qwen3NextForCausalLM",
            "GraniteMoeHybridForCausalLM",
            "NemotronHForCausalLM",
            "Lfm2ForCausalLM",
            "JambaForCausalLM",
            "FalconH1ForCausalLM",
        ),
        "its recurrent-state layers (state pages per request, scan and convolution costs)",
    ),
    "Gemma4ForCausalLM": "its per-layer head sizes and KV heads, per-layer embeddings and KV-sharing layers",
}


@dataclass(frozen=True)
class ModelSpec:
    """Parameter counts (in weights) and shapes of a decoder-only model."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    #: Weights of one layer's attention projections (q, k, v, o).
    attn_params: int
    #: Weights of one dense layer's MLP (or of one MoE layer's dense/shared part).
    dense_mlp_params: int
    #: MoE: experts per MoE layer, experts per token, weights of one expert.
    num_experts: int = 0
    experts_per_token: int = 0
    expert_params: int = 0
    num_moe_layers: int = 0
    #: MoE layers' always-active MLP weights: shared experts and the router.
    moe_shared_params: int = 0
    #: Storage format of the linear weights (a key of WEIGHT_BYTES).
    weight_format: str = "bfloat16"

    @classmethod
    def from_config(cls, cfg: dict[str, Any], name: str = "model") -> ModelSpec:
        if isinstance(cfg.get("text_config"), dict):
            cfg = {**cfg["text_config"], "quantization_config": cfg.get("quantization_config")}
        for arch in cfg.get("architectures") or ():
            if arch in UNMODELED_ARCHITECTURES:
                raise ValueError(
                    f"the capacity planner cannot model {arch} yet: {UNMODELED_ARCHITECTURES[arch]} "
                    "are not priced; plan a transformer of similar size instead"
                )
        try:
            hidden = int(_first(cfg, "hidden_size", "n_embd", "d_model"))
            layers = int(_first(cfg, "num_hidden_layers", "n_layer", "num_layers"))
            heads = int(_first(cfg, "num_attention_heads", "n_head", "num_heads"))
            vocab = int(cfg["vocab_size"])
        except (KeyError, TypeError) as e:
            raise ValueError(
                f"model config lacks a required field ({e}); need hidden_size, "
                "num_hidden_layers, num_attention_heads and vocab_size"
            ) from e
        kv_heads = int(_first(cfg, "num_key_value_heads", "num_kv_heads", "n_head_kv", default=heads))
        if cfg.get("multi_query"):
            kv_heads = 1
        head_dim = int(_first(cfg, "head_dim", default=hidden // heads))
        inter = int(_first(cfg, "intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size", default=4 * hidden))
        mlp_mats = 2 if cfg.get("model_type") in _PLAIN_MLP else 3
        attn = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
        if cfg.get("kv_lora_rank"):
            attn, kv_heads, head_dim = _mla_attention(cfg, hidden, heads)
        experts = int(_first(cfg, "num_local_experts", "num_experts", "n_routed_experts", default=0) or 0)
        spec = dict(
            name=name,
            num_layers=layers,
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=vocab,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=int(_first(cfg, "max_position_embeddings", "n_positions", default=2048)),
            attn_params=attn,
            dense_mlp_params=mlp_mats * hidden * inter,
            weight_format=_weight_format(cfg),
        )
        if experts > 1:
            moe_inter = int(_first(cfg, "moe_intermediate_size", default=inter))
            shared = int(_first(cfg, "shared_expert_intermediate_size", default=0) or 0)
            shared_gate = hidden if shared else 0  # Qwen2-MoE gates its shared expert: [1, hidden]
            shared += int(cfg.get("n_shared_experts") or 0) * moe_inter
            dense_first = int(cfg.get("first_k_dense_replace") or 0) + len(cfg.get("mlp_only_layers") or [])
            # GPT-OSS's experts carry biases: gate and up [2 * inter] and down [hidden] each.
            expert_bias = 2 * moe_inter + hidden if cfg.get("model_type") == "gpt_oss" else 0
            spec.update(
                num_experts=experts,
                experts_per_token=int(_first(cfg, "num_experts_per_tok", "moe_topk", "top_k", default=2)),
                expert_params=mlp_mats * hidden * moe_inter + expert_bias,
                num_moe_layers=max(layers - dense_first, 0),
                moe_shared_params=mlp_mats * hidden * shared + hidden * experts + shared_gate,
            )
        return cls(**spec)

    # -- parameter counts ---------------------------------------------------------------------
    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    @property
    def layer_params_total(self) -> int:
        """Weights of all decoder layers (every expert counted)."""
        moe = self.attn_params + self.moe_shared_params + self.num_experts * self.expert_params
        return self.num_dense_layers * (self.attn_params + self.dense_mlp_params) + self.num_moe_layers * moe

    @property
    def layer_params_active(self) -> int:
        """Weights of all decoder layers one token multiplies with (top-k experts only)."""
        moe = self.attn_params + self.moe_shared_params + self.experts_per_token * self.expert_params
        return self.num_dense_layers * (self.attn_params + self.dense_mlp_params) + self.num_moe_layers * moe

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        lm_head = 0 if self.tie_word_embeddings else self.embedding_params
        return self.layer_params_total + self.embedding_params + lm_head

    def expected_experts_touched(self, num_tokens: int) -> float:
        """Expected distinct experts a batch of ``num_tokens`` routes to (uniform routing)."""
        if not self.num_experts:
            return 0.0
        miss = (1.0 - self.experts_per_token / self.num_experts) ** num_tokens
        return self.num_experts * (1.0 - miss)

    def layer_params_read(self, num_tokens: int) -> float:
        """Weights a step of ``num_tokens`` tokens reads from memory over all layers: every
        dense weight, and of the experts those the batch routes to (all, for big batches)."""
        moe = self.attn_params + self.moe_shared_params + self.expected_experts_touched(num_tokens) * self.expert_params
        return self.num_dense_layers * (self.attn_params + self.dense_mlp_params) + self.num_moe_layers * moe

    # -- bytes ----------------------------------------------------------------------------------
    @property
    def bytes_per_weight(self) -> float:
        return WEIGHT_BYTES[self.weight_format]

    def weight_bytes(self, activation_dtype: str) -> float:
        """Bytes of all weights in memory (embeddings in the activation dtype)."""
        emb = self.embedding_params * WEIGHT_BYTES[activation_dtype]
        lm_head = 0 if self.tie_word_embeddings else self.embedding_params * self.bytes_per_weight
        return self.layer_params_total * self.bytes_per_weight + emb + lm_head

    def kv_bytes_per_token(self, kv_dtype_bytes: float) -> float:
        """KV bytes of one token over all layers (keys and values)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * kv_dtype_bytes

    def with_format(self, weight_format: str) -> ModelSpec:
        if weight_format not in WEIGHT_BYTES:
            raise ValueError(f"unknown weight format {weight_format!r}; known: {', '.join(WEIGHT_BYTES)}")
        return replace(self, weight_format=weight_format)


def _weight_format(cfg: dict[str, Any]) -> str:
    q = cfg.get("quantization_config") or {}
    if q:
        fmt = q.get("weight_format") or q.get("quant_method")
        if fmt == "fp8" or q.get("quant_method") == "fp8":
            return "fp8"
        if fmt in WEIGHT_BYTES:
            return fmt
        if q.get("bits") == 4:
            return "int4"
        if q.get("bits") == 8:
            return "int8"
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").replace("torch.", "")
    return dtype if dtype in ("float32", "bfloat16", "float16") else "bfloat16"


def _mla_attention(cfg: dict[str, Any], hidden: int, heads: int) -> tuple[int, int, int]:
    """Multi-head latent attention (DeepSeek-V2/V3): the projections' weights, and the KV
    heads and head size pagedserve caches: the latent and the rope key, one vector of
    ``kv_lora_rank + qk_rope_head_dim`` per token shared by every head (and every
    tensor-parallel rank), stored as one KV head of half of it in the key and value caches."""
    nope, rope = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"])
    v_dim, kv_rank = int(cfg["v_head_dim"]), int(cfg["kv_lora_rank"])
    qk = nope + rope
    q_rank = cfg.get("q_lora_rank")
    q = hidden * heads * qk if not q_rank else hidden * int(q_rank) + int(q_rank) * heads * qk
    kv = hidden * (kv_rank + rope) + kv_rank * heads * (nope + v_dim)
    return q + kv + heads * v_dim * hidden, 1, -(-(kv_rank + rope) // 2)
