"""Where a running ``cache-indexer local`` says how to reach it.

Local mode picks a free port for its embedded nats-server, so tools started later (``events``,
``simulate``) cannot guess it. It writes ``local.json`` (pid, NATS URL, API URL, targets file, store)
into ``$CACHE_INDEXER_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR/cache-indexer``, else
``/tmp/cache-indexer-<uid>``, and removes it on exit. A record whose pid is gone is stale: the next
local start removes the temporary store it names (left behind by a ``kill -9``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path


def runtime_dir() -> Path:
    explicit = os.environ.get("CACHE_INDEXER_RUNTIME_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "cache-indexer"
    return Path(tempfile.gettempdir()) / f"cache-indexer-{os.getuid() if hasattr(os, 'getuid') else 'user'}"


def local_record_path() -> Path:
    return runtime_dir() / "local.json"


def simulated_targets_path() -> Path:
    """The targets overlay a running local instance watches besides its own file; ``simulate`` owns it."""
    return runtime_dir() / "simulated-targets.yaml"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_local() -> dict | None:
    """The record of a running local instance, or None (no record, unreadable, or its process is gone)."""
    try:
        record = json.loads(local_record_path().read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("pid"), int) or not _alive(record["pid"]):
        return None
    return record


def write_local(record: dict) -> None:
    path = local_record_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), **record}))
    tmp.replace(path)


def remove_local() -> None:
    """Remove the record if it is this process's own."""
    path = local_record_path()
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError, AttributeError):
        pass


def clean_stale_local() -> str | None:
    """Remove a dead instance's record and its temporary store; returns the store removed, if any."""
    path = local_record_path()
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or (isinstance(record.get("pid"), int) and _alive(record["pid"])):
        return None
    store = record.get("store_dir") if record.get("temporary_store") else None
    if store and Path(store).name.startswith("cache-indexer-nats-"):
        shutil.rmtree(store, ignore_errors=True)
    path.unlink(missing_ok=True)
    return store
