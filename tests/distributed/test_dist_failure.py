"""A worker that dies is reported as a clear RuntimeError within a bounded time, the
engine refuses further steps, and shutdown is clean (no hang, no leaked process group)."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch.distributed as dist
from dist_helpers import greedy, make_prompts, running_llm, token_ids

pytestmark = pytest.mark.timeout(90)


@pytest.mark.parametrize("when", ["between-steps", "during-generate"])
def test_killed_worker_gives_clear_error(when, tiny_checkpoint_factory):
    path = tiny_checkpoint_factory(arch="llama", num_heads=4, num_kv_heads=2)
    prompts = make_prompts()
    with running_llm(model=str(path), tensor_parallel_size=2, distributed_executor_backend="mp") as llm:
        executor = llm.llm_engine.executor
        token_ids(llm, prompts[:2], greedy(4))
        (pid,) = executor.worker_pids()
        if when == "between-steps":
            os.kill(pid, signal.SIGKILL)
            executor.procs[0].join(timeout=10)
        else:
            # Killed while the driver is inside its collectives: the broken connection,
            # not a timeout, ends the step.
            engine = llm.llm_engine
            engine.add_request("victim", prompts[3], greedy(200))
            engine.step()
            os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"worker rank 1 \(pid \d+\) exited with code -9"):
            if when == "between-steps":
                token_ids(llm, prompts, greedy(4))
            else:
                while True:
                    llm.llm_engine.step()
        assert time.monotonic() - start < 30
        # The failure sticks: no step runs on a half-dead group.
        with pytest.raises(RuntimeError, match="worker rank 1"):
            llm.llm_engine.executor.check_health()
    assert not dist.is_initialized()
    assert not executor.procs[0].is_alive()
