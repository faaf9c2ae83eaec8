"""Random PEFT LoRA adapters made with peft itself, and their merged transformers
reference (peft initialises B to zero: both halves are randomised here)."""

from __future__ import annotations

from pathlib import Path

import torch


def make_adapter(
    hf_model,
    out: Path,
    seed: int,
    r: int = 8,
    alpha: float = 16,
    targets=("q_proj", "v_proj"),
    rslora: bool = False,
    std: float = 0.08,
) -> Path:
    """Save a random adapter for ``hf_model`` (left unchanged) in PEFT format at ``out``."""
    import copy

    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(
        r=r, lora_alpha=alpha, target_modules=list(targets), use_rslora=rslora, lora_dropout=0.0, task_type="CAUSAL_LM"
    )
    model = get_peft_model(copy.deepcopy(hf_model), cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    model.save_pretrained(str(out))
    return out


def merged_model(hf_model, adapter: Path):
    """A copy of ``hf_model`` with the adapter merged into its weights (float32, eval)."""
    import copy

    from peft import PeftModel

    model = PeftModel.from_pretrained(copy.deepcopy(hf_model), str(adapter))
    return model.merge_and_unload().eval()


@torch.inference_mode()
def logprobs_of(model, token_ids: list[int]) -> torch.Tensor:
    """log-softmax float32 [len(token_ids), vocab] of one full forward."""
    logits = model(input_ids=torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)
