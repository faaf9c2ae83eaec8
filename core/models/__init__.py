"""Model families written against the op registry, and the registry that maps
architecture names to them (see docs/models.md)."""

from __future__ import annotations

from pagedserve.models.registry import gguf_architectures, model_entries, supported_architectures

__all__ = ["supported_architectures", "model_entries", "gguf_architectures"]
