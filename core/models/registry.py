"""The model registry: Hugging Face architecture names (``config.json``'s
``architectures[0]``) and GGUF ``general.architecture`` names to model classes.

Entries name their class by module and attribute, imported on first use, so reading
the registry (``pagedserve.models.supported_architectures()``, the loader's GGUF name
table, the docs table) imports no model code.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

__all__ = [
    "ModelEntry",
    "model_entries",
    "supported_architectures",
    "resolve_model_class",
    "gguf_architectures",
    "SEQUENCE_CLASSIFICATION",
    "base_architecture",
    "VisionLanguageEntry",
    "vision_language_entries",
    "resolve_vision_class",
    "text_architecture",
]


@dataclass(frozen=True)
class ModelEntry:
    """One supported architecture.

    architecture: the Hugging Face class name (``config.json`` ``architectures[0]``).
    model_type: ``config.json``'s ``model_type`` for it.
    module, class_name: where the pagedserve model class lives.
    gguf: the GGUF ``general.architecture`` names loaded as this architecture.
    quantized: whether quantized checkpoints / ``--quantization`` methods apply (the
        linear layers are those of ``pagedserve.quantization.base.LINEAR_SUFFIXES``;
        MoE experts are not).
    tensor_parallel: whether the family shards over tensor-parallel ranks.
    notes: what the family implements beyond the Llama baseline (for the docs table).
    """

    architecture: str
    model_type: str
    module: str
    class_name: str
    gguf: tuple[str, ...] = ()
    quantized: bool = True
    tensor_parallel: bool = True
    notes: str = ""

    def load(self) -> type:
        return getattr(importlib.import_module(self.module), self.class_name)


_LLAMA = "pagedserve.models.llama"

_GEMMA = "pagedserve.models.gemma"
_MOE = "pagedserve.models.moe"
_QWEN3_5 = "pagedserve.models.qwen3_5"

_ENTRIES: tuple[ModelEntry, ...] = (
    ModelEntry(
        "LlamaForCausalLM",
        "llama",
        _LLAMA,
        "LlamaForCausalLM",
        gguf=("llama",),
        notes="Llama 2/3 (linear, llama3 RoPE scaling), SmolLM2; GGUF Mistral files load as `llama`",
    ),
    ModelEntry(
        "MistralForCausalLM", "mistral", _LLAMA, "LlamaForCausalLM", notes="sliding window on every layer (v0.1)"
    ),
    ModelEntry(
        "Qwen2ForCausalLM",
        "qwen2",
        _LLAMA,
        "Qwen2ForCausalLM",
        gguf=("qwen2",),
        notes="q/k/v biases; `use_sliding_window` layers",
    ),
    ModelEntry(
        "Qwen3ForCausalLM",
        "qwen3",
        _LLAMA,
        "Qwen3ForCausalLM",
        gguf=("qwen3",),
        notes="per-head q/k RMSNorm, explicit head_dim",
    ),
    ModelEntry(
        "GraniteForCausalLM",
        "granite",
        _LLAMA,
        "GraniteForCausalLM",
        gguf=("granite",),
        notes="embedding, attention, residual and logits multipliers",
    ),
    ModelEntry(
        "Phi3ForCausalLM",
        "phi3",
        _LLAMA,
        "Phi3ForCausalLM",
        gguf=("phi3",),
        notes="Phi-3 / Phi-4; fused qkv_proj and gate_up_proj, partial rotary, longrope",
    ),
    ModelEntry(
        "SmolLM3ForCausalLM",
        "smollm3",
        _LLAMA,
        "LlamaForCausalLM",
        gguf=("smollm3",),
        notes="NoPE layers (`no_rope_layers`; GGUF: every fourth layer, as llama.cpp)",
    ),
    ModelEntry(
        "Olmo2ForCausalLM",
        "olmo2",
        "pagedserve.models.olmo2",
        "Olmo2ForCausalLM",
        gguf=("olmo2",),
        notes="post-norm layers, q/k norm over the whole projection",
    ),
    ModelEntry(
        "Olmo3ForCausalLM",
        "olmo3",
        "pagedserve.models.olmo3",
        "Olmo3ForCausalLM",
        notes="OLMo 2 plus sliding-window layers (`layer_types`) and a RoPE per layer type",
    ),
    ModelEntry(
        "Glm4ForCausalLM",
        "glm4",
        "pagedserve.models.glm4",
        "Glm4ForCausalLM",
        gguf=("glm4",),
        notes="sandwich norms, fused gate_up_proj, interleaved partial rotary",
    ),
    ModelEntry(
        "Starcoder2ForCausalLM",
        "starcoder2",
        "pagedserve.models.starcoder2",
        "Starcoder2ForCausalLM",
        gguf=("starcoder2",),
        notes="LayerNorm with bias, non-gated GELU MLP, biases, sliding window",
    ),
    ModelEntry(
        "MixtralForCausalLM",
        "mixtral",
        _MOE,
        "MixtralForCausalLM",
        gguf=("llama",),
        notes="MoE (`fused_moe`), top-k renormalised, optional sliding window; GGUF: a `llama` file with experts",
    ),
    ModelEntry(
        "Qwen2MoeForCausalLM",
        "qwen2_moe",
        _MOE,
        "Qwen2MoeForCausalLM",
        gguf=("qwen2moe",),
        notes="MoE with a gated shared expert; `mlp_only_layers`",
    ),
    ModelEntry(
        "Qwen3MoeForCausalLM",
        "qwen3_moe",
        _MOE,
        "Qwen3MoeForCausalLM",
        gguf=("qwen3moe",),
        notes="MoE, per-head q/k norms; `mlp_only_layers`",
    ),
    ModelEntry(
        "GemmaForCausalLM", "gemma", _GEMMA, "GemmaForCausalLM", notes="(1 + w) RMSNorm, GeGLU, scaled embeddings"
    ),
    ModelEntry(
        "Gemma2ForCausalLM",
        "gemma2",
        _GEMMA,
        "Gemma2ForCausalLM",
        gguf=("gemma2",),
        notes="sandwich norms, attention and final-logit soft-capping, query_pre_attn_scalar, "
        "alternating sliding windows",
    ),
    ModelEntry(
        "Gemma3ForCausalLM",
        "gemma3_text",
        _GEMMA,
        "Gemma3ForCausalLM",
        gguf=("gemma3",),
        notes="text only; Gemma 2 plus q/k norms and a local RoPE base on sliding layers",
    ),
    ModelEntry(
        "Gemma4ForCausalLM",
        "gemma4_text",
        "pagedserve.models.gemma4",
        "Gemma4ForCausalLM",
        notes="text only: w-scaled norms, value norm, a head size and KV heads per layer type, proportional "
        "RoPE, layer scalars, per-layer embeddings, KV sharing (no cache for the sharing layers), the MoE block",
    ),
    ModelEntry(
        "GptOssForCausalLM",
        "gpt_oss",
        "pagedserve.models.gpt_oss",
        "GptOssForCausalLM",
        quantized=False,
        notes="attention sinks, alternating sliding/full layers, YaRN, biased MoE with the clamped SwiGLU "
        "(`swigluoai`); bf16/fp32 safetensors, MXFP4 experts dequantized at load",
    ),
    ModelEntry(
        "DeepseekV2ForCausalLM",
        "deepseek_v2",
        "pagedserve.models.deepseek_v2",
        "DeepseekV2ForCausalLM",
        gguf=("deepseek2",),
        notes="DeepSeek-V2 / V2-Lite: MLA with the latent cached (576 values per token, "
        "`mla_paged_attention`), "
        "MoE with shared experts, greedy or group-limited routing",
    ),
    ModelEntry(
        "Qwen3_5ForCausalLM",
        "qwen3_5_text",
        _QWEN3_5,
        "Qwen3_5ForCausalLM",
        gguf=("qwen35",),
        quantized=False,
        notes="text only; Gated DeltaNet layers (recurrent state in state pages) 3 : 1 with gated attention "
        "(output gate, partial rotary, (1 + w) norms)",
    ),
    ModelEntry(
        "Qwen3_5MoeForCausalLM",
        "qwen3_5_moe_text",
        _QWEN3_5,
        "Qwen3_5MoeForCausalLM",
        gguf=("qwen35moe",),
        quantized=False,
        notes="text only; Qwen3.5's layers with MoE (gated shared expert) in every layer",
    ),
    ModelEntry(
        "Qwen3NextForCausalLM",
        "qwen3_next",
        _QWEN3_5,
        "Qwen3NextForCausalLM",
        gguf=("qwen3next",),
        quantized=False,
        notes="Qwen3.5's layers with MoE (gated shared expert) and per-key-head packed DeltaNet projections",
    ),
    ModelEntry(
        "GraniteMoeHybridForCausalLM",
        "granitemoehybrid",
        "pagedserve.models.granite_hybrid",
        "GraniteMoeHybridForCausalLM",
        gguf=("granitehybrid",),
        quantized=False,
        notes="Granite 4: Mamba 2 layers (SSD scan, state in state pages) beside attention without RoPE, "
        "MoE plus a shared MLP, Granite multipliers",
    ),
    ModelEntry(
        "NemotronHForCausalLM",
        "nemotron_h",
        "pagedserve.models.nemotron_h",
        "NemotronHForCausalLM",
        gguf=("nemotron_h",),
        quantized=False,
        notes="one mixer per layer: Mamba 2, attention without RoPE, squared-ReLU MLP (`backbone.*` names), "
        "Nemotron 3's MoE (sigmoid group routing, squared-ReLU experts, optional latent projection, shared MLP)",
    ),
    ModelEntry(
        "FalconH1ForCausalLM",
        "falcon_h1",
        "pagedserve.models.falcon_h1",
        "FalconH1ForCausalLM",
        quantized=False,
        notes="attention (RoPE) and Mamba 2 side by side in every layer, run as two engine layers (token blocks "
        "and state pages); muP multipliers folded into the weights; optional gated output norm, `mamba_d_ssm`",
    ),
    ModelEntry(
        "Lfm2ForCausalLM",
        "lfm2",
        "pagedserve.models.lfm2",
        "Lfm2ForCausalLM",
        gguf=("lfm2",),
        quantized=False,
        notes="LFM2: gated short-convolution layers (window in state pages) beside attention with q/k norms",
    ),
    ModelEntry(
        "JambaForCausalLM",
        "jamba",
        "pagedserve.models.jamba",
        "JambaForCausalLM",
        gguf=("jamba",),
        quantized=False,
        notes="Jamba: Mamba 1 layers (selective scan, state in state pages) beside attention without RoPE "
        "(`attn_layer_period`), MoE every `expert_layer_period` layers",
    ),
    ModelEntry(
        "DeepseekV3ForCausalLM",
        "deepseek_v3",
        "pagedserve.models.deepseek_v3",
        "DeepseekV3ForCausalLM",
        notes="DeepSeek-V3 / R1 layout: V2's MLA (latent cached) with sigmoid routing over expert groups, "
        "score-correction biases, `routed_scaling_factor`, `first_k_dense_replace`",
    ),
)

_BY_ARCH: dict[str, ModelEntry] = {e.architecture: e for e in _ENTRIES}


def model_entries() -> list[ModelEntry]:
    """Every registered architecture, in registry order."""
    return list(_ENTRIES)


def supported_architectures() -> list[str]:
    """The Hugging Face architecture names pagedserve can load, sorted."""
    return sorted(_BY_ARCH)


#: Sequence-classification checkpoints: the decoder of the causal-LM class plus a
#: ``score.weight`` head ``[num_labels, hidden]`` on the last token's final hidden state,
#: applied engine-side to the pooled vector (pagedserve.pooling).
SEQUENCE_CLASSIFICATION: dict[str, str] = {
    "LlamaForSequenceClassification": "LlamaForCausalLM",
    "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
    "Qwen3ForSequenceClassification": "Qwen3ForCausalLM",
}


def base_architecture(architecture: str) -> str:
    """The registered decoder architecture of ``architecture`` (itself unless it is a
    sequence-classification one)."""
    return SEQUENCE_CLASSIFICATION.get(architecture, architecture)


def resolve_model_class(architecture: str) -> type:
    """The model class for ``architecture``; a ValueError listing the supported ones if
    there is none."""
    entry = _BY_ARCH.get(base_architecture(architecture))
    if entry is None:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(supported_architectures())}"
        )
    return entry.load()


def gguf_architectures() -> dict[str, tuple[str, str]]:
    """GGUF ``general.architecture`` -> (model_type, Hugging Face architecture).

    A name shared by several entries maps to the first; the loader tells the others apart
    by the file's contents (a ``llama`` file with expert tensors is Mixtral)."""
    out: dict[str, tuple[str, str]] = {}
    for e in _ENTRIES:
        for g in e.gguf:
            out.setdefault(g, (e.model_type, e.architecture))
    return out


@dataclass(frozen=True)
class VisionLanguageEntry:
    """A ``*ForConditionalGeneration`` architecture: its language model is any
    registered decoder family (named by ``text_config.model_type``), its vision side the
    class ``module.class_name`` (vision tower, projector, where image features go).

    image_token_key: config.json's key for the image placeholder token id.
    """

    architecture: str
    model_type: str
    module: str
    class_name: str
    image_token_key: str = "image_token_index"
    notes: str = ""

    def load(self) -> type:
        return getattr(importlib.import_module(self.module), self.class_name)


_VISION_LANGUAGE: tuple[VisionLanguageEntry, ...] = (
    VisionLanguageEntry(
        "LlavaForConditionalGeneration",
        "llava",
        "pagedserve.models.llava",
        "LlavaVision",
        notes="CLIP ViT tower (a chosen hidden layer, CLS dropped or kept), two-layer MLP projector",
    ),
    VisionLanguageEntry(
        "LlavaNextForConditionalGeneration",
        "llava_next",
        "pagedserve.models.llava",
        "LlavaNextVision",
        notes="LLaVA's tower and projector over a base view and anyres tiles, unpadded, a newline per row",
    ),
    VisionLanguageEntry(
        "Qwen2_5_VLForConditionalGeneration",
        "qwen2_5_vl",
        "pagedserve.models.qwen2_5_vl",
        "Qwen2_5_VLVision",
        image_token_key="image_token_id",
        notes="window-attention ViT (2-D rotary, RMSNorm, SwiGLU), 2x2 patch merger; M-RoPE positions",
    ),
    VisionLanguageEntry(
        "Qwen3VLForConditionalGeneration",
        "qwen3_vl",
        "pagedserve.models.qwen3_vl",
        "Qwen3VLVision",
        image_token_key="image_token_id",
        notes="ViT with interpolated learned positions and 2-D rotary, 2x2 patch merger, DeepStack features "
        "added after the first decoder layers; interleaved M-RoPE positions",
    ),
    VisionLanguageEntry(
        "Qwen3VLMoeForConditionalGeneration",
        "qwen3_vl_moe",
        "pagedserve.models.qwen3_vl",
        "Qwen3VLVision",
        image_token_key="image_token_id",
        notes="Qwen3-VL's vision side over a Qwen3-MoE language model (fused expert tensors)",
    ),
    VisionLanguageEntry(
        "Gemma3ForConditionalGeneration",
        "gemma3",
        "pagedserve.models.gemma3_vision",
        "Gemma3Vision",
        notes="SigLIP tower, patches average-pooled to `mm_tokens_per_image`, (1 + w) RMSNorm, projection; "
        "an image's tokens attend to each other both ways (`key_ends`), computed in one step; no pan-and-scan",
    ),
    VisionLanguageEntry(
        "SmolVLMForConditionalGeneration",
        "smolvlm",
        "pagedserve.models.smolvlm_vision",
        "SmolVLMVision",
        image_token_key="image_token_id",
        notes="SigLIP-style tower per tile (a grid of tiles plus the global view, row/column tokens), "
        "pixel-shuffle connector; one item per tile",
    ),
    VisionLanguageEntry(
        "Idefics3ForConditionalGeneration",
        "idefics3",
        "pagedserve.models.smolvlm_vision",
        "SmolVLMVision",
        image_token_key="image_token_id",
        notes="SmolVLM's vision side (the same tiles, tower and connector)",
    ),
)

_VL_BY_ARCH: dict[str, VisionLanguageEntry] = {e.architecture: e for e in _VISION_LANGUAGE}


def vision_language_entries() -> list[VisionLanguageEntry]:
    """Every registered vision-language architecture, in registry order."""
    return list(_VISION_LANGUAGE)


def resolve_vision_class(architecture: str) -> type | None:
    """The vision-side class of vision-language ``architecture``; None when images of
    that architecture are not supported (its text part may still load)."""
    entry = _VL_BY_ARCH.get(architecture)
    return None if entry is None else entry.load()


#: Language models of vision-language checkpoints that are a registered family for text:
#: Qwen-VL's decoders use M-RoPE, which is plain RoPE when a prompt has no image (the
#: three position components are equal).
_TEXT_MODEL_TYPES = {
    "qwen2_vl_text": "Qwen2ForCausalLM",
    "qwen2_5_vl_text": "Qwen2ForCausalLM",
    "qwen3_vl_text": "Qwen3ForCausalLM",
    "qwen3_vl_moe_text": "Qwen3MoeForCausalLM",
}


def text_architecture(model_type: str | None, vision_architecture: str) -> str:
    """The registered decoder architecture of a vision-language checkpoint whose
    ``text_config.model_type`` is ``model_type``; ValueError naming both otherwise."""
    if model_type in _TEXT_MODEL_TYPES:
        return _TEXT_MODEL_TYPES[model_type]
    for e in _ENTRIES:
        if e.model_type == model_type:
            return e.architecture
    types = ", ".join(sorted({e.model_type for e in _ENTRIES}))
    raise ValueError(
        f"{vision_architecture}: its language model (text_config.model_type={model_type!r}) is not a supported "
        f"decoder family; supported model types: {types}"
    )
