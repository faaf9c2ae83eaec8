"""pytest options of the conformance kit (loaded through the ``pytest11`` entry point).

    pytest --pyargs pagedserve.testing.conformance --platform NAME

``--pyargs`` does not load a conftest.py that lives inside an installed package before
the command line is parsed, so the options are registered by this plugin instead.
Where the entry point is not installed (e.g. a source checkout that was never
``pip install``-ed), load it by hand: ``pytest -p pagedserve.testing.pytest_plugin ...``.
It only adds options: importing it costs nothing and changes no other test run.
"""

from __future__ import annotations

from typing import Any

__all__ = ["pytest_addoption"]


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("pagedserve", "pagedserve platform conformance kit")
    try:
        group.addoption(
            "--platform",
            "--pagedserve-platform",
            dest="pagedserve_platform",
            metavar="NAME",
            default=None,
            help="platform the conformance kit checks (default: "
            "PAGEDSERVE_TARGET_DEVICE, else the platform the engine would auto-select)",
        )
    except ValueError:  # another plugin owns --platform: keep the unambiguous spelling
        group.addoption(
            "--pagedserve-platform",
            dest="pagedserve_platform",
            metavar="NAME",
            default=None,
            help="platform the conformance kit checks",
        )
    group.addoption(
        "--conformance-model",
        dest="pagedserve_conformance_model",
        metavar="PATH",
        default=None,
        help="checkpoint folder for the engine check (default: a tiny random Llama made on the spot)",
    )
    group.addoption(
        "--conformance-seed",
        dest="pagedserve_conformance_seed",
        metavar="N",
        type=int,
        default=0,
        help="seed mixed into every case's random inputs (default 0)",
    )
