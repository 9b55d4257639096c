"""The subscriber's pending run and its queue: what arrives while a run is being published is not
forgotten (a CI run hung on it: the queue's signal was cleared after the await that published)."""

from __future__ import annotations

import asyncio

import zmq.asyncio

from cache_indexer.bridge.endpoint import Endpoint
from cache_indexer.bridge.vllm_subscriber import VllmSubscriber
from cache_indexer.infra.config_loader import load_config
from cache_indexer.infra.metrics import Metrics
from cache_indexer.simulate.vllm_engine import batch_payload, stored
from tests.conftest import wait_for


class GatedSink:
    """Stands in for the stream: records what is published; a run waits for ``gate`` (a full window)."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.runs: list[list[int]] = []
        self.resets = 0

    async def run(self, pod, rank, gen, batches, epoch=""):
        await self.gate.wait()
        self.runs.append([seq for seq, _, _ in batches])

    async def reset(self, *args, **kw):
        self.resets += 1


async def test_a_batch_queued_while_the_pending_run_is_published_is_handled():
    cfg = load_config(env={}, overrides=["ingest.l1.blockKeyCheckInterval=0"]).ingest.l1
    ctx = zmq.asyncio.Context()
    sink = GatedSink()
    sub = VllmSubscriber(ctx, Endpoint("127.0.0.1", 0, "tcp://127.0.0.1:1", None), cfg, sink, Metrics(),
                         asyncio.Semaphore(1))
    sub.sequencer.gen, sub.sequencer.last = 7, 4
    sub.sequencer.pending.add(7, 4, 1.0, [], 0, 0)  # handed on after a replay, not yet published
    task = asyncio.create_task(sub._loop())
    try:
        await wait_for(lambda: not sink.gate.is_set() and sub.sequencer.pending.batches == [], 5, "the run being published")
        sub._take([b"", (5).to_bytes(8, "big"), batch_payload([stored([11], block_size=4)])])  # as the reader does
        sub._queued.set()
        sink.gate.set()  # the publish completes
        await wait_for(lambda: sink.runs == [[4], [5]], 5, "the batch queued meanwhile published too")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        ctx.term()


async def test_a_stop_cancelled_again_while_it_closes_still_closes_the_socket():
    """A CI hang (tests/test_discovery.py, a bad reload, 1 run in 6 once periodic work woke on whole
    seconds): a bridge stopping while a pod was being removed cancels the removal (``cancel_and_wait``
    cancels until it is done); a cancel that landed while the subscription's stop waited for its reader
    left the SUB socket open, and the bridge's ``ctx.term()`` waited for it for ever."""
    cfg = load_config(env={}).ingest.l1
    ctx = zmq.asyncio.Context()
    sub = VllmSubscriber(ctx, Endpoint("127.0.0.1", 0, "tcp://127.0.0.1:1", None), cfg, GatedSink(), Metrics(),
                         asyncio.Semaphore(1))
    sub._open()
    sock = sub._sock
    may_end = asyncio.Event()

    async def slow_to_end() -> None:  # a reader that takes a while to end once cancelled
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            while not may_end.is_set():
                try:
                    await may_end.wait()
                except asyncio.CancelledError:
                    continue
            raise
    sub._reader.cancel()
    await asyncio.gather(sub._reader, return_exceptions=True)
    sub._reader = reader = asyncio.create_task(slow_to_end())
    try:
        await asyncio.sleep(0)  # (the reader waiting)
        stopping = asyncio.create_task(sub.stop())
        await wait_for(lambda: reader.cancelling() > 0, 5, "the stop waiting for the reader")
        stopping.cancel()  # the caller cancelled again
        await asyncio.gather(stopping, return_exceptions=True)
        assert sock.closed and sub._sock is None
    finally:
        may_end.set()
        await asyncio.gather(reader, return_exceptions=True)
        ctx.destroy(linger=0)
