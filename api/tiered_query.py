"""``POST /query`` and ``POST /query_by_hash``: the ecosystem's indexer API (schemas/tiered_api.py), per
instance and DP rank, in tokens, by tier.

Errors as Dynamo's standalone indexer gives them: ``{"error": ...}``, 400 for a body that is not JSON or
asks something impossible, 422 for JSON that does not fit the contract, 413 over
``http.maxHitRateBodyBytes``, 408 not received within ``http.readTimeout``, 500 (logged) where the
computation failed. Decoding is msgspec (the
pydantic models generate the OpenAPI document; a test holds the two alike).
"""

from __future__ import annotations

import asyncio
import logging
from array import array
from collections.abc import Awaitable, Callable, Iterator, Sequence
from itertools import islice
from typing import Annotated

import msgspec
from aiohttp import web

from cache_indexer.api.json_request import RequestError, UnprocessableRequest, cut_token_array, decode_json, token_array
from cache_indexer.api.request_body import BodyRefused, closing_unread, read_body
from cache_indexer.indexer.hit_rate import Tier
from cache_indexer.indexer.hit_rate import NativeQuery
from cache_indexer.indexer.tier_match import KeyWalk, NativeTierQuery, TierMatch, chain_keys
from cache_indexer.infra.registrations import RegistrationStore
from cache_indexer.infra.throttled_log import ThrottledWarning
from cache_indexer.schemas.api import MAX_MM_FEATURES, MAX_NAME_CHARS
from cache_indexer.schemas.events import MAX_BLOCK_SIZE
from cache_indexer.schemas.block_hash import U64_MASK, BlockHasher, LoRAKey, MultiModalKey, find_token_ids
from cache_indexer.schemas.config import HttpConfig

try:  # /query's answer in one native pass (api/_answer_json.c); without it, ``answer`` and msgspec
    from cache_indexer.api import _answer_json
except ImportError:  # pragma: no cover - no C compiler at install time
    _answer_json = None

log = logging.getLogger(__name__)

QUERY_PATH = "/query"
QUERY_BY_HASH_PATH = "/query_by_hash"
#: Blocks the reference walk takes before the event loop serves other work (about 2.5 ms)
WALK_SLICE = 4096
#: Block hashes a ``/query_by_hash`` may hold. A real hash has 19 or 20 digits, so a body within
#: ``http.maxHitRateBodyBytes`` (4 MiB) holds at most about 200k; a million one-digit numbers held the
#: event loop for 119 ms while they became ints. The body's commas are counted first (a key given twice
#: is decoded twice: only the whole body bounds that), a millisecond for 4 MiB.
MAX_QUERY_HASHES = 1 << 18

_Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME_CHARS)]
_I64_MIN = -(1 << 63)


class _MultiModal(msgspec.Struct, forbid_unknown_fields=True):
    identifier: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME_CHARS)]
    offset: Annotated[int, msgspec.Meta(ge=0)]
    length: Annotated[int, msgspec.Meta(gt=0)]


class _Scope(msgspec.Struct):
    """Fields both requests share; the ecosystem's other spellings of them are accepted (unknown fields
    are ignored, as Dynamo does)."""

    model_name: _Name | None = None
    model: _Name | None = None  # Mooncake RFC #1403
    routing_group: _Name | None = None
    tenant_id: _Name | None = None  # Dynamo before 1.3
    block_size: Annotated[int, msgspec.Meta(gt=0, le=MAX_BLOCK_SIZE)] | None = None


class _Query(_Scope):
    token_ids: msgspec.Raw = msgspec.Raw()  # left raw (empty: absent) for the accelerator's parser
    cache_salt: str = ""
    lora_name: _Name = ""
    lora_path: _Name = ""
    mm_features: Annotated[list[_MultiModal], msgspec.Meta(max_length=MAX_MM_FEATURES)] = []


class _QueryByHash(_Scope):
    block_hashes: list[int] | None = None  # i64 or uint64: bounds checked after decoding (msgspec's stop at int64)
    seq_hashes: list[int] | None = None
    cache_salt: str | None = None


_query_decoder = msgspec.json.Decoder(_Query)
_by_hash_decoder = msgspec.json.Decoder(_QueryByHash)


def _decode(decoder: msgspec.json.Decoder, body: bytes):
    req = decode_json(decoder, body, UnprocessableRequest)
    if (req.model_name or req.model) is None:
        raise UnprocessableRequest("missing field `model_name`")
    return req


def decode_query(body: bytes) -> tuple[_Query, bytes | memoryview]:
    """The request and its token array's JSON text, not yet parsed (``query_tokens`` parses it); only the
    rest of the body goes through msgspec where the accelerator finds the array (``cut_token_array``)."""
    span = find_token_ids(body, True) if find_token_ids is not None else None
    if span is not None:
        rest, token_json = cut_token_array(body, span)
        return _decode(_query_decoder, rest), token_json
    req = _decode(_query_decoder, body)
    if not len(req.token_ids):
        raise UnprocessableRequest("missing field `token_ids`")
    return req, bytes(req.token_ids)


def query_tokens(token_json: bytes | memoryview) -> array:
    """The token ids (format 'Q'); 422 where the array is malformed."""
    return token_array(token_json, "token_ids", UnprocessableRequest)


def decode_query_by_hash(body: bytes) -> tuple[_QueryByHash, list[int]]:
    """The request and its block keys (uint64: an i64 is the same 64 bits)."""
    if (values := body.count(b",") + 1) > MAX_QUERY_HASHES + 64:  # (64: the other fields)
        raise RequestError(f"block_hashes: the request holds {values} values or more, over {MAX_QUERY_HASHES} "
                           "block hashes")
    req = _decode(_by_hash_decoder, body)
    hashes = req.block_hashes if req.block_hashes is not None else req.seq_hashes
    if hashes is None:
        raise UnprocessableRequest("missing field `block_hashes`")
    if req.cache_salt:
        raise RequestError("cache_salt is not accepted by /query_by_hash: the block hashes already include it")
    if hashes and not (_I64_MIN <= min(hashes) and max(hashes) <= U64_MASK):
        raise UnprocessableRequest("block_hashes: a hash is neither an int64 nor a uint64")
    return req, [h & U64_MASK for h in hashes]


def answer(match: TierMatch, block_size: int) -> dict:
    """Dynamo's response: ``instances`` with any match (tokens), the legacy ``scores`` (GPU per rank).
    One pass over each pod's ranks (this runs on the loop for every routing query)."""
    scores: dict[str, dict[str, int]] = {}
    instances: dict[str, dict] = {}
    by_rank, by_l3 = match.ranks, match.l3
    for pod in (dict.fromkeys([*by_rank, *by_l3]) if by_l3 else by_rank):
        ranks = by_rank.get(pod)
        l3 = by_l3.get(pod, 0) * block_size if by_l3 else 0
        dp: dict[str, int] = {}
        gpu_ranks: dict[str, int] = {}
        best_gpu = best_cpu = best_disk = 0
        if ranks:
            for rank, (gpu, cpu, disk) in ranks.items():
                if gpu > best_gpu:
                    best_gpu = gpu
                if cpu > best_cpu:
                    best_cpu = cpu
                if disk > best_disk:
                    best_disk = disk
                if disk:
                    dp[key := str(rank)] = tokens = gpu * block_size
                    if tokens:
                        gpu_ranks[key] = tokens
        if not dp and not l3:
            continue
        instances[pod] = {"longest_matched": best_disk * block_size, "gpu": best_gpu * block_size, "dp": dp,
                          "cpu": best_cpu * block_size, "disk": best_disk * block_size, "l3": l3}
        if gpu_ranks:
            scores[pod] = gpu_ranks
    return {"scores": scores, "frequencies": [], "instances": instances}


def native_answer(query: NativeTierQuery, out: tuple[int, int, list[list[int]]], block_size: int,
                  allowed: Callable[[str], bool] | None) -> bytes:
    """The answer's JSON to a native query's lengths: in one native pass where the accelerator is built
    (api/_answer_json.c: the same JSON values), else through ``result`` and ``answer``."""
    if _answer_json is not None:
        w = query.native.workers
        try:
            return _answer_json.tiered_answer(w.pods, w.slots, w.ranks, out[2], block_size, allowed)
        except (TypeError, ValueError, OverflowError):  # (a name with no UTF-8, which msgspec refuses too)
            pass
    return msgspec.json.encode(answer(query.result(out).only(allowed), block_size))


class TieredQueryApi:
    """The two routes, over the replica's tiers (L1 with its offload media, L3)."""

    def __init__(self, http: HttpConfig, hasher: BlockHasher, block_size: int,
                 tiers: Callable[[], Sequence[Tier | None]],
                 registrations: Callable[[], RegistrationStore | None] = lambda: None,
                 run_native: Callable[[NativeQuery, int], Awaitable[tuple]] | None = None,
                 fits_inline: Callable[[NativeQuery, int], bool] = lambda query, size: True) -> None:
        """``run_native(query, body size)``: runs a native query where the API's other queries run (on the
        loop, or the query threads for a large body); default: on the loop. ``fits_inline(query, body
        size)``: whether ``run_native`` would run it on the loop."""
        self.run_native = run_native or _on_the_loop
        self.fits_inline = fits_inline
        self.http = http
        self.hasher = hasher
        self.block_size = block_size
        self.tiers = tiers
        self.registrations = registrations
        self._refused = ThrottledWarning(log)  # counted per status by the API's middleware; logged here

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post(QUERY_PATH, self.query)
        app.router.add_post(QUERY_BY_HASH_PATH, self.query_by_hash)

    async def query(self, request: web.Request) -> web.Response:
        return await self._answer(request, self._match_tokens)

    async def query_by_hash(self, request: web.Request) -> web.Response:
        return await self._answer(request, self._match_hashes)

    def _scope(self, req) -> tuple[int, Callable[[str], bool] | None]:
        """The request's block size (given, else its model's registered one, else blockKey.blockSize) and
        which instances may answer it: discovered pods always, registered ones for their model and group
        (None: every one, nothing being registered)."""
        model = req.model_name if req.model_name is not None else req.model
        group = req.routing_group or req.tenant_id or "default"
        store = self.registrations()
        registered = store.current if store is not None else {}
        if not registered:
            return req.block_size or self.block_size, None
        serving, others, sizes = set(), set(), set()
        for reg in registered.values():
            if (reg.model_name, reg.routing_group) == (model, group):
                serving.add(reg.instance_id)
                sizes.add(reg.block_size)
            else:
                others.add(reg.instance_id)
        block_size = req.block_size or (min(sizes) if sizes else self.block_size)
        others -= serving
        return block_size, lambda pod: pod not in others

    def _native(self, body: bytes) -> tuple[_Query, bytes | memoryview, int, Callable[[str], bool] | None,
                                             NativeTierQuery | None]:
        """The request, its token array's JSON, its block size and scope, and its native query (None where
        only the Python hasher takes it: multimodal, a LoRA or index the native query does not cover)."""
        req, token_json = decode_query(body)
        bs, allowed = self._scope(req)
        if req.mm_features:
            return req, token_json, bs, allowed, None
        lora = LoRAKey(req.lora_name, req.lora_path) if req.lora_name else None
        l1, l3 = self.tiers()
        try:
            return req, token_json, bs, allowed, NativeTierQuery.prepare(self.hasher, token_json, bs, req.cache_salt,
                                                                        l1, l3, lora)
        except NotImplementedError:
            return req, token_json, bs, allowed, None  # a pickle token over 2**31-1: only the Python hasher
        except ValueError as exc:
            raise UnprocessableRequest(f"token_ids: {exc}") from None

    def answer_now(self, body: bytes) -> bytes | Awaitable[bytes | None] | None:
        """The answer's JSON where the native query answers it (api/fast_path.py): at once on the loop, or
        awaited from the query threads; None, with no effect, where ``query`` must (an error, the Python
        path)."""
        try:
            _, _, bs, allowed, query = self._native(body)
            if query is None:
                return None
            if not self.fits_inline(query.native, len(body)):
                return self._answer_later(query, len(body), bs, allowed)
            out = query.native.run()
        except (RequestError, ValueError, NotImplementedError):
            return None
        return native_answer(query, out, bs, allowed)

    async def _answer_later(self, query: NativeTierQuery, size: int, bs: int, allowed) -> bytes | None:
        try:
            out = await self.run_native(query.native, size)
        except (ValueError, NotImplementedError):
            return None
        return native_answer(query, out, bs, allowed)

    async def _match_tokens(self, body: bytes) -> tuple[TierMatch, int]:
        req, token_json, bs, allowed, query = self._native(body)
        if query is not None:
            try:
                return query.result(await self.run_native(query.native, len(body))).only(allowed), bs
            except NotImplementedError:
                pass  # a pickle token over 2**31-1: only the Python hasher encodes it
            except ValueError as exc:
                raise UnprocessableRequest(f"token_ids: {exc}") from None
        lora = LoRAKey(req.lora_name, req.lora_path) if req.lora_name else None
        mm = tuple(MultiModalKey(m.identifier, m.offset, m.length) for m in req.mm_features)
        tokens = query_tokens(token_json)
        for m in mm:
            if m.offset + m.length > len(tokens):
                raise RequestError(f"mm_features: item {m.identifier!r} ends past the prompt")
        keys = chain_keys(self.hasher, tokens, bs, req.cache_salt, lora, mm)
        l1, l3 = self.tiers()
        try:
            return (await _walk(keys, len(tokens) // bs, l1, l3)).only(allowed), bs
        except NotImplementedError as exc:
            raise RequestError(str(exc)) from None

    async def _match_hashes(self, body: bytes) -> tuple[TierMatch, int]:
        req, keys = decode_query_by_hash(body)
        bs, allowed = self._scope(req)
        l1, l3 = self.tiers()
        return (await _walk(iter(keys), len(keys), l1, l3)).only(allowed), bs

    async def _answer(self, request: web.Request,
                      match: Callable[[bytes], Awaitable[tuple[TierMatch, int]]]) -> web.Response:
        try:
            body = await read_body(request, self.http.maxHitRateBodyBytes, self.http.readTimeout)
            result, bs = await match(body)
        except BodyRefused as exc:
            self._refused("%s %s from %s refused (%d): %s", request.method, request.path, request.remote, exc.status, exc)
            return closing_unread(request, _error(exc.status, str(exc)))
        except RequestError as exc:
            status = 422 if isinstance(exc, UnprocessableRequest) else 400
            self._refused("%s %s from %s refused (%d): %s", request.method, request.path, request.remote, status, exc)
            return _error(status, str(exc))
        except Exception as exc:
            log.exception("%s failed", request.path)
            return _error(500, f"the query failed: {exc}")
        return web.Response(body=msgspec.json.encode(answer(result, bs)), content_type="application/json")


async def _walk(keys: Iterator[int], n_blocks: int, l1, l3) -> TierMatch:
    """The reference walk, WALK_SLICE blocks at a time, the event loop serving other work in between (a
    4 MiB body holds 200k hashes: 0.1 s of walking)."""
    walk = KeyWalk(n_blocks, l1, l3)
    while True:
        before = walk.hashed
        if not walk.feed(islice(keys, WALK_SLICE)) or walk.hashed == before:
            return walk.result()
        await asyncio.sleep(0)


async def _on_the_loop(query: NativeQuery, size: int) -> tuple:
    return query.run()


def query_error_body(status: int, message: str) -> bytes:
    """An error's JSON, as Dynamo's indexer gives it."""
    return msgspec.json.encode({"error": message})


def _error(status: int, message: str) -> web.Response:
    return web.Response(body=query_error_body(status, message), status=status, content_type="application/json")
