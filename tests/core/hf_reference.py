"""Greedy and logits references computed with Hugging Face transformers."""

from __future__ import annotations

import torch


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation with a KV cache and no EOS handling (like ignore_eos)."""
    ids = torch.tensor([prompt_ids])
    out = model(input_ids=ids, use_cache=True)
    past = out.past_key_values
    generated = []
    nxt = int(out.logits[0, -1].argmax())
    for _ in range(max_new_tokens):
        generated.append(nxt)
        if len(generated) == max_new_tokens:
            break
        out = model(input_ids=torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        nxt = int(out.logits[0, -1].argmax())
    return generated


@torch.inference_mode()
def hf_logits(model, token_ids: list[int]) -> torch.Tensor:
    """float32 logits [len(token_ids), vocab] of one full forward."""
    return model(input_ids=torch.tensor([token_ids])).logits[0].float()


def load_hf(path, **kwargs):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32, **kwargs)
    model.eval()
    return model
