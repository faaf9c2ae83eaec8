"""Device-layout KV connectors (platform interface 1.7): the host tier is the builtin one,
and a plugin's tier -- here block slots in memory-mapped files, an NVMe-like store,
installed by entry point -- takes the same path: the same spills, reloads and swaps as
the host tier of the same size, the same outputs, every copy through its own
``save_blocks``/``load_blocks``; its conformance case; on-evict saves of a content
store; the configuration rules."""

from __future__ import annotations

import random
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.config import CacheConfig, EngineConfig, ParallelConfig
from pagedserve.config_rules import BUILTIN_KV_CONNECTORS
from pagedserve.kv_cache.connector import ConnectorKVCacheManager
from pagedserve.offload.connectors import BUILTIN_CONNECTORS, HostTierConnector, check_kv_connector
from pagedserve.request import Request, RequestStatus

SHAPE = dict(arch="llama", num_heads=4, num_kv_heads=2)
VOCAB = 259

#: The plugin: a device-layout tier in memory-mapped files (``filetier:DIR``) and a
#: content store that saves on eviction (``evictstore``).
PLUGIN = '''
"""Test plugin: KV connectors of platform interface 1.7."""

import collections
import math
import os
import tempfile

import torch

from pagedserve.platforms import DeviceLayoutKVConnector, KVConnector, hookimpl

PAGEDSERVE_INTERFACE_VERSION = "1.7"

#: Blocks copied by every FileTier of this process, by direction (per layer and tensor).
COPIES = collections.Counter()
INSTANCES = []
EVICT_STORES = []


class FileTier(DeviceLayoutKVConnector):
    """Slots in one memory-mapped file per layer and tensor, in DIR."""

    def __init__(self, arg=None, max_bytes=0, fingerprint=""):
        super().__init__(max_bytes)
        self.dir = arg or tempfile.mkdtemp()  # the conformance kit gives no directory
        self.files = []
        INSTANCES.append(self)

    def allocate(self, platform, num_blocks, block_size, num_kv_heads, head_size, dtype):
        shape = platform.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        out = []
        for _ in range(2):
            path = os.path.join(self.dir, f"{os.getpid()}-{len(self.files)}.kv")
            with open(path, "wb") as f:
                f.truncate(nbytes)
            self.files.append(path)
            raw = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
            out.append(raw.view(dtype).view(shape))
        return tuple(out)

    def save_blocks(self, swap_blocks, device, store, mapping):
        COPIES["save"] += len(mapping)
        swap_blocks(device, store, mapping)

    def load_blocks(self, swap_blocks, store, device, mapping):
        COPIES["load"] += len(mapping)
        swap_blocks(store, device, mapping)


class EvictStore(KVConnector):
    """A dict of blocks, saved when the device cache evicts them."""

    save_mode = "on-evict"

    def __init__(self, arg=None, max_bytes=0, fingerprint=""):
        self.blocks = {}
        self.saved = []
        EVICT_STORES.append(self)

    def contains(self, key):
        return key in self.blocks

    def save(self, key, tensors):
        self.saved.append(key)
        self.blocks[key] = tensors

    def load(self, key):
        return self.blocks.get(key)


@hookimpl
def pagedserve_register_kv_connectors(register):
    register("filetier", FileTier)
    register("evictstore", EvictStore)
'''


@pytest.fixture
def tier_plugin(tmp_path, monkeypatch):
    """The plugin as pip leaves it: its module plus a dist-info declaring the entry point."""
    site = tmp_path / "site"
    info = site / "file_tier-0.1.0.dist-info"
    info.mkdir(parents=True)
    (site / "file_tier.py").write_text(textwrap.dedent(PLUGIN))
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: file-tier\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[pagedserve.platforms]\nfile-tier = file_tier\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delenv("PAGEDSERVE_PLUGINS", raising=False)
    import file_tier

    yield file_tier
    sys.modules.pop("file_tier", None)


def make_prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, VOCAB) for _ in range(13)]
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 5, 17, 30)]
    return prompts + [shared + [rng.randrange(3, VOCAB) for _ in range(n)] for n in (2, 9)]


# ~11 blocks of 8 tokens for 6 requests of up to ~45 tokens: preemption is forced.
PREEMPTING = dict(
    dtype="float32", max_num_batched_tokens=64, block_size=8, num_gpu_blocks_override=11, max_model_len=88
)
MAX_NEW = [12, 20, 7, 16, 10, 14]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=1) for n in MAX_NEW]

# 16 device blocks of 4 tokens for 24-token prefixes: round one's prefixes are evicted
# from the device before round two asks for them.
SMALL_DEVICE = dict(
    dtype="float32",
    block_size=4,
    num_gpu_blocks_override=16,
    max_model_len=64,
    max_num_batched_tokens=64,
    max_num_seqs=2,
)


def shared_prefix_rounds(seed: int) -> list[list[list[int]]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, VOCAB) for _ in range(24)] for _ in range(4)]
    return [[p + [rng.randrange(3, VOCAB) for _ in range(3)] for p in prefixes] for _ in range(2)]


def outputs(llm: LLM, prompts, params) -> list:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]


def assert_same(a, b) -> None:
    for (ta, la), (tb, lb) in zip(a, b, strict=True):
        assert ta == tb
        for pa, pb in zip(la or [], lb or [], strict=True):
            assert pa.keys() == pb.keys()
            for tok in pa:
                assert pb[tok].logprob == pytest.approx(pa[tok].logprob, abs=1e-4)


TIER_COUNTERS = (
    "num_swap_outs",
    "num_swap_ins",
    "kv_blocks_swapped_out",
    "kv_blocks_swapped_in",
    "kv_blocks_spilled",
    "kv_blocks_reloaded",
    "host_prefix_cache_hits",
    "host_kv_cache_blocks",
)


def test_plugin_tier_swaps_as_the_host_tier_does(tier_plugin, tiny_checkpoint_factory, tmp_path):
    """Forced swap preemption: the plugin's file tier and the builtin host tier of the same
    size decide the same swaps (the engine's index is the same) and give the outputs of
    an engine without a tier; every block moved through the plugin's copies, and its
    files hold the swapped KV."""
    path = tiny_checkpoint_factory(**SHAPE)
    prompts = make_prompts(7)
    plain = outputs(LLM(model=str(path), **PREEMPTING, preemption_mode="recompute"), prompts, PARAMS)

    host = LLM(model=str(path), **PREEMPTING, kv_offload_memory="1MiB", preemption_mode="swap")
    assert_same(plain, outputs(host, prompts, PARAMS))
    heng = host.llm_engine
    assert isinstance(heng.runner.kv_connector, HostTierConnector)  # the host tier is the builtin connector
    assert heng.kv.connector is heng.runner.kv_connector

    store = tmp_path / "tier"
    store.mkdir()
    tier = LLM(
        model=str(path),
        **PREEMPTING,
        kv_connector=f"filetier:{store}",
        kv_connector_memory="1MiB",
        preemption_mode="swap",
    )
    assert_same(plain, outputs(tier, prompts, PARAMS))
    teng = tier.llm_engine
    (conn,) = tier_plugin.INSTANCES
    assert teng.runner.kv_connector is conn and teng.kv.connector is conn
    hstats, tstats = heng.stats(), teng.stats()
    assert tstats.num_swap_outs > 0 and tstats.num_swap_ins == tstats.num_swap_outs
    assert {c: getattr(tstats, c) for c in TIER_COUNTERS} == {c: getattr(hstats, c) for c in TIER_COUNTERS}
    # Every block copied, per layer and tensor, went through the plugin's copies.
    layers = len(teng.runner.kv_caches)
    assert tier_plugin.COPIES["save"] == 2 * layers * (tstats.kv_blocks_swapped_out + tstats.kv_blocks_spilled)
    assert tier_plugin.COPIES["load"] == 2 * layers * (tstats.kv_blocks_swapped_in + tstats.kv_blocks_reloaded)
    # The store is the files: their bytes are the runner's store tensors, and hold KV.
    assert len(conn.files) == 2 * layers
    assert any(Path(f).read_bytes().strip(b"\0") for f in conn.files)
    teng.kv.check_invariants()
    assert teng.kv.pool.num_in_use == 0 and all(b.ref_cnt == 0 for b in teng.kv.host.blocks)


def test_plugin_tier_spills_and_reloads_prefixes(tier_plugin, tiny_checkpoint_factory, tmp_path):
    """Prefixes evicted from a 16-block device cache spill to the plugin's tier and come
    back from it, exactly as with the host tier: the same tokens computed, reloaded and
    generated."""
    path = tiny_checkpoint_factory(**SHAPE)
    rounds = shared_prefix_rounds(1)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1)

    def run(**kwargs):
        llm = LLM(model=str(path), **SMALL_DEVICE, **kwargs)
        got, computed = [], []
        for prompts in rounds:
            before = llm.llm_engine.kv.num_scheduled_tokens
            got.append(outputs(llm, prompts, params))
            computed.append(llm.llm_engine.kv.num_scheduled_tokens - before)
        return llm, got, computed

    _, plain, _ = run()
    host, host_out, host_computed = run(kv_offload_memory="256KiB")
    store = tmp_path / "tier"
    store.mkdir()
    tier, tier_out, tier_computed = run(kv_connector=f"filetier:{store}", kv_connector_memory="256KiB")
    for a, b in zip(plain, tier_out):
        assert_same(a, b)
    assert tier_computed == host_computed and tier_computed[1] == 4 * (3 + 3)
    kv = tier.llm_engine.kv
    assert kv.num_spilled_blocks > 0 and kv.num_reloaded_tokens == host.llm_engine.kv.num_reloaded_tokens > 0


def test_plugin_tier_swaps_without_prefix_caching(tier_plugin, tiny_checkpoint_factory, tmp_path):
    """A device-layout connector carries swap preemption alone (no prefix cache): allowed,
    and it computes only the useful tokens."""
    path = tiny_checkpoint_factory(**SHAPE)
    prompts = make_prompts(7)
    store = tmp_path / "tier"
    store.mkdir()
    llm = LLM(
        model=str(path),
        **PREEMPTING,
        kv_connector=f"filetier:{store}",
        kv_connector_memory="1MiB",
        preemption_mode="swap",
        enable_prefix_caching=False,
    )
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_NEW]
    llm.generate(prompts, params, use_tqdm=False)
    useful = sum(len(p) for p in prompts) + sum(n - 1 for n in MAX_NEW)
    assert llm.llm_engine.kv.num_scheduled_tokens == useful
    assert llm.llm_engine.kv.num_swap_outs > 0


class DictStore:
    """A content store for the manager alone (no model)."""

    def __init__(self, save_mode: str) -> None:
        self.save_mode = save_mode
        self.blocks: dict[str, object] = {}

    def contains(self, key):
        return key in self.blocks

    def load(self, key):
        return self.blocks.get(key)


def _run_whole(kv, r: Request) -> None:
    blocks, n = kv.get_computed_blocks(r)
    r.num_computed_tokens = n
    assert kv.allocate_slots(r, r.num_tokens - n, blocks) is not None
    r.num_computed_tokens = r.num_tokens


def _finish(kv, r: Request) -> None:
    r.status = RequestStatus.FINISHED_STOPPED
    kv.free(r)


@pytest.mark.parametrize("mode", ["write-through", "on-evict"])
def test_content_store_save_modes(mode):
    """write-through saves each full block one step after it is registered; on-evict saves
    nothing until the device pool evicts a block, then exactly the evicted blocks, in the
    step that evicts them."""
    kv = ConnectorKVCacheManager(4, 4, DictStore(mode), "seed")
    a = Request("a", list(range(9)), SamplingParams(max_tokens=1))
    _run_whole(kv, a)
    a_blocks = [b.block_id for b in kv.req_blocks["a"][:2]]
    first = kv.take_transfers()
    assert first is None  # registered this step: written by its forward
    _finish(kv, a)
    second = kv.flush_transfers()
    if mode == "write-through":
        assert [b for b, _ in second.saves] == a_blocks
        return
    assert second is None
    b = Request("b", list(range(100, 116)), SamplingParams(max_tokens=1))
    _run_whole(kv, b)  # takes every block: a's two cached blocks are evicted
    third = kv.take_transfers()
    assert sorted(blk for blk, _ in third.saves) == sorted(a_blocks)
    assert kv.num_saved_blocks == 2
    assert len({key for _, key in third.saves}) == 2


def test_on_evict_content_store_in_the_engine(tier_plugin, tiny_checkpoint_factory):
    """A plugin content store with save_mode="on-evict": saves only what the device evicts,
    loads it back for later prompts, the outputs unchanged; with room for everything on
    the device it saves nothing."""
    path = tiny_checkpoint_factory(**SHAPE)
    rounds = shared_prefix_rounds(1)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1)
    plain = LLM(model=str(path), **SMALL_DEVICE)
    expected = [outputs(plain, ps, params) for ps in rounds]
    llm = LLM(model=str(path), **SMALL_DEVICE, kv_connector="evictstore")
    for ps, want in zip(rounds, expected):
        assert_same(want, outputs(llm, ps, params))
    (store,) = tier_plugin.EVICT_STORES
    kv = llm.llm_engine.kv
    assert kv.num_saved_blocks == len(store.saved) > 0 and kv.num_loaded_blocks > 0
    big = LLM(model=str(path), **{**SMALL_DEVICE, "num_gpu_blocks_override": 128}, kv_connector="evictstore")
    outputs(big, rounds[0], params)
    big.llm_engine.flush_kv_transfers()
    assert big.llm_engine.kv.num_saved_blocks == 0 and not tier_plugin.EVICT_STORES[1].saved


def test_device_layout_connector_config_rules(tier_plugin, tiny_checkpoint_factory, tmp_path):
    """A device-layout connector is accepted with tensor/pipeline parallelism, swap
    preemption and without prefix caching; a content store still is not -- a plugin's
    kind is told from its registration before weights load (the settings themselves
    cannot import the plugins)."""
    tp2 = ParallelConfig(tensor_parallel_size=2)
    check_kv_connector(EngineConfig(cache=CacheConfig(kv_connector="filetier:/x"), parallel=tp2))
    check_kv_connector(
        EngineConfig(cache=CacheConfig(kv_connector="filetier:/x", preemption_mode="swap", enable_prefix_caching=False))
    )
    with pytest.raises(ValueError, match="kv_connector='evictstore' is not supported with tensor/pipeline"):
        check_kv_connector(EngineConfig(cache=CacheConfig(kv_connector="evictstore"), parallel=tp2))
    with pytest.raises(ValueError, match="needs enable_prefix_caching"):
        check_kv_connector(EngineConfig(cache=CacheConfig(kv_connector="evictstore", enable_prefix_caching=False)))
    path = tiny_checkpoint_factory(**SHAPE)
    with pytest.raises(ValueError, match="needs a host KV tier: kv_connector='evictstore' is a store by content"):
        LLM(model=str(path), **PREEMPTING, kv_connector="evictstore", preemption_mode="swap")
    assert not tier_plugin.EVICT_STORES  # refused before the engine built anything
    with pytest.raises(ValueError, match="cannot be combined with kv_offload_memory"):
        EngineConfig(cache=CacheConfig(kv_connector="filetier:/x", kv_offload_memory="1MiB"))
    # The builtin names are content stores, refused with the settings.
    with pytest.raises(ValueError, match="needs a host KV tier"):
        CacheConfig(kv_connector="host", preemption_mode="swap")
    assert set(BUILTIN_CONNECTORS) == set(BUILTIN_KV_CONNECTORS)
    with pytest.raises(ValueError, match=r"kv_connector='filetier:.*' with kv_connector_memory=100 bytes holds no"):
        LLM(
            model=str(path),
            **PREEMPTING,
            kv_connector=f"filetier:{tmp_path}",
            kv_connector_memory=100,
        )


def test_conformance_kit_checks_device_layout_connectors(tier_plugin):
    from pagedserve.testing import run_conformance

    report = run_conformance("cpu", engine=False, only=["connector:"])
    assert report.ok, report.format()
    assert sorted(r.id for r in report.results) == ["connector:evictstore", "connector:filetier"]


def test_conformance_kit_fails_a_tier_that_ignores_the_mapping(tmp_path):
    """A device-layout connector whose load pairs the mapping's slots with the wrong
    destinations fails, named; so does one registered through a factory that hides
    device_layout (the engine could not tell it apart before creating it)."""
    from types import SimpleNamespace

    from pagedserve.platforms import DeviceLayoutKVConnector, discover, hookimpl
    from pagedserve.testing import run_conformance

    class Sloppy(DeviceLayoutKVConnector):
        def __init__(self, arg=None, max_bytes=0, fingerprint=""):
            super().__init__(max_bytes)

        def load_blocks(self, swap_blocks, store, device, mapping):
            swap_blocks(store, device, torch.stack([mapping[:, 0].flip(0), mapping[:, 1]], 1))

    @hookimpl
    def pagedserve_register_kv_connectors(register):
        register("sloppy", Sloppy)
        register("hidden", lambda arg, max_bytes, fingerprint: Sloppy(arg, max_bytes))

    reg = discover()
    reg.register_plugin(SimpleNamespace(pagedserve_register_kv_connectors=pagedserve_register_kv_connectors), "sl")
    report = run_conformance("cpu", registry=reg, engine=False, only=["connector:"])
    failed = {r.id: r.message for r in report.failed}
    assert set(failed) == {"connector:sloppy", "connector:hidden"}
    assert "saved and loaded back into block" in failed["connector:sloppy"]
    assert "registered factory" in failed["connector:hidden"]


def test_store_tensors_follow_the_platform_layout():
    """The builtin host tier's slots: the platform's kv_cache_shape, pinned when it can pin."""
    from pagedserve.platforms import current_platform

    platform = current_platform("cpu")
    k, v = HostTierConnector(2**20).allocate(platform, 5, 16, 2, 8, torch.bfloat16)
    assert tuple(k.shape) == tuple(platform.kv_cache_shape(5, 16, 2, 8)) and k.dtype == torch.bfloat16
    assert k.data_ptr() != v.data_ptr() and not k.any()
    assert HostTierConnector(2**20).num_blocks(1000) == 2**20 // 1000


@pytest.mark.slow
def test_plugin_tier_under_tensor_parallelism(tier_plugin, tiny_checkpoint_factory, tmp_path):
    """TP=2 (worker processes): every rank creates its own store from the plugin (its own
    files) and runs rank 0's copies against it; the swaps give one process's tokens."""
    path = tiny_checkpoint_factory(**SHAPE)
    prompts = make_prompts(7)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_NEW]
    plain = LLM(model=str(path), **PREEMPTING, preemption_mode="recompute")
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    store = tmp_path / "tier"
    store.mkdir()
    llm = LLM(
        model=str(path),
        **PREEMPTING,
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
        kv_connector=f"filetier:{store}",
        kv_connector_memory="1MiB",
        preemption_mode="swap",
    )
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.llm_engine.stats()
    finally:
        llm.llm_engine.shutdown()
    assert got == expected
    assert stats.num_swap_outs > 0 and stats.num_swap_ins == stats.num_swap_outs
    pids = {f.name.split("-")[0] for f in store.glob("*.kv")}
    assert len(pids) == 2  # one store per rank


@pytest.mark.parametrize("max_window_layers", [0, 1])
def test_plugin_tier_with_freed_window_blocks_is_refused(
    tier_plugin, tiny_checkpoint_factory, tmp_path, max_window_layers
):
    """A plugin's device-layout tier is held to the host tier's rules for windowed
    models: with the slid-out blocks freed (one window for every layer, or KV cache
    groups with recompute preemption) it is refused before weights load or a store is
    made; keeping every block serves."""
    path = tiny_checkpoint_factory(
        arch="qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=max_window_layers
    )
    spec = f"filetier:{tmp_path}"
    match = (
        rf"kv_connector='{spec}' \(a device-layout KV tier\) cannot be combined with freeing"
        if max_window_layers == 0
        else rf"kv_connector='{spec}' \(a device-layout KV tier\) with preemption_mode='recompute'"
    )
    mode = {} if max_window_layers == 0 else {"preemption_mode": "recompute"}
    with pytest.raises(ValueError, match=match):
        LLM(model=str(path), **PREEMPTING, kv_connector=spec, **mode)
    assert not tier_plugin.INSTANCES
    llm = LLM(model=str(path), **PREEMPTING, kv_connector=spec, free_sliding_window_blocks=False)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4 and tier_plugin.INSTANCES
