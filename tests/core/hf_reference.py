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


@torch.inference_mode()
def hf_token_logprobs(model, token_ids: list[int]) -> list[float]:
    """Teacher-forced float32 log-probability of each token given the ones before it
    (len(token_ids) - 1 values: the first token has none)."""
    logits = model(input_ids=torch.tensor([token_ids])).logits[0, :-1].float()
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(1, torch.tensor(token_ids[1:]).unsqueeze(1)).squeeze(1).tolist()


def engine_token_logprobs(prompt_logprobs, token_ids: list[int]) -> list[float]:
    """The same values from an engine's ``prompt_logprobs`` (entry i: {token: Logprob})."""
    return [prompt_logprobs[i][t].logprob for i, t in enumerate(token_ids) if i > 0]
