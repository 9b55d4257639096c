"""A stream followed in order by an ordered push consumer of our own, on nats-py's public API.

nats-py's ordered consumer (``js.subscribe(ordered_consumer=True)``, and every KV ``watch``) starts two
tasks per subscription that wake up forever: a flow-control check every 0.25 s and a heartbeat check;
and it wraps every message (JetStream metadata as dataclasses and datetimes). An indexer replica follows
two streams and the registrations, and is idle most of the time: those wake-ups were about half of its
idle CPU. Here, per stream:

- one core subscription on an inbox of its own and an ephemeral consumer pushing to it (``ack none``,
  flow control, idle heartbeats, memory storage, one replica), as nats-py's ordered consumer creates;
- the handler gets each message's stream sequence, the time JetStream stored it (ns), how many messages
  the consumer had left after it, and the message, read from the reply subject (``$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<dseq>.<ts>.<pending>``,
  or the longer layout with a domain and an account hash in front), in order, one after the other;
- a flow-control request is answered in its turn, i.e. once every message before it was handled (the
  server holds back what follows until then: what this process buffers stays bounded); a heartbeat that
  names a stalled consumer is answered at once;
- the consumer is made again from the stream sequence after the last message handled when a consumer
  sequence is skipped (a message lost), a heartbeat names a consumer sequence other than the last one
  seen, no message nor heartbeat came for two heartbeat intervals (the server restarted, the consumer was
  deleted, a cluster lost the node that held it), the connection came back, or the server sends any other
  status. One timer per stream checks the heartbeats. A failure to make it again (NATS away) is counted,
  logged and tried again with a back-off: the follower never dies.

Whoever owns the feed decides what a jump in stream sequences means (indexer/service.py reloads the
snapshot on one); the feed only guarantees that it hands over the stream's messages in order, none
twice except after a restart of the consumer mid-message (the handler resumes at the message it had not
finished).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from nats.js import api

from cache_indexer.infra.tasks import cancel_and_wait
from cache_indexer.infra.throttled_log import ThrottledWarning
from cache_indexer.infra.log_format import describe

log = logging.getLogger(__name__)

#: (stream seq, stored at in ns since the epoch, messages pending after it, the message)
Handler = Callable[[int, int, int, Any], Awaitable[None]]
_ACK = "$JS.ACK."
_STATUS = "Status"
_LAST_CONSUMER = "Nats-Last-Consumer"
_STALLED = "Nats-Consumer-Stalled"
#: heartbeat intervals without a message or heartbeat after which the consumer is made again
MISSED_HEARTBEATS = 2
#: the longest a stop (or a restart of the consumer) waits for the handler to finish its message
HANDLER_GRACE = 10.0


def ack_fields(reply: str) -> tuple[int, int, int, int] | None:
    """(stream seq, consumer seq, stored at ns, pending) from a JetStream message's reply subject; None when
    it is not one. Both layouts: ``$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<dseq>.<ts>.<pending>`` (9
    tokens) and ``$JS.ACK.<domain>.<account hash>.<stream>.<consumer>.<delivered>.<sseq>.<dseq>.<ts>.
    <pending>[.<token>...]`` (11 and more)."""
    if not reply.startswith(_ACK):
        return None
    t = reply.split(".")
    n = len(t)
    if n == 9:
        i = 5
    elif n >= 11:
        i = 7
    else:
        return None
    try:
        return int(t[i]), int(t[i + 1]), int(t[i + 2]), int(t[i + 3])
    except ValueError:
        return None


class _Incarnation:
    """One consumer's subscription: its messages go to the feed until a newer one replaces it."""

    __slots__ = ("sub", "next_dseq", "stale")

    def __init__(self) -> None:
        self.sub = None
        self.next_dseq = 1
        self.stale = False


class OrderedFeed:
    def __init__(self, nc, js, stream: str, subject: str, handler: Handler, *, heartbeat: float = 2.0,
                 on_restart: Callable[[str], None] | None = None, on_error: Callable[[], None] | None = None,
                 request_timeout: float = 5.0, last_per_subject: bool = False) -> None:
        """``last_per_subject``: the first consumer delivers the last message of each subject (a KV
        bucket's values), later ones go on from the message after the last handled."""
        self.nc = nc
        self.js = js
        self.stream = stream
        self.subject = subject
        self.handler = handler
        self.heartbeat = heartbeat
        self.request_timeout = request_timeout
        self._on_restart = on_restart or (lambda reason: None)
        self._on_error = on_error or (lambda: None)
        #: the stream sequence to resume from: the one after the last message the handler finished
        self.next_seq = 1
        self.restarts: dict[str, int] = {}  # reason -> count (tests; metrics via on_restart)
        self.errors = 0
        self.flow_controls = 0  # flow-control requests answered (tests)
        #: messages the first consumer had to deliver when it was made (a KV follower's "values are in")
        self.pending_at_start = 0
        self._last_per_subject = last_per_subject
        self._made = 0  # consumers made
        self._inc: _Incarnation | None = None
        self._trouble: str | None = None
        self._wake = asyncio.Event()
        self._seen = False
        self._busy = False
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task | None = None
        self._warn = ThrottledWarning(log, every=10.0)

    # -- life cycle -----------------------------------------------------------------------------------
    async def start(self, start_seq: int = 1) -> None:
        """Follow the stream from ``start_seq`` (1: from its first message). The first consumer is made
        here (its failure raises: the caller retries); later ones by the feed itself."""
        await self.stop()
        self.next_seq = max(1, start_seq)
        self._trouble = None
        self._wake.clear()
        await self._subscribe()
        self._task = asyncio.create_task(self._supervise(), name=f"feed-{self.stream}")

    async def stop(self) -> None:
        """Stop following: no handler call starts after this returns (one in progress is waited for, within
        HANDLER_GRACE). Not from within the handler."""
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_wait(task)
        inc, self._inc = self._inc, None
        if inc is not None:
            inc.stale = True
            await self._drop(inc)

    def reconnected(self) -> None:
        """The connection came back: the consumer may be gone with the server it lived on."""
        self._flag("reconnect")

    # -- messages -------------------------------------------------------------------------------------
    async def _deliver(self, inc: _Incarnation, msg) -> None:
        if inc.stale:
            return
        self._seen = True
        reply = msg.reply
        fields = ack_fields(reply) if reply else None
        if fields is not None:
            sseq, dseq, ts, pending = fields
            if dseq != inc.next_dseq:
                self._restart(inc, "gap", f"consumer seq {dseq} where {inc.next_dseq} was next (stream seq {sseq})")
                return
            inc.next_dseq = dseq + 1
            self._busy = True
            self._idle.clear()
            try:
                await self.handler(sseq, ts, pending, msg)
            except Exception:  # the handler's own failure: the message is not handed over again
                log.exception("stream %s seq %d: the handler failed", self.stream, sseq)
            finally:
                self._busy = False
                self._idle.set()
            self.next_seq = sseq + 1  # (not reached when cut off mid-message: then it comes again)
            return
        hdr = msg.headers
        status = hdr.get(_STATUS) if hdr else None
        if status != "100":
            self._restart(inc, "status", f"status {status!r} on {msg.subject}")
            return
        if reply:  # a flow-control request, after every message before it was handled
            self.flow_controls += 1
            await self._publish(reply)
            return
        stalled = hdr.get(_STALLED)  # a heartbeat
        if stalled:
            await self._publish(stalled)
        last = hdr.get(_LAST_CONSUMER)
        if last is not None and last.isdigit() and int(last) != inc.next_dseq - 1:
            self._restart(inc, "gap", f"heartbeat names consumer seq {last}, the last seen was {inc.next_dseq - 1}")

    async def _publish(self, subject: str) -> None:
        try:
            await self.nc.publish(subject, b"")
        except Exception as exc:  # the next heartbeat names the stall again
            self._error("flow-control reply", exc)

    def _restart(self, inc: _Incarnation, reason: str, why: str) -> None:
        inc.stale = True
        self._warn("stream %s: %s: making its consumer again from stream seq %d", self.stream, why, self.next_seq)
        self._flag(reason)

    def _flag(self, reason: str) -> None:
        if self._trouble is None:
            self._trouble = reason
        self._wake.set()

    # -- the consumer ---------------------------------------------------------------------------------
    async def _supervise(self) -> None:
        """The feed's one timer: heartbeats, and the consumer made again whenever something is wrong."""
        while True:
            try:
                try:
                    await asyncio.wait_for(self._wake.wait(), self.heartbeat * MISSED_HEARTBEATS)
                except asyncio.TimeoutError:
                    if not (self._seen or self._busy or self._pending()):
                        self._flag("heartbeat")
                    self._seen = False
                    if self._trouble is None:
                        continue
                await self._recreate()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # never a dead follower
                self._error("supervising the consumer", exc)
                await asyncio.sleep(1.0)

    async def _recreate(self) -> None:
        reason = self._trouble or "unknown"
        delay = 0.25
        while True:
            self._wake.clear()
            self._trouble = None
            old, self._inc = self._inc, None
            if old is not None:
                old.stale = True
                await self._drop(old)
            try:
                await self._subscribe()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._error(f"making the consumer again from stream seq {self.next_seq}", exc)
                await asyncio.sleep(delay)
                delay = min(2 * delay, 2.0)
                continue
            self.restarts[reason] = self.restarts.get(reason, 0) + 1
            self._on_restart(reason)
            self._seen = True  # heartbeats are judged from now on
            return

    async def _subscribe(self) -> None:
        inc = _Incarnation()
        inbox = self.nc.new_inbox()
        # unbounded here: flow control bounds what the server sends ahead of the handler
        inc.sub = await self.nc.subscribe(inbox, cb=functools.partial(self._deliver, inc), pending_msgs_limit=-1,
                                          pending_bytes_limit=-1)
        self._inc = inc
        at = self.next_seq
        if self._last_per_subject and not self._made:
            start = {"deliver_policy": api.DeliverPolicy.LAST_PER_SUBJECT}
        elif at > 1:
            start = {"deliver_policy": api.DeliverPolicy.BY_START_SEQUENCE, "opt_start_seq": at}
        else:
            start = {"deliver_policy": api.DeliverPolicy.ALL}
        cfg = api.ConsumerConfig(
            deliver_subject=inbox, filter_subject=self.subject, ack_policy=api.AckPolicy.NONE, max_deliver=1,
            flow_control=True, idle_heartbeat=self.heartbeat, mem_storage=True, num_replicas=1, **start)
        try:
            info = await self.js.add_consumer(self.stream, config=cfg, timeout=self.request_timeout)
        except BaseException:
            inc.stale = True
            if self._inc is inc:
                self._inc = None
            await self._drop(inc)
            raise
        if not self._made:
            self.pending_at_start = info.num_pending or 0
        self._made += 1

    async def _drop(self, inc: _Incarnation) -> None:
        """Unsubscribe a replaced consumer's inbox (its server side goes once nobody listens). The handler
        is not cut off mid-message: unsubscribing cancels the task that runs it."""
        if self._busy:
            try:
                await asyncio.wait_for(self._idle.wait(), HANDLER_GRACE)
            except asyncio.TimeoutError:
                log.warning("stream %s: the handler did not finish its message within %.0fs; cutting it off",
                            self.stream, HANDLER_GRACE)
        if inc.sub is not None:
            try:
                await inc.sub.unsubscribe()
            except Exception as exc:  # a subscription the connection already lost
                log.debug("unsubscribe: %s", exc)

    def _pending(self) -> int:
        inc = self._inc
        try:
            return inc.sub.pending_msgs if inc is not None and inc.sub is not None else 0
        except Exception:
            return 0

    def _error(self, what: str, exc: BaseException) -> None:
        self.errors += 1
        self._on_error()
        self._warn("stream %s: %s failed (%s); trying again", self.stream, what, describe(exc))
