"""``cache-indexer events view|tail [--tier l1|l3]``: prints stream messages as JSON lines, since the
nats CLI is not always at hand. L1 block hashes are printed as integers and as 16-digit hex."""

from __future__ import annotations

import asyncio
import json
import sys

import msgpack
from nats.js import api

from cache_indexer.streams import connect
from schemas.config import Config


def render(seq: int, subject: str, headers: dict | None, data: bytes) -> str:
    try:
        payload = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception:
        payload = {"undecodable": data[:64].hex()}
    for ev in payload.get("events", []) if isinstance(payload, dict) else []:
        if "hashes" in ev:
            ev["hashes_hex"] = [f"{h:016x}" for h in ev["hashes"]]

    return json.dumps({"seq": seq, "subject": subject, "headers": headers or {}, "data": payload}, default=str)


async def run(cfg: Config, mode: str, subject: str | None, last: int, out=sys.stdout, tier: str = "l1") -> int:
    nc = await connect(cfg.nats, name="cache-indexer-inspect")
    js = nc.jetstream()
    scfg = cfg.nats.l1Stream if tier == "l1" else cfg.nats.l3Stream
    stream = scfg.name
    filt = subject or f"{scfg.subjectPrefix}.>"
    info = await js.stream_info(stream)
    done = asyncio.Event()
    end = info.state.last_seq

    async def on_msg(msg) -> None:
        seq = msg.metadata.sequence.stream
        print(render(seq, msg.subject, msg.headers, msg.data), file=out, flush=True)
        if mode == "view" and (msg.metadata.num_pending == 0 or seq >= end):
            done.set()

    if mode == "view" and (info.state.messages == 0):
        await nc.close()
        return 0
    start = max(info.state.first_seq, end - last + 1) if last else info.state.first_seq
    cfg_c = api.ConsumerConfig(deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start)
    if mode == "tail" and not last:
        cfg_c = api.ConsumerConfig(deliver_policy=api.DeliverPolicy.NEW)
    await js.subscribe(filt, stream=stream, ordered_consumer=True, cb=on_msg, config=cfg_c)
    try:
        if mode == "view":
            await asyncio.wait_for(done.wait(), 30)
        else:
            await asyncio.Event().wait()
    except asyncio.TimeoutError:
        pass
    finally:
        await nc.close()
    return 0
