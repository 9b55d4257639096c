"""JetStream names and stream set-up shared by the bridge, the indexer and the inspect command.

Subjects (prefix ``nats.l1Stream.subjectPrefix``, default ``kvcache.l1``): ``kvcache.l1.<pod>.<rank>``
carries one (pod, rank)'s batches and resets; pod lifecycle messages go to ``kvcache.l1.<pod>.lifecycle``. Tokens are sanitised (``.`` and other characters NATS
reserves become ``_``), so a pod IP 10.0.0.1 becomes ``10_0_0_1``; the exact IP is in the payload and
the ``Kv-Pod`` header.
"""

from __future__ import annotations

import logging
import re

import nats
from nats.js import api
from nats.js.errors import APIError, BadRequestError, BucketNotFoundError, NotFoundError

from cache_indexer.throttled_log import ThrottledWarning
from schemas.config import NatsConfig, StreamConfig

log = logging.getLogger(__name__)

_TOKEN_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


def subject_token(value: str) -> str:
    return _TOKEN_UNSAFE.sub("_", value) or "_"


def l1_subject(prefix: str, pod: str, rank: int) -> str:
    return f"{prefix}.{subject_token(pod)}.{rank}"


def l1_lifecycle_subject(prefix: str, pod: str) -> str:
    return f"{prefix}.{subject_token(pod)}.lifecycle"


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
    """The stream as configured: looked up first, created when missing, updated only on a real difference.

    A single nats-server checks its storage reservation before it notices that a stream exists, so an
    ``add_stream`` of an existing stream can fail with 10047 (insufficient storage) where the store holds
    it fine: every start after the first would then fail. An update the server refuses (a larger
    ``maxBytes`` than the store can reserve, say) is logged and the existing stream is used as it is."""
    sc = stream_config(cfg, subjects)
    try:
        info = await js.stream_info(cfg.name)
    except NotFoundError:
        try:
            return await js.add_stream(sc)
        except BadRequestError as exc:
            if exc.err_code != 10058:  # created meanwhile by another process: compare below
                raise
            info = await js.stream_info(cfg.name)
    diff = stream_differences(info.config, sc)
    if not diff:
        return info
    try:
        updated = await js.update_stream(sc)
        log.info("stream %s updated to the configured limits: %s", cfg.name, "; ".join(diff))
        return updated
    except APIError as exc:
        log.error("stream %s differs from the configuration (%s) and the server refused the update: %s; "
                  "using the stream as it is", cfg.name, "; ".join(diff), exc.description or exc)
        return info


async def ensure_l1_stream(js, cfg: NatsConfig) -> api.StreamInfo:
    return await ensure_stream(js, cfg.l1Stream, [f"{cfg.l1Stream.subjectPrefix}.>"])


def l3_subject(prefix: str, master: str) -> str:
    return f"{prefix}.{subject_token(master)}"


async def ensure_l3_stream(js, cfg: NatsConfig) -> api.StreamInfo:
    return await ensure_stream(js, cfg.l3Stream, [f"{cfg.l3Stream.subjectPrefix}.>"])


async def connect(cfg: NatsConfig, name: str, **callbacks) -> nats.NATS:
    """Connect with unlimited reconnects; callbacks (async) are passed through to nats-py."""
    warn = ThrottledWarning(log)

    async def _error_cb(exc: Exception) -> None:
        warn("nats: %s", exc or type(exc).__name__)

    opts = {"error_cb": _error_cb, **callbacks}
    return await nats.connect(
        cfg.url, name=name, max_reconnect_attempts=-1, reconnect_time_wait=0.5,
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


async def kv_bucket(js, bucket: str, **create):
    """The KV bucket, created with ``create`` (history, ttl, ...) where it does not exist yet."""
    try:
        return await js.key_value(bucket)
    except (BucketNotFoundError, NotFoundError):
        return await js.create_key_value(bucket=bucket, **create)
