"""Issue 16 #12: NATS secured, and the stream not trusted blindly.

- Indexers refuse messages whose generation or seq is impossible: a forged batch with generation 2^63
  blinded a pod for ever (every real, later generation was older).
- Every kind of credentials the processes support, against a real nats-server configured for it:
  user/password, token, nkey, .creds (JWT), TLS with a private CA and a client certificate.
- ``config show`` masks secrets.
The chart's own NATS configuration (generated credentials, per-role permissions) is run for real in
tests/test_chart_nats_auth.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

import msgpack
import pytest

from cache_indexer.inspect_events import connect_once
from cache_indexer.nats_server import NatsServer
from cache_indexer.infra.streams import subject_token
from cache_indexer.schemas.config import NatsConfig
from tests.conftest import ROOT, make_config, wait_for
from tests.l1_stack import L1Stack
from tests.test_l1_end_to_end import BS, CHAIN, POD, TOKENS, until_ratio
from cache_indexer.simulate.vllm_engine import stored



async def test_a_forged_generation_or_seq_is_refused_and_the_pod_stays_indexed(nats_url, stream_prefix):
    cfg = make_config(nats_url, stream_prefix, blockKey={"pythonHashSeed": "0"})
    stack = await L1Stack(cfg).start()
    try:
        eng = stack.engine(POD)
        await stack.connect((eng, POD, 0))
        await eng.publish([stored(CHAIN[:2])])
        await until_ratio(stack, POD, 2 / 8)
        js = stack.bridge.nc.jetstream()
        subject = f"{cfg.nats.l1Stream.subjectPrefix}.{subject_token(POD)}.0"
        errors = stack.replica.metrics.ingest_errors.labels(cfg.nats.l1Stream.name)
        before = errors._value.get()
        forged = [{"type": "batch", "pod": POD, "rank": 0, "gen": (1 << 63) + 1, "seq": 0, "events": []},
                  {"type": "reset", "pod": POD, "rank": 0, "gen": stack.replica.indexer.l1.cursors[(POD, 0)].gen + 1,
                   "next_seq": (1 << 64) - 2, "reason": "forged", "epoch": "-"}]
        for msg in forged:
            await js.publish(subject, msgpack.packb(msg))
        await wait_for(lambda: errors._value.get() == before + 2, 10, "both forged messages refused and counted")
        await eng.publish([stored(CHAIN[2:4], parent=CHAIN[1])])
        await until_ratio(stack, POD, 4 / 8, what="the pod still indexed after the forged messages")
        assert (await stack.ratios([POD], TOKENS, BS)) == [0.5]
    finally:
        await stack.stop()


# -- credentials and TLS against a real nats-server configured for them -------------------------------
def _userpass(tmp):
    return 'authorization { users: [{user: "bridge", password: "s3cret pass"}] }\n', \
        {"user": "bridge", "password": "s3cret pass"}


def _token(tmp):
    return 'authorization { token: "t0ken-value" }\n', {"token": "t0ken-value"}


def _nkey(tmp):
    import nkeys

    from tests.nats_credentials import new_key

    user = new_key(nkeys.PREFIX_BYTE_USER)
    seed = tmp / "user.nk"
    seed.write_bytes(user.seed)
    return f'authorization {{ users: [{{nkey: {user.public_key.decode()}}}] }}\n', {"nkeySeedFile": str(seed)}


def _creds(tmp):
    from tests.nats_credentials import operator_setup

    conf, creds = operator_setup(tmp)
    return conf, {"credsFile": str(creds)}


async def _stream_message_acked(cfg: NatsConfig, nc) -> None:
    """The bridge's connection for stream messages (bridge/stream_connection.py) connects with ``cfg`` too,
    and a message it publishes is stored and acked."""
    import asyncio

    from cache_indexer.bridge.stream_connection import StreamConnection

    await nc.jetstream().add_stream(name="SEC", subjects=["sec.>"])
    conn = StreamConnection(cfg, "test-streams")
    await conn.connect()
    try:
        acked = asyncio.get_running_loop().create_future()
        inbox = conn.take_replies(lambda token, status, data: acked.done() or acked.set_result((token, status, data)))
        await conn.publish("sec.a", b"x", reply=f"{inbox}.7", headers={"Nats-Msg-Id": "one"})
        token, status, data = await asyncio.wait_for(acked, 5)
        assert (token, status) == ("7", "") and b'"seq":1' in data.replace(b" ", b"")
    finally:
        await conn.close()


@pytest.mark.parametrize("kind", [_userpass, _token, _nkey, _creds], ids=["user-password", "token", "nkey", "creds"])
async def test_each_kind_of_credentials_connects_and_none_is_refused(kind, tmp_path):
    from cache_indexer.bridge.stream_connection import StreamConnection

    conf, creds = kind(tmp_path)
    server = NatsServer(extra_config=conf).start()
    try:
        good = NatsConfig(url=server.url, **creds)
        nc = await connect_once(good, "test")
        info = await nc.jetstream().account_info()  # JetStream works for this user
        assert info.limits is not None
        await _stream_message_acked(good, nc)
        await nc.close()
        with pytest.raises(Exception):
            await connect_once(NatsConfig(url=server.url, connectTimeout=2), "anonymous")
        with pytest.raises(ConnectionError, match="Authorization Violation"):
            await StreamConnection(NatsConfig(url=server.url, connectTimeout=2), "anonymous").connect()
    finally:
        server.close()


async def test_tls_with_a_private_ca_and_a_client_certificate(tmp_path):
    import trustme

    from cache_indexer.bridge.stream_connection import StreamConnection

    ca = trustme.CA()
    server_cert = ca.issue_cert("127.0.0.1", "nats.internal")
    client_cert = ca.issue_cert("cache-indexer-bridge")
    paths = {}
    for name, blob in (("ca.crt", ca.cert_pem), ("server.crt", server_cert.cert_chain_pems[0]),
                       ("server.key", server_cert.private_key_pem), ("client.crt", client_cert.cert_chain_pems[0]),
                       ("client.key", client_cert.private_key_pem)):
        blob.write_to_path(str(tmp_path / name))
        paths[name] = str(tmp_path / name)
    conf = (f'tls {{ cert_file: "{paths["server.crt"]}", key_file: "{paths["server.key"]}", '
            f'ca_file: "{paths["ca.crt"]}", verify: true, timeout: 2 }}\n')
    server = NatsServer(extra_config=conf).start()
    try:
        tls = {"caFile": paths["ca.crt"], "certFile": paths["client.crt"], "keyFile": paths["client.key"]}
        nc = await connect_once(NatsConfig(url=server.url, tls=tls), "test")
        await nc.jetstream().account_info()
        assert nc._server_info.get("tls_required")  # the server speaks TLS only: connected means over TLS
        await _stream_message_acked(NatsConfig(url=server.url, tls=tls), nc)
        await nc.close()
        # the server's name, when the URL's host is not on its certificate
        named = NatsConfig(url=f"nats://localhost:{server.port}", tls={**tls, "serverName": "nats.internal"})
        nc = await connect_once(named, "t")
        await nc.close()
        conn = StreamConnection(named, "t")
        await conn.connect()
        await conn.close()
        for refused in ({"caFile": paths["ca.crt"]},  # no client certificate: the server verifies clients
                        {"enabled": True, "certFile": paths["client.crt"], "keyFile": paths["client.key"]}):  # unknown CA
            with pytest.raises(Exception):
                await connect_once(NatsConfig(url=server.url, connectTimeout=2, tls=refused), "refused")
            with pytest.raises(ConnectionError):
                await StreamConnection(NatsConfig(url=server.url, connectTimeout=2, tls=refused), "refused").connect()
    finally:
        server.close()


def test_a_credentials_file_that_cannot_be_read_is_one_clear_error(tmp_path):
    from cache_indexer.infra.nats_auth import NatsAuthError, connect_options

    with pytest.raises(NatsAuthError, match="nats.credsFile: cannot read"):
        connect_options(NatsConfig(credsFile=str(tmp_path / "missing.creds")))
    with pytest.raises(ValueError, match="one kind of authentication"):
        NatsConfig(user="a", token="b")


def test_config_show_masks_secrets():
    env = {**os.environ, "CACHE_INDEXER_NATS__USER": "bridge", "CACHE_INDEXER_NATS__PASSWORD": "hunter2-secret"}
    out = subprocess.run([sys.executable, "-m", "cache_indexer.cli", "config", "show"], env=env, capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "hunter2-secret" not in out.stdout and "password: '**********'" in out.stdout
    assert "user: bridge" in out.stdout


def test_a_process_whose_credentials_file_is_missing_stops_at_once_naming_it(tmp_path):
    out = subprocess.run([sys.executable, "-m", "cache_indexer.cli", "indexer", "--set",
                          f"nats.tls.caFile={tmp_path / 'ca.crt'}"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 2 and "nats.tls.caFile: cannot read" in out.stderr, out.stderr
