"""The engine flags of docs/engine_settings.md at work on the tiny model: chunked prefill
off, --kv-cache-dtype, --tokenizer, --num-gpu-blocks-override and --max-logprobs."""

from __future__ import annotations

import json
import math
import random
import shutil

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.entrypoints import cli
from pagedserve.loader.tokenizer import Tokenizer

BASE = {"dtype": "float32", "kv_cache_memory": "16MiB", "threads": 1}


def random_prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def record_schedule(llm: LLM) -> list[tuple[str, int, int, int]]:
    """(request id, computed before, new tokens, tokens) for every scheduled item."""
    sched = llm.llm_engine.scheduler
    seen: list[tuple[str, int, int, int]] = []
    inner = sched.schedule

    def schedule():
        out = inner()
        seen.extend(
            (s.request.request_id, s.request.num_computed_tokens, s.num_new_tokens, s.request.num_tokens)
            for s in out.scheduled
        )
        return out

    sched.schedule = schedule
    return seen


def test_chunked_prefill_off_schedules_prompts_whole(tiny_llama):
    lengths = [20, 25, 30, 12]
    prompts = random_prompts(lengths, 259)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    runs = {}
    for chunked in (True, False):
        llm = LLM(model=str(tiny_llama), enable_chunked_prefill=chunked, max_num_batched_tokens=32, **BASE)
        seen = record_schedule(llm)
        runs[chunked] = (llm.generate(prompts, params, use_tqdm=False), seen)
        assert llm.llm_engine.kv.pool.num_in_use == 0  # every block given back
    prefill = {
        c: [(rid, done, n, total) for rid, done, n, total in seen if done < lengths[int(rid)]]
        for c, (_, seen) in runs.items()
    }
    # With the default a prompt is split to fill the step; without, never.
    assert any(done + n < total for _, done, n, total in prefill[True])
    assert all(done == 0 and n == total for _, done, n, total in prefill[False])
    assert sorted(rid for rid, *_ in prefill[False]) == ["0", "1", "2", "3"]
    for on, off in zip(runs[True][0], runs[False][0]):
        a, b = on.outputs[0], off.outputs[0]
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs):
            assert la.keys() == lb.keys()
            assert all(math.isclose(la[t].logprob, lb[t].logprob, abs_tol=1e-4) for t in la)


def test_chunked_prefill_off_refuses_a_prompt_longer_than_the_budget(tiny_llama):
    llm = LLM(model=str(tiny_llama), enable_chunked_prefill=False, max_num_batched_tokens=16, **BASE)
    long, short = random_prompts([17, 16], 259)
    with pytest.raises(
        ValueError, match="prompt has 17 tokens, more than max_num_batched_tokens=16; with chunked prefill disabled"
    ):
        llm.generate([short, long], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()  # nothing was queued
    assert llm.llm_engine.kv.pool.num_in_use == 0
    out = llm.generate([short], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_kv_cache_dtype_flag(tiny_llama, capsys):
    llm = LLM(model=str(tiny_llama), kv_cache_dtype="auto", **BASE)
    assert llm.llm_engine.config.cache.cache_dtype == "auto"
    fp8 = LLM(model=str(tiny_llama), kv_cache_dtype="fp8", **BASE)  # the flag reaches the cache
    assert fp8.llm_engine.config.cache.cache_dtype == "fp8"
    assert all(c.dtype == torch.float8_e4m3fn for c in fp8.llm_engine.runner.kv_caches[0])
    int8 = LLM(model=str(tiny_llama), kv_cache_dtype="int8", **BASE)
    assert all(c.dtype == torch.int8 for c in int8.llm_engine.runner.kv_caches[0])
    with pytest.raises(SystemExit, match="cache_dtype='int4' is not supported"):
        cli.main(["generate", str(tiny_llama), "--kv-cache-dtype", "int4"])


def write_shuffled_tokenizer(src, dst) -> Tokenizer:
    """``src``'s byte tokenizer with its byte tokens' ids permuted: same size, other ids."""
    dst.mkdir()
    data = json.loads((src / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    specials = {t["content"] for t in data["added_tokens"]}
    plain = sorted((t for t in vocab if t not in specials), key=lambda t: vocab[t])
    ids = [vocab[t] for t in plain]
    random.Random(1).shuffle(ids)
    data["model"]["vocab"] = {**{t: vocab[t] for t in specials}, **dict(zip(plain, ids))}
    (dst / "tokenizer.json").write_text(json.dumps(data))
    shutil.copy(src / "tokenizer_config.json", dst / "tokenizer_config.json")
    return Tokenizer.from_folder(dst)


def test_tokenizer_flag_replaces_the_models_tokenizer(tiny_llama, tmp_path):
    other = write_shuffled_tokenizer(tiny_llama, tmp_path / "tok")
    own = Tokenizer.from_folder(tiny_llama)
    text = "Paged attention, prefix caching!"
    assert other.encode(text) != own.encode(text)
    llm = LLM(model=str(tiny_llama), tokenizer=str(tmp_path / "tok"), **BASE)
    out = llm.generate([text], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert out.prompt_token_ids == other.encode(text)
    assert out.outputs[0].text == other.decode(out.outputs[0].token_ids)
    # The CLI flag reaches the same place.
    args = [
        "generate",
        str(tiny_llama),
        "--tokenizer",
        str(tmp_path / "tok"),
        "-p",
        text,
        "--max-tokens",
        "2",
        "--dtype",
        "float32",
        "--json",
        "--threads",
        "1",
    ]
    assert cli.main(args) == 0
    # A tokenizer with ids the model's embedding lacks is refused before generating.
    with pytest.raises(ValueError, match="has 49152 tokens, more than the model's vocabulary \\(259\\)"):
        LLM(model=str(tiny_llama), tokenizer="smollm2-135m-instruct", **BASE)
    with pytest.raises(ValueError, match="tokenizer='/nonexistent/tok'"):
        LLM(model=str(tiny_llama), tokenizer="/nonexistent/tok", **BASE)


@pytest.mark.parametrize("keyword", ["num_gpu_blocks_override", "num_kv_blocks_override"])
def test_kv_block_count_override(tiny_llama, keyword):
    llm = LLM(model=str(tiny_llama), max_model_len=128, **{keyword: 13}, **BASE)
    assert llm.llm_engine.runner.num_blocks == 13 == llm.llm_engine.kv.num_blocks
    args = cli.build_parser(["serve"]).parse_args(["serve", "--" + keyword.replace("_", "-"), "9"])
    assert args.num_gpu_blocks_override == 9


def test_max_logprobs_refuses_larger_requests(tiny_llama):
    llm = LLM(model=str(tiny_llama), max_logprobs=2, **BASE)
    prompt = random_prompts([5], 259)
    with pytest.raises(ValueError, match="logprobs=3 is more than this engine's max_logprobs=2"):
        llm.generate(prompt, SamplingParams(max_tokens=2, logprobs=3), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate(prompt, SamplingParams(max_tokens=2, logprobs=2, ignore_eos=True), use_tqdm=False)[0]
    assert all(len(entry) >= 2 for entry in out.outputs[0].logprobs)


def test_http_requests_over_the_limits_get_400(tiny_llama):
    from fastapi.testclient import TestClient

    from pagedserve.async_engine import AsyncLLMEngine
    from pagedserve.entrypoints.openai import ServerSettings, build_app

    llm = LLM(model=str(tiny_llama), max_logprobs=1, enable_chunked_prefill=False, max_num_batched_tokens=16, **BASE)
    app = build_app(AsyncLLMEngine(llm.llm_engine), ServerSettings(served_model_names=["tiny"]))
    with TestClient(app) as client:
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2, "logprobs": 2})
        assert r.status_code == 400 and "max_logprobs=1" in r.json()["error"]["message"]
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": list(range(3, 23)), "max_tokens": 2})
        assert r.status_code == 400 and "max_num_batched_tokens=16" in r.json()["error"]["message"]
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2, "logprobs": 1})
        assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is not None
