"""Speculative decoding: proposers draft tokens, the target verifies them in one forward
(docs/speculative.md).

Only the configuration is imported here (the config dataclasses parse
``speculative_config`` without loading torch); the ``Proposer`` protocol and n-gram
lookup are in ``proposer.py``, the draft model in ``draft_model.py``, verification in
``verifier.py``, the engine's ``SpecDecoder`` in ``decoder.py`` and ``builder.py``.
"""

from pagedserve.spec_config import MAX_SPECULATIVE_TOKENS, METHODS, SpeculativeConfig, parse_speculative_config

__all__ = ["SpeculativeConfig", "parse_speculative_config", "METHODS", "MAX_SPECULATIVE_TOKENS"]
