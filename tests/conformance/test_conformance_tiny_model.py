"""The kit's tiny checkpoints: its own safetensors writer produces exactly what
transformers reads, and the engine's greedy outputs on it match transformers'."""

from __future__ import annotations

import json
import os

import pytest
import torch

from pagedserve.testing import TinyLlamaSpec, make_tiny_llama
from pagedserve.testing.engine_check import conformance_prompts

transformers = pytest.importorskip("transformers")


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    for _ in range(n):
        ids = torch.cat([ids, model(input_ids=ids).logits[0, -1].argmax().view(1, 1)], dim=1)
    return ids[0, len(prompt) :].tolist()


def test_own_writer_is_read_by_transformers_and_the_engine_agrees(tmp_path, monkeypatch):
    path = make_tiny_llama(tmp_path / "m", writer="safetensors", seed=3)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, torch_dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info  # no missing, unexpected or mismatched weights
    spec = TinyLlamaSpec()
    assert hf.config.head_dim == spec.head_dim and hf.config.num_key_value_heads == spec.num_key_value_heads

    for key in [k for k in list(os.environ) if k.startswith("PAGEDSERVE_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("PAGEDSERVE_CPU_KERNELS", "0")  # the references: this checks the checkpoint
    from pagedserve import LLM, SamplingParams

    prompts = conformance_prompts(hf.config.vocab_size)[:4]
    llm = LLM(model=str(path), device="cpu", dtype="float32", kv_cache_memory="8MiB")
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_greedy(hf.eval(), p, 8) for p in prompts]


def test_writers_agree_on_the_format(tmp_path):
    own = make_tiny_llama(tmp_path / "own", writer="safetensors")
    ref = make_tiny_llama(tmp_path / "hf", writer="auto")  # transformers, which is installed here
    from safetensors import safe_open

    def shapes(folder):
        with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}

    assert shapes(own) == shapes(ref)
    cfg = json.loads((own / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] is False
    with pytest.raises(ValueError, match="writer must be"):
        make_tiny_llama(tmp_path / "x", writer="pickle")
