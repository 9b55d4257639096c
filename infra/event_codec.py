"""Payload encodings of the L1 and L3 stream messages: msgpack (the default, the most compact) or JSON
(``nats.l1Stream.encoding`` / ``l3Stream.encoding``), which the nats CLI prints as it is.

Both carry the same maps (schemas/events.py): every key a string, hashes as integers below 2^64, so a
reader gets the same dict from either. A message says which it is by its first byte: a JSON object
starts with ``{`` (or white space), which in msgpack is a positive integer, never a message (always a
map). ``decode`` therefore reads both, message by message, and a stream holding both (a setting
changed, bridges of two versions) is read as one.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any, Callable

import msgpack
import msgspec

from cache_indexer.infra.log_format import describe

try:  # built where a C compiler was (setup.py); else every payload goes through msgpack
    from cache_indexer.infra._event_unpack import unpack as _unpack_packed
except ImportError:  # pragma: no cover - exercised by the no-compiler CI step
    _unpack_packed = None

ENCODINGS = ("msgpack", "json")
_JSON_FIRST = frozenset(b"{ \t\r\n")
_json_decode = msgspec.json.Decoder().decode


class MalformedEvent(ValueError):
    """A payload in neither encoding."""


@dataclass(frozen=True, slots=True)
class Codec:
    name: str
    encode: Callable[[Any], bytes]
    #: Upper bound of one uint64 hash in a list: msgpack 9 bytes, JSON 20 digits and a comma.
    hash_bytes: int
    #: What a list adds per item besides the item: JSON's comma.
    item_sep: int

    def content_type(self, base: str) -> str:
        """A Content-Type of schemas/events.py (``...+msgpack``) in this encoding (``...+json``)."""
        return f"{base.rpartition('+')[0]}+{self.name}"

    def key_bytes(self, key: str) -> int:
        """Upper bound of a map key (a pod) with its list's opening and closing: what a part budgets."""
        if self.name == "msgpack":
            return 10 + len(key.encode())
        return len(msgspec.json.encode(key)) + 4  # "key":[ ... ],

    def str_bytes(self, text: str) -> int:
        return len(text.encode()) if self.name == "msgpack" else len(msgspec.json.encode(text))


#: msgspec's encoder writes the bytes msgpack.packb writes for these maps (the smallest form of each integer,
#: str8 and float64 alike; a test holds them equal), in about a third of the time: a real trace's batch of
#: 1,200 hashes took 28 us to pack, now 8 (the bridge packs every message).
MSGPACK = Codec("msgpack", msgspec.msgpack.Encoder().encode, 9, 0)
JSON = Codec("json", msgspec.json.encode, 21, 1)


def codec(name: str) -> Codec:
    """The codec of a configured ``encoding``."""
    if name == "json":
        return JSON
    if name == "msgpack":
        return MSGPACK
    raise ValueError(f"unknown event encoding {name!r}: one of {', '.join(ENCODINGS)}")


def encoding_of(data: bytes) -> str:
    """Which encoding a payload is in, by its first byte (see the module's docstring)."""
    return "json" if data[:1] and data[0] in _JSON_FIRST else "msgpack"


def decode(data: bytes) -> Any:
    """The message a payload holds, in either encoding (what the indexers apply). Raises MalformedEvent
    when it is neither; whether the map is a valid message is the reader's check."""
    if data[:1] and data[0] in _JSON_FIRST:
        try:
            return _json_decode(data)
        except msgspec.DecodeError as exc:
            raise MalformedEvent(f"malformed JSON: {exc}") from None
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several kinds (ValueError, ExtraData, StackError, ...)
        raise MalformedEvent(f"neither JSON (an object starts with '{{') nor msgpack "
                             f"({describe(exc)})") from None


def decode_packed(data: bytes) -> Any:
    """``decode``, except that each event's ``hashes`` may come as an ``array('Q')`` instead of a list (the
    C reader, infra/_event_unpack.c, where built): what the indexers turn the lists into anyway, made
    without an int object per hash. Such arrays are the readers' own: no encoder here takes them
    (``plain`` makes them lists again)."""
    if _unpack_packed is not None and encoding_of(data) == "msgpack":
        got = _unpack_packed(data)
        if got is not None:
            return got
    return decode(data)


def plain(obj: Any) -> Any:
    """msgpack's ``default`` for what ``decode_packed`` returns: an ``array('Q')`` of hashes as a list."""
    if isinstance(obj, array):
        return obj.tolist()
    raise TypeError(f"can not serialize {type(obj).__name__!r} object")
