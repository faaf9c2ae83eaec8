"""One settings surface: every engine setting is a config field, a flag of every command
and a keyword of ``LLM``; cross-feature rules fail before any model work."""

from __future__ import annotations

import dataclasses
import inspect
import pathlib
import time

import pytest

from pagedserve import LLM
from pagedserve.config import CacheConfig, EngineConfig, ParallelConfig
from pagedserve.entrypoints import cli
from pagedserve.entrypoints.cli import serve_cmd
from pagedserve.entrypoints.engine_args import (
    add_engine_arguments,
    engine_args,
    engine_config_from_args,
    engine_config_from_kwargs,
    settings_markdown,
)

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "engine_settings.md"
COMMANDS = {"serve": ["serve"], "generate": ["generate"], "bench throughput": ["bench", "throughput"]}
# Settings a command spells differently on purpose: `generate --seed` seeds sampling and
# `bench throughput --seed` the workload.
EXCLUDED = {"generate": {"seed"}, "bench throughput": {"seed"}}


def parse(argv: list[str]):
    return cli.build_parser(argv).parse_args(argv)


def option_strings(argv: list[str]) -> set[str]:
    parser = cli.build_parser(argv)
    sub = parser._subparsers._group_actions[0].choices[argv[0]]
    if len(argv) > 1:
        sub = sub._subparsers._group_actions[0].choices[argv[1]]
    return {s for a in sub._actions for s in a.option_strings}


def test_every_field_is_documented_and_spelled_once():
    args = engine_args()
    for section in dataclasses.fields(EngineConfig):
        for f in dataclasses.fields(section.default_factory):
            if f.init:
                assert f.metadata.get("help"), f"{section.name}.{f.name} has no help text"
    assert len({a.name for a in args}) == len(args)
    names = {a.name: a for a in args}
    # vLLM spellings, overrides and aliases from the field metadata.
    assert names["max_num_seqs"].flags == ("--max-num-seqs",)
    assert names["gpu_memory_utilization"].flags == ("--gpu-memory-utilization", "--memory-utilization")
    assert names["scheduling_policy"].field == "policy" and names["kv_cache_dtype"].field == "cache_dtype"
    assert "--num-kv-blocks-override" in names["num_gpu_blocks_override"].flags
    assert not names["model"].cli


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_has_every_engine_flag(command):
    have = option_strings(COMMANDS[command])
    for arg in engine_args():
        if not arg.cli or arg.name in EXCLUDED.get(command, ()):
            continue
        flags = arg.flags if arg.type is not bool else (*arg.flags, "--no-" + arg.flags[0][2:])
        missing = [f for f in flags if f not in have]
        assert not missing, f"{command} lacks {missing}"


@pytest.mark.parametrize("command", list(COMMANDS))
def test_flag_defaults_are_the_config_defaults(command):
    """The one source of defaults: no flag restates one (the 2048 of the past)."""
    args = parse(COMMANDS[command])
    config = engine_config_from_args(args, model=None)
    expected = EngineConfig()
    for section in ("cache", "scheduler", "parallel", "device"):
        if command != "serve" and section == "cache":
            continue  # offline commands size the KV cache themselves (default_kv_budget)
        assert getattr(config, section) == getattr(expected, section), section


def test_flags_and_keywords_reach_the_same_config():
    argv = [
        "serve",
        "--max-num-seqs",
        "3",
        "--max-num-batched-tokens",
        "64",
        "--no-enable-chunked-prefill",
        "--kv-cache-dtype",
        "auto",
        "--num-kv-blocks-override",
        "40",
        "--max-logprobs",
        "5",
        "--scheduling-policy",
        "priority",
        "--scheduler-delay-factor",
        "0.25",
        "-tp",
        "1",
        "--tokenizer",
        "/some/tokenizer",
        "--memory-utilization",
        "0.5",
        "--no-enable-prefix-caching",
        "--device-map",
        "cpu",
    ]
    from_flags, _, _ = serve_cmd.build_engine_config(parse(argv))
    from_kwargs = engine_config_from_kwargs(
        max_num_seqs=3,
        max_num_batched_tokens=64,
        enable_chunked_prefill=False,
        kv_cache_dtype="auto",
        num_kv_blocks_override=40,
        max_logprobs=5,
        scheduling_policy="priority",
        scheduler_delay_factor=0.25,
        tensor_parallel_size=1,
        tokenizer="/some/tokenizer",
        gpu_memory_utilization=0.5,
        enable_prefix_caching=False,
        device_map="cpu",
        served_model_name="smollm2-135m-instruct",
    )
    assert from_flags == from_kwargs
    assert from_kwargs.cache.num_gpu_blocks_override == 40 and from_kwargs.scheduler.policy == "priority"
    assert not from_kwargs.scheduler.enable_chunked_prefill and from_kwargs.model.max_logprobs == 5


def test_unknown_keyword_names_the_closest_setting():
    with pytest.raises(TypeError, match="'max_num_seq'; did you mean 'max_num_seqs'"):
        LLM(max_num_seq=4)
    with pytest.raises(TypeError, match="'gpu_memory_utilisation'; did you mean 'gpu_memory_utilization'"):
        LLM(gpu_memory_utilisation=0.5)
    with pytest.raises(TypeError, match="unexpected keyword argument 'zzz'$"):
        LLM(zzz=1)
    with pytest.raises(ValueError, match="disagree"):
        LLM(memory_utilization=0.5, gpu_memory_utilization=0.6)
    params = inspect.signature(LLM).parameters
    assert params["max_num_batched_tokens"].default == 2048 and "kv_cache_dtype" in params


def test_command_defaults_and_exclusions():
    p = __import__("argparse").ArgumentParser()
    add_engine_arguments(p, exclude=["seed"], defaults={"max_num_seqs": 7})
    args = p.parse_args([])
    assert args.max_num_seqs == 7 and not hasattr(args, "seed")
    with pytest.raises(ValueError, match="not engine settings: sed"):
        add_engine_arguments(__import__("argparse").ArgumentParser(), exclude=["sed"])
    # generate's --seed stays the sampling seed; the engine seed keeps its default.
    args = parse(["generate", "--seed", "5"])
    assert args.seed == 5 and engine_config_from_args(args).model.seed == 0


def test_docs_list_every_setting():
    text = DOCS.read_text(encoding="utf-8")
    assert settings_markdown() in text, (
        "docs/engine_settings.md is stale: regenerate its table with python -m pagedserve.entrypoints.engine_args"
    )


def test_world_size():
    assert ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=3).world_size == 6
    assert ParallelConfig().world_size == 1


# -- every refused combination fails before any model work ---------------------------------
REFUSED = [
    (
        dict(device_map="cpu:1,cpu", tensor_parallel_size=2),
        r"device_map='cpu:1,cpu' cannot be combined with "
        r"tensor/pipeline parallelism",
    ),
    (
        dict(device_map="cpu:1,cpu", distributed_executor_backend="mp"),
        r"distributed_executor_backend='mp' is "
        r"not supported",
    ),
    (dict(device_map="cpu:1,cpu", cpu_offload_gb=1), r"cannot be combined with cpu_offload_gb"),
    (dict(distributed_executor_backend="uni", pipeline_parallel_size=2), r"'uni' runs one rank"),
    (dict(cpu_bind="0", tensor_parallel_size=2), r"cpu_bind='0' is not supported with tensor/pipeline"),
    (dict(cpu_offload_gb=1, pipeline_parallel_size=2), r"cpu_offload_gb=1 is not supported with tensor"),
    (dict(quantization="w8a8", tensor_parallel_size=2), r"quantization='w8a8' is not supported with tensor"),
    (dict(kv_cache_dtype="fp8_inc"), r"kv_cache_dtype='fp8_inc' is not implemented"),
    (dict(kv_cache_dtype="int4"), r"cache_dtype='int4' is not supported"),
    (dict(preemption_mode="swap"), r"needs a host KV tier"),
]


@pytest.fixture
def no_model_work(monkeypatch):
    """Opening a model, selecting a platform or starting an executor fails the test."""
    import pagedserve.engine.llm_engine as engine_mod
    from pagedserve.loader.model_source import ModelSource

    def forbidden(*_a, **_k):
        raise AssertionError("model work started before the settings were checked")

    for name in ("open_model", "select_platform", "create_executor"):
        monkeypatch.setattr(engine_mod, name, forbidden)
    monkeypatch.setattr(ModelSource, "weights", forbidden)


@pytest.mark.parametrize("kwargs,message", REFUSED, ids=[",".join(k) for k, _ in REFUSED])
def test_refused_combinations_fail_fast(kwargs, message, no_model_work):
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=message):
        LLM(**kwargs)
    assert time.perf_counter() - t0 < 1.0


def test_refused_combination_from_the_command_line_fails_fast(no_model_work):
    t0 = time.perf_counter()
    with pytest.raises(
        SystemExit, match="pagedserve generate: cpu_offload_gb=1.0 is not supported with tensor/pipeline parallelism"
    ):
        cli.main(["generate", "--tensor-parallel-size", "2", "--cpu-offload-gb", "1"])
    with pytest.raises(SystemExit, match="pagedserve generate: cache_dtype='int4' is not supported"):
        cli.main(["generate", "--kv-cache-dtype", "int4"])
    with pytest.raises(ValueError, match="quantization='w8a8' is not supported with tensor"):
        serve_cmd.build_engine_config(parse(["serve", "-tp", "2", "--quantization", "w8a8"]))
    assert time.perf_counter() - t0 < 1.0


def test_model_shape_rules_fail_before_weights_or_workers(tiny_llama, monkeypatch):
    """tensor_parallel_size must divide the heads: known from config.json alone."""
    import pagedserve.engine.llm_engine as engine_mod
    from pagedserve.loader.model_source import ModelSource

    def forbidden(*_a, **_k):
        raise AssertionError("weights loaded or workers started")

    monkeypatch.setattr(engine_mod, "create_executor", forbidden)
    monkeypatch.setattr(ModelSource, "weights", forbidden)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 must divide the attention heads \(4\)"):
        LLM(model=str(tiny_llama), tensor_parallel_size=3)
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 exceeds the model's 2 layers"):
        LLM(model=str(tiny_llama), pipeline_parallel_size=3)


def test_cache_config_keeps_the_field_name():
    assert CacheConfig(cache_dtype="auto").cache_dtype == "auto"


def test_disaggregated_instances_refuse_before_starting(no_model_work):
    from pagedserve.serving.disagg import DisaggregatedLLM

    with pytest.raises(ValueError, match="single-rank"):
        DisaggregatedLLM(tensor_parallel_size=2)
    with pytest.raises(ValueError, match="needs enable_prefix_caching=True"):
        DisaggregatedLLM(enable_prefix_caching=False)
    with pytest.raises(TypeError, match="did you mean 'max_num_seqs'"):
        DisaggregatedLLM(max_num_seq=2)


def test_overrides_take_any_spelling_and_refuse_unknown_names():
    args = parse(["serve", "--gpu-memory-utilization", "0.3"])
    assert engine_config_from_args(args, memory_utilization=0.4).cache.memory_utilization == 0.4
    with pytest.raises(TypeError, match="'max_num_seq' is not an engine setting; did you mean 'max_num_seqs'"):
        engine_config_from_args(args, max_num_seq=2)
