"""vLLM pods from the Kubernetes API: one list, then a watch resumed from the last resourceVersion.

Only Running, Ready pods with an IP, not being deleted, whose ``pdRole`` label is one of the
configured roles become targets. Each pod yields one endpoint per data-parallel rank (ports + rank).
The endpoint carries the pod's epoch (uid and container restart count): a restarted container is a
new endpoint, so the bridge restarts its subscription, which publishes a reset and replays from 0.

The pods are listed once; then a watch (``timeoutSeconds = discovery.refreshInterval``, with
``allowWatchBookmarks``) follows from the list's resourceVersion, and each next watch resumes from the
last resourceVersion seen, an event's or a BOOKMARK's: the API server replays what changed meanwhile, so
nothing is lost and nothing is listed again. A bookmark moves the resume point on while none of our pods
changes, so the history the API server keeps (about 5 min) does not run out from under it. Only a 410
Gone (an ERROR event or an HTTP 410: that version is no longer kept) lists again; other errors back off
and resume. A watch that goes silent is given up after twice its timeout and resumed. A periodic full
list at 1,000 pods was a steady load on the API server (issue 38).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from types import SimpleNamespace

import aiohttp
from kubernetes_asyncio import client, config

from cache_indexer.bridge.mooncake_poller import MasterTarget
from cache_indexer.bridge.endpoint import Endpoint
from cache_indexer.infra.tasks import cancel_and_wait
from cache_indexer.schemas.config import DiscoveryConfig, MooncakeDiscoveryConfig, VllmDiscoveryConfig

log = logging.getLogger(__name__)

OnChange = Callable[[list[Endpoint]], Awaitable[None]]


#: how long watch events gather before the targets are published (a burst becomes one publish)
PUBLISH_AFTER = 0.1
#: pods per list page (``limit``; client-go's pager uses 500): a page, not the whole namespace, is in memory
LIST_PAGE = 500
#: bound on one list page's body: 128 KiB a pod on average
MAX_PAGE_BYTES = 64 << 20
#: bound on one watch event (a line): above the 1.5 MiB etcd keeps for an object, so only a broken server
#: or proxy sends more
MAX_EVENT_BYTES = 4 << 20
#: bound on the pods one selector tracks; more are left out (and logged): the memory is bounded
MAX_PODS = 10_000
#: bound on a resourceVersion (an opaque string to a client; etcd's are decimal integers)
MAX_RV_CHARS = 128
#: bound on a list page's round trip
LIST_TIMEOUT = 60.0


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


class Relist(Exception):
    """Only a list goes on from here."""


class WatchGone(Relist):
    """410 Gone: the resourceVersion to resume from is no longer kept."""


class EventTooLarge(Relist):
    """A watch event over MAX_EVENT_BYTES, dropped: resuming would meet it again, the list pages have room."""


class WatchFailed(Exception):
    """A list or watch that failed otherwise (an error status, a malformed event, a broken connection)."""


def _resource_version(obj: dict) -> str:
    meta = obj.get("metadata")
    rv = meta.get("resourceVersion") if isinstance(meta, dict) else None
    if not isinstance(rv, str) or not 0 < len(rv) <= MAX_RV_CHARS:
        raise WatchFailed(f"an event without a valid metadata.resourceVersion: {str(rv)[:MAX_RV_CHARS]!r}")
    return rv


async def _body(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """A response's body, at most ``limit`` bytes; an error status is raised (410 as WatchGone)."""
    data = bytearray()
    while chunk := await resp.content.read(min(1 << 20, limit + 1 - len(data))):
        data += chunk
        if len(data) > limit:
            raise WatchFailed(f"a response over {limit} bytes")
    _check_status(resp.status, bytes(data))
    return bytes(data)


def _check_status(status: int, body: bytes) -> None:
    if 200 <= status < 300:
        return
    try:
        message = str(json.loads(body).get("message", ""))[:200]
    except (ValueError, AttributeError):
        message = body[:200].decode("utf-8", "replace")
    if status == 410:
        raise WatchGone(f"410 Gone: {message}")
    raise WatchFailed(f"HTTP {status}: {message}")


async def _lines(resp: aiohttp.ClientResponse, limit: int) -> AsyncIterator[bytes]:
    """The lines of a watch's body, each at most ``limit`` bytes (never more is buffered)."""
    buf = bytearray()
    while chunk := await resp.content.readany():
        start = len(buf)
        buf += chunk
        end = buf.find(b"\n", start)
        while end >= 0:
            if end > limit:
                raise EventTooLarge(f"a watch event over {limit} bytes")
            line = bytes(buf[:end])
            del buf[:end + 1]
            if line.strip():
                yield line
            end = buf.find(b"\n")
        if len(buf) > limit:
            raise EventTooLarge(f"a watch event over {limit} bytes")
    if buf.strip():
        raise WatchFailed("the watch ended inside an event")


class KubernetesDiscovery:
    """List + watch of the pods matching ``selector``; ``mapper`` turns a pod into targets (vLLM
    endpoints by default, Mooncake masters with ``master_targets``)."""

    #: the wait after a failed list or watch, doubling up to ``backoff_max`` (reset by a good watch)
    backoff_initial = 1.0
    backoff_max = 30.0

    def __init__(self, cfg: DiscoveryConfig, on_change: OnChange, api_client: client.ApiClient | None = None,
                 selector: dict[str, str] | None = None, mapper=None, metrics=None, kind: str = "vllm") -> None:
        self.cfg = cfg
        self.on_change = on_change
        self.selector = selector if selector is not None else cfg.vllm.labelSelector
        self.mapper = mapper or (lambda pod: pod_endpoints(pod, cfg.vllm))
        self._api_client = api_client
        self.pods: dict[str, object] = {}  # uid -> pod
        #: where the next watch resumes: the last resourceVersion seen (None: list first)
        self.resource_version: str | None = None
        self.lists = 0  # list operations (each may be several pages)
        self.watches = 0
        #: counters of lists and watches (infra.metrics), labelled by what this discovers
        self._counted = (metrics.discovery_lists.labels(kind), metrics.discovery_watches.labels(kind)) \
            if metrics is not None else None
        self._errors = metrics.task_errors.labels("k8s-discovery") if metrics is not None else None
        self._task: asyncio.Task | None = None
        self._last: list[Endpoint] | None = None
        self._dirty = False
        self._publishing: asyncio.Task | None = None
        self._publish_lock = asyncio.Lock()
        self._over_cap = False

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
        async with self._publish_lock:  # the list's publish and the events' never interleave
            eps = sorted((t for pod in self.pods.values() for t in self.mapper(pod)), key=repr)
            if eps != self._last:
                self._last = None  # published once on_change took it: a failure is published again
                await self.on_change(eps)
                self._last = eps

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
            except Exception:  # the next event or round publishes again; never a silent end
                self._count()
                log.exception("kubernetes discovery: publishing the targets failed")

    def _keep(self, pods: dict[str, object], pod) -> None:
        """``pods[uid] = pod`` within MAX_PODS (a pod over the bound is left out, and logged once)."""
        uid = pod.metadata.uid if pod.metadata is not None else None
        if not isinstance(uid, str) or not uid:
            raise WatchFailed("a pod without metadata.uid")
        if uid not in pods and len(pods) >= MAX_PODS:
            if not self._over_cap:
                self._over_cap = True
                log.error("kubernetes discovery (%s): over %d pods; the pods beyond are left out",
                          label_selector(self.selector), MAX_PODS)
            return
        pods[uid] = pod

    def _count(self) -> None:
        if self._errors is not None:
            self._errors.inc()

    async def _loop(self) -> None:
        api = None
        loop = asyncio.get_running_loop()
        backoff = self.backoff_initial
        listed_at = -float("inf")
        while True:
            try:
                if api is None:  # in the guard: no kube config yet must not end discovery silently
                    api = client.CoreV1Api(await self._client())
                if self.resource_version is None:
                    listed_at = loop.time()
                    await self._list(api)
                elif self._last is None:  # the last publish failed: again, once a round
                    self._changed()
                if await self._watch(api):
                    backoff = self.backoff_initial
                    continue
                raise WatchFailed("the watch ended at once, with nothing")
            except asyncio.CancelledError:
                raise
            except Relist as exc:
                self.resource_version = None
                if loop.time() - listed_at >= backoff:  # lists again at once, but not again and again
                    log.log(logging.INFO if isinstance(exc, WatchGone) else logging.WARNING,
                            "kubernetes discovery (%s): %s; listing again", label_selector(self.selector), exc)
                    continue
                log.warning("kubernetes discovery (%s): %s right after a list; listing again in %.1fs",
                            label_selector(self.selector), exc, backoff)
            except Exception as exc:
                self._count()
                after = "listing" if self.resource_version is None else f"resuming from {self.resource_version}"
                if api is None:  # once a backoff (it doubles up to backoff_max): throttled
                    log.error("kubernetes discovery (%s): no API client (%s: %s); trying again in %.1fs",
                              label_selector(self.selector), type(exc).__name__, exc, backoff)
                else:
                    log.warning("kubernetes discovery (%s): %s; %s in %.1fs", label_selector(self.selector),
                                str(exc) or type(exc).__name__, after, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.backoff_max)

    async def _list(self, api: client.CoreV1Api) -> None:
        """Every pod of the selector, page by page of one snapshot; the watch goes on from its version."""
        self.lists += 1
        if self._counted:
            self._counted[0].inc()
        pods: dict[str, object] = {}
        self._over_cap = False
        token = None
        while True:
            resp = await api.list_namespaced_pod(
                self.cfg.namespace or "default", label_selector=label_selector(self.selector), limit=LIST_PAGE,
                _continue=token, _preload_content=False, _request_timeout=LIST_TIMEOUT)
            try:
                page = self._api_client.deserialize(SimpleNamespace(data=await _body(resp, MAX_PAGE_BYTES)),
                                                    "V1PodList")
            finally:
                resp.release()
            for pod in page.items or []:
                self._keep(pods, pod)
            token = page.metadata._continue if page.metadata is not None else None
            if not token:
                break
        rv = page.metadata.resource_version if page.metadata is not None else None
        if not isinstance(rv, str) or not 0 < len(rv) <= MAX_RV_CHARS:
            raise WatchFailed(f"a list without a valid resourceVersion: {str(rv)[:MAX_RV_CHARS]!r}")
        self.pods = pods
        self.resource_version = rv
        log.info("kubernetes discovery (%s): listed %d pods at resourceVersion %s",
                 label_selector(self.selector), len(pods), rv)
        await self._publish()

    async def _watch(self, api: client.CoreV1Api) -> bool:
        """One watch from ``resource_version`` until the API server ends it; False when it ended at once
        with nothing (a server that does so must not make a busy loop)."""
        self.watches += 1
        if self._counted:
            self._counted[1].inc()
        timeout = max(1, int(self.cfg.refreshInterval))
        loop = asyncio.get_running_loop()
        began, got = loop.time(), False
        try:
            async with asyncio.timeout(2 * timeout):  # the server ends it at ``timeout``: silent past that
                resp = await api.list_namespaced_pod(
                    self.cfg.namespace or "default", label_selector=label_selector(self.selector), watch=True,
                    allow_watch_bookmarks=True, resource_version=self.resource_version, timeout_seconds=timeout,
                    _preload_content=False)
                done = False
                try:
                    if not 200 <= resp.status < 300:
                        await _body(resp, 64 << 10)
                    async for line in _lines(resp, MAX_EVENT_BYTES):
                        got = True
                        self._apply(line)
                    done = True
                finally:
                    if done:
                        resp.release()  # the connection serves the next watch
                    else:
                        resp.close()
        except TimeoutError:
            log.info("kubernetes discovery (%s): the watch went silent for %ds; resuming from %s",
                     label_selector(self.selector), 2 * timeout, self.resource_version)
            return True
        return got or loop.time() - began >= 1.0

    def _apply(self, line: bytes) -> None:
        """One watch event: the pods, and the resourceVersion to resume from, move on."""
        try:
            event = json.loads(line)
        except ValueError:
            raise WatchFailed(f"a watch event that is not JSON: {line[:100]!r}") from None
        obj = event.get("object") if isinstance(event, dict) else None
        kind = event.get("type") if isinstance(event, dict) else None
        if not isinstance(obj, dict) or not isinstance(kind, str):
            raise WatchFailed(f"a malformed watch event: {line[:100]!r}")
        if kind == "ERROR":
            message = str(obj.get("message", ""))[:200]
            if obj.get("code") == 410:
                raise WatchGone(f"410 Gone: {message}")
            raise WatchFailed(f"watch error {str(obj.get('code'))[:10]} {str(obj.get('reason'))[:50]}: {message}")
        rv = _resource_version(obj)
        if kind in ("ADDED", "MODIFIED", "DELETED"):
            pod = self._api_client.deserialize(SimpleNamespace(data=json.dumps(obj)), "V1Pod")
            if kind == "DELETED":
                if pod.metadata is not None:
                    self.pods.pop(pod.metadata.uid, None)
            else:
                self._keep(self.pods, pod)
            self._changed()
        elif kind != "BOOKMARK":
            log.warning("kubernetes discovery: watch event of unknown type %r ignored", kind[:20])
        self.resource_version = rv
