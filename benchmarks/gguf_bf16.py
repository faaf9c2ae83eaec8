"""A BF16 GGUF file of the same weights as a quantized one, for llama.cpp.

    python benchmarks/gguf_bf16.py SRC.gguf DST.gguf [--f32]

Every quantized tensor is dequantized with the `gguf` package and stored as BF16 (the
values are those of the quantized file, so the two files hold the same model); float32
tensors (norms) stay float32, as llama.cpp's converter keeps them. Metadata, the tokenizer
and the tensor order are copied, with `general.file_type` set to BF16. llama.cpp's own
`convert_hf_to_gguf.py` would need sentencepiece for this model's architecture, and a
GGUF-to-GGUF copy keeps llama.cpp's layout (its permuted Q/K rows) without re-deriving it.

``--f32`` stores the same bf16-rounded values as F32 tensors: the weights of
benchmarks/workloads.py's bf16 folder, in a file that llama.cpp runs in float32 (the
reference of `llama-perplexity --kl-divergence-base` in benchmarks/kl_divergence.py, as
its `--convert` writes it, without the converter's dependencies).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import gguf
import numpy as np

__all__ = ["write_bf16_gguf"]

_KEEP = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.BF16, gguf.GGMLQuantizationType.F16}
# Written by GGUFWriter itself, or describing the header rather than the model.
_SKIP = {"general.architecture", "general.file_type", "GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}


def _copy_field(writer: gguf.GGUFWriter, key: str, field) -> None:
    vtype = field.types[0]
    sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
    writer.add_key_value(key, field.contents(), vtype, sub_type=sub)


def write_bf16_gguf(src: pathlib.Path, dst: pathlib.Path, f32: bool = False) -> None:
    """Write `dst`: `src`'s metadata and tensors, quantized tensors dequantized to BF16
    (``f32``: those BF16 values stored as F32)."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    tmp = dst.with_name(dst.name + ".partial")
    writer = gguf.GGUFWriter(tmp, arch)
    for key, field in reader.fields.items():
        if key not in _SKIP:
            _copy_field(writer, key, field)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if f32 else gguf.LlamaFileType.MOSTLY_BF16)
    for t in reader.tensors:
        if t.tensor_type in _KEEP:
            writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
            continue
        # dequantize gives float32 in the numpy (reversed) shape of the GGUF dims.
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        packed = gguf.quants.quantize(values.astype(np.float32), gguf.GGMLQuantizationType.BF16)
        if f32:
            rounded = gguf.quants.dequantize(packed, gguf.GGMLQuantizationType.BF16).astype(np.float32)
            writer.add_tensor(t.name, rounded, raw_dtype=gguf.GGMLQuantizationType.F32)
        else:
            writer.add_tensor(t.name, packed, raw_dtype=gguf.GGMLQuantizationType.BF16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(dst)  # a half-written file never takes the final name


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", type=pathlib.Path)
    p.add_argument("dst", type=pathlib.Path)
    p.add_argument("--f32", action="store_true", help="store the bf16-rounded values as F32")
    a = p.parse_args()
    write_bf16_gguf(a.src, a.dst, a.f32)
    print(f"wrote {a.dst} ({a.dst.stat().st_size / 2**20:.0f} MiB)")
    sys.exit(0)
