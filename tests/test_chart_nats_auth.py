"""Issue 16 #12: the chart's bundled NATS authenticates every client and confines each role.

The NATS configuration the chart renders (its authorization block, with the passwords it generates into
a Secret) is run by a real nats-server; the bridge and an indexer replica connect with the user and
password their Deployments are given (resolved from that Secret) and do their whole job: ingest, query,
snapshot, compaction. Nothing they do is refused (the server logs no violation), and what a role must
not do is refused: connecting without credentials, an indexer publishing to the stream, the bridge
purging it, anyone deleting it.
"""

from __future__ import annotations

import re

import aiohttp
import pytest
import zmq.asyncio

from cache_indexer.bridge.service import Bridge
from cache_indexer.infra.config_loader import load_config
from cache_indexer.inspect_events import connect_once
from cache_indexer.nats_server import NatsServer
from cache_indexer.replica import Replica
from cache_indexer.simulate.vllm_engine import VllmPublisher, stored
from cache_indexer.schemas.config import NatsConfig
from tests.chart_render import (by_kind, chart_with_nats, container_env, nats_conf_of, needs_nats_chart, render,
                                 secrets_of)
from tests.conftest import wait_for
from tests.test_l1_end_to_end import BS, CHAIN, TOKENS

pytestmark = needs_nats_chart


def _block(conf: str, key: str) -> str:
    """The ``"key": {...}`` block of a rendered NATS configuration (balanced braces)."""
    start = conf.index(f'"{key}"')
    depth, i = 0, conf.index("{", start)
    while True:
        depth += {"{": 1, "}": -1}.get(conf[i], 0)
        i += 1
        if depth == 0:
            return conf[start:i]


async def test_the_charts_nats_runs_the_product_with_each_role_confined(tmp_path):
    objs = render(chart_with_nats(tmp_path))
    secrets = secrets_of(objs)
    authorization = _block(nats_conf_of(objs), "authorization")
    server_env = container_env(objs, "StatefulSet", "cache-indexer-nats")
    bridge_env = container_env(objs, "Deployment", "cache-indexer-bridge")
    indexer_env = container_env(objs, "Deployment", "cache-indexer-indexer")
    assert bridge_env["CACHE_INDEXER_NATS__USER"] != indexer_env["CACHE_INDEXER_NATS__USER"]
    log = tmp_path / "nats.log"
    server = NatsServer(extra_config=f'{authorization}\nlog_file: "{log}"\n', env=server_env).start()
    ctx = zmq.asyncio.Context()
    bridge = replica = eng = None
    try:
        overrides = [f"nats.url={server.url}", "http.host=127.0.0.1", "http.port=0", "nats.lease.ttl=2s",
                     "snapshot.everyMessages=5", "snapshot.interval=1s", "snapshot.purgeKeep=1",
                     "blockKey.pythonHashSeed=0", "ingest.l1.replayTimeout=2s"]
        bridge = Bridge(load_config(env=bridge_env, overrides=overrides))
        replica = Replica(load_config(env=indexer_env, overrides=overrides))
        await bridge.start()
        await replica.start()
        eng = VllmPublisher(ctx, "127.0.0.1", 0, 0)
        await bridge.set_endpoints([eng.endpoint("127.0.0.1")])
        await eng.wait_subscribed()
        for i in range(8):
            await eng.publish([stored(CHAIN[i:i + 1], parent=CHAIN[i - 1] if i else None)])
        port = replica.http.port
        async with aiohttp.ClientSession() as s:
            async def ratio():
                body = {"server_ip": ["127.0.0.1"], "body": {"token_ids": TOKENS, "block_size": BS}}
                async with s.post(f"http://127.0.0.1:{port}/kv-cache/hit-rate", json=body) as r:
                    return (await r.json())["server_score_list"][0]["l1_hit_ratio"] == 1.0
            await wait_for(ratio, 20, "the chain indexed through the authenticated bridge and indexer")
        await wait_for(lambda: replica.metrics.snapshot_writes._value.get() >= 1, 20, "a snapshot written")
        admin = NatsConfig(url=server.url, user="admin", password=secrets["cache-indexer-nats-auth"]["admin-password"])
        nc = await connect_once(admin, "admin")
        js = nc.jetstream()
        await wait_for(lambda: _first_seq(js), 20, "the snapshot writer compacted KV_L1 (purge allowed)")
        before = (await js.stream_info("KV_L1")).state
        await nc.close()
        violations = [line for line in log.read_text().splitlines() if "Violation" in line]
        assert violations == [], "the roles need nothing they are not allowed"

        # what each role must not do
        with pytest.raises(Exception):
            await connect_once(NatsConfig(url=server.url, connectTimeout=2), "anonymous")
        for env, forbidden in ((indexer_env, ("publish", "delete")), (bridge_env, ("purge", "delete"))):
            nc = await connect_once(NatsConfig(url=server.url, user=env["CACHE_INDEXER_NATS__USER"],
                                               password=env["CACHE_INDEXER_NATS__PASSWORD"]), "role")
            js = nc.jetstream(timeout=1.5)
            for action in forbidden:
                with pytest.raises(Exception):
                    if action == "publish":
                        await js.publish("kvcache.l1.127_0_0_1.0", b"forged")
                    elif action == "purge":
                        await js.purge_stream("KV_L1")
                    else:
                        await js.delete_stream("KV_L1")
            await nc.close()
        nc = await connect_once(admin, "admin")
        after = (await nc.jetstream().stream_info("KV_L1")).state
        assert (after.first_seq, after.last_seq, after.messages) == (before.first_seq, before.last_seq, before.messages), \
            "the stream is intact"
        await nc.close()
        assert len([line for line in log.read_text().splitlines() if "Publish Violation" in line]) == 4
    finally:
        if eng:
            await eng.close()
        if replica:
            await replica.stop()
        if bridge:
            await bridge.stop()
        ctx.term()
        server.close()


async def _first_seq(js) -> bool:
    return (await js.stream_info("KV_L1")).state.first_seq > 1


def test_the_generated_passwords_are_kept_out_of_config_maps_and_an_existing_secret_is_used(tmp_path):
    chart = chart_with_nats(tmp_path)
    objs = render(chart)
    passwords = [p for name, data in secrets_of(objs).items() if name.endswith("-nats-auth") for p in data.values()]
    # NATS substitutes them into its configuration unquoted: one starting with a digit reads as a number
    assert len(passwords) == 3 and all(re.fullmatch(r"[A-Za-z][A-Za-z0-9]{31}", p) for p in passwords)
    for cm in by_kind(objs, "ConfigMap"):
        assert not any(p in str(cm) for p in passwords), cm["metadata"]["name"]
    mine = render(chart, {"nats": {"auth": {"existingSecret": "my-nats-users"}}})
    assert not [s for s in by_kind(mine, "Secret") if s["metadata"]["name"].endswith("-nats-auth")]
    refs = [e["valueFrom"]["secretKeyRef"]["name"] for d in by_kind(mine, "Deployment") + by_kind(mine, "StatefulSet")
            for c in d["spec"]["template"]["spec"]["containers"] for e in c.get("env", []) if "valueFrom" in e
            and "secretKeyRef" in e["valueFrom"]]
    assert refs and set(refs) == {"my-nats-users"}
    off = render(chart, {"nats": {"auth": {"enabled": False}}})
    assert "authorization" not in nats_conf_of(off)
    assert not any(e.get("name", "").startswith("CACHE_INDEXER_NATS__") for d in by_kind(off, "Deployment")
                   for c in d["spec"]["template"]["spec"]["containers"] for e in c.get("env", []))


def test_external_nats_credentials_and_tls_come_from_secrets(tmp_path):
    from cache_indexer.schemas.config import Config
    from tests.chart_render import config_of

    chart = chart_with_nats(tmp_path)
    objs = render(chart, {"nats": {"enabled": False}, "externalNats": {
        "url": "tls://nats.example:4222", "secretName": "nats-client", "credsKey": "bridge.creds"},
        "natsTls": {"secretName": "nats-ca", "clientCertificate": True, "serverName": "nats.example"}})
    cfg = Config.model_validate(config_of(objs))
    assert cfg.nats.credsFile == "/etc/nats-credentials/bridge.creds"
    assert (cfg.nats.tls.caFile, cfg.nats.tls.certFile, cfg.nats.tls.serverName) == \
        ("/etc/nats-tls/ca.crt", "/etc/nats-tls/tls.crt", "nats.example")
    for dep in by_kind(objs, "Deployment"):
        pod = dep["spec"]["template"]["spec"]
        assert {v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v} == {"nats-client", "nats-ca"}
        assert {m["mountPath"] for m in pod["containers"][0]["volumeMounts"]} >= {"/etc/nats-credentials", "/etc/nats-tls"}
    objs = render(chart, {"nats": {"enabled": False}, "externalNats": {
        "url": "nats://nats.example:4222", "secretName": "nats-client", "user": "ci", "passwordKey": "password"}})
    env = by_kind(objs, "Deployment", "cache-indexer-bridge")[0]["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "CACHE_INDEXER_NATS__USER", "value": "ci"} in env
    assert {"name": "CACHE_INDEXER_NATS__PASSWORD",
            "valueFrom": {"secretKeyRef": {"name": "nats-client", "key": "password"}}} in env


def test_nats_box_connects_as_the_admin_user(tmp_path):
    objs = render(chart_with_nats(tmp_path))
    box = by_kind(objs, "Deployment", "cache-indexer-nats-box")[0]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in box["env"]}
    assert env["NATS_USER"]["value"] == "admin"
    assert env["NATS_PASSWORD"]["valueFrom"]["secretKeyRef"]["key"] == "admin-password"

