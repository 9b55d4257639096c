"""Discovery: vLLM pods from a Kubernetes API on loopback (list + watch, 410 Gone, broken watches),
and the static targets file."""

from __future__ import annotations

import copy

import msgpack
import pytest
from kubernetes_asyncio import client

from bridge.k8s_discovery import KubernetesDiscovery
from bridge.static_targets import StaticTargets
from schemas.config import DiscoveryConfig
from tests.conftest import make_config, wait_for
from tests.kube_fake import FakeKubeApi, make_pod


@pytest.fixture
async def kube():
    api = await FakeKubeApi().start()
    yield api
    await api.stop()


def api_client(kube: FakeKubeApi) -> client.ApiClient:
    conf = client.Configuration(host=kube.url)
    return client.ApiClient(conf)


class Seen:
    def __init__(self) -> None:
        self.history: list[list] = []

    async def __call__(self, endpoints) -> None:
        self.history.append(endpoints)

    @property
    def current(self):
        return self.history[-1] if self.history else []

    def pods(self):
        return {(e.pod, e.rank) for e in self.current}


@pytest.fixture
async def discovery(kube):
    seen = Seen()
    cfg = DiscoveryConfig(mode="kubernetes", namespace="infer", refreshInterval=30)
    d = KubernetesDiscovery(cfg, seen, api_client(kube))
    yield kube, d, seen
    await d.stop()


async def test_pod_lifecycle(discovery):
    kube, d, seen = discovery
    pod = make_pod("vllm-0", "127.0.0.41", ready=False)
    kube.add(pod)
    kube.add(make_pod("other", "127.0.0.49", engine="sglang"))  # label does not match
    d.start()
    await wait_for(lambda: kube.watching, 10, "watch open")
    assert seen.pods() == set()
    ready = copy.deepcopy(pod)
    ready["status"]["conditions"][0]["status"] = "True"
    kube.modify(ready)
    await wait_for(lambda: seen.pods() == {("127.0.0.41", 0)}, 10, "ready pod becomes a target")
    ep = seen.current[0]
    assert ep.pub == "tcp://127.0.0.41:5557" and ep.replay is None and ep.name == "vllm-0"
    epoch = ep.epoch

    restarted = copy.deepcopy(ready)
    restarted["status"]["containerStatuses"][0]["restartCount"] = 1
    kube.modify(restarted)
    await wait_for(lambda: seen.current and seen.current[0].epoch != epoch, 10, "restart changes the epoch")

    moved = copy.deepcopy(restarted)
    moved["status"]["podIP"] = "127.0.0.42"
    kube.modify(moved)
    await wait_for(lambda: seen.pods() == {("127.0.0.42", 0)}, 10, "IP change")

    prefill_only = copy.deepcopy(moved)
    prefill_only["metadata"]["labels"]["openfuyao.com/pdRole"] = "decode"
    kube.modify(prefill_only)
    await wait_for(lambda: seen.pods() == set(), 10, "decode pods are not targets")

    kube.modify(moved)
    await wait_for(lambda: seen.pods() == {("127.0.0.42", 0)}, 10, "back to aggregate")
    gone = copy.deepcopy(moved)
    gone["metadata"]["labels"]["openfuyao.com/engine"] = "none"
    kube.modify(gone)  # leaves the label selector: the API server sends DELETED
    await wait_for(lambda: seen.pods() == set(), 10, "label no longer matches")

    kube.modify(moved)
    await wait_for(lambda: seen.pods() == {("127.0.0.42", 0)}, 10, "matches again")
    kube.delete("vllm-0")
    await wait_for(lambda: seen.pods() == set(), 10, "deleted")


async def test_a_burst_of_watch_events_is_published_once_not_once_an_event(discovery):
    """300 pods deleted at once (a namespace drained) reach the bridge as a few publishes of the whole
    set, not 300: each publish maps every pod and the bridge reconciles every target (the bridge's loop
    was held up to 0.5 s at a time while 1,000 pods left)."""
    kube, d, seen = discovery
    for i in range(300):
        kube.add(make_pod(f"vllm-{i}", f"127.0.1.{i % 250 + 1}" if i < 250 else f"127.0.2.{i - 249}"))
    d.start()
    await wait_for(lambda: len(seen.pods()) == 300 and kube.watching, 10, "every pod a target")
    before = len(seen.history)
    for i in range(300):
        kube.delete(f"vllm-{i}")
    await wait_for(lambda: seen.pods() == set(), 10, "every pod gone")
    assert len(seen.history) - before <= 5, f"{len(seen.history) - before} publishes for one burst"


async def test_ports_by_name_and_dp_ranks(discovery):
    kube, d, seen = discovery
    kube.add(make_pod("vllm-dp", "127.0.0.43", zmq_port=6000, replay_port=6100,
                      annotations={"openfuyao.com/dp-ranks": "2"}))
    d.start()
    await wait_for(lambda: len(seen.current) == 2, 10, "two ranks")
    assert [(e.rank, e.pub, e.replay) for e in seen.current] == [
        (0, "tcp://127.0.0.43:6000", "tcp://127.0.0.43:6100"), (1, "tcp://127.0.0.43:6001", "tcp://127.0.0.43:6101")]


async def test_pending_and_terminating_pods_are_not_targets(discovery):
    kube, d, seen = discovery
    kube.add(make_pod("pending", "127.0.0.44", phase="Pending"))
    terminating = make_pod("terminating", "127.0.0.45")
    terminating["metadata"]["deletionTimestamp"] = "2026-12-02T00:00:00Z"
    kube.add(terminating)
    kube.add(make_pod("good", "127.0.0.46"))
    d.start()
    await wait_for(lambda: seen.pods() == {("127.0.0.46", 0)}, 10, "only the running, ready pod")


async def watching_one_pod(discovery, ip: str) -> int:
    """Pod "a" at ``ip`` discovered and a watch open; the list calls made so far."""
    kube, d, seen = discovery
    kube.add(make_pod("a", ip))
    d.start()
    await wait_for(lambda: seen.pods() == {(ip, 0)}, 10, "first pod")
    await wait_for(lambda: kube.watching, 10, "watch open")
    return kube.list_calls


async def test_gone_watch_relists(discovery):
    kube, d, seen = discovery
    lists = await watching_one_pod(discovery, "127.0.0.51")
    kube.expire()  # the open watch gets 410 Gone
    kube.add(make_pod("b", "127.0.0.52"))
    await wait_for(lambda: kube.list_calls > lists, 10, "relist after 410")
    await wait_for(lambda: seen.pods() == {("127.0.0.51", 0), ("127.0.0.52", 0)}, 10, "second pod after relist")


async def test_broken_watch_recovers_what_happened_meanwhile(discovery):
    kube, d, seen = discovery
    lists = await watching_one_pod(discovery, "127.0.0.53")
    kube.break_watches()
    kube.delete("a")
    kube.add(make_pod("c", "127.0.0.54"))
    await wait_for(lambda: kube.list_calls > lists, 15, "relist after the broken watch")
    await wait_for(lambda: seen.pods() == {("127.0.0.54", 0)}, 10, "state after the broken watch")


async def test_periodic_relist_bounds_staleness(kube):
    """Even a watch that silently stops delivering is replaced after refreshInterval."""
    seen = Seen()
    d = KubernetesDiscovery(DiscoveryConfig(mode="kubernetes", namespace="infer", refreshInterval=1), seen,
                            api_client(kube))
    d.start()
    try:
        await wait_for(lambda: kube.list_calls >= 3, 10, "relists every refreshInterval")
    finally:
        await d.stop()


async def test_discovery_drives_the_bridge_and_publishes_pod_removal(kube, nats_url, stream_prefix):
    from bridge.service import Bridge

    cfg = make_config(nats_url, stream_prefix, discovery={"mode": "kubernetes", "namespace": "infer"},
                      ingest={"l1": {"removalGrace": "200ms"}})
    kube.add(make_pod("vllm-0", "127.0.0.55"))
    bridge = Bridge(cfg, kube_client=api_client(kube))
    await bridge.start()
    try:
        await wait_for(lambda: {e.pod for e in bridge.subscribers} == {"127.0.0.55"}, 10, "subscribed by discovery")
        kube.delete("vllm-0")
        await wait_for(lambda: not bridge.subscribers, 10, "unsubscribed")
        js = bridge.nc.jetstream()
        name = cfg.nats.l1Stream.name

        async def removal_published():
            info = await js.stream_info(name)
            if not info.state.messages:
                return False
            msg = await js.get_msg(name, info.state.last_seq)
            body = msgpack.unpackb(msg.data)
            return (isinstance(body.pop("gen", None), int)  # the removal's mark
                    and body == {"v": 1, "type": "pod_removed", "pod": "127.0.0.55", "reason": "discovery"})
        await wait_for(removal_published, 10, "pod_removed on the stream")
    finally:
        await bridge.stop()


async def test_static_targets_file_is_reloaded_on_change(tmp_path):
    f = tmp_path / "targets.yaml"
    st = StaticTargets(f)
    assert st.changed() is None  # no file yet: nothing to change
    f.write_text("vllm:\n  - ip: 127.0.0.61\n    zmqPort: 7000\n    replayPort: 7100\n    dpRanks: 2\n")
    eps = st.changed().endpoints()
    assert [(e.pod, e.rank, e.pub, e.replay) for e in eps] == [
        ("127.0.0.61", 0, "tcp://127.0.0.61:7000", "tcp://127.0.0.61:7100"),
        ("127.0.0.61", 1, "tcp://127.0.0.61:7001", "tcp://127.0.0.61:7101")]
    assert st.changed() is None  # unchanged
    f.write_text("vllm:\n  - ip: 127.0.0.62\n")
    assert [e.pod for e in st.changed().endpoints()] == ["127.0.0.62"]
    f.write_text("vllm:\n  - ip: 127.0.0.63\n    bogus: 1\n")
    with pytest.raises(Exception, match="bogus"):
        st.changed()
    f.unlink()
    assert st.changed().endpoints() == []  # the file went away: no targets


async def test_mooncake_masters_by_label_and_port_name(kube):
    from bridge.k8s_discovery import master_targets

    cfg = DiscoveryConfig(mode="kubernetes", namespace="infer")
    master = make_pod("mooncake-master-0", "127.0.0.56", engine="none")
    master["metadata"]["labels"]["openfuyao.com/kvmanager"] = "mooncake"
    master["spec"]["containers"][0]["ports"] = [{"name": "rpc", "containerPort": 50051, "protocol": "TCP"},
                                                {"name": "http", "containerPort": 9010, "protocol": "TCP"}]
    kube.add(master)
    kube.add(make_pod("vllm-0", "127.0.0.57"))
    seen = Seen()
    d = KubernetesDiscovery(cfg, seen, api_client(kube), selector=cfg.mooncakeMaster.labelSelector,
                            mapper=lambda pod: master_targets(pod, cfg.mooncakeMaster))
    d.start()
    try:
        await wait_for(lambda: seen.current, 10, "the master")
        assert [(t.name, t.url) for t in seen.current] == [("mooncake-master-0", "http://127.0.0.56:9010")]
        no_name = copy.deepcopy(kube.pods["mooncake-master-0"])
        no_name["spec"]["containers"][0]["ports"] = []
        kube.modify(no_name)  # no port named http: the configured httpPort
        await wait_for(lambda: seen.current and seen.current[0].url == "http://127.0.0.56:9003", 10, "fallback port")
    finally:
        await d.stop()


def test_targets_errors_name_the_file_and_line(tmp_path):
    from bridge.static_targets import TargetsError, load_targets

    f = tmp_path / "targets.yaml"
    f.write_text("vllm:\n  - ip: 127.0.0.1\n  - ip: 127.0.0.2\n    dpRanks: zero\n")
    with pytest.raises(TargetsError, match=rf"{f}:4: vllm.1.dpRanks"):
        load_targets(f)
    f.write_text("vllm:\n  - ip: 127.0.0.1\n    name: [unclosed\n")
    with pytest.raises(TargetsError, match=rf"{f}:\d+: not valid YAML"):
        load_targets(f)


async def test_a_bad_reload_keeps_the_last_good_targets_and_is_counted(tmp_path, nats_url, stream_prefix, caplog):
    import logging

    import zmq.asyncio

    from bridge.service import Bridge
    from cache_indexer.simulate.vllm_engine import VllmPublisher

    f = tmp_path / "targets.yaml"
    ctx = zmq.asyncio.Context()
    engine = VllmPublisher(ctx, "127.0.0.1", 0, 0)
    f.write_text(f"vllm:\n  - ip: 127.0.0.64\n    host: 127.0.0.1\n    zmqPort: {engine.pub_port}\n")
    cfg = make_config(nats_url, stream_prefix, discovery={"mode": "static", "static": {"file": str(f)}},
                      ingest={"leaderElection": False})
    bridge = Bridge(cfg)
    await bridge.start()
    try:
        await engine.wait_subscribed(10)
        f.write_text("vllm:\n  - ip: 127.0.0.64\n    zmqPort: nope\n")
        await wait_for(lambda: bridge.metrics.targets_reload_errors._value.get() == 1, 10, "the bad version counted")
        assert {e.pod for e in bridge.subscribers} == {"127.0.0.64"}, "the last good targets stay"
        assert any(r.levelno == logging.ERROR and "keeping the last good" in r.getMessage() for r in caplog.records)
        caplog.clear()
        f.unlink()
        await wait_for(lambda: not bridge.subscribers, 10, "a removed file lists nothing")
        assert any(r.levelno == logging.WARNING and "was removed" in r.getMessage() for r in caplog.records)
    finally:
        await bridge.stop()
        await engine.close()
        ctx.term()
