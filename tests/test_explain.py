"""``explain: true``: per candidate, why its ratio is what it is, through a real bridge, NATS and replica:
an unknown pod, a pod that published nothing since it was subscribed, an engine hashing differently
from blockKey, a prefix that stops at block k, a whole prefix."""

from __future__ import annotations

import json

from cache_indexer.simulate.vllm_engine import stored
from cache_indexer.schemas.block_hash import BlockHasher
from tests.conftest import make_config, wait_for
from tests.l1_stack import L1Stack

B = 4
PROMPT = list(range(1000, 1000 + 4 * B))
OURS = BlockHasher("sha256_cbor", "0")
OTHER = BlockHasher("sha256", "0")  # an engine started with --prefix-caching-hash-algo sha256


async def _explained(stack: L1Stack, pods: list[str], tokens=PROMPT, **body) -> list[dict]:
    request = {"server_ip": pods, "body": {"token_ids": tokens, "block_size": B, **body}, "explain": True}
    async with stack.session.post("/kv-cache/hit-rate", data=json.dumps(request)) as r:
        out = await r.json()
        assert r.status == 200, out
    return out["server_score_list"]


async def test_explain_names_the_cause_of_each_ratio(nats_url, stream_prefix):
    stack = await L1Stack(make_config(nats_url, stream_prefix, blockKey={"pythonHashSeed": "0"})).start()
    try:
        pods = ["127.0.1.1", "127.0.1.2", "127.0.1.3", "127.0.1.4", "127.0.1.5"]
        # the fourth without a replay socket (vLLM's default): nothing tells the bridge it publishes events;
        # the fifth with one, idle: its empty buffer's answer starts its generation (reason "idle")
        engines = [stack.engine(pod, **({"replay_port": None} if i == 3 else {})) for i, pod in enumerate(pods)]
        await stack.connect(*[(e, pod, 0) for e, pod in zip(engines, pods)])
        hashes = OURS.event_hashes(PROMPT, B)
        await engines[0].publish([stored(hashes[:2], block_size=B, token_ids=PROMPT[:2 * B])])
        await engines[1].publish([stored(hashes, block_size=B, token_ids=PROMPT)])
        await engines[2].publish([stored(OTHER.event_hashes(PROMPT, B), block_size=B, token_ids=PROMPT)])
        # engines[3] and [4] publish nothing
        asked = pods + ["10.9.9.9"]

        async def settled() -> bool:
            got = await _explained(stack, asked)
            return got[0]["explain"]["known"] and got[2]["explain"]["block_key_ok"] is False \
                and got[3]["explain"]["subscribed"] and got[4]["explain"]["known"]
        await wait_for(settled, 20, "the events applied, the verdict and the bridge's record written")
        stops, whole, other, silent, idle, unknown = (item["explain"] for item in await _explained(stack, asked))
        assert stops["cause"].startswith("prefix stops at block 2") and stops["first_missing_block"] == 2
        assert stops["l1_blocks"] == 2 and stops["ranks"] == [0] and stops["last_event_s_ago"] >= 0
        assert whole["cause"] == "the whole prefix is cached" and whole["first_missing_block"] is None
        assert other["cause"].startswith("blockKey mismatch") and "hashAlgo=sha256," in other["cause"]
        assert {"hashAlgo": "sha256", "pythonHashSeed": "0", "extraKeysEncoding": "tagged"} in \
            other["first_block_matches_under"]
        assert silent["cause"].startswith("no events from 127.0.1.4") and silent["subscribed"] is True
        assert idle["cause"].startswith("prefix stops at block 0") and idle["l1_blocks"] == 0
        assert unknown["cause"].startswith("unknown pod") and unknown["subscribed"] is False
        plain = await stack.session.post("/kv-cache/hit-rate", data=json.dumps(
            {"server_ip": pods, "body": {"token_ids": PROMPT, "block_size": B}}))
        assert all("explain" not in item for item in (await plain.json())["server_score_list"]), \
            "without explain: the documented shape"
        # a review: the first block was hashed under every other setting once per candidate, so one pod
        # named many times with a long first block held the event loop for seconds: now once per request
        hashed = []
        plain_hashes = BlockHasher.event_hashes

        def counted(self, *args, **kw):
            hashed.append(self.algo)
            return plain_hashes(self, *args, **kw)
        setattr(BlockHasher, "event_hashes", counted)
        try:
            got = await _explained(stack, [pods[2]] * 64)
        finally:
            setattr(BlockHasher, "event_hashes", plain_hashes)
        assert all(item["explain"]["cause"].startswith("blockKey mismatch") for item in got)
        assert 0 < len(hashed) <= 2 * 12, f"{len(hashed)} first-block hashes for one request"
    finally:
        await stack.stop()
