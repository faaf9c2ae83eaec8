"""The one exception a checkpoint that cannot be loaded raises.

Every loader failure (truncated or corrupt files, metadata that contradicts the tensors,
values no model can have) surfaces as :class:`ModelLoadError`, a ``ValueError``, whose
message names the file and the field, so that ``pagedserve serve`` can print it as one
line and callers can catch one type.
"""

from __future__ import annotations

import pathlib

__all__ = ["ModelLoadError"]


class ModelLoadError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and the problem."""

    def __init__(self, path: str | pathlib.Path, problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"cannot load {self.path!r}: {problem}")
