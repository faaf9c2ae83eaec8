"""Adapters on the real default model (SmolLM2-135M-Instruct, dequantized, float32):
the base and two adapters mixed in one batch equal transformers + peft (merged)."""

from __future__ import annotations

import pytest
import torch
from peft_adapters import make_adapter
from test_lora_vs_peft import check_against_peft

from pagedserve import LLM, SamplingParams
from pagedserve.lora import LoRARequest

pytest.importorskip("peft")
pytest.importorskip("gguf")

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_default_model_adapters_match_peft(tmp_path, default_model_hf_dir):
    import transformers

    # transformers' reading of the GGUF file, saved once per session (tests/conftest.py).
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(default_model_hf_dir), dtype=torch.float32).eval()
    paths = [
        make_adapter(hf, tmp_path / "a1", seed=1, r=8, alpha=16, targets=ALL, std=0.03),
        make_adapter(
            hf,
            tmp_path / "a2",
            seed=2,
            r=16,
            alpha=16,
            targets=("q_proj", "v_proj", "down_proj"),
            rslora=True,
            std=0.03,
        ),
    ]
    llm = LLM(
        dtype="float32",
        quantization="none",
        enable_lora=True,
        max_loras=2,
        max_lora_rank=16,
        kv_cache_memory="64MiB",
        max_model_len=256,
    )
    reqs = [LoRARequest("a1", 1, str(paths[0])), LoRARequest("a2", 2, str(paths[1]))]
    tok = llm.get_tokenizer()
    prompt = tok.encode("The capital of France is")
    prompts, loras = [prompt] * 3, [None, *reqs]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    check_against_peft(outs, prompts, loras, hf, paths, atol=2e-3)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) > 1
