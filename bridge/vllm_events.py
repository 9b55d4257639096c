"""Tolerant decoder of vLLM ``KVEventBatch`` msgpack payloads, every wire shape from 0.9 to 0.34.

Shapes accepted (see ../shared/reference/vllm-hashing-and-events.md, sections 2 and 6):
- batch: array ``[ts, events]`` (0.9.0) or ``[ts, events, data_parallel_rank]`` (>= 0.9.2);
- event: tagged map ``{"type": "BlockStored", ...}`` (>= 0.24) or tagged array ``["BlockStored", f1, ...]``;
- hashes: uint64, int64 (builtin-hash era) or raw digest bytes; all normalised to the uint64 form;
- missing fields mean None, unknown fields and trailing elements are ignored.

The output is the normalized event dicts of ``schemas.events`` (token ids are not carried: the index
keys on hashes).

Two paths: the current shape (a batch of tagged maps, every field of the type it should be) is decoded by
msgspec into typed structs that skip what the index does not need (token ids: most of a batch's bytes),
about twice as fast (and its plain form, before msgspec, by bridge/_vllm_decode.c where it is built, which
returns msgspec's result: ``decode_current``); anything else (older shapes, unknown events, odd types) fails that strict decoder
and takes the tolerant reference path, which has the last word. A test checks both give the same result.
What the fast path skips it never decodes: a batch whose skipped parts msgpack-python refuses (a map
keyed by arrays, a reserved ext code, text that is not UTF-8 in an unknown field) is decoded by the fast
path alone (tests/test_fuzz.py holds the two equal on everything else).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack
import msgspec

from cache_indexer.schemas.block_hash import U64_MASK, normalize_event_hash
from cache_indexer.schemas.events import MAX_BLOCK_SIZE, MAX_GROUP_IDX

# Positional field order of the array-like (<= 0.23) events, after the tag.
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                  "lora_name", "extra_keys", "group_idx")
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


class MalformedPayload(ValueError):
    """The payload is not a KVEventBatch this decoder understands."""


#: Blocks larger than this are not probed: the check hashes the block once per divisor of its size, on
#: the event loop (a 720,720-token block held it for 17 s).
PROBE_MAX_TOKENS = 4096


@dataclass(slots=True)
class HashProbe:
    """A block the engine hashed from nothing but its tokens: the first block of a GPU BlockStored with no
    parent and no extra keys. Recomputing its hash checks the configured blockKey (bridge/block_key_check)."""

    token_ids: list[int]
    block_hash: int
    #: the event carries lookahead_token_ids (vLLM >= 0.33 with EAGLE/MTP): the engine hashes each block
    #: with the tokens after it, which no query can reproduce
    lookahead: bool = False


@dataclass(slots=True)
class DecodedBatch:
    ts: float | None
    events: list[dict]
    dp_rank: int | None
    unknown_events: int = 0
    probe: HashProbe | None = None


def _probe(event: object) -> HashProbe | None:
    _, f = _fields(event, _STORED_FIELDS)
    tokens, size, extra = f.get("token_ids"), f.get("block_size"), f.get("extra_keys")
    if (f.get("parent_block_hash") is not None or f.get("lora_name") is not None or not isinstance(size, int)
            or not 0 < size <= PROBE_MAX_TOKENS or not isinstance(tokens, list) or len(tokens) < size
            or not isinstance(extra, list) or not extra or extra[0] is not None):
        return None  # absent extra_keys (before vLLM 0.20) may hide a salt: not a probe
    block_tokens = tokens[:size]
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in block_tokens):
        return None
    return HashProbe(block_tokens, _hashes(f.get("block_hashes")[:1])[0], bool(f.get("lookahead_token_ids")))


def _fields(event: object, positional: tuple[str, ...]) -> tuple[str, dict]:
    if isinstance(event, dict):
        kind = event.get("type")
        return kind, event
    if isinstance(event, (list, tuple)) and event:
        kind = event[0]
        return kind, dict(zip(positional, event[1:]))
    raise MalformedPayload(f"event is neither a map nor a tagged array: {type(event).__name__}")


def _hashes(value: object) -> list[int]:
    if not isinstance(value, (list, tuple)):
        raise MalformedPayload("block_hashes is not a list")
    try:
        return [normalize_event_hash(h) for h in value]
    except TypeError as exc:
        raise MalformedPayload(str(exc)) from None


def _medium(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise MalformedPayload("medium is not a string")
    return value.upper()


def _opt_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _in_range(name: str, value: int | None, low: int, high: int) -> int | None:
    """The normalised schema is the contract: a value outside it makes the batch malformed, here at the
    edge, rather than a failure half-way through applying it in every indexer."""
    if value is not None and not low <= value <= high:
        raise MalformedPayload(f"{name} {value} outside {low}..{high}")
    return value


def normalize_event(event: object) -> dict | None:
    """One vLLM event -> normalized dict, or None for an event type this version does not know."""
    tag = event.get("type") if isinstance(event, dict) else (event[0] if isinstance(event, (list, tuple)) and event else None)
    if tag == "BlockStored":
        _, f = _fields(event, _STORED_FIELDS)
        parent = f.get("parent_block_hash")
        out = {"kind": "stored", "medium": _medium(f.get("medium")), "hashes": _hashes(f.get("block_hashes")),
               "parent": None if parent is None else _hashes([parent])[0]}
        block_size = _opt_int(f.get("block_size"))
        if block_size is not None and block_size > 0:  # CPU / STORAGE placeholders carry 0: not carried
            _in_range("block_size", block_size, 1, MAX_BLOCK_SIZE)
            out["block_size"] = block_size
        if isinstance(f.get("lora_name"), str):
            out["lora_name"] = f["lora_name"]
        group = _in_range("group_idx", _opt_int(f.get("group_idx")), 0, MAX_GROUP_IDX)
        if group is not None:
            out["group_idx"] = group
        return out
    if tag == "BlockRemoved":
        _, f = _fields(event, _REMOVED_FIELDS)
        out = {"kind": "removed", "medium": _medium(f.get("medium")), "hashes": _hashes(f.get("block_hashes"))}
        group = _in_range("group_idx", _opt_int(f.get("group_idx")), 0, MAX_GROUP_IDX)
        if group is not None:
            out["group_idx"] = group
        return out
    if tag == "AllBlocksCleared":
        _, f = _fields(event, ())
        return {"kind": "cleared", "medium": _medium(f.get("medium"))}
    if isinstance(tag, str):
        return None
    raise MalformedPayload("event has no type tag")


class _Stored(msgspec.Struct, tag_field="type", tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None = None
    block_size: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    group_idx: int | None = None


class _Removed(msgspec.Struct, tag_field="type", tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None = None
    group_idx: int | None = None


class _Cleared(msgspec.Struct, tag_field="type", tag="AllBlocksCleared"):
    medium: str | None = None


class _Batch(msgspec.Struct, array_like=True):
    ts: float | None
    events: list[_Stored | _Removed | _Cleared]
    dp_rank: int | None = None


_strict = msgspec.msgpack.Decoder(_Batch)

try:
    from cache_indexer.bridge._vllm_decode import decode as _native
except ImportError:  # not built (no compiler at install): msgspec alone
    _native = None


def _fast_hashes(values: list[int | bytes]) -> list[int]:
    return [h & U64_MASK if type(h) is int else int.from_bytes(h[-8:], "big") for h in values]


def decode_current(payload: bytes) -> DecodedBatch:
    """The current shape only, strictly (msgspec errors otherwise); the same result as the reference.
    Consecutive removals of one medium and group come out as one event (``merge_removals``).

    The plain current shape goes through the C decoder where it is built (bridge/_vllm_decode.c: no struct
    per event, token ids skipped without objects; 3-4x faster on a real trace's batch of hundreds of
    removals); what it does not take, it leaves to msgspec below."""
    if _native is not None:
        got = _native(payload)
        if got is not None:
            return DecodedBatch(ts=got[0], events=got[1], dp_rank=got[2])
    return decode_strict(payload)


def decode_strict(payload: bytes) -> DecodedBatch:
    """``decode_current`` through msgspec alone."""
    try:
        batch = _strict.decode(payload)
    except RecursionError:
        # msgspec skips an unknown field by recursion: one nested a thousand deep is not the strict shape,
        # and leaves it to the reference decoder like any other (a RecursionError killed the caller)
        raise msgspec.DecodeError("nested too deep for the strict decoder") from None
    events: list[dict] = []
    run: list | None = None  # the raw hashes of the removals gathered into the last event, while it is one
    run_key = None
    for ev in batch.events:
        medium = ev.medium.upper() if ev.medium is not None else None
        if type(ev) is _Removed:
            # vLLM publishes a BlockRemoved per evicted block: a batch that evicts 500 blocks holds 500 of them
            key = (medium, ev.group_idx)
            if run is not None and key == run_key:
                run += ev.block_hashes
                continue
            if run is not None:
                events[-1]["hashes"] = _fast_hashes(run)
            run, run_key = list(ev.block_hashes), key
            out = {"kind": "removed", "medium": medium, "hashes": None}
        else:
            if run is not None:
                events[-1]["hashes"] = _fast_hashes(run)
                run = None
            if type(ev) is _Stored:
                parent = ev.parent_block_hash
                out = {"kind": "stored", "medium": medium, "hashes": _fast_hashes(ev.block_hashes),
                       "parent": None if parent is None else _fast_hashes([parent])[0]}
                if ev.block_size is not None and ev.block_size > 0:
                    out["block_size"] = _in_range("block_size", ev.block_size, 1, MAX_BLOCK_SIZE)
                if ev.lora_name is not None:
                    out["lora_name"] = ev.lora_name
            else:
                events.append({"kind": "cleared", "medium": medium})
                continue
        if ev.group_idx is not None:
            out["group_idx"] = _in_range("group_idx", ev.group_idx, 0, MAX_GROUP_IDX)
        events.append(out)
    if run is not None:
        events[-1]["hashes"] = _fast_hashes(run)
    ts = batch.ts
    return DecodedBatch(ts=float(ts) if ts is not None else None, events=events, dp_rank=batch.dp_rank)


def merge_removals(events: list[dict]) -> list[dict]:
    """Consecutive removals of one medium and KV-cache group as one event, their hashes in order: the same
    to every index (a removal is applied hash by hash, in order; a hash named twice is removed twice, one
    copy each time), and one event to check, encode and apply instead of one per evicted block."""
    out: list[dict] = []
    for e in events:
        prev = out[-1] if out else None
        if (e["kind"] == "removed" and prev is not None and prev["kind"] == "removed"
                and prev["medium"] == e["medium"] and prev.get("group_idx") == e.get("group_idx")):
            prev["hashes"] = prev["hashes"] + e["hashes"]
        else:
            out.append(e)
    return out


def decode_batch(payload: bytes, want_probe: bool = False) -> DecodedBatch:
    """Decode one ZMQ payload frame. Raises MalformedPayload on anything that is not a KVEventBatch.

    ``want_probe``: also look for a HashProbe (when a check is due). Only a batch that can hold one (a GPU
    store without a parent) goes through the reference decoder for it: on a real fleet almost every
    store has a parent (prompts start with a cached system prompt), and a check stays due until a probe
    comes, so looking in every batch put every batch of every pod on the slow path."""
    try:
        batch = decode_current(payload)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return decode_reference(payload, want_probe)  # not the current shape, or not strictly: the reference decides
    if want_probe and may_hold_probe(batch.events):
        return decode_reference(payload, want_probe)
    return batch


_GPU = (None, "GPU")


def may_hold_probe(events: list[dict]) -> bool:
    """Whether decoded events can hold a HashProbe (a GPU store without a parent): only such a batch is
    worth the reference decoder's look when a blockKey check is due."""
    return any(ev["kind"] == "stored" and ev["parent"] is None and ev["hashes"] and ev["medium"] in _GPU
               for ev in events)


def decode_reference(payload: bytes, want_probe: bool = False) -> DecodedBatch:
    """The tolerant decoder: every shape, odd types ignored where vLLM's meaning stays clear."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several exception types for bad input
        raise MalformedPayload(f"not msgpack: {exc}") from None
    if not isinstance(raw, (list, tuple)) or len(raw) < 2 or not isinstance(raw[1], (list, tuple)):
        raise MalformedPayload("batch is not an array [ts, events, dp_rank?]")
    ts = raw[0] if isinstance(raw[0], (int, float)) and not isinstance(raw[0], bool) else None
    dp_rank = _opt_int(raw[2]) if len(raw) > 2 else None
    events: list[dict] = []
    unknown = 0
    probe = None
    for ev in raw[1]:
        norm = normalize_event(ev)
        if norm is None:
            unknown += 1
            continue
        events.append(norm)
        if (want_probe and probe is None and norm["kind"] == "stored" and norm["parent"] is None and norm["hashes"]
                and norm["medium"] in (None, "GPU")):
            probe = _probe(ev)
    return DecodedBatch(ts=float(ts) if ts is not None else None, events=merge_removals(events), dp_rank=dp_rank,
                        unknown_events=unknown, probe=probe)
