"""POST /v1/embeddings through the official `openai` client: equal to transformers'
final-norm hidden states pooled and normalised (tiny checkpoint with mean pooling, and
the default model with last pooling), base64 encoding, and 400s for bad input."""

from __future__ import annotations

import base64
import struct

import httpx
import pytest
import torch
from conftest import TINY_SERVER_ARGS


@torch.inference_mode()
def hf_embedding(model, ids: list[int], pooling: str) -> torch.Tensor:
    h = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0].float()
    v = {"last": h[-1], "mean": h.mean(dim=0), "cls": h[0]}[pooling]
    return torch.nn.functional.normalize(v, dim=0)


@pytest.fixture(scope="module")
def embed_server(server_factory, tiny_llama):
    return server_factory(
        str(tiny_llama),
        [*TINY_SERVER_ARGS, "--served-model-name", "tiny", "--pooling", "mean", "--max-num-batched-tokens", "8"],
    )


def load_hf(path, **kwargs):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32, **kwargs).eval()


@pytest.fixture(scope="module")
def hf_tiny(tiny_llama):
    return load_hf(tiny_llama)


def test_embeddings_match_transformers(embed_server, hf_tiny):
    client = embed_server.openai()
    ids = [[5, 77, 120, 33, 9, 200, 41, 17, 99, 3, 250], [42]]
    resp = client.embeddings.create(model="tiny", input=ids)
    assert resp.object == "list" and resp.model == "tiny"
    assert [d.index for d in resp.data] == [0, 1] and all(d.object == "embedding" for d in resp.data)
    for d, p in zip(resp.data, ids):
        torch.testing.assert_close(torch.tensor(d.embedding), hf_embedding(hf_tiny, p, "mean"), rtol=1e-5, atol=1e-5)
    assert resp.usage.prompt_tokens == resp.usage.total_tokens == sum(map(len, ids))
    # Text input (tokenized as /tokenize does), one string or a list.
    text = "Hello world"
    tok = httpx.post(embed_server.url + "/tokenize", json={"prompt": text}).json()["tokens"]
    one = client.embeddings.create(model="tiny", input=text)
    torch.testing.assert_close(
        torch.tensor(one.data[0].embedding), hf_embedding(hf_tiny, tok, "mean"), rtol=1e-5, atol=1e-5
    )
    assert len(client.embeddings.create(model="tiny", input=[text, "other"]).data) == 2
    assert embed_server.metrics().get("vllm:num_requests_running", 0) == 0


def test_base64_and_raw_shape(embed_server):
    body = {"model": "tiny", "input": [5, 6, 7]}
    plain = httpx.post(embed_server.url + "/v1/embeddings", json=body, timeout=60).json()
    b64 = httpx.post(embed_server.url + "/v1/embeddings", json={**body, "encoding_format": "base64"}, timeout=60).json()
    assert set(plain) >= {"object", "data", "model", "usage"}
    raw = base64.b64decode(b64["data"][0]["embedding"])
    decoded = struct.unpack(f"<{len(raw) // 4}f", raw)
    assert decoded == pytest.approx(plain["data"][0]["embedding"], rel=1e-6)
    # The openai client asks for base64 by default and decodes it itself (checked above).
    dims = len(plain["data"][0]["embedding"])
    ok = httpx.post(embed_server.url + "/v1/embeddings", json={**body, "dimensions": dims}, timeout=60)
    assert ok.status_code == 200


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": [5, 6], "dimensions": 3}, "dimensions"),
        ({"input": []}, "input"),
        ({"input": [[5], []]}, "input"),
        ({"input": [5, 6], "encoding_format": "int8"}, "encoding_format"),
        ({"input": [5, 6], "truncate_prompt_tokens": 1}, "truncate_prompt_tokens"),
        ({"input": [5, 6], "embed_dtype": "float16"}, "embed_dtype"),
        ({"input": [999999]}, "input"),
        ({}, "input"),
    ],
)
def test_bad_requests_are_400(embed_server, body, param):
    r = httpx.post(embed_server.url + "/v1/embeddings", json={"model": "tiny", **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"]
    # The server goes on.
    assert (
        httpx.post(embed_server.url + "/v1/embeddings", json={"model": "tiny", "input": "x"}, timeout=60).status_code
        == 200
    )


def test_unknown_model_is_404(embed_server):
    r = httpx.post(embed_server.url + "/v1/embeddings", json={"model": "nope", "input": "x"}, timeout=60)
    assert r.status_code == 404


# -- the default model (SmolLM2-135M-Instruct GGUF, dequantized, float32), last pooling --------
DEFAULT_ARGS = [
    "--quantization",
    "none",
    "--dtype",
    "float32",
    "--kv-cache-memory",
    "128MiB",
    "--max-model-len",
    "512",
    "--threads",
    "1",
]
SENTENCES = ["The capital of France is Paris.", "Embeddings map text to vectors."]


@pytest.fixture(scope="module")
def default_model_hf(request):
    from pagedserve.loader.model_path import default_model_path

    try:
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(f"the default model is not installed: {e}")
    # transformers' reading of the GGUF file, saved once per session (tests/conftest.py).
    return load_hf(str(request.getfixturevalue("default_model_hf_dir")))


# Two model loads plus the transformers reference: 15-30 s on 2 cores, the one real-model check.
def test_default_model_embeddings_match_transformers(server_factory, default_model_hf):
    from pagedserve import LLM

    llm = LLM(
        quantization="none", dtype="float32", kv_cache_memory="128MiB", max_model_len=512, max_num_batched_tokens=8
    )  # several prefill chunks per sentence
    tok = llm.get_tokenizer()
    ids = [tok.encode(s) for s in SENTENCES]
    expected = [hf_embedding(default_model_hf, p, "last") for p in ids]
    outs = llm.embed(SENTENCES)
    for out, p, ref in zip(outs, ids, expected):
        assert out.prompt_token_ids == p
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), ref, rtol=1e-5, atol=1e-5)
    assert llm.llm_engine.kv.pool.num_in_use == 0
    llm.shutdown()

    server = server_factory(None, DEFAULT_ARGS)
    resp = server.openai().embeddings.create(model="smollm2-135m-instruct", input=SENTENCES)
    for d, ref in zip(resp.data, expected):
        torch.testing.assert_close(torch.tensor(d.embedding), ref, rtol=1e-5, atol=1e-5)
    assert resp.usage.prompt_tokens == sum(map(len, ids))
