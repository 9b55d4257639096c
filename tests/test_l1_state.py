"""Ordering rules of the L1 applier and the index structure."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

import pytest

from cache_indexer.indexer.block_index import BlockIndex, _native_index
from cache_indexer.indexer.l1_state import L1State
from tests.conftest import needs_native


def batch(seq, events, pod="127.0.1.1", rank=0, gen=1):
    return {"v": 1, "type": "batch", "pod": pod, "rank": rank, "gen": gen, "seq": seq, "ts": 0.0, "events": events}


def stored(*hashes, medium="GPU"):
    return {"kind": "stored", "medium": medium, "hashes": list(hashes), "parent": None}


def removed(*hashes, medium="GPU"):
    return {"kind": "removed", "medium": medium, "hashes": list(hashes)}


def held(state, pod="127.0.1.1", rank=0):
    wid = state.workers.get(pod, rank)
    return set() if wid is None else {h for h, m in state.blocks.items() if m >> wid & 1}


def test_store_remove_clear():
    s = L1State()
    s.apply(batch(0, [stored(1, 2, 3)]))
    s.apply(batch(1, [removed(2)]))
    assert held(s) == {1, 3}
    s.apply(batch(2, [{"kind": "cleared", "medium": None}, stored(9)]))
    assert held(s) == {9}


def held_in(state, medium, pod="127.0.1.1", rank=0):
    wid = state.workers.get(pod, rank)
    return set() if wid is None else {h for h, m in state.media[medium].blocks.items() if m >> wid & 1}


def test_offload_media_have_their_own_index_and_do_not_touch_l1():
    s = L1State()
    s.apply(batch(0, [stored(1, medium="CPU"), stored(2, medium="STORAGE"), stored(3, medium=None),
                      stored(4, medium="External")]))
    assert held(s) == {3}
    assert held_in(s, "CPU") == {1} and held_in(s, "STORAGE") == {2}
    assert s.stats.ignored_medium == 1  # a medium nobody indexes is counted and dropped


def test_offload_media_count_copies_and_clear_on_their_own():
    """A chunk event may re-announce a hash the medium holds: it stays until removed as often. A GPU
    AllBlocksCleared leaves the CPU copies (and the worker's id, which they name); a reset clears all."""
    s = L1State()
    s.apply(batch(0, [stored(1, 2), stored(1, 2, 3, medium="CPU"), stored(2, medium="CPU")]))
    s.apply(batch(1, [removed(2, medium="CPU"), {"kind": "cleared", "medium": "GPU"}]))
    assert held(s) == set() and held_in(s, "CPU") == {1, 2, 3}
    s.apply(batch(2, [removed(2, medium="CPU"), stored(7)]))
    assert held(s) == {7} and held_in(s, "CPU") == {1, 3}
    s.apply(batch(3, [{"kind": "cleared", "medium": "CPU"}]))
    assert held(s) == {7} and held_in(s, "CPU") == set()
    s.apply(batch(4, [stored(5, medium="STORAGE")]))
    s.apply({"type": "reset", "pod": "127.0.1.1", "rank": 0, "gen": 2, "next_seq": 0, "reason": "restart"})
    assert s.workers.get("127.0.1.1", 0) is None
    s.apply(batch(0, [stored(8)], pod="127.0.1.2"))  # takes the freed id: nothing of the old worker's is its
    assert held(s, "127.0.1.2") == {8} and held_in(s, "STORAGE", "127.0.1.2") == set()


def test_offload_media_survive_a_snapshot():
    from cache_indexer.indexer.snapshot import decode_l1, encode_l1
    s = L1State()
    s.apply(batch(0, [stored(1, 2), stored(1, 2, 3, medium="CPU"), stored(3, medium="CPU"), stored(9, medium="STORAGE")]))
    s.apply(batch(0, [stored(4)], pod="127.0.1.2", rank=1))
    loaded, seq = decode_l1(encode_l1(s, 5))
    assert seq == 5
    assert held(loaded) == {1, 2} and held_in(loaded, "CPU") == {1, 2, 3} and held_in(loaded, "STORAGE") == {9}
    assert held(loaded, "127.0.1.2", 1) == {4}
    loaded.apply(batch(1, [removed(3, medium="CPU"), {"kind": "cleared", "medium": None}]))
    assert held_in(loaded, "CPU") == {1, 2, 3}, "the copy count and the offloaded worker came back too"


def test_duplicates_are_dropped_and_early_batches_wait_for_the_missing_one():
    s = L1State()
    s.apply(batch(0, [stored(1)]))
    s.apply(batch(0, [stored(99)]))  # duplicate
    s.apply(batch(2, [removed(5)]))  # early: waits for seq 1
    assert held(s) == {1}
    s.apply(batch(1, [stored(5)]))
    assert held(s) == {1}  # stored then removed, in seq order
    assert s.stats.duplicates == 1


def test_reset_clears_and_older_generations_are_stale():
    s = L1State()
    s.apply(batch(0, [stored(1)], gen=1))
    s.apply({"type": "reset", "pod": "127.0.1.1", "rank": 0, "gen": 2, "next_seq": 7, "reason": "gap"})
    assert held(s) == set()
    s.apply(batch(5, [stored(4)], gen=1))  # stale
    s.apply(batch(7, [stored(8)], gen=2))
    assert held(s) == {8}
    # a reset arriving after its generation's first batch does not wipe it
    s.apply(batch(0, [stored(11)], gen=3))
    s.apply({"type": "reset", "pod": "127.0.1.1", "rank": 0, "gen": 3, "next_seq": 0, "reason": "subscribed"})
    assert held(s) == {11}


def test_pod_removed_drops_all_ranks_and_late_batches():
    s = L1State()
    s.apply(batch(0, [stored(1)], rank=0))
    s.apply(batch(0, [stored(2)], rank=1))
    s.apply({"type": "pod_removed", "pod": "127.0.1.1", "reason": "discovery"})
    assert s.pod_workers("127.0.1.1") == {} and not s.blocks
    s.apply(batch(1, [stored(3)], rank=0))
    assert not s.blocks
    s.apply(batch(0, [stored(4)], rank=0, gen=2))  # the pod came back
    assert held(s) == {4}


def test_a_removal_with_a_mark_retires_only_the_generations_before_it_in_whatever_order_they_are_stored():
    """Issue 36's sequencing model: a pod back right after its removal starts a new generation whose
    messages the stream stored before the ``pod_removed`` (a retry after NATS lost it); the removal used to
    retire that generation too, and every later batch of it was dropped as stale: the pod blind. With its
    mark (the bridge's clock when it removed the pod) it retires only the generations before it, and a
    message of one of those stored after it is stale, on any rank, seen before or not."""
    from cache_indexer.indexer.snapshot import decode_l1, encode_l1

    s = L1State()
    s.apply(batch(0, [stored(1)], rank=0, gen=10))
    s.apply(batch(0, [stored(2)], rank=1, gen=30))  # started after the removal (the pod back): stays
    s.apply({"type": "pod_removed", "pod": "127.0.1.1", "reason": "discovery", "gen": 20})
    assert held(s, rank=0) == set() and held(s, rank=1) == {2}
    s.apply(batch(1, [stored(3)], rank=0, gen=10))  # late ones of generations the removal retired
    s.apply(batch(0, [stored(4)], rank=0, gen=15))
    s.apply(batch(0, [stored(5)], rank=2, gen=15))  # a rank never seen
    s.apply(reset(0, gen=19, rank=3))
    s.apply(batch(1, [stored(6)], rank=1, gen=30))
    assert held(s, rank=0) == held(s, rank=2) == held(s, rank=3) == set() and held(s, rank=1) == {2, 6}
    loaded, _ = decode_l1(encode_l1(s, 7))  # the mark survives a snapshot
    loaded.apply(batch(0, [stored(7)], rank=4, gen=19))
    loaded.apply(batch(0, [stored(8)], rank=0, gen=21))  # a generation after the removal
    assert held(loaded, rank=4) == set() and held(loaded, rank=0) == {8} and loaded.knows("127.0.1.1")
    # one rank alike; and a removal without a mark (an older bridge's) retires every generation
    loaded.apply({"type": "rank_removed", "pod": "127.0.1.1", "rank": 1, "reason": "discovery", "gen": 25})
    assert held(loaded, rank=1) == {2, 6}
    loaded.apply({"type": "rank_removed", "pod": "127.0.1.1", "rank": 5, "reason": "discovery", "gen": 25})
    loaded.apply(batch(0, [stored(9)], rank=5, gen=24))
    assert held(loaded, rank=5) == set()
    loaded.apply({"type": "pod_removed", "pod": "127.0.1.1", "reason": "discovery"})
    assert not loaded.blocks and not loaded.knows("127.0.1.1")


def test_a_removal_mark_far_ahead_of_the_streams_clock_is_refused():
    """A mark retires every generation before it: one far ahead (forged, or a broken clock) would blind
    the pod for ever, as a generation that far ahead would."""
    from cache_indexer.indexer.l1_state import ImplausibleMessage
    from cache_indexer.schemas.events import GEN_MAX_AHEAD_NS

    s = L1State()
    now = 10**18
    s.apply(batch(0, [stored(1)], gen=now - 5), now)
    with pytest.raises(ImplausibleMessage):
        s.apply({"type": "pod_removed", "pod": "127.0.1.1", "reason": "x", "gen": now + GEN_MAX_AHEAD_NS + 1}, now)
    with pytest.raises(ValueError):
        s.apply({"type": "rank_removed", "pod": "127.0.1.1", "rank": 0, "reason": "x", "gen": "soon"}, now)
    assert held(s) == {1}


def test_too_many_held_batches_declare_the_gap_lost():
    s = L1State(max_early=3)
    s.apply(batch(0, [stored(1)]))
    for seq in range(5, 9):
        s.apply(batch(seq, [stored(seq * 10)]))
    assert s.stats.lost_gaps == 1
    assert held(s) == {50, 60, 70, 80}


def test_block_shared_by_workers_and_worker_ids_reused():
    idx = BlockIndex()
    idx.store(0, [1, 2])
    idx.store(5, [2, 3])
    assert idx.blocks == {1: 1, 2: 1 | 32, 3: 32}
    assert idx.entries() == 4
    idx.clear(5)
    assert idx.blocks == {1: 1, 2: 1}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["s", "r", "c"]), st.integers(0, 3), st.lists(st.integers(0, 20), max_size=5)),
                max_size=40))
@example([("s", 0, [1, 2]), ("s", 0, [2]), ("r", 0, [2])])  # one hash, two physical blocks
def test_index_matches_vllms_multiset_of_cached_hashes(ops):
    """vLLM's BlockPool: each stored hash is one physical block; a BlockRemoved evicts one of them; the
    hash is held while any copy is cached."""
    from collections import Counter

    idx = BlockIndex()
    model = {w: Counter() for w in range(4)}
    for op, wid, hashes in ops:
        if op == "s":
            idx.store(wid, hashes)
            model[wid].update(hashes)
        elif op == "r":
            idx.remove(wid, hashes)
            for h in hashes:
                if model[wid][h]:
                    model[wid][h] -= 1
        else:
            idx.clear(wid)
            model[wid] = Counter()
    for wid, hs in model.items():
        held = {h for h, n in hs.items() if n}
        assert {h for h, m in idx.blocks.items() if m >> wid & 1} == held
        assert idx.worker_blocks.get(wid, 0) == len(held)
        assert {h: n - 1 for h, n in hs.items() if n > 1} == idx.copies.get(wid, {}), "only duplicates recorded"
    assert all(m for m in idx.blocks.values())


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["s", "r", "c"]), st.integers(0, 2), st.sampled_from([None, 0, 1, 2]),
                          st.lists(st.integers(0, 12), max_size=5)), max_size=50))
@example([("s", 0, None, [1]), ("s", 0, None, [1]), ("r", 0, None, [1])])
@example([("s", 0, 1, [1]), ("s", 0, 1, [1]), ("r", 0, 1, [1]), ("s", 0, 0, [1]), ("r", 0, 1, [1])])
def test_a_block_is_held_while_any_of_the_workers_kv_cache_groups_holds_it(ops):
    idx = BlockIndex()
    model = {w: {} for w in range(3)}  # worker -> block -> {group: copies cached}
    for op, wid, group, hashes in ops:
        g = group or 0
        if op == "s":
            idx.store(wid, hashes, group)
            for h in hashes:
                copies = model[wid].setdefault(h, {})
                copies[g] = copies.get(g, 0) + 1
        elif op == "r":
            idx.remove(wid, hashes, group)
            for h in hashes:
                copies = model[wid].get(h, {})
                if copies.get(g):
                    copies[g] -= 1
                    if not copies[g]:
                        del copies[g]
                    if not copies:
                        del model[wid][h]
        else:
            idx.clear(wid)
            model[wid] = {}
    model = {w: {h: set(copies) for h, copies in blocks.items()} for w, blocks in model.items()}
    for wid, held_by in model.items():
        assert {h for h, m in idx.blocks.items() if m >> wid & 1} == set(held_by)
        assert idx.worker_blocks.get(wid, 0) == len(held_by)
        assert {h: {g for g in range(3) if gm >> g & 1} for h, gm in idx.groups.get(wid, {}).items()} == \
            {h: gs for h, gs in held_by.items() if gs != {0}}, "only entries not held by group 0 alone are recorded"
    assert all(m for m in idx.blocks.values())


def test_hybrid_model_sliding_window_eviction_keeps_the_full_attention_blocks():
    s = L1State()
    s.apply(batch(0, [dict(stored(1, 2, 3), group_idx=0), dict(stored(1, 2, 3), group_idx=1)]))
    s.apply(batch(1, [dict(removed(1, 2), group_idx=1)]))  # the sliding-window group evicts early blocks
    assert held(s) == {1, 2, 3}
    s.apply(batch(2, [dict(removed(1), group_idx=0)]))
    assert held(s) == {2, 3}
    s.apply(batch(3, [{"kind": "cleared", "medium": None}]))
    assert held(s) == set() and not s.index.groups


def test_a_snapshot_after_a_pod_left_round_trips():
    """A removed pod's cursor must stay encodable: it broke every snapshot after any scale-down."""
    from cache_indexer.indexer.snapshot import decode_l1, encode_l1

    s = L1State()
    s.apply(batch(0, [stored(1)], pod="127.0.1.1"))
    s.apply(batch(0, [stored(2)], pod="127.0.1.2"))
    s.apply({"type": "pod_removed", "pod": "127.0.1.1", "reason": "discovery"})
    loaded, seq = decode_l1(encode_l1(s, 42))
    assert seq == 42 and held(loaded, pod="127.0.1.2") == {2} and not loaded.pod_workers("127.0.1.1")
    loaded.apply(batch(1, [stored(3)], pod="127.0.1.1"))  # late batch of the removed generation: still stale
    assert not loaded.pod_workers("127.0.1.1")



def test_a_hash_cached_twice_stays_until_both_copies_are_evicted_and_snapshots_keep_the_count():
    """The reported case, in the normalised stream: block 1 of the prompt stored twice, evicted once."""
    from cache_indexer.indexer.snapshot import decode_l1, encode_l1

    s = L1State()
    s.apply(batch(0, [stored(10, 11)]))
    s.apply(batch(1, [stored(11)]))  # the same prefix scheduled again before the first copy was cached
    s.apply(batch(2, [removed(11)]))  # one copy evicted: vLLM still reuses the other
    assert held(s) == {10, 11}
    s.apply(batch(3, [stored(11)]))
    loaded, _ = decode_l1(encode_l1(s, 7))
    assert loaded.index.copies == s.index.copies == {s.workers.get("127.0.1.1", 0): {11: 1}}
    for state in (s, loaded):
        state.apply(batch(4, [removed(11)]))
        assert held(state) == {10, 11}
        state.apply(batch(5, [removed(11)]))
        assert held(state) == {10}
    s.apply(batch(6, [stored(10)]))
    s.apply(batch(7, [{"kind": "cleared"}]))
    assert held(s) == set() and not s.index.copies


def test_a_batch_with_an_event_outside_the_schema_is_refused_whole_and_the_position_moves_on():
    """Issue 16 #9, issue 35 #5: the indexer does not trust the stream blindly: a batch with a forged
    group_idx, a hash outside uint64 or a non-int hash is refused whole (nothing of it applied, in the
    native index and the Python one alike), counted, and the batches after it still apply."""
    bad_events = [
        [{"kind": "stored", "medium": "GPU", "hashes": [1], "group_idx": -1}],
        [{"kind": "stored", "medium": "GPU", "hashes": [2], "group_idx": 64}],
        [{"kind": "stored", "medium": "GPU", "hashes": [5, 1 << 64]}],
        [{"kind": "removed", "medium": "GPU", "hashes": [-1]}],
        [{"kind": "stored", "medium": "CPU", "hashes": [1.5]}],
        [{"kind": "evicted", "hashes": [6]}],
        [{"kind": "stored", "hashes": "77"}],
        ["stored"],
    ]
    for native in (True, False):
        s = L1State()
        if not native:
            s.index, s.media = BlockIndex(), {m: BlockIndex() for m in s.media}
        s.apply({"type": "batch", "pod": "p", "rank": 0, "gen": 1, "seq": 0, "events": [
            {"kind": "stored", "medium": "GPU", "hashes": [9]}]})
        for seq, events in enumerate(bad_events, start=1):
            # the good event first: it must not be applied either
            with pytest.raises(ValueError):
                s.apply({"type": "batch", "pod": "p", "rank": 0, "gen": 1, "seq": seq, "events": [
                    {"kind": "stored", "medium": "GPU", "hashes": [3]}, *events]})
        s.apply({"type": "batch", "pod": "p", "rank": 0, "gen": 1, "seq": len(bad_events) + 1, "events": [
            {"kind": "stored", "medium": "GPU", "hashes": [4]}]})
        assert set(s.blocks) == {9, 4} and not s.media["CPU"].entries(), native
        assert s.stats.malformed_events == len(bad_events) and s.cursors[("p", 0)].next_seq == len(bad_events) + 2


def test_the_native_and_python_indexes_refuse_the_same_inputs_before_changing_anything():
    """Issue 35 #5: the same limits in both (worker ids 0..65535, not bools; hashes uint64 ints), each
    refused before any hash of the call is stored."""
    from cache_indexer.indexer.block_index import MAX_WORKERS, NativeBlockIndex

    needs_native(_native_index is not None, "the native index")
    for make in (BlockIndex, NativeBlockIndex):
        ix = make()
        ix.store(3, [10, 11])
        for wid, hashes, exc in [(MAX_WORKERS, [1], ValueError), (-1, [1], ValueError), (True, [1], TypeError),
                                 (2, [12, 1 << 64], ValueError), (2, [12, -5], ValueError), (2, [12, "x"], TypeError),
                                 (2, [12, 1.0], TypeError)]:
            with pytest.raises(exc):
                ix.store(wid, hashes)
            with pytest.raises(exc):
                ix.remove(wid if wid != 2 else 3, [10, *hashes[1:]])
        assert ix.blocks == {10: 1 << 3, 11: 1 << 3} and ix.entries() == 2, make
        ix.store(MAX_WORKERS - 1, [10])
        assert ix.blocks[10] == 1 << 3 | 1 << (MAX_WORKERS - 1)
    from cache_indexer.indexer.block_index import TooManyWorkers, WorkerTable

    workers = WorkerTable()
    for i in range(MAX_WORKERS):
        workers.intern(f"p{i}", 0)
    with pytest.raises(TooManyWorkers):
        workers.intern("one more", 0)
    workers.release("p7", 0)
    assert workers.intern("one more", 0) == 7 and workers.generation(7) == 1


def test_a_batch_in_parts_applies_in_order_and_completes_its_seq():
    """Issue 16 #8: a batch over the message limit arrives in parts of one seq; early parts wait,
    repeated parts are duplicates, and the next seq applies only after the last part."""
    def part(seq, i, n, hashes):
        return {"type": "batch", "pod": "p", "rank": 0, "gen": 1, "seq": seq, "part": i, "parts": n,
                "events": [{"kind": "stored", "medium": "GPU", "hashes": hashes}]}
    s = L1State()
    s.apply(part(0, 0, 1, [1]))
    s.apply(part(1, 0, 3, [2]))
    s.apply({"type": "batch", "pod": "p", "rank": 0, "gen": 1, "seq": 2, "events": [
        {"kind": "removed", "medium": "GPU", "hashes": [3]}]})  # before seq 1 is whole: held
    s.apply(part(1, 2, 3, [4]))  # early: held
    assert set(s.blocks) == {1, 2}
    s.apply(part(1, 0, 3, [2]))  # again: a duplicate
    s.apply(part(1, 1, 3, [3]))
    assert set(s.blocks) == {1, 2, 4}, "part 1, then the held part 2, then seq 2 (which removes 3)"
    assert s.stats.duplicates == 1 and s.cursors[("p", 0)].next_seq == 3


def run(first, batches, pod="127.0.1.1", gen=1):
    """Batches first.. coalesced into one message, as the bridge writes it."""
    from cache_indexer.bridge.l1_publisher import run_message

    return run_message(pod, 0, gen, [(first + i, 0.0, evs) for i, evs in enumerate(batches)])


def test_a_run_applies_its_batches_in_order_and_an_overlap_applies_only_the_rest():
    s = L1State()
    s.apply(batch(0, [stored(1)]))
    s.apply(run(1, [[stored(2)], [removed(1)], [stored(3)]]))
    assert held(s) == {2, 3} and s.cursors[("127.0.1.1", 0)].next_seq == 4 and s.stats.batches == 4
    s.apply(run(2, [[removed(1)], [stored(3)], [removed(2)], [stored(1)]]))  # batches 2, 3 again, then 4, 5
    assert held(s) == {1, 3} and not s.index.copies, "batch 3 (stored 3) not applied twice; 4 and 5 applied"
    s.apply(run(0, [[stored(1)], [stored(2)]]))  # all seen: a duplicate
    assert held(s) == {1, 3} and s.stats.duplicates == 1


def test_an_early_run_waits_and_one_that_starts_before_the_next_seq_goes_on_from_it():
    s = L1State()
    s.apply(batch(0, [stored(1)]))
    s.apply(run(3, [[stored(4)], [stored(5)]]))  # early: held until 1 and 2 arrive
    s.apply(run(1, [[stored(2)], [stored(3)], [stored(4)]]))  # 1..3; its 3 also starts the held run's 3..4
    assert held(s) == {1, 2, 3, 4, 5} and s.cursors[("127.0.1.1", 0)].next_seq == 5
    assert not s.index.copies, "the held run's batch 3 was not applied a second time"
    s2 = L1State()
    s2.apply(batch(0, [stored(1)]))
    s2.apply(run(1, [[stored(2)], [stored(3)], [removed(2)]]))
    s2.apply(run(6, [[stored(7)]]))
    s2.apply(run(3, [[removed(2)], [stored(5)], [stored(6)]]))  # starts before next (4): 4 and 5 applied
    assert held(s2) == {1, 3, 5, 6, 7} and s2.cursors[("127.0.1.1", 0)].next_seq == 7


def test_a_run_that_does_not_hold_together_is_refused_and_changes_nothing():
    import pytest

    s = L1State()
    s.apply(batch(0, [stored(1)]))
    bad = run(1, [[stored(2)], [stored(3)]])
    for broken in ({**bad, "ends": [1]}, {**bad, "ends": [2, 1]}, {**bad, "ends": [1, 3]}, {**bad, "last_seq": 0},
                   {**bad, "parts": 2}, {**bad, "ends": None}):
        with pytest.raises(ValueError):
            s.apply(broken)
    assert held(s) == {1} and s.cursors[("127.0.1.1", 0)].next_seq == 1


_event = st.one_of(st.builds(lambda h: stored(h), st.integers(1, 6)), st.builds(lambda h: removed(h), st.integers(1, 6)))


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_runs_cut_anyhow_overlapping_repeated_and_reordered_index_as_the_batches_one_by_one(data):
    """What the indexers hold does not depend on how the bridge coalesced the batches, nor on overlaps,
    repeats and arrival order (held early arrivals, including runs that start before the next seq)."""
    from cache_indexer.indexer.snapshot import decode_l1, encode_l1

    batches = data.draw(st.lists(st.lists(_event, max_size=3), min_size=1, max_size=25))
    ref = L1State()
    for i, evs in enumerate(batches):
        ref.apply(batch(i, evs))
    msgs, i = [], 0
    while i < len(batches):
        j = data.draw(st.integers(i + 1, len(batches)))
        start = data.draw(st.integers(max(0, i - 3), i))  # may overlap the run before
        msgs.append(run(start, batches[start:j]) if j - start > 1 else batch(start, batches[start]))
        i = j
    msgs += data.draw(st.lists(st.sampled_from(msgs), max_size=3))  # repeated (a retry past the dedupe window)
    first, rest = msgs[0], data.draw(st.permutations(msgs[1:]))
    s = L1State()
    s.apply(first)
    for k, m in enumerate(rest):
        s.apply(m)
        if k == len(rest) // 2:  # a snapshot in between keeps what is held
            s, _ = decode_l1(encode_l1(s, 1))
    assert held(s) == held(ref)
    assert s.index.copies == ref.index.copies
    assert s.cursors[("127.0.1.1", 0)].next_seq == len(batches) and not s.cursors[("127.0.1.1", 0)].early


def reset(next_seq, gen, pod="127.0.1.1", rank=0):
    return {"type": "reset", "pod": pod, "rank": rank, "gen": gen, "next_seq": next_seq, "reason": "engine-restart"}


def test_a_generations_batch_stored_before_its_reset_does_not_drop_the_earlier_ones():
    """Issue 24 #2: batch 3, then the reset, then batches 0-2 (the reset's publish was lost and re-sent
    after the ack timeout while later batches were stored): every block is indexed, none taken for a
    duplicate; the same for a known worker whose new generation begins that way, and across a snapshot."""
    from cache_indexer.indexer.snapshot import decode_l1, encode_l1

    t = 10**18  # when the stream stored them (a journal is kept only where that is known)
    s = L1State()
    s.apply(batch(3, [stored(13)], gen=5), t)
    s.apply(reset(0, gen=5), t)
    for seq in range(3):
        s.apply(batch(seq, [stored(10 + seq)], gen=5), t)
    assert held(s) == {10, 11, 12, 13} and s.stats.duplicates == 0
    assert s.cursors[("127.0.1.1", 0)].next_seq == 4

    s.apply(batch(4, [stored(14)], gen=5), t)
    s.apply(batch(40, [stored(140), removed(1)], gen=9), t)  # the engine restarted: generation 9 from seq 0
    s, _ = decode_l1(encode_l1(s, 1))  # a snapshot while the generation is provisional
    s.apply(run(41, [[stored(141)], [removed(140)]], gen=9), t + 1)
    s.apply(reset(0, gen=9), t + 2)
    assert held(s) == set(), "rebuilt from seq 0: batches 40.. wait for 0..39"
    s.apply(run(0, [[stored(1)]] + [[] for _ in range(39)], gen=9), t + 3)
    assert held(s) == {141}, "seq 0 stores 1, 40 removes it and stores 140, 42 removes 140"
    assert s.stats.duplicates == 0


def test_a_late_reset_rebuilds_from_the_message_reaching_further_of_two_from_one_seq():
    """Issue 36's sequencing model: a pod back from a flap resumed from the stream's last message and
    published its engine's buffer again as runs, while the single batches of the first try were still in
    flight. Batch 4 and the run 4-7 were both journaled before the generation's late reset; the rebuild
    kept batch 4 alone, and batch 7 (its single copy dropped as applied by the run) never came again:
    the worker waited, then lost the gap."""
    t = 10**18
    s = L1State()
    s.apply(batch(4, [stored(4)], gen=5), t)
    s.apply(batch(7, [stored(7)], gen=5), t)  # early, then applied by the run: dropped
    s.apply(run(4, [[stored(4)], [stored(5)], [stored(6)], [stored(7)]], gen=5), t)
    s.apply(reset(0, gen=5), t)  # late: rebuilt from seq 0, the journal going back to the early ones
    s.apply(run(0, [[stored(0)], [stored(1)], [stored(2)], [stored(3)]], gen=5), t)
    s.apply(batch(8, [stored(8)], gen=5), t)
    assert held(s) == set(range(9)) and s.cursors[("127.0.1.1", 0)].next_seq == 9


def test_a_reset_later_than_the_hold_timeout_is_not_waited_for_and_benchmarks_keep_no_journal():
    from cache_indexer.indexer.l1_state import EARLY_TIMEOUT_NS

    t = 10**18
    s = L1State()
    s.apply(batch(3, [stored(13)], gen=5), t)
    s.apply(batch(4, [stored(14)], gen=5), t + EARLY_TIMEOUT_NS + 1)  # the journal is given up
    s.apply(reset(0, gen=5), t + EARLY_TIMEOUT_NS + 2)
    assert held(s) == {13, 14} and s.cursors[("127.0.1.1", 0)].next_seq == 5
    b = L1State()
    b.apply(batch(0, [stored(1)]))  # no stored time: nothing journaled (memory figures stay what they were)
    assert b.cursors[("127.0.1.1", 0)].journal is None


def test_a_reset_after_the_batches_it_starts_changes_nothing():
    s = L1State()
    s.apply(batch(0, [stored(1)], gen=2))
    s.apply(batch(1, [stored(2)], gen=2))
    s.apply(reset(0, gen=2))
    assert held(s) == {1, 2} and s.cursors[("127.0.1.1", 0)].journal is None


def test_a_missing_batch_is_declared_lost_after_the_hold_timeout_of_stream_time():
    """Issue 24 #3: one message that never arrives must not freeze a worker: once the first held batch
    waited EARLY_TIMEOUT_NS of stream time (any worker's message tells the time), the gap is lost."""
    from cache_indexer.indexer.l1_state import EARLY_TIMEOUT_NS
    from cache_indexer.indexer.snapshot import decode_l1, encode_l1

    t0 = 10**18
    s = L1State()
    s.apply(batch(0, [stored(1)]), t0)
    s.apply(batch(2, [stored(3)]), t0 + 1)  # seq 1 never comes
    s.apply(batch(3, [stored(4)]), t0 + 2)
    s, _ = decode_l1(encode_l1(s, 1))  # the wait survives a snapshot: replicas decide alike
    s.apply(batch(0, [stored(9)], pod="127.0.1.2"), t0 + EARLY_TIMEOUT_NS - 1)
    assert held(s) == {1} and s.stats.lost_gaps == 0
    s.apply(batch(1, [stored(10)], pod="127.0.1.2"), t0 + EARLY_TIMEOUT_NS + 1)
    assert held(s) == {3, 4} and s.stats.lost_gaps == 1
    s.apply(batch(4, [stored(5)]), t0 + EARLY_TIMEOUT_NS + 2)
    assert held(s) == {3, 4, 5}


def test_a_snapshot_written_before_journals_loads_and_an_older_reader_skips_the_new_fields():
    """Cursor rows grew (parts, then journal, held_since, journal_since, spilled): both directions still read."""
    import msgpack

    from cache_indexer.indexer.snapshot import decode_l1, encode_l1

    s = L1State()
    s.apply(batch(0, [stored(1)]), 10**18)
    s.apply(batch(2, [stored(3)]), 10**18)  # held: seq 1 is missing
    blob = encode_l1(s, 5)
    n = int.from_bytes(blob[:8], "little")
    header = msgpack.unpackb(blob[8:8 + n], raw=False, strict_map_key=False)
    assert len(header["cursors"][0]) == 11
    for row in header["cursors"]:  # as the previous version read them
        pod, rank, gen, next_seq, reset_seen, held_msgs, *next_part = row
        assert (pod, next_seq, [m["seq"] for m in held_msgs], next_part[0]) == ("127.0.1.1", 1, [2], 0)
    header["cursors"] = [row[:6] for row in header["cursors"]]  # as the version before parts wrote them
    head = msgpack.packb(header)
    old, seq = decode_l1(len(head).to_bytes(8, "little") + head + blob[8 + n:])
    assert seq == 5 and held(old) == {1}
    old.apply(batch(1, [stored(2)]))
    assert held(old) == {1, 2, 3}


class ModelStream:
    """The stream as the service reads it: every message with its stream sequence; a spilled message read
    back from it by its stream sequence when its worker's cursor reaches it."""

    def __init__(self) -> None:
        self.msgs: list[tuple[int, dict, int]] = []

    def feed(self, state: L1State, msg: dict, stored_ns: int = 10**18) -> None:
        seq = len(self.msgs) + 1
        self.msgs.append((seq, msg, stored_ns))
        state.apply(msg, stored_ns, seq)
        self.read_back(state, seq)

    def read_back(self, state: L1State, upto: int) -> None:
        while (due := state.read_back_due()) is not None:
            key, at = due
            assert at < upto
            seq, msg, stored_ns = self.msgs[at - 1]
            assert (msg["pod"], msg["rank"]) == key
            state.read_back_taken(key, at)
            state.apply(msg, stored_ns, seq, read_back=True)


def test_batches_held_past_max_early_are_read_back_from_the_stream_and_no_gap_is_lost():
    """Issue 36 #3: a nats-server restart under a busy engine had 1,025 later batches stored before the
    bridge re-sent the lost ones; the indexer declared the gap lost and cleared the worker although the
    stream held every batch. Past ``max_early`` the later ones are now read back from the stream once the
    missing one comes, not taken for a loss; another worker's messages in between are not touched."""
    stream, s = ModelStream(), L1State(max_early=3)
    stream.feed(s, batch(0, [stored(100)]))
    for seq in range(2, 10):  # seq 1 is late: 2..4 held, 5..9 spilled
        stream.feed(s, batch(seq, [stored(100 + seq)]))
        stream.feed(s, batch(seq, [stored(900 + seq)], pod="127.0.1.2"))
    assert held(s) == {100} and s.stats.spilled == 5 and s.spill_floor() == 8  # the stream seq of batch 5
    stream.feed(s, batch(1, [stored(101)]))
    assert held(s) == {100 + i for i in range(10)} and s.stats.lost_gaps == 0 and s.stats.read_back == 5
    assert held(s, "127.0.1.2") == {902, 903, 904, 905, 906, 907, 908, 909}
    assert s.spill_floor() == 0 and not s.cursors[("127.0.1.1", 0)].early
    stream.feed(s, batch(10, [stored(110), removed(100)]))
    assert held(s) == {100 + i for i in range(1, 11)}


def test_a_second_gap_among_the_spilled_batches_is_filled_from_the_stream_too():
    """The batches spilled are not all after the gap's end: one fills the gap, the cursor then stops at
    another gap; what it reaches later (held or spilled) goes on from there."""
    stream, s = ModelStream(), L1State(max_early=2)
    stream.feed(s, batch(0, [stored(100)]))
    for seq in (4, 5, 6, 2, 7, 8):  # 1 and 3 are late; 4, 5 held, 6, 2, 7, 8 spilled
        stream.feed(s, batch(seq, [stored(100 + seq)]))
    stream.feed(s, batch(1, [stored(101)]))  # reads back 2; 3 is missing still
    assert held(s) == {100, 101, 102} and s.stats.lost_gaps == 0 and s.stats.read_back == 1
    stream.feed(s, batch(9, [stored(109)]))
    stream.feed(s, batch(3, [stored(103)]))
    assert held(s) == {100 + i for i in range(10)} and s.stats.lost_gaps == 0


def test_replicas_that_spill_agree_also_one_restored_from_a_snapshot_while_it_spills():
    from cache_indexer.indexer.snapshot import decode_l1, encode_l1

    stream, a = ModelStream(), L1State(max_early=3)
    msgs = [batch(0, [stored(100)])] + [batch(q, [stored(100 + q)]) for q in range(2, 12)] + [batch(1, [stored(101)])]
    for msg in msgs[:8]:
        stream.feed(a, msg)
    b, _ = decode_l1(encode_l1(a, 8))  # a snapshot while spilled: it records where to read back from
    b.max_early = 3
    assert b.spill_floor() == a.spill_floor() > 0
    for msg in msgs[8:]:
        stream.feed(a, msg)
        seq = len(stream.msgs)
        b.apply(msg, 10**18, seq)
        stream.read_back(b, seq)
    assert held(a) == held(b) == {100 + i for i in range(12)}


def test_the_purge_keeps_what_a_replica_close_behind_still_reads_back():
    """The writer read its spilled batches back, and its floor is 0; a replica ``purgeKeep`` messages behind
    it, whose next message is kept, has not reached that read-back yet. The purge floor keeps what it will
    read: before, the writer purged up to ``applied + 1 - purgeKeep``, and that replica found its spilled
    batches gone and reported history lost (and lost their blocks)."""
    stream, writer, behind = ModelStream(), L1State(max_early=1), L1State(max_early=1)
    for msg in [batch(0, [stored(100)])] + [batch(q, [stored(100 + q)]) for q in (2, 3, 4)]:
        stream.feed(writer, msg)  # 2 held, 3 and 4 spilled (stream seqs 3 and 4)
    for seq, msg, stored_ns in stream.msgs:
        behind.apply(msg, stored_ns, seq)
    stream.feed(writer, batch(1, [stored(101)]))  # stream seq 5: the writer reads 3 and 4 back
    assert writer.spill_floor() == 0 and held(writer) == {100 + q for q in range(5)}
    keep, applied = 1, len(stream.msgs)
    cut = applied + 1 - keep  # the replica behind (at 4) is within keep: its next message, 5, stays
    floor = writer.purge_floor(cut)
    assert floor == 3, "the first message the replica behind still reads back"
    first = min(cut, floor) if floor else cut
    seq, msg, stored_ns = stream.msgs[4]
    behind.apply(msg, stored_ns, seq)
    while (due := behind.read_back_due()) is not None:
        key, at = due
        assert at >= first, "purged past what the replica behind reads back"
        behind.read_back_taken(key, at)
        behind.apply(stream.msgs[at - 1][1], stream.msgs[at - 1][2], at, read_back=True)
    assert held(behind) == held(writer) and behind.stats.lost_gaps == 0
    assert writer.purge_floor(applied + 1) == 0, "none read back at or after the cut: nothing held"


def test_a_read_back_found_gone_holds_no_purge_back():
    """A spilled batch gone from the stream (retention) is no one's to read back: the purge floor does not
    keep the purge at its sequence (a review: it held every purge for ``purgeKeep`` messages)."""
    stream, s = ModelStream(), L1State(max_early=1)
    for msg in [batch(0, [stored(100)])] + [batch(q, [stored(100 + q)]) for q in (2, 3)]:
        stream.feed(s, msg)  # 3 spilled (stream seq 3)
    s.apply(batch(1, [stored(101)]), 10**18, 4)
    key, at = s.read_back_due()
    assert at == 3
    s.read_back_gone(key, at)
    assert s.purge_floor(4) == 0 and s.read_back_due() is None


def test_a_state_loaded_from_a_snapshot_purges_nothing_it_cannot_vouch_for():
    """Read-backs before a snapshot are not in it: a replica loaded from one does not know what a replica
    behind its snapshot still reads back, so it purges nothing before its snapshot's seq until it has
    applied ``purgeKeep`` messages of its own."""
    from cache_indexer.indexer.snapshot import decode_l1, encode_l1

    stream, a = ModelStream(), L1State(max_early=1)
    for msg in [batch(0, [stored(100)])] + [batch(q, [stored(100 + q)]) for q in (2, 3, 4, 1, 5)]:
        stream.feed(a, msg)
    b, seq = decode_l1(encode_l1(a, len(stream.msgs)))
    assert seq == 6 and a.purge_floor(5) == 3
    assert b.purge_floor(5) == 1, "read-backs before the snapshot are not known: nothing purged"
    assert b.purge_floor(7) == 0 and a.purge_floor(7) == 0


def test_a_gap_that_never_comes_is_lost_by_stream_time_and_the_spilled_batches_follow():
    from cache_indexer.indexer.l1_state import EARLY_TIMEOUT_NS

    t0 = 10**18
    stream, s = ModelStream(), L1State(max_early=2)
    stream.feed(s, batch(0, [stored(100)]), t0)
    for seq in range(2, 7):  # seq 1 never comes: 2, 3 held, 4..6 spilled
        stream.feed(s, batch(seq, [stored(100 + seq)]), t0 + seq)
    assert s.stats.lost_gaps == 0
    stream.feed(s, batch(0, [stored(7)], pod="127.0.1.2"), t0 + EARLY_TIMEOUT_NS + 10)
    assert s.stats.lost_gaps == 1 and held(s) == {102, 103, 104, 105, 106}


def test_a_later_gap_waits_its_own_time_after_a_gap_filled_from_the_stream():
    """The sequencing model (SpillingSequencing, SEQUENCING_SEED=12): a gap filled, the batches after it
    read back from the stream, the worker caught up; 30 s of stream time later another gap opened, and was
    declared lost at once (the worker cleared): the read-back that emptied the cursor left it waiting
    since the first gap. A worker that caught up waits no more; the next gap gets its own time."""
    from cache_indexer.indexer.l1_state import EARLY_TIMEOUT_NS

    t0 = 10**18
    stream, s = ModelStream(), L1State(max_early=1)
    stream.feed(s, batch(0, [stored(100)]), t0)
    for seq in (2, 3, 1):  # 1 late: 2 held, 3 spilled, both applied once it comes (3 read back)
        stream.feed(s, batch(seq, [stored(100 + seq)]), t0)
    assert held(s) == {100, 101, 102, 103} and s.stats.read_back == 1
    later = t0 + EARLY_TIMEOUT_NS + 1
    stream.feed(s, batch(5, [stored(105)]), later)  # 4 is late, not lost
    stream.feed(s, batch(4, [stored(104)]), later + 1)
    assert s.stats.lost_gaps == 0 and held(s) == {100 + i for i in range(6)}


def test_a_generation_rebuilt_from_its_journal_past_max_early_loses_no_gap():
    """The sequencing model (SpillingSequencing, SEQUENCING_SEED=13): a pod back from a flap published its
    buffer again while its first batches were still in flight; the generation's reset was stored after
    a dozen of its batches. Rebuilt from the journal, those batches were all held early, more than
    ``max_early``, and the next copy of one of them (a duplicate) declared the gap before them lost,
    clearing the worker, although the stream held every batch. With stream sequences the journal's
    messages are within their own bound (``max_journal``): only spilling, never a loss, keeps ``max_early``."""
    stream, s = ModelStream(), L1State(max_early=1, max_journal=1024)
    stream.feed(s, batch(0, [stored(9)], pod="127.0.1.2"))  # the stream's time known
    for seq in (2, 3, 4):  # first sight: applied provisionally, journaled
        stream.feed(s, batch(seq, [stored(100 + seq)], gen=5))
    stream.feed(s, {"v": 1, "type": "reset", "pod": "127.0.1.1", "rank": 0, "gen": 5, "next_seq": 0,
                    "reason": "subscribed"})
    stream.feed(s, batch(3, [stored(103)], gen=5))  # a copy of one held (a retry, or a run overlapping it)
    for seq in (0, 1):
        stream.feed(s, batch(seq, [stored(100 + seq)], gen=5))
    assert s.stats.lost_gaps == 0 and held(s) == {100, 101, 102, 103, 104}


def test_without_stream_sequences_too_many_held_batches_still_declare_the_gap_lost():
    s = L1State(max_early=2)
    s.apply(batch(0, [stored(100)]), 10**18)
    for seq in range(2, 5):
        s.apply(batch(seq, [stored(100 + seq)]), 10**18)
    assert s.stats.lost_gaps == 1 and s.stats.spilled == 0
