"""The README's first command: ``cache-indexer local`` runs everything on an embedded nats-server."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
import zmq.asyncio

from cache_indexer.nats_server import find_binary
from cache_indexer.schemas.block_hash import BlockHasher
from tests.conftest import free_port, wait_for
from cache_indexer.simulate.vllm_engine import VllmPublisher, stored

ROOT = Path(__file__).resolve().parents[1]


def test_readme_commands_match_ci():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```\n(python3 -m venv .*?)\n```", readme)
    assert len(blocks) == 2, "the README has exactly two fresh-machine commands"
    run_cmd, test_cmd = blocks
    assert "cache-indexer local" in run_cmd
    assert test_cmd in (ROOT / ".ci" / "run").read_text()
    assert (ROOT / "examples" / "targets.yaml").exists()


def test_run_it_ends_with_simulate_and_the_curl_it_prints():
    from cache_indexer.simulate.workload import curl_line, demo_request

    readme = (ROOT / "README.md").read_text()
    run_it = readme[readme.index("## Run it"):readme.index("\n## ", readme.index("## Run it") + 1)]
    blocks = re.findall(r"```\n(.*?)\n```", run_it, re.S)
    assert blocks[-2] == ".venv/bin/cache-indexer simulate"
    pods = [f"127.0.1.{i}" for i in range(1, 4)]
    assert blocks[-1] == curl_line("http://127.0.0.1:28080", demo_request(pods, 16)), "what simulate prints"
    assert run_it.rstrip().endswith("```")


@pytest.mark.skipif(not find_binary(), reason="needs the nats-server binary")
async def test_local_mode_serves_hit_rates(tmp_path):
    ctx = zmq.asyncio.Context()
    engine = VllmPublisher(ctx, "127.0.0.21", 0, 0)
    targets = tmp_path / "targets.yaml"
    targets.write_text(f"vllm:\n  - ip: 127.0.0.21\n    zmqPort: {engine.pub_port}\n    replayPort: {engine.replay_port}\n")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "cache_indexer.cli", "local", "--targets", str(targets), "--set", f"http.port={port}",
         "--set", "blockKey.pythonHashSeed=0"], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{port}") as session:
            async def ready():
                assert proc.poll() is None, "cache-indexer local exited"
                try:
                    async with session.get("/readyz") as r:
                        return r.status == 200
                except aiohttp.ClientError:
                    return False
            await wait_for(ready, 30, "local mode ready")
            await engine.wait_subscribed(30)
            tokens = list(range(64))
            await engine.publish([stored(BlockHasher("sha256_cbor", "0").event_hashes(tokens, 16)[:2])])

            async def ratio():
                body = {"server_ip": ["127.0.0.21"], "body": {"token_ids": tokens, "block_size": 16}}
                async with session.post("/kv-cache/hit-rate", data=json.dumps(body)) as r:
                    return (await r.json())["server_score_list"][0]["l1_hit_ratio"] == 0.5
            await wait_for(ratio, 20, "ratio through the local stack")
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        await engine.close()
        ctx.term()
