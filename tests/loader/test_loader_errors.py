"""Corrupt or contradictory checkpoints fail at load with one named error.

Each case is a tiny checkpoint written here and then damaged in one way; loading it must
raise ModelLoadError (a ValueError) whose message names the file and the field at fault,
never an AttributeError, ZeroDivisionError, RecursionError, a huge allocation or a model
that loads and generates garbage.
"""

from __future__ import annotations

import math
import pathlib
import subprocess
import sys

import pytest
from gguf import GGUFValueType

from pagedserve.loader import ModelLoadError, open_model

from .capped import run_capped
from .tiny_checkpoints import edit_config, write_tiny_gguf, write_tiny_safetensors


@pytest.fixture()
def folder(tmp_path: pathlib.Path) -> pathlib.Path:
    return write_tiny_safetensors(tmp_path / "tiny")


def test_tiny_checkpoints_load(folder: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """The undamaged files load: every failure below is caused by its damage."""
    open_model(folder).tokenizer()
    open_model(write_tiny_gguf(tmp_path / "ok.gguf")).tokenizer()


CONFIG_CASES = [
    ({"num_hidden_layers": 3}, "num_hidden_layers=3"),
    ({"num_attention_heads": 0}, "num_attention_heads=0"),
    ({"num_key_value_heads": 2}, "k_proj"),
    ({"num_attention_heads": 3, "num_key_value_heads": 2}, "num_attention_heads=3"),
    ({"hidden_size": 128}, "hidden_size"),
    ({"intermediate_size": 96}, "intermediate_size"),
    ({"vocab_size": 300}, "vocab_size"),
    ({"rope_theta": math.nan}, "rope_theta"),
    ({"rope_theta": -1.0}, "rope_theta"),
    ({"rms_norm_eps": -1e-5}, "rms_norm_eps"),
    ({"rms_norm_eps": math.inf}, "rms_norm_eps"),
    ({"max_position_embeddings": 2**32}, "max_position_embeddings"),
    ({"num_hidden_layers": 1.5}, "num_hidden_layers"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 0.0}}, "rope_scaling.factor"),
]


@pytest.mark.parametrize(("changes", "field"), CONFIG_CASES, ids=[f for _, f in CONFIG_CASES])
def test_bad_config_is_named(folder: pathlib.Path, changes: dict, field: str) -> None:
    edit_config(folder, **changes)
    with pytest.raises(ModelLoadError, match=field) as info:
        open_model(folder)
    assert str(folder) in str(info.value)


def test_truncated_safetensors_names_the_file(folder: pathlib.Path) -> None:
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        open_model(folder)


def test_truncated_tokenizer_json_names_the_file(folder: pathlib.Path) -> None:
    tok = folder / "tokenizer.json"
    tok.write_bytes(tok.read_bytes()[:-200])
    source = open_model(folder)
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        source.tokenizer()


GGUF_CASES = [
    ({"max_position_embeddings": 2**32 - 1}, "max_position_embeddings=4294967295"),
    ({"num_attention_heads": 0}, "num_attention_heads=0"),
    ({"num_key_value_heads": 1}, "k_proj"),
    ({"num_hidden_layers": 5}, "num_hidden_layers=5"),
    ({"hidden_size": 96}, "hidden_size"),
    ({"rope_theta": math.nan}, "rope_theta"),
    ({"rms_norm_eps": -1.0}, "rms_norm_eps"),
]


@pytest.mark.parametrize(("changes", "field"), GGUF_CASES, ids=[f for _, f in GGUF_CASES])
def test_bad_gguf_metadata_is_named(tmp_path: pathlib.Path, changes: dict, field: str) -> None:
    path = write_tiny_gguf(tmp_path / "bad.gguf", **changes)
    with pytest.raises(ModelLoadError, match=field) as info:
        open_model(path)
    assert "bad.gguf" in str(info.value)


def test_flipped_vocabulary_byte_is_named(tmp_path: pathlib.Path) -> None:
    path = write_tiny_gguf(tmp_path / "vocab.gguf")
    data = bytearray(path.read_bytes())
    # The token "he" (a u64 length 2, then the bytes): its merge "h e" no longer has a result.
    at = data.index(b"\x02\x00\x00\x00\x00\x00\x00\x00he")
    data[at + 8] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="vocab.gguf.*tokenizer"):
        open_model(path).tokenizer()


@pytest.mark.parametrize("depth", [9, 500])
def test_deeply_nested_metadata_is_named(tmp_path: pathlib.Path, depth: int) -> None:
    value: list = [1]
    for _ in range(depth - 1):
        value = [value]
    path = write_tiny_gguf(tmp_path / "nested.gguf", metadata={"general.nested": (value, GGUFValueType.ARRAY)})
    with pytest.raises(ModelLoadError, match="general.nested.*nests arrays"):
        open_model(path)


def test_huge_context_length_is_sized_by_max_model_len(tmp_path: pathlib.Path) -> None:
    """A model claiming 2^30 positions loads with max_model_len=256 under a 6 GiB cap
    (its full RoPE table would be 128 GiB), and without max_model_len is refused by name."""
    path = write_tiny_gguf(tmp_path / "long.gguf", max_position_embeddings=2**30)
    rc, reports, err = run_capped(f"""
        import json
        from pagedserve import LLM, SamplingParams
        try:
            LLM(model={str(path)!r}, quantization="none", kv_cache_memory="64MiB")
        except ValueError as e:
            print("@@" + json.dumps({{"refused": str(e)}}), flush=True)
        llm = LLM(model={str(path)!r}, quantization="none", max_model_len=256, kv_cache_memory="64MiB")
        out = llm.generate(["hello"], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
        print("@@" + json.dumps({{"tokens": out[0].outputs[0].token_ids}}), flush=True)
    """)
    assert rc == 0, err[-2000:]
    assert "pass max_model_len" in reports[0]["refused"]
    assert len(reports[1]["tokens"]) == 3


def test_serve_prints_one_line(folder: pathlib.Path) -> None:
    edit_config(folder, num_hidden_layers=4)
    proc = subprocess.run(
        [sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", str(folder), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "num_hidden_layers=4" in lines[-1] and str(folder) in lines[-1], proc.stderr[-2000:]
