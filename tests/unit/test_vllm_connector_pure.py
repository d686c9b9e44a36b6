"""The vLLM connector's pure parts: load planning, save planning, config, version check."""

from __future__ import annotations

import pytest

from kvdir.agent.engine.vllm import compat
from kvdir.agent.engine.vllm.config import ConnectorConfigError, from_extra
from kvdir.agent.engine.vllm.namespace import KvShape, namespace
from kvdir.agent.engine.vllm.plan import (
    NOTHING,
    BlockTables,
    Found,
    LoadPlan,
    PullCost,
    SavePlanner,
    plan_load,
    pool_only,
)
from kvdir.agent.engine.vllm.worker import valid_local

BT = 32


def test_nothing_found_loads_nothing() -> None:
    assert plan_load(NOTHING, 50, 1600, BT, 0).tokens == 0


def test_a_peer_prefix_loads_every_full_block_but_the_last_tokens() -> None:
    plan = plan_load(Found((), 50, True), 53, 1700, BT, 0)
    assert (plan.tokens, plan.start_block, plan.end_block, plan.from_pool) == (1600, 0, 50, 0)
    # A prompt that is all full blocks: the block of its last token is computed, not loaded.
    whole = plan_load(Found((), 50, True), 50, 1600, BT, 0)
    assert whole.end_block == 49


def test_the_local_hit_and_the_pool_are_counted_from_vllms_blocks() -> None:
    plan = plan_load(Found(tuple(range(20)), 50, True), 53, 1700, BT, 10 * BT)
    assert (plan.tokens, plan.start_block, plan.end_block, plan.from_pool) == (1280, 10, 50, 10)
    assert plan_load(Found((), 10, True), 53, 1700, BT, 10 * BT).tokens == 0


def test_short_hits_below_min_blocks_are_recomputed() -> None:
    assert plan_load(Found((), 2, True), 53, 1700, BT, 0, min_blocks=3).tokens == 0


def test_saves_each_completed_block_once() -> None:
    s = SavePlanner(BT)
    hashes = [bytes([i]) * 8 for i in range(10)]
    s.admit("r1", 2)
    assert s.due("r1", hashes, 5 * BT + 3) == (2, [2, 3, 4])
    assert s.due("r1", hashes, 6 * BT) == (5, [5])
    s.admit("r2", 0)  # the same prefix in another request: only what r1 did not save
    assert s.due("r2", hashes, 8 * BT)[1] == [0, 1, 6, 7]
    assert s.due("unknown", hashes, 8 * BT) == (0, [])


def test_local_reads_are_valid_only_while_the_header_stood_still() -> None:
    h = [b"a", b"b", b"c"]
    before = [(1, 2, b"a"), (1, 2, b"b"), (1, 2, b"c")]
    assert valid_local(before, before, h) == 3
    moved = [(1, 2, b"a"), (2, 2, b"b"), (1, 2, b"c")]  # generation bumped during the copy
    assert valid_local(before, moved, h) == 1
    assert valid_local(before, before, [b"a", b"x", b"c"]) == 1  # another block


def test_config_refuses_unknown_keys_and_bad_values() -> None:
    assert from_extra({"agent_socket": "/s", "lookup_timeout_ms": 50}).lookup_timeout_ms == 50
    for bad in ({"nope": 1}, {"lookup_timeout_ms": 0}, {"save": "yes"}, {"agent_socket": ""}):
        with pytest.raises(ConnectorConfigError):
            from_extra(bad)


def test_unknown_vllm_versions_are_refused_in_one_line() -> None:
    assert compat.check("0.32.0") == "0.32"
    assert compat.check("0.33.1+cu129") == "0.33"
    assert compat.check("0.24.0") == "0.24"
    with pytest.raises(compat.UnsupportedVllm) as e:
        compat.check("0.23.0")
    assert "\n" not in str(e.value) and "0.23.0" in str(e.value)


def test_the_layout_is_part_of_the_namespace() -> None:
    cpu = KvShape(4, (2, 32, 128), "bf16", 2, "cpu")
    gpu = KvShape(4, (2, 32, 128), "bf16", 2, "cuda")
    assert cpu.block_bytes == 4 * 2 * 32 * 128 * 2
    a, b = namespace("m", 32, cpu, 0, 1), namespace("m", 32, gpu, 0, 1)
    assert a.layout == "vllm-cpu-bhnc/L4/2x32x128" and a.layout != b.layout
    assert namespace("m", 32, cpu, 1, 2).tp_rank == 1


def test_a_cuda_namespace_names_the_physical_order() -> None:
    fa = KvShape(32, (2, 16, 8, 128), "bf16", 2, "cuda", "bknhc")
    hnd = KvShape(32, (2, 8, 16, 128), "bf16", 2, "cuda", "bkhnc")
    assert fa.layer_block_bytes == 64 * 1024 and fa.block_bytes == 2 * 1024 * 1024
    assert fa.layout == "vllm-cuda-bknhc/L32/2x16x8x128"
    assert namespace("m", 16, fa, 0, 1).layout != namespace("m", 16, hnd, 0, 1).layout


def test_block_tables_follow_new_appended_and_resumed_requests() -> None:
    t = BlockTables()
    t.new("a", [4, 5])
    t.cached("a", [9], resumed=False)
    t.cached("a", None, resumed=False)  # no new blocks this step
    assert t.get("a") == [4, 5, 9]
    t.cached("a", [1, 2], resumed=True)  # preempted, then resumed with a new table
    assert t.get("a") == [1, 2]
    t.forget("a")
    assert t.get("a") is None


def test_a_pull_is_tried_until_both_speeds_are_measured() -> None:
    cost = PullCost()
    assert cost.pull_wins(1 << 30, 8192)
    cost.observe_load(1 << 30, 0.45)  # 1 GB over loopback TCP
    assert cost.pull_wins(1 << 30, 8192)  # no prefill measured yet
    cost.observe_prefill(100, 0.001)  # too few tokens to say anything: ignored
    assert cost.prefill_tokens_per_s == 0.0


def test_the_seeds_point_a_slow_pull_loses_to_recompute_a_fast_one_wins() -> None:
    tcp, ipc = PullCost(), PullCost()
    for cost, load_s in ((tcp, 0.45), (ipc, 0.012)):
        cost.observe_load(1 << 30, load_s)  # 1 GB: TCP vs CUDA IPC (H200 figures)
        cost.observe_prefill(8192, 0.218)  # an 8k prefill in 218 ms
    assert not tcp.pull_wins(1 << 30, 8192)
    assert ipc.pull_wins(1 << 30, 8192)
    # averages follow the engine: TCP twice as fast as it was, pulls win again
    for _ in range(20):
        tcp.observe_load(1 << 30, 0.05)
    assert tcp.pull_wins(1 << 30, 8192)


def test_skipping_the_peer_part_keeps_what_this_nodes_pool_holds() -> None:
    plan = LoadPlan(tokens=64 * 16, start_block=0, end_block=64, from_pool=10)
    assert plan.peer_blocks == 54
    kept = pool_only(plan, 16)
    assert (kept.tokens, kept.end_block, kept.from_pool, kept.peer_blocks) == (160, 10, 10, 0)
    assert pool_only(LoadPlan(512, 2, 10, 0), 16) == LoadPlan(0, 2, 2, 0)
