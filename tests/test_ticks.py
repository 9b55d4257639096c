"""Periodic sleeps ended on one grid (infra/ticks.py): never longer than asked, and ones due in the same
grid interval wake the process once."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, strategies as st

from cache_indexer.infra import ticks
from cache_indexer.infra.ticks import GRID, SLACK, grid_delay, sleep_on_grid, wait_on_grid


@given(now=st.floats(0, 1e7), seconds=st.floats(GRID, 3600))
def test_a_sleep_on_the_grid_ends_on_it_no_later_than_asked(now, seconds):
    d = grid_delay(now, seconds)
    end = now + d
    assert d <= seconds + SLACK + 1e-6
    assert d > seconds - GRID - 1e-6  # at most one grid interval early
    assert d > 0
    assert abs(end / GRID - round(end / GRID)) < 1e-6


@given(now=st.floats(0, 1e7), seconds=st.floats(0, GRID, exclude_max=True))
def test_a_period_under_the_grid_is_slept_as_asked(now, seconds):
    assert grid_delay(now, seconds) == seconds


def test_a_timer_fired_a_little_early_does_not_end_its_next_sleep_at_once():
    # asyncio runs a timer a clock resolution early: the next sleep must not end on the point just left
    assert grid_delay(10.0 * GRID - 1e-7, GRID) == pytest.approx(GRID, abs=1e-6)
    assert grid_delay(10.0 * GRID + 1e-7, GRID) == pytest.approx(GRID, abs=1e-6)


async def test_periodic_sleeps_started_apart_wake_the_loop_together(monkeypatch):
    """Three loops of different periods, started at different moments: every wake-up of the slower ones
    lands in a turn of the loop that the fastest one's wake-up also takes (the same grid point exactly)."""
    monkeypatch.setattr(ticks, "GRID", 0.05)
    loop = asyncio.get_running_loop()
    woke: dict[str, list[float]] = {"1x": [], "2x": [], "3x": []}

    async def periodic(name: str, every: float) -> None:
        while True:
            await sleep_on_grid(every)
            woke[name].append(loop.time())

    tasks = []
    for name, every in (("1x", 0.05), ("2x", 0.1), ("3x", 0.15)):
        tasks.append(asyncio.create_task(periodic(name, every)))
        await asyncio.sleep(0.013)  # each starts at another phase of the grid
    try:
        async with asyncio.timeout(10):
            while len(woke["3x"]) < 4:
                await asyncio.sleep(0.01)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    fast = woke["1x"]
    for name in ("2x", "3x"):
        for t in woke[name][1:]:  # (the first wake-up of a loop started later may precede the fast one's first)
            nearest = min(fast, key=lambda f: abs(f - t))
            assert abs(nearest - t) < 0.002, (name, t, fast)


async def test_wait_on_grid_says_whether_the_event_came():
    ev = asyncio.Event()
    assert await wait_on_grid(ev, 0.01) is False
    asyncio.get_running_loop().call_later(0.01, ev.set)
    assert await wait_on_grid(ev, 30.0) is True
