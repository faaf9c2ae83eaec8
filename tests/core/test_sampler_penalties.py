"""The penalties' and logit edits' effect on the logits, exactly, against a hand
computation from vLLM's definitions:

- repetition penalty: every token seen in the prompt or the output has its logit divided
  by the penalty when positive, multiplied by it when negative (0 stays 0);
- frequency penalty: minus the penalty times the token's count in the output only;
- presence penalty: minus the penalty once for every token present in the output only;
- logit_bias: added to the logit (clamped to [-100, 100]).

The values are chosen so that the float32 results are exact or within one ulp.
"""

from __future__ import annotations

import torch

from pagedserve.executor.logits_processors import apply_logits_processors
from pagedserve.executor.sampler import Sampler
from pagedserve.request import Request
from pagedserve.sampling_params import SamplingParams

LOGITS = [2.0, -1.5, 0.75, 3.25, -0.5, 0.0, 1.25, -2.0]


def _request(prompt: list[int], output: list[int], **params) -> Request:
    r = Request("r", list(prompt), SamplingParams(**params))
    for t in output:
        r.append_token(t)
    return r


def _penalised(request: Request, logits: list[float] = LOGITS) -> list[float]:
    return Sampler._apply_penalties(torch.tensor([logits]), [request])[0].tolist()


def hand(logits, prompt, output, rep=1.0, freq=0.0, pres=0.0) -> list[float]:
    out = list(logits)
    seen = set(prompt) | set(output)
    for t in range(len(out)):
        if rep != 1.0 and t in seen:
            out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
        count = output.count(t)
        out[t] -= freq * count + (pres if count else 0.0)
    return out


def _close(a: list[float], b: list[float]) -> None:
    assert torch.allclose(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-6), (a, b)


def test_repetition_penalty_on_prompt_and_output_tokens():
    prompt, output = [0, 1, 5], [3, 3, 4]
    got = _penalised(_request(prompt, output, repetition_penalty=2.0))
    # Positive logits divided, negative multiplied, 0 unchanged, unseen untouched.
    assert got == [1.0, -3.0, 0.75, 1.625, -1.0, 0.0, 1.25, -2.0]
    _close(got, hand(LOGITS, prompt, output, rep=2.0))


def test_repetition_penalty_below_one_rewards_seen_tokens():
    got = _penalised(_request([6, 7], [], repetition_penalty=0.5))
    assert got == [2.0, -1.5, 0.75, 3.25, -0.5, 0.0, 2.5, -1.0]


def test_frequency_penalty_counts_output_tokens_only():
    prompt, output = [2, 2, 2, 6], [0, 0, 0, 6, 4]
    got = _penalised(_request(prompt, output, frequency_penalty=0.5))
    assert got == [0.5, -1.5, 0.75, 3.25, -1.0, 0.0, 0.75, -2.0]
    _close(got, hand(LOGITS, prompt, output, freq=0.5))


def test_presence_penalty_once_per_output_token():
    prompt, output = [1, 1], [3, 3, 3, 7]
    got = _penalised(_request(prompt, output, presence_penalty=0.25))
    assert got == [2.0, -1.5, 0.75, 3.0, -0.5, 0.0, 1.25, -2.25]


def test_negative_frequency_and_presence_penalties_reward():
    got = _penalised(_request([], [5, 5], frequency_penalty=-1.0, presence_penalty=-0.5))
    assert got[5] == 2.5 and got[:5] == LOGITS[:5]


def test_all_penalties_together():
    prompt, output = [0, 1, 2], [2, 3, 3, 6, 0]
    params = {"repetition_penalty": 1.25, "frequency_penalty": 0.375, "presence_penalty": 0.125}
    got = _penalised(_request(prompt, output, **params))
    _close(got, hand(LOGITS, prompt, output, rep=1.25, freq=0.375, pres=0.125))
    # One value by hand: token 3 seen twice in the output: 3.25 / 1.25 - 2 * 0.375 - 0.125.
    assert abs(got[3] - 1.725) < 1e-6


def test_no_output_yet_means_no_frequency_or_presence_penalty():
    got = _penalised(_request([0, 3], [], frequency_penalty=1.0, presence_penalty=1.0))
    assert got == LOGITS


def test_penalties_touch_only_their_own_row():
    a = _request([0], [3, 3], repetition_penalty=2.0, frequency_penalty=1.0)
    b = Request("b", [1], SamplingParams())
    c = _request([4], [6], presence_penalty=1.0)
    logits = torch.tensor([LOGITS] * 3)
    got = Sampler._apply_penalties(logits, [a, b, c]).tolist()
    _close(got[0], hand(LOGITS, [0], [3, 3], rep=2.0, freq=1.0))
    assert got[1] == LOGITS
    _close(got[2], hand(LOGITS, [4], [6], pres=1.0))
    assert logits.tolist() == [LOGITS] * 3  # the input is not modified


def test_token_ids_past_the_vocabulary_are_ignored():
    # A padded vocabulary: the prompt may hold ids the logits row does not have.
    got = _penalised(_request([1, 50], [60], repetition_penalty=2.0, frequency_penalty=1.0))
    assert got == [2.0, -3.0, 0.75, 3.25, -0.5, 0.0, 1.25, -2.0]


def test_logit_bias_is_added_and_clamped():
    r = _request([0], [], logit_bias={1: 2.5, "3": -0.25, 6: 500.0, 7: -1e9})
    got = apply_logits_processors(torch.tensor([LOGITS]), [r])[0].tolist()
    assert got == [2.0, 1.0, 0.75, 3.0, -0.5, 0.0, 101.25, -102.0]


def test_allowed_token_ids_mask_everything_else():
    r = _request([0], [], allowed_token_ids=[2, 5])
    got = apply_logits_processors(torch.tensor([LOGITS]), [r])[0].tolist()
    inf = float("-inf")
    assert got == [inf, inf, 0.75, inf, inf, 0.0, inf, inf]
