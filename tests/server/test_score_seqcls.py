"""Sequence-classification checkpoints (``*ForSequenceClassification``: a ``score.weight``
head on the last token's final hidden state): LLM.classify and LLM.score against
transformers' AutoModelForSequenceClassification on tiny random float32 Llama, Qwen2 and
Qwen3 checkpoints (one and three labels), and /v1/score, /v1/rerank and /classify on a
server of one of them.  The pair is the tokenizer's text-pair encoding (a template with a
BOS and a separator here)."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
import torch

QUERY = "What is the capital of China?"
DOCS = [
    "The capital of China is Beijing.",
    "Gravity makes things fall down.",
    "Paris is in France.",
    "",
]
PROMPTS = ["a short one", "Some longer text that spans several chunks of the step.", "x"]

CONFIGS = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}
MODELS = {
    "llama": "LlamaForSequenceClassification",
    "qwen2": "Qwen2ForSequenceClassification",
    "qwen3": "Qwen3ForSequenceClassification",
}


def make_seqcls_checkpoint(path, base, arch: str, num_labels: int, seed: int):
    """A random sequence-classification checkpoint with ``base``'s tokenizer, given a pair
    template (``<|im_start|> A <|im_end|> B <|im_end|>``)."""
    import transformers
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    path.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(base / name, path / name)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.post_processor = TemplateProcessing(
        single="<|im_start|> $A <|im_end|>",
        pair="<|im_start|> $A <|im_end|> $B:1 <|im_end|>:1",
        special_tokens=[("<|im_start|>", 1), ("<|im_end|>", 2)],
    )
    tok.save(str(path / "tokenizer.json"))
    base_cfg = json.loads((base / "config.json").read_text())
    config = getattr(transformers, CONFIGS[arch])(
        vocab_size=base_cfg["vocab_size"],
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        num_labels=num_labels,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, MODELS[arch])(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2 if "embed" in name else 0.08)
            elif "bias" in name:
                p.normal_(0.0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_checkpoint_factory):
    base = tiny_checkpoint_factory(arch="llama")
    root = tmp_path_factory.mktemp("seqcls")
    made = {}

    def get(arch: str, num_labels: int):
        key = (arch, num_labels)
        if key not in made:
            folder = root / f"{arch}-{num_labels}"
            made[key] = make_seqcls_checkpoint(folder, base, arch, num_labels, seed=len(made) + 5)
        return made[key]

    return get


@torch.inference_mode()
def hf_logits(path, texts) -> list[torch.Tensor]:
    """transformers' logits of each text (a string) or (query, document) pair, one at a time."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for t in texts:
        enc = tok(*t, return_tensors="pt") if isinstance(t, tuple) else tok(t, return_tensors="pt")
        out.append(model(**enc).logits[0].float())
    return out


CHUNKED = dict(max_num_batched_tokens=8, enable_prefix_caching=True, block_size=4)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_llm_score_and_classify_equal_transformers(checkpoints, arch):
    from pagedserve import LLM

    path = checkpoints(arch, 1)
    ref = hf_logits(path, [(QUERY, d) for d in DOCS])
    relevance = [torch.sigmoid(x)[0].item() for x in ref]
    assert len({round(s, 3) for s in relevance}) == len(DOCS)  # the test can tell documents apart
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory="16MiB", **(CHUNKED if arch == "llama" else {}))
    try:
        for _ in range(2):  # the second round may hit the prefix cache
            outs = llm.score(QUERY, DOCS)
            assert [o.outputs.score for o in outs] == pytest.approx(relevance, abs=1e-4)
        import transformers

        tok = transformers.AutoTokenizer.from_pretrained(path)
        assert outs[0].prompt_token_ids == tok(QUERY, DOCS[0]).input_ids
        classified = llm.classify(PROMPTS)
        for out, want in zip(classified, hf_logits(path, PROMPTS)):
            torch.testing.assert_close(torch.tensor(out.outputs.logits), want, rtol=1e-4, atol=1e-4)
            assert out.outputs.num_classes == 1
        with pytest.raises(ValueError, match="sequence-classification"):
            llm.generate(["hello"])
        with pytest.raises(ValueError, match="instruction"):
            llm.score(QUERY, DOCS, instruction="judge")
    finally:
        llm.shutdown()


def test_three_labels_classify_with_softmax(checkpoints):
    from pagedserve import LLM

    path = checkpoints("llama", 3)
    ref = hf_logits(path, PROMPTS)
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory="16MiB", pooling="mean", **CHUNKED)
    try:
        # Classification pools the last token whatever the engine's embedding pooling.
        outs = llm.classify(PROMPTS)
        for out, want in zip(outs, ref):
            torch.testing.assert_close(torch.tensor(out.outputs.logits), want, rtol=1e-4, atol=1e-4)
            assert out.outputs.probs == pytest.approx(torch.softmax(want, 0).tolist(), abs=1e-5)
            assert out.outputs.num_classes == 3
        with pytest.raises(ValueError, match="one label"):
            llm.score(QUERY, DOCS)
    finally:
        llm.shutdown()


def test_a_checkpoint_without_its_head_is_refused(checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    from pagedserve import LLM

    path = tmp_path / "headless"
    shutil.copytree(checkpoints("llama", 1), path)
    weights = load_file(path / "model.safetensors")
    del weights["score.weight"]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"score\.weight"):
        LLM(model=str(path), dtype="float32", kv_cache_memory="16MiB")


def test_classify_on_a_causal_lm_is_refused(tiny_llama):
    from pagedserve import LLM, PoolingParams

    llm = LLM(model=str(tiny_llama), dtype="float32", kv_cache_memory="16MiB")
    try:
        with pytest.raises(ValueError, match="sequence-classification"):
            llm.classify(["hello"])
        with pytest.raises(ValueError, match="sequence-classification"):
            llm.embed(["hello"], PoolingParams(task="classify"))
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def server(server_factory, checkpoints, tiny_server_args):
    return server_factory(str(checkpoints("llama", 1)), [*tiny_server_args, "--served-model-name", "cls"])


@pytest.fixture(scope="module")
def reference(checkpoints):
    return [torch.sigmoid(x)[0].item() for x in hf_logits(checkpoints("llama", 1), [(QUERY, d) for d in DOCS])]


def test_score_and_rerank_routes(server, reference):
    r = httpx.post(server.url + "/v1/score", json={"model": "cls", "text_1": QUERY, "text_2": DOCS}, timeout=120)
    assert r.status_code == 200, r.text
    assert [d["score"] for d in r.json()["data"]] == pytest.approx(reference, abs=1e-4)
    r = httpx.post(server.url + "/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 2}, timeout=120)
    assert r.status_code == 200, r.text
    order = sorted(range(len(DOCS)), key=lambda i: -reference[i])[:2]
    results = r.json()["results"]
    assert [x["index"] for x in results] == order
    assert [x["relevance_score"] for x in results] == pytest.approx([reference[i] for i in order], abs=1e-4)


@pytest.mark.parametrize("path", ["/classify", "/v1/classify"])
def test_classify_route(server, checkpoints, path):
    want = hf_logits(checkpoints("llama", 1), PROMPTS)
    r = httpx.post(server.url + path, json={"model": "cls", "input": PROMPTS}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "cls" and body["usage"]["prompt_tokens"] > 0
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    for d, w in zip(body["data"], want):
        assert d["num_classes"] == 1 and d["label"] == "LABEL_0"
        assert d["probs"] == pytest.approx([torch.sigmoid(w)[0].item()], abs=1e-4)


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/rerank", {"query": QUERY, "documents": []}, "documents"),
        ("/v1/score", {"text_1": QUERY, "text_2": []}, "text_1"),
        ("/v1/score", {"text_1": QUERY, "text_2": DOCS, "instruction": "judge"}, "instruction"),
        ("/classify", {}, "input"),
        ("/classify", {"input": []}, "input"),
        ("/classify", {"input": "hi", "truncate_prompt_tokens": 3}, "truncate_prompt_tokens"),
    ],
)
def test_bad_requests_are_named(server, path, body, param):
    r = httpx.post(server.url + path, json={"model": "cls", **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_generation_is_refused(server):
    r = httpx.post(server.url + "/v1/completions", json={"model": "cls", "prompt": "hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 400, r.text
    assert "sequence-classification" in r.json()["error"]["message"]


@pytest.mark.compat("pooling", "tp_mp")
@pytest.mark.compat("pooling", "pp")
@pytest.mark.parametrize("split", ["tp", "pp"])
def test_parallel_classify_equals_transformers(checkpoints, split):
    """Two ranks (mp), tensor or pipeline parallel: the pooled state reaches the engine as
    the full hidden vector, so the head applies there as on one process."""
    from pagedserve import LLM

    path = checkpoints("llama", 3)
    ref = hf_logits(path, PROMPTS)
    sizes = dict(tensor_parallel_size=2) if split == "tp" else dict(pipeline_parallel_size=2)
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory="16MiB", distributed_executor_backend="mp", **sizes)
    try:
        model = llm.llm_engine.runner.model
        if split == "tp":
            assert model.num_heads == 2  # half of the 4 heads: really sharded
        else:
            assert model.layer_end < 2  # rank 0 holds the first layer only
        for out, want in zip(llm.classify(PROMPTS), ref):
            torch.testing.assert_close(torch.tensor(out.outputs.logits), want, rtol=1e-4, atol=1e-4)
    finally:
        llm.shutdown()
