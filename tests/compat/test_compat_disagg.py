"""The matrix's disaggregated prefill/decode column (docs/compatibility.md): the features a
request brings to ``DisaggregatedLLM.generate`` (sampling parameters, priorities, LoRA
adapters) and ``.beam_search``, each equal to the single process's result
(tests/compat/compat_cases.py), with the prompt's KV blocks handed over by the prefill
instance (under the request's adapter for ``lora``).  Embeddings are refused by a rule
(config_rules.disaggregated_request_refusal)."""

from __future__ import annotations

import pytest
from compat_cases import CASES, cell_params, check_cell

pytestmark = pytest.mark.timeout(300)

COMPAT_FEATURES = (
    "prefix_caching",
    "chunked_prefill",
    "preemption_recompute",
    "preemption_swap",
    "n_best_of",
    "beam_search",
    "structured_outputs",
    "logits_processors",
    "prompt_logprobs",
    "quant_int8",
    "quant_gguf",
    "quant_fp8",
    "quant_gptq_awq",
    "spec_ngram",
    "spec_draft_model",
    "spec_self_quantized",
    "priority",
    "lora",
)
COMPAT_DEPLOYMENTS = ("disagg",)
#: Each cell starts its own pair of instances (about 10 s on two cores); these add no
#: hand-off path the others do not take (quantized weights, the quantized draft, priorities).
SLOW_CELLS = (
    ("quant_gguf", "disagg"),
    ("quant_fp8", "disagg"),
    ("quant_gptq_awq", "disagg"),
    ("spec_self_quantized", "disagg"),
    # Orders requests in the decode instance's scheduler, as in one process.
    ("priority", "disagg"),
)
assert set(CASES) >= set(COMPAT_FEATURES)


CELLS = cell_params(COMPAT_FEATURES, COMPAT_DEPLOYMENTS, slow_cells=SLOW_CELLS)


@pytest.mark.parametrize(("feature", "deployment"), CELLS)
def test_cell_matches_one_process(engines, feature, deployment):
    check_cell(engines, feature, deployment)


def test_embeddings_are_refused_by_the_rule():
    from pagedserve.config_rules import disaggregated_request_refusal
    from pagedserve.serving.disagg import DisaggregatedLLM

    message = disaggregated_request_refusal("pooling")
    assert "disaggregated prefill/decode" in message and "embed" in message
    with pytest.raises(ValueError) as exc:
        DisaggregatedLLM.embed(object.__new__(DisaggregatedLLM), ["a prompt"])
    assert str(exc.value) == message
