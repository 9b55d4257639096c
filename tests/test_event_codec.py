"""The msgpack encoding of stream messages writes exactly what msgpack.packb writes (the bridge packs with
msgspec's encoder for speed; indexers of earlier versions, and ``events decode``, read the same bytes),
and the indexers' C reader of them reads what msgpack reads (its fuzz target: tests/test_fuzz.py).
A few seconds."""

from __future__ import annotations

from array import array
from pathlib import Path

import msgpack
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_indexer.indexer.l1_state import L1State
from cache_indexer.infra.event_codec import MSGPACK, decode, decode_packed
from cache_indexer.simulate.vllm_engine import batch_payload, removed, stored
from cache_indexer.bridge.vllm_events import decode_batch
from tests.conftest import needs_native

_scalars = (st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats(allow_nan=False)
            | st.text(max_size=300, alphabet=st.characters(max_codepoint=0x3ff)))
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=20) | st.dictionaries(st.text(max_size=40), inner,
                                                                                                 max_size=8), max_leaves=30)


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.text(max_size=40), _values, max_size=10))
def test_msgpack_encoding_is_msgpack_packb_byte_for_byte(message):
    assert MSGPACK.encode(message) == msgpack.packb(message)


def test_a_batch_message_of_decoded_vllm_events_is_packb_byte_for_byte():
    hashes = [(1 << 64) - 1 - i * 7919 for i in range(300)]
    batch = decode_batch(batch_payload([removed([h]) for h in hashes[:200]]
                                       + [stored(hashes[200:], parent=hashes[0], block_size=16)], ts=1764932400.25))
    message = {"v": 1, "type": "batch", "pod": "10.0.0.1", "rank": 0, "gen": 1_764_900_000_000_000_000, "seq": 12,
               "ts": batch.ts, "events": batch.events}
    assert MSGPACK.encode(message) == msgpack.packb(message)
    assert decode(MSGPACK.encode(message)) == message


# -- the indexer's C reader (infra/_event_unpack.c, decode_packed) ----------------------------------------
def _as_lists(obj):
    """What decode_packed returned, with its arrays as lists: msgpack's answer where the reader is right."""
    if isinstance(obj, array):
        return obj.tolist()
    if isinstance(obj, list):
        return [_as_lists(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _as_lists(v) for k, v in obj.items()}
    return obj


def same(got, want) -> bool:
    """Equal and of the same types all the way down (True is not 1, 1.0 is not 1; floats by repr: NaN)."""
    if type(got) is not type(want):
        return False
    if isinstance(got, list):
        return len(got) == len(want) and all(same(a, b) for a, b in zip(got, want))
    if isinstance(got, dict):
        return got.keys() == want.keys() and all(same(got[k], want[k]) for k in got)
    if isinstance(got, float):
        return repr(got) == repr(want)
    return got == want


def arrays_only_under_hashes(obj, key=None) -> bool:
    """Every array('Q') is the value of a "hashes" key, and every "hashes" list of uint64s is one."""
    if isinstance(obj, array):
        return key == "hashes" and obj.typecode == "Q"
    if isinstance(obj, list):
        if key == "hashes" and all(type(v) is int and 0 <= v < 1 << 64 for v in obj):
            return False
        return all(arrays_only_under_hashes(v) for v in obj)
    if isinstance(obj, dict):
        return all(arrays_only_under_hashes(v, k) for k, v in obj.items())
    return True


def _unpack():
    from cache_indexer.infra import event_codec

    needs_native(event_codec._unpack_packed is not None, "the indexer's C reader of stream payloads")
    return event_codec._unpack_packed


_hashes = st.lists(st.integers(0, (1 << 64) - 1), max_size=40) | st.lists(
    st.integers(-(1 << 63), (1 << 64) - 1) | st.booleans() | st.floats(allow_nan=False) | st.none(), max_size=6)
_maps = st.recursive(
    st.dictionaries(st.text(max_size=12), _values, max_size=6),
    lambda inner: st.dictionaries(st.sampled_from(["hashes", "events", "kind", "x"]) | st.text(max_size=8),
                                  inner | _hashes | st.lists(inner, max_size=4), max_size=6), max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(_maps)
def test_the_c_reader_equals_msgpack_with_uint64_hashes_as_arrays(message):
    """Any map of msgpack's plain values, "hashes" keys anywhere holding uint64s or anything else: read as
    msgpack reads it, each all-uint64 "hashes" array an array('Q') and nothing else one."""
    unpack = _unpack()
    raw = msgpack.packb(message)
    got = unpack(raw)
    assert got is not None, raw[:200]
    assert same(_as_lists(got), msgpack.unpackb(raw, raw=False, strict_map_key=False)), raw[:200]
    assert arrays_only_under_hashes(got)


def l1_messages() -> list[dict]:
    """Stream messages as the bridge writes them (l1_publisher): batches of the vLLM corpus's events, a run,
    a part, a reset, removals."""
    out = []
    for i, path in enumerate(sorted((Path(__file__).parent / "data" / "vllm" / "events").glob("*.bin"))):
        batch = decode_batch(path.read_bytes())
        out.append({"v": 1, "type": "batch", "pod": f"10.0.0.{i}", "rank": i % 2, "gen": 1_764_900_000_000_000_000 + i,
                    "seq": i, "ts": batch.ts, "events": batch.events})
    events = [e for m in out for e in m["events"]]
    out.append({"v": 1, "type": "batch", "pod": "10.0.0.9", "rank": 0, "gen": 7, "seq": 3, "last_seq": 5, "ts": None,
                "ends": [1, 2, len(events)], "events": events})
    out.append({**out[0], "part": 1, "parts": 3})
    out.append({"v": 1, "type": "reset", "pod": "10.0.0.1", "rank": 0, "gen": 8, "next_seq": 0, "reason": "subscribed"})
    out.append({"v": 1, "type": "pod_removed", "pod": "10.0.0.1", "gen": 9, "reason": "deleted"})
    out.append({"v": 1, "type": "rank_removed", "pod": "10.0.0.1", "rank": 1, "gen": 9, "reason": "scaled"})
    return out


def test_stream_messages_read_by_the_c_reader_apply_as_msgpacks():
    """The bridge's messages: the reader's arrays are where the hashes are, and an index fed through it
    equals one fed msgpack's lists."""
    unpack = _unpack()
    ref, fast = L1State(), L1State()
    arrays = 0
    for n, message in enumerate(l1_messages(), 1):
        raw = MSGPACK.encode(message)
        got = decode_packed(raw)
        assert same(_as_lists(got), decode(raw)) and arrays_only_under_hashes(got)
        arrays += sum(isinstance(e.get("hashes"), array) for e in got.get("events", ()))
        ref.apply(decode(raw), None, n)
        fast.apply(got, None, n)
    assert arrays >= 10
    assert fast.index.blocks == ref.index.blocks and fast.cursor_rows() == ref.cursor_rows()
    assert unpack(b"\x81\xa6hashes\x92\x01") is None  # cut short: msgpack decides
    assert unpack(MSGPACK.encode({"a": 1}) + b"\x00") is None  # bytes left over


def test_a_snapshot_of_a_state_holding_messages_read_by_the_c_reader():
    """Held messages (a provisional generation's journal, batches early for their turn) go into the
    snapshot's header: their arrays are written as msgpack lists (a TypeError from msgpack before)."""
    _unpack()
    from cache_indexer.indexer.snapshot import decode_l1, encode_l1

    state = L1State()
    first = {"v": 1, "type": "batch", "pod": "p", "rank": 0, "gen": 5, "seq": 1, "ts": None,
             "events": [{"kind": "stored", "medium": "GPU", "hashes": [11, 12], "parent": None}]}
    early = {**first, "seq": 3, "events": [{"kind": "stored", "medium": "GPU", "hashes": [13], "parent": 12}]}
    for n, message in enumerate((first, early), 1):
        state.apply(decode_packed(MSGPACK.encode(message)), 1_000 + n, 0)
    assert any(isinstance(e["hashes"], array) for row in state.cursor_rows() for m in row[5] for e in m["events"])
    restored, seq = decode_l1(encode_l1(state, 2))
    assert seq == 2 and restored.cursor_rows() == _as_lists(state.cursor_rows())
    restored.apply({**first, "seq": 2, "events": [{"kind": "stored", "medium": "GPU", "hashes": [14], "parent": 12}]},
                   1_010, 0)
    assert sorted(restored.index.blocks) == [11, 12, 13, 14]
