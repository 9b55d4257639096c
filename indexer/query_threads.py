"""The native query threads as an awaitable for the event loop.

The loop prepares a ``NativeQuery`` (with the GIL: the candidates' workers), ``QueryThreads.run`` hands it
to native threads that parse, hash and walk without ever taking the GIL (``_native_index.QueryPool``,
``indexer/native_pool.h`` says why not Python threads), and a pipe the loop watches wakes it when answers
are in. A request cancelled meanwhile (its client went away) has its answer dropped when it comes.
"""

from __future__ import annotations

import asyncio
import itertools
import logging

from cache_indexer.indexer.block_index import _native_index
from cache_indexer.indexer.hit_rate import NativeQuery

log = logging.getLogger(__name__)


class QueryThreads:
    """``threads`` native threads, started on first use and bound to the loop that used them first."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._pool = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiting: dict[int, asyncio.Future] = {}
        self._keys = itertools.count()

    async def run(self, query: NativeQuery) -> tuple[int, int, list[list[int]]]:
        """``query.run()``'s answer, computed on a native thread; its exceptions likewise."""
        loop = asyncio.get_running_loop()
        if self._pool is None:
            self._pool = _native_index.QueryPool(self.threads)
            loop.add_reader(self._pool.fileno(), self._collect)
            self._loop = loop
        elif loop is not self._loop:
            raise RuntimeError("the query threads answer the event loop that started them")
        key = next(self._keys)
        answer = self._waiting[key] = loop.create_future()
        try:
            self._pool.submit(key, *query.call_args)
            return await answer
        finally:
            self._waiting.pop(key, None)

    def _collect(self) -> None:
        try:
            done = self._pool.done()
        except Exception as exc:  # out of memory building the answers: the ones not built are lost
            log.exception("collecting query answers failed; failing the queries in flight")
            for answer in self._waiting.values():
                if not answer.done():
                    answer.set_exception(RuntimeError(f"the query's answer was lost: {exc!r}"))
            return
        for key, answer, exc in done:
            waiting = self._waiting.get(key)
            if waiting is None or waiting.done():
                continue  # cancelled: nobody waits for it
            if exc is not None:
                waiting.set_exception(exc)
            else:
                waiting.set_result(answer)

    def close(self) -> None:
        """Stops the threads (a query running finishes first); queries waiting are cancelled."""
        if self._pool is None:
            return
        if not self._loop.is_closed():
            self._loop.remove_reader(self._pool.fileno())
            for answer in self._waiting.values():
                answer.cancel()
        self._pool.close()
        self._pool = None
        self._waiting.clear()
