"""The CUDA C++ kernels: nvcc compiles, a syntax check of the torch binding, the build
helper's cache key, and (on a GPU) every kernel against kernels/reference.py.

The compile jobs start together in one module fixture so that they share the
machine's cores instead of queueing one after another.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch

from pagedserve.kernels import reference
from pagedserve.kernels.cuda import build

CUDA_DIR = build.SOURCE_DIR
CU_FILES = sorted(p.name for p in CUDA_DIR.glob("*.cu"))
ARCHS = ("sm_80", "sm_90")
NVCC = shutil.which("nvcc") or (
    str(Path(os.environ["CUDA_HOME"]) / "bin" / "nvcc") if os.environ.get("CUDA_HOME") else None
)
GPU = torch.cuda.is_available() and bool(torch.version.cuda)


def _cuda_include_dir() -> Path | None:
    candidates = [Path(os.environ[v]) / "include" for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    if NVCC is not None:
        candidates.append(Path(NVCC).resolve().parent.parent / "include")
    candidates.append(Path("/usr/local/cuda/include"))
    return next((inc for inc in candidates if (inc / "cuda_runtime.h").exists()), None)


def _binding_syntax_command(stub_dir: Path) -> list[str] | None:
    """g++ -fsyntax-only over binding.cpp against this torch's headers, or None."""
    cxx = shutil.which("g++") or shutil.which("c++")
    torch_inc = Path(torch.__file__).parent / "include"
    cuda_inc = _cuda_include_dir()
    if cxx is None or cuda_inc is None or not (torch_inc / "c10" / "cuda" / "CUDAGuard.h").exists():
        return None
    # CPU wheels ship torch's CUDA headers but not this one generated header.
    macros = stub_dir / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    if not (torch_inc / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").exists():
        macros.parent.mkdir(parents=True, exist_ok=True)
        macros.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    return [
        cxx,
        "-fsyntax-only",
        "-std=c++17",
        "-Wall",
        "-Wextra",
        "-Werror",
        f"-I{stub_dir}",
        f"-I{CUDA_DIR}",
        "-isystem",
        str(torch_inc),
        "-isystem",
        str(torch_inc / "torch" / "csrc" / "api" / "include"),
        "-isystem",
        str(cuda_inc),
        "-isystem",
        sysconfig.get_paths()["include"],
        "-DTORCH_EXTENSION_NAME=pagedserve_cuda_kernels",
        str(CUDA_DIR / "binding.cpp"),
    ]


@pytest.fixture(scope="module")
def cuda_compile_jobs(tmp_path_factory) -> dict[str, subprocess.Popen | str]:
    """Start every compile at once; values are running processes or a skip reason."""
    out = tmp_path_factory.mktemp("nvcc")
    jobs: dict[str, subprocess.Popen | str] = {}
    for cu in CU_FILES:
        for arch in ARCHS:
            key = f"{cu}:{arch}"
            if NVCC is None:
                jobs[key] = "nvcc not found (install the CUDA toolkit or set CUDA_HOME)"
                continue
            cmd = [
                NVCC,
                "-c",
                str(CUDA_DIR / cu),
                f"-arch={arch}",
                "-std=c++17",
                "-O3",
                "-Xptxas",
                "-v",
                "-Werror",
                "all-warnings",
                "-o",
                str(out / f"{cu}.{arch}.o"),
            ]
            jobs[key] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    cmd = _binding_syntax_command(out / "stub")
    if cmd is None:
        jobs["binding"] = "needs g++, torch's c10/cuda headers and the CUDA toolkit headers"
    else:
        jobs["binding"] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    yield jobs
    for job in jobs.values():
        if isinstance(job, subprocess.Popen) and job.poll() is None:
            job.kill()
            job.wait()


def _wait(jobs, key) -> str:
    job = jobs[key]
    if isinstance(job, str):
        pytest.skip(job)
    output, _ = job.communicate(timeout=600)
    assert job.returncode == 0, f"{' '.join(job.args)}\n{output[-6000:]}"
    return output


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("cu", CU_FILES)
def test_cu_compiles_with_nvcc(cu, arch, cuda_compile_jobs):
    output = _wait(cuda_compile_jobs, f"{cu}:{arch}")
    # Register spills turn a bandwidth-bound kernel into a local-memory-bound one.
    spills = [line for line in output.splitlines() if re.search(r"[1-9]\d* bytes spill (stores|loads)", line)]
    assert not spills, "\n".join(spills)


def test_binding_cpp_syntax(cuda_compile_jobs):
    _wait(cuda_compile_jobs, "binding")


def test_cu_files_do_not_include_torch():
    for path in [*CUDA_DIR.glob("*.cu"), *CUDA_DIR.glob("*.cuh"), *CUDA_DIR.glob("*.h")]:
        includes = re.findall(r'#include\s*[<"]([^>"]+)[>"]', path.read_text())
        bad = [i for i in includes if i.split("/")[0] in ("torch", "ATen", "c10", "pybind11")]
        assert not bad, f"{path.name} includes {bad}: the kernels must build with nvcc alone"


def test_sources_listed_for_the_build():
    on_disk = {p.name for p in CUDA_DIR.iterdir() if p.suffix in (".cu", ".cpp")}
    assert on_disk == set(build.SOURCES)
    assert {p.name for p in CUDA_DIR.iterdir() if p.suffix in (".h", ".cuh")} == set(build.HEADERS)


def test_build_directory_honours_env(monkeypatch, tmp_path):
    monkeypatch.delenv("PAGEDSERVE_CACHE_DIR", raising=False)
    monkeypatch.setenv("PAGEDSERVE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")
    d = build.build_directory()
    assert d.parent == tmp_path / "cuda"
    assert "sm80-90pPTX" in d.name
    spec = build.cuda_build_spec()
    assert spec.directory == d and spec.name.isidentifier() and spec.cuda_cflags
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    assert build.build_directory() != d
    assert build.cuda_build_spec().name != spec.name  # another build, another module name
    # The CUDA build's old root variable still works, with a warning; builds go where they went.
    monkeypatch.delenv("PAGEDSERVE_KERNEL_CACHE")
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "old"))
    with pytest.warns(DeprecationWarning, match="PAGEDSERVE_KERNEL_CACHE"):
        assert build.build_directory().parent == tmp_path / "old" / "kernels" / "cuda"


@pytest.mark.skipif(bool(torch.version.cuda), reason="checks the message on a torch without CUDA")
def test_build_refuses_cpu_torch():
    with pytest.raises(RuntimeError, match="CUDA build of torch"):
        build.build_cuda_extension(verbose=False)


# ---- real GPU checks (skipped without one) ---------------------------------------


@pytest.fixture(scope="module")
def cuda_ext():
    if not GPU:
        pytest.skip("needs a CUDA GPU and a CUDA build of torch")
    return build.load_cuda_extension()


TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _random_batch(seqs, num_kv_heads, group, head_size, block_size, dtype, gen):
    blocks = [-(-ctx // block_size) for _, ctx in seqs]
    num_blocks = sum(blocks) + 2
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    kc = torch.randn(shape, generator=gen).to(dtype)
    vc = torch.randn(shape, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    bt = torch.zeros(len(seqs), max(blocks), dtype=torch.int32)
    for i, n in enumerate(blocks):
        bt[i, :n] = torch.tensor([perm.pop() for _ in range(n)])
    q_lens = [q for q, _ in seqs]
    q = torch.randn(sum(q_lens), num_kv_heads * group, head_size, generator=gen).to(dtype)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    sl = torch.tensor([c for _, c in seqs], dtype=torch.int32)
    return [t.cuda() for t in (q, kc, vc, bt, sl, qsl)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "head_size, block_size, num_kv_heads, group",
    [(64, 16, 2, 1), (80, 32, 1, 4), (96, 16, 2, 2), (128, 32, 8, 8), (256, 16, 1, 2)],
)
def test_gpu_paged_attention_decode(cuda_ext, dtype, head_size, block_size, num_kv_heads, group):
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    # Decodes, plus a 3-token chunk that the kernel walks token by token.
    q, kc, vc, bt, sl, qsl = _random_batch(
        [(1, 1), (1, 300), (3, 77), (1, 1000)], num_kv_heads, group, head_size, block_size, dtype, gen
    )
    out = torch.full_like(q, float("nan"))
    cuda_ext.paged_attention_decode(out, q, kc, vc, bt, sl, qsl, head_size**-0.5)
    expected = reference.paged_attention(q, kc, vc, bt, sl, qsl, head_size**-0.5)
    torch.testing.assert_close(out.float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("extra", [{"sliding_window": 40}, {"soft_cap": 5.0}, {"sliding_window": 129, "soft_cap": 3.0}])
def test_gpu_paged_attention_window_and_soft_cap(cuda_ext, dtype, extra):
    """Decodes and a walked 3-token chunk; slid-out table entries point at a NaN block."""
    from pagedserve.kernels.cuda import ops

    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    q, kc, vc, bt, sl, qsl = _random_batch([(1, 1), (1, 300), (3, 77), (1, 1000)], 2, 4, 128, 16, dtype, gen)
    expected = reference.paged_attention(q, kc, vc, bt, sl, qsl, 128**-0.5, **extra)
    window = extra.get("sliding_window")
    if window is not None:
        kc, vc = (
            torch.cat([kc, torch.full_like(kc[:1], float("nan"))]),
            torch.cat([vc, torch.full_like(vc[:1], float("nan"))]),
        )
        q_lens = (qsl[1:] - qsl[:-1]).tolist()
        for i, ctx in enumerate(sl.tolist()):
            bt[i, : max(0, ctx - q_lens[i] - window + 1) // 16] = kc.shape[0] - 1
    out = torch.full_like(q, float("nan"))
    cuda_ext.paged_attention_decode(out, q, kc, vc, bt, sl, qsl, 128**-0.5, window or 0, extra.get("soft_cap", 0.0))
    torch.testing.assert_close(out.float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype])
    # ops.paged_attention sends the prefill-shaped batch to Triton with the same parameters.
    got = ops.paged_attention(q, kc, vc, bt, sl, qsl, 128**-0.5, **extra)
    torch.testing.assert_close(got.float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("extra", [{}, {"sliding_window": 40}, {"soft_cap": 5.0}], ids=["plain", "window", "cap"])
@pytest.mark.parametrize("spread", [2.0, 30.0], ids=["sinks", "large-sinks"])
def test_gpu_paged_attention_sinks(cuda_ext, dtype, extra, spread):
    """GPT-OSS sink logits in the decode kernel and, for the prefill-shaped batch, Triton."""
    from pagedserve.kernels.cuda import ops

    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    q, kc, vc, bt, sl, qsl = _random_batch([(1, 1), (1, 300), (3, 77), (1, 1000)], 2, 4, 128, 16, dtype, gen)
    sinks = (torch.randn(q.shape[1], generator=gen) * spread).cuda()
    expected = reference.paged_attention(q, kc, vc, bt, sl, qsl, 128**-0.5, sinks=sinks, **extra)
    out = torch.full_like(q, float("nan"))
    window, cap = extra.get("sliding_window", 0), extra.get("soft_cap", 0.0)
    cuda_ext.paged_attention_decode(out, q, kc, vc, bt, sl, qsl, 128**-0.5, window, cap, sinks)
    torch.testing.assert_close(out.float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype])
    got = ops.paged_attention(q, kc, vc, bt, sl, qsl, 128**-0.5, sinks=sinks, **extra)
    torch.testing.assert_close(got.float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype])


#: 8-bit caches the decode kernel reads: (cache dtype, rows carry a float32 scale).
KV8 = {
    "int8": (torch.int8, True),
    "e4m3-rows": (torch.float8_e4m3fn, True),
    "e5m2-rows": (torch.float8_e5m2, True),
    "e4m3": (torch.float8_e4m3fn, False),
    "e5m2": (torch.float8_e5m2, False),
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kv", list(KV8))
@pytest.mark.parametrize("extra", [{}, {"sliding_window": 40, "soft_cap": 5.0}], ids=["plain", "window-cap"])
def test_gpu_paged_attention_decode_reads_8bit_caches(cuda_ext, dtype, kv, extra):
    """int8 and fp8 caches (rows with their scales, and unscaled fp8) written by the
    reference, keys with outliers; decodes and a walked 3-token chunk."""
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    q, kc, vc, bt, sl, qsl = _random_batch([(1, 1), (1, 300), (3, 77), (1, 1000)], 2, 4, 128, 16, dtype, gen)
    kv_dtype, rows = KV8[kv]
    keys, values = kc.float().flatten(0, 1).cpu() * 8, vc.float().flatten(0, 1).cpu()
    keys[::5, :, 0] *= 40  # beyond e4m3's range: a row scale absorbs it, unscaled saturates
    shape = (*kc.shape[:3], 128 + 4 if rows else 128)
    # The reference writes and reads on the host (its 8-bit tensor ops need not exist on the GPU).
    k8, v8 = torch.zeros(shape, dtype=kv_dtype), torch.zeros(shape, dtype=kv_dtype)
    reference.reshape_and_cache(keys, values, k8, v8, torch.arange(keys.shape[0]))
    meta = [t.cpu() for t in (bt, sl, qsl)]
    expected = reference.paged_attention(q.float().cpu(), k8, v8, *meta, 128**-0.5, **extra).cuda()
    k8, v8 = k8.cuda(), v8.cuda()
    out = torch.full_like(q, float("nan"))
    window, cap = extra.get("sliding_window", 0), extra.get("soft_cap", 0.0)
    cuda_ext.paged_attention_decode(out, q, k8, v8, bt, sl, qsl, 128**-0.5, window, cap)
    torch.testing.assert_close(out.float(), expected, atol=TOL[dtype], rtol=TOL[dtype])
    with pytest.raises(ValueError, match="needs rows of query head_size"):
        cuda_ext.paged_attention_decode(out, q, k8[..., :120], v8[..., :120], bt, sl, qsl, 0.1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_reshape_and_cache(cuda_ext, dtype):
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    key = torch.randn(9, 2, 80, generator=gen).to(dtype).cuda()
    value = torch.randn(9, 2, 80, generator=gen).to(dtype).cuda()
    kc = torch.randn(4, 16, 2, 80, generator=gen).to(dtype).cuda()
    vc = torch.randn(4, 16, 2, 80, generator=gen).to(dtype).cuda()
    slots = torch.randperm(64, generator=gen)[:9].cuda()
    slots[[2, 5]] = -1
    exp_k, exp_v = kc.clone(), vc.clone()
    reference.reshape_and_cache(key, value, exp_k, exp_v, slots)
    cuda_ext.reshape_and_cache(key, value, kc, vc, slots)
    assert torch.equal(kc, exp_k) and torch.equal(vc, exp_v)


@pytest.mark.gpu
def test_gpu_copy_and_swap_blocks(cuda_ext):
    from pagedserve.kernels.cuda import ops

    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    dev = torch.randn(6, 16, 2, 64, generator=gen).to(torch.bfloat16).cuda()
    host = torch.randn(5, 16, 2, 64, generator=gen).to(torch.bfloat16).pin_memory()
    mapping = torch.tensor([[0, 3], [2, 4]], dtype=torch.int64)
    expected = dev.clone()
    reference.copy_blocks(dev.clone(), expected, mapping)
    ops.copy_blocks(dev, dev, mapping)
    assert torch.equal(dev, expected)
    exp_host = host.clone()
    reference.swap_blocks(dev, exp_host, mapping)
    ops.swap_blocks(dev, host, mapping)
    assert torch.equal(host, exp_host)
    exp_dev = dev.clone()
    reference.swap_blocks(host, exp_dev, torch.tensor([[4, 1]]))
    ops.swap_blocks(host, dev, torch.tensor([[4, 1]]))
    assert torch.equal(dev, exp_dev)


@pytest.mark.gpu
def test_gpu_binding_rejects_bad_inputs(cuda_ext):
    q = torch.randn(2, 4, 64, device="cuda", dtype=torch.float16)
    kc = torch.randn(3, 16, 2, 64, device="cuda", dtype=torch.float16)
    bt = torch.zeros(2, 1, dtype=torch.int32, device="cuda")
    sl = torch.ones(2, dtype=torch.int32, device="cuda")
    qsl = torch.arange(3, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="share one dtype"):
        cuda_ext.paged_attention_decode(torch.empty_like(q), q, kc.float(), kc.float(), bt, sl, qsl, 0.1)
    with pytest.raises(ValueError, match="block_tables must have dtype"):
        cuda_ext.paged_attention_decode(torch.empty_like(q), q, kc, kc, bt.long(), sl, qsl, 0.1)
    with pytest.raises(ValueError, match="16-byte boundary"):
        odd = torch.randn(2 * 4 * 64 + 1, device="cuda", dtype=torch.float16)[1:].view(2, 4, 64)
        cuda_ext.paged_attention_decode(torch.empty_like(q), odd, kc, kc, bt, sl, qsl, 0.1)


def test_gpu_tests_are_marked():
    # Every test that needs a device carries the gpu marker, so `-m "not gpu"` is safe.
    for name, obj in dict(globals()).items():
        if name.startswith("test_gpu_") and name != "test_gpu_tests_are_marked":
            assert any(m.name == "gpu" for m in getattr(obj, "pytestmark", [])), name
