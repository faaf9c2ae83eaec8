"""The builtin platforms' environment switches: one boolean spelling, bad values refused
by name, read once when the platform is created."""

from __future__ import annotations

import pytest
import torch

from pagedserve.platforms.cpu import CpuPlatform
from pagedserve.platforms.options import CpuOptions, GpuOptions, env_flag, target_device


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        ("1", True),
        ("TRUE", True),
        (" yes ", True),
        ("on", True),
        ("0", False),
        ("False", False),
        ("no", False),
        ("OFF", False),
        ("", None),
        (None, None),
    ],
)
def test_one_boolean_spelling(raw, want):
    env = {} if raw is None else {"X": raw}
    assert env_flag(env, "X", True) is (True if want is None else want)
    assert env_flag(env, "X", False) is (False if want is None else want)


def test_bad_values_are_refused_by_name():
    with pytest.raises(ValueError, match="PAGEDSERVE_CPU_KERNELS='nope' is not a boolean"):
        CpuOptions.from_env({"PAGEDSERVE_CPU_KERNELS": "nope"})
    with pytest.raises(ValueError, match="PAGEDSERVE_CPU_KV_LAYOUT='rows' is not one of head, token"):
        CpuOptions.from_env({"PAGEDSERVE_CPU_KV_LAYOUT": "rows"})
    with pytest.raises(ValueError, match="PAGEDSERVE_CUDA_KERNELS='cudnn' is not one of triton, cuda"):
        GpuOptions.from_env({"PAGEDSERVE_CUDA_KERNELS": "cudnn"})


def test_cpu_options_from_env():
    assert CpuOptions.from_env({}) == CpuOptions()
    got = CpuOptions.from_env(
        {
            "PAGEDSERVE_CPU_KERNELS": "0",
            "PAGEDSERVE_QUANT_CPU_KERNELS": "off",
            "PAGEDSERVE_CPU_ISA": " AVX2 ",
            "PAGEDSERVE_CPU_PREPACK": "no",
            "PAGEDSERVE_CPU_KV_LAYOUT": "Token",
            "PAGEDSERVE_CPU_HUGE_PAGES": "yes",
            "PAGEDSERVE_CPU_GGUF_REPACK": "0",
            "PAGEDSERVE_CPU_WEIGHT_HUGE_PAGES": "off",
        }
    )
    assert got == CpuOptions(
        native_kernels=False,
        quant_kernels=False,
        isa="avx2",
        prepack=False,
        kv_layout="token",
        huge_pages=True,
        weight_huge_pages=False,
        gguf_repack=False,
    )


def test_target_device_is_resolved_in_one_place():
    assert target_device({}) is None
    assert target_device({"PAGEDSERVE_TARGET_DEVICE": " auto "}) is None
    assert target_device({"PAGEDSERVE_TARGET_DEVICE": " cpu "}) == "cpu"


def test_a_platform_reads_its_switches_once(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CPU_KV_LAYOUT", "token")
    platform = CpuPlatform()
    monkeypatch.setenv("PAGEDSERVE_CPU_KV_LAYOUT", "head")  # too late for this platform
    k, _ = platform.allocate_kv_cache(4, 16, 2, 8, torch.float32)
    assert k.is_contiguous()  # token-major storage: the plain layout
    k, _ = CpuPlatform().allocate_kv_cache(4, 16, 2, 8, torch.float32)
    assert not k.is_contiguous() and k.transpose(1, 2).is_contiguous()  # head-major storage
    assert CpuPlatform(CpuOptions(kv_layout="token")).options.kv_layout == "token"
