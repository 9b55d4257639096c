"""HTTP client of a Mooncake Master's admin port, across the response formats of 0.3.7 .. 0.3.13+.

- ``/get_all_keys``, ``/get_all_segments``: text, one item per line.
- replica locations: ``/batch_query_keys?keys=`` (>= 0.3.12: read-only, URL-decoded, JSON) in
  batches; masters shown not to have it fall back to ``/query_key?key=`` per key (raw key, JSON on
  >= 0.3.12, NDJSON text before). ``/query_key`` grants a read lease on the object, so it is only
  used where nothing else exists.
Only the host part of ``transport_endpoint_`` is kept: it is the pod IP of the holder.

Only what a master sends is accepted: no redirects are followed, listings must be ``text/plain`` that
decodes as UTF-8, JSON must parse (however deep), and no answer may exceed ``ingest.l3.maxResponseBytes``
(read in chunks, so a huge or endless body costs at most that much). Anything else is a MasterError:
counted, and the previous state stands; a proxy's HTML error page never reads as an empty store.
Listings are decoded and split chunk by chunk as they arrive, so no large body holds the event loop.

One odd answer of ``/batch_query_keys`` (a 404, an answer about none of the keys asked) does not switch
to the leasing ``/query_key``: a probe with one listed key decides, the switch is logged at WARNING
(either way) and the endpoint is probed again every ``REPROBE_SECONDS``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
import time
from collections.abc import Callable
from urllib.parse import quote

import aiohttp
from yarl import URL

from cache_indexer.infra.pauser import REST_SECONDS, Pauser
from cache_indexer.infra.throttled_log import ThrottledWarning

log = logging.getLogger(__name__)


class MasterError(RuntimeError):
    """The master answered something this client cannot use (counted; the previous state is kept)."""


#: the host of a segment or replica endpoint: a DNS name or IPv4 address, or (bracketed) an IPv6 one
_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")
_IPV6 = re.compile(r"[0-9A-Fa-f:.]{2,45}(%[A-Za-z0-9._-]{1,64})?")
_malformed = ThrottledWarning(log)


def endpoint_host(endpoint: str) -> str | None:
    """The host of a master's ``host:port`` or ``[v6]:port``; None (logged, throttled) where it names none:
    a line the master should not have sent is left out, never the poll's end (an unclosed bracket failed
    every poll of its master), nor another pod's (the poller joins hosts with commas)."""
    if endpoint.startswith("["):
        end = endpoint.find("]")
        host = endpoint[1:end] if end > 0 else ""
        ok = _IPV6.fullmatch(host) is not None
    else:
        host = endpoint.split(":", 1)[0]
        ok = _HOST.fullmatch(host) is not None
    if not ok:
        _malformed("mooncake master: endpoint %r names no host; left out", endpoint[:200])
        return None
    return host


def _hosts(descriptors) -> set[str]:
    out = set()
    for d in descriptors or []:
        ep = d.get("transport_endpoint_") if isinstance(d, dict) else None
        if isinstance(ep, str) and ep and (host := endpoint_host(ep)) is not None:
            out.add(host)
    return out


@functools.lru_cache(maxsize=4096)
def _quoted_head(head: str) -> str:
    return quote(head, safe="")


def quote_key(key: str) -> str:
    """``urllib.parse.quote(key, safe="")``, fast for the block keys of every grammar: they end in
    ``@<hex hash>`` after a head that few keys do not share, so the head's quoting is cached. quote()
    itself cost 15 us a key: 1.5 s of a 100k-key first poll, in pieces long enough to delay the API."""
    head, sep, tail = key.rpartition("@")
    if tail.isascii() and tail.isalnum():
        return _quoted_head(head) + "%40" + tail if sep else tail
    return quote(key, safe="")


def parse_query_key(status: int, content_type: str, body: bytes) -> set[str] | None:
    """Hosts holding the key, None when the key does not exist; raises MasterError otherwise."""
    if status == 404:
        return None
    if status != 200:
        raise MasterError(f"query_key: HTTP {status}")
    text = body.decode("utf-8", "replace")
    try:
        if content_type.startswith("application/json"):
            doc = json.loads(text)
            if not doc.get("success"):
                return None
            return _hosts(doc.get("data"))
        return _hosts([json.loads(line) for line in text.splitlines() if line.strip()])
    except (ValueError, AttributeError, RecursionError) as exc:
        raise MasterError(f"query_key: malformed body: {type(exc).__name__}: {exc}") from None


def parse_batch_query(body: bytes) -> dict[str, set[str] | None]:
    try:
        doc = json.loads(body)
        data = doc["data"]
        return {k: (_hosts(v.get("values")) if v.get("ok") else None) for k, v in data.items()}
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise MasterError(f"batch_query_keys: malformed body: {type(exc).__name__}: {exc}") from None


class LineReader:
    """A listing read as it streams in: text/plain, UTF-8, one item per line (an empty body is an empty
    store), handed to ``consume`` a chunk at a time (or collected into a set). A 45 MB listing never
    holds the event loop for longer than one chunk's work, and is never held whole."""

    def __init__(self, path: str, content_type: str, consume: Callable[[list[str]], None] | None = None) -> None:
        if not content_type.startswith("text/plain"):
            raise MasterError(f"{path}: not a master's listing (Content-Type {content_type or 'missing'!r})")
        self.path = path
        self.lines: set[str] = set()
        self._consume = consume or self.lines.update
        self._rest = b""
        self._offset = 0

    def feed(self, chunk: bytes) -> None:
        data = self._rest + chunk
        cut = data.rfind(b"\n") + 1  # a UTF-8 character never spans a newline byte
        self._rest = data[cut:]
        if cut:
            self._take(data[:cut])

    def close(self) -> set[str]:
        if self._rest:
            self._take(self._rest)
            self._rest = b""
        return self.lines

    def _take(self, data: bytes) -> None:
        if b"\x00" in data:
            raise MasterError(f"{self.path}: binary body")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise MasterError(f"{self.path}: not UTF-8 text ({exc.reason} at byte {self._offset + exc.start})") from None
        self._offset += len(data)
        lines = text.split("\n")
        if lines[-1] == "":
            lines.pop()
        if "" in lines:  # blank lines: never from a master, but not keys either
            lines = [line for line in lines if line]
        self._consume(lines)


#: How long a master shown to lack a usable /batch_query_keys is asked per key before a new probe.
REPROBE_SECONDS = 300.0


class _OddAnswer(Exception):
    """/batch_query_keys answered in a way that may mean it is not supported: a probe decides."""

    def __init__(self, key: str, why: str) -> None:
        super().__init__(why)
        self.key, self.why = key, why


class MasterClient:
    def __init__(self, base_url: str, session: aiohttp.ClientSession, timeout: float, batch_keys: int = 500,
                 concurrency: int = 4, segments_timeout: float | None = None, max_bytes: int = 64 << 20) -> None:
        self.max_bytes = max_bytes
        self.base = base_url.rstrip("/")
        self.session = session
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        #: discovery.segmentsFetchTimeout: the segment list is small, so a master slow to give it is unwell
        self.segments_timeout = aiohttp.ClientTimeout(total=segments_timeout) if segments_timeout else self.timeout
        self.batch_keys = batch_keys
        self.concurrency = concurrency
        self.sem = asyncio.Semaphore(concurrency)
        self._parsing = asyncio.Lock()
        #: None until the first answer; False only once a probe showed the endpoint unusable
        self.batch_supported: bool | None = None
        self._reprobe_at = 0.0

    async def _get(self, path: str, timeout: aiohttp.ClientTimeout | None = None, lines: bool = False,
                   consume: Callable[[list[str]], None] | None = None) -> tuple[int, str, bytes | set[str]]:
        """(status, content type, body); with ``lines``, a 200 body is a listing, parsed as it streams in
        (and handed to ``consume`` a chunk at a time, when given)."""
        name = path.split("?")[0]
        async with self.sem:
            async with self.session.get(URL(self.base + path, encoded=True), timeout=timeout or self.timeout,
                                        allow_redirects=False) as r:
                if 300 <= r.status < 400:
                    raise MasterError(f"{name}: HTTP {r.status} redirect to {r.headers.get('Location', '?')!r} "
                                      "(a master does not redirect)")
                if (r.content_length or 0) > self.max_bytes:
                    raise MasterError(f"{name}: answer of {r.content_length} bytes is over "
                                      f"ingest.l3.maxResponseBytes ({self.max_bytes})")
                ctype = r.headers.get("Content-Type", "")
                reader = LineReader(name, ctype, consume) if lines and r.status == 200 else None
                body = bytearray()
                size = 0
                pause = Pauser()
                async for chunk in r.content.iter_chunked(1 << 14):
                    await pause()  # buffered data is read without suspending
                    size += len(chunk)
                    if size > self.max_bytes:
                        raise MasterError(f"{name}: answer over ingest.l3.maxResponseBytes ({self.max_bytes} bytes)")
                    if reader:
                        reader.feed(chunk)
                    else:
                        body += chunk
                return r.status, ctype, reader.close() if reader else bytes(body)

    async def _lines(self, path: str, timeout: aiohttp.ClientTimeout | None = None,
                     consume: Callable[[list[str]], None] | None = None) -> set[str]:
        status, _, lines = await self._get(path, timeout, lines=True, consume=consume)
        if status != 200:
            raise MasterError(f"{path}: HTTP {status}")
        return lines

    async def all_keys(self, consume: Callable[[list[str]], None]) -> None:
        """The keys, handed to ``consume`` a chunk at a time as the listing streams in."""
        await self._lines("/get_all_keys", consume=consume)

    async def segments(self) -> set[str]:
        return await self._lines("/get_all_segments", self.segments_timeout)

    async def locate(self, keys: list[str]) -> dict[str, set[str] | None]:
        """Hosts of each key's memory replicas (None: the key is gone). With /batch_query_keys, keys that
        contain "," are left out of the answer: the master splits its (decoded) value on ",", so they
        cannot be asked for, and asking /query_key instead would lease them."""
        if not keys:
            return {}
        if self.batch_supported is False and time.monotonic() >= self._reprobe_at:
            await self._probe(keys[0])
        if self.batch_supported is not False:
            plain = [k for k in keys if "," not in k]
            batches = [plain[i:i + self.batch_keys] for i in range(0, len(plain), self.batch_keys)]
            results = await self._bounded(self._batch, batches)
            odd = next((r for r in results if isinstance(r, _OddAnswer)), None)
            failed = next((r for r in results if isinstance(r, BaseException) and not isinstance(r, _OddAnswer)), None)
            if failed is not None:
                raise failed
            if odd is None:
                out: dict[str, set[str] | None] = {}
                for r in results:
                    out.update(r)
                return out
            if await self._probe(odd.key):
                raise MasterError(f"batch_query_keys: {odd.why}, but a probe shows the endpoint works; "
                                  "the next poll asks again")
        found = await self._bounded(self._one, keys)
        for r in found:
            if isinstance(r, BaseException):
                raise r
        return dict(zip(keys, found))

    async def _bounded(self, fn, items: list) -> list:
        """``fn`` over ``items`` by ``concurrency`` workers, results (or exceptions) in order. Not one task
        per item: hundreds of ready tasks would each do their CPU work in one turn of the event loop."""
        results: list = [None] * len(items)
        it = iter(range(len(items)))

        async def worker() -> None:
            for i in it:
                try:
                    results[i] = await fn(items[i])
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    results[i] = exc
        await asyncio.gather(*(worker() for _ in range(min(self.concurrency, len(items)))))
        return results

    async def _batch(self, keys: list[str]) -> dict[str, set[str] | None]:
        status, _, body = await self._get("/batch_query_keys?keys=" + ",".join(map(quote_key, keys)))
        if status == 404:
            raise _OddAnswer(keys[0], "HTTP 404")
        if status != 200:
            raise MasterError(f"batch_query_keys: HTTP {status}")
        async with self._parsing:  # one answer parsed at a time, then a rest for the loop's other work
            result = parse_batch_query(body)
            await asyncio.sleep(REST_SECONDS)
        if not any(k in result for k in keys):
            raise _OddAnswer(keys[0], f"an answer about none of the {len(keys)} keys asked")
        self.batch_supported = True
        return {k: result[k] for k in keys if k in result}  # an answer for a key not asked about is ignored

    async def _probe(self, key: str) -> bool:
        """Whether /batch_query_keys can be used, from one listed key: a 404 (master < 0.3.9) or an echo of
        the percent-encoded key (0.3.9 - 0.3.11: no decoding, and leases granted) says no; an answer
        about the key says yes. Anything else decides nothing (MasterError: the poll fails, the mode stays)."""
        status, _, body = await self._get("/batch_query_keys?keys=" + quote_key(key))
        if status == 404:
            return self._set_mode(False, "HTTP 404 on a probe with a listed key (master < 0.3.9)")
        if status != 200:
            raise MasterError(f"batch_query_keys probe: HTTP {status}")
        result = parse_batch_query(body)
        if key in result:
            return self._set_mode(True, "a probe with a listed key was answered")
        if quote_key(key) in result:
            return self._set_mode(False, "it does not decode keys (master < 0.3.12, whose batch grants leases)")
        raise MasterError("batch_query_keys probe: an answer about another key; the mode stays as it is")

    def _set_mode(self, supported: bool, why: str) -> bool:
        if not supported:
            self._reprobe_at = time.monotonic() + REPROBE_SECONDS
        if supported != self.batch_supported and (self.batch_supported is not None or not supported):
            if supported:
                log.warning("%s: /batch_query_keys works again (%s); keys are located read-only", self.base, why)
            else:
                log.warning("%s: /batch_query_keys cannot be used (%s); locating keys with /query_key, which "
                            "grants read leases; probing again in %.0f s", self.base, why, REPROBE_SECONDS)
        self.batch_supported = supported
        return supported

    async def _one(self, key: str) -> set[str] | None:
        status, ctype, body = await self._get("/query_key?key=" + key)
        return parse_query_key(status, ctype, body)
