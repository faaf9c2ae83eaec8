"""Multi-LoRA serving: PEFT adapters loaded next to one base model, many of them mixed
in one batch (docs/lora.md).

- :class:`LoRARequest` names an adapter for a request (as vLLM's).
- :mod:`.adapter` reads and checks a PEFT folder.
- :class:`LoRAManager` keeps adapters in host memory (LRU, ``max_cpu_loras``) and in
  device slots (LRU, ``max_loras``), wraps the model's linear projections, and per step
  maps each token row to its adapter's slot for the batched ``lora_linear`` op.
"""

from __future__ import annotations

from pagedserve.lora.adapter import LoRAAdapter, load_adapter
from pagedserve.lora.manager import LoRAManager
from pagedserve.lora.request import LoRARequest, lora_cache_salt

__all__ = ["LoRARequest", "LoRAAdapter", "LoRAManager", "load_adapter", "lora_cache_salt"]
