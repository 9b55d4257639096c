"""L3 end to end against a real Mooncake Master; run by tests/test_mooncake.py inside `unshare -n`
(a network namespace with only loopback, because the store clients' transfer engines listen on all
interfaces). Prints SCENARIO OK and exits 0 when every check passed."""

from __future__ import annotations

import asyncio
import json
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp

from cache_indexer.bridge.service import Bridge
from cache_indexer.infra.config_loader import load_config
from cache_indexer.nats_server import NatsServer
from cache_indexer.replica import Replica
from cache_indexer.schemas.block_hash import BlockHasher

BS = 16
TOKENS = list(range(3000, 3000 + 8 * BS))
DIGESTS = BlockHasher("sha256_cbor", "0").block_hashes(TOKENS, BS)
POD_A, POD_B, POD_C, POD_D = "127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"
TOKENS2 = list(range(9000, 9000 + 8 * BS))
DIGESTS2 = BlockHasher("sha256_cbor", "0").block_hashes(TOKENS2, BS)
HTTP_PORT = 9003
RELOCATE_EVERY = 2.0


def ascend_key(d: bytes, tp: int = 0) -> str:
    return f"Qwen2.5-7B-Instruct@pcp0@dcp0@head_or_tp_rank:{tp}@pp_rank:0@group:0@cache_role:kv@cache_family:default@{d.hex()}"


def vllm_key(d: bytes) -> str:
    return f"Qwen2.5-7B-Instruct@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{d.hex()}"


def start_master() -> subprocess.Popen:
    import mooncake

    binary = Path(mooncake.__file__).parent / "mooncake_master"
    proc = subprocess.Popen([str(binary), "--rpc_address=127.0.0.1", "--rpc_port=50051", "--metrics_host=127.0.0.1",
                             f"--metrics_port={HTTP_PORT}", "--default_kv_lease_ttl=500", "--client_ttl=3"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{HTTP_PORT}/health", timeout=1) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("mooncake_master did not start")


def segment_of(host: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{HTTP_PORT}/get_all_segments", timeout=2) as r:
        return next(s for s in r.read().decode().split() if s.startswith(host + ":"))


class Client:
    def __init__(self, host: str) -> None:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        self.store = MooncakeDistributedStore()
        rc = self.store.setup(host, "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", "127.0.0.1:50051")
        assert rc == 0, f"setup {host}: {rc}"
        self.cfg = ReplicateConfig()
        self.cfg.preferred_segment = segment_of(host)
        self.two = ReplicateConfig()
        self.two.replica_num = 2

    def put(self, key: str, replicas: int = 1) -> None:
        assert self.store.put(key, b"\0" * 64, self.cfg if replicas == 1 else self.two) == 0, key

    def remove(self, key: str) -> None:
        deadline = time.monotonic() + 10
        while self.store.remove(key) != 0:  # a read lease may still be held
            assert time.monotonic() < deadline, f"cannot remove {key}"
            time.sleep(0.1)


def holders(key: str) -> set[str]:
    from urllib.parse import quote

    with urllib.request.urlopen(f"http://127.0.0.1:{HTTP_PORT}/batch_query_keys?keys={quote(key, safe='')}", timeout=2) as r:
        item = json.loads(r.read())["data"][key]
    return {v["transport_endpoint_"].split(":")[0] for v in item.get("values") or []}


async def ratio(session, pod: str, tokens: list[int] = TOKENS) -> float:
    body = {"server_ip": [pod], "body": {"token_ids": tokens, "block_size": BS}}
    async with session.post("/kv-cache/hit-rate", data=json.dumps(body)) as r:
        return (await r.json())["server_score_list"][0]["l3_hit_ratio"]


async def until(session, pod: str, expected: float, what: str, tokens: list[int] = TOKENS, within: float = 20) -> None:
    deadline = time.monotonic() + within
    while (got := await ratio(session, pod, tokens)) != expected:
        assert time.monotonic() < deadline, f"{what}: l3 ratio of {pod} is {got}, expected {expected}"
        await asyncio.sleep(0.05)
    print(f"ok: {what}", flush=True)


async def main() -> None:
    nats = NatsServer().start()
    master = start_master()
    tmp = Path(tempfile.mkdtemp())
    (tmp / "targets.yaml").write_text(f"mooncakeMasters:\n  - host: 127.0.0.1\n    httpPort: {HTTP_PORT}\n    name: mc0\n")
    cfg = load_config(env={}, overrides=[
        f"nats.url={nats.url}", f"discovery.static.file={tmp / 'targets.yaml'}", "ingest.leaderElection=false",
        "ingest.l3.pollInterval=0.2", f"ingest.l3.relocateEvery={RELOCATE_EVERY}", "blockKey.pythonHashSeed=0", "http.host=127.0.0.1", "http.port=0"])
    bridge, replica = Bridge(cfg), Replica(cfg)
    await bridge.start()
    await replica.start()
    a = await asyncio.to_thread(Client, POD_A)
    b = await asyncio.to_thread(Client, POD_B)
    try:
        async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{replica.http.port}") as s:
            for d in DIGESTS[:4]:
                await asyncio.to_thread(a.put, ascend_key(d))
                await asyncio.to_thread(a.put, ascend_key(d, tp=1))
            for d in DIGESTS:
                await asyncio.to_thread(b.put, vllm_key(d))
            await asyncio.to_thread(a.put, "unrelated/key")
            await until(s, POD_A, 0.5, "keys appear -> ratio rises (ascend grammar, two TP ranks)")
            await until(s, POD_B, 1.0, "keys appear -> ratio rises (vLLM store grammar)")
            await asyncio.to_thread(a.remove, ascend_key(DIGESTS[1]))
            await until(s, POD_A, 0.5, "one TP rank removed -> the block still held")
            await asyncio.to_thread(a.remove, ascend_key(DIGESTS[1], tp=1))
            await until(s, POD_A, 1 / 8, "all ranks of block 1 removed -> ratio falls to the prefix before it")
            await asyncio.to_thread(b.store.close)
            await until(s, POD_B, 0.0, "pod's client closed (segment unmapped) -> its entries drop")
            assert bridge.metrics.l3_unparsed_keys._value.get() == 1
            await moved_key(s, bridge, a)
            await dead_holders_ip(s)
            master.kill()
            master.wait(10)
            master = await asyncio.to_thread(start_master)
            await until(s, POD_A, 0.0, "master restarted empty -> L3 entries drop")
            print("SCENARIO OK", flush=True)
    finally:
        await replica.stop()
        await bridge.stop()
        master.kill()
        nats.close()


async def moved_key(s, bridge, a: Client) -> None:
    """Issue 13 #1: block 0 removed from pod A and put again on pod C right after a poll: the key is
    listed at both polls, so only locating it again (relocateEvery) moves it."""
    c = await asyncio.to_thread(Client, POD_C)
    poller = next(iter(bridge.pollers.values()))
    polls = poller.polls
    while poller.polls == polls:  # just after a poll: the move falls between two polls
        await asyncio.sleep(0.005)
    for tp in (0, 1):
        await asyncio.to_thread(a.remove, ascend_key(DIGESTS[0], tp))
        await asyncio.to_thread(c.put, ascend_key(DIGESTS[0], tp))
    assert holders(ascend_key(DIGESTS[0])) == {POD_C}
    bound = RELOCATE_EVERY + 2 * 0.2 + 1.0  # a round of the rolling re-check, a poll, the way to the index
    await until(s, POD_C, 1 / 8, "a key removed and put again on another pod between two polls -> re-attributed",
                within=bound)
    await until(s, POD_A, 0.0, "... and no longer attributed to the old pod", within=bound)


async def dead_holders_ip(s) -> None:
    """Issue 13 #1: a 2-replica key whose holder died keeps its other replica; a new client that mounts
    with the dead holder's IP must not be credited with it."""
    d = await asyncio.to_thread(Client, POD_D)
    k = vllm_key(DIGESTS2[0])
    await asyncio.to_thread(d.put, k, 2)
    first = holders(k)
    assert POD_D in first and len(first) == 2, first
    await until(s, POD_D, 1 / 8, "a 2-replica key held by pod D", TOKENS2)
    await asyncio.to_thread(d.store.close)
    await until(s, POD_D, 0.0, "pod D's client closed", TOKENS2)
    left = holders(k) if k in await asyncio.to_thread(all_keys) else set()
    print(f"after pod D closed, the key is held by {sorted(left) or 'nobody'}", flush=True)
    d2 = await asyncio.to_thread(Client, POD_D)  # a new client with the dead holder's IP
    for other in left:
        await until(s, other, 1 / 8, "the surviving replica still counts", TOKENS2)
    await until(s, POD_D, 0.0, "the new client on D's IP holds none of it", TOKENS2)
    polls_seen = time.monotonic() + 1.0
    while time.monotonic() < polls_seen:  # a few polls later it still holds none of it
        assert await ratio(s, POD_D, TOKENS2) == 0.0, "the new client on D's IP was credited with the old replica"
        await asyncio.sleep(0.05)
    await asyncio.to_thread(d2.store.close)


def all_keys() -> set[str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{HTTP_PORT}/get_all_keys", timeout=2) as r:
        return set(r.read().decode().split())


if __name__ == "__main__":
    asyncio.run(main())
