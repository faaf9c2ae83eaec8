"""Checks of the ``Platform`` members: identity, interface version, dtypes, memory and
tuning numbers, KV allocation and asynchronous copies.  (Block copies are the
``copy_blocks``/``swap_blocks`` ops, checked with the other ops.)"""

from __future__ import annotations

import torch

from pagedserve.platforms.interface import PLATFORM_INTERFACE_VERSION, check_interface_version
from pagedserve.testing.checks import Check
from pagedserve.testing.op_checks import NAN, assert_matches
from pagedserve.testing.target import Target

__all__ = ["platform_checks"]


def _identity(t: Target) -> str:
    p = t.platform
    assert isinstance(p.name, str) and p.name == t.info.name, (
        f"Platform.name is {p.name!r} but the platform was registered as {t.info.name!r}"
    )
    ok, reason = t.info.cls.is_available()
    assert ok is True or ok is False, f"is_available() must return (bool, str), got ({ok!r}, ...)"
    assert isinstance(reason, str) and reason.strip(), (
        "is_available() must give a reason a user can act on, got an empty one"
    )
    assert ok, f"is_available() says the platform is unavailable: {reason}"
    assert isinstance(p.device, torch.device) and p.device.type == p.device_type, (
        f"Platform.device is {p.device!r}, expected a torch.device of type {p.device_type!r}"
    )
    assert isinstance(p.dist_backend, str) and p.dist_backend, "Platform.dist_backend must name a backend"
    return f"device {p.device}, dist backend {p.dist_backend}: {reason}"


def _interface_version(t: Target) -> str:
    declared = t.info.cls.interface_version
    check_interface_version(declared, f"platform {t.name!r}")  # PlatformError -> reported as raised
    return f"targets {declared}, pagedserve provides {PLATFORM_INTERFACE_VERSION}"


def _dtypes(t: Target) -> str:
    p = t.platform
    dtypes = tuple(p.supported_dtypes)
    assert dtypes, "supported_dtypes is empty"
    assert all(isinstance(d, torch.dtype) for d in dtypes), f"supported_dtypes must hold torch.dtypes: {dtypes!r}"
    assert p.default_dtype in dtypes, f"default_dtype {p.default_dtype} is not in supported_dtypes {dtypes}"
    assert t.dtypes(), f"none of supported_dtypes {dtypes} is a dtype the kit can check (float32, bfloat16, float16)"
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def _memory(t: Target) -> str:
    total = t.platform.total_memory()
    assert isinstance(total, int) and not isinstance(total, bool), f"total_memory() returned {total!r}, not an int"
    assert total > 0, f"total_memory() is {total}"
    return f"total {total / 2**30:.2f} GiB"


def _kv_cache(t: Target, dtype: torch.dtype, block_size: int) -> str:
    num_blocks, kv_heads, head = 5, 2, 64
    shape = tuple(t.platform.kv_cache_shape(num_blocks, block_size, kv_heads, head))
    assert all(isinstance(s, int) and s > 0 for s in shape), f"kv_cache_shape returned {shape!r}"
    elems = num_blocks * block_size * kv_heads * head
    n = 1
    for s in shape:
        n *= s
    assert n >= elems, f"kv_cache_shape {shape} holds {n} elements, fewer than the {elems} the blocks need"
    pair = t.platform.allocate_kv_cache(num_blocks, block_size, kv_heads, head, dtype)
    assert isinstance(pair, tuple) and len(pair) == 2, "allocate_kv_cache must return (key_cache, value_cache)"
    for label, cache in zip(("key_cache", "value_cache"), pair):
        assert isinstance(cache, torch.Tensor), f"{label} is {type(cache).__name__}, not a tensor"
        assert tuple(cache.shape) == shape, f"{label} shape {tuple(cache.shape)} != kv_cache_shape {shape}"
        assert cache.dtype == dtype, f"{label} dtype {cache.dtype} != requested {dtype}"
        assert cache.device.type == t.device.type, f"{label} is on {cache.device}, not the platform's {t.device}"
    k, v = pair
    k.fill_(1.0)
    v.fill_(2.0)
    assert bool((k == 1.0).all()), "key_cache and value_cache share memory (writing value_cache changed key_cache)"
    return f"{shape} on {k.device}"


def _copy_async(t: Target, dtype: torch.dtype) -> str:
    """copy_async + wait_copy host -> device, as weight streaming uses them: work queued
    after wait_copy (here the read-back of ``dst``) must see the copied values."""
    gen = torch.Generator().manual_seed(4321)
    src = torch.randn((3, 257), generator=gen).to(dtype)
    dst = torch.full(src.shape, NAN, dtype=dtype, device=t.device)
    handle = t.platform.copy_async(dst, src.clone())
    t.platform.wait_copy(handle)
    assert_matches("Platform.copy_async (host->device)", dst, src, dtype, exact=True)
    return "host->device"


def _release_memory(t: Target) -> str:
    """release_memory (interface 1.6, sleep mode) runs with the platform's tensors freed
    and leaves live tensors intact (it may only give back memory no tensor holds)."""
    gen = torch.Generator().manual_seed(99)
    keep = torch.randn((64, 129), generator=gen)
    live = keep.to(t.device)
    dropped = torch.empty((1024, 1024), device=t.device)
    del dropped
    t.platform.release_memory()
    assert_matches("a live tensor after Platform.release_memory", live, keep, keep.dtype, exact=True)
    return "ran; a live tensor kept its values"


def _tuning(t: Target) -> str:
    """The numbers the engine sizes memory and weighs preemption with."""
    p = t.platform
    util = p.default_memory_utilization
    assert isinstance(util, float) and 0.0 < util <= 1.0, f"default_memory_utilization is {util!r}, not in (0, 1]"
    for member in ("host_copy_bandwidth", "compute_flops"):
        value = getattr(p, member)
        assert isinstance(value, (int, float)) and 0 < value < float("inf"), f"{member} is {value!r}"
    bs = p.default_block_size
    assert isinstance(bs, int) and bs >= 1 and bs & (bs - 1) == 0, f"default_block_size is {bs!r}, not a power of two"
    return (
        f"memory utilization {util:g}, host copy {p.host_copy_bandwidth:.3g} B/s, compute {p.compute_flops:.3g} "
        f"FLOP/s, KV blocks of {bs} tokens"
    )


def platform_checks(target: Target) -> list[Check]:
    """Checks of the Platform object itself (they do not depend on which ops it overrides)."""
    t = target
    checks = [
        Check("platform:identity", lambda: _identity(t)),
        Check("platform:interface-version", lambda: _interface_version(t)),
        Check("platform:dtypes", lambda: _dtypes(t)),
        Check("platform:memory", lambda: _memory(t)),
        Check("platform:tuning", lambda: _tuning(t)),
        Check("platform:release-unused", lambda: _release_memory(t)),
    ]
    for dtype in t.dtypes():
        name = str(dtype).removeprefix("torch.")
        for block_size in sorted({16, 32, int(t.platform.default_block_size)}):
            checks.append(
                Check(f"platform:kv-cache[{name}-bs{block_size}]", lambda d=dtype, b=block_size: _kv_cache(t, d, b))
            )
        checks.append(Check(f"platform:copy-async[{name}]", lambda d=dtype: _copy_async(t, d)))
    return checks
