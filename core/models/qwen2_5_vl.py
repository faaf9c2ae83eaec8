"""Qwen2.5-VL's vision side: the window-attention ViT (a Conv3d patch embedding over
temporal patches, taken as one linear over each patch's pixels; 2-D rotary positions;
attention within windows of merged patches except in the ``fullatt_block_indexes``
layers; RMSNorm and a SwiGLU MLP) and the patch merger (2x2 neighbouring patches into one
language-model token); and the M-RoPE positions of a prompt with images (3-D for image
tokens, then the text after them shifted by the images' saved positions)."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, fields

import numpy as np
import torch

from pagedserve.models.arch_config import ArchConfig
from pagedserve.models.layers import linear

__all__ = ["Qwen2_5_VLVision", "load_qwen_vl_processor", "qwen_vl_mrope_positions"]

_BLOCK_NAMES = frozenset(
    f"{p}.{x}"
    for p in ("attn.qkv", "attn.proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    for x in ("weight", "bias")
) | {"norm1.weight", "norm2.weight"}
_MERGER_NAMES = frozenset({"ln_q.weight", "mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias"})
_processor_classes: dict[str, type] = {}
_processor_lock = threading.Lock()


def load_qwen_vl_processor(folder: str, processor_class: str = "Qwen2_5_VLProcessor"):
    """The checkpoint's ``Qwen2_5_VLProcessor`` (or ``processor_class``, e.g.
    ``Qwen3VLProcessor``) for images only: its image processor (PIL backend) and
    tokenizer, without the video processor (which needs torchvision)."""
    import transformers

    with _processor_lock:
        cls = _processor_classes.get(processor_class)
        if cls is None:

            class ImageOnlyProcessor(getattr(transformers, processor_class)):
                def check_argument_for_proper_class(self, argument_name, argument):
                    if argument_name == "video_processor" and argument is None:
                        return None
                    return super().check_argument_for_proper_class(argument_name, argument)

                def validate_inputs(self, *args, **kwargs):
                    # Videos are expanded in the text before the call (expand_video): their
                    # tokens are text here, with no video to count them against.
                    token, self.video_token = self.video_token, None
                    try:
                        return super().validate_inputs(*args, **kwargs)
                    finally:
                        self.video_token = token

            cls = _processor_classes[processor_class] = ImageOnlyProcessor
    image_processor = transformers.AutoImageProcessor.from_pretrained(folder, backend="pil")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    return cls(image_processor=image_processor, tokenizer=tokenizer, video_processor=None)


def qwen_video_patches(image_processor, frames: list, temporal_patch: int) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """A video's patches as transformers' Qwen-VL video processors lay them out, from the
    image processor (PIL; the video processors need torchvision): the frames (padded
    with the last one to a multiple of ``temporal_patch``) are resized and normalized
    one by one as images are, and temporal patch ``g`` takes its slot ``s`` from frame
    ``g * temporal_patch + s`` (an image's patch holds its one frame in every slot).
    Returns (pixel_values [t * h * w, 3 * temporal_patch * patch * patch], (t, h, w))."""
    frames = list(frames) + [frames[-1]] * (-len(frames) % temporal_patch)
    out = image_processor(images=frames, return_tensors="pt")
    pixels, grid = out["pixel_values"], out["image_grid_thw"]
    if grid.shape[0] != len(frames) or (grid != grid[:1]).any() or int(grid[0, 0]) != 1:
        raise ValueError(f"a video's frames were resized to different grids: {grid.tolist()}")
    _, h, w = (int(x) for x in grid[0].tolist())
    t = len(frames) // temporal_patch
    per = pixels.shape[-1] // (3 * temporal_patch)  # pixels of a patch
    v = pixels.view(t, temporal_patch, h * w, 3, temporal_patch, per)
    v = torch.diagonal(v, dim1=1, dim2=4)  # [t, h * w, 3, per, slot]: frame g * tp + s in slot s
    return v.permute(0, 1, 2, 4, 3).reshape(t * h * w, -1).contiguous(), (t, h, w)


@dataclass
class _Block:
    """One vision layer's weights; ``gate_up`` fuses the MLP's gate and up projections."""

    norm1: torch.Tensor
    norm2: torch.Tensor
    qkv: torch.Tensor
    qkv_b: torch.Tensor
    proj: torch.Tensor
    proj_b: torch.Tensor
    gate_up: torch.Tensor
    gate_up_b: torch.Tensor
    down: torch.Tensor
    down_b: torch.Tensor


class Qwen2_5_VLVision:
    """Images -> language-model embeddings for ``Qwen2_5_VLForConditionalGeneration``.

    Weights: ``visual.patch_embed.proj.weight``, ``visual.blocks.<i>.*``,
    ``visual.merger.*``.  Processor outputs per image: ``pixel_values`` [patches,
    3 * temporal_patch * patch * patch] and ``image_grid_thw`` [1, 3] (in patches).
    """

    uses_mrope = True
    load_processor = staticmethod(lambda folder: load_qwen_vl_processor(folder))

    def __init__(self, arch: ArchConfig, ops, dtype: torch.dtype, device) -> None:
        mm = arch.multimodal or {}
        v = mm["vision_config"]
        self.ops, self.dtype, self.device = ops, dtype, device
        self.image_token_id = int(mm.get("image_token_id", 151655))
        self.video_token_id = int(mm.get("video_token_id", 151656))
        self.temporal_patch = int(v.get("temporal_patch_size", 2))
        self.tokens_per_second = float(v.get("tokens_per_second", 4))
        self.hidden = int(v["hidden_size"])
        self.heads = int(v["num_heads"])
        self.head_dim = self.hidden // self.heads
        self.depth = int(v["depth"])
        self.patch = int(v.get("patch_size", 14))
        self.merge = int(v.get("spatial_merge_size", 2))
        self.window = int(v.get("window_size", 112))
        self.full_layers = {int(i) for i in v.get("fullatt_block_indexes") or []}
        act = v.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"Qwen2.5-VL vision activation {act!r} is not supported (silu)")
        rope = v.get("rope_parameters") if isinstance(v.get("rope_parameters"), dict) else {}
        theta = float(rope.get("rope_theta", v.get("rope_theta", 10000.0)))
        quarter = self.head_dim // 2
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, quarter, 2, dtype=torch.float32) / quarter))
        self.blocks: list[_Block | None] = [None] * self.depth
        self._pending: dict[int, dict[str, torch.Tensor]] = {}
        self.patch_weight: torch.Tensor | None = None
        self.merger: dict[str, torch.Tensor] = {}

    # -- weights ----------------------------------------------------------------------------
    def _param(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(device=self.device, dtype=self.dtype).contiguous()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, t in weights:
            if not name.startswith("visual."):
                raise ValueError(f"unexpected weight {name!r} on Qwen2.5-VL's vision side")
            local = name[len("visual.") :]
            if local == "patch_embed.proj.weight":
                self.patch_weight = self._param(t.reshape(t.shape[0], -1))  # [hidden, 3 * T * p * p]
            elif local.startswith("blocks."):
                _, idx, rest = local.split(".", 2)
                i = int(idx)
                if i >= self.depth or rest not in _BLOCK_NAMES:
                    raise ValueError(f"unexpected vision weight {name!r}")
                got = self._pending.setdefault(i, {})
                got[rest] = t
                if len(got) == len(_BLOCK_NAMES):
                    self.blocks[i] = self._block(self._pending.pop(i))
            elif local.startswith("merger.") and local[len("merger.") :] in _MERGER_NAMES:
                self.merger[local[len("merger.") :]] = self._param(t)
            else:
                raise ValueError(f"unexpected vision weight {name!r}")
        missing = [i for i, b in enumerate(self.blocks) if b is None]
        if missing or self.patch_weight is None or set(self.merger) != _MERGER_NAMES:
            raise ValueError(f"Qwen2.5-VL's vision weights are incomplete (blocks missing: {missing})")

    def _block(self, w: dict[str, torch.Tensor]) -> _Block:
        p = self._param
        return _Block(
            norm1=p(w["norm1.weight"]),
            norm2=p(w["norm2.weight"]),
            qkv=p(w["attn.qkv.weight"]),
            qkv_b=p(w["attn.qkv.bias"]),
            proj=p(w["attn.proj.weight"]),
            proj_b=p(w["attn.proj.bias"]),
            gate_up=p(torch.cat([w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"]])),
            gate_up_b=p(torch.cat([w["mlp.gate_proj.bias"], w["mlp.up_proj.bias"]])),
            down=p(w["mlp.down_proj.weight"]),
            down_b=p(w["mlp.down_proj.bias"]),
        )

    def weight_bytes(self) -> int:
        tensors = [self.patch_weight, *self.merger.values()]
        for b in self.blocks:
            tensors += [getattr(b, f.name) for f in fields(b)] if b is not None else []
        return sum(t.nbytes for t in tensors if isinstance(t, torch.Tensor))

    # -- the tower --------------------------------------------------------------------------
    def _grid_layout(self, t: int, h: int, w: int) -> tuple[torch.Tensor, list[int], list[int], torch.Tensor]:
        """For a grid of t x h x w patches (the processor orders them by merge unit: each
        2x2 block of neighbours together): the merge units' order in the window layout
        (windows row by row, units row by row inside each), the window boundaries and
        the full (per frame) boundaries in that layout, and each patch's (row, col)."""
        m = self.merge
        gh, gw = h // m, w // m
        side = self.window // m // self.patch  # merge units per window side
        order, bounds = [], [0]
        for frame in range(t):
            base = frame * gh * gw
            for wr in range(0, gh, side):
                for wc in range(0, gw, side):
                    units = [
                        base + r * gw + c for r in range(wr, min(wr + side, gh)) for c in range(wc, min(wc + side, gw))
                    ]
                    order += units
                    bounds.append(bounds[-1] + len(units) * m * m)
        full = [frame * h * w for frame in range(t + 1)]
        rows = torch.arange(h).view(gh, m, 1, 1).expand(gh, m, gw, m).permute(0, 2, 1, 3).reshape(-1)
        cols = torch.arange(w).view(1, 1, gw, m).expand(gh, m, gw, m).permute(0, 2, 1, 3).reshape(-1)
        pos = torch.stack([rows, cols], dim=-1).repeat(t, 1)  # [t * h * w, 2]
        return torch.tensor(order, dtype=torch.int64), bounds, full, pos

    def embed_image(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's processor outputs -> its image tokens' embeddings [tokens, text hidden]."""
        ops, d, mu = self.ops, self.hidden, self.merge * self.merge
        t, h, w = (int(x) for x in data["image_grid_thw"].reshape(-1)[:3].tolist())
        pixels = data["pixel_values"].reshape(t * h * w, -1).to(device=self.device, dtype=self.dtype)
        x = linear(ops, pixels, self.patch_weight)
        n = x.shape[0]
        order, bounds, full, pos = self._grid_layout(t, h, w)
        # Reorder merge units into the window layout: a window's patches are contiguous.
        x = x.view(n // mu, mu, d)[order.to(x.device)].reshape(n, d)
        freqs = pos.float().unsqueeze(-1) * self.inv_freq  # [n, 2, head_dim / 4]
        angles = freqs.flatten(1)  # cat(rows', cols' angles): head_dim / 2 frequencies
        table = torch.cat([angles.cos(), angles.sin()], dim=-1)
        table = table.view(n // mu, mu, -1)[order].reshape(n, -1).to(self.device)
        index = torch.arange(n, dtype=torch.int64, device=self.device)
        cu_window = torch.tensor(bounds, dtype=torch.int32, device=self.device)
        cu_full = torch.tensor(full, dtype=torch.int32, device=self.device)
        scale = self.head_dim**-0.5
        for i, b in enumerate(self.blocks):
            hs = ops.rms_norm(x, b.norm1, 1e-6)
            q, k, v = linear(ops, hs, b.qkv, b.qkv_b).view(n, 3, self.heads, self.head_dim).unbind(1)
            q, k = ops.rotary_embedding(index, q.contiguous(), k.contiguous(), table)
            cu = cu_full if i in self.full_layers else cu_window
            attn = ops.encoder_attention(q, k, v.contiguous(), cu, scale)
            x = x + linear(ops, attn.reshape(n, d), b.proj, b.proj_b)
            hs = ops.rms_norm(x, b.norm2, 1e-6)
            x = x + linear(ops, ops.silu_and_mul(linear(ops, hs, b.gate_up, b.gate_up_b)), b.down, b.down_b)
        g = self.merger
        hs = ops.rms_norm(x, g["ln_q.weight"], 1e-6).view(n // mu, mu * d)
        hs = linear(
            ops,
            ops.gelu(linear(ops, hs, g["mlp.0.weight"], g["mlp.0.bias"]), "none"),
            g["mlp.2.weight"],
            g["mlp.2.bias"],
        )
        return hs[torch.argsort(order).to(hs.device)]

    # -- videos -----------------------------------------------------------------------------
    def expand_video(self, processor, video) -> tuple[str, list[dict]]:
        """A video (:class:`pagedserve.multimodal.video.Video`) -> (the text replacing its
        placeholder: one video token per merged patch of its t x h x w grid, [its data]).
        The tower reads a video's patches as an image's with t > 1; its temporal M-RoPE
        positions step by ``tokens_per_second * second_per_grid_ts`` (seconds per
        temporal patch: ``temporal_patch_size / fps``)."""
        pixels, (t, h, w) = qwen_video_patches(processor.image_processor, video.frames, self.temporal_patch)
        data = {
            "pixel_values": pixels,
            "image_grid_thw": torch.tensor([[t, h, w]]),
            "second_per_grid_ts": self.temporal_patch / video.fps,
        }
        return processor.video_token * (t * h * w // self.merge**2), [data]

    # -- M-RoPE positions -------------------------------------------------------------------
    def mrope_positions(self, num_tokens: int, items: list) -> tuple[np.ndarray, int]:
        """See :func:`qwen_vl_mrope_positions`."""
        return qwen_vl_mrope_positions(num_tokens, items, self.merge, self.tokens_per_second)


def qwen_vl_mrope_positions(
    num_tokens: int, items: list, merge: int, tokens_per_second: float = 1.0
) -> tuple[np.ndarray, int]:
    """The M-RoPE positions int64 [3, num_tokens] of a prompt of ``num_tokens`` tokens
    with images ``items`` (offset, length, ``image_grid_thw``; patches merged ``merge`` x
    ``merge``), and the delta every later token's position gets (its index + delta, all
    three equal; past the largest position): text counts on from the previous token; an
    image's tokens sit on a t x h x w grid (merged patches) starting where the text
    stopped, and the text after it starts past the grid's largest side (Qwen2.5-VL and
    Qwen3-VL alike).  A video item with ``second_per_grid_ts`` (Qwen2.5-VL) has its
    temporal positions ``floor(t * tokens_per_second * second_per_grid_ts)`` from there
    (computed in float32 as transformers does)."""
    out = np.empty((3, num_tokens), dtype=np.int64)
    cur, done = 0, 0
    for item in sorted(items, key=lambda it: it.offset):
        gap = item.offset - done
        out[:, done : item.offset] = np.arange(cur, cur + gap)
        cur += gap
        t, h, w = (int(x) for x in item.data["image_grid_thw"].reshape(-1)[:3].tolist())
        gh, gw = h // merge, w // merge
        if t * gh * gw != item.length:
            raise ValueError(f"an image grid of {t}x{gh}x{gw} tokens for an image span of {item.length}")
        steps = np.arange(t)
        if "second_per_grid_ts" in item.data:
            interval = np.float32(tokens_per_second) * np.float32(item.data["second_per_grid_ts"])
            steps = (steps.astype(np.float32) * interval).astype(np.int64)
        tt, hh, ww = np.meshgrid(steps, np.arange(gh), np.arange(gw), indexing="ij")
        out[:, item.offset : item.end] = np.stack([tt.ravel(), hh.ravel(), ww.ravel()]) + cur
        cur += max(gh, gw)
        done = item.end
    out[:, done:] = np.arange(cur, cur + num_tokens - done)
    return out, (int(out.max()) + 1 if num_tokens else 0) - num_tokens
