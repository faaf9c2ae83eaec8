"""KV connectors (platform interface 1.6): full blocks saved by content, prefix misses
loaded from the store instead of recomputed, outputs equal to a cold run (greedy tokens
and logprobs); the disk connector across engine restarts, with torn and corrupt block
files ignored and its size bound kept; the host connector; a plugin's connector found
by entry point; the configuration rules."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.config import CacheConfig, EngineConfig, ParallelConfig
from pagedserve.offload.connectors import DiskKVConnector, HostKVConnector, create_kv_connector

ENGINE = dict(dtype="float32", kv_cache_memory="8MiB", block_size=4)
PARAMS = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2)
REPO = Path(__file__).resolve().parents[2]


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 259) for _ in range(22)]
    own = [[rng.randrange(3, 259) for _ in range(n)] for n in (37, 9)]
    return own + [shared + [rng.randrange(3, 259) for _ in range(n)] for n in (3, 10)]


def run(llm: LLM, ps) -> list:
    outs = llm.generate(ps, PARAMS, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]


def assert_same(a, b) -> None:
    for (ta, la), (tb, lb) in zip(a, b, strict=True):
        assert ta == tb
        for pa, pb in zip(la, lb, strict=True):
            assert pa.keys() == pb.keys()
            for tok in pa:
                assert pb[tok].logprob == pytest.approx(pa[tok].logprob, abs=1e-4)


@pytest.fixture(scope="module")
def cold(tiny_llama):
    """Outputs without any connector, and the number of full prompt blocks a lookup can hit."""
    ps = prompts()
    hittable = sum((len(p) - 1) // 4 for p in ps)
    return ps, run(LLM(str(tiny_llama), **ENGINE), ps), hittable


def block_files(d: Path) -> list[Path]:
    return sorted(d.glob("*.kvb"))


def first_block_file(model, tokens: list[int], d: Path) -> Path:
    """The block file the disk connector writes for the first block of ``tokens`` (one
    full block and a token: an engine on the fresh directory ``d`` saves just that one)."""
    llm = LLM(str(model), **ENGINE, kv_connector=f"disk:{d}")
    llm.generate([tokens], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    llm.shutdown()
    (saved,) = block_files(d)
    return saved


@pytest.mark.compat("kv_connector", "single")
def test_disk_connector_across_restarts_torn_and_corrupt_files(tiny_llama, cold, tmp_path):
    ps, expected, hittable = cold
    d = tmp_path / "kv"
    first = LLM(str(tiny_llama), **ENGINE, kv_connector=f"disk:{d}")
    assert_same(expected, run(first, ps))
    kv = first.llm_engine.kv
    assert kv.num_loaded_blocks == 0 and kv.num_saved_blocks == len(block_files(d)) > 0
    first.shutdown()  # writes the index
    assert (d / "index.json").exists()
    del first

    # A new engine (as after a restart) finds every prefix block on disk.
    second = LLM(str(tiny_llama), **ENGINE, kv_connector=f"disk:{d}")
    assert_same(expected, run(second, ps))
    kv2 = second.llm_engine.kv
    # The two prompts sharing a prefix: the second's shared blocks are device hits.
    assert kv2.num_loaded_blocks == hittable - 22 // 4
    assert kv2.num_saved_blocks == 0
    second.shutdown()
    del second

    # Damage: a torn write (truncated file), a flipped byte, a stray temporary file.  The
    # damaged files are the first blocks of the two prompts that share nothing, which every
    # lookup of those prompts reads first (file names follow the content and the checkpoint's
    # fingerprint: a probe engine on a fresh directory saves just that block to learn it).
    torn, flipped = (d / first_block_file(tiny_llama, p[:5], tmp_path / f"probe{i}").name for i, p in enumerate(ps[:2]))
    files = block_files(d)
    assert torn in files and flipped in files
    torn.write_bytes(torn.read_bytes()[:-7])
    data = bytearray(flipped.read_bytes())
    data[-3] ^= 0x40
    flipped.write_bytes(bytes(data))
    (d / f".{files[2].name}.123.tmp").write_bytes(b"half a block")
    third = LLM(str(tiny_llama), **ENGINE, kv_connector=f"disk:{d}")
    assert_same(expected, run(third, ps))  # damaged blocks were recomputed, never loaded
    stats = third.llm_engine.runner.kv_connector.stats()
    # Both damaged blocks are found (each is the first a lookup of its prompt reads) and
    # none is ever loaded (outputs above).
    assert stats["corrupt"] == 2 and stats["torn_temp_files_removed"] == 1
    # Each damaged block ends the run of hits of its prompt; it and what follows are recomputed
    # (and saved again).
    kv3 = third.llm_engine.kv
    assert 0 < kv3.num_loaded_blocks < hittable - 22 // 4
    assert kv3.num_saved_blocks >= 1  # a damaged block a lookup found is saved again
    assert not list(d.glob(".*.tmp"))
    third.shutdown()
    # Whatever is left on disk: each damaged file was found exactly once, by the run or now.
    reopened = DiskKVConnector(d, max_bytes=1 << 30)
    for f in block_files(d):
        reopened.load(f.name[: -len(".kvb")])
    assert stats["corrupt"] + reopened.stats().get("corrupt", 0) <= 2
    assert all(reopened.load(f.name[: -len(".kvb")]) is not None for f in block_files(d))
    reopened.close()


def test_disk_connector_size_bound_and_index(tmp_path):
    gen = torch.Generator().manual_seed(1)
    blocks = {f"{i:064x}": [torch.randn(4, 2, 8, generator=gen), torch.randn(4, 2, 8, generator=gen)] for i in range(6)}
    one = len(next(iter(blocks.values()))) * 4 * 2 * 8 * 4
    conn = DiskKVConnector(tmp_path, max_bytes=3 * one + 3 * 400)  # three blocks and their headers
    for key, tensors in blocks.items():
        conn.save(key, tensors)
        if key == f"{1:064x}":
            assert conn.load(f"{0:064x}") is not None  # block 0 is now used more recently than block 1
    assert len(block_files(tmp_path)) == 3 == conn.stats()["blocks"]
    kept = [k for k in blocks if conn.contains(k)]
    assert kept == [f"{i:064x}" for i in (3, 4, 5)]
    for key in kept:
        got = conn.load(key)
        assert all(torch.equal(a, b) for a, b in zip(got, blocks[key], strict=True))
    conn.close()
    # Reopened: the index's order; a file saved after the index was written is added.
    extra = DiskKVConnector(tmp_path, max_bytes=10 * one)
    assert [k for k in blocks if extra.contains(k)] == kept


def test_disk_connector_keeps_every_dtype_exactly(tmp_path):
    conn = DiskKVConnector(tmp_path, max_bytes=2**20)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 5, generator=gen)
    tensors = [x, x.to(torch.bfloat16), x.to(torch.float8_e4m3fn).view(torch.uint8), x.to(torch.float16)]
    conn.save("ab" * 32, tensors)
    got = DiskKVConnector(tmp_path, max_bytes=2**20).load("ab" * 32)
    assert [t.dtype for t in got] == [t.dtype for t in tensors]
    assert all(torch.equal(a, b) for a, b in zip(got, tensors, strict=True))


def test_host_connector_reloads_evicted_prefixes(tiny_llama, cold):
    ps, expected, _ = cold
    # 12 device blocks: the first round's prompt blocks are evicted by the later prompts.
    llm = LLM(str(tiny_llama), **{**ENGINE, "kv_cache_memory": "48KiB", "max_model_len": 48}, kv_connector="host")
    for p, want in zip(ps, expected):
        assert_same([want], run(llm, [p]))
    kv = llm.llm_engine.kv
    loaded = kv.num_loaded_blocks
    for p, want in zip(ps, expected):
        assert_same([want], run(llm, [p]))
    assert kv.num_loaded_blocks > loaded
    kv.pool.check_invariants()
    assert kv.num_blocks_in_use == 0
    # The counters in EngineStats and on /metrics.
    from prometheus_client.parser import text_string_to_metric_families

    from pagedserve.entrypoints.openai.metrics import ServerMetrics

    stats = llm.llm_engine.stats()
    assert stats.kv_connector_blocks_loaded == kv.num_loaded_blocks
    assert stats.kv_connector_blocks_saved == kv.num_saved_blocks > 0
    text = ServerMetrics(llm.llm_engine.stats, "tiny").render().decode()
    totals = {
        s.name: s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name.startswith("pagedserve:kv_connector_blocks_") and s.name.endswith("_total")
    }
    assert totals == {
        "pagedserve:kv_connector_blocks_loaded_total": kv.num_loaded_blocks,
        "pagedserve:kv_connector_blocks_saved_total": kv.num_saved_blocks,
    }


def test_host_connector_lru_bound():
    conn = HostKVConnector(max_bytes=2 * 64)
    for i in range(4):
        conn.save(str(i), [torch.full((16,), float(i))])
    assert [conn.contains(str(i)) for i in range(4)] == [False, False, True, True]
    assert conn.stats()["evicted"] == 2


def test_a_different_layout_never_hits(tiny_llama, cold, tmp_path):
    ps, expected, _ = cold
    d = tmp_path / "kv"
    run(LLM(str(tiny_llama), **ENGINE, kv_connector=f"disk:{d}"), ps)
    other = LLM(str(tiny_llama), **{**ENGINE, "block_size": 8}, kv_connector=f"disk:{d}")
    run(other, ps)
    assert other.llm_engine.kv.num_loaded_blocks == 0


def test_sleep_saves_pending_blocks_first(tiny_llama, cold, tmp_path):
    ps, expected, _ = cold
    d = tmp_path / "kv"
    llm = LLM(str(tiny_llama), **ENGINE, kv_connector=f"disk:{d}", enable_sleep_mode=True)
    engine = llm.llm_engine
    # One step: the prompt's blocks are registered; their saves wait for the next step.
    engine.add_request("a", None, SamplingParams(max_tokens=1), prompt_token_ids=ps[0])
    engine.step()
    assert not engine.has_unfinished_requests()
    assert not block_files(d)
    llm.sleep(1)
    assert len(block_files(d)) == (len(ps[0])) // 4
    llm.wake_up()
    assert_same(expected[:1], run(llm, ps[:1]))
    assert engine.kv.num_loaded_blocks == (len(ps[0]) - 1) // 4


@pytest.fixture
def memo_plugin(tmp_path, monkeypatch):
    """examples/kv_connector_plugin as pip leaves it: its package plus a dist-info that
    declares the entry point."""
    site = tmp_path / "site"
    info = site / "memo_kv_connector-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: memo-kv-connector\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[pagedserve.platforms]\nmemo-kv = memo_connector\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.syspath_prepend(str(REPO / "examples" / "kv_connector_plugin"))
    monkeypatch.delenv("PAGEDSERVE_PLUGINS", raising=False)
    yield
    for mod in [m for m in sys.modules if m == "memo_connector"]:
        del sys.modules[mod]


def test_out_of_tree_connector_by_entry_point(memo_plugin, tiny_llama, cold):
    ps, expected, hittable = cold
    first = LLM(str(tiny_llama), **ENGINE, kv_connector="memo:t")
    assert_same(expected, run(first, ps))
    import memo_connector

    saved = {k for name, op, k in memo_connector.CALLS if name == "t" and op == "save"}
    assert saved and set(memo_connector.STORES["t"]) == saved
    second = LLM(str(tiny_llama), **ENGINE, kv_connector="memo:t")
    assert_same(expected, run(second, ps))
    assert second.llm_engine.kv.num_loaded_blocks == hittable - 22 // 4
    with pytest.raises(ValueError, match=r"no connector named 'nope' \(available: disk, host, memo\)"):
        create_kv_connector("nope", 2**20, "f")


def test_connector_config_rules(tiny_llama):
    with pytest.raises(ValueError, match="kv_connector='host' is not supported with tensor/pipeline"):
        EngineConfig(cache=CacheConfig(kv_connector="host"), parallel=ParallelConfig(tensor_parallel_size=2))
    with pytest.raises(ValueError, match="cannot be combined with kv_offload_memory"):
        EngineConfig(cache=CacheConfig(kv_connector="host", kv_offload_memory="1MiB"))
    with pytest.raises(ValueError, match="needs enable_prefix_caching"):
        EngineConfig(cache=CacheConfig(kv_connector="host", enable_prefix_caching=False))
    with pytest.raises(ValueError, match="needs a directory"):
        LLM(str(tiny_llama), **ENGINE, kv_connector="disk")


def test_conformance_kit_checks_a_plugin_connector(memo_plugin):
    from pagedserve.testing import run_conformance

    report = run_conformance("cpu", engine=False, only=["connector:"])
    assert report.ok, report.format()
    assert [r.id for r in report.results] == ["connector:memo"]


def test_conformance_kit_fails_a_lossy_connector():
    """A connector that keeps blocks in float32 (so a bf16 block comes back as float32)
    fails its check, named."""
    from types import SimpleNamespace

    from pagedserve.platforms import KVConnector, discover, hookimpl
    from pagedserve.testing import run_conformance

    class Lossy(KVConnector):
        def __init__(self):
            self.blocks = {}

        def contains(self, key):
            return key in self.blocks

        def save(self, key, tensors):
            self.blocks[key] = [t.float() if t.is_floating_point() else t for t in tensors]

        def load(self, key):
            return self.blocks.get(key)

    @hookimpl
    def pagedserve_register_kv_connectors(register):
        register("lossy", lambda arg, max_bytes, fingerprint: Lossy())

    reg = discover()
    reg.register_plugin(SimpleNamespace(pagedserve_register_kv_connectors=pagedserve_register_kv_connectors), "lossy")
    report = run_conformance("cpu", registry=reg, engine=False, only=["connector:"])
    assert not report.ok
    (failed,) = report.failed
    assert failed.id == "connector:lossy" and "saved torch.bfloat16" in failed.message


def test_disk_prefix_from_another_process_is_a_hit(tiny_llama, cold, tmp_path):
    """A prompt run by a separate Python process leaves its blocks in the directory; this
    process's engine loads them (keys do not depend on the process)."""
    import subprocess

    ps, expected, hittable = cold
    d = tmp_path / "kv"
    script = (
        "from pagedserve import LLM, SamplingParams\n"
        f"llm = LLM({str(tiny_llama)!r}, dtype='float32', kv_cache_memory='8MiB', block_size=4, "
        f"kv_connector={'disk:' + str(d)!r})\n"
        f"llm.generate({ps!r}, SamplingParams(max_tokens=1), use_tqdm=False)\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300, cwd=tmp_path)
    assert block_files(d)
    llm = LLM(str(tiny_llama), **ENGINE, kv_connector=f"disk:{d}")
    assert_same(expected, run(llm, ps))
    assert llm.llm_engine.kv.num_loaded_blocks == hittable - 22 // 4
