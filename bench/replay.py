"""Rebuilding an indexer replica from JetStream.

- replay only: a stream holding 1M block events (31,250 batch messages of 32 hashes, as the bridge
  writes them) replayed by a fresh replica until ready; baseline in the same run: applying the same
  decoded messages in-process (no NATS).
- snapshot + tail: a snapshot of 2M (block, worker) entries in the object store plus a 10k-message
  tail; the replica's start until ready, and the snapshot decode alone.
"""

from __future__ import annotations

import asyncio
import random
import time

import msgpack

from cache_indexer.infra.config_loader import load_config
from cache_indexer.nats_server import NatsServer
from cache_indexer.infra.streams import connect, ensure_l1_stream, l1_subject
from cache_indexer.indexer.l1_state import L1State
from cache_indexer.indexer.service import Indexer
from cache_indexer.indexer.snapshot import SnapshotStore, decode_l1, encode_l1


def _messages(n_msgs: int, per_msg: int, pods: int = 16, seed: int = 1) -> list[tuple[str, bytes]]:
    rng = random.Random(seed)
    out = []
    seqs = [0] * pods
    for _ in range(n_msgs):
        p = rng.randrange(pods)
        pod = f"10.0.{p // 250}.{p % 250}"
        msg = {"v": 1, "type": "batch", "pod": pod, "rank": 0, "gen": 1, "seq": seqs[p], "ts": 0.0,
               "events": [{"kind": "stored", "medium": "GPU", "hashes": [rng.getrandbits(64) for _ in range(per_msg)]}]}
        seqs[p] += 1
        out.append((l1_subject("kvcache.l1", pod, 0), msgpack.packb(msg)))
    return out


async def _fill(cfg, msgs) -> None:
    nc = await connect(cfg.nats, name="bench-fill")
    js = nc.jetstream(publish_async_max_pending=8000)
    await ensure_l1_stream(js, cfg.nats)
    for subject, data in msgs:
        await js.publish_async(subject, data)
    await js.publish_async_completed()
    await nc.close()


async def _until_ready(cfg) -> tuple[float, Indexer]:
    t = time.perf_counter()
    idx = Indexer(cfg)
    await idx.start()
    await asyncio.wait_for(idx.ready.wait(), 600)
    return time.perf_counter() - t, idx


async def _run(quick: bool) -> dict:
    n_msgs, per = (3125, 32) if quick else (31250, 32)
    server = NatsServer().start()
    try:
        cfg = load_config(env={}, overrides=[f"nats.url={server.url}", "snapshot.enabled=false"])
        msgs = _messages(n_msgs, per)
        await _fill(cfg, msgs)
        secs, idx = await _until_ready(cfg)
        events = idx.l1.stats.block_events
        await idx.stop()
        state = L1State()
        decoded = [msgpack.unpackb(d) for _, d in msgs]
        t = time.perf_counter()
        for m in decoded:
            state.apply(m)
        base = time.perf_counter() - t
        replay = {"block_events": events, "messages": n_msgs, "seconds": secs, "rate": events / secs,
                  "baseline_rate": events / base}

        # snapshot + tail
        entries = 200_000 if quick else 2_000_000
        big = L1State()
        rng = random.Random(2)
        for w in range(16):
            big.apply({"type": "batch", "pod": f"10.1.0.{w}", "rank": 0, "gen": 1, "seq": 0, "events": [
                {"kind": "stored", "medium": "GPU", "hashes": [rng.getrandbits(64) for _ in range(entries // 16)]}]})
        cfg2 = load_config(env={}, overrides=[f"nats.url={server.url}", "nats.l1Stream.name=KV_L1B",
                                              "nats.l1Stream.subjectPrefix=kvcache.l1b", "snapshot.purge=false",
                                              "snapshot.bucket=bench-snap", "snapshot.metaBucket=bench-meta"])
        tail = _messages(10_000 if not quick else 1000, 32, seed=3)
        tail = [(s.replace("kvcache.l1", "kvcache.l1b", 1), d) for s, d in tail]
        nc = await connect(cfg2.nats, name="bench-snap")
        js = nc.jetstream()
        await ensure_l1_stream(js, cfg2.nats)
        blob = encode_l1(big, 0)
        t = time.perf_counter()
        decode_l1(blob)
        decode_secs = time.perf_counter() - t
        await SnapshotStore(js, "bench-snap", "bench-meta").save(blob, 1)  # covers nothing of the stream: all is tail
        await nc.close()
        await _fill(cfg2, tail)
        secs2, idx2 = await _until_ready(cfg2)
        snap = {"entries": big.index.entries(), "snapshot_mb": len(blob) / 1e6, "decode_seconds": decode_secs,
                "tail_messages": len(tail), "start_to_ready": secs2, "loaded_entries": idx2.l1.index.entries()}
        await idx2.stop()
        return {"replay": replay, "snapshot": snap}
    finally:
        server.close()


def run(quick: bool = False) -> dict:
    return asyncio.run(_run(quick))


def table(res: dict) -> str:
    r, s = res["replay"], res["snapshot"]
    return "\n".join([
        "| rebuild | size | time | rate | baseline (apply in-process, no NATS) |", "|---|---|---|---|---|",
        f"| replay only | {r['block_events']:,} block events in {r['messages']:,} messages | {r['seconds']:.2f} s "
        f"| **{r['rate']:,.0f} block-events/s** | {r['baseline_rate']:,.0f} block-events/s |",
        f"| snapshot + tail | {s['entries']:,} entries ({s['snapshot_mb']:.0f} MB) + {s['tail_messages']:,} messages "
        f"| **{s['start_to_ready']:.2f} s** to ready | snapshot decode alone {s['decode_seconds']:.2f} s | - |",
    ])


if __name__ == "__main__":
    import sys

    print(table(run(quick="--quick" in sys.argv)))
