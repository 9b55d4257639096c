"""Engines registered over HTTP (``/register``, ``/unregister``, ``/workers``): indexed like discovered pods
through a real bridge, NATS and replica; kept across restarts of both; refused when unauthenticated,
oversized or malformed, with Dynamo's codes."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from cache_indexer.bridge.service import Bridge
from cache_indexer.replica import Replica
from cache_indexer.schemas.block_hash import BlockHasher
from cache_indexer.simulate.vllm_engine import stored
from tests.conftest import make_config, wait_for
from tests.l1_stack import L1Stack

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
HASHER = BlockHasher("sha256_cbor", "0")
B = 4


def chain(seed: int, blocks: int = 4) -> tuple[list[int], list[int]]:
    tokens = [seed * 1000 + i for i in range(blocks * B)]
    return tokens, HASHER.event_hashes(tokens, B)


def config(nats_url, prefix, **http):
    return make_config(nats_url, prefix, blockKey={"pythonHashSeed": "0", "blockSize": 16},
                       http={"registrationToken": TOKEN, **http})


async def _registrations_ready(replica: Replica) -> None:
    await wait_for(lambda: replica.registrations is not None and replica.registrations.synced.is_set(), 20,
                   "the replica to read the registrations")


async def _post(session, path: str, body: dict, headers=AUTH) -> tuple[int, dict]:
    async with session.post(path, json=body, headers=headers) as r:
        return r.status, await r.json()


async def _instances(session, tokens, model="m", **extra) -> dict:
    status, out = await _post(session, "/query", {"token_ids": tokens, "model_name": model, **extra}, headers={})
    assert status == 200, out
    return out["instances"]


async def _workers(session) -> list[dict]:
    async with session.get("/workers") as r:
        assert r.status == 200
        return await r.json()


async def test_a_registered_engine_is_indexed_survives_restarts_and_goes_with_unregister(nats_url, stream_prefix):
    cfg = config(nats_url, stream_prefix)
    stack = await L1Stack(cfg).start()
    eng = stack.engine("127.0.0.1")
    first, h1 = chain(1)
    second, h2 = chain(2)
    try:
        await _registrations_ready(stack.replica)
        reg = {"instance_id": 7, "endpoint": f"tcp://127.0.0.1:{eng.pub_port}",
               "replay_endpoint": f"tcp://127.0.0.1:{eng.replay_port}", "model_name": "m", "block_size": B}
        assert await _post(stack.session, "/register", reg) == (201, {"status": "ok"})
        await eng.wait_subscribed()
        await eng.publish([stored(h1, block_size=B, token_ids=first)])

        async def holds(tokens, n) -> bool:  # (a request without block_size gets the registered one)
            return (await _instances(stack.session, tokens)).get("7", {}).get("gpu") == n
        await wait_for(lambda: holds(first, len(first)), 20, "the registered engine's blocks indexed")
        [worker] = await _workers(stack.session)
        assert worker == {"instance_id": 7, "source": "registration", "status": "active", "model_name": "m",
                          "routing_group": "default", "block_size": B, "endpoints": {"0": reg["endpoint"]},
                          "listeners": {"0": {"endpoint": reg["endpoint"], "status": "active"}}}

        await stack.settled()
        await stack.replica.stop()  # both restarted: the registration is in NATS, not in either process
        await stack.bridge.stop()
        stack.bridge, stack.replica = Bridge(cfg, stack.bridge_metrics), Replica(cfg)
        await stack.bridge.start()
        await stack.replica.start()
        await stack.session.close()
        stack.session = aiohttp.ClientSession(base_url=f"http://127.0.0.1:{stack.replica.http.port}")
        await wait_for(lambda: holds(first, len(first)), 20, "the blocks indexed before the restart")
        await wait_for(lambda: ("7", 0) in {(e.pod, e.rank) for e in stack.bridge.subscribers}, 20,
                       "the new bridge subscribed to the registered engine")
        await eng.publish([stored(h2, block_size=B, token_ids=second)])
        await wait_for(lambda: holds(second, len(second)), 20, "blocks stored after the restart indexed")

        await _registrations_ready(stack.replica)
        assert await _post(stack.session, "/unregister", {"instance_id": 7, "model_name": "m"}) == (200, {"status": "ok"})
        await wait_for(lambda: not stack.bridge.subscribers, 20, "the bridge to unsubscribe")

        async def dropped() -> bool:  # (the block size given: the registration that named it is gone)
            return "7" not in await _instances(stack.session, first, block_size=B)
        await wait_for(dropped, 20, "the unregistered engine dropped from the index")
        assert await _workers(stack.session) == []
        status, out = await _post(stack.session, "/unregister", {"instance_id": 7})
        assert status == 404 and "not registered" in out["error"]
    finally:
        await stack.stop()


async def test_a_query_is_answered_by_the_instances_registered_for_its_model(nats_url, stream_prefix):
    cfg = config(nats_url, stream_prefix)
    stack = await L1Stack(cfg).start()
    engines = [stack.engine("127.0.0.1") for _ in range(2)]
    tokens, hashes = chain(3)
    try:
        await _registrations_ready(stack.replica)
        for instance, (eng, model) in enumerate(zip(engines, ["m", "other"])):
            assert (await _post(stack.session, "/register", {"instance_id": f"eng-{instance}", "model_name": model,
                                                             "endpoint": f"tcp://127.0.0.1:{eng.pub_port}",
                                                             "block_size": B}))[0] == 201
        for eng in engines:
            await eng.wait_subscribed()
            await eng.publish([stored(hashes, block_size=B, token_ids=tokens)])

        async def each_by_its_own() -> bool:
            return [set(await _instances(stack.session, tokens, model)) for model in ("m", "other")] == \
                [{"eng-0"}, {"eng-1"}]
        await wait_for(each_by_its_own, 20, "each model answered by its own instance")
    finally:
        await stack.stop()


REFUSED = [
    ({}, {"instance_id": 1, "endpoint": "tcp://127.0.0.1:5", "model_name": "m", "block_size": 4}, 401, "Bearer"),
    ({"Authorization": "Bearer wrong"}, {"instance_id": 1, "endpoint": "tcp://127.0.0.1:5", "model_name": "m",
                                         "block_size": 4}, 401, "Bearer"),
    (AUTH, {"instance_id": 1, "endpoint": "tcp://127.0.0.1:5", "block_size": 4}, 422, "model_name"),
    (AUTH, {"instance_id": 1, "model_name": "m", "block_size": 4}, 422, "endpoint"),
    (AUTH, {"instance_id": -1, "endpoint": "tcp://127.0.0.1:5", "model_name": "m", "block_size": 4}, 422, "instance_id"),
    (AUTH, {"instance_id": "10.0.0.1", "endpoint": "tcp://127.0.0.1:5", "model_name": "m", "block_size": 4}, 400,
     "instance_id"),
    (AUTH, {"instance_id": 1, "endpoint": "nonsense", "model_name": "m", "block_size": 4}, 400, "endpoint"),
    (AUTH, {"instance_id": 1, "endpoint": "tcp://127.0.0.1:70000", "model_name": "m", "block_size": 4}, 400, "endpoint"),
    # a host libzmq's connect refuses (a review: accepted, it failed every reconcile of the bridge)
    (AUTH, {"instance_id": 1, "endpoint": "tcp://-engine-1:5557", "model_name": "m", "block_size": 4}, 400, "endpoint"),
    (AUTH, {"instance_id": 1, "endpoint": "tcp://127.0.0.1:5", "replay_endpoint": "tcp://_e:5", "model_name": "m",
            "block_size": 4}, 400, "replay_endpoint"),
    (AUTH, {"instance_id": 1, "endpoint": "tcp://127.0.0.1:5", "model_name": "m", "block_size": 0}, 400, "block_size"),
    # a review: accepted, a block size past 2**63 made every /query of the model a 500, kept in NATS
    (AUTH, {"instance_id": 1, "endpoint": "tcp://127.0.0.1:5", "model_name": "m", "block_size": 1 << 63}, 400,
     "block_size"),
    (AUTH, {"instance_id": 1, "endpoint": "tcp://127.0.0.1:5", "model_name": "m", "block_size": 4, "dp_rank": 5000},
     400, "dp_rank"),
    (AUTH, {"instance_id": 1, "endpoint": "tcp://127.0.0.1:5", "model_name": "m" * 5000, "block_size": 4}, 422,
     "model_name"),
]


async def test_registrations_are_refused_with_a_clear_error_and_counted(nats_url, stream_prefix):
    cfg = config(nats_url, stream_prefix, maxRegistrations=2)
    stack = await L1Stack(cfg).start()
    try:
        await _registrations_ready(stack.replica)
        for headers, body, status, named in REFUSED:
            got, out = await _post(stack.session, "/register", body, headers=headers)
            assert (got, named in out["error"]) == (status, True), (body, got, out)
        async with stack.session.post("/register", data=b"{" + b" " * (70 * 1024) + b"}", headers=AUTH) as r:
            assert r.status == 413
        # a review: an Authorization header that is not UTF-8 was a 500 ("Server got itself in trouble")
        reader, writer = await asyncio.open_connection("127.0.0.1", stack.session._base_url.port)
        writer.write(b"POST /register HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xe9\r\nContent-Length: 2\r\n"
                     b"Connection: close\r\n\r\n{}")
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
        ok = {"instance_id": 1, "endpoint": "tcp://127.0.0.1:5", "model_name": "m", "block_size": 4}
        assert (await _post(stack.session, "/register", ok))[0] == 201
        status, out = await _post(stack.session, "/register", ok)
        assert status == 409 and "already registered" in out["error"]
        status, out = await _post(stack.session, "/register", {**ok, "dp_rank": 1, "block_size": 8})
        assert status == 409 and "block_size mismatch" in out["error"]
        assert (await _post(stack.session, "/register", {**ok, "dp_rank": 1}))[0] == 201
        status, out = await _post(stack.session, "/register", {**ok, "instance_id": 2})
        assert status == 409 and "maxRegistrations" in out["error"]
        refused = stack.replica.metrics.registrations_refused
        assert sum(c._value.get() for c in refused._metrics.values()) == len(REFUSED) + 5
        assert [w["instance_id"] for w in await _workers(stack.session)] == [1]
    finally:
        await stack.stop()


async def test_without_a_token_registration_is_off(nats_url, stream_prefix):
    stack = await L1Stack(make_config(nats_url, stream_prefix)).start()
    try:
        status, out = await _post(stack.session, "/register", {"instance_id": 1}, headers=AUTH)
        assert status == 403 and "registrationToken" in out["error"]
    finally:
        await stack.stop()


@pytest.mark.parametrize("path", ["/register", "/unregister"])
async def test_writes_need_the_token_before_the_body_is_sent(nats_url, stream_prefix, path):
    """``Expect: 100-continue`` (curl's way past 1 KiB), on a raw socket: a caller without the token is
    refused before its body leaves it, and the connection ends; with the token it may send."""
    stack = await L1Stack(config(nats_url, stream_prefix)).start()
    port = stack.replica.http.port
    try:
        await _registrations_ready(stack.replica)
        for auth, length in ((b"", b"10000000"), (b"Authorization: Bearer " + TOKEN.encode() + b"\r\n", b"2")):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                writer.write(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: " + length + b"\r\nExpect: 100-continue\r\n" + auth + b"\r\n")
                await writer.drain()
                head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).lower()
                if not auth:
                    assert head.startswith(b"http/1.1 401"), head
                    assert b"connection: close" in head and b"www-authenticate: bearer" in head
                    continue
                assert head.startswith(b"http/1.1 100"), head
                writer.write(b"{}")  # sent, read, and found short of the fields
                assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).startswith(b"HTTP/1.1 422")
            finally:
                writer.close()
    finally:
        await stack.stop()


@pytest.mark.parametrize("value", [b"", b"{", b"[]", b'{"instance_id": "a"}', b'{"instance_id": "a", "dp_rank": "0", '
                                   b'"endpoint": "tcp://h:1", "replay_endpoint": null, "model_name": "m", '
                                   b'"routing_group": "g", "block_size": 4}',
                                   b'{"instance_id": "a", "dp_rank": 0, "endpoint": "tcp://h:1", "replay_endpoint": null, '
                                   b'"model_name": "m", "routing_group": "g", "block_size": true}'])
def test_a_value_that_is_not_a_registration_is_refused_when_read(value):
    """What the bucket holds is outside input too (written by hand, by a newer version): refused with a
    ValueError, which the follower counts and logs, and the others stay."""
    from cache_indexer.infra.registrations import Registration

    with pytest.raises(ValueError, match="registration|instance_id|endpoint"):
        Registration.decode(value)


async def test_the_follower_skips_a_bad_value_and_keeps_the_good_ones(nats_url, stream_prefix):
    import nats

    from cache_indexer.infra.registrations import Registration, RegistrationStore
    from cache_indexer.infra.streams import kv_bucket

    nc = await nats.connect(nats_url)
    errors = []
    store = RegistrationStore(nc.jetstream(), f"{stream_prefix}-meta", on_error=lambda: errors.append(1), nc=nc)
    try:
        good = Registration("a", 0, "tcp://127.0.0.1:5", None, "m", "default", 4)
        assert await store.create(good)
        kv = await kv_bucket(nc.jetstream(), f"{stream_prefix}-meta")
        await kv.put("registration.b.0", b'{"instance_id": "b", "dp_rank": "x"}')
        seen = []

        async def on_change(regs):
            seen.append(regs)
        store.follow(on_change)
        await wait_for(lambda: seen, 10, "the registrations read")
        assert seen[-1] == [good] and errors == [1]
        await store.delete("a")
        await wait_for(lambda: seen[-1] == [], 10, "the deletion followed")
    finally:
        await store.stop()
        await nc.close()
