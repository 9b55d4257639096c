"""Stopping background tasks: a cancellation swallowed once (as nats-py does inside its publish flush)
must not leave a task running, and a task that never stops must not hang whoever stops it."""

from __future__ import annotations

import asyncio
import logging
import random
import time

import nats

from cache_indexer.infra.lease import Lease
from cache_indexer.infra.tasks import cancel_and_wait


async def test_a_task_that_swallows_one_cancellation_is_stopped():
    rounds = 0

    async def loop_like_nats_py():
        nonlocal rounds
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if rounds == 0:  # swallowed, like Client._flush_pending's "except CancelledError: pass"
                    rounds += 1
                    continue
                raise

    task = asyncio.create_task(loop_like_nats_py())
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_and_wait(task), 5)
    assert task.cancelled() and rounds == 1


async def test_a_task_that_never_stops_is_given_up_within_the_bound(caplog):
    release = asyncio.Event()

    async def stubborn():
        while not release.is_set():
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                pass

    task = asyncio.create_task(stubborn(), name="stubborn")
    await asyncio.sleep(0)
    t = time.monotonic()
    with caplog.at_level(logging.WARNING):
        await cancel_and_wait(task, timeout=0.5)
    assert 0.4 < time.monotonic() - t < 3
    assert "stubborn" in caplog.text and not task.done()
    release.set()
    task.cancel()
    await asyncio.wait({task}, timeout=5)


async def test_leases_stop_whenever_they_are_stopped(nats_url, stream_prefix):
    """Stop at random moments of a fast renewal loop: every stop returns (it once hung in CI)."""
    nc = await nats.connect(nats_url)
    try:
        rng = random.Random(1)
        for i in range(60):
            lease = Lease(nc.jetstream(), f"{stream_prefix}-lease", "k", f"holder-{i}", ttl=0.3)
            lease.start()
            await asyncio.sleep(rng.random() * 0.1)  # a random point of the renewal loop is the subject
            await asyncio.wait_for(lease.stop(), 15)
            assert lease._task.done() and not lease.is_leader
    finally:
        await nc.close()
