"""`pagedserve serve` flags (vLLM's names) and how they become the engine's configuration."""

from __future__ import annotations

import pytest

from pagedserve.entrypoints.cli import build_parser, serve_cmd


def parse(*argv: str):
    argv = ["serve", *argv]
    return build_parser(argv).parse_args(argv)


def test_defaults_bind_localhost_and_serve_the_default_model():
    args = parse()
    assert (args.host, args.port, args.model, args.api_key) == ("127.0.0.1", 8000, None, None)
    config, names, max_body = serve_cmd.build_engine_config(args)
    assert names == ["smollm2-135m-instruct"]
    assert config.model.model is None and config.model.served_model_name == "smollm2-135m-instruct"
    assert config.cache.enable_prefix_caching and max_body == 16 * 2**20


def test_without_a_budget_the_platform_default_applies(monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_TARGET_DEVICE", raising=False)
    config, _, _ = serve_cmd.build_engine_config(parse("--device", "cpu"))
    # Neither budget set: the engine uses the platform's default_memory_utilization.
    assert config.cache.kv_cache_memory is None and config.cache.memory_utilization is None
    config, _, _ = serve_cmd.build_engine_config(parse("--device", "cpu", "--kv-cache-memory", "300MiB"))
    assert config.cache.kv_cache_memory == 300 * 2**20
    config, _, _ = serve_cmd.build_engine_config(parse("--device", "cpu", "--gpu-memory-utilization", "0.5"))
    assert config.cache.kv_cache_memory is None and config.cache.memory_utilization == 0.5


def test_vllm_flag_names_reach_the_engine_config():
    args = parse(
        "/models/x",
        "--host",
        "0.0.0.0",
        "--port",
        "9001",
        "--device",
        "cpu",
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "512",
        "--max-num-seqs",
        "8",
        "--max-num-batched-tokens",
        "256",
        "--block-size",
        "32",
        "--kv-cache-memory",
        "1GiB",
        "--memory-utilization",
        "0.7",
        "--scheduler-delay-factor",
        "0.5",
        "--no-enable-prefix-caching",
        "--tensor-parallel-size",
        "1",
        "--served-model-name",
        "a",
        "b",
        "--max-queue-len",
        "4",
        "--threads",
        "3",
        "--seed",
        "9",
        "--max-body-size",
        "2MiB",
    )
    config, names, max_body = serve_cmd.build_engine_config(args)
    assert (args.host, args.port) == ("0.0.0.0", 9001)
    assert names == ["a", "b"] and max_body == 2 * 2**20
    m, c, s, d = config.model, config.cache, config.scheduler, config.device
    assert (m.model, m.dtype, m.max_model_len, m.seed, m.served_model_name) == ("/models/x", "bfloat16", 512, 9, "a")
    assert (c.block_size, c.kv_cache_memory, c.memory_utilization, c.enable_prefix_caching) == (32, 2**30, 0.7, False)
    assert (s.max_num_seqs, s.max_num_batched_tokens, s.delay_factor, s.max_queue_len) == (8, 256, 0.5, 4)
    assert (d.device, d.threads, config.parallel.tensor_parallel_size) == ("cpu", 3, 1)


def test_api_key_flag_wins_over_the_environment():
    assert serve_cmd.resolve_api_key(parse(), {}) is None
    assert serve_cmd.resolve_api_key(parse(), {"PAGEDSERVE_API_KEY": "env"}) == "env"
    assert serve_cmd.resolve_api_key(parse("--api-key", "flag"), {"PAGEDSERVE_API_KEY": "env"}) == "flag"
    assert serve_cmd.resolve_api_key(parse(), {"PAGEDSERVE_API_KEY": ""}) is None


def test_chat_template_from_a_file_or_text(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert serve_cmd.read_chat_template(str(f)) == f.read_text()
    assert serve_cmd.read_chat_template("{{ messages[0]['content'] }}") == "{{ messages[0]['content'] }}"
    assert serve_cmd.read_chat_template(None) is None
    with pytest.raises(SystemExit, match="neither a file"):
        serve_cmd.read_chat_template(str(tmp_path / "missing.jinja"))


def test_bad_values_are_refused_with_the_field_name():
    with pytest.raises(ValueError, match="max_queue_len"):
        serve_cmd.build_engine_config(parse("--max-queue-len", "0", "--kv-cache-memory", "1GiB"))
    with pytest.raises(ValueError, match="max-body-size"):
        serve_cmd.build_engine_config(parse("--max-body-size", "lots", "--kv-cache-memory", "1GiB"))


def test_parallel_and_offload_flags_reach_the_engine_config():
    config, _, _ = serve_cmd.build_engine_config(
        parse(
            "--device",
            "cpu",
            "--tensor-parallel-size",
            "2",
            "--pipeline-parallel-size",
            "2",
            "--distributed-executor-backend",
            "ray",
        )
    )
    assert config.parallel.tensor_parallel_size == 2 and config.parallel.pipeline_parallel_size == 2
    assert config.parallel.distributed_executor_backend == "ray" and config.parallel.world_size == 4
    config, _, _ = serve_cmd.build_engine_config(
        parse("--device", "cpu", "--kv-offload-memory", "1GiB", "--preemption-mode", "swap", "--cpu-offload-gb", "0.5")
    )
    assert config.cache.kv_offload_memory == 2**30 and config.cache.preemption_mode == "swap"
    assert config.cache.cpu_offload_gb == 0.5
    # Together they are refused while the flags are read: offload runs on one rank.
    with pytest.raises(ValueError, match="not supported with tensor/pipeline parallelism"):
        serve_cmd.build_engine_config(parse("--tensor-parallel-size", "2", "--cpu-offload-gb", "0.5"))
