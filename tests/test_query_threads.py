"""``QueryThreads``: the native query threads as an awaitable for the event loop. Answers equal the
calling thread's, a cancelled request's answer is dropped when it comes (nothing waits for it, nothing
leaks), closing cancels what waits, and the threads answer only the loop that started them."""

from __future__ import annotations

import asyncio
import json
import random
from array import array

import pytest

from cache_indexer.indexer import hit_rate
from cache_indexer.indexer.hit_rate import NativeQuery
from cache_indexer.indexer.l1_state import L1State
from cache_indexer.indexer.query_threads import QueryThreads
from cache_indexer.schemas.block_hash import BlockHasher
from tests.conftest import needs_native

HASHER = BlockHasher("sha256_cbor", "0")
TOKENS = [random.Random(9).randrange(150_000) for _ in range(16 * 300)]
PODS = [f"10.0.0.{p}" for p in range(1, 9)]


@pytest.fixture(autouse=True)
def _native():
    needs_native(hit_rate.NATIVE_QUERY, "the native index and query")


@pytest.fixture
def l1():
    state = L1State()
    chain = HASHER.event_hashes(TOKENS, 16)
    for p, pod in enumerate(PODS):
        state.apply({"type": "batch", "pod": pod, "rank": 0, "gen": 1, "seq": 0,
                     "events": [{"kind": "stored", "medium": "GPU", "hashes": chain[:(p + 1) * 30]}]})
    return state


def _query(l1, n_tokens: int, text: bytes | None = None) -> NativeQuery:
    tokens = text if text is not None else json.dumps(TOKENS[:n_tokens]).encode()
    return NativeQuery.prepare(HASHER, tokens, 16, "", PODS, [l1, None])


async def test_answers_equal_the_calling_threads(l1):
    threads = QueryThreads(2)
    try:
        queries = [_query(l1, n) for n in range(0, len(TOKENS), 97)]
        answers = await asyncio.gather(*(threads.run(q) for q in queries))
        assert answers == [q.run() for q in queries]
        assert len({a[1] for a in answers}) > 10, "the answers differ from one another"
        with pytest.raises(ValueError, match="non-negative"):
            await threads.run(_query(l1, 0, b"[1, 2, -3]"))
    finally:
        threads.close()


async def test_a_cancelled_query_is_dropped_and_the_others_are_answered(l1):
    threads = QueryThreads(1)
    try:
        long = [asyncio.ensure_future(threads.run(_query(l1, len(TOKENS)))) for _ in range(20)]
        await asyncio.sleep(0)  # submitted
        for task in long[::2]:
            task.cancel()
        answers = await asyncio.gather(*long[1::2])
        assert all(a == answers[0] for a in answers)
        assert all(t.cancelled() for t in long[::2])
        async def drained() -> bool:
            while threads._waiting:
                await asyncio.sleep(0.01)
            return True
        assert await asyncio.wait_for(drained(), 10)
        assert await threads.run(_query(l1, 160)) == _query(l1, 160).run()
    finally:
        threads.close()


async def test_closing_cancels_what_waits_and_a_later_run_starts_again(l1):
    threads = QueryThreads(1)
    waiting = [asyncio.ensure_future(threads.run(_query(l1, len(TOKENS)))) for _ in range(30)]
    await asyncio.sleep(0)
    threads.close()
    threads.close()
    results = await asyncio.gather(*waiting, return_exceptions=True)
    assert all(isinstance(r, asyncio.CancelledError) or isinstance(r, tuple) for r in results)
    assert any(isinstance(r, asyncio.CancelledError) for r in results), "the queued ones were cancelled"
    try:
        assert await threads.run(_query(l1, 160)) == _query(l1, 160).run()
    finally:
        threads.close()


def test_the_threads_answer_only_the_loop_that_started_them(l1):
    threads = QueryThreads(1)
    try:
        asyncio.run(threads.run(_query(l1, 160)))
        with pytest.raises(RuntimeError, match="event loop that started them"):
            asyncio.run(threads.run(_query(l1, 160)))
    finally:
        threads.close()


async def test_tokens_given_as_uint64s_are_answered_too(l1):
    threads = QueryThreads(1)
    try:
        query = NativeQuery.prepare(HASHER, array("Q", TOKENS), 16, "", PODS, [l1, None])
        assert await threads.run(query) == query.run()
    finally:
        threads.close()


# -- at fleet shape (issue 35) -----------------------------------------------------------------------------
def fleet_under_load(seed: int, seconds: float) -> None:
    """Three tiers (GPU and CPU over the L1 workers, L3 over its own), ids spread over 2,000 (~32 chunks)
    in random order. Threads query while the main thread changes the tables for ``seconds``: two Python
    threads through ``_native_index.query`` (the GIL released), one through a ``QueryPool`` (native
    threads), one copying the tables (``export_chunks``, as snapshots are taken). The main thread stores,
    removes, clears, releases and reuses ids (a table's chunk array and worker array grow as ids past
    them come), stores thousands of hashes at a time (segments grow), and swaps a tier for its snapshot.
    Atomic pods store their document's whole chain or remove it in one batch: a query of that document
    answers 0 or 1 for them, never part of a batch. At the end every answer (calling thread, QueryPool,
    QueryThreads) equals ``score`` over the references, and the indexes hold what they hold. Prints
    ``settled`` (the child process's test checks it)."""
    import select
    import threading
    import time

    from cache_indexer.indexer.block_index import BlockIndex, NativeBlockIndex, WorkerTable, _native_index
    from cache_indexer.indexer.hit_rate import score
    from tests.native_fleet import BS, CHAINS, DOCS, HASHER, FleetTier, Runner, random_hashes, same_index, spread

    rng = random.Random(seed)
    tiers = ("GPU", "CPU", "L3")
    table_of = {"GPU": "l1", "CPU": "l1", "L3": "l3"}
    workers = {"l1": WorkerTable(), "l3": WorkerTable()}
    for table in workers.values():
        spread(table, 2000, rng)
    nat = {t: NativeBlockIndex() for t in tiers}
    ref = {t: BlockIndex() for t in tiers}
    atomic = [(f"10.0.1.{i}", i % len(DOCS)) for i in range(24)]  # (pod, its document)
    holding = {(pod, t): False for pod, _ in atomic for t in tiers}
    noise = [f"10.0.2.{i}" for i in range(200)]
    lock = threading.Lock()  # the event loop's part: workers interned and released, queries prepared
    stop, errors, answered = threading.Event(), [], [0, 0, 0]

    def view(indexes) -> list:
        return [FleetTier(workers[table_of[t]], indexes[t]) for t in tiers]

    def prepared(r: random.Random):
        d = r.randrange(len(DOCS))
        pods = [p for p, doc in atomic if doc == d] + r.sample(noise, 6)
        with lock:
            return NativeQuery.prepare(HASHER, array("Q", DOCS[d]), BS, "", pods, view(nat)), d, pods

    def whole(query, out, d, pods, where: str) -> None:
        for s in query.result(out).scores:
            if any(p == s.pod for p, doc in atomic if doc == d):
                for t, ratio in zip(tiers, s.ratios):
                    if ratio not in (0.0, 1.0):
                        errors.append(f"{s.pod} in {t}: {ratio} ({where}): part of a batch")

    def ask(k: int) -> None:
        r = random.Random(seed + k)
        try:
            while not stop.is_set():
                query, d, pods = prepared(r)
                whole(query, query.run(), d, pods, "query()")
                answered[0] += 1
        except Exception as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(repr(exc))

    def ask_the_pool() -> None:
        r = random.Random(seed + 9)
        pool = _native_index.QueryPool(2)
        try:
            while not stop.is_set():
                batch = [prepared(r) for _ in range(4)]
                for key, (query, _, _) in enumerate(batch):
                    pool.submit(key, *query.call_args)
                got, deadline = [], time.monotonic() + 60
                while len(got) < len(batch) and time.monotonic() < deadline:
                    select.select([pool.fileno()], [], [], 0.5)
                    got += pool.done()
                assert len(got) == len(batch), "the pool answered"
                for key, out, exc in got:
                    if exc is not None:
                        raise exc
                    query, d, pods = batch[key]
                    whole(query, out, d, pods, "QueryPool")
                answered[1] += 1
        except Exception as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(repr(exc))
        finally:
            pool.close()

    def export() -> None:
        try:
            while not stop.is_set():
                for t in tiers:
                    for c, keys, masks in nat[t].export_chunks():
                        assert len(keys) == len(masks) and len(keys) % 8 == 0 and 0 <= c < 1024
                answered[2] += 1
        except Exception as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(repr(exc))

    def both(t: str, method: str, *args) -> None:
        getattr(ref[t], method)(*args)
        getattr(nat[t], method)(*args)

    threads = [threading.Thread(target=ask, args=(k,)) for k in range(2)] + [
        threading.Thread(target=ask_the_pool), threading.Thread(target=export)]
    for th in threads:
        th.start()
    steps, end = 0, time.monotonic() + seconds
    try:
        while time.monotonic() < end and not errors:
            steps += 1
            r = rng.random()
            t = rng.choice(tiers)
            table = workers[table_of[t]]
            with lock:
                if r < 0.35:  # an atomic pod's whole chain, in or out, in one batch
                    pod, d = rng.choice(atomic)
                    wid = table.intern(pod, 0)
                    kind = "remove" if holding[(pod, t)] else "store"
                    with nat[t].batch():
                        nat[t].store(wid, CHAINS[d]) if kind == "store" else nat[t].remove(wid, CHAINS[d])
                    getattr(ref[t], kind)(wid, CHAINS[d])
                    holding[(pod, t)] = not holding[(pod, t)]
                elif r < 0.65:  # only workers of ids below 600 offload: the CPU table's worker array
                    # doubles past its chunks, and the others' CPU removals fall in between
                    wid = table.intern(rng.choice(noise), rng.randrange(2))
                    both("GPU" if t == "CPU" and wid >= 600 else t, "store", wid, random_hashes(rng),
                         rng.choice([None, None, 1]))
                elif r < 0.85:  # removals by any noise pod: most never stored on the CPU
                    wid = table.get(rng.choice(noise), rng.randrange(2))
                    if wid is not None:
                        both(t, "remove", wid, random_hashes(rng), rng.choice([None, None, 1]))
                elif r < 0.95:  # a pod leaves as the product lets it go: cleared everywhere, id released
                    pod, d = rng.choice(atomic) if rng.random() < 0.3 else (rng.choice(noise), None)
                    name = table_of[t]
                    for rank, wid in list(table.pod_workers(pod).items()):
                        for tt in tiers:
                            if table_of[tt] == name:
                                with nat[tt].batch():
                                    nat[tt].clear(wid)
                                ref[tt].clear(wid)
                                if d is not None:
                                    holding[(pod, tt)] = False
                        table.release(pod, rank)
                else:  # a snapshot: taken here too, and the tier swapped for its copy
                    fresh = NativeBlockIndex()
                    src = nat[t]
                    fresh.restore_chunks(src.export_chunks(), src.worker_blocks, src.groups, src.copies)
                    nat[t] = fresh
    finally:
        stop.set()
        for th in threads:
            th.join(60)
    assert not any(th.is_alive() for th in threads), "the threads stopped"
    assert not errors, errors[:5]
    assert all(answered), f"every kind of reader ran: {answered}"
    for t in tiers:
        same_index(ref[t], nat[t], t)
    pool, runner = _native_index.QueryPool(2), Runner(2)
    try:
        for d in range(len(DOCS)):
            pods = [p for p, _ in atomic] + noise[::7]
            want = score(HASHER, DOCS[d], BS, "", pods, view(ref))
            query = NativeQuery.prepare(HASHER, array("Q", DOCS[d]), BS, "", pods, view(nat))
            pool.submit(d, *query.call_args)
            got = []
            while not got:
                select.select([pool.fileno()], [], [], 1.0)
                got = pool.done()
            out = query.run()
            assert got == [(d, out, None)], "the pool answers as the calling thread"
            assert runner.run(query) == out, "QueryThreads answers as the calling thread"
            assert query.result(out) == want, f"document {d}: the native answer differs from score's"
    finally:
        pool.close()
        runner.close()
    print(f"settled: {steps} steps, {answered} answers, {sum(nat[t].entries() for t in tiers)} entries")


def test_queries_on_threads_at_fleet_shape_while_the_tables_change_and_grow():
    """``fleet_under_load`` in a child process (a crash there is this test's failure, with its signal;
    under ThreadSanitizer, .ci/native, its reports go where the parent's go). FLEET_LOAD_SEED replays
    the main thread's changes (the threads' timing, not)."""
    import os

    from tests.native_fleet import PERTURB, child, died

    seed = int(os.environ.get("FLEET_LOAD_SEED") or random.SystemRandom().randrange(1 << 32))
    print(f"FLEET_LOAD_SEED={seed}")
    seconds = float(os.environ.get("FLEET_LOAD_SECONDS", "3"))
    done = child(["-c", f"from tests.test_query_threads import fleet_under_load; fleet_under_load({seed}, {seconds})"],
                 timeout=300 + 10 * seconds, env=PERTURB)
    assert done.returncode == 0 and "settled" in done.stdout, \
        f"{died(done)}; FLEET_LOAD_SEED={seed}\n{done.stdout[-2000:]}\n{done.stderr[-5000:]}"
    print(done.stdout.strip())
