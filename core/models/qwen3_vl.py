"""Qwen3-VL's vision side: a ViT over temporal patches (a Conv3d patch embedding with a
bias, taken as one linear over each patch's pixels; a learned square grid of position
embeddings resampled bilinearly to each image's patch grid; 2-D rotary positions;
full attention within each frame; LayerNorm and a plain GELU MLP), the patch merger
(2x2 neighbouring patches into one language-model token) and DeepStack: the hidden
states after the ``deepstack_visual_indexes`` vision layers, each through its own
merger, are added to the image tokens' hidden states after the first decoder layers.

The encoder output of an image is one tensor [tokens, (1 + k) * text hidden]: its
embeddings, then the k DeepStack features.  The encoder cache holds it whole, so every
prefill chunk that covers part of the image reads the rows it needs of all of them;
the model runner hands the features to the decoder (``DecoderForCausalLM.forward``'s
``embeds``), which adds feature ``i`` after decoder layer ``i`` at the rows of the
image tokens of that chunk.  M-RoPE positions as Qwen2.5-VL's, the rotary frequencies'
parts interleaved (``rope.mrope_parts``)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import torch

from pagedserve.models.arch_config import ArchConfig
from pagedserve.models.layers import linear
from pagedserve.models.qwen2_5_vl import load_qwen_vl_processor, qwen_video_patches, qwen_vl_mrope_positions
from pagedserve.models.vision import vision_activation

__all__ = ["Qwen3VLVision", "qwen3_video_timestamps"]

_BLOCK_NAMES = tuple(
    f"{p}.{x}"
    for p in ("norm1", "norm2", "attn.qkv", "attn.proj", "mlp.linear_fc1", "mlp.linear_fc2")
    for x in ("weight", "bias")
)
_MERGER_NAMES = tuple(f"{p}.{x}" for p in ("norm", "linear_fc1", "linear_fc2") for x in ("weight", "bias"))


class Qwen3VLVision:
    """Images -> language-model embeddings (and DeepStack features) for
    ``Qwen3VLForConditionalGeneration``.

    Weights: ``visual.patch_embed.proj.{weight,bias}``, ``visual.pos_embed.weight``,
    ``visual.blocks.<i>.*``, ``visual.merger.*``, ``visual.deepstack_merger_list.<j>.*``.
    Processor outputs per image: ``pixel_values`` [patches, 3 * temporal_patch * patch *
    patch] (merge units of 2x2 patches together) and ``image_grid_thw`` [1, 3].
    """

    uses_mrope = True
    load_processor = staticmethod(lambda folder: load_qwen_vl_processor(folder, "Qwen3VLProcessor"))

    def __init__(self, arch: ArchConfig, ops, dtype: torch.dtype, device) -> None:
        mm = arch.multimodal or {}
        v = mm["vision_config"]
        self.ops, self.dtype, self.device = ops, dtype, device
        self.image_token_id = int(mm.get("image_token_id", 151655))
        self.video_token_id = int(mm.get("video_token_id", 151656))
        self.temporal_patch = int(v.get("temporal_patch_size", 2))
        self.hidden = int(v["hidden_size"])
        self.heads = int(v["num_heads"])
        self.head_dim = self.hidden // self.heads
        self.depth = int(v["depth"])
        self.merge = int(v.get("spatial_merge_size", 2))
        self.num_positions = int(v.get("num_position_embeddings", 2304))
        self.side = math.isqrt(self.num_positions)
        if self.side * self.side != self.num_positions:
            raise ValueError(f"Qwen3-VL's num_position_embeddings {self.num_positions} is not a square grid")
        self.deepstack_indexes = [int(i) for i in v.get("deepstack_visual_indexes") or []]
        if any(not 0 <= i < self.depth for i in self.deepstack_indexes):
            raise ValueError(
                f"deepstack_visual_indexes {self.deepstack_indexes} outside the {self.depth} vision layers"
            )
        if len(self.deepstack_indexes) > arch.num_layers:
            raise ValueError(
                f"{len(self.deepstack_indexes)} DeepStack features for a language model of {arch.num_layers} layers"
            )
        #: Decoder layers after which a DeepStack feature is added (the model runner reads it).
        self.deepstack_layers = len(self.deepstack_indexes)
        self.act = vision_activation(ops, v.get("hidden_act", "gelu_pytorch_tanh"))
        rope = v.get("rope_parameters") if isinstance(v.get("rope_parameters"), dict) else {}
        theta = float(rope.get("rope_theta", v.get("rope_theta", 10000.0)))
        quarter = self.head_dim // 2
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, quarter, 2, dtype=torch.float32) / quarter))
        self.w: dict[str, torch.Tensor] = {}

    # -- weights ----------------------------------------------------------------------------
    def _expected(self) -> set[str]:
        names = {"patch_embed.proj.weight", "patch_embed.proj.bias", "pos_embed.weight"}
        names |= {f"blocks.{i}.{n}" for i in range(self.depth) for n in _BLOCK_NAMES}
        names |= {f"merger.{n}" for n in _MERGER_NAMES}
        names |= {f"deepstack_merger_list.{j}.{n}" for j in range(self.deepstack_layers) for n in _MERGER_NAMES}
        return names

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        expected = self._expected()
        for name, t in weights:
            local = name[len("visual.") :] if name.startswith("visual.") else None
            if local not in expected:
                raise ValueError(f"unexpected weight {name!r} on Qwen3-VL's vision side")
            if local == "patch_embed.proj.weight":
                t = t.reshape(t.shape[0], -1)  # [hidden, 3 * T * p * p]
            self.w[local] = t.to(device=self.device, dtype=self.dtype).contiguous()
        missing = sorted(expected - set(self.w))
        if missing:
            raise ValueError(f"Qwen3-VL's vision weights are incomplete: {', '.join(missing[:6])}")

    def weight_bytes(self) -> int:
        return sum(t.nbytes for t in self.w.values())

    # -- the tower --------------------------------------------------------------------------
    def _merge_order(self, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(row, col) int64 [h * w] of each patch of an h x w grid in the processor's
        order: merge units (m x m neighbours) row by row, each unit's patches row by row."""
        m = self.merge
        gh, gw = h // m, w // m
        rows = torch.arange(h).view(gh, m, 1, 1).expand(gh, m, gw, m).permute(0, 2, 1, 3).reshape(-1)
        cols = torch.arange(w).view(1, 1, gw, m).expand(gh, m, gw, m).permute(0, 2, 1, 3).reshape(-1)
        return rows, cols

    def position_embeddings(self, t: int, h: int, w: int) -> torch.Tensor:
        """The learned square grid of position embeddings resampled (bilinear, corners
        aligned) to h x w patches, in the processor's patch order, float32 [t * h * w, hidden]."""
        grid = self.w["pos_embed.weight"].float().view(self.side, self.side, -1).permute(2, 0, 1)[None]
        grid = torch.nn.functional.interpolate(grid, size=(h, w), mode="bilinear", align_corners=True)[0]
        rows, cols = self._merge_order(h, w)
        return grid[:, rows.to(grid.device), cols.to(grid.device)].transpose(0, 1).repeat(t, 1)

    def _merger(self, x: torch.Tensor, prefix: str, postshuffle: bool) -> torch.Tensor:
        w, ops, mu = self.w, self.ops, self.merge * self.merge
        n, d = x.shape
        if postshuffle:  # DeepStack's mergers normalize the merged unit
            hs = ops.layer_norm(x.reshape(n // mu, mu * d), w[f"{prefix}.norm.weight"], w[f"{prefix}.norm.bias"], 1e-6)
        else:
            hs = ops.layer_norm(x, w[f"{prefix}.norm.weight"], w[f"{prefix}.norm.bias"], 1e-6).reshape(n // mu, mu * d)
        hs = ops.gelu(linear(ops, hs, w[f"{prefix}.linear_fc1.weight"], w[f"{prefix}.linear_fc1.bias"]), "none")
        return linear(ops, hs, w[f"{prefix}.linear_fc2.weight"], w[f"{prefix}.linear_fc2.bias"])

    def embed_image(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's processor outputs -> [tokens, (1 + k) * text hidden]: its image
        tokens' embeddings, then its k DeepStack features."""
        ops, w, d = self.ops, self.w, self.hidden
        t, h, wd = (int(x) for x in data["image_grid_thw"].reshape(-1)[:3].tolist())
        n = t * h * wd
        pixels = data["pixel_values"].reshape(n, -1).to(device=self.device, dtype=self.dtype)
        x = linear(ops, pixels, w["patch_embed.proj.weight"], w["patch_embed.proj.bias"])
        x = x + self.position_embeddings(t, h, wd).to(x.dtype)
        rows, cols = self._merge_order(h, wd)
        pos = torch.stack([rows, cols], dim=-1).repeat(t, 1)  # [n, 2]
        angles = (pos.float().unsqueeze(-1) * self.inv_freq).flatten(1)  # rows', then cols' angles
        table = torch.cat([angles.cos(), angles.sin()], dim=-1).to(self.device)
        index = torch.arange(n, dtype=torch.int64, device=self.device)
        cu = torch.tensor([f * h * wd for f in range(t + 1)], dtype=torch.int32, device=self.device)  # per frame
        scale = self.head_dim**-0.5
        deepstack = []
        for i in range(self.depth):
            b = f"blocks.{i}."
            hs = ops.layer_norm(x, w[b + "norm1.weight"], w[b + "norm1.bias"], 1e-6)
            qkv = linear(ops, hs, w[b + "attn.qkv.weight"], w[b + "attn.qkv.bias"])
            q, k, v = qkv.view(n, 3, self.heads, self.head_dim).unbind(1)
            q, k = ops.rotary_embedding(index, q.contiguous(), k.contiguous(), table)
            attn = ops.encoder_attention(q, k, v.contiguous(), cu, scale)
            x = x + linear(ops, attn.reshape(n, d), w[b + "attn.proj.weight"], w[b + "attn.proj.bias"])
            hs = ops.layer_norm(x, w[b + "norm2.weight"], w[b + "norm2.bias"], 1e-6)
            hs = self.act(linear(ops, hs, w[b + "mlp.linear_fc1.weight"], w[b + "mlp.linear_fc1.bias"]))
            x = x + linear(ops, hs, w[b + "mlp.linear_fc2.weight"], w[b + "mlp.linear_fc2.bias"])
            if i in self.deepstack_indexes:
                j = self.deepstack_indexes.index(i)
                deepstack.append(self._merger(x, f"deepstack_merger_list.{j}", postshuffle=True))
        return torch.cat([self._merger(x, "merger", postshuffle=False), *deepstack], dim=-1)

    # -- videos -----------------------------------------------------------------------------
    def expand_video(self, processor, video) -> tuple[str, list[dict]]:
        """A video (:class:`pagedserve.multimodal.video.Video`) -> (the text replacing its
        placeholder, one data dict per temporal patch), as transformers' Qwen3-VL
        processor writes it: per temporal patch its timestamp ``<{t:.1f} seconds>`` (the
        mean time of its frames), then ``<|vision_start|>``, a video token per merged
        patch, ``<|vision_end|>``.  The tower attends within each frame group, so each
        temporal patch is encoded on its own (a 1 x h x w grid) and sits on the M-RoPE
        grid as an image does."""
        pixels, (t, h, w) = qwen_video_patches(processor.image_processor, video.frames, self.temporal_patch)
        stamps = qwen3_video_timestamps(len(video.frames), video.fps, self.temporal_patch)
        per = h * w // self.merge**2
        frame = processor.vision_start_token + processor.video_token * per + processor.vision_end_token
        text = "".join(f"<{stamp:.1f} seconds>" + frame for stamp in stamps)
        grid = torch.tensor([[1, h, w]])
        parts = [{"pixel_values": pixels[g * h * w : (g + 1) * h * w], "image_grid_thw": grid} for g in range(t)]
        return text, parts

    # -- M-RoPE positions -------------------------------------------------------------------
    def mrope_positions(self, num_tokens: int, items: list) -> tuple[np.ndarray, int]:
        """As Qwen2.5-VL's (:func:`pagedserve.models.qwen2_5_vl.qwen_vl_mrope_positions`)."""
        return qwen_vl_mrope_positions(num_tokens, items, self.merge)


def qwen3_video_timestamps(num_frames: int, fps: float, temporal_patch: int) -> list[float]:
    """Seconds of each temporal patch of a video of ``num_frames`` frames at ``fps``
    (frame indices padded with the last to a multiple of ``temporal_patch``): the mean of
    its first and last frames' times."""
    indices = list(range(num_frames)) + [num_frames - 1] * (-num_frames % temporal_patch)
    times = [i / fps for i in indices]
    return [(times[i] + times[i + temporal_patch - 1]) / 2 for i in range(0, len(times), temporal_patch)]
