"""The snapshot store against a real nats-server: round trip, and reads that race the writer's pruning
(an object deleted while a replica loads it must cost a retry, never a hang)."""

from __future__ import annotations

import asyncio
import random

import nats
import pytest

from cache_indexer.indexer.l1_state import L1State
from cache_indexer.indexer.snapshot import PartsReader, SnapshotStore, encode_l1, object_name
from tests.conftest import wait_for


def state_with(n_blocks: int, seed: int) -> L1State:
    rng = random.Random(seed)
    st = L1State()
    for pod in range(3):
        hashes = [rng.getrandbits(64) for _ in range(n_blocks)]
        events = [{"kind": "stored", "hashes": hashes}]
        if pod == 2:  # a hybrid model: a second KV-cache group holding part of the blocks
            events.append({"kind": "stored", "hashes": hashes[: n_blocks // 2], "group_idx": 1})
        st.apply({"type": "batch", "pod": f"127.0.0.{pod + 1}", "rank": 0, "gen": 0, "seq": 0, "events": events})
    return st


def contents(st: L1State) -> tuple[dict[int, int], dict[int, dict[int, int]]]:
    return dict(st.index.blocks), st.index.groups


@pytest.fixture
async def js(nats_url):
    nc = await nats.connect(nats_url)
    yield nc.jetstream()
    await nc.close()


@pytest.fixture
def buckets(stream_prefix):
    return f"{stream_prefix}-snap", f"{stream_prefix}-meta"


async def test_round_trip_through_the_object_store(js, buckets):
    store = SnapshotStore(js, *buckets)
    assert await store.load() is None
    st = state_with(100_000, 1)  # several chunks
    assert await store.save(encode_l1(st, 42), 42)
    assert not await store.save(encode_l1(st, 41), 41), "an older snapshot never replaces a newer one"
    loaded, seq = await store.load()
    assert seq == 42 and contents(loaded) == contents(st)
    assert len(loaded.index.groups[loaded.workers.get("127.0.0.3", 0)]) == 50_000


async def save_without_chunks(js, store: SnapshotStore, st: L1State, seq: int) -> None:
    """A snapshot whose object metadata stands but whose chunks are gone: what a concurrent prune leaves
    between a reader's get_info and its first chunk."""
    assert await store.save(encode_l1(st, seq), seq)
    obs, _ = await store._stores()
    info = await obs.get_info((await store.pointer()).name)
    await js.purge_stream(f"OBJ_{store.bucket}", subject=f"$O.{store.bucket}.C.{info.nuid}")


async def test_a_snapshot_whose_chunks_vanished_is_given_up_within_the_bound(js, buckets):
    store = SnapshotStore(js, *buckets, chunk_timeout=0.3, load_attempts=3)
    await save_without_chunks(js, store, state_with(50_000, 2), 7)
    assert await asyncio.wait_for(store.load(), 10) is None
    assert store.failed_loads == 3


async def test_a_reader_whose_snapshot_vanished_retries_with_the_newer_one(js, buckets):
    store = SnapshotStore(js, *buckets, chunk_timeout=0.3, load_attempts=50)
    await save_without_chunks(js, store, state_with(1000, 3), 7)
    loading = asyncio.create_task(store.load())
    await wait_for(lambda: store.failed_loads >= 1, 10, "the first read to give up")
    newer = state_with(1000, 4)
    assert await SnapshotStore(js, *buckets).save(encode_l1(newer, 9), 9)
    loaded, seq = await asyncio.wait_for(loading, 20)
    assert seq == 9 and contents(loaded) == contents(newer)


async def test_loads_racing_a_writer_that_prunes_everything_but_the_newest(js, buckets):
    """keep=1: every save deletes the snapshot a reader may be in the middle of."""
    writer = SnapshotStore(js, *buckets, keep=1)
    reader = SnapshotStore(js, *buckets, chunk_timeout=0.5, load_attempts=100)
    states = {seq: state_with(20_000, seq) for seq in range(1, 4)}
    assert await writer.save(encode_l1(states[1], 1), 1)
    stop = asyncio.Event()

    async def write_forever():
        seq = 1
        while not stop.is_set():
            seq += 1
            assert await writer.save(encode_l1(states[(seq - 1) % 3 + 1], seq), seq)

    task = asyncio.create_task(write_forever())
    try:
        for _ in range(15):
            loaded, seq = await asyncio.wait_for(reader.load(), 30)
            assert contents(loaded) == contents(states[(seq - 1) % 3 + 1])
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def test_snapshots_of_a_recreated_stream_are_pruned_first(nats_url, stream_prefix):
    """After the stream was recreated its seqs start again: pruning by name alone would keep the old
    stream's snapshots (higher seqs) and delete the new ones."""
    nc = await nats.connect(nats_url)
    try:
        store = SnapshotStore(nc.jetstream(), f"{stream_prefix}-snap", f"{stream_prefix}-meta", keep=2)
        for seq in (900, 1000):
            assert await store.save(encode_l1(L1State(), seq), seq, "old-stream")
        for seq in (10, 20, 30):
            assert await store.save(encode_l1(L1State(), seq), seq, "new-stream")
        obs, _ = await store._stores()
        names = sorted(o.name for o in await obs.list() if not o.deleted)
        assert len(names) == 2 and all(n.startswith(("l1-000000000020.", "l1-000000000030.")) for n in names), names
        assert (await store.load("new-stream"))[1] == 30
    finally:
        await nc.close()


async def test_a_meta_bucket_that_did_not_answer_once_is_asked_again(js, buckets, monkeypatch):
    """The CI run of a three-node cluster losing a node: the object store answered, the meta bucket
    timed out, and every later call failed with AttributeError on the store left None."""
    import cache_indexer.infra.streams as streams

    real, calls = streams.kv_bucket, []

    async def first_times_out(*args, **kwargs):
        calls.append(args)
        if len(calls) == 1:
            raise asyncio.TimeoutError()
        return await real(*args, **kwargs)
    monkeypatch.setattr(streams, "kv_bucket", first_times_out)
    store = SnapshotStore(js, *buckets)
    with pytest.raises(asyncio.TimeoutError):
        await store.pointer()
    assert await store.pointer() is None and len(calls) == 2
    assert await store.save(encode_l1(state_with(10, 3), 5), 5)
    assert (await store.pointer()).stream_seq == 5


def test_a_snapshot_in_pieces_reads_as_its_bytes_whatever_the_chunk_size():
    """The indexer hands the object store a snapshot's pieces (``PartsReader``), never one joined copy:
    read in chunks of any size, they are the bytes ``encode`` joins. The seed is printed."""
    seed = random.SystemRandom().randrange(1 << 32)
    print(f"seed={seed}")
    rng = random.Random(seed)
    for _ in range(50):
        parts = [rng.randbytes(rng.choice([0, 1, 7, 8, 100, 5000])) for _ in range(rng.randrange(0, 12))]
        reader = PartsReader(parts)
        assert reader.size == sum(map(len, parts))
        size, out = rng.choice([1, 3, 64, 4096, 1 << 20]), bytearray()
        while True:
            buf = bytearray(size)
            n = reader.readinto(buf)
            if not n:
                break
            out += buf[:n]
        assert bytes(out) == b"".join(parts)


async def test_a_snapshots_pieces_are_freed_one_at_a_time_with_the_loop_free_between():
    pieces = [bytes(1000) for _ in range(20)]
    reader = PartsReader(pieces)
    del pieces
    turns = 0

    async def other() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)
    ticking = asyncio.create_task(other())
    await asyncio.sleep(0)
    before = turns
    await reader.release()
    ticking.cancel()
    assert reader.readinto(bytearray(10)) == 0, "nothing left"
    assert turns - before >= 19, "the loop ran other work between two pieces"


async def test_a_late_prune_never_deletes_the_object_the_pointer_names(js, buckets):
    """Issue 36 #6a: a writer paused between moving the pointer and pruning wakes up after the next lease
    holder wrote a snapshot of the stream as recreated since (another tag: it sorts first, to be pruned).
    Its prune must leave the object the pointer names; and no two uploads share a name."""
    old_writer = SnapshotStore(js, *buckets, keep=1)
    assert await SnapshotStore(js, *buckets, keep=10).save(encode_l1(L1State(), 900), 900, "old-stream")
    old_name = (await old_writer.pointer()).name
    st = state_with(10, 5)
    assert await SnapshotStore(js, *buckets, keep=10).save(encode_l1(st, 10), 10, "new-stream")
    pointer = await old_writer.pointer()
    await old_writer._prune(old_name)  # the paused writer's prune, late
    obs, _ = await old_writer._stores()
    assert await obs.get_info(pointer.name), "the pointer's object stands"
    loaded, seq = await SnapshotStore(js, *buckets).load("new-stream")
    assert seq == 10 and contents(loaded) == contents(st)
    assert len({object_name(7, "s") for _ in range(100)}) == 100
