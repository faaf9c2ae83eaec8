"""`pagedserve run-batch`: an OpenAI batch file mixing chat, completions, embeddings and
responses lines with bad ones, answered in input order by the server's request handling
in process; greedy texts and embeddings equal the offline LLM's on the same checkpoint,
and every bad line is reported on its own output line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagedserve import LLM, SamplingParams

ENGINE = {"dtype": "float32", "kv_cache_memory": "64MiB"}
MESSAGES = [{"role": "user", "content": "Hello world"}]


def line(custom_id, url, body, method="POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


LINES = [
    line("chat", "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "max_tokens": 6, "temperature": 0}),
    line("cmpl", "/v1/completions", {"model": "tiny", "prompt": "Hello world", "max_tokens": 6, "temperature": 0}),
    line("emb", "/v1/embeddings", {"model": "tiny", "input": ["Hello world", "bye"]}),
    line("resp", "/v1/responses", {"model": "tiny", "input": "Hello world", "max_output_tokens": 6, "temperature": 0}),
    "{not json",
    "",
    line("bad-body", "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "max_tokens": 0}),
    line("bad-model", "/v1/completions", {"model": "other", "prompt": "x", "max_tokens": 1}),
    line("chat", "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1}),
    line("bad-url", "/v1/models", {}),
    line("bad-method", "/v1/completions", {"model": "tiny", "prompt": "x"}, method="GET"),
    line("streamed", "/v1/completions", {"model": "tiny", "prompt": "x", "stream": True}),
]


@pytest.fixture(scope="module")
def results(tiny_llama, tmp_path_factory):
    folder = tmp_path_factory.mktemp("batch")
    (folder / "in.jsonl").write_text("\n".join(LINES) + "\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedserve.entrypoints.cli",
            "run-batch",
            str(tiny_llama),
            "--served-model-name",
            "tiny",
            "--dtype",
            ENGINE["dtype"],
            "--kv-cache-memory",
            ENGINE["kv_cache_memory"],
            "--threads",
            "1",
            "-i",
            str(folder / "in.jsonl"),
            "-o",
            str(folder / "out.jsonl"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    outputs = [json.loads(x) for x in (folder / "out.jsonl").read_text().splitlines()]
    return outputs, proc.stderr


@pytest.fixture(scope="module")
def offline(tiny_llama):
    llm = LLM(model=str(tiny_llama), **ENGINE)
    yield llm
    llm.shutdown()


def test_one_output_line_per_request_in_order(results):
    outputs, stderr = results
    assert len(outputs) == len([x for x in LINES if x.strip()])
    ids = [o["custom_id"] for o in outputs]
    assert ids[:4] == ["chat", "cmpl", "emb", "resp"] and ids[4] is None
    assert ids[5:] == ["bad-body", "bad-model", "chat", "bad-url", "bad-method", "streamed"]
    assert len({o["id"] for o in outputs}) == len(outputs) and all(o["id"].startswith("batch_req_") for o in outputs)
    assert "run-batch: 4 succeeded, 7 failed" in stderr
    assert "11/11" in stderr  # the progress bar's last state


def test_answers_equal_the_offline_engine(results, offline):
    outputs, _ = results
    chat, cmpl, emb, resp = (o["response"] for o in outputs[:4])
    assert all(r["status_code"] == 200 for r in (chat, cmpl, emb, resp)) and all(
        o["error"] is None for o in outputs[:4]
    )
    greedy = SamplingParams(temperature=0, max_tokens=6)
    ref_chat = offline.chat(MESSAGES, greedy, use_tqdm=False)[0].outputs[0].text
    assert chat["body"]["object"] == "chat.completion"
    assert chat["body"]["choices"][0]["message"]["content"] == ref_chat
    assert resp["body"]["object"] == "response" and resp["body"]["output"][0]["content"][0]["text"] == ref_chat
    ref = offline.generate("Hello world", greedy, use_tqdm=False)[0]
    assert cmpl["body"]["choices"][0]["text"] == ref.outputs[0].text
    assert cmpl["body"]["usage"]["prompt_tokens"] == len(ref.prompt_token_ids)
    ref_emb = offline.embed(["Hello world", "bye"])
    got = [d["embedding"] for d in emb["body"]["data"]]
    for g, r in zip(got, ref_emb):
        assert g == pytest.approx(list(r.outputs.embedding), abs=1e-5)


def test_bad_lines_are_reported_and_never_stop_the_file(results):
    outputs, _ = results
    by_id = {o["custom_id"]: o for o in outputs[5:] if o["custom_id"] != "chat"}
    not_json = outputs[4]
    assert not_json["response"] is None and not_json["error"]["code"] == "invalid_json"
    assert "line 5" in not_json["error"]["message"]
    body = by_id["bad-body"]["response"]
    assert body["status_code"] == 400 and body["body"]["error"]["param"] == "max_tokens"
    assert by_id["bad-body"]["error"]["message"] == body["body"]["error"]["message"]
    assert by_id["bad-model"]["response"]["status_code"] == 404
    assert by_id["bad-model"]["error"]["code"] == "model_not_found"
    repeated = outputs[7]
    assert (
        repeated["custom_id"] == "chat"
        and repeated["response"] is None
        and "earlier line" in repeated["error"]["message"]
    )
    for name, word in (("bad-url", "'url'"), ("bad-method", "'method'"), ("streamed", "stream")):
        assert by_id[name]["response"] is None and word in by_id[name]["error"]["message"], by_id[name]


def test_progress_without_tqdm_is_a_counter(monkeypatch, capsys):
    from pagedserve.entrypoints.cli.batch_runner import Progress

    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm now raises ImportError
    bar = Progress(3)
    for _ in range(3):
        bar.update()
    bar.close()
    err = capsys.readouterr().err
    assert "run-batch: 1/3 requests" in err and err.endswith("run-batch: 3/3 requests\n")
