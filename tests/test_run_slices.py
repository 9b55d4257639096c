"""A long coalesced run is applied in slices of whole batches (indexer/run_slices.py), with the event
loop free between them: the slices hold together as runs, applying them is applying the run, a snapshot
taken between two slices is completed by the run applied again after a restore, and a real replica
gives its loop to other work between the slices of a run it reads from a real stream. Random runs print
their seed."""

from __future__ import annotations

import asyncio
import random

import msgpack
import pytest

from cache_indexer.indexer.block_index import BlockIndex
from cache_indexer.indexer.l1_state import L1State
from cache_indexer.indexer.run_slices import SLICE_BLOCKS, run_slices
from cache_indexer.indexer.service import Indexer
from cache_indexer.infra.streams import l1_subject
from cache_indexer.schemas.events import run_error
from tests.conftest import make_config, wait_for


def _run(rng: random.Random, pod: str, seq: int, batches: int, most: int) -> dict:
    """A run of batches of random events: stores mostly, some removals of what it stored, a clear now and
    then, empty batches too (a vLLM step can publish none)."""
    events, ends, stored = [], [], []
    for _ in range(batches):
        for _ in range(rng.choice([0, 1, 1, 2, 3])):
            roll = rng.random()
            if roll < 0.8 or not stored:
                hashes = [rng.getrandbits(64) for _ in range(rng.randrange(1, most))]
                stored += hashes
                events.append({"kind": "stored", "hashes": hashes})
            elif roll < 0.97:
                events.append({"kind": "removed", "hashes": rng.sample(stored, min(len(stored), rng.randrange(1, 50)))})
            else:
                events.append({"kind": "cleared"})
        ends.append(len(events))
    return {"type": "batch", "v": 1, "pod": pod, "rank": 0, "gen": 1, "seq": seq, "last_seq": seq + batches - 1,
            "ends": ends, "events": events}


def _view(state: L1State) -> dict:
    blocks = dict(state.blocks.items())
    return {key: sorted(h for h, m in blocks.items() if m >> wid & 1) for key, wid in state.workers.items()}


def _fresh(native: bool) -> L1State:
    state = L1State()
    if not native:
        state.index = BlockIndex()
    return state


def _blocks(msg: dict) -> int:
    return sum(len(e.get("hashes") or ()) or 1 for e in msg["events"])


@pytest.mark.parametrize("native", [False, True])
def test_slices_are_runs_of_whole_batches_and_applying_them_is_applying_the_run(native):
    seed = random.SystemRandom().randrange(1 << 32)
    print(f"seed={seed}")
    rng = random.Random(seed)
    for _ in range(30):
        limit = rng.choice([1, 50, 300, 1000])
        msg = _run(rng, "10.0.0.1", rng.randrange(0, 1000), rng.randrange(1, 120), rng.choice([2, 40, 400]))
        pieces = run_slices(msg, limit)
        assert [e for p in pieces for e in p["events"]] == msg["events"]
        assert pieces[0]["seq"] == msg["seq"] and pieces[-1]["last_seq"] == msg["last_seq"]
        for a, b in zip(pieces, pieces[1:]):
            assert b["seq"] == a["last_seq"] + 1
        for p in pieces:
            assert run_error(p) is None
            nonempty = sum(b > a for a, b in zip([0] + p["ends"], p["ends"]))
            assert _blocks(p) <= limit or nonempty == 1, "over the limit only as one batch (and empty ones)"
        whole, sliced = _fresh(native), _fresh(native)
        whole.apply(msg)
        for p in pieces:
            sliced.apply(p)
        assert _view(sliced) == _view(whole)
        # a snapshot between two slices, restored, then the whole run again (the stream redelivers it)
        cut = rng.randrange(len(pieces))
        restored = _fresh(native)
        for p in pieces[:cut]:
            restored.apply(p)
        restored.apply(msg)
        assert _view(restored) == _view(whole), f"cut after {cut} of {len(pieces)} slices"


def test_what_is_not_a_long_well_formed_run_stays_whole():
    rng = random.Random(1)
    short = _run(rng, "10.0.0.1", 0, 3, 5)
    assert run_slices(short, 10_000) == [short]
    single = {"type": "batch", "pod": "p", "rank": 0, "gen": 1, "seq": 4,
              "events": [{"kind": "stored", "hashes": list(range(1, SLICE_BLOCKS * 2))}]}
    assert run_slices(single) == [single], "one batch is never cut"
    broken = dict(_run(rng, "10.0.0.1", 0, 50, 400), ends=[1, 0])
    assert run_slices(broken, 10) == [broken], "a malformed run is left for the state to refuse"
    assert run_slices({"type": "reset", "pod": "p", "rank": 0, "gen": 2, "next_seq": 0}, 1)[0]["type"] == "reset"


async def test_a_replica_answers_between_the_slices_of_a_long_run(nats_url, stream_prefix, monkeypatch):
    """A run of 40 batches x 512 blocks, published to the real stream as the bridge publishes runs: the
    replica applies it in slices, other tasks of its loop run between every two of them, and the index
    ends as the run applied whole."""
    cfg = make_config(nats_url, stream_prefix, snapshot={"enabled": False})
    rng = random.Random(7)
    events = [{"kind": "stored", "hashes": [rng.getrandbits(64) for _ in range(512)]} for _ in range(40)]
    run = {"type": "batch", "v": 1, "pod": "10.9.0.1", "rank": 0, "gen": 1, "seq": 0, "last_seq": 39,
           "ends": list(range(1, 41)), "events": events}
    indexer = Indexer(cfg)
    ticks = 0
    seen: list[int] = []
    apply = indexer.l1.apply

    def counted(msg, stored_ns=None, *args, **kw):
        seen.append(ticks)
        apply(msg, stored_ns, *args, **kw)
    monkeypatch.setattr(indexer.l1, "apply", counted)

    async def ticker():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)
    await indexer.start()
    tick_task = asyncio.create_task(ticker())
    try:
        reset = {"type": "reset", "v": 1, "pod": "10.9.0.1", "rank": 0, "gen": 1, "next_seq": 0}
        for msg in (reset, run):
            await indexer.js.publish(l1_subject(cfg.nats.l1Stream.subjectPrefix, "10.9.0.1", 0), msgpack.packb(msg),
                                     stream=cfg.nats.l1Stream.name)
        await wait_for(lambda: indexer.applied_seq >= 2, 20, "the run to be applied")
        slices = seen[1:]  # after the reset
        assert len(slices) == len(run_slices(run)) >= 5, seen
        assert all(b > a for a, b in zip(slices, slices[1:])), f"the loop ran nothing between slices: {seen}"
        whole = L1State()
        whole.apply(reset)
        whole.apply(run)
        assert _view(indexer.l1) == _view(whole)
    finally:
        tick_task.cancel()
        await asyncio.gather(tick_task, return_exceptions=True)
        await indexer.stop()
