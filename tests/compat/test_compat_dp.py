"""The matrix's data-parallel column (docs/compatibility.md): two replicas behind the
router that ``pagedserve serve --data-parallel-size 2`` runs, every request of a case sent
at once so that both replicas serve, each feature's result equal to the single process's
(tests/compat/compat_cases.py).  Embedding requests, adapters and beam search go through
the router like any request; the router's counters (preemptions, swaps, drafts, prefix
hits) come from the replicas' reports and show that the feature acted on them.

Cells with the same settings share one router (its two replicas start in about 10 s on two
cores); the per-request features and the lifted refusals (adapters, embeddings) run on
every CI run, the cells that only add an engine setting the router passes on untouched
are ``slow``.
"""

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
    "priority",
    "pooling",
    "quant_int8",
    "quant_gguf",
    "quant_fp8",
    "quant_gptq_awq",
    "kv_groups",
    "spec_ngram",
    "spec_draft_model",
    "spec_self_quantized",
    "lora",
    "kv_connector",
)
COMPAT_DEPLOYMENTS = ("dp",)
#: Each needs a router of its own and tests a setting each replica's engine applies as one
#: process does (the router only forwards requests and their priorities).
SLOW_CELLS = tuple(
    (f, "dp")
    for f in (
        "priority",
        "preemption_recompute",
        "preemption_swap",
        "quant_int8",
        "quant_gguf",
        "quant_fp8",
        "quant_gptq_awq",
        "kv_groups",
        "spec_ngram",
        "spec_draft_model",
        "spec_self_quantized",
    )
)
assert set(CASES) >= set(COMPAT_FEATURES)


@pytest.mark.parametrize(
    ("feature", "deployment"), cell_params(COMPAT_FEATURES, COMPAT_DEPLOYMENTS, slow_cells=SLOW_CELLS)
)
def test_cell_matches_one_process(engines, feature, deployment):
    check_cell(engines, feature, deployment)
