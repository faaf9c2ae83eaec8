"""The Ray executor on a local Ray head started by the test (127.0.0.1, 2 CPUs): the
worker rank is a Ray actor in a placement group; greedy tokens match a single process,
and a killed actor is reported."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist
from dist_helpers import greedy, make_prompts, running_llm, token_ids

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'ray>=2.9')")

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(
        num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False, configure_logging=False
    )
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint_factory):
    path = tiny_checkpoint_factory(arch="llama", num_heads=4, num_kv_heads=2, num_layers=3)
    with running_llm(model=str(path)) as llm:
        return path, token_ids(llm, make_prompts(), greedy())


@pytest.mark.compat("chunked_prefill", "tp_ray")
@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)], ids=["tp2", "pp2"])
def test_ray_matches_single_process(parallel, ray_cluster, checkpoint):
    path, expected = checkpoint
    with running_llm(model=str(path), distributed_executor_backend="ray", **parallel) as llm:
        assert token_ids(llm, make_prompts(), greedy()) == expected
    assert not dist.is_initialized()
    # The placement group is gone (Ray releases it asynchronously): its CPUs come back.
    deadline = time.monotonic() + 20
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == pytest.approx(2)


def test_ray_killed_actor_gives_clear_error(ray_cluster, checkpoint):
    path, _ = checkpoint
    with running_llm(model=str(path), distributed_executor_backend="ray", tensor_parallel_size=2) as llm:
        token_ids(llm, make_prompts()[:1], greedy(2))
        ray.kill(llm.llm_engine.executor.actors[0])
        with pytest.raises(RuntimeError, match="worker rank 1 \\(Ray actor\\)"):
            token_ids(llm, make_prompts(), greedy(4))
    assert not dist.is_initialized()
