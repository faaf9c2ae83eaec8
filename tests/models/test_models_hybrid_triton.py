"""The Triton kernels of the recurrent layers inside the engine: a Qwen3.5 (Gated
DeltaNet), a Granite 4 (Mamba 2), an LFM2 (short convolutions) and a Jamba (Mamba 1)
tiny checkpoint prefill with ``causal_conv1d``, ``gated_delta_rule``, ``mamba2_ssd`` and
``mamba1_scan`` (kernels/triton/recurrent_prefill.py) and decode with
``causal_conv1d_update``, ``gated_delta_rule_recurrent``, ``mamba2_ssd_step`` and
``mamba1_scan_step`` (kernels/triton/recurrent.py), Triton's interpreter without a GPU,
and give transformers' greedy tokens and logprobs."""

from __future__ import annotations

import math
import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from test_models_hybrid_vs_hf import COMMON, _prompts, build_checkpoint, hf_reference  # noqa: E402

from pagedserve import LLM, SamplingParams  # noqa: E402
from pagedserve.kernels.triton import recurrent, recurrent_prefill  # noqa: E402

TRITON_OPS = {
    "gated_delta_rule_recurrent": recurrent.gated_delta_rule_recurrent_triton,
    "mamba2_ssd_step": recurrent.mamba2_ssd_step_triton,
    "mamba1_scan_step": recurrent.mamba1_scan_step_triton,
    "causal_conv1d_update": recurrent.causal_conv1d_update_triton,
    **recurrent_prefill.PREFILL_KERNELS,
}


@pytest.mark.parametrize(
    "case",
    [
        "qwen3_5-deltanet-gated-attn",
        pytest.param("granite4-mamba2-moe-nope", marks=pytest.mark.slow),
        pytest.param("lfm2-shortconv-bias-attn", marks=pytest.mark.slow),
        pytest.param("jamba-mamba1-moe-attn", marks=pytest.mark.slow),
    ],
)
def test_triton_kernels_in_the_engine_match_transformers(case, tmp_path):
    model = build_checkpoint(tmp_path / "ckpt", case)
    prompts = _prompts(5)[:3]
    expected = [hf_reference(model, p, 5) for p in prompts]
    llm = LLM(model=str(tmp_path / "ckpt"), **COMMON, device="cpu")
    ops = llm.llm_engine.runner.ops
    calls: list[str] = []
    for name, fn in TRITON_OPS.items():

        def counted(*args, _fn=fn, _name=name, **kwargs):
            calls.append(_name)
            return _fn(*args, **kwargs)

        ops.register(name, counted, source="triton")
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert calls.count("causal_conv1d_update") >= 4  # 4 decode steps
    assert "causal_conv1d" in calls  # the prompts' prefill
    scans = {
        "qwen3_5": ("gated_delta_rule", "gated_delta_rule_recurrent"),
        "granite4": ("mamba2_ssd", "mamba2_ssd_step"),
        "jamba": ("mamba1_scan", "mamba1_scan_step"),
    }
    family = case.split("-")[0]
    assert set(scans.get(family, ())) <= set(calls), (case, sorted(set(calls)))
    for out, (tokens, logprobs) in zip(outs, expected):
        got = out.outputs[0]
        assert got.token_ids == tokens
        for tok, entry, want in zip(got.token_ids, got.logprobs, logprobs):
            assert math.isclose(entry[tok].logprob, want, abs_tol=2e-4)
