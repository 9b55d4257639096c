"""The HTTP server's deadlines and header bound over raw sockets on 127.0.0.1: readHeaderTimeout
(slowloris), readTimeout (a body that does not arrive), maxHeaderBytes over the whole header block,
and that none of them cuts a well-behaved client."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import pytest

from cache_indexer.api.app import HitRateApi
from cache_indexer.api.server import HttpServer
from cache_indexer.infra.metrics import Metrics
from cache_indexer.schemas.block_hash import BlockHasher
from cache_indexer.indexer.l1_state import L1State
from cache_indexer.schemas.config import HttpConfig

HEADER_TIMEOUT = 0.5
BODY = json.dumps({"server_ip": ["127.0.0.1"], "body": {"token_ids": list(range(32)), "block_size": 16}}).encode()
HEAD = (b"POST /kv-cache/hit-rate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(BODY))


@contextlib.asynccontextmanager
async def serving(http: HttpConfig):
    metrics = Metrics()
    api = HitRateApi(http, BlockHasher("sha256_cbor", "0"), tiers=lambda: (L1State(), None), ready=lambda: True,
                     metrics=metrics)
    srv = HttpServer(api.make_app(), http, metrics)
    await srv.start()
    try:
        yield srv, metrics
    finally:
        await srv.stop()


@pytest.fixture
async def server():
    async with serving(HttpConfig(host="127.0.0.1", port=0, readHeaderTimeout=HEADER_TIMEOUT, readTimeout=1.5,
                                  idleTimeout=30)) as served:
        yield served


@pytest.fixture
async def conn(server):
    """A raw connection to the server, and its metrics."""
    srv, metrics = server
    reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
    yield reader, writer, metrics
    writer.close()


async def closed_by_server(reader: asyncio.StreamReader, within: float) -> float:
    """Seconds until the server closes the connection (EOF or reset); fails after ``within``."""
    t = time.monotonic()
    try:
        data = await asyncio.wait_for(reader.read(65536), within)
    except ConnectionResetError:
        data = b""
    assert data == b"", f"expected the server to close, got {data[:80]!r}"
    return time.monotonic() - t


async def response(reader: asyncio.StreamReader) -> tuple[int, dict]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    status = int(head.split(b" ", 2)[1])
    length = int(next(line.split(b":", 1)[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    return status, json.loads(await asyncio.wait_for(reader.readexactly(length), 5))


def header_timeouts(metrics: Metrics) -> float:
    return metrics.http_header_timeouts._value.get()


async def test_a_silent_connection_is_closed_after_the_header_timeout(conn):
    reader, writer, metrics = conn
    waited = await closed_by_server(reader, 5)
    assert waited >= HEADER_TIMEOUT * 0.8
    assert header_timeouts(metrics) == 1


async def test_headers_dribbled_slower_than_the_deadline_are_cut_off(conn):
    reader, writer, metrics = conn
    with contextlib.suppress(ConnectionError):
        for byte in HEAD[:-2]:  # a byte every 50 ms, never finishing the header block
            writer.write(bytes([byte]))
            await writer.drain()
            with contextlib.suppress(asyncio.TimeoutError):
                if await asyncio.wait_for(reader.read(1), 0.05) == b"":
                    break
    await closed_by_server(reader, 1)
    assert header_timeouts(metrics) == 1


async def test_kept_alive_connection_survives_idle_time_but_not_a_dribbled_second_request(conn):
    reader, writer, metrics = conn
    for _ in range(2):
        writer.write(HEAD + BODY)
        assert (await response(reader))[0] == 200, "waiting between requests is idleTimeout's business"
        await asyncio.sleep(HEADER_TIMEOUT * 1.5)  # the elapsed time is the subject: idle, not reading headers
    writer.write(HEAD[:20])  # a third request that stalls in its request line
    await closed_by_server(reader, 5)
    assert header_timeouts(metrics) == 1


async def test_a_slow_body_is_not_cut_by_the_header_deadline(conn):
    reader, writer, metrics = conn
    writer.write(HEAD)
    half = len(BODY) // 2
    writer.write(BODY[:half])
    await asyncio.sleep(HEADER_TIMEOUT * 1.6)  # past the header deadline, within readTimeout
    writer.write(BODY[half:])
    status, body = await response(reader)
    assert status == 200 and body["status"] == 0
    assert header_timeouts(metrics) == 0


async def test_a_body_that_never_arrives_gets_408(conn):
    reader, writer, _ = conn
    writer.write(HEAD + BODY[:10])
    status, body = await response(reader)
    assert status == 408 and body["status"] == 408 and "within 1.5s" in body["message"]


async def test_complete_headers_are_not_cut_when_the_event_loop_was_busy(conn):
    """The deadline is about bytes arriving, not about how soon the server gets to the request: a loop
    blocked past the deadline (a large snapshot being decoded, say) must not close a waiting client."""
    reader, writer, metrics = conn
    writer.write(HEAD + BODY)
    await writer.drain()
    time.sleep(HEADER_TIMEOUT * 1.6)  # blocks the loop the server shares with this test: that is the subject
    status, _ = await response(reader)
    assert status == 200 and header_timeouts(metrics) == 0


@pytest.fixture
async def small_header_server():
    async with serving(HttpConfig(host="127.0.0.1", port=0, maxHeaderBytes=64 << 10, readHeaderTimeout=0)) as served:
        yield served


async def test_a_header_block_over_max_header_bytes_gets_431_and_is_not_buffered(small_header_server):
    """Issue 16 #7: the bound is on the whole header block (Go's MaxHeaderBytes), not per field: many
    fields each under the limit are refused as soon as their sum passes it, with no header timer."""
    srv, metrics = small_header_server
    reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
    field = b"X-Filler-%d: " + b"a" * (8 << 10) + b"\r\n"
    writer.write(b"POST /kv-cache/hit-rate HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    sent = 0
    with contextlib.suppress(ConnectionError):
        for i in range(120):  # 120 fields of 8 KiB: 960 KiB, each field far below the 64 KiB bound
            writer.write(field % i)
            await writer.drain()
            sent += len(field)
            if reader.at_eof() or reader._buffer:  # noqa: SLF001 - the answer arrived: stop sending
                break
    status, body = await response(reader)
    assert status == 431 and "maxHeaderBytes" in body["message"]
    assert metrics.http_headers_too_large._value.get() == 1
    await closed_by_server(reader, 5)
    writer.close()
    ok_reader, ok_writer = await asyncio.open_connection("127.0.0.1", srv.port)
    ok_writer.write(HEAD.replace(b"\r\n\r\n", b"\r\n" + b"X-Big: " + b"b" * (40 << 10) + b"\r\n\r\n") + BODY)
    status, body = await response(ok_reader)
    assert status == 200, body  # a large header block within the bound is served
    ok_writer.close()


async def test_bodies_read_in_parts_are_bounded_all_together_and_the_rest_wait_their_turn():
    """A review had 200 clients send 4 MiB bodies at once: 950 MB resident, nothing bounded them together.
    Here the largest body is 64 KiB, so the app reserves at most 16 x 64 KiB for bodies being read: 40
    clients that send 40 KiB of a 60 KiB body and stall hold no more than that, the others wait (each within
    readTimeout: 408), a request that comes whole is answered meanwhile, and all is given back after. Each
    connection closes after its 408: aiohttp's lingering close held it 10 s more, and the shutdown too."""
    from tests.conftest import wait_for

    async with _budgeted() as (srv, budget):
        conns = await _sending(srv, 40, 40 << 10)

        async def some_wait() -> bool:
            return budget.waits > 0 and budget.used >= budget.limit - (60 << 10)
        await wait_for(some_wait, 10, "readers waiting for room")
        assert budget.most <= budget.limit, f"{budget.most} bytes of bodies held at once"
        reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
        writer.write(HEAD + BODY)  # whole with its headers: answered meanwhile
        assert (await asyncio.wait_for(reader.readline(), 5)).startswith(b"HTTP/1.1 200")
        writer.close()
        statuses = [await asyncio.wait_for(r.readline(), 10) for r, _ in conns]
        assert all(s.startswith(b"HTTP/1.1 408") for s in statuses), statuses[:3]
        assert budget.used == 0 and budget.most <= budget.limit
        for r, w in conns:  # closed after the answer, the rest of the body unread (no lingering close: 10 s)
            await asyncio.wait_for(r.read(), 2)
            w.close()


async def test_bodies_that_come_in_parts_at_once_are_all_answered_within_the_budget():
    """A review of the bound: readers that held what they had read and waited for room for the rest filled
    the budget with halves, and none could finish: 40 clients sending 60 KiB bodies in two halves at once
    got 408s. A reader now reserves its whole body before it reads: all are answered."""
    async with _budgeted() as (srv, budget):
        body = BODY + b" " * ((60 << 10) - len(BODY))
        conns = await _sending(srv, 40, 32 << 10, body)
        for _, writer in conns:
            writer.write(body[32 << 10:])
        statuses = [await asyncio.wait_for(r.readline(), 10) for r, _ in conns]
        assert all(s.startswith(b"HTTP/1.1 200") for s in statuses), [s for s in statuses if b"200" not in s][:3]
        assert budget.waits > 0 and budget.most <= budget.limit and budget.used == 0
        for _, w in conns:
            w.close()


@contextlib.asynccontextmanager
async def _budgeted():
    """A server whose largest body is 64 KiB (its budget for bodies read in parts: 1 MiB), and that budget."""
    from cache_indexer.api.request_body import BODY_BUDGET

    http = HttpConfig(host="127.0.0.1", port=0, maxHitRateBodyBytes=64 << 10, readTimeout=2.0, idleTimeout=30)
    metrics = Metrics()
    app = HitRateApi(http, BlockHasher("sha256_cbor", "0"), tiers=lambda: (L1State(), None), ready=lambda: True,
                     metrics=metrics).make_app()
    budget = app[BODY_BUDGET]
    assert budget.limit == 16 * (64 << 10)
    srv = HttpServer(app, http, metrics)
    await srv.start()
    try:
        yield srv, budget
    finally:
        await srv.stop()


async def _sending(srv, clients: int, first: int, body: bytes = b" " * (60 << 10)) -> list:
    """``clients`` connections, each having sent its headers and the first ``first`` bytes of ``body``."""
    head = (b"POST /kv-cache/hit-rate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    conns = []
    for _ in range(clients):
        reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
        writer.write(head + body[:first])
        conns.append((reader, writer))
    return conns
