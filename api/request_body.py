"""Reading a request body within the API's bounds (size, time, and memory of all bodies together), for
every POST route.

A body that came whole with its headers (the usual) is taken as it is. One that comes in parts is
joined here, and it counts against the app's ``BodyBudget``: ``BODIES_IN_FLIGHT`` of the largest body
(64 MiB at the default 4 MiB), all requests together. A reader reserves its whole ``Content-Length`` (the
largest body where it is chunked) before it reads, so one admitted never waits halfway (readers that each
held what they had read and waited for more filled the budget, and none could finish); past the budget
a reader waits to start, its client slowed by TCP, until others are done, or until ``http.readTimeout``
(408). A review had 200 clients send 4 MiB bodies at once: 950 MB of resident memory.
"""

from __future__ import annotations

import asyncio
import zlib

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

try:  # a deadline on the task itself: wait_for would start a task of its own (20 us a call)
    from asyncio import timeout as within
except ImportError:  # Python 3.10: aiohttp's own dependency there
    from async_timeout import timeout as within


#: Bodies read in parts at once, all requests together, as multiples of the largest body
BODIES_IN_FLIGHT = 16


class BodyBudget:
    """Bytes reserved by request bodies being read in parts, all requests together, at most ``limit`` (one
    body is always let through, whatever its size)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.most = 0  # the most ever held at once
        self.waits = 0  # times a reader waited for room
        self._freed = asyncio.Event()

    async def take(self, n: int) -> None:
        while not self.take_now(n):
            self.waits += 1
            self._freed.clear()
            await self._freed.wait()

    def take_now(self, n: int) -> bool:
        """``take(n)`` where there is room now; False (nothing taken) where it would wait."""
        if self.used and self.used + n > self.limit:
            return False
        self.used += n
        self.most = max(self.most, self.used)
        return True

    def give(self, n: int) -> None:
        self.used -= n
        self._freed.set()


#: The app's budget (``make_app``); an app without one reads bodies unbounded together
BODY_BUDGET = web.AppKey("body_budget", BodyBudget)


class BodyRefused(Exception):
    """The body could not be taken; ``status`` and the message say why (413, 408 or 400)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _too_large(limit: int) -> BodyRefused:
    return BodyRefused(413, f"request body exceeds the limit of {limit} bytes")


async def _read(request: web.Request, limit: int) -> bytes:
    """``request.read()`` without two of its copies (into a bytearray, then into bytes: 20 us for a 240 KB
    body): what arrived is taken as the stream joins it, and joined once more only if it came in parts."""
    parts, size = [], 0
    budget = request.app.get(BODY_BUDGET)
    reserved = 0
    if budget is not None:
        length = request.content_length
        want = limit if length is None or request.headers.get("Content-Encoding") else length
        await budget.take(want)  # (cancelled while it waits: nothing taken)
        reserved = want
    try:
        while chunk := await request.content.readany():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            parts.append(chunk)
        return bytes(parts[0]) if len(parts) == 1 else b"".join(parts)
    finally:
        if reserved:
            budget.give(reserved)


async def read_body(request: web.Request, limit: int, timeout: float | None) -> bytes:
    """The whole body, at most ``limit`` bytes, received within ``timeout`` seconds (None or 0: unbounded);
    BodyRefused otherwise. An empty body is refused too (every route needs one)."""
    length = request.content_length
    if length is not None and length > limit:
        raise BodyRefused(413, f"request body of {length} bytes exceeds the limit of {limit} bytes")
    try:
        if request.content.is_eof():  # all of it came with the headers (the usual): no wait, no deadline
            body = request.content.read_nowait(-1)
            if len(body) > limit:
                raise _too_large(limit)
        else:
            async with within(timeout or None):
                body = await _read(request, limit)
    except asyncio.TimeoutError:
        raise BodyRefused(408, late_body(timeout)) from None
    except (RequestPayloadError, HttpProcessingError, zlib.error) as exc:
        raise BodyRefused(400, f"request body could not be read: {exc}") from None  # e.g. invalid gzip
    if not body.strip():
        raise BodyRefused(400, "empty request body")
    return body


def late_body(timeout: float | None) -> str:
    """What a 408 says."""
    return f"request body not received within {timeout}s"


def closing_unread(request: web.Request, response: web.Response) -> web.Response:
    """``response`` to a request whose body was refused before its end: the connection closes after it.
    Kept open, aiohttp reads the rest of the body on the loop (a lingering close), and inflates it where it
    is compressed: a 4 MiB gzip bomb answered 413 still held the loop for 280 ms. (The server also runs
    with no lingering time: api/server.py.)"""
    if not request.content.at_eof():
        response.force_close()
    return response
