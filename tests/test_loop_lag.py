"""The event loop's pauses as a served process reports them (infra/loop_lag.py): a step that keeps the
loop's thread on the CPU shows as a long step and as lag, a thread kept off the CPU (as by a node short
of cores, here a blocking sleep) as lag only; read over real HTTP from /metrics. And the turns a backlog
gives the loop (infra/loop_turns.py)."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from cache_indexer.api.ops import make_ops_app
from cache_indexer.api.server import HttpServer
from cache_indexer.infra.loop_lag import LoopLagMonitor, WindowMax
from cache_indexer.infra.loop_turns import LoopTurns
from cache_indexer.infra.metrics import Metrics
from cache_indexer.schemas.config import HttpConfig
from tests.conftest import wait_for


def test_the_window_max_keeps_the_longest_of_the_last_one_or_two_windows():
    now = [0.0]
    w = WindowMax(span=10.0, clock=lambda: now[0])
    assert w.add(0.002) == 0.002
    now[0] = 5.0
    assert w.add(0.050) == 0.050
    now[0] = 12.0  # a new window: the last one's longest still counts
    assert w.add(0.001) == 0.050
    now[0] = 23.0  # two windows on: forgotten
    assert w.add(0.003) == 0.003
    now[0] = 60.0  # after a silence longer than two windows, nothing older counts
    assert w.add(0.001) == 0.001


async def _gauges(session: aiohttp.ClientSession, port: int) -> dict[str, float]:
    async with session.get(f"http://127.0.0.1:{port}/metrics") as r:
        text = await r.text()
    out = {}
    for name in ("lag", "step"):
        prefix = f"cache_indexer_event_loop_{name}_max_seconds "
        out[name] = next(float(line[len(prefix):]) for line in text.splitlines() if line.startswith(prefix))
    return out


async def _served(step) -> dict[str, float]:
    """A process's ops server; ``step`` holds its loop once the monitor runs; the longest lag and step
    read afterwards."""
    metrics = Metrics()
    server = HttpServer(make_ops_app(metrics, lambda: True), HttpConfig(host="127.0.0.1", port=0), metrics)
    await server.start()
    try:
        async with aiohttp.ClientSession() as session:
            def sample(name: str) -> float:
                return metrics.registry.get_sample_value(f"cache_indexer_event_loop_lag_{name}") or 0
            await wait_for(lambda: sample("seconds_count") >= 2, 5, "the monitor to run")
            asyncio.get_running_loop().call_soon(step)  # a step of its own while a timer of the monitor is pending
            await wait_for(lambda: sample("max_seconds") >= 0.06, 5, "the lag to show")
            return await _gauges(session, server.port)
    finally:
        await server.stop()


async def test_a_long_step_of_the_processs_own_work_shows_as_a_long_step_and_lag():
    def spin():
        end = time.thread_time() + 0.08
        while time.thread_time() < end:
            pass
    out = await _served(spin)
    assert out["lag"] >= 0.06 and out["step"] >= 0.075, out


async def test_a_loop_kept_off_the_cpu_shows_as_lag_only():
    out = await _served(lambda: time.sleep(0.08))
    assert out["lag"] >= 0.06 and out["step"] < 0.02, out
    assert asyncio.events.Handle._run.__name__ == "_run", "the plain step again once nobody watches"


async def test_an_idle_monitor_wakes_its_loop_once_a_second_not_two_hundred_times():
    """Its own timer is coarse (1 s): a 5 ms one cost an idle process about 3% of a core (issue 37). ~1.5 s."""
    metrics = Metrics()
    monitor = LoopLagMonitor(metrics)

    def ticks() -> float:
        return metrics.registry.get_sample_value("cache_indexer_event_loop_lag_seconds_count") or 0
    monitor.start()
    try:
        await wait_for(lambda: ticks() >= 1, 5, "a first tick (on the next whole second: infra/ticks.py)")
        await asyncio.sleep(1.5)  # (this sleep is one timer more, not a tick)
        assert ticks() == 2, ticks()
    finally:
        await monitor.stop()


async def test_periodic_work_due_with_the_monitors_tick_is_no_lag(monkeypatch):
    """From a review: periodic work ends its sleeps on the monitor's grid (infra/ticks.py); where its timer
    ran first in the turn they share, its step (a read sweep over many sockets, say) was reported as the
    loop's lag at every tick. The tick is now due just before the grid point. ~1 s."""
    from cache_indexer.infra import ticks as grid

    monkeypatch.setattr(grid, "GRID", 0.1)
    metrics = Metrics()
    monitor = LoopLagMonitor(metrics, every=0.1)

    async def periodic() -> None:
        for _ in range(8):
            await grid.sleep_on_grid(0.1)
            spin_until = time.thread_time() + 0.04  # 40 ms of its own work, at each grid point
            while time.thread_time() < spin_until:
                pass
    work = asyncio.create_task(periodic())
    await asyncio.sleep(0)  # its timer set first: it would run first in the turn
    monitor.start()
    try:
        await work
        ticks = metrics.registry.get_sample_value("cache_indexer_event_loop_lag_seconds_count")
        lag = metrics.registry.get_sample_value("cache_indexer_event_loop_lag_max_seconds")
        step = metrics.registry.get_sample_value("cache_indexer_event_loop_step_max_seconds")
        assert ticks >= 5 and step >= 0.035, (ticks, step)
        assert lag < 0.02, lag
    finally:
        await monitor.stop()


async def test_a_pause_shows_as_lag_through_any_timer_of_the_process_while_the_monitors_own_is_not_due():
    """The monitor's timer fires on time after the pause (it is due 0.5 s after the last tick); a timer the
    process set for 5 ms into the pause fires 75 ms late, and that is the lag recorded. ~1 s."""
    metrics = Metrics()
    monitor = LoopLagMonitor(metrics, every=0.5)

    def count() -> float:
        return metrics.registry.get_sample_value("cache_indexer_event_loop_lag_seconds_count") or 0
    monitor.start()
    try:
        await wait_for(lambda: count() >= 1, 5, "a first tick")
        loop = asyncio.get_running_loop()
        loop.call_later(0.005, lambda: None)
        loop.call_soon(time.sleep, 0.08)  # kept off the CPU, right after a tick
        await wait_for(lambda: count() >= 2, 5, "the next tick")
        lag = metrics.registry.get_sample_value("cache_indexer_event_loop_lag_max_seconds")
        assert lag >= 0.06, lag
    finally:
        await monitor.stop()


async def test_work_hands_the_loop_a_turn_once_its_budget_is_spent():
    now = [0.0]
    turns = LoopTurns(budget=0.002, clock=lambda: now[0])
    ran: list[float] = []

    async def query() -> None:
        ran.append(now[0])
    asyncio.get_running_loop().create_task(query())
    now[0] = 0.001
    await turns.done()  # within the budget: no turn, the query waits
    assert ran == [] and turns.given == 0
    now[0] = 0.0025
    await turns.done()  # spent: the query runs before the next piece of work
    assert ran == [0.0025] and turns.given == 1
