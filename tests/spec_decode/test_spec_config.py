"""speculative_config: parsing, refusals at start-up, the CLI flag, and the metrics."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from prometheus_client import generate_latest

from pagedserve import LLM, SamplingParams
from pagedserve.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SpeculativeDecodingConfig
from pagedserve.entrypoints import cli
from pagedserve.entrypoints.openai.metrics import ServerMetrics
from pagedserve.spec_decode import SpeculativeConfig, parse_speculative_config
from pagedserve.spec_decode.metrics import acceptance_rate

KW = dict(dtype="float32", kv_cache_memory="16MiB", block_size=4)


@pytest.mark.parametrize(
    "value, message",
    [
        (
            '{"method": "medusa", "num_speculative_tokens": 2}',
            "method must be one of ngram, draft_model, self_quantized",
        ),
        (
            '{"method": "ngram", "num_speculative_tokens": 0}',
            "num_speculative_tokens must be an integer in \\[1, 16\\]",
        ),
        ('{"method": "ngram", "num_speculative_tokens": 17}', "in \\[1, 16\\]"),
        ('{"method": "ngram"}', "num_speculative_tokens must be"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}', "unknown key\\(s\\) lookahead"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}',
            "prompt_lookup_min <= prompt_lookup_max",
        ),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', "needs 'model'"),
        ('{"method": "ngram", "num_speculative_tokens": "2"}', "must be an integer"),
        ('{"method": "self_quantized", "num_speculative_tokens": 2, "quantization": "none"}', "would draft with"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2}',
            "draft_tensor_parallel_size applies to 'draft_model', not 'ngram'",
        ),
        ('{"model": "/m", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 0}', "must be >= 1"),
        ("{method: ngram}", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
    ],
)
def test_bad_configs_are_refused(value, message):
    with pytest.raises(ValueError, match=message):
        parse_speculative_config(value)
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative=SpeculativeDecodingConfig(value))


def test_good_configs():
    c = parse_speculative_config({"model": "/m", "num_speculative_tokens": 5})
    assert c == SpeculativeConfig("draft_model", 5, "/m", 1, 4, None)
    c = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 6}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (1, 6)
    assert parse_speculative_config({"method": "self_quantized", "num_speculative_tokens": 2}).quantization == "gguf"


@pytest.mark.parametrize(
    "section",
    [
        dict(parallel=ParallelConfig(tensor_parallel_size=2)),
        dict(parallel=ParallelConfig(pipeline_parallel_size=2, distributed_executor_backend="ray")),
        dict(cache=CacheConfig(kv_offload_memory="1GiB")),
        dict(cache=CacheConfig(cpu_offload_gb=1)),
    ],
)
def test_deployments_are_accepted(section):
    """Verified to give one process's outputs in tests/distributed/test_dist_spec.py and
    tests/spec_decode/test_spec_offload.py."""
    for method in ("ngram", "self_quantized"):
        EngineConfig(speculative=SpeculativeDecodingConfig({"method": method, "num_speculative_tokens": 2}), **section)


@pytest.mark.parametrize(
    "spec, parallel, message",
    [
        ({}, dict(tensor_parallel_size=3), "must be 1 .* or the target's tensor_parallel_size=3"),
        (
            {},
            dict(tensor_parallel_size=2, pipeline_parallel_size=2),
            "cannot be combined with pipeline_parallel_size=2: .* use draft_tensor_parallel_size=1",
        ),
        ({"quantization": "int8"}, dict(tensor_parallel_size=2), "quantization='int8' is not sharded yet"),
    ],
)
def test_sharded_draft_limits_are_refused(spec, parallel, message):
    value = {"model": "/m", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2, **spec}
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative=SpeculativeDecodingConfig(value), parallel=ParallelConfig(**parallel))
    EngineConfig(speculative=SpeculativeDecodingConfig(value | {"draft_tensor_parallel_size": 1}))


def test_sharded_draft_whose_heads_do_not_split_is_refused_before_loading(
    tiny_llama, tiny_checkpoint_factory, monkeypatch
):
    from pagedserve.loader import model_source

    draft = tiny_checkpoint_factory(hidden_size=48, num_heads=3, num_kv_heads=1)
    monkeypatch.setattr(model_source.ModelSource, "weights", lambda self: pytest.fail("weights were read"))
    spec = {"model": str(draft), "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2}
    with pytest.raises(ValueError, match=r"draft_tensor_parallel_size=2: tensor_parallel_size=2 must divide .* \(3\)"):
        LLM(model=str(tiny_llama), speculative_config=spec, tensor_parallel_size=2, **KW)


def test_self_quantized_refuses_a_quantized_target():
    spec = SpeculativeDecodingConfig({"method": "self_quantized", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="quantization='gguf' would quantize the target too"):
        EngineConfig(speculative=spec, model=ModelConfig(quantization="gguf"))


def test_draft_with_another_vocabulary_is_refused_before_loading(tiny_llama, tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file

    from pagedserve.loader import model_source

    # A consistent checkpoint with 300 vocabulary rows (the target has 259).
    other = tmp_path / "other"
    shutil.copytree(tiny_llama, other)
    for f in other.glob("*.safetensors"):
        tensors = load_file(f)
        for name, t in tensors.items():
            if t.shape[0] == 259 and ("embed_tokens" in name or "lm_head" in name):
                tensors[name] = torch.cat([t, t[:41]])
        save_file(tensors, f, metadata={"format": "pt"})
    cfg = json.loads((other / "config.json").read_text())
    cfg["vocab_size"] = 300
    (other / "config.json").write_text(json.dumps(cfg))
    # The draft's config alone decides: no weight of either model is read.
    monkeypatch.setattr(model_source.ModelSource, "weights", lambda self: pytest.fail("weights were read"))
    with pytest.raises(ValueError, match="vocabulary of 300 tokens, the target 259"):
        LLM(model=str(tiny_llama), speculative_config={"model": str(other), "num_speculative_tokens": 2}, **KW)


def test_cli_flag_and_metrics(tiny_llama, capsys):
    args = [
        "generate",
        str(tiny_llama),
        "-p",
        "abcabcabcabc",
        "--max-tokens",
        "8",
        "--dtype",
        "float32",
        "--json",
        "--threads",
        "1",
        "--speculative-config",
        '{"method": "ngram", "num_speculative_tokens": 2}',
    ]
    assert cli.main(args) == 0
    with pytest.raises(SystemExit):
        cli.main(["generate", str(tiny_llama), "--speculative-config", '{"method": "eagle"}'])
    assert "method must be one of" in capsys.readouterr().err

    llm = LLM(model=str(tiny_llama), speculative_config={"method": "ngram", "num_speculative_tokens": 3}, **KW)
    llm.generate(
        [[5, 6, 7, 5, 6, 7, 5, 6, 7, 5]],
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        use_tqdm=False,
    )
    stats = llm.llm_engine.stats()
    assert stats.spec_decode_num_draft_tokens > 0
    assert sum(stats.spec_decode_num_accepted_tokens_per_pos) == stats.spec_decode_num_accepted_tokens
    assert 0 <= acceptance_rate(stats) <= 1
    text = generate_latest(ServerMetrics(llm.llm_engine.stats, "tiny").registry).decode()
    assert (
        f'pagedserve:spec_decode_num_draft_tokens_total{{engine="0",model_name="tiny"}} '
        f"{float(stats.spec_decode_num_draft_tokens)}" in text
    )
    assert (
        f'pagedserve:spec_decode_num_accepted_tokens_total{{engine="0",model_name="tiny"}} '
        f"{float(stats.spec_decode_num_accepted_tokens)}" in text
    )
    assert 'pagedserve:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="0"}' in text
