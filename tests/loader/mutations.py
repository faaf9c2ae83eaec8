"""Mutations of checkpoint files for the loader fuzz tests: each is a recipe that damages
one copy of a tiny GGUF file or safetensors folder in one way.

Kinds: truncation at any offset, byte flips (anywhere, and concentrated on the headers
where a flip changes structure rather than a weight), counts and sizes that lie (a u64 or
u32 field overwritten with a small, huge or off-by-one value), and for safetensors a
header length, a header JSON byte, a shape or a data offset that lies, and config.json
fields set to implausible values.
"""

from __future__ import annotations

import json
import math
import pathlib
import random
import shutil
import struct
from dataclasses import dataclass

__all__ = ["Mutation", "gguf_mutations", "safetensors_mutations", "apply"]

_LIES = (0, 1, 2, 3, 255, 2**16, 2**31 - 1, 2**32 - 1, 2**32, 2**62, 2**64 - 1)
_CONFIG_VALUES = (0, -1, 1, 3, 10**9, 2**32, 1.5, math.nan, math.inf, "x", None, [], True)
_CONFIG_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
    "rope_theta",
    "rms_norm_eps",
    "tie_word_embeddings",
    "rope_scaling",
)


@dataclass(frozen=True)
class Mutation:
    """``target``: the file to damage (relative to the checkpoint folder, "" for a GGUF);
    ``kind`` and ``args`` say how."""

    target: str
    kind: str
    args: tuple

    def __str__(self) -> str:
        return f"{self.target or 'gguf'}:{self.kind}{self.args}"


def _header_size(data: bytes, fmt: str) -> int:
    """Bytes before the weights: where a flip changes structure."""
    if fmt == "safetensors":
        return 8 + struct.unpack_from("<Q", data)[0]
    # GGUF: tensor data starts after the last tensor info; the metadata (vocabulary)
    # dominates, so the first ~40% of a tiny file is all header.
    return int(len(data) * 0.4)


def _byte_mutations(rng: random.Random, target: str, data: bytes, fmt: str, n: int) -> list[Mutation]:
    size, header = len(data), _header_size(data, fmt)
    out = []
    for _ in range(n):
        kind = rng.choice(("truncate", "flip", "flip", "header-flip", "header-flip", "lie64", "lie32"))
        if kind == "truncate":
            out.append(Mutation(target, kind, (rng.randrange(0, size),)))
        elif kind == "flip":
            out.append(Mutation(target, kind, (rng.randrange(size), 1 << rng.randrange(8))))
        elif kind == "header-flip":
            out.append(Mutation(target, "flip", (rng.randrange(min(header, size)), 1 << rng.randrange(8))))
        else:
            width = 8 if kind == "lie64" else 4
            value = rng.choice(_LIES) % (1 << (8 * width))
            out.append(Mutation(target, kind, (rng.randrange(0, min(header, size - width)), value)))
    return out


def gguf_mutations(path: pathlib.Path, n: int, seed: int) -> list[Mutation]:
    rng = random.Random(seed)
    return _byte_mutations(rng, "", path.read_bytes(), "gguf", n)


def safetensors_mutations(folder: pathlib.Path, n: int, seed: int) -> list[Mutation]:
    rng = random.Random(seed)
    weights = (folder / "model.safetensors").read_bytes()
    n_config = n // 4
    n_tok = n // 8
    n_header = n // 4
    out = _byte_mutations(rng, "model.safetensors", weights, "safetensors", n - n_config - n_tok - n_header)
    names = sorted(k for k in json.loads(weights[8 : 8 + struct.unpack_from("<Q", weights)[0]]) if k != "__metadata__")
    for _ in range(n_header):
        # Valid JSON that lies: a shape, a data offset or a dtype that disagrees with the bytes.
        field = rng.choice(("shape", "data_offsets", "dtype"))
        out.append(
            Mutation("model.safetensors", "st-header", (rng.choice(names), field, rng.randrange(4), rng.choice(_LIES)))
        )
    for _ in range(n_config):
        out.append(Mutation("config.json", "config", (rng.choice(_CONFIG_KEYS), rng.choice(_CONFIG_VALUES))))
    size = (folder / "tokenizer.json").stat().st_size
    for _ in range(n_tok):
        out.append(Mutation("tokenizer.json", "truncate", (rng.randrange(0, size),)))
    return out


def apply(mutation: Mutation, source: pathlib.Path, dest: pathlib.Path) -> pathlib.Path:
    """Copy checkpoint ``source`` to ``dest`` and damage the copy; returns what to load."""
    if source.is_dir():
        shutil.copytree(source, dest)
        file = dest / mutation.target
        root = dest
    else:
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, dest)
        file = root = dest
    if mutation.kind == "st-header":
        _lie_in_header(file, *mutation.args)
        return root
    if mutation.kind == "config":
        key, value = mutation.args
        config = json.loads(file.read_text())
        config[key] = value
        file.write_text(json.dumps(config))
        return root
    data = bytearray(file.read_bytes())
    if mutation.kind == "truncate":
        del data[mutation.args[0] :]
    elif mutation.kind == "flip":
        at, bit = mutation.args
        data[at] ^= bit
    else:
        at, value = mutation.args
        struct.pack_into("<Q" if mutation.kind == "lie64" else "<I", data, at, value)
    file.write_bytes(bytes(data))
    return root


def _lie_in_header(file: pathlib.Path, name: str, field: str, which: int, value: int) -> None:
    """Rewrite one entry of a safetensors header, keeping it valid JSON (padded to fit)."""
    data = file.read_bytes()
    size = struct.unpack_from("<Q", data)[0]
    header = json.loads(data[8 : 8 + size])
    entry = header[name]
    if field == "dtype":
        entry["dtype"] = ("F16", "BF16", "I64", "U8")[which]
    else:
        values = list(entry[field])
        if values:
            values[which % len(values)] = value if field == "data_offsets" else value % (1 << 40)
        if which == 3:
            values.append(2)  # one more dimension (or offset) than there should be
        entry[field] = values
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    file.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + size :])
