"""MXFP4 GPT-OSS checkpoints dequantized at load: ``dequantize_mxfp4`` against a
dequantizer written here from the OCP Microscaling spec (E2M1 codes decoded from their
bit fields, E8M0 scales) and against transformers' own converter; then a tiny
checkpoint whose experts are stored as MXFP4 gives, through ``LLM``, transformers'
float32 greedy tokens and logprobs on the same (dequantized) weights."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve import LLM, SamplingParams
from pagedserve.models.mxfp4 import dequantize_mxfp4

transformers = pytest.importorskip("transformers")


def spec_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Element by bit fields: code = s eem (sign bit 3, exponent bits 2-1, mantissa bit
    0); 0.5 * m when e == 0, else 2^(e-1) * (1 + m / 2); the even element of each byte in
    its low nibble; times 2^(scale - 127).  float64, [..., rows, G * 32]."""
    b = blocks.long()
    codes = torch.stack([b % 16, b // 16], dim=-1).flatten(-2)  # [..., G, 32]
    sign = torch.where(codes >= 8, -1.0, 1.0).double()
    e, m = (codes // 2) % 4, (codes % 2).double()
    mag = torch.where(e == 0, 0.5 * m, torch.pow(2.0, (e - 1).double()) * (1 + m / 2))
    vals = sign * mag * torch.pow(2.0, scales.double() - 127).unsqueeze(-1)
    return vals.flatten(-2)


def _random_mx(gen: torch.Generator, *shape: int, low: int = 118, high: int = 128):
    blocks = torch.randint(0, 256, (*shape, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(low, high, shape, generator=gen, dtype=torch.uint8)
    return blocks, scales


def test_dequantize_matches_the_spec_and_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks, scales = _random_mx(gen, 3, 10, 4, low=100, high=150)
    got = dequantize_mxfp4(blocks, scales, torch.float32)
    assert got.shape == (3, 10, 128)
    torch.testing.assert_close(got.double(), spec_dequantize(blocks, scales), atol=0, rtol=0)
    hf = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [3, 128, 10], transposed
    torch.testing.assert_close(got, hf.transpose(1, 2), atol=0, rtol=0)
    with pytest.raises(ValueError, match="NaN"):
        dequantize_mxfp4(blocks, torch.full_like(scales, 255))
    with pytest.raises(ValueError, match="do not fit"):
        dequantize_mxfp4(blocks, scales[..., :3])


VOCAB, HIDDEN, INTER, EXPERTS = 259, 64, 64, 4


def _build(path) -> tuple[transformers.PreTrainedModel, dict]:
    """A float32 GPT-OSS whose experts hold MXFP4-representable values; its checkpoint
    is rewritten with the experts as blocks and scales."""
    from pagedserve.testing.tiny_model import write_byte_tokenizer

    cfg = transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, sliding_window=5, num_local_experts=EXPERTS, num_experts_per_tok=2,
        max_position_embeddings=256, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                         "rope_theta": 150000.0, "truncate": False},
    )  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.GptOssForCausalLM(cfg)
    packed: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("experts.gate_up_proj"):  # [E, H, 2I] <- blocks [E, 2I, H / 32, 16]
                blocks, scales = _random_mx(gen, EXPERTS, 2 * INTER, HIDDEN // 32)
                p.copy_(spec_dequantize(blocks, scales).transpose(1, 2))
                packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
            elif name.endswith("experts.down_proj"):  # [E, I, H] <- blocks [E, H, I / 32, 16]
                blocks, scales = _random_mx(gen, EXPERTS, HIDDEN, INTER // 32)
                p.copy_(spec_dequantize(blocks, scales).transpose(1, 2))
                packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
            elif "sinks" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 2)
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.2 if "embed" in name else 0.08))
            elif "bias" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            else:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
    model.eval()
    path.mkdir(parents=True, exist_ok=True)
    write_byte_tokenizer(path)
    model.save_pretrained(path, safe_serialization=True)
    (st,) = path.glob("*.safetensors")
    tensors = {k: v for k, v in load_file(st).items() if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    save_file({**tensors, **packed}, st, metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["self_attn", "router"]}
    (path / "config.json").write_text(json.dumps(config))
    return model, packed


@torch.inference_mode()
def _greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    ids, tokens, lps = list(prompt), [], []
    for _ in range(n):
        lp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1].float(), -1)
        tokens.append(int(lp.argmax()))
        lps.append(float(lp.max()))
        ids.append(tokens[-1])
    return tokens, lps


@pytest.mark.timeout(180)
@pytest.mark.parametrize("tp", [1, 2])
def test_mxfp4_checkpoint_matches_transformers_on_the_dequantized_weights(tmp_path, tp):
    """At TP=2 each rank keeps whole MXFP4 blocks of every expert's intermediate rows."""
    model, packed = _build(tmp_path / "ckpt")
    assert any(k.endswith("gate_up_proj_blocks") for k in packed)
    prompts = [[5, 77, 140, 33, 9, 201, 18, 64, 99, 12, 250], [7], [40, 41, 42, 43, 44, 45, 46]]
    expected = [_greedy(model, p, 8) for p in prompts]
    llm = LLM(
        model=str(tmp_path / "ckpt"), dtype="float32", kv_cache_memory="8MiB", block_size=4,
        max_num_batched_tokens=8, enable_prefix_caching=True, tensor_parallel_size=tp,
        distributed_executor_backend="mp" if tp > 1 else None,
    )  # fmt: skip
    try:
        layer = llm.llm_engine.runner.model.layers[0]
        assert tuple(layer.w13.shape) == (EXPERTS, 2 * INTER // tp, HIDDEN)
        assert tuple(layer.w2.shape) == (EXPERTS, HIDDEN, INTER // tp) and layer.sinks.shape == (4 // tp,)
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
        for out, (tokens, lps) in zip(llm.generate(prompts, params, use_tqdm=False), expected):
            got = out.outputs[0]
            assert got.token_ids == tokens
            for tok, entry, want in zip(got.token_ids, got.logprobs, lps):
                assert math.isclose(entry[tok].logprob, want, abs_tol=2e-4)
    finally:
        llm.shutdown()
