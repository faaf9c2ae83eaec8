"""Small GGUF files written here from random models: every supported tensor type, the
Q/K row permutation, name mapping and the errors for what is not supported; dequantization
of each tensor type and the byte-level tokenizer built from GGUF metadata."""

from __future__ import annotations

import pathlib
from typing import Any

import numpy as np
import pytest
import torch

from pagedserve.loader import open_model
from pagedserve.loader.dequant import dequantize
from pagedserve.loader.gguf_checkpoint import GGUFCheckpoint, reverse_rope_permutation

# One tensor type per projection; q/k of layer 0 stay F32 so the permutation can be checked
# against the original weights exactly. K-quant tensors get random block bytes because the
# gguf package cannot quantize to them.
LLAMA_TYPES = {
    "model.embed_tokens.weight": "Q8_0",
    "lm_head.weight": "Q6_K",
    "model.layers.0.self_attn.v_proj.weight": "Q4_0",
    "model.layers.0.self_attn.o_proj.weight": "Q4_1",
    "model.layers.0.mlp.gate_proj.weight": "Q5_0",
    "model.layers.0.mlp.up_proj.weight": "Q5_1",
    "model.layers.0.mlp.down_proj.weight": "Q8_0",
    "model.layers.1.self_attn.q_proj.weight": "Q4_K",
    "model.layers.1.self_attn.k_proj.weight": "Q5_K",
    "model.layers.1.self_attn.v_proj.weight": "Q2_K",
    "model.layers.1.self_attn.o_proj.weight": "Q3_K",
    "model.layers.1.mlp.gate_proj.weight": "BF16",
    "model.layers.1.mlp.up_proj.weight": "F16",
}
RANDOM_BYTES = tuple(name for name, kind in LLAMA_TYPES.items() if kind.endswith("_K"))
# Worst-case relative error (max abs error / max abs value) of each type on Gaussian weights.
TOLERANCE = {
    "F32": 0.0,
    "F16": 1e-3,
    "BF16": 8e-3,
    "Q8_0": 1e-2,
    "Q5_0": 0.07,
    "Q5_1": 0.07,
    "Q4_0": 0.15,
    "Q4_1": 0.15,
}


def _reference_state(model: Any, tied: bool) -> dict[str, torch.Tensor]:
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if tied:
        state.pop("lm_head.weight")
    return state


@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Any, write_gguf: Any) -> pathlib.Path:
    model, shape = tiny_llama
    folder = tmp_path_factory.mktemp("llama_gguf")
    return write_gguf(
        folder / "tiny-llama.gguf",
        "llama",
        shape,
        _reference_state(model, tied=False),
        LLAMA_TYPES,
        random_bytes=RANDOM_BYTES,
    )


def _transformers_state(path: pathlib.Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return {k: v.detach() for k, v in model.state_dict().items()}


def test_llama_gguf_equals_transformers(llama_gguf: pathlib.Path) -> None:
    ours = dict(open_model(llama_gguf).weights())
    reference = _transformers_state(llama_gguf)
    assert set(ours) == set(reference)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32 and tensor.shape == reference[name].shape, name
        assert torch.isfinite(tensor).all(), name
        assert torch.equal(tensor, reference[name]), name


def test_llama_gguf_recovers_the_original_weights(llama_gguf: pathlib.Path, tiny_llama: Any) -> None:
    model, shape = tiny_llama
    source = open_model(llama_gguf)
    ours = dict(source.weights())
    original = model.state_dict()
    # F32 tensors, including layer 0's permuted q/k projections, come back bit for bit.
    for name in (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.norm.weight",
        "model.layers.1.mlp.down_proj.weight",
    ):
        assert torch.equal(ours[name], original[name]), name
    for name, kind in LLAMA_TYPES.items():
        if name in RANDOM_BYTES:
            continue
        error = (ours[name] - original[name]).abs().max() / original[name].abs().max()
        assert error <= TOLERANCE[kind], (name, kind, float(error))

    config = source.hf_config
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is False
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "max_position_embeddings",
    ):
        assert config[key] == shape[key], key
    assert config["head_dim"] == 64 and config["rope_theta"] == shape["rope_theta"]
    assert config["rms_norm_eps"] == pytest.approx(shape["rms_norm_eps"])
    assert config["torch_dtype"] == "float32"


def test_qwen2_gguf_has_biases_and_no_permutation(tmp_path: pathlib.Path, tiny_qwen2: Any, write_gguf: Any) -> None:
    model, shape = tiny_qwen2
    state = _reference_state(model, tied=True)
    types = {"model.embed_tokens.weight": "F16"}
    path = write_gguf(tmp_path / "tiny-qwen2.gguf", "qwen2", shape, state, types)
    source = open_model(path)
    ours = dict(source.weights())
    assert set(ours) == set(state)
    assert source.hf_config["architectures"] == ["Qwen2ForCausalLM"]
    assert source.hf_config["tie_word_embeddings"] is True and source.hf_config["attention_bias"] is True
    for name, tensor in ours.items():
        if name == "model.embed_tokens.weight":
            assert torch.allclose(tensor, state[name], rtol=1e-3, atol=1e-4)
        else:
            assert torch.equal(tensor, state[name]), name
    reference = _transformers_state(path)
    for name, tensor in ours.items():
        assert torch.equal(tensor, reference[name]), name


def test_reverse_permutation_inverts_llama_cpp(llama_cpp_permute: Any) -> None:
    rng = np.random.default_rng(1)
    for heads, head_dim in ((4, 8), (3, 64), (1, 4)):
        weight = rng.standard_normal((heads * head_dim, 5)).astype(np.float32)
        permuted = llama_cpp_permute(weight, heads)
        assert not np.array_equal(permuted, weight)
        assert np.array_equal(reverse_rope_permutation(permuted, heads), weight)


def test_unsupported_quant_type_is_named(tmp_path: pathlib.Path, tiny_llama: Any, write_gguf: Any) -> None:
    import gguf

    _, shape = tiny_llama
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.IQ2_XXS]
    data = np.zeros((4, 256 // block * size), dtype=np.uint8)
    extra = {"blk.0.attn_v.weight": (data, "IQ2_XXS")}
    path = write_gguf(tmp_path / "iq.gguf", "llama", shape, {}, {}, extra_tensors=extra)
    with pytest.raises(ValueError, match=r"blk\.0\.attn_v\.weight.*IQ2_XXS"):
        open_model(path)


def test_unknown_tensor_and_architecture_are_refused(tmp_path: pathlib.Path, tiny_llama: Any, write_gguf: Any) -> None:
    _, shape = tiny_llama
    data = np.zeros((4, 8), dtype=np.float32)
    extra = {"blk.0.mystery.weight": (data, "F32")}
    path = write_gguf(tmp_path / "odd.gguf", "llama", shape, {}, {}, extra_tensors=extra)
    with pytest.raises(ValueError, match="blk.0.mystery.weight"):
        open_model(path)

    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "mamba.gguf"), "mamba")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="mamba"):
        open_model(tmp_path / "mamba.gguf")


def test_metadata_rope_scaling_and_stop_ids(tmp_path: pathlib.Path, tiny_llama: Any, write_gguf: Any) -> None:
    _, shape = tiny_llama
    metadata = {
        "llama.rope.scaling.type": "linear",
        "llama.rope.scaling.factor": 4.0,
        "llama.rope.scaling.original_context_length": 64,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.eot_token_id": 5,
    }
    # Metadata only: a file without tensors is no loadable model, so read it below open_model.
    source = GGUFCheckpoint(write_gguf(tmp_path / "meta.gguf", "llama", shape, {}, {}, metadata=metadata))
    config = source.hf_config()
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 4.0, "original_max_position_embeddings": 64}
    assert source.eos_token_ids() == [2, 5] and config["eos_token_id"] == 2


def test_corrupt_gguf_is_a_clear_error(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"NOTGGUF" + bytes(64))
    with pytest.raises(ValueError, match="broken.gguf"):
        open_model(path)


# Dequantization, against gguf.quants.dequantize bit for bit and against the ggml block layouts.

FAST_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
# Plus two that `dequantize` hands to gguf, to check its row handling on that path too.
DEQUANT_TYPES = (*FAST_TYPES, "Q5_1", "Q6_K")
# Byte offsets of each block's fp16 scale fields.
SCALE_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2)}


def _random_data(rng: np.random.Generator, type_name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Random stored bytes for a tensor of `shape` whose fp16 scales are finite (any sign,
    magnitudes from subnormal to ~1e4); the other bytes, plain float data included, are arbitrary."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    n_blocks = int(np.prod(shape)) // block
    # Types without listed scale fields (the ones gguf dequantizes for us) get bytes below 0x3C,
    # which keeps every fp16 they embed finite.
    high = 256 if type_name in FAST_TYPES else 0x3C
    blocks = rng.integers(0, high, (n_blocks, size), dtype=np.uint8)
    for start in SCALE_FIELDS.get(type_name, ()):
        magnitude = 10.0 ** rng.uniform(-8, 4, n_blocks)
        scales = np.clip(rng.standard_normal(n_blocks) * magnitude, -6e4, 6e4).astype(np.float16)
        blocks[:, start : start + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(-1)


@pytest.mark.parametrize("type_name", DEQUANT_TYPES)
@pytest.mark.parametrize("shape", [(1, 256), (7, 512), (2, 3, 768), (64, 4096)])
def test_dequantize_is_bit_exact_with_gguf(type_name: str, shape: tuple[int, ...]) -> None:
    import gguf

    rng = np.random.default_rng([DEQUANT_TYPES.index(type_name), *shape])
    raw = _random_data(rng, type_name, shape)
    raw.flags.writeable = False  # as a view of a read-only memory map would be
    ours = dequantize(raw, type_name, shape)
    qtype = gguf.GGMLQuantizationType[type_name]
    reference = gguf.quants.dequantize(raw.reshape(-1, raw.size // int(np.prod(shape[:-1]))), qtype)
    reference = np.asarray(reference, dtype=np.float32).reshape(shape)
    assert ours.dtype == np.float32 and ours.shape == shape
    assert ours.flags.writeable and not np.shares_memory(ours, raw)
    if type_name in SCALE_FIELDS:
        assert np.isfinite(ours).all()
    # Compared as bits, so NaN payloads and signed zeros of the plain float types count too.
    assert np.array_equal(ours.view(np.uint32), reference.view(np.uint32))


def test_dequantize_follows_the_ggml_block_layouts() -> None:
    """One hand-built block per type, values computed from the layout in ggml-common.h."""
    j = np.arange(16)
    half = lambda x: np.array([x], dtype=np.float16).view(np.uint8)  # noqa: E731
    q4 = (j | ((15 - j) << 4)).astype(np.uint8)  # low nibbles 0..15, high nibbles 15..0
    nibbles = np.concatenate([j, 15 - j]).astype(np.float32)

    q4_0 = np.concatenate([half(0.5), q4])
    assert np.array_equal(dequantize(q4_0, "Q4_0", (32,)), (nibbles - 8) * 0.5)
    q4_1 = np.concatenate([half(0.25), half(-1.0), q4])
    assert np.array_equal(dequantize(q4_1, "Q4_1", (32,)), nibbles * 0.25 - 1.0)
    q8 = np.arange(-16, 16, dtype=np.int8)
    q8_0 = np.concatenate([half(-2.0), q8.view(np.uint8)])
    assert np.array_equal(dequantize(q8_0, "Q8_0", (1, 32)), (q8 * -2.0).astype(np.float32).reshape(1, 32))
    bf16 = np.array([1.5, -2.25, 2.0**100], dtype=np.float32).view(np.uint32) >> 16  # exact in bfloat16
    assert np.array_equal(dequantize(bf16.astype(np.uint16).view(np.uint8), "BF16", (3,)), [1.5, -2.25, 2.0**100])


def test_dequantize_checks_sizes() -> None:
    with pytest.raises(ValueError, match="do not hold a tensor of shape"):
        dequantize(np.zeros(34, dtype=np.uint8), "Q8_0", (2, 32))
    with pytest.raises(ValueError, match="do not hold a tensor of shape"):
        dequantize(np.zeros(34, dtype=np.uint8), "Q8_0", (2, 16))
    with pytest.raises(ValueError, match="Unknown ggml type"):
        dequantize(np.zeros(4, dtype=np.uint8), "Q9_9", (1,))


def test_byte_level_tokenizer_from_gguf_metadata() -> None:
    """Raw-text tokens are respelled in the byte alphabet, user-defined tokens are added,
    a CONTROL token spelled outside the alphabet is not, and a bad merge is named."""
    from pagedserve.loader.gguf_tokenizer import build_gguf_tokenizer, bytes_to_unicode

    spelling = bytes_to_unicode()
    tokens = [spelling[b] for b in range(256)] + ["he", "âĤ", "€", "<|ctl|>", "<ctl raw>", "userdef"]
    types = [1] * 256 + [1, 1, 1, 3, 3, 4]
    metadata = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": ["h e", "â Ĥ", "âĤ ¬"],
    }
    backend = build_gguf_tokenizer(metadata)
    vocab = backend.get_vocab(with_added_tokens=False)
    assert vocab["he"] == 256 and vocab["âĤ¬"] == 258 and vocab["<ctlĠraw>"] == 260  # € is E2 82 AC
    added = {i: (t.content, t.special) for i, t in backend.get_added_tokens_decoder().items()}
    assert added == {259: ("<|ctl|>", True), 261: ("userdef", False)}
    assert backend.encode("he€<|ctl|>userdef").ids == [256, 258, 259, 261]

    with pytest.raises(ValueError, match="'a b c' is not two tokens"):
        build_gguf_tokenizer({**metadata, "tokenizer.ggml.merges": ["h e", "a b c"]})
