"""L3 parsing and polling: key grammars and every captured master response format, the poller's diffs
and failure handling over real HTTP, and (in a loopback-only network namespace) a real Mooncake Master
with real store clients."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import aiohttp
import msgpack
import pytest
from aiohttp import web

from cache_indexer.bridge.mooncake_keys import KeyParser
from cache_indexer.bridge.mooncake_master import MasterError, parse_batch_query, parse_query_key
from cache_indexer.bridge.mooncake_poller import MasterTarget, MooncakePoller
from cache_indexer.infra.metrics import Metrics
from cache_indexer.indexer.l3_state import L3State
from cache_indexer.schemas.config import L3IngestConfig
from tests.conftest import DATA, lose_messages_keep_metadata, make_config, wait_for

MC = DATA / "mooncake"
RESP = MC / "responses"
ROOT = Path(__file__).resolve().parents[1]


def captured(name: str) -> tuple[int, str, bytes]:
    """(status, content type, body) of a captured .http file."""
    raw = (RESP / name).read_bytes()
    head, _, body = raw.partition(b"\r\n\r\n") if b"\r\n\r\n" in raw else raw.partition(b"\n\n")
    lines = head.decode().splitlines()
    status_line = next(line for line in lines if line.startswith("HTTP/"))
    ctype = next((line.split(":", 1)[1].strip() for line in lines if line.lower().startswith("content-type:")), "")
    return int(status_line.split()[1]), ctype, body


# -- key grammars --------------------------------------------------------------------------------
def test_every_captured_key_grammar():
    ex = json.loads((RESP / "00_example_keys.json").read_text())
    hashes = {h[-16:] for h in ex["vllm_block_hashes_hex"]}
    parser = KeyParser()
    for fmt, keys in ex["keys"].items():
        for key in keys:
            h = parser.block_hash(key)
            if fmt.startswith("ascend_v0.11") or fmt.startswith("lmcache"):
                assert h is None, (fmt, key)
            else:
                assert h is not None and f"{h:016x}" in hashes, (fmt, key)
    assert parser.unmatched == 0 and parser.foreign > 0
    for line in (MC / "example-keys.txt").read_text().splitlines():
        if line.strip():
            parser.block_hash(line.strip())
    assert parser.unmatched == 0
    assert parser.block_hash("some/other-key") is None and parser.unmatched == 1


def test_key_hash_matches_the_event_form_of_the_vllm_chain():
    from cache_indexer.schemas.block_hash import BlockHasher, event_block_hash

    digest = BlockHasher("sha256", "0").block_hashes(list(range(1000, 1128)), 128)[0]
    key = f"Qwen2.5-7B-Instruct@pcp0@dcp0@head_or_tp_rank:0@pp_rank:0@group:0@cache_role:kv@cache_family:default@{digest.hex()}"
    assert KeyParser().block_hash(key) == event_block_hash(digest)


def test_custom_patterns_and_unknown_formats():
    p = KeyParser(formats=["vllm_store_v2"], extra_patterns=[r"^mine/(?P<hash>[0-9a-f]{64})$"])
    assert p.block_hash("mine/" + "ab" * 32) == int("ab" * 8, 16)
    with pytest.raises(ValueError, match="unknown"):
        KeyParser(formats=["nope"])
    with pytest.raises(ValueError, match="hash"):
        KeyParser(extra_patterns=[r"^(?P<x>.*)$"])


# -- response formats ----------------------------------------------------------------------------
def test_query_key_formats_of_every_version():
    assert parse_query_key(*captured("04_query_key_ascend_raw.http")) == {"127.0.0.2"}  # >= 0.3.12 JSON
    assert parse_query_key(*captured("08_query_key_two_replicas.http")) == {"127.0.0.2", "127.0.0.4"}
    assert parse_query_key(*captured("01_query_key_missing.http")) is None
    for version in ("0.3.11.post1", "0.3.7.post2"):  # NDJSON text, with and without protocol_
        st = json.loads((RESP / f"16_selftest_v{version}.json").read_text())
        status, ctype, body = st["query_key"]
        assert parse_query_key(status, ctype, body.encode()) == {"127.0.0.2"}
        status, ctype, body = st["query_key_missing"]
        assert parse_query_key(status, ctype, body.encode()) is None
    with pytest.raises(MasterError):
        parse_query_key(200, "application/json", b"{not json")
    with pytest.raises(MasterError):
        parse_query_key(503, "text/plain", b"503 Service Unavailable")


def test_batch_query_format():
    _, _, body = captured("05_batch_query_keys_raw.http")
    res = parse_batch_query(body)
    assert res["missing-key"] is None
    assert any(v == {"127.0.0.2"} for v in res.values())
    with pytest.raises(MasterError):
        parse_batch_query(b'{"success": true}')


# -- the poller over HTTP -------------------------------------------------------------------------
class FakeMaster:
    """Serves the admin endpoints from an in-memory table, in the >= 0.3.12 formats, with faults."""

    def __init__(self) -> None:
        self.keys: dict[str, list[str]] = {}  # key -> transport endpoints
        self.segments: list[str] = []
        self.fault: str | None = None
        self.segments_delay = 0.0
        self.batch_calls = 0
        self.batch_keys_asked = 0
        self.asked: list[str] = []  # keys asked about through /batch_query_keys, in order
        self.query_key_calls = 0
        self.batch_faults: list[str] = []  # one-off faults of the next /batch_query_keys answers

    async def start(self):
        app = web.Application()
        app.router.add_get("/get_all_keys", self.all_keys)
        app.router.add_get("/get_all_segments", self.all_segments)
        app.router.add_get("/batch_query_keys", self.batch)
        app.router.add_get("/query_key", self.query_key)
        app.router.add_get("/empty", self.empty)
        self.runner = web.AppRunner(app, max_line_size=4 << 20)  # the real master takes 500 kB query strings
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def _faulty(self):
        if self.fault == "timeout":
            await asyncio.sleep(1.5)  # past the poller's httpTimeout of 1 s
        if self.fault == "503":
            return web.Response(status=503, text="503 Service Unavailable")
        return None

    async def all_keys(self, request):
        if self.fault == "html":  # an ingress's error page, with status 200
            return web.Response(text="<html><body><h1>Bad Gateway</h1></body></html>\n", content_type="text/html")
        if self.fault == "binary":
            return web.Response(body=b"\xff\xfe\x00\x01garbage\n", content_type="text/plain")
        if self.fault == "redirect":
            raise web.HTTPFound("/empty")
        if self.fault == "huge":  # one body over ingest.l3.maxResponseBytes
            return web.Response(body=b"k\n" * (1 << 20), content_type="text/plain")
        if self.fault == "endless":  # a chunked stream that never ends
            resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
            await resp.prepare(request)
            while True:
                await resp.write(b"key\n" * 4096)
        return await self._faulty() or web.Response(text="".join(k + "\n" for k in self.keys),
                                                    content_type="text/plain; version=0.0.4")

    async def empty(self, request):
        return web.Response(text="", content_type="text/plain")

    async def all_segments(self, request):
        await asyncio.sleep(self.segments_delay)
        return await self._faulty() or web.Response(text="".join(s + "\n" for s in self.segments),
                                                    content_type="text/plain")

    async def query_key(self, request):
        self.query_key_calls += 1
        k = request.query_string[len("key="):]
        if k not in self.keys:
            return web.json_response({"success": False, "error": "OBJECT_NOT_FOUND"}, status=404)
        return web.json_response({"success": True, "data": [{"transport_endpoint_": ep} for ep in self.keys[k]]})

    async def batch(self, request):
        fault = self.batch_faults.pop(0) if self.batch_faults else self.fault
        if fault in ("404", "old"):  # an ingress hiccup once, or a master < 0.3.9 for good
            return web.Response(status=404, text="404 Not Found")
        if fault == "empty":  # an odd answer about none of the keys
            return web.json_response({"success": True, "data": {}})
        if fault == "no_decode":  # 0.3.9 - 0.3.11 echo the percent-encoded keys
            raw = request.raw_path.split("?keys=", 1)[1].split(",")
            return web.json_response({"success": True, "data": {k: {"ok": False, "error": "OBJECT_NOT_FOUND"} for k in raw}})
        if self.fault == "malformed":
            return web.Response(text="{garbage", content_type="application/json")
        if self.fault == "nested":  # valid JSON, 100,000 levels deep
            return web.Response(text="[" * 100000 + "]" * 100000, content_type="application/json")
        self.batch_calls += 1
        asked = request.query["keys"].split(",")
        self.batch_keys_asked += len(asked)
        self.asked.extend(asked)
        data = {k: ({"ok": True, "error": None, "values": [{"size_": 64, "transport_endpoint_": ep} for ep in self.keys[k]]}
                    if k in self.keys else {"ok": False, "error": "OBJECT_NOT_FOUND", "values": None}) for k in asked}
        if self.fault == "unasked":  # an answer about a key nobody asked for
            data[key(999)] = {"ok": True, "error": None, "values": [{"transport_endpoint_": "127.0.0.9:1"}]}
        return web.json_response({"success": True, "data": data})


def l3_held(state: L3State, pod: str) -> set[int]:
    return {h for h, m in state.blocks.items() if any(m >> w & 1 for w in state.pod_workers(pod).values())}


class Sink:
    def __init__(self) -> None:
        self.state = L3State()
        self.messages: list[dict] = []

    async def diff(self, master, added, removed):
        self._apply({"type": "l3_diff", "master": master, "added": added, "removed": removed})

    async def full(self, master, pods):
        self._apply({"type": "l3_full", "master": master, "pods": pods})
        return True

    def _apply(self, msg):
        msg = msgpack.unpackb(msgpack.packb(msg), strict_map_key=False)
        self.messages.append(msg)
        self.state.apply(msg)

    def held(self, pod):
        return l3_held(self.state, pod)


def key(h: int, tp: int = 0) -> str:
    return f"M@pcp0@dcp0@head_or_tp_rank:{tp}@pp_rank:0@group:0@cache_role:kv@cache_family:default@{h:064x}"


@pytest.fixture
async def poller():
    master = await FakeMaster().start()
    sink, metrics = Sink(), Metrics()
    async with aiohttp.ClientSession() as session:
        cfg = L3IngestConfig(httpTimeout=1, batchKeys=2, fullStateEvery=1000, pollInterval=0.05, relocateEvery=0)
        p = MooncakePoller(MasterTarget("m0", master.url), cfg, sink, metrics, session)
        yield master, p, sink, metrics
    await master.runner.cleanup()


async def test_poller_diffs_refcounts_and_segments(poller):
    master, p, sink, metrics = poller
    master.segments = ["127.0.0.2:12001", "127.0.0.3:12002"]
    master.keys = {key(1): ["127.0.0.2:16001"], key(1, tp=1): ["127.0.0.2:16001"], key(2): ["127.0.0.3:16002"],
                   "unrelated/key": ["127.0.0.2:16001"]}
    await p.poll()
    assert sink.messages[-1]["type"] == "l3_full"
    assert sink.held("127.0.0.2") == {1} and sink.held("127.0.0.3") == {2}
    asked = master.batch_keys_asked
    await p.poll()  # nothing new: no location queries, no message
    assert master.batch_keys_asked == asked and len(sink.messages) == 1
    del master.keys[key(1)]  # one TP rank of block 1 goes: the pair stays
    master.keys[key(3)] = ["127.0.0.2:16001", "127.0.0.3:16002"]
    await p.poll()
    assert master.batch_keys_asked == asked + 1, "only the new key is located"
    assert sink.held("127.0.0.2") == {1, 3} and sink.held("127.0.0.3") == {2, 3}
    master.segments = ["127.0.0.2:12001"]  # pod .3's segment is unmounted
    await p.poll()
    assert sink.held("127.0.0.3") == set()
    master.keys = {}  # master restarted empty / all evicted
    await p.poll()
    assert sink.held("127.0.0.2") == set()
    assert metrics.l3_unparsed_keys._value.get() == 1  # counted once, not per poll


async def test_an_endpoint_that_names_no_host_is_left_out_and_the_rest_goes_on(poller, caplog):
    """From a review: one segment line with an unclosed bracket failed every poll of its master (nothing it
    changed was published while it was listed); a host with a comma (the poller joins hosts with commas)
    took another pod's block away; a 2 MB host failed the first full state. Such an endpoint is left out,
    logged; the other pods' keys go on."""
    master, p, sink, metrics = poller
    master.segments = ["127.0.0.2:12001", "[fe80::1", "10.0.0.1,127.0.0.2:12000", "h" * (2 << 20) + ":1"]
    master.keys = {key(1): ["127.0.0.2:16001"], key(1, tp=1): ["10.0.0.1,127.0.0.2:12000"],
                   key(2): ["h" * (2 << 20) + ":1", "127.0.0.2:16001"]}
    await p.poll()
    assert sink.messages[-1]["type"] == "l3_full"
    assert sink.held("127.0.0.2") == {1, 2}
    master.keys[key(3)] = ["127.0.0.2:16001"]
    del master.keys[key(1, tp=1)]  # the odd key goes: it took nothing of 127.0.0.2 with it
    await p.poll()
    assert sink.held("127.0.0.2") == {1, 2, 3}
    assert not poll_errors(metrics)
    assert "names no host; left out" in caplog.text


async def test_a_publish_that_failed_is_made_good_by_the_next_polls_full_state(poller):
    """From a review: the poller's state moved before its publish; a publish that failed (NATS away, a
    message refused) lost that change until the next periodic full state, fullStateEvery polls later."""
    master, p, sink, metrics = poller
    master.segments = ["127.0.0.2:12001"]
    master.keys = {key(1): ["127.0.0.2:16001"]}
    await p.poll()
    master.keys[key(2)] = ["127.0.0.2:16001"]
    plain = sink.diff

    async def failing(*args):
        raise RuntimeError("injected: the publish failed")
    sink.diff = failing
    with pytest.raises(RuntimeError):
        await p.poll()
    sink.diff = plain
    await p.poll()
    assert sink.messages[-1]["type"] == "l3_full" and sink.held("127.0.0.2") == {1, 2}


async def test_a_master_back_empty_drops_its_keys_in_slices(poller, monkeypatch):
    """From a review: with 300k keys known, a master restarted empty held the event loop for 300 ms while
    the poller dropped every key in one piece (the API answers on that loop in local mode). The keys gone,
    like those selected, are dropped a slice at a time, the loop let go between slices (infra/pauser.py)."""
    from cache_indexer.bridge import mooncake_poller

    master, p, sink, metrics = poller
    master.segments = ["127.0.0.2:12001"]
    master.keys = {key(h): ["127.0.0.2:16001"] for h in range(1, 3001)}
    await p.poll()
    turns = []

    class Counted(mooncake_poller.Pauser):
        async def __call__(self) -> None:
            turns.append(1)
            await super().__call__()
    monkeypatch.setattr(mooncake_poller, "Pauser", Counted)
    master.keys = {}  # restarted empty
    await p.poll()
    assert sink.held("127.0.0.2") == set()
    assert len(turns) >= 2 * (3000 // mooncake_poller._SLICE), f"{len(turns)} chances to let go for 3,000 keys"


async def test_replicas_follow_their_segment_out_and_back_and_the_master_is_asked_again(poller):
    master, p, sink, _ = poller
    master.segments = ["127.0.0.2:12001", "127.0.0.3:12002"]
    master.keys = {key(1): ["127.0.0.2:16001", "127.0.0.3:16002"], key(2): ["127.0.0.3:16002"]}
    await p.poll()
    master.segments = ["127.0.0.2:12001"]  # pod .3's client re-registers: its segment is briefly gone
    await p.poll()
    assert sink.held("127.0.0.2") == {1} and sink.held("127.0.0.3") == set()
    master.asked.clear()
    master.segments = ["127.0.0.2:12001", "127.0.0.3:12002"]
    await p.poll()
    assert sink.held("127.0.0.3") == {1, 2}, "the replicas count again once the segment is back"
    assert sorted(master.asked) == sorted([key(1), key(2)]), "the keys on the returning host were asked about"
    del master.keys[key(1)]
    await p.poll()
    assert sink.held("127.0.0.2") == set() and sink.held("127.0.0.3") == {2}


async def test_a_new_client_on_a_dead_holders_ip_is_not_given_its_old_replicas(poller):
    """A 2-replica key whose holder .2 died keeps its replica on .3; a new client that mounts with .2's
    IP holds none of it (issue 13 #1: it was re-attributed to .2 without asking)."""
    master, p, sink, _ = poller
    master.segments = ["127.0.0.2:12001", "127.0.0.3:12002"]
    master.keys = {key(1): ["127.0.0.2:16001", "127.0.0.3:16002"]}
    await p.poll()
    master.segments = ["127.0.0.3:12002"]
    master.keys = {key(1): ["127.0.0.3:16002"]}  # the master dropped the dead holder's replica
    await p.poll()
    master.segments = ["127.0.0.2:12077", "127.0.0.3:12002"]  # a new client with the same IP
    await p.poll()
    assert sink.held("127.0.0.2") == set() and sink.held("127.0.0.3") == {1}


async def test_a_segment_that_re_registers_between_two_polls_has_its_keys_asked_again(poller):
    master, p, sink, _ = poller
    master.segments = ["127.0.0.2:12001"]
    master.keys = {key(1): ["127.0.0.2:16001"], key(2): ["127.0.0.2:16001"]}
    await p.poll()
    master.segments = ["127.0.0.2:12999"]  # unmounted and mounted again under a new name, keys gone
    master.keys = {key(1): [], key(2): ["127.0.0.2:16999"]}
    master.asked.clear()
    await p.poll()
    assert sorted(master.asked) == sorted([key(1), key(2)])
    assert sink.held("127.0.0.2") == {2}


@pytest.mark.parametrize("relocate_every", [0.5, 2.0])
async def test_a_key_put_again_on_another_pod_moves_within_relocate_every(relocate_every):
    """Listed at both polls, so only asking again finds it moved (issue 13 #1): every known key is asked
    about within relocateEvery, a few per poll."""
    master = await FakeMaster().start()
    sink, metrics = Sink(), Metrics()
    interval = 0.05
    cfg = L3IngestConfig(httpTimeout=1, batchKeys=50, fullStateEvery=1000, pollInterval=interval,
                         relocateEvery=relocate_every)
    master.segments = ["127.0.0.2:12001", "127.0.0.3:12002"]
    master.keys = {key(i): ["127.0.0.2:16001"] for i in range(200)}
    try:
        async with aiohttp.ClientSession() as session:
            p = MooncakePoller(MasterTarget("m0", master.url), cfg, sink, metrics, session)
            await p.poll()
            assert master.batch_keys_asked == 200
            master.keys[key(7)] = ["127.0.0.3:16002"]  # removed from .2 and put again on .3
            polls = 0
            while sink.held("127.0.0.3") != {7}:
                await p.poll()
                polls += 1
                assert polls <= relocate_every / interval + 1, f"still on the old pod after {polls} polls"
            assert 7 not in sink.held("127.0.0.2")
            per_poll = (master.batch_keys_asked - 200) / polls
            assert per_poll < 100, "a slice per poll, not every key every poll"
    finally:
        await master.runner.cleanup()
    assert metrics.l3_relocated_keys.labels("rolling")._value.get() >= 1


async def test_a_slow_segment_list_fails_the_poll_at_segments_fetch_timeout():
    master = await FakeMaster().start()
    master.segments = ["127.0.0.2:12001"]
    master.keys = {key(1): ["127.0.0.2:16001"]}
    master.segments_delay = 0.5  # within httpTimeout (1 s), beyond segmentsFetchTimeout (0.2 s)
    cfg = L3IngestConfig(httpTimeout=1, fullStateEvery=1000)
    try:
        async with aiohttp.ClientSession() as session:
            await MooncakePoller(MasterTarget("m0", master.url), cfg, Sink(), Metrics(), session).poll()
            with pytest.raises(asyncio.TimeoutError):
                await MooncakePoller(MasterTarget("m0", master.url), cfg, Sink(), Metrics(), session,
                                     segments_timeout=0.2).poll()
    finally:
        await master.runner.cleanup()


async def _master_in_l3(cfg):
    """A master holding block 1 on 127.0.0.2, a replica and a leading bridge polling it, started; the
    block in L3. Returns (master, indexer, bridge) for the caller to stop."""
    from cache_indexer.bridge.service import Bridge
    from cache_indexer.indexer.service import Indexer

    master = await FakeMaster().start()
    master.segments = ["127.0.0.2:12001"]
    master.keys = {key(1): ["127.0.0.2:16001"]}
    indexer, bridge = Indexer(cfg), Bridge(cfg)
    await indexer.start()
    await bridge.start()
    await wait_for(lambda: bridge.targets_record is not None and bridge.lease.is_leader, 10, "a leading bridge")
    await bridge.set_masters([MasterTarget("m0", master.url)])
    await wait_for(lambda: l3_held(indexer.l3, "127.0.0.2") == {1}, 10, "the master's block in L3")
    return master, indexer, bridge


async def test_a_master_that_left_while_no_bridge_ran_is_dropped_by_the_next_bridge(nats_url, stream_prefix):
    from cache_indexer.bridge.service import Bridge

    cfg = make_config(nats_url, stream_prefix, ingest={"l3": {"pollInterval": 0.05}})
    master, indexer, bridge = await _master_in_l3(cfg)
    try:
        await bridge.stop()  # no bridge runs while the master goes away
        bridge = Bridge(cfg)
        await bridge.start()
        await wait_for(lambda: bridge._inherited_masters == {"m0"}, 10, "the next bridge to lead and read the record")
        await bridge.set_masters([])  # discovery no longer shows it
        await wait_for(lambda: l3_held(indexer.l3, "127.0.0.2") == set(), 10, "its L3 entries dropped")
    finally:
        await bridge.stop()
        await indexer.stop()
        await master.runner.cleanup()


async def test_an_l3_stream_a_replica_created_again_gets_every_masters_full_state(nats_url, stream_prefix,
                                                                                    monkeypatch):
    """The L3 stream deleted (an operator, storage lost) and created again by a replica's lag round: the
    bridge's publishes never failed, so its pollers went on publishing diffs, and with a master whose
    keys did not change, nothing: the new stream lacked the master's state until the next full state
    (``fullStateEvery`` polls: 5 minutes by default). The bridge looks at the streams on its own too and
    has every master publish its full state at its next poll."""
    from cache_indexer.bridge import service as bridge_service
    from cache_indexer.indexer import service

    monkeypatch.setattr(service, "TRACK_EVERY", 0.2)
    monkeypatch.setattr(bridge_service, "STREAMS_CHECK_EVERY", 0.5)
    cfg = make_config(nats_url, stream_prefix, ingest={"l3": {"pollInterval": 0.05, "fullStateEvery": 100_000}})
    master, indexer, bridge = await _master_in_l3(cfg)
    try:
        name = cfg.nats.l3Stream.name
        await indexer.js.delete_stream(name)  # the replica's lag round makes it again and follows it anew
        await wait_for(lambda: indexer.metrics.streams_recreated.labels(name)._value.get() == 1, 10,
                       "the replica to follow a new stream")
        await wait_for(lambda: l3_held(indexer.l3, "127.0.0.2") == {1}, 10, "the master's block from the new stream")
        assert bridge.metrics.streams_recreated.labels(name)._value.get() == 1
    finally:
        await bridge.stop()
        await indexer.stop()
        await master.runner.cleanup()


async def test_an_l3_stream_that_lost_its_messages_but_not_its_metadata_is_followed_anew(
        restartable_nats, stream_prefix, monkeypatch):
    """The L3 stream back empty under its old name and metadata (a cluster that kept the assignment of
    a stream whose node lost its storage; here its message files wiped while nats-server was down): the
    replica took it for the stream it followed and went on from its old position, past the master's new
    state on it, keeping the lost stream's L3 entries for good. The bridge names it anew and the replica
    follows it from its start."""
    from cache_indexer.bridge import service as bridge_service
    from cache_indexer.indexer import service

    monkeypatch.setattr(service, "TRACK_EVERY", 0.2)
    monkeypatch.setattr(bridge_service, "STREAMS_CHECK_EVERY", 0.5)
    cfg = make_config(restartable_nats.url, stream_prefix, ingest={"l3": {"pollInterval": 0.05}})
    master, indexer, bridge = await _master_in_l3(cfg)
    try:
        for k in range(3, 23):  # a diff each: the replica's position past what the new stream gets
            master.keys = {**master.keys, key(k): ["127.0.0.2:16001"]}
            await wait_for(lambda: k in l3_held(indexer.l3, "127.0.0.2"), 10, f"the master's block {k}")
        name = cfg.nats.l3Stream.name
        assert indexer.l3_applied_seq >= 20
        lose_messages_keep_metadata(restartable_nats, name)
        master.keys = {key(2): ["127.0.0.2:16001"]}
        await wait_for(lambda: l3_held(indexer.l3, "127.0.0.2") == {2}, 20, "the master's state after the loss")
        assert bridge.metrics.streams_recreated.labels(name)._value.get() == 1
    finally:
        await bridge.stop()
        await indexer.stop()
        await master.runner.cleanup()


async def test_states_over_the_message_limit_are_published_in_parts(nats_url, stream_prefix):
    """Issue 13 #3: with the L3 stream's maxMsgSize at 16 KiB, full states and diffs of thousands of pairs
    are split into parts that each fit; live and replaying indexers hold exactly the master's state."""
    from cache_indexer.bridge.service import Bridge
    from cache_indexer.indexer.service import Indexer

    cfg = make_config(nats_url, stream_prefix, ingest={"l3": {"pollInterval": 0.05, "fullStateEvery": 1000}})
    cfg.nats.l3Stream.maxMsgSize = 16 << 10
    master = await FakeMaster().start()
    master.segments = ["127.0.0.2:12001", "127.0.0.3:12002"]
    master.keys = {key(i): [f"127.0.0.{2 + i % 2}:16001"] for i in range(5000)}
    want = lambda pod, n: {i for i in range(n) if i % 2 == int(pod[-1]) - 2}  # noqa: E731
    indexer, bridge, late = Indexer(cfg), Bridge(cfg), None
    await indexer.start()
    await bridge.start()
    try:
        await wait_for(lambda: bridge.lease.is_leader, 10, "a leading bridge")
        await bridge.set_masters([MasterTarget("m0", master.url)])
        await wait_for(lambda: l3_held(indexer.l3, "127.0.0.2") == want("127.0.0.2", 5000), 20, "the first full state")
        for i in range(5000, 9000):  # a diff of 4,000 pairs
            master.keys[key(i)] = [f"127.0.0.{2 + i % 2}:16001"]
        await wait_for(lambda: all(l3_held(indexer.l3, pod) == want(pod, 9000) for pod in ("127.0.0.2", "127.0.0.3")),
                       20, "the split diff")
        def parts():
            return {s.labels["kind"]: s.value for s in bridge.metrics.l3_message_parts.collect()[0].samples
                    if s.name.endswith("_total")}
        assert parts()["l3_full"] == 3 and parts()["l3_diff"] == 3, parts()  # 45 kB and 36 kB in 16 KiB parts
        cfg.ingest.l3.fullStateEvery = 1  # from now on every poll rolls the subject up
        await wait_for(lambda: parts()["l3_full"] >= 3 + 2 * 6, 20, "full states of 9,000 pairs in parts")
        assert not bridge.metrics.publish_refused.collect()[0].samples
        assert bridge.metrics.publish_retries._value.get() == 0
        late = Indexer(cfg)  # replays the subject: the last full state's parts, then what followed
        await late.start()
        await wait_for(lambda: all(l3_held(late.l3, pod) == want(pod, 9000) for pod in ("127.0.0.2", "127.0.0.3")),
                       20, "a replaying indexer to rebuild the state from parts")
        assert indexer.l3.incomplete == 0 and late.l3.incomplete == 0
    finally:
        await bridge.stop()
        await indexer.stop()
        if late:
            await late.stop()
        await master.runner.cleanup()


def test_a_full_state_missing_a_part_is_dropped_and_the_previous_state_stands():
    state = L3State()
    state.apply({"type": "l3_full", "master": "m", "pods": {"p": [1, 2]}})
    state.apply({"type": "l3_full", "master": "m", "pods": {"p": [3]}, "gen": 7, "part": 0, "parts": 3})
    state.apply({"type": "l3_full", "master": "m", "pods": {"p": [4]}, "gen": 7, "part": 2, "parts": 3})
    assert l3_held(state, "p") == {1, 2} and state.incomplete == 1
    state.apply({"type": "l3_full", "master": "m", "pods": {"p": [5], "q": [6]}, "gen": 8, "part": 0, "parts": 2})
    state.apply({"type": "l3_diff", "master": "m", "added": {"p": [9]}, "removed": {}})
    assert l3_held(state, "p") == {1, 2, 9}, "nothing of a full state shows before its last part"
    state.apply({"type": "l3_full", "master": "m", "pods": {"p": [7]}, "gen": 8, "part": 1, "parts": 2})
    assert l3_held(state, "p") == {5, 7} and l3_held(state, "q") == {6}
    state.apply({"type": "l3_full", "master": "m", "pods": {}})
    assert not state.blocks and not state.pod_workers("p")


def poll_errors(metrics: Metrics) -> dict[str, float]:
    return {s.labels["reason"]: s.value for s in metrics.l3_poll_errors.collect()[0].samples
            if s.name.endswith("_total")}


@pytest.mark.parametrize("fault,reason", [
    ("timeout", "timeout"), ("503", "malformed"), ("malformed", "malformed"), ("nested", "malformed"),
    ("html", "malformed"), ("binary", "malformed"), ("redirect", "malformed"), ("huge", "malformed"),
    ("endless", "malformed"),
])
async def test_failed_polls_keep_the_previous_state(poller, fault, reason, caplog):
    master, p, sink, metrics = poller
    p.client.max_bytes = 1 << 20  # ingest.l3.maxResponseBytes, small for the test
    master.segments = ["127.0.0.2:12001"]
    master.keys = {key(1): ["127.0.0.2:16001"]}
    await p.poll()
    master.keys[key(2)] = ["127.0.0.2:16001"]
    master.fault = fault
    p.start()
    try:
        await wait_for(lambda: poll_errors(metrics).get(reason, 0) >= 2, 15, f"two failed polls ({fault})")
        assert sink.held("127.0.0.2") == {1}, "previous state kept"
        assert all(m["pods"] for m in sink.messages if m["type"] == "l3_full"), "never an empty full state"
        failures = [r.getMessage() for r in caplog.records if "poll failed" in r.getMessage()]
        assert failures and all("()" not in m and f"({reason}: " in m for m in failures), failures
        master.fault = None

        async def recovered():
            while sink.held("127.0.0.2") != {1, 2}:
                await asyncio.sleep(0.01)
        await asyncio.wait_for(recovered(), 10)
    finally:
        await p.stop()


async def test_an_answer_about_a_key_not_asked_for_is_ignored(poller):
    master, p, sink, metrics = poller
    master.segments = ["127.0.0.2:12001"]
    master.keys = {key(1): ["127.0.0.2:16001"]}
    master.fault = "unasked"
    await p.poll()
    assert sink.held("127.0.0.2") == {1} and not sink.held("127.0.0.9") and not poll_errors(metrics)


async def test_a_poller_that_ends_is_restarted_and_counted(poller, monkeypatch):
    master, p, sink, metrics = poller
    master.segments = ["127.0.0.2:12001"]
    master.keys = {key(1): ["127.0.0.2:16001"]}
    real_sleep, broken = asyncio.sleep, [True]

    async def sleep_once_broken(delay, *a):  # a BaseException the per-poll handler does not catch
        if broken and delay == p.cfg.pollInterval:
            broken.clear()
            raise SystemError("the loop itself failed")
        return await real_sleep(delay, *a)
    monkeypatch.setattr(asyncio, "sleep", sleep_once_broken)
    p.start()
    try:
        await wait_for(lambda: metrics.l3_poller_restarts._value.get() == 1, 10, "a restart counted")
        master.keys[key(2)] = ["127.0.0.2:16001"]
        await wait_for(lambda: sink.held("127.0.0.2") == {1, 2}, 10, "the restarted poller polls")
    finally:
        await p.stop()


def batch_mode(metrics: Metrics) -> float:
    return metrics.l3_batch_query.labels("m0")._value.get()


@pytest.mark.parametrize("odd", ["empty", "404"])
async def test_one_odd_batch_answer_does_not_switch_to_the_leasing_query_key(poller, odd, caplog):
    """Issue 13 #4: a {"success":true,"data":{}} or a 404 after the endpoint had worked is one failed
    poll, not a switch for good: a probe with a listed key shows that the endpoint works."""
    master, p, sink, metrics = poller
    master.segments = ["127.0.0.2:12001"]
    master.keys = {key(1): ["127.0.0.2:16001"]}
    await p.poll()
    master.keys[key(2)] = ["127.0.0.2:16001"]
    master.batch_faults = [odd]
    with pytest.raises(MasterError, match="a probe shows the endpoint works"):
        await p.poll()
    assert p.client.batch_supported is True and batch_mode(metrics) == 1
    await p.poll()
    assert sink.held("127.0.0.2") == {1, 2} and master.query_key_calls == 0
    assert not [r for r in caplog.records if "query_key" in r.getMessage() and r.levelname == "WARNING"]


@pytest.mark.parametrize("kind", ["old", "no_decode"])
async def test_a_master_without_a_usable_batch_endpoint_falls_back_loudly_and_is_probed_again(
        poller, kind, caplog, monkeypatch):
    import cache_indexer.bridge.mooncake_master as mm

    master, p, sink, metrics = poller
    master.segments = ["127.0.0.2:12001"]
    master.keys = {key(1): ["127.0.0.2:16001"]}
    master.fault = kind
    await p.poll()
    assert p.client.batch_supported is False and batch_mode(metrics) == 0
    assert sink.held("127.0.0.2") == {1} and master.query_key_calls == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("cannot be used" in w and "/query_key" in w for w in warnings), warnings
    monkeypatch.setattr(mm, "REPROBE_SECONDS", 0.0)
    master.fault = None  # the master was upgraded
    p.client._reprobe_at = 0.0
    master.keys[key(2)] = ["127.0.0.2:16001"]
    await p.poll()
    assert p.client.batch_supported is True and batch_mode(metrics) == 1
    assert sink.held("127.0.0.2") == {1, 2} and master.query_key_calls == 1
    assert any("works again" in r.getMessage() for r in caplog.records if r.levelname == "WARNING")


async def test_keys_with_a_comma_are_skipped_and_counted_not_leased(poller):
    """The master splits its decoded ``keys`` value on ",", so such keys cannot be asked read-only; asking
    /query_key instead would lease them (issue 13 #4)."""
    master, p, sink, metrics = poller
    master.segments = ["127.0.0.2:12001"]
    comma = key(5).replace("cache_role:kv", "cache_role:k,v")
    master.keys = {key(1): ["127.0.0.2:16001"], comma: ["127.0.0.2:16001"]}
    p.parser.block_hash = lambda k: int(k.rsplit("@", 1)[1], 16)  # the custom grammar that admits it
    await p.poll()
    await p.poll()
    assert sink.held("127.0.0.2") == {1}
    assert master.query_key_calls == 0 and comma not in master.asked
    assert metrics.l3_unlocatable_keys._value.get() == 1, "counted once, not every poll"


# -- a real master ---------------------------------------------------------------------------------
def _mooncake_available() -> str | None:
    try:
        import mooncake  # noqa: F401
    except ImportError:
        return "mooncake-transfer-engine-non-cuda is not installed"
    binary = Path(__import__("mooncake").__file__).parent / "mooncake_master"
    if not binary.exists():
        return "mooncake_master binary not found"
    if not shutil.which("unshare") or not shutil.which("ip") or os.geteuid() != 0:
        return "needs root, unshare and ip for a loopback-only network namespace"
    r = subprocess.run([str(binary), "--help"], capture_output=True, timeout=30)
    if r.returncode not in (0, 1) or b"error while loading shared libraries" in r.stderr:
        return "mooncake_master cannot start (system libraries missing: libibverbs1 libnl-3-200 libnl-route-3-200)"
    return None


def test_real_mooncake_master_end_to_end():
    """tests/mooncake_scenario.py runs inside `unshare -n` (only loopback): nats-server, a real master,
    real store clients putting keys in the real grammars, the bridge's poller and an indexer replica."""
    why = _mooncake_available()
    if why:
        if os.environ.get("CACHE_INDEXER_REQUIRE_MOONCAKE") == "1":
            pytest.fail(why)
        pytest.skip(why)
    r = subprocess.run(["unshare", "-n", "sh", "-c", f"ip link set lo up && exec {sys.executable} -m tests.mooncake_scenario"],
                       cwd=ROOT, capture_output=True, text=True, timeout=240,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, f"scenario failed:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    assert "SCENARIO OK" in r.stdout


def l3_diff(seq, added=None, removed=None, origin=7):
    return {"type": "l3_diff", "master": "m", "added": added or {}, "removed": removed or {}, "origin": origin,
            "seq": seq}


def test_l3_diffs_apply_in_their_masters_order_and_a_repeat_is_refused():
    """Issue 24 #5: an older diff re-sent after newer ones was applied, and the wrong attribution stood
    until the next full state. Diffs carry (origin, seq): a repeat is refused, an early one waits for
    the one missing, a newer bridge's full state sets the order anew and an older bridge's diff is refused."""
    s = L3State()
    s.apply({"type": "l3_full", "master": "m", "pods": {"p": [1]}, "origin": 7, "seq": 0})
    s.apply(l3_diff(1, added={"p": [2]}))
    s.apply(l3_diff(2, removed={"p": [2]}))
    s.apply(l3_diff(1, added={"p": [2]}))  # re-sent after the newer one
    assert l3_held(s, "p") == {1} and s.out_of_order == 1
    s.apply(l3_diff(4, removed={"p": [1]}))  # early: 3 is missing
    assert l3_held(s, "p") == {1}
    s.apply(l3_diff(3, added={"p": [5]}))
    assert l3_held(s, "p") == {5}
    s.apply(l3_diff(1, added={"p": [9]}, origin=8))  # a new bridge's diff before its full state: held
    assert l3_held(s, "p") == {5}
    s.apply({"type": "l3_full", "master": "m", "pods": {"p": [6]}, "origin": 8, "seq": 0})
    assert l3_held(s, "p") == {6, 9}
    s.apply(l3_diff(5, added={"p": [1]}, origin=7))  # the old bridge's, late
    assert l3_held(s, "p") == {6, 9} and s.out_of_order == 2
    s.apply({"type": "l3_diff", "master": "m", "added": {"p": [3]}, "removed": {}})  # a bridge without seqs
    assert l3_held(s, "p") == {3, 6, 9}


async def test_a_late_l3_diff_through_the_stream_is_refused_and_a_refused_one_brings_a_full_state(nats_url,
                                                                                               stream_prefix):
    """Issue 24 #5 through a real stream: the bridge's publisher numbers the master's messages; the same
    diff stored again after newer ones (a retry past the duplicate window) changes nothing in a replica;
    a diff the stream refuses for good is told to the bridge (which then publishes the full state)."""
    import nats

    from cache_indexer.bridge.jetstream_publisher import JetStreamPublisher
    from cache_indexer.bridge.l3_publisher import L3Publisher
    from cache_indexer.infra.streams import l3_subject
    from cache_indexer.indexer.service import Indexer

    cfg = make_config(nats_url, stream_prefix)
    indexer = Indexer(cfg)
    await indexer.start()
    nc = await nats.connect(nats_url)
    refused: list[str] = []
    try:
        pub = JetStreamPublisher(nc, Metrics(), ack_timeout=1.0)
        await pub.start()
        l3 = L3Publisher(pub, cfg.nats.l3Stream.subjectPrefix, lambda: 64 << 10, Metrics(), on_refused=refused.append)
        await l3.full("m", {"127.0.0.2": [1]})
        await l3.diff("m", {"127.0.0.2": [2]}, {})
        await l3.diff("m", {}, {"127.0.0.2": [2]})
        assert await pub.flush(10)
        js = nc.jetstream()
        subject = l3_subject(cfg.nats.l3Stream.subjectPrefix, "m")
        first_diff = await js.get_msg(cfg.nats.l3Stream.name, 2)
        await js.publish(subject, first_diff.data, headers={"Nats-Msg-Id": "the same diff, re-sent"})
        await l3.diff("m", {"127.0.0.3": [7]}, {})
        assert await pub.flush(10)
        await wait_for(lambda: l3_held(indexer.l3, "127.0.0.3") == {7}, 10, "the last diff applied")
        assert l3_held(indexer.l3, "127.0.0.2") == {1} and indexer.l3.out_of_order == 1
        info = await js.stream_info(cfg.nats.l3Stream.name)
        info.config.max_msg_size = 64
        await js.update_stream(info.config)
        await l3.diff("m", {"127.0.0.3": list(range(100))}, {})
        await wait_for(lambda: refused == ["m"], 10, "the refusal told")
    finally:
        await nc.close()
        await indexer.stop()


class _Handed:
    """What an L3 publisher hands the JetStream publisher (which still sends it): the messages as sent."""

    def __init__(self, pub) -> None:
        self.sent: list[tuple[str, bytes, dict[str, str]]] = []
        self._publish = pub.publish
        pub.publish = self.publish

    async def publish(self, subject, data, headers, *args, **kwargs):
        self.sent.append((subject, data, dict(headers)))
        return await self._publish(subject, data, headers, *args, **kwargs)


async def test_a_full_state_part_re_sent_late_onto_a_subject_that_moved_on_is_refused_and_rolls_nothing_up(
        nats_url, stream_prefix):
    """A full state's first part, lost with a server and re-sent after the later parts and a diff were stored
    (the re-send as the JetStream publisher makes it: the same bytes and headers): before, its
    ``Nats-Rollup`` deleted them from the subject, and a replica replaying the stream held only that part.
    Now each message names the subject's last sequence its publisher saw, and the stream refuses it."""
    from nats.js.errors import APIError

    from cache_indexer.indexer.service import Indexer

    cfg, nc, js, pub, l3 = await _l3_chain(nats_url, stream_prefix, max_payload=lambda: 1024)
    replaying = None
    try:
        handed = _Handed(pub)
        pods = {f"127.0.0.{i}": list(range(i * 100, i * 100 + 40)) for i in range(2, 6)}
        assert await l3.full("m", pods)
        first = next(m for m in handed.sent if m[2].get("Nats-Rollup"))
        assert int(handed.sent[-1][2]["Kv-Part"].split("/")[1]) > 1, "a state in several parts"
        await l3.diff("m", {"127.0.0.9": [7]}, {})
        subject, data, headers = first
        with pytest.raises(APIError) as refused:
            await js.publish(subject, data, headers={**headers, "Nats-Msg-Id": "the first part, sent anew"})
        assert refused.value.err_code == 10071, "wrong last sequence: the subject moved on"
        replaying = Indexer(cfg)
        await replaying.start()
        want = {**pods, "127.0.0.9": [7]}
        for pod, hashes in want.items():
            assert l3_held(replaying.l3, pod) == set(hashes), f"{pod}: the whole state and the diff, from the stream"
    finally:
        if replaying is not None:
            await replaying.stop()
        await pub.close()
        await nc.close()


async def test_after_a_failover_the_old_owners_late_messages_are_refused_by_the_stream(nats_url, stream_prefix):
    """Two bridges on one master (a failover, or a shard handed over to a bridge that started earlier: its
    origin is the smaller). The new owner publishes its full state; the old one, not yet aware, sends a
    diff and its full state again. Before, both were stored: the live indexer took the old owner's diff for
    a newer bridge's, held it and then refused every diff of the new owner, and the old owner's full state
    replaced the new one's (its rollup deleting it from the stream). Now the stream refuses them, the old
    owner is told, and every replica holds the new owner's state and diffs."""
    import nats
    from nats.js.errors import APIError

    from cache_indexer.bridge.jetstream_publisher import JetStreamPublisher
    from cache_indexer.bridge.l3_publisher import L3Publisher
    from cache_indexer.indexer.service import Indexer

    cfg = make_config(nats_url, stream_prefix)
    live = Indexer(cfg)
    await live.start()
    conns = [await nats.connect(nats_url) for _ in range(2)]
    replaying = None
    try:
        told: list[str] = []
        pubs = [JetStreamPublisher(nc, Metrics(), ack_timeout=1.0) for nc in conns]
        old, new = (L3Publisher(p, cfg.nats.l3Stream.subjectPrefix, lambda: 1 << 20, Metrics(), js=nc.jetstream(),
                                stream=cfg.nats.l3Stream.name, on_refused=r)
                    for p, nc, r in zip(pubs, conns, (told.append, lambda m: None)))
        for p in pubs:
            await p.start()
        handed = _Handed(pubs[0])
        new.origin = old.origin - 1  # the new owner started first
        assert await old.full("m", {"127.0.0.2": [1]})
        assert await new.full("m", {"127.0.0.2": [2]})
        await old.diff("m", {"127.0.0.2": [3]}, {})
        assert told == ["m"], "the old owner is told"
        subject, data, headers = handed.sent[0]  # its full state, re-sent late (its first send lost)
        with pytest.raises(APIError) as refused:
            await conns[0].jetstream().publish(subject, data, headers={**headers, "Nats-Msg-Id": "sent anew"})
        assert refused.value.err_code == 10071
        await new.diff("m", {"127.0.0.2": [4]}, {})
        await wait_for(lambda: l3_held(live.l3, "127.0.0.2") == {2, 4}, 10, "the new owner's state and diff")
        replaying = Indexer(cfg)
        await replaying.start()
        assert l3_held(replaying.l3, "127.0.0.2") == {2, 4}
        assert live.l3.out_of_order == 0
    finally:
        if replaying is not None:
            await replaying.stop()
        for nc in conns:
            await nc.close()
        await live.stop()


async def _l3_chain(nats_url, stream_prefix, ack_timeout: float = 1.0, **kw):
    """A connection, the L3 stream, a JetStream publisher and an L3 publisher on the chain (``kw``: the
    L3 publisher's, besides the stream's)."""
    import nats

    from cache_indexer.bridge.jetstream_publisher import JetStreamPublisher
    from cache_indexer.bridge.l3_publisher import L3Publisher
    from cache_indexer.infra.streams import ensure_l3_stream

    cfg = make_config(nats_url, stream_prefix)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await ensure_l3_stream(js, cfg.nats)
    metrics = Metrics()
    pub = JetStreamPublisher(nc, metrics, ack_timeout=ack_timeout)
    await pub.start()
    l3 = L3Publisher(pub, cfg.nats.l3Stream.subjectPrefix, kw.pop("max_payload", lambda: 1 << 20), metrics, js=js,
                     stream=cfg.nats.l3Stream.name, **kw)
    return cfg, nc, js, pub, l3


def _drop_first_ack(pub) -> list:
    """The JetStream publisher's first ack is lost (held in the list returned); the others come."""
    real, held = pub._on_ack, []

    async def lossy(msg):
        if not held:
            held.append(msg)
            return
        await real(msg)
    pub._sub._cb = lossy
    return held


async def test_a_stored_part_whose_ack_was_lost_is_taken_as_stored_and_the_rest_follows(nats_url, stream_prefix):
    """A review: the stream checks the expected last sequence before the duplicate, so the re-send of a
    stored message whose ack was lost is refused. The first part of a full state was then taken as
    refused: the later parts never went out, and the subject held that part alone. The publisher now
    finds its message last on the subject and goes on."""
    from cache_indexer.indexer.l3_state import L3State

    cfg, nc, js, pub, l3 = await _l3_chain(nats_url, stream_prefix, ack_timeout=0.3, max_payload=lambda: 1024,
                                           on_refused=(told := []).append)
    try:
        _drop_first_ack(pub)
        pods = {f"127.0.0.{i}": list(range(i * 100, i * 100 + 40)) for i in range(2, 6)}
        assert await l3.full("m", pods) and not told
        state = L3State()
        info = await js.stream_info(cfg.nats.l3Stream.name)
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            state.apply(msgpack.unpackb((await js.get_msg(cfg.nats.l3Stream.name, seq)).data))
        assert all(l3_held(state, pod) == set(h) for pod, h in pods.items()), "every part on the subject"
    finally:
        await pub.close()
        await nc.close()


async def test_a_removal_onto_a_subject_emptied_by_retention_is_stored(nats_url, stream_prefix):
    """A review: the removal of a master whose subject holds nothing any more (its messages aged out while
    it was unreachable; the stream's first sequence past 1) named the last message it followed as the
    expected one, and the stream refused it at every try (sharded: pending for good; not sharded: lost). A
    removal goes onto whatever the subject holds now."""
    from cache_indexer.bridge.removals import PendingRemovals

    cfg, nc, js, pub, l3 = await _l3_chain(nats_url, stream_prefix)
    try:
        for i in range(3):  # another master's full states: each rollup deletes the one before
            assert await l3.full("other", {"10.0.0.1": [i]})
        assert (await js.stream_info(cfg.nats.l3Stream.name)).state.first_seq > 1
        clock = [0.0]
        removals = PendingRemovals(js, cfg.nats, None, l3, lambda shard: True, check_every=1, publish_every=1,
                                   clock=lambda: clock[0])
        removals.add("master", "never-published")
        for _ in range(2):  # one settle publishes the removal, the next finds it on the stream
            clock[0] += 5
            done = await removals.settle()
        assert [r.name for r in done] == ["never-published"] and not removals.pending
        assert await l3.full("other", {})  # and where the publisher's own last message is gone: read again
    finally:
        await pub.close()
        await nc.close()


async def test_a_second_publish_of_a_message_in_flight_is_told_when_it_is_stored(nats_url, stream_prefix):
    """A review: the same removal published again while the first is in flight (its ack late) was not sent
    twice, and the second caller was never told: it waited the whole ack wait and failed, also after the
    message was stored. Both callers are told now."""
    from cache_indexer.bridge.l3_publisher import NotAcknowledged

    cfg, nc, js, pub, l3 = await _l3_chain(nats_url, stream_prefix, ack_timeout=30.0, ack_wait=1.0)
    try:
        held = _drop_first_ack(pub)
        with pytest.raises(NotAcknowledged):
            await l3.gone("m", after=0)
        second = asyncio.create_task(l3.gone("m", after=0))
        await wait_for(lambda: l3._lock("m").locked(), 5, "the second removal under way")
        await pub._on_ack(held[0])  # the first send's ack, late
        await asyncio.wait_for(second, 5)
        assert not pub._pending
    finally:
        await pub.close()
        await nc.close()


async def test_masters_gone_while_nats_is_away_are_removed_once_it_is_back(tmp_path, stream_prefix, monkeypatch):
    """A review: a bridge without shards publishes a gone master's empty full state itself. With NATS away
    the first removal failed after the ack wait, the second was never tried, and both had left the targets
    record: the indexers kept their L3 entries for good. Each is now tried again until it is stored, and
    stays in the record meanwhile."""
    import nats

    from cache_indexer.bridge import l3_publisher
    from cache_indexer.bridge.service import Bridge
    from cache_indexer.nats_server import NatsServer

    monkeypatch.setattr(l3_publisher, "ACK_WAIT", 1.0)
    srv = NatsServer().start()
    masters = [await FakeMaster().start() for _ in range(2)]
    for i, fm in enumerate(masters):
        fm.keys = {key(10 + i): ["127.0.0.2:16001"]}
        fm.segments = ["127.0.0.2:12001"]
    targets = tmp_path / "targets.yaml"
    targets.write_text("vllm: []\nmooncakeMasters:\n" + "".join(
        f"  - host: 127.0.0.1\n    name: m{i}\n    httpPort: {fm.url.rsplit(':', 1)[1]}\n" for i, fm in enumerate(masters)))
    cfg = make_config(srv.url, stream_prefix, discovery={"mode": "static", "static": {"file": str(targets)}},
                      ingest={"leaderElection": False, "l3": {"pollInterval": 0.5}})
    bridge = Bridge(cfg)
    await bridge.start()
    nc = None
    try:
        for i in range(2):
            await wait_for(lambda i=i: bridge.l3._last.get(f"m{i}"), 15, f"m{i} published")
        srv.stop()
        targets.write_text("vllm: []\nmooncakeMasters: []\n")
        await wait_for(lambda: bridge._masters_unremoved == {"m0", "m1"} and not bridge.pollers, 15,
                       "both masters gone, their removals not stored")
        srv.start()
        nc = await nats.connect(srv.url)
        js, l3 = nc.jetstream(), cfg.nats.l3Stream

        async def removed(i: int) -> bool:
            try:
                msg = await js.get_last_msg(l3.name, f"{l3.subjectPrefix}.m{i}")
            except Exception:
                return False
            return msg.headers.get("Kv-Type") == "l3_full" and not msgpack.unpackb(msg.data).get("pods")
        for i in range(2):
            await wait_for(lambda i=i: removed(i), 30, f"m{i}'s removal stored")
        await wait_for(lambda: not bridge._masters_unremoved, 10, "nothing left to remove")
    finally:
        await bridge.stop()
        if nc is not None:
            await nc.close()
        srv.close()
        for fm in masters:
            await fm.runner.cleanup()
