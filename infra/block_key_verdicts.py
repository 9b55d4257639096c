"""The bridge's blockKey verdict per pod, kept in the records bucket (key ``blockkey.<pod>``) so that a
replica can say why a pod's ratio is 0 (``explain``): whether the engine's own hash of a first block
matched the configured ``blockKey`` when last checked, and which usual setting it matches otherwise.
Written by the bridge when a pod's verdict changes, not at every check."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass

from nats.js.errors import KeyNotFoundError, NotFoundError

from cache_indexer.infra.streams import RecordsKv, subject_token

log = logging.getLogger(__name__)

PREFIX = "blockkey."


@dataclass(frozen=True, slots=True)
class BlockKeyVerdict:
    pod: str
    ok: bool
    advice: str  # on a mismatch, which setting the engine's hash matches (or what to check)
    checked_at: float  # unix time of the check


def verdict_key(pod: str) -> str:
    return PREFIX + subject_token(pod)


async def write_verdict(store: RecordsKv, pod: str, ok: bool, advice: str) -> None:
    """Best effort: a verdict not written is logged; the next change writes again."""
    value = BlockKeyVerdict(pod, ok, advice, time.time())
    try:
        await (await store()).put(verdict_key(pod), json.dumps(asdict(value)).encode())
    except Exception as exc:
        log.warning("blockKey verdict of %s not recorded (%s)", pod, exc)


async def read_verdict(store: RecordsKv, pod: str) -> BlockKeyVerdict | None:
    """The pod's last verdict; None where none was recorded (or it cannot be read)."""
    try:
        entry = await (await store()).get(verdict_key(pod))
        raw = json.loads(entry.value)
        verdict = BlockKeyVerdict(str(raw["pod"]), bool(raw["ok"]), str(raw["advice"]), float(raw["checked_at"]))
    except (KeyNotFoundError, NotFoundError):
        return None
    except Exception as exc:  # an unreadable record says nothing either way
        log.warning("blockKey verdict of %s unreadable (%s)", pod, exc)
        return None
    return verdict if verdict.pod == pod else None
