"""`cache-indexer local` driven the way a terminal drives it: Ctrl-C (SIGINT to the foreground process
group), SIGTERM to the group or the main PID, a busy port, kill -9, a malformed targets file; and the
first-hour tools against it: `simulate`, the printed curl, `events view` without flags."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from cache_indexer.nats_server import find_binary
from tests.conftest import free_port, http_ready, wait_for

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not find_binary(), reason="needs the nats-server binary")
SHUTDOWN_TIMEOUT = 5.0


def children(pid: int, comm: str) -> list[int]:
    """PIDs of the direct children of ``pid`` whose command name is ``comm`` (from /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        name = text[text.index("(") + 1:text.rindex(")")]
        ppid = int(text[text.rindex(")") + 2:].split()[1])
        if ppid == pid and name == comm:
            out.append(int(stat.parent.name))
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class Local:
    """A `cache-indexer local` in its own process group (a terminal's foreground job), with its own
    runtime dir and TMPDIR so that what it leaves behind can be seen."""

    def __init__(self, tmp: Path, targets: Path, port: int | None = None, *extra: str) -> None:
        self.tmp = tmp
        self.port = port or free_port()
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "CACHE_INDEXER_RUNTIME_DIR": str(tmp / "run"),
                    "TMPDIR": str(tmp / "tmpdir")}
        (tmp / "tmpdir").mkdir(exist_ok=True)
        self.stderr_path = tmp / f"local-{self.port}.err"
        self.args = ["local", "--targets", str(targets), "--set", f"http.port={self.port}",
                     "--set", f"http.shutdownTimeout={SHUTDOWN_TIMEOUT}s", *extra]
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Local":
        self.stderr = self.stderr_path.open("wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "cache_indexer.cli", *self.args], cwd=self.tmp,
                                     env=self.env, stdout=subprocess.DEVNULL, stderr=self.stderr,
                                     start_new_session=True)
        return self

    def cli(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "cache_indexer.cli", *args], cwd=self.tmp, env=self.env,
                              capture_output=True, text=True, timeout=timeout)

    async def wait_ready(self) -> None:
        async with aiohttp.ClientSession() as session:
            async def ready():
                assert self.proc.poll() is None, f"local exited: {self.stderr_text()}"
                return await http_ready(session, f"http://127.0.0.1:{self.port}/readyz")
            await wait_for(ready, 30, "local mode ready")

    def record(self) -> dict:
        return json.loads((self.tmp / "run" / "local.json").read_text())

    def stderr_text(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    async def wait_exit(self, timeout: float) -> tuple[int, float]:
        t0 = time.monotonic()
        code = await asyncio.to_thread(self.proc.wait, timeout)
        return code, time.monotonic() - t0

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.stderr.close()


@pytest.fixture
def targets(tmp_path) -> Path:
    path = tmp_path / "targets.yaml"
    path.write_text("vllm: []\n")
    return path


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("to", ["group", "pid"])
async def test_signal_stops_everything_in_order_and_quickly(tmp_path, targets, sig, to):
    local = Local(tmp_path, targets).start()
    try:
        await local.wait_ready()
        nats_pids = children(local.proc.pid, "nats-server")
        assert len(nats_pids) == 1, "one embedded nats-server"
        store = Path(local.record()["store_dir"])
        assert store.exists()
        if to == "group":  # what a terminal's Ctrl-C does, and what container runtimes do with SIGTERM
            os.killpg(local.proc.pid, sig)
        else:
            os.kill(local.proc.pid, sig)
        code, took = await local.wait_exit(SHUTDOWN_TIMEOUT + 5)
        err = local.stderr_text()
        assert code == 0, err
        assert took < SHUTDOWN_TIMEOUT, f"stopping took {took:.1f}s"
        assert "Traceback" not in err and "CancelledError" not in err, err
        assert len(re.findall(r"WARNING", err)) == 0, err
        await wait_for(lambda: not alive(nats_pids[0]), 5, "the nats-server gone")
        assert not store.exists(), "the temporary store is removed"
        assert not (tmp_path / "run" / "local.json").exists()
    finally:
        local.kill()


async def test_busy_port_is_one_line_and_starts_nothing(tmp_path, targets):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        local = Local(tmp_path, targets, busy.getsockname()[1]).start()
        try:
            code, took = await local.wait_exit(15)
        finally:
            local.kill()
    err = local.stderr_text().strip()
    assert code == 2 and took < 10
    assert len(err.splitlines()) == 1 and "in use" in err and "http.port" in err, err
    assert not list((tmp_path / "tmpdir").iterdir()), "no nats-server store was created"


async def test_kill_9_leaves_no_server_and_the_next_start_cleans_the_store(tmp_path, targets):
    local = Local(tmp_path, targets).start()
    try:
        await local.wait_ready()
        nats_pid = children(local.proc.pid, "nats-server")[0]
        store = Path(local.record()["store_dir"])
        os.kill(local.proc.pid, signal.SIGKILL)
        local.proc.wait()
        await wait_for(lambda: not alive(nats_pid), 10, "the orphaned nats-server to die with its parent")
        assert store.exists(), "kill -9 leaves the store behind ..."
    finally:
        local.kill()
    again = Local(tmp_path, targets).start()
    try:
        await again.wait_ready()
        assert not store.exists(), "... and the next start removes it"
        os.killpg(again.proc.pid, signal.SIGINT)
        assert (await again.wait_exit(SHUTDOWN_TIMEOUT + 5))[0] == 0
    finally:
        again.kill()


@pytest.mark.parametrize("text,expect", [
    ("vllm:\n  - ip: 10.0.0.1\n    zmqPort: 5557\n  - ip: 10.0.0.2\n    zmqPort: lots\n", ":5: vllm.1.zmqPort"),
    ("vllm: [\n", ":2: not valid YAML"),
], ids=["bad-field", "bad-yaml"])
async def test_malformed_targets_at_start_are_a_configuration_error(tmp_path, text, expect):
    bad = tmp_path / "targets.yaml"
    bad.write_text(text)
    local = Local(tmp_path, bad).start()
    try:
        code, _ = await local.wait_exit(15)
    finally:
        local.kill()
    err = local.stderr_text()
    assert code == 2 and f"{bad}{expect}" in err, err


async def test_events_without_anything_running_fails_fast(tmp_path):
    local = Local(tmp_path, tmp_path / "none.yaml")
    t0 = time.monotonic()
    r = await asyncio.to_thread(local.cli, "events", "view", "--set", f"nats.url=nats://127.0.0.1:{free_port()}",
                                "--set", "nats.connectTimeout=1s")
    assert r.returncode == 1 and time.monotonic() - t0 < 10
    assert "no NATS server answered" in r.stderr and "Traceback" not in r.stderr, r.stderr


async def _printed_curl(sim: subprocess.Popen) -> tuple[str, dict]:
    """The URL and body of the curl `simulate` prints once the API shows a ratio above 0."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = await asyncio.to_thread(sim.stdout.readline)
        assert line, f"simulate ended: {sim.stderr.read()}"
        if line.startswith("curl "):
            words = shlex.split(line.strip())
            return words[2], json.loads(words[words.index("-d") + 1])
    raise AssertionError("simulate printed no curl within 60s")


async def test_simulate_shows_real_ratios_and_events_view_finds_local(tmp_path, targets):
    local = Local(tmp_path, targets).start()
    sim = None
    try:
        await local.wait_ready()
        r = await asyncio.to_thread(local.cli, "events", "view")
        assert r.returncode == 0 and "holds no messages yet" in r.stderr and "simulate" in r.stderr, r.stderr
        sim = subprocess.Popen([sys.executable, "-m", "cache_indexer.cli", "simulate", "--rate", "50"], cwd=tmp_path,
                               env=local.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
        url, body = await _printed_curl(sim)
        assert url == f"http://127.0.0.1:{local.port}/kv-cache/hit-rate"
        async with aiohttp.ClientSession() as session:  # what the curl does
            async with session.post(url, data=json.dumps(body)) as resp:
                answer = await resp.json()
        assert resp.status == 200 and answer["status"] == 0
        assert max(s["l1_hit_ratio"] for s in answer["server_score_list"]) > 0, answer
        r = await asyncio.to_thread(local.cli, "events", "view")
        assert r.returncode == 0, r.stderr
        lines = [json.loads(x) for x in r.stdout.splitlines()]
        assert any(x["subject"].startswith("kvcache.l1.127_0_1_") and x["data"]["type"] == "batch" for x in lines)
        os.killpg(sim.pid, signal.SIGINT)
        assert await asyncio.to_thread(sim.wait, 15) == 0
        assert not (tmp_path / "run" / "simulated-targets.yaml").exists(), "simulate removes its engines"
    finally:
        if sim is not None and sim.poll() is None:
            os.killpg(sim.pid, signal.SIGKILL)
        local.kill()


async def test_events_tail_follows_local_and_ctrl_c_ends_it_quietly(tmp_path, targets):
    local = Local(tmp_path, targets).start()
    tail = None
    try:
        await local.wait_ready()
        tail = subprocess.Popen([sys.executable, "-m", "cache_indexer.cli", "events", "tail"], cwd=tmp_path,
                                env=local.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        import threading

        import msgpack
        import nats as nats_client

        lines: list[str] = []
        threading.Thread(target=lambda: lines.extend(iter(tail.stdout.readline, "")), daemon=True).start()
        nc = await nats_client.connect(local.record()["nats_url"])
        js = nc.jetstream()
        body = {"v": 1, "type": "pod_removed", "pod": "127.0.9.9", "reason": "test"}

        async def printed():  # published again until the tail (which starts at new messages) has joined
            await js.publish("kvcache.l1.127_0_9_9.lifecycle", msgpack.packb(body))
            return any("127.0.9.9" in line for line in lines)
        await wait_for(printed, 20, "events tail prints what is published")
        await nc.close()
        t0 = time.monotonic()
        os.killpg(tail.pid, signal.SIGINT)
        code = await asyncio.to_thread(tail.wait, 10)
        err = tail.stderr.read()
        assert code == 130 and time.monotonic() - t0 < 5 and "Traceback" not in err, err
    finally:
        if tail is not None and tail.poll() is None:
            os.killpg(tail.pid, signal.SIGKILL)
        local.kill()


def test_reconnect_warnings_are_throttled(caplog):
    import logging

    from cache_indexer.infra.throttled_log import ThrottledWarning

    log = logging.getLogger("throttle-test")
    clock = [1000.0]
    warn = ThrottledWarning(log, every=30, clock=lambda: clock[0])
    for i in range(80):  # a server down for 40 s: nats-py reports two reconnect failures a second
        clock[0] = 1000 + i * 0.5
        warn("nats: %s", "connection refused")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["nats: connection refused", "nats: connection refused (59 more held back in the last 30s)"]


async def test_simulate_registers_its_engines_and_asks_the_ecosystem_api(tmp_path, targets):
    """`simulate --register --ask query`: the engines come in over POST /register (the local instance's
    token, given to both: the runtime file never holds it), the ratio is checked and the curl printed with POST /query, and Ctrl-C unregisters them."""
    local = Local(tmp_path, targets, None, "--set", "http.registrationToken=local-token").start()
    sim = None
    try:
        await local.wait_ready()
        record = (tmp_path / "run" / "local.json").read_text()
        assert "local-token" not in record, "a secret in the runtime file (issue 38)"
        assert json.loads(record)["config"]["http"]["registrationToken"] == "**********"
        sim = subprocess.Popen([sys.executable, "-m", "cache_indexer.cli", "simulate", "--rate", "50", "--register",
                                "--ask", "query", "--token", "local-token"], cwd=tmp_path, env=local.env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
        url, body = await _printed_curl(sim)
        assert url == f"http://127.0.0.1:{local.port}/query"
        async with aiohttp.ClientSession() as session:
            async with session.post(url, data=json.dumps(body)) as resp:
                answer = await resp.json()
            assert resp.status == 200 and set(answer["instances"]) <= {"sim-0", "sim-1", "sim-2"}, answer
            assert max(i["gpu"] for i in answer["instances"].values()) > 0
            async with session.get(f"http://127.0.0.1:{local.port}/workers") as resp:
                workers = await resp.json()
            assert {w["instance_id"] for w in workers} == {"sim-0", "sim-1", "sim-2"}
            assert {w["source"] for w in workers} == {"registration"}
            os.killpg(sim.pid, signal.SIGINT)
            assert await asyncio.to_thread(sim.wait, 15) == 0
            async with session.get(f"http://127.0.0.1:{local.port}/workers") as resp:
                assert await resp.json() == [], "simulate unregisters its engines"
    finally:
        if sim is not None and sim.poll() is None:
            os.killpg(sim.pid, signal.SIGKILL)
        local.kill()
