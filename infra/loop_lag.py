"""How long the event loop was kept from answering, measured from inside the process.

A probe from outside (a router's latency, a benchmark's client) cannot tell a pause of the replica's
own work (a long step on the event loop, which delays every query behind it) from a process waiting for
a core the node gives to someone else. Both matter, to different people: the first is this product's
to fix, the second is sizing (CPU requests and limits). A timer set every ``every`` seconds measures
how late it fires (``lag``); the CPU time the loop's thread used meanwhile bounds how much of that was
its own work (``busy``: the smaller of the two). A step of d seconds shows as a lag between d - every
and d, so the figures are within ``every`` (5 ms) of the pause.
"""

from __future__ import annotations

import asyncio
import logging
import time

from infra.throttled_log import ThrottledWarning

log = logging.getLogger(__name__)

#: pauses of the loop's own work longer than this are logged (throttled): every query waited that long
WARN_AFTER = 0.1


class WindowMax:
    """The largest value seen in the current window of ``span`` seconds or the one before it: a gauge a
    scraper reads as "the longest in the last span to 2 x span seconds"."""

    def __init__(self, span: float = 10.0, clock=time.monotonic) -> None:
        self.span = span
        self.clock = clock
        self._start = clock()
        self._cur = self._prev = 0.0

    def add(self, value: float) -> float:
        now = self.clock()
        if now - self._start >= self.span:
            self._prev = self._cur if now - self._start < 2 * self.span else 0.0
            self._cur, self._start = 0.0, now
        self._cur = max(self._cur, value)
        return max(self._cur, self._prev)


class LoopLagMonitor:
    def __init__(self, metrics, every: float = 0.005) -> None:
        self.metrics = metrics
        self.every = every
        self._task: asyncio.Task | None = None
        self._lag_max = WindowMax()
        self._busy_max = WindowMax()
        self._warn = ThrottledWarning(log, every=30.0)

    def observe(self, lag: float, busy: float) -> None:
        m = self.metrics
        m.loop_lag.labels("wall").observe(lag)
        m.loop_lag.labels("busy").observe(busy)
        m.loop_lag_max.labels("wall").set(self._lag_max.add(lag))
        m.loop_lag_max.labels("busy").set(self._busy_max.add(busy))
        if busy > WARN_AFTER:
            self._warn("the event loop was held %.0f ms by this process's own work (queries waited as long)",
                       busy * 1e3)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                t, cpu = loop.time(), time.thread_time()
                await asyncio.sleep(self.every)
                lag = max(0.0, loop.time() - t - self.every)
                self.observe(lag, min(lag, time.thread_time() - cpu))
            except asyncio.CancelledError:
                raise
            except Exception:  # never fatal: a monitor that dies would read as a quiet loop
                log.exception("event loop monitor")
                await asyncio.sleep(1.0)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="event-loop-lag")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
