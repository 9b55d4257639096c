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
