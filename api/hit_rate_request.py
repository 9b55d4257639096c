"""Fast decoding of ``POST /kv-cache/hit-rate`` bodies.

The contract is ``schemas.api.HitRateRequest`` (pydantic; it generates the OpenAPI document). Decoding
a 240k-token body through pydantic or ``json`` costs 15-17 ms, mostly creating a Python int per token,
so the hot path decodes the envelope with msgspec (same strictness: unknown fields, wrong types and
bools-as-ints are rejected) and leaves ``token_ids`` raw: the native query parses it without the GIL
(indexer.hit_rate.NativeQuery), else ``HitRateQuery.tokens`` parses it with the C accelerator straight
into native uint64s that the hasher reads without ever creating the ints. msgspec still scans a raw
array (2 ns a byte: 0.5 ms for 32k tokens), so where the accelerator finds the array first
(``find_token_ids``, memchr), only the rest of the body goes through msgspec. A test checks that this
decoder and the pydantic model accept and reject the same requests.

Candidates are counted before they are decoded where the envelope is large (``COUNT_FIRST_BYTES``): a
legal 4 MiB body of a million one-character candidates held the event loop for half a second while
msgspec made a million strings, only to be refused for ``http.maxCandidates``. The count skips the
array (msgspec's Raw) and counts its quotes: 12 ms for such a body, one step of the loop. A key given
twice is decoded twice (the last one kept), so the strings of the whole envelope are counted too: more
than the candidates and the other fields can hold is refused before any of them is made.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Annotated

import msgspec

from cache_indexer.schemas.api import MAX_MM_FEATURES, MAX_NAME_CHARS
from cache_indexer.schemas.events import MAX_BLOCK_SIZE
from cache_indexer.api.json_request import RequestError, cut_token_array, decode_json, token_array
from cache_indexer.schemas.block_hash import LoRAKey, MultiModalKey


_Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME_CHARS)]


class _MultiModal(msgspec.Struct, forbid_unknown_fields=True):
    identifier: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME_CHARS)]
    offset: Annotated[int, msgspec.Meta(ge=0)]
    length: Annotated[int, msgspec.Meta(gt=0)]


class _Body(msgspec.Struct, forbid_unknown_fields=True):
    token_ids: msgspec.Raw
    block_size: Annotated[int, msgspec.Meta(gt=0, le=MAX_BLOCK_SIZE)]
    cache_salt: str = ""
    lora_name: _Name = ""
    lora_path: _Name = ""
    mm_features: Annotated[list[_MultiModal], msgspec.Meta(max_length=MAX_MM_FEATURES)] = []


class _Request(msgspec.Struct, forbid_unknown_fields=True):
    #: an empty or blank one is refused after the decode (``_blank``): msgspec's pattern (``\S``, the
    #: contract's) runs a regular expression a string, 0.2 ms of a 1,000-candidate request's 0.25
    server_ip: Annotated[list[str], msgspec.Meta(min_length=1)]
    body: _Body
    explain: bool = False


_decoder = msgspec.json.Decoder(_Request)

#: Envelopes (the body without a token array the accelerator found) from this size on have their
#: candidates counted before they are decoded: below it a decode takes a few milliseconds at most.
COUNT_FIRST_BYTES = 64 * 1024


class _Candidates(msgspec.Struct):
    """``server_ip`` alone, its array skipped (the rest of the body too): the full decode checks all."""
    server_ip: msgspec.Raw = msgspec.Raw(b"")


_candidates_decoder = msgspec.json.Decoder(_Candidates)


#: Strings an envelope holds besides its candidates, at most: keys and names, and each multimodal item's
#: key and identifier (``mm_features`` is bounded)
OTHER_STRINGS = 16 + 4 * MAX_MM_FEATURES


def string_count(body: bytes) -> int:
    """About how many strings (keys and values) a JSON text holds: its quotes that no backslash escapes,
    halved (a quote after an escaped backslash is taken for escaped: at most half of them are missed)."""
    escaped = body.count(b'\\"') if b"\\" in body else 0
    return (body.count(b'"') - escaped) // 2


def least_candidates(body: bytes) -> int:
    """At least how many strings the body's ``server_ip`` array holds, without making them (0 where the
    body is not the envelope it should be: the full decode says what is wrong). Each string has two
    quotes that are not escaped; every other quote follows a backslash. RequestError where the body is
    not JSON: the full decode would make every string before it came to the fault (a review: a million
    candidates then a stray byte held the loop 280 ms)."""
    try:
        raw = _candidates_decoder.decode(body).server_ip
    except (msgspec.ValidationError, RecursionError):  # (a DecodeError itself: first)
        return 0
    except msgspec.DecodeError as exc:
        raise RequestError(f"invalid JSON: {exc}") from None
    raw = bytes(raw)
    if not raw.startswith(b"["):
        return 0
    return string_count(raw)


@dataclass(slots=True)
class HitRateQuery:
    server_ip: list[str]
    token_json: bytes | memoryview  # the token_ids array's JSON text, not yet parsed
    block_size: int
    cache_salt: str
    lora: LoRAKey | None = None
    mm_features: tuple[MultiModalKey, ...] = ()
    explain: bool = False

    def tokens(self) -> array:
        """The token ids (format 'Q'); RequestError where the array is malformed."""
        return token_array(self.token_json, "body.token_ids")


def _blank(candidates: list[str]) -> int | None:
    """The index of the first candidate that is empty or all whitespace (what the contract's pattern
    refuses), if any: each looked at in C (``str.isspace``), no Python call a candidate."""
    if "" not in candidates and not any(map(str.isspace, candidates)):
        return None
    return next(i for i, s in enumerate(candidates) if not s or s.isspace())


def decode_hit_rate_request(body: bytes, max_candidates: int | None = None) -> HitRateQuery:
    if max_candidates is not None and len(body) >= COUNT_FIRST_BYTES:
        least = least_candidates(body)
        if least > max_candidates:  # refused before a string of them is made
            raise RequestError(f"server_ip: {least} candidates (at least) exceed http.maxCandidates ({max_candidates})")
        strings = string_count(body)
        if strings > max_candidates + OTHER_STRINGS:  # a key given twice: the first one's made all the same
            raise RequestError(f"the request holds {strings} strings, more than http.maxCandidates ({max_candidates}) "
                               f"and the other fields allow: is a key given twice?")
    req = decode_json(_decoder, body)
    if max_candidates is not None and len(req.server_ip) > max_candidates:
        raise RequestError(f"server_ip: {len(req.server_ip)} candidates exceed http.maxCandidates ({max_candidates})")
    if (at := _blank(req.server_ip)) is not None:
        raise RequestError(f"Expected a candidate that is not empty or blank - at `server_ip[{at}]`")
    body = req.body
    return HitRateQuery(server_ip=req.server_ip, token_json=bytes(body.token_ids), block_size=body.block_size,
                        cache_salt=body.cache_salt,
                        lora=LoRAKey(body.lora_name, body.lora_path) if body.lora_name else None,
                        mm_features=tuple(MultiModalKey(m.identifier, m.offset, m.length) for m in body.mm_features),
                        explain=req.explain)


def decode_split_request(body: bytes, span: tuple[int, int], max_candidates: int | None = None) -> HitRateQuery:
    """A request whose token array ``find_token_ids`` found at ``span``: the rest of it decoded here, as
    ``decode_hit_rate_request`` decodes a whole one, the array left unparsed (a view of ``body``)."""
    rest, token_json = cut_token_array(body, span)
    req = decode_hit_rate_request(rest, max_candidates)
    req.token_json = token_json
    return req
