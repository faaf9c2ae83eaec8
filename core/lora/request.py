"""LoRARequest: which adapter a request runs with (vLLM's shape)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["LoRARequest", "lora_cache_salt", "per_prompt_lora"]


@dataclass(frozen=True)
class LoRARequest:
    """An adapter for a request: ``lora_name`` (what the server lists as a model),
    ``lora_int_id`` (unique and >= 1 per distinct adapter) and ``lora_path`` (a PEFT
    folder with ``adapter_config.json`` and ``adapter_model.safetensors``)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("LoRARequest.lora_name must be a non-empty string")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be an int >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError("LoRARequest.lora_path must be a non-empty path")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path


def lora_cache_salt(cache_salt: str | None, lora: LoRARequest | None) -> str | None:
    """The prefix-cache salt of a request under ``lora``: the same prompt under two
    adapters (or an adapter and the base) never shares KV blocks.  Folded into the
    salt that already keys the first block's hash, so the whole chain differs."""
    if lora is None:
        return cache_salt
    return f"{cache_salt or ''}\x00lora:{lora.lora_int_id}:{lora.lora_name}:{lora.lora_path}"


def per_prompt_lora(
    lora: LoRARequest | Sequence[LoRARequest | None] | None, num_prompts: int
) -> list[LoRARequest | None]:
    """``LLM.generate``'s ``lora_request`` as one entry per prompt (ValueError on a
    length mismatch or a non-LoRARequest entry)."""
    if lora is None or isinstance(lora, LoRARequest):
        return [lora] * num_prompts
    loras = list(lora)
    if len(loras) != num_prompts:
        raise ValueError(f"got {num_prompts} prompts but {len(loras)} lora_request entries")
    for x in loras:
        if x is not None and not isinstance(x, LoRARequest):
            raise ValueError(f"lora_request entries must be LoRARequest or None, got {type(x).__name__}")
    return loras
