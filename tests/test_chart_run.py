"""A default `helm install`, run for real on loopback: the nats.conf the NATS sub-chart renders (its 10Gi
JetStream store included) drives a nats-server of the version the chart pins, and two indexers and two
bridges start from the product configuration the chart renders, Kubernetes discovery answered by a
Kubernetes API on loopback. All reach ready; each, and the server, is killed with SIGKILL and started
again, and all reach ready again. The same for the documented product's values.yaml."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import aiohttp
import pytest
import yaml

from cache_indexer.nats_server import find_binary
from tests.chart_render import chart_with_nats, config_of, container_env, nats_conf_of, needs_nats_chart, render
from tests.conftest import DATA, ROOT, free_port, http_ready, wait_for
from tests.kube_fake import FakeKubeApi

pytestmark = [needs_nats_chart, pytest.mark.skipif(not find_binary(), reason="needs the nats-server binary")]
pytest.importorskip("helm_python")


def nats_version() -> str:
    out = subprocess.run([find_binary(), "--version"], capture_output=True, text=True, timeout=10).stdout
    return out.strip().rsplit("v", 1)[-1]


class RenderedNats:
    """nats-server with the sub-chart's nats.conf; only what binds or writes moves onto loopback / tmp."""

    def __init__(self, conf: str, tmp: Path, env: dict[str, str]) -> None:
        self.env = env  # the container's environment as rendered (the users' passwords)
        self.port, self.monitor = free_port(), free_port()
        store = tmp / "jetstream"
        replaced = {r'"port": 4222': f'"port": {self.port}', r'"http_port": 8222': f'"http_port": {self.monitor}',
                    r'"store_dir": "/data"': f'"store_dir": "{store}"',
                    r'"pid_file": "/var/run/nats/nats.pid"': f'"pid_file": "{tmp / "nats.pid"}"'}
        for old, new in replaced.items():
            assert old in conf, f"the rendered nats.conf has no {old}"
            conf = conf.replace(old, new)
        self.conf = tmp / "nats.conf"
        self.conf.write_text(conf)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen([find_binary(), "-c", str(self.conf), "-a", "127.0.0.1"],
                                     env={**os.environ, **self.env, "SERVER_NAME": "nats-0"},
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    async def wait_healthy(self) -> None:
        def healthy():
            assert self.proc.poll() is None, "nats-server exited with the rendered nats.conf"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.monitor}/healthz?js-enabled-only=true",
                                            timeout=1) as r:
                    return r.status == 200
            except OSError:
                return False
        await wait_for(lambda: asyncio.to_thread(healthy), 20, "nats-server healthy")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()


class Component:
    def __init__(self, kind: str, config: Path, env: dict, log: Path) -> None:
        self.kind, self.config, self.env, self.log = kind, config, env, log
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "cache_indexer.cli", self.kind, "--config", str(self.config),
                 "--set", f"http.port={self.port}"], cwd=ROOT, env=self.env, stdout=log, stderr=log)

    async def ready(self, session: aiohttp.ClientSession) -> bool:
        assert self.proc.poll() is None, f"{self.kind} exited {self.proc.returncode}: {self.log.read_text()[-2000:]}"
        return await http_ready(session, f"http://127.0.0.1:{self.port}/readyz")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("values", ["defaults", "documented", "full-store"])
async def test_rendered_install_starts_and_survives_kill_9_of_every_pod(tmp_path, values):
    """full-store: streams that reserve all but 1 MiB of the 10Gi store; a server that re-checked the reservation on
    every start of a pod (an add_stream of an existing stream) refused every pod after the first."""
    chart_meta = yaml.safe_load((ROOT / "charts" / "cache-indexer" / "Chart.yaml").read_text())
    assert nats_version() == chart_meta["dependencies"][0]["version"], "test against the server the chart pins"
    given = {"defaults": None, "documented": yaml.safe_load((DATA / "seed-values.yaml").read_text()),
             "full-store": {"jetstream": {"l1": {"maxBytes": "8GiB"}, "l3": {"maxBytes": "2047MiB"}}}}[values]
    objs = render(chart_with_nats(tmp_path / "chart"), given, name="cache-indexer", namespace="infer")
    conf = nats_conf_of(objs)
    assert re.search(r'"max_file_store": 10Gi', conf), "the sub-chart's default store"
    nats = RenderedNats(conf, tmp_path, container_env(objs, "StatefulSet", "cache-indexer-nats"))
    kube = await FakeKubeApi().start()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": kube.url}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u", "namespace": "infer"}}]}))
    product = config_of(objs)
    assert product["nats"]["url"] == "nats://cache-indexer-nats.infer.svc:4222"
    product["nats"]["url"] = nats.url
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(product))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KUBECONFIG": str(kubeconfig)}
    pods = [Component(kind, config, {**env, **container_env(objs, "Deployment", f"cache-indexer-{kind}")},
                      tmp_path / f"{kind}-{i}.log") for kind in ("indexer", "bridge") for i in range(2)]
    assert all("CACHE_INDEXER_NATS__PASSWORD" in p.env for p in pods), "the bundled NATS authenticates every role"
    nats.start()
    try:
        await nats.wait_healthy()
        async with aiohttp.ClientSession() as session:
            async def all_ready() -> bool:
                return all([await p.ready(session) for p in pods])

            for pod in pods:  # one after another, as a rollout does: each start finds the streams there
                pod.start()
                await wait_for(lambda: pod.ready(session), 30, f"{pod.kind} ready")
            for pod in pods:
                pod.kill()
                pod.start()
                await wait_for(all_ready, 30, f"all ready after kill -9 of a {pod.kind}")
            nats.kill()
            nats.start()
            await nats.wait_healthy()
            await wait_for(all_ready, 60, "all ready after kill -9 of the nats-server")
        for pod in pods:
            assert "insufficient storage" not in pod.log.read_text()
    finally:
        for pod in pods:
            pod.kill()
        nats.kill()
        await kube.stop()
