"""Issue 38: the chart rolls bridges standby-first (RollingUpdate, maxUnavailable 0, maxSurge 1), which
holds only if a new bridge is ready while another holds the lease, and if the active one hands the lease
over as it stops. Two real bridge processes on a real nats-server; about 10 s."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import aiohttp

from tests.conftest import ROOT, free_port, http_ready, make_config, metric_value, wait_for
from tests.test_recovery import stop_all, write_config


async def test_a_new_bridge_is_ready_as_standby_and_takes_over_when_the_active_one_stops(nats_url, stream_prefix,
                                                                                         tmp_path):
    cfg = make_config(nats_url, stream_prefix, nats={"lease": {"bucket": f"{stream_prefix}-lease", "ttl": "4s"}})
    targets = tmp_path / "targets.yaml"
    targets.write_text(f"vllm:\n  - ip: 127.0.0.1\n    zmqPort: {free_port()}\n")
    ports, procs = [free_port(), free_port()], []

    def start(port: int) -> subprocess.Popen:
        cfg_file = write_config(cfg, tmp_path / f"bridge-{port}.yaml", **{"discovery.static.file": str(targets),
                                                                          "http.port": port})
        return subprocess.Popen([sys.executable, "-m", "cache_indexer.cli", "bridge", "--config", str(cfg_file)],
                                cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=subprocess.DEVNULL)

    try:
        async with aiohttp.ClientSession() as session:
            async def leader(port: int) -> float | None:
                return await metric_value(session, port, "cache_indexer_bridge_leader")

            procs.append(start(ports[0]))
            await wait_for(lambda: _is(leader(ports[0]), 1), 60, "the old bridge active")
            procs.append(start(ports[1]))  # the surge pod of a rollout
            await wait_for(lambda: http_ready(session, f"http://127.0.0.1:{ports[1]}/readyz"), 60, "the new one ready")
            assert await leader(ports[1]) == 0, "ready as a standby, without the lease"
            stopped = time.monotonic()
            procs[0].send_signal(signal.SIGTERM)  # what the rollout does next: the old pod stops
            await wait_for(lambda: _is(leader(ports[1]), 1), 3, "the standby active before the lease's TTL (4 s)")
            took = time.monotonic() - stopped
            assert procs[0].wait(15) == 0
            print(f"handover after SIGTERM: {took:.2f}s")
    finally:
        await stop_all(procs, 30)


async def _is(value, expected) -> bool:
    return await value == expected
