"""The sleeps of a process's periodic work, ended on one grid of whole seconds so that they wake it together.

A quiet process pays for each time it wakes: a Python process that slept finds its caches cold, and a
wake-up costs it about as much as a small message does (bench/RESULTS.md, the trace section's quiet
second). Timers set apart (the loop-lag tick, a lease's renewal, the static targets file's check, the
read sweep, the stream checks) each wake it on their own; ended on the same grid, the ones due in the
same second wake it once. The grid is the loop's clock (``CLOCK_MONOTONIC``, the same for every process
of a node), so the processes of a pod, and nats-server's work for them, meet too.

A sleep on the grid is never longer than asked (by at most ``SLACK``): a lease renewed on it is renewed
no later. Its first sleep is shorter (up to the first grid point); a period under the grid's is slept
as asked.
"""

from __future__ import annotations

import asyncio
import math

#: seconds between the grid's points
GRID = 1.0
#: how far past the asked time a sleep may end to land on the grid (a timer fired a little early or late
#: must not make the next sleep end on the point it just left)
SLACK = 0.01


def grid_delay(now: float, seconds: float) -> float:
    """Seconds from ``now`` to the last grid point at most ``seconds`` (plus SLACK) away; ``seconds``
    itself where it is shorter than the grid."""
    if not seconds >= GRID:
        return seconds
    return math.floor((now + seconds + SLACK) / GRID) * GRID - now


def grid_deadline(now: float, seconds: float) -> float:
    """The loop time ``grid_delay`` ends at."""
    return now + grid_delay(now, seconds)


async def sleep_on_grid(seconds: float) -> None:
    """``asyncio.sleep(seconds)``, ended on the grid (at the grid point exactly, not a few microseconds
    after it as a delay counted from a later clock read would: timers due at one point run in one turn
    of the loop)."""
    loop = asyncio.get_running_loop()
    if not seconds >= GRID:
        await asyncio.sleep(seconds)
        return
    await sleep_until(grid_deadline(loop.time(), seconds))


async def sleep_until(when: float) -> None:
    """Sleeps until the loop's time ``when``. Its timer is known to the loop-lag monitor as periodic work
    on the grid (``is_grid_timer``): several fire in one turn, each after the ones before it in that turn,
    which is no lateness of the loop's."""
    done = asyncio.get_running_loop().create_future()
    timer = asyncio.get_running_loop().call_at(when, _wake, done)
    try:
        await done
    finally:
        timer.cancel()


def is_grid_timer(handle: asyncio.TimerHandle) -> bool:
    return handle._callback is _wake


async def wait_on_grid(event: asyncio.Event, seconds: float) -> bool:
    """Waits for ``event`` at most until about the grid point ``sleep_on_grid(seconds)`` would end at
    (``wait_for`` reads the clock again: microseconds after it); whether it was set."""
    try:
        await asyncio.wait_for(event.wait(), grid_delay(asyncio.get_running_loop().time(), seconds))
    except asyncio.TimeoutError:
        return False
    return True


def _wake(done: asyncio.Future) -> None:
    if not done.done():
        done.set_result(None)
