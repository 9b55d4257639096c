"""The routing queries' path past aiohttp: a plain request answered from the connection's bytes.

A routing query (``POST /kv-cache/hit-rate`` or ``/query``) is answered in about 70 us of work (decode,
native hash and walk, the answer's JSON), but through aiohttp it cost the replica 320 us of CPU (its
request and response objects, its task per connection, the middlewares, the body's stream), and on a busy
2-core node about 0.85 ms (bench/RESULTS.md). The connection's protocol (api/header_guard.py) answers
the plain case itself: ``POST`` to one of these paths, HTTP/1.1, one ``Content-Length`` within the body
limit, no ``Transfer-Encoding``, ``Expect``, ``Content-Encoding`` or ``Connection: close``, and a query
the route answers natively (``FastRoute.answer``), on the loop or the query threads. Everything else
(another route, any header this parser does not take, a body that is not valid, the Python path)
goes to aiohttp with the connection's bytes as they came, from the start of that request. Where that
request's head says plainly where it ends (``lendable_end``), aiohttp's handler is lent the connection for
it alone, and the connection comes back here once it is answered: a router's pool that once carried a
readiness check, a registration or a refused query keeps its connections on this path. Otherwise the
connection stays with aiohttp from then on. Both ways give the same answers; tests hold them equal.
"""

from __future__ import annotations

import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from email.utils import formatdate

from aiohttp import web

#: A request line this path takes; its path is then looked up among the fast routes
_REQUEST_LINE = re.compile(rb"POST (/[!$&'()*+,\-./0-9:;=@A-Z_a-z~]*) HTTP/1\.1\r\n")
#: A request line whose request may be lent to aiohttp's handler alone (``lendable_end``)
_LENT_REQUEST_LINE = re.compile(rb"(GET|HEAD|POST|PUT|PATCH|DELETE|OPTIONS) /[!$%&'()*+,\-./0-9:;=?@A-Z_a-z~]* "
                                rb"HTTP/1\.1\r\n")
_BODY_METHODS = frozenset((b"POST", b"PUT", b"PATCH"))
#: Header fields as RFC 9110 allows them (a token, then a value of visible characters, spaces and tabs),
#: each field's name and value (its spaces stripped after); no pattern here backtracks, so each is linear
#: in the head's length
_FIELD = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+:[\t\x20-\x7e\x80-\xff]*\r\n"
_FIELDS = re.compile(rb"(?:%s)*\r\n" % _FIELD)
_FIELD_SPLIT = re.compile(rb"([!#$%&'*+\-.^_`|~0-9A-Za-z]+):([^\r\n]*)\r\n")
#: Headers that change how the body or the connection is read: such a request goes to aiohttp
_NOT_HERE = frozenset((b"transfer-encoding", b"expect", b"content-encoding", b"upgrade", b"sec-websocket-key1"))
#: Headers aiohttp refuses twice in a request (RFC 9110's singletons): such a request goes to it
_SINGLETONS = frozenset((b"content-length", b"content-location", b"content-range", b"content-type", b"etag", b"host",
                         b"max-forwards", b"server", b"transfer-encoding", b"user-agent"))
#: Headers that may ask for the connection's close (llhttp reads Proxy-Connection as Connection)
_CONNECTION = frozenset((b"connection", b"proxy-connection"))
#: More header fields than this: aiohttp's to take or refuse
_MAX_FIELDS = 32
#: The longest head this path takes (a router's is about 200 bytes): a longer one goes to aiohttp
FAST_HEAD_MAX = 4096
#: The largest body this path waits for in parts: a larger one goes to aiohttp (its query would not be
#: answered on the loop anyway: api/app.py, INLINE_BUDGET)
FAST_BODY_MAX = 1 << 20


@dataclass(frozen=True)
class FastRoute:
    """A route's plain case: ``answer(body)`` is the JSON of a 200 answer (or an awaitable of it, from the
    query threads), or None where aiohttp must answer (with no effect before it returns None);
    ``refuse(status, message)`` the JSON of an error in the route's own shape; ``count(status, started)``
    counts a request as the API's middleware does."""

    answer: Callable[[bytes], bytes | Awaitable[bytes | None] | None]
    refuse: Callable[[int, str], bytes]
    count: Callable[[int, float], None]


#: The app's fast routes, by path (set by the API's ``make_app``; none: every request goes to aiohttp)
FAST_ROUTES = web.AppKey("fast_routes", dict)


@dataclass(frozen=True)
class Head:
    """A request's head this path takes: its route, where its body starts and ends in the buffer."""

    route: FastRoute
    path: str
    body_start: int
    body_end: int


def parse_head(buf: bytes, end: int, routes: dict[str, FastRoute], max_body: int) -> Head | None:
    """The head ``buf[:end]`` (``end`` just past its blank line), or None where aiohttp must take the
    request: a head over FAST_HEAD_MAX, a method, path, version or header field this path does not take,
    no ``Content-Length``, no ``Host``, a field aiohttp refuses twice given twice, a body over
    ``max_body``."""
    line = _REQUEST_LINE.match(buf) if end <= FAST_HEAD_MAX else None
    if line is None:
        return None
    route = routes.get(path := line[1].decode("ascii"))
    framing = _framing(buf, line.end(), end) if route is not None else None
    if framing is None:
        return None
    length, has_host = framing
    if length is None or length > min(max_body, FAST_BODY_MAX) or not has_host:
        return None
    return Head(route, path, end, end + length)


def lendable_end(buf: bytes, end: int) -> int | None:
    """Where the request at ``buf``'s start ends, for a head ``buf[:end]`` (``end`` just past its blank line)
    that says so as plainly as a routing query's: an HTTP/1.1 request of a usual method, header fields as
    ``parse_head`` takes them (none that changes how the body is read or asks for the connection's close),
    its body a ``Content-Length`` (or none, for a method that carries none). aiohttp's handler is then lent
    the connection for that request alone (api/header_guard.py). None for any other: aiohttp keeps the
    connection."""
    line = _LENT_REQUEST_LINE.match(buf) if end <= FAST_HEAD_MAX else None
    framing = _framing(buf, line.end(), end) if line is not None else None
    if framing is None or (framing[0] is None and line[1] in _BODY_METHODS):
        return None  # (a body-carrying method with no length: what follows may well be its body)
    return end + (framing[0] or 0)


def _framing(buf: bytes, start: int, end: int) -> tuple[int | None, bool] | None:
    """(its ``Content-Length`` or None, whether it has a ``Host``) of the header fields ``buf[start:end]``
    (the blank line included); None where a field is not as RFC 9110 writes one, they are more than
    _MAX_FIELDS, a singleton comes twice, or one changes how the body or the connection is read."""
    if _FIELDS.fullmatch(buf, start, end) is None:
        return None
    fields = _FIELD_SPLIT.findall(buf, start, end)
    if len(fields) > _MAX_FIELDS:
        return None
    length = None
    seen = set()
    for name, value in fields:
        name, value = name.lower(), value.strip(b" \t")
        if name in _SINGLETONS:
            if name in seen:
                return None
            seen.add(name)
        if name == b"content-length":
            if not value.isdigit() or len(value) > 12:
                return None
            length = int(value)
        elif name in _NOT_HERE or (name in _CONNECTION and b"close" in value.lower()):
            return None
    return length, b"host" in seen


#: What a head this path takes may be while it is coming: a start of ``POST /``, a request line, then
#: whole field lines, then part of one (each pattern linear, as the others)
_LINES = re.compile(rb"(?:%s)*" % _FIELD)
_LINE_TAIL = re.compile(rb"[\t\x20-\x7e\x80-\xff]*\r?")


def could_be_fast(buf: bytes) -> bool:
    """Whether ``buf``, a head not yet whole, may still become one this path takes: where it cannot,
    aiohttp takes it at once (and refuses a bad one at its first bad byte, as without this path)."""
    if not b"POST /".startswith(buf[:6]):
        return False
    line = _REQUEST_LINE.match(buf)
    if line is None:
        return b"\n" not in buf and _LINE_TAIL.fullmatch(buf) is not None
    last = buf.rfind(b"\r\n") + 2
    return _LINES.fullmatch(buf, line.end(), last) is not None and _LINE_TAIL.fullmatch(buf, last) is not None


_STATUS = {200: b"200 OK", 408: b"408 Request Timeout"}
_date: tuple[int, bytes] = (0, b"")


def response(status: int, body: bytes, close: bool = False) -> bytes:
    """An HTTP/1.1 response of a JSON body, with aiohttp's headers for one."""
    global _date
    now = int(time.time())
    if _date[0] != now:
        _date = (now, formatdate(now, usegmt=True).encode("ascii"))
    return b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\nDate: %s\r\n%s\r\n%s" % (
        _STATUS[status], len(body), _date[1], b"Connection: close\r\n" if close else b"", body)
