"""Adapters a server serves by name: ``--lora-modules`` and runtime loads/unloads."""

from __future__ import annotations

import itertools
import json
import threading

from pagedserve.lora.request import LoRARequest

__all__ = ["LoRAModules", "parse_lora_module"]


def parse_lora_module(value: str) -> tuple[str, str]:
    """(name, path) of one ``--lora-modules`` entry: ``name=path`` or vLLM's JSON form
    ``{"name": ..., "path": ..., "base_model_name": ...}``."""
    text = value.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--lora-modules entry {value!r} is not valid JSON ({exc})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"--lora-modules JSON entry {value!r} must be an object")
        name, path = obj.get("name"), obj.get("path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ValueError(f"--lora-modules JSON entry {value!r} needs string 'name' and 'path'")
        return name, path
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules entry {value!r} must be name=path or a JSON object")
    return name, path


class LoRAModules:
    """Thread-safe name -> LoRARequest map; each (re)load gets a new ``lora_int_id`` so
    that the prefix cache never mixes two adapters that shared a name."""

    def __init__(self) -> None:
        self._by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def add(self, name: str, path: str) -> LoRARequest:
        """Register ``name``; ValueError if it is taken."""
        with self._lock:
            if name in self._by_name:
                raise ValueError(f"The lora adapter '{name}' has already been loaded.")
            lora = LoRARequest(name, next(self._ids), path)
            self._by_name[name] = lora
            return lora

    def remove(self, name: str) -> LoRARequest | None:
        with self._lock:
            return self._by_name.pop(name, None)

    def get(self, name: str | None) -> LoRARequest | None:
        return self._by_name.get(name) if name else None

    def all(self) -> list[LoRARequest]:
        with self._lock:
            return list(self._by_name.values())
