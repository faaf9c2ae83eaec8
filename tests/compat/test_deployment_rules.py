"""The refusals of deployments beside the engine (data-parallel replicas, disaggregated
prefill/decode) and of quantized weights on a multi-platform layer map: each one rule of
config_rules, raised before weights load with a message naming both settings."""

from __future__ import annotations

import pytest

from pagedserve import config_rules
from pagedserve.entrypoints.engine_args import engine_config_from_kwargs


def _cfg(**kw):
    return engine_config_from_kwargs(model="unused", **kw)


def test_data_parallel_rules():
    config_rules.check_data_parallel(_cfg(enable_lora=True), 2)  # replicas serve adapters
    config_rules.check_data_parallel(_cfg(), 2)
    multinode = _cfg(nnodes=2, tensor_parallel_size=2, master_port=29555)
    config_rules.check_data_parallel(multinode, 1)
    with pytest.raises(ValueError, match=r"nnodes=2 cannot be combined with data_parallel_size=3"):
        config_rules.check_data_parallel(multinode, 3)


def test_disaggregated_rules():
    config_rules.check_disaggregated(_cfg(), [None, None])
    with pytest.raises(ValueError, match="enable_prefix_caching=False"):
        config_rules.check_disaggregated(_cfg(enable_prefix_caching=False))
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2"):
        config_rules.check_disaggregated(_cfg(tensor_parallel_size=2))
    with pytest.raises(ValueError, match="free_sliding_window_blocks=False"):
        config_rules.check_disaggregated(_cfg(), [8, None])
    config_rules.check_disaggregated(_cfg(free_sliding_window_blocks=False), [8, None])
    with pytest.raises(ValueError, match=r"enable_sleep_mode cannot be combined with disaggregated.*single instance"):
        config_rules.check_disaggregated(_cfg(enable_sleep_mode=True))
    with pytest.raises(ValueError, match=r"kv_connector='host' cannot be combined with disaggregated.*single instance"):
        config_rules.check_disaggregated(_cfg(kv_connector="host"))


def test_disaggregated_llm_refuses_before_starting_anything(tiny_llama):
    from pagedserve.serving.disagg import DisaggregatedLLM

    with pytest.raises(ValueError, match="enable_prefix_caching=False"):
        DisaggregatedLLM(model=str(tiny_llama), enable_prefix_caching=False)
    with pytest.raises(ValueError, match="enable_sleep_mode cannot be combined with disaggregated"):
        DisaggregatedLLM(model=str(tiny_llama), enable_sleep_mode=True)


def test_quantized_weights_on_a_map_over_two_platforms_are_refused():
    with pytest.raises(ValueError, match=r"quantization='int8' cannot be combined with device_map='cpu:1,cpu-ref'"):
        _cfg(quantization="int8", device_map="cpu:1,cpu-ref")
    _cfg(quantization="int8", device_map="cpu:1,cpu")  # one platform: allowed
    _cfg(quantization="none", device_map="cpu:1,cpu-ref")
