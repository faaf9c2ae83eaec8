"""SmolVLM's and Idefics3's vision side: the SigLIP-style tower over each tile of an
image (the processor splits an image into a grid of ``max_image_size`` tiles plus the
whole image resized to one tile; every tile is a full square, so each patch has its own
position), its last hidden state after the post-layernorm, the pixel-shuffle connector
(``scale_factor`` x ``scale_factor`` neighbouring patches into one token) and the
projection into the language model.

In the prompt each tile is one run of ``image_seq_len`` image tokens between the
processor's ``<fake_token_around_image>``, ``<row_r_col_c>`` / ``<global-img>`` and
newline tokens; every run is one multimodal item (its tile's pixels, the image's hash
and the tile's index as its key), so the encoder cache, the encoder budget and prefix
caching work per tile.  The processor is the checkpoint's (PIL backend), built without
SmolVLM's video processor."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import torch

from pagedserve.models.arch_config import ArchConfig
from pagedserve.models.layers import linear
from pagedserve.models.vision import VisionTower

__all__ = ["SmolVLMVision", "load_smolvlm_processor"]

_VISION_TYPES = ("smolvlm_vision", "idefics3_vision")
_processor_classes: dict[str, type] = {}
_processor_lock = threading.Lock()


def load_smolvlm_processor(folder: str):
    """The checkpoint's SmolVLM (or Idefics3) processor for images: its image processor
    (PIL backend) and tokenizer, without SmolVLM's video processor."""
    import json
    import pathlib

    import transformers

    cfg = json.loads((pathlib.Path(folder) / "config.json").read_text(encoding="utf-8"))
    image_processor = transformers.AutoImageProcessor.from_pretrained(folder, backend="pil")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    extra = {}
    proc_cfg = pathlib.Path(folder) / "processor_config.json"
    if proc_cfg.is_file():
        saved = json.loads(proc_cfg.read_text(encoding="utf-8"))
        extra = {k: saved[k] for k in ("image_seq_len",) if k in saved}
    if cfg.get("model_type") == "idefics3":
        return transformers.Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, **extra)
    with _processor_lock:
        cls = _processor_classes.get("smolvlm")
        if cls is None:

            class ImageOnlyProcessor(transformers.SmolVLMProcessor):
                def check_argument_for_proper_class(self, argument_name, argument):
                    if argument_name == "video_processor" and argument is None:
                        return None
                    return super().check_argument_for_proper_class(argument_name, argument)

            cls = _processor_classes["smolvlm"] = ImageOnlyProcessor
    return cls(image_processor=image_processor, tokenizer=tokenizer, video_processor=None, **extra)


class SmolVLMVision:
    """Image tiles -> language-model embeddings for ``SmolVLMForConditionalGeneration``
    and ``Idefics3ForConditionalGeneration``.

    Weights: ``vision_model.*`` (the tower) and ``connector.modality_projection.proj.weight``.
    Items: one per tile, ``pixel_values`` [1, 3, tile, tile].
    """

    load_processor = staticmethod(lambda folder: load_smolvlm_processor(folder))

    def __init__(self, arch: ArchConfig, ops, dtype: torch.dtype, device) -> None:
        mm = arch.multimodal or {}
        vcfg = dict(mm["vision_config"])
        if vcfg.get("model_type", _VISION_TYPES[0]) not in _VISION_TYPES:
            raise ValueError(f"{mm.get('architecture')}: a {vcfg.get('model_type')!r} vision tower is not supported")
        vcfg.setdefault("hidden_act", "gelu_pytorch_tanh")
        vcfg.setdefault("layer_norm_eps", 1e-6)
        self.ops, self.dtype, self.device = ops, dtype, device
        self.image_token_id = int(mm.get("image_token_id", 128257))
        self.scale = int(mm.get("scale_factor", 2))
        side = int(vcfg["image_size"]) // int(vcfg["patch_size"])
        if side % self.scale:
            raise ValueError(f"scale_factor {self.scale} does not divide the {side} patches per tile side")
        self.side = side
        self.tokens = (side // self.scale) ** 2
        self.tower = VisionTower(vcfg, ops, dtype, device, num_layers=int(vcfg["num_hidden_layers"]), class_token=False)
        self.proj: torch.Tensor | None = None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, t in weights:
            if name.startswith("vision_model."):
                self.tower.load(name[len("vision_model.") :], t)
            elif name == "connector.modality_projection.proj.weight":
                self.proj = t.to(device=self.device, dtype=self.dtype).contiguous()
            else:
                raise ValueError(f"unexpected weight {name!r} on the vision side")
        self.tower.check_loaded()
        if self.tower.post_norm is None or None in self.tower.post_norm:
            raise ValueError("the vision tower lacks its post_layernorm")
        if self.proj is None:
            raise ValueError("the connector lacks modality_projection.proj.weight")

    def weight_bytes(self) -> int:
        return self.tower.weight_bytes() + (self.proj.nbytes if self.proj is not None else 0)

    def embed_image(self, data: dict[str, Any]) -> torch.Tensor:
        """One tile (``pixel_values`` [1, 3, tile, tile]) -> its tokens' embeddings
        [image_seq_len, text hidden]: the tower, then each scale x scale block of
        patches (as transformers' pixel shuffle orders them) through the projection."""
        pixels = data["pixel_values"].reshape(-1, *data["pixel_values"].shape[-3:])[:1]
        x = self.tower.last_hidden_state(pixels)[0]  # [side * side, hidden]
        s, f, d = self.side, self.scale, x.shape[-1]
        # transformers' pixel_shuffle: token (i, j) of the (side / f)^2 grid (row major)
        # holds patches (i * f + a, j * f + c), ordered by a, then c.
        x = x.view(s, s // f, f * d)  # [row, column group, (c, d)]
        x = x.permute(1, 0, 2).reshape(s // f, s // f, f * f * d)  # [column group, row group, (a, c, d)]
        x = x.permute(1, 0, 2).reshape(self.tokens, f * f * d)
        return linear(self.ops, x.contiguous(), self.proj)

    def mm_items(
        self, processor, ids: list[int], runs: list[tuple[int, int]], num_images: int, tensors: dict, hashes: list[str]
    ) -> list[tuple[int, int, str, dict]]:
        """(offset, length, hash, data) of each item: one per image-token run (a tile),
        in prompt order; an image's runs end with its global view (the run after
        ``<global-img>``); a tile's hash is its image's and its index."""
        tag = getattr(processor, "global_image_token", None) or processor.global_image_tag  # SmolVLM's / Idefics3's
        global_id = processor.tokenizer.convert_tokens_to_ids(tag)
        pixels = tensors["pixel_values"]
        pixels = pixels.reshape(-1, *pixels.shape[-3:])
        if len(runs) > pixels.shape[0]:
            raise ValueError(f"{len(runs)} image-token runs for {pixels.shape[0]} tiles")
        mask = tensors.get("pixel_attention_mask")
        if mask is not None and not bool(mask.reshape(-1, *mask.shape[-2:])[: len(runs)].all()):
            # Padded tiles would need the tower's patch mask and bucketed positions.
            raise ValueError("tiles with padding are not supported (the image processor should resize to whole tiles)")
        items, image, tile = [], 0, 0
        for k, (offset, length) in enumerate(runs):
            if length != self.tokens:
                raise ValueError(f"an image-token run of {length} tokens; each tile has {self.tokens}")
            if image >= num_images:
                raise ValueError(f"the prompt's image tokens belong to more than its {num_images} image(s)")
            data = {"pixel_values": pixels[k : k + 1]}
            items.append((offset, length, f"{hashes[image]}:{tile}", data))
            tile += 1
            if offset > 0 and ids[offset - 1] == global_id:  # the image's last run: its global view
                image, tile = image + 1, 0
        if image != num_images:
            raise ValueError(f"the prompt's image tokens cover {image} of its {num_images} image(s)")
        return items
