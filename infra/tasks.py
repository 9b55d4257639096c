"""Stopping background tasks for sure.

``task.cancel()`` once is not enough around nats-py: a CancelledError that lands in its publish flush
(``Client._flush_pending``) is swallowed, and the once-cancelled task runs on, so a loop that publishes
or makes requests (a lease renewal, a poller, a watchdog) never stops and whoever awaits it hangs. The
helper cancels again until the tasks are done, within a bound.
"""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger(__name__)


async def cancel_and_wait(*tasks: asyncio.Task | None, timeout: float = 10.0) -> None:
    """Cancel the tasks (None entries are skipped) and wait until each is done; re-cancel while waiting."""
    pending = {t for t in tasks if t is not None}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while pending:
        for t in pending:
            t.cancel()
        left = deadline - loop.time()
        if left <= 0:
            log.warning("tasks still running after %.0fs of cancelling: %s", timeout,
                        ", ".join(sorted(t.get_name() for t in pending)))
            break
        _, pending = await asyncio.wait(pending, timeout=min(0.1, left))
    for t in tasks:  # an exception of a stopped task is not news: mark it retrieved
        if t is not None and t.done() and not t.cancelled():
            t.exception()
