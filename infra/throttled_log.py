"""One warning per interval for a burst of similar problems, with a count of those held back: a NATS
server that is down (nats-py reports every reconnect attempt, two a second) or an engine sending
malformed batches would otherwise drown the log."""

from __future__ import annotations

import logging
import time


class ThrottledWarning:
    """Logs a warning (or a record at ``level``) at most once per ``every`` seconds (held-back ones at
    debug) and says how many it held back."""

    def __init__(self, logger: logging.Logger, every: float = 30.0, clock=time.monotonic,
                 level: int = logging.WARNING) -> None:
        self.logger = logger
        self.every = every
        self.clock = clock
        self.level = level
        self._last: float | None = None
        self._held = 0

    def __call__(self, msg: str, *args, exc_info: bool = False) -> None:
        now = self.clock()
        if self._last is not None and now - self._last < self.every:
            self._held += 1
            self.logger.debug(msg, *args)
            return
        if self._held:
            msg += f" ({self._held} more held back in the last {now - self._last:.0f}s)"
        self.logger.log(self.level, msg, *args, exc_info=exc_info)
        self._last, self._held = now, 0
