"""`pagedserve run-batch -i requests.jsonl -o results.jsonl [MODEL]`: an OpenAI batch file
answered offline by an in-process engine behind the server's own request handling
(batch_runner.py), so every answer equals what `pagedserve serve` would give."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys

__all__ = ["add_parser", "run"]


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "run-batch",
        help="answer an OpenAI batch file (JSONL) offline",
        description="Answer every request of an OpenAI batch file (lines of {custom_id, method, url, body} with url "
        "/v1/chat/completions, /v1/completions, /v1/embeddings or /v1/responses) and write one result line per "
        "request, in input order.  A bad line is reported on its own output line.",
    )
    p.add_argument("model", nargs="?", default=None, help="model (default: smollm2-135m-instruct)")
    p.add_argument("-i", "--input-file", required=True, help="the batch file (JSONL); '-' reads stdin")
    p.add_argument("-o", "--output-file", required=True, help="where the results go (JSONL); '-' writes stdout")
    p.add_argument(
        "--served-model-name", nargs="+", default=None, help="name(s) the lines' 'model' may use (default: MODEL)"
    )
    p.add_argument("--chat-template", default=None, help="a Jinja2 chat template file (or text) overriding the model's")
    p.add_argument(
        "--max-concurrency", type=int, default=256, help="requests in flight at once (the engine batches them)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    from pagedserve.entrypoints.engine_args import add_engine_arguments

    add_engine_arguments(p)
    from pagedserve.entrypoints.cli.structured_args import add_tool_arguments

    add_tool_arguments(p)


def _build_app(args: argparse.Namespace):
    from pagedserve.async_engine import AsyncLLMEngine
    from pagedserve.engine import LLMEngine
    from pagedserve.entrypoints.cli.serve_cmd import read_chat_template
    from pagedserve.entrypoints.cli.structured_args import tool_options
    from pagedserve.entrypoints.engine_args import engine_config_from_args
    from pagedserve.entrypoints.openai import ServerSettings, build_app
    from pagedserve.entrypoints.openai.responses_store import ResponseStoreConfig
    from pagedserve.loader.model_path import DEFAULT_MODEL_ALIAS

    names = args.served_model_name or [args.model or DEFAULT_MODEL_ALIAS]
    config = engine_config_from_args(args, model=args.model, served_model_name=names[0])
    tools = tool_options(args, config.structured_outputs.reasoning_parser)
    engine = LLMEngine(config)
    settings = ServerSettings(
        served_model_names=names,
        chat_template=read_chat_template(args.chat_template),
        tool_options=tools,
        responses_store=ResponseStoreConfig(max_entries=0),  # nothing to retrieve a batch's responses with
    )
    return build_app(AsyncLLMEngine(engine), settings)


async def _run(app, lines, write, args) -> tuple[int, int]:
    from pagedserve.entrypoints.cli.batch_runner import run_batch

    async with app.router.lifespan_context(app):  # starts the engine thread, stops it after
        return await run_batch(app, lines, write, args.max_concurrency, not args.no_progress)


def run(args: argparse.Namespace) -> int:
    import logging

    from pagedserve.platforms import PlatformError

    if args.max_concurrency < 1:
        raise SystemExit(f"pagedserve run-batch: --max-concurrency must be >= 1, got {args.max_concurrency}")
    try:
        if args.input_file == "-":
            lines = sys.stdin.read().splitlines()
        else:
            with open(args.input_file, encoding="utf-8") as f:
                lines = f.read().splitlines()
    except OSError as e:
        raise SystemExit(f"pagedserve run-batch: cannot read {args.input_file}: {e}") from None
    logging.getLogger("pagedserve").setLevel(logging.WARNING)  # the progress bar says enough
    try:
        app = _build_app(args)
    except (ValueError, PlatformError, RuntimeError) as e:
        raise SystemExit(f"pagedserve run-batch: {e}") from None
    with contextlib.ExitStack() as stack:
        out = (
            sys.stdout
            if args.output_file == "-"
            else stack.enter_context(open(args.output_file, "w", encoding="utf-8"))
        )

        def write(obj: dict) -> None:
            out.write(json.dumps(obj, ensure_ascii=False) + "\n")
            out.flush()

        ok, failed = asyncio.run(_run(app, lines, write, args))
    print(f"run-batch: {ok} succeeded, {failed} failed", file=sys.stderr)
    return 0
