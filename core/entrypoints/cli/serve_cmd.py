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
    p = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve MODEL (default: smollm2-135m-instruct) over HTTP with "
        "OpenAI's /v1/completions and /v1/chat/completions.",
    )
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="model: a Hugging Face checkpoint folder, a .gguf file, or the default model's alias",
    )
    net = p.add_argument_group("HTTP")
    net.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    net.add_argument("--port", type=int, default=8000)
    net.add_argument(
        "--api-key", default=None, help=f"require 'Authorization: Bearer KEY' on every /v1 route (or set {API_KEY_ENV})"
    )
    net.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="name(s) clients use in 'model' (default: the model argument)",
    )
    net.add_argument(
        "--chat-template", default=None, help="a Jinja2 chat template file (or template text) overriding the model's"
    )
    net.add_argument("--max-body-size", default="16MiB", help="largest request body accepted (413 above)")
    net.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    net.add_argument("--disable-access-log", action="store_true", help="do not log every HTTP request")
    net.add_argument(
        "--timeout-graceful-shutdown",
        type=float,
        default=GRACEFUL_SHUTDOWN_S,
        help="seconds open requests may finish after SIGTERM before they are cut with an error "
        f"(default {GRACEFUL_SHUTDOWN_S})",
    )
    from pagedserve.entrypoints.openai.http_guard import add_http_security_arguments

    add_http_security_arguments(p)
    from pagedserve.entrypoints.engine_args import add_engine_arguments

    add_engine_arguments(p)  # every engine setting, from pagedserve.config
    from pagedserve.entrypoints.cli.server_ops_args import add_ops_arguments

    add_ops_arguments(p)
    from pagedserve.entrypoints.cli.structured_args import add_tool_arguments

    add_tool_arguments(p)
    from pagedserve.entrypoints.cli.lora_args import add_lora_server_arguments

    add_lora_server_arguments(p)  # --lora-modules, --allow-runtime-lora-updating
    from pagedserve.entrypoints.openai.responses_store import add_store_arguments

    add_store_arguments(p)  # --responses-store-max-entries, --responses-store-max-age, --responses-store-path
    dp = p.add_argument_group("data parallelism (docs/distributed.md)")
    dp.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        help="independent engine replicas, each in its own process, behind this endpoint; "
        "--threads is then the budget split between them",
    )
    dp.add_argument(
        "--data-parallel-backend",
        default="mp",
        choices=["mp", "ray"],
        help="replicas as local processes (mp) or Ray actors on a Ray cluster (ray)",
    )
    dp.add_argument(
        "--data-parallel-devices",
        default=None,
        help="one platform per replica, e.g. cuda,cpu,cpu (default: --device for every replica)",
    )


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
    from pagedserve.config import parse_memory
    from pagedserve.entrypoints.engine_args import engine_config_from_args
    from pagedserve.loader.model_path import DEFAULT_MODEL_ALIAS

    names = args.served_model_name or [args.model or DEFAULT_MODEL_ALIAS]
    config = engine_config_from_args(args, model=args.model, served_model_name=names[0])
    return config, names, parse_memory(args.max_body_size, "--max-body-size")


def build_dp_config(args: argparse.Namespace):
    """The DataParallelConfig of the --data-parallel-* flags, or None for one engine."""
    from pagedserve.serving.data_parallel import DataParallelConfig

    devices = DataParallelConfig.parse_devices(args.data_parallel_devices)
    if args.data_parallel_size == 1:
        if devices:
            raise ValueError("--data-parallel-devices needs --data-parallel-size > 1 (use --device for one engine)")
        return None
    if args.cpu_bind:
        raise ValueError(
            "--cpu-bind with --data-parallel-size > 1 would pin every replica to the same cores; "
            "the replicas' threads are split by --threads instead"
        )
    return DataParallelConfig(
        size=args.data_parallel_size,
        backend=args.data_parallel_backend,
        devices=devices or [args.device] * args.data_parallel_size,
    )


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from pagedserve.async_engine import AsyncLLMEngine
    from pagedserve.engine import LLMEngine
    from pagedserve.entrypoints.cli.lora_args import check_lora_modules, lora_modules_from_args
    from pagedserve.entrypoints.cli.server_ops_args import ops_settings, uvicorn_options
    from pagedserve.entrypoints.openai import ServerSettings, build_app
    from pagedserve.entrypoints.openai.http_guard import cors_settings_from_args
    from pagedserve.entrypoints.openai.shutdown import CUT_MARGIN_S, GracefulServer
    from pagedserve.entrypoints.openai.stats_logger import configure_logging

    log_config = configure_logging(args.log_level, args.log_format)
    log = logging.getLogger("pagedserve.serve")
    from pagedserve.platforms import PlatformError

    try:
        config, names, max_body = build_engine_config(args)
        dp = build_dp_config(args)
        from pagedserve.entrypoints.cli.structured_args import tool_options

        tools = tool_options(args, config.structured_outputs.reasoning_parser)
        ops = ops_settings(args, config)
        cors = cors_settings_from_args(args)
        lora_modules = lora_modules_from_args(args, config.lora.enable_lora)
        from pagedserve.entrypoints.openai.responses_store import store_config_from_args

        responses_store = store_config_from_args(args)
        if dp is not None:
            from pagedserve.config_rules import check_data_parallel

            check_data_parallel(config, dp.size)
        if args.timeout_graceful_shutdown < 0:
            raise ValueError(f"--timeout-graceful-shutdown must be >= 0, got {args.timeout_graceful_shutdown}")
    except ValueError as e:
        raise SystemExit(f"pagedserve serve: {e}") from None
    if config.parallel.nnodes > 1:  # multi-node: a worker node runs no server (docs/distributed.md)
        from pagedserve.distributed.multinode import serve_node

        if (status := serve_node(config, dp is not None)) is not None:
            return status
    chat_template = read_chat_template(args.chat_template)
    if dp is None:
        try:
            engine = LLMEngine(config)
        except (ValueError, PlatformError, RuntimeError) as e:  # e.g. a node that never joined
            raise SystemExit(f"pagedserve serve: {e}") from None
        log.info(
            "model %s loaded: max_model_len=%d, %d KV blocks of %d tokens, platform %s",
            names[0],
            engine.max_model_len,
            engine.runner.num_blocks,
            engine.config.cache.block_size,
            engine.platform.name,
        )
        ops["cache_info"]["num_blocks"] = str(engine.runner.num_blocks)
        ops["cache_info"]["block_size"] = str(engine.config.cache.block_size)  # resolved from the platform if unset
        check_lora_modules(engine, lora_modules)  # a bad adapter stops the start, named
        served = AsyncLLMEngine(engine)
    else:
        from pagedserve.serving.router import DataParallelRouter, ReplicaStartError

        try:
            served = DataParallelRouter(config, dp, log_level=args.log_level)
        except (ValueError, PlatformError, ReplicaStartError) as e:
            raise SystemExit(f"pagedserve serve: {e}") from None
        log.info("model %s served by %d data-parallel replicas (%s backend)", names[0], dp.size, dp.backend)
        # Each replica resolves an unset block size from its platform; the routing's is the smallest.
        ops["cache_info"]["block_size"] = str(served.policy.block_size)
    settings = ServerSettings(
        served_model_names=names,
        api_key=resolve_api_key(args),
        max_body_bytes=max_body,
        chat_template=chat_template,
        cors=cors,
        tool_options=tools,
        lora_modules=tuple(lora_modules),
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        responses_store=responses_store,
        enable_sleep_mode=config.model.enable_sleep_mode,
        **ops,
    )
    try:
        app = build_app(served, settings)
    except ValueError as e:  # e.g. --tool-call-parser auto on a template that does not tell
        served.shutdown()
        raise SystemExit(f"pagedserve serve: {e}") from None
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning(
            "binding %s: the server is reachable from other machines%s",
            args.host,
            "" if settings.api_key else " and has no --api-key",
        )
    # uvicorn turns SIGINT/SIGTERM into a graceful shutdown (requests still open after the
    # grace period are cut with an error, see shutdown.py) and the app's lifespan then
    # stops and joins the engine thread.
    # uvicorn re-raises the signal once done; these no-op handlers make that a normal exit
    # (status 0) instead of death by signal.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    grace = args.timeout_graceful_shutdown
    server = GracefulServer(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            log_config=log_config,
            access_log=not args.disable_access_log,
            timeout_graceful_shutdown=grace + CUT_MARGIN_S,
            **uvicorn_options(args),
        ),
        app.state.drain,
        grace,
    )
    # An engine-wide failure stops the server, loudly.
    served.set_callbacks(on_engine_dead=lambda e: setattr(server, "should_exit", True))
    try:
        server.run()
    finally:
        served.shutdown()  # already done by the lifespan unless uvicorn failed to start
    if not server.started:
        log.error("the HTTP server did not start (see the error above)")
        return 3  # uvicorn's own status for a failed start
    fatal = served.fatal_error
    if fatal is not None:
        log.critical("server stopped: the engine failed (%s: %s)", type(fatal).__name__, fatal)
        return 1
    log.info("server stopped")
    return 0
