"""The native-kernel build path (kernels/build.py): flags, cache, fallback, CLI.

Subprocess tests get their own environment (cache directory, compiler) so they can
simulate a missing compiler or a failing build without touching this process.  The
real build is the one the kernel tests use (persistent cache), so it is compiled at
most once per session.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from native_build import native_build_failed

from pagedserve.kernels import build

pytestmark = pytest.mark.timeout(600)

ZEN4 = frozenset("avx avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512_bf16 avx512_vnni".split())
SKYLAKE_SP = frozenset("avx avx2 fma f16c avx512f avx512bw avx512vl avx512dq".split())
HASWELL = frozenset("avx avx2 fma f16c".split())


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **env}
    full_env.pop("PAGEDSERVE_CPU_ISA", None)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=500)


# ---- flags ------------------------------------------------------------------------------


def test_auto_flags_follow_cpu_features():
    assert build.auto_cpu_arch_flags(ZEN4) == [
        "-mavx2",
        "-mfma",
        "-mf16c",
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vl",
        "-mavx512dq",
        "-mavx512bf16",
    ]
    assert "-mavx512bf16" not in build.auto_cpu_arch_flags(SKYLAKE_SP)
    assert "-mavx512f" in build.auto_cpu_arch_flags(SKYLAKE_SP)
    assert build.auto_cpu_arch_flags(HASWELL) == ["-mavx2", "-mfma", "-mf16c"]
    assert build.auto_cpu_arch_flags(frozenset({"sse4_2"})) == []
    assert build.auto_cpu_arch_flags(frozenset()) == []


def test_flags_from_this_cpu_and_env_override():
    flags, origin = build.cpu_arch_flags(env={})
    assert origin == "/proc/cpuinfo"
    assert flags == build.auto_cpu_arch_flags(build.read_cpu_features())
    flags, origin = build.cpu_arch_flags(env={"PAGEDSERVE_CPU_ARCH_FLAGS": "-mavx2 -mfma -mf16c"}, features=ZEN4)
    assert (flags, origin) == (["-mavx2", "-mfma", "-mf16c"], "PAGEDSERVE_CPU_ARCH_FLAGS")
    assert build.cpu_arch_flags(env={"PAGEDSERVE_CPU_ARCH_FLAGS": ""}, features=ZEN4)[0] == []


def test_unsupported_flags_are_reported():
    assert build.unsupported_arch_flags(["-mavx2", "-mavx512f", "-mavx512bf16"], HASWELL) == [
        "-mavx512f",
        "-mavx512bf16",
    ]
    assert build.unsupported_arch_flags(["-mavx2", "-O2"], HASWELL) == []


def test_cache_key_covers_flags_compiler_and_location(tmp_path):
    base = {"PAGEDSERVE_KERNEL_CACHE": str(tmp_path), "CXX": "c++", "PAGEDSERVE_CPU_ARCH_FLAGS": "-mavx2 -mfma"}
    a = build.cpu_build_spec(base)
    assert a.directory.parent == tmp_path and a.directory.name == a.name
    assert build.cpu_build_spec(base) == a  # deterministic
    assert build.cpu_build_spec({**base, "PAGEDSERVE_CPU_ARCH_FLAGS": "-mavx2"}).name != a.name
    assert build.cpu_build_spec({**base, "CXX": "g++-12"}).name != a.name
    assert build.kernel_cache_root({"XDG_CACHE_HOME": "/x"}) == Path("/x/pagedserve/kernels")


def test_one_cache_root_with_the_old_cuda_variable_as_deprecated_alias():
    with pytest.warns(DeprecationWarning, match="PAGEDSERVE_CACHE_DIR is deprecated"):
        assert build.kernel_cache_root({"PAGEDSERVE_CACHE_DIR": "/y"}) == Path("/y/kernels")
    assert build.kernel_cache_root({"PAGEDSERVE_CACHE_DIR": "/y", "PAGEDSERVE_KERNEL_CACHE": "/z"}) == Path("/z")


def test_only_load_extension_compiles():
    """Every native extension is built by build.load_extension (one cache, one lock)."""
    root = Path(build.__file__).resolve().parents[1]
    callers = sorted(
        str(p.relative_to(root))
        for d in ("core", "platforms", "kernels")
        for p in (root / d).rglob("*.py")
        if "cpp_extension.load(" in p.read_text()
    )
    assert callers == ["kernels/build.py"]


def test_quantized_kernels_load_through_load_extension(monkeypatch, tmp_path):
    from pagedserve.kernels.cpu import quant_native

    seen = []

    def fake_load_extension(spec, label="", verbose=False):
        seen.append((spec, label))
        raise build.KernelBuildError("no build in this test")

    monkeypatch.setattr(build, "load_extension", fake_load_extension)
    monkeypatch.setenv("PAGEDSERVE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.delenv("PAGEDSERVE_QUANT_CPU_KERNELS", raising=False)
    quant_native.load_quant_kernels.cache_clear()
    try:
        with pytest.warns(UserWarning, match="no build in this test"):
            assert quant_native.load_quant_kernels() is None
    finally:
        quant_native.load_quant_kernels.cache_clear()
    ((spec, label),) = seen
    assert label == "quantized CPU kernels" and spec.directory.parent == tmp_path
    assert [s.name for s in spec.sources] == [
        "quant_gguf.cpp",
        "quant_gguf_packed.cpp",
        "quant_gguf_kquant.cpp",
        "quant_gguf_kpacked.cpp",
        "quant_gguf_q2k.cpp",
        "quant_gguf_q3k.cpp",
        "quant_gguf_iq4nl.cpp",
        "quant_gguf_iq4xs.cpp",
    ]
    assert spec.cuda_cflags is None


def test_default_target(monkeypatch):
    from pagedserve.platforms.options import target_device

    assert build.default_target(target_device({"PAGEDSERVE_TARGET_DEVICE": "rocm"})) == "rocm"
    with pytest.raises(build.KernelBuildError, match="PAGEDSERVE_TARGET_DEVICE='tpu'; targets: cpu, cuda, rocm"):
        build.default_target(target_device({"PAGEDSERVE_TARGET_DEVICE": "tpu"}))
    import torch

    if not torch.cuda.is_available():
        assert build.default_target(target_device({"PAGEDSERVE_TARGET_DEVICE": "auto"})) == "cpu"
        assert build.default_target(None) == "cpu"


def test_waits_for_a_live_build_and_clears_a_stale_lock(tmp_path):
    import threading

    lock = tmp_path / "lock"
    lock.touch()
    threading.Timer(1.5, lock.unlink).start()  # another process finishing its build
    start = time.perf_counter()
    build._wait_for_other_build(lock)
    assert 1.0 < time.perf_counter() - start < 30
    lock.touch()
    old = time.time() - build.STALE_LOCK_SECONDS - 60  # left by a build killed outright
    os.utime(lock, (old, old))
    build._wait_for_other_build(lock)
    assert not lock.exists()


# ---- the real build ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def built() -> build.BuildReport:
    """The CPU kernels for this machine, compiled (once) into the persistent cache."""
    try:
        return build.load_cpu_extension()[1]
    except build.KernelBuildError as exc:
        native_build_failed("the native CPU kernels", exc)


def test_build_has_the_chosen_instruction_sets(built):
    spec = build.cpu_build_spec()
    assert built.arch_flags == list(spec.arch_flags)
    assert built.isas[-1] == "scalar"
    if "-mavx2" in spec.arch_flags:
        assert "avx2" in built.isas and built.features.get("avx2") and built.features.get("fma")
    if "-mavx512f" in spec.arch_flags:
        assert "avx512" in built.isas
    if "-mavx512bf16" in spec.arch_flags:
        assert built.isas[0] == "avx512bf16" and built.features.get("avx512bf16")


def test_build_uses_torchs_openmp_threads(built):
    """at::parallel_for only spawns threads in files compiled with OpenMP: without it every
    native kernel silently runs on one thread.  Check the flag took effect and that a
    parallel kernel call really runs on more than one OpenMP thread."""
    import torch

    if not torch.backends.openmp.is_available():
        pytest.skip("this torch is built without OpenMP")
    assert built.features.get("openmp"), built.features
    module, _ = build.load_cpu_extension()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert module.parallel_thread_count(64) == 2
        torch.set_num_threads(1)
        assert module.parallel_thread_count(64) == 1
    finally:
        torch.set_num_threads(before)


def test_second_load_reuses_the_cache(built):
    """A fresh process finds the build: no compiler run, no message, same files."""
    spec = build.cpu_build_spec()
    so_mtime = spec.so_path.stat().st_mtime_ns
    start = time.perf_counter()
    proc = run_python(
        "from pagedserve.kernels import build\nm, r = build.load_cpu_extension()\nprint(r.compiled, r.name)\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", spec.name]
    assert "compiling" not in proc.stderr
    assert spec.so_path.stat().st_mtime_ns == so_mtime
    assert time.perf_counter() - start < 60


def test_missing_compiler_falls_back_to_reference_with_warning(tmp_path):
    code = (
        "from pagedserve.platforms import select_platform\n"
        "platform, ops = select_platform('cpu')\n"
        "print(sorted(set(src for _, src in ops.table())))\n"
    )
    proc = run_python(
        code,
        CXX=str(tmp_path / "no-such-c++"),
        PAGEDSERVE_KERNEL_CACHE=str(tmp_path / "cache"),
        PAGEDSERVE_TARGET_DEVICE="cpu",
    )
    assert proc.returncode == 0, proc.stderr
    # No native kernel: the references, and what torch itself provides (quantized ops,
    # oneDNN-packed dense weights, or the measured choice among torch's own linears).
    allowed = {"reference", "torch", "onednn-prepack", "cpu-tuned(onednn,torch)"}
    assert set(eval(proc.stdout.strip())) <= allowed, proc.stdout
    assert "no C++ compiler" in proc.stderr and "using the torch reference kernels" in proc.stderr
    assert not list((tmp_path / "cache").glob("*/*.so"))


def test_failing_build_falls_back_with_the_compiler_error(tmp_path):
    proc = run_python(
        "from pagedserve.kernels.cpu import load_cpu_kernels\nprint(load_cpu_kernels())\n",
        PAGEDSERVE_CPU_ARCH_FLAGS="-mno-such-option",
        PAGEDSERVE_KERNEL_CACHE=str(tmp_path),
        MAX_JOBS="2",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "None"
    assert "failed" in proc.stderr and "no-such-option" in proc.stderr
    assert "using the torch reference kernels" in proc.stderr


def test_import_builds_nothing(tmp_path):
    proc = run_python(
        "import pagedserve, pagedserve.kernels.cpu, pagedserve.kernels.build, pagedserve.platforms\n"
        "from pagedserve.platforms import discover\n"
        "discover()\n",
        PAGEDSERVE_KERNEL_CACHE=str(tmp_path),
        CXX=str(tmp_path / "no-such-c++"),
    )
    assert proc.returncode == 0, proc.stderr
    assert "compiling" not in proc.stderr and "unavailable" not in proc.stderr
    assert not any(tmp_path.iterdir())


def test_disabled_kernels_are_not_built(tmp_path):
    proc = run_python(
        "from pagedserve.platforms import select_platform\n"
        "print(select_platform('cpu')[1].source('paged_attention'))\n",
        PAGEDSERVE_CPU_KERNELS="0",
        PAGEDSERVE_KERNEL_CACHE=str(tmp_path),
        PAGEDSERVE_TARGET_DEVICE="cpu",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "reference" and "unavailable" not in proc.stderr
    assert not any(tmp_path.iterdir())


# ---- CLI ---------------------------------------------------------------------------------


def test_cli_build_kernels_cpu(built, capsys):
    from pagedserve.entrypoints.cli import main

    assert main(["build-kernels", "--target", "cpu", "--verbose"]) == 0
    out, err = capsys.readouterr()
    assert built.name in out and "loaded from cache" in out
    assert "CPU arch flags" in err and "kernels compiled for" in err


def test_cli_build_kernels_gpu_target_without_gpu_torch(capsys):
    import torch

    if torch.version.cuda:
        pytest.skip("this torch is a CUDA build")
    from pagedserve.entrypoints.cli import main

    assert main(["build-kernels", "--target", "cuda"]) == 1
    assert "needs a CUDA build of torch" in capsys.readouterr().err


# -- a failed native build fails the suite (tests/native_build.py) ----------------------------
def _broken_spec() -> build.ExtensionSpec:
    return build.ExtensionSpec(
        name="probe",
        directory=Path("/nonexistent"),
        sources=(),
        cflags=(),
        arch_flags=(),
        arch_origin="t",
        compiler="cc",
    )


def _failing_load(spec, label, verbose=False):
    raise build.KernelBuildError("e1")


def test_no_compiler_is_declared_only_by_the_setting():
    assert build.no_compiler_declared({"PAGEDSERVE_NO_COMPILER": "1"})
    assert not build.no_compiler_declared({})
    assert not build.no_compiler_declared({"PAGEDSERVE_NO_COMPILER": "0"})


def test_a_failed_build_fails_the_test_unless_no_compiler_is_declared(monkeypatch):
    from native_build import native_build_failed, require_native

    monkeypatch.delenv("PAGEDSERVE_NO_COMPILER", raising=False)
    with pytest.raises(pytest.fail.Exception, match="did not build: boom"):
        native_build_failed("the X kernel", "boom")
    broken = _broken_spec()
    monkeypatch.setattr(build, "load_extension", _failing_load)
    with pytest.raises(pytest.fail.Exception, match="the Y kernel did not build: e1"):
        require_native(lambda: None, lambda: broken, "the Y kernel")

    def warning_loader():
        import warnings

        warnings.warn("Z kernel unavailable (lora.cpp:3: error: nope)", stacklevel=1)

    with pytest.raises(pytest.fail.Exception, match="lora.cpp:3: error: nope"):
        require_native(warning_loader, lambda: broken, "the Z kernel")
    monkeypatch.setenv("PAGEDSERVE_NO_COMPILER", "1")
    with pytest.raises(pytest.skip.Exception, match="PAGEDSERVE_NO_COMPILER=1"):
        require_native(lambda: None, lambda: broken, "the Y kernel")


def test_build_kernels_all_builds_every_applicable_extension(monkeypatch, capsys):
    """--all: each CPU_EXTENSIONS entry is built (here: loaded from the cache), one that
    says it does not apply to this CPU is left out, and a failed build raises."""
    import sys
    import types

    fake = types.ModuleType("fake_amx_native")
    fake.applicable = lambda: False
    fake.spec = lambda: pytest.fail("an inapplicable extension must not be built")
    monkeypatch.setitem(sys.modules, "fake_amx_native", fake)
    monkeypatch.setattr(build, "CPU_EXTENSIONS", (*build.CPU_EXTENSIONS, ("fake_amx_native", "spec", "AMX test")))
    try:
        build.build_kernels("cpu", every=True)
    except build.KernelBuildError as exc:
        native_build_failed("a native CPU extension", exc)
    err = capsys.readouterr().err
    for modname, _, label in build.CPU_EXTENSIONS[:-1]:
        if getattr(importlib.import_module(modname), "applicable", lambda: True)():
            assert f"{label}: c" in err, err  # compiled or cached
        else:  # the AMX extensions on a CPU without AMX tiles
            assert f"{label}: not applicable to this CPU, not built" in err, err
    assert "AMX test: not applicable to this CPU, not built" in err

    fake.applicable = lambda: True
    fake.spec = _broken_spec
    monkeypatch.setattr(build, "CPU_EXTENSIONS", (("fake_amx_native", "spec", "AMX test"),))
    monkeypatch.setattr(build, "load_extension", _failing_load)
    with pytest.raises(build.KernelBuildError, match="e1"):
        build.build_kernels("cpu", every=True)
