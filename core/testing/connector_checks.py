"""Conformance checks of the KV connectors plugins register (platform interface 1.6,
``pagedserve_register_kv_connectors``): one ``connector:NAME`` check each.  A content
store (1.6) saves and loads blocks by key bit for bit; a device-layout connector
(interface 1.7) allocates slots in the platform's layout and copies batches of blocks
into and out of them bit for bit through the platform's ``swap_blocks``."""

from __future__ import annotations

import hashlib

import torch

from pagedserve.platforms import DeviceLayoutKVConnector, KVConnector, PlatformError
from pagedserve.platforms.interface import SAVE_MODES
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


def _check(factory, name: str, target: Target) -> str:
    fingerprint = hashlib.sha256(b"conformance").hexdigest()
    conn = factory(arg=None, max_bytes=_MAX_BYTES, fingerprint=fingerprint)
    assert isinstance(conn, KVConnector), f"the factory returned {conn!r}, not a KVConnector"
    assert conn.save_mode in SAVE_MODES, f"save_mode {conn.save_mode!r} is not one of {SAVE_MODES}"
    declared = bool(getattr(factory, "device_layout", False))
    assert declared == bool(conn.device_layout), (
        f"the connector's device_layout is {conn.device_layout} but its registered factory's is {declared}: "
        "register the DeviceLayoutKVConnector subclass itself, or mark the factory device_layout = True"
    )
    if conn.device_layout:
        assert isinstance(conn, DeviceLayoutKVConnector), "device_layout is set on a non-DeviceLayoutKVConnector"
        return _tier_roundtrip(conn, target)
    return _roundtrip(conn, name)


def _tier_blocks(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:  # an 8-bit cache's bytes
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).to(device)
    return torch.randn(shape, generator=gen).to(dtype).to(device)


def _poison(t: torch.Tensor) -> None:
    t.fill_(0xA5 if t.dtype == torch.uint8 else float("nan"))


def _poisoned(t: torch.Tensor) -> bool:
    return bool((t == 0xA5).all() if t.dtype == torch.uint8 else t.isnan().all())


def _tier_roundtrip(conn: DeviceLayoutKVConnector, target: Target) -> str:
    """Slots in the platform's layout within the byte bound; batched copies device ->
    slots -> device move every byte of the right blocks, in mapping order; a slot written
    twice keeps the last write; nothing else is written."""
    platform, swap = target.platform, target.ops.swap_blocks
    block_size, heads, head_size, num_device = 16, 2, 8, 4
    for dtype in (torch.float32, torch.bfloat16, torch.uint8):
        per_block = 2 * block_size * heads * head_size * torch.empty((), dtype=dtype).element_size()
        n = conn.num_blocks(per_block)
        assert 6 <= n and n * per_block <= _MAX_BYTES, (
            f"num_blocks({per_block}) = {n}: expected at least 6 slots and at most {_MAX_BYTES} bytes of them"
        )
        n = 6
        stores = conn.allocate(platform, n, block_size, heads, head_size, dtype)
        shape = tuple(platform.kv_cache_shape(n, block_size, heads, head_size))
        assert len(stores) == 2, f"allocate() returned {len(stores)} tensors, not (key, value)"
        for t in stores:
            assert tuple(t.shape) == shape and t.dtype == dtype, (
                f"allocate() gave {t.dtype} {tuple(t.shape)}, not {dtype} {shape} (the platform's kv_cache_shape)"
            )
        assert stores[0].data_ptr() != stores[1].data_ptr(), "the key and value slots share memory"
        dshape = tuple(platform.kv_cache_shape(num_device, block_size, heads, head_size))
        device = [_tier_blocks(dshape, dtype, platform.device, seed) for seed in (1, 2)]
        want = [d.clone() for d in device]
        out = torch.tensor([[0, 5], [1, 0], [2, 3]], dtype=torch.int64)
        for d, st in zip(device, stores):
            conn.save_blocks(swap, d, st, out)
            _poison(d)
        back = torch.tensor([[5, 2], [0, 3], [3, 0]], dtype=torch.int64)
        for d, st in zip(device, stores):
            conn.load_blocks(swap, st, d, back)
        for i, (d, w) in enumerate(zip(device, want)):
            name = ("key", "value")[i]
            for src, dst in ((0, 2), (1, 3), (2, 0)):
                assert torch.equal(d[dst].cpu(), w[src].cpu()), (
                    f"{dtype} {name} block {src} saved and loaded back into block {dst} came back with other values"
                )
            assert _poisoned(d[1]), f"{dtype} {name}: block 1 was not in the load mapping but was written"
        # Slot 0 written again: the last write wins.
        fresh = [_tier_blocks(dshape, dtype, platform.device, seed) for seed in (3, 4)]
        for f, st in zip(fresh, stores):
            conn.save_blocks(swap, f, st, torch.tensor([[3, 0]], dtype=torch.int64))
        for f, st, w in zip(fresh, stores, want):
            target_blocks = f.clone()
            _poison(target_blocks)
            conn.load_blocks(swap, st, target_blocks, torch.tensor([[0, 1], [5, 2]], dtype=torch.int64))
            assert torch.equal(target_blocks[1].cpu(), f[3].cpu()), (
                f"{dtype}: a slot written twice did not keep the last write"
            )
            assert torch.equal(target_blocks[2].cpu(), w[0].cpu()), f"{dtype}: writing slot 0 changed slot 5"
    conn.close()
    return "slots in the platform's layout (float32, bf16, 8-bit bytes); batched copies bit for bit both ways"


def _roundtrip(conn: KVConnector, name: str) -> str:
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
        Check(f"connector:{name}", lambda f=factory, n=name: _check(f, n, target))
        for name, (factory, _) in found.items()
    ]
