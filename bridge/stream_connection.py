"""The bridge's own NATS connection for its stream messages: a publish is one write to the socket, an ack
is handled where it is read.

nats-py hands each publish to its flusher task and each reply to a subscription task as a ``Msg``. For a
vLLM batch that comes alone, as most do on a real fleet, that was about half of what the bridge spends on
the batch (bench/RESULTS.md, the trace section). The stream messages therefore go on a connection of their
own that speaks only what they need of the NATS protocol: the handshake (TLS and every credential
``nats.*`` takes, from infra/nats_auth.py), HPUB, one subscription for the acks, PING and PONG. Streams,
KV buckets and leases stay on nats-py's connection.

Like nats-py's, it reconnects for ever, through the configured servers every ``RECONNECT_WAIT`` (those of
``nats.url``: a cluster's INFO adds none, where a Kubernetes Service is the usual URL anyway). Its
owner is told of a loss and of the reconnection (bridge/jetstream_publisher.py re-sends what a lost
connection took). It buffers nothing while disconnected: a publish then raises and is re-sent later.
What the server sends is bounded (a line, a reply); anything else closes the connection, which is then
made anew.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import re
import secrets
import ssl
from collections import deque
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlparse

from cache_indexer.infra.nats_auth import connect_options
from cache_indexer.infra.streams import servers
from cache_indexer.infra.tasks import cancel_and_wait
from cache_indexer.infra.throttled_log import ThrottledWarning
from cache_indexer.infra.log_format import describe
from cache_indexer.infra.version import VERSION
from cache_indexer.schemas.config import NatsConfig

log = logging.getLogger(__name__)

#: between two rounds of attempts through the servers (nats-py's ``reconnect_time_wait`` in infra/streams.py)
RECONNECT_WAIT = 0.5
#: a PING this often; two unanswered close the connection (a peer gone without a FIN: nats-py pings too)
PING_EVERY = 30.0
MAX_PINGS_OUT = 2
#: the longest protocol line taken from the server (an INFO of a large cluster is a few kB)
MAX_LINE = 64 << 10
#: the largest reply taken on the ack inbox (a JetStream ack is under 200 bytes)
MAX_REPLY = 64 << 10
#: nats-py's rules for a header: a name of these characters, line breaks in a value made spaces
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_NOT_IN_SUBJECT = re.compile(r"\s")
_NEWLINES = str.maketrans({"\r": " ", "\n": " "})

#: told of each reply on the ack inbox: (the last token of its subject, its status ("" unless it is a
#: status message such as 503), its payload)
OnReply = Callable[[str, str, bytes], None]


class NatsRefused(ConnectionError):
    """The server refused the handshake (``-ERR``: credentials, permissions) or spoke no NATS."""


class StreamConnection:
    def __init__(self, cfg: NatsConfig, name: str, on_lost: Callable[[], None] | None = None,
                 on_back: Callable[[], None] | None = None) -> None:
        self._servers = servers(cfg.url)
        self._opts = connect_options(cfg)
        self._timeout = cfg.connectTimeout
        self._name = name
        self._on_lost = on_lost or (lambda: None)
        self._on_back = on_back or (lambda: None)
        self._on_reply: OnReply = lambda token, status, data: None
        #: the subject prefix of the acks' inbox (nats-py's ``_INBOX.`` prefix, which the chart permits)
        self.inbox = f"_INBOX.{secrets.token_hex(11)}"
        self.max_payload = 1 << 20  # the server's, from its INFO
        self._wire: _Wire | None = None
        self._closed = False
        self._reconnecting: asyncio.Task | None = None
        self._next_server = 0
        self._warn = ThrottledWarning(log)  # the connection's losses and failed attempts
        self._warn_server = ThrottledWarning(log)  # what the server said or sent that is not NATS
        self._names_ok: set[str] = set()

    @property
    def is_connected(self) -> bool:
        return self._wire is not None

    def take_replies(self, on_reply: OnReply) -> str:
        """Every reply on the inbox goes to ``on_reply``; returns the inbox (``<inbox>.<token>`` is a reply)."""
        self._on_reply = on_reply
        return self.inbox

    async def connect(self) -> None:
        """The first connection: each server once, in order; raises the last one's error."""
        error: BaseException | None = None
        for _ in self._servers:
            try:
                await self._open()
                return
            except (OSError, asyncio.TimeoutError, ssl.SSLError) as exc:
                error = exc
        raise ConnectionError(f"cannot connect to NATS at {', '.join(self._servers)}: {describe(error)}") \
            from error

    async def close(self) -> None:
        self._closed = True
        if self._reconnecting is not None:
            await cancel_and_wait(self._reconnecting)
        wire, self._wire = self._wire, None
        if wire is not None:
            wire.close()

    async def publish(self, subject: str, payload: bytes = b"", reply: str = "",
                      headers: dict[str, str] | None = None) -> None:
        """One message written to the socket (nats-py's ``publish``, headers and all). Raises
        ``ConnectionError`` while disconnected; waits while the socket's buffer is over its high mark."""
        wire = self._wire
        if wire is None or wire.transport.is_closing():
            raise ConnectionError("not connected to NATS")
        if wire.paused is not None:
            await asyncio.shield(wire.paused)
            if wire is not self._wire:
                raise ConnectionError("the NATS connection was lost")
        if not subject or _NOT_IN_SUBJECT.search(subject) or _NOT_IN_SUBJECT.search(reply):
            raise ValueError(f"not a NATS subject: {subject!r} (reply {reply!r})")
        head = self._header_block(headers) if headers else b"NATS/1.0\r\n\r\n"
        wire.transport.write(b"HPUB %s %s%d %d\r\n%s%s\r\n" % (
            subject.encode(), reply.encode() + b" " if reply else b"", len(head), len(head) + len(payload), head,
            payload))

    def _header_block(self, headers: dict[str, str]) -> bytes:
        parts = [b"NATS/1.0\r\n"]
        for k, v in headers.items():
            name = k.strip()
            if not name:
                continue
            if name not in self._names_ok:
                if not _HEADER_NAME.fullmatch(name):
                    raise ValueError(f"not a NATS header name: {name!r}")
                if len(self._names_ok) < 256:
                    self._names_ok.add(name)
            parts.append(b"%s: %s\r\n" % (name.encode(), v.strip().translate(_NEWLINES).encode()))
        parts.append(b"\r\n")
        return b"".join(parts)

    # -- the connection's life ----------------------------------------------------------------------
    async def _open(self) -> None:
        """Connects to the next server: TCP, TLS where asked, CONNECT and PING answered by PONG, the inbox's
        subscription. Raises where any of it fails (the socket closed)."""
        url = self._servers[self._next_server % len(self._servers)]
        self._next_server += 1
        u = urlparse(url if "://" in url else f"nats://{url}")
        host, port = u.hostname or "127.0.0.1", u.port or 4222
        loop = asyncio.get_running_loop()
        transport, wire = await asyncio.wait_for(loop.create_connection(lambda: _Wire(self), host, port),
                                                 self._timeout)
        try:
            info = _json_object(await asyncio.wait_for(wire.handshake_line(b"INFO "), self._timeout))
            tls = self._opts.get("tls")
            if tls is None and (u.scheme == "tls" or info.get("tls_required")):
                tls = ssl.create_default_context()
            if tls is not None:
                if not (info.get("tls_required") or info.get("tls_available")):
                    raise NatsRefused(f"TLS is asked for (nats.tls, or a tls:// URL) but {host}:{port} offers none")
                if wire.unread():
                    raise NatsRefused("NATS sent more than its INFO before TLS began")
                transport = await asyncio.wait_for(loop.start_tls(
                    transport, wire, tls, server_hostname=self._opts.get("tls_hostname") or host), self._timeout)
                wire.transport = transport
            transport.write(b"CONNECT %s\r\nPING\r\n" % self._connect_options(info, u).encode())
            await asyncio.wait_for(wire.handshake_line(b"PONG"), self._timeout)
            # the inbox's subscription answered too: a permission refused is an -ERR before this PONG
            transport.write(b"SUB %s.* 1\r\nPING\r\n" % self.inbox.encode())
            await asyncio.wait_for(wire.handshake_line(b"PONG"), self._timeout)
            if wire.closed_because is not None or transport.is_closing():  # lost while this task resumed
                raise ConnectionError(f"NATS closed the connection ({wire.closed_because or 'closing'})")
            wire.go_live()
        except BaseException:
            transport.abort()
            raise
        self._take_info(info)
        self._wire = wire

    def _take_info(self, info: dict) -> None:
        """What the connection keeps of a server's INFO (its first, or one it sends later)."""
        if isinstance(info.get("max_payload"), int) and info["max_payload"] > 0:
            self.max_payload = info["max_payload"]

    def _connect_options(self, info: dict, u) -> str:
        opts: dict = {"verbose": False, "pedantic": False, "lang": "python-cache-indexer", "version": VERSION,
                      "protocol": 1, "headers": True, "no_responders": True, "echo": False, "name": self._name}
        o = self._opts
        if "nkeys_seed" in o or "user_credentials" in o:
            if "nkeys_seed" in o:
                seed = Path(o["nkeys_seed"]).read_bytes().strip()
            else:
                jwt, seed = _read_creds(o["user_credentials"])
                opts["jwt"] = jwt
            import nkeys  # nats-py's own dependency for these credentials

            if "nonce" in info:  # (as nats-py: no nonce, nothing to sign)
                kp = nkeys.from_seed(bytearray(seed))
                if "nkeys_seed" in o:
                    opts["nkey"] = kp.public_key.decode()
                opts["sig"] = base64.b64encode(kp.sign(str(info["nonce"]).encode())).decode()
                kp.wipe()
        elif "user" in o:
            opts["user"], opts["pass"] = o["user"], o["password"]
        elif "token" in o:
            opts["auth_token"] = o["token"]
        elif u.username is not None:  # credentials in the URL, as nats-py takes them
            if u.password is None:
                opts["auth_token"] = u.username
            else:
                opts["user"], opts["pass"] = u.username, u.password
        return json.dumps(opts, sort_keys=True)

    def _lost(self, wire: _Wire, why: str) -> None:
        if wire is not self._wire:
            return  # one never live, or closed by us
        self._wire = None
        if self._closed:
            return
        self._warn("the bridge's NATS connection for stream messages was lost (%s); connecting again", why)
        try:
            self._on_lost()
        except Exception:
            log.exception("a connection-lost callback failed")
        self._reconnecting = asyncio.get_running_loop().create_task(self._reconnect(),
                                                                     name="bridge-stream-connection")

    async def _reconnect(self) -> None:
        while not self._closed:
            for _ in self._servers:
                try:
                    await self._open()
                except Exception as exc:  # never a dead reconnection: NATS away, refusing, unreadable creds
                    self._warn("stream connection: cannot connect to NATS yet: %s", describe(exc))
                    continue
                log.info("the bridge's NATS connection for stream messages is back")
                try:
                    self._on_back()
                except Exception:
                    log.exception("a reconnection callback failed")
                return
            await asyncio.sleep(RECONNECT_WAIT)

    def _reply(self, subject: bytes, head: bytes, data: bytes) -> None:
        token = subject.rsplit(b".", 1)[-1].decode("ascii", "replace")
        status = ""
        if head:  # "NATS/1.0 503 ..." for a status message, "NATS/1.0" for headers alone
            first = head.split(b"\r\n", 1)[0].split()
            status = first[1].decode("ascii", "replace") if len(first) > 1 else ""
        try:
            self._on_reply(token, status, data)
        except Exception:
            log.exception("an ack handler failed")


class _Wire(asyncio.Protocol):
    """One TCP (or TLS) connection's bytes: lines handed to the handshake while it runs, then MSG/HMSG
    replies, PING, PONG, INFO and -ERR handled as they are read."""

    def __init__(self, conn: StreamConnection) -> None:
        self.conn = conn
        self.transport: asyncio.Transport | None = None
        self.live = False
        self.paused: asyncio.Future | None = None  # set while the socket's buffer is over its high mark
        self._buf = b""
        self._lines: deque[bytes] = deque()
        self._waiter: asyncio.Future | None = None
        self.closed_because: str | None = None
        self._pings_out = 0
        self._ping_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        if self.closed_because is None:
            self.closed_because = describe(exc) if exc is not None else "closed by NATS"
        if self._ping_timer is not None:
            self._ping_timer.cancel()
        if self.paused is not None and not self.paused.done():
            self.paused.set_result(None)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(ConnectionError(f"NATS closed the connection ({self.closed_because})"))
        self.conn._lost(self, self.closed_because)

    def pause_writing(self) -> None:
        self.paused = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self.paused is not None and not self.paused.done():
            self.paused.set_result(None)
        self.paused = None

    def close(self) -> None:
        self.closed_because = "closed"
        if self.transport is not None:
            self.transport.close()

    def _fail(self, why: str) -> None:
        """The server sent what NATS is not: the connection is closed and made anew."""
        self.conn._warn_server("stream connection: %s; closing it", why)
        if self.transport.is_closing():  # lost already: the loss may have been told while it was not live
            self.conn._lost(self, self.closed_because or why)
            return
        self.closed_because = why
        self.transport.abort()

    # -- the handshake ------------------------------------------------------------------------------
    async def handshake_line(self, op: bytes) -> bytes:
        """The next line that starts with ``op`` (a PING is answered meanwhile); a ``-ERR`` raises, and so
        does any other first line than an INFO (not a NATS server)."""
        while True:
            while not self._lines:
                if self.closed_because is not None:
                    raise ConnectionError(f"NATS closed the connection ({self.closed_because})")
                self._waiter = asyncio.get_running_loop().create_future()
                await self._waiter
            line = self._lines.popleft()
            if line.startswith(b"-ERR"):
                raise NatsRefused(f"NATS refused the connection: {line[5:].decode('utf-8', 'replace')}")
            if line.startswith(op):
                return line[len(op):] if op.endswith(b" ") else line
            if op == b"INFO ":
                raise NatsRefused(f"not a NATS server: it said {line[:40]!r}")
            if line == b"PING":
                self.transport.write(b"PONG\r\n")

    def unread(self) -> bool:
        """Whether bytes the handshake has not taken are buffered."""
        return bool(self._lines or self._buf)

    def go_live(self) -> None:
        self.live = True
        rest = b"".join(line + b"\r\n" for line in self._lines) + self._buf
        self._lines.clear()
        self._buf = b""
        self._ping_timer = asyncio.get_running_loop().call_later(PING_EVERY, self._ping)
        if rest:
            self.data_received(rest)

    def _ping(self) -> None:
        if self._pings_out >= MAX_PINGS_OUT:
            self._fail(f"{self._pings_out} PINGs unanswered")
            return
        self._pings_out += 1
        self.transport.write(b"PING\r\n")
        self._ping_timer = asyncio.get_running_loop().call_later(PING_EVERY, self._ping)

    # -- what the server sends ----------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self._buf:
            data, self._buf = self._buf + data, b""
        if not self.live:
            return self._handshake_bytes(data)
        pos, end = 0, len(data)
        while pos < end:
            nl = data.find(b"\r\n", pos)
            if nl < 0:
                if end - pos > MAX_LINE:
                    return self._fail(f"a line of over {MAX_LINE} bytes")
                break
            op = data[pos:pos + 4]
            if op == b"MSG " or op == b"HMSG":
                parts = data[pos:nl].split()
                try:
                    size = int(parts[-1])
                    head = int(parts[-2]) if op == b"HMSG" else 0
                except (ValueError, IndexError):
                    return self._fail(f"a malformed {op.decode().strip()} line")
                if not 0 <= head <= size <= MAX_REPLY or len(parts) < (5 if op == b"HMSG" else 4):
                    return self._fail(f"a reply of {size} bytes (at most {MAX_REPLY})")
                start = nl + 2
                if start + size + 2 > end:
                    break  # the rest of it is to come
                if data[start + size:start + size + 2] != b"\r\n":
                    return self._fail(f"a reply longer than its {size} bytes")
                self.conn._reply(parts[1], data[start:start + head], data[start + head:start + size])
                pos = start + size + 2
                continue
            line = data[pos:nl]
            pos = nl + 2
            if line == b"PING":
                self.transport.write(b"PONG\r\n")
            elif line == b"PONG":
                self._pings_out = 0
            elif op == b"INFO":
                try:
                    self.conn._take_info(_json_object(line[5:]))
                except NatsRefused as exc:
                    return self._fail(str(exc))
            elif op == b"-ERR":
                self.conn._warn_server("NATS says of the stream connection: %s", line[5:].decode("utf-8", "replace"))
            elif line != b"+OK":
                return self._fail(f"not a NATS operation: {line[:40]!r}")
        if pos < end:
            self._buf = data[pos:]

    def _handshake_bytes(self, data: bytes) -> None:
        lines = data.split(b"\r\n")
        self._buf = lines.pop()
        if len(self._buf) > MAX_LINE:
            return self._fail(f"a line of over {MAX_LINE} bytes")
        self._lines.extend(lines)
        if lines and self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


def _json_object(text: bytes) -> dict:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        raise NatsRefused("NATS sent an INFO that is not JSON") from None
    if not isinstance(value, dict):
        raise NatsRefused("NATS sent an INFO that is not an object")
    return value


def _read_creds(path: str) -> tuple[str, bytes]:
    """(the user JWT, the user's nkey seed) of a .creds file (nsc's layout, as nats-py reads it)."""
    jwt = seed = None
    lines = Path(path).read_bytes().splitlines()
    for i, line in enumerate(lines[:-1]):
        if b"BEGIN NATS USER JWT" in line:
            jwt = lines[i + 1].strip().decode()
        elif b"BEGIN USER NKEY SEED" in line:
            seed = lines[i + 1].strip()
    if not jwt or not seed:
        raise ValueError(f"{path}: not a .creds file (a user JWT and an nkey seed)")
    return jwt, seed
