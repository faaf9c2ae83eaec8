"""ArchConfig: the architecture hyper-parameters the engine and the model classes read,
parsed once from a Hugging Face ``config.json`` (or the config a GGUF file implies)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedserve.models.layers import engine_layer_count
from pagedserve.models.registry import (
    SEQUENCE_CLASSIFICATION,
    base_architecture,
    resolve_model_class,
    text_architecture,
)
from pagedserve.models.rope import normalize_rope_scaling

__all__ = ["ArchConfig"]


@dataclass
class ArchConfig:
    """Shapes shared by every decoder-only family, plus the raw config (``hf_config``)
    from which a family reads its own extras (soft-caps, windows, multipliers...).

    ``num_kv_heads``, ``head_dim`` and ``num_layers`` size the KV cache; a runner keeps a
    copy with this rank's share of them (``dataclasses.replace``).  ``num_layers`` counts
    the layers the engine runs (``layers.engine_layer_count``: a Falcon-H1 layer is two).
    """

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
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    #: Sequence-classification checkpoints (``*ForSequenceClassification``): the labels of
    #: their ``score.weight`` head; None for a causal LM.  ``architecture`` is then the
    #: decoder's causal-LM name (registry.SEQUENCE_CLASSIFICATION).
    num_labels: int | None = None
    #: A vision-language checkpoint's (``*ForConditionalGeneration``) config outside its
    #: language model: ``architecture`` (the vision-language class), ``vision_config``,
    #: the image token id...; None for a text-only checkpoint, or when images are off.
    multimodal: dict[str, Any] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def from_hf(cls, cfg: dict) -> ArchConfig:
        """Parse ``cfg``; an architecture missing from the registry, or a feature its
        family does not implement, fails here naming it."""
        multimodal = cfg.get("multimodal")
        archs = cfg.get("architectures") or [cfg.get("model_type", "?")]
        if multimodal:  # the language model of a *ForConditionalGeneration checkpoint
            archs = [text_architecture(cfg.get("model_type"), multimodal["architecture"])]
        num_labels = None
        if archs[0] in SEQUENCE_CLASSIFICATION:
            num_labels = int(cfg.get("num_labels") or len(cfg.get("id2label") or {}) or 2)
        arch = base_architecture(archs[0])
        model_cls = resolve_model_class(arch)
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        rope_theta = cfg.get("rope_theta")
        rope_scaling = cfg.get("rope_scaling")
        params = cfg.get("rope_parameters")  # newer transformers keep theta and scaling here
        if isinstance(params, dict):
            rope_theta = params.get("rope_theta", rope_theta)
            if params.get("rope_type", "default") != "default":
                rope_scaling = params
        rope_scaling, extended = normalize_rope_scaling(rope_scaling, cfg)
        out = cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            # A MoE-only family (Qwen3.5-MoE) sizes its experts alone.
            intermediate_size=cfg.get("intermediate_size") or cfg["moe_intermediate_size"],
            num_layers=engine_layer_count(cfg),  # Falcon-H1: two per checkpoint layer
            num_heads=heads,
            num_kv_heads=model_cls.kv_cache_heads(cfg),
            head_dim=model_cls.kv_head_dim(cfg),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=extended or cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_cls.default_attention_bias)),
            hf_config=dict(cfg),
            num_labels=num_labels,
            multimodal=multimodal or None,
        )
        model_cls.check_config(out)
        return out

    @property
    def tensor_parallel(self) -> bool:
        """Whether this architecture's family shards over tensor-parallel ranks."""
        return bool(resolve_model_class(self.architecture).tensor_parallel)

    def tensor_parallel_refusal(self, tp: int) -> str | None:
        """Why this checkpoint cannot be split over ``tp`` tensor-parallel ranks beyond the
        attention and MLP counts (its family's own counts), or None."""
        return resolve_model_class(self.architecture).tensor_parallel_refusal(self.hf_config, tp)

    @property
    def pipeline_refusal(self) -> str | None:
        """Why this checkpoint cannot be split into pipeline stages (its family says), or None."""
        return resolve_model_class(self.architecture).pipeline_refusal(self.hf_config)
