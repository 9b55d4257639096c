"""Bounded-time fuzzing of the boundaries where the network's bytes meet native code, each held equal
to its pure-Python reference: the request's token array (``parse_token_array`` and the native query's
parse, C), vLLM's block hash chain (``chain``, C) and vLLM event payloads through the decoder into the
L1 state (the native index held equal to the pure-Python one). At fleet shape (issue 35): the native
walk over populated tiers of hundreds of workers spread over ~32 chunks of 64 ids, and the L1 and L3
stream messages of many workers, against the pure-Python indexes (tests/native_fleet.py,
tests/native_events.py). Those two run in a child process: a case that fails, or crashes the child, is
saved into their corpus (``tests/data/fuzz/fleet``, ``tests/data/fuzz/events``), replayed first by every
run after.

Mutations of the corpus under ``tests/data/fuzz`` and ``tests/data/vllm/events`` (bit flips, byte
insertions and deletions, splices, interesting tokens), for ``FUZZ_SECONDS`` per target (2 by
default; CI's sanitizer step runs them again in the AddressSanitizer/UBSan build). The seed is printed;
``FUZZ_SEED`` replays a run.
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import msgpack
import pytest

from bridge.vllm_events import MalformedPayload, decode_batch, decode_reference
from indexer import hit_rate
from indexer.block_index import BlockIndex
from indexer.l1_state import L1State
from schemas import block_hash
from schemas.block_hash import BlockHasher
from tests.conftest import needs_native

DATA = Path(__file__).resolve().parent / "data"
SECONDS = float(os.environ.get("FUZZ_SECONDS", "2"))
INTERESTING = [b"-", b".", b"e", b"E", b"+", b"0", b"00", b"18446744073709551615", b"18446744073709551616",
               b"99999999999999999999", b"[", b"]", b",", b" ", b"\t", b"\n", b"\x00", b"\xff", b"true", b"null",
               b"1e5", b'"', b"\\u0031"]


@pytest.fixture
def fuzz_seed() -> int:
    seed = int(os.environ.get("FUZZ_SEED") or random.SystemRandom().randrange(1 << 32))
    print(f"FUZZ_SEED={seed}")
    return seed


@pytest.fixture
def rng(fuzz_seed):
    return random.Random(fuzz_seed)


def mutate(rng: random.Random, data: bytes, corpus: list[bytes]) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(6)
        at = rng.randrange(len(b) + 1)
        if op == 0 and b:
            b[at % len(b)] ^= 1 << rng.randrange(8)
        elif op == 1:
            b[at:at] = bytes([rng.randrange(256)])
        elif op == 2 and b:
            del b[at:at + rng.randint(1, 8)]
        elif op == 3:
            b[at:at] = rng.choice(INTERESTING)
        elif op == 4:
            other = rng.choice(corpus)
            cut = rng.randrange(len(other) + 1)
            b = b[:at] + other[cut:]
        elif b:
            b[at % len(b)] = rng.choice(b"0123456789")
    return bytes(b)


def reference_tokens(raw: bytes) -> list[int] | None:
    """What the API accepts as ``token_ids`` (the pydantic contract): a JSON array of non-negative ints
    below 2**64 in UTF-8; None when refused."""
    try:
        values = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):
        return None
    if not isinstance(values, list) or not all(type(v) is int and 0 <= v < 1 << 64 for v in values):
        return None
    return values


def budget():
    end = time.monotonic() + SECONDS
    n = 0
    while time.monotonic() < end or n < 50:
        yield n
        n += 1


def _parses_as_the_reference(raw: bytes) -> list[int] | None:
    """parse_token_array's answer to raw, checked equal to the reference's (None: refused)."""
    from array import array

    want = reference_tokens(raw)
    try:
        got = array("Q", block_hash.parse_token_array(raw)).tolist()
    except ValueError:
        got = None
    assert got == want, f"{raw[:200]!r}: C {got and got[:8]} != reference {want and want[:8]}"
    return want


def test_the_token_array_parser_equals_the_json_reference(rng):
    needs_native(block_hash.parse_token_array is not None, "the request parser's C accelerator")
    corpus = [p.read_bytes() for p in sorted((DATA / "fuzz" / "token_arrays").glob("*.json"))]
    for n in budget():
        raw = mutate(rng, rng.choice(corpus), corpus) if n >= len(corpus) else corpus[n]
        want = _parses_as_the_reference(raw)
        if hit_rate.NATIVE_QUERY:  # the native query parses the same text on its own, off the GIL
            try:
                n_tokens = hit_rate._native_index.query(raw, True, 1, bytes(32), True, [])[0]
            except ValueError:
                n_tokens = None
            assert n_tokens == (None if want is None else len(want)), raw[:200]


def test_the_token_array_parser_at_every_offset_of_its_64_byte_blocks(rng):
    """The C parser reads the usual array 64 bytes at a time (bit masks of digits, commas and whitespace,
    numbers and commas alternating across blocks): every kind of fault at every offset of the first
    blocks, in each separator style, takes the scalar parser's path to the reference's answer."""
    needs_native(block_hash.parse_token_array is not None, "the request parser's C accelerator")
    styles = [(", ", ""), (",", ""), (",\n  ", "\n"), (" ,\t", "\r\n")]
    faults = [b"", b",", b" ", b"0", b"-", b"]", b"[", b"x", b"9" * 8, b"9" * 20, b"18446744073709551616"]
    for sep, pad in styles:
        values = [rng.choice([rng.randrange(10), rng.randrange(151_000), rng.randrange(1 << 64)])
                  for _ in range(40)]
        base = ("[" + pad + sep.join(map(str, values)) + pad + "]").encode()
        for at in range(1, min(len(base), 200)):
            for fault in faults:
                _parses_as_the_reference(base[:at] + fault + base[at + (fault == b""):])  # b"": a byte dropped


def _decoded(decode, *args):
    """What a decoded request asks, or None where it is refused."""
    from api.json_request import RequestError

    try:
        req = decode(*args)
        return req.server_ip, req.tokens().tolist(), req.block_size, req.cache_salt, req.lora, req.mm_features
    except RequestError:
        return None


def test_the_request_split_equals_the_whole_decode(rng):
    """``find_token_ids`` finds the token array with one scan and the rest is decoded alone: the same
    requests accepted, with the same values, as decoding the whole body."""
    from api.hit_rate_request import decode_hit_rate_request, decode_split_request

    needs_native(block_hash.find_token_ids is not None, "the request splitter's C accelerator")
    corpus = [p.read_bytes() for p in sorted((DATA / "fuzz" / "requests").glob("*.json"))]
    split = 0
    for n in budget():
        raw = mutate(rng, rng.choice(corpus), corpus) if n >= len(corpus) else corpus[n]
        want = _decoded(decode_hit_rate_request, raw)
        span = block_hash.find_token_ids(raw)
        if span is None:
            continue  # not the plain shape: decoded whole, as before
        split += 1
        assert _decoded(decode_split_request, raw, span) == want, raw[:300]
    assert split >= min(n, len(corpus)), "the plain requests of the corpus were split"


def _query_decoded(raw: bytes, split: bool):
    """What a /query body asks (its token array parsed), or None where it is refused; whole or split."""
    from api import tiered_query
    from api.json_request import RequestError

    find = tiered_query.find_token_ids
    if not split:
        tiered_query.find_token_ids = None
    try:
        req, token_json = tiered_query.decode_query(raw)
        return (req.model_name, req.model, req.routing_group, req.cache_salt, req.block_size, req.lora_name,
                tiered_query.query_tokens(token_json).tolist())
    except RequestError:
        return None
    finally:
        tiered_query.find_token_ids = find


def _query_body(rng: random.Random) -> bytes:
    """A /query body as routers write them, or nearly: members in any order, unknown ones (some holding a
    token_ids of their own), odd spacing, and now and then a duplicate, an escaped key or a bad array."""
    tokens = [rng.randrange(1 << 17) for _ in range(rng.randrange(40))]
    members = [("token_ids", json.dumps(tokens)), ("model_name", json.dumps(rng.choice(["m", "qwen", ""])))]
    for name, value in [("cache_salt", '"s"'), ("block_size", str(rng.choice([1, 16, 0, -3]))),
                        ("routing_group", '"g"'), ("other", json.dumps({"token_ids": [9, 9], "x": [[1], {}]})),
                        ("lora_name", '"a"'), ("token_ids", "[1, 2]"), ("token_\\u0069ds", "[7]"),
                        ("instance_id", "5"), ("mm_features", "[]")]:
        if rng.random() < 0.3:
            members.append((name, value))
    rng.shuffle(members)
    ws = lambda: rng.choice(["", " ", "\n  ", "\t"])  # noqa: E731
    text = "{" + ws() + ("," + ws()).join(f'"{k}"{ws()}:{ws()}{v}' for k, v in members) + ws() + "}"
    if rng.random() < 0.1:
        cut = rng.randrange(len(text))
        text = text[:cut] + rng.choice(["", "]", "[", ",", '"', "-1", "1e3", "true"]) + text[cut + 1:]
    return text.encode()


def test_the_query_split_equals_the_whole_decode(rng):
    """/query bodies: the token array found with one scan (at the top, never in a nested member) and the
    rest decoded alone accept the same requests, with the same values, as decoding the whole body."""
    needs_native(block_hash.find_token_ids is not None, "the request splitter's C accelerator")
    split = 0
    for _ in budget():
        raw = _query_body(rng)
        split += block_hash.find_token_ids(raw, True) is not None
        assert _query_decoded(raw, True) == _query_decoded(raw, False), raw[:300]
    assert split > 10


@pytest.mark.parametrize("algo", ["sha256_cbor", "sha256", "xxhash_cbor", "xxhash"])
def test_the_hash_chain_equals_the_python_reference(rng, algo):
    fast, reference = BlockHasher(algo, "0"), BlockHasher(algo, "0", accelerate=False)
    kinds = [lambda: rng.randrange(1 << 17), lambda: rng.randrange(1 << 64), lambda: rng.randrange(1 << 31),
             lambda: rng.choice([True, False]), lambda: -rng.randrange(1 << 40), lambda: rng.randrange(1 << 70)]
    for _ in budget():
        bs = rng.choice([1, 2, 3, 4, 16, 64])
        tokens = [rng.choice(kinds[:3] if rng.random() < 0.8 else kinds)() for _ in range(bs * rng.randint(0, 12))]
        salt = rng.choice([None, "", "tenant"])
        try:
            want = reference.block_hashes(tokens, bs, cache_salt=salt)
        except (TypeError, ValueError, OverflowError) as exc:
            with pytest.raises(type(exc)):
                fast.block_hashes(tokens, bs, cache_salt=salt)
            continue
        assert fast.block_hashes(tokens, bs, cache_salt=salt) == want, (bs, tokens[:16], salt)


def test_event_payloads_decode_as_the_reference_and_apply_without_harm(rng):
    corpus = [p.read_bytes() for p in sorted((DATA / "vllm" / "events").glob("*.bin"))]
    state, reference = L1State(), L1State()
    reference.index = BlockIndex()  # the pure-Python index (``state``'s is native where built)
    for n in budget():
        raw = mutate(rng, rng.choice(corpus), corpus)
        try:
            got = decode_batch(raw)
        except MalformedPayload:
            with pytest.raises(MalformedPayload):
                decode_reference(raw)
            continue
        try:
            ref = decode_reference(raw)
        except MalformedPayload as exc:
            # what the fast path skips (token ids, unknown fields) it never decodes; msgpack-python, which
            # decodes all, refuses some of it (a map keyed by arrays, a reserved ext code, text that is
            # not UTF-8): those batches are the fast path's alone. Nothing else may differ.
            assert str(exc).startswith("not msgpack"), (raw[:200], exc)
            ref = got
        assert (got.ts, got.events, got.dp_rank) == (ref.ts, ref.events, ref.dp_rank), raw[:200]
        msg = {"type": "batch", "pod": "10.0.0.1", "rank": 0, "gen": 0, "seq": n, "events": got.events}
        state.apply(msgpack.unpackb(msgpack.packb(msg), raw=False))  # as the stream carries it
        reference.apply(msgpack.unpackb(msgpack.packb(msg), raw=False))
        idx = state.index
        assert idx.blocks == reference.index.blocks and idx.copies == reference.index.copies, raw[:200]
        counts: dict[int, int] = {}
        for mask in idx.blocks.values():
            for wid in range(mask.bit_length()):
                if mask >> wid & 1:
                    counts[wid] = counts.get(wid, 0) + 1
        assert counts == {w: c for w, c in idx.worker_blocks.items() if c}, "per-worker counts match the table"


def test_the_native_walk_over_populated_tiers_of_many_workers_equals_the_reference(fuzz_seed, tmp_path):
    """Hundreds of workers, their ids spread over up to 2,000 (~32 chunks) and reused, hold runs of
    chains that share prefixes in four tiers (GPU, CPU, STORAGE, L3); removals (by workers that never
    stored in the tier too), clears, releases, snapshots across the native and Python indexes; then
    requests whose prefixes partly match the chains (cut anywhere, a token changed, tokens added): the
    native query, on the query threads and on the calling thread, answers as ``score`` over the
    references, and both indexes hold the same throughout."""
    from tests import native_fleet

    needs_native(hit_rate.NATIVE_QUERY, "the native index and query")
    native_fleet.fuzz_in_child("fleet", fuzz_seed, SECONDS, tmp_path)


def test_stream_messages_of_many_workers_apply_and_query_as_the_reference(fuzz_seed, tmp_path):
    """L1 batches (GPU and offloaded media, KV-cache groups, duplicates, resets, removed pods) and L3
    diffs and full states of hundreds of workers, applied to the native states and to pure-Python ones:
    the same held; the hit-rate query and the /query walk answer as the references; and a query prepared
    before messages were applied and run after reports 0 for a worker whose id was released meanwhile
    (possibly to another pod), never that pod's blocks."""
    from tests import native_fleet

    needs_native(hit_rate.NATIVE_QUERY, "the native index and query")
    native_fleet.fuzz_in_child("events", fuzz_seed, SECONDS, tmp_path)
