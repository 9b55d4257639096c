"""vLLM pods from the Kubernetes API: list + watch by label, with a periodic relist.

Only Running, Ready pods with an IP, not being deleted, whose ``pdRole`` label is one of the
configured roles become targets. Each pod yields one endpoint per data-parallel rank (ports + rank).
The endpoint carries the pod's epoch (uid and container restart count): a restarted container is a
new endpoint, so the bridge restarts its subscription, which publishes a reset and replays from 0.

The watch runs with ``timeout_seconds = discovery.refreshInterval``: whatever happens to a watch (a
silent stall, a 410 Gone, a broken connection), the view is rebuilt from a fresh list at least that
often.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from kubernetes_asyncio import client, config, watch
from kubernetes_asyncio.client.exceptions import ApiException

from bridge.mooncake_poller import MasterTarget
from bridge.endpoint import Endpoint
from infra.tasks import cancel_and_wait
from schemas.config import DiscoveryConfig, MooncakeDiscoveryConfig, VllmDiscoveryConfig

log = logging.getLogger(__name__)

OnChange = Callable[[list[Endpoint]], Awaitable[None]]


#: how long watch events gather before the targets are published (a burst becomes one publish)
PUBLISH_AFTER = 0.1


def label_selector(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def _port(pod, name: str) -> int | None:
    for c in pod.spec.containers or []:
        for p in c.ports or []:
            if p.name == name:
                return p.container_port
    return None


def _ready(pod) -> bool:
    if pod.metadata.deletion_timestamp is not None or pod.status is None:
        return False
    if pod.status.phase != "Running" or not pod.status.pod_ip:
        return False
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


def pod_endpoints(pod, cfg: VllmDiscoveryConfig) -> list[Endpoint]:
    """The ZMQ endpoints of one pod, or [] when it is not (yet) a target."""
    labels = pod.metadata.labels or {}
    if any(labels.get(k) != v for k, v in cfg.labelSelector.items()):
        return []
    if cfg.pdRoles and labels.get(cfg.pdRoleLabel) not in cfg.pdRoles:
        return []
    if not _ready(pod):
        return []
    ip = pod.status.pod_ip
    pub = _port(pod, cfg.zmqPortName) or cfg.zmqPort
    replay = _port(pod, cfg.replayPortName) or cfg.replayPort
    ranks = cfg.dpRanks
    raw = (pod.metadata.annotations or {}).get(cfg.dpRanksAnnotation)
    if raw:
        try:
            ranks = max(1, int(raw))
        except ValueError:
            log.warning("pod %s: annotation %s=%r is not an integer", pod.metadata.name, cfg.dpRanksAnnotation, raw)
    restarts = sum(cs.restart_count or 0 for cs in pod.status.container_statuses or [])
    epoch = f"{pod.metadata.uid}:{restarts}"
    host = f"[{ip}]" if ":" in ip else ip
    return [Endpoint(pod=ip, rank=r, pub=f"tcp://{host}:{pub + r}",
                     replay=f"tcp://{host}:{replay + r}" if replay else None,
                     name=pod.metadata.name, epoch=epoch)
            for r in range(ranks)]


def master_targets(pod, cfg: MooncakeDiscoveryConfig, scheme: str = "http") -> list[MasterTarget]:
    """A Running, Ready Mooncake Master pod's admin HTTP endpoint (port by name, else the configured one)."""
    labels = pod.metadata.labels or {}
    if any(labels.get(k) != v for k, v in cfg.labelSelector.items()) or not _ready(pod):
        return []
    ip = pod.status.pod_ip
    host = f"[{ip}]" if ":" in ip else ip
    port = _port(pod, cfg.httpPortName) or cfg.httpPort
    return [MasterTarget(name=pod.metadata.name, url=f"{scheme}://{host}:{port}")]


class KubernetesDiscovery:
    """List + watch of the pods matching ``selector``; ``mapper`` turns a pod into targets (vLLM
    endpoints by default, Mooncake masters with ``master_targets``)."""

    def __init__(self, cfg: DiscoveryConfig, on_change: OnChange, api_client: client.ApiClient | None = None,
                 selector: dict[str, str] | None = None, mapper=None) -> None:
        self.cfg = cfg
        self.on_change = on_change
        self.selector = selector if selector is not None else cfg.vllm.labelSelector
        self.mapper = mapper or (lambda pod: pod_endpoints(pod, cfg.vllm))
        self._api_client = api_client
        self.pods: dict[str, object] = {}  # uid -> pod
        self._task: asyncio.Task | None = None
        self._last: list[Endpoint] | None = None
        self._dirty = False
        self._publishing: asyncio.Task | None = None

    async def _client(self) -> client.ApiClient:
        if self._api_client is None:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                await config.load_kube_config()
            self._api_client = client.ApiClient()
        return self._api_client

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name=f"k8s-discovery-{label_selector(self.selector)}")

    async def stop(self) -> None:
        if self._task:
            await cancel_and_wait(self._task, self._publishing)
        if self._api_client is not None:
            await self._api_client.close()

    async def _publish(self) -> None:
        eps = sorted((t for pod in self.pods.values() for t in self.mapper(pod)), key=repr)
        if eps != self._last:
            self._last = eps
            await self.on_change(eps)

    def _changed(self) -> None:
        """A watch event: the targets are published once the events at hand are read. A burst (a rolling
        update, a node drained, 1,000 pods deleted) is one publish, not one per event: each maps every
        pod and the bridge reconciles every target, so a publish per event cost O(pods) per event (the
        bridge's loop held up to 0.5 s at a time while 1,000 pods left)."""
        self._dirty = True
        if self._publishing is None or self._publishing.done():
            self._publishing = asyncio.create_task(self._publish_changes(), name="k8s-discovery-publish")

    async def _publish_changes(self) -> None:
        while self._dirty:
            await asyncio.sleep(PUBLISH_AFTER)
            self._dirty = False
            try:
                await self._publish()
            except asyncio.CancelledError:
                raise
            except Exception:  # the next event publishes again; never a silent end
                log.exception("kubernetes discovery: publishing the targets failed")

    async def _loop(self) -> None:
        api = client.CoreV1Api(await self._client())
        ns = self.cfg.namespace or "default"
        selector = label_selector(self.selector)
        backoff = 1.0
        while True:
            try:
                listed = await api.list_namespaced_pod(ns, label_selector=selector)
                self.pods = {p.metadata.uid: p for p in listed.items}
                await self._publish()
                backoff = 1.0
                w = watch.Watch()
                async with w:
                    async for event in w.stream(api.list_namespaced_pod, ns, label_selector=selector,
                                                resource_version=listed.metadata.resource_version,
                                                timeout_seconds=max(1, int(self.cfg.refreshInterval))):
                        pod = event["object"]
                        if event["type"] == "DELETED":
                            self.pods.pop(pod.metadata.uid, None)
                        elif event["type"] in ("ADDED", "MODIFIED"):
                            self.pods[pod.metadata.uid] = pod
                        self._changed()
            except asyncio.CancelledError:
                raise
            except ApiException as exc:
                if exc.status == 410:
                    log.info("watch expired (410 Gone): relisting")
                    continue
                log.warning("kubernetes API error %s: %s; relisting in %.0fs", exc.status, exc.reason, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30.0)
            except Exception as exc:
                log.warning("kubernetes discovery: %s; relisting in %.0fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30.0)
