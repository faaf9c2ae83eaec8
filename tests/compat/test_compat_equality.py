"""The feature x deployment matrix's equality suite (docs/compatibility.md).

Every pair of ``COMPAT_FEATURES`` x ``COMPAT_DEPLOYMENTS`` that config_rules does not
refuse runs here, and its outputs must equal the single-process engine's with the same
feature on the tiny random float32 checkpoint: greedy tokens equal, logprobs within the
distributed tests' 1e-3, seeded samples equal, embeddings within 1e-4.  Each case also
checks that the feature really acted (prefix-cache hits, preemptions, a constraint that
holds, a banned word absent), so a deployment that silently drops a feature fails even
where the single process would have produced the same tokens.

A cell's engine is ``compat_matrix.cell_kwargs(feature, deployment)``, so a refusal that
is lifted in config_rules brings its cell into this suite by itself; a new feature joins
by an entry in ``CASES`` and ``COMPAT_FEATURES``, a new deployment by one in
``COMPAT_DEPLOYMENTS`` (and ``SLOW`` when it is slow to start).  Engines are shared:
cells with the same settings run one after the other on one engine, and only one
multi-process engine is alive at a time.

The docs generator reads ``COMPAT_FEATURES`` / ``COMPAT_DEPLOYMENTS`` from this file
(literal tuples) and counts every cell they produce as tested.
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
    "quant_gptq_awq",
    "kv_groups",
    "spec_ngram",
    "spec_draft_model",
    "spec_self_quantized",
    "quant_fp8",
    "lora",
    "sleep_mode",
    "kv_connector",
)
COMPAT_DEPLOYMENTS = ("tp_mp", "pp", "tp_pp", "tp_ray", "cpu_offload", "kv_offload", "device_map")
#: Deployments whose engines start slowly on two cores (four worker processes; a Ray head).
SLOW = ("tp_pp", "tp_ray")
#: Cells that need an engine of their own on a multi-process deployment (about 10 s to
#: start on two cores) and test nothing the rank split could change (the scheduler runs
#: in the engine's process).
SLOW_CELLS = (
    ("priority", "tp_mp"),
    ("priority", "pp"),
    ("priority", "tp_ray"),
    ("kv_groups", "tp_mp"),
    # Swaps run on every rank's share; tp_mp's cell checks that on each CI run.
    ("preemption_swap", "pp"),
    # tests/distributed/test_dist_quant.py runs GPTQ and AWQ at TP=2 on each CI run.
    ("quant_gptq_awq", "tp_mp"),
    # tests/distributed/test_dist_sleep.py (TP=2 on each CI run, PP=2) and
    # tests/offload/test_sleep_mode.py (host tier, device map) run these.
    ("sleep_mode", "tp_mp"),
    ("sleep_mode", "pp"),
    ("sleep_mode", "kv_offload"),
    ("sleep_mode", "device_map"),
)

assert set(CASES) >= set(COMPAT_FEATURES)


@pytest.mark.parametrize(("feature", "deployment"), cell_params(COMPAT_FEATURES, COMPAT_DEPLOYMENTS, SLOW, SLOW_CELLS))
def test_cell_matches_one_process(engines, feature, deployment):
    check_cell(engines, feature, deployment)
