"""The builtin platforms as this machine sees them, the op registry and the public names."""

from __future__ import annotations

import pytest
import torch

import pagedserve.platforms as platforms_pkg
from pagedserve.kernels import reference
from pagedserve.platforms import OpRegistry, PlatformError, discover

CPU_ONLY_TORCH = not torch.version.cuda and not getattr(torch.version, "hip", None)
needs_cpu_only_torch = pytest.mark.skipif(not CPU_ONLY_TORCH, reason="this torch build has a GPU backend")

BUILTINS_ONLY = {"PAGEDSERVE_PLUGINS": "pagedserve"}


def test_every_public_name_exists():
    missing = [n for n in platforms_pkg.__all__ if not hasattr(platforms_pkg, n)]
    assert missing == []


def test_builtins_are_discovered_as_builtin(clean_env):
    reg = discover(clean_env)
    for name in ("cpu", "cuda", "rocm"):
        assert reg.platforms[name].origin == "builtin", name
        assert reg.platforms[name].plugin == name


@needs_cpu_only_torch
def test_cpu_is_selected_by_default(clean_env):
    reg = discover({**clean_env, **BUILTINS_ONLY})
    assert reg.select().name == "cpu"
    third_party = [p.name for p in discover(clean_env).platforms.values() if not p.builtin and p.probe()[0]]
    if third_party:
        pytest.skip(f"an available third-party platform is installed here: {third_party}")
    assert discover(clean_env).select().name == "cpu"


@needs_cpu_only_torch
@pytest.mark.parametrize("name", ["cuda", "rocm"])
def test_gpu_platforms_are_unavailable_on_a_cpu_only_torch(clean_env, name):
    reg = discover(clean_env)
    ok, reason = reg.platforms[name].probe()
    assert not ok
    assert "CPU-only build" in reason and torch.__version__ in reason
    with pytest.raises(PlatformError, match=f"platform '{name}' is not available: .*CPU-only build"):
        reg.select(name)


@needs_cpu_only_torch
def test_no_available_platform_is_an_error_with_every_reason(clean_env):
    with pytest.raises(PlatformError, match=r"no platform is available \(cuda: .*CPU-only.*; rocm: .*CPU-only"):
        discover({**clean_env, "PAGEDSERVE_PLUGINS": "cuda,rocm"}).select()


def test_current_platform_reads_the_environment_and_is_cached(monkeypatch):
    from pagedserve.platforms import _cached_platform, current_platform

    monkeypatch.delenv("PAGEDSERVE_PLUGINS", raising=False)
    monkeypatch.setenv("PAGEDSERVE_TARGET_DEVICE", "cpu")
    _cached_platform.cache_clear()
    try:
        first = current_platform()
        assert first.name == "cpu"
        assert current_platform() is first
        monkeypatch.setenv("PAGEDSERVE_TARGET_DEVICE", "tpu")
        with pytest.raises(PlatformError, match="unknown platform 'tpu'"):
            current_platform()
    finally:
        _cached_platform.cache_clear()


def test_cpu_platform_facts(clean_env):
    platform = discover(clean_env).select("cpu").cls()
    assert platform.device == torch.device("cpu")
    assert platform.default_dtype in platform.supported_dtypes
    assert platform.total_memory() > 0
    facts = platform.describe()
    assert facts["total_memory"] == platform.total_memory()


def test_cpu_kv_cache_allocation_and_block_copy(clean_env):
    platform = discover(clean_env).select("cpu").cls()
    k, v = platform.allocate_kv_cache(num_blocks=6, block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float32)
    assert k.shape == v.shape == platform.kv_cache_shape(6, 4, 2, 8) == (6, 4, 2, 8)
    assert k.data_ptr() != v.data_ptr()
    src = torch.randn(6, 4, 2, 8)
    k.fill_(float("nan"))  # poison: every block the copy skips must stay untouched
    reg = discover(clean_env)
    reg.resolve_ops(platform).copy_blocks(src, k, torch.tensor([[0, 5], [3, 1]]))
    torch.testing.assert_close(k[5], src[0])
    torch.testing.assert_close(k[1], src[3])
    assert torch.isnan(k[[0, 2, 3, 4]]).all()


def test_op_registry_defaults_to_the_reference_for_every_op():
    ops = OpRegistry()
    assert [name for name, _ in ops.table()] == list(reference.OP_NAMES)
    # The registry's own parts, composed.
    composite = {"linear_silu_and_mul", "gguf_linear_silu_and_mul", "gguf_linear_stacked", "rotary_paged_attention"}
    for name in reference.OP_NAMES:
        assert ops.source(name) == "reference"
        assert (ops.get(name) is getattr(reference, name)) == (name not in composite), name


def test_fused_op_default_composes_the_registry_parts():
    """linear_silu_and_mul defaults to silu_and_mul(linear(...)) of the same registry,
    looked up per call: a platform that overrides only linear (say, taking weights it
    packed in prepare_linear_weight) and silu_and_mul gets them in the fused op too."""
    ops = OpRegistry()
    gen = torch.Generator().manual_seed(3)
    x, w, b = torch.randn(5, 8, generator=gen), torch.randn(12, 8, generator=gen), torch.randn(12, generator=gen)
    torch.testing.assert_close(ops.linear_silu_and_mul(x, w, b), reference.linear_silu_and_mul(x, w, b))
    calls = []
    ops.register("prepare_linear_weight", lambda w: ("packed", w), source="test")
    ops.register("linear", lambda x, w, b=None: calls.append("linear") or reference.linear(x, w[1], b), source="test")
    ops.register("silu_and_mul", lambda x: calls.append("silu") or reference.silu_and_mul(x), source="test")
    got = ops.linear_silu_and_mul(x, ops.prepare_linear_weight(w), b)
    assert calls == ["linear", "silu"] and ops.source("linear_silu_and_mul") == "reference"
    torch.testing.assert_close(got, reference.linear_silu_and_mul(x, w, b))


def test_op_registry_rejects_bad_registrations():
    ops = OpRegistry()
    with pytest.raises(TypeError, match="not callable"):
        ops.register("silu_and_mul", 42)
    with pytest.raises(ValueError, match="not a valid identifier"):
        ops.register("silu-and-mul", lambda x: x)
    with pytest.raises(AttributeError, match="no op named 'flash_attn'.*paged_attention"):
        ops.flash_attn  # noqa: B018


def test_op_registry_override_and_source():
    def mine(x):
        return x

    ops = OpRegistry()
    ops.register("rms_norm", mine, source="mine")
    assert ops.rms_norm is mine and ops.source("rms_norm") == "mine"
    ops.register("linear", mine)  # the source defaults to the function's module
    assert ops.source("linear") == __name__


def test_op_capabilities_are_declared_checked_and_go_with_the_implementation():
    from pagedserve.platforms.ops import PREFERS_QUANTIZED

    ops = OpRegistry()
    assert not ops.has_capability("gguf_linear", PREFERS_QUANTIZED)  # the reference declares none
    assert not ops.has_capability("no_such_op", PREFERS_QUANTIZED)
    ops.register("gguf_linear", reference.gguf_linear, source="fast", capabilities=[PREFERS_QUANTIZED])
    assert ops.has_capability("gguf_linear", PREFERS_QUANTIZED)
    ops.register("gguf_linear", reference.gguf_linear, source="later plugin")  # an override declares its own
    assert not ops.has_capability("gguf_linear", PREFERS_QUANTIZED)
    with pytest.raises(ValueError, match="unknown capabilities \\['prefers_quantised'\\]"):
        ops.register("gguf_linear", reference.gguf_linear, capabilities=["prefers_quantised"])
    with pytest.raises(ValueError, match="unknown capability 'fast'"):
        ops.has_capability("gguf_linear", "fast")
