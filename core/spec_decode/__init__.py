"""Speculative decoding: proposers draft tokens, the target verifies them in one forward
(docs/speculative.md).  ``SpecDecoder`` and its builder live in ``decoder.py`` and
``builder.py`` (imported on use: they pull in the model runner)."""

from pagedserve.spec_decode.config import MAX_SPECULATIVE_TOKENS, METHODS, SpeculativeConfig, parse_speculative_config
from pagedserve.spec_decode.proposer import Draft, NgramProposer, Proposer

__all__ = ["SpeculativeConfig", "parse_speculative_config", "METHODS", "MAX_SPECULATIVE_TOKENS", "Draft",
           "Proposer", "NgramProposer"]
