"""The ordered consumer of our own (infra/ordered_feed.py) against a real nats-server: every message of the
stream handed over in order, none lost and none twice, through a skipped consumer sequence, a deleted
consumer (no more heartbeats), a server restart, and flow control while the handler is slow. About 25 s
in all (heartbeats of 0.25 s: a lost consumer is made again within a second)."""

from __future__ import annotations

import asyncio
import random

import pytest

from cache_indexer.infra.ordered_feed import OrderedFeed, ack_fields
from tests.conftest import wait_for

HB = 0.25


def test_the_reply_subject_is_read_in_both_layouts():
    assert ack_fields("$JS.ACK.S.C.1.42.7.1700000000123456789.3") == (42, 7, 1700000000123456789, 3)
    assert ack_fields("$JS.ACK.dom.ACCHASH.S.C.2.42.7.1700000000123456789.0.tok") == (42, 7, 1700000000123456789, 0)
    assert ack_fields("$JS.ACK.dom.ACCHASH.S.C.2.42.7.1700000000123456789.0") == (42, 7, 1700000000123456789, 0)
    for reply in ("_INBOX.abc", "$JS.ACK.S.C.1.x.7.1.0", "$JS.ACK.S.C.1.2", "$JS.FC.S.C.1"):
        assert ack_fields(reply) is None


class Follower:
    """A feed and what it handed over."""

    def __init__(self, nc, js, stream: str, subject: str, slow: float = 0.0) -> None:
        self.got: list[tuple[int, bytes]] = []
        self.slow = slow
        self.feed = OrderedFeed(nc, js, stream, subject, self._take, heartbeat=HB, request_timeout=2.0)

    async def _take(self, seq: int, stored_ns: int, pending: int, msg) -> None:
        assert stored_ns > 1_600_000_000 * 10**9 and pending >= 0
        if self.slow:
            await asyncio.sleep(self.slow)
        self.got.append((seq, msg.data))


async def _stream(nc, name: str):
    js = nc.jetstream()
    await js.add_stream(name=name, subjects=[f"{name}.>"])
    return js


async def _publish(js, name: str, n: int, size: int = 16) -> None:
    for _ in range(n):
        await js.publish(f"{name}.x", random.randbytes(size))


async def _expect_all(js, f: Follower, name: str, timeout: float = 15.0) -> None:
    """The follower got every message of the stream, in order, once each."""
    info = await js.stream_info(name)
    await wait_for(lambda: len(f.got) >= info.state.messages, timeout, f"all {info.state.messages} messages")
    await asyncio.sleep(3 * HB)  # nothing more comes (no duplicate after the last one)
    seqs = [s for s, _ in f.got]
    assert seqs == list(range(1, info.state.last_seq + 1)), seqs
    for seq, data in f.got[:: max(1, len(f.got) // 20)]:
        assert (await js.get_msg(name, seq)).data == data


async def _inject_gap(js, f: Follower, name: str) -> None:
    """Messages whose consumer sequences do not go on from the last one, as when one is lost in flight: a
    second consumer pushing the stream's last message to the feed's inbox (its sequence starts at 1)."""
    from nats.js import api

    restarts = sum(f.feed.restarts.values())
    info = await js.add_consumer(name, api.ConsumerConfig(
        deliver_subject=f.feed._inc.sub.subject, ack_policy=api.AckPolicy.NONE, deliver_policy=api.DeliverPolicy.LAST,
        mem_storage=True, num_replicas=1))
    try:
        await wait_for(lambda: sum(f.feed.restarts.values()) > restarts, 10, "the consumer made again")
    finally:
        await js.delete_consumer(name, info.name)


async def test_a_skipped_consumer_sequence_restarts_the_consumer_from_the_last_message_handled(nats_url, stream_prefix):
    import nats

    nc = await nats.connect(nats_url)
    name = f"{stream_prefix}_F"
    js = await _stream(nc, name)
    f = Follower(nc, js, name, f"{name}.>")
    try:
        await _publish(js, name, 30)
        await f.feed.start()
        await wait_for(lambda: len(f.got) == 30, 10, "the first messages")
        await _inject_gap(js, f, name)
        await _publish(js, name, 30)
        await _expect_all(js, f, name)
        assert f.feed.restarts == {"gap": 1}
    finally:
        await f.feed.stop()
        await nc.close()


async def test_a_deleted_consumer_is_noticed_by_its_missing_heartbeats(nats_url, stream_prefix):
    import nats

    nc = await nats.connect(nats_url)
    name = f"{stream_prefix}_F"
    js = await _stream(nc, name)
    f = Follower(nc, js, name, f"{name}.>")
    try:
        await f.feed.start()
        await _publish(js, name, 20)
        await wait_for(lambda: len(f.got) == 20, 10, "the first messages")
        for info in await js.consumers_info(name):
            await js.delete_consumer(name, info.name)
        await _publish(js, name, 20)  # while nobody delivers them
        await wait_for(lambda: f.feed.restarts.get("heartbeat"), 10, "the consumer made again")
        await _expect_all(js, f, name)
        assert len(await js.consumers_info(name)) == 1
    finally:
        await f.feed.stop()
        await nc.close()
    assert f.feed._task is None and f.feed._inc is None


async def test_flow_control_is_answered_while_the_handler_is_slow(nats_url, stream_prefix):
    import nats

    nc = await nats.connect(nats_url)
    name = f"{stream_prefix}_F"
    js = await _stream(nc, name)
    f = Follower(nc, js, name, f"{name}.>", slow=0.001)
    try:
        await _publish(js, name, 300, size=100_000)  # 30 MB: the server asks for flow control on the way
        await f.feed.start()
        await _expect_all(js, f, name, timeout=30)
        assert f.feed.flow_controls > 0 and f.feed.restarts == {} and f.feed.errors == 0
    finally:
        await f.feed.stop()
        await nc.close()


async def test_random_faults_lose_nothing_and_repeat_nothing(restartable_nats):
    """A model of the feed's promise under a seeded mix of faults: publishes, skipped consumer sequences,
    deleted consumers and server restarts; after each step the handler has seen exactly the stream."""
    import nats

    server = restartable_nats
    rng = random.Random(20261205)
    nc = await nats.connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.1)
    name = "FEEDFAULTS"
    js = await _stream(nc, name)
    js = nc.jetstream()
    f = Follower(nc, js, name, f"{name}.>")
    try:
        await f.feed.start()
        for _ in range(8):
            step = rng.choice(["publish", "gap", "delete", "restart"])
            if step == "gap" and f.got:
                await _inject_gap(js, f, name)
            elif step == "delete":
                for info in await js.consumers_info(name):
                    await js.delete_consumer(name, info.name)
            elif step == "restart":
                await asyncio.to_thread(server.restart)
                await wait_for(lambda: nc.is_connected, 10, "reconnected")
                if rng.random() < 0.5:
                    f.feed.reconnected()  # as its owner's reconnected callback does (else: the heartbeats tell)
            await _publish(js, name, rng.randint(1, 15))
            await _expect_all(js, f, name)
        assert sum(f.feed.restarts.values()) >= 3, f.feed.restarts
    finally:
        await f.feed.stop()
        await nc.close()


async def test_an_idle_replica_wakes_up_for_few_timers(nats_url, stream_prefix, monkeypatch):
    """Idle CPU: a replica (the L1 and L3 streams, the registrations, snapshots and the lease) that has
    nothing to do runs few timers. nats-py's ordered consumers and KV watch each ran a flow-control check
    every 0.25 s for ever: 12 a second for the three, most of the replica's idle CPU."""
    import asyncio.events

    from cache_indexer.replica import Replica
    from tests.conftest import make_config

    cfg = make_config(nats_url, stream_prefix, nats={"lease": {"bucket": f"{stream_prefix}-lease", "ttl": "10s"}})
    replica = Replica(cfg)
    await replica.start()
    try:
        await wait_for(replica.indexer.is_ready, 10, "ready")
        await wait_for(lambda: replica.registrations.synced.is_set(), 10, "registrations read")
        await asyncio.sleep(1.0)
        timers = []
        plain = asyncio.events.Handle._run

        def counted(handle):
            if type(handle) is asyncio.events.TimerHandle:
                timers.append(repr(handle._callback)[:100])
            plain(handle)
        monkeypatch.setattr(asyncio.events.Handle, "_run", counted)
        await asyncio.sleep(4.0)
        monkeypatch.setattr(asyncio.events.Handle, "_run", plain)
        # left: the snapshot scheduler, the stream tracker (1/10 s), the lease (1/3.3 s with a 10 s TTL), the
        # loop-lag tick (1/s), the consumers' heartbeat checks (1/(2 x heartbeat) each), and this test's own sleep
        assert len(timers) <= 4 * 5, timers
    finally:
        await replica.stop()


def test_the_stored_time_is_the_one_nats_py_metadata_gave():
    """Replicas judge plausibility and stream time by when JetStream stored a message: a replica of this
    version (the reply subject read here) and one of an older version (nats-py's metadata, through a
    datetime) must get the same nanoseconds."""
    from nats.aio.msg import Msg

    from cache_indexer.indexer.service import _stored_ns

    rng = random.Random(7)
    for _ in range(2000):
        ts = rng.randrange(1_600_000_000 * 10**9, 1_900_000_000 * 10**9)
        reply = f"$JS.ACK.S.C.1.5.6.{ts}.0"
        old = int(Msg(None, subject="x", reply=reply, data=b"").metadata.timestamp.timestamp() * 1e9)
        assert _stored_ns(ack_fields(reply)[2]) == old
