"""Start-up and release of tensor/pipeline-parallel engines.

A worker that dies before it joins the process group is an error within seconds (naming
its rank, exit code and the `__main__` guard), not a wait for the rendezvous timeout; an
engine releases its process group and workers on shutdown, when dropped and at exit, so a
second distributed engine in the same process works.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import time

import pytest
import torch.distributed as dist
from dist_helpers import BASE, greedy, make_prompts, running_llm, token_ids

from pagedserve import LLM

pytestmark = pytest.mark.timeout(180)


def test_worker_dying_before_it_joins_fails_fast(tiny_checkpoint_factory, tmp_path):
    """`python - <<EOF`: spawned workers cannot re-import the script and die at once."""
    path = tiny_checkpoint_factory(arch="llama", num_heads=4, num_kv_heads=2)
    script = textwrap.dedent(f"""
        from pagedserve import LLM
        LLM(model={str(path)!r}, tensor_parallel_size=2, dtype="float32", kv_cache_memory="8MiB")
    """)
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-"], input=script, capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    took = time.monotonic() - start
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "worker rank 1" in last and "exited with code 1" in last, proc.stderr[-3000:]
    assert 'if __name__ == "__main__":' in last
    assert took < 60  # the rendezvous timeout is 300 s


def test_second_engine_in_the_same_process(tiny_checkpoint_factory):
    path = str(tiny_checkpoint_factory(arch="llama", num_heads=4, num_kv_heads=2))
    prompts, params = make_prompts()[:3], greedy(4)
    kw = {**BASE, "model": path, "distributed_executor_backend": "mp"}
    # Never named: only garbage collection can release it.
    first = token_ids(LLM(tensor_parallel_size=2, **kw), prompts, params)
    llm = LLM(pipeline_parallel_size=2, **kw)
    assert token_ids(llm, prompts, params) == first
    # Rebinding the name: the old engine is still referenced while the new one starts.
    old = llm
    llm = LLM(tensor_parallel_size=2, **kw)
    assert token_ids(llm, prompts, params) == first
    with pytest.raises(RuntimeError, match="another tensor/pipeline-parallel engine was created"):
        token_ids(old, prompts, params)
    procs = list(llm.llm_engine.executor.procs)
    del llm, old
    gc.collect()
    assert not dist.is_initialized()
    for p in procs:
        p.join(timeout=20)
        assert not p.is_alive()


def test_process_group_of_the_caller_is_not_torn_down(tiny_checkpoint_factory, tmp_path):
    """A default group pagedserve did not create is the caller's: refused by name, kept."""
    path = str(tiny_checkpoint_factory(arch="llama", num_heads=4, num_kv_heads=2))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="already initialized in this process, not by pagedserve"):
            LLM(**{**BASE, "model": path, "tensor_parallel_size": 2, "distributed_executor_backend": "mp"})
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()


def test_an_idle_engine_outlives_the_collective_timeout(tiny_checkpoint_factory):
    """Ranks > 0 wait for the next step inside a collective bounded by
    distributed_timeout_s: an engine idle for longer than that still answers, the same
    tokens as before (rank 0 sent its workers the keepalive command meanwhile)."""
    path = str(tiny_checkpoint_factory(arch="llama", num_heads=4, num_kv_heads=2))
    prompts, params = make_prompts()[:3], greedy(4)
    kw = {**BASE, "model": path, "distributed_executor_backend": "mp", "distributed_timeout_s": 5}
    with running_llm(tensor_parallel_size=2, **kw) as llm:
        first = token_ids(llm, prompts, params)
        time.sleep(7.5)  # 1.5 timeouts, nothing running
        assert token_ids(llm, prompts, params) == first
        keepalive = llm.llm_engine.executor.driver.keepalive
        assert keepalive.sent >= 2 and keepalive.error is None
