"""``QueryThreads``: the native query threads as an awaitable for the event loop. Answers equal the
calling thread's, a cancelled request's answer is dropped when it comes (nothing waits for it, nothing
leaks), closing cancels what waits, and the threads answer only the loop that started them."""

from __future__ import annotations

import asyncio
import json
import random
from array import array

import pytest

from indexer import hit_rate
from indexer.hit_rate import NativeQuery
from indexer.l1_state import L1State
from indexer.query_threads import QueryThreads
from schemas.block_hash import BlockHasher
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
