"""The cases of the matrix's equality suites (tests/compat/test_compat_*.py): per feature,
what its cells run on the cell's engine and on the single-process engine with the same
settings, and how the two results compare; the engines, shared across cells."""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import json
import re
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pagedserve import LLM, SamplingParams, StructuredOutputsParams
from pagedserve.beam_search import BeamSearchParams
from pagedserve.entrypoints.engine_args import engine_config_from_kwargs
from pagedserve.lora import LoRARequest
from pagedserve.testing.compat_matrix import TINY_HF_CONFIG, cell_kwargs, suite_cells

LOGPROB_TOL = 1e-3
EMBED_TOL = 1e-4
#: Under tests/conftest.py's make_tiny_checkpoint, the shape compat_matrix's checks use.
TINY = dict(
    arch="llama",
    hidden_size=TINY_HF_CONFIG["hidden_size"],
    num_layers=TINY_HF_CONFIG["num_hidden_layers"],
    num_heads=TINY_HF_CONFIG["num_attention_heads"],
    num_kv_heads=TINY_HF_CONFIG["num_key_value_heads"],
    intermediate_size=TINY_HF_CONFIG["intermediate_size"],
)


def _prompts(seed: int = 0) -> list[list[int]]:
    """Lengths 3..30 (past the base settings' 16-token step: chunked) and two sharing a
    13-token prefix."""
    gen = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(3, TINY_HF_CONFIG["vocab_size"], (n,), generator=gen).tolist()

    shared = ids(13)
    return [ids(n) for n in (3, 6, 17, 30)] + [shared + ids(n) for n in (2, 9)]


def _params(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 8, "logprobs": 2, "ignore_eos": True, **kw})


def _rows(entries) -> list[dict[int, float]]:
    return [{t: lp.logprob for t, lp in e.items()} for e in entries or []]


def _same_logprobs(got, want) -> None:
    assert (got is None) == (want is None)
    g_rows, w_rows = _rows(got), _rows(want)
    assert len(g_rows) == len(w_rows)
    for g, w in zip(g_rows, w_rows):
        assert g.keys() == w.keys()
        for t in w:
            assert g[t] == pytest.approx(w[t], abs=LOGPROB_TOL)


def _same_generations(got, want) -> None:
    """Every completion of every request: tokens, finish reason, logprobs."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert len(g.outputs) == len(w.outputs)
        for go, wo in zip(g.outputs, w.outputs):
            assert go.token_ids == wo.token_ids
            assert go.finish_reason == wo.finish_reason
            _same_logprobs(go.logprobs, wo.logprobs)


# -- the cases: run(llm) -> result on the cell's engine and on its single-process twin ------------


def _generate(llm: LLM, prompts, params, **kw):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, **kw)


def _prefix_caching(llm: LLM, pool: Engines):
    prompts = _prompts(1)
    kv = llm.llm_engine.kv
    first = _generate(llm, prompts, _params())
    hits = kv.prefix_hits
    again = _generate(llm, prompts[::-1], _params())
    assert kv.prefix_hits > hits, "the second round of the same prompts hit no cached prefix"
    return first + again


def _greedy(llm: LLM, pool: Engines):
    return _generate(llm, _prompts(2), _params(max_tokens=10))


def _quantized(method: str) -> Callable[[LLM, Engines], object]:
    def run(llm: LLM, pool: Engines):
        used = getattr(llm.llm_engine.model_source, "method", None)
        assert used is not None and used.name == method, f"weights not loaded as {method}: {used}"
        return _greedy(llm, pool)

    return run


def _chunked(llm: LLM, pool: Engines):
    sched, prompts = llm.llm_engine.scheduler.config, _prompts(2)
    assert sched.enable_chunked_prefill and max(map(len, prompts)) > sched.max_num_batched_tokens
    return _generate(llm, prompts, _params(max_tokens=10))


def _preempting(llm: LLM, pool: Engines):
    before = llm.llm_engine.scheduler.num_preemptions
    out = _generate(llm, _prompts(3), _params(max_tokens=24))
    assert llm.llm_engine.scheduler.num_preemptions > before, "24 KV blocks did not force a preemption"
    return out


def _swapping(llm: LLM, pool: Engines):
    out = _preempting(llm, pool)
    assert llm.llm_engine.kv.num_swap_outs > 0, "preemption_mode='swap' preempted without swapping"
    return out


def _n_best_of(llm: LLM, pool: Engines):
    params = [
        _params(n=3, temperature=1.0, seed=11, max_tokens=6),
        _params(n=2, best_of=4, temperature=0.8, seed=5, max_tokens=6),
    ]
    out = _generate(llm, _prompts(4)[:2], params)
    assert [len(o.outputs) for o in out] == [3, 2]
    return out


def _beam_search(llm: LLM, pool: Engines):
    out = llm.beam_search(
        [{"prompt_token_ids": p} for p in _prompts(5)[1:4]], BeamSearchParams(beam_width=3, max_tokens=5)
    )
    assert all(len(o.sequences) == 3 for o in out)
    return [[(s.tokens, s.cum_logprob) for s in o.sequences] for o in out]


def _same_beams(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        assert [t for t, _ in g] == [t for t, _ in w]
        assert [c for _, c in g] == pytest.approx([c for _, c in w], abs=LOGPROB_TOL)


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[A-Z]{2}"
CHOICES = ["yes", "no", "maybe so"]


def _structured(llm: LLM, pool: Engines):
    so = StructuredOutputsParams
    cases = [
        ("A person: ", _params(max_tokens=40, ignore_eos=False, structured_outputs=so(json=PERSON))),
        ("A part: ", _params(temperature=1.0, seed=1, ignore_eos=False, structured_outputs=so(regex=REGEX))),
        ("Pick: ", _params(logprobs=None, ignore_eos=False, structured_outputs=so(choice=CHOICES))),
    ]
    out = llm.generate([c[0] for c in cases], [c[1] for c in cases], use_tqdm=False)
    json_out, regex_out, choice_out = (o.outputs[0] for o in out)
    # Each constraint holds on its own, whatever the single process does.
    if json_out.finish_reason == "stop":
        value = json.loads(json_out.text)
        assert set(value) == {"name", "age"} and isinstance(value["age"], int), json_out.text
    else:
        assert json_out.text.lstrip().startswith("{"), json_out.text
    assert re.fullmatch(REGEX, regex_out.text), regex_out.text
    assert choice_out.text in CHOICES, choice_out.text
    return out


def _logits_processors(llm: LLM, pool: Engines):
    prompts = _prompts(6)[:3]
    allowed = [40, 41, 42, 43]
    params = [
        _params(logit_bias={77: 100.0}),
        _params(allowed_token_ids=allowed),
        _params(bad_words=["a", "e"]),
    ]
    out = _generate(llm, prompts, params)
    biased, only, banned = (o.outputs[0] for o in out)
    assert set(biased.token_ids) == {77}
    assert set(only.token_ids) <= set(allowed)
    tok = llm.get_tokenizer()
    assert not {tok.encode(w, add_special_tokens=False)[0] for w in ("a", "e")} & set(banned.token_ids)
    return out


def _prompt_logprobs(llm: LLM, pool: Engines):
    out = _generate(llm, _prompts(7)[2:5], _params(max_tokens=2, prompt_logprobs=2))
    assert all(o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == len(o.prompt_token_ids) for o in out)
    return out


def _same_prompt_logprobs(got, want) -> None:
    _same_generations(got, want)
    for g, w in zip(got, want):
        _same_logprobs(g.prompt_logprobs[1:], w.prompt_logprobs[1:])


def _priority(llm: LLM, pool: Engines):
    assert llm.llm_engine.scheduler.config.policy == "priority"
    prompts = _prompts(8)
    return _generate(llm, prompts, _params(max_tokens=16), priority=[3, 0, 2, 1, 5, 4])


def _pooling(llm: LLM, pool: Engines):
    return [torch.tensor(o.outputs.embedding) for o in llm.embed([{"prompt_token_ids": p} for p in _prompts(9)])]


def _same_embeddings(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape == (TINY_HF_CONFIG["hidden_size"],)
        torch.testing.assert_close(g, w, atol=EMBED_TOL, rtol=0)


def _lora(llm: LLM, pool: Engines):
    """Each prompt with and without the adapter in one batch, twice (the second round
    reuses cached, possibly spilled, blocks: they must be the adapter's own)."""
    lora = LoRARequest("a", 1, str(pool.adapter()))
    prompts = _prompts(10)
    loras = [lora, None] * len(prompts)
    doubled = [p for p in prompts for _ in range(2)]
    first = _generate(llm, doubled, _params(), lora_request=loras)
    assert any(a.outputs[0].token_ids != b.outputs[0].token_ids for a, b in zip(first[::2], first[1::2]))
    again = _generate(llm, doubled[::-1], _params(), lora_request=loras[::-1])
    return first + again


def _speculative(llm: LLM, pool: Engines):
    """Greedy tokens and logprobs with drafts verified (prompts that repeat themselves, so
    that n-gram lookup finds proposals too)."""
    spec = llm.llm_engine.spec
    assert spec is not None, "speculative_config was set but no proposer runs"
    before = spec.num_draft_tokens
    prompts = [p[:8] * 4 for p in _prompts(11)[2:6]]
    out = _generate(llm, prompts, _params(max_tokens=12))
    assert spec.num_draft_tokens > before, "no token was drafted"
    return out


#: The attention window of the layers of the kv_groups model, in tokens (two blocks).
WINDOW = 8


def make_windowed_checkpoint(path: Path) -> Path:
    """A tiny random Gemma 2 (4 layers alternating an ``WINDOW``-token window and full
    attention; the tiny Llama's heads and widths), saved by transformers."""
    import transformers

    from pagedserve.testing.tiny_model import write_byte_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    vocab = write_byte_tokenizer(path)
    config = transformers.Gemma2Config(
        vocab_size=vocab,
        hidden_size=TINY_HF_CONFIG["hidden_size"],
        intermediate_size=TINY_HF_CONFIG["intermediate_size"],
        num_hidden_layers=4,
        num_attention_heads=TINY_HF_CONFIG["num_attention_heads"],
        num_key_value_heads=TINY_HF_CONFIG["num_key_value_heads"],
        head_dim=16,
        sliding_window=WINDOW,
        query_pre_attn_scalar=16,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    gen = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.Gemma2ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = (0.2 if "embed" in name else 0.08) if p.dim() >= 2 else 0.1  # norms apply 1 + w
            p.copy_(torch.randn(p.shape, generator=gen) * scale)
    model.to(torch.float32).save_pretrained(path, safe_serialization=True)
    return path


def _kv_groups(llm: LLM, pool: Engines):
    """Generation far past the window, in a pool too small for every request's blocks:
    the windowed group frees slid-out blocks that others reuse."""
    from pagedserve.kv_cache.kv_groups import GroupedKVCacheManager

    if isinstance(llm, DataParallelEngine):
        assert llm.llm_engine.kv_cache_groups > 1, "the windowed layers got no KV cache group"
    else:
        assert isinstance(llm.llm_engine.kv, GroupedKVCacheManager), "the windowed layers got no KV cache group"
        runner = llm.llm_engine.runner
        # Under a device map each segment's layers share slot tensors among themselves only.
        owners: dict[int, int] = {}
        layer = 0
        for i, seg in enumerate(runner.segments):
            for k, _ in runner.kv_caches[layer : layer + seg.num_layers]:
                assert owners.setdefault(k.data_ptr(), i) == i, "a KV slot tensor spans two device-map segments"
            layer += seg.num_layers
    return _generate(llm, [p[:20] for p in _prompts(12)], _params(max_tokens=40))


def _sleep_mode(llm: LLM, pool: Engines):
    """Outputs after sleeping at each level and waking equal the ones before (and the
    single process's)."""
    prompts = _prompts(5)
    before = _generate(llm, prompts, _params())
    after = []
    for level in (1, 2):
        llm.sleep(level)
        assert llm.is_sleeping(), f"sleep({level}) left the engine awake"
        llm.wake_up()
        assert not llm.is_sleeping()
        after = _generate(llm, prompts, _params())
        _same_generations(after, before)
    return before + after


def _kv_connector(llm: LLM, pool: Engines):
    """The prompts' full blocks are saved to the connector's store; longer prompts then
    evict them from the small device pool, and the first prompts again load their prefixes
    from the store instead of recomputing them."""
    prompts, kv = _prompts(6), llm.llm_engine.kv
    gen = torch.Generator().manual_seed(7)
    fillers = [torch.randint(3, TINY_HF_CONFIG["vocab_size"], (40,), generator=gen).tolist() for _ in range(6)]
    first = _generate(llm, prompts, _params())
    filled = _generate(llm, fillers, _params(max_tokens=2))
    loaded = kv.num_loaded_blocks
    again = _generate(llm, prompts, _params())
    assert kv.num_loaded_blocks > loaded, "no prefix block was loaded from the connector's store"
    return first + filled + again


@dataclass(frozen=True)
class Case:
    run: Callable[[LLM, Engines], object]
    same: Callable[[object, object], None] = _same_generations


#: One entry per feature: what its cells run on both engines and how they compare.
CASES: dict[str, Case] = {
    "prefix_caching": Case(_prefix_caching),
    "chunked_prefill": Case(_chunked),
    "preemption_recompute": Case(_preempting),
    "preemption_swap": Case(_swapping),
    "n_best_of": Case(_n_best_of),
    "beam_search": Case(_beam_search, _same_beams),
    "structured_outputs": Case(_structured),
    "logits_processors": Case(_logits_processors),
    "prompt_logprobs": Case(_prompt_logprobs, _same_prompt_logprobs),
    "priority": Case(_priority),
    "pooling": Case(_pooling, _same_embeddings),
    "quant_int8": Case(_quantized("int8")),
    "quant_fp8": Case(_quantized("fp8")),
    "quant_gguf": Case(_quantized("gguf")),
    "quant_gptq_awq": Case(_quantized("gptq")),
    "lora": Case(_lora),
    "kv_groups": Case(_kv_groups),
    "spec_ngram": Case(_speculative),
    "spec_draft_model": Case(_speculative),
    "spec_self_quantized": Case(_speculative),
    "sleep_mode": Case(_sleep_mode),
    "kv_connector": Case(_kv_connector),
}


def cell_params(
    features: Iterable[str], deployments: Iterable[str], slow: Iterable[str] = (), slow_cells: Iterable = ()
) -> list:
    """``pytest.param(feature, deployment)`` for every cell of ``features`` x ``deployments``
    that config_rules allows, grouped by engine (deployment, then the cell's settings) so
    that consecutive cells share one; ``slow`` deployments and ``slow_cells`` marked slow."""
    deployments, slow, slow_cells = list(deployments), set(slow), set(map(tuple, slow_cells))
    cells = suite_cells(features, deployments)
    order = {d: i for i, d in enumerate(deployments)}
    cells.sort(key=lambda c: (order[c[1]], repr(engine_config_from_kwargs(**cell_kwargs(*c))), c[0]))
    return [
        pytest.param(f, d, id=f"{f}-{d}", marks=[pytest.mark.slow] if d in slow or (f, d) in slow_cells else [])
        for f, d in cells
    ]


class DisaggregatedEngine:
    """A DisaggregatedLLM where the cases expect an LLM: ``generate`` goes through the
    prefill instance and the KV hand-off; the rest is the decode instance's."""

    def __init__(self, **kwargs) -> None:
        from pagedserve.serving.disagg import DisaggregatedLLM

        self.disagg = DisaggregatedLLM(prefill_threads=1, **kwargs)
        self.llm_engine = self.disagg.llm.llm_engine

    def generate(self, prompts, params, use_tqdm: bool = False, **kw):
        return self.disagg.generate(prompts, params, **kw)

    def beam_search(self, prompts, params: BeamSearchParams):
        return self.disagg.beam_search(prompts, params)

    def get_tokenizer(self):
        return self.disagg.llm.get_tokenizer()

    def shutdown(self) -> None:
        self.disagg.shutdown()


class _RouterStats:
    """The counters the cases read off an engine, from the replicas' combined reports."""

    def __init__(self, router, config) -> None:
        self._router = router
        self.config = config

    @property
    def prefix_hits(self) -> int:
        return self._router.stats().prefix_cache_hits

    @property
    def num_swap_outs(self) -> int:
        return self._router.stats().num_swap_outs

    @property
    def num_spilled_blocks(self) -> int:
        return self._router.stats().kv_blocks_spilled

    @property
    def num_preemptions(self) -> int:
        return self._router.stats().num_preemptions

    @property
    def num_loaded_blocks(self) -> int:
        return self._router.stats().kv_connector_blocks_loaded

    @property
    def num_draft_tokens(self) -> int:
        return self._router.stats().spec_decode_num_draft_tokens


class _RouterView:
    """What the cases read of ``llm.llm_engine``, answered by the router: counters from
    the replicas' reports, the weights' form and KV cache groups from what each replica
    reported when it loaded (every replica must agree)."""

    def __init__(self, router, config) -> None:
        self.router = router
        counters = _RouterStats(router, config.scheduler)
        self.kv = self.scheduler = counters
        self.spec = counters if config.speculative.speculative_config is not None else None
        (weights,) = {s.weights for s in router.replica_status()}
        self.model_source = SimpleNamespace(method=None if weights == "float" else SimpleNamespace(name=weights))
        (self.kv_cache_groups,) = {s.kv_cache_groups for s in router.replica_status()}


class DataParallelEngine:
    """Two data-parallel replicas behind the router that ``pagedserve serve
    --data-parallel-size 2`` runs, where the cases expect an LLM: every request of a call
    goes to the router at once (so that both replicas serve), on an event loop of its own."""

    def __init__(self, **kwargs) -> None:
        from pagedserve.serving.data_parallel import DataParallelConfig
        from pagedserve.serving.router import DataParallelRouter

        config = engine_config_from_kwargs(**kwargs)
        self.router = DataParallelRouter(config, DataParallelConfig(size=2), log_level="warning")
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="compat-dp-loop", daemon=True)
        self.thread.start()
        self._call(self._start())
        self.llm_engine = _RouterView(self.router, config)
        self._ids = itertools.count()

    async def _start(self) -> None:
        self.router.start()

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=240)

    async def _one(self, prompt, params, **kw):
        text, ids = (prompt, None) if isinstance(prompt, str) else (None, prompt["prompt_token_ids"])
        stream = await self.router.add_request(f"c{next(self._ids)}", text, params, prompt_token_ids=ids, **kw)
        last = None
        async for out in stream:
            last = out
        assert last is not None and last.finished
        return last

    async def _all(self, calls):
        return await asyncio.gather(*calls)

    def generate(self, prompts, params, use_tqdm: bool = False, priority=None, lora_request=None):
        n = len(prompts)
        params = params if isinstance(params, list) else [params] * n
        priority = priority if priority is not None else [0] * n
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * n
        calls = [
            self._one(p, sp, priority=pr, lora_request=lo) for p, sp, pr, lo in zip(prompts, params, priority, loras)
        ]
        return self._call(self._all(calls))

    def embed(self, prompts):
        from pagedserve.pooling import PoolingParams

        calls = [self._one(p, SamplingParams(max_tokens=1), pooling_params=PoolingParams()) for p in prompts]
        return self._call(self._all(calls))

    def beam_search(self, prompts, params: BeamSearchParams):
        """As LLM.beam_search: each step's beams go to the router together."""
        from pagedserve.beam_search import BeamSearch

        ids = [p["prompt_token_ids"] for p in prompts]
        search = BeamSearch(ids, params, self.router.eos_token_ids, self.router.max_model_len)

        def expand(tokens, step):
            outs = self.generate([{"prompt_token_ids": t} for t in tokens], step)
            return [o.outputs[0].logprobs[0] for o in outs]

        search.run(expand)
        return search.outputs(lambda t: self.router.tokenizer.decode(t))

    def get_tokenizer(self):
        return self.router.tokenizer

    def shutdown(self) -> None:
        self.router.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


def ray_engine(**kwargs) -> LLM:
    """An LLM on the Ray executor, on a local Ray head started on first use (one logical
    CPU per rank, as tests/distributed/test_dist_ray.py starts it)."""
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'ray>=2.9')")
    if not ray.is_initialized():
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            log_to_driver=False,
            configure_logging=False,
        )
    return LLM(**kwargs)


#: How a deployment's engine is made when not by LLM(**cell_kwargs).
FACTORIES: dict[str, Callable[..., object]] = {
    "disagg": DisaggregatedEngine,
    "tp_ray": ray_engine,
    "dp": DataParallelEngine,
}


def _helper(folder: str, name: str):
    """A helper module of another test folder (tests/<folder>/<name>), under its own name."""
    path = Path(__file__).resolve().parents[1] / folder / name
    spec = importlib.util.spec_from_file_location(f"compat_{Path(name).stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Engines:
    """LLMs by their EngineConfig: single-process ones stay up for the module (they are
    cheap), a deployment's engine until the next one is needed."""

    def __init__(self, model: str, tmp: Path) -> None:
        self.model, self.tmp = model, tmp
        self.single: dict[str, LLM] = {}
        self.current: tuple[str, LLM] | None = None
        self.results: dict[tuple[str, str], object] = {}
        self._adapter: Path | None = None
        self._windowed: Path | None = None
        self._gguf: Path | None = None
        self._gptq: Path | None = None

    def adapter(self) -> Path:
        """A random PEFT adapter for the model (made once, with peft)."""
        if self._adapter is None:
            pytest.importorskip("peft")
            import transformers

            hf = transformers.AutoModelForCausalLM.from_pretrained(self.model, dtype=torch.float32)
            self._adapter = _helper("lora", "peft_adapters.py").make_adapter(hf, self.tmp / "adapter", seed=3, r=8)
        return self._adapter

    def model_for(self, feature: str) -> str:
        """The tiny Llama; for ``kv_groups`` a tiny Gemma 2 (windowed and full layers), for
        ``quant_gguf`` the tiny Llama written as a Q8_0 GGUF, for ``quant_gptq_awq`` as a
        GPTQ checkpoint (4 bits, groups of 32 rows, act-order)."""
        if feature == "kv_groups":
            if self._windowed is None:
                self._windowed = make_windowed_checkpoint(self.tmp / "gemma2")
            return str(self._windowed)
        if feature == "quant_gguf":
            if self._gguf is None:
                self._gguf = self._write_gguf()
            return str(self._gguf)
        if feature == "quant_gptq_awq":
            if self._gptq is None:
                support = _helper("quantization", "test_quant_support.py")
                self._gptq = support.write_quantized_pair(Path(self.model), self.tmp / "gptq", "gptq")[0]
            return str(self._gptq)
        return self.model

    def _write_gguf(self) -> Path:
        """The tiny Llama converted as llama.cpp's converter does (tests/models/gguf_convert.py)."""
        import shutil

        import transformers

        convert = _helper("models", "gguf_convert.py")
        folder = self.tmp / "gguf"
        folder.mkdir(exist_ok=True)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(Path(self.model) / name, folder / name)
        hf = transformers.AutoModelForCausalLM.from_pretrained(self.model, dtype=torch.float32)
        # The converter's gpt2 vocabulary adds one merged token: one more embedding row.
        hf.resize_token_embeddings(hf.config.vocab_size + 1, mean_resizing=False)
        return convert.write_gguf_like_llama_cpp(folder / "q8_0.gguf", hf, "llama", "Q8_0")

    def _key(self, kwargs: dict) -> str:
        return repr(engine_config_from_kwargs(**kwargs))

    def reference(self, feature: str):
        """The single-process result of ``feature``'s case (computed once)."""
        kwargs = cell_kwargs(feature, "single", model=self.model_for(feature))
        key = self._key(kwargs)
        if (key, feature) not in self.results:
            if key not in self.single:
                self.single[key] = LLM(**kwargs)
            self.results[(key, feature)] = CASES[feature].run(self.single[key], self)
        return self.results[(key, feature)]

    def get(self, feature: str, deployment: str) -> LLM:
        kwargs = cell_kwargs(feature, deployment, model=self.model_for(feature))
        key = deployment + self._key(kwargs)
        if self.current is not None and self.current[0] != key:
            self.current[1].shutdown()
            self.current = None
        if self.current is None:
            self.current = (key, FACTORIES.get(deployment, LLM)(**kwargs))
        return self.current[1]

    def close(self) -> None:
        if self.current is not None:
            self.current[1].shutdown()
        for llm in self.single.values():
            llm.shutdown()
        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():
            ray.shutdown()


#: Evidence that a deployment did its part, checked after each of its cells.
IN_USE: dict[str, Callable[[LLM], bool]] = {
    "tp_mp": lambda llm: llm.llm_engine.runner.model.num_heads == TINY_HF_CONFIG["num_attention_heads"] // 2,
    "tp_ray": lambda llm: llm.llm_engine.runner.model.num_heads == TINY_HF_CONFIG["num_attention_heads"] // 2,
    "pp": lambda llm: llm.llm_engine.runner.model.layer_end < llm.llm_engine.arch.num_layers,
    # Layers' weights live on the host and were streamed in for the forwards.
    "cpu_offload": lambda llm: (
        (s := llm.llm_engine.weight_streamer) is not None and bool(s.offloaded) and s.num_layer_copies > 0
    ),
    # The plugin's platform runs the model, its linear op the plugin's (ONNX Runtime).
    "plugin_ort": lambda llm: llm.llm_engine.ops.source("linear") == "pagedserve_ort",
    # Blocks of every prompt longer than one block came from the prefill instance.
    "disagg": lambda llm: llm.disagg.num_injected_blocks > 0,
    # The small device pool spills evicted cached blocks to the host tier (or swaps; KV
    # cache groups' tier only swaps).
    "kv_offload": lambda llm: getattr(llm.llm_engine.kv, "num_spilled_blocks", 0) + llm.llm_engine.kv.num_swap_outs > 0,
    # The layers run on more than one segment of the map.
    "device_map": lambda llm: len(llm.llm_engine.runner.segments) > 1,
    # Both replicas served requests of this cell's engine.
    "dp": lambda llm: all(s.routed > 0 and s.alive for s in llm.router.replica_status()),
}


def _fill_prefix_cache(llm: LLM, embed: bool = False) -> None:
    """Leave the device pool full of cached blocks of unrelated prompts, so that the
    cell's own requests must evict some (which the host tier spills), whether the pool
    hands out a fresh engine or one earlier cells used (a deployment's engine is kept
    only until another is needed: the order of the cells must not decide)."""
    kv = llm.llm_engine.kv
    if not hasattr(kv, "num_spilled_blocks"):  # KV cache groups' tier only swaps
        return
    gen = torch.Generator().manual_seed(1234)
    size = 4 * kv.block_size  # four full blocks each, cached when they finish
    prompts = [
        torch.randint(3, TINY_HF_CONFIG["vocab_size"], (size,), generator=gen).tolist()
        for _ in range(kv.pool.num_blocks // 4 + 1)
    ]
    if embed:  # an embedding engine's prompts are cached blocks too
        llm.embed([{"prompt_token_ids": p} for p in prompts])
    else:
        _generate(llm, prompts, _params(max_tokens=1))


def check_cell(engines: Engines, feature: str, deployment: str) -> None:
    """The cell's result equals the single process's, and its deployment was used."""
    want = engines.reference(feature)
    llm = engines.get(feature, deployment)
    if deployment == "kv_offload":
        _fill_prefix_cache(llm, embed=feature == "pooling")
    got = CASES[feature].run(llm, engines)
    CASES[feature].same(got, want)
    if deployment in IN_USE:
        assert IN_USE[deployment](llm), f"the {deployment} deployment was configured but not used"
