"""The one build path for every compiled kernel of pagedserve.

Targets:
    cpu    the C++ kernels in ``kernels/cpu`` (torch cpp_extension, ninja), built ahead
           of time by ``pagedserve build-kernels`` or just in time on first use.
    cuda   ``kernels/cuda/build.py:build_cuda_extension(verbose)``, imported only then.
    rocm   the same function under a ROCm build of torch (torch hipifies the sources).

Every native extension (the CPU kernels, the quantized CPU kernels of
``kernels/cpu/quant_native.py``, the CUDA/ROCm kernels) is built and loaded by
:func:`load_extension`, which waits for another process building the same key.  Both
ways of building the CPU kernels write to one persistent cache,
``<root>/pagedserve_cpu_<key>/``, where the key hashes the sources, the compiler
flags, the compiler, torch's and Python's versions, so a stale build is never loaded
and an unchanged one is never rebuilt.  Importing pagedserve builds nothing.

Environment:
    PAGEDSERVE_TARGET_DEVICE   default target of ``pagedserve build-kernels`` (read by
                               the command, passed to :func:`default_target`).
    MAX_JOBS                   parallel compile jobs (read by torch's ninja build).
    PAGEDSERVE_CPU_ARCH_FLAGS  compiler flags replacing those chosen from
                               /proc/cpuinfo, e.g. "-mavx2 -mfma -mf16c"; "" builds
                               only the portable kernels.
    PAGEDSERVE_KERNEL_CACHE    cache root of every native build (default
                               ~/.cache/pagedserve/kernels); PAGEDSERVE_CACHE_DIR is
                               a deprecated alias (its ``kernels`` subfolder).
    CXX                        the C++ compiler (default ``c++``), as for torch.
    PAGEDSERVE_NO_COMPILER     "1" declares a machine without a C++ compiler: the
                               test suite then skips the native-kernel tests instead
                               of failing them when a build fails (no_compiler_declared).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import json
import os
import platform
import re
import shlex
import shutil
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = [
    "TARGETS",
    "KernelBuildError",
    "BuildReport",
    "ExtensionSpec",
    "toolchain_available",
    "cpu_extension_spec",
    "read_cpu_features",
    "auto_cpu_arch_flags",
    "cpu_arch_flags",
    "unsupported_arch_flags",
    "kernel_cache_root",
    "cpu_build_spec",
    "load_extension",
    "load_cpu_extension",
    "default_target",
    "build_kernels",
    "CPU_EXTENSIONS",
    "no_compiler_declared",
]

TARGETS: tuple[str, ...] = ("cpu", "cuda", "rocm")

CPU_DIR = Path(__file__).resolve().parent / "cpu"
CPU_SOURCES: tuple[str, ...] = ("bindings.cpp", "isa_avx512.cpp", "isa_avx2.cpp", "isa_scalar.cpp")
CPU_HEADERS: tuple[str, ...] = ("kernels.h", "vec.h", "attention.h", "attention_plan.h", "elementwise.h", "linear.h")
# Hidden visibility: two builds loaded in one process (say a stale and a fresh one)
# must not bind to each other's kernel symbols.
# -fopenmp: at::parallel_for is a header template that only spawns threads when the
# including file is compiled with OpenMP; without it every native kernel runs on one
# thread.  No -lgomp is linked: the runtime already loaded by torch (same soname) serves.
BASE_CFLAGS: tuple[str, ...] = ("-O3", "-DNDEBUG", "-fvisibility=hidden", "-fopenmp")

STALE_LOCK_SECONDS = 900

# Compiler flag -> the /proc/cpuinfo feature it needs at run time.
ARCH_FLAG_FEATURES: dict[str, str] = {
    "-mavx2": "avx2",
    "-mfma": "fma",
    "-mf16c": "f16c",
    "-mavx512f": "avx512f",
    "-mavx512bw": "avx512bw",
    "-mavx512vl": "avx512vl",
    "-mavx512dq": "avx512dq",
    "-mavx512bf16": "avx512_bf16",
    "-mavx512vnni": "avx512_vnni",
}


#: The CPU extensions besides the main kernels, built by ``build_kernels(every=True)``:
#: (module, function returning its ExtensionSpec, label).  Named rather than imported
#: (each of these modules imports this one).  A module may define ``applicable()``
#: (False: not built on this CPU, e.g. an instruction set it lacks).
CPU_EXTENSIONS: tuple[tuple[str, str, str], ...] = (
    ("pagedserve.kernels.cpu.quant_native", "quant_build_spec", "quantized CPU kernels"),
    ("pagedserve.kernels.cpu.spec_native", "spec_build_spec", "speculative-decoding CPU kernel"),
    ("pagedserve.kernels.cpu.lora_native", "lora_build_spec", "LoRA CPU kernel"),
    ("pagedserve.kernels.cpu.moe_native", "moe_build_spec", "MoE CPU kernel"),
    ("pagedserve.kernels.cpu.recurrent_native", "recurrent_build_spec", "recurrent-layer CPU kernels"),
    ("pagedserve.kernels.cpu.attention_amx", "amx_build_spec", "AMX attention CPU kernel"),
    ("pagedserve.kernels.cpu.prefill_attn", "bf16_prefill_build_spec", "AVX-512 BF16 prefill attention CPU kernel"),
    ("pagedserve.kernels.cpu.quant_gguf_amx", "gguf_amx_build_spec", "AMX int8 GGUF CPU kernel"),
)


def no_compiler_declared(env: Mapping[str, str] | None = None) -> bool:
    """Whether PAGEDSERVE_NO_COMPILER=1 says this machine has no C++ compiler, so that a
    failed native build is expected (the tests skip) rather than a defect (they fail)."""
    return (os.environ if env is None else env).get("PAGEDSERVE_NO_COMPILER", "").strip() == "1"


class KernelBuildError(RuntimeError):
    """A native kernel could not be built or loaded; the message says why."""


@dataclass
class BuildReport:
    """What a build or load did, for messages and `pagedserve build-kernels`."""

    target: str
    name: str
    path: str
    compiled: bool  # False: loaded from the cache without compiling
    seconds: float
    arch_flags: list[str] = field(default_factory=list)
    arch_origin: str = ""
    isas: list[str] = field(default_factory=list)
    features: dict[str, bool] = field(default_factory=dict)

    def summary(self) -> str:
        how = f"compiled in {self.seconds:.1f}s" if self.compiled else "loaded from cache"
        isas = ", ".join(self.isas) or "?"
        return f"{self.target} kernels {self.name}: {how}; instruction sets {isas}; {self.path}"


def read_cpu_features(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU feature flags of /proc/cpuinfo (empty where it cannot be read)."""
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def auto_cpu_arch_flags(features: frozenset[str]) -> list[str]:
    """The -m flags for the best instruction sets ``features`` supports.

    AVX2 needs FMA and F16C next to it (every AVX2 CPU has both); AVX-512 needs the
    F/BW/VL/DQ subsets (Skylake-SP onwards, Zen 4); BF16 dot products are optional.
    """
    flags: list[str] = []
    if {"avx2", "fma", "f16c"} <= features:
        flags += ["-mavx2", "-mfma", "-mf16c"]
        if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= features:
            flags += ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
            if "avx512_bf16" in features:
                flags.append("-mavx512bf16")
    return flags


def cpu_arch_flags(
    env: Mapping[str, str] | None = None, features: frozenset[str] | None = None
) -> tuple[list[str], str]:
    """(flags, where they came from): PAGEDSERVE_CPU_ARCH_FLAGS if set, else /proc/cpuinfo."""
    env = os.environ if env is None else env
    raw = env.get("PAGEDSERVE_CPU_ARCH_FLAGS")
    if raw is not None:
        return shlex.split(raw), "PAGEDSERVE_CPU_ARCH_FLAGS"
    return auto_cpu_arch_flags(read_cpu_features() if features is None else features), "/proc/cpuinfo"


def unsupported_arch_flags(flags: list[str], features: frozenset[str]) -> list[str]:
    """Flags whose instructions this CPU lacks (a build with them could crash here)."""
    if not features:  # no /proc/cpuinfo: nothing to check against
        return []
    return [f for f in flags if f in ARCH_FLAG_FEATURES and ARCH_FLAG_FEATURES[f] not in features]


def kernel_cache_root(env: Mapping[str, str] | None = None) -> Path:
    """PAGEDSERVE_KERNEL_CACHE, else $XDG_CACHE_HOME/pagedserve/kernels, else ~/.cache/...

    The one cache root of every native build.  PAGEDSERVE_CACHE_DIR (once the CUDA
    build's own root, with builds under ``<root>/kernels``) is a deprecated alias.
    """
    env = os.environ if env is None else env
    if env.get("PAGEDSERVE_KERNEL_CACHE"):
        return Path(env["PAGEDSERVE_KERNEL_CACHE"]).expanduser()
    if env.get("PAGEDSERVE_CACHE_DIR"):
        warnings.warn(
            "PAGEDSERVE_CACHE_DIR is deprecated: set PAGEDSERVE_KERNEL_CACHE "
            "(the kernel cache root itself, i.e. $PAGEDSERVE_CACHE_DIR/kernels)",
            DeprecationWarning,
            stacklevel=2,
        )
        return Path(env["PAGEDSERVE_CACHE_DIR"]).expanduser() / "kernels"
    base = Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return base / "pagedserve" / "kernels"


@dataclass(frozen=True)
class ExtensionSpec:
    """Everything that determines one build of a native extension (the CPU kernels, the
    quantized CPU kernels, the CUDA/ROCm kernels): each goes through :func:`load_extension`."""

    name: str  # python module name, unique per key
    directory: Path
    sources: tuple[Path, ...]
    cflags: tuple[str, ...]
    arch_flags: tuple[str, ...]
    arch_origin: str
    compiler: str
    include_dirs: tuple[Path, ...] = (CPU_DIR,)
    #: nvcc flags of a CUDA extension (torch hipifies them under ROCm); None: C++ only.
    cuda_cflags: tuple[str, ...] | None = None

    @property
    def so_path(self) -> Path:
        return self.directory / f"{self.name}.so"

    @property
    def stamp_path(self) -> Path:
        return self.directory / "build.json"


def cpu_build_spec(env: Mapping[str, str] | None = None) -> ExtensionSpec:
    """The build of the CPU kernels for this machine and environment."""
    import torch

    env = os.environ if env is None else env
    arch, origin = cpu_arch_flags(env)
    cflags = (*BASE_CFLAGS, *arch)
    compiler = env.get("CXX", "c++")
    digest = hashlib.sha256()
    for name in (*CPU_SOURCES, *CPU_HEADERS):
        digest.update(name.encode())
        digest.update((CPU_DIR / name).read_bytes())
    digest.update(json.dumps([cflags, compiler, torch.__version__, sys.version_info[:2], platform.machine()]).encode())
    name = f"pagedserve_cpu_{digest.hexdigest()[:16]}"
    return ExtensionSpec(
        name=name,
        directory=kernel_cache_root(env) / name,
        sources=tuple(CPU_DIR / s for s in CPU_SOURCES),
        cflags=cflags,
        arch_flags=tuple(arch),
        arch_origin=origin,
        compiler=compiler,
    )


def _log(msg: str) -> None:
    print(f"pagedserve: {msg}", file=sys.stderr, flush=True)


def cpu_extension_spec(
    prefix: str,
    sources: Sequence[str],
    arch_flags: Sequence[str] = (),
    arch_origin: str = "portable",
    headers: Sequence[str] = (),
) -> ExtensionSpec:
    """The build of a small CPU extension besides the main kernels (quantized GEMM,
    LoRA, rejection sampling): ``pagedserve_<prefix>_<hash>`` from ``sources`` (file
    names in kernels/cpu/), keyed by their text, the flags, the compiler, torch and
    Python, into the shared kernel cache.  Each is its own extension, so that building
    it never invalidates the main kernels' build.  ``headers`` (kernels/cpu/ file names
    the sources include) join the key without being compiled."""
    import torch

    cflags = (*BASE_CFLAGS, *arch_flags)
    compiler = os.environ.get("CXX", "c++")
    digest = hashlib.sha256()
    for name in (*sources, *headers):
        digest.update(name.encode())
        digest.update((CPU_DIR / name).read_bytes())
    digest.update(json.dumps([cflags, compiler, torch.__version__, sys.version_info[:2], platform.machine()]).encode())
    name = f"pagedserve_{prefix}_{digest.hexdigest()[:16]}"
    return ExtensionSpec(
        name=name,
        directory=kernel_cache_root() / name,
        sources=tuple(CPU_DIR / s for s in sources),
        cflags=cflags,
        arch_flags=tuple(arch_flags),
        arch_origin=arch_origin,
        compiler=compiler,
    )


def toolchain_available(compiler: str | None = None) -> bool:
    """Whether native extensions can be built here (the C++ compiler of ``CXX`` and
    ninja), for ops that build theirs on first use and so must know at registration."""
    compiler = compiler if compiler is not None else os.environ.get("CXX", "c++")
    try:
        _check_toolchain(
            ExtensionSpec(
                name="probe",
                directory=Path("."),
                sources=(),
                cflags=(),
                arch_flags=(),
                arch_origin="probe",
                compiler=compiler,
            )
        )
    except KernelBuildError:
        return False
    return True


def _check_toolchain(spec: ExtensionSpec) -> None:
    if shutil.which(shlex.split(spec.compiler)[0] if spec.compiler.strip() else "") is None:
        raise KernelBuildError(f"no C++ compiler: {spec.compiler!r} (from CXX, default c++) was not found")
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        raise KernelBuildError("ninja was not found (pip install ninja)")


def _first_error(text: str) -> str:
    """The first compiler error line of a failed build (else its last line)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in lines:
        if re.search(r"\berror\b", ln, re.IGNORECASE) and "Error building extension" not in ln:
            return ln[:300]
    return (lines[-1] if lines else text)[:300]


def _wait_for_other_build(lock: Path) -> None:
    """Wait while another process builds into the same directory.

    torch serialises concurrent builds with this lock file but waits for it forever,
    and a build killed outright leaves it behind; past STALE_LOCK_SECONDS (far longer
    than any build) the lock is taken to be such a leftover and removed.
    """
    announced = False
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > STALE_LOCK_SECONDS:
            _log(f"removing stale build lock {lock}")
            lock.unlink(missing_ok=True)
            return
        if not announced:
            _log(f"waiting for another process building into {lock.parent}")
            announced = True
        time.sleep(1.0)


def _compile(spec: ExtensionSpec, verbose: bool) -> ModuleType:
    from torch.utils import cpp_extension

    spec.directory.mkdir(parents=True, exist_ok=True)
    try:
        cuda: dict[str, Any] = {}
        if spec.cuda_cflags is not None:
            cuda = {"extra_cuda_cflags": list(spec.cuda_cflags), "with_cuda": True}
        return cpp_extension.load(
            name=spec.name,
            sources=[str(s) for s in spec.sources],
            extra_cflags=list(spec.cflags),
            extra_include_paths=[str(d) for d in spec.include_dirs],
            build_directory=str(spec.directory),
            verbose=verbose,
            **cuda,
        )
    except Exception as exc:  # compiler errors arrive as RuntimeError/CalledProcessError
        raise KernelBuildError(f"building {spec.name} failed: {_first_error(str(exc))}") from exc


def _import_built(spec: ExtensionSpec) -> ModuleType:
    if spec.name in sys.modules:
        return sys.modules[spec.name]
    import torch  # noqa: F401  (the extension links against torch's libraries)

    module_spec = importlib.util.spec_from_file_location(spec.name, spec.so_path)
    if module_spec is None or module_spec.loader is None:
        raise KernelBuildError(f"cannot import {spec.so_path}")
    try:
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    except ImportError as exc:
        raise KernelBuildError(f"cannot load {spec.so_path}: {exc}") from exc
    sys.modules[spec.name] = module
    return module


def _is_built(spec: ExtensionSpec) -> bool:
    return spec.so_path.is_file() and spec.stamp_path.is_file()


def _report(spec: ExtensionSpec, module: ModuleType, compiled: bool, seconds: float) -> BuildReport:
    return BuildReport(
        target="cpu",
        name=spec.name,
        path=str(spec.directory),
        compiled=compiled,
        seconds=seconds,
        arch_flags=list(spec.arch_flags),
        arch_origin=spec.arch_origin,
        isas=list(module.compiled_isas()),
        features=dict(module.build_features()),
    )


def _log_verbose(spec: ExtensionSpec, report: BuildReport | None = None) -> None:
    if report is None:
        flags = " ".join(spec.arch_flags) or "(none: portable kernels only)"
        _log(
            f"CPU arch flags {flags} (from {spec.arch_origin}); compiler {spec.compiler}; "
            f"MAX_JOBS={os.environ.get('MAX_JOBS', 'unset (ninja default)')}; cache {spec.directory}"
        )
        return
    on = ", ".join(k for k, v in sorted(report.features.items()) if v) or "none"
    _log(f"compiler features in effect: {on}; kernels compiled for: {', '.join(report.isas)}")


def load_cpu_extension(verbose: bool = False, rebuild: bool = False) -> tuple[ModuleType, BuildReport]:
    """Load the CPU kernels, compiling them first unless the cache has this build.

    Raises KernelBuildError (with the reason) when there is no compiler, the build
    fails, or the requested arch flags name instructions this CPU lacks.
    """
    spec = cpu_build_spec()
    bad = unsupported_arch_flags(list(spec.arch_flags), read_cpu_features())
    if bad:
        raise KernelBuildError(f"this CPU lacks the instructions of {' '.join(bad)} (from {spec.arch_origin})")
    if verbose:
        _log_verbose(spec)
    if rebuild:  # ninja would keep up-to-date objects: start from an empty directory
        _cached_load.cache_clear()
        shutil.rmtree(spec.directory, ignore_errors=True)
    result = _cached_load(spec, verbose)
    if isinstance(result, KernelBuildError):
        raise KernelBuildError(str(result)) from result
    module, report = result
    if verbose:
        _log_verbose(spec, report)
    return module, report


@functools.cache
def _cached_load(spec: ExtensionSpec, verbose: bool) -> tuple[ModuleType, BuildReport] | KernelBuildError:
    # One attempt per process and build: a failed compile is remembered rather than
    # retried (for minutes) on every platform selection.
    try:
        return _load_or_compile(spec, verbose)
    except KernelBuildError as exc:
        return exc


def load_extension(
    spec: ExtensionSpec, label: str = "native CPU kernels", verbose: bool = False
) -> tuple[ModuleType, bool, float]:
    """Import the build ``spec`` from the cache, compiling it first if it is not there.

    Returns (module, compiled, seconds).  While compiling, one line on stderr says
    so.  Raises KernelBuildError when there is no toolchain or the build fails.  Other
    extensions (e.g. the quantized kernels) reuse this with their own spec.
    """
    start = time.perf_counter()
    if _is_built(spec):
        return _import_built(spec), False, time.perf_counter() - start
    _check_toolchain(spec)
    _wait_for_other_build(spec.directory / "lock")
    if _is_built(spec):  # the other process has just finished it
        return _import_built(spec), False, time.perf_counter() - start
    flags = " ".join(spec.arch_flags) or "portable"
    _log(f"compiling {label} ({flags}) into {spec.directory}; this takes a minute or two, once per machine and version")
    module = _compile(spec, verbose)
    seconds = time.perf_counter() - start
    stamp = {
        "name": spec.name,
        "cflags": list(spec.cflags),
        "compiler": spec.compiler,
        "seconds": round(seconds, 1),
        "built": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    spec.stamp_path.write_text(json.dumps(stamp, indent=1))
    return module, True, seconds


def _load_or_compile(spec: ExtensionSpec, verbose: bool) -> tuple[ModuleType, BuildReport]:
    module, compiled, seconds = load_extension(spec, "native CPU kernels", verbose)
    return module, _report(spec, module, compiled, seconds)


def default_target(requested: str | None = None) -> str:
    """``requested`` (the platform PAGEDSERVE_TARGET_DEVICE names, which the build
    command resolves with pagedserve.platforms.options.target_device) if given; else
    rocm/cuda when torch is built for one and sees a device; else cpu."""
    if requested:
        if requested not in TARGETS:
            raise KernelBuildError(
                f"nothing to build for PAGEDSERVE_TARGET_DEVICE={requested!r}; targets: {', '.join(TARGETS)}"
            )
        return requested
    import torch

    if getattr(torch.version, "hip", None) and torch.cuda.is_available():
        return "rocm"
    if torch.version.cuda and torch.cuda.is_available():
        return "cuda"
    return "cpu"


def _build_gpu(target: str, verbose: bool) -> Any:
    import torch

    if target == "rocm" and not getattr(torch.version, "hip", None):
        raise KernelBuildError(f"target rocm needs a ROCm build of torch (this is {torch.__version__})")
    if target == "cuda" and not torch.version.cuda:
        raise KernelBuildError(f"target cuda needs a CUDA build of torch (this is {torch.__version__})")
    modname = "pagedserve.kernels.cuda.build"
    try:
        mod = importlib.import_module(modname)
    except ModuleNotFoundError as exc:
        if exc.name != modname:
            raise
        raise KernelBuildError(f"{target} kernels have no build script ({modname} is missing)") from exc
    build = getattr(mod, "build_cuda_extension", None)
    if build is None:
        raise KernelBuildError(f"{modname} defines no build_cuda_extension(verbose)")
    try:
        return build(verbose)
    except KernelBuildError:
        raise
    except Exception as exc:  # compiler failures arrive as RuntimeError/CalledProcessError
        raise KernelBuildError(f"building the {target} kernels failed: {_first_error(str(exc))}") from exc


def build_kernels(
    target: str | None = None, verbose: bool = False, force: bool = False, every: bool = False
) -> BuildReport | Any:
    """Compile the kernels of ``target`` ahead of time (default: default_target()).

    For cpu this fills the same cache the first use would, so later loads only
    import; ``force`` rebuilds the main kernels even when the cache is current; ``every``
    also builds each of CPU_EXTENSIONS that applies to this CPU.
    """
    target = target or default_target()
    if target not in TARGETS:
        raise KernelBuildError(f"unknown target {target!r}; targets: {', '.join(TARGETS)}")
    if target == "cpu":
        report = load_cpu_extension(verbose=verbose, rebuild=force)[1]
        if every:
            _build_cpu_extensions(verbose)
        return report
    return _build_gpu(target, verbose)


def _build_cpu_extensions(verbose: bool) -> None:
    """Build every CPU_EXTENSIONS entry this CPU can run; KernelBuildError on a failure."""
    for modname, spec_fn, label in CPU_EXTENSIONS:
        mod = importlib.import_module(modname)
        if not getattr(mod, "applicable", lambda: True)():
            _log(f"{label}: not applicable to this CPU, not built")
            continue
        spec = getattr(mod, spec_fn)()
        bad = unsupported_arch_flags(list(spec.arch_flags), read_cpu_features())
        if bad:
            _log(f"{label}: this CPU lacks {' '.join(bad)}, not built")
            continue
        _, compiled, seconds = load_extension(spec, label, verbose)
        _log(f"{label}: {'compiled' if compiled else 'cached'} ({seconds:.1f} s) {spec.so_path}")
