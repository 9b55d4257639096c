"""The routing queries' fast path (api/fast_path.py, api/header_guard.py) over raw sockets on 127.0.0.1:
what it answers equals what aiohttp answers for the same bytes, on a server without it; what it does not
take reaches aiohttp as it came, on the same connection; its bounds (body deadline, body budget, idle and
write deadlines, shutdown) hold as aiohttp's do."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time

import pytest
from aiohttp import web
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from cache_indexer.api.app import HitRateApi
from cache_indexer.api.fast_path import FAST_ROUTES
from cache_indexer.api.request_body import BODY_BUDGET
from cache_indexer.api.header_guard import LEND_RUN
from cache_indexer.api.server import HttpServer
from cache_indexer.indexer.hit_rate import NATIVE_QUERY
from cache_indexer.indexer.l1_state import L1State
from cache_indexer.infra.metrics import Metrics
from cache_indexer.schemas.block_hash import BlockHasher
from cache_indexer.schemas.config import HttpConfig
from tests.conftest import needs_native, wait_for

HASHER = BlockHasher("sha256_cbor", "0")
TOKENS = list(range(1000, 1064))  # 4 blocks of 16
PODS = ["127.0.1.1", "127.0.1.2", "127.0.1.3", "127.0.1.9"]


def _index() -> L1State:
    l1 = L1State()
    chain = HASHER.event_hashes(TOKENS, 16)
    for seq, (pod, rank, held) in enumerate([("127.0.1.1", 0, chain[:3]), ("127.0.1.2", 0, [chain[0], chain[2]]),
                                             ("127.0.1.3", 1, chain)]):
        l1.apply({"type": "batch", "pod": pod, "rank": rank, "gen": 1, "seq": 0,
                  "events": [{"kind": "stored", "medium": "GPU", "hashes": held}]})
    return l1


def hit_rate(pods=PODS, tokens=TOKENS) -> bytes:
    return json.dumps({"server_ip": pods, "body": {"token_ids": tokens, "block_size": 16}}).encode()


def query(tokens=TOKENS) -> bytes:
    return json.dumps({"token_ids": tokens, "model_name": "default"}).encode()


def request(body: bytes, path: str = "/kv-cache/hit-rate", extra: bytes = b"", length: bool = True) -> bytes:
    return (b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n%s%s\r\n%s"
            % (path.encode(), b"Content-Length: %d\r\n" % len(body) if length else b"", extra, body))


@contextlib.asynccontextmanager
async def serving(fast: bool = True, setup=None, **http):
    metrics = Metrics()
    cfg = HttpConfig(**{"host": "127.0.0.1", "port": 0, "maxHitRateBodyBytes": 64 * 1024, "readTimeout": 2,
                        **http})
    app = HitRateApi(cfg, HASHER, tiers=lambda: (_index(), None), ready=lambda: True, metrics=metrics).make_app()
    if not fast:
        app[FAST_ROUTES] = {}
    if setup is not None:
        setup(app)
    srv = HttpServer(app, cfg, metrics)
    await srv.start()
    try:
        yield srv, metrics, app
    finally:
        await srv.stop()


@pytest.fixture
def native_query():
    """The fast path answers what the native query covers (without it, a pure-Python install, everything
    goes to aiohttp, as the tests that take this show)."""
    needs_native(NATIVE_QUERY, "the native query")


@pytest.fixture
async def both():
    async with serving() as fast, serving(fast=False) as plain:
        yield fast, plain


async def read_response(reader: asyncio.StreamReader, within: float = 5) -> tuple[int, object] | None:
    """(status, JSON body) of the next response, or None where the server closed the connection."""
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), within)
    except (asyncio.IncompleteReadError, ConnectionResetError):
        return None
    lines = head.split(b"\r\n")
    fields = {k.strip().lower(): v.strip() for k, v in (line.split(b":", 1) for line in lines[1:] if b":" in line)}
    body = await asyncio.wait_for(reader.readexactly(int(fields.get(b"content-length", b"0"))), within)
    try:
        return int(lines[0].split(b" ", 2)[1]), json.loads(body) if body else None
    except ValueError:
        return int(lines[0].split(b" ", 2)[1]), body


async def exchange(port: int, sent: list[bytes], answers: int, lockstep: bool = False, then=None) -> list:
    """Each of ``sent`` written in turn on one connection (``lockstep``: each after the answer to the one
    before); up to ``answers`` responses read (None once the server closed); ``then()`` awaited before the
    connection is closed."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    out = []
    try:
        for data in sent:
            writer.write(data)
            await writer.drain()
            if lockstep:
                out.append(got := await read_response(reader))
                if got is None:
                    return out
        for _ in range(answers - len(out)):
            out.append(got := await read_response(reader))
            if got is None:
                break
        if then is not None:
            await then()
        return out
    finally:
        writer.close()


def answered(metrics: Metrics, path: str, status: int) -> float:
    return metrics.http_requests.labels(path, str(status))._value.get()


def aiohttp_connections(srv: HttpServer) -> int:
    return len(srv.runner.server.connections)


async def test_plain_routing_queries_skip_aiohttp_and_get_its_answers(both, native_query):
    (fast, fast_metrics, _), (plain, _, _) = both
    sent = [request(hit_rate()), request(query(), "/query"), request(hit_rate(PODS[::-1], TOKENS[:40])),
            request(query(TOKENS[:33]), "/query"), request(hit_rate(["127.0.1.3"]))]
    reader, writer = await asyncio.open_connection("127.0.0.1", fast.port)
    got = []
    for data in sent:
        writer.write(data)
        got.append(await read_response(reader))
    assert aiohttp_connections(fast) == 0 and len(fast.guard.fast_connections) == 1
    writer.close()
    want = await exchange(plain.port, sent, len(sent))
    assert got == want and all(status == 200 for status, _ in got), got
    assert got[0][1]["server_score_list"][2]["l1_hit_ratio"] == 1.0  # an answer with something in it
    assert answered(fast_metrics, "/kv-cache/hit-rate", 200) == 3 and answered(fast_metrics, "/query", 200) == 2


async def test_queries_for_the_query_threads_are_answered_there_and_the_connection_stays(both, monkeypatch, native_query):
    from cache_indexer.api import app as app_module
    monkeypatch.setattr(app_module, "INLINE_BUDGET", -1.0)  # every native call on the query threads
    (fast, _, _), (plain, _, _) = both
    sent = [request(hit_rate()), request(query(), "/query"), request(hit_rate(PODS[:2]))]
    got = await exchange(fast.port, [b"".join(sent)], 3)  # pipelined behind one another too
    assert got == await exchange(plain.port, [b"".join(sent)], 3) and [g[0] for g in got] == [200] * 3, got
    reader, writer = await asyncio.open_connection("127.0.0.1", fast.port)
    for data in sent:
        writer.write(data)
        assert (await read_response(reader))[0] == 200
    assert aiohttp_connections(fast) == 0 and len(fast.guard.fast_connections) == 1
    writer.close()


ODD = {
    "another route": b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n",
    "a bad body": request(b'{"server_ip": ["a"], "body": {"token_ids": [1, "x"]}}'),
    "an empty body": request(b""),
    "explain": request(json.dumps({"server_ip": PODS, "body": {"token_ids": TOKENS}, "explain": True}).encode()),
    "chunked": request(b"%x\r\n%s\r\n0\r\n\r\n" % (len(hit_rate()), hit_rate()), extra=b"Transfer-Encoding: chunked\r\n",
                       length=False),
    "chunked and a length (smuggling)": request(b"0\r\n\r\n" + request(hit_rate()),
                                                extra=b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n",
                                                length=False),
    "two lengths": request(hit_rate(), extra=b"Content-Length: 3\r\n"),
    "a folded header": request(hit_rate(), extra=b"X-A: a\r\n b\r\n"),
    "no length": request(hit_rate(), length=False),
    "a query string": request(hit_rate(), "/kv-cache/hit-rate?x=1"),
    "HTTP/1.0": request(hit_rate()).replace(b"HTTP/1.1", b"HTTP/1.0", 1),
    "Connection: close": request(hit_rate(), extra=b"Connection: close\r\n"),
    "Proxy-Connection: close": request(hit_rate(), extra=b"Proxy-Connection: close\r\n"),
    "over the body limit": request(hit_rate(tokens=list(range(20000)))),
    "the Python path (a LoRA)": request(json.dumps({"token_ids": TOKENS, "model_name": "default",
                                                    "lora_name": "a", "lora_path": "/a"}).encode(), "/query"),
    "a query /query refuses": request(b'{"token_ids": [1, 2]}', "/query"),
}


@pytest.mark.parametrize("case", list(ODD))
async def test_a_request_it_does_not_take_reaches_aiohttp_as_it_came_on_the_same_connection(both, case):
    (fast, _, _), (plain, _, _) = both
    sent = [request(hit_rate()), ODD[case], request(query(), "/query")]
    got = await exchange(fast.port, sent, 3, lockstep=True)
    want = await exchange(plain.port, sent, 3, lockstep=True)
    assert got == want, (got, want)
    assert got[0][0] == 200 and got[1] is not None


#: the requests of ODD whose end their head says plainly: aiohttp's handler answers them alone, and the
#: connection comes back to the fast path (each other one leaves it with aiohttp, or closed)
LENT = {"another route", "a bad body", "an empty body", "explain", "a query string", "the Python path (a LoRA)",
        "a query /query refuses"}
#: those of LENT that are routing queries as the fast path reads their heads (counted against LEND_RUN)
QUERIES_LENT = LENT - {"another route", "a query string"}


@pytest.mark.parametrize("case", list(ODD))
async def test_after_a_request_aiohttp_answered_alone_the_connection_is_back_on_the_fast_path(case, native_query):
    """A router's pool used for anything else once (a readiness check, a registration, a refused query)
    kept each such connection on aiohttp's path for good: at 2,000 queries a run, most of the trace
    benchmark's queries went through aiohttp (bench/RESULTS.md)."""
    async with serving() as (fast, metrics, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", fast.port)
        try:
            writer.write(ODD[case])
            first = await read_response(reader)
            if case not in LENT:  # closed, or aiohttp's for good
                writer.write(request(query(), "/query"))
                after = await read_response(reader) if first is not None else None
                assert after is None or (after[0] == 200 and aiohttp_connections(fast) == 1), after
                return
            assert first is not None
            await until(lambda: aiohttp_connections(fast) == 0)
            assert fast.guard.fast_connections and not fast.guard.connections
            before = answered(metrics, "/query", 200)
            for _ in range(3):
                writer.write(request(query(), "/query"))
                assert (await read_response(reader))[0] == 200
            assert aiohttp_connections(fast) == 0 and answered(metrics, "/query", 200) == before + 3
        finally:
            writer.close()


async def test_requests_pipelined_behind_one_aiohttp_answers_are_held_and_answered_in_order(both, native_query):
    (fast, _, _), (plain, _, _) = both
    sent = [b"".join([request(query(), "/query"), b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n",
                      request(hit_rate(PODS[:2])), request(b'{"token_ids": [1, 2]}', "/query"),
                      request(query(TOKENS[:20]), "/query")])]
    got = await exchange(fast.port, sent, 5, then=lambda: until(lambda: aiohttp_connections(fast) == 0))
    assert got == await exchange(plain.port, sent, 5) and [g[0] for g in got] == [200, 200, 200, 422, 200], got


@settings(max_examples=50, deadline=None)
@given(cases=st.lists(st.sampled_from(sorted(LENT) + ["query", "hit-rate"]), min_size=1, max_size=8),
       pipelined=st.booleans())
def test_any_run_of_requests_on_one_connection_gets_aiohttps_answers_and_ends_on_the_fast_path(cases, pipelined):
    """Routing queries and requests aiohttp answers alone, in any order on one connection (each after the
    answer before, or all in one write): the answers of a server without the fast path, in order, and
    the connection on the fast path at the end, unless more than LEND_RUN routing queries in a row went
    to aiohttp (every one, without the native query) and it stayed there."""
    plain = {"query": request(query(), "/query"), "hit-rate": request(hit_rate(PODS[:3]))}
    data = [plain.get(case) or ODD[case] for case in cases]
    sent = [b"".join(data)] if pipelined else data
    in_a_row = kept = 0
    for case in cases:
        if case in plain and NATIVE_QUERY:
            in_a_row = 0
        elif case in plain or case in QUERIES_LENT:
            in_a_row += 1
            kept = kept or in_a_row > LEND_RUN

    async def run():
        async with serving() as (fast, _, _), serving(fast=False) as (without, _, _):
            got = await exchange(fast.port, sent, len(data), lockstep=not pipelined,
                                 then=lambda: until(lambda: aiohttp_connections(fast) == kept))
            return got, await exchange(without.port, sent, len(data), lockstep=not pipelined)
    got, want = asyncio.run(run())
    assert got == want and None not in got, (cases, got, want)


async def test_a_connection_whose_queries_all_go_to_aiohttp_stays_there_after_a_few(both, native_query):
    """A client whose every routing query only aiohttp answers (or an install without the native query)
    would make aiohttp's handler afresh for each: after LEND_RUN in a row the connection stays with
    aiohttp; one the fast path answers between them starts the count again. Other requests do not count:
    a router polling readiness until the replica is ready keeps its connections."""
    (fast, _, _), (plain, _, _) = both
    lora = ODD["the Python path (a LoRA)"]
    ready = b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n"
    sent = ([ready] * (3 * LEND_RUN) + [lora] * LEND_RUN + [request(query(), "/query")] + [lora] * (LEND_RUN + 1)
            + [request(query(), "/query")])
    got = []
    reader, writer = await asyncio.open_connection("127.0.0.1", fast.port)
    try:
        for i, data in enumerate(sent):
            writer.write(data)
            got.append(await read_response(reader))
            if i == 4 * LEND_RUN:  # a query after the readiness checks and LEND_RUN lent queries: the fast path's
                await until(lambda: aiohttp_connections(fast) == 0)
        assert aiohttp_connections(fast) == 1, "LEND_RUN + 1 in a row: aiohttp's for good"
    finally:
        writer.close()
    assert got == await exchange(plain.port, sent, len(sent), lockstep=True)


async def test_a_lent_connection_that_asks_for_its_close_is_closed_by_aiohttp(both):
    (fast, _, _), _ = both
    got = await exchange(fast.port, [b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n",
                                     b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                                     request(query(), "/query")], 3, lockstep=True)
    assert [g and g[0] for g in got] == [200, 200, None], got


async def test_pipelined_requests_are_answered_in_order(both):
    (fast, _, _), (plain, _, _) = both
    sent = [b"".join([request(hit_rate()), request(query(TOKENS[:17]), "/query"), request(hit_rate(PODS[:1])),
                      b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", request(hit_rate())])]
    got = await exchange(fast.port, sent, 5)
    assert got == await exchange(plain.port, sent, 5) and len(got) == 5 and got[3][0] == 200, got


async def until(cond, within: float = 5.0) -> None:
    end = time.monotonic() + within
    while not cond():
        assert time.monotonic() < end, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_a_body_in_parts_is_held_against_the_budget_and_answered(both, native_query):
    (fast, _, app), (plain, _, _) = both
    data = request(hit_rate())
    reader, writer = await asyncio.open_connection("127.0.0.1", fast.port)
    writer.write(data[:-20])
    await writer.drain()
    budget = app[BODY_BUDGET]
    await until(lambda: budget.used == len(hit_rate()))
    writer.write(data[-20:])
    got = await read_response(reader)
    assert [got] == await exchange(plain.port, [data], 1) and budget.used == 0
    assert aiohttp_connections(fast) == 0
    writer.close()


async def test_a_long_head_in_parts_goes_to_aiohttp(both):
    (fast, _, _), (plain, _, _) = both
    data = request(hit_rate(), extra=b"X-Long: %s\r\n" % (b"a" * 5000))
    reader, writer = await asyncio.open_connection("127.0.0.1", fast.port)
    writer.write(data[:4500])
    await until(lambda: aiohttp_connections(fast) == 1)
    writer.write(data[4500:])
    assert [await read_response(reader)] == await exchange(plain.port, [data], 1)
    writer.close()


async def test_a_long_head_that_came_whole_goes_to_aiohttp_unparsed(both):
    """Past FAST_HEAD_MAX the head is not parsed here at all: a router's is about 200 bytes, and no
    pattern of this path may cost the loop more than a short head's time."""
    (fast, _, _), (plain, _, _) = both
    data = request(hit_rate(), extra=b"X-Long: a%sb\r\n" % (b" " * 60_000))
    reader, writer = await asyncio.open_connection("127.0.0.1", fast.port)
    writer.write(data)
    assert [await read_response(reader)] == await exchange(plain.port, [data], 1)
    assert aiohttp_connections(fast) == 1
    writer.close()


@pytest.mark.parametrize("path,shape", [("/kv-cache/hit-rate", "status"), ("/query", "error")])
async def test_a_body_that_stops_coming_gets_408_in_the_routes_shape_and_is_counted(path, shape, caplog):
    caplog.set_level(logging.WARNING)
    async with serving(readTimeout=0.5) as (srv, metrics, app):
        reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
        body = hit_rate() if path != "/query" else query()
        writer.write(request(body, path)[:-10])
        t = time.monotonic()
        status, answer = await read_response(reader)
        assert status == 408 and 0.4 < time.monotonic() - t < 3 and shape in answer, answer
        assert await reader.read() == b""  # closed after it
        assert answered(metrics, path, 408) == 1 and app[BODY_BUDGET].used == 0
        waited = metrics.http_latency.labels(path, "408")._sum.get()
        assert 0.4 < waited < 3, f"its latency counts from its head, as aiohttp's does ({waited:.3f}s)"
        assert "refused (408)" in caplog.text
        writer.close()


async def test_with_the_budget_held_another_body_in_parts_waits_in_aiohttp_for_room():
    async with serving(maxHitRateBodyBytes=4096) as (srv, metrics, app):
        budget = app[BODY_BUDGET]
        budget.limit = len(hit_rate()) + 10  # room for one body in parts at a time
        first, second = request(hit_rate()), request(hit_rate(PODS[:2]))
        r1, w1 = await asyncio.open_connection("127.0.0.1", srv.port)
        w1.write(first[:-5])
        await until(lambda: budget.used > 0)
        r2, w2 = await asyncio.open_connection("127.0.0.1", srv.port)
        w2.write(second[:-5])
        await until(lambda: aiohttp_connections(srv) == 1)  # no room: handed to aiohttp, which waits
        await until(lambda: budget.waits == 1)
        w2.write(second[-5:])
        w1.write(first[-5:])
        assert (await read_response(r1))[0] == 200 and (await read_response(r2))[0] == 200
        assert budget.used == 0
        w1.close()
        w2.close()


async def test_an_idle_connection_is_closed_after_the_idle_timeout():
    async with serving(idleTimeout=0.5) as (srv, _, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
        for _ in range(3):  # the deadline moves with each answer
            writer.write(request(hit_rate()))
            assert (await read_response(reader))[0] == 200
        t = time.monotonic()
        assert await asyncio.wait_for(reader.read(), 5) == b""
        assert 0.4 < time.monotonic() - t < 3
        writer.close()


@pytest.mark.parametrize("fast", [True, False])
async def test_a_client_that_reads_no_answers_is_cut_off_after_the_write_timeout(fast, caplog):
    """Its answers pile up unread: after ``writeTimeout`` the connection is ended, answers and all (a close
    would wait for the client to read them, for ever). aiohttp's connections alike."""
    caplog.set_level(logging.WARNING)
    async with serving(fast=fast, writeTimeout=0.5) as (srv, _, _):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", srv.port))
        sock.setblocking(False)
        reader, writer = await asyncio.open_connection(sock=sock)
        one = request(hit_rate(PODS * 8))  # an answer of about 2.6 kB
        for _ in range(400):
            writer.write(one * 5)
            try:
                await asyncio.wait_for(writer.drain(), 2)
            except (asyncio.TimeoutError, ConnectionError):
                break  # the server reads no more: it holds more answers than it may
        await until(lambda: "not written within" in caplog.text, 10)
        await until(lambda: not srv.guard.fast_connections and not srv.runner.server.connections, 5)
        writer.close()


async def test_pipelined_requests_held_while_the_client_read_nothing_are_answered_when_it_reads():
    """Reading stops while the client reads no answers; once it reads again, the requests it had already
    sent are answered, every one (none left waiting in the buffer)."""
    n = 2000
    async with serving() as (fast, _, _), serving(fast=False) as (plain, _, _):
        got = {}
        for srv in (fast, plain):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", srv.port))
            sock.setblocking(False)
            reader, writer = await asyncio.open_connection(sock=sock, limit=1 << 20)
            writer.write(request(hit_rate(PODS * 8)) * n)  # answers of about 2.6 kB, none read yet
            await until(lambda: any("write" in c._paused for c in srv.guard.fast_connections)
                        or any(c.transport is not None and c.transport.get_write_buffer_size()
                               for c in srv.runner.server.connections))
            got[srv] = 0
            while got[srv] < n and await read_response(reader, within=5) is not None:
                got[srv] += 1
            writer.close()
        assert got[plain] == n and got[fast] == n, (got[fast], got[plain])


@pytest.mark.parametrize("fast", [True, False])
async def test_stopping_answers_a_query_under_way_on_the_query_threads(fast, monkeypatch, native_query):
    from cache_indexer.api import app as app_module
    monkeypatch.setattr(app_module, "INLINE_BUDGET", -1.0)  # every native call on the query threads
    started = asyncio.Event()

    class SlowThreads:
        async def run(self, q):
            started.set()
            await asyncio.sleep(0.5)
            return q.run()
    threads = SlowThreads()
    monkeypatch.setattr(HitRateApi, "_threads", lambda self: threads)
    async with serving(fast=fast) as (srv, _, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
        writer.write(request(hit_rate()))
        await asyncio.wait_for(started.wait(), 5)
        stopping = asyncio.create_task(srv.stop())
        got = await read_response(reader)
        await stopping
        writer.close()
    assert got is not None and got[0] == 200, got


@pytest.mark.parametrize("fast", [True, False])
async def test_a_connection_lent_to_aiohttp_when_the_server_stops_is_closed_after_its_answer(fast):
    """As aiohttp closes its connections at the end, a lent one whose answer comes during the shutdown does
    not come back to the fast path (the fast path's connections were closed already)."""
    entered, release = asyncio.Event(), asyncio.Event()

    async def held(request):
        entered.set()
        await release.wait()
        return web.json_response({"ok": True})

    def with_held(app: web.Application) -> None:
        app.router.add_get("/held", held)
    async with serving(fast=fast, setup=with_held, shutdownTimeout=5) as (srv, _, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
        writer.write(b"GET /held HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.wait_for(entered.wait(), 5)
        stopping = asyncio.create_task(srv.stop())
        await until(lambda: srv.guard.stopping)
        release.set()
        got = await read_response(reader)
        await stopping
        writer.write(request(query(), "/query"))
        after = await read_response(reader)
        writer.close()
    assert got == (200, {"ok": True}) and after is None and not srv.guard.fast_connections, (got, after)


@pytest.mark.parametrize("sent", [b"GET /healthz HTTP/1.1\nHost: x\n\n",
                                  b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03",
                                  b"POST /query HTTP/1.1\r\nHost: x\r\nBad Header\r\n"],
                         ids=["bare LF", "TLS", "a bad field"])
async def test_a_head_aiohttp_refuses_at_its_first_bad_byte_is_refused_at_once(sent):
    """Not held until the head's end or the header timeout: handed to aiohttp as soon as it cannot be a head
    the fast path takes."""
    async with serving(readHeaderTimeout=3) as (fast, _, _), serving(fast=False, readHeaderTimeout=3) as (plain, _, _):
        t = time.monotonic()
        want = await exchange(plain.port, [sent], 1)
        got = await exchange(fast.port, [sent], 1)
    assert want[0][0] == 400 and got == want and time.monotonic() - t < 2.5, got


async def test_answers_carry_the_content_type_aiohttp_gives_them(both):
    (fast, _, _), (plain, _, _) = both
    for data in (request(hit_rate()), request(query(), "/query")):
        heads = []
        for srv in (fast, plain):
            reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
            writer.write(data)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            heads.append([line for line in head.lower().split(b"\r\n") if line.startswith(b"content-type")])
            writer.close()
        assert heads[0] == heads[1], heads


async def test_stopping_closes_a_connection_whose_body_is_coming():
    """Nothing under way to wait for (aiohttp answers 408 at readTimeout, later; the client then retries)."""
    async with serving() as (srv, _, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
        writer.write(request(hit_rate())[:-5])
        await until(lambda: srv.guard.fast_connections and next(iter(srv.guard.fast_connections))._reserved)
        t = time.monotonic()
    assert time.monotonic() - t < 3
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()


_FIELDS = st.sampled_from([
    b"Content-Length: %d", b"content-length: %d", b"Content-Length:%d", b"Content-Length: %d ", b"Content-Length: +%d",
    b"Content-Length: %d, %d", b"Content-Length: 0%d", b"Transfer-Encoding: chunked", b"Transfer-Encoding: identity",
    b"Expect: 100-continue", b"Content-Encoding: gzip", b"Connection: keep-alive", b"Connection: close",
    b"Connection: Keep-Alive, Close", b"X-Empty:", b"X-Tab:\tv", b"Bad Name: v", b"X-Nul: a\x00b", b"X-Bare: a\rb",
    b"X-Bare-Lf: a\nb", b" X-Lead: v", b"X-Utf8: \xc3\xa9", b"Upgrade: h2c", b"Host: a", b"Host: a", b"Host: a",
    b"host:b", b"User-Agent: a", b"User-Agent: b", b"Content-Type: application/json", b"Proxy-Connection: close"])


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fields=st.lists(_FIELDS, max_size=4), path=st.sampled_from(["/kv-cache/hit-rate", "/query"]),
       tail=st.sampled_from([b"", b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"]), cut=st.floats(0, 1))
def test_any_head_gets_the_answer_aiohttp_gives_it(fields, path, tail, cut):
    """Whatever header fields a request carries, the server with the fast path answers it as the one
    without does (on one fresh connection each, with a request after it to show where the framing ends;
    sent in two writes, cut anywhere)."""
    body = hit_rate() if path != "/query" else query()
    head = b"".join(f.replace(b"%d", b"%d" % len(body)) + b"\r\n" for f in fields)
    data = b"POST %s HTTP/1.1\r\n%s\r\n%s%s" % (path.encode(), head, body, tail)
    at = int(len(data) * cut)
    sent = [data[:at], data[at:]]

    async def run():
        async with serving(readTimeout=0.3) as (fast, _, _), serving(fast=False, readTimeout=0.3) as (plain, _, _):
            return (await exchange(fast.port, sent, 1 + bool(tail)),
                    await exchange(plain.port, sent, 1 + bool(tail)))
    got, want = asyncio.run(run())
    assert got == want, (data, got, want)


@settings(max_examples=100, deadline=None)
@given(fields=st.lists(_FIELDS, max_size=4),
       method=st.sampled_from([b"GET", b"DELETE", b"POST", b"PUT", b"PATCH", b"OPTIONS"]),  # (HEAD: no body)
       path=st.sampled_from([b"/healthz", b"/readyz?x=1", b"/register", b"/query", b"/nowhere"]),
       cut=st.floats(0, 1), body=st.booleans())
def test_a_request_lent_to_aiohttp_ends_where_aiohttp_ends_it(fields, method, path, cut, body):
    """Where the head of a request aiohttp answers says where it ends, aiohttp is lent the connection for
    it alone; the answers to it and to a routing query behind it are those of a server without the fast
    path, however the head's fields read (sent in two writes, cut anywhere). (A body with no
    ``Content-Length`` is not drawn: its bytes are then a bad next request, and aiohttp answers the request
    before it or only the 400, by how the bytes were cut.)"""
    assume(not body or any(b"%d" in f for f in fields))
    payload = query() if body else b""
    head = b"".join(f.replace(b"%d", b"%d" % len(payload)) + b"\r\n" for f in fields)
    data = b"%s %s HTTP/1.1\r\n%s\r\n%s%s" % (method, path, head, payload, request(query(), "/query"))
    at = int(len(data) * cut)
    sent = [data[:at], data[at:]]

    async def run():
        async with serving(readTimeout=0.3) as (fast, _, _), serving(fast=False, readTimeout=0.3) as (plain, _, _):
            return await exchange(fast.port, sent, 2), await exchange(plain.port, sent, 2)
    got, want = asyncio.run(run())
    assert got == want, (data, got, want)


@pytest.mark.parametrize("fast", [True, False], ids=["fast-path", "aiohttp"])
@pytest.mark.parametrize("raw", [b"GARBAGE\r\n\r\n", b"POST /query HTTP/1.1\r\nHost: x\r\nBad Header: 1\r\n\r\n",
                                 b"POST /query HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n"],
                         ids=["request-line", "header-name", "two-lengths"])
async def test_a_request_aiohttps_parser_refuses_is_counted(fast, raw):
    """Bad input is counted: a request aiohttp's parser refused with 400 never reached the middlewares, so
    ``http_requests_total`` missed it; it counts now, under path "other"."""
    async with serving(fast=fast) as (srv, metrics, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
        writer.write(raw)
        status, _ = await read_response(reader)
        assert status == 400
        await wait_for(lambda: answered(metrics, "other", 400) == 1, 5, "the refusal counted")
        writer.close()
        ok = await exchange(srv.port, [request(query(), "/query")], 1)
        assert ok[0][0] == 200 and answered(metrics, "other", 400) == 1, "a request the app counts is not counted again"
