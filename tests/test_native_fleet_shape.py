"""Issue 35's cases, each at the shape that broke it: worker ids past the first chunks, reached by a
removal, a lookup or a clear without a store; a worker id released and reused between a query's
preparation and its walk (L3, and the Python walk between its slices); the batch lock used from two
threads and by a query inside its own batch; a store that runs out of memory half-way; a process that
exits while the query threads hash; the argument checks shared with the Python index.

Each crash reproduces in a subprocess, so a segfault fails its test instead of the run."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from array import array

import pytest

from cache_indexer.indexer import hit_rate
from cache_indexer.indexer.block_index import BlockIndex, NativeBlockIndex, _native_index
from cache_indexer.indexer.hit_rate import NativeQuery
from cache_indexer.indexer.l1_state import L1State
from cache_indexer.indexer.l3_state import L3State
from cache_indexer.indexer.tier_match import KeyWalk, chain_keys
from cache_indexer.schemas.block_hash import BlockHasher
from tests.conftest import needs_native

HASHER = BlockHasher("sha256_cbor")
BS = 4


@pytest.fixture(autouse=True)
def _native():
    needs_native(hit_rate.NATIVE_QUERY, "the native index and query")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)


def _chain(tokens: list[int]) -> list[int]:
    return list(chain_keys(HASHER, tokens, BS, ""))


# -- 1. worker ids past the chunks stored ------------------------------------------------------------
@pytest.mark.parametrize("call", ["t.remove(65, list(range(1, 5000)))", "t.holds(65, list(range(1, 5000)))",
                                  "t.clear(127)", "t.remove(4000, [1])", "t.holds(70, [1])"])
def test_a_worker_past_the_chunks_stored_is_reached_without_a_store(call):
    """nworkers grew by doubling (33 -> 68 after worker 40) while the chunks covered worker 63 only: a
    removal, a lookup or a clear for worker 65 indexed past the chunk array (SIGSEGV)."""
    out = _run(f"""
        from indexer import _native_index
        t = _native_index.Table()
        t.store(33, [1])
        t.store(40, [1])
        {call}
        t.store(65, [2])
        assert t.as_dict() == {{1: 1 << 33 | 1 << 40, 2: 1 << 65}}, t.as_dict()
        print("ok")
    """)
    assert out.returncode == 0 and out.stdout.strip() == "ok", (out.returncode, out.stderr[-2000:])


def test_a_replica_survives_workers_past_64_whose_first_gpu_event_is_a_removal():
    """The replica's own path: 130 engines, the later ones interned through the CPU medium first, or
    sending a removal of blocks stored before the bridge subscribed, then storing."""
    out = _run("""
        from cache_indexer.indexer.l1_state import L1State
        s = L1State()
        def batch(pod, seq, events):
            s.apply({"type": "batch", "pod": pod, "rank": 0, "gen": 1, "seq": seq, "events": events})
        for i in range(130):
            pod = f"10.0.0.{i}"
            if i % 3 == 0:
                batch(pod, 0, [{"kind": "stored", "medium": "CPU", "hashes": [1000 + i]}])
            elif i % 3 == 1:
                batch(pod, 0, [{"kind": "removed", "medium": "GPU", "hashes": list(range(1, 3000))}])
            else:
                batch(pod, 0, [{"kind": "stored", "medium": "GPU", "hashes": [i]}])
            batch(pod, 1, [{"kind": "removed", "medium": "GPU", "hashes": list(range(5000, 8000))},
                           {"kind": "stored", "medium": "GPU", "hashes": [10_000 + i]}])
        assert s.index.entries() == 130 + 43 and s.media["CPU"].entries() == 44, s.index.entries()
        print("ok")
    """)
    assert out.returncode == 0 and out.stdout.strip() == "ok", (out.returncode, out.stderr[-2000:])


# -- 2. a worker id reused between a query's preparation and its walk -------------------------------
def _l3_diff(seq: int, added: dict, removed: dict) -> dict:
    return {"type": "l3_diff", "master": "m", "origin": 1, "seq": seq, "added": added, "removed": removed}


def test_an_l3_worker_id_reused_before_the_walk_is_not_credited_to_the_pod_that_left():
    """L3 freed a worker id without clearing it in the table, so its epoch stayed: a query prepared for
    pod A (id 5, epoch 0) walked after A emptied and B took id 5 reported B's blocks as A's ratio."""
    tokens = list(range(1, 8 * BS + 1))
    keys = _chain(tokens)
    l3 = L3State()
    l3.apply({"type": "l3_full", "master": "m", "origin": 1, "seq": 0, "pods": {f"10.0.0.{i}": [i] for i in range(5)}})
    l3.apply(_l3_diff(1, {"10.0.1.1": [999]}, {}))  # pod A
    wid_a = l3.pod_workers("10.0.1.1")[0]
    query = NativeQuery.prepare(HASHER, array("Q", tokens), BS, "", ["10.0.1.1", "10.0.2.2"], [None, l3])
    l3.apply(_l3_diff(2, {"10.0.2.2": keys}, {"10.0.1.1": [999]}))  # A leaves, B takes its id
    assert l3.pod_workers("10.0.2.2")[0] == wid_a, "the scenario needs the id reused"
    ratios = [s.ratios[1] for s in query.result(query.run()).scores]
    assert ratios == [0.0, 0.0], "A's ratio is B's blocks; B was not a candidate when the query was prepared"
    fresh = NativeQuery.prepare(HASHER, array("Q", tokens), BS, "", ["10.0.1.1", "10.0.2.2"], [None, l3])
    assert [s.ratios[1] for s in fresh.result(fresh.run()).scores] == [0.0, 1.0]


@pytest.mark.parametrize("native", [True, False])
def test_the_python_walk_drops_a_worker_released_between_its_slices(native):
    """KeyWalk looks the workers up once; fed in slices, the loop runs between them: a pod released there
    and its id reused must not lend the new pod's blocks to the old one (L1 and L3 alike)."""
    tokens = list(range(1, 8 * BS + 1))
    keys = _chain(tokens)
    l1, l3 = L1State(), L3State()
    if not native:
        l1.index, l1.media = BlockIndex(), {m: BlockIndex() for m in l1.media}
        l3.index = BlockIndex()
    l1.apply({"type": "batch", "pod": "A", "rank": 0, "gen": 1, "seq": 0,
              "events": [{"kind": "stored", "hashes": keys[:4]}]})
    l3.apply({"type": "l3_full", "master": "m", "origin": 1, "seq": 0, "pods": {"A": keys[:4]}})
    walk = KeyWalk(len(keys), l1, l3)
    walk.feed(keys[:2])
    l1.apply({"type": "pod_removed", "pod": "A"})  # A leaves; B takes its ids and holds the whole chain
    l1.apply({"type": "batch", "pod": "B", "rank": 0, "gen": 1, "seq": 0, "events": [{"kind": "stored", "hashes": keys}]})
    l3.apply(_l3_diff(1, {"B": keys}, {"A": keys[:4]}))
    assert l1.pod_workers("B") == {0: 0} and l3.pod_workers("B") == {0: 0}
    walk.feed(keys[2:])
    match = walk.result()
    assert match.ranks == {} and match.l3 == {}, "A holds nothing now; B was not a worker of the walk"


# -- 3. the batch lock ----------------------------------------------------------------------------------
def test_a_second_threads_batch_waits_for_the_first():
    """The batch depth was per table: a second thread's ``with table`` saw depth > 0 and went in without
    the lock, writing while the first thread's batch (and the queries it excludes) ran."""
    t = _native_index.Table()
    inside, leave, entered = threading.Event(), threading.Event(), threading.Event()

    def first():
        with t:
            inside.set()
            leave.wait(10)

    def second():
        with t:
            entered.set()
            t.store(1, [2])

    a = threading.Thread(target=first)
    a.start()
    assert inside.wait(10)
    b = threading.Thread(target=second)
    b.start()
    assert not entered.wait(0.3), "the second thread entered while the first held the batch"
    leave.set()
    a.join(10)
    b.join(10)
    assert entered.is_set() and t.as_dict() == {2: 1 << 1}


def test_exit_by_another_thread_and_a_query_inside_its_own_batch_are_refused():
    """``__exit__`` never checked the owner, and a query inside its own thread's batch got EDEADLK from
    the read lock, walked unlocked, and its unlock released the batch's write lock."""
    t = _native_index.Table()
    tokens = list(range(1, 4 * BS + 1))
    t.store(0, _chain(tokens))
    args = (array("Q", tokens), False, BS, HASHER.none_hash, True, [(t, t.candidates([0]))])
    assert _native_index.query(*args)[2] == [[4]]
    errors = []
    with t:
        th = threading.Thread(target=lambda: errors.append(_raises(lambda: t.__exit__(None, None, None))))
        th.start()
        th.join(10)
        with pytest.raises(RuntimeError, match="batch"):
            _native_index.query(*args)
        writer_done = threading.Event()
        w = threading.Thread(target=lambda: (t.store(7, [7]), writer_done.set()))
        w.start()
        assert not writer_done.wait(0.3), "the batch's write lock was released by the refused query"
    w.join(10)
    assert errors == [RuntimeError] and writer_done.is_set()
    with pytest.raises(RuntimeError):
        t.__exit__(None, None, None)


def _raises(fn):
    try:
        fn()
    except Exception as exc:
        return type(exc)
    return None


# -- 4. running out of memory, and exiting -----------------------------------------------------------
@pytest.mark.parametrize("fail_after", [0, 1, 2, 3, 5, 8, 13, 40])
def test_a_store_that_runs_out_of_memory_changes_nothing(fail_after):
    """A store that failed part-way kept the hashes it had added and left ``entries`` short of the
    workers' counts; a later clear wrapped it around. Now it is taken back whole."""
    t = _native_index.Table()
    for w in (0, 1, 70):
        t.store(w, list(range(w, w + 300)))
    before = (t.as_dict(), t.worker_counts(), t.counts()[0])
    _native_index._fail_allocs_after(fail_after)
    try:
        with pytest.raises(MemoryError):
            t.store(130, list(range(10_000, 30_000)))
        with pytest.raises(MemoryError):
            t.store(1, list(range(50_000, 70_000)))
    finally:
        _native_index._fail_allocs_after(-1)
    assert (t.as_dict(), t.worker_counts(), t.counts()[0]) == before
    for w in (0, 1, 70, 130):
        t.clear(w)
    assert t.counts()[0] == 0 and t.as_dict() == {}
    t.store(130, [5])
    assert t.as_dict() == {5: 1 << 130}


def test_a_process_that_exits_while_the_query_threads_hash_exits_cleanly():
    """The query threads were joined only by close() or dealloc: an exit mid-walk ran EVP_Digest* while
    libcrypto's exit handler freed the digest. The module's exit handler joins them first (a running
    query finishes; .ci/native runs this under AddressSanitizer)."""
    out = _run("""
        import sys, threading
        from array import array
        from cache_indexer.indexer import _native_index as n
        t = n.Table()
        t.store(0, [1])
        pool = n.QueryPool(2)
        bs = 2_000_000
        tokens = array("Q", range(bs)).tobytes()
        for k in range(4):
            pool.submit(k, tokens, False, bs, bytes(32), True, [(t, t.candidates([0]))])
        # and one on a Python thread without the GIL, still hashing at exit
        threading.Thread(target=n.query, args=(tokens, False, bs, bytes(32), True, [(t, t.candidates([0]))]),
                         daemon=True).start()
        keep = [pool, t]
        keep.append(keep)  # a cycle, never freed: the pool is not closed by its dealloc
        import gc
        gc.disable()
        print("exiting", flush=True)
        sys.exit(0)
    """)
    assert out.returncode == 0 and out.stdout.strip() == "exiting" and not out.stderr, (out.returncode, out.stderr)


# -- 5. the same inputs refused alike ---------------------------------------------------------------
def test_hash_buffers_of_other_formats_are_refused_and_unaligned_ones_copied():
    """``u64s_get`` took any buffer's bytes as uint64s (an array of doubles, of int32), at any alignment."""
    t = _native_index.Table()
    with pytest.raises(TypeError, match="format"):
        t.store(0, array("d", [1.0, 2.0]))
    with pytest.raises(TypeError, match="format"):
        t.store(0, array("i", [1, 2]))
    with pytest.raises(TypeError):
        t.store(True, [1])
    raw = b"\0" + array("Q", [11, 12, 13]).tobytes()
    t.store(1, memoryview(raw)[1:])  # bytes at an odd offset
    t.store(2, array("Q", [12]))
    assert t.as_dict() == {11: 1 << 1, 12: 1 << 1 | 1 << 2, 13: 1 << 1} and t.counts()[0] == 4


def test_a_message_past_the_worker_bound_is_refused_whole_in_both_indexes():
    """The native table refused worker ids from 65,536 after half a message was applied; the Python
    index took them. Both tiers now refuse the message that needs one id too many, whole."""
    from cache_indexer.indexer.block_index import MAX_WORKERS, TooManyWorkers

    for native in (True, False):
        s = L1State()
        if not native:
            s.index, s.media = BlockIndex(), {m: BlockIndex() for m in s.media}
        for i in range(MAX_WORKERS):
            s.workers.intern(f"p{i}", 0)
        with pytest.raises(TooManyWorkers):
            s.apply({"type": "batch", "pod": "new", "rank": 0, "gen": 1, "seq": 0, "events": [
                {"kind": "removed", "hashes": [1]}, {"kind": "stored", "hashes": [2]}]})
        assert s.index.entries() == 0 and s.workers.get("new", 0) is None
        l3 = L3State()
        if not native:
            l3.index = BlockIndex()
        for i in range(MAX_WORKERS - 1):
            l3.workers.intern(f"p{i}", 0)
        with pytest.raises(TooManyWorkers):
            l3.apply({"type": "l3_full", "master": "m", "pods": {"x": [1], "y": [2]}})
        assert l3.index.entries() == 0 and l3.pod_workers("x") == {}


def test_the_cases_above_run_on_the_index_replicas_use():
    assert isinstance(L1State().index, NativeBlockIndex) and isinstance(L3State().index, NativeBlockIndex)
