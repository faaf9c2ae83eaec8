"""Helpers of the quantization tests (no tests here): reference quantizers written from the
published GPTQ/AWQ formats, HF folder writers, and sequence scoring through the engine."""

from __future__ import annotations

import json
import math
import shutil
import zlib
from pathlib import Path

import torch

from pagedserve.executor.attention_metadata import AttentionMetadata

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

#: A small text set for the perplexity deltas.
TEXTS = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.",
    "Water boils at one hundred degrees Celsius at sea level, and freezes at zero degrees.",
    "In the beginning the universe was created. This has made a lot of people very angry.",
)


def _to_int32(v: torch.Tensor) -> torch.Tensor:
    """int64 holding 32-bit patterns -> int32 with the same bits."""
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)


#: AutoAWQ's GEMM pack order, as its packer writes it (``WQLinear_GEMM.from_linear``:
#: ``order_map = [0, 2, 4, 6, 1, 3, 5, 7]``; nibble i of each int32 takes column
#: ``order_map[i]`` of its 8).  Written here from the format, never imported from
#: pagedserve, so a wrong order in the product's unpacking cannot cancel out.
AUTOAWQ_ORDER_MAP: tuple[int, ...] = (0, 2, 4, 6, 1, 3, 5, 7)


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """int [R, C] in [0, 15] -> int32 [R/8, C]; row 8i+j in bits 4j.. (GPTQ qweight)."""
    q = q.long().reshape(-1, 8, q.shape[1])
    return _to_int32(sum(q[:, j] << (4 * j) for j in range(8)))


def pack_cols(q: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """int [R, C] in [0, 15] -> int32 [R, C/8]; nibble i holds column order[i] of each 8."""
    q = q.long().reshape(q.shape[0], -1, 8)
    return _to_int32(sum(q[:, :, order[i]] << (4 * i) for i in range(8)))


def _minmax_params(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit parameters of rows' groups: w [..., n] -> (fp16 scale, int zero in [1, 15])."""
    lo, hi = w.amin(dim=0).clamp(max=0), w.amax(dim=0).clamp(min=0)
    scale = ((hi - lo) / 15).clamp_min(1e-6).half()
    # Zero >= 1: GPTQ checkpoints store zero - 1 in 4 bits.
    zero = torch.round(-lo / scale.float()).clamp(1, 15)
    return scale, zero


def gptq_quantize(w: torch.Tensor, group_size: int, act_order: bool, gen: torch.Generator):
    """float [N, K] -> (tensors of a GPTQ checkpoint, dequantized float [N, K])."""
    wt = w.t().float()  # [K, N]
    k, n = wt.shape
    perm = torch.randperm(k, generator=gen) if act_order else torch.arange(k)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = (torch.arange(k) // group_size).int()
    groups = k // group_size
    scales = torch.empty(groups, n, dtype=torch.float16)
    zeros = torch.empty(groups, n)
    for g in range(groups):
        scales[g], zeros[g] = _minmax_params(wt[g_idx == g])
    s, z = scales.float()[g_idx.long()], zeros[g_idx.long()]
    q = torch.clamp(torch.round(wt / s) + z, 0, 15)
    deq = ((q - z) * s).t().contiguous()
    tensors = {"qweight": pack_rows(q), "qzeros": pack_cols(zeros - 1), "scales": scales, "g_idx": g_idx}
    return tensors, deq


def awq_quantize(w: torch.Tensor, group_size: int):
    """float [N, K] -> (tensors of an AWQ GEMM checkpoint, dequantized float [N, K])."""
    wt = w.t().float()  # [K, N]
    k, n = wt.shape
    groups = k // group_size
    scales = torch.empty(groups, n, dtype=torch.float16)
    zeros = torch.empty(groups, n)
    for g in range(groups):
        scales[g], zeros[g] = _minmax_params(wt[g * group_size : (g + 1) * group_size])
    idx = torch.arange(k) // group_size
    s, z = scales.float()[idx], zeros[idx]
    q = torch.clamp(torch.round(wt / s) + z, 0, 15)
    deq = ((q - z) * s).t().contiguous()
    tensors = {
        "qweight": pack_cols(q, AUTOAWQ_ORDER_MAP),
        "qzeros": pack_cols(zeros, AUTOAWQ_ORDER_MAP),
        "scales": scales,
    }
    return tensors, deq


def write_quantized_pair(src: Path, dst: Path, method: str, group_size: int = 32, act_order: bool = True):
    """From float checkpoint ``src``: a ``method`` checkpoint at ``dst`` and, at ``dst``-fake,
    a float checkpoint of its dequantized weights (what the quantized model must compute)."""
    from safetensors.torch import load_file, save_file

    fake = dst.with_name(dst.name + "-fake")
    for d in (dst, fake):
        shutil.copytree(src, d)
        for f in d.glob("*.safetensors"):
            f.unlink()
    weights = {}
    for f in sorted(src.glob("*.safetensors")):
        weights.update(load_file(f))
    quant, deq = {}, {}
    for name, t in weights.items():
        module = name.rsplit(".", 2)
        if name.endswith(".weight") and module[-2] in LINEARS:
            prefix = name[: -len(".weight")]
            if method == "gptq":
                # q/k/v (and gate/up) see the same input, so GPTQ's act order is shared.
                layer = name.rsplit(".", 3)[0]
                key = layer + {
                    "q_proj": "in",
                    "k_proj": "in",
                    "v_proj": "in",
                    "gate_proj": "mlp",
                    "up_proj": "mlp",
                }.get(module[-2], module[-2])
                g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
                tensors, d = gptq_quantize(t, group_size, act_order, g)
            else:
                tensors, d = awq_quantize(t, group_size)
            for leaf, v in tensors.items():
                quant[f"{prefix}.{leaf}"] = v
            deq[name] = d
        else:
            quant[name] = t
            deq[name] = t
    save_file({k: v.contiguous() for k, v in quant.items()}, str(dst / "model.safetensors"))
    save_file({k: v.contiguous() for k, v in deq.items()}, str(fake / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    if method == "gptq":
        qcfg = {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": group_size,
            "desc_act": act_order,
            "sym": False,
            "checkpoint_format": "gptq",
        }
    else:
        qcfg = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
    config["quantization_config"] = qcfg
    (dst / "config.json").write_text(json.dumps(config))
    return dst, fake


def sequence_logprobs(llm, ids: list[int]) -> torch.Tensor:
    """float32 [len(ids) - 1]: log p(ids[i+1] | ids[:i+1]) from one prefill of ``llm``'s model
    (uses the first KV blocks; call between generate() calls only)."""
    runner = llm.llm_engine.runner
    n, bs = len(ids), runner.block_size
    blocks = -(-n // bs)
    meta = AttentionMetadata(
        positions=torch.arange(n),
        slot_mapping=torch.arange(n),
        block_tables=torch.arange(blocks, dtype=torch.int32)[None],
        seq_lens=torch.tensor([n], dtype=torch.int32),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
    )
    tokens = torch.tensor(ids)
    with torch.inference_mode():
        hidden = runner.model.forward(tokens.to(runner.device), meta, runner.kv_caches)
        logits = runner.model.compute_logits(hidden).float()
    return logits.log_softmax(-1)[:-1].gather(1, tokens[1:, None]).squeeze(1)


def perplexity(llm, texts=TEXTS) -> float:
    tok = llm.get_tokenizer()
    total, count = 0.0, 0
    for text in texts:
        lp = sequence_logprobs(llm, tok.encode(text))
        total -= lp.sum().item()
        count += lp.numel()
    return math.exp(total / count)


def greedy(llm, prompts, max_tokens: int = 12) -> list[list[int]]:
    from pagedserve import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of positions where greedy tokens agree, counting each sequence up to its first difference."""
    same = total = 0
    for x, y in zip(a, b):
        total += len(x)
        for i, j in zip(x, y):
            if i != j:
                break
            same += 1
    return same / total
