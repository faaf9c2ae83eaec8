"""Yes/no relevance scoring (Qwen3-Reranker's method): LLM.score against transformers on a
tiny random Qwen2 whose vocabulary has "yes" and "no" tokens, and /v1/score, /v1/rerank,
/rerank on a server of the same checkpoint."""

from __future__ import annotations

import math

import httpx
import pytest
import torch

from pagedserve.entrypoints.scoring import rerank_prompt

QUERY = "What is the capital of China?"
DOCS = [
    "The capital of China is Beijing.",
    "Gravity makes things fall down.",
    "Paris is in France.",
]


@pytest.fixture(scope="module")
def reranker(tmp_path_factory, tiny_checkpoint_factory):
    """A tiny random Qwen2 checkpoint with "yes" and "no" added as tokens."""
    import shutil

    import transformers
    from tokenizers import Tokenizer

    path = tmp_path_factory.mktemp("reranker") / "model"
    shutil.copytree(tiny_checkpoint_factory(arch="qwen2", seed=3), path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_tokens(["yes", "no"])
    tok.save(str(path / "tokenizer.json"))
    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    model.resize_token_embeddings(tok.get_vocab_size())
    torch.manual_seed(7)
    with torch.no_grad():  # fresh random rows for the two new tokens, spread like the others
        model.get_input_embeddings().weight[-2:].normal_(0.0, 0.2)
        model.get_output_embeddings().weight[-2:].normal_(0.0, 0.3)
    model.save_pretrained(path, safe_serialization=True)
    return path


def _reference(path, pairs) -> list[float]:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    scores = []
    for query, doc in pairs:
        ids = tok(rerank_prompt(query, doc), add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            last = model(ids).logits[0, -1]
        scores.append(torch.softmax(torch.stack([last[no], last[yes]]), 0)[1].item())
    return scores


@pytest.fixture(scope="module")
def reference(reranker):
    return _reference(reranker, [(QUERY, d) for d in DOCS])


def test_llm_score_equals_transformers(reranker, reference):
    from pagedserve import LLM

    llm = LLM(model=str(reranker), dtype="float32", kv_cache_memory="64MiB")
    try:
        outs = llm.score(QUERY, DOCS)
        assert [o.outputs.score for o in outs] == pytest.approx(reference, abs=2e-5)
        assert len({round(s, 3) for s in reference}) == len(DOCS)  # the test can tell documents apart
        pairs = llm.score([QUERY, "Where is Paris?"], DOCS[:2])
        assert pairs[0].outputs.score == pytest.approx(reference[0], abs=2e-5)
        with pytest.raises(ValueError, match="data_1"):
            llm.score([QUERY, QUERY], DOCS)
    finally:
        llm.shutdown()


def test_a_vocabulary_without_yes_and_no_is_refused(tiny_llama):
    from pagedserve.entrypoints.scoring import answer_token_ids
    from pagedserve.loader.tokenizer import Tokenizer

    with pytest.raises(ValueError, match="single tokens"):
        answer_token_ids(Tokenizer.from_folder(tiny_llama))


@pytest.fixture(scope="module")
def server(server_factory, reranker, tiny_server_args):
    return server_factory(str(reranker), [*tiny_server_args, "--served-model-name", "rr"])


def test_score_route(server, reference):
    r = httpx.post(server.url + "/v1/score", json={"model": "rr", "text_1": QUERY, "text_2": DOCS}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "rr" and body["id"].startswith("score-")
    assert [d["index"] for d in body["data"]] == [0, 1, 2] and {d["object"] for d in body["data"]} == {"score"}
    assert [d["score"] for d in body["data"]] == pytest.approx(reference, abs=2e-5)
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v2/rerank"])
def test_rerank_routes(server, reference, path):
    r = httpx.post(server.url + path, json={"model": "rr", "query": QUERY, "documents": DOCS, "top_n": 2}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    order = sorted(range(len(DOCS)), key=lambda i: -reference[i])[:2]
    assert [x["index"] for x in body["results"]] == order
    assert [x["document"]["text"] for x in body["results"]] == [DOCS[i] for i in order]
    assert [x["relevance_score"] for x in body["results"]] == pytest.approx([reference[i] for i in order], abs=2e-5)
    assert body["usage"]["total_tokens"] > 0 and body["model"] == "rr"


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/score", {"text_1": [QUERY, QUERY], "text_2": DOCS}, "text_1"),
        ("/v1/score", {"text_1": QUERY}, "text_2"),
        ("/v1/rerank", {"query": QUERY, "documents": []}, "documents"),
        ("/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 0}, "top_n"),
        ("/v1/rerank", {"query": QUERY, "documents": DOCS, "truncate_prompt_tokens": 5}, "truncate_prompt_tokens"),
        ("/v1/score", {"text_1": QUERY, "text_2": DOCS, "model": "nope"}, "model"),
    ],
)
def test_bad_requests_are_named(server, path, body, param):
    r = httpx.post(server.url + path, json={"model": "rr", **body}, timeout=60)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param


def test_relevance_is_the_two_way_softmax():
    from pagedserve.entrypoints.scoring import relevance

    assert relevance(math.log(0.3), math.log(0.1)) == pytest.approx(0.75)
    assert relevance(0.0, -1e9) == 1.0 and relevance(-1e9, 0.0) == 0.0


def test_classify_without_a_score_head_is_refused(server):
    r = httpx.post(server.url + "/classify", json={"model": "rr", "input": "hello"}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "model" and "score.weight" in r.json()["error"]["message"]
