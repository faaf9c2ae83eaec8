"""Device maps (``device_map``): one model's layers split across two platforms.

The CPU is the only real device here, so the second platform is a plugin installed for
these tests through a real entry point: ``cpu-hm``, the host CPU with a head-major KV
layout ``[num_blocks, num_kv_heads, block_size, head_size]`` and counted reference ops.
A layer run with the other platform's ops, or whose cache was allocated by the other
platform, reads its KV in the wrong layout and cannot reproduce the unmapped tokens.
"""

from __future__ import annotations

import random

import pytest
from plugin_dists import install_plugin

from pagedserve import LLM, SamplingParams
from pagedserve.entrypoints import cli
from pagedserve.entrypoints.cli import serve_cmd
from pagedserve.platforms.cpu.platform import CpuPlatform

PLUGIN = """
from collections import Counter

import torch

from pagedserve.kernels import reference
from pagedserve.platforms import Platform, hookimpl

CALLS = Counter()
ALLOCATED = []  # data_ptr of every KV tensor this platform allocated


class HeadMajorCpuPlatform(Platform):
    name = "cpu-hm"
    device_type = "cpu"
    supported_dtypes = (torch.float32,)

    @classmethod
    def is_available(cls):
        return True, "the host CPU"

    def total_memory(self):
        return 8 * 1024**3

    def free_memory(self):
        return 4 * 1024**3

    def kv_cache_shape(self, num_blocks, block_size, num_kv_heads, head_size):
        return (num_blocks, num_kv_heads, block_size, head_size)

    def allocate_kv_cache(self, *args, **kwargs):
        k, v = super().allocate_kv_cache(*args, **kwargs)
        ALLOCATED.extend([k.data_ptr(), v.data_ptr()])
        return k, v


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping):
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    blocks, offsets = slots // key_cache.shape[2], slots % key_cache.shape[2]
    key_cache[blocks, :, offsets] = key[valid].to(key_cache.dtype)
    value_cache[blocks, :, offsets] = value[valid].to(value_cache.dtype)


def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, out=None):
    return reference.paged_attention(query, key_cache.transpose(1, 2), value_cache.transpose(1, 2),
                                     block_tables, seq_lens, query_start_loc, scale, out)


def counted(name, fn):
    def op(*args, **kwargs):
        CALLS[name] += 1
        return fn(*args, **kwargs)
    return op


@hookimpl
def pagedserve_register_platforms(register):
    register(HeadMajorCpuPlatform)


@hookimpl
def pagedserve_register_ops(platform, ops):
    if isinstance(platform, HeadMajorCpuPlatform):
        # rotary_paged_attention keeps the registry's default, the composition of these
        # parts (the reference one composes the reference parts, for the reference layout).
        impls = {name: getattr(reference, name) for name in reference.OP_NAMES if name != "rotary_paged_attention"}
        impls.update(reshape_and_cache=reshape_and_cache, paged_attention=paged_attention)
        for name, fn in impls.items():
            ops.register(name, counted(name, fn), source="cpu-hm")
"""


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    """The ``cpu-hm`` plugin as an installed distribution (entry point on sys.path)."""
    yield from install_plugin(tmp_path_factory, "psmap_plugin", "cpu-hm", PLUGIN)


SHAPE = dict(arch="llama", num_layers=4, num_heads=4, num_kv_heads=2)  # head_dim 16
# Block size 4 != 2 KV heads: the two layouts differ.  A 16-token budget chunks the
# longer prompts; the second round hits the prefix cache.
ENGINE = dict(
    dtype="float32",
    block_size=4,
    kv_cache_memory="1MiB",
    max_model_len=128,
    max_num_batched_tokens=16,
    max_num_seqs=4,
    enable_prefix_caching=True,
    enable_chunked_prefill=True,
)
MAX_TOKENS = [6, 9, 4, 7, 5, 8]


def prompts() -> list[list[int]]:
    rng = random.Random(11)
    shared = [rng.randrange(3, 259) for _ in range(21)]
    out = [shared + [rng.randrange(3, 259) for _ in range(n)] for n in (2, 7, 13)]
    return out + [[rng.randrange(3, 259) for _ in range(n)] for n in (1, 9, 40)]


def two_rounds(llm: LLM) -> list[list[list[int]]]:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    first = [o.outputs[0].token_ids for o in llm.generate(prompts(), params, use_tqdm=False)]
    second = [o.outputs[0].token_ids for o in llm.generate(prompts()[::-1], params[::-1], use_tqdm=False)]
    return [first, second[::-1]]


def count_calls(llm: LLM) -> dict[str, int]:
    """Counts of the model's forwards and LM-head calls (steps where some request samples)."""
    model, calls = llm.llm_engine.runner.model, {"forward": 0, "compute_logits": 0}
    for name in calls:

        def counting(*args, _name=name, _fn=getattr(model, name), **kwargs):  # noqa: B008 (binds now)
            calls[_name] += 1
            return _fn(*args, **kwargs)

        setattr(model, name, counting)
    return calls


@pytest.fixture(scope="module")
def expected(plugin, tiny_checkpoint_factory):
    path = tiny_checkpoint_factory(**SHAPE)
    return path, two_rounds(LLM(model=str(path), device="cpu", **ENGINE))


# (map, which of the 4 layers run on cpu-hm)
MAPS = [
    ("cpu:1,cpu-hm", [1, 2, 3]),
    ("cpu-hm", [0, 1, 2, 3]),
    ("cpu:0-0,cpu-hm:1-2,cpu:3-3", [1, 2]),
    ("cpu-hm:3,cpu", [0, 1, 2]),
]


@pytest.mark.parametrize("device_map,on_hm", MAPS)
def test_greedy_outputs_equal_the_unmapped_run(device_map, on_hm, plugin, expected):
    path, want = expected
    llm = LLM(model=str(path), device_map=device_map, **ENGINE)
    model_calls = count_calls(llm)
    plugin.CALLS.clear()
    assert two_rounds(llm) == want
    eng = llm.llm_engine
    assert eng.kv.prefix_hits > 0  # the second round reused cached prefixes
    assert [p.name for p in eng.runner.layer_platforms] == ["cpu-hm" if i in on_hm else "cpu" for i in range(4)]
    # cpu-hm's ops ran for its layers and only for them.
    n, calls = model_calls["forward"], plugin.CALLS
    first_hm, last_hm = 0 in on_hm, 3 in on_hm
    assert calls["paged_attention"] == calls["reshape_and_cache"] == n * len(on_hm) > 0
    assert calls["rotary_embedding"] == calls["linear_silu_and_mul"] == n * len(on_hm)
    # qkv, o and down per layer (gate/up go through linear_silu_and_mul), plus the LM
    # head when the last segment is cpu-hm's.
    assert calls["linear"] == n * 3 * len(on_hm) + model_calls["compute_logits"] * last_hm
    assert calls["embedding"] == n * first_hm
    eng.kv.pool.check_invariants()
    assert eng.kv.pool.num_in_use == 0


def test_each_layer_kv_is_allocated_by_its_platform(plugin, expected, monkeypatch):
    path, _ = expected
    by_cpu: list[int] = []
    allocate = CpuPlatform.allocate_kv_cache

    def recording(self, *args, **kwargs):
        k, v = allocate(self, *args, **kwargs)
        by_cpu.extend([k.data_ptr(), v.data_ptr()])
        return k, v

    monkeypatch.setattr(CpuPlatform, "allocate_kv_cache", recording)
    plugin.ALLOCATED.clear()
    llm = LLM(model=str(path), device_map="cpu:0-0,cpu-hm:1-2,cpu:3-3", **ENGINE)
    runner = llm.llm_engine.runner
    nb = runner.num_blocks
    assert [p.name for p in runner.layer_platforms] == ["cpu", "cpu-hm", "cpu-hm", "cpu"]
    for i, (k, v) in enumerate(runner.kv_caches):
        if i in (1, 2):
            assert tuple(k.shape) == tuple(v.shape) == (nb, 2, 4, 16)  # head-major
            assert k.data_ptr() in plugin.ALLOCATED and v.data_ptr() in plugin.ALLOCATED
        else:
            assert tuple(k.shape) == tuple(v.shape) == (nb, 4, 2, 16)  # the reference layout
            assert k.data_ptr() in by_cpu and v.data_ptr() in by_cpu
    assert len(plugin.ALLOCATED) == 4 and len(by_cpu) == 4
    # Every layer has the same number of blocks: the budget covers all four layers.
    assert nb == 2**20 // (2 * 4 * 4 * 2 * 16 * 4)


def test_aborts_leak_no_blocks(plugin, expected):
    path, _ = expected
    eng = LLM(model=str(path), device_map="cpu:0-0,cpu-hm:1-2,cpu:3-3", **ENGINE).llm_engine
    for i, (p, n) in enumerate(zip(prompts(), MAX_TOKENS)):
        eng.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=n + 10, ignore_eos=True))
    for step in range(40):
        eng.step()
        eng.kv.pool.check_invariants()
        if step == 2:
            eng.abort_request(["5", "1"])  # a long prefill mid-way, a shared-prefix request
        if step == 6:
            eng.abort_request(["0"])
        if not eng.has_unfinished_requests():
            break
    assert not eng.has_unfinished_requests()
    assert eng.kv.pool.num_in_use == 0 and not eng.kv.req_blocks


def test_host_kv_tier_uses_each_layers_layout_and_copies(plugin, tiny_checkpoint_factory):
    path = tiny_checkpoint_factory(**SHAPE)
    rng = random.Random(5)
    prefixes = [[rng.randrange(3, 259) for _ in range(24)] for _ in range(4)]
    rounds = [[p + [rng.randrange(3, 259) for _ in range(3)] for p in prefixes] for _ in range(2)]
    # 16 device blocks of 4 tokens: the first round's prefixes spill before round two.
    small = dict(
        dtype="float32",
        block_size=4,
        num_gpu_blocks_override=16,
        max_model_len=64,
        max_num_batched_tokens=64,
        max_num_seqs=2,
        kv_offload_memory="256KiB",
    )
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    def run(**kwargs):
        llm = LLM(model=str(path), **small, **kwargs)
        return llm, [[o.outputs[0].token_ids for o in llm.generate(r, params, use_tqdm=False)] for r in rounds]

    _, want = run(device="cpu")
    plugin.CALLS.clear()
    llm, got = run(device_map="cpu:1,cpu-hm")
    assert got == want
    eng = llm.llm_engine
    assert eng.kv.num_spilled_blocks > 0 and eng.kv.num_reloaded_tokens > 0
    host = eng.runner.host_kv_caches
    assert tuple(host[0][0].shape)[1:] == (4, 2, 16) and tuple(host[1][0].shape)[1:] == (2, 4, 16)
    # Three of the four layers' copies ran cpu-hm's swap_blocks (key and value, per run).
    assert plugin.CALLS["swap_blocks"] > 0 and plugin.CALLS["swap_blocks"] % 6 == 0


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(device_map="tpu:1,cpu"), r"unknown platform 'tpu'; available platforms: cpu, cpu-hm"),
        (dict(device_map="cpu:1,tpu"), r"unknown platform 'tpu'; available platforms: cpu, cpu-hm"),
        (dict(device_map="cpu:3,cpu-hm:3"), r"places 6 layers, but the model has 4"),
        (dict(device_map="cpu:2,cpu-hm:1"), r"places 3 layers, but the model has 4; give every layer"),
        (dict(device_map="cpu:4,cpu-hm"), r"'cpu-hm' \(the rest\) would get none"),
        (dict(device_map="cpu:0-2,cpu-hm:2-3"), r"segments cpu:0-2 and cpu-hm:2-3 overlap"),
        (dict(device_map="cpu:0-1,cpu-hm:3-3"), r"places no platform for layer 2"),
        (dict(device_map="cpu:0-1,cpu-hm:2-5"), r"places layers up to 5, but the model has 4 layers"),
        (dict(device_map="cpu:1,cpu-hm,cpu"), r"only one segment may omit its layer count"),
        (dict(device_map="cpu:1,cpu-hm", tensor_parallel_size=2), r"tensor/pipeline parallelism"),
        (dict(device_map="cpu:1,cpu-hm", pipeline_parallel_size=2), r"tensor/pipeline parallelism"),
        (dict(device_map="cpu:1,cpu-hm", distributed_executor_backend="mp"), r"distributed_executor_backend='mp'"),
        (dict(device_map="cpu:1,cpu-hm", cpu_offload_gb=0.001), r"cannot be combined with cpu_offload_gb"),
        (dict(device_map="cpu:1,cpu-hm", device="cpu-hm"), r"device='cpu-hm' conflicts with device_map"),
        (dict(device_map="cpu:1,cpu-hm", dtype="bfloat16"), r"platform 'cpu-hm' does not support dtype bfloat16"),
        (dict(device_map="cpu:1,cpu-hm", quantization="int8"), r"quantization='int8'.*cpu-hm"),
    ],
)
def test_bad_maps_are_refused_naming_the_problem(kwargs, message, plugin, expected):
    path, _ = expected
    kwargs = {"dtype": "float32", **kwargs}
    with pytest.raises(ValueError, match=message):
        LLM(model=str(path), kv_cache_memory="1MiB", **kwargs)


def test_the_map_is_normalised_and_names_the_engines_platform(plugin, expected):
    path, _ = expected
    llm = LLM(model=str(path), device_map=[("cpu-hm", 2), "cpu"], **ENGINE)
    eng = llm.llm_engine
    assert eng.config.device.device_map == "cpu-hm:2,cpu"
    assert eng.platform.name == eng.config.device.device == "cpu-hm"
    assert [(s.platform.name, s.start, s.end) for s in eng.runner.segments] == [("cpu-hm", 0, 2), ("cpu", 2, 4)]


@pytest.mark.parametrize("command", [["generate"], ["serve"], ["bench", "throughput"]])
@pytest.mark.parametrize(
    "value,message",
    [
        ("tpu:20,cpu", "unknown platform 'tpu'; available platforms: cpu, cpu-hm"),
        ("cpu:0-3,cpu-hm:3-5", "segments cpu:0-3 and cpu-hm:3-5 overlap"),
        ("cpu:x", "is not PLATFORM, PLATFORM:COUNT or PLATFORM:FIRST-LAST"),
    ],
)
def test_cli_flag_errors_cleanly(command, value, message, plugin, capsys):
    argv = [*command, "--device-map", value]
    with pytest.raises(SystemExit) as exc:
        cli.build_parser(argv).parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --device-map" in err and message in err and "Traceback" not in err


def test_cli_flag_reaches_the_engine(plugin, expected, capsys):
    path, _ = expected
    argv = ["serve", str(path), "--device-map", "cpu:1, cpu-hm", "--kv-cache-memory", "1MiB"]
    config, _, _ = serve_cmd.build_engine_config(cli.build_parser(argv).parse_args(argv))
    assert config.device.device_map == "cpu:1,cpu-hm" and config.device.device == "cpu"
    # A map that does not fit the model fails when the engine starts, without a traceback.
    argv = ["generate", str(path), "--device-map", "cpu:9,cpu-hm", "--dtype", "float32", "-p", "hi"]
    with pytest.raises(SystemExit, match="pagedserve generate: device_map 'cpu:9,cpu-hm' places 9 layers"):
        cli.main(argv)
    argv = [
        "generate",
        str(path),
        "--device-map",
        "cpu:1,cpu-hm",
        "--dtype",
        "float32",
        "-p",
        "hi",
        "--max-tokens",
        "3",
        "--json",
    ]
    assert cli.main(argv) == 0
    assert '"finish_reason": "length"' in capsys.readouterr().out


def test_target_device_variable_must_agree_with_the_map(plugin, expected, monkeypatch):
    path, _ = expected
    monkeypatch.setenv("PAGEDSERVE_TARGET_DEVICE", "cpu-hm")
    with pytest.raises(ValueError, match="PAGEDSERVE_TARGET_DEVICE='cpu-hm' conflicts with device_map='cpu:1,cpu-hm'"):
        LLM(model=str(path), device_map="cpu:1,cpu-hm", **ENGINE)
    # Naming the map's first platform is fine; the other platforms are still found.
    monkeypatch.setenv("PAGEDSERVE_TARGET_DEVICE", "cpu")
    llm = LLM(model=str(path), device_map="cpu:1,cpu-hm", **ENGINE)
    assert [s.platform.name for s in llm.llm_engine.runner.segments] == ["cpu", "cpu-hm"]
