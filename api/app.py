"""The aiohttp application: ``POST /kv-cache/hit-rate`` (the seed API), ``/query`` and ``/query_by_hash``
(the ecosystem's, api/tiered_query.py), with ``/register``, ``/unregister``, ``/workers``
(api/registration_api.py, added by the replica), ``/healthz``, ``/readyz``, ``/metrics``.

Errors of the seed API use one shape, ``{"status": <HTTP code>, "message": ..., "server_score_list": []}``, with the
same code in the HTTP status: 400 malformed request, 405 wrong method, 408 body not received within
``http.readTimeout``, 413 body over ``http.maxHitRateBodyBytes``, 500 the computation failed. A response
that cannot be written within ``http.writeTimeout`` closes the connection.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial

import msgspec
from aiohttp import web

from cache_indexer.api.explain import Explainer
from cache_indexer.api.fast_path import FAST_ROUTES, FastRoute
from cache_indexer.api.hit_rate_request import HitRateQuery, decode_hit_rate_request, decode_split_request
from cache_indexer.api.json_request import RequestError
from cache_indexer.api.ops import add_ops_routes
from cache_indexer.api.request_body import (BODIES_IN_FLIGHT, BODY_BUDGET, BodyBudget, BodyRefused, closing_unread,
                                           read_body)
from cache_indexer.api.request_body import within as _within
from cache_indexer.api.registration_api import REGISTER_PATH, UNREGISTER_PATH, WORKERS_PATH
from cache_indexer.api.tiered_query import QUERY_BY_HASH_PATH, QUERY_PATH, TieredQueryApi, query_error_body
from cache_indexer.infra.registrations import RegistrationStore
from cache_indexer.infra.streams import RecordsKv
from cache_indexer.infra.metrics import Metrics
from cache_indexer.infra.throttled_log import ThrottledWarning
from cache_indexer.schemas.block_hash import BlockHasher, find_token_ids
from cache_indexer.indexer.hit_rate import (KeptCandidates, NativeQuery, ScoreResult, Tier, configure_native_query,
                                            score)
from cache_indexer.indexer.query_threads import QueryThreads
from cache_indexer.schemas.config import HttpConfig

try:  # the seed API's answer in one native pass (api/_answer_json.c); without it, the Python path below
    from cache_indexer.api import _answer_json
except ImportError:  # pragma: no cover - no C compiler at install time
    _answer_json = None

log = logging.getLogger(__name__)

HIT_RATE_PATH = "/kv-cache/hit-rate"
_KNOWN_PATHS = {HIT_RATE_PATH, QUERY_PATH, QUERY_BY_HASH_PATH, REGISTER_PATH, UNREGISTER_PATH, WORKERS_PATH,
                "/healthz", "/readyz", "/metrics"}
UNKNOWN_POD_MESSAGE = "no KV-cache events seen for this server"
#: The longest one query's native call may hold the event loop: a request whose worst case (``inline_cost``)
#: fits is answered on the loop, a larger one on the query threads while the loop goes on serving I/O. A
#: hand-off costs more than the work it moves for most routing queries (about 60 us of CPU and two
#: wake-ups, each a wait for a core on a busy node; a 12k-token prompt's call is 40-190 us), and a bound
#: in time, not bytes, holds for every block size. Half the ingest's turn (infra/loop_turns.TURN). (Deciding
#: by load instead does not work: a body that arrived whole is answered without the handler ever yielding,
#: so the loop never sees the requests queued behind it.)
INLINE_BUDGET = 0.001
#: The native call's worst case, measured (``python -m bench.query_trace --calibrate``, AMD EPYC 2-core
#: VM): every token parsed and hashed, up to 3.0 ns a byte of its JSON (one-digit tokens, the most per
#: byte), and every block hashed and looked up, up to 130 ns a block over its tokens' share (block size 1;
#: more where the machine is busy), and 7-10 ns a block more for each further index chunk (64 workers) its
#: candidates are in. With margin: a 70 kB body of 16-bit tokens at block size 16 is bounded at 0.6 ms,
#: measured 0.18 ms; at block size 1, 6.0 ms (1.0-1.4 ms measured); over 64 chunks (4,096 workers all
#: candidates) at block size 16, 4.7 ms (0.6 ms measured, a small index: more cache misses in a large one).
_NS_PER_BYTE = 3.5
_NS_PER_BLOCK = 160.0
_NS_PER_BLOCK_CHUNK = 30.0


def inline_cost(size: int, block_size: int, chunks: int = 1) -> float:
    """Seconds the native call of a ``size``-byte body takes at most: its tokens (2 bytes of JSON each at
    least: at most ``size / 2``, so ``size / (2 * block_size)`` blocks) all parsed, hashed and looked up in
    each of ``chunks`` index chunks."""
    per_block = _NS_PER_BLOCK + _NS_PER_BLOCK_CHUNK * (max(1, chunks) - 1)
    return size * (_NS_PER_BYTE + per_block / (2 * max(1, block_size))) * 1e-9


def _error_body(status: int, message: str) -> bytes:
    return msgspec.json.encode({"status": status, "message": message, "server_score_list": []})


def _error(status: int, message: str, **headers: str) -> web.Response:
    return web.Response(body=_error_body(status, message), status=status, content_type="application/json",
                        headers=headers or None)


class HitRateApi:
    """Binds the HTTP layer to a hasher and the tier indexes (L1, L3) of one replica."""

    def __init__(self, http: HttpConfig, hasher: BlockHasher, tiers: Callable[[], Sequence[Tier | None]],
                 ready: Callable[[], bool], metrics: Metrics, block_size: int = 16,
                 registrations: Callable[[], RegistrationStore | None] = lambda: None,
                 more_routes: Sequence = (), records: Callable[[], RecordsKv | None] = lambda: None) -> None:
        """``block_size``: the engines' (``blockKey.blockSize``), for /query requests that give none;
        ``registrations``: the registered engines (/query answers them for their model only);
        ``more_routes``: other route sets (``add_routes(app)``), e.g. the registration API; ``records``:
        the records bucket (the bridge's), which ``explain`` reads."""
        self.http = http
        self.hasher = hasher
        self.tiers = tiers
        self.ready = ready
        self.metrics = metrics
        #: Native queries run here, one thread per core, while the loop goes on serving I/O
        self._query_threads: QueryThreads | None = None
        self._by_path_status: dict[tuple[str, int], tuple] = {}  # the request metrics' children
        self._candidates = KeptCandidates()  # the candidates' workers, while the router names the same ones
        self._best_l1 = metrics.best_hit_ratio.labels("l1")
        self._best_l3 = metrics.best_hit_ratio.labels("l3")
        configure_native_query(http.digestMemoBytes)
        self.tiered = TieredQueryApi(http, hasher, block_size, tiers, registrations, self._run_native,
                                     self._fits_inline)
        self.more_routes = list(more_routes)
        self.explainer = Explainer(hasher, records)
        self._refused = ThrottledWarning(log)  # counted per status by the middleware; logged here

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=self.http.maxHitRateBodyBytes,
                              middlewares=[self._observe])
        app[BODY_BUDGET] = BodyBudget(BODIES_IN_FLIGHT * self.http.maxHitRateBodyBytes)
        app[FAST_ROUTES] = {
            HIT_RATE_PATH: FastRoute(self.answer_now, _error_body, partial(self._count_path, HIT_RATE_PATH)),
            QUERY_PATH: FastRoute(self.tiered.answer_now, query_error_body, partial(self._count_path, QUERY_PATH))}
        app.on_cleanup.append(self._close_pool)
        app.router.add_route("*", HIT_RATE_PATH, self.hit_rate, expect_handler=self._expect)
        self.tiered.add_routes(app)
        for routes in self.more_routes:
            routes.add_routes(app)
        add_ops_routes(app, self.metrics, self.ready, "catching up with the event streams")
        return app

    @web.middleware
    async def _observe(self, request: web.Request, handler) -> web.StreamResponse:
        start = time.perf_counter()
        status = 500
        try:
            resp = await handler(request)
            status = resp.status
            if isinstance(resp, web.Response) and self.http.writeTimeout:
                try:
                    async with _within(self.http.writeTimeout):
                        await resp.prepare(request)
                        await resp.write_eof()
                except asyncio.TimeoutError:
                    log.warning("response to %s not written within %ss; closing", request.remote, self.http.writeTimeout)
                    if request.transport is not None:
                        request.transport.abort()  # (a close would wait for the client to read what is buffered)
            return resp
        except web.HTTPException as exc:
            status = exc.status
            if request.path == HIT_RATE_PATH:
                return _error(exc.status, exc.reason)
            raise
        finally:
            self._count(request, status, start)

    def _count(self, request: web.Request, status: int, start: float) -> None:
        self._count_path(request.path if request.path in _KNOWN_PATHS else "other", status, start)

    def _count_path(self, path: str, status: int, start: float) -> None:
        counted = self._by_path_status.get((path, status))
        if counted is None:  # a few paths times a few codes: kept, as labels() costs 5 us a call
            counted = self._by_path_status[(path, status)] = (
                self.metrics.http_requests.labels(path, str(status)),
                self.metrics.http_latency.labels(path, str(status)))
        counted[0].inc()
        counted[1].observe(time.perf_counter() - start)

    def _observe_answer(self, scores) -> None:
        best_l1 = best_l3 = 0.0
        unknown = 0
        for s in scores:
            best_l1 = max(best_l1, s.ratios[0])
            best_l3 = max(best_l3, s.ratios[1])
            unknown += not s.known
        self._observe_best(best_l1, best_l3, unknown)

    def _observe_best(self, best_l1: float, best_l3: float, unknown: int) -> None:
        self._best_l1.observe(best_l1)
        self._best_l3.observe(best_l3)
        if unknown:
            self.metrics.unknown_candidates.inc(unknown)

    def _threads(self) -> QueryThreads:
        if self._query_threads is None:
            threads = self.http.queryThreads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                                 else os.cpu_count())
            self._query_threads = QueryThreads(min(threads or 2, 1024))
        return self._query_threads

    def _decode(self, body: bytes) -> HitRateQuery:
        """The envelope is decoded here; the token array, where the accelerator finds it (one scan: a few
        microseconds for a 240 KB body), stays JSON text for the native query to parse without the GIL."""
        span = find_token_ids(body) if find_token_ids is not None else None
        return (decode_split_request(body, span, self.http.maxCandidates) if span is not None
                else decode_hit_rate_request(body, self.http.maxCandidates))

    def _prepare(self, req: HitRateQuery, tiers: Sequence[Tier | None]) -> NativeQuery | None:
        """The request's native query; None where only ``score`` answers it (LoRA or multimodal: extra keys
        on every block, hashed in Python; the Python index or hasher)."""
        if req.lora is not None or req.mm_features:
            return None
        try:
            return NativeQuery.prepare(self.hasher, req.token_json, req.block_size, req.cache_salt, req.server_ip, tiers,
                                       kept=self._candidates)
        except ValueError as exc:
            raise RequestError(f"body.token_ids: {exc}") from None

    async def _score(self, req: HitRateQuery, size: int) -> ScoreResult:
        """Where the native query covers the request: on the loop where its worst case fits INLINE_BUDGET,
        else on the query threads. Otherwise here, in Python (``score``)."""
        tiers = self.tiers()
        query = self._prepare(req, tiers)
        if query is not None:
            try:
                return query.result(await self._run_native(query, size))
            except NotImplementedError:
                pass  # a pickle token over 2**31-1: only score() encodes it
            except ValueError as exc:
                raise RequestError(f"body.token_ids: {exc}") from None
        return score(self.hasher, req.tokens(), req.block_size, req.cache_salt, req.server_ip, tiers, req.lora,
                     req.mm_features)

    async def _run_native(self, query: NativeQuery, size: int) -> tuple:
        """A native query of a ``size``-byte body: on the loop where its worst case fits INLINE_BUDGET, else
        on the query threads."""
        if self._fits_inline(query, size):
            return query.run()
        return await self._threads().run(query)

    @staticmethod
    def _fits_inline(query: NativeQuery, size: int) -> bool:
        return inline_cost(size, query.block_size, query.chunks) <= INLINE_BUDGET

    async def _close_pool(self, app: web.Application) -> None:
        if self._query_threads is not None:
            self._query_threads.close()
            self._query_threads = None

    def _too_large(self, request: web.Request) -> web.Response | None:
        length, limit = request.content_length, self.http.maxHitRateBodyBytes
        if length is not None and length > limit:
            return _error(413, f"request body of {length} bytes exceeds the limit of {limit} bytes")
        return None

    async def _expect(self, request: web.Request) -> web.Response | None:
        """``Expect: 100-continue``: refuse an oversized or non-POST body before the client sends it. A
        refusal here is counted here: aiohttp answers it without the middleware."""
        start = time.perf_counter()
        if request.headers.get("Expect", "").lower() != "100-continue":
            self._count(request, 417, start)
            return _error(417, f"unsupported Expect: {request.headers.get('Expect')}")
        refusal = (_error(405, f"method {request.method} not allowed; use POST", Allow="POST")
                   if request.method != "POST" else self._too_large(request))
        if refusal is not None:
            refusal.force_close()  # the body was never sent: the connection cannot carry another request
            self._refused("%s %s from %s refused (%d) before its body: %s", request.method, request.path,
                          request.remote, refusal.status, refusal.text)
            self._count(request, refusal.status, start)
            return refusal
        if request.version >= (1, 1):
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0
        return None

    async def hit_rate(self, request: web.Request) -> web.Response:
        if request.method != "POST":
            return _error(405, f"method {request.method} not allowed; use POST", Allow="POST")
        try:
            body = await read_body(request, self.http.maxHitRateBodyBytes, self.http.readTimeout)
        except BodyRefused as exc:
            self._refused("%s %s from %s refused (%d): %s", request.method, request.path, request.remote, exc.status, exc)
            return closing_unread(request, _error(exc.status, str(exc)))
        try:
            req = self._decode(body)
            result = await self._score(req, len(body))
            explained = await self.explainer.explain(req, result, self.tiers()[0]) if req.explain else None
        except RequestError as exc:
            self._refused("%s %s from %s refused (400): %s", request.method, request.path, request.remote, exc)
            return _error(400, str(exc))
        except Exception as exc:
            log.exception("hit-rate computation failed")
            return _error(500, f"hit-rate computation failed: {exc}")
        return web.Response(body=self._answer_body(result, explained), content_type="application/json")

    def answer_now(self, body: bytes) -> bytes | Awaitable[bytes | None] | None:
        """The answer's JSON where the native query answers it (api/fast_path.py): at once on the loop, or
        awaited from the query threads; None, with no effect, where ``hit_rate`` must (an error, an
        explanation, the Python path)."""
        try:
            req = self._decode(body)
            if req.explain:
                return None
            query = self._prepare(req, self.tiers())
            if query is None:
                return None
            if not self._fits_inline(query, len(body)):
                return self._answer_later(query)
            out = query.run()
        except (RequestError, ValueError, NotImplementedError):
            return None
        return self._native_answer(query, out)

    async def _answer_later(self, query: NativeQuery) -> bytes | None:
        try:
            out = await self._threads().run(query)
        except (ValueError, NotImplementedError):
            return None
        return self._native_answer(query, out)

    def _native_answer(self, query: NativeQuery, out: tuple[int, int, list[list[int]]]) -> bytes:
        """The answer to a native query's lengths: in one native pass where the accelerator is built (the
        same JSON values as ``_answer_body``), else through ``result``."""
        if _answer_json is not None:
            try:
                body, best_l1, best_l3, unknown = _answer_json.seed_answer(
                    query.workers.pods, query.workers.slots, out[2], out[0] // query.block_size, query.knows,
                    UNKNOWN_POD_MESSAGE)
            except (TypeError, ValueError, OverflowError):  # (not two tiers; a name msgspec refuses too)
                pass
            else:
                self.metrics.hashed_blocks.inc(out[1])
                self._observe_best(best_l1, best_l3, unknown)
                return body
        return self._answer_body(query.result(out), None)

    def _answer_body(self, result: ScoreResult, explained) -> bytes:
        self.metrics.hashed_blocks.inc(result.hashed_blocks)
        items = [{"server_ip": s.pod, "l1_hit_ratio": s.ratios[0], "l3_hit_ratio": s.ratios[1],
                  "message": "" if s.known else UNKNOWN_POD_MESSAGE, "status": 0} for s in result.scores]
        for item, why in zip(items, explained or ()):
            item["explain"] = why
        self._observe_answer(result.scores)
        return msgspec.json.encode({"status": 0, "message": "", "server_score_list": items})
