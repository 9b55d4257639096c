"""The event loop's pauses as a served process reports them (infra/loop_lag.py): a step that keeps the
loop's thread on the CPU shows as ``busy`` lag, a thread kept off the CPU (as by a node short of cores,
here a blocking sleep) as ``wall`` lag only; read over real HTTP from /metrics."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from api.ops import make_ops_app
from api.server import HttpServer
from infra.loop_lag import WindowMax
from infra.loop_turns import LoopTurns
from infra.metrics import Metrics
from schemas.config import HttpConfig
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


async def _lag(session: aiohttp.ClientSession, port: int) -> dict[str, float]:
    async with session.get(f"http://127.0.0.1:{port}/metrics") as r:
        text = await r.text()
    out = {}
    for line in text.splitlines():
        if line.startswith("cache_indexer_event_loop_lag_max_seconds{"):
            out[line.split('kind="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return out


async def _served(step) -> dict[str, float]:
    """A process's ops server; ``step`` holds its loop once the monitor runs; the lags read afterwards."""
    metrics = Metrics()
    server = HttpServer(make_ops_app(metrics, lambda: True), HttpConfig(host="127.0.0.1", port=0), metrics)
    await server.start()
    try:
        async with aiohttp.ClientSession() as session:
            def sample(name: str) -> float:
                return metrics.registry.get_sample_value(f"cache_indexer_event_loop_lag_{name}", {"kind": "wall"}) or 0
            await wait_for(lambda: sample("seconds_count") >= 2, 5, "the monitor to run")
            step()  # a timer of the monitor is pending meanwhile
            await wait_for(lambda: sample("max_seconds") >= 0.06, 5, "the lag to show")
            return await _lag(session, server.port)
    finally:
        await server.stop()


async def test_a_long_step_of_the_processs_own_work_shows_as_busy_lag():
    def spin():
        end = time.thread_time() + 0.08
        while time.thread_time() < end:
            pass
    lag = await _served(spin)
    assert lag["wall"] >= 0.06 and lag["busy"] >= 0.06, lag


async def test_a_loop_kept_off_the_cpu_shows_as_wall_lag_only():
    lag = await _served(lambda: time.sleep(0.08))
    assert lag["wall"] >= 0.06 and lag["busy"] < 0.03, lag


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
