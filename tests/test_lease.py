"""The leader lease through NATS trouble (issue 36): a renewal that fails for a passing reason keeps the
lease while the key is surely still ours; a renewal stored whose reply was lost is recognised."""

from __future__ import annotations

import asyncio
import logging
import time
from types import SimpleNamespace

import pytest
from nats.js.errors import KeyWrongLastSequenceError

import cache_indexer.infra.lease as lease_module
from cache_indexer.infra.lease import Lease
from tests.conftest import wait_for


class FakeKv:
    """A KV key with revisions; ``fail`` decides, per call, whether a write is refused or its reply lost."""

    def __init__(self) -> None:
        self.holder: bytes | None = None
        self.revision = 0
        self.fail = None  # callable(kind) -> None | "timeout" | "lost-reply" | "gone"
        self.calls: list[str] = []

    def _write(self, kind: str, value: bytes, last: int) -> int:
        self.calls.append(kind)
        how = self.fail(kind) if self.fail else None
        if how == "timeout":
            raise asyncio.TimeoutError()
        if self.revision != last:
            raise KeyWrongLastSequenceError("wrong last sequence")
        self.holder, self.revision = value, self.revision + 1
        if how == "lost-reply":  # stored, but the client never hears so
            raise asyncio.TimeoutError()
        return self.revision

    async def create(self, key: str, value: bytes) -> int:
        return self._write("create", value, 0 if self.holder is None else -1)

    async def update(self, key: str, value: bytes, last: int) -> int:
        return self._write("update", value, last)

    async def get(self, key: str):
        return SimpleNamespace(value=self.holder, revision=self.revision)


@pytest.fixture
def kv(monkeypatch):
    fake = FakeKv()

    async def bucket(*args, **kw):
        return fake
    monkeypatch.setattr(lease_module, "kv_bucket", bucket)
    return fake


async def _leading(kv: FakeKv, ttl: float) -> tuple[Lease, list[bool]]:
    lease = Lease(None, "b", "k", "me", ttl)
    seen: list[bool] = []
    lease.start()
    await wait_for(lambda: lease.is_leader, 5, "the lease")
    lease.changed.clear()

    async def watch():
        while True:
            await lease.changed.wait()
            lease.changed.clear()
            seen.append(lease.is_leader)
    lease._watch = asyncio.create_task(watch())
    return lease, seen


async def _stop(lease: Lease) -> None:
    lease._watch.cancel()
    await lease.stop()


async def test_renewals_failing_for_less_than_most_of_the_ttl_keep_the_lease(kv):
    """A nats-server restarting: renewals time out for a while (under 80 % of the TTL since the last one
    that succeeded); the holder keeps leading and renews once the server answers again."""
    lease, seen = await _leading(kv, ttl=2.0)
    try:
        failing_until = time.monotonic() + 0.9
        kv.fail = lambda kind: "timeout" if time.monotonic() < failing_until else None
        renewed = kv.revision
        await wait_for(lambda: time.monotonic() > failing_until and kv.revision > renewed, 5, "a renewal after")
        assert lease.is_leader and seen == [], "never lost"
    finally:
        await _stop(lease)


async def test_a_renewal_stored_whose_reply_was_lost_keeps_the_lease(kv):
    lease, seen = await _leading(kv, ttl=1.0)
    try:
        kv.fail = lambda kind: "lost-reply" if kv.calls.count("update") == 1 else None
        await wait_for(lambda: kv.calls.count("update") >= 3, 5, "renewals after the lost reply")
        assert lease.is_leader and seen == [] and kv.holder == b"me"
    finally:
        await _stop(lease)


async def test_renewals_failing_past_most_of_the_ttl_give_the_lease_up(kv):
    lease, seen = await _leading(kv, ttl=1.0)
    try:
        kv.fail = lambda kind: "timeout"
        await wait_for(lambda: seen == [False], 5, "the lease given up")
    finally:
        await _stop(lease)


async def test_a_key_another_holder_took_gives_the_lease_up_at_once(kv):
    lease, seen = await _leading(kv, ttl=1.0)
    try:
        kv.holder, kv.revision = b"someone-else", kv.revision + 1
        await wait_for(lambda: seen == [False], 5, "the lease given up")
        assert not lease.is_leader
    finally:
        await _stop(lease)


async def test_losing_the_lease_is_a_warning_naming_the_lease_the_holder_and_why(kv, caplog):
    """Issue 38: a bridge that loses the lease stops relaying; that was logged at INFO (the reason at
    DEBUG). Now one WARNING, its lease and holder as fields; acquiring stays INFO."""
    caplog.set_level(logging.DEBUG, logger="cache_indexer.infra.lease")
    lease, seen = await _leading(kv, ttl=1.0)
    try:
        kv.holder, kv.revision = b"someone-else", kv.revision + 1
        await wait_for(lambda: seen == [False], 5, "the lease given up")
    finally:
        await _stop(lease)
    records = [r for r in caplog.records if r.name == "cache_indexer.infra.lease" and r.levelno >= logging.INFO]
    assert [(r.levelname, r.getMessage()) for r in records] == [
        ("INFO", "k lease acquired by me"), ("WARNING", "k lease lost by me: another holder's write replaced ours")]
    assert (records[1].lease, records[1].holder) == ("k", "me")
