"""``cache-indexer events view|tail [--tier l1|l3]``: prints stream messages as JSON lines, since the
nats CLI is not always at hand. L1 block hashes are printed as integers and as 16-digit hex.

Without a configured ``nats.url`` it reads the record a running ``cache-indexer local`` leaves
(cache_indexer.runtime_file), so the documented commands work against local mode as they are. It
gives up with one line after ``nats.connectTimeout`` when nothing answers.
"""

from __future__ import annotations

import asyncio
import json
import sys

import msgpack
import nats
from nats.js import api
from nats.js.errors import NotFoundError

from cache_indexer import runtime_file
from infra.nats_auth import connect_options
from infra.streams import servers
from schemas.config import Config, NatsConfig


def resolve_nats(cfg: Config) -> tuple[NatsConfig, str]:
    """The NATS settings to use, and where they came from: configured, or a running local instance's."""
    if "url" in cfg.nats.model_fields_set:
        return cfg.nats, "configured"
    record = runtime_file.read_local()
    if record is None:
        return cfg.nats, "default"
    local = Config.model_validate(record.get("config") or {}).nats if record.get("config") else cfg.nats
    return local.model_copy(update={"url": record["nats_url"], "connectTimeout": cfg.nats.connectTimeout}), \
        f"the local instance (pid {record['pid']})"


async def connect_once(cfg: NatsConfig, name: str) -> nats.NATS:
    """One bounded attempt: no reconnect loop and no warnings (a CLI reports failure itself)."""

    async def _quiet(exc: Exception) -> None:
        pass

    return await asyncio.wait_for(
        nats.connect(servers(cfg.url), name=name, connect_timeout=cfg.connectTimeout, allow_reconnect=False,
                     max_reconnect_attempts=1, reconnect_time_wait=0.1, error_cb=_quiet, **connect_options(cfg)),
        cfg.connectTimeout + 1)


def render(seq: int, subject: str, headers: dict | None, data: bytes) -> str:
    try:
        payload = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception:
        payload = {"undecodable": data[:64].hex()}
    for ev in payload.get("events", []) if isinstance(payload, dict) else []:
        if "hashes" in ev:
            ev["hashes_hex"] = [f"{h:016x}" for h in ev["hashes"]]

    return json.dumps({"seq": seq, "subject": subject, "headers": headers or {}, "data": payload}, default=str)


async def inspect(cfg: Config, mode: str, subject: str | None, last: int, out=sys.stdout, tier: str = "l1",
              err=sys.stderr) -> int:
    ncfg, source = resolve_nats(cfg)
    try:
        nc = await connect_once(ncfg, "cache-indexer-inspect")
    except (OSError, asyncio.TimeoutError, nats.errors.Error) as exc:
        hint = " (is `cache-indexer local` running?)" if source == "default" else ""
        print(f"cache-indexer: no NATS server answered at {ncfg.url} within {ncfg.connectTimeout:g}s{hint}: "
              f"{exc or type(exc).__name__}", file=err)
        return 1
    js = nc.jetstream()
    scfg = ncfg.l1Stream if tier == "l1" else ncfg.l3Stream
    stream = scfg.name
    filt = subject or f"{scfg.subjectPrefix}.>"
    try:
        info = await js.stream_info(stream)
    except NotFoundError:
        await nc.close()
        print(f"cache-indexer: stream {stream} does not exist at {ncfg.url}: no bridge or indexer has started "
              "against this server yet", file=err)
        return 1
    done = asyncio.Event()
    end = info.state.last_seq

    async def on_msg(msg) -> None:
        seq = msg.metadata.sequence.stream
        print(render(seq, msg.subject, msg.headers, msg.data), file=out, flush=True)
        if mode == "view" and (msg.metadata.num_pending == 0 or seq >= end):
            done.set()

    if mode == "view" and (info.state.messages == 0):
        await nc.close()
        what = "vLLM engine" if tier == "l1" else "Mooncake master"
        print(f"stream {stream} at {ncfg.url} holds no messages yet: no {what} has published "
              "(try `cache-indexer simulate`, or `events tail` to wait for the first)", file=err)
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
