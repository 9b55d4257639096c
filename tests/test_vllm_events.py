"""The tolerant decoder against the real vLLM payloads in tests/data/vllm/events/."""

from __future__ import annotations

import json

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_indexer.bridge.vllm_events import MalformedPayload, decode_batch
from cache_indexer.schemas.block_hash import BlockHasher, event_block_hash
from tests.conftest import VLLM_EVENTS as EVENTS
from tests.conftest import needs_native

FILES = sorted(EVENTS.glob("*.bin")) + sorted((EVENTS / "legacy").glob("*.bin"))


def _norm_hash(v):
    if isinstance(v, dict):
        return int.from_bytes(bytes.fromhex(v["bytes_hex"])[-8:], "big")
    return v & ((1 << 64) - 1)


def _expected(decoded_event):
    """The normalized form of a sidecar's decoded event (map or tagged array)."""
    if isinstance(decoded_event, list):
        tag = decoded_event[0]
        names = {"BlockStored": ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                                 "lora_name", "extra_keys", "group_idx"],
                 "BlockRemoved": ["block_hashes", "medium", "group_idx"], "AllBlocksCleared": []}[tag]
        decoded_event = {"type": tag, **dict(zip(names, decoded_event[1:]))}
    tag = decoded_event["type"]
    if tag == "AllBlocksCleared":
        return {"kind": "cleared", "medium": decoded_event.get("medium")}
    out = {"kind": "stored" if tag == "BlockStored" else "removed", "medium": decoded_event.get("medium"),
           "hashes": [_norm_hash(h) for h in decoded_event["block_hashes"]]}
    if tag == "BlockStored":
        p = decoded_event.get("parent_block_hash")
        out["parent"] = None if p is None else _norm_hash(p)
    return out


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_decodes_every_shared_payload(path):
    sidecar = json.loads(path.with_suffix(".json").read_text())
    batch = decode_batch(path.read_bytes())
    decoded = sidecar["decoded"]
    assert batch.ts == decoded[0]
    assert batch.dp_rank == (decoded[2] if len(decoded) > 2 else None)
    assert batch.unknown_events == 0
    expected = []  # consecutive removals of one medium and group come as one event, their hashes in order
    for raw in decoded[1]:
        exp = _expected(raw)
        group = (raw.get("group_idx") if isinstance(raw, dict) else None)
        prev = expected[-1] if expected else None
        if prev and exp["kind"] == prev[0]["kind"] == "removed" and (exp["medium"], group) == (prev[0]["medium"], prev[1]):
            prev[0]["hashes"] += exp["hashes"]
        else:
            expected.append((exp, group))
    assert len(batch.events) == len(expected)
    for got, (exp, _) in zip(batch.events, expected):
        assert {k: got.get(k) for k in exp} == exp


def test_consecutive_removals_of_one_medium_and_group_are_one_event():
    """vLLM publishes a BlockRemoved per evicted block; both decoders give a run of them as one event (the
    same to every index), and keep apart what a store, another medium or another group separates."""
    from cache_indexer.bridge.vllm_events import decode_current, decode_reference
    from cache_indexer.simulate.vllm_engine import batch_payload, removed, stored

    events = [removed([1]), removed([2]), removed([2]), stored([3], block_size=4, token_ids=[0] * 4), removed([4]),
              removed([5], medium="CPU"), removed([6], medium="cpu"), removed([7], group_idx=1), removed([8])]
    for decode in (decode_batch, decode_current, decode_reference):
        got = [(e["kind"], e["medium"], e.get("group_idx"), e["hashes"]) for e in decode(batch_payload(events)).events]
        assert got == [("removed", "GPU", 0, [1, 2, 2]), ("stored", "GPU", 0, [3]), ("removed", "GPU", 0, [4]),
                       ("removed", "CPU", 0, [5, 6]), ("removed", "GPU", 1, [7]), ("removed", "GPU", 0, [8])], decode


def test_legacy_and_current_shapes_agree():
    """Every legacy encoding of the same logical events decodes to the same hashes and kinds."""
    seen = {}
    for path in sorted((EVENTS / "legacy").glob("*.bin")):
        batch = decode_batch(path.read_bytes())
        seen[path.name] = [(e["kind"], tuple(e.get("hashes", ())), e.get("parent")) for e in batch.events]
    assert len(set(map(tuple, seen.values()))) == 1, seen


def test_bytes_hashes_equal_int_hashes_and_our_chain():
    ints = decode_batch((EVENTS / "01_block_stored_with_parent.bin").read_bytes())
    raw = decode_batch((EVENTS / "06_bytes_hashes.bin").read_bytes())
    stored = lambda b: [e["hashes"] for e in b.events if e["kind"] == "stored"]  # noqa: E731
    assert stored(ints) == stored(raw)
    ctx = json.loads((EVENTS / "01_block_stored_with_parent.json").read_text())
    tokens = [t for e in ctx["decoded"][1] for t in e["token_ids"]]
    ours = BlockHasher("sha256_cbor", "0").block_hashes(tokens, 4)
    assert [event_block_hash(d) for d in ours] == [h for e in ints.events for h in e["hashes"]]


def test_lora_salt_payload_matches_hasher():
    from cache_indexer.schemas.block_hash import LoRAKey

    ctx = json.loads((EVENTS / "02_block_stored_lora_salt.json").read_text())["context"]
    batch = decode_batch((EVENTS / "02_block_stored_lora_salt.bin").read_bytes())
    h = BlockHasher("sha256_cbor", "0")
    digests = h.block_hashes(ctx["token_ids"], ctx["block_size"], cache_salt=ctx["cache_salt"],
                             lora=LoRAKey(ctx["lora"]["lora_name"], ctx["lora"]["lora_path"]))
    assert batch.events[0]["hashes"] == [event_block_hash(d) for d in digests]
    assert batch.events[0]["lora_name"] == "my-lora"


def test_cpu_offload_events_keep_their_medium():
    batch = decode_batch((EVENTS / "07_cpu_offload_events.bin").read_bytes())
    assert {e["medium"] for e in batch.events} == {"CPU"}


def test_zmq_capture_frames_decode():
    cap = json.loads((EVENTS / "zmq_capture.json").read_text())
    for msg in cap["live_pub_frames"]:
        topic, seq, payload = (bytes.fromhex(f) for f in msg["frames_hex"])
        assert topic == b"kv-events" and int.from_bytes(seq, "big") == msg["seq_be_u64"]
        assert decode_batch(payload).events


def test_unknown_fields_and_event_types_are_tolerated():
    payload = msgpack.packb([1.0, [
        {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None, "token_ids": [], "block_size": 2,
         "lora_id": None, "medium": "GPU", "lora_name": None, "future_field": {"x": 1}},
        {"type": "SomethingNew", "payload": 1},
        ["BlockRemoved", [1], "GPU", 0, "LOCAL", "owner", "trailing"],
    ], 3])
    batch = decode_batch(payload)
    assert batch.dp_rank == 3 and batch.unknown_events == 1
    assert [e["kind"] for e in batch.events] == ["stored", "removed"]


@pytest.mark.parametrize("payload", [
    b"", b"\xc1", msgpack.packb({"not": "a batch"}), msgpack.packb([1.0]), msgpack.packb([1.0, "x"]),
    msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": "nope"}]]),
    msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [1.5]}]]),
    msgpack.packb([1.0, [{"no_type": 1}]]), msgpack.packb([1.0, [42]]),
])
def test_malformed_payloads_raise_a_clear_error(payload):
    with pytest.raises(MalformedPayload):
        decode_batch(payload)


@pytest.mark.parametrize("field,value", [("group_idx", -1), ("group_idx", 64), ("group_idx", 1 << 24),
                                         ("block_size", 720_720)])
def test_values_outside_the_normalised_schema_make_the_batch_malformed(field, value):
    """Issue 16 #9/#10: group_idx -1 stuck an indexer half-way through a batch, 64 broke every snapshot,
    2^24 cost 2 MB an event; a 720,720-token block held the bridge's loop for 17 s."""
    from cache_indexer.simulate.vllm_engine import batch_payload, removed, stored

    event = {**stored([1, 2], block_size=16), field: value}
    with pytest.raises(MalformedPayload, match=field):
        decode_batch(batch_payload([event]))
    if field == "group_idx":
        with pytest.raises(MalformedPayload, match=field):
            decode_batch(batch_payload([{**removed([1]), field: value}]))
    ok = decode_batch(batch_payload([stored([1, 2], block_size=16, group_idx=63)]))
    assert ok.events[0]["group_idx"] == 63


def test_a_large_block_is_not_probed_on_the_event_loop():
    from cache_indexer.bridge.vllm_events import PROBE_MAX_TOKENS
    from cache_indexer.simulate.vllm_engine import batch_payload, stored

    big = stored([7], block_size=PROBE_MAX_TOKENS * 2)
    assert decode_batch(batch_payload([big]), want_probe=True).probe is None
    small = stored([7], block_size=16)
    assert decode_batch(batch_payload([small]), want_probe=True).probe is not None


_value = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1), st.floats(allow_nan=False),
                   st.text(max_size=4), st.binary(max_size=40), st.lists(st.integers(0, 9), max_size=3))
_hash = st.one_of(st.integers(-(1 << 63), (1 << 64) - 1), st.binary(min_size=8, max_size=32))
_medium = st.sampled_from([None, "GPU", "cpu", "CPU"])
_group = st.one_of(st.none(), st.integers(0, 63), st.sampled_from([-1, 64]))
_stored_map = st.fixed_dictionaries(
    {"type": st.just("BlockStored"), "block_hashes": st.lists(_hash, max_size=4)},
    optional={"parent_block_hash": st.one_of(st.none(), _hash), "token_ids": st.lists(st.integers(0, 1 << 20), max_size=20),
              "block_size": st.one_of(st.integers(-1, 70), st.just(720_720)), "lora_id": st.none(), "medium": _medium,
              "lora_name": st.one_of(st.none(), st.text(max_size=4)), "extra_keys": st.one_of(st.none(), st.just([None])),
              "group_idx": _group, "kv_cache_spec_kind": st.just("full_attention")})
_removed_map = st.fixed_dictionaries({"type": st.just("BlockRemoved"), "block_hashes": st.lists(_hash, max_size=4)},
                                     optional={"medium": _medium, "group_idx": _group})
_cleared_map = st.fixed_dictionaries({"type": st.just("AllBlocksCleared")}, optional={"medium": _medium})
_good_event = st.one_of(_stored_map, _removed_map, _cleared_map)


@st.composite
def _odd_event(draw):
    """A current-shape event with one field of another type, an unknown type, or an older array shape."""
    kind = draw(st.sampled_from(["field", "unknown", "array"]))
    if kind == "unknown":
        return {"type": "SomethingNew", "x": draw(_value)}
    if kind == "array":
        return ["BlockRemoved", draw(st.lists(_hash, max_size=3)), draw(_medium), draw(_group)]
    event = draw(_good_event)
    event[draw(st.sampled_from(sorted(event)))] = draw(_value)
    return event


_batch = st.tuples(st.one_of(st.floats(allow_nan=False), st.integers(0, 1 << 40), st.none(), _value),
                   st.lists(st.one_of(_good_event, _good_event, _odd_event()), max_size=4),
                   st.lists(st.one_of(st.integers(0, 7), _value), max_size=2)).map(lambda t: [t[0], t[1], *t[2]])


def _outcome(decode, payload):
    try:
        b = decode(payload)
    except MalformedPayload as exc:
        return "malformed", str(exc)
    return b.ts, b.events, b.dp_rank, b.unknown_events


@settings(max_examples=1500, deadline=None)
@given(_batch)
def test_the_fast_path_decodes_as_the_reference_wherever_it_decodes_at_all(batch):
    """Issue 15: msgspec decodes the current shape strictly; where it does not fail, its result (or its
    MalformedPayload) is the tolerant reference decoder's, byte for byte of what is published."""
    import msgspec

    from cache_indexer.bridge.vllm_events import decode_current, decode_reference

    payload = msgpack.packb(batch, use_bin_type=True)
    try:
        fast = _outcome(decode_current, payload)
    except (msgspec.ValidationError, msgspec.DecodeError):
        assert _outcome(decode_batch, payload) == _outcome(decode_reference, payload)
        return
    assert fast == _outcome(decode_reference, payload)
    assert _outcome(decode_batch, payload) == fast


def _native_or_none(payload):
    from cache_indexer.bridge.vllm_events import DecodedBatch, _native
    got = _native(payload)
    return None if got is None else _outcome(lambda _: DecodedBatch(ts=got[0], events=got[1], dp_rank=got[2]), payload)


def _strict_or_error(payload):
    import msgspec

    from cache_indexer.bridge.vllm_events import decode_strict
    try:
        return _outcome(decode_strict, payload)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        return "error", type(exc).__name__


_extra = st.dictionaries(st.text(max_size=6).filter(lambda k: k not in {"type", "block_hashes", "medium", "group_idx",
                                                                          "parent_block_hash", "block_size", "lora_name"}),
                         st.recursive(_value, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                                      st.dictionaries(st.text(max_size=3), inner,
                                                                                      max_size=3)), max_leaves=8),
                         max_size=2)


@settings(max_examples=1500, deadline=None)
@given(_batch, st.lists(_extra, max_size=4), st.sampled_from(["GPU", "gpu", "cpu", None]), st.integers(0, 6),
       st.data())
def test_the_c_decoder_equals_msgspec_wherever_it_takes_a_batch(batch, extras, run_medium, run_length, data):
    """bridge/_vllm_decode.c (issue 37): what it returns is exactly what msgspec's path returns; what it does
    not take (None) is left to that path. Also with unknown fields of every kind (nested maps, binary,
    text), long runs of removals, truncated and corrupted payloads. It takes every batch of the plain shape."""
    from cache_indexer.bridge import vllm_events
    needs_native(vllm_events._native is not None, "the bridge's C decoder of vLLM batches")
    if isinstance(batch[1], list):
        for event, extra in zip(batch[1], extras):
            if isinstance(event, dict):
                event.update(extra)
        batch[1].extend({"type": "BlockRemoved", "block_hashes": [i], "medium": run_medium} for i in range(run_length))
    payload = msgpack.packb(batch, use_bin_type=True)
    native, strict = _native_or_none(payload), _strict_or_error(payload)
    if native is not None:
        assert native == strict
    plain = (isinstance(batch[0], float) or batch[0] is None) and len(batch) <= 3 and strict[0] != "error" and all(
        isinstance(e, dict) and next(iter(e)) == "type" and all(all(ord(c) < 128 for c in k) for k in e)
        for e in batch[1]) and (len(batch) < 3 or type(batch[2]) is int or batch[2] is None)
    if plain and strict[0] != "malformed":
        assert native is not None, "a plain batch left to msgspec"
    cut = data.draw(st.integers(0, len(payload)))
    flip = data.draw(st.integers(0, max(0, len(payload) - 1)))
    for broken in (payload[:cut], payload[:flip] + bytes([payload[flip] ^ 0xFF]) + payload[flip + 1:] if payload else b""):
        native = _native_or_none(broken)
        if native is not None:
            assert repr(native) == repr(_strict_or_error(broken))  # (a flipped byte may make the ts NaN)


def test_the_c_decoder_takes_a_real_traces_batch_of_hundreds_of_removals():
    """The shape that made the bridge's decode most of its CPU on the trace benchmark: 520 removals (one a
    block, as vLLM publishes them) and a store of 700 blocks with their token ids."""
    import random

    from cache_indexer.bridge import vllm_events
    needs_native(vllm_events._native is not None, "the bridge's C decoder of vLLM batches")
    r = random.Random(3)
    events = [{"type": "BlockRemoved", "block_hashes": [r.getrandbits(64)], "medium": "GPU"} for _ in range(520)]
    events.append({"type": "BlockStored", "block_hashes": [r.getrandbits(64) for _ in range(700)],
                   "parent_block_hash": r.getrandbits(64), "token_ids": [r.randrange(150_000) for _ in range(11_200)],
                   "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": None})
    payload = msgpack.packb([1.5, events, 0])
    got = _native_or_none(payload)
    assert got is not None and got == _strict_or_error(payload)
    assert [e["kind"] for e in got[1]] == ["removed", "stored"] and len(got[1][0]["hashes"]) == 520


def test_the_fast_path_takes_the_engines_payloads():
    """The shapes vLLM >= 0.24 sends (and the fake engines) do take the fast path."""
    from cache_indexer.bridge.vllm_events import decode_current

    current = [p for p in sorted(EVENTS.glob("*.bin")) if msgpack.unpackb(p.read_bytes())[1]
               and all(isinstance(e, dict) for e in msgpack.unpackb(p.read_bytes())[1])]
    assert len(current) >= 5
    for path in current:
        assert _outcome(decode_current, path.read_bytes()) == _outcome(decode_batch, path.read_bytes())


def test_a_due_blockkey_check_puts_only_batches_that_can_hold_a_probe_on_the_reference_decoder(monkeypatch):
    """Issue 37: a check stays due until a parentless GPU store comes; with want_probe every batch went
    through the tolerant reference decoder (per-hash Python), and on a real fleet, where stores have
    parents (a cached system prompt first), every batch of every pod did, for good."""
    import cache_indexer.bridge.vllm_events as ve
    from cache_indexer.simulate.vllm_engine import batch_payload, removed, stored

    calls = []
    reference = ve.decode_reference
    monkeypatch.setattr(ve, "decode_reference", lambda p, w=False: calls.append(1) or reference(p, w))
    with_parent = batch_payload([stored([5, 6], parent=4, block_size=4, token_ids=list(range(8))), removed([1])])
    offloaded = batch_payload([stored([7], medium="CPU", block_size=4, token_ids=list(range(4)))])
    for payload in (with_parent, offloaded):
        assert ve.decode_batch(payload, want_probe=True) == ve.decode_batch(payload)
    assert calls == [], "no batch here can hold a probe: the fast decoder answers"
    first = batch_payload([stored([9], block_size=4, token_ids=[1, 2, 3, 4])])
    probe = ve.decode_batch(first, want_probe=True).probe
    assert calls == [1] and probe is not None and probe.token_ids == [1, 2, 3, 4] and probe.block_hash == 9


@pytest.mark.parametrize("depth", [2_000, 100_000])
def test_an_unknown_field_nested_too_deep_is_malformed_not_a_recursion_error(depth):
    """An unknown field nested thousands deep: msgspec skips it by recursion and raised RecursionError,
    which neither decode_batch nor the bridge's usual-batch path caught (the task publishing the pod's
    batches died); the C decoder, skipping without recursion, took the batch msgspec refuses (a different
    answer from the path it must equal). Now the strict path refuses it as msgspec's DecodeError, the C
    decoder leaves it (nested past 32 levels), and the reference decides: msgpack-python refuses it too."""
    import msgspec

    from cache_indexer.bridge import vllm_events
    payload = msgpack.packb([1.5, [{"type": "BlockRemoved", "block_hashes": [1], "x": None}], 0])
    payload = payload.replace(b"\xa1x\xc0", b"\xa1x" + b"\x91" * depth + b"\xc0")
    with pytest.raises(MalformedPayload):
        decode_batch(payload)
    if vllm_events._native is not None:
        assert vllm_events._native(payload) is None
    with pytest.raises(msgspec.DecodeError):
        vllm_events.decode_strict(payload)
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):  # what take_usual catches
        vllm_events.decode_current(payload)


def test_the_c_decoder_takes_unknown_fields_nested_as_deep_as_its_bound():
    """32 levels of containers inside an unknown field are still the plain shape (vLLM's nest 3 deep at
    most); 33 are left to msgspec, which takes them too: the same answer either way."""
    from cache_indexer.bridge import vllm_events
    needs_native(vllm_events._native is not None, "the bridge's C decoder of vLLM batches")
    base = msgpack.packb([1.5, [{"type": "BlockRemoved", "block_hashes": [1], "x": None}], 0])
    for depth, taken in ((32, True), (33, False)):
        payload = base.replace(b"\xa1x\xc0", b"\xa1x" + b"\x92\x01" * depth + b"\xc0")
        assert (vllm_events._native(payload) is not None) is taken, depth
        assert _outcome(decode_batch, payload) == _strict_or_error(payload)
