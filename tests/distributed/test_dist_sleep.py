"""Sleep mode under tensor and pipeline parallelism: every rank drops its shard's weights
and KV cache (at level 2 the worker's resident memory falls by its weights: an untouched
KV cache is not resident) and the outputs after waking are the ones before (greedy tokens
and logprobs)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch.distributed as dist
from dist_helpers import make_prompts, running_llm

from pagedserve import SamplingParams

pytestmark = pytest.mark.timeout(120)

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
# Layers big enough that a worker's weights (about 16 MiB of float32 per rank) show in its RSS.
SHAPE = dict(arch="llama", hidden_size=512, intermediate_size=2048, num_heads=8, num_kv_heads=4, num_layers=2)
WORKER_WEIGHTS = 16 * 2**20


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def outputs(llm) -> list[tuple[list[int], list[dict[int, float]]]]:
    outs = llm.generate(make_prompts(), PARAMS, use_tqdm=False)
    return [
        (list(o.outputs[0].token_ids), [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
        for o in outs
    ]


def assert_same(a, b) -> None:
    for (ta, la), (tb, lb) in zip(a, b, strict=True):
        assert ta == tb
        for da, db in zip(la, lb, strict=True):
            assert da.keys() == db.keys()
            assert all(abs(da[t] - db[t]) < 1e-5 for t in da)


def wait_for(cond, timeout: float = 20.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.1)
    return cond()


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the workers' RSS from /proc")
@pytest.mark.parametrize(
    "parallel",
    [{"tensor_parallel_size": 2}, pytest.param({"pipeline_parallel_size": 2}, marks=pytest.mark.slow)],
)
@pytest.mark.compat("sleep_mode", "tp_mp")
@pytest.mark.compat("sleep_mode", "pp")
def test_workers_sleep_and_wake(tiny_checkpoint_factory, parallel):
    path = tiny_checkpoint_factory(**SHAPE)
    with running_llm(model=str(path), enable_sleep_mode=True, **parallel) as llm:
        before = outputs(llm)
        (pid,) = llm.llm_engine.executor.worker_pids()
        for level in (1, 2):
            awake = rss(pid)
            llm.sleep(level)
            if level == 2:
                # The worker runs the command from its step loop and drops its weights
                # (level 1 keeps a host copy: on a CPU the same memory).
                assert wait_for(lambda a=awake: rss(pid) < a - WORKER_WEIGHTS // 2), (awake, rss(pid))
            llm.wake_up()
            assert_same(before, outputs(llm))
            assert llm.llm_engine.kv.pool.num_in_use == 0
        assert rss(pid) > awake - WORKER_WEIGHTS // 4  # the weights are back
    assert not dist.is_initialized()
