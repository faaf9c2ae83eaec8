"""`pagedserve serve [MODEL]`: the OpenAI-compatible HTTP server (vLLM's flag names)."""

from __future__ import annotations

import argparse
import logging
import os
import pathlib
import signal

__all__ = ["add_parser", "run", "build_dp_config", "API_KEY_ENV"]

API_KEY_ENV = "PAGEDSERVE_API_KEY"
GRACEFUL_SHUTDOWN_S = 10  # how long open requests may finish after SIGTERM


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                              description="Serve MODEL (default: smollm2-135m-instruct) over HTTP with "
                                          "OpenAI's /v1/completions and /v1/chat/completions.")
    p.add_argument("model", nargs="?", default=None,
                   help="model: a Hugging Face checkpoint folder, a .gguf file, or the default model's alias")
    net = p.add_argument_group("HTTP")
    net.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    net.add_argument("--port", type=int, default=8000)
    net.add_argument("--api-key", default=None,
                     help=f"require 'Authorization: Bearer KEY' on every /v1 route (or set {API_KEY_ENV})")
    net.add_argument("--served-model-name", nargs="+", default=None,
                     help="name(s) clients use in 'model' (default: the model argument)")
    net.add_argument("--chat-template", default=None,
                     help="a Jinja2 chat template file (or template text) overriding the model's")
    net.add_argument("--max-queue-len", type=int, default=None,
                     help="answer 503 while this many sequences wait to be scheduled (default: unbounded)")
    net.add_argument("--max-body-size", default="16MiB", help="largest request body accepted (413 above)")
    net.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    net.add_argument("--disable-access-log", action="store_true", help="do not log every HTTP request")
    eng = p.add_argument_group("engine")
    eng.add_argument("--device", default=None, help="platform name (default: PAGEDSERVE_TARGET_DEVICE or auto)")
    eng.add_argument("--dtype", default="auto")
    eng.add_argument("--quantization", default=None,
                     help="none, auto (from the checkpoint; default), gguf, int8, w8a8, fp8, gptq, awq (docs/quantization.md)")
    eng.add_argument("--max-model-len", type=int, default=None)
    eng.add_argument("--max-num-seqs", type=int, default=256)
    eng.add_argument("--max-num-batched-tokens", type=int, default=2048)
    eng.add_argument("--block-size", type=int, default=16)
    eng.add_argument("--kv-cache-memory", default=None, help="KV-cache budget, e.g. 4GiB")
    eng.add_argument("--gpu-memory-utilization", "--memory-utilization", dest="memory_utilization",
                     type=float, default=None,
                     help="fraction of the device's memory for weights, activations and KV cache")
    eng.add_argument("--scheduler-delay-factor", type=float, default=0.0)
    eng.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    eng.add_argument("--tensor-parallel-size", type=int, default=1)
    eng.add_argument("--pipeline-parallel-size", type=int, default=1)
    eng.add_argument("--distributed-executor-backend", default=None, choices=["uni", "mp", "ray"],
                     help="how ranks run when tensor/pipeline parallel size > 1 (default: mp)")
    eng.add_argument("--kv-offload-memory", default=None, help="host-memory KV tier, e.g. 8GiB")
    eng.add_argument("--preemption-mode", default="auto", choices=["auto", "swap", "recompute"])
    eng.add_argument("--cpu-offload-gb", type=float, default=0.0,
                     help="GB of layer weights kept in host memory and streamed to the device")
    from pagedserve.entrypoints.structured_args import add_structured_output_arguments
    add_structured_output_arguments(p)
    from pagedserve.entrypoints.device_map_arg import add_device_map_argument

    add_device_map_argument(eng)
    eng.add_argument("--threads", type=int, default=None, help="CPU threads for the model")
    eng.add_argument("--cpu-bind", default=None, metavar="CPUS",
                     help="pin the model's threads to these host cores, one each, e.g. 0-3 (threads defaults "
                          "to their number)")
    eng.add_argument("--seed", type=int, default=0)
    dp = p.add_argument_group("data parallelism (docs/distributed.md)")
    dp.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                    help="independent engine replicas, each in its own process, behind this endpoint; "
                         "--threads is then the budget split between them")
    dp.add_argument("--data-parallel-backend", default="mp", choices=["mp", "ray"],
                    help="replicas as local processes (mp) or Ray actors on a Ray cluster (ray)")
    dp.add_argument("--data-parallel-devices", default=None,
                    help="one platform per replica, e.g. cuda,cpu,cpu (default: --device for every replica)")


def resolve_api_key(args: argparse.Namespace, env: dict[str, str] | None = None) -> str | None:
    """--api-key, else the environment variable; an empty value means no key."""
    env = os.environ if env is None else env
    return args.api_key or env.get(API_KEY_ENV) or None


def read_chat_template(value: str | None) -> str | None:
    """The template text of --chat-template: a file's contents, or the text itself."""
    if value is None:
        return None
    path = pathlib.Path(value).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if "{{" in value or "{%" in value:
        return value
    raise SystemExit(f"--chat-template {value!r} is neither a file nor Jinja2 template text")


def build_engine_config(args: argparse.Namespace):
    from pagedserve.config import (CacheConfig, DeviceConfig, EngineConfig, ModelConfig, ParallelConfig,
                                   SchedulerConfig, parse_memory)
    from pagedserve.entrypoints.structured_args import structured_outputs_config
    from pagedserve.loader.model_path import DEFAULT_MODEL_ALIAS

    names = args.served_model_name or [args.model or DEFAULT_MODEL_ALIAS]
    cache_kwargs = {}
    if args.memory_utilization is not None:
        cache_kwargs["memory_utilization"] = args.memory_utilization
    config = EngineConfig(
        model=ModelConfig(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, seed=args.seed,
                          served_model_name=names[0], quantization=args.quantization),
        cache=CacheConfig(block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
                          enable_prefix_caching=args.enable_prefix_caching,
                          kv_offload_memory=args.kv_offload_memory, preemption_mode=args.preemption_mode,
                          cpu_offload_gb=args.cpu_offload_gb, **cache_kwargs),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                  delay_factor=args.scheduler_delay_factor, max_queue_len=args.max_queue_len),
        parallel=ParallelConfig(tensor_parallel_size=args.tensor_parallel_size,
                                pipeline_parallel_size=args.pipeline_parallel_size,
                                distributed_executor_backend=args.distributed_executor_backend),
        device=DeviceConfig(device=args.device, threads=args.threads, device_map=args.device_map,
                            cpu_bind=args.cpu_bind),
        structured_outputs=structured_outputs_config(args),
    )
    return config, names, parse_memory(args.max_body_size, "--max-body-size")


def build_dp_config(args: argparse.Namespace):
    """The DataParallelConfig of the --data-parallel-* flags, or None for one engine."""
    from pagedserve.distributed.data_parallel import DataParallelConfig

    devices = DataParallelConfig.parse_devices(args.data_parallel_devices)
    if args.data_parallel_size == 1:
        if devices:
            raise ValueError("--data-parallel-devices needs --data-parallel-size > 1 (use --device for one engine)")
        return None
    if args.cpu_bind:
        raise ValueError("--cpu-bind with --data-parallel-size > 1 would pin every replica to the same cores; "
                         "the replicas' threads are split by --threads instead")
    return DataParallelConfig(size=args.data_parallel_size, backend=args.data_parallel_backend,
                              devices=devices or [args.device] * args.data_parallel_size)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from pagedserve.async_engine import AsyncLLMEngine
    from pagedserve.engine import LLMEngine
    from pagedserve.entrypoints.openai import ServerSettings, build_app

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    log = logging.getLogger("pagedserve.serve")
    from pagedserve.platforms import PlatformError

    try:
        config, names, max_body = build_engine_config(args)
        dp = build_dp_config(args)
        from pagedserve.entrypoints.structured_args import tool_options
        tools = tool_options(args)
    except ValueError as e:
        raise SystemExit(f"pagedserve serve: {e}") from None
    chat_template = read_chat_template(args.chat_template)
    if dp is None:
        try:
            engine = LLMEngine(config)
        except (ValueError, PlatformError) as e:  # e.g. a layer map that does not fit the model
            raise SystemExit(f"pagedserve serve: {e}") from None
        log.info("model %s loaded: max_model_len=%d, %d KV blocks of %d tokens, platform %s",
                 names[0], engine.max_model_len, engine.runner.num_blocks, config.cache.block_size,
                 engine.platform.name)
        served = AsyncLLMEngine(engine)
    else:
        from pagedserve.distributed.router import DataParallelRouter, ReplicaStartError

        try:
            served = DataParallelRouter(config, dp, log_level=args.log_level)
        except (ValueError, PlatformError, ReplicaStartError) as e:
            raise SystemExit(f"pagedserve serve: {e}") from None
        log.info("model %s served by %d data-parallel replicas (%s backend)", names[0], dp.size, dp.backend)
    settings = ServerSettings(served_model_names=names, api_key=resolve_api_key(args),
                              max_body_bytes=max_body, chat_template=chat_template, tool_options=tools)
    app = build_app(served, settings)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("binding %s: the server is reachable from other machines%s", args.host,
                    "" if settings.api_key else " and has no --api-key")
    # uvicorn turns SIGINT/SIGTERM into a graceful shutdown (streams still open after the
    # grace period are cut) and the app's lifespan then stops and joins the engine thread.
    # uvicorn re-raises the signal once done; these no-op handlers make that a normal exit
    # (status 0) instead of death by signal.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                    access_log=not args.disable_access_log, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    finally:
        served.shutdown()  # already done by the lifespan unless uvicorn failed to start
    log.info("server stopped")
    return 0
