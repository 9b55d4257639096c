"""Reliable asynchronous JetStream publishing: a bounded in-flight window with retries.

A JetStream publish is a core NATS publish with a reply subject; the stream's ack arrives there. This
publisher sends each message with ``publish(reply=<inbox>.<token>)`` and takes every ack on one
wildcard subscription, instead of nats-py's ``publish_async``, which per message creates a future, a
timeout task and an inbox entry: 2.4x the cost (27k vs 66k messages/s, one core, same headers). The
bridge publishes on a connection of its own (bridge/stream_connection.py: each ack handled as it is
read); a nats-py connection serves too (tools and tests), its acks taken on a nats-py subscription.

Acks can be lost (across a nats-server restart they simply are), so every message carries a
``Nats-Msg-Id`` and stays in the window until its ack arrives; one that is not acked within
``ack_timeout``, or is answered with a passing error (no stream yet, a server restarting), is re-sent
with the same id, so the server's duplicate window turns a retry of a stored message into a no-op.
When the connection comes back after it was lost (``connection_lost``, ``reconnected``: the owner wires
them to the connection's callbacks), every message sent on the lost connection and not acked is re-sent at
once, not at its ack deadline: a server killed mid-stream loses what it had received but not stored, and
until the re-send the indexers hold every later batch of those workers as early (issue 36). A publish
while disconnected is re-sent shortly (the bridge's connection refuses it; nats-py buffers it and flushes
it at the reconnection, before telling).
``publish`` waits while the window is full, which pushes back on the ZMQ readers instead of growing
memory.

A message that can never be stored is not retried: one over the connection's ``max_payload``
(headers included; the server would close the connection) is refused before it is sent, and one the
stream rejects for good (a 4xx ack, e.g. over the stream's ``maxMsgSize``) is dropped. Both are logged
at ERROR and counted in ``cache_indexer_bridge_publish_refused_total{reason}``, and free their place in
the window. Callers split what may be large (bridge/l3_publisher.py); this is the last line. One sent
onto a subject that moved on (``Nats-Expected-Last-Subject-Sequence``: bridge/l3_publisher.py) is
refused as ``superseded``, logged at INFO: its caller tells what it means (an old owner's message after
a failover, or a re-send of one stored whose ack was lost: the stream checks the expected sequence
before the duplicate).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from collections.abc import Callable
from itertools import count

from cache_indexer.bridge.stream_connection import StreamConnection
from cache_indexer.infra.metrics import Metrics
from cache_indexer.infra.streams import unsubscribe_quietly
from cache_indexer.infra.tasks import cancel_and_wait
from cache_indexer.infra.throttled_log import ThrottledWarning

log = logging.getLogger(__name__)


#: JetStream's error code for a message whose ``Nats-Expected-Last-Subject-Sequence`` the subject is past
WRONG_LAST_SEQUENCE = 10071

#: Told when a message is stored, with its stream sequence (the ack's ``seq``).
OnStored = Callable[[int], None]
#: Told when a message can never be stored (refused before sending, or rejected for good by the stream).
OnRefused = Callable[[], None]


@dataclass(slots=True)
class _Pending:
    subject: str
    data: bytes
    headers: dict[str, str]
    deadline: float
    token: str = ""  # of the last send; "" = not sent or failed: the watchdog re-sends
    conn: int = 0  # the connection it was last sent on (JetStreamPublisher._conn)
    on_stored: OnStored | None = None
    on_refused: OnRefused | None = None


class JetStreamPublisher:
    def __init__(self, nc, metrics: Metrics, window: int = 2048, ack_timeout: float = 5.0,
                 on_stream_lost: Callable[[str], None] | None = None) -> None:
        self._nc = nc
        #: called when a stream may have been lost: with "" when the server says no stream takes the
        #: subject (503), with the stream's name when an ack names a sequence at or below one acked before
        #: on it (one created again counts from 1; a duplicate's ack names the original's: not counted)
        self._on_stream_lost = on_stream_lost or (lambda stream: None)
        #: the last sequence acked for a new message, and its Nats-Msg-Id, by stream
        self._last_acked: dict[str, tuple[int, str]] = {}
        self._metrics = metrics
        self._window = asyncio.Semaphore(window)
        self._ack_timeout = ack_timeout
        self._pending: OrderedDict[str, _Pending] = OrderedDict()
        self._by_token: dict[str, str] = {}  # reply token -> Nats-Msg-Id
        self._tokens = count()
        self._inbox = ""
        self._sub = None
        self._idle = asyncio.Event()
        self._idle.set()
        self._watchdog: asyncio.Task | None = None
        self._wake = asyncio.Event()  # the watchdog looks at once (a reconnection, a deadline sooner than planned)
        #: when the watchdog looks next (it sleeps until the earliest deadline, not on a fixed tick)
        self._look_at = 0.0
        #: how soon a message whose send failed (or that was answered with a passing error) is re-sent
        self._retry_after = max(0.05, min(0.5, ack_timeout / 4))
        #: counts the connections lost: a message sent on an earlier one than the current may be lost
        self._conn = 0
        self._retry_warning = ThrottledWarning(log)

    async def start(self) -> None:
        if isinstance(self._nc, StreamConnection):
            self._inbox = self._nc.take_replies(self._on_reply)
        elif self._sub is None:
            self._inbox = self._nc.new_inbox()
            self._sub = await self._nc.subscribe(f"{self._inbox}.*", cb=self._on_ack,
                                                 pending_msgs_limit=-1, pending_bytes_limit=-1)
        if self._watchdog is None:
            self._watchdog = asyncio.create_task(self._watch(), name="jetstream-publisher-watchdog")

    async def close(self) -> None:
        if self._watchdog:
            await cancel_and_wait(self._watchdog)
            self._watchdog = None
        await unsubscribe_quietly(self._sub)
        self._sub = None

    async def publish(self, subject: str, data: bytes, headers: dict[str, str], on_stored: OnStored | None = None,
                      on_refused: OnRefused | None = None) -> None:
        """Queue one message; returns once it is sent (not acked). ``headers`` must hold Nats-Msg-Id.
        ``on_stored`` / ``on_refused`` tell the caller what became of it (exactly one of them is called,
        unless the publisher closes first); a message already in flight is not sent twice, and tells this
        caller too when it is stored or refused."""
        msg_id = headers["Nats-Msg-Id"]
        rec = self._pending.get(msg_id)
        if rec is not None:  # already in flight: the same message twice is one message
            rec.on_stored = _both(rec.on_stored, on_stored)
            rec.on_refused = _both(rec.on_refused, on_refused)
            return
        size = message_size(data, headers)
        if size > self._nc.max_payload:
            self._refuse(msg_id, subject, "too_large", f"{size} bytes with headers, over the server's "
                                                       f"max_payload of {self._nc.max_payload}", on_refused)
            return
        await self._window.acquire()
        rec = _Pending(subject, data, headers, 0.0, on_stored=on_stored, on_refused=on_refused)
        self._pending[msg_id] = rec
        self._idle.clear()
        self._metrics.publish_inflight.set(len(self._pending))
        await self._send(msg_id, rec)

    def last_acked(self, stream: str) -> tuple[int, str] | None:
        """The stream sequence and ``Nats-Msg-Id`` of the last new message ``stream`` acked (None: none yet)."""
        return self._last_acked.get(stream)

    def forget_stream(self, stream: str) -> None:
        """The stream was lost and is followed anew: its sequences count from where the new one stands."""
        self._last_acked.pop(stream, None)

    def connection_lost(self) -> None:
        """The NATS connection broke: what was sent on it and is not acked yet may be lost with it."""
        self._conn += 1

    def reconnected(self) -> int:
        """The connection is back: every message sent on a lost one and not acked yet is re-sent now (by
        the watchdog, in publish order), not at its ack deadline. Returns how many."""
        due = 0
        for rec in self._pending.values():
            if rec.conn < self._conn or not rec.token:  # (not rec.token: its send failed meanwhile)
                rec.deadline = 0.0
                due += 1
        if due:
            log.info("NATS connection back: re-sending %d unacknowledged publishes", due)
            self._wake.set()
        return due

    async def _send(self, msg_id: str, rec: _Pending) -> None:
        self._due(rec, time.monotonic() + self._ack_timeout)
        rec.conn = self._conn
        token = str(next(self._tokens))
        rec.token = token
        self._by_token[token] = msg_id
        try:
            await self._nc.publish(rec.subject, rec.data, reply=f"{self._inbox}.{token}", headers=rec.headers)
        except Exception as exc:  # disconnected, closed, buffer full: the watchdog re-sends
            log.debug("publish %s failed: %s", msg_id, exc)
            self._by_token.pop(token, None)
            rec.token = ""
            self._due(rec, time.monotonic() + self._retry_after)

    def _due(self, rec: _Pending, deadline: float) -> None:
        """``rec`` is to be re-sent at ``deadline`` unless acked before: the watchdog is woken to plan anew
        only where that is sooner than it meant to look (a failed send, a passing error; a first send's
        deadline is never sooner: the watchdog of an empty window looks an ack timeout later)."""
        rec.deadline = deadline
        if deadline < self._look_at:
            self._look_at = deadline
            self._wake.set()

    async def _on_ack(self, msg) -> None:
        """A reply on a nats-py connection's subscription."""
        status = msg.headers.get("Status", "") if msg.headers else ""
        self._on_reply(msg.subject.rsplit(".", 1)[1], status, msg.data)

    def _on_reply(self, token: str, status: str, data: bytes) -> None:
        msg_id = self._by_token.pop(token, None)
        rec = self._pending.get(msg_id) if msg_id is not None else None
        if rec is None or rec.token != token:
            return  # a late ack of an earlier send: the current one decides
        error, permanent, stream_seq, stream = _ack_error(status, data)
        if permanent:
            if error.endswith(f"err_code {WRONG_LAST_SEQUENCE})"):  # sent onto a subject that moved on since
                self._refuse(msg_id, rec.subject, "superseded", error, rec.on_refused, logging.INFO)
            else:
                self._refuse(msg_id, rec.subject, "rejected", error, rec.on_refused)
            self._done(msg_id)
            return
        if error:
            if error == "status 503":
                self._on_stream_lost("")
            self._retry_warning("publish %s not stored (%s); re-sending", msg_id, error)
            rec.token = ""  # the watchdog re-sends
            self._due(rec, time.monotonic() + self._retry_after)
            return
        self._done(msg_id)
        if stream:
            if stream_seq <= self._last_acked.get(stream, (0, ""))[0]:
                self._on_stream_lost(stream)
            self._last_acked[stream] = (stream_seq, msg_id)
        if rec.on_stored is not None:
            _tell(rec.on_stored, stream_seq)

    def _done(self, msg_id: str) -> None:
        del self._pending[msg_id]
        self._window.release()
        self._metrics.publish_inflight.set(len(self._pending))
        if not self._pending:
            self._idle.set()

    def _refuse(self, msg_id: str, subject: str, reason: str, why: str, on_refused: OnRefused | None,
                level: int = logging.ERROR) -> None:
        self._metrics.publish_refused.labels(reason).inc()
        log.log(level, "publish %s to %s can never be stored (%s); dropped", msg_id, subject, why)
        if on_refused is not None:
            _tell(on_refused)

    async def _watch(self) -> None:
        """Re-sends each message at its deadline. It sleeps until the earliest one, not on a tick (a tick of
        0.5 s was 2 of the bridge's 10 wake-ups a second when idle): with nothing in flight for an ack
        timeout, since a message published meanwhile is due no sooner; a sooner deadline wakes it."""
        while True:
            now = time.monotonic()
            self._look_at = min((rec.deadline for rec in self._pending.values()), default=now + self._ack_timeout)
            if self._look_at > now:
                try:
                    await asyncio.wait_for(self._wake.wait(), self._look_at - now)
                except asyncio.TimeoutError:
                    pass
            self._wake.clear()
            now = time.monotonic()
            if not self._nc.is_connected:  # each send would fail: looked at again shortly, or when told back
                for rec in self._pending.values():
                    rec.deadline = max(rec.deadline, now + self._retry_after)
                continue
            retry = [(mid, rec) for mid, rec in self._pending.items() if now >= rec.deadline]
            for mid, rec in retry:
                self._by_token.pop(rec.token, None)
                self._metrics.publish_retries.inc()
                await self._send(mid, rec)

    async def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued message is acked; False on timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False


def message_size(data: bytes, headers: dict[str, str]) -> int:
    """What the server counts against max_payload: the payload and the encoded header block."""
    return len(data) + 12 + sum(len(k) + len(v) + 4 for k, v in headers.items())


def _both(first, second):
    """One callback that calls ``first`` then ``second`` (either may be None), each on its own (``_tell``)."""
    if first is None or second is None:
        return first or second

    def both(*args) -> None:
        _tell(first, *args)
        _tell(second, *args)
    return both


def _tell(callback, *args) -> None:
    """A caller's callback runs inside the ack handler: its failure is logged, never the handler's end."""
    try:
        callback(*args)
    except Exception:
        log.exception("a publish callback failed")


def _ack_error(status: str, data: bytes) -> tuple[str, bool, int, str]:
    """Why a reply is not a positive JetStream ack ("" when it is one), whether the refusal is for good
    (a 4xx: the stream will never take this message) rather than passing (503: no stream yet), the
    stream sequence a positive ack names, and its stream where it stored a new message ("" for a
    duplicate, whose ack names the original's sequence)."""
    if status:  # e.g. 503 no responders: no stream (yet) for the subject
        return f"status {status}", False, 0, ""
    try:
        reply = json.loads(data)
    except ValueError:
        return "not JSON", False, 0, ""
    if not isinstance(reply, dict):
        return "not an ack", False, 0, ""
    error = reply.get("error")
    if error is not None:
        code = error.get("code") if isinstance(error, dict) else None
        text = error.get("description", str(error)) if isinstance(error, dict) else str(error)
        return f"{text} (code {code}, err_code {error.get('err_code') if isinstance(error, dict) else '-'})", \
            isinstance(code, int) and 400 <= code < 500, 0, ""
    seq, stream = reply.get("seq"), reply.get("stream")
    if type(seq) is not int:
        return "not an ack", False, 0, ""
    return "", False, seq, stream if isinstance(stream, str) and not reply.get("duplicate") else ""
