"""SamplingParams: how to pick each next token and when to stop (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.sampling_checks import check_sampling_params
from pagedserve.structured_params import StructuredOutputsParams

__all__ = ["SamplingParams", "StructuredOutputsParams"]

_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    """Per-request sampling settings, validated on construction.

    Invalid values raise ``ValueError`` naming the field and its limit.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    #: Added to the logits of these token ids (values clamped to [-100, 100] as OpenAI does).
    logit_bias: dict[int, float] | None = None
    #: Only these token ids may be sampled.
    allowed_token_ids: list[int] | None = None
    #: Words never generated: a word's last token is banned where the text so far ends
    #: with the word's other tokens (tokenized by the engine, with and without a space).
    bad_words: list[str] | None = None
    #: Log-probabilities of every prompt token (with this many alternatives).  -1 (the
    #: offline API only): the full next-token log-distribution at every prompt position,
    #: as one float32 tensor in ``RequestOutput.prompt_logprob_rows`` (the entries of
    #: ``prompt_logprobs`` then hold each prompt token's own logprob and rank alone).
    prompt_logprobs: int | None = None
    #: Keep only the last this many prompt tokens.
    truncate_prompt_tokens: int | None = None
    #: Samples drawn per prompt; the ``n`` with the highest cumulative logprob are returned.
    best_of: int | None = None
    #: The constraint the output follows (JSON schema, regex, choice, grammar...).
    structured_outputs: StructuredOutputsParams | None = None
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        check_sampling_params(self)

        def bad(name: str, limit: str) -> None:
            raise ValueError(f"{name} must be {limit}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", "an integer >= 1")
        if self.temperature < 0:
            bad("temperature", ">= 0")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "in (0, 1]")
        if self.top_k == -1:
            self.top_k = 0
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", "an integer >= 0 (0 or -1 disables it)")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "in [0, 1]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", "an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"<= max_tokens ({self.max_tokens})")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", "in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 10.0:
            bad("repetition_penalty", "in (0, 10]")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            bad("logprobs", "an integer in [0, 20]")
        if isinstance(self.stop, str):
            self._stop_list = [self.stop] if self.stop else []
        elif self.stop is None:
            self._stop_list = []
        else:
            if not all(isinstance(s, str) for s in self.stop):
                bad("stop", "a string or a list of strings")
            self._stop_list = [s for s in self.stop if s]
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            bad("structured_outputs", "a StructuredOutputsParams")
        if self.structured_outputs is not None and self.min_tokens > 0:
            # The grammar decides where the output ends; banning EOS there leaves no token.
            bad("min_tokens", "0 with structured_outputs (the grammar decides where the output ends)")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list

    @property
    def needs_logits_processing(self) -> bool:
        """Whether logit_bias, allowed_token_ids or bad_words change the logits."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words)

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
