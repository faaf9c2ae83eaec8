"""The data-parallel routing policy and replica plan, as pure functions (no processes)."""

from __future__ import annotations

import pytest

from pagedserve.platforms import PlatformError
from pagedserve.serving.data_parallel import DataParallelConfig, plan_replicas, resolve_platforms
from pagedserve.serving.routing_policy import NoReplicaAvailable, ReplicaLoad, RoutingPolicy


def loads(*seqs: int, kv=None, routed=None, down=()) -> list[ReplicaLoad]:
    kv = kv or [0.0] * len(seqs)
    routed = routed or [0] * len(seqs)
    return [ReplicaLoad(i, s, kv[i], routed[i], i not in down) for i, s in enumerate(seqs)]


def test_least_loaded_wins_and_kv_usage_counts():
    p = RoutingPolicy(block_size=4)
    assert p.choose([], loads(3, 1, 2)).replica == 1
    # A full KV cache weighs kv_weight sequences: 1 + 4 * 1.0 > 3 + 0.
    assert p.choose([], loads(3, 1, kv=[0.0, 1.0])).replica == 0
    # Equal scores: the replica sent the fewest requests so far (an idle server spreads).
    assert p.choose([], loads(0, 0, 0, routed=[5, 2, 3])).replica == 1


def test_dead_replicas_are_skipped_and_none_left_raises():
    p = RoutingPolicy(block_size=4)
    assert p.choose([], loads(0, 9, down=(0,))).replica == 1
    with pytest.raises(NoReplicaAvailable):
        p.choose([], loads(0, 0, down=(0, 1)))


def test_prefix_hashes_cover_full_blocks_before_the_last_token():
    p = RoutingPolicy(block_size=4, max_blocks=3)
    assert p.prefix_hashes(list(range(4))) == []  # the only block holds the last token
    assert len(p.prefix_hashes(list(range(5)))) == 1
    assert len(p.prefix_hashes(list(range(100)))) == 3  # capped at max_blocks
    a, b = p.prefix_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9]), p.prefix_hashes([1, 2, 3, 4, 0, 6, 7, 8, 9])
    assert a[0] == b[0] and a[1] != b[1]  # chained: a block's hash covers its prefix
    assert RoutingPolicy(block_size=4, enable_affinity=False).prefix_hashes(list(range(50))) == []


def test_affinity_prefers_the_replica_that_served_the_prefix_within_the_margin():
    p = RoutingPolicy(block_size=4, margin=2.0)
    shared = list(range(100, 112))
    h = p.prefix_hashes(shared + [1, 2, 3])
    p.record(h, 1)
    # Same prefix, another tail: replica 1 has the blocks and is within the margin.
    other = p.prefix_hashes(shared + [7, 7, 7, 7, 7])
    choice = p.choose(other, loads(0, 2))
    assert (choice.replica, choice.reason, choice.matched_blocks) == (1, "affinity", 3)
    # Beyond the margin load wins, and the prefix then belongs to the new replica.
    choice = p.choose(other, loads(0, 3))
    assert (choice.replica, choice.reason) == (0, "load")
    p.record(other, 0)
    assert p.choose(h, loads(1, 0)).replica == 0
    # An unrelated prompt gets no affinity.
    assert p.choose(p.prefix_hashes(list(range(20))), loads(1, 0)).reason == "load"


def test_deepest_known_prefix_wins_and_dead_replicas_are_forgotten():
    p = RoutingPolicy(block_size=2, margin=10)
    system = [9, 9, 9, 9]
    p.record(p.prefix_hashes(system + [1, 1, 1]), 0)  # system prompt + conversation A
    p.record(p.prefix_hashes(system + [2, 2, 2, 2, 2]), 1)  # + conversation B (newer)
    assert p.choose(p.prefix_hashes(system + [1, 1, 5]), loads(0, 0)).replica == 0
    assert p.choose(p.prefix_hashes(system + [2, 2, 2, 2, 5]), loads(0, 0)).replica == 1
    p.forget_replica(1)
    assert p.choose(p.prefix_hashes(system + [2, 2, 2, 2, 5]), loads(0, 0)).replica == 0
    # A replica that cannot take requests is never chosen for affinity.
    assert p.choose(p.prefix_hashes(system + [1, 1, 5]), loads(0, 0, down=(0,))).replica == 1


def test_min_blocks_and_capacity_bound_the_table():
    p = RoutingPolicy(block_size=2, min_blocks=2, capacity=3)
    p.record(p.prefix_hashes([5, 5, 6, 6, 7]), 1)
    assert p.choose(p.prefix_hashes([5, 5, 0, 0, 0]), loads(0, 0)).reason == "load"  # 1 block < min_blocks
    p.record(p.prefix_hashes(list(range(20))), 0)
    assert len(p) == 3
    with pytest.raises(ValueError):
        RoutingPolicy(block_size=0)


def test_threads_are_split_between_host_replicas_and_ranks():
    dp = DataParallelConfig(size=3, devices=["cuda", "cpu", "cpu"])
    specs = plan_replicas(dp, ["cuda", "cpu", "cpu"], threads=None, ranks_per_replica=1, cores=lambda: 7)
    assert [(s.device, s.on_host, s.threads) for s in specs] == [("cuda", False, 1), ("cpu", True, 4), ("cpu", True, 3)]
    dp = DataParallelConfig(size=2)
    specs = plan_replicas(dp, ["cpu", "cpu"], threads=8, ranks_per_replica=2, cores=lambda: 64)
    assert [s.threads for s in specs] == [2, 2]
    assert [s.threads for s in plan_replicas(dp, ["cpu", "cpu"], 1, 1)] == [1, 1]  # never below one
    # Accelerator replicas of one platform take consecutive devices (Ray: each its own 0).
    gpus = plan_replicas(DataParallelConfig(size=2, devices=["cuda"] * 2), ["cuda"] * 2, None, 1)
    assert [s.device_index for s in gpus] == [0, 1]
    gpus = plan_replicas(
        DataParallelConfig(size=2, devices=["cuda"] * 2), ["cuda"] * 2, None, 1, one_accelerator_per_actor=True
    )
    assert [s.device_index for s in gpus] == [0, 0]
    with pytest.raises(ValueError, match="host"):
        plan_replicas(DataParallelConfig(size=2, devices=["cuda"] * 2), ["cuda"] * 2, None, 2)


def test_host_replicas_share_the_default_memory_fraction():
    dp = DataParallelConfig(size=3, devices=["cuda", "cpu", "cpu"])
    specs = plan_replicas(dp, ["cuda", "cpu", "cpu"], None, 1, default_utilization=[0.9, 0.25, 0.25])
    assert [s.memory_utilization for s in specs] == [None, 0.125, 0.125]
    # An explicit budget (no defaults passed) applies to every replica unchanged.
    assert [s.memory_utilization for s in plan_replicas(dp, ["cuda", "cpu", "cpu"], None, 1)] == [None] * 3


def test_bad_dp_flags_are_refused_loudly():
    with pytest.raises(ValueError, match="exactly one per replica"):
        DataParallelConfig(size=3, devices=["cpu", "cpu"])
    with pytest.raises(ValueError, match="data_parallel_backend"):
        DataParallelConfig(size=2, backend="threads")
    assert DataParallelConfig.parse_devices("cuda, cpu,auto") == ["cuda", "cpu", None]
    with pytest.raises(ValueError, match="empty"):
        DataParallelConfig.parse_devices("cpu,,cpu")
    # An unknown name lists every platform and whether it is available here.
    with pytest.raises(PlatformError, match=r"unknown platform 'tpu'.*cpu \(available\)"):
        resolve_platforms(["cpu", "tpu"], check_available=True)
    assert [p.device_type for p in resolve_platforms(["cpu", "cpu"], check_available=True)] == ["cpu", "cpu"]


def test_serve_flags_become_a_dp_config():
    from pagedserve.entrypoints.cli import build_parser, serve_cmd

    def parse(*argv: str):
        argv = ["serve", *argv]
        return serve_cmd.build_dp_config(build_parser(argv).parse_args(argv))

    assert parse() is None
    dp = parse("--data-parallel-size", "3", "--device", "cpu")
    assert (dp.size, dp.backend, dp.devices) == (3, "mp", ["cpu"] * 3)
    dp = parse("-dp", "2", "--data-parallel-backend", "ray", "--data-parallel-devices", "cuda,cpu")
    assert (dp.size, dp.backend, dp.devices) == (2, "ray", ["cuda", "cpu"])
    with pytest.raises(ValueError, match="needs --data-parallel-size > 1"):
        parse("--data-parallel-devices", "cpu")
    with pytest.raises(ValueError, match="exactly one per replica"):
        parse("-dp", "2", "--data-parallel-devices", "cpu")
