"""Fast decoding of ``POST /kv-cache/hit-rate`` bodies.

The contract is ``schemas.api.HitRateRequest`` (pydantic; it generates the OpenAPI document). Decoding
a 240k-token body through pydantic or ``json`` costs 15-17 ms, mostly creating a Python int per token,
so the hot path decodes the envelope with msgspec (same strictness: unknown fields, wrong types and
bools-as-ints are rejected) and leaves ``token_ids`` raw: the native query parses it off the event loop
(indexer.hit_rate.NativeQuery), else ``HitRateQuery.tokens`` parses it with the C accelerator straight
into native uint64s that the hasher reads without ever creating the ints. A test checks that this
decoder and the pydantic model accept and reject the same requests.
"""

from __future__ import annotations

import json
from array import array
from dataclasses import dataclass
from typing import Annotated

import msgspec

from schemas.api import MAX_MM_FEATURES, MAX_NAME_CHARS
from schemas.block_hash import LoRAKey, MultiModalKey, parse_token_array

#: Bodies from this size on have their token array found and parsed on a worker thread (``split_request``)
#: before the rest is decoded here: what is left for the event loop is the small envelope.
SPLIT_MIN_BYTES = 16 * 1024

_U64_LIMIT = 1 << 64


_Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME_CHARS)]


class _MultiModal(msgspec.Struct, forbid_unknown_fields=True):
    identifier: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME_CHARS)]
    offset: Annotated[int, msgspec.Meta(ge=0)]
    length: Annotated[int, msgspec.Meta(gt=0)]


class _Body(msgspec.Struct, forbid_unknown_fields=True):
    token_ids: msgspec.Raw
    block_size: Annotated[int, msgspec.Meta(gt=0)]
    cache_salt: str = ""
    lora_name: _Name = ""
    lora_path: _Name = ""
    mm_features: Annotated[list[_MultiModal], msgspec.Meta(max_length=MAX_MM_FEATURES)] = []


class _Request(msgspec.Struct, forbid_unknown_fields=True):
    server_ip: Annotated[list[Annotated[str, msgspec.Meta(pattern=r"\S")]], msgspec.Meta(min_length=1)]
    body: _Body


_decoder = msgspec.json.Decoder(_Request)


class RequestError(ValueError):
    """The request does not follow the contract; the message says where."""


@dataclass(slots=True)
class HitRateQuery:
    server_ip: list[str]
    token_json: bytes  # the token_ids array's JSON text, not yet parsed ...
    block_size: int
    cache_salt: str
    token_array: array | memoryview | None = None  # ... or its tokens, parsed already (format 'Q')
    lora: LoRAKey | None = None
    mm_features: tuple[MultiModalKey, ...] = ()

    def tokens(self) -> array | memoryview:
        """The token ids (format 'Q'); RequestError where the array is malformed."""
        return self.token_array if self.token_array is not None else _tokens(self.token_json)


def _tokens(raw: bytes) -> array:
    out = array("Q")
    if parse_token_array is not None:
        try:
            out.frombytes(parse_token_array(raw))
        except ValueError as exc:
            raise RequestError(f"body.token_ids: {exc}") from None
        return out
    try:
        values = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise RequestError(f"body.token_ids: not a flat array of integers ({type(exc).__name__})") from None
    if not isinstance(values, list):
        raise RequestError("body.token_ids: token_ids must be an array")
    for v in values:
        if type(v) is not int or v < 0 or v >= _U64_LIMIT:
            raise RequestError("body.token_ids: token_ids must be non-negative integers below 2**64")
    out.extend(values)
    return out


def decode_hit_rate_request(body: bytes, max_candidates: int | None = None) -> HitRateQuery:
    try:
        req = _decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise RequestError(str(exc).replace("`$.", "`").replace("`$`", "`request`")) from None
    except msgspec.DecodeError as exc:
        raise RequestError(f"invalid JSON: {exc}") from None
    except RecursionError:
        raise RequestError("invalid JSON: nested too deeply") from None
    if max_candidates is not None and len(req.server_ip) > max_candidates:
        raise RequestError(f"server_ip: {len(req.server_ip)} candidates exceed http.maxCandidates ({max_candidates})")
    body = req.body
    return HitRateQuery(server_ip=req.server_ip, token_json=bytes(body.token_ids), block_size=body.block_size,
                        cache_salt=body.cache_salt,
                        lora=LoRAKey(body.lora_name, body.lora_path) if body.lora_name else None,
                        mm_features=tuple(MultiModalKey(m.identifier, m.offset, m.length) for m in body.mm_features))


def decode_split_request(body: bytes, cut: tuple[int, int, bytes], max_candidates: int | None = None) -> HitRateQuery:
    """A request whose token array ``split_request`` found and parsed (``cut``): the rest of it decoded
    here, as ``decode_hit_rate_request`` decodes a whole one."""
    start, stop, raw = cut
    req = decode_hit_rate_request(body[:start] + b"[]" + body[stop:], max_candidates)
    req.token_array = memoryview(raw).cast("Q")  # no copy
    return req
