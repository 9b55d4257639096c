"""JetStream names and stream set-up shared by the bridge, the indexer and the inspect command.

Subjects (prefix ``nats.l1Stream.subjectPrefix``, default ``kvcache.l1``): ``kvcache.l1.<pod>.<rank>``
carries one (pod, rank)'s batches and resets; pod lifecycle messages go to ``kvcache.l1.<pod>.lifecycle``. Tokens are sanitised (``.`` and other characters NATS
reserves become ``_``), so a pod IP 10.0.0.1 becomes ``10_0_0_1``; the exact IP is in the payload and
the ``Kv-Pod`` header.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time

import nats
from nats.js import api
from nats.js.errors import APIError, BadRequestError, BucketNotFoundError, NotFoundError, ServiceUnavailableError

from cache_indexer.infra.nats_auth import connect_options
from cache_indexer.infra.throttled_log import ThrottledWarning
from cache_indexer.schemas.config import Config, NatsConfig, StreamConfig
from cache_indexer.infra.log_format import describe

log = logging.getLogger(__name__)

_TOKEN_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


def subject_token(value: str) -> str:
    return _TOKEN_UNSAFE.sub("_", value) or "_"


def l1_subject(prefix: str, pod: str, rank: int) -> str:
    return f"{prefix}.{subject_token(pod)}.{rank}"


def l1_lifecycle_subject(prefix: str, pod: str) -> str:
    return f"{prefix}.{subject_token(pod)}.lifecycle"


def l1_pod_subjects(prefix: str, pod: str) -> str:
    """Every subject of the pod: its ranks' and its lifecycle's."""
    return f"{prefix}.{subject_token(pod)}.*"


def stream_config(cfg: StreamConfig, subjects: list[str]) -> api.StreamConfig:
    return api.StreamConfig(
        name=cfg.name,
        subjects=subjects,
        retention=api.RetentionPolicy.LIMITS,
        storage=api.StorageType.FILE if cfg.storage == "file" else api.StorageType.MEMORY,
        num_replicas=cfg.replicas,
        max_age=cfg.maxAge,
        max_bytes=cfg.maxBytes,
        max_msg_size=cfg.maxMsgSize,
        max_msgs_per_subject=-1,
        discard=api.DiscardPolicy.OLD,
        duplicate_window=cfg.duplicateWindow,
        allow_rollup_hdrs=True,
        deny_delete=True,
        deny_purge=False,
        allow_direct=True,
    )


#: What ensure_stream compares between the configured and the existing stream.
_COMPARED = ("subjects", "retention", "storage", "num_replicas", "max_age", "max_bytes", "max_msg_size",
             "max_msgs_per_subject", "discard", "duplicate_window", "allow_rollup_hdrs", "deny_delete", "deny_purge",
             "allow_direct")


def stream_differences(existing: api.StreamConfig, wanted: api.StreamConfig) -> list[str]:
    out = []
    for name in _COMPARED:
        have, want = getattr(existing, name), getattr(wanted, name)
        if name == "subjects":
            have, want = sorted(have or []), sorted(want or [])
        elif isinstance(want, float) or isinstance(have, float):
            have, want = round(have or 0, 3), round(want or 0, 3)
        if have != want:
            out.append(f"{name} {have} -> {want}")
    return out


async def ensure_stream(js, cfg: StreamConfig, subjects: list[str]) -> api.StreamInfo:
    """The stream as configured: looked up first, created when missing, updated only on a real difference,
    and named (``stream_id``) where it is not yet.

    A single nats-server checks its storage reservation before it notices that a stream exists, so an
    ``add_stream`` of an existing stream can fail with 10047 (insufficient storage) where the store holds
    it fine: every start after the first would then fail. An update the server refuses (a larger
    ``maxBytes`` than the store can reserve, say) is logged and the existing stream is used as it is."""
    return (await _ensure_stream(js, cfg, subjects))[0]


async def _ensure_stream(js, cfg: StreamConfig, subjects: list[str]) -> tuple[api.StreamInfo, bool]:
    """``ensure_stream``, and whether this call created the stream."""
    sc = stream_config(cfg, subjects)
    created = False
    try:
        info = await js.stream_info(cfg.name)
    except NotFoundError:
        try:
            # no generation begun before it began on it: one a bridge finds here began on a stream lost since
            sc.metadata = {LOST_BEFORE: str(time.time_ns())}
            info = await js.add_stream(sc)
            created = True
            await wait_for_leader(js, cfg.name)
        except BadRequestError as exc:
            if exc.err_code != 10058:  # created meanwhile by another process: compare below
                raise
            info = await js.stream_info(cfg.name)
    diff = stream_differences(info.config, sc)
    if diff:
        try:
            info = await js.stream_info(cfg.name)  # its name as of now (a bridge may have named it anew since)
            info = await js.update_stream(_named(sc, info))
            log.info("stream %s updated to the configured limits: %s", cfg.name, "; ".join(diff))
        except APIError as exc:
            log.error("stream %s differs from the configuration (%s) and the server refused the update: %s; "
                      "using the stream as it is", cfg.name, "; ".join(diff), exc.description or exc)
    if not (info.config.metadata or {}).get(INCARNATION):
        try:
            info = await js.stream_info(cfg.name)
            info = await js.update_stream(_named(info.config, info))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # refused, or no permission to update (a timeout): known by its creation time
            log.warning("stream %s: naming it in its metadata failed (%s); it is known by its creation time",
                        cfg.name, getattr(exc, "description", None) or describe(exc))
    return info, created


def _named(config: api.StreamConfig, info: api.StreamInfo, name: str = "",
           lost_before: int | None = None) -> api.StreamConfig:
    """``config`` with the stream's name in its metadata: ``name``, else the one it has, else its creation
    time (what it was known by; named in the run of nats-server that created it, that time is the one every
    version reads), and ``lost_before`` where given. The server's own keys (``_nats.*``) are left to it;
    the others it has are kept."""
    config = dataclasses.replace(config)
    config.metadata = {**{k: v for k, v in (info.config.metadata or {}).items() if not k.startswith("_nats.")},
                       INCARNATION: name or stream_id(info)}
    if lost_before is not None:
        config.metadata[LOST_BEFORE] = str(lost_before)
    return config


async def name_anew(js, info: api.StreamInfo, lost_before: int | None = None) -> api.StreamInfo:
    """The stream given a new name (``stream_id``): it lost its messages but kept its metadata, so that
    replicas, snapshots and resume records, which know a stream by that name, take it for the new stream it
    is. (A cluster that keeps a stream's assignment brings it back so when the node holding its only replica
    lost its storage: empty, its sequence from 1 again; a restored backup of it comes back with its old
    name too.) The new name is the old one and a "+": ordered after it as names are (``stream_id``; one
    created later, named by its creation time, after both), and the same whichever bridge names it, so two
    bridges finding one loss at once give one name. ``lost_before``: the generation the loss was found at
    (``LOST_BEFORE``), for the bridges started after it."""
    old = stream_id(info)
    info = await js.stream_info(info.config.name)  # read again: another bridge may have named it meanwhile
    if stream_id(info) != old:
        return info
    if lost_before is not None:
        lost_before = max(lost_before, generations_lost_before(info))
    return await js.update_stream(_named(info.config, info, old + "+", lost_before))


def stream_subjects(cfg: StreamConfig) -> list[str]:
    return [f"{cfg.subjectPrefix}.>"]


async def ensure_l1_stream(js, cfg: NatsConfig) -> api.StreamInfo:
    return await ensure_stream(js, cfg.l1Stream, stream_subjects(cfg.l1Stream))


async def ensure_again(js, cfg: NatsConfig, tier: str) -> tuple[api.StreamInfo, bool]:
    """A stream as it is now, created again when it is gone (deleted, its storage lost), logged at
    ERROR: (info, whether this call created it again). A NotFound that passes (the stream found on the
    second look, or created meanwhile by another process) is not a creation here: a bridge would start
    every engine over on it."""
    scfg = cfg.l1Stream if tier == "l1" else cfg.l3Stream
    try:
        return await js.stream_info(scfg.name), False
    except NotFoundError:
        pass
    info, created = await _ensure_stream(js, scfg, stream_subjects(scfg))
    if created:
        log.error("stream %s was gone (deleted, or its storage lost): created again; what it held is lost",
                  scfg.name)
    return info, created


#: The stream metadata key that names its incarnation (``stream_id``).
INCARNATION = "cache_indexer.incarnation"
#: The stream metadata key that holds the generation (L1's, wall-clock nanoseconds) at which the stream
#: was created (the creating process's clock), or found to have lost its messages and named anew (the
#: finding bridge's): a generation begun before it began on a stream whose messages are gone, and no
#: bridge resumes it (``L1Publisher.lost_before``), also one started after the bridge that found the
#: loss; a bridge begins its own after it.
LOST_BEFORE = "cache_indexer.lost_before"


def generations_lost_before(info: api.StreamInfo) -> int:
    """The stream's ``LOST_BEFORE`` (-1: none, as on a stream created before it was kept)."""
    value = (info.config.metadata or {}).get(LOST_BEFORE, "") if info.config is not None else ""
    return int(value) if value.isdigit() else -1


def stream_id(info: api.StreamInfo) -> str:
    """What tells one incarnation of a stream from another of the same name: its creation time as written
    into its metadata (``INCARNATION``, by ``ensure_stream``), else the server's creation time. Not the
    server's alone: nats-server 2.14 may change it across restarts after an update (nats-io/nats-server#8470),
    and every replica would take its stream for a new one, dropping its snapshots. Ordered by time, as the
    resume records' merge compares them; a stream named anew (``name_anew``) gets its old name and a "+",
    after it."""
    named = (info.config.metadata or {}).get(INCARNATION) if info.config is not None else None
    return named or (info.created.isoformat() if info.created else "")


def leader_answered(info: api.StreamInfo) -> bool:
    """Whether a stream's state comes from its leader (a single server's always does): a member's answer
    while its group elects a leader may lag, and a sequence judged from it may look gone back."""
    return info.cluster is None or bool(info.cluster.leader)


def l3_subject(prefix: str, master: str) -> str:
    return f"{prefix}.{subject_token(master)}"


async def ensure_l3_stream(js, cfg: NatsConfig) -> api.StreamInfo:
    return await ensure_stream(js, cfg.l3Stream, stream_subjects(cfg.l3Stream))


#: How long start-up waits out a JetStream that does not answer (a cluster electing leaders after the
#: loss of a node takes a few seconds; requests time out meanwhile).
SETUP_PATIENCE_SECONDS = 60.0


async def patiently(step, what: str, patience: float = SETUP_PATIENCE_SECONDS):
    """Run ``step()`` (idempotent) until it gets through JetStream's timeouts and "no responders"."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + patience
    while True:
        try:
            return await step()
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError, ServiceUnavailableError) as exc:
            if loop.time() > deadline:
                raise
            log.warning("%s: JetStream did not answer (%s); trying again", what, type(exc).__name__)
            await asyncio.sleep(1.0)


def servers(url: str) -> list[str]:
    """``nats.url`` as a list: one URL, or several separated by commas (every server of a cluster, so a
    process whose first server is down still connects)."""
    return [u.strip() for u in url.split(",") if u.strip()]


async def connect(cfg: NatsConfig, name: str, **callbacks) -> nats.NATS:
    """Connect with unlimited reconnects; callbacks (async) are passed through to nats-py."""
    warn = ThrottledWarning(log)

    async def _error_cb(exc: Exception) -> None:
        warn("nats: %s", describe(exc))

    opts = {"error_cb": _error_cb, **connect_options(cfg), **callbacks}
    return await nats.connect(
        servers(cfg.url), name=name, max_reconnect_attempts=-1, reconnect_time_wait=0.5,
        connect_timeout=cfg.connectTimeout, **opts,
    )


async def unsubscribe_quietly(sub) -> None:
    """Unsubscribe when stopping or switching: a subscription the connection already lost is no error."""
    if sub is None:
        return
    try:
        await sub.unsubscribe()
    except Exception as exc:
        log.debug("unsubscribe: %s", exc)


def records_bucket(cfg: Config) -> str:
    """The KV bucket of the deployment's small records, shared by both sides on purpose: the indexers'
    snapshot pointer, the bridge's targets record and resume points. Set by ``snapshot.metaBucket``, the
    name the values have always had (the chart's NATS permissions grant that bucket to both)."""
    return cfg.snapshot.metaBucket


async def kv_bucket(js, bucket: str, replicas: int = 1, **create):
    """The KV bucket, created with ``create`` (history, ttl, ...) and ``replicas`` where it does not exist
    yet; an existing one is brought to ``replicas`` (the lease and the records must survive a node as
    the streams do: an R1 lease bucket stopped all ingestion while its node was down)."""
    try:
        kv = await js.key_value(bucket)
    except (BucketNotFoundError, NotFoundError):
        kv = await js.create_key_value(bucket=bucket, replicas=replicas, **create)
        await wait_for_leader(js, f"KV_{bucket}")
        return kv
    await _ensure_replicas(js, f"KV_{bucket}", replicas)
    return kv


class RecordsKv:
    """The records bucket (``records_bucket``) as a KV handle, opened (created where missing) on first
    use; an open that fails is tried again at the next use. History 5: a record's last writes can be read
    back when something went wrong."""

    def __init__(self, js, bucket: str, replicas: int = 1) -> None:
        self.js = js
        self.bucket = bucket
        self.replicas = replicas
        self._kv = None

    async def __call__(self):
        if self._kv is None:
            self._kv = await kv_bucket(self.js, self.bucket, self.replicas, history=5)
        return self._kv


async def object_store(js, bucket: str, replicas: int = 1):
    """The object store, created (file storage, ``replicas``) where missing, brought to ``replicas``."""
    try:
        obs = await js.object_store(bucket)
    except (BucketNotFoundError, NotFoundError):
        obs = await js.create_object_store(bucket, storage=api.StorageType.FILE, replicas=replicas)
        await wait_for_leader(js, f"OBJ_{bucket}")
        return obs
    await _ensure_replicas(js, f"OBJ_{bucket}", replicas)
    return obs


async def wait_for_leader(js, stream: str, timeout: float = 15.0) -> None:
    """A stream just created in a cluster answers only once its replicas elected a leader: until then
    reads time out. Waits (bounded) for the leader; a single server has one at once."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            info = await js.stream_info(stream)
            if leader_answered(info):
                return
        except (NotFoundError, nats.errors.TimeoutError):
            pass
        if loop.time() > deadline:
            log.warning("stream %s has no leader after %.0fs; going on", stream, timeout)
            return
        await asyncio.sleep(0.1)


async def _ensure_replicas(js, stream: str, replicas: int) -> None:
    try:
        info = await js.stream_info(stream)
        if info.config.num_replicas != replicas:
            info.config.num_replicas = replicas
            await js.update_stream(info.config)
            log.info("%s now has %d replicas", stream, replicas)
    except APIError as exc:  # e.g. more replicas than servers: the asset works as it is
        log.error("%s: cannot set %d replicas (%s); using it as it is", stream, replicas, exc.description or exc)
