"""The `pagedserve` command line: `main` (main.py) and one module per subcommand
(``*_cmd.py``), with the argument groups they share (``*_args.py``)."""

from pagedserve.entrypoints.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
