"""Consecutive work handed back to the event loop in turns of a bounded length.

nats-py runs a subscription's callback for each pending message in turn, without returning to the
event loop while messages are pending (``asyncio.Queue.get`` of a non-empty queue does not suspend).
A backlog (a replica catching up, a fleet's rolling update) was applied in one step of the loop: at 50M
entries the replica's loop was held up to 100-250 ms at a time by its own work, and every query waited
behind it. A callback ends its message with ``await turns.done()``: once ``budget`` seconds of work went
by since the loop last had a turn, the loop gets one (a select of the sockets: queries are read and
answered before the next message)."""

from __future__ import annotations

import asyncio
import time

#: the longest the loop goes without a turn while a backlog is worked off (a step may take longer)
TURN = 0.002


class LoopTurns:
    def __init__(self, budget: float = TURN, clock=time.perf_counter) -> None:
        self.budget = budget
        self.clock = clock
        self._since = clock()
        self.given = 0  # turns given so far (tests)

    async def done(self) -> None:
        """One piece of work is done: give the loop a turn if the budget is spent."""
        if self.clock() - self._since >= self.budget:
            await self.give()

    async def give(self) -> None:
        await asyncio.sleep(0)
        self.given += 1
        self._since = self.clock()
