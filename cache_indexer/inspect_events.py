"""``cache-indexer events view|tail``: stream messages as JSON lines (docs/events.md).

One line per message (sequence, subject, headers, payload), since the nats CLI is not always at hand;
the payload as ``events decode`` prints it (cache_indexer/decode_event.py). L1 block hashes are printed
as integers and as 16-digit hex.

Where the NATS server is: the configuration (``--config``, ``$CACHE_INDEXER_CONFIG``, which the chart
sets in its pods, environment, ``--set``); without a configured ``nats.url``, the record a running
``cache-indexer local`` leaves (cache_indexer.runtime_file). It gives up with one line after
``nats.connectTimeout`` when nothing answers.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import nats
from nats.js import api
from nats.js.errors import APIError, NotFoundError

from cache_indexer import runtime_file
from cache_indexer.decode_event import readable
from cache_indexer.infra.event_codec import MalformedEvent, decode
from cache_indexer.infra.nats_auth import connect_options
from cache_indexer.infra.streams import servers
from cache_indexer.schemas.config import Config, NatsConfig
from cache_indexer.infra.log_format import describe

#: ``view`` stops with an error when the stream goes quiet this long before it has shown what it found
#: (the messages it counted were purged meanwhile).
VIEW_IDLE = 5.0


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
        payload = readable(decode(data))
    except MalformedEvent:
        payload = {"undecodable": data[:64].hex()}
    return json.dumps({"seq": seq, "subject": subject, "headers": headers or {}, "data": payload}, default=str)


async def _pending_from(js, stream: str, filt: str, seq: int) -> int:
    """How many messages of ``filt`` the stream holds from ``seq`` on: what a consumer starting there
    would have pending (the server counts them; nothing is delivered)."""
    info = await js.add_consumer(stream, config=api.ConsumerConfig(
        filter_subject=filt, deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=seq,
        ack_policy=api.AckPolicy.NONE, inactive_threshold=10.0, mem_storage=True))
    try:
        await js.delete_consumer(stream, info.name)
    except Exception:  # inactive_threshold removes it anyway
        pass
    return info.num_pending


async def start_of_last(js, stream: str, filt: str, first: int, end: int, last: int) -> tuple[int, int]:
    """(the stream sequence to start at so that the last ``last`` messages of ``filt`` come out, how many
    messages of ``filt`` there are). A binary search over the pending counts of probe consumers: about
    log2(stream length) of them, never a read of the messages themselves."""
    total = await _pending_from(js, stream, filt, first)
    if not last or total <= last:
        return first, total
    lo, hi = first, end  # pending(lo) >= last; the largest such start is wanted
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if await _pending_from(js, stream, filt, mid) >= last:
            lo = mid
        else:
            hi = mid - 1
    return lo, total


async def inspect(cfg: Config, mode: str, subject: str | None, last: int, out=sys.stdout, tier: str = "l1",
                  err=sys.stderr) -> int:
    ncfg, source = resolve_nats(cfg)
    try:
        nc = await connect_once(ncfg, "cache-indexer-inspect")
    except (OSError, asyncio.TimeoutError, nats.errors.Error) as exc:
        hint = (" (is `cache-indexer local` running? In a pod: --config /etc/cache-indexer/config.yaml, or "
                "CACHE_INDEXER_CONFIG)") if source == "default" else ""
        print(f"cache-indexer: no NATS server answered at {ncfg.url} within {ncfg.connectTimeout:g}s{hint}: "
              f"{describe(exc)}", file=err)
        return 1
    try:
        return await _inspect(nc, ncfg, mode, subject, last, out, tier, err)
    finally:
        await nc.close()


async def _inspect(nc, ncfg: NatsConfig, mode: str, subject: str | None, last: int, out, tier: str, err) -> int:
    js = nc.jetstream()
    scfg = ncfg.l1Stream if tier == "l1" else ncfg.l3Stream
    stream = scfg.name
    filt = subject or f"{scfg.subjectPrefix}.>"
    try:
        info = await js.stream_info(stream)
    except NotFoundError:
        print(f"cache-indexer: stream {stream} does not exist at {ncfg.url}: no bridge or indexer has started "
              "against this server yet", file=err)
        return 1
    end, first = info.state.last_seq, info.state.first_seq
    if mode == "view" and info.state.messages == 0:
        what = "vLLM engine" if tier == "l1" else "Mooncake master"
        print(f"stream {stream} at {ncfg.url} holds no messages yet: no {what} has published "
              "(try `cache-indexer simulate`, or `events tail` to wait for the first)", file=err)
        return 0
    shape = (f"{scfg.subjectPrefix}.<pod IP, . and : as _>.<rank or lifecycle>" if tier == "l1"
             else f"{scfg.subjectPrefix}.<master, . and : as _>")
    if subject:
        try:
            start, matching = await start_of_last(js, stream, filt, first, end, last)
        except APIError as exc:
            print(f"cache-indexer: subject {subject!r} cannot be read from stream {stream}: "
                  f"{exc.description or exc}; its subjects are {shape}", file=err)
            return 1
        if matching == 0 and mode == "view":
            print(f"cache-indexer: no message in stream {stream} ({info.state.messages} messages) matches subject "
                  f"{subject!r}; its subjects are {shape} (docs/events.md)", file=err)
            return 1
        want = min(last, matching) if last else matching
    else:
        start = max(first, end - last + 1) if last else first
        want = end - start + 1 if info.state.messages else 0
    cfg_c = api.ConsumerConfig(deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start)
    if mode == "tail" and not last:
        cfg_c = api.ConsumerConfig(deliver_policy=api.DeliverPolicy.NEW)
    done = asyncio.Event()
    shown = 0
    heard = time.monotonic()

    async def on_msg(msg) -> None:
        nonlocal shown, heard
        heard = time.monotonic()
        if done.is_set():
            return
        meta = msg.metadata
        print(render(meta.sequence.stream, msg.subject, msg.headers, msg.data), file=out, flush=True)
        shown += 1
        if mode == "view" and (shown >= want or meta.num_pending == 0 or meta.sequence.stream >= end):
            done.set()

    await js.subscribe(filt, stream=stream, ordered_consumer=True, cb=on_msg, config=cfg_c)
    if mode == "tail":
        await asyncio.Event().wait()
    while not done.is_set():  # view: until all it counted is shown, or the stream goes quiet
        try:
            await asyncio.wait_for(done.wait(), max(0.1, heard + VIEW_IDLE - time.monotonic()))
        except asyncio.TimeoutError:
            if time.monotonic() - heard >= VIEW_IDLE:
                print(f"cache-indexer: stream {stream} sent {shown} of the {want} messages counted, then nothing "
                      f"for {VIEW_IDLE:g}s (purged meanwhile?)", file=err)
                return 1
    return 0
