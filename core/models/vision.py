"""Vision transformers (ViT) of vision-language models, written against the op registry:
CLIP's vision tower (LLaVA) and SigLIP's (same layer layout; no CLS token, no pre-norm).

A tower holds the patch embedding, the position table and pre-norm encoder layers of
bidirectional attention (``ops.encoder_attention``) and a non-gated MLP (``ops.linear``
and the activation op), with LayerNorms (``ops.layer_norm``).  It returns the hidden
states after each layer, so a model can pick the one it projects (LLaVA's
``vision_feature_layer``).
"""

from __future__ import annotations

from typing import Any

import torch

from pagedserve.models.layers import linear

__all__ = ["VisionTower", "vision_activation"]


class VisionLayer:
    """One encoder layer's weights; ``qkv`` fuses q/k/v [3 * hidden, hidden]."""

    __slots__ = ("norm1", "norm1_b", "qkv", "qkv_b", "o", "o_b", "norm2", "norm2_b", "fc1", "fc1_b", "fc2", "fc2_b")


_LAYER_NAMES = (
    "layer_norm1.weight",
    "layer_norm1.bias",
    "layer_norm2.weight",
    "layer_norm2.bias",
    "mlp.fc1.weight",
    "mlp.fc1.bias",
    "mlp.fc2.weight",
    "mlp.fc2.bias",
    "self_attn.out_proj.weight",
    "self_attn.out_proj.bias",
    *(f"self_attn.{p}_proj.{leaf}" for p in "qkv" for leaf in ("weight", "bias")),
)


def vision_activation(ops, name: str):
    """The op computing Hugging Face activation ``name`` (a ViT MLP's, a projector's)."""
    if name == "quick_gelu":
        return ops.quick_gelu
    if name == "gelu":
        return lambda x: ops.gelu(x, "none")
    if name in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        return lambda x: ops.gelu(x, "tanh")
    raise ValueError(f"vision activation {name!r} is not implemented (quick_gelu, gelu, gelu_pytorch_tanh)")


class VisionTower:
    """A CLIP (``class_token=True``: a CLS embedding and a pre-LayerNorm) or SigLIP
    vision tower over ``num_layers`` of its layers (the ones a model's features need).

    cfg: the checkpoint's ``vision_config``.  Weights are given with the tower's own
    names (``embeddings.*``, ``encoder.layers.<i>.*``, ``pre_layrnorm.*``,
    ``post_layernorm.*``) through :meth:`load`.
    """

    def __init__(self, cfg: dict[str, Any], ops, dtype: torch.dtype, device, num_layers: int, class_token: bool):
        self.cfg, self.ops, self.dtype, self.device = cfg, ops, dtype, device
        self.hidden = int(cfg["hidden_size"])
        self.heads = int(cfg["num_attention_heads"])
        self.head_dim = self.hidden // self.heads
        self.patch = int(cfg["patch_size"])
        self.eps = float(cfg.get("layer_norm_eps", 1e-5))
        self.act = vision_activation(ops, cfg.get("hidden_act", "quick_gelu"))
        self.class_token = class_token
        self.num_layers = num_layers
        self.layers = [VisionLayer() for _ in range(num_layers)]
        self._pending: dict[int, dict[str, torch.Tensor]] = {}
        self.patch_weight: torch.Tensor | None = None
        self.patch_bias: torch.Tensor | None = None
        self.class_embedding: torch.Tensor | None = None
        self.position_embedding: torch.Tensor | None = None
        self.pre_norm: tuple[torch.Tensor, torch.Tensor] | None = None
        self.post_norm: tuple[torch.Tensor, torch.Tensor] | None = None

    def _param(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(device=self.device, dtype=self.dtype).contiguous()

    def load(self, name: str, t: torch.Tensor) -> None:
        """Take one tower tensor (its name relative to the tower); ValueError if unknown."""
        if name.startswith("encoder.layers."):
            _, _, idx, local = name.split(".", 3)
            i = int(idx)
            if i >= self.num_layers:
                return  # a layer past the features the model projects
            if local not in _LAYER_NAMES:
                raise ValueError(f"unexpected vision tower weight {name!r}")
            got = self._pending.setdefault(i, {})
            got[local] = t
            if len(got) == len(_LAYER_NAMES):
                self._finish(self.layers[i], self._pending.pop(i))
            return
        if name == "embeddings.patch_embedding.weight":
            self.patch_weight = self._param(t.reshape(t.shape[0], -1))  # [hidden, 3 * p * p]
        elif name == "embeddings.patch_embedding.bias":
            self.patch_bias = self._param(t)
        elif name == "embeddings.class_embedding":
            self.class_embedding = self._param(t)
        elif name == "embeddings.position_embedding.weight":
            self.position_embedding = self._param(t)
        elif name in ("pre_layrnorm.weight", "pre_layrnorm.bias"):
            self.pre_norm = _norm_part(self.pre_norm, name, self._param(t))
        elif name in ("post_layernorm.weight", "post_layernorm.bias"):
            self.post_norm = _norm_part(self.post_norm, name, self._param(t))
        elif name.startswith("head."):
            return  # SigLIP's pooling head: not used for image features
        else:
            raise ValueError(f"unexpected vision tower weight {name!r}")

    def check_loaded(self) -> None:
        missing = [i for i, layer in enumerate(self.layers) if not hasattr(layer, "qkv")]
        if missing or self.patch_weight is None or self.position_embedding is None:
            raise ValueError(f"the vision tower's weights are incomplete (layers missing: {missing})")
        if self.class_token and (self.class_embedding is None or self.pre_norm is None):
            raise ValueError("the CLIP vision tower lacks its class embedding or pre-layernorm")

    def _finish(self, layer: VisionLayer, w: dict[str, torch.Tensor]) -> None:
        p = self._param
        a = "self_attn."
        layer.norm1, layer.norm1_b = p(w["layer_norm1.weight"]), p(w["layer_norm1.bias"])
        layer.norm2, layer.norm2_b = p(w["layer_norm2.weight"]), p(w["layer_norm2.bias"])
        layer.qkv = p(torch.cat([w[f"{a}{x}_proj.weight"] for x in "qkv"]))
        layer.qkv_b = p(torch.cat([w[f"{a}{x}_proj.bias"] for x in "qkv"]))
        layer.o, layer.o_b = p(w[a + "out_proj.weight"]), p(w[a + "out_proj.bias"])
        layer.fc1, layer.fc1_b = p(w["mlp.fc1.weight"]), p(w["mlp.fc1.bias"])
        layer.fc2, layer.fc2_b = p(w["mlp.fc2.weight"]), p(w["mlp.fc2.bias"])

    def embed(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [B, 3, H, W] -> [B, T, hidden]: the patches (a stride-``patch``
        convolution as one linear over each patch's pixels), CLS first for CLIP, plus
        positions."""
        b, c, h, w = pixel_values.shape
        p = self.patch
        x = pixel_values.to(device=self.device, dtype=self.dtype)
        patches = x.unfold(2, p, p).unfold(3, p, p)  # [B, C, gh, gw, p, p]
        gh, gw = patches.shape[2], patches.shape[3]
        patches = patches.permute(0, 2, 3, 1, 4, 5).reshape(b * gh * gw, c * p * p)
        emb = linear(self.ops, patches, self.patch_weight, self.patch_bias).view(b, gh * gw, self.hidden)
        if self.class_token:
            cls = self.class_embedding.view(1, 1, -1).expand(b, 1, -1)
            emb = torch.cat([cls, emb], dim=1)
        if emb.shape[1] != self.position_embedding.shape[0]:
            raise ValueError(
                f"the image gives {emb.shape[1]} positions, the vision tower has {self.position_embedding.shape[0]} "
                f"(image_size {self.cfg.get('image_size')}); the image processor should resize to that size"
            )
        return emb + self.position_embedding.unsqueeze(0)

    def forward(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        """pixel_values [B, 3, H, W] -> the hidden states [B, T, hidden] before the first
        layer (after CLIP's pre-norm) and after each of the tower's layers."""
        ops = self.ops
        x = self.embed(pixel_values)
        b, t, d = x.shape
        x = x.reshape(b * t, d)
        if self.pre_norm is not None:
            x = ops.layer_norm(x, self.pre_norm[0], self.pre_norm[1], self.eps)
        states = [x.view(b, t, d)]
        cu = torch.arange(0, (b + 1) * t, t, dtype=torch.int32, device=x.device)
        scale = self.head_dim**-0.5
        for layer in self.layers:
            h = ops.layer_norm(x, layer.norm1, layer.norm1_b, self.eps)
            q, k, v = linear(ops, h, layer.qkv, layer.qkv_b).view(b * t, 3, self.heads, self.head_dim).unbind(1)
            attn = ops.encoder_attention(q.contiguous(), k.contiguous(), v.contiguous(), cu, scale)
            x = x + linear(ops, attn.reshape(b * t, d), layer.o, layer.o_b)
            h = ops.layer_norm(x, layer.norm2, layer.norm2_b, self.eps)
            x = x + linear(ops, self.act(linear(ops, h, layer.fc1, layer.fc1_b)), layer.fc2, layer.fc2_b)
            states.append(x.view(b, t, d))
        return states

    def last_hidden_state(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [B, 3, H, W] -> [B, T, hidden]: the last layer's output after the
        post-layernorm (SigLIP's ``last_hidden_state``, what Gemma 3 projects)."""
        x = self.forward(pixel_values)[-1]
        b, t, d = x.shape
        if self.post_norm is None:
            raise ValueError("the vision tower has no post_layernorm")
        return self.ops.layer_norm(x.reshape(b * t, d), self.post_norm[0], self.post_norm[1], self.eps).view(b, t, d)

    def weight_bytes(self) -> int:
        tensors = [self.patch_weight, self.patch_bias, self.class_embedding, self.position_embedding]
        tensors += list(self.pre_norm or ()) + list(self.post_norm or ())
        for layer in self.layers:
            tensors += [getattr(layer, n, None) for n in VisionLayer.__slots__]
        return sum(t.nbytes for t in tensors if isinstance(t, torch.Tensor))


def _norm_part(
    current: tuple[torch.Tensor, torch.Tensor] | None, name: str, t: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    w, b = current or (None, None)
    return (t, b) if name.endswith("weight") else (w, t)
