"""The net under libzmq's edge-triggered FD signal: one sweep a loop, not one timed wait a reader.

A subscription's reader waits for its socket's FD (bridge/vllm_subscriber.py); were a signal missed, a
message would wait for the next one. A timed wait in every reader bounded that, but at 1,000 engines it
woke 1,000 readers a second (a task and a timer each: 8-10% of a core of an idle bridge, issue 37).
Instead one task a loop asks each waiting reader's socket every ``every`` seconds whether a message is
there (ZMQ_EVENTS, one getsockopt) and wakes only those that have one: a missed signal still costs at
most ``every`` of delay.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Callable

import zmq

from cache_indexer.infra.ticks import sleep_on_grid

log = logging.getLogger(__name__)


class ReadSweep:
    def __init__(self, every: float) -> None:
        self.every = every
        self._waiting: dict[int, tuple[zmq.Socket, asyncio.Event, Callable[[], None] | None]] = {}
        self._task: asyncio.Task | None = None
        #: readers woken by the sweep: each a signal libzmq's FD did not give
        self.woken = 0

    def watch(self, sock: zmq.Socket, wake: asyncio.Event, on_woken: Callable[[], None] | None = None) -> None:
        """Sweep ``sock`` until forgotten, setting ``wake`` when a message waits there (and telling
        ``on_woken``: the owner counts the signals libzmq did not give)."""
        self._waiting[id(wake)] = (sock, wake, on_woken)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="zmq-read-sweep")

    def forget(self, wake: asyncio.Event) -> None:
        self._waiting.pop(id(wake), None)
        if not self._waiting and self._task is not None:
            self._task.cancel()
            self._task = None

    def sweep(self) -> None:
        for sock, wake, on_woken in list(self._waiting.values()):
            if wake.is_set():
                continue
            try:
                ready = sock.closed or sock.get(zmq.EVENTS) & zmq.POLLIN
            except zmq.ZMQError:
                ready = True  # the reader meets the error itself
            if ready:
                self.woken += 1
                wake.set()
                if on_woken is not None:
                    on_woken()

    async def _run(self) -> None:
        while True:
            await sleep_on_grid(self.every)
            try:
                self.sweep()
            except Exception:  # never fatal: without the sweep a missed signal would wait for the next message
                log.exception("ZMQ read sweep")


_sweeps: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, ReadSweep] = weakref.WeakKeyDictionary()


def read_sweep(every: float) -> ReadSweep:
    """The running loop's sweep (made on first use)."""
    loop = asyncio.get_running_loop()
    sweep = _sweeps.get(loop)
    if sweep is None:
        sweep = _sweeps[loop] = ReadSweep(every)
    return sweep
