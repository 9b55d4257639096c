"""Bounded-time fuzzing of the boundaries where the network's bytes meet native code, each held equal
to its pure-Python reference: the request's token array (``parse_token_array`` and the native query's
parse, C), vLLM's block hash chain (``chain``, C), vLLM event payloads through the decoder into the
L1 state (the native index held equal to the pure-Python one) and through the bridge's C decoder of vLLM
batches (``bridge/_vllm_decode.c``, held equal to msgspec's path; lengths, widths and truncations too). At fleet shape (issue 35): the native
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

from cache_indexer.bridge.vllm_events import MalformedPayload, decode_batch, decode_reference
from cache_indexer.indexer import hit_rate
from cache_indexer.indexer.block_index import BlockIndex
from cache_indexer.indexer.l1_state import L1State
from cache_indexer.schemas import block_hash
from cache_indexer.schemas.block_hash import BlockHasher
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
    from cache_indexer.api.json_request import RequestError

    try:
        req = decode(*args)
        return req.server_ip, req.tokens().tolist(), req.block_size, req.cache_salt, req.lora, req.mm_features
    except RequestError:
        return None


def test_the_request_split_equals_the_whole_decode(rng):
    """``find_token_ids`` finds the token array with one scan and the rest is decoded alone: the same
    requests accepted, with the same values, as decoding the whole body."""
    from cache_indexer.api.hit_rate_request import decode_hit_rate_request, decode_split_request

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


@pytest.mark.parametrize("second", [b"4", b"[5, 6]", b'"x"', b"null", b"{}"])
def test_a_token_array_given_twice_is_decoded_whole(second):
    """A fuzz run (FUZZ_SEED=2121627850): body.token_ids given twice, an array, then a number. The splitter
    saw only a second array as a second token_ids, so it cut out the first, and the rest's decoder took the
    number's place, where the whole decode (the last one wins) refuses the request: one accepted what the
    other refused, and with two arrays they would hash different tokens. A second token_ids, whatever its
    value, is now decoded whole; the same at the top of a /query."""
    needs_native(block_hash.find_token_ids is not None, "the request splitter's C accelerator")
    from cache_indexer.api.hit_rate_request import decode_hit_rate_request

    seed = b'{"server_ip": ["a"], "body": {"token_ids": [1, 2], "block_size": 2, "token_ids": %s}}' % second
    assert block_hash.find_token_ids(seed) is None
    assert _decoded(decode_hit_rate_request, seed) == (None if second != b"[5, 6]" else
                                                       (["a"], [5, 6], 2, "", None, ()))
    query = b'{"token_ids": [1, 2], "model_name": "m", "token_ids": %s}' % second
    assert block_hash.find_token_ids(query, True) is None
    assert _query_decoded(query, True) == _query_decoded(query, False)


def _query_decoded(raw: bytes, split: bool):
    """What a /query body asks (its token array parsed), or None where it is refused; whole or split."""
    from cache_indexer.api import tiered_query
    from cache_indexer.api.json_request import RequestError

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
                        ("lora_name", '"a"'), ("token_ids", "[1, 2]"), ("token_ids", "4"), ("token_\\u0069ds", "[7]"),
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


def _headers(data: bytes) -> list[tuple[int, int, str, int]]:
    """Where each msgpack value's header lies in data: (offset, header length, kind, count or length),
    kind one of array/map/str/bin/ext/int; as far as the bytes parse."""
    out, at, left = [], 0, 1
    while left and at < len(data):
        c, left = data[at], left - 1
        if c <= 0x7f or c >= 0xe0:
            out.append((at, 1, "int", c))
            at += 1
        elif 0x80 <= c <= 0x9f:
            n = c & 0x0f
            out.append((at, 1, "map" if c < 0x90 else "array", n))
            left += 2 * n if c < 0x90 else n
            at += 1
        elif 0xa0 <= c <= 0xbf:
            out.append((at, 1, "str", c & 0x1f))
            at += 1 + (c & 0x1f)
        elif c in (0xdc, 0xdd, 0xde, 0xdf):
            w = 2 if c in (0xdc, 0xde) else 4
            n = int.from_bytes(data[at + 1:at + 1 + w], "big")
            out.append((at, 1 + w, "array" if c < 0xde else "map", n))
            left += n if c < 0xde else 2 * n
            at += 1 + w
        elif c in (0xc4, 0xc5, 0xc6, 0xd9, 0xda, 0xdb, 0xc7, 0xc8, 0xc9):
            w = {0xc4: 1, 0xc5: 2, 0xc6: 4, 0xd9: 1, 0xda: 2, 0xdb: 4, 0xc7: 1, 0xc8: 2, 0xc9: 4}[c]
            n = int.from_bytes(data[at + 1:at + 1 + w], "big")
            kind = "bin" if c <= 0xc6 else "str" if c >= 0xd9 else "ext"
            out.append((at, 1 + w, kind, n))
            at += 1 + w + n + (kind == "ext")
        elif 0xcc <= c <= 0xd3:
            w = 1 << ((c - 0xcc) % 4)
            out.append((at, 1 + w, "int", int.from_bytes(data[at + 1:at + 1 + w], "big", signed=c >= 0xd0)))
            at += 1 + w
        else:  # nil, bools, floats, fixext: passed over
            at += {0xca: 5, 0xcb: 9, 0xd4: 3, 0xd5: 4, 0xd6: 6, 0xd7: 10, 0xd8: 18}.get(c, 1)
    return out


_WIDE = {"array": (0xdc, 0xdd), "map": (0xde, 0xdf), "str": (0xd9, 0xda, 0xdb), "bin": (0xc4, 0xc5, 0xc6)}
_NEAR_2_32 = [0, 1, 2, 15, 16, 31, 32, 255, 256, 65535, 65536, (1 << 31) - 1, 1 << 31, (1 << 32) - 2, (1 << 32) - 1]


def corrupt_headers(rng: random.Random, data: bytes) -> bytes:
    """A msgpack payload with one value's header rewritten: a container's or a string's length set to a
    boundary (0, off by one, near 2**31 and 2**32), a fixed-size header widened to its 16- or 32-bit form
    (real payloads use the short ones, vLLM's longer batches the long ones), or an integer re-encoded in
    every width and sign (uint64 above 2**63, int64 below 0)."""
    headers = _headers(data)
    if not headers:
        return data
    at, size, kind, n = rng.choice(headers)
    head, tail = data[:at], data[at + size:]
    if kind == "int":
        v = rng.choice([n, n + 1, n - 1, -1, -(1 << 63), (1 << 63) - 1, 1 << 63, (1 << 64) - 1, 63, 64, 65536, 65537])
        fmts = [(0xcc, "B"), (0xcd, ">H"), (0xce, ">I"), (0xcf, ">Q"), (0xd0, "b"), (0xd1, ">h"), (0xd2, ">i"),
                (0xd3, ">q")]
        import struct

        for code, fmt in rng.sample(fmts, len(fmts)):
            try:
                return head + bytes([code]) + struct.pack(fmt, v) + tail
            except struct.error:
                continue
        return head + msgpack.packb(v if -(1 << 63) <= v < 1 << 64 else 0) + tail
    if kind == "ext":
        return head + data[at:at + 1] + (rng.choice(_NEAR_2_32) % (1 << 8 * (size - 1))).to_bytes(size - 1, "big") + tail
    if rng.random() < 0.5:  # the same length, a wider header
        code = rng.choice(_WIDE[kind])
        w = {0xdc: 2, 0xdd: 4, 0xde: 2, 0xdf: 4, 0xd9: 1, 0xda: 2, 0xdb: 4, 0xc4: 1, 0xc5: 2, 0xc6: 4}[code]
        if n < 1 << (8 * w):
            return head + bytes([code]) + n.to_bytes(w, "big") + tail
    v = rng.choice(_NEAR_2_32 + [n + 1, max(n - 1, 0), n + len(tail), max(n - 2, 0)])
    code = rng.choice(_WIDE[kind])
    w = {0xdc: 2, 0xdd: 4, 0xde: 2, 0xdf: 4, 0xd9: 1, 0xda: 2, 0xdb: 4, 0xc4: 1, 0xc5: 2, 0xc6: 4}[code]
    return head + bytes([code]) + (v % (1 << (8 * w))).to_bytes(w, "big") + tail


def msgpack_cases(rng: random.Random, corpus: list[bytes]):
    """(n, payload) for FUZZ_SECONDS: the corpus as it is first, then each case one of its payloads
    mutated byte-wise, with one or two headers corrupted, cut short, or both."""
    for n in budget():
        base = rng.choice(corpus)
        op = rng.randrange(4) if n >= len(corpus) else -1
        if op == 0:
            raw = mutate(rng, base, corpus)
        elif op == 1:
            raw = corrupt_headers(rng, base)
            if rng.random() < 0.5:
                raw = corrupt_headers(rng, raw)
        elif op == 2:
            raw = base[:rng.randrange(len(base) + 1)]
        elif op == 3:
            raw = corrupt_headers(rng, base)[:rng.randrange(len(base) + 8)]
        else:
            raw = base
        yield n, raw


def test_the_c_decoder_of_vllm_batches_equals_msgspecs_path(rng):
    """bridge/_vllm_decode.c reads the network's bytes: on the vLLM event corpus mutated (the byte-level
    mutations above, every header's length corrupted or widened to its 16/32-bit form, integers in every
    width and sign, truncations), whatever it takes equals msgspec's path (``decode_strict``) on the same
    bytes, and whatever it does not take (None) it leaves without an exception. Most of the cases it
    takes, so both paths are held equal on real answers, not only on refusals."""
    import msgspec

    from cache_indexer.bridge import vllm_events
    needs_native(vllm_events._native is not None, "the bridge's C decoder of vLLM batches")
    # the engines' payloads, and batches with what they seldom hold (digests, unknown fields of every kind,
    # removal runs across media and groups, 16-bit lengths): tests/data/fuzz/vllm_batches
    corpus = [p.read_bytes() for p in sorted([*(DATA / "vllm" / "events").glob("*.bin"),
                                              *(DATA / "fuzz" / "vllm_batches").glob("*.bin")])]
    taken = 0
    for n, raw in msgpack_cases(rng, corpus):
        got = vllm_events._native(raw)
        if got is None:
            continue
        taken += 1
        try:
            want = vllm_events.decode_strict(raw)
        except (msgspec.ValidationError, msgspec.DecodeError, MalformedPayload) as exc:
            raise AssertionError(f"C took {raw[:200]!r} which msgspec's path refuses: {exc}") from None
        # repr: a corrupted ts may be NaN, equal to itself only in print
        assert repr(got) == repr((want.ts, want.events, want.dp_rank)), raw[:200]
    assert taken >= n // 20, f"the C decoder took only {taken} of {n} cases (about a sixth is usual)"


def test_the_c_reader_of_stream_payloads_equals_msgpack(rng):
    """infra/_event_unpack.c reads whatever the L1 stream holds: on the bridge's messages mutated (the
    byte-level mutations, headers corrupted as above, truncations), whatever it takes equals msgpack's
    answer on the same bytes (its arrays as lists, every type the same), and whatever it does not take
    (None) it leaves to msgpack without an exception of its own. Most cases it takes."""
    from tests.test_event_codec import _as_lists, _unpack, arrays_only_under_hashes, l1_messages, same

    unpack = _unpack()
    corpus = [msgpack.packb(m) for m in l1_messages()]
    taken = 0
    for n, raw in msgpack_cases(rng, corpus):
        got = unpack(raw)
        if got is None:
            continue
        taken += 1
        try:
            want = msgpack.unpackb(raw, raw=False, strict_map_key=False)
        except Exception as exc:
            raise AssertionError(f"C took {raw[:200]!r} which msgpack refuses: {exc!r}") from None
        assert same(_as_lists(got), want), raw[:200]
        assert arrays_only_under_hashes(got), raw[:200]
    assert taken >= n // 20, f"the C reader took only {taken} of {n} cases"


def test_the_seed_apis_native_answer_equals_the_python_path(rng):
    """api/_answer_json.c writes the router's candidate names into the answer: on seed API requests
    mutated at the byte level (names with quotes, escapes, controls, any UTF-8), whatever the decode
    takes is answered with the same JSON values, best ratios and unknown candidates as the Python path,
    and a name the native pass refuses (no UTF-8) the Python path refuses too."""
    from cache_indexer.api import app as app_module
    from cache_indexer.api.app import UNKNOWN_POD_MESSAGE, HitRateApi
    from cache_indexer.api.json_request import RequestError
    from cache_indexer.infra.metrics import Metrics
    from cache_indexer.schemas.config import HttpConfig

    native = app_module._answer_json
    needs_native(native is not None, "the seed API's native answer")
    hasher = BlockHasher("sha256_cbor", "0")
    tokens = [(i * 7919) % 50000 for i in range(64)]
    chain = hasher.event_hashes(tokens, 4)
    state = L1State()
    for i, pod in enumerate(["10.0.0.1", 'q"uo\\te', "é\u2028", "\x01ctl"]):
        for rank in range(1 + i % 2):
            state.apply({"type": "batch", "pod": pod, "rank": rank, "gen": 1, "seq": 0,
                         "events": [{"kind": "stored", "medium": "GPU", "hashes": chain[:4 * (i + rank) + 1]}]})
    api = HitRateApi(HttpConfig(), hasher, tiers=lambda: (state, None), ready=lambda: True, metrics=Metrics())
    corpus = [json.dumps({"server_ip": ips, "body": {"token_ids": tokens[:n], "block_size": 4}}).encode()
              for ips, n in ((["10.0.0.1", 'q"uo\\te'], 64), (["é\u2028", "\x01ctl", "nobody", "10.0.0.1"], 33),
                             (['\\"', "\\u00e9", "\\ud83d\\ude00"], 3))]
    taken = 0
    for n in budget():
        raw = mutate(rng, rng.choice(corpus), corpus)
        try:
            query = api._prepare(api._decode(raw), api.tiers())
            out = query.run() if query is not None else None
        except (RequestError, ValueError, NotImplementedError):
            continue
        if out is None:
            continue
        try:
            want = json.loads(api._answer_body(query.result(out), None))
        except Exception:  # (a name msgspec cannot write: no UTF-8)
            want = None
        try:
            body, *_ = native.seed_answer(query.workers.pods, query.workers.slots, out[2], out[0] // query.block_size,
                                          query.knows, UNKNOWN_POD_MESSAGE)
        except (TypeError, ValueError):
            assert want is None, f"{raw[:200]!r}: the native pass refused what the Python path answers"
            continue
        taken += 1
        assert json.loads(body) == want, raw[:200]
    print(f"seed API answers: {taken} of {n} mutated requests decoded and answered")
    assert taken >= 5, f"only {taken} requests of {n} decoded"
