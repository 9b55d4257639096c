"""Events an operator reads with the nats CLI alone (issue 38): the JSON encoding of the stream payloads,
``cache-indexer events decode`` behind the CLI's ``--translate`` (the payload on stdin, its stdout
shown), and ``events view`` (configuration from the pod's environment, ``--subject`` with ``--last``, a
subject that matches nothing). Real publishers, a real nats-server; about 15 s in all."""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
import time

import msgpack
import nats
import pytest
import yaml

from cache_indexer.bridge.jetstream_publisher import JetStreamPublisher
from cache_indexer.bridge.l1_publisher import L1Publisher
from cache_indexer.bridge.l3_publisher import L3Publisher
from cache_indexer.infra.event_codec import JSON, MSGPACK, codec
from cache_indexer.infra.metrics import Metrics
from cache_indexer.infra.streams import ensure_l1_stream, ensure_l3_stream, l1_subject
from cache_indexer.schemas.events import (AllBlocksCleared, BlocksRemoved, BlocksStored, L1Batch, L1Envelope, L1Reset, L3Diff,
                            L3Envelope, L3Full, PodRemoved, RankRemoved)
from tests.chart_render import chart_with_nats, needs_nats_chart, render
from tests.conftest import ROOT, make_config, wait_for

POD, POD2, MASTER = "10.0.0.1", "10.0.0.2", "10.0.9.1:50051"
GEN = 1_764_900_000_000_000_000
TYPES = {"batch", "reset", "pod_removed", "rank_removed", "l3_diff", "l3_full"}
MODELS = (L1Batch, L1Reset, PodRemoved, RankRemoved, L3Diff, L3Full, BlocksStored, BlocksRemoved, AllBlocksCleared)


def _cli_env(tmp_path) -> dict:
    # no `cache-indexer local` of another test is found: the configuration alone names the server
    return {**{k: v for k, v in os.environ.items() if not k.startswith("CACHE_INDEXER_")},
            "PYTHONPATH": str(ROOT), "CACHE_INDEXER_RUNTIME_DIR": str(tmp_path / "run")}


async def _publish_every_type(nc, cfg, encoding: str) -> None:
    """One message of every type and shape the bridge writes, by the bridge's own publishers: single
    batches (every event kind and field), a batch in parts, a run of batches, a reset, a rank and a pod
    removal, an L3 full state in parts and a diff."""
    js = nc.jetstream()
    await ensure_l1_stream(js, cfg.nats)
    await ensure_l3_stream(js, cfg.nats)
    pub = JetStreamPublisher(nc, Metrics(), ack_timeout=2.0)
    await pub.start()
    try:
        n = cfg.nats
        l1 = L1Publisher(pub, n.l1Stream.subjectPrefix, js, n.l1Stream.name, lambda: 2048, "bridge-test",
                         codec=codec(encoding))
        l3 = L3Publisher(pub, n.l3Stream.subjectPrefix, lambda: 1024, Metrics(), codec=codec(encoding))
        stored = {"kind": "stored", "medium": "GPU", "hashes": [(1 << 64) - 1, 2, 3], "parent": 12345,
                  "block_size": 16, "lora_name": "adapter-é", "group_idx": 1}
        await l1.batch(POD, 0, GEN, 0, 1764900000.25, [
            stored, {"kind": "removed", "medium": None, "hashes": [2], "group_idx": 0},
            {"kind": "cleared", "medium": "GPU"}], epoch="ep1")
        await l1.batch(POD, 0, GEN, 1, 1764900001.0, [  # over 2 KB in either encoding: parts
            {"kind": "stored", "medium": None, "hashes": list(range(1 << 40, (1 << 40) + 240)), "parent": None,
             "block_size": 16}], epoch="ep1")
        await l1.run(POD, 0, GEN, [(2, 1764900002.0, [{"kind": "removed", "medium": None, "hashes": [7]}]),
                                   (3, 1764900003.0, [{"kind": "stored", "medium": None, "hashes": [8, 9]}])],
                     epoch="ep1")
        await l1.reset(POD, 1, GEN + 1, 40, "sequence gap", epoch="ep2")
        await l1.rank_removed(POD, 1, "dpRanks shrank")
        await l1.pod_removed(POD2, "left discovery")
        await l3.full(MASTER, {POD: list(range(1 << 40, (1 << 40) + 120)), POD2: [5]})  # over 1 KB: parts
        await l3.diff(MASTER, {POD2: [6]}, {POD: [100]})
        assert await pub.flush(10)
    finally:
        await pub.close()


async def _stored_messages(nc, cfg) -> list:
    js = nc.jetstream()
    out = []
    for name in (cfg.nats.l1Stream.name, cfg.nats.l3Stream.name):
        info = await js.stream_info(name)
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            out.append(await js.get_msg(name, seq))
    return out


def _independent_decode(data: bytes, encoding: str):
    """The payload read without the product's code: the standard library's JSON, or msgpack."""
    if encoding == "json":
        return json.loads(data.decode("utf-8"))
    return msgpack.unpackb(data, raw=False)


def _check_every_field(shown: dict, payload: dict, seen: dict) -> None:
    """Every field of the message (schemas/events.py) the bridge set appears in ``shown`` with its value,
    each event's too, and L1 hashes also in hex. ``seen``: model class -> the fields met so far."""
    model = (L3Envelope if payload["type"].startswith("l3_") else L1Envelope)(message=payload).message
    seen.setdefault(type(model), set()).update(model.model_fields_set)
    for name in model.model_fields_set:
        if name != "events":
            assert shown[name] == payload[name], (name, shown)
    assert len(shown.get("events", [])) == len(payload.get("events", []))
    for ev_model, ev, ev_shown in zip(getattr(model, "events", None) or [], payload.get("events", []),
                                      shown.get("events", [])):
        seen.setdefault(type(ev_model), set()).update(ev_model.model_fields_set)
        for name in ev_model.model_fields_set:
            assert ev_shown[name] == ev[name], (name, ev_shown)
        if "hashes" in ev:
            assert ev_shown["hashes_hex"] == [f"{h:016x}" for h in ev["hashes"]]


async def _decode_cli(data: bytes, tmp_path) -> tuple[int, str, str]:
    """What the nats CLI's --translate does: the payload on the command's stdin, its output shown."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "cache_indexer.cli", "events", "decode", stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_cli_env(tmp_path), cwd=tmp_path)
    out, err = await asyncio.wait_for(proc.communicate(data), 30)
    return proc.returncode, out.decode(), err.decode()


@pytest.mark.parametrize("encoding", ["msgpack", "json"])
async def test_every_message_type_reads_as_text_through_translate_and_the_json_encoding(
        nats_url, stream_prefix, tmp_path, encoding):
    cfg = make_config(nats_url, stream_prefix)
    nc = await nats.connect(nats_url)
    try:
        await _publish_every_type(nc, cfg, encoding)
        msgs = await _stored_messages(nc, cfg)
    finally:
        await nc.close()
    seen_types, seen_fields = set(), {}
    decoded = await asyncio.gather(*(_decode_cli(m.data, tmp_path) for m in msgs))
    for m, (rc, out, err) in zip(msgs, decoded):
        payload = _independent_decode(m.data, encoding)
        h = m.headers
        assert rc == 0 and err == "", err
        _check_every_field(json.loads(out), payload, seen_fields)
        seen_types.add(payload["type"])
        # the headers docs/events.md lists, as `nats stream view` prints them
        assert h["Kv-Type"] == payload["type"] and h["Kv-Schema"] == "1"
        assert h["Content-Type"].endswith(f"+{encoding}")
        if payload["type"] in ("batch", "reset"):
            assert h["Kv-Epoch"] in ("ep1", "ep2") and h["Kv-Gen"] == str(payload["gen"])
        if payload["type"] in ("reset", "rank_removed", "pod_removed"):
            assert h["Kv-Reason"] == payload["reason"] and h["Kv-Reason"]
        if encoding == "json":  # the readable encoding: the stored bytes are the text the nats CLI prints
            assert m.data.decode("utf-8").startswith('{"v":1,"type":"')
    assert seen_types == TYPES
    # every field of every message and event model met at least once (parts, runs, each event kind)
    assert {cls.__name__: fields for cls, fields in seen_fields.items()} == \
        {cls.__name__: set(cls.model_fields) for cls in MODELS}


async def test_decode_refuses_garbage_and_oversized_input_with_one_line(tmp_path):
    for data, expect in ((b"\xc1garbage", "neither JSON"), (b'{"no": "end"', "malformed JSON"),
                         (msgpack.packb([1, 2]), "not a cache-indexer event"), (b"", "empty payload"),
                         (JSON.encode({"type": "weather"}), "not a cache-indexer event")):
        rc, out, err = await _decode_cli(data, tmp_path)
        assert rc == 1 and out == "" and expect in err and len(err.splitlines()) == 1, err
    from cache_indexer import decode_event

    out, err = io.StringIO(), io.StringIO()
    big = io.BytesIO(b"{" + b" " * decode_event.MAX_PAYLOAD)
    assert decode_event.decode_stdin(big, out, err) == 1 and "over 64 MiB" in err.getvalue()
    assert big.tell() == decode_event.MAX_PAYLOAD + 1, "reads no more than the bound"


async def test_indexers_read_a_stream_holding_both_encodings(nats_url, stream_prefix):
    """A setting changed while the stream holds the other encoding (or two bridges' versions): the
    replica's index is what the same messages give applied in-process."""
    from cache_indexer.indexer.l1_state import L1State
    from cache_indexer.indexer.service import Indexer

    cfg = make_config(nats_url, stream_prefix)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await ensure_l1_stream(js, cfg.nats)
    await ensure_l3_stream(js, cfg.nats)
    pub = JetStreamPublisher(nc, Metrics(), ack_timeout=2.0)
    await pub.start()
    indexer = Indexer(cfg)
    try:
        n = cfg.nats
        pubs = {c: L1Publisher(pub, n.l1Stream.subjectPrefix, js, n.l1Stream.name, lambda: 1 << 20, codec=c)
                for c in (MSGPACK, JSON)}
        l3s = {c: L3Publisher(pub, n.l3Stream.subjectPrefix, lambda: 1 << 20, Metrics(), codec=c) for c in (MSGPACK, JSON)}
        reference = L1State()
        for seq in range(6):
            events = [{"kind": "stored", "medium": None, "hashes": [seq * 10 + 1, seq * 10 + 2], "parent": None}]
            await pubs[(MSGPACK, JSON)[seq % 2]].batch(POD, 0, GEN, seq, None, events)
            reference.apply({"type": "batch", "pod": POD, "rank": 0, "gen": GEN, "seq": seq, "events": events})
        # a bridge restarted with the other encoding: its full state, then its diffs
        await l3s[MSGPACK].full(MASTER, {POD: [1, 2]})
        await l3s[MSGPACK].diff(MASTER, {POD2: [3]}, {})
        await l3s[JSON].full(MASTER, {POD: [1, 2], POD2: [3, 4]})
        await l3s[JSON].diff(MASTER, {}, {POD: [1], POD2: [4]})
        assert await pub.flush(10)
        await indexer.start()
        await wait_for(lambda: indexer.l1.stats.block_events >= 12 and indexer.ready.is_set(), 10, "all applied")
        assert indexer.l1.blocks == reference.blocks
        assert indexer.metrics.ingest_errors.labels(n.l1Stream.name)._value.get() == 0
        held = {pod: {h for h, m in indexer.l3.blocks.items() if any(m >> w & 1 for w in indexer.l3.pod_workers(pod).values())}
                for pod in (POD, POD2)}
        assert held == {POD: {2}, POD2: {3}}
    finally:
        await pub.close()
        await indexer.stop()
        await nc.close()


def _config_file(tmp_path, cfg) -> str:
    """The configuration a pod mounts (the chart's shape: nats.url and the streams under their names)."""
    path = tmp_path / "config.yaml"
    n = cfg.nats
    path.write_text(yaml.safe_dump({"nats": {
        "url": n.url, "connectTimeout": "2s",
        "l1Stream": {"name": n.l1Stream.name, "subjectPrefix": n.l1Stream.subjectPrefix},
        "l3Stream": {"name": n.l3Stream.name, "subjectPrefix": n.l3Stream.subjectPrefix}}}))
    return str(path)


def _view(tmp_path, *args: str, config: str) -> tuple[subprocess.CompletedProcess, float]:
    """`events view` as run in a pod: no --config, the file named by CACHE_INDEXER_CONFIG (the chart's)."""
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "cache_indexer.cli", "events", "view", *args], capture_output=True,
                       text=True, timeout=60, cwd=tmp_path, env={**_cli_env(tmp_path), "CACHE_INDEXER_CONFIG": config})
    return r, time.monotonic() - t0


async def test_events_view_last_n_of_a_subject_and_a_subject_that_matches_nothing(nats_url, stream_prefix, tmp_path):
    cfg = make_config(nats_url, stream_prefix)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await ensure_l1_stream(js, cfg.nats)
    pub = JetStreamPublisher(nc, Metrics(), ack_timeout=2.0)
    await pub.start()
    try:
        l1 = L1Publisher(pub, cfg.nats.l1Stream.subjectPrefix, js, cfg.nats.l1Stream.name, lambda: 1 << 20)
        for seq in range(12):  # three workers interleaved: one message in three is the watched worker's
            for pod in (POD, POD2, "10.0.0.3"):
                await l1.batch(pod, 0, GEN, seq, None, [{"kind": "stored", "medium": None, "hashes": [seq + 1]}])
        assert await pub.flush(10)
        subject = l1_subject(cfg.nats.l1Stream.subjectPrefix, POD2, 0)
        of_subject = [seq for seq in range(1, 37)
                      if (await js.get_msg(cfg.nats.l1Stream.name, seq)).subject == subject]
    finally:
        await pub.close()
        await nc.close()
    config = _config_file(tmp_path, cfg)
    r, _ = await asyncio.to_thread(_view, tmp_path, "--subject", subject, "--last", "4", config=config)
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert [x["data"]["seq"] for x in lines] == [8, 9, 10, 11] and {x["subject"] for x in lines} == {subject}
    assert [x["seq"] for x in lines] == of_subject[-4:] and len(of_subject) == 12
    r, _ = await asyncio.to_thread(_view, tmp_path, "--subject", subject, "--last", "50", config=config)
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 12, r.stderr
    r, _ = await asyncio.to_thread(_view, tmp_path, "--last", "2", config=config)  # no subject: the whole stream's
    assert [json.loads(x)["seq"] for x in r.stdout.splitlines()] == [35, 36]
    nothing = f"{cfg.nats.l1Stream.subjectPrefix}.10_9_9_9.>"
    r, took = await asyncio.to_thread(_view, tmp_path, "--subject", nothing, "--last", "3", config=config)
    assert r.returncode == 1 and took < 15 and r.stdout == "", (r.stderr, took)
    assert f"no message in stream {cfg.nats.l1Stream.name} (36 messages) matches subject '{nothing}'" in r.stderr
    r, took = await asyncio.to_thread(_view, tmp_path, "--subject", "elsewhere.>", config=config)
    assert r.returncode == 1 and took < 15 and f"subjects are {cfg.nats.l1Stream.subjectPrefix}.<pod IP" in r.stderr, \
        r.stderr


@needs_nats_chart
def test_the_chart_points_its_pods_at_their_mounted_configuration(tmp_path):
    """`kubectl exec deploy/<release>-indexer -- cache-indexer events view` reads the file the process
    reads (CACHE_INDEXER_CONFIG), not 127.0.0.1:4222."""
    objs = render(chart_with_nats(tmp_path))
    for component in ("indexer", "bridge"):
        [deploy] = [o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"].endswith(component)]
        spec = deploy["spec"]["template"]["spec"]
        c = spec["containers"][0]
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        mount = next(m for m in c["volumeMounts"] if m["name"] == "config")["mountPath"]
        cm_name = next(v for v in spec["volumes"] if v["name"] == "config")["configMap"]["name"]
        [cm] = [o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] == cm_name]
        assert env["CACHE_INDEXER_CONFIG"] == f"{mount}/config.yaml" and "config.yaml" in cm["data"]
        assert c["args"][c["args"].index("--config") + 1] == env["CACHE_INDEXER_CONFIG"]


async def test_a_bridge_set_to_json_publishes_text_that_its_indexers_serve(nats_url, stream_prefix):
    """nats.l1Stream.encoding: json through the real bridge (vLLM's frames over ZMQ) to the API."""
    from cache_indexer.simulate.vllm_engine import stored as stored_event
    from cache_indexer.schemas.block_hash import BlockHasher
    from tests.l1_stack import L1Stack

    cfg = make_config(nats_url, stream_prefix, blockKey={"pythonHashSeed": "0"})
    cfg = cfg.model_copy(update={"nats": cfg.nats.model_copy(update={
        "l1Stream": cfg.nats.l1Stream.model_copy(update={"encoding": "json"})})})
    stack = await L1Stack(cfg).start()
    try:
        tokens = list(range(9000, 9032))
        engine = stack.engine("127.0.0.41")
        await stack.connect((engine, "127.0.0.41", 0))
        await engine.publish([stored_event(BlockHasher("sha256_cbor", "0").event_hashes(tokens, 16), token_ids=tokens)])
        last = await stack.settled()
        msg = await stack.replica.indexer.js.get_msg(cfg.nats.l1Stream.name, last)
        assert msg.headers["Content-Type"].endswith("+json") and json.loads(msg.data)["pod"] == "127.0.0.41"
        await wait_for(lambda: stack.replica.indexer.applied_seq >= last, 10, "the replica applied it")
        assert await stack.ratios(["127.0.0.41"], tokens, 16) == [1.0]
    finally:
        await stack.stop()
