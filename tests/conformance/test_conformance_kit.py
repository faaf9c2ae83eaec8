"""The conformance kit itself: it must fail, naming the culprit, for each kind of
non-conformance -- a wrong op, an op that ignores ``out``, a cache write that does not
skip slot -1, attention without grouped-query support, lying memory queries, a wrong
KV allocation, a wrong block copy -- and pass the same platform once the fault is gone.

Plugins are registered in-process (no install) except for the command-line checks,
which find a throwaway distribution through its entry point, like a real plugin.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from pagedserve.platforms import PlatformRegistry
from pagedserve.testing import ConformanceReport, run_conformance

#: A complete plugin: platform ``fake`` plus op overrides chosen by FAULT (a placeholder
#: replaced per test).  Every override is correct unless FAULT names it.
PLUGIN = """
import torch

from pagedserve.kernels import reference
from pagedserve.platforms import Platform, hookimpl

FAULT = {fault!r}


class FakePlatform(Platform):
    name = "fake"
    device_type = "cpu"
    supported_dtypes = (torch.float32, torch.bfloat16)

    @classmethod
    def is_available(cls):
        return True, "the fake device is the host"

    def total_memory(self):
        return 8.0 * 1024**3 if FAULT == "memory" else 8 * 1024**3  # a float: the fault

    def kv_cache_shape(self, num_blocks, block_size, num_kv_heads, head_size):
        return (num_blocks, block_size, num_kv_heads, head_size)

    def release_memory(self):
        if FAULT == "release-memory":
            raise RuntimeError("allocator trim failed")

    def allocate_kv_cache(self, num_blocks, block_size, num_kv_heads, head_size, dtype):
        if FAULT == "kv-dtype":
            dtype = torch.float32
        return super().allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_size, dtype)


def silu_and_mul(x):
    d = x.shape[-1] // 2
    gate, up = x[..., :d].float(), x[..., d:].float()
    if FAULT == "silu_and_mul":  # sigmoid where silu belongs
        return (torch.sigmoid(gate) * up).to(x.dtype)
    return (gate * torch.sigmoid(gate) * up).to(x.dtype)


def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, out=None):
    if FAULT == "attention-ignores-out":
        return reference.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale)
    if FAULT == "attention-no-gqa":  # query head h reads KV head h % num_kv_heads, not h // group
        # Reorder the heads so that the reference's h // group lands on h % num_kv_heads.
        order = torch.argsort(torch.arange(query.shape[1]) % key_cache.shape[2], stable=True)
        result = reference.paged_attention(query[:, order], key_cache, value_cache, block_tables, seq_lens,
                                           query_start_loc, scale)
        result = result[:, torch.argsort(order)]
        if out is None:
            return result
        out.copy_(result)
        return out
    return reference.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                     scale, out)


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping):
    if FAULT == "cache-writes-slot-minus-1":  # -1 indexes the last slot instead of skipping
        n = key_cache.shape[0] * key_cache.shape[1]
        slot_mapping = slot_mapping % n
    reference.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def rms_norm(x, weight, eps):
    if FAULT == "rms_norm-raises":
        raise RuntimeError("kernel launch failed")
    return reference.rms_norm(x, weight, eps)


@hookimpl
def pagedserve_register_platforms(register):
    register(FakePlatform)


@hookimpl
def pagedserve_register_ops(platform, ops):
    if isinstance(platform, FakePlatform):
        for fn in (silu_and_mul, paged_attention, reshape_and_cache, rms_norm):
            ops.register(fn.__name__, fn, source="fake-kernels")
"""


def plugin_module(fault: str | None) -> types.ModuleType:
    module = types.ModuleType("fake_plugin")
    exec(compile(PLUGIN.format(fault=fault), "fake_plugin.py", "exec"), module.__dict__)
    return module


def check_fake(fault: str | None, only: list[str] | None = None) -> ConformanceReport:
    reg = PlatformRegistry(env={})
    reg.register_plugin(plugin_module(fault), "fake", "fake-platform 0.1")
    assert reg.failures == []
    return run_conformance("fake", registry=reg, only=only)


@pytest.fixture(scope="module")
def healthy() -> ConformanceReport:
    return check_fake(None)


def test_a_conforming_platform_passes(healthy):
    assert healthy.ok, healthy.format(verbose=False)
    assert set(healthy.overridden_ops) == {"silu_and_mul", "paged_attention", "reshape_and_cache", "rms_norm"}
    ids = {r.id for r in healthy.results}
    # Both dtypes, both block sizes, GQA and MHA are exercised.
    for expected in (
        "op:paged_attention[float32-bs16-h4kv4-d64]",
        "op:paged_attention[bfloat16-bs32-h8kv2-d64]",
        "op:reshape_and_cache[float32-bs32-kv2-d64]",
        "op:silu_and_mul[bfloat16-7x256]",
        "platform:memory",
        "platform:kv-cache[bfloat16-bs16]",
        "platform:copy-async[float32]",
    ):
        assert expected in ids
    # Ops left to the reference are not re-checked against themselves.
    assert not any(i.startswith(("op:linear", "op:embedding")) for i in ids)
    engine = next(r for r in healthy.results if r.id.startswith("engine:"))
    assert engine.status == "skipped" and "entry-point discovery" in engine.message


def test_a_wrong_op_fails_and_is_named(healthy):
    report = check_fake("silu_and_mul")
    assert not report.ok
    failed = {r.id for r in report.failed}
    assert failed == {r.id for r in report.results if r.id.startswith("op:silu_and_mul[")}
    assert len(failed) == 6  # 3 shapes x 2 dtypes
    assert all(r.message.startswith("op silu_and_mul (from fake-kernels): silu_and_mul:") for r in report.failed)
    text = report.format()
    assert "FAIL  op:silu_and_mul[float32-1x128]" in text
    assert text.splitlines()[-1].startswith("FAILED: ") and f"{len(failed)} failed" in text
    # Everything else still passes: one fault does not hide or fake the others.
    assert report.count("passed") == healthy.count("passed") - len(failed)


@pytest.mark.parametrize(
    ("fault", "failing", "message"),
    [
        ("attention-ignores-out", "op:paged_attention[", "not fully written"),
        ("cache-writes-slot-minus-1", "op:reshape_and_cache[", "reshape_and_cache key_cache"),
        ("rms_norm-raises", "op:rms_norm[", "raised RuntimeError: kernel launch failed"),
        ("memory", "platform:memory", "total_memory() returned 8589934592.0, not an int"),
        ("kv-dtype", "platform:kv-cache[bfloat16", "dtype torch.float32 != requested torch.bfloat16"),
        ("release-memory", "platform:release-unused", "allocator trim failed"),
    ],
)
def test_each_kind_of_fault_is_caught(fault, failing, message):
    # The area at fault, the platform checks, and one op as a control.
    report = check_fake(fault, only=[failing.split("[")[0], "platform:", "op:silu_and_mul"])
    named = [r for r in report.failed if r.id.startswith(failing)]
    assert named, f"{fault} went unnoticed: {[r.id for r in report.failed]}"
    assert all(message in r.message for r in named), named[0].message
    if fault == "kv-dtype":
        # The ops that allocate bfloat16 caches through the platform may fail too.
        assert all("bfloat16" in r.id for r in report.failed)
    else:
        assert len(named) == len(report.failed), [r.id for r in report.failed]


def test_attention_without_gqa_fails_only_the_gqa_cases():
    report = check_fake("attention-no-gqa", only=["op:paged_attention"])
    failed = {r.id for r in report.failed}
    attention = {r.id for r in report.results}
    # With one KV head, h % 1 == h // group: only several KV heads shared by groups tell.
    # The fake takes no sliding_window / soft_cap / sinks / key_ends: those cases are skipped, not failed.
    extras = ("sliding_window", "soft_cap", "sinks", "key_ends")
    windowed = {r.id for r in report.results if any(k in r.id for k in extras)}
    assert windowed and all(r.status == "skipped" for r in report.results if r.id in windowed)
    gqa = {i for i in attention - windowed if "h4kv4" not in i and "kv1" not in i}
    assert failed == gqa and gqa and gqa != attention


def test_an_unknown_platform_is_a_failed_report():
    report = run_conformance("no-such-platform", registry=PlatformRegistry(env={}))
    assert not report.ok and report.results == []
    assert "unknown platform 'no-such-platform'" in report.error
    assert "FAILED: the platform could not be selected" in report.format()


# -- through the command line and pytest, with an installed-looking distribution ----------


def write_dist(site: Path, fault: str | None) -> Path:
    """``fake_plugin.py`` plus the dist-info pip would leave, declaring the entry point."""
    site.mkdir(parents=True, exist_ok=True)
    (site / "fake_plugin.py").write_text(textwrap.dedent(PLUGIN.format(fault=fault)), encoding="utf-8")
    info = site / "fake_platform-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-platform\nVersion: 0.1\n", encoding="utf-8")
    (info / "entry_points.txt").write_text("[pagedserve.platforms]\nfake = fake_plugin\n", encoding="utf-8")
    return site


def run(args: list[str], site: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_") and k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    return subprocess.run([sys.executable, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=600)


def test_cli_check_exits_non_zero_naming_the_wrong_op(tmp_path):
    site = write_dist(tmp_path / "site", "silu_and_mul")
    proc = run(
        [
            "-m",
            "pagedserve.entrypoints.cli",
            "platforms",
            "check",
            "fake",
            "--skip-engine",
            "--failures-only",
            "--only",
            "op:silu_and_mul,platform:memory",
        ],
        site,
        tmp_path,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert any(
        line.startswith("FAIL  op:silu_and_mul[bfloat16-2x3x192]  op silu_and_mul (from fake-kernels)")
        for line in lines
    )
    assert not any(line.startswith("PASS") for line in lines)  # --failures-only
    assert "conformance of platform 'fake' (from fake-platform 0.1)" in lines
    assert (
        "  overridden ops: paged_attention (fake-kernels), reshape_and_cache (fake-kernels), "
        "rms_norm (fake-kernels), silu_and_mul (fake-kernels)"
    ) in lines
    assert lines[-1].startswith("FAILED: 1 passed, 6 failed, 0 skipped")


def test_pytest_run_of_the_kit_fails_naming_the_wrong_op(tmp_path):
    site = write_dist(tmp_path / "site", "silu_and_mul")
    proc = run(
        [
            "-m",
            "pytest",
            "-p",
            "pagedserve.testing.pytest_plugin",
            "--pyargs",
            "pagedserve.testing.conformance",
            "--platform",
            "fake",
            "-k",
            "silu_and_mul or memory",
            "-q",
            "-p",
            "no:cacheprovider",
        ],
        site,
        tmp_path,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAILED" in proc.stdout and "test_conformance[op:silu_and_mul[float32-7x256]]" in proc.stdout
    assert "6 failed, 1 passed" in proc.stdout


# -- a platform with its own KV layout ------------------------------------------------------

LAYOUT_PLUGIN = '''
import torch

from pagedserve.kernels import reference
from pagedserve.platforms import Platform, hookimpl

BROKEN = {broken!r}


class HeadMajorPlatform(Platform):
    """Keeps each layer's cache as [num_blocks, num_kv_heads, block_size, head_size]."""

    name = "head-major"
    supported_dtypes = (torch.float32,)

    @classmethod
    def is_available(cls):
        return True, "host"

    def total_memory(self):
        return 8 * 1024**3

    def free_memory(self):
        return 1024**3

    def kv_cache_shape(self, num_blocks, block_size, num_kv_heads, head_size):
        return (num_blocks, num_kv_heads, block_size, head_size)


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping):
    k, v = key_cache.transpose(1, 2).contiguous(), value_cache.transpose(1, 2).contiguous()
    if BROKEN:  # off by one slot
        slot_mapping = torch.where(slot_mapping >= 0, (slot_mapping + 1) % (k.shape[0] * k.shape[1]), slot_mapping)
    reference.reshape_and_cache(key, value, k, v, slot_mapping)
    key_cache.copy_(k.transpose(1, 2))
    value_cache.copy_(v.transpose(1, 2))


def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, out=None):
    return reference.paged_attention(query, key_cache.transpose(1, 2), value_cache.transpose(1, 2),
                                     block_tables, seq_lens, query_start_loc, scale, out)


@hookimpl
def pagedserve_register_platforms(register):
    register(HeadMajorPlatform)


@hookimpl
def pagedserve_register_ops(platform, ops):
    if isinstance(platform, HeadMajorPlatform):
        ops.register("reshape_and_cache", reshape_and_cache, source="head-major")
        ops.register("paged_attention", paged_attention, source="head-major")
'''


@pytest.mark.parametrize("broken", [False, True])
def test_an_own_kv_layout_is_checked_through_its_own_cache_writes(broken):
    module = types.ModuleType("head_major")
    exec(LAYOUT_PLUGIN.format(broken=broken), module.__dict__)
    reg = PlatformRegistry(env={})
    reg.register_plugin(module, "head-major", "head-major 0.1")
    report = run_conformance("head-major", registry=reg, engine=False)
    statuses = {r.id: r.status for r in report.results}
    assert statuses["platform:kv-cache[float32-bs32]"] == "passed"
    # The cache writes cannot be compared slot by slot with the reference layout...
    assert {s for i, s in statuses.items() if i.startswith("op:reshape_and_cache[")} == {"skipped"}
    attention = [r for r in report.results if r.id.startswith("op:paged_attention[")]
    # This plugin's attention takes no sliding_window / soft_cap / sinks / key_ends: those cases are skipped.
    extras = ("sliding_window", "soft_cap", "sinks", "key_ends")
    attention = [r for r in attention if not any(k in r.id for k in extras)]
    if not broken:
        assert report.ok and {r.status for r in attention} == {"passed"}
    else:  # ...so they are checked by attention reading what they wrote
        assert not report.ok and {r.id for r in report.failed} == {r.id for r in attention}
        assert all("cache written with the platform's reshape_and_cache" in r.message for r in report.failed)
