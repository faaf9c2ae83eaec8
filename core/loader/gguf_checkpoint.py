"""GGUF files: metadata to a Hugging Face config, tensors to Hugging Face weights.

A GGUF (llama.cpp's format) carries no `config.json`; its metadata is the config, under
llama.cpp's key names. Its tensors use llama.cpp names, and llama.cpp's converter rewrote
some of them (Q/K rows reordered for its RoPE kernel, Gemma norms stored as 1 + w, MoE
experts stacked; the per-architecture facts are in `gguf_arch`). This module reads the file
(`gguf_reader`), dequantizes every tensor to float32 (`dequant`), undoes those rewrites and
renames tensors, so the model code sees exactly what a safetensors export of the same
model would hold.
"""

from __future__ import annotations

import pathlib
import re
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedserve.loader.dequant import dequantize
from pagedserve.loader.gguf_arch import GGUF_ARCHS, MIXTRAL, GGUFArch, Metadata, arch_config, expert_target
from pagedserve.loader.gguf_hybrid import HYBRID_ARCHS, UNSUPPORTED_HYBRID, column_groups, row_order
from pagedserve.loader.gguf_mla import SPLIT_KV_B_PARTS, merge_kv_b, merged_kv_b_shape
from pagedserve.loader.gguf_reader import GGUFReader, GGUFTensor

__all__ = ["GGUFBlocks", "GGUFCheckpoint", "SUPPORTED_GGUF_ARCHITECTURES", "reverse_rope_permutation"]

# Architectures whose GGUF tensors this module translates; value: (model_type, HF class
# name).  The model registry lists the same names (its `gguf` column; a test keeps the two
# in step); a `llama` file with expert tensors loads as Mixtral.
_ARCHS: dict[str, GGUFArch] = {**GGUF_ARCHS, **HYBRID_ARCHS}
SUPPORTED_GGUF_ARCHITECTURES: dict[str, tuple[str, str]] = {
    name: (arch.model_type, arch.architecture) for name, arch in _ARCHS.items()
}

# ggml type names `dequant.dequantize` handles, natively or through `gguf.quants`. Other types
# (the rest of the IQ family, the ternary ones) exist but are rare and unverified here, so they
# are refused by name.  IQ4_NL and IQ4_XS are checked: `quant_reference.dequantize_gguf` against
# `gguf.quants`.
_SUPPORTED_TYPES = frozenset(
    {
        *("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"),
        *("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"),
    }
)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output_norm.bias": "model.norm.bias",
    "output.weight": "lm_head.weight",
}
# blk.<layer>.<part>[.weight|.bias]: parts may hold dots (LFM2's shortconv.conv), and some
# tensors have no suffix (the SSM families' ssm_a, ssm_d).
_BLOCK_PATTERN = re.compile(r"blk\.(\d+)\.([\w.]+?)(?:\.(weight|bias))?")
# llama.cpp stores Llama 3.1's RoPE frequency factors as a tensor; the model has no such parameter.
_NON_PARAMETERS = frozenset({"rope_freqs.weight"})
# Rows llama.cpp's converter reorders for Llama-derived families (`GGUFArch.permute_qk`).
_PERMUTED = ("attn_q.weight", "attn_k.weight", "attn_q.bias", "attn_k.bias")


@dataclass
class GGUFBlocks:
    """A 2-D tensor kept in its stored ggml blocks (``GGUFCheckpoint.weights(keep_quantized=...)``).

    type_name: the ggml type, e.g. "Q4_1"; shape: ``(rows, row_length)`` in PyTorch order;
    data: uint8 ``[rows, bytes_per_row]``, Hugging Face row order, independent of the file.
    """

    type_name: str
    shape: tuple[int, int]
    data: torch.Tensor


class GGUFCheckpoint:
    """One `.gguf` file, opened lazily: tensor data is memory-mapped, read on iteration."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path
        try:
            self._reader = GGUFReader(path)
        except (ValueError, OSError) as e:
            raise ValueError(f"Could not read GGUF file {str(path)!r}: {e}") from e
        self.metadata: dict[str, Any] = self._reader.metadata
        self.architecture: str = str(self.metadata.get("general.architecture", ""))
        if self.architecture in UNSUPPORTED_HYBRID:
            raise ValueError(
                f"GGUF file {str(path)!r} has architecture {self.architecture!r}: GGUF of "
                f"{self.architecture} is not supported yet; load the Hugging Face checkpoint "
                f"({UNSUPPORTED_HYBRID[self.architecture]}). Supported GGUF architectures: "
                f"{', '.join(sorted(SUPPORTED_GGUF_ARCHITECTURES))}."
            )
        if self.architecture not in SUPPORTED_GGUF_ARCHITECTURES:
            raise ValueError(
                f"GGUF file {str(path)!r} has architecture {self.architecture!r}; supported: "
                f"{', '.join(sorted(SUPPORTED_GGUF_ARCHITECTURES))}."
            )
        self.tensor_names: list[str] = [t.name for t in self._reader.tensors]
        shapes = {t.name: tuple(t.numpy_shape) for t in self._reader.tensors}
        self._meta = Metadata(self.architecture, self.metadata, set(self.tensor_names), repr(str(path)), shapes)
        self.arch: GGUFArch = _ARCHS[self.architecture]
        if self.architecture == "llama" and (self._arch("expert_count") or self._meta.layers_with("ffn_gate_exps")):
            self.arch = MIXTRAL
        self.hf_config()  # refuses a feature the family does not implement, by name, first
        self._check_tensors()

    def _check_tensors(self) -> None:
        """Fail at open time, not halfway through loading, on a tensor that cannot be loaded."""
        for tensor in self._reader.tensors:
            if tensor.name in _NON_PARAMETERS:
                continue
            self._targets(tensor)
            type_name = tensor.ggml_type.name
            if type_name not in _SUPPORTED_TYPES:
                raise ValueError(
                    f"GGUF tensor {tensor.name!r} in {str(self.path)!r} is stored as {type_name}, which is "
                    f"not supported; supported types: {', '.join(sorted(_SUPPORTED_TYPES))}."
                )

    def _arch(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def _required(self, key: str) -> int:
        value = self._arch(key)
        if value is None:
            raise ValueError(f"GGUF file {str(self.path)!r} lacks the metadata key {self.architecture}.{key}.")
        return int(value)

    def hf_config(self) -> dict[str, Any]:
        """The `config.json` a Hugging Face export of this model would carry.

        Follows transformers' reading of GGUF metadata (`head_dim` from the RoPE dimension
        count for Llama-derived families, `tie_word_embeddings` when the file has no
        `output.weight`), then the architecture's own entries (`gguf_arch.arch_config`).
        """
        model_type, class_name = self.arch.model_type, self.arch.architecture
        name = str(self.metadata.get("general.name", "")).lower()
        if model_type == "llama" and "mistral" in name:
            # llama.cpp files Mistral under `llama`; the architecture name is the only trace.
            model_type, class_name = "mistral", "MistralForCausalLM"
        hidden_size = self._required("embedding_length")
        num_heads = self._required("attention.head_count")
        tokens = self.metadata.get("tokenizer.ggml.tokens")
        names = set(self.tensor_names)
        base = {
            "architectures": [class_name],
            "model_type": model_type,
            "vocab_size": int(self._arch("vocab_size", len(tokens) if tokens else 0)),
            "hidden_size": hidden_size,
            "intermediate_size": self._feed_forward_length(),
            "num_hidden_layers": self._required("block_count"),
            "num_attention_heads": num_heads,
            "num_key_value_heads": self._kv_heads(num_heads),
            "head_dim": self._head_dim(hidden_size, num_heads),
            "hidden_act": "silu",
            "rms_norm_eps": float(self._arch("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self._arch("rope.freq_base", 10000.0)),
            "rope_scaling": self._rope_scaling(),
            "max_position_embeddings": int(self._arch("context_length", 2048)),
            "tie_word_embeddings": "output.weight" not in names,
            "attention_bias": "blk.0.attn_q.bias" in names,
            "bos_token_id": self.metadata.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.metadata.get("tokenizer.ggml.eos_token_id"),
            "pad_token_id": self.metadata.get("tokenizer.ggml.padding_token_id"),
            "unk_token_id": self.metadata.get("tokenizer.ggml.unknown_token_id"),
            "torch_dtype": self._float_dtype(),
        }
        return arch_config(self.arch, self._meta, base)

    def _feed_forward_length(self) -> int:
        """``feed_forward_length``; Nemotron-H stores one entry per layer (0 but for its
        MLP layers): the largest."""
        value = self._arch("feed_forward_length")
        if isinstance(value, (list, tuple)):
            return max((int(v) for v in value), default=0)
        return self._required("feed_forward_length")

    def _kv_heads(self, num_heads: int) -> int:
        """``attention.head_count_kv``; the hybrid families store one entry per layer (0 for
        a recurrent layer): their attention layers' count."""
        value = self._arch("attention.head_count_kv", num_heads)
        if isinstance(value, (list, tuple)):
            return max((int(v) for v in value), default=0) or num_heads
        return int(value)

    def _head_dim(self, hidden_size: int, num_heads: int) -> int:
        key_length = self._arch("attention.key_length")
        if key_length is not None:
            return int(key_length)
        rope_dims = self._arch("rope.dimension_count")
        if self.arch.permute_qk and rope_dims is not None:  # Llama-derived: RoPE spans the head
            return int(rope_dims)
        return hidden_size // num_heads

    def _rope_scaling(self) -> dict[str, Any] | None:
        kind = self._arch("rope.scaling.type")
        if kind is None and float(self._arch("rope.scaling.factor", 1.0)) != 1.0:
            kind = "linear"  # llama.cpp's reading of a factor without a type
        if kind in (None, "none"):
            return None
        scaling: dict[str, Any] = {"rope_type": kind, "factor": float(self._arch("rope.scaling.factor", 1.0))}
        for key, hf_key in (
            ("rope.scaling.original_context_length", "original_max_position_embeddings"),
            ("rope.scaling.attn_factor", "attention_factor"),
            ("rope.scaling.yarn_beta_fast", "beta_fast"),
            ("rope.scaling.yarn_beta_slow", "beta_slow"),
        ):
            value = self._arch(key)
            if value is not None:
                scaling[hf_key] = int(value) if hf_key.startswith("original") else float(value)
        ext = self._arch("rope.scaling.yarn_ext_factor")
        if ext is not None and float(ext) != 1.0:
            self._meta.refuse(f"a YaRN extrapolation factor of {float(ext)} (rope.scaling.yarn_ext_factor)")
        return scaling

    def _float_dtype(self) -> str:
        """The dtype the weights come out in: float32, unless the file is all F16 or BF16."""
        kinds = {t.ggml_type.name for t in self._reader.tensors} - {"F32"}
        if kinds == {"F16"}:
            return "float16"
        return "bfloat16" if kinds == {"BF16"} else "float32"

    def eos_token_ids(self) -> list[int]:
        """EOS plus end-of-turn / end-of-message ids: llama.cpp stops on all of them."""
        keys = ("eos_token_id", "eot_token_id", "eom_token_id")
        ids = [self.metadata.get(f"tokenizer.ggml.{key}") for key in keys]
        return list(dict.fromkeys(int(i) for i in ids if i is not None))

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of every parameter (PyTorch order), by Hugging Face name; a stacked expert
        tensor ``[n_expert, rows, cols]`` gives one ``[rows, cols]`` entry per expert."""
        out: dict[str, tuple[int, ...]] = {}
        split: dict[str, dict[str, tuple[int, ...]]] = {}
        merged: dict[str, dict[int, tuple[int, ...]]] = {}
        for t in self._parameters():
            names = self._targets(t)
            if self._split_part(t) is not None:
                split.setdefault(names[0], {})[self._split_part(t)] = tuple(t.numpy_shape)
                continue
            if self._merged_part(t) is not None:
                merged.setdefault(names[0], {})[self._merged_part(t)[1]] = tuple(t.numpy_shape)
                continue
            shape = t.numpy_shape[1:] if len(names) > 1 else t.numpy_shape
            fix = self._fix(names[0])
            out.update((name, tuple(fix.shape(tuple(shape)) if fix else shape)) for name in names)
        for name, parts in split.items():
            if len(parts) == 2:
                out[name] = merged_kv_b_shape(*(parts[p] for p in SPLIT_KV_B_PARTS), name)
        for name, pieces in merged.items():
            shapes = [pieces[i] for i in sorted(pieces)]
            out[name] = (*shapes[0][:-2], sum(s[-2] for s in shapes), shapes[0][-1])
        return out

    def tensor_types(self) -> dict[str, str]:
        """ggml type name of every parameter, by Hugging Face name (F32 for a kv_b_proj
        put back together from attn_k_b / attn_v_b: it loads dequantized)."""
        out: dict[str, str] = {}
        for t in self._parameters():
            names = self._targets(t)
            dequantized = self._split_part(t) is not None or self._fix(names[0]) is not None
            if self._merged_part(t) is not None and out.get(names[0], t.ggml_type.name) != t.ggml_type.name:
                dequantized = True  # parts of different types: put back together as floats
            out.update((name, "F32" if dequantized else t.ggml_type.name) for name in names)
        return out

    def _split_part(self, tensor: GGUFTensor) -> str | None:
        """``attn_k_b`` / ``attn_v_b`` for a part of a split kv_b_proj (``gguf_mla``), else None."""
        match = _BLOCK_PATTERN.fullmatch(tensor.name)
        part = None if match is None else match.group(2)
        return part if part in SPLIT_KV_B_PARTS and part in self.arch.block else None

    def _merged_part(self, tensor: GGUFTensor) -> tuple[str, int, int] | None:
        """(HF name under ``model.layers.<i>.``, position, number of parts) of a part of a
        tensor the converter split (``GGUFArch.merged``), else None."""
        match = _BLOCK_PATTERN.fullmatch(tensor.name)
        if match is None or match.group(3) != "weight":
            return None
        return self.arch.merged_part(match.group(2))

    def _fix(self, hf_name: str):
        """The architecture's :class:`~pagedserve.loader.gguf_arch.Fix` of ``hf_name``, else None."""
        if not self.arch.fixes or not hf_name.startswith("model.layers."):
            return None
        return self.arch.fixes.get(hf_name.split(".", 3)[3])

    def _shifted_norm(self, hf_name: str) -> bool:
        """Whether the converter stored ``hf_name`` as ``w + norm_shift``."""
        if not self.arch.norm_shift or not hf_name.endswith("norm.weight"):
            return False
        return not (hf_name.startswith("model.layers.") and hf_name.split(".", 3)[3] in self.arch.unshifted_norms)

    def _parameters(self) -> list[GGUFTensor]:
        return [t for t in self._reader.tensors if t.name not in _NON_PARAMETERS]

    def weights(self, keep_quantized: Collection[str] = ()) -> Iterator[tuple[str, torch.Tensor | GGUFBlocks]]:
        """Yield `(hf_name, tensor)` for every parameter, dequantized to float32.

        Shapes are PyTorch's (`[out_features, in_features]` for a linear weight), the reverse
        of ggml's dimension order.  2-D tensors whose ggml type is in `keep_quantized` come
        as :class:`GGUFBlocks` instead (their raw blocks, rows in Hugging Face order), and so
        do stacked experts (one per expert) of layers whose expert tensors all have such a
        type; other experts come dequantized, one tensor per expert.  Norms are always
        shifted back.
        """
        config = self.hf_config()
        kept_expert_layers = self._kept_expert_layers(keep_quantized)
        split: dict[str, dict[str, np.ndarray]] = {}
        merged: dict[str, dict[int, GGUFTensor]] = {}
        for tensor in self._parameters():
            names = self._targets(tensor)
            data = tensor.data
            part = self._split_part(tensor)
            if part is not None:  # half of a split kv_b_proj: yielded once both came
                got = split.setdefault(names[0], {})
                got[part] = dequantize(data, tensor.ggml_type.name, tensor.numpy_shape)
                if len(got) == 2:
                    yield names[0], torch.from_numpy(merge_kv_b(*(got.pop(p) for p in SPLIT_KV_B_PARTS), names[0]))
                continue
            piece = self._merged_part(tensor)
            if piece is not None:  # a part of a tensor the converter split: yielded once all came
                pieces = merged.setdefault(names[0], {})
                pieces[piece[1]] = tensor
                if len(pieces) == piece[2]:
                    parts = [pieces[i] for i in sorted(merged.pop(names[0]))]
                    order = row_order(self.arch, piece[0], config)
                    yield names[0], self._merge(names[0], parts, keep_quantized, order)
                continue
            local = names[0].split(".", 3)[3] if names[0].startswith("model.layers.") and len(names) == 1 else None
            order = row_order(self.arch, local, config) if local is not None else None
            if order is not None:  # rows are whole blocks: moved as stored bytes
                data = np.asarray(data).reshape(tensor.numpy_shape[0], -1)[order]
            groups = column_groups(self.arch, local, config) if local is not None else None
            fix = self._fix(names[0])
            if groups is not None:
                data, moved = _reorder_column_groups(data, tensor, *groups)
                if not moved:  # groups are not whole blocks: reordered as floats, loaded as floats
                    yield names[0], torch.from_numpy(data)
                    continue
            if fix is not None:
                values = dequantize(data, tensor.ggml_type.name, tensor.numpy_shape)
                yield names[0], torch.from_numpy(fix.apply(values))
                continue
            if len(names) > 1 and self._layer(tensor) in kept_expert_layers:
                yield from self._expert_blocks(tensor, names)
                continue
            if self.arch.permute_qk and tensor.name.endswith(_PERMUTED):
                key = "num_attention_heads" if ".attn_q." in tensor.name else "num_key_value_heads"
                # Each row is whole blocks, so rows can be reordered as raw bytes, before
                # dequantizing: a copy of the stored bytes rather than of the float32 result.
                rows = data.reshape(tensor.numpy_shape[0], -1)
                data = reverse_rope_permutation(rows, config[key])
            if len(names) == 1 and tensor.ggml_type.name in keep_quantized and len(tensor.numpy_shape) == 2:
                rows = np.ascontiguousarray(data).reshape(tensor.numpy_shape[0], -1).copy()
                yield names[0], GGUFBlocks(tensor.ggml_type.name, tuple(tensor.numpy_shape), torch.from_numpy(rows))
                continue
            # Always a fresh writable array, even for F32: the map is read-only, and tensors
            # handed out must not keep the file mapped.
            values = dequantize(data, tensor.ggml_type.name, tensor.numpy_shape)
            if self._shifted_norm(names[0]):
                values -= np.float32(self.arch.norm_shift)
            if len(names) == 1:
                yield names[0], torch.from_numpy(values)
            else:
                yield from ((name, torch.from_numpy(values[e])) for e, name in enumerate(names))

    @staticmethod
    def _merge(
        name: str, parts: list[GGUFTensor], keep_quantized: Collection[str], order: np.ndarray | None = None
    ) -> torch.Tensor | GGUFBlocks:
        """One tensor from the parts the converter split it into, rows concatenated in
        order (then, with ``order``, row ``i`` is the concatenation's row ``order[i]``):
        their blocks when all are 2-D of one kept type, else float32."""
        kinds = {t.ggml_type.name for t in parts}
        cols = {t.numpy_shape[-1] for t in parts}
        if len(cols) != 1 or len({t.numpy_shape[:-2] for t in parts}) != 1:
            shapes = ", ".join(str(list(t.numpy_shape)) for t in parts)
            raise ValueError(f"{name}: its parts {shapes} do not put back together along their rows")
        if len(kinds) == 1 and kinds <= set(keep_quantized) and all(len(t.numpy_shape) == 2 for t in parts):
            rows = np.concatenate([np.asarray(t.data).reshape(t.numpy_shape[0], -1) for t in parts])
            shape = (rows.shape[0], parts[0].numpy_shape[1])
            rows = rows if order is None else rows[order]
            return GGUFBlocks(parts[0].ggml_type.name, shape, torch.from_numpy(np.ascontiguousarray(rows)))
        values = np.concatenate([dequantize(t.data, t.ggml_type.name, t.numpy_shape) for t in parts], axis=-2)
        if order is not None:
            values = values[..., order, :]
        return torch.from_numpy(np.ascontiguousarray(values))

    def _kept_expert_layers(self, keep_quantized: Collection[str]) -> set[str]:
        """Layers (as numbered in tensor names) whose stacked experts keep their blocks: every
        expert tensor of the layer has a kept type, since a model takes a layer's experts
        all quantized or all float."""
        types: dict[str, set[str]] = {}
        for t in self._parameters():
            if len(t.numpy_shape) == 3 and len(self._targets(t)) > 1:
                types.setdefault(self._layer(t), set()).add(t.ggml_type.name)
        return {layer for layer, kinds in types.items() if kinds <= set(keep_quantized)}

    @staticmethod
    def _layer(tensor: GGUFTensor) -> str | None:
        match = _BLOCK_PATTERN.fullmatch(tensor.name)
        return None if match is None else match.group(1)

    @staticmethod
    def _expert_blocks(tensor: GGUFTensor, names: list[str]) -> Iterator[tuple[str, GGUFBlocks]]:
        """One :class:`GGUFBlocks` per expert of a stacked ``[n_expert, rows, cols]`` tensor:
        each expert's rows of blocks are contiguous in the file, so it is a copy of its bytes."""
        n_expert, rows, cols = tensor.numpy_shape
        data = np.asarray(tensor.data).reshape(n_expert, rows, -1)
        for e, name in enumerate(names):
            yield name, GGUFBlocks(tensor.ggml_type.name, (rows, cols), torch.from_numpy(data[e].copy()))

    def _targets(self, tensor: GGUFTensor) -> list[str]:
        """Hugging Face names of one GGUF tensor: one, or one per expert of a stacked tensor."""
        gguf_name = tensor.name
        if gguf_name in self.arch.globals:
            return [self.arch.globals[gguf_name]]
        if gguf_name in _GLOBAL_NAMES:
            return [_GLOBAL_NAMES[gguf_name]]
        match = _BLOCK_PATTERN.fullmatch(gguf_name)
        if match is not None:
            layer, part, kind = match.groups()
            local = part if kind is None else f"{part}.{kind}"
            if local in self.arch.tensors:
                return [f"model.layers.{layer}.{self.arch.tensors[local]}"]
            if kind is not None and part in self.arch.block:
                return [f"model.layers.{layer}.{self.arch.block[part]}.{kind}"]
            if kind == "weight" and self.arch.merged_part(part) is not None:
                return [f"model.layers.{layer}.{self.arch.merged_part(part)[0]}"]
            if part in self.arch.experts and kind == "weight" and len(tensor.numpy_shape) == 3:
                return [expert_target(self.arch, int(layer), part, e) for e in range(tensor.numpy_shape[0])]
        raise ValueError(
            f"GGUF tensor {gguf_name!r} in {str(self.path)!r} has no Hugging Face counterpart for "
            f"architecture {self.architecture!r}."
        )


def _reorder_column_groups(
    data: np.ndarray, tensor: GGUFTensor, order: np.ndarray, width: int
) -> tuple[np.ndarray, bool]:
    """Columns of a 2-D tensor put back in Hugging Face order, in groups of ``width``
    (``order``: the stored group of each HF group).  As stored bytes when a group is whole
    blocks ((bytes, True)); else dequantized ((float32 values, False))."""
    rows, cols = tensor.numpy_shape
    kind = tensor.ggml_type
    if width % kind.block_size == 0:
        group_bytes = width // kind.block_size * kind.type_size
        moved = np.asarray(data).reshape(rows, len(order), group_bytes)[:, order].reshape(rows, -1)
        return moved, True
    values = dequantize(data, kind.name, tensor.numpy_shape).reshape(rows, len(order), width)
    return np.ascontiguousarray(values[:, order].reshape(rows, cols)), False


def reverse_rope_permutation(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's row reordering of a query or key projection.

    Hugging Face Llama rotates the two halves of each head (`rotate_half`); llama.cpp rotates
    adjacent pairs, so its converter interleaves each head's rows: HF row `(h, j, i)` (head,
    half, index in half) is stored at `(h, i, j)`. This puts them back.

    Args:
        weight: `[num_heads * head_dim, ...]` in the GGUF file's row order: the values, or each
            row's stored bytes (`[rows, bytes_per_row]`, any type: rows are whole blocks).
        num_heads: heads of this projection (key/value heads for `attn_k`).

    Returns:
        The same shape and dtype in Hugging Face row order.
    """
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
