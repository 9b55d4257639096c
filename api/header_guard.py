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

The same protocol answers the routing queries' plain requests itself (api/fast_path.py), holding them to
those bounds too, and makes aiohttp's handler for a connection only when one of its requests needs it:
lent the connection for that request alone where its head says where it ends (what follows is held until
the answer is written, then served here again), for good otherwise.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from aiohttp import web
from aiohttp.tcp_helpers import tcp_keepalive

from cache_indexer.api.fast_path import FAST_HEAD_MAX, Head, could_be_fast, lendable_end, parse_head, response
from cache_indexer.api.request_body import BodyBudget, late_body
from cache_indexer.infra.throttled_log import ThrottledWarning

log = logging.getLogger(__name__)


LINGER_SECONDS = 2.0
#: routing queries lent to aiohttp in a row (none answered by the fast path between; other requests, such
#: as readiness checks, do not count) after which the connection stays with aiohttp: where the fast path
#: answers none of a connection's queries (an install without the native query, a client whose every query
#: only the Python path takes), a handler made for each costs more than one kept
LEND_RUN = 4
#: set on each request that reached the middlewares (the application counts it; api/server.py counts those
#: aiohttp refused before)
ROUTED = web.RequestKey("routed", bool) if hasattr(web, "RequestKey") else "cache_indexer.routed"  # (aiohttp < 3.12)
_TOO_LARGE = (b"HTTP/1.1 431 Request Header Fields Too Large\r\nConnection: close\r\n"
              b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s")


class HeaderGuardProtocol(asyncio.Protocol):
    """A connection: the header timer and byte count, then aiohttp's request handler; or, while the
    connection's requests are plain routing queries, their answers straight from its bytes
    (api/fast_path.py), with aiohttp's handler made only when a request needs it."""

    def __init__(self, make_inner: Callable[[], asyncio.Protocol], guard: "HeaderGuard", registry: dict,
                 on_timeout: Callable[[], None]):
        self.make_inner = make_inner
        self.inner: asyncio.Protocol | None = None
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
        # the fast path's state (api/fast_path.py)
        self._buf = b""  # from the start of the request not yet answered
        self._head: Head | None = None  # that request's head, once parsed
        self._head_at = 0.0  # when it was (time.perf_counter)
        self._parts: list[bytes] = []  # what came of its body after the buffer
        self._have = 0  # the buffer's bytes and its parts'
        self._reserved = 0  # bytes of the body budget held while its body comes in parts
        self._wait: asyncio.TimerHandle | None = None  # the body's deadline or the write one
        self._idle: asyncio.TimerHandle | None = None  # http.idleTimeout between requests
        self._idle_until = 0.0
        self._paused: set[str] = set()  # why reading is paused: a pipelined request, a full buffer, a query
        self._later: asyncio.Future | None = None  # an answer from the query threads, awaited
        self._eof = False
        #: while aiohttp's handler is lent the connection for one request: what it sees of the transport, and
        #: how many of that request's bytes it has still to be given (what comes after is held here)
        self._lent: _LentTransport | None = None
        self._lent_left = 0
        self._queries_lent = 0  # routing queries lent in a row
        self._writing_paused = False  # the transport's buffer is over its high mark

    # -- called by the middleware ------------------------------------------------------------------------
    def request_started(self) -> None:
        self.awaiting_headers = False
        self._disarm()

    def request_finished(self) -> None:
        self.awaiting_headers = True  # the timer starts with the next request's first byte
        self._tail = b""
        self._header_bytes = 0
        if self._lent is not None and not self._lent.answered:  # an exception aiohttp answers: it keeps the
            self._keep_with_aiohttp()                          # connection (a 404 or 500 is rare on a pool)

    @property
    def lent(self) -> bool:
        """Whether aiohttp's handler serves the connection for the one request under way only."""
        return self._lent is not None

    def answered_by_aiohttp(self, keep_alive: bool) -> None:
        """The lent request's answer is written whole: the connection comes back to the fast path on the
        loop's next turn (once aiohttp's handler is done with the request; ``_take_back`` then checks it is
        still open), where the answer keeps it alive and the handler was given all of the request. Else
        aiohttp keeps it."""
        if self._lent is None:
            return
        if keep_alive and not self._lent_left:
            self._lent.answered = True
            asyncio.get_running_loop().call_soon(self._take_back, self.inner)
        else:
            self._keep_with_aiohttp()

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

    # -- asyncio.Protocol --------------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        if self.guard.fast_routes:
            tcp_keepalive(transport)
            self.guard.fast_connections.add(self)
        else:
            self._to_aiohttp()
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._discarding:
            return
        if self.inner is None:
            if self._head is not None:  # its body, in parts: joined once, when it is all here
                self._parts.append(data)
                self._have += len(data)
                if self._have < self._head.body_end:
                    return
                self._buf = b"".join([self._buf, *self._parts])
                self._parts.clear()
            else:
                self._buf = self._buf + data if self._buf else data
            if not self._paused:
                self._serve()
            return
        if self._lent is not None:
            if len(data) > self._lent_left:  # the next request: the fast path's, once the connection is back
                self._buf = self._buf + data[self._lent_left:] if self._buf else data[self._lent_left:]
                data = data[:self._lent_left]
                self._pause("lent")
            self._lent_left -= len(data)
            if data:
                self.inner.data_received(data)
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
        self._end_wait()
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
        self._buf = b""
        self._parts.clear()
        self.awaiting_headers = False
        asyncio.get_running_loop().call_later(LINGER_SECONDS, self.transport.close)

    def eof_received(self):
        if self._discarding:
            return False  # the client is done: close
        if self.inner is None:
            self._eof = True  # pipelined requests still to answer keep it open until they are
            return bool(self._buf) and bool(self._paused & {"pipeline", "query"})
        return self.inner.eof_received()

    def connection_lost(self, exc) -> None:
        self._disarm()
        self._leave_fast_path()
        if self.inner is not None:
            self.registry.pop(self.inner, None)
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._writing_paused = True
        if self.inner is not None:
            self.inner.pause_writing()
        else:  # the client reads no answers: no more are made, and it gets writeTimeout to start again
            self._pause("write")
            self._wait_for(self.guard.write_timeout, self._write_expired)

    def resume_writing(self) -> None:
        self._writing_paused = False
        if self.inner is not None:
            self.inner.resume_writing()
        elif "write" in self._paused:
            self._end_wait()
            self._resume("write")
            if not self._paused and self._buf and self._head is None:  # requests that came meanwhile
                asyncio.get_running_loop().call_soon(self._serve_next)

    # -- the fast path -----------------------------------------------------------------------------------
    def _serve(self) -> None:
        """Answers the request at the buffer's start if it is complete and plain; waits for the rest of it;
        or hands the connection to aiohttp. One request a call: a pipelined one is served on the loop's
        next turn, reading paused meanwhile."""
        buf, head = self._buf, self._head
        if not buf or self.transport is None or self.transport.is_closing():
            return
        if head is None:
            if self._timer is None:
                self._arm()  # the first byte of a request on a kept-alive connection
            end = buf.find(b"\r\n\r\n")
            if (end + 4 if end >= 0 else len(buf)) > self.max_bytes:
                self._refuse()
                return
            if end < 0:
                if len(buf) > FAST_HEAD_MAX or not could_be_fast(buf):  # aiohttp's to parse (or refuse)
                    self._to_aiohttp()
                elif self._eof:
                    self.transport.close()
                return
            self._disarm()
            self._head_at = time.perf_counter()  # its latency counts from here, as aiohttp's handler's does
            head = self._head = parse_head(buf, end + 4, self.guard.fast_routes, self.guard.max_body)
            if head is None:
                self._to_aiohttp()
                return
        if len(buf) < head.body_end:  # the body comes in parts: held against the body budget, by a deadline
            if self._wait is None:
                budget = self.guard.body_budget
                want = head.body_end - head.body_start
                if budget is not None and not budget.take_now(want):
                    self._to_aiohttp()  # there it waits for room
                    return
                self._reserved = want if budget is not None else 0
                self._wait_for(self.guard.body_timeout, self._body_expired)
            self._have = len(buf)
            if self._eof:
                self.transport.close()
            return
        self._end_wait()
        self._release()
        started = self._head_at
        try:
            answer = head.route.answer(buf[head.body_start:head.body_end])
        except Exception:  # aiohttp's handler answers it again, and logs the failure where it fails there
            answer = None
        if answer is None:
            self._to_aiohttp()
        elif isinstance(answer, bytes):
            self._answered(answer, started)
        else:  # on the query threads: reading waits for the answer
            self._pause("query")
            self._later = asyncio.ensure_future(self._answer_later(answer, started))

    async def _answer_later(self, answer: Awaitable[bytes | None], started: float) -> None:
        try:
            got = await answer
        except Exception:
            got = None
        finally:
            self._later = None
        if self.transport.is_closing():
            return
        self._resume("query")
        if got is None:
            self._to_aiohttp()
        else:
            self._answered(got, started)

    def _answered(self, answer: bytes, started: float) -> None:
        """The answer to the request at the buffer's start written; the next one's turn."""
        head = self._head
        self._queries_lent = 0
        self.transport.write(response(200, answer))
        head.route.count(200, started)
        self._head, self._buf = None, self._buf[head.body_end:]
        if self._buf:  # pipelined: the loop's next turn
            self._pause("pipeline")
            asyncio.get_running_loop().call_soon(self._serve_next)
        elif self._eof:
            self.transport.close()
        elif self.guard.idle_timeout:
            self._idle_from_now()

    def _idle_from_now(self) -> None:
        loop = asyncio.get_running_loop()
        self._idle_until = loop.time() + self.guard.idle_timeout
        if self._idle is None:
            self._idle = loop.call_at(self._idle_until, self._idle_check)

    def _serve_next(self) -> None:
        if self.inner is None:
            self._resume("pipeline")
            if not self._paused:
                self._serve()

    def _to_aiohttp(self) -> None:
        """aiohttp's handler answers the request at the buffer's start, given what came of it from its start:
        lent the connection for that request alone where its head is whole and says where it ends
        (``lendable_end``: a router's other calls, a refused query; not past LEND_RUN routing queries in a
        row), and for good otherwise (from then on it serves the connection)."""
        self._leave_fast_path()
        writing_paused = "write" in self._paused
        for why in tuple(self._paused):
            self._resume(why)
        query = self._head is not None  # a routing query the fast path could not answer
        buf, self._buf, self._head = b"".join([self._buf, *self._parts]), b"", None
        self._parts.clear()
        end = buf.find(b"\r\n\r\n", 0, FAST_HEAD_MAX)
        stop = lendable_end(buf, end + 4) if end >= 0 and not (query and self._queries_lent >= LEND_RUN) else None
        self.inner = self.make_inner()
        self.registry[self.inner] = self
        if stop is not None:
            self._lent, self._lent_left = _LentTransport(self), stop
            self._queries_lent += query
        self.inner.connection_made(self._lent or self.transport)
        if writing_paused:
            self.inner.pause_writing()
        self.awaiting_headers, self._tail, self._header_bytes = stop is None, b"", 0
        if buf:
            self.data_received(buf)
        if self._eof:
            self.inner.eof_received()

    def _keep_with_aiohttp(self) -> None:
        """The lent connection stays with aiohttp's handler: it is given what was held back."""
        lent, self._lent = self._lent, None
        self._resume("lent")
        lent.kept()  # (after: a pause of aiohttp's own stays)
        held, self._buf = self._buf, b""
        self.awaiting_headers, self._tail, self._header_bytes = True, b"", 0
        if held:
            self.data_received(held)

    def _take_back(self, inner) -> None:
        """The fast path serves the connection again: aiohttp's handler, done with its request, is let go
        (its close is then nothing), and what came after that request is served."""
        if inner is not self.inner or self._lent is None:
            return
        if self.guard.stopping or self.transport.is_closing():  # aiohttp closes it after this answer, as
            self._keep_with_aiohttp()                           # it would without the lending
            return
        lent, self._lent = self._lent, None
        lent.returned = True
        self.registry.pop(inner, None)
        self.inner = None
        inner.connection_lost(None)
        self.guard.fast_connections.add(self)
        self.awaiting_headers, self._tail, self._header_bytes = True, b"", 0
        self._resume("lent")
        self._resume("aiohttp")
        if self._writing_paused:  # the client has not read aiohttp's answer yet: as after an answer of ours
            self.pause_writing()
        if self._buf:
            if not self._paused:
                self._serve()
        elif self._eof:
            self.transport.close()
        elif self.guard.idle_timeout:
            self._idle_from_now()

    def _leave_fast_path(self) -> None:
        """Its deadlines and idle timer stopped, its body budget given back, no longer one of the fast
        connections (the connection went to aiohttp, or is gone)."""
        self._end_wait()
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        self._release()
        self.guard.fast_connections.discard(self)

    def _pause(self, why: str) -> None:
        if not self._paused:
            self.transport.pause_reading()
        self._paused.add(why)

    def _resume(self, why: str) -> None:
        self._paused.discard(why)
        if not self._paused and self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def _release(self) -> None:
        if self._reserved:
            self.guard.body_budget.give(self._reserved)
            self._reserved = 0

    def _wait_for(self, seconds: float, then: Callable[[], None]) -> None:
        self._end_wait()
        if seconds:
            self._wait = asyncio.get_running_loop().call_later(seconds, then)

    def _end_wait(self) -> None:
        if self._wait is not None:
            self._wait.cancel()
            self._wait = None

    def _idle_check(self) -> None:
        """Idle since the last answer for ``http.idleTimeout``: closed (a lazy timer, as aiohttp's: the
        deadline moves with every answer, the timer is set again only when it fires early or a request is
        under way)."""
        self._idle = None
        if self.inner is not None or self.transport.is_closing():
            return
        loop = asyncio.get_running_loop()
        if self._buf:  # under way: the header and body deadlines hold it; idle again after its answer
            self._idle_until = loop.time() + self.guard.idle_timeout
        if self._idle_until > loop.time():
            self._idle = loop.call_at(self._idle_until, self._idle_check)
        else:
            self.transport.close()

    def _body_expired(self) -> None:
        self._wait = None
        head = self._head
        message = late_body(self.guard.body_timeout)
        self.guard.refused("POST %s from %s refused (408): %s", head.path,
                           self.transport.get_extra_info("peername"), message)
        self._release()
        self.transport.write(response(408, head.route.refuse(408, message), close=True))
        head.route.count(408, self._head_at)
        self._buf, self._head = b"", None
        self._parts.clear()
        self._discarding = True
        self.transport.close()

    def _write_expired(self) -> None:
        self._wait = None
        log.warning("response to %s not written within %ss; closing", self.transport.get_extra_info("peername"),
                    self.guard.write_timeout)
        self.transport.abort()  # (a close would wait for the client to read what is buffered)


class _LentTransport(asyncio.Transport):
    """The connection as aiohttp's handler sees it while lent one request: its reading paused and resumed
    among the connection's other reasons; once the connection is taken back, the handler's close (as it
    lets the connection go) and anything it might still write are nothing."""

    def __init__(self, owner: HeaderGuardProtocol) -> None:
        super().__init__()
        self._owner = owner
        self._real = owner.transport
        self.answered = False  # its request's answer is written whole: the connection is to come back
        self.returned = False

    def kept(self) -> None:
        """aiohttp keeps the connection: its pauses become the transport's own."""
        if "aiohttp" in self._owner._paused:
            self._owner._resume("aiohttp")
            self._real.pause_reading()
        self._owner = None

    def get_extra_info(self, name, default=None):
        return self._real.get_extra_info(name, default)

    def is_closing(self) -> bool:
        return self.returned or self._real.is_closing()

    def close(self) -> None:
        if not self.returned:
            self._real.close()

    def abort(self) -> None:
        if not self.returned:
            self._real.abort()

    def write(self, data) -> None:
        if not self.returned:
            self._real.write(data)

    def writelines(self, list_of_data) -> None:
        if not self.returned:
            self._real.writelines(list_of_data)

    def write_eof(self) -> None:
        if not self.returned:
            self._real.write_eof()

    def can_write_eof(self) -> bool:
        return self._real.can_write_eof()

    def get_write_buffer_size(self) -> int:
        return self._real.get_write_buffer_size()

    def get_write_buffer_limits(self):
        return self._real.get_write_buffer_limits()

    def set_write_buffer_limits(self, high=None, low=None) -> None:
        self._real.set_write_buffer_limits(high, low)

    def is_reading(self) -> bool:
        return self._real.is_reading()

    def pause_reading(self) -> None:
        if self.returned:
            return
        if self._owner is None:
            self._real.pause_reading()
        else:
            self._owner._pause("aiohttp")

    def resume_reading(self) -> None:
        if self.returned:
            return
        if self._owner is None:
            self._real.resume_reading()
        else:
            self._owner._resume("aiohttp")


class HeaderGuard:
    """The middleware and the site for one server (``timeout`` 0: no timer). With ``fast_routes``
    (api/fast_path.py), a connection's plain routing queries are answered by its protocol, within the same
    bounds: the body ``max_body`` bytes, against ``body_budget``, within ``body_timeout``; the connection
    closed after ``idle_timeout`` between requests, or ``write_timeout`` with an answer unread; at the
    end, a query under way on the query threads answered within ``shutdown_timeout``."""

    def __init__(self, timeout: float, max_bytes: int, on_timeout: Callable[[], None] = lambda: None,
                 on_too_large: Callable[[], None] = lambda: None, fast_routes: dict | None = None,
                 max_body: int = 0, body_budget: BodyBudget | None = None, body_timeout: float = 0.0,
                 idle_timeout: float = 0.0, write_timeout: float = 0.0, shutdown_timeout: float = 0.0) -> None:
        self.timeout = timeout
        self.max_bytes = max_bytes
        self.on_timeout = on_timeout
        self.on_too_large = on_too_large
        self.connections: dict = {}  # aiohttp's request handler -> its wrapper
        self.fast_routes = fast_routes or {}
        self.fast_connections: set[HeaderGuardProtocol] = set()  # those no handler of aiohttp's serves
        self.max_body = max_body
        self.body_budget = body_budget
        self.body_timeout = body_timeout
        self.idle_timeout = idle_timeout
        self.write_timeout = write_timeout
        self.shutdown_timeout = shutdown_timeout
        self.refused = ThrottledWarning(log)
        self.stopping = False  # no connection comes back from aiohttp: its shutdown closes them

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        request[ROUTED] = True
        wrapper = self.connections.get(request.protocol)
        if wrapper is None:
            return await handler(request)
        wrapper.request_started()
        try:
            response = await handler(request)
            if wrapper.lent:  # the answer written whole here, so that the connection can come back at once
                try:
                    await response.prepare(request)
                    await response.write_eof()
                except ConnectionError:
                    return response  # (aiohttp's handler finds it so too, and lets the connection go)
                wrapper.answered_by_aiohttp(response.keep_alive)
            return response
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
            return HeaderGuardProtocol(factory, d, d.connections, d.on_timeout)

        self._server = await asyncio.get_running_loop().create_server(
            protocol, self.host, self.requested_port, backlog=self._backlog)
        if self._server.sockets:
            self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """Stops accepting, lets the queries under way on the query threads be answered (within
        ``http.shutdownTimeout``, as aiohttp lets its handlers finish), then closes the connections aiohttp
        does not serve (aiohttp then shuts down its own): a body still coming in parts is not waited for."""
        self.guard.stopping = True
        await super().stop()
        answering = [conn._later for conn in self.guard.fast_connections if conn._later is not None]
        if answering:
            await asyncio.wait(answering, timeout=self.guard.shutdown_timeout or None)
        for conn in tuple(self.guard.fast_connections):
            conn.transport.close()
