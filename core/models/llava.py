"""LLaVA's vision side: a CLIP vision tower, the hidden layer(s) its features come from
(``vision_feature_layer``, CLS dropped with the "default" strategy) and a two-layer MLP
projector into the language model's embedding space.  The language model is the
registered decoder family of ``text_config``; image features replace the embeddings of
the image tokens (pagedserve.executor.model_runner)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from pagedserve.models.arch_config import ArchConfig
from pagedserve.models.layers import linear
from pagedserve.models.vision import VisionTower, vision_activation

__all__ = ["LlavaVision", "LlavaNextVision"]


class LlavaVision:
    """Images -> language-model embeddings for ``LlavaForConditionalGeneration``.

    Weights: ``vision_tower.*`` (CLIP) and ``multi_modal_projector.linear_{1,2}.*``.
    """

    def __init__(self, arch: ArchConfig, ops, dtype: torch.dtype, device) -> None:
        mm = arch.multimodal or {}
        vcfg = mm["vision_config"]
        if vcfg.get("model_type", "clip_vision_model") != "clip_vision_model":
            raise ValueError(f"LLaVA with a {vcfg.get('model_type')!r} vision tower is not supported (CLIP only)")
        self.ops, self.dtype, self.device = ops, dtype, device
        self.image_token_id = int(mm.get("image_token_index", mm.get("image_token_id", 32000)))
        layers = mm.get("vision_feature_layer", -2)
        self.feature_layers = [layers] if isinstance(layers, int) else list(layers)
        self.strategy = mm.get("vision_feature_select_strategy", "default")
        if self.strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy {self.strategy!r} is not supported (default, full)")
        total = int(vcfg["num_hidden_layers"])
        # hidden_states[i]: before layer 0 for i = 0, after layer i-1 otherwise (negative from the end).
        index = [i if i >= 0 else total + 1 + i for i in self.feature_layers]
        if any(not 0 <= i <= total for i in index):
            raise ValueError(f"vision_feature_layer {layers} is outside the tower's {total} layers")
        self.state_index = index
        self.tower = VisionTower(vcfg, ops, dtype, device, num_layers=max(index), class_token=True)
        self.act = vision_activation(ops, mm.get("projector_hidden_act", "gelu"))
        self.proj: dict[str, torch.Tensor] = {}
        self.use_bias = bool(mm.get("multimodal_projector_bias", True))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, t in weights:
            if name.startswith("vision_tower."):
                self.tower.load(name[len("vision_tower.") :], t)
            elif name.startswith("multi_modal_projector."):
                local = name[len("multi_modal_projector.") :]
                if local not in ("linear_1.weight", "linear_1.bias", "linear_2.weight", "linear_2.bias"):
                    raise ValueError(f"unexpected projector weight {name!r}")
                self.proj[local] = t.to(device=self.device, dtype=self.dtype).contiguous()
            else:
                raise ValueError(f"unexpected weight {name!r} on LLaVA's vision side")
        self.tower.check_loaded()
        need = {"linear_1.weight", "linear_2.weight"} | ({"linear_1.bias", "linear_2.bias"} if self.use_bias else set())
        if not need <= set(self.proj):
            raise ValueError(f"the projector lacks {', '.join(sorted(need - set(self.proj)))}")

    def weight_bytes(self) -> int:
        return self.tower.weight_bytes() + sum(t.nbytes for t in self.proj.values())

    def embed_image(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's processor outputs (``pixel_values`` [1, 3, H, W]) -> its image
        tokens' embeddings [num_tokens, text hidden]."""
        states = self.tower.forward(data["pixel_values"])
        picked = [states[i] for i in self.state_index]
        if self.strategy == "default":
            picked = [s[:, 1:] for s in picked]
        feats = torch.cat(picked, dim=-1)
        feats = feats.reshape(-1, feats.shape[-1])
        p = self.proj
        h = self.act(linear(self.ops, feats, p["linear_1.weight"], p.get("linear_1.bias")))
        return linear(self.ops, h, p["linear_2.weight"], p.get("linear_2.bias"))


class LlavaNextVision(LlavaVision):
    """LLaVA-NeXT ("anyres"): an image is a base view plus a grid of tiles at the best of
    ``image_grid_pinpoints`` (as its processor chose), all through the CLIP tower and
    projector; the tiles' features are laid out as one feature map, the padding the
    processor added is cut off, and an ``image_newline`` embedding ends every row.

    Weights: LLaVA's plus ``image_newline`` [text hidden].
    """

    def __init__(self, arch: ArchConfig, ops, dtype: torch.dtype, device) -> None:
        super().__init__(arch, ops, dtype, device)
        mm = arch.multimodal or {}
        self.pinpoints = [tuple(p) for p in mm.get("image_grid_pinpoints") or []]
        vcfg = mm["vision_config"]
        self.tile = int(vcfg["image_size"])
        self.side = self.tile // int(vcfg["patch_size"])  # features per tile side
        self.newline: torch.Tensor | None = None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        rest = []
        for name, t in weights:
            if name == "image_newline":
                self.newline = t.to(device=self.device, dtype=self.dtype)
            else:
                rest.append((name, t))
        if self.newline is None:
            raise ValueError("the LLaVA-NeXT checkpoint lacks image_newline")
        super().load_weights(rest)

    def _project(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[n, 3, H, W] tiles -> [n, features per tile, text hidden]."""
        states = self.tower.forward(pixel_values)
        picked = [states[i] for i in self.state_index]
        feats = torch.cat(picked, dim=-1)
        if self.strategy == "default":
            feats = feats[:, 1:]
        n, t, d = feats.shape
        p = self.proj
        h = self.act(linear(self.ops, feats.reshape(n * t, d), p["linear_1.weight"], p.get("linear_1.bias")))
        return linear(self.ops, h, p["linear_2.weight"], p.get("linear_2.bias")).view(n, t, -1)

    def embed_image(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's processor outputs (``pixel_values`` [1, tiles, 3, H, W] (padded
        to the batch's most tiles), ``image_sizes`` [1, 2] as (height, width)) -> its
        image tokens' embeddings [num_tokens, text hidden]."""
        from transformers.image_processing_utils import select_best_resolution

        height, width = (int(v) for v in data["image_sizes"].reshape(-1)[:2].tolist())
        best_h, best_w = select_best_resolution((height, width), self.pinpoints)
        rows, cols = best_h // self.tile, best_w // self.tile
        pixels = data["pixel_values"].reshape(-1, *data["pixel_values"].shape[-3:])[: 1 + rows * cols]
        feats = self._project(pixels)  # [1 + rows * cols, side * side, hidden]
        base, tiles = feats[0], feats[1:]
        s, hidden = self.side, feats.shape[-1]
        grid = tiles.view(rows, cols, s, s, hidden).permute(4, 0, 2, 1, 3).reshape(hidden, rows * s, cols * s)
        grid = _unpad(grid, height, width)
        newline = self.newline.view(hidden, 1, 1).expand(hidden, grid.shape[1], 1)
        grid = torch.cat([grid, newline.to(grid.dtype)], dim=-1)  # a newline after each row
        return torch.cat([base, grid.flatten(1).transpose(0, 1)], dim=0)


def _unpad(t: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Cut the padding the processor added around an image of ``height`` x ``width``
    (kept aspect ratio) off a feature map ``t`` [hidden, H', W'] (rounded as the
    processor rounds the resized side)."""
    cur_h, cur_w = t.shape[1:]
    if width / height > cur_w / cur_h:  # wider than the map: padded above and below
        new_h = int(round(height * (cur_w / width), 7))
        pad = (cur_h - new_h) // 2
        return t[:, pad : cur_h - pad, :]
    new_w = int(round(width * (cur_h / height), 7))
    pad = (cur_w - new_w) // 2
    return t[:, :, pad : cur_w - pad]
