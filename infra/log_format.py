"""How the processes write their log: one JSON object a line (``log.format: json``) or plain text.

Timestamps are RFC 3339 in UTC with milliseconds (``2026-12-05T08:30:15.123Z``) in both. What a record
is about travels as structured fields, not only in its message: a call's ``extra={"pod": ..., "rank":
..., "master": ...}`` (or a ``logging.LoggerAdapter`` carrying them) becomes top-level JSON keys, so a
log query can select ``pod="10.0.0.7"`` without parsing the text.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import datetime, timezone

#: Attributes every LogRecord has; anything else on a record came from ``extra``
_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime", "taskName"}


def describe(exc: BaseException) -> str:
    """What a log line says of an exception: its message, or its type where it has none (an
    ``asyncio.TimeoutError`` has an empty one, and every exception is truthy)."""
    return str(exc) or type(exc).__name__


def rfc3339(created: float) -> str:
    return datetime.fromtimestamp(created, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": rfc3339(record.created), "level": record.levelname.lower(), "logger": record.name,
               "msg": record.getMessage()}
        out.update((k, v) for k, v in record.__dict__.items() if k not in _STANDARD and k not in out)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return rfc3339(record.created)


def configure(level: str, fmt: str) -> None:
    """The root logger writes to stderr at ``level`` in ``fmt`` (json or text), replacing any handler."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
