"""The bridge's bulk ZMQ receive (bridge/_zmq_drain.c) against pyzmq's, on real sockets."""

from __future__ import annotations

import pytest
import zmq

from cache_indexer.bridge.zmq_drain import drainer
from tests.conftest import needs_native


@pytest.fixture
def pair():
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    for s in (push, pull):
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.RCVHWM, 0)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push.connect(f"tcp://127.0.0.1:{port}")
    yield push, pull
    push.close(0)
    pull.close(0)
    ctx.term()


MESSAGES = [[b"kv-events", (7).to_bytes(8, "big"), b"\x93" + bytes(range(256)) * 40],  # vLLM's three frames
            [b"", b"\x00" * 8, b""], [b"only one frame"], [b"a", b"b", b"c", b"d"], [b"x" * (1 << 20)]]


def test_the_bulk_receive_gives_what_pyzmq_gives_whole_messages_in_order(pair):
    push, pull = pair
    drain = drainer(pull)
    needs_native(drain is not None, "the bridge's bulk ZMQ receive")
    sent = MESSAGES * 40
    for m in sent:
        push.send_multipart(m)
    got: list[list[bytes]] = []
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    while len(got) < len(sent):
        assert poller.poll(5000), f"only {len(got)} of {len(sent)} messages arrived"
        batch, error = drain(7)
        assert len(batch) <= 7 and error is None
        got += batch
    assert got == sent
    assert drain(7) == ([], None), "nothing queued: an empty list, not a wait"
    for m in MESSAGES:  # and pyzmq's receive sees the same
        push.send_multipart(m)
    assert poller.poll(5000)
    assert [pull.recv_multipart() for _ in MESSAGES] == MESSAGES


async def test_without_the_bulk_receive_the_bridge_receives_through_pyzmq(nats_url, stream_prefix, monkeypatch):
    """The fallback (no compiler at install, a libzmq that cannot be bound): the same batches indexed."""
    import cache_indexer.bridge.vllm_subscriber as subscriber
    from cache_indexer.simulate.vllm_engine import stored
    from cache_indexer.schemas.block_hash import BlockHasher
    from tests.conftest import make_config, wait_for
    from tests.l1_stack import L1Stack

    calls = []
    monkeypatch.setattr(subscriber, "drainer", lambda sock: calls.append(sock) and None)
    chain = BlockHasher("sha256_cbor", "0").event_hashes(list(range(64)), 4)
    stack = await L1Stack(make_config(nats_url, stream_prefix, blockKey={"pythonHashSeed": "0"})).start()
    try:
        eng = stack.engine("127.0.0.21")
        await stack.connect((eng, "127.0.0.21", 0))
        for i in range(16):
            await eng.publish([stored(chain[i:i + 1], parent=chain[i - 1] if i else None, block_size=4)])
        await wait_for(lambda: stack.replica.indexer.l1.stats.block_events == 16, 10, "16 batches indexed")
        assert (await stack.ratios(["127.0.0.21"], list(range(64)), 4)) == [1.0] and calls
    finally:
        await stack.stop()


def test_a_message_that_cannot_be_added_loses_itself_not_the_ones_before_it(pair):
    """The messages received before a failure are off the socket and held nowhere else: they come back
    beside the error (before, a failed append dropped the whole burst)."""
    push, pull = pair
    drain = drainer(pull)
    needs_native(drain is not None, "the bridge's bulk ZMQ receive")
    from cache_indexer.bridge import _zmq_drain

    sent = [[b"t", i.to_bytes(8, "big"), b"payload %d" % i] for i in range(6)]
    for m in sent:
        push.send_multipart(m)
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    assert poller.poll(5000)
    got, error = [], None
    while len(got) < 3 and error is None:  # the first 3 may arrive in several polls
        batch, error = _zmq_drain.drain(pull.underlying, 10, -1, 3 - len(got))
        got += batch
        if error is None:
            assert poller.poll(5000)
    assert got == sent[:3] and isinstance(error, MemoryError)
    rest: list[list[bytes]] = []
    while len(rest) < 2:
        assert poller.poll(5000) or len(rest) == 2
        batch, error = drain(10)
        assert error is None
        rest += batch
    assert rest == sent[4:], "the message whose append failed is lost, and only it"
