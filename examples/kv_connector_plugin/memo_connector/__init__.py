"""A KV connector plugin for pagedserve: ``kv_connector="memo"`` (or ``"memo:NAME"``).

Blocks live in a dict shared by every engine of the process under the same NAME, so a
second engine finds the prefixes the first one computed.  ``CALLS`` logs every call,
for demonstration and tests.  It registers no platform, only a connector.
"""

from __future__ import annotations

import torch

from pagedserve.platforms import KVConnector, hookimpl

#: The platform interface version this plugin targets (KV connectors arrived in 1.6).
PAGEDSERVE_INTERFACE_VERSION = "1.6"

#: store name -> {key: tensors}
STORES: dict[str, dict[str, list[torch.Tensor]]] = {}
#: (store name, method, key) of every save and load.
CALLS: list[tuple[str, str, str]] = []


class MemoConnector(KVConnector):
    def __init__(self, name: str, max_bytes: int) -> None:
        self.name = name
        self.max_bytes = max_bytes
        self.blocks = STORES.setdefault(name, {})

    def contains(self, key: str) -> bool:
        return key in self.blocks

    def save(self, key: str, tensors: list[torch.Tensor]) -> None:
        CALLS.append((self.name, "save", key))
        if sum(t.numel() * t.element_size() for b in self.blocks.values() for t in b) < self.max_bytes:
            self.blocks[key] = [t.clone() for t in tensors]

    def load(self, key: str) -> list[torch.Tensor] | None:
        CALLS.append((self.name, "load", key))
        found = self.blocks.get(key)
        return None if found is None else [t.clone() for t in found]

    def stats(self) -> dict[str, int]:
        return {"blocks": len(self.blocks)}


@hookimpl
def pagedserve_register_kv_connectors(register):
    register("memo", lambda arg, max_bytes, fingerprint: MemoConnector(arg or "default", max_bytes))
