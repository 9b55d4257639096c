"""Bytes of vLLM batches the bridge holds received but not yet published, all engines together.

libzmq bounds a socket's queue by message count only (12 KB batches arriving faster than they are
published took the bridge from 95 MB to 1.34 GB). Each subscription therefore reads its socket ahead
into a queue of its own and takes the bytes from this budget first; what does not fit is dropped and
replayed later from the engine's buffer. Live queues may fill half of the budget, so a replay that
repairs the drops always finds room; a replay also gets one batch when nothing is left, so it
progresses (the bound is then exceeded by at most one batch per concurrent replay).

Freed memory is given back to the system once the budget empties after a peak: glibc keeps freed
small blocks in its arenas (824 MB stayed once the queue was empty again), libzmq's I/O thread's arena included.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time

log = logging.getLogger(__name__)

#: Budget bytes a batch costs beyond its frames (the tuple, the bytes objects' headers).
BATCH_OVERHEAD = 64
#: The budget empty again after at least this many bytes taken: memory goes back to the system (malloc_trim).
TRIM_AFTER_BYTES = 8 << 20
#: ... at most this often.
TRIM_EVERY = 10.0


def _malloc_trim():
    """glibc's malloc_trim, or None elsewhere (musl, macOS)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


class ReceiveBudget:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.taken = 0
        self.peak = 0  # most taken since the last trim
        self._trim = _malloc_trim()
        self._last_trim = float("-inf")

    def take_live(self, n: int) -> bool:
        """Room for a live batch: within half of the limit (the other half is the replays')."""
        if self.taken + n > self.limit // 2:
            return False
        self._take(n)
        return True

    def take_replay(self, n: int, first: bool) -> bool:
        """Room for a replayed batch: within the limit, or the first of a replay in any case."""
        if not first and self.taken + n > self.limit:
            return False
        self._take(n)
        return True

    def _take(self, n: int) -> None:
        self.taken += n
        if self.taken > self.peak:
            self.peak = self.taken

    def give(self, n: int) -> None:
        self.taken -= n
        if self.taken == 0 and self.peak >= TRIM_AFTER_BYTES and self._trim is not None:
            now = time.monotonic()
            if now - self._last_trim >= TRIM_EVERY:
                self._last_trim, self.peak = now, 0
                self._trim(0)
