"""The request header block, bounded in time (``http.readHeaderTimeout``) and in bytes (``http.maxHeaderBytes``).

Bytes: aiohttp bounds each header line (``max_field_size``) but not their sum: 8 connections each
sending 120 fields of 1000 KiB took a replica from 62 MB to 1.99 GB. Like Go's ``MaxHeaderBytes``, which
the Helm value mirrors, the bound here is on the whole header block, request line included: past it the
connection gets ``431 Request Header Fields Too Large`` and is closed, before aiohttp buffers more.

Time:

aiohttp has no header deadline: a connection that is accepted and then sends nothing, or dribbles
its request line a byte at a time, holds a slot for ever (slowloris). Go's ``ReadHeaderTimeout``,
which the Helm value mirrors, bounds that. Here each accepted connection's protocol is wrapped: a
timer starts at accept and at the first byte of each later request on a kept-alive connection, and
stops as soon as the bytes received hold the end of the header block (``CRLF CRLF``), whether or not
the server has got round to the request yet (a busy event loop must not cost waiting clients their
connection). When it fires, the connection is closed. Waiting between requests on a kept-alive
connection is ``http.idleTimeout``'s job; reading the body is ``http.readTimeout``'s.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from aiohttp import web

log = logging.getLogger(__name__)


LINGER_SECONDS = 2.0
_TOO_LARGE = (b"HTTP/1.1 431 Request Header Fields Too Large\r\nConnection: close\r\n"
              b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s")


class HeaderGuardProtocol(asyncio.Protocol):
    """Delegates everything to aiohttp's request handler and adds the header timer and byte count."""

    def __init__(self, inner: asyncio.Protocol, guard: "HeaderGuard", registry: dict, on_timeout: Callable[[], None]):
        self.inner = inner
        self.guard = guard
        self.timeout = guard.timeout
        self.max_bytes = guard.max_bytes
        self._header_bytes = 0
        self._discarding = False  # refused: whatever else the client sends is dropped
        self.registry = registry
        self.on_timeout = on_timeout
        self.transport: asyncio.Transport | None = None
        self.awaiting_headers = True  # from accept, and from the end of each request to the next header block
        self._tail = b""  # the last bytes seen while awaiting headers: a CRLF CRLF may straddle two reads
        self._timer: asyncio.TimerHandle | None = None

    # -- called by the middleware ------------------------------------------------------------------------
    def request_started(self) -> None:
        self.awaiting_headers = False
        self._disarm()

    def request_finished(self) -> None:
        self.awaiting_headers = True  # the timer starts with the next request's first byte
        self._tail = b""
        self._header_bytes = 0

    # -- the timer ---------------------------------------------------------------------------------------
    def _arm(self) -> None:
        if self.timeout:
            self._timer = asyncio.get_running_loop().call_later(self.timeout, self._expired)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        if not self.awaiting_headers or self.transport is None or self.transport.is_closing():
            return
        peer = self.transport.get_extra_info("peername")
        log.debug("closing %s: request headers not complete within %ss", peer, self.timeout)
        self.on_timeout()
        self.transport.close()

    # -- asyncio.Protocol, delegated -----------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        self.registry[self.inner] = self
        self.inner.connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._discarding:
            return
        if self.awaiting_headers:
            if self._timer is None:
                self._arm()  # the first byte of the next request on a kept-alive connection
            seen = self._tail + data if self._tail else data  # (no copy of a body that came with its headers)
            end = seen.find(b"\r\n\r\n")
            self._header_bytes += (end + 4 - len(self._tail)) if end >= 0 else len(data)
            if self._header_bytes > self.max_bytes:
                self._refuse()
                return
            if end >= 0:  # the header block is complete; what follows is body (or pipelined)
                self.awaiting_headers = False
                self._disarm()
            else:
                self._tail = seen[-3:]
        self.inner.data_received(data)

    def _refuse(self) -> None:
        self._disarm()
        self.guard.on_too_large()
        log.debug("closing %s: request headers over http.maxHeaderBytes (%d)",
                  self.transport.get_extra_info("peername"), self.max_bytes)
        body = (b'{"status": 431, "message": "request headers exceed http.maxHeaderBytes (%d bytes)", '
                b'"server_score_list": []}' % self.max_bytes)
        self.transport.write(_TOO_LARGE % (len(body), body))
        # A lingering close: closing with the client's bytes unread would reset the connection and could
        # destroy the answer before the client reads it; so the answer goes out, what else arrives is
        # dropped unread, and the connection closes when the client does, or after LINGER_SECONDS.
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._discarding = True
        self.awaiting_headers = False
        asyncio.get_running_loop().call_later(LINGER_SECONDS, self.transport.close)

    def eof_received(self):
        if self._discarding:
            return False  # the client is done: close
        return self.inner.eof_received()

    def connection_lost(self, exc) -> None:
        self._disarm()
        self.registry.pop(self.inner, None)
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


class HeaderGuard:
    """The middleware and the site for one server (``timeout`` 0: no timer)."""

    def __init__(self, timeout: float, max_bytes: int, on_timeout: Callable[[], None] = lambda: None,
                 on_too_large: Callable[[], None] = lambda: None) -> None:
        self.timeout = timeout
        self.max_bytes = max_bytes
        self.on_timeout = on_timeout
        self.on_too_large = on_too_large
        self.connections: dict = {}  # aiohttp's request handler -> its wrapper

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        wrapper = self.connections.get(request.protocol)
        if wrapper is None:
            return await handler(request)
        wrapper.request_started()
        try:
            return await handler(request)
        finally:
            wrapper.request_finished()

    def site(self, runner: web.BaseRunner, host: str, port: int, backlog: int = 128) -> "HeaderGuardSite":
        return HeaderGuardSite(runner, self, host, port, backlog)


class HeaderGuardSite(web.BaseSite):
    """A TCP site whose connections get the header guard (aiohttp's TCPSite, with a wrapped factory)."""

    def __init__(self, runner: web.BaseRunner, guard: HeaderGuard, host: str, port: int, backlog: int) -> None:
        super().__init__(runner, backlog=backlog)
        self.guard = guard
        self.host = host
        self.requested_port = port
        self.port = port

    @property
    def name(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        await super().start()
        factory = self._runner.server
        d = self.guard

        def protocol() -> HeaderGuardProtocol:
            return HeaderGuardProtocol(factory(), d, d.connections, d.on_timeout)

        self._server = await asyncio.get_running_loop().create_server(
            protocol, self.host, self.requested_port, backlog=self._backlog)
        if self._server.sockets:
            self.port = self._server.sockets[0].getsockname()[1]
