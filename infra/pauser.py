"""Long work on the event loop in pieces: the API, the NATS client and the ZMQ readers share one loop
(in local mode all of them), so a piece of work that runs for long delays every answer behind it.

``await pause()`` inside such a loop gives the loop up for ``rest`` seconds once ``hold`` seconds of
work ran since the last pause; cheap to call often (a clock read). Not ``sleep(0)``: that yields for one
turn of the loop, and an HTTP request needs several (read, handle, body, write), so it would wait a
whole piece at each: a real rest lets requests in flight finish. Data already buffered by aiohttp is
read without suspending, so reading a large body needs it too.
"""

from __future__ import annotations

import asyncio
import time

#: The longest one piece holds the loop, and the rest after it: background work gets at most half of
#: the loop while it runs (a hit-rate answer takes about 2 ms).
HOLD_SECONDS = 0.002
REST_SECONDS = 0.002


class Pauser:
    def __init__(self, hold: float = HOLD_SECONDS, rest: float = REST_SECONDS) -> None:
        self._hold = hold
        self._rest = rest
        self._since = time.perf_counter()

    async def __call__(self) -> None:
        if time.perf_counter() - self._since >= self._hold:
            await asyncio.sleep(self._rest)
            self._since = time.perf_counter()
