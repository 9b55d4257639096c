"""A 3-node NATS cluster with JetStream on 127.0.0.1 (one process per node, routes between them), for
tests of what must survive the loss of a node."""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from cache_indexer.nats_server import find_binary
from tests.conftest import free_port


class NatsCluster:
    def __init__(self, size: int = 3) -> None:
        self.binary = find_binary()
        self.dir = Path(tempfile.mkdtemp(prefix="nats-cluster-"))
        self.nodes = [{"name": f"n{i}", "client": free_port(), "route": free_port(), "http": free_port()}
                      for i in range(size)]
        self.procs: list[subprocess.Popen | None] = [None] * size

    @property
    def url(self) -> str:
        return ",".join(f"nats://127.0.0.1:{n['client']}" for n in self.nodes)

    def _conf(self, i: int) -> Path:
        n = self.nodes[i]
        routes = ", ".join(f"nats://127.0.0.1:{m['route']}" for m in self.nodes if m is not n)
        conf = self.dir / f"{n['name']}.conf"
        conf.write_text(
            f'server_name: {n["name"]}\nlisten: "127.0.0.1:{n["client"]}"\nhttp: "127.0.0.1:{n["http"]}"\n'
            f'jetstream {{ store_dir: "{self.dir / n["name"]}", max_file_store: {1 << 30}, max_memory_store: {64 << 20} }}\n'
            f'cluster {{ name: test, listen: "127.0.0.1:{n["route"]}", routes: [{routes}] }}\n')
        return conf

    def start_node(self, i: int) -> None:
        self.procs[i] = subprocess.Popen([self.binary, "-c", str(self._conf(i))], stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL)

    def start(self, timeout: float = 30.0) -> "NatsCluster":
        for i in range(len(self.nodes)):
            self.start_node(i)
        deadline = time.monotonic() + timeout
        for n in self.nodes:  # healthy = JetStream up, with a meta leader the cluster agrees on
            while not self._healthy(n):
                if time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError("the NATS cluster did not become healthy")
                time.sleep(0.1)
        return self

    @staticmethod
    def _healthy(n: dict) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{n['http']}/healthz", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def index_of(self, name: str) -> int:
        return next(i for i, n in enumerate(self.nodes) if n["name"] == name)

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        self.procs[i] = None

    def close(self) -> None:
        for i in range(len(self.nodes)):
            self.kill(i)
        shutil.rmtree(self.dir, ignore_errors=True)
