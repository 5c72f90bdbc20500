"""Data parallelism's pure parts: the router (prefix affinity bounded by load) and the
merge of replicas' answers (engine/router.py, engine/merge.py), and where ranks go."""
from __future__ import annotations

import pytest

from specserve.engine.merge import merge_metrics, merge_model_info, merge_server_info
from specserve.engine.protocol import ModelInfo
from specserve.engine.ranks import Layout
from specserve.engine.router import BLOCK, SLACK, Router


def test_distinct_prompts_spread_by_load():
    router = Router(2)
    picks = [router.pick([i] * 8) for i in range(6)]
    assert picks == [0, 1, 0, 1, 0, 1] and router.loads == [3, 3]
    router.done(0)
    assert router.pick([99]) == 0


def test_a_shared_prefix_returns_to_its_replica_until_it_is_too_busy():
    router = Router(2)
    system = list(range(2 * BLOCK))
    first = router.pick(system + [1])
    router.pick([7] * 4)  # the other replica gets some load too
    same = [router.pick(system + [i]) for i in range(2, 3 + SLACK)]  # up to SLACK ahead of the other
    assert same == [first] * (SLACK + 1) and router.loads[first] == router.loads[1 - first] + SLACK + 1
    assert router.pick(system + [50]) != first  # now more than SLACK ahead
    assert router.routed[first] == 2 + SLACK


def test_prefix_memory_is_bounded():
    router = Router(2, capacity=10)
    for i in range(20):
        router.pick([i] * (3 * BLOCK))
    assert len(router._owner) == 10


def test_merged_answers_sum_totals_and_keep_each_replica():
    infos = [ModelInfo("m", 4096, 100, 8, 1000), ModelInfo("m", 2048, 100, 8, 500)]
    assert merge_model_info(infos) == ModelInfo("m", 2048, 100, 16, 1500)
    a = {"max_total_num_tokens": 1000, "max_running_requests": 8, "device": "cuda",
         "internal_states": [{"avg_spec_accept_length": 3.0}], "tp_size": 1}
    b = {**a, "max_total_num_tokens": 500, "internal_states": [{"avg_spec_accept_length": 2.0}]}
    info = merge_server_info([a, b], [5, 7])
    assert info["dp_size"] == 2 and info["max_total_num_tokens"] == 1500 and info["max_running_requests"] == 16
    assert [r["requests_routed"] for r in info["replicas"]] == [5, 7]
    assert info["internal_states"][0]["avg_spec_accept_length"] == 2.5
    m = merge_metrics([{"num_requests_total": 3, "token_usage": 0.5, "name": "x"},
                       {"num_requests_total": 4, "token_usage": 0.1}])
    assert m["num_requests_total"] == 7 and m["token_usage"] == pytest.approx(0.3) and len(m["replicas"]) == 2


def test_ranks_and_gpus_of_each_replica_and_node():
    one = Layout(tp_size=2, nnodes=1, node_rank=0, base_gpu_id=1, on_gpu=True, dist_init_addr=None, dp_size=2)
    assert [(p.rank, p.gpu, p.host_procs) for p in one.places(1)] == [(0, 3, 4), (1, 4, 4)]
    node1 = Layout(tp_size=4, nnodes=2, node_rank=1, base_gpu_id=0, on_gpu=True, dist_init_addr="h:5")
    assert [(p.rank, p.gpu, p.dist_addr) for p in node1.places(0)] == [(2, 0, "h:5"), (3, 1, "h:5")]
    cpu = Layout(tp_size=2, nnodes=1, node_rank=0, base_gpu_id=0, on_gpu=False, dist_init_addr=None)
    assert all(p.gpu is None for p in cpu.places(0))
    cpu.check_gpus(8)  # no GPUs needed
