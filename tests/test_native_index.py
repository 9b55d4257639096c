"""The native index (``indexer._native_index``) against the pure-Python reference (``BlockIndex``,
``hit_rate.score``): random streams of stores, removals and clears over KV-cache groups, duplicate
copies and worker ids past 64, with snapshots taken and loaded across the two; queries of every hash
mode answered alike; and queries on threads, without the GIL, while events are applied and snapshots
taken. Hypothesis prints the failing example (its seed: ``--hypothesis-seed``)."""

from __future__ import annotations

import json
import random

import msgpack
import threading
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_indexer.indexer import block_index, hit_rate
from cache_indexer.indexer.block_index import _native_index
from cache_indexer.indexer.block_index import BlockIndex, NativeBlockIndex
from cache_indexer.indexer.hit_rate import NativeQuery, score
from cache_indexer.indexer.l1_state import L1State
from cache_indexer.indexer.snapshot import decode_l1, encode_l1
from cache_indexer.schemas.block_hash import BlockHasher
from tests.conftest import needs_native


@pytest.fixture(autouse=True)
def _native():
    needs_native(hit_rate.NATIVE_QUERY, "the native index and query")


WIDS = [0, 1, 2, 63, 64, 65, 130]
HASHES = [0, 1, 2, 3, 5, 8, (1 << 63) + 7, (1 << 64) - 1]
op = st.one_of(
    st.tuples(st.just("store"), st.sampled_from(WIDS), st.lists(st.sampled_from(HASHES), max_size=6),
              st.sampled_from([None, 0, 1, 2])),
    st.tuples(st.just("remove"), st.sampled_from(WIDS), st.lists(st.sampled_from(HASHES), max_size=6),
              st.sampled_from([None, 0, 1, 2])),
    st.tuples(st.just("clear"), st.sampled_from(WIDS), st.just([]), st.just(None)),
    st.tuples(st.just("reload"), st.just(0), st.just([]), st.just(None)),
)


def _same(ref: BlockIndex, nat: NativeBlockIndex) -> None:
    assert nat.blocks == ref.blocks
    assert nat.worker_blocks == {w: n for w, n in ref.worker_blocks.items() if n}
    assert nat.groups == ref.groups and nat.copies == ref.copies
    assert len(nat) == len(ref) and nat.entries() == ref.entries()


def _reloaded(index: BlockIndex, into: type) -> BlockIndex:
    """``index`` through the snapshot encoding (its chunks) into an index of type ``into``."""
    out = into()
    out.restore_chunks(index.export_chunks(), index.worker_blocks, index.groups, index.copies)
    return out


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(op, max_size=40))
def test_the_native_index_holds_what_the_reference_holds(ops):
    ref, nat = BlockIndex(), NativeBlockIndex()
    for kind, wid, hashes, group in ops:
        if kind == "store":
            ref.store(wid, hashes, group)
            nat.store(wid, hashes, group)
        elif kind == "remove":
            ref.remove(wid, hashes, group)
            nat.remove(wid, hashes, group)
        elif kind == "clear":
            assert nat.clear(wid) == ref.clear(wid)
        else:  # a snapshot, loaded crosswise: each kind reads what the other wrote
            ref, nat = _reloaded(nat, BlockIndex), _reloaded(ref, NativeBlockIndex)
        _same(ref, nat)


def test_large_tables_grow_shrink_and_delete_as_the_reference():
    """Thousands of hashes per worker through growth, deletions (entries shifted back, around the end of
    the table) and shrinking, checked against the reference as they go. The seed is printed."""
    seed = random.SystemRandom().randrange(1 << 32)
    print(f"seed={seed}")
    rng = random.Random(seed)
    ref, nat = BlockIndex(), NativeBlockIndex()
    pool = [rng.getrandbits(64) for _ in range(20_000)]
    for step in range(60):
        wid = rng.choice([0, 5, 64, 70])
        hashes = rng.sample(pool, rng.randrange(1, 3000))
        if rng.random() < 0.55:
            ref.store(wid, hashes)
            nat.store(wid, hashes)
        elif rng.random() < 0.9:
            ref.remove(wid, hashes)
            nat.remove(wid, hashes)
        else:
            assert nat.clear(wid) == ref.clear(wid)
        if step % 10 == 9:
            _same(ref, nat)
    for wid in (0, 5, 64, 70):  # down to empty (copies stored twice stay after one removal): the tables shrink
        ref.remove(wid, pool)
        nat.remove(wid, pool)
        _same(ref, nat)
        assert nat.clear(wid) == ref.clear(wid)
    _same(ref, nat)
    assert nat.entries() == 0 and nat.memory_bytes() < 64 * 1024


def test_churn_keeps_a_workers_list_bounded_and_a_clear_exact():
    """A worker's hash list keeps removed hashes until it is compacted: a store/remove churn of the same
    hashes must not grow it (or the memory) without bound, and a clear after it drops exactly what is held."""
    nat, rng = NativeBlockIndex(), random.Random(5)
    nat.store(1, [10**9 + i for i in range(1000)])  # another worker's blocks stay untouched
    for _ in range(2000):
        hs = [rng.randrange(1, 300) for _ in range(20)]
        nat.store(0, hs)
        nat.remove(0, hs[:15])
    memory = nat.memory_bytes()
    for _ in range(2000):
        hs = [rng.randrange(1, 300) for _ in range(20)]
        nat.store(0, hs)
        nat.remove(0, hs[:15])
    assert nat.memory_bytes() <= memory * 1.5
    held = {h for h, m in nat.blocks.items() if m & 1}
    assert nat.clear(0) == len(held) and nat.entries() == 1000
    assert set(nat.blocks) == {10**9 + i for i in range(1000)}


def test_compactions_keep_exactly_what_is_held_with_the_hash_0_and_repeats():
    """A worker's list is compacted many times over (its removed hashes dropped, a hash stored again
    after a removal listed once): held hashes, the hash 0 among them, and other workers' bits come out as
    the pure-Python index has them, and a clear after it drops exactly what is held."""
    ref, nat, rng = BlockIndex(), NativeBlockIndex(), random.Random(37)
    pool = [0, *range(1, 120), *(rng.getrandbits(64) for _ in range(80))]
    for index in (ref, nat):
        index.store(3, pool[::3])  # another worker shares some of the hashes
    for _ in range(3000):
        hs = list(dict.fromkeys(rng.sample(pool, 12)))
        gone = list(dict.fromkeys(rng.sample(pool, 12)))
        fresh = [h for h in hs if not ref.blocks.get(h, 0) & 1]  # (no second copies: not what is tested)
        for index in (ref, nat):
            index.store(0, fresh)
            index.remove(0, gone)
    _same(ref, nat)
    held = {h for h, m in ref.blocks.items() if m & 1}
    assert nat.clear(0) == len(held)
    assert {h for h, m in nat.blocks.items() if m & 1} == set()
    assert {h for h, m in nat.blocks.items() if m & 8} == set(pool[::3])


def test_a_clear_costs_the_workers_own_blocks_not_the_tables():
    """Clearing a worker (pod removal, AllBlocksCleared, a gap) looks at that worker's hashes only: the
    same for a worker of 100 blocks in a table of 1,000 entries and of 200,000, and at most twice what it
    holds (plus a constant) after any churn of stores and removals. A count, not a time."""
    rng = random.Random(3)
    visits = []
    for others in (1_000, 200_000):
        nat = NativeBlockIndex()
        for wid in range(10):
            nat.store(wid, [rng.getrandbits(64) for _ in range(others // 10)])
        mine = [rng.getrandbits(64) for _ in range(400)]
        for _ in range(50):  # churn: the worker's list gathers removed hashes until it is compacted
            nat.store(50, rng.sample(mine, 100))
            nat.remove(50, rng.sample(mine, 100))
        nat.store(50, mine[:100])
        held = nat.worker_blocks[50]
        before = nat.table.counts()[3]
        assert nat.clear(50) == held
        visits.append(nat.table.counts()[3] - before)
        assert visits[-1] <= 2 * held + 64 + 100, (visits[-1], held)
    assert visits[1] <= visits[0] * 2, f"a clear looked at {visits} hashes: it grew with the table"


def test_a_store_moves_what_it_adds_not_the_chunk():
    """Growing the table is spread over the stores that fill it: 64 workers x 12,000 blocks in one chunk
    (768k hashes), stored 4,096 at a time: a store moves about three times what it adds (the segments it
    pushes past their load), at worst ten times, never the chunk. One table per chunk moved all of it at
    once (35 ms at 1.6M hashes, on the event loop), and 256 segments of one size all grew within the same
    few stores (48 ms). A count, not a time."""
    rng = random.Random(5)
    nat = NativeBlockIndex()
    per_store, moved = 4096, []
    for wid in range(64):
        for _ in range(3):
            before = nat.table.counts()[5]
            nat.store(wid, [rng.getrandbits(64) for _ in range(per_store)])
            moved.append(nat.table.counts()[5] - before)
    total = nat.entries()
    assert total == 64 * 3 * per_store
    tail = moved[len(moved) // 4:]  # past the first stores, which add more than the chunk held
    assert max(tail) <= 10 * per_store, sorted(tail)[-5:]
    assert sum(tail) <= 4 * per_store * len(tail), sum(tail) / len(tail)
    assert sum(moved) >= total // 2, "the table did grow"


def _states(events: list[tuple[str, int, list[int]]]) -> tuple[L1State, L1State]:
    ref, nat = L1State(), L1State()
    ref.index = BlockIndex()
    assert isinstance(nat.index, NativeBlockIndex)
    for i, (pod, rank, hashes) in enumerate(events):
        msg = {"type": "batch", "pod": pod, "rank": rank, "gen": 1, "seq": 0,
               "events": [{"kind": "stored", "hashes": hashes, "medium": "GPU"}]}
        ref.apply(msg)
        nat.apply(msg)
    return ref, nat


def _native_answer(hasher, tokens, bs, salt, pods, tiers, raw: bool):
    query = NativeQuery.prepare(hasher, json.dumps(tokens).encode() if raw else array("Q", tokens), bs, salt,
                                pods, tiers)
    assert query is not None
    return query.result(query.run())


@settings(max_examples=80, deadline=None)
@given(algo=st.sampled_from(["sha256_cbor", "sha256"]), bs=st.sampled_from([1, 3, 4, 16]),
       salt=st.sampled_from(["", "s"]), extra=st.sampled_from([0, 70]), raw=st.booleans(),
       l1=st.lists(st.tuples(st.integers(1, 12), st.lists(st.integers(0, 19), max_size=20)), max_size=8),
       l3=st.lists(st.tuples(st.integers(1, 12), st.lists(st.integers(0, 19), max_size=20)), max_size=8),
       n_tokens=st.integers(0, 20 * 16), big=st.booleans())
def test_the_native_query_answers_as_the_reference(algo, bs, salt, extra, raw, l1, l3, n_tokens, big):
    hasher = BlockHasher(algo, "0")
    rng = random.Random(n_tokens)
    tokens = [rng.randrange(1 << 32 if big else 50_000) for _ in range(n_tokens)]
    chain = hasher.event_hashes(tokens, bs, cache_salt=salt or None)
    events = [(f"10.9.{w // 250}.{w % 250}", 0, [w + 1]) for w in range(extra)]  # ids past 64 for the rest
    tiers = []
    for holdings in (l1, l3):
        tiers.append(_states(events + [(f"10.0.0.{p}", p % 2, [chain[i] for i in held if i < len(chain)])
                                       for p, held in holdings]))
    pods = [f"10.0.0.{i}" for i in range(1, 13)] + ["10.0.0.1"]
    reference = score(hasher, tokens, bs, salt, pods, [ref for ref, _ in tiers])
    try:
        native = _native_answer(hasher, tokens, bs, salt, pods, [nat for _, nat in tiers], raw)
    except NotImplementedError:
        assert algo == "sha256" and any(t > 2**31 - 1 for t in tokens), "only pickle's LONG1 tokens are left to Python"
        return
    assert native == reference


def test_a_malformed_token_array_is_refused_by_the_native_query():
    _, nat = _states([("10.0.0.1", 0, [1])])
    query = NativeQuery.prepare(BlockHasher("sha256_cbor", "0"), b"[1, 2, -3]", 1, "", ["10.0.0.1"], [nat, None])
    with pytest.raises(ValueError, match="non-negative"):
        query.run()


def test_a_query_prepared_before_a_clear_does_not_count_the_next_owner_of_the_worker_id():
    """The worker id of a pod cleared between prepare (on the loop) and run (on a thread) may be given to
    another pod at once: the run must not count that pod's blocks for the first."""
    hasher = BlockHasher("sha256_cbor", "0")
    tokens = list(range(64))
    chain = hasher.event_hashes(tokens, 16)
    _, nat = _states([("10.0.0.1", 0, chain)])
    query = NativeQuery.prepare(hasher, array("Q", tokens), 16, "", ["10.0.0.1"], [nat, None])
    nat.apply({"type": "pod_removed", "pod": "10.0.0.1"})
    nat.apply({"type": "batch", "pod": "10.0.0.2", "rank": 0, "gen": 1, "seq": 0,
               "events": [{"kind": "stored", "hashes": chain, "medium": "GPU"}]})
    assert nat.workers.get("10.0.0.2", 0) == 0, "the id was reused"
    assert query.result(query.run()).scores[0].ratios == [0.0, 0.0]


def _v1_blob(state, seq: int) -> bytes:
    """A snapshot as versions before format 2 wrote it at any size: one merged pair of arrays, masks
    wider than 64 bits in the header."""
    blocks = state.index.blocks
    keys = array("Q", blocks)
    masks = array("Q", (m & ((1 << 64) - 1) for m in blocks.values()))
    header = {"format": "cache-indexer-l1-v1", "stream_seq": seq, "count": len(keys),
              "workers": [[pod, rank, wid] for (pod, rank), wid in state.workers.items()],
              "worker_blocks": list(state.index.worker_blocks.items()), "cursors": state.cursor_rows(),
              "wide": {str(i): m.to_bytes((m.bit_length() + 7) // 8, "little")
                       for i, m in enumerate(blocks.values()) if m >> 64}}
    head = msgpack.packb(header)
    return len(head).to_bytes(8, "little") + head + keys.tobytes() + masks.tobytes()


@pytest.mark.parametrize("workers,written", [(64, "cache-indexer-l1-v1"), (70, "cache-indexer-l1-v2")])
def test_snapshots_up_to_64_workers_are_written_as_earlier_versions_write_them(workers, written):
    """Replicas of this version and earlier ones share snapshots during a rolling upgrade: up to 64 workers
    both indexes write format 1 (one pair of arrays); past 64, format 2 (a pair per chunk of 64 workers,
    no merging walk), which an earlier replica refuses and rebuilds from the stream. Each loads into
    either index, and a format-1 snapshot with masks past 64 workers (as earlier versions wrote them)
    still loads."""
    events = [(f"10.0.{w // 250}.{w % 250}", 0, [7, 8, w + 100]) for w in range(workers)]
    ref, nat = _states(events)
    for blob, fmt in ((encode_l1(ref, 9), written), (encode_l1(nat, 9), written), (_v1_blob(ref, 9), "cache-indexer-l1-v1")):
        assert msgpack.unpackb(blob[8:8 + int.from_bytes(blob[:8], "little")])["format"] == fmt
        loaded, seq = decode_l1(blob)
        assert seq == 9 and loaded.index.blocks == ref.index.blocks
        assert type(loaded.index) is NativeBlockIndex


def test_queries_on_threads_see_whole_messages_while_events_and_snapshots_go_on():
    """Three threads query without the GIL, and a fourth through the native query threads, while the main thread applies messages (each storing a whole
    chain for one pod, or removing the pod) and takes snapshots: a query sees a pod's chain wholly or
    not at all (never part of a message), and at the end every answer equals the reference's."""
    hasher = BlockHasher("sha256_cbor", "0")
    tokens = list(range(16 * 64))
    chain = hasher.event_hashes(tokens, 16)
    pods = [f"10.0.0.{i}" for i in range(1, 9)]
    _, nat = _states([])
    stop, errors, answered = threading.Event(), [], [0]

    def ask() -> None:
        try:
            while not stop.is_set():
                query = NativeQuery.prepare(hasher, array("Q", tokens), 16, "", pods, [nat, None])
                for s in query.result(query.run()).scores:
                    if s.ratios[0] not in (0.0, 1.0):
                        errors.append(f"{s.pod}: {s.ratios[0]} (part of a message)")
                answered[0] += 1
        except Exception as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(repr(exc))

    def ask_the_pool() -> None:  # the native query threads: no Python (and no GIL) on them at all
        pool = _native_index.QueryPool(2)
        try:
            while not stop.is_set():
                query = NativeQuery.prepare(hasher, array("Q", tokens), 16, "", pods, [nat, None])
                for key in range(4):
                    pool.submit(key, *query.call_args)
                for _, out, exc in _collect(pool, 4):
                    if exc is not None:
                        raise exc
                    for s in query.result(out).scores:
                        if s.ratios[0] not in (0.0, 1.0):
                            errors.append(f"{s.pod}: {s.ratios[0]} (part of a message, on the pool)")
                answered[0] += 1
        except Exception as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(repr(exc))
        finally:
            pool.close()

    exporting = [nat]  # the state the exporter copies (the main thread replaces it at each reload)

    def export() -> None:  # a snapshot's copy of the tables, off the main thread, as the indexer takes it
        try:
            while not stop.is_set():
                for c, keys, masks in exporting[0].index.export_chunks():
                    assert len(keys) == len(masks) and c >= 0
        except Exception as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(repr(exc))

    threads = [threading.Thread(target=ask) for _ in range(3)] + [threading.Thread(target=ask_the_pool),
                                                                  threading.Thread(target=export)]
    for t in threads:
        t.start()
    rng = random.Random(11)
    seqs, gens, holding = dict.fromkeys(pods, 0), dict.fromkeys(pods, 1), dict.fromkeys(pods, False)
    try:
        for i in range(3000):
            pod = rng.choice(pods)
            if rng.random() < 0.05:
                nat.apply({"type": "pod_removed", "pod": pod})
                seqs[pod], gens[pod], holding[pod] = 0, i + 2, False
                nat.apply({"type": "reset", "pod": pod, "rank": 0, "gen": gens[pod], "next_seq": 0})
                continue
            # a message of 64 one-block events (a prefix growing or shrinking block by block as it is
            # applied): a query that saw part of it would answer k/64
            kind, hashes = ("removed", chain[::-1]) if holding[pod] else ("stored", chain)
            nat.apply({"type": "batch", "pod": pod, "rank": 0, "gen": gens[pod], "seq": seqs[pod],
                       "events": [{"kind": kind, "hashes": [h], "medium": "GPU"} for h in hashes]})
            seqs[pod] += 1
            holding[pod] = not holding[pod]
            if i % 500 == 0:
                nat, _ = decode_l1(encode_l1(nat, i))
                exporting[0] = nat
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not errors, errors[:5]
    assert answered[0] > 0
    reference = score(hasher, tokens, 16, "", pods, [_as_reference(nat), None])
    assert _native_answer(hasher, tokens, 16, "", pods, [nat, None], raw=False) == reference


def _as_reference(state: L1State) -> L1State:
    """The same state over the pure-Python index (through a snapshot)."""
    ref, _ = decode_l1(encode_l1(state, 0))
    ref.index = _reloaded(state.index, BlockIndex)
    return ref


def test_without_the_native_module_the_pure_index_is_used(monkeypatch):
    monkeypatch.setattr(block_index, "_native_index", None)
    assert type(block_index.new_block_index()) is BlockIndex


def test_the_digest_memo_answers_a_repeated_query_exactly():
    """A query thread remembers the digests of the blocks it hashed (keyed by the whole serialised block,
    so a hit is exact): asked again, it hashes nothing and answers the same; other salts, block sizes and
    encodings are other messages, answered as the reference answers them."""
    from cache_indexer.indexer import _native_index

    tokens = list(range(1000, 1000 + 64 * 16))
    answers = {}
    for algo in ("sha256_cbor", "sha256"):
        hasher = BlockHasher(algo, "0")
        for bs, salt in ((16, ""), (16, "s"), (32, "")):
            chain = hasher.event_hashes(tokens, bs, cache_salt=salt or None)
            ref, nat = _states([("10.0.0.1", 0, chain[:40]), ("10.0.0.2", 0, chain)])
            pods = ["10.0.0.1", "10.0.0.2"]
            want = score(hasher, tokens, bs, salt, pods, [ref, None])
            hits = _native_index.memo_stats()[0]
            first = _native_answer(hasher, tokens, bs, salt, pods, [nat, None], raw=False)
            again = _native_answer(hasher, tokens, bs, salt, pods, [nat, None], raw=True)
            assert first == again == want
            assert _native_index.memo_stats()[0] - hits >= len(chain) - 1, "the second query hashed nothing again"
            answers[(algo, bs, salt)] = [s.ratios[0] for s in want.scores]
    assert len(set(map(tuple, answers.values()))) > 1


def test_the_digest_memo_keeps_within_its_bound():
    """http.digestMemoBytes bounds the blocks a thread's memo keeps; past it blocks are hashed, not kept,
    and answers do not change. 0: no memo at all."""
    from cache_indexer.indexer import _native_index
    from cache_indexer.indexer.hit_rate import configure_native_query

    hasher = BlockHasher("sha256_cbor", "0")
    tokens = [random.Random(1).randrange(150000) for _ in range(32768)]
    chain = hasher.event_hashes(tokens, 16)
    ref, nat = _states([("10.0.0.1", 0, chain)])
    want = score(hasher, tokens, 16, "", ["10.0.0.1"], [ref, None])
    try:
        configure_native_query(100_000)
        assert _native_answer(hasher, tokens, 16, "", ["10.0.0.1"], [nat, None], raw=False) == want
        hits, misses, kept = _native_index.memo_stats()
        assert misses == 2048 and 0 < kept <= 100_000, (hits, misses, kept)
        configure_native_query(0)
        assert _native_answer(hasher, tokens, 16, "", ["10.0.0.1"], [nat, None], raw=False) == want
        assert _native_index.memo_stats() == (0, 0, 0)
    finally:
        configure_native_query(8 << 20)


def _collect(pool, n: int, timeout: float = 30.0) -> list:
    """The next n answers of a QueryPool, waiting on its descriptor (bounded)."""
    import select
    import time

    got, deadline = [], time.monotonic() + timeout
    while len(got) < n:
        assert time.monotonic() < deadline, f"{len(got)} of {n} answers after {timeout}s"
        select.select([pool.fileno()], [], [], 0.5)
        got += pool.done()
    return got


def test_the_query_threads_answer_as_the_calling_thread_does():
    """QueryPool runs query() on native threads: every answer, and every refusal (a malformed array, a
    pickle token only Python encodes), equals what query() gives on the calling thread."""
    rng = random.Random(5)
    hasher, pickle = BlockHasher("sha256_cbor", "0"), BlockHasher("sha256", "0")
    tokens = [rng.randrange(150_000) for _ in range(16 * 40)]
    chain = hasher.event_hashes(tokens, 16)
    _, nat = _states([(f"10.0.0.{p}", 0, chain[:p * 5]) for p in range(1, 9)])
    pods = [f"10.0.0.{p}" for p in range(1, 10)]
    cases = []
    for i in range(60):
        cut = rng.randrange(len(tokens))
        text = json.dumps(tokens[:cut]).encode()
        kind = i % 4
        if kind == 1:
            text = text[:-1] + b", -1]"  # refused: ValueError
        raw = array("Q", [2**40] + tokens[:max(cut, 16)]) if kind == 3 else text  # block 0: pickle LONG1
        query = NativeQuery.prepare(pickle if kind == 3 else hasher, raw, 16, "s" if kind == 2 else "", pods,
                                    [nat, None])
        cases.append(query.call_args)
    pool = _native_index.QueryPool(3)
    try:
        for key, args in enumerate(cases):
            pool.submit(key, *args)
        answers = {key: (out, exc) for key, out, exc in _collect(pool, len(cases))}
    finally:
        pool.close()
    assert sorted(answers) == list(range(len(cases)))
    kinds = set()
    for key, args in enumerate(cases):
        out, exc = answers[key]
        try:
            want, want_exc = _native_index.query(*args), None
        except (ValueError, NotImplementedError) as e:
            want, want_exc = None, e
        assert out == want
        assert type(exc) is type(want_exc) and str(exc) == str(want_exc)
        kinds.add(type(exc).__name__)
    assert kinds == {"NoneType", "ValueError", "NotImplementedError"}


def test_closed_query_threads_drop_what_is_queued_and_take_nothing_more():
    hasher = BlockHasher("sha256_cbor", "0")
    tokens = list(range(16 * 200))
    _, nat = _states([("10.0.0.1", 0, hasher.event_hashes(tokens, 16))])
    query = NativeQuery.prepare(hasher, array("Q", tokens), 16, "", ["10.0.0.1"], [nat, None])
    pool = _native_index.QueryPool(1)
    for key in range(300):
        pool.submit(key, *query.call_args)
    pool.close()  # one may be running: it finishes; the rest are freed unrun
    pool.close()
    assert pool.done() == []
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(0, *query.call_args)
    with pytest.raises(ValueError, match="threads"):
        _native_index.QueryPool(0)


def test_the_digest_memo_keeps_two_blocks_that_fall_on_one_place():
    """The memo is two-way: of a 2,048-block request asked again, nearly every block is a hit (a
    direct-mapped memo of the same size loses about one block in sixteen to its neighbours)."""
    hasher = BlockHasher("sha256_cbor", "0")
    tokens = [random.Random(2).randrange(150000) for _ in range(32768)]
    _, nat = _states([("10.0.0.1", 0, hasher.event_hashes(tokens, 16))])
    _native_answer(hasher, tokens, 16, "", ["10.0.0.1"], [nat, None], raw=False)
    hits, misses, _ = _native_index.memo_stats()
    _native_answer(hasher, tokens, 16, "", ["10.0.0.1"], [nat, None], raw=False)
    again_hits, again_misses, _ = _native_index.memo_stats()
    assert again_misses - misses <= 2048 // 50, (again_hits - hits, again_misses - misses)


def test_the_replicas_periodic_gauges_do_not_walk_the_table():
    """A replica sets its index gauges every 2 s on the event loop. Entries, memory and the block count
    cost a pass over the chunk and worker headers, never a walk of the table: the distinct count past 64
    workers walks it (0.25 s at 2M entries over 1,000 workers, twice a tier per update before). The
    block count is the distinct count up to 64 workers, past that a hash once per 64-worker chunk."""
    from cache_indexer.indexer.service import Indexer
    from cache_indexer.infra.metrics import Metrics
    from cache_indexer.schemas.config import Config

    small_ref, small = _states([(f"10.0.0.{w}", 0, [7, 8, w + 100]) for w in range(1, 40)])
    assert small.index.block_count() == len(small_ref.index) == 41
    ref, nat = _states([(f"10.0.{w // 250}.{w % 250}", 0, [7, 8, w + 100]) for w in range(130)])
    indexer = Indexer(Config(), Metrics())
    indexer.l1 = nat
    scans = nat.index.table.counts()[4]
    indexer.update_gauges()
    assert nat.index.table.counts()[4] == scans, "the gauges walked the table"
    gauge = {s.labels["tier"]: s.value for f in indexer.metrics.registry.collect() if f.name == "cache_indexer_index_blocks"
             for s in f.samples}
    assert gauge["l1"] == 2 * 3 + 130 == nat.index.block_count()  # 7 and 8 in each of the 3 chunks
    assert nat.index.entries() == ref.index.entries() == 390 and len(nat.index) == len(ref.index) == 132
    assert nat.index.table.counts()[4] == scans + 1, "len() is the one that walks (the counter counts)"


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["store", "clear", "remove", "rank_removed", "reset"]),
                              st.integers(0, 5), st.integers(0, 2), st.integers(0, 6)), max_size=40))
def test_the_fleet_kept_between_queries_follows_workers_joining_leaving_and_ids_reused(ops):
    """/query reads every pod's workers once and keeps them while the worker tables do not change
    (``NativeTierQuery._fleet``), and the seed API the candidates' (``KeptCandidates``): after every step
    of a random stream (workers interned, cleared, removed, their ids handed to others), both answers equal
    the reference's over a pure-Python state."""
    from cache_indexer.indexer.hit_rate import KeptCandidates
    from cache_indexer.indexer.tier_match import NativeTierQuery, chain_keys, match_keys
    hasher = BlockHasher("sha256_cbor", "0")
    kept, candidates = KeptCandidates(), [f"10.0.0.{p}" for p in range(7)]  # a router's, the same each time
    tokens = list(range(96))
    chain = hasher.event_hashes(tokens, 16)
    ref, nat = L1State(), L1State()
    ref.index = BlockIndex()
    seqs: dict = {}
    for kind, p, rank, n in ops:
        pod = f"10.0.0.{p}"
        seq = seqs.get((pod, rank), 0)
        if kind == "store":
            msg = {"type": "batch", "pod": pod, "rank": rank, "gen": 1, "seq": seq,
                   "events": [{"kind": "stored", "hashes": chain[:n], "medium": "GPU"}]}
        elif kind == "clear":
            msg = {"type": "batch", "pod": pod, "rank": rank, "gen": 1, "seq": seq, "events": [{"kind": "cleared"}]}
        elif kind == "remove":
            msg = {"type": "pod_removed", "pod": pod}
        elif kind == "rank_removed":
            msg = {"type": "rank_removed", "pod": pod, "rank": rank}
        else:
            msg = {"type": "reset", "pod": pod, "rank": rank, "gen": 2, "next_seq": 0, "reason": "test"}
        seqs[(pod, rank)] = seq + 1 if kind in ("store", "clear") else 0
        for state in (ref, nat):
            state.apply(msg)
        query = NativeTierQuery.prepare(hasher, array("Q", tokens), 16, "", nat, None)
        got = query.result(query.native.run())
        assert got == match_keys(chain_keys(hasher, tokens, 16, ""), 6, ref, None), (kind, pod, rank, n)
        seed = NativeQuery.prepare(hasher, array("Q", tokens), 16, "", candidates, [nat, None], kept=kept)
        assert seed.result(seed.run()) == score(hasher, tokens, 16, "", candidates, [ref, None]), (kind, pod, rank, n)
