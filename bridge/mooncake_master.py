"""HTTP client of a Mooncake Master's admin port, across the response formats of 0.3.7 .. 0.3.13+.

- ``/get_all_keys``, ``/get_all_segments``: text, one item per line.
- replica locations: ``/batch_query_keys?keys=`` (>= 0.3.12: read-only, URL-decoded, JSON) in
  batches; masters without it (404) fall back to ``/query_key?key=`` per key (raw key, JSON on
  >= 0.3.12, NDJSON text before). ``/query_key`` grants a read lease on the object, so it is only
  used where nothing else exists, and only for keys new since the last poll.
Only the host part of ``transport_endpoint_`` is kept: it is the pod IP of the holder.

Only what a master sends is accepted: no redirects are followed, listings must be ``text/plain`` that
decodes as UTF-8, JSON must parse (however deep), and no answer may exceed ``ingest.l3.maxResponseBytes``
(read in chunks, so a huge or endless body costs at most that much). Anything else is a MasterError:
counted, and the previous state stands; a proxy's HTML error page never reads as an empty store.
Large listings are decoded and split in a worker thread, off the event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
from urllib.parse import quote

import aiohttp
from yarl import URL

log = logging.getLogger(__name__)


class MasterError(RuntimeError):
    """The master answered something this client cannot use (counted; the previous state is kept)."""


def endpoint_host(endpoint: str) -> str:
    if endpoint.startswith("["):
        return endpoint[1:endpoint.index("]")]
    return endpoint.split(":", 1)[0]


def _hosts(descriptors) -> set[str]:
    out = set()
    for d in descriptors or []:
        ep = d.get("transport_endpoint_") if isinstance(d, dict) else None
        if isinstance(ep, str) and ep:
            out.add(endpoint_host(ep))
    return out


#: Bodies larger than this are decoded and split off the event loop.
_OFF_LOOP_BYTES = 1 << 20


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


def parse_lines(path: str, content_type: str, body: bytes) -> list[str]:
    """A listing: text/plain, UTF-8, one item per line (an empty body is an empty store)."""
    if not content_type.startswith("text/plain"):
        raise MasterError(f"{path}: not a master's listing (Content-Type {content_type or 'missing'!r})")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MasterError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if "\x00" in text:
        raise MasterError(f"{path}: binary body")
    return [line for line in text.split("\n") if line]


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
        self.sem = asyncio.Semaphore(concurrency)
        self.batch_supported: bool | None = None

    async def _get(self, path: str, timeout: aiohttp.ClientTimeout | None = None) -> tuple[int, str, bytes]:
        async with self.sem:
            async with self.session.get(URL(self.base + path, encoded=True), timeout=timeout or self.timeout,
                                        allow_redirects=False) as r:
                if 300 <= r.status < 400:
                    raise MasterError(f"{path.split('?')[0]}: HTTP {r.status} redirect to "
                                      f"{r.headers.get('Location', '?')!r} (a master does not redirect)")
                if (r.content_length or 0) > self.max_bytes:
                    raise MasterError(f"{path.split('?')[0]}: answer of {r.content_length} bytes is over "
                                      f"ingest.l3.maxResponseBytes ({self.max_bytes})")
                body = bytearray()
                async for chunk in r.content.iter_chunked(1 << 16):
                    body += chunk
                    if len(body) > self.max_bytes:
                        raise MasterError(f"{path.split('?')[0]}: answer over ingest.l3.maxResponseBytes "
                                          f"({self.max_bytes} bytes)")
                return r.status, r.headers.get("Content-Type", ""), bytes(body)

    async def _lines(self, path: str, timeout: aiohttp.ClientTimeout | None = None) -> list[str]:
        status, ctype, body = await self._get(path, timeout)
        if status != 200:
            raise MasterError(f"{path}: HTTP {status}")
        if len(body) > _OFF_LOOP_BYTES:
            return await asyncio.to_thread(parse_lines, path, ctype, body)
        return parse_lines(path, ctype, body)

    async def all_keys(self) -> list[str]:
        return await self._lines("/get_all_keys")

    async def segments(self) -> list[str]:
        return await self._lines("/get_all_segments", self.segments_timeout)

    async def locate(self, keys: list[str]) -> dict[str, set[str] | None]:
        """Hosts of each key's memory replicas (None: the key is gone)."""
        out: dict[str, set[str] | None] = {}
        if not keys:
            return out
        if self.batch_supported is not False:
            plain = [k for k in keys if "," not in k]
            batches = [plain[i:i + self.batch_keys] for i in range(0, len(plain), self.batch_keys)]
            results = await asyncio.gather(*(self._batch(b) for b in batches))
            if self.batch_supported is not False:
                for r in results:
                    out.update(r)
                keys = [k for k in keys if "," in k]  # cannot be asked for in a batch
        if keys:
            if self.batch_supported is False:
                log.debug("%s: /batch_query_keys not available; using /query_key (grants read leases)", self.base)
            found = await asyncio.gather(*(self._one(k) for k in keys))
            out.update(zip(keys, found))
        return out

    async def _batch(self, keys: list[str]) -> dict[str, set[str] | None]:
        status, _, body = await self._get("/batch_query_keys?keys=" + ",".join(quote(k, safe="") for k in keys))
        if status == 404 and body.strip() in (b"404 Not Found", b""):
            if self.batch_supported is None:
                log.warning("%s: master has no /batch_query_keys (< 0.3.9); falling back to /query_key, which "
                            "grants read leases", self.base)
            self.batch_supported = False
            return {}
        if status != 200:
            raise MasterError(f"batch_query_keys: HTTP {status}")
        result = parse_batch_query(body)
        if keys and not any(k in result for k in keys):
            # 0.3.9 - 0.3.11 do not URL-decode (they echo our encoded keys) and grant leases anyway
            if self.batch_supported is None:
                log.warning("%s: /batch_query_keys does not decode keys (master < 0.3.12); using /query_key, "
                            "which grants read leases", self.base)
            self.batch_supported = False
            return {}
        self.batch_supported = True
        return {k: result[k] for k in keys if k in result}  # an answer for a key not asked about is ignored

    async def _one(self, key: str) -> set[str] | None:
        status, ctype, body = await self._get("/query_key?key=" + key)
        return parse_query_key(status, ctype, body)
