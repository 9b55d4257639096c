"""The ecosystem's indexer API, ``POST /query`` and ``/query_by_hash`` (Dynamo's standalone indexer 1.6.1,
Mooncake RFC #1403): answers equal to the engines' truth and to Dynamo's over the same engines; the
tier walk vLLM makes; the request contract and its errors."""

from __future__ import annotations

import json
import os
from array import array
import random
import shutil

import aiohttp
import pytest
from aiohttp import web
from pydantic import ValidationError

from cache_indexer.api.app import HitRateApi
from cache_indexer.api.json_request import RequestError
from cache_indexer.api.tiered_query import decode_query, decode_query_by_hash, query_tokens
from bench.dynamo import dynamo_python, in_loopback_namespace
from cache_indexer.indexer.hit_rate import NATIVE_QUERY
from cache_indexer.indexer.l1_state import L1State
from cache_indexer.indexer.tier_match import NativeTierQuery, match_keys
from cache_indexer.infra.metrics import Metrics
from cache_indexer.schemas.block_hash import BlockHasher
from cache_indexer.schemas.config import HttpConfig
from cache_indexer.schemas.tiered_api import QueryByHashRequest, QueryRequest
from tests import dynamo_side_by_side as side
from tests.test_api import EXTRA_KEY_CASES

HASHER = BlockHasher("sha256_cbor", "0")
B = 4
PROMPT = [random.Random(1).randrange(1, 1000) for _ in range(8 * B)]
H = HASHER.event_hashes(PROMPT, B)


def _seed() -> int:
    seed = int(os.environ.get("CACHE_INDEXER_SEED", random.randrange(1 << 30)))
    print(f"seed {seed} (replay: CACHE_INDEXER_SEED={seed})")
    return seed


def _check(report: dict) -> None:
    assert report["requests"] == 200
    assert not report["mismatches"], json.dumps(report["mismatches"][:3], indent=1)
    for what, n in report["covered"].items():
        assert n > 0, f"no request exercised {what} (seed {report['seed']})"


async def test_query_answers_equal_the_engines_truth(nats_url):
    """200 token and by-hash queries (plain, LoRA, salted, multimodal) over engines with two DP ranks,
    GPU, CPU and STORAGE events, evictions: every answer is what vLLM would load."""
    _check(await side.scenario(_seed(), None))


def test_query_answers_equal_dynamos_over_the_same_engines():
    """The same 200 requests to Dynamo's standalone indexer and to cache-indexer, over the same engines,
    in a loopback-only network namespace (Dynamo listens on every interface)."""
    python = dynamo_python()
    if python is None:
        if os.environ.get("CACHE_INDEXER_REQUIRE_DYNAMO") == "1":
            pytest.fail("Dynamo's standalone indexer (ai-dynamo-runtime) is required but not found (DYNAMO_PYTHON)")
        pytest.skip("Dynamo's standalone indexer is not installed: pip install -e '.[bench]' (ai-dynamo-runtime "
                    "1.6.1), or set DYNAMO_PYTHON to a Python that has it")
    if not shutil.which("unshare"):
        pytest.skip("needs unshare: Dynamo listens on every interface, so it runs in its own network namespace")
    seed = _seed()
    report = in_loopback_namespace(f"from tests.dynamo_side_by_side import run\nresult = run({seed}, {python!r})",
                                   timeout=600)
    _check(report)
    assert report["compared_with_dynamo"] >= 80 and report["by_hash_compared"] >= 30, report
    print({k: v for k, v in report.items() if k != "mismatches"})


# -- the tier walk ---------------------------------------------------------------------------------

def _state(histories: dict[tuple[str, int], list[tuple[int, int, str]]]) -> L1State:
    """Workers storing ranges [a, z) of PROMPT's chain per medium."""
    l1 = L1State()
    for (pod, rank), ranges in histories.items():
        events = [{"kind": "stored", "medium": m, "hashes": H[a:z], "parent": None} for a, z, m in ranges]
        l1.apply({"v": 1, "type": "batch", "pod": pod, "rank": rank, "gen": 1, "seq": 0, "ts": 0.0, "events": events})
    return l1


#: What Dynamo 1.6.1 answered for these histories (probed over real ZMQ engines), in blocks:
#: (gpu, cpu, disk) per worker. The walk is vLLM's: GPU from block 0, then CPU from there, then STORAGE.
WALKS = [
    ([(0, 4, "GPU"), (0, 8, "CPU")], (4, 8, 8)),
    ([(0, 2, "GPU"), (4, 8, "CPU")], (2, 2, 2)),  # the CPU's run must start where the GPU's ended
    ([(0, 2, "GPU"), (2, 6, "CPU"), (0, 8, "STORAGE")], (2, 6, 8)),
    ([(0, 4, "CPU")], (0, 4, 4)),
    ([(0, 8, "STORAGE")], (0, 0, 8)),
    ([(0, 3, "STORAGE"), (3, 8, "CPU")], (0, 0, 3)),  # STORAGE comes after the CPU: not back again
    ([(0, 2, "GPU"), (2, 4, "CPU"), (4, 8, "GPU")], (2, 4, 4)),  # nor back to the GPU
]


@pytest.mark.parametrize("ranges,want", WALKS)
def test_the_tier_walk_is_vllms(ranges, want):
    l1 = _state({("p", 0): ranges})
    assert match_keys(H, len(H), l1, None).ranks["p"][0] == want


async def test_query_answers_per_rank_and_instance_as_dynamo_does():
    """Per instance: each rank's walk; ``gpu``, ``cpu``, ``disk`` of the best rank; ``dp`` the ranks with
    any match (their GPU tokens); instances without a match left out; ``scores`` the GPU per rank."""
    l1 = _state({("i5", 0): [(0, 2, "GPU"), (4, 8, "CPU")], ("i5", 1): [(0, 4, "GPU")],  # CPU is per rank
                 ("i6", 0): [(0, 4, "CPU")], ("i7", 1): [(0, 2, "GPU")], ("i8", 0): [(6, 8, "GPU")]})
    async with _served(l1) as base, aiohttp.ClientSession() as s:
        for path, body in (("/query", {"token_ids": PROMPT, "model_name": "m"}),
                           ("/query_by_hash", {"block_hashes": H, "model_name": "m"})):
            async with s.post(base + path, json=body) as r:
                assert r.status == 200, await r.text()
                got = await r.json()
            assert got == {
                "scores": {"i5": {"0": 8, "1": 16}, "i7": {"1": 8}}, "frequencies": [],
                "instances": {"i5": {"longest_matched": 16, "gpu": 16, "dp": {"0": 8, "1": 16}, "cpu": 16, "disk": 16, "l3": 0},
                              "i6": {"longest_matched": 16, "gpu": 0, "dp": {"0": 0}, "cpu": 16, "disk": 16, "l3": 0},
                              "i7": {"longest_matched": 8, "gpu": 8, "dp": {"1": 8}, "cpu": 8, "disk": 8, "l3": 0}}}


@pytest.mark.skipif(not NATIVE_QUERY, reason="the native query is not built")
def test_the_native_match_equals_the_reference_walk():
    """Without offloaded blocks /query goes through the native query; with them, the reference walk."""
    seed = _seed()
    rng = random.Random(seed)
    for _ in range(40):
        histories = {(f"p{rng.randrange(4)}", rng.randrange(2)): [(a := rng.randrange(8), rng.randint(a, 8), "GPU")
                                                                   for _ in range(rng.randrange(3))]
                     for _ in range(rng.randrange(1, 6))}
        l1 = _state(histories)
        tokens = PROMPT[:rng.randint(0, len(PROMPT))]
        keys = HASHER.event_hashes(tokens, B)
        query = NativeTierQuery.prepare(HASHER, array("Q", tokens), B, "", l1, None)
        assert query is not None, "nothing offloaded: the native query answers"
        native, ref = query.result(query.native.run()), match_keys(keys, len(keys), l1, None)
        assert (native.ranks, native.full_blocks) == (ref.ranks, ref.full_blocks), (seed, histories, len(tokens))


async def test_query_answers_on_the_query_threads_equal_the_reference_walks(monkeypatch):
    """Bodies whose worst case exceeds INLINE_BUDGET go to the native query threads (here every one): the
    same answers."""
    from cache_indexer.api import app as app_module
    from cache_indexer.api.tiered_query import answer

    monkeypatch.setattr(app_module, "INLINE_BUDGET", -1)
    l1 = _state({("a", 0): [(0, 5, "GPU")], ("a", 1): [(0, 7, "GPU")], ("b", 0): [(0, 2, "GPU"), (3, 8, "GPU")]})
    async with _served(l1) as base, aiohttp.ClientSession() as s:
        for length in range(0, len(PROMPT) + 1, 3):
            tokens = PROMPT[:length]
            async with s.post(base + "/query", json={"token_ids": tokens, "model_name": "m", "cache_salt": ""}) as r:
                got = await r.json()
            keys = HASHER.event_hashes(tokens, B)
            assert got == json.loads(json.dumps(answer(match_keys(keys, len(keys), l1, None), B))), length



async def test_a_routing_query_of_a_long_prompt_is_answered_on_the_loop_within_its_budget(monkeypatch):
    """A conversation prompt (12k tokens of 16-bit ids, block size 16: a 70 kB body, the trace benchmark's
    routing query) is answered on the event loop: its call's worst case fits INLINE_BUDGET, and a hand-off
    to the query threads would cost more than the call. The same prompt at block size 1 (a worst case 9x
    longer) goes to the threads, and so does the first with 1,100 engines as candidates (the walk looks
    each block up in their 18 index chunks). All answer what the reference walk answers. (Seconds.)"""
    from cache_indexer.api import app as app_module
    from cache_indexer.api.tiered_query import answer
    from cache_indexer.indexer.query_threads import QueryThreads
    from tests.conftest import needs_native

    needs_native(NATIVE_QUERY, "the native query")
    handed: list[int] = []
    run = QueryThreads.run

    async def counted(self, query):
        handed.append(query.call_args[2])
        return await run(self, query)
    monkeypatch.setattr(QueryThreads, "run", counted)
    tokens = [random.Random(2).randrange(1 << 16) for _ in range(12_000)]
    l1 = L1State()
    for bs in (16, 1):  # pod a holds the first half of the chain at each block size
        keys = HASHER.event_hashes(tokens, bs)
        l1.apply({"v": 1, "type": "batch", "pod": "a", "rank": 0, "gen": 1, "seq": int(bs == 1), "ts": 0.0,
                  "events": [{"kind": "stored", "medium": "GPU", "hashes": keys[:len(keys) // 2], "parent": None}]})
    body = {"token_ids": tokens, "model_name": "m"}
    assert 60_000 < len(json.dumps(body, separators=(",", ":"))) < 80_000
    async with _served(l1) as base, aiohttp.ClientSession() as s:
        for bs, threads in ((16, []), (1, [1])):
            async with s.post(base + "/query", json={**body, "block_size": bs}) as r:
                got = await r.json()
            keys = HASHER.event_hashes(tokens, bs)
            assert got == json.loads(json.dumps(answer(match_keys(keys, len(keys), l1, None), bs))), bs
            assert got["instances"]["a"]["gpu"] == len(keys) // 2 * bs
            assert handed == threads, (bs, handed)
    for i in range(1_100):  # a large fleet: engines holding a block of their own
        l1.apply({"v": 1, "type": "batch", "pod": f"e{i}", "rank": 0, "gen": 1, "seq": 0, "ts": 0.0,
                  "events": [{"kind": "stored", "medium": "GPU", "hashes": [i + 1], "parent": None}]})
    async with _served(l1) as base, aiohttp.ClientSession() as s:
        async with s.post(base + "/query", json={**body, "block_size": 16}) as r:
            assert r.status == 200 and (await r.json())["instances"]["a"]["gpu"] == 12_000 // 16 // 2 * 16
    assert handed == [1, 16]


# -- the contract ----------------------------------------------------------------------------------

class _Served:
    """An app on 127.0.0.1, for ``async with``: its base URL."""

    def __init__(self, api: HitRateApi) -> None:
        self.app = api.make_app()

    async def __aenter__(self) -> str:
        self.runner = web.AppRunner(self.app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc) -> None:
        await self.runner.cleanup()


def _served(l1, max_body: int = 1 << 20) -> _Served:
    """The app over ``l1`` (PROMPT's block size)."""
    http = HttpConfig(host="127.0.0.1", port=0, maxHitRateBodyBytes=max_body)
    return _Served(HitRateApi(http, HASHER, lambda: (l1, None), lambda: True, Metrics(), block_size=B))


BAD = [
    ("/query", b'{"token_ids": [1, 2]}', 422, "model_name"),
    ("/query", b'{"model_name": "m"}', 422, "token_ids"),
    ("/query", b'{"model_name": "m", "token_ids": [1, -2]}', 422, "token_ids"),
    ("/query", b'{"model_name": "m", "token_ids": "12"}', 422, "token_ids"),
    ("/query", b'{"model_name": 7, "token_ids": []}', 422, "model_name"),
    ("/query", b'{"model_name": "m", "token_ids": [], "block_size": 0}', 422, "block_size"),
    ("/query", b'{"model_name": "m", "token_ids": [1]', 400, "invalid JSON"),
    ("/query", b'   ', 400, "empty"),
    ("/query", b'{"model_name": "m", "token_ids": [1, 2], "mm_features": [{"identifier": "x", "offset": 1, '
               b'"length": 5}]}', 400, "past the prompt"),
    ("/query_by_hash", b'{"model_name": "m"}', 422, "block_hashes"),
    ("/query_by_hash", b'{"model_name": "m", "block_hashes": [18446744073709551616]}', 422, "block_hashes"),
    ("/query_by_hash", b'{"model_name": "m", "block_hashes": [1], "cache_salt": "s"}', 400, "cache_salt"),
]


@pytest.mark.parametrize("path,body,status,named", BAD)
async def test_bad_requests_get_dynamos_codes_with_a_message_naming_the_problem(path, body, status, named):
    async with _served(L1State()) as base, aiohttp.ClientSession() as s:
        async with s.post(base + path, data=body, headers={"Content-Type": "application/json"}) as r:
            assert r.status == status
            assert named in (await r.json())["error"]


async def test_oversized_bodies_get_413():
    async with _served(L1State(), max_body=1000) as base, aiohttp.ClientSession() as s:
        async with s.post(base + "/query", json={"model_name": "m", "token_ids": list(range(1000))}) as r:
            assert r.status == 413 and "limit" in (await r.json())["error"]


async def test_the_ecosystems_other_spellings_and_unknown_fields_are_accepted():
    """Mooncake's ``model`` and ``seq_hashes``, Dynamo's older ``tenant_id``; an int64 hash is the same
    64 bits as the uint64 vLLM publishes; unknown fields are ignored, as Dynamo ignores them."""
    l1 = _state({("p", 0): [(0, 3, "GPU")]})
    signed = [h - (1 << 64) if h >= 1 << 63 else h for h in H]
    async with _served(l1) as base, aiohttp.ClientSession() as s:
        for path, body in (("/query", {"model": "m", "tenant_id": "t", "token_ids": PROMPT, "instance_id": 4}),
                           ("/query_by_hash", {"model_name": "m", "seq_hashes": signed})):
            async with s.post(base + path, json=body) as r:
                assert (await r.json())["instances"]["p"]["gpu"] == 12


BODIES = [
    {"model_name": "m", "token_ids": [1, 2, 3]},
    {"model": "m", "token_ids": [], "routing_group": "g", "block_size": 16, "cache_salt": "s", "lora_name": "a",
     "lora_path": "/a", "mm_features": [{"identifier": "x", "offset": 0, "length": 1}], "other": [1]},
    {"model_name": "m", "token_ids": [1], "block_size": -1},
    {"model_name": "m", "token_ids": [True]},
    {"model_name": None, "token_ids": [1]},
    {"token_ids": [1]},
    {"model_name": "m", "token_ids": [1], "mm_features": [{"identifier": "", "offset": 0, "length": 1}]},
    {"model_name": "m", "token_ids": [1], "lora_name": "x" * 5000},
]


def _accepted(check, raw: bytes, errors) -> bool:
    try:
        check(raw)
        return True
    except errors:
        return False


@pytest.mark.parametrize("body", BODIES)
def test_the_fast_decoder_and_the_contract_agree(body):
    raw = json.dumps(body).encode()
    fast = _accepted(lambda r: query_tokens(decode_query(r)[1]), raw, RequestError)
    assert fast == _accepted(QueryRequest.model_validate_json, raw, ValidationError)


@pytest.mark.parametrize("body", [{"model_name": "m", "block_hashes": [1, -1]}, {"model_name": "m"},
                                  {"model_name": "m", "block_hashes": [-(1 << 63) - 1]},
                                  {"model": "m", "seq_hashes": [(1 << 64) - 1]}])
def test_the_by_hash_decoder_and_the_contract_agree(body):
    raw = json.dumps(body).encode()
    assert (_accepted(decode_query_by_hash, raw, RequestError)
            == _accepted(QueryByHashRequest.model_validate_json, raw, ValidationError))


async def test_a_long_walk_leaves_the_event_loop_between_slices(monkeypatch):
    """/query_by_hash over many matching blocks: the reference walk yields to the loop every WALK_SLICE
    blocks, and still answers the whole run."""
    from cache_indexer.api import tiered_query

    monkeypatch.setattr(tiered_query, "WALK_SLICE", 64)
    keys = list(range(1, 20_001))
    l1 = L1State()
    l1.apply({"v": 1, "type": "batch", "pod": "p", "rank": 0, "gen": 1, "seq": 0, "ts": 0.0,
              "events": [{"kind": "stored", "medium": "GPU", "hashes": keys, "parent": None}]})
    turns = 0
    real_sleep = tiered_query.asyncio.sleep

    async def counted(delay):
        nonlocal turns
        turns += 1
        await real_sleep(delay)
    monkeypatch.setattr(tiered_query.asyncio, "sleep", counted)
    async with _served(l1, max_body=1 << 22) as base, aiohttp.ClientSession() as s:
        async with s.post(base + "/query_by_hash", json={"block_hashes": keys, "model_name": "m"}) as r:
            assert (await r.json())["instances"]["p"]["gpu"] == len(keys) * B
    assert turns >= len(keys) // 64 - 1


@pytest.mark.parametrize("twice", [False, True])
async def test_a_4_mib_body_of_two_million_short_hashes_gets_its_400_without_holding_the_loop(twice):
    """A review: ``/query_by_hash`` with two million one-digit hashes (4 MiB, within the body limit) held the
    event loop for 119 ms while they became ints, to answer a walk that stops at the first block. Refused
    now from a count of the body's values, also where the key is given twice (the first one, decoded all
    the same, holds them); real hashes (19 or 20 digits) never come near the bound."""
    from cache_indexer.api.server import HttpServer
    from cache_indexer.api.tiered_query import MAX_QUERY_HASHES
    from tests.test_api import slow_loop_steps

    many = b"[" + b",".join([b"1"] * 2_000_000) + b"]"
    body = (b'{"model_name":"m","block_hashes":' + many + b',"block_hashes":[1]}' if twice else
            b'{"model_name":"m","block_hashes":' + many + b"}")
    http = HttpConfig(host="127.0.0.1", port=0)
    assert len(body) <= http.maxHitRateBodyBytes
    metrics = Metrics()
    server = HttpServer(HitRateApi(http, HASHER, lambda: (_state({("p", 0): [(0, 8, "GPU")]}), None), lambda: True,
                                   metrics, block_size=B).make_app(), http, metrics)
    await server.start()
    try:
        async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{server.port}") as s:
            before, _ = await slow_loop_steps(s)
            async with s.post("/query_by_hash", data=body) as r:
                assert r.status == 400 and str(MAX_QUERY_HASHES) in (await r.json())["error"]
            after, longest = await slow_loop_steps(s)
            assert after == before, f"a step of the loop took {longest * 1e3:.0f} ms"
            rng = random.Random(7)  # about as many real hashes as a 4 MiB body holds pass
            real = H + [rng.getrandbits(63) | 1 << 62 for _ in range(190_000)]
            payload = json.dumps({"model_name": "m", "block_hashes": real}, separators=(",", ":")).encode()
            assert len(payload) <= http.maxHitRateBodyBytes
            async with s.post("/query_by_hash", data=payload) as r:
                assert r.status == 200 and (await r.json())["instances"]["p"]["gpu"] == 8 * B
    finally:
        await server.stop()


async def test_a_failing_computation_is_a_logged_500_not_a_dropped_connection(monkeypatch, caplog):
    from cache_indexer.api import tiered_query

    def broken(*args):
        raise RuntimeError("index unreadable")
    monkeypatch.setattr(tiered_query.KeyWalk, "feed", broken)
    async with _served(_state({("p", 0): [(0, 2, "GPU")]})) as base, aiohttp.ClientSession() as s:
        async with s.post(base + "/query_by_hash", json={"block_hashes": H, "model_name": "m"}) as r:
            assert r.status == 500 and "index unreadable" in (await r.json())["error"]
    assert "failed" in caplog.text


@pytest.mark.parametrize("case,encoding", EXTRA_KEY_CASES, ids=[f"{e}:{c['id']}" for c, e in EXTRA_KEY_CASES])
async def test_lora_and_multimodal_queries_match_the_blocks_vllm_hashed(case, encoding):
    """vLLM's own hashes of LoRA and multimodal requests (tests/data): /query names the adapter or the
    items and matches every block; without them it does not; /query_by_hash with vLLM's hashes does."""
    hasher = BlockHasher(case["hash_algo"], case["PYTHONHASHSEED"], encoding)
    hashes = [b["event_block_hash_int"] for b in case["blocks"]]
    l1 = L1State()
    l1.apply({"v": 1, "type": "batch", "pod": "p", "rank": 0, "gen": 1, "seq": 0, "ts": 0.0,
              "events": [{"kind": "stored", "medium": "GPU", "hashes": hashes, "parent": None}]})
    body = {"token_ids": case["token_ids"], "block_size": case["block_size"], "cache_salt": case["cache_salt"] or "",
            "model_name": "m"}
    if case["lora"]:
        body.update(lora_name=case["lora"]["lora_name"], lora_path=case["lora"]["lora_path"])
    if case["mm_features"]:
        body["mm_features"] = [{k: m[k] for k in ("identifier", "offset", "length")} for m in case["mm_features"]]
    plain = {k: v for k, v in body.items() if k not in ("lora_name", "lora_path", "mm_features")}
    full = len(hashes) * case["block_size"]
    app = HitRateApi(HttpConfig(host="127.0.0.1", port=0), hasher, lambda: (l1, None), lambda: True, Metrics())
    async with _Served(app) as base, aiohttp.ClientSession() as s:
        for path, request, want in (("/query", body, full), ("/query_by_hash", {"block_hashes": hashes,
                                                                                "block_size": case["block_size"],
                                                                                "model_name": "m"}, full)):
            async with s.post(base + path, json=request) as r:
                assert (await r.json())["instances"]["p"]["gpu"] == want
        async with s.post(base + "/query", json=plain) as r:
            assert (await r.json())["instances"].get("p", {}).get("gpu", 0) < full
