"""Engines registered over HTTP (``POST /register``), kept in the records bucket so that every bridge and
replica sees them and they outlive restarts: key ``registration.<instance>.<dp_rank>``, a JSON value.

The API writes (create, so that a second registration of one rank is refused, and delete); active
bridges follow the keys (``follow``) and subscribe to each registration as to a discovered pod, under
the instance id where a pod has its address; replicas follow them too (``/workers``, and ``/query``'s
model filter and block size). A follower reads the bucket's values, then every change, through an
ordered consumer of the bucket's stream (infra/ordered_feed.py: nats-py's KV ``watch`` woke every
follower four times a second for ever); one that cannot start again from the bucket's values: the set it
reports is always whole.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass

from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from cache_indexer.infra.ordered_feed import OrderedFeed
from cache_indexer.infra.streams import RecordsKv
from cache_indexer.infra.tasks import cancel_and_wait
from cache_indexer.infra.throttled_log import ThrottledWarning
from cache_indexer.schemas.events import MAX_BLOCK_SIZE
from cache_indexer.infra.log_format import describe

log = logging.getLogger(__name__)

PREFIX = "registration."
#: An instance id: Dynamo's u64 (written in decimal), or a name of these characters. Neither can be a
#: pod address (no dots, no colons), so a registered instance never takes a discovered pod's place.
INSTANCE_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
#: A ZMQ TCP endpoint an engine binds: tcp://host:port (a bracketed IPv6 host included; a name starting
#: with "-", "_" or "." libzmq's connect refuses)
ZMQ_ENDPOINT = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9_.-]*):([0-9]{1,5})")
MAX_DP_RANK = 1023
#: How long the bucket's present values may take to come in before the watch is started again (a
#: watch whose end-of-values marker never comes would leave registrations unread for ever)
SYNC_TIMEOUT = 10.0
#: seconds between the follower's heartbeats from the server (two missed: its consumer is made again)
HEARTBEAT = 5.0


@dataclass(frozen=True, slots=True)
class Registration:
    instance_id: str
    dp_rank: int
    endpoint: str  # the engine's PUB socket
    replay_endpoint: str | None  # its ROUTER replay socket
    model_name: str
    routing_group: str
    block_size: int
    lora_name: str = ""

    @property
    def key(self) -> str:
        return registration_key(self.instance_id, self.dp_rank)

    def encode(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> "Registration":
        """ValueError where the value is not a registration (written by hand, or by a newer version)."""
        try:
            raw = json.loads(data)
            reg = cls(**{f: raw[f] for f in cls.__dataclass_fields__ if f in raw})
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"not a registration: {exc}") from None
        for name, kind in _TYPES.items():
            value = getattr(reg, name)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ValueError(f"not a registration: {name} is {type(value).__name__}")
        error = reg.problem()
        if error:
            raise ValueError(error)
        return reg

    def problem(self) -> str | None:
        """What makes this registration unusable; None when it is fine."""
        if not INSTANCE_ID.fullmatch(self.instance_id):
            return f"instance_id {self.instance_id!r}: an integer, or 1-128 letters, digits, '_' or '-'"
        if not 0 <= self.dp_rank <= MAX_DP_RANK:
            return f"dp_rank {self.dp_rank}: 0 to {MAX_DP_RANK}"
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is None and name == "replay_endpoint":
                continue
            m = ZMQ_ENDPOINT.fullmatch(value or "")
            if not m or not 0 < int(m.group(2)) < 65536:
                return f"{name} {value!r}: a ZMQ TCP endpoint, tcp://host:port"
        if not 0 < self.block_size <= MAX_BLOCK_SIZE:
            return f"block_size {self.block_size}: a number of tokens from 1 to {MAX_BLOCK_SIZE}"
        return None


_TYPES = {"instance_id": str, "dp_rank": int, "endpoint": str, "replay_endpoint": (str, type(None)), "model_name": str,
          "routing_group": str, "block_size": int, "lora_name": str}


def registration_key(instance_id: str, dp_rank: int) -> str:
    return f"{PREFIX}{instance_id}.{dp_rank}"


class RegistrationStore:
    """The registrations in the records bucket: written by the API, followed by bridges and replicas."""

    def __init__(self, js, bucket: str, replicas: int = 1, on_error: Callable[[], None] = lambda: None, *,
                 nc) -> None:
        self._nc, self._js, self._bucket = nc, js, bucket
        self._kv = RecordsKv(js, bucket, replicas)
        #: what ``follow`` saw last, by key (a follower's view; the API checks it before writing)
        self.current: dict[str, Registration] = {}
        self.synced = asyncio.Event()  # ``current`` holds the bucket's values (once, at least)
        self._on_error = on_error  # counts a lost watch or an unreadable value
        self._task: asyncio.Task | None = None
        self._warn = ThrottledWarning(log, every=30.0)

    async def create(self, reg: Registration) -> bool:
        """False where this rank of the instance is registered already."""
        try:
            await (await self._kv()).create(reg.key, reg.encode())
        except KeyWrongLastSequenceError:
            return False
        self.current[reg.key] = reg
        return True

    async def delete(self, instance_id: str, dp_rank: int | None = None) -> list[Registration]:
        """Delete the instance's registration (one rank, or all of them); what was deleted."""
        kv = await self._kv()
        gone = [reg for reg in list(self.current.values())
                if reg.instance_id == instance_id and (dp_rank is None or reg.dp_rank == dp_rank)]
        for reg in gone:
            try:
                await kv.delete(reg.key)
            except KeyNotFoundError:
                pass
            self.current.pop(reg.key, None)
        return gone

    def follow(self, on_change: Callable[[list[Registration]], Awaitable[None]] | None = None) -> None:
        """Keep ``current`` up to date, and call ``on_change`` with all of them once the bucket's values are
        in, then after each change."""
        self._task = asyncio.create_task(self._follow(on_change), name="registrations")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)  # (once is not enough around nats-py: infra/tasks.py)
        self._task = None

    async def _follow(self, on_change) -> None:
        backoff = 0.5
        subjects = f"$KV.{self._bucket}."
        while True:
            feed = None
            try:
                await self._kv()  # the bucket, created where missing
                seen: dict[str, Registration] = {}
                synced, changed = asyncio.Event(), asyncio.Event()

                async def take(seq: int, stored_ns: int, pending: int, msg) -> None:
                    op = (msg.headers or {}).get("KV-Operation", "PUT")
                    self._take(seen, msg.subject[len(subjects):], op, msg.data)
                    if not pending:  # the bucket's values are in (and after that: each change)
                        synced.set()
                    changed.set()
                feed = OrderedFeed(self._nc, self._js, f"KV_{self._bucket}", f"{subjects}{PREFIX}>", take,
                                   heartbeat=HEARTBEAT, last_per_subject=True, on_error=self._on_error)
                await feed.start()
                if not feed.pending_at_start:
                    synced.set()
                await asyncio.wait_for(synced.wait(), SYNC_TIMEOUT)
                while True:
                    changed.clear()
                    self.current = dict(seen)
                    self.synced.set()
                    backoff = 0.5
                    if on_change is not None:
                        await on_change(list(seen.values()))
                    await changed.wait()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # followed again from the bucket's values; what was known stays meanwhile
                self._on_error()
                self._warn("registrations not followed (%s); again in %.1fs", describe(exc), backoff)
            finally:
                if feed is not None:
                    try:
                        await feed.stop()
                    except Exception:
                        pass
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 10.0)

    def _take(self, seen: dict[str, Registration], key: str, operation: str, value: bytes) -> None:
        if operation in ("DEL", "PURGE") or not value:
            seen.pop(key, None)
            return
        try:
            reg = Registration.decode(value)
            if reg.key != key:
                raise ValueError(f"stored under {key}, not its own key {reg.key}")
        except ValueError as exc:
            self._on_error()
            log.error("registration %s ignored: %s", key, exc)
            return
        seen[key] = reg
