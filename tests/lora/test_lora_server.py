"""Adapters over HTTP: `model` picks one, /v1/models lists them, runtime load/unload
behind --allow-runtime-lora-updating, errors in OpenAI's shape."""

from __future__ import annotations

import argparse

import pytest
from test_lora_errors import write_adapter

from pagedserve import LLM, SamplingParams
from pagedserve.lora import LoRARequest

PROMPT = [5, 6, 7, 8]


def body(model, **kw):
    return {"model": model, "prompt": PROMPT, "max_tokens": 5, "temperature": 0, **kw}


@pytest.fixture(scope="module")
def served(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("http-adapters")
    paths = {n: write_adapter(root / n, r=4, targets=("q_proj",)) for n in ("sql", "chat")}
    # Different weights per adapter: rewrite "chat" with another rank.
    paths["chat"] = write_adapter(root / "chat2", r=2, targets=("q_proj",))
    llm = LLM(
        model=str(tiny_llama),
        dtype="float32",
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        kv_cache_memory="8MiB",
        max_model_len=128,
    )
    params = SamplingParams(temperature=0.0, max_tokens=5)
    want = {
        name: llm.generate([PROMPT], params, use_tqdm=False, lora_request=LoRARequest(name, i + 1, str(p)))[0]
        .outputs[0]
        .token_ids
        for i, (name, p) in enumerate(paths.items())
    }
    want["tiny"] = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
    assert want["sql"] != want["tiny"] and want["chat"] != want["sql"]
    return llm, paths, want, root


def client_for(llm, modules, allow):
    from fastapi.testclient import TestClient

    from pagedserve.async_engine import AsyncLLMEngine
    from pagedserve.entrypoints.openai import ServerSettings, build_app

    settings = ServerSettings(
        served_model_names=["tiny"], lora_modules=tuple(modules), allow_runtime_lora_updating=allow
    )
    return TestClient(build_app(AsyncLLMEngine(llm.llm_engine), settings))


def tokens(r):
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_model_picks_adapter_and_models_lists_them(served):
    llm, paths, want, _ = served
    tok = llm.get_tokenizer()
    with client_for(llm, [(n, str(p)) for n, p in paths.items()], allow=False) as client:
        cards = client.get("/v1/models").json()["data"]
        assert [(c["id"], c["parent"]) for c in cards] == [("tiny", None), ("sql", "tiny"), ("chat", "tiny")]
        assert client.get("/v1/models/sql").json()["parent"] == "tiny"
        for name in ("tiny", "sql", "chat"):
            r = client.post("/v1/completions", json=body(name))
            assert tokens(r) == tok.decode(want[name]), name
            assert r.json()["model"] == name
        r = client.post(
            "/v1/chat/completions",
            json={"model": "sql", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        )
        assert r.status_code == 200 and r.json()["model"] == "sql"
        r = client.post("/v1/completions", json=body("nope"))
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(paths["sql"])})
        assert r.status_code == 403 and "--allow-runtime-lora-updating" in r.json()["error"]["message"]
    assert llm.llm_engine.kv.pool.num_in_use == 0


def test_runtime_load_and_unload(served):
    llm, paths, want, root = served
    tok = llm.get_tokenizer()
    with client_for(llm, [], allow=True) as client:
        assert client.post("/v1/completions", json=body("sql")).status_code == 404
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": str(paths["sql"])})
        assert r.status_code == 200, r.text
        assert tokens(client.post("/v1/completions", json=body("sql"))) == tok.decode(want["sql"])
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": str(paths["sql"])})
        assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]
        bad = write_adapter(root / "wide", shape_in=96)
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "wide", "lora_path": str(bad)})
        assert r.status_code == 400 and "another base model" in r.json()["error"]["message"]
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "gone", "lora_path": str(root / "nowhere")})
        assert r.status_code == 404 and r.json()["error"]["param"] == "lora_path"
        r = client.post(
            "/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": str(write_adapter(root / "big", r=16))}
        )
        assert r.status_code == 400 and "max_lora_rank=8" in r.json()["error"]["message"]
        # Still serving the good adapter and the base.
        assert tokens(client.post("/v1/completions", json=body("sql"))) == tok.decode(want["sql"])
        assert tokens(client.post("/v1/completions", json=body("tiny"))) == tok.decode(want["tiny"])
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}).status_code == 200
        r = client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
        assert r.status_code == 404 and r.json()["error"]["message"].startswith("The lora adapter 'sql'")
        assert client.post("/v1/completions", json=body("sql")).status_code == 404
        r = client.post("/v1/load_lora_adapter", json={"lora_path": "/x"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
    assert llm.llm_engine.kv.pool.num_in_use == 0


def test_lora_module_flags(tmp_path):
    from pagedserve.entrypoints.cli.lora_args import add_lora_server_arguments, lora_modules_from_args

    parser = argparse.ArgumentParser()
    add_lora_server_arguments(parser)
    args = parser.parse_args(["--lora-modules", "a=/p/a", '{"name": "b", "path": "/p/b", "base_model_name": "m"}'])
    assert lora_modules_from_args(args, True) == [("a", "/p/a"), ("b", "/p/b")]
    with pytest.raises(ValueError, match="need --enable-lora"):
        lora_modules_from_args(args, False)
    for bad, msg in (("a", "name=path"), ("{", "not valid JSON"), ('{"name": "a"}', "'name' and 'path'")):
        with pytest.raises(ValueError, match=msg):
            lora_modules_from_args(parser.parse_args(["--lora-modules", bad]), True)
    with pytest.raises(ValueError, match="more than once"):
        lora_modules_from_args(parser.parse_args(["--lora-modules", "a=/x", "a=/y"]), True)
