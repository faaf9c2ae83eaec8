"""Conformance checks of the KV connectors plugins register (platform interface 1.6,
``pagedserve_register_kv_connectors``): one ``connector:NAME`` check each."""

from __future__ import annotations

import hashlib

import torch

from pagedserve.platforms import KVConnector, PlatformError
from pagedserve.testing.checks import Check
from pagedserve.testing.target import Target

__all__ = ["connector_checks"]

#: The store bound the checks give a connector: room for the few blocks they save.
_MAX_BYTES = 64 * 2**20


def _block(seed: int) -> list[torch.Tensor]:
    """A block as the engine hands it over: per layer a key and a value tensor, in the
    model's dtypes and as an 8-bit cache's bytes (uint8), fresh random values."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 16, 3, 8, generator=gen)
    return [x, -x, x.to(torch.bfloat16), x.to(torch.float16), (x * 50).to(torch.int8).view(torch.uint8)]


def _roundtrip(factory, name: str) -> str:
    fingerprint = hashlib.sha256(b"conformance").hexdigest()
    conn = factory(arg=None, max_bytes=_MAX_BYTES, fingerprint=fingerprint)
    assert isinstance(conn, KVConnector), f"the factory returned {conn!r}, not a KVConnector"
    keys = [hashlib.sha256(f"{name}-{i}".encode()).hexdigest() for i in range(3)]
    blocks = [_block(i) for i in range(3)]
    assert not conn.contains(keys[0]), "contains() is True for a key never saved"
    assert conn.load(keys[0]) is None, "load() of a key never saved did not return None"
    for key, block in zip(keys, blocks):
        conn.save(key, [t.clone() for t in block])
    for key, block in zip(keys, blocks):
        assert conn.contains(key), "contains() is False right after save()"
        got = conn.load(key)
        assert got is not None, "load() returned None right after save()"
        assert len(got) == len(block), f"load() returned {len(got)} tensors, {len(block)} were saved"
        for i, (g, want) in enumerate(zip(got, block)):
            assert g.device.type == "cpu", f"tensor {i} came back on {g.device}, not the CPU"
            assert g.dtype == want.dtype and g.shape == want.shape, (
                f"tensor {i}: saved {want.dtype} {tuple(want.shape)}, loaded {g.dtype} {tuple(g.shape)}"
            )
            assert torch.equal(g, want), f"tensor {i} ({want.dtype}) came back with other values"
    conn.close()
    return f"{len(keys)} blocks of {len(blocks[0])} tensors saved and loaded bit for bit"


def connector_checks(target: Target) -> list[Check]:
    """One check per KV connector of the registry's plugins (none: no checks)."""
    try:
        found = target.registry.kv_connectors()
    except PlatformError as exc:
        message = str(exc)

        def fail() -> None:
            raise AssertionError(message)

        return [Check("connector:registry", fail)]
    return [
        Check(f"connector:{name}", lambda f=factory, n=name: _roundtrip(f, n)) for name, (factory, _) in found.items()
    ]
