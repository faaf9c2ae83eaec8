"""Gemma 3's vision side: a SigLIP tower (its last hidden state after the post-layernorm),
the multimodal projector (the patch grid average-pooled to ``mm_tokens_per_image``
tokens, Gemma's ``(1 + w)`` RMSNorm, a projection into the language model), and what
the engine must do for its images: their tokens attend to each other both ways (as
transformers' ``token_type_ids`` mask), so the model runner gives the attention op
``key_ends`` and the scheduler computes an image's tokens in one step.

The processor is the checkpoint's ``Gemma3Processor`` (PIL backend): a prompt holds
``<start_of_image>`` once per image, expanded into ``\\n\\n<start_of_image>`` +
``mm_tokens_per_image`` image tokens + ``<end_of_image>\\n\\n``.  Pan-and-scan crops
(``do_pan_and_scan``) are not implemented and refused.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterable
from typing import Any

import torch

from pagedserve.models.arch_config import ArchConfig
from pagedserve.models.layers import linear
from pagedserve.models.vision import VisionTower

__all__ = ["Gemma3Vision", "load_gemma3_processor"]

_PROJECTOR = ("mm_input_projection_weight", "mm_soft_emb_norm.weight")


def _pan_and_scan(folder: pathlib.Path) -> bool:
    """Whether the checkpoint's image processor config turns pan-and-scan on."""
    for name in ("preprocessor_config.json", "processor_config.json"):
        path = folder / name
        if path.is_file():
            cfg = json.loads(path.read_text(encoding="utf-8"))
            cfg = cfg.get("image_processor", cfg) if isinstance(cfg.get("image_processor"), dict) else cfg
            if cfg.get("do_pan_and_scan"):
                return True
    return False


def load_gemma3_processor(folder: str):
    """The checkpoint's ``Gemma3Processor`` with its image processor's PIL backend;
    ValueError when it turns pan-and-scan on (not implemented)."""
    import transformers

    if _pan_and_scan(pathlib.Path(folder)):
        raise ValueError(_PAN_AND_SCAN)
    processor = transformers.AutoProcessor.from_pretrained(folder, backend="pil")
    if getattr(processor.image_processor, "do_pan_and_scan", False):
        raise ValueError(_PAN_AND_SCAN)
    return processor


_PAN_AND_SCAN = (
    "Gemma 3 images with pan-and-scan crops (do_pan_and_scan=true in the checkpoint's image processor "
    "config) are not supported; set it to false (transformers' default)"
)


class Gemma3Vision:
    """Images -> language-model embeddings for ``Gemma3ForConditionalGeneration``.

    Weights: ``vision_tower.*`` (SigLIP; ``vision_tower.vision_model.*`` from transformers 4) and
    ``multi_modal_projector.{mm_input_projection_weight, mm_soft_emb_norm.weight}``.
    Processor outputs per image: ``pixel_values`` [1, 3, image_size, image_size].
    """

    #: Image tokens attend to each other both ways (``paged_attention``'s ``key_ends``).
    bidirectional_images = True
    load_processor = staticmethod(lambda folder: load_gemma3_processor(folder))

    def __init__(self, arch: ArchConfig, ops, dtype: torch.dtype, device) -> None:
        mm = arch.multimodal or {}
        vcfg = dict(mm["vision_config"])
        if vcfg.get("model_type", "siglip_vision_model") != "siglip_vision_model":
            raise ValueError(f"Gemma 3 with a {vcfg.get('model_type')!r} vision tower is not supported (SigLIP only)")
        vcfg.setdefault("hidden_act", "gelu_pytorch_tanh")
        vcfg.setdefault("layer_norm_eps", 1e-6)
        self.ops, self.dtype, self.device = ops, dtype, device
        self.image_token_id = int(mm.get("image_token_index", mm.get("image_token_id", 262144)))
        self.tokens = int(mm.get("mm_tokens_per_image", 256))
        self.side = int(round(self.tokens**0.5))
        self.patches = int(vcfg["image_size"]) // int(vcfg["patch_size"])  # per side
        if self.side * self.side != self.tokens or self.patches % self.side:
            raise ValueError(
                f"mm_tokens_per_image={self.tokens} must be a square whose side divides the "
                f"{self.patches} patches per image side"
            )
        self.eps = float(vcfg["layer_norm_eps"])
        layers = int(vcfg["num_hidden_layers"])
        self.tower = VisionTower(vcfg, ops, dtype, device, num_layers=layers, class_token=False)
        self.proj: dict[str, torch.Tensor] = {}

    @classmethod
    def check_engine(cls, config, arch: ArchConfig, ops, folder: pathlib.Path | None = None) -> None:
        """ValueError, before weights load, when the engine cannot serve these images: a
        step budget smaller than one image (its tokens are computed together), an
        attention op without ``key_ends``, or pan-and-scan on."""
        tokens = int((arch.multimodal or {}).get("mm_tokens_per_image", 256))
        budget = config.scheduler.max_num_batched_tokens
        if budget < tokens:
            raise ValueError(
                f"Gemma 3 images need max_num_batched_tokens >= {tokens} (the tokens of one image, which attend to "
                f"each other both ways and are computed in one step), got {budget}; raise it or serve the language "
                "model alone with limit_mm_per_prompt={'image': 0} (--limit-mm-per-prompt image=0)"
            )
        if not takes_argument(ops.paged_attention, "key_ends"):
            raise ValueError(
                f"Gemma 3 images need a paged_attention op that takes key_ends (image tokens attend to each other "
                f"both ways); this platform's ({ops.source('paged_attention')}) does not: serve the language model "
                "alone with limit_mm_per_prompt={'image': 0} (--limit-mm-per-prompt image=0)"
            )
        if folder is not None and _pan_and_scan(pathlib.Path(folder)):
            raise ValueError(_PAN_AND_SCAN)

    # -- weights ----------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, t in weights:
            if name.startswith("vision_tower."):  # transformers 4 saves vision_tower.vision_model.*
                self.tower.load(name[len("vision_tower.") :].removeprefix("vision_model."), t)
            elif name.startswith("multi_modal_projector.") and name[len("multi_modal_projector.") :] in _PROJECTOR:
                self.proj[name[len("multi_modal_projector.") :]] = t
            else:
                raise ValueError(f"unexpected weight {name!r} on Gemma 3's vision side")
        self.tower.check_loaded()
        if self.tower.post_norm is None or None in self.tower.post_norm:
            raise ValueError("Gemma 3's vision tower lacks its post_layernorm")
        missing = [n for n in _PROJECTOR if n not in self.proj]
        if missing:
            raise ValueError(f"Gemma 3's multimodal projector lacks {', '.join(missing)}")
        w = self.proj
        # (1 + w) RMSNorm folded, and the projection [vision hidden, text hidden] as a linear weight.
        w["mm_soft_emb_norm.weight"] = (w["mm_soft_emb_norm.weight"].float() + 1.0).to(self.device, self.dtype)
        w["mm_input_projection_weight"] = (
            w["mm_input_projection_weight"].t().to(device=self.device, dtype=self.dtype).contiguous()
        )

    def weight_bytes(self) -> int:
        return self.tower.weight_bytes() + sum(t.nbytes for t in self.proj.values())

    # -- images -----------------------------------------------------------------------------
    def embed_image(self, data: dict[str, Any]) -> torch.Tensor:
        """One image's processor outputs (``pixel_values`` [1, 3, H, W]) -> its image
        tokens' embeddings [mm_tokens_per_image, text hidden]."""
        pixels = data["pixel_values"]
        pixels = pixels.reshape(-1, *pixels.shape[-3:])[:1]
        x = self.tower.last_hidden_state(pixels)[0]  # [patches * patches, vision hidden]
        p, s, d = self.patches, self.side, x.shape[-1]
        k = p // s
        # Average pooling over k x k patches (row-major grid), as transformers' AvgPool2d.
        pooled = x.view(s, k, s, k, d).float().mean(dim=(1, 3)).reshape(s * s, d).to(x.dtype)
        h = self.ops.rms_norm(pooled.contiguous(), self.proj["mm_soft_emb_norm.weight"], self.eps)
        return linear(self.ops, h, self.proj["mm_input_projection_weight"])


def takes_argument(fn, name: str) -> bool:
    """Whether callable ``fn`` takes keyword argument ``name`` (an op's optional feature)."""
    import inspect

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
