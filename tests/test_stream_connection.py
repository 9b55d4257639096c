"""The bridge's connection for stream messages (bridge/stream_connection.py) against a real nats-server that
is killed and started again, and against servers that answer what NATS is not: a wrong first line, a
line without end, an unknown operation, a reply too large to take, a peer that no longer answers PINGs,
an ack that arrives a byte at a time. Credentials and TLS: tests/test_nats_security.py."""

from __future__ import annotations

import asyncio
import json

import nats
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_indexer.bridge import stream_connection
from cache_indexer.bridge.stream_connection import MAX_LINE, MAX_REPLY, StreamConnection
from cache_indexer.schemas.config import NatsConfig
from tests.conftest import wait_for
from tests.test_jetstream_publisher import kill, publisher_on

INFO = b'INFO {"server_id":"fake","max_payload":1048576,"headers":true}\r\n'


class FakeServer:
    """A TCP server on loopback that says what ``script`` says: it gets the connection's number (from 0)
    and the reader and writer, after INFO was sent where ``info`` holds."""

    def __init__(self, script, info: bool = True) -> None:
        self.script, self.info = script, info
        self.connections = 0
        self.server: asyncio.AbstractServer | None = None

    async def __aenter__(self) -> FakeServer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader, writer) -> None:
        n, self.connections = self.connections, self.connections + 1
        try:
            if self.info:
                writer.write(INFO)
            await self.script(n, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


async def handshake(reader, writer) -> None:
    """The server's side of a client's CONNECT and PING, then its SUB and PING."""
    line = await reader.readline()
    assert line.startswith(b"CONNECT {")
    assert json.loads(line[8:])["headers"] is True
    assert await reader.readline() == b"PING\r\n"
    writer.write(b"PONG\r\n")
    assert (await reader.readline()).startswith(b"SUB _INBOX.")
    assert await reader.readline() == b"PING\r\n"
    writer.write(b"PONG\r\n")


def config(url: str) -> NatsConfig:
    return NatsConfig(url=url, connectTimeout=2)


async def test_a_killed_server_is_told_reconnected_and_told_again(restartable_nats, stream_prefix, monkeypatch):
    monkeypatch.setattr(stream_connection, "RECONNECT_WAIT", 0.1)
    server = restartable_nats
    events: list[str] = []
    conn = StreamConnection(config(server.url), "t", on_lost=lambda: events.append("lost"),
                            on_back=lambda: events.append("back"))
    nc = await nats.connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.1)
    acks: list[tuple[str, str, bytes]] = []
    try:
        await nc.jetstream().add_stream(name=stream_prefix, subjects=[f"{stream_prefix}.>"])
        await conn.connect()
        inbox = conn.take_replies(lambda *reply: acks.append(reply))
        await conn.publish(f"{stream_prefix}.a", b"1", reply=f"{inbox}.1", headers={"Nats-Msg-Id": "1"})
        await wait_for(lambda: len(acks) == 1, 5, "the first ack")
        await kill(server)
        await wait_for(lambda: events == ["lost"], 5, "the loss told")
        assert not conn.is_connected
        with pytest.raises(ConnectionError):
            await conn.publish(f"{stream_prefix}.a", b"2", reply=f"{inbox}.2", headers={"Nats-Msg-Id": "2"})
        await asyncio.to_thread(server.start)
        await wait_for(lambda: events == ["lost", "back"], 10, "the reconnection told")
        await conn.publish(f"{stream_prefix}.a", b"2", reply=f"{inbox}.2", headers={"Nats-Msg-Id": "2"})
        await wait_for(lambda: len(acks) == 2, 5, "the ack on the new connection")
        assert acks[1][:2] == ("2", "") and json.loads(acks[1][2])["seq"] == 2
    finally:
        await conn.close()
        await nc.close()


async def test_a_connection_closed_right_after_its_last_pong_is_not_taken_for_live(monkeypatch):
    """From a review: the server's last PONG and its close read before the handshake's task resumed left a
    connection that said it was connected, refused every publish, and was never made again. Now the
    handshake fails (the first connection raises, a later one is tried again) and what is made next works."""
    monkeypatch.setattr(stream_connection, "RECONNECT_WAIT", 0.05)
    published = []

    async def script(n, reader, writer):
        if n == 0:  # the handshake up to its last PONG, then gone
            await reader.readline()
            await reader.readline()
            writer.write(b"PONG\r\n")
            await reader.readline()
            await reader.readline()
            writer.write(b"PONG\r\n")
            await writer.drain()
            writer.transport.abort()
            return
        await handshake(reader, writer)
        published.append(await reader.readline())
        await reader.read(1 << 16)

    async with FakeServer(script) as fake:
        conn = StreamConnection(config(fake.url), "t")
        try:
            try:
                await conn.connect()
            except ConnectionError:
                await conn.connect()
            await wait_for(lambda: conn.is_connected and fake.connections == 2, 10, "a working connection")
            await conn.publish("s.t", b"x", reply="r.1")
            await wait_for(lambda: published, 5, "the publish on it")
            assert published[0].startswith(b"HPUB s.t r.1 ")
        finally:
            await conn.close()


async def test_an_inbox_the_user_may_not_subscribe_to_is_refused_at_connect(tmp_path):
    """The acks' subscription is confirmed in the handshake: a user denied ``_INBOX.>`` would otherwise get
    no ack ever, every message re-sent for ever, the bridge ready all along."""
    from cache_indexer.nats_server import NatsServer

    conf = ('authorization { users: [{user: "b", password: "p", permissions: '
            '{publish: ">", subscribe: {deny: "_INBOX.>"}}}] }\n')
    server = NatsServer(extra_config=conf).start()
    try:
        with pytest.raises(ConnectionError, match="Permissions Violation"):
            await StreamConnection(NatsConfig(url=server.url, user="b", password="p", connectTimeout=2), "t").connect()
    finally:
        server.close()


async def test_tls_asked_of_a_server_that_offers_none_is_one_clear_error(nats_url):
    with pytest.raises(ConnectionError, match="offers none"):
        await StreamConnection(NatsConfig(url=nats_url, connectTimeout=2, tls={"enabled": True}), "t").connect()


@pytest.mark.parametrize("first", [b"HTTP/1.1 400 Bad Request\r\n\r\n", b"-ERR 'Authorization Violation'\r\n",
                                   b"INFO [1, 2]\r\n", b"x" * (MAX_LINE + 10)],
                         ids=["http", "err", "info-not-an-object", "line-without-end"])
async def test_a_server_that_speaks_no_nats_is_refused_at_connect(first):
    async def script(n, reader, writer):
        writer.write(first)
        await reader.read(1 << 16)

    async with FakeServer(script, info=False) as fake:
        with pytest.raises(ConnectionError) as refused:
            await asyncio.wait_for(StreamConnection(config(fake.url), "t").connect(), 10)
        assert "NATS" in str(refused.value)


@pytest.mark.parametrize("garbage", [b"BOGUS op\r\n", b"MSG _INBOX.x.1 1 %d\r\n" % (MAX_REPLY + 1),
                                     b"HMSG _INBOX.x.1 1 9 5\r\n", b"MSG _INBOX.x.1 1 many\r\n", b"y" * (MAX_LINE + 1),
                                     b"MSG _INBOX.x.1 1 2\r\nabXY+OK\r\n"],
                         ids=["unknown-op", "reply-too-large", "header-past-the-end", "size-not-a-number",
                              "line-without-end", "payload-longer-than-its-size"])
async def test_garbage_once_connected_closes_the_connection_which_is_made_anew(garbage, monkeypatch, caplog):
    monkeypatch.setattr(stream_connection, "RECONNECT_WAIT", 0.05)
    events: list[str] = []
    conn: StreamConnection | None = None

    async def script(n, reader, writer):
        await handshake(reader, writer)
        if n == 0:  # once the client took the connection for live (not in its handshake)
            await wait_for(lambda: conn.is_connected, 5, "the first connection live")
            writer.write(garbage)
        await reader.read(1 << 20)  # until the client closes

    async with FakeServer(script) as fake:
        conn = StreamConnection(config(fake.url), "t", on_lost=lambda: events.append("lost"),
                                on_back=lambda: events.append("back"))
        await conn.connect()
        try:
            await wait_for(lambda: events == ["lost", "back"], 10, "closed, then made anew")
            assert fake.connections == 2 and conn.is_connected
            assert any("closing it" in r.getMessage() for r in caplog.records), "the reason logged"
        finally:
            await conn.close()


async def test_a_peer_that_no_longer_answers_pings_is_left(monkeypatch):
    monkeypatch.setattr(stream_connection, "PING_EVERY", 0.1)
    pings = []

    async def script(n, reader, writer):
        await handshake(reader, writer)
        while await reader.readline():  # PINGs, never answered on the first connection
            pings.append(n)
            if n:
                writer.write(b"PONG\r\n")

    lost: list[int] = []
    async with FakeServer(script) as fake:
        conn = StreamConnection(config(fake.url), "t", on_lost=lambda: lost.append(1))
        await conn.connect()
        try:
            await wait_for(lambda: lost and conn.is_connected, 10, "left after two unanswered PINGs, then back")
            assert pings.count(0) == 2
            await wait_for(lambda: pings.count(1) >= 4, 10, "PINGs answered on the new connection")
            assert lost == [1]
        finally:
            await conn.close()


async def test_replies_split_anywhere_are_each_told_once_and_a_ping_is_answered():
    replies = (b"MSG _INBOX.x.17 1 23\r\n" + b'{"stream":"S","seq":42}' + b"\r\n"
               + b"PING\r\n"
               + b"HMSG _INBOX.x.18 1 30 30\r\nNATS/1.0 503 No Responders\r\n\r\n\r\n"
               + b"+OK\r\nMSG _INBOX.x.19 1 _INBOX.r 2\r\n{}\r\n")
    pong = asyncio.Event()

    async def script(n, reader, writer):
        await handshake(reader, writer)
        for i in range(len(replies)):
            writer.write(replies[i:i + 1])
            await writer.drain()
        assert await reader.readline() == b"PONG\r\n"
        pong.set()
        await reader.read(1 << 16)

    got: list[tuple[str, str, bytes]] = []
    async with FakeServer(script) as fake:
        conn = StreamConnection(config(fake.url), "t")
        conn.take_replies(lambda *reply: got.append(reply))
        await conn.connect()
        try:
            await wait_for(lambda: len(got) == 3 and pong.is_set(), 10, "three replies and the PONG")
            assert got == [("17", "", b'{"stream":"S","seq":42}'), ("18", "503", b""), ("19", "", b"{}")]
        finally:
            await conn.close()


async def test_headers_go_as_nats_py_sends_them_and_a_bad_name_or_subject_is_refused():
    seen = asyncio.get_running_loop().create_future()

    async def script(n, reader, writer):
        await handshake(reader, writer)
        line = await reader.readline()
        head, total = (int(x) for x in line.split()[-2:])
        body = await reader.readexactly(total + 2)
        seen.set_result((line, body[:head], body[head:total]))
        await reader.read(1 << 16)

    async with FakeServer(script) as fake:
        conn = StreamConnection(config(fake.url), "t")
        await conn.connect()
        try:
            with pytest.raises(ValueError):
                await conn.publish("a b", b"x", reply="r.1", headers={"K": "v"})
            with pytest.raises(ValueError):
                await conn.publish("s", b"x", reply="r.1", headers={"K:": "v"})
            await conn.publish("s.t", b"payload", reply="r.1", headers={" Nats-Msg-Id ": " id\r\n2 ", "": "skipped"})
            line, head, payload = await asyncio.wait_for(seen, 5)
            assert line.startswith(b"HPUB s.t r.1 ")
            assert head == b"NATS/1.0\r\nNats-Msg-Id: id  2\r\n\r\n" and payload == b"payload"
        finally:
            await conn.close()


async def test_while_disconnected_nothing_is_sent_and_everything_goes_out_once_back(restartable_nats, stream_prefix):
    """A publish that finds the connection down is not tried again every few ms while it stays down (each
    try an exception, a window of 2,048 of them four times a second): it goes out once the connection is
    back, with whatever else is due."""
    server = restartable_nats
    async with publisher_on("stream-connection", server.url, stream_prefix, window=64, ack_timeout=0.2) as \
            (pub, metrics, js):  # (a re-send due every 50 ms)
        await kill(server)
        await wait_for(lambda: not pub._nc.is_connected, 5, "the loss seen")
        for i in range(50):
            await pub.publish(f"{stream_prefix}.a", b"%d" % i, {"Nats-Msg-Id": f"m{i}"})
        await asyncio.to_thread(server.start)  # (a second or so down)
        assert await pub.flush(15)
        assert (await js.stream_info(stream_prefix)).state.messages == 50
        assert metrics.publish_retries._value.get() <= 50, "each sent again once, at the reconnection"


class _Recorder:
    """The transport under the parser in the property tests below (the socket's side is tested above)."""

    def __init__(self) -> None:
        self.written, self.aborted = [], False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def abort(self) -> None:
        self.aborted = True

    def is_closing(self) -> bool:
        return self.aborted


_token = st.text("0123456789abc", min_size=1, max_size=6)
_frames = st.one_of(
    st.tuples(st.just("msg"), _token, st.binary(max_size=300)),
    st.tuples(st.just("status"), _token, st.sampled_from(["503", "408", "100"])),
    st.tuples(st.sampled_from(["ping", "pong", "ok", "info"]), st.just(""), st.just(b"")))


def _encode(frame) -> bytes:
    kind, token, body = frame
    if kind == "msg":
        return b"MSG _INBOX.x.%s 1 %d\r\n%s\r\n" % (token.encode(), len(body), body)
    if kind == "status":
        head = b"NATS/1.0 %s Why\r\n\r\n" % body.encode()
        return b"HMSG _INBOX.x.%s 1 %d %d\r\n%s\r\n" % (token.encode(), len(head), len(head), head)
    return {"ping": b"PING\r\n", "pong": b"PONG\r\n", "ok": b"+OK\r\n", "info": INFO}[kind]


def _wire(got: list) -> tuple[stream_connection._Wire, _Recorder]:
    conn = StreamConnection(config("nats://127.0.0.1:1"), "t")
    conn.take_replies(lambda *reply: got.append(reply))
    wire = stream_connection._Wire(conn)
    wire.transport, wire.live = _Recorder(), True
    return wire, wire.transport


@settings(max_examples=300, deadline=None)
@given(frames=st.lists(_frames, max_size=25), cuts=st.lists(st.integers(0, 20_000), max_size=12))
def test_what_the_server_sends_cut_anywhere_is_read_as_sent(frames, cuts):
    data = b"".join(_encode(f) for f in frames)
    got: list = []
    wire, transport = _wire(got)
    at = 0
    for cut in sorted({c % (len(data) + 1) for c in cuts}) + [len(data)]:
        wire.data_received(data[at:cut])
        at = cut
    assert not transport.aborted and wire._buf == b""
    assert got == [(t, "", b) if k == "msg" else (t, b, b"") for k, t, b in frames if k in ("msg", "status")]
    assert transport.written == [b"PONG\r\n"] * sum(k == "ping" for k, _, _ in frames)


@settings(max_examples=300, deadline=None)
@given(garbage=st.lists(st.one_of(st.binary(max_size=200), _frames.map(_encode),
                                  st.sampled_from([b"MSG ", b"HMSG a 1 5 3\r\n", b"\r\n", b"MSG a 1 99999999\r\n",
                                                   b"INFO {", b"-ERR 'x'\r\n"])), max_size=30))
def test_garbage_from_the_server_is_refused_or_read_never_raised_nor_held_unbounded(garbage):
    wire, transport = _wire([])
    for chunk in garbage:
        if transport.aborted:
            break
        wire.data_received(chunk)
        assert len(wire._buf) <= MAX_LINE + MAX_REPLY + 2
