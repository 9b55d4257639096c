"""Issue 24: nothing lost when a bridge restarts after the stream has moved on, and no silent holes.

Real bridge processes (SIGTERM, kill -9, a standby taking over), a real nats-server whose stream the
snapshot writer purges, engines in vLLM's frames whose replay buffer is far smaller than their history;
a batch cut off half-way through its parts, a publish the stream refuses, a payload that cannot be
decoded, a frame over ``maxBatchBytes``: each ends in an index equal to what the engine holds (or, where
the engine's events are unknown, a new generation), never in a worker frozen or silently wrong.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal

import msgpack
import pytest

from cache_indexer.bridge.resume_points import record_key
from cache_indexer.simulate.vllm_engine import batch_payload, stored
from cache_indexer.schemas.block_hash import BlockHasher
from cache_indexer.indexer.service import Indexer
from tests.conftest import make_config, wait_for
from tests.l1_stack import L1Stack
from tests.test_local_mode import free_port
from tests.test_recovery import spawn, write_config

H = BlockHasher("sha256_cbor", "0")
BS = 4
PODS = ["127.0.0.91", "127.0.0.92", "127.0.0.93", "127.0.0.94"]


def chain(n: int, start: int) -> list[int]:
    return H.event_hashes(list(range(start, start + BS * n)), BS)


def worker_blocks(indexer: Indexer, pod: str, rank: int = 0) -> set[int]:
    l1 = indexer.l1
    wid = l1.workers.get(pod, rank)
    return set() if wid is None else {h for h, m in l1.blocks.items() if m >> wid & 1}


def targets_file(path, engines) -> None:
    path.write_text("vllm:\n" + "".join(f"  - ip: {e.host}\n    zmqPort: {e.pub_port}\n    replayPort: {e.replay_port}\n"
                                        for e in engines))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("restart", ["sigterm", "kill", "standby", "upgrade"])
async def test_a_bridge_restarted_after_a_purge_resumes_an_idle_engine(nats_url, stream_prefix, tmp_path, restart):
    """Issue 24 #1: engine X publishes 600 batches and goes idle, the others 600 more; a snapshot purges
    the stream (keep 100), so X's last message is gone; the bridge restarts (SIGTERM, kill -9, or its
    standby takes over); X publishes one more batch. Its engine keeps 100 batches: a new generation could
    bring back only those. Every replica must hold all 601 of X's blocks.

    "upgrade": before the purge, the bridge is killed and X's record deleted (a bridge from before the
    records, or one killed before its first write); the next bridge resumes X from the stream's last
    message and must record that position, or the bridge after the purge starts X anew (the chaos soak's
    seed 3844727340 in CI)."""
    cfg = make_config(nats_url, stream_prefix, blockKey={"pythonHashSeed": "0"},
                      snapshot={"everyMessages": 10**9, "interval": "1h", "purgeKeep": 100},
                      ingest={"l1": {"coalesceMaxBatches": 1, "replayCooldown": 0, "replayTimeout": "2s",
                                     "backoffInitial": "100ms", "backoffMax": "1s"}})
    stack = L1Stack(cfg)
    await stack.replica.start()
    engines = [stack.engine(pod, buffer_steps=100) for pod in PODS]
    x = engines[0]
    targets = tmp_path / "targets.yaml"
    targets_file(targets, engines)
    files = [write_config(cfg, tmp_path / f"bridge{i}.yaml", **{"discovery.static.file": str(targets),
                                                                "http.port": free_port()}) for i in range(2)]
    bridges = [spawn("bridge", "--config", str(files[0]))]
    late = None
    try:
        for e in engines:
            await e.wait_subscribed(30)
        if restart == "standby":
            bridges.append(spawn("bridge", "--config", str(files[1])))
        xs = chain(601, 1000)
        for i in range(600):
            await x.publish([stored(xs[i:i + 1], parent=xs[i - 1] if i else None, block_size=BS)])
        indexer = stack.replica.indexer
        await wait_for(lambda: len(worker_blocks(indexer, PODS[0])) == 600, 30, "X's 600 blocks indexed")
        records = await indexer.js.key_value(cfg.snapshot.metaBucket)

        async def x_recorded() -> bool:  # X is idle now: its resume point is written within a second
            try:
                row = msgpack.unpackb((await records.get(record_key(PODS[0]))).value, strict_map_key=False)
            except Exception:
                return False
            return row["ranks"][0][1] == 599
        await wait_for(x_recorded, 10, "X's resume point recorded")
        if restart == "upgrade":
            bridges[0].send_signal(signal.SIGKILL)
            bridges[0].wait(20)
            await records.delete(record_key(PODS[0]))
            bridges[0] = spawn("bridge", "--config", str(files[0]))
            await wait_for(x_recorded, 30, "X's resume point recorded by a bridge that resumed it from the stream")
        others = [chain(200, 100000 * (k + 2)) for k in range(3)]
        for i in range(200):
            for e, hs in zip(engines[1:], others):
                await e.publish([stored(hs[i:i + 1], block_size=BS)])
        name = cfg.nats.l1Stream.name

        async def all_applied():
            info = await indexer.js.stream_info(name)
            return indexer.applied_seq == info.state.last_seq and info.state.messages >= 1200
        await wait_for(all_applied, 60, "the others' batches applied")
        assert await indexer.snapshot_now()
        with pytest.raises(Exception):  # X's last message went with the purge
            await indexer.js.get_last_msg(name, f"{cfg.nats.l1Stream.subjectPrefix}.127_0_0_91.0")

        victim = bridges.pop(0)
        victim.send_signal(signal.SIGTERM if restart == "sigterm" else signal.SIGKILL)
        victim.wait(20)
        if restart != "standby":
            bridges.append(spawn("bridge", "--config", str(files[0])))
        for e in engines:
            await e.wait_subscribed(30)
        await x.publish([stored(xs[600:601], parent=xs[599], block_size=BS)])
        await wait_for(lambda: len(worker_blocks(indexer, PODS[0])) == 601, 30,
                       f"all of X's blocks after the {restart}")
        late = Indexer(cfg)  # a replica started now: the snapshot, then the tail
        await late.start()
        await wait_for(lambda: worker_blocks(late, PODS[0]) == set(xs), 30, "a new replica holds them too")
        info = await indexer.js.stream_info(name)
        resets = [msgpack.unpackb((await indexer.js.get_msg(name, q)).data) for q in
                  range(info.state.first_seq, info.state.last_seq + 1)]
        assert not [m for m in resets if m["type"] == "reset" and m["pod"] == PODS[0]], "X resumed, no new generation"
    finally:
        for b in bridges:
            b.kill()
            b.wait(10)
        if late is not None:
            await late.stop()
        await stack.stop()


@pytest.fixture
async def stack(nats_url, stream_prefix):
    s = await L1Stack(make_config(nats_url, stream_prefix, blockKey={"pythonHashSeed": "0"},
                                  ingest={"l1": {"replayCooldown": 0, "replayTimeout": "1s", "backoffInitial": "100ms",
                                                 "backoffMax": "1s", "maxBatchBytes": "1MiB"}})).start()
    yield s
    await s.stop()


async def engine_holding(stack, pod: str, hashes: list[int]):
    """An engine subscribed to, whose first batch (a store of ``hashes``) is indexed."""
    eng = stack.engine(pod)
    await stack.connect((eng, pod, 0))
    await eng.publish([stored(hashes, block_size=BS)])
    await wait_for(lambda: worker_blocks(stack.replica.indexer, pod) == set(hashes), 20, "the first batch indexed")
    return eng


async def test_a_bridge_killed_half_way_through_a_batchs_parts_resumes_at_that_batch(nats_url, stream_prefix):
    """Issue 24 #3: a bridge died after 4 of a large batch's parts (the stream takes 4 KiB messages);
    the next bridge resumed after that seq, the indexers waited for part 5 for ever and held every later
    batch. It must publish that batch again, whole, and the engine's index must converge."""
    from cache_indexer.bridge.jetstream_publisher import JetStreamPublisher
    from cache_indexer.bridge.l1_publisher import L1Publisher
    from cache_indexer.bridge.vllm_events import decode_batch

    cfg = make_config(nats_url, stream_prefix, blockKey={"pythonHashSeed": "0"},
                      nats={"l1Stream": {"name": f"{stream_prefix}_L1", "subjectPrefix": f"t.{stream_prefix}.l1",
                                         "maxMsgSize": "4KiB", "maxBytes": "256MiB"}, "publish": {"window": 2}})
    stack = await L1Stack(cfg).start()
    try:
        pod = PODS[1]
        eng = stack.engine(pod)
        await stack.connect((eng, pod, 0))
        small = chain(10, 50)
        for i in range(10):
            await eng.publish([stored(small[i:i + 1], block_size=BS)])
        await wait_for(lambda: len(worker_blocks(stack.replica.indexer, pod)) == 10, 20, "the first batches")
        await stack.bridge.stop()
        big = chain(3000, 7000)
        seq = await eng.publish([stored(big, block_size=BS)])  # no bridge listens: the dying bridge had it
        # the dying bridge: its publisher got 4 of the batch's parts out, then the process was gone
        js = stack.replica.indexer.js
        pub = JetStreamPublisher(stack.replica.indexer.nc, stack.bridge_metrics, window=2, ack_timeout=1.0)
        await pub.start()
        sent = []
        real_publish = pub.publish

        async def dies_after_four(subject, data, headers, *callbacks):
            if len(sent) == 4:
                raise asyncio.CancelledError  # kill -9: nothing more leaves
            sent.append(headers["Nats-Msg-Id"])
            await real_publish(subject, data, headers, *callbacks)
        pub.publish = dies_after_four
        subject = f"{cfg.nats.l1Stream.subjectPrefix}.127_0_0_92.0"
        gen = int((await js.get_last_msg(cfg.nats.l1Stream.name, subject)).headers["Kv-Gen"])
        dying = L1Publisher(pub, cfg.nats.l1Stream.subjectPrefix, js, cfg.nats.l1Stream.name, lambda: 4096 - 1024)
        payload = eng.buffer[-1][1]
        with pytest.raises(asyncio.CancelledError):
            await dying.batch(pod, 0, gen, seq, decode_batch(payload).ts, decode_batch(payload).events)
        assert await pub.flush(10) and len(sent) == 4
        await pub.close()
        last = await js.get_last_msg(cfg.nats.l1Stream.name, subject)
        assert last.headers["Kv-Part"].startswith("4/"), "the stream ends with part 4 of the big batch"

        await stack.next_bridge()
        await wait_for(lambda: stack.bridge.lease.is_leader, 10, "the new bridge to lead")
        await stack.connect((eng, pod, 0))
        after = chain(5, 90000)
        for i in range(5):
            await eng.publish([stored(after[i:i + 1], block_size=BS)])
        await wait_for(lambda: worker_blocks(stack.replica.indexer, pod) == set(small) | set(big) | set(after), 30,
                       "the engine's index whole again")
        assert stack.replica.indexer.l1.stats.lost_gaps == 0
    finally:
        await stack.stop()


async def test_a_generation_whose_reset_a_killed_bridge_never_got_stored_is_whole_at_the_next(stack):
    """The window docs/operations.md listed as open (and the sequencing model found after a stream loss,
    SEQUENCING_SEED=7): a bridge killed while a new generation's reset and first batches were in flight,
    a later batch of it stored, no resume record yet. The next bridge resumes from that batch and
    publishes the engine's buffer up to it again, but the indexers had begun the generation at the stored
    batch and dropped the ones before it as duplicates: the index held one batch of the engine's four
    until the engine restarted. The reset now goes again with them."""
    from cache_indexer.bridge.jetstream_publisher import JetStreamPublisher
    from cache_indexer.bridge.l1_publisher import L1Publisher, new_generation
    from cache_indexer.bridge.vllm_events import decode_batch

    cfg, pod = stack.cfg, PODS[3]
    await stack.bridge.stop()
    eng = stack.engine(pod)
    chains = [chain(3, 1000 * (i + 1)) for i in range(4)]
    for c in chains:
        seq = await eng.publish([stored(c, block_size=BS)])
    # the dying bridge: of the generation it began (a reset, batches 0..3) only the last batch was stored
    js = stack.replica.indexer.js
    pub = JetStreamPublisher(stack.replica.indexer.nc, stack.bridge_metrics, window=2, ack_timeout=1.0)
    await pub.start()
    dying = L1Publisher(pub, cfg.nats.l1Stream.subjectPrefix, js, cfg.nats.l1Stream.name, lambda: 1 << 20)
    last = decode_batch(eng.buffer[-1][1])
    await dying.batch(pod, 0, new_generation(), seq, last.ts, last.events)
    assert await pub.flush(10)
    await pub.close()
    assert (await js.stream_info(cfg.nats.l1Stream.name)).state.messages == 1
    await wait_for(lambda: worker_blocks(stack.replica.indexer, pod) == set(chains[3]), 20,
                   "the stored batch indexed: the generation begun there")

    await stack.next_bridge()
    await wait_for(lambda: stack.bridge.lease.is_leader, 10, "the new bridge to lead")
    await stack.connect((eng, pod, 0))  # quiet: the catch-up alone must make it whole
    whole = set().union(*map(set, chains))
    await wait_for(lambda: worker_blocks(stack.replica.indexer, pod) == whole, 20,
                   "the engine's four batches indexed, not the stored one alone")
    assert stack.replica.indexer.l1.stats.lost_gaps == 0
    assert not stack.bridge_metrics.bridge_resets.labels("subscribed")._value.get(), "resumed, not started anew"



async def test_a_publish_the_stream_refuses_starts_a_new_generation_after_it(stack):
    """Issue 24 #3 (a refused publish): the stream's own limit is smaller than the bridge knows (an
    operator changed it); the batch over it can never be stored. It was dropped, and the indexers held
    every later batch of that worker. The bridge must start a new generation after it, from the engine's
    buffer, and the worker goes on."""
    pod = PODS[2]
    eng = await engine_holding(stack, pod, chain(4, 300))
    js = stack.replica.indexer.js
    info = await js.stream_info(stack.cfg.nats.l1Stream.name)
    info.config.max_msg_size = 2048
    await js.update_stream(info.config)
    await eng.publish([stored(chain(400, 5000), block_size=BS)])  # 3.6 KB: refused for good
    refused = stack.bridge_metrics.publish_refused.labels("rejected")
    await wait_for(lambda: refused._value.get() == 1, 20, "the stream to refuse it")
    info.config.max_msg_size = -1  # the operator puts it back; the refused batch stays lost
    await js.update_stream(info.config)
    then = chain(3, 900000)
    for i in range(3):
        await eng.publish([stored(then[i:i + 1], block_size=BS)])
    await wait_for(lambda: worker_blocks(stack.replica.indexer, pod) == set(then), 20,
                   "a new generation with what followed the refused batch")
    assert stack.bridge_metrics.bridge_resets.labels("refused")._value.get() == 1
    assert stack.bridge_metrics.publish_refused.labels("rejected")._value.get() == 1


async def test_a_payload_that_cannot_be_decoded_starts_a_new_generation(stack):
    """Issue 24 #4: a malformed payload was published as an empty batch; what it removed stayed indexed
    (ratios too high). Its events are unknown: the worker starts over after it."""
    pod = PODS[3]
    hs = chain(4, 600)
    eng = await engine_holding(stack, pod, hs)
    await eng.publish_payload(b"\xc1 it removed them, in truth")
    await eng.publish([stored(hs[:1], block_size=BS)])
    await wait_for(lambda: worker_blocks(stack.replica.indexer, pod) == set(hs[:1]), 20,
                   "only what came after the undecodable batch")
    assert stack.bridge_metrics.bridge_resets.labels("malformed")._value.get() == 1
    assert stack.bridge_metrics.bridge_malformed._value.get() == 1


@pytest.mark.timeout(60)
async def _an_oversized_batch_after_two_blocks(stack, pod: str, hs: list[int]):
    """An engine subscribed to, its first two blocks indexed, then a frame over ``maxBatchBytes`` (the third
    block's batch, padded): libzmq gives the connection up."""
    eng = stack.engine(pod, buffer_steps=10000)
    await stack.connect((eng, pod, 0))
    await eng.publish([stored(hs[:2], block_size=BS)])
    await wait_for(lambda: worker_blocks(stack.replica.indexer, pod) == set(hs[:2]), 20, "before")
    await eng.publish_payload(batch_payload([stored(hs[2:3], block_size=BS)]) + b"\x00" * (2 << 20))
    return eng, hs


async def test_a_frame_over_max_batch_bytes_is_a_gap_and_the_subscription_comes_back(stack):
    """Issue 24 #6: libzmq drops the connection on a message over MAXMSGSIZE and, a protocol error, never
    reconnects: the engine's later batches never arrived, nothing was logged or counted. The socket must
    be made anew, the lost batch fetched from the engine's buffer, and a socket without a connection shown.
    Since issue 36 #6b the replay socket takes the oversized batch (its own limit) and the new socket
    catches up at once: the batch (here padded past its msgpack: undecodable) starts a new generation
    after it, whether the catch-up or the gap of the next live batch reads it first."""
    pod = PODS[0]
    eng, hs = await _an_oversized_batch_after_two_blocks(stack, pod, chain(12, 1200))
    await eng.wait_subscribed(10)  # subscribed again
    for i in range(3, 12):
        await eng.publish([stored(hs[i:i + 1], parent=hs[i - 1], block_size=BS)])
    await wait_for(lambda: set(hs[3:]) <= worker_blocks(stack.replica.indexer, pod), 20,
                   "the batches after the oversized one indexed")
    m = stack.bridge_metrics
    assert m.bridge_resubscribes._value.get() == 1 and m.bridge_resets.labels("malformed")._value.get() == 1
    assert m.subscriptions_disconnected._value.get() == 0 and m.subscriptions._value.get() == 1
    assert stack.bridge.is_ready()


async def test_a_socket_that_cannot_be_made_anew_is_tried_again_and_the_engine_heard(stack, monkeypatch, caplog):
    """From a review: the socket made anew after libzmq gave a connection up was made outside any guard,
    so one failure (out of file descriptors, say) ended the connection's watch with nothing logged, and
    the subscription was left with no socket: the engine was never heard again. The failure is logged,
    counted and tried again after the reconnect backoff."""
    import errno

    import zmq

    from cache_indexer.bridge.vllm_subscriber import VllmSubscriber

    plain, opens = VllmSubscriber._open, []

    def failing_once(self):
        opens.append(self.ep.pod)
        if len(opens) == 2:  # the first reopen
            raise zmq.ZMQError(errno.EMFILE)
        return plain(self)
    monkeypatch.setattr(VllmSubscriber, "_open", failing_once)
    pod = PODS[1]
    eng, hs = await _an_oversized_batch_after_two_blocks(stack, pod, chain(6, 1300))
    await wait_for(lambda: len(opens) >= 3, 20, "the socket made anew after the failed try")
    await eng.wait_subscribed(10)
    for i in range(3, 6):
        await eng.publish([stored(hs[i:i + 1], parent=hs[i - 1], block_size=BS)])
    await wait_for(lambda: set(hs[3:]) <= worker_blocks(stack.replica.indexer, pod), 20, "the engine heard again")
    assert stack.bridge_metrics.task_errors.labels("vllm-subscription")._value.get() == 1
    assert "making the socket to" in caplog.text


def _write_loop_on(kv):
    """The bridge's resume points writing to ``kv`` (tests/test_sequencing_model.py's MemoryKV, or one that
    fails or stalls), their write loop started, the interval an hour: only a write at once is seen."""
    from cache_indexer.bridge.resume_points import ResumePoints

    points = ResumePoints(None, "meta", interval=3600)
    points._store._kv = kv
    points.stream_id = "s"
    points.start()
    return points


def _recorded_ranks(kv, pod: str = "127.0.0.91") -> dict:
    """The ranks of the pod's resume record as ``kv`` holds it: rank -> [gen, seq, epoch, ts, stream seq]."""
    return msgpack.unpackb(kv.data[record_key(pod)], strict_map_key=False)["ranks"]


async def test_a_workers_first_position_is_recorded_at_once():
    """CI's chaos soak (seed 2287974246): the first bridge was killed 0.9 s after the idle engine's 600
    batches were acked, before the records' one-second write; the snapshot writer then purged those
    messages, and the next bridge, with neither record nor message, started the engine anew. A worker's
    first position is now written at once (later ones wait for the interval, here an hour)."""
    from cache_indexer.bridge.resume_points import Position
    from tests.test_sequencing_model import MemoryKV

    kv = MemoryKV()
    points = _write_loop_on(kv)
    try:
        points.update("127.0.0.91", 0, Position(1, 599, "-", 1.5, 20))
        await wait_for(lambda: record_key("127.0.0.91") in kv.data, 5, "the first position recorded at once")
        points.update("127.0.0.91", 1, Position(1, 7, "-", 2.5, 21))  # another rank's first: at once too

        await wait_for(lambda: set(_recorded_ranks(kv)) == {0, 1}, 5,
                       "the second rank's first position recorded at once")
        assert _recorded_ranks(kv)[0][1] == 599
    finally:
        await points.stop()


async def test_a_position_that_ran_far_past_its_last_write_is_recorded_at_once():
    """CI's chaos soak (sharded, seed 558473181): the record's first write caught the idle engine's burst of
    600 batches at seq 93, the next was due an interval later; the engine's holder was killed within it, the
    snapshot writer purged the burst's messages, and the next bridge resumed from 93 while the engine's
    buffer kept only 500-599: a gap beyond the replay, and chains 0-499 lost. A worker's position is now
    also written at once when it is ``RECORD_LAG_MAX`` batches past its last write, so a bridge killed at
    any moment leaves a record that an engine's buffer reaches back to where it holds more than that and
    the batches in flight (vLLM's: 10,000)."""
    from cache_indexer.bridge.resume_points import RECORD_LAG_MAX, Position
    from tests.test_sequencing_model import MemoryKV

    class CountingKV(MemoryKV):
        puts = 0

        async def put(self, key: str, value: bytes) -> None:
            CountingKV.puts += 1
            await asyncio.sleep(0.003)
            await super().put(key, value)
    kv = CountingKV()
    points = _write_loop_on(kv)

    def recorded() -> int:
        return _recorded_ranks(kv)[0][1]
    try:
        points.update("127.0.0.91", 0, Position(1, 0, "-", 1.0, 1))
        await wait_for(lambda: record_key("127.0.0.91") in kv.data, 5, "the first position recorded at once")
        for seq in range(1, 600):  # the burst's acks, a few to a read of the connection
            points.update("127.0.0.91", 0, Position(1, seq, "-", 1.0 + seq, 1 + seq))
            if seq % 4 == 0:
                await asyncio.sleep(0.001)  # a write takes a round trip, during which more acks come
        await wait_for(lambda: recorded() > 599 - RECORD_LAG_MAX, 5, "the burst's end recorded within the lag bound")
        assert kv.puts <= 1 + 600 // RECORD_LAG_MAX, f"{kv.puts} writes: one per RECORD_LAG_MAX batches at most"
        before = recorded()  # 536..599: the last write may have caught the burst anywhere in that range
        nxt = before + RECORD_LAG_MAX - 1  # the farthest a position runs without a write at once (>= 599)
        points.update("127.0.0.91", 0, Position(1, nxt, "-", 1.0 + nxt, 1000 + nxt))  # the interval's
        await asyncio.sleep(0.05)
        assert recorded() == before, "a position close to its last write waits for the interval"
    finally:
        await points.stop()


async def test_a_failed_record_write_is_tried_again_within_a_second_and_not_at_every_ack():
    """From a review of the write at once: a position counts as written when its write is issued, so when
    that write failed and the engine then went idle, no ack asked again and the record waited for the
    interval (the soak's window: a kill and a purge within it); and with a NATS that refuses at once, every
    ack asked for a put. Now a failed write is tried again after ``RETRY_AFTER``, acks or not, and no sooner."""
    from cache_indexer.bridge.resume_points import RETRY_AFTER, Position
    from tests.test_sequencing_model import MemoryKV

    class RefusingKV(MemoryKV):
        refuse, puts = True, 0

        async def put(self, key: str, value: bytes) -> None:
            RefusingKV.puts += 1
            if RefusingKV.refuse:
                raise ConnectionError("no responders")
            await super().put(key, value)
    kv = RefusingKV()
    points = _write_loop_on(kv)
    try:
        t0 = asyncio.get_running_loop().time()
        for seq in range(300):  # acks while every put is refused
            points.update("127.0.0.91", 0, Position(1, seq, "-", 1.0 + seq, 1 + seq))
            await asyncio.sleep(0.001)
        took = asyncio.get_running_loop().time() - t0
        assert kv.puts <= 2 + took / RETRY_AFTER, f"{kv.puts} puts for 300 acks in {took:.2f} s while refused"
        RefusingKV.refuse = False  # NATS back; the engine idle from now on: no ack asks again
        await wait_for(lambda: record_key("127.0.0.91") in kv.data, 3 * RETRY_AFTER, "the record written again")
        assert _recorded_ranks(kv)[0][1] == 299
    finally:
        await points.stop()


async def test_a_record_write_whose_bucket_did_not_open_is_tried_again_within_a_second():
    """As a refused put, a bucket that could not be opened (NATS away at the first write) is tried again
    after ``RETRY_AFTER``, not at the next interval: the pods' records had waited for it."""
    from cache_indexer.bridge.resume_points import RETRY_AFTER, Position
    from tests.test_sequencing_model import MemoryKV

    kv, refused = MemoryKV(), [True]

    async def store():
        if refused[0]:
            raise ConnectionError("no responders")
        return kv
    points = _write_loop_on(kv)
    points._store = store
    try:
        points.update("127.0.0.91", 0, Position(1, 0, "-", 1.0, 1))  # a first position: written at once
        await asyncio.sleep(0.05)
        refused[0] = False  # NATS back; the engine idle: no ack asks again
        await wait_for(lambda: record_key("127.0.0.91") in kv.data, 3 * RETRY_AFTER, "the record written again")
    finally:
        await points.stop()


async def test_a_graceful_stop_during_a_record_write_still_writes_that_pod():
    """From the same review: stop() cancels the write loop, and a pod whose write it cancelled had left the
    pods to write already, so stop()'s own write skipped it (writes now come during bursts, so a stop lands
    on one more often)."""
    from cache_indexer.bridge.resume_points import Position
    from tests.test_sequencing_model import MemoryKV

    class StallingKV(MemoryKV):
        stall = True

        async def put(self, key: str, value: bytes) -> None:
            if StallingKV.stall:
                StallingKV.stall = False
                await asyncio.sleep(3600)  # the first write hangs until cancelled
            await super().put(key, value)
    kv = StallingKV()
    points = _write_loop_on(kv)
    points.update("127.0.0.91", 0, Position(1, 5, "-", 6.0, 6))
    await wait_for(lambda: not StallingKV.stall, 5, "the first write under way")
    await points.stop()
    assert _recorded_ranks(kv)[0][1] == 5


@pytest.mark.timeout(90)
@pytest.mark.parametrize("then", ["idle", "one-more-batch"])
async def test_an_oversized_batch_and_the_chains_sent_during_the_recovery_all_reach_the_index(stack, then):
    """Issue 36 #6b: a batch over maxBatchBytes drops the live connection (libzmq), and the engine sends
    three more chains before the bridge has subscribed again. The replay socket had the same size limit:
    the replay that was to fill the gap broke on the same batch, timed out, and the worker was reset at
    the next live batch (its whole index lost, the three chains with it); an engine that went idle was
    never asked at all.

    Guaranteed: the engine's whole truth reaches the index (the oversized batch included) whether the
    engine goes on or goes idle, as long as the batch fits the replay socket's own limit (half of
    ingest.l1.maxBufferedBytes, the replays' share of the receive budget), without a reset."""
    pod = PODS[1]
    eng = stack.engine(pod, buffer_steps=10000)
    await stack.connect((eng, pod, 0))
    indexer, m = stack.replica.indexer, stack.bridge_metrics
    chains = [chain(4, 100_000 + 1000 * i) for i in range(6)]
    truth: set[int] = set()

    async def send(hashes: list[int]) -> None:
        await eng.publish([stored(hashes, block_size=BS)])
        truth.update(hashes)
    for c in chains[:2]:
        await send(c)
    await wait_for(lambda: worker_blocks(indexer, pod) == truth, 20, "the first two chains indexed")
    big = [(0x9E3779B97F4A7C15 * (i + 1)) & ((1 << 64) - 1) for i in range(60_000)]  # fixed, no seed needed
    payload = batch_payload([stored(big, block_size=BS)])
    assert stack.cfg.ingest.l1.maxBatchBytes < len(payload) <= stack.cfg.ingest.l1.maxBufferedBytes // 2
    await eng.publish_payload(payload)
    truth.update(big)
    for c in chains[2:5]:  # while the bridge has no connection: they reach it from the engine's buffer only
        await send(c)
    if then == "one-more-batch":
        await eng.wait_subscribed(10)  # subscribed again
        await send(chains[5])
    await wait_for(lambda: worker_blocks(indexer, pod) == truth, 30,
                   "the engine's truth indexed, the oversized batch and the chains sent during the recovery included")
    assert m.bridge_resubscribes._value.get() == 1
    assert sum(m.bridge_resets.labels(r)._value.get() for r in ("gap-beyond-replay", "unverified", "engine-restart",
                                                                  "malformed")) == 0, "the worker was never reset"
    assert indexer.l1.stats.lost_gaps == 0


async def test_a_busy_pods_write_at_once_leaves_the_other_pods_to_the_interval():
    """A pod past ``RECORD_LAG_MAX`` is written at once, alone: before, every pod that had moved was written
    with it, so on a trace of 8 engines at 5x a quiet pod beside a busy one had its record put at the busy
    one's pace (70% of the bridge's puts). The quiet pod's move waits for the interval (here an hour)."""
    from cache_indexer.bridge.resume_points import RECORD_LAG_MAX, Position
    from tests.test_sequencing_model import MemoryKV

    kv = MemoryKV()
    points = _write_loop_on(kv)
    busy, quiet = "127.0.0.91", "127.0.0.92"
    try:
        for pod in (busy, quiet):
            points.update(pod, 0, Position(1, 0, "-", 1.0, 1))
        await wait_for(lambda: record_key(busy) in kv.data and record_key(quiet) in kv.data, 5, "first positions")
        points.update(quiet, 0, Position(1, 1, "-", 2.0, 2))  # moved, not far: the interval's
        points.update(busy, 0, Position(1, RECORD_LAG_MAX, "-", 3.0, 3))  # far: at once
        await wait_for(lambda: _recorded_ranks(kv, busy)[0][1] == RECORD_LAG_MAX, 5, "the busy pod written at once")
        await asyncio.sleep(0.05)
        assert _recorded_ranks(kv, quiet)[0][1] == 0, "the quiet pod's move waits for the interval"
    finally:
        await points.stop()
    assert _recorded_ranks(kv, quiet)[0][1] == 1, "written at the stop"


@contextlib.asynccontextmanager
async def two_bridges_records(nats_url: str, stream_prefix: str):
    """Two bridges' resume points (A, B) on one records bucket of a real nats-server, and a reader of what
    the bucket holds for a pod: (a, b, stored)."""
    import nats

    from cache_indexer.bridge.resume_points import ResumePoints

    bucket = f"{stream_prefix}_META"
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        a, b = ResumePoints(js, bucket, interval=3600), ResumePoints(js, bucket, interval=3600)
        a.stream_id = b.stream_id = "s"

        async def stored(pod: str) -> dict:
            kv = await js.key_value(bucket)
            return msgpack.unpackb((await kv.get(record_key(pod))).value, strict_map_key=False)
        yield a, b, stored
    finally:
        await nc.close()


async def test_a_bridge_that_lost_a_pod_never_writes_its_record_back_over_the_next_holders(nats_url, stream_prefix):
    """The chaos soak (sharded, CHAOS_SEED=421964534): the DP pod's shard moved from bridge A to bridge B,
    and acks of A's batches still in flight reached A afterwards. B removed a rank (its record then kept the
    removal's mark); A's write loop then wrote the pod's record from what A knew, the positions of before
    and no mark. After the NATS restart A held the shard again, read its own record back and resumed the
    retired generation: the indexers dropped it as stale, and the rank stayed empty for ever. A record is
    now written on the revision its writer last saw: A's write is refused, A reads B's record, takes its
    marks and newer positions, and writes what they make together. Two bridges' resume points on one
    records bucket of a real nats-server."""
    from cache_indexer.bridge.resume_points import Position

    pod = "127.0.0.91"
    async with two_bridges_records(nats_url, stream_prefix) as (a, b, stored):
        a.update(pod, 0, Position(5, 240, "-", 1.0, 1340))
        a.update(pod, 1, Position(5, 316, "-", 1.0, 1341))
        await a.write()
        assert set(await b.load(pod)) == {0, 1}  # the shard moved to B
        b.update(pod, 0, Position(5, 600, "-", 2.0, 2579))
        await b.forget_rank(pod, 1, before=9)  # rank 1 removed by B: generations up to 8 retired
        a.update(pod, 1, Position(5, 317, "-", 1.1, 1342))  # late acks of A's batches in flight at the move
        a.update(pod, 0, Position(5, 241, "-", 1.1, 1343))
        await a.write()
        record = await stored(pod)
        assert record.get("retiredRanks") == {1: 8}, "the removal's mark B wrote is kept"
        assert record["ranks"][0][1] == 600 and 1 not in record["ranks"], "B's newer positions are kept"
        assert a.own(pod, 1) is None and a.own(pod, 0).seq == 600, "A took B's record"
        assert await a.load(pod) == {0: Position(5, 600, "-", 2.0, 2579)}  # the shard back at A
        assert a.retired(pod, 1) == 8
        b.update(pod, 0, Position(5, 601, "-", 2.1, 2600))  # B, still writing on the revision it last saw
        await b.write()
        record = await stored(pod)
        assert record["ranks"][0][1] == 601 and record.get("retiredRanks") == {1: 8}


async def test_a_late_ack_of_an_older_generation_never_takes_the_record_back_to_it(nats_url, stream_prefix):
    """From a review of the merged write: bridge B took the pod and started a new generation (no removal);
    a batch of A's older one, a retry, was stored after B's reset and its ack reached A. Merged by stream
    sequence alone, A's write put the older generation back into the record, and B's next merge took it
    too: with the worker idle, that batch the subject's last message, the next bridge would resume the
    generation the indexers had left behind. Positions are ordered by generation, then seq."""
    from cache_indexer.bridge.resume_points import Position

    pod = "127.0.0.91"
    async with two_bridges_records(nats_url, stream_prefix) as (a, b, stored):
        a.update(pod, 0, Position(1000, 100, "-", 1.0, 10))
        await a.write()
        await b.load(pod)
        b.update(pod, 0, Position(2000, 4, "-", None, 20))  # B's new generation (its reset and replay)
        await b.write()
        a.update(pod, 0, Position(1000, 101, "-", 1.1, 21))  # A's retry, stored after B's messages
        await a.write()
        record = await stored(pod)
        assert record["ranks"][0][:2] == [2000, 4], "the newer generation stays recorded"
        b.update(pod, 0, Position(2000, 5, "-", 2.0, 22))
        await b.write()
        assert b.own(pod, 0).gen == 2000 and (await a.load(pod))[0].gen == 2000
