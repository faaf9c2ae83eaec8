"""`pagedserve eval kl`: KL divergence, perplexity and top-1 agreement of one model against
a reference, checked against the same quantities computed with transformers."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from pagedserve import LLM
from pagedserve.entrypoints.cli.eval_cmd import chunk_tokens, evaluate_kl
from pagedserve.entrypoints.cli.main import main

ENGINE = {"dtype": "float32", "kv_cache_memory": "64MiB", "threads": 1, "enable_prefix_caching": False}
CTX = 32
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards box and quiz the jolly king".split()


def _text(seed: int = 0, words: int = 120) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


@pytest.fixture(scope="module")
def perturbed(tiny_llama, tmp_path_factory):
    """The tiny checkpoint with noise on every matrix: a model near the reference."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    path = tmp_path_factory.mktemp("perturbed")
    model.save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).write_bytes((tiny_llama / name).read_bytes())
    return path


def _hf_log_softmax(path, chunk: list[int]) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([chunk])).logits[0].double(), dim=-1)


def test_chunks_cut_as_llama_perplexity():
    ids = list(range(10, 110))
    chunks = chunk_tokens(ids, 32, bos=1)
    assert [len(c) for c in chunks] == [32, 32, 32]  # the last 4 tokens make no whole chunk
    assert [c[0] for c in chunks] == [1, 1, 1] and chunks[1][1:] == ids[33:64]
    assert chunk_tokens(ids, 32, bos=None, limit=2)[1] == ids[32:64]
    with pytest.raises(ValueError, match="--ctx"):
        chunk_tokens(ids, 2, None)


def test_kl_matches_transformers(tiny_llama, perturbed):
    reference, model = LLM(model=str(tiny_llama), **ENGINE), LLM(model=str(perturbed), **ENGINE)
    ids = reference.get_tokenizer().encode(_text())
    report = evaluate_kl(model, reference, ids, CTX, None, chunks=3, batch=2)
    first = CTX // 2
    kld, nll_ref, nll_model, same = [], 0.0, 0.0, 0
    for chunk in chunk_tokens(ids, CTX, None, 3):
        ref = _hf_log_softmax(tiny_llama, chunk)[first:-1]
        mod = _hf_log_softmax(perturbed, chunk)[first:-1]
        targets = torch.tensor(chunk[first + 1 :]).unsqueeze(1)
        kld.append((ref.exp() * (ref - mod)).sum(-1))
        nll_ref -= float(ref.gather(1, targets).sum())
        nll_model -= float(mod.gather(1, targets).sum())
        same += int((ref.argmax(-1) == mod.argmax(-1)).sum())
    kld = torch.cat(kld)
    n = kld.numel()
    assert report.positions == n == 3 * (CTX - 1 - first) and report.chunks == 3
    assert float(kld.mean()) > 1e-3  # the noise is visible: the check below can fail
    assert report.mean_kld == pytest.approx(float(kld.mean()), rel=1e-3)
    assert report.max_kld == pytest.approx(float(kld.max()), rel=1e-3)
    assert report.p99_kld == pytest.approx(float(torch.quantile(kld, 0.99)), rel=1e-3)
    assert report.ppl_reference == pytest.approx(math.exp(nll_ref / n), rel=1e-4)
    assert report.ppl_model == pytest.approx(math.exp(nll_model / n), rel=1e-4)
    assert report.top1_agreement == pytest.approx(same / n)


def test_a_model_against_itself(tiny_llama):
    llm = LLM(model=str(tiny_llama), **ENGINE)
    ids = llm.get_tokenizer().encode(_text(1))
    report = evaluate_kl(llm, llm, ids, CTX, None, chunks=2)
    assert report.mean_kld < 1e-9 and report.ppl_ratio == pytest.approx(1.0, abs=1e-9)
    assert report.top1_agreement == 1.0


def test_cli_writes_the_report(tiny_llama, perturbed, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text(_text(2))
    out = tmp_path / "kl.json"
    args = ["eval", "kl", "--model", str(perturbed), "--reference", str(tiny_llama), "--text", str(text)]
    args += ["--ctx", str(CTX), "--chunks", "2", "--dtype", "float32", "--threads", "1", "--json", str(out)]
    assert main(args) == 0
    report = json.loads(out.read_text())
    assert report["chunks"] == 2 and report["positions"] == 2 * (CTX - 1 - CTX // 2)
    assert report["mean_kld"] > 0 and "mean KLD" in capsys.readouterr().out
    text.write_text("short")
    with pytest.raises(SystemExit, match="shorter than one chunk"):
        main(args)
