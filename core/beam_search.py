"""Beam search on top of the engine, as vLLM's ``LLM.beam_search`` does it.

Each step submits every live beam as a one-token request asking for the logprobs of its
``2 * beam_width`` most likely next tokens; the candidates (beam + token) are ranked by
cumulative logprob and the best ``beam_width`` survive.  Beams of one prompt share all
but their last tokens, so prefix caching serves their common prefix blocks and each step
computes roughly one new token per beam.  A candidate ending in EOS (unless
``ignore_eos``) is set aside as completed; at the end the completed and live beams are
ranked by ``cum_logprob / len(tokens) ** length_penalty`` (vLLM's score, prompt included,
EOS excluded) and the best ``beam_width`` returned, best first.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from pagedserve.outputs import Logprob
from pagedserve.sampling_params import SamplingParams

__all__ = ["BeamSearchParams", "BeamSearchSequence", "BeamSearchOutput", "BeamSearch"]

MAX_BEAM_WIDTH = 10  # 2 x beam_width candidates per beam; logprobs go up to 20


def length_penalized(cum_logprob: float, length: int, length_penalty: float) -> float:
    """``cum_logprob / length ** length_penalty`` (vLLM's beam score), saturating where
    plain float arithmetic raises: a large penalty makes ``length ** penalty`` overflow
    (OverflowError), a very negative one underflow to 0 (ZeroDivisionError).  The score
    then runs out to 0 or -inf (cum_logprob is <= 0), which still ranks."""
    try:
        denominator = float(max(length, 1)) ** length_penalty
    except OverflowError:
        denominator = math.inf
    if denominator == 0.0:
        return 0.0 if cum_logprob == 0.0 else math.copysign(math.inf, cum_logprob)
    return cum_logprob / denominator


@dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be an integer in [1, {MAX_BEAM_WIDTH}], got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if (
            not isinstance(self.length_penalty, (int, float))
            or self.length_penalty != self.length_penalty
            or abs(self.length_penalty) == float("inf")
        ):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        # The step's SamplingParams checks temperature (finite, >= 0).
        self.step_params()

    def step_params(self) -> SamplingParams:
        return SamplingParams(max_tokens=1, temperature=self.temperature, logprobs=2 * self.beam_width, ignore_eos=True)


@dataclass
class BeamSearchSequence:
    """One beam: all its tokens (prompt first), the logprob entries of the generated ones."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best ``beam_width`` beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


class BeamSearch:
    """The beams of a batch of prompts; ``run`` / ``run_async`` drive it with an
    ``expand`` callback that returns, per token list, the logprob entries of its next token."""

    def __init__(
        self, prompts: list[list[int]], params: BeamSearchParams, eos_token_ids: frozenset[int], max_model_len: int
    ) -> None:
        self.params = params
        self.eos = eos_token_ids
        self.max_model_len = max_model_len
        self.prompt_lens = [len(p) for p in prompts]
        self.live = [[BeamSearchSequence(list(p))] for p in prompts]
        self.done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        self.steps = 0

    def pending(self) -> list[list[int]]:
        """Token lists to extend this step (empty when the search is over)."""
        if self.steps >= self.params.max_tokens:
            return []
        return [b.tokens for beams in self.live for b in beams if len(b.tokens) < self.max_model_len]

    def advance(self, entries: list[dict[int, Logprob]]) -> None:
        """Extend every pending beam with its candidates; keep the best ``beam_width``."""
        it = iter(entries)
        width = self.params.beam_width
        for i, beams in enumerate(self.live):
            candidates = []
            for beam in beams:
                if len(beam.tokens) >= self.max_model_len:
                    self.done[i].append(beam)
                    continue
                for tid, lp in next(it).items():
                    new = BeamSearchSequence(
                        beam.tokens + [tid], beam.logprobs + [{tid: lp}], beam.cum_logprob + lp.logprob
                    )
                    if tid in self.eos and not self.params.ignore_eos:
                        new.finish_reason = "stop"
                        self.done[i].append(new)
                    else:
                        candidates.append(new)
            self.live[i] = sorted(candidates, key=lambda b: b.cum_logprob, reverse=True)[:width]
        self.steps += 1

    def score(self, beam: BeamSearchSequence) -> float:
        n = len(beam.tokens) - (1 if beam.finish_reason == "stop" else 0)
        return length_penalized(beam.cum_logprob, n, self.params.length_penalty)

    def outputs(self, decode: Callable[[list[int]], str]) -> list[BeamSearchOutput]:
        out = []
        for i, beams in enumerate(self.live):
            ranked = sorted(self.done[i] + beams, key=self.score, reverse=True)[: self.params.beam_width]
            for b in ranked:
                b.finish_reason = b.finish_reason or "length"
                generated = b.tokens[self.prompt_lens[i] :]
                if b.finish_reason == "stop":
                    generated = generated[:-1]  # the EOS is not text
                b.text = decode(generated)
            out.append(BeamSearchOutput(ranked))
        return out

    def run(self, expand: Callable[[list[list[int]], SamplingParams], list[dict[int, Logprob]]]) -> None:
        step = self.params.step_params()
        while todo := self.pending():
            self.advance(expand(todo, step))

    async def run_async(
        self, expand: Callable[[list[list[int]], SamplingParams], Awaitable[list[dict[int, Logprob]]]]
    ) -> None:
        step = self.params.step_params()
        while todo := self.pending():
            self.advance(await expand(todo, step))
