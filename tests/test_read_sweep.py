"""The net under libzmq's FD signal (bridge/read_sweep.py), on real ZMQ sockets over loopback: idle
readers are left asleep, a message whose signal nobody heard is found within one sweep. About 3 s."""

from __future__ import annotations

import asyncio
import time

import zmq

from cache_indexer.bridge.read_sweep import ReadSweep, read_sweep
from tests.conftest import wait_for


def _pair(ctx: zmq.Context) -> tuple[zmq.Socket, zmq.Socket]:
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    return pub, sub


async def test_idle_readers_stay_asleep_and_a_message_without_a_signal_wakes_its_reader_within_a_sweep():
    ctx = zmq.Context()
    pairs = [_pair(ctx) for _ in range(50)]
    try:
        sweep = ReadSweep(every=0.2)
        wakes = [asyncio.Event() for _ in pairs]
        told = []
        for i, ((_, sub), wake) in enumerate(zip(pairs, wakes)):
            sweep.watch(sub, wake, lambda i=i: told.append(i))  # nobody listens to the FDs: only the sweep wakes
        await asyncio.sleep(1.0)  # five sweeps over fifty idle sockets
        assert sweep.woken == 0 and not any(w.is_set() for w in wakes)

        pub, sub = pairs[7]
        deadline = time.monotonic() + 5
        while not sub.poll(0) and time.monotonic() < deadline:  # a slow joiner: publish until one is there
            pub.send(b"batch")
            await asyncio.sleep(0.01)
        started = time.monotonic()
        await wait_for(wakes[7].is_set, 2, "the sweep to find the message")
        assert time.monotonic() - started <= 0.5
        assert sweep.woken == 1 and sum(w.is_set() for w in wakes) == 1
        assert told == [7]  # the owner is told (the bridge counts it: ..._bridge_read_sweep_wakeups_total)

        for wake in wakes:
            sweep.forget(wake)
        assert sweep._task is None  # the last reader gone, the sweep stops
    finally:
        for pub, sub in pairs:
            pub.close(0)
            sub.close(0)
        ctx.term()


async def test_one_sweep_a_loop():
    assert read_sweep(1.0) is read_sweep(1.0)
