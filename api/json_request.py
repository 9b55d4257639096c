"""Strict decoding of JSON request bodies, shared by the API's routes: msgspec into errors that name the
field, and token arrays straight into native uint64s (the C accelerator's parser where it was built)."""

from __future__ import annotations

import json
from array import array

import msgspec

from cache_indexer.schemas.block_hash import parse_token_array

_U64_LIMIT = 1 << 64


class RequestError(ValueError):
    """The request does not follow the contract; the message says where."""


class UnprocessableRequest(RequestError):
    """JSON that does not fit the contract (the ecosystem API answers it with 422, as Dynamo does)."""


def decode_json(decoder: msgspec.json.Decoder, body: bytes, misfit: type[RequestError] = RequestError):
    """``body`` through ``decoder``: RequestError where it is not JSON, ``misfit`` where it does not fit."""
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise misfit(str(exc).replace("`$.", "`").replace("`$`", "`request`")) from None
    except msgspec.DecodeError as exc:
        raise RequestError(f"invalid JSON: {exc}") from None
    except RecursionError:
        raise RequestError("invalid JSON: nested too deeply") from None


def cut_token_array(body: bytes, span: tuple[int, int]) -> tuple[bytes, memoryview]:
    """A body whose token array the accelerator found at ``span`` (``find_token_ids``): the body with an
    empty array in its place, for the decoder (which would scan a 240k-token array for 3 ms), and the
    array's JSON text, a view of ``body`` (no copy), for the parser."""
    start, stop = span
    return body[:start] + b"[]" + body[stop:], memoryview(body)[start:stop]


def token_array(raw: bytes | memoryview, field: str, misfit: type[RequestError] = RequestError) -> array:
    """The token ids of a JSON array (format 'Q'); ``misfit`` naming ``field`` where it is not a flat array
    of integers in [0, 2**64)."""
    out = array("Q")
    if parse_token_array is not None:
        try:
            out.frombytes(parse_token_array(raw))
        except ValueError as exc:
            raise misfit(f"{field}: {exc}") from None
        return out
    try:
        values = json.loads(bytes(raw))
    except (ValueError, RecursionError) as exc:
        raise misfit(f"{field}: not a flat array of integers ({type(exc).__name__})") from None
    if not isinstance(values, list):
        raise misfit(f"{field}: token_ids must be an array")
    for v in values:
        if type(v) is not int or v < 0 or v >= _U64_LIMIT:
            raise misfit(f"{field}: token_ids must be non-negative integers below 2**64")
    out.extend(values)
    return out
