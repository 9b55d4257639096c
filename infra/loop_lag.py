"""How long the event loop was kept from answering, measured from inside the process.

A probe from outside (a router's latency, a benchmark's client) cannot tell a pause of the process's
own work (a long step of the event loop, which delays every query behind it) from a process waiting for
a core the node gives to someone else. Both matter, to different people: the first is this product's
to fix, the second is sizing (CPU requests and limits). Two measures:

- the lag: how late the process's timers fire (wall clock: both causes). Every timer the loop runs counts
  (a sleep, a timeout, a call_later: each a sample taken in the step timing below, one comparison), and the
  monitor's own timer, every ``every`` seconds (1 s), makes sure of a sample in a quiet process; each
  tick records the latest of them since the tick before. The process's periodic work ends its sleeps on
  one grid (infra/ticks.py): the monitor's tick runs first in that turn, and those timers, each run
  after the others due with it, do not count. A fast timer of its own (5 ms before) cost an idle
  process 200 wake-ups a second, about 3% of a core, more than the work it watched on a real trace;
- the steps: every callback the loop runs (``asyncio.Handle._run``: a task's step, an I/O callback),
  timed in CPU time of the loop's thread, so waiting for a core does not count: the longest piece of
  this process's own work, which a query arriving meanwhile waits for. Steps of 1 ms or more are
  counted (a CPU clock read and two wall clock reads a step otherwise); those over WARN_AFTER are logged with what ran.
"""

from __future__ import annotations

import asyncio
import asyncio.events
import logging
import time
from collections.abc import Callable

from cache_indexer.infra.throttled_log import ThrottledWarning
from cache_indexer.infra.ticks import grid_deadline, is_grid_timer, sleep_until

log = logging.getLogger(__name__)

#: steps of the loop's own work longer than this are logged (throttled): every query waited that long
WARN_AFTER = 0.1
#: steps shorter than this are not recorded
STEP_LEAST = 0.001
#: how long before the grid point the monitor's tick is due (infra/ticks.py)
_AHEAD = 1e-6

_observers: list[Callable[[float, asyncio.Handle], None]] = []
_plain_run = asyncio.events.Handle._run


#: the lag monitors of this process, each told of every timer's lateness
_lag_watchers: list[LoopLagMonitor] = []
_TimerHandle = asyncio.events.TimerHandle
#: the loop's clock (``BaseEventLoop.time``), which timers are set in
_thread_time, _wall = time.thread_time, time.monotonic


def _timed_run(self: asyncio.Handle) -> None:
    start, wall = _thread_time(), _wall()
    if self.__class__ is _TimerHandle and not is_grid_timer(self):  # due at self._when: how late it runs is the lag
        late = wall - self._when
        for watcher in _lag_watchers:
            if late > watcher.late:
                watcher.late = late
    _plain_run(self)
    # a thread's CPU time never runs ahead of the wall clock: a step shorter than STEP_LEAST in wall time
    # is shorter in CPU time too, and its second CPU clock read (a system call, about 0.5 us, where the
    # wall clock's is a vDSO read: 0.6 of the 1.2 us that timing a step cost) is not needed
    if _wall() - wall >= STEP_LEAST:
        took = _thread_time() - start
        if took >= STEP_LEAST:
            for observe in _observers:
                observe(took, self)


def _what(handle: asyncio.Handle) -> str:
    """A task's name and where its coroutine stands now, or the callback."""
    task = getattr(handle._callback, "__self__", None)
    if isinstance(task, asyncio.Task):
        frame = getattr(task.get_coro(), "cr_frame", None)
        at = f" at {frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else ""
        return f"task {task.get_name()}{at}"
    return repr(handle._callback)[:200]


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
    def __init__(self, metrics, every: float = 1.0) -> None:
        self.metrics = metrics
        self.every = every
        #: the latest any timer fired since the last tick (set by the step timing)
        self.late = 0.0
        self._task: asyncio.Task | None = None
        self._lag_max = WindowMax()
        self._step_max = WindowMax()
        self._warn = ThrottledWarning(log, every=30.0)

    def observe_step(self, took: float, handle: asyncio.Handle) -> None:
        self.metrics.loop_step.observe(took)
        self.metrics.loop_step_max.set(self._step_max.add(took))
        if took > WARN_AFTER:
            self._warn("a step of the event loop took %.0f ms of this process's own work (queries waited as "
                       "long): %s", took * 1e3, _what(handle))

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                # due just before the grid point: first in the turn it shares with the process's other
                # periodic work (infra/ticks.py), whose steps in that turn are no lag of the loop's
                due = grid_deadline(loop.time(), self.every) - _AHEAD
                await sleep_until(due)
                lag = max(0.0, loop.time() - due, self.late)
                self.late = 0.0
                self.metrics.loop_lag.observe(lag)
                self.metrics.loop_lag_max.set(self._lag_max.add(lag))
                self.metrics.loop_step_max.set(self._step_max.add(0.0))  # a quiet window ends too
            except asyncio.CancelledError:
                raise
            except Exception:  # never fatal: a monitor that dies would read as a quiet loop
                log.exception("event loop monitor")
                await asyncio.sleep(1.0)

    def start(self) -> None:
        if self._task is None:
            asyncio.events.Handle._run = _timed_run  # once per process; the plain one when nobody watches
            _observers.append(self.observe_step)
            _lag_watchers.append(self)
            self._task = asyncio.create_task(self._run(), name="event-loop-lag")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
            _observers.remove(self.observe_step)
            _lag_watchers.remove(self)
            if not _observers:
                asyncio.events.Handle._run = _plain_run
