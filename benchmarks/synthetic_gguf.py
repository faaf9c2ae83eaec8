"""A GGUF of a random Llama of real-model dimensions, and llama-quantize's files of it.

    python benchmarks/synthetic_gguf.py OUT_DIR [--hidden 2048 --intermediate 8192
        --layers 4 --heads 32 --kv-heads 8] [--quantize Q4_K_M,Q4_1]

The default model's hidden size (576) is not a multiple of the K-quants' 256-value
super-block, so llama-quantize's Q4_K_M of it is mostly Q5_0 and Q8_0 with Q4_K/Q6_K only
in the down projections: it does not run the kernels a Q4_K_M of Llama 3.2 1B, Qwen or
Mistral runs (every linear Q4_K or Q6_K, the gated MLP and a mixed Q4_K/Q6_K qkv). This
writes ``OUT_DIR/synthetic-F32.gguf``: the default model's tokenizer and metadata with the
given dimensions (default: Llama 3.2 1B's layer, 4 layers, the default model's 49,152-token
vocabulary, tied embedding) and normal random weights (std 0.02; norms 1), then runs
llama-quantize (benchmarks/README.md builds it) for each ``--quantize`` type into
``OUT_DIR/synthetic-<TYPE>.gguf``.  Random weights make the files fit for speed only
(outputs are noise; quality is measured on the default model: benchmarks/kl_divergence.py).

    python benchmarks/gguf_ab.py OUT/synthetic-Q4_1.gguf OUT/synthetic-Q4_K_M.gguf  # A/B
    python benchmarks/compare_llamacpp.py --gguf OUT/synthetic-Q4_K_M.gguf --no-bf16 --bf16-gguf none
"""

from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys

import gguf
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from workloads import default_gguf_path  # noqa: E402

__all__ = ["write_synthetic_gguf"]

LLAMA_BIN = pathlib.Path("/work/llamacpp/build/bin")
# Written by GGUFWriter itself, set below, or describing the default model's size.
_SKIP = {"general.architecture", "general.file_type", "GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}


def write_synthetic_gguf(
    dst: pathlib.Path, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, seed: int = 0
) -> None:
    """Write an F32 GGUF: the default model's tokenizer and settings, these dimensions,
    random weights (tensor names and the numpy shapes of llama.cpp's converter)."""
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"hidden {hidden} must split into {heads} heads, and those into {kv_heads} kv heads")
    src = gguf.GGUFReader(default_gguf_path())
    head_dim = hidden // heads
    sizes = {
        "llama.block_count": layers,
        "llama.embedding_length": hidden,
        "llama.feed_forward_length": intermediate,
        "llama.attention.head_count": heads,
        "llama.attention.head_count_kv": kv_heads,
        "llama.rope.dimension_count": head_dim,
    }
    tmp = dst.with_name(dst.name + ".partial")
    writer = gguf.GGUFWriter(tmp, "llama")
    for key, field in src.fields.items():
        if key in _SKIP or key in sizes or key.startswith("general.") and key != "general.quantization_version":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    writer.add_name(f"synthetic llama {hidden}x{intermediate}x{layers}")
    for key, value in sizes.items():
        writer.add_uint32(key, value)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    vocab = int(src.fields["llama.vocab_size"].contents())
    rng = np.random.default_rng(seed)

    def add(name: str, *shape: int) -> None:
        # numpy shape (out, in), as the converter writes a [in, out] GGUF tensor
        values = np.ones(shape, np.float32) if len(shape) == 1 else rng.normal(0, 0.02, shape).astype(np.float32)
        writer.add_tensor(name, values, raw_dtype=gguf.GGMLQuantizationType.F32)

    add("token_embd.weight", vocab, hidden)
    for i in range(layers):
        b = f"blk.{i}."
        add(b + "attn_norm.weight", hidden)
        add(b + "attn_q.weight", hidden, hidden)
        add(b + "attn_k.weight", kv_heads * head_dim, hidden)
        add(b + "attn_v.weight", kv_heads * head_dim, hidden)
        add(b + "attn_output.weight", hidden, hidden)
        add(b + "ffn_norm.weight", hidden)
        add(b + "ffn_gate.weight", intermediate, hidden)
        add(b + "ffn_up.weight", intermediate, hidden)
        add(b + "ffn_down.weight", hidden, intermediate)
    add("output_norm.weight", hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(dst)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", type=pathlib.Path)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=8192)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quantize", default="Q4_K_M,Q4_1", help="comma-separated llama-quantize types ('' for none)")
    p.add_argument("--llama-bin", type=pathlib.Path, default=LLAMA_BIN)
    args = p.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    f32 = args.out_dir / "synthetic-F32.gguf"
    if not f32.is_file():
        write_synthetic_gguf(f32, args.hidden, args.intermediate, args.layers, args.heads, args.kv_heads, args.seed)
    print(f"{f32}: {f32.stat().st_size / 2**20:.0f} MiB")
    for qtype in filter(None, args.quantize.split(",")):
        out = args.out_dir / f"synthetic-{qtype}.gguf"
        if not out.is_file():
            log = args.out_dir / f"quantize-{qtype}.log"
            with log.open("w") as f:
                subprocess.run(
                    [str(args.llama_bin / "llama-quantize"), str(f32), str(out), qtype],
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    check=True,
                )
        print(f"{out}: {out.stat().st_size / 2**20:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
