"""The bridge process: keeps one subscriber per discovered or registered vLLM endpoint and relays into
JetStream. Registered engines (``POST /register``, infra/registrations.py) are targets like discovered
pods, named by their instance id.

When an endpoint's pod leaves discovery the bridge stops its subscribers and, once it has stayed away
for ``ingest.l1.removalGrace`` (a readiness flap is not a departure: back within it, the engine resumes
where it stopped), publishes ``pod_removed`` on the stream, so every indexer drops the pod through the
same ordered log; an unregistered instance is removed at once. A rank that leaves while its pod stays
(unregistered alone, ``dpRanks`` shrunk) gets ``rank_removed``.

Several bridges run active/standby (``ingest.leaderElection``): only the holder of a KV lease
discovers and subscribes. All of them publishing everything would also be correct (message ids
dedupe identical batches), but each bridge starts its own sequence generation, so two writers make
indexers throw away the older one's work and double the stream traffic; a standby that resumes from
the stream costs one lease TTL of delay and nothing else. With ``ingest.sharded`` they all run active
instead, each publishing for its own share of the pods and masters (bridge/shard_leases.py), so
capacity grows with their number; a removal (pod, rank, master) stays pending at every one of them
until the stream shows it, and the holder of its shard's lease publishes it, so the death of the
bridge that owned the pod cannot skip it (bridge/removals.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid

import aiohttp
import zmq.asyncio
from nats.js.errors import NotFoundError

from cache_indexer.bridge.block_key_check import BlockKeyCheck
from cache_indexer.bridge.endpoint import Endpoint
from cache_indexer.bridge.jetstream_publisher import JetStreamPublisher
from cache_indexer.bridge.k8s_discovery import KubernetesDiscovery, master_targets
from cache_indexer.bridge.l1_publisher import L1Publisher, new_generation
from cache_indexer.bridge.l3_publisher import L3Publisher
from cache_indexer.bridge.mooncake_poller import MasterTarget, MooncakePoller
from cache_indexer.bridge.receive_budget import ReceiveBudget
from cache_indexer.bridge.removals import MASTER, POD, PendingRemovals
from cache_indexer.bridge.resume_points import ResumePoints
from cache_indexer.bridge.shard_leases import ShardLeases
from cache_indexer.bridge.static_targets import StaticTargets
from cache_indexer.bridge.stream_connection import StreamConnection
from cache_indexer.bridge.vllm_subscriber import VllmSubscriber
from cache_indexer.infra.block_key_verdicts import write_verdict
from cache_indexer.infra.event_codec import codec
from cache_indexer.infra.lease import Lease
from cache_indexer.infra.log_format import describe
from cache_indexer.infra.metrics import Metrics
from cache_indexer.infra.registrations import Registration, RegistrationStore
from cache_indexer.infra.streams import (INCARNATION, connect, ensure_again, ensure_l1_stream, ensure_l3_stream,
                                         generations_lost_before, leader_answered, name_anew, patiently,
                                         records_bucket, stream_id)
from cache_indexer.infra.targets_record import TargetsRecord, read_ranks
from cache_indexer.infra.tasks import cancel_and_wait
from cache_indexer.infra.throttled_log import ThrottledWarning
from cache_indexer.infra.ticks import sleep_on_grid, wait_on_grid
from cache_indexer.schemas.config import Config

log = logging.getLogger(__name__)

#: A lost stream is looked for at most this often (a publish to it fails once per message).
_RESTORE_EVERY = 2.0
#: How often the streams are looked at without a sign of their loss: a stream created again (by a
#: replica, another bridge, an operator) whose sequence has passed the last this bridge was acked gives
#: none in the acks (bridge/jetstream_publisher.py); the message at that sequence then is another.
STREAMS_CHECK_EVERY = 30.0
#: Bytes of a message's limit kept for its headers (ours take about 300).
_HEADER_ROOM = 1024
#: A subscription without a connection to its engine for longer makes the bridge not ready: a pod that
#: discovery lists as ready but whose events cannot be received is a blind spot to see, not to guess.
DISCONNECTED_UNREADY_AFTER = 60.0
#: Sockets the bridge's ZMQ context may open (two per engine rank, and libzmq's own)
MAX_ZMQ_SOCKETS = 65536
#: Seconds before subscriptions that could not start (an endpoint libzmq refuses, no file descriptors
#: left, NATS away for the resume position) are tried again, doubling while they keep failing up to
#: SUBSCRIBE_RETRY_MAX; discovery's next change tries them too.
SUBSCRIBE_RETRY, SUBSCRIBE_RETRY_MAX = 5.0, 60.0


class Bridge:
    def __init__(self, cfg: Config, metrics: Metrics | None = None, kube_client=None) -> None:
        self.cfg = cfg
        self.metrics = metrics or Metrics()
        self.ctx = zmq.asyncio.Context()
        # libzmq's default is 1,023 sockets a context: a SUB and a replay DEALER per endpoint stopped a
        # bridge at about 500 engine ranks (bench fleet); the file descriptor limit is the real bound
        self.ctx.max_sockets = MAX_ZMQ_SOCKETS
        self.subscribers: dict[Endpoint, VllmSubscriber] = {}
        self.nc = None
        #: the connection the stream messages go on (bridge/stream_connection.py); the rest uses ``nc``
        self.stream_conn: StreamConnection | None = None
        self.publisher: JetStreamPublisher | None = None
        self.l1: L1Publisher | None = None
        self._replay_slots = asyncio.Semaphore(cfg.ingest.l1.maxConcurrentReplays)
        self.receive_budget = ReceiveBudget(cfg.ingest.l1.maxBufferedBytes)
        self.metrics.bridge_buffered_bytes.set_function(lambda: self.receive_budget.taken)
        interval = cfg.ingest.l1.blockKeyCheckInterval
        self.block_key_check = BlockKeyCheck(cfg.blockKey, self.metrics, interval, self._record_verdict) if interval else None
        self._verdict_writes: set[asyncio.Task] = set()
        self._watch_task: asyncio.Task | None = None
        #: what discovery and the registrations list, all of it (a sharded bridge subscribes to its share)
        self._endpoints: list[Endpoint] = []
        self._discovered: list[Endpoint] | None = None  # discovery's last answer (None: none yet)
        self._registered: list[Endpoint] | None = None  # the registrations' (None: not read yet)
        self._registered_pods: set[str] = set()
        #: pods that left discovery -> when their grace ends (``ingest.l1.removalGrace``)
        self._leaving: dict[str, float] = {}
        self._leaving_task: asyncio.Task | None = None
        #: the ranks each pod was listed with (a rank gone from a pod still listed is removed alone)
        self._ranks: dict[str, set[int]] = {}
        self._targets_lock = asyncio.Lock()
        self.registrations: RegistrationStore | None = None
        self._masters: list[MasterTarget] = []
        self._discovered_pods: set[str] = set()
        self._discovered_masters: set[str] = set()
        self.shards: ShardLeases | None = None
        #: sharded: the removals not on the stream yet (bridge/removals.py); None: published at once
        self.removals: PendingRemovals | None = None
        self._settle_now = asyncio.Event()
        #: a removal was stored: the targets record, which kept its pod or rank until then, is written again
        self._record_stale = False
        #: discovery and shard changes both reconcile subscriptions and pollers: one at a time, or two
        #: could each start a subscriber for the same endpoint while the other awaits
        self._reconciling = asyncio.Lock()
        self._kube_client = kube_client  # a kubernetes_asyncio ApiClient; None: in-cluster or kubeconfig
        self.discovery: KubernetesDiscovery | None = None
        self.master_discovery: KubernetesDiscovery | None = None
        self.pollers: dict[MasterTarget, MooncakePoller] = {}
        #: looks at the streams when told (``_stream_lost``) and every STREAMS_CHECK_EVERY
        self._streams_task: asyncio.Task | None = None
        self._stream_doubt = asyncio.Event()
        #: streams an ack showed a sequence that went back on: they lost what they held
        self._went_back: set[str] = set()
        #: each tier's stream's name (``stream_id``) as this bridge publishes to it
        self._stream_ids: dict[str, str] = {}
        #: tiers whose stream lost its messages under its name, and naming it anew failed: tried again
        self._unnamed: set[str] = set()
        self._streams_unchecked = ThrottledWarning(log)
        #: subscriptions whose start failed are tried again by this task, after ``_subscribe_retry``
        self._resubscribing: asyncio.Task | None = None
        self._subscribe_retry = SUBSCRIBE_RETRY
        self.l3: L3Publisher | None = None
        self._http = None
        self.lease: Lease | None = None
        self._lease_task: asyncio.Task | None = None
        self.targets_record: TargetsRecord | None = None
        self.resume_points: ResumePoints | None = None
        # what the previous leader (or this bridge before a restart) published for and discovery may no
        # longer list: removed on the first discovery result, as if they had left while we watched
        self._inherited_pods: set[str] = set()
        self._inherited_masters: set[str] = set()
        #: gone masters whose empty full state is not stored yet (not sharded: tried again each round;
        #: sharded bridges keep theirs in ``removals``)
        self._masters_unremoved: set[str] = set()
        self._master_removal_failed = ThrottledWarning(log)

    async def start(self) -> None:
        self.nc = await connect(self.cfg.nats, name="cache-indexer-bridge", disconnected_cb=self._nats_lost)
        js = self.nc.jetstream()
        l1_info = await patiently(lambda: ensure_l1_stream(js, self.cfg.nats), "stream set-up")
        l3_info = await patiently(lambda: ensure_l3_stream(js, self.cfg.nats), "stream set-up")
        self._stream_ids = {"l1": stream_id(l1_info), "l3": stream_id(l3_info)}
        self.resume_points = ResumePoints(js, records_bucket(self.cfg), self.cfg.nats.replicas,
                                          self.cfg.ingest.l1.resumeInterval)
        self.resume_points.stream_id = stream_id(l1_info)
        self.resume_points.start()
        self.stream_conn = StreamConnection(self.cfg.nats, "cache-indexer-bridge-streams",
                                            on_lost=self._stream_conn_lost, on_back=self._stream_conn_back)
        await self.stream_conn.connect()
        self.publisher = JetStreamPublisher(self.stream_conn, self.metrics, self.cfg.nats.publish.window,
                                            self.cfg.nats.publish.ackTimeout, on_stream_lost=self._stream_lost)
        await self.publisher.start()
        self._streams_task = asyncio.create_task(self._watch_streams(), name="bridge-streams")
        nc, nats, conn = self.nc, self.cfg.nats, self.stream_conn  # (conn: the messages' connection, its limit)
        holder = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.l1 = L1Publisher(self.publisher, nats.l1Stream.subjectPrefix, js, nats.l1Stream.name,
                              lambda: min(conn.max_payload, nats.l1Stream.maxMsgSize) - _HEADER_ROOM, holder,
                              self.resume_points, codec(nats.l1Stream.encoding))
        self.l1.on_removal_stored = self._targets_changed
        self.l1.on_stream_lost = self._stream_lost
        self.l1.lost_before = generations_lost_before(l1_info)  # a loss found by a bridge before this one
        self.l3 = L3Publisher(self.publisher, nats.l3Stream.subjectPrefix,
                              lambda: min(conn.max_payload, nats.l3Stream.maxMsgSize) - _HEADER_ROOM, self.metrics,
                              on_refused=self._l3_refused, codec=codec(nats.l3Stream.encoding), js=js,
                              stream=nats.l3Stream.name)
        self.targets_record = TargetsRecord(js, records_bucket(self.cfg), self.cfg.nats.replicas)
        self.registrations = RegistrationStore(js, records_bucket(self.cfg), self.cfg.nats.replicas,
                                               on_error=self.metrics.registration_errors.inc, nc=nc)
        if self.cfg.ingest.sharded:
            ttl = self.cfg.nats.lease.ttl
            self.shards = ShardLeases(js, self.cfg.nats.lease.bucket, holder, ttl, self.cfg.nats.replicas,
                                      self._on_owned, metrics=self.metrics)
            self.removals = PendingRemovals(js, self.cfg.nats, self.l1, self.l3, lambda s: s in self.shards.owned,
                                            check_every=ttl / 4, publish_every=ttl)
            self.shards.start()
            self.metrics.bridge_leader.set(1)  # every bridge is active, for its share
            await self._start_sources()
        elif self.cfg.ingest.leaderElection:
            self.lease = Lease(js, self.cfg.nats.lease.bucket, "bridge-l1-leader", holder, self.cfg.nats.lease.ttl,
                               self.cfg.nats.replicas)
            self.lease.start()
            self._lease_task = asyncio.create_task(self._follow_lease(), name="bridge-lease")
        else:
            self.metrics.bridge_leader.set(1)  # the only bridge: always the active one
            await self._start_sources()

    async def _nats_lost(self) -> None:
        if self.nc is not None and (self.nc.is_draining or self.nc.is_closed):
            return  # our own close at shutdown
        self.metrics.nats_disconnects.inc()

    def _stream_conn_lost(self) -> None:
        self.metrics.nats_disconnects.inc()
        if self.publisher is not None:
            self.publisher.connection_lost()

    def _stream_conn_back(self) -> None:
        """Publishes the lost connection took with it go out again now, not at their ack deadline."""
        if self.publisher is not None:
            self.publisher.reconnected()

    async def _follow_lease(self) -> None:
        while True:
            await self.lease.changed.wait()
            self.lease.changed.clear()
            self.metrics.bridge_leader.set(1 if self.lease.is_leader else 0)
            try:
                if self.lease.is_leader:
                    await self._start_sources()
                else:
                    await self._stop_sources()
            except Exception:  # this loop must outlive any one change, or leadership is no longer followed
                self.metrics.task_errors.labels("bridge-lease").inc()
                log.exception("following the bridge lease failed; trying again in %.0fs", SUBSCRIBE_RETRY)
                try:  # a half-made start is undone, then the change is taken again
                    await self._stop_sources()
                except Exception:
                    log.exception("stopping the bridge's sources failed")
                await asyncio.sleep(SUBSCRIBE_RETRY)
                self.lease.changed.set()

    def _record_verdict(self, pod: str, ok: bool, advice: str) -> None:
        """A pod's blockKey verdict changed: recorded for explain (a task of its own: the check runs in
        the receive path, which must not wait on NATS)."""
        if self.targets_record is None:
            return
        task = asyncio.get_running_loop().create_task(write_verdict(self.targets_record.store, pod, ok, advice),
                                                      name="blockkey-verdict")
        self._verdict_writes.add(task)
        task.add_done_callback(self._verdict_writes.discard)

    async def _start_sources(self) -> None:
        self._inherited_pods, self._inherited_masters = await self.targets_record.load()
        self._ranks = await self._recorded_ranks()
        self._leaving_task = asyncio.create_task(self._remove_when_due(), name="bridge-removal-grace")
        self.registrations.follow(self.set_registered)
        if self.cfg.discovery.mode == "static":
            self._watch_task = asyncio.create_task(self._watch_static(), name="bridge-static-targets")
        else:
            self.discovery = KubernetesDiscovery(self.cfg.discovery, self.set_endpoints, self._kube_client,
                                                 metrics=self.metrics)
            self.discovery.start()
            if self.cfg.ingest.l3.enabled:
                mc, scheme = self.cfg.discovery.mooncakeMaster, self.cfg.ingest.l3.scheme
                self.master_discovery = KubernetesDiscovery(self.cfg.discovery, self.set_masters, self._kube_client,
                                                            selector=mc.labelSelector,
                                                            mapper=lambda pod: master_targets(pod, mc, scheme),
                                                            metrics=self.metrics, kind="mooncake_master")
                self.master_discovery.start()

    async def _stop_sources(self) -> None:
        """Stop discovering and subscribing, without declaring any pod removed (standby)."""
        if self._resubscribing:
            await cancel_and_wait(self._resubscribing)
            self._resubscribing = None
        if self._watch_task:
            await cancel_and_wait(self._watch_task)
            self._watch_task = None
        for d in (self.discovery, self.master_discovery):
            if d:
                await d.stop()
        self.discovery = self.master_discovery = None
        if self.registrations is not None:
            await self.registrations.stop()
        if self._leaving_task:
            await cancel_and_wait(self._leaving_task)
            self._leaving_task = None
        self._leaving, self._ranks = {}, {}  # the next active bridge inherits the leaving pods from the record
        if self.removals is not None:
            self.removals.clear()  # the other bridges have them too
        self._discovered = self._registered = None
        self._registered_pods = set()
        for sub in self.subscribers.values():
            await sub.stop()
        self.subscribers.clear()
        self._endpoints, self._masters = [], []
        self._discovered_pods, self._discovered_masters = set(), set()
        self._masters_unremoved.clear()  # (the targets record keeps them for whoever relays next)
        for target, poller in self.pollers.items():
            await poller.stop()
            self.l3.forget(target.name)
        self.pollers.clear()

    def is_ready(self) -> bool:
        return self.publisher is not None and self._connected() and not self._cut_off()

    def _connected(self) -> bool:
        """Both NATS connections up: nats-py's, and the one the stream messages go on."""
        return (self.nc is not None and self.nc.is_connected and self.stream_conn is not None
                and self.stream_conn.is_connected)

    def _cut_off(self) -> list[Endpoint]:
        """Subscriptions that have had no connection to their engine for DISCONNECTED_UNREADY_AFTER."""
        limit = time.monotonic() - DISCONNECTED_UNREADY_AFTER
        return [ep for ep, sub in self.subscribers.items()
                if sub.disconnected_since is not None and sub.disconnected_since < limit]

    def not_ready_reason(self) -> str:
        cut = self._cut_off()
        if not self._connected() or not cut:
            return "not connected to NATS"
        names = ", ".join(f"{ep.pod} rank {ep.rank} ({ep.pub})" for ep in cut[:5])
        return f"no connection to {len(cut)} vLLM endpoint(s) for over {DISCONNECTED_UNREADY_AFTER:.0f}s: {names}"

    async def _watch_static(self) -> None:
        targets = StaticTargets(self.cfg.discovery.static.file, *self.cfg.discovery.static.extraFiles)
        interval = min(1.0, self.cfg.discovery.refreshInterval)
        while True:
            try:
                found = targets.changed()
            except Exception as exc:
                found = None
                self.metrics.targets_reload_errors.inc()
                log.error("targets file %s: %s (keeping the last good targets)", targets.path, exc)
            if found is not None:
                try:
                    for path in targets.vanished:  # the configured file; an extra one comes and goes
                        log.log(logging.WARNING if path == targets.path else logging.INFO,
                                "targets file %s was removed: unsubscribing every pod and master it listed", path)
                    await self.set_endpoints(found.endpoints())
                    if self.cfg.ingest.l3.enabled:
                        await self.set_masters([m.target(self.cfg.ingest.l3.scheme) for m in found.mooncakeMasters])
                except asyncio.CancelledError:
                    raise
                except Exception:  # read and valid, but not applied whole: applied again at the next look
                    targets.again()
                    self.metrics.task_errors.labels("static-targets").inc()
                    log.exception("applying targets file %s failed; trying again", targets.path)
            await sleep_on_grid(interval)

    async def _recorded_ranks(self) -> dict[str, set[int]]:
        """The ranks each pod was listed with when the record was last written: a rank gone meanwhile (while
        no bridge watched, or before this one read discovery) is removed like one that leaves now."""
        try:
            rows = await read_ranks(self.targets_record.store) or ()
        except Exception as exc:  # unreadable: only what leaves from now on is seen, as before the record
            log.warning("bridge targets record unreadable (%s): DP ranks gone meanwhile stay indexed", exc)
            return {}
        ranks: dict[str, set[int]] = {}
        for row in rows:
            try:
                ranks.setdefault(str(row[0]), set()).add(int(row[1]))
            except (TypeError, ValueError, IndexError):
                continue
        return ranks

    async def set_endpoints(self, endpoints: list[Endpoint]) -> None:
        """Discovery's answer (all of it, each time)."""
        self._discovered = list(endpoints)
        await self._reconcile_targets()

    async def set_registered(self, registrations: list[Registration]) -> None:
        """The registrations' (all of them, each time): endpoints named by the instance id."""
        self._registered = [Endpoint(pod=r.instance_id, rank=r.dp_rank, pub=r.endpoint, replay=r.replay_endpoint,
                                     name="registration") for r in registrations]
        await self._reconcile_targets()

    async def _reconcile_targets(self) -> None:
        """Subscribe to what this bridge publishes for (all of it, or its share), and publish pod_removed
        for pods that left (where sharded, pending until the stream shows it). The record of an earlier
        run's pods is settled once discovery and the registrations have both answered: before, a pod
        missing from one of them may be in the other."""
        async with self._targets_lock:
            endpoints = (self._discovered or []) + (self._registered or [])
            was_registered = self._registered_pods
            self._registered_pods = {e.pod for e in self._registered or []}
            self._endpoints = endpoints
            live = {e.pod for e in endpoints}
            whole = self._discovered is not None and self._registered is not None
            gone = (self._discovered_pods | (self._inherited_pods if whole else set())) - live
            self._discovered_pods = live
            if whole:
                self._inherited_pods = set()
            for pod in live & self._leaving.keys():
                del self._leaving[pod]
                log.info("%s is back within ingest.l1.removalGrace: it resumes where it stopped", pod,
                         extra={"pod": pod})
            if self.removals is not None:
                for e in endpoints:
                    self.removals.cancel("rank", e.pod, e.rank)
                    if self.removals.cancel("pod", e.pod):
                        log.info("%s is back before its removal reached the stream: not removed", e.pod,
                                 extra={"pod": e.pod})
            await self._subscribe_to(self._mine(endpoints))
            ranks: dict[str, set[int]] = {}
            for e in endpoints:
                ranks.setdefault(e.pod, set()).add(e.rank)
            for pod, now in ranks.items():
                for rank in sorted(self._ranks.get(pod, set()) - now):
                    reason = "unregistered" if pod in was_registered else "discovery"
                    if self.removals is not None:
                        self.removals.add("rank", pod, rank, reason)
                        self._settle_now.set()
                    else:
                        await self.l1.rank_removed(pod, rank, reason)
            grace = self.cfg.ingest.l1.removalGrace
            for pod in sorted(gone):
                if pod in was_registered or grace <= 0:
                    await self._remove_pod(pod, "unregistered" if pod in was_registered else "discovery")
                else:
                    self._leaving.setdefault(pod, time.monotonic() + grace)
                    self._settle_now.set()  # its grace is watched from now on (bridge._remove_when_due)
                    log.info("%s left discovery: removed in %.0fs unless it comes back", pod, grace, extra={"pod": pod})
            pending = self.removals.names("pod") if self.removals is not None else set()
            self._ranks = {pod: ranks.get(pod) or self._ranks.get(pod, set())
                           for pod in live | self._leaving.keys() | self._inherited_pods | pending}
            self._want_shards()
            if whole:
                await self._save_pods()

    def _pods_known(self) -> set[str]:
        """The pods listed, leaving, or whose removal is pending or not stored yet: the record's (what a
        bridge that starts removes if it is gone)."""
        pending = self.removals.names("pod") if self.removals is not None else set()
        unstored = {pod for pod, rank in self.l1.unstored_removals() if rank is None}
        return self._discovered_pods | self._leaving.keys() | pending | unstored

    def _ranks_unlisted(self) -> set[tuple[str, int]]:
        """DP ranks known but not listed: those whose removal is pending or not stored yet, and those of the
        pods in their grace or whose removal is pending. Kept in the record: a bridge killed (or losing its
        lease) now would otherwise take the only knowledge of them along, and a pod back with fewer ranks
        would keep the others indexed for ever."""
        ranks = {(pod, rank) for pod, rank in self.l1.unstored_removals() if rank is not None}
        if self.removals is not None:
            ranks |= {(r.name, r.rank) for r in self.removals.pending.values() if r.kind == "rank"}
        ranks |= {(pod, rank) for pod in self._pods_known() - self._discovered_pods
                  for rank in self._ranks.get(pod, ())}
        return ranks - {(e.pod, e.rank) for e in self._endpoints}

    async def _save_pods(self) -> None:
        self._record_stale = False
        await self.targets_record.save(pods=self._pods_known(), endpoints=self._endpoints,
                                       removing=self._ranks_unlisted())

    def _targets_changed(self) -> None:
        """A removal was stored (its pod or rank leaves the targets record), or a stream lost some (they
        come back to it while what they retired is in flight)."""
        self._record_stale = True
        self._settle_now.set()

    async def _remove_pod(self, pod: str, reason: str) -> None:
        """``pod_removed`` (where sharded, pending until it is on the stream: bridge/removals.py), and what
        the bridge kept for the pod goes; where pending, its ranks stay until then (back before it, with
        fewer ranks, the ones gone are removed: the pod's removal is cancelled)."""
        self._leaving.pop(pod, None)
        if self.removals is not None:
            self.removals.add("pod", pod, reason=reason)
            self._settle_now.set()
        else:
            self._ranks.pop(pod, None)
            await self.l1.pod_removed(pod, reason)
        if self.block_key_check is not None:
            self.block_key_check.forget(pod)

    async def _remove_when_due(self) -> None:
        """Pods whose grace ended without their coming back are removed, and where sharded the pending
        removals are settled (never dies: a failed round is logged and tried again). With no pod in its
        grace, nothing pending and the record written, it sleeps until told (``_settle_now``), not on its
        tick: one of an idle bridge's few wake-ups a second."""
        while True:
            grace = self.cfg.ingest.l1.removalGrace
            watching = bool(self._leaving) or self.removals is not None or self._record_stale or \
                bool(self._masters_unremoved)
            try:
                await asyncio.wait_for(self._settle_now.wait(), min(1.0, max(0.05, grace / 4)) if watching else None)
            except asyncio.TimeoutError:
                pass
            self._settle_now.clear()
            now = time.monotonic()
            due = [pod for pod, until in self._leaving.items() if until <= now]
            if not due and not (self.removals is not None and self.removals.due()) and not self._record_stale \
                    and not self._masters_unremoved:
                continue
            try:
                async with self._targets_lock:
                    for pod in sorted(due):
                        if pod in self._leaving and pod not in self._discovered_pods:
                            await self._remove_pod(pod, "discovery")
                    if self.removals is not None:
                        done = await self.removals.settle()
                        if done:
                            self._want_shards()
                        if any(r.kind == "master" for r in done):
                            await self.targets_record.save(masters=self._recorded_masters())
                    if self._masters_unremoved:
                        unremoved = set(self._masters_unremoved)
                        await self._remove_masters()
                        if self._masters_unremoved != unremoved:
                            await self.targets_record.save(masters=self._recorded_masters())
                    if self._discovered is not None and self._registered is not None:
                        await self._save_pods()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("removing pods after their grace failed; trying again")

    def _mine(self, endpoints: list[Endpoint]) -> list[Endpoint]:
        return endpoints if self.shards is None else [e for e in endpoints if POD + e.pod in self.shards.owned]

    def _want_shards(self) -> None:
        """The shards of what is listed, of the pods in their grace and of the removals pending (their
        holder publishes them)."""
        if self.shards is not None:
            self.shards.want({POD + p for p in self._discovered_pods | self._leaving.keys()}
                             | {MASTER + m for m in self._discovered_masters} | self.removals.shards())

    async def _on_owned(self, owned: set[str]) -> None:
        """The shards this bridge holds changed: follow them (what moved away is stopped before its
        lease is released; what arrived resumes from the stream)."""
        await self._subscribe_to(self._mine(self._endpoints))
        await self._poll(self._mine_masters(self._masters))

    async def _subscribe_to(self, endpoints: list[Endpoint]) -> None:
        async with self._reconciling:
            await self._subscribe_to_now(endpoints)

    async def _subscribe_to_now(self, endpoints: list[Endpoint]) -> None:
        wanted = set(endpoints)
        for ep in [e for e in self.subscribers if e not in wanted]:
            await self.subscribers.pop(ep).stop()
            log.info("unsubscribed %s rank %d (%s)", ep.pod, ep.rank, ep.pub, extra={"pod": ep.pod, "rank": ep.rank})
        failed = 0
        for ep in endpoints:
            if ep not in self.subscribers:
                sub = VllmSubscriber(self.ctx, ep, self.cfg.ingest.l1, self.l1, self.metrics, self._replay_slots,
                                     self.block_key_check, self.receive_budget)
                try:  # one endpoint that cannot start must not keep the others (nor the removals after) waiting
                    await sub.resume_from_stream()
                    sub.start()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    failed += 1
                    self.metrics.task_errors.labels("vllm-subscribe").inc()
                    log.error("subscribing to %s rank %d at %s failed (%s); trying again in %.0fs", ep.pod, ep.rank,
                              ep.pub, exc, self._subscribe_retry, extra={"pod": ep.pod, "rank": ep.rank})
                    continue
                self.subscribers[ep] = sub
                log.info("subscribed %s rank %d at %s (replay %s)", ep.pod, ep.rank, ep.pub, ep.replay or "off",
                         extra={"pod": ep.pod, "rank": ep.rank})
        if not failed:
            self._subscribe_retry = SUBSCRIBE_RETRY
        elif self._resubscribing is None or self._resubscribing.done():
            self._resubscribing = asyncio.create_task(self._subscribe_again(), name="bridge-resubscribe")

    async def _subscribe_again(self) -> None:
        """What could not start is tried again (what is wanted then: discovery may have moved on), until
        every wanted endpoint has its subscription; the wait doubles while the same keep failing."""
        await asyncio.sleep(self._subscribe_retry)
        self._subscribe_retry = min(2 * self._subscribe_retry, SUBSCRIBE_RETRY_MAX)
        self._resubscribing = None
        try:
            await self._subscribe_to(self._mine(self._endpoints))
        except asyncio.CancelledError:
            raise
        except Exception:
            self.metrics.task_errors.labels("vllm-subscribe").inc()
            log.exception("subscribing again failed")

    def _stream_lost(self, stream: str) -> None:
        """A publish found no stream (``stream`` ""), or an ack on ``stream`` named a sequence that went
        back: look at the streams."""
        if stream:
            self._went_back.add(stream)
        self._stream_doubt.set()

    async def _watch_streams(self) -> None:
        """Looks at the streams when a publish gives cause, at most every _RESTORE_EVERY (a publish to a
        lost stream fails once per message), and every STREAMS_CHECK_EVERY without one."""
        last = float("-inf")
        while True:
            await wait_on_grid(self._stream_doubt, STREAMS_CHECK_EVERY)
            await asyncio.sleep(max(0.0, last + _RESTORE_EVERY - time.monotonic()))
            last = time.monotonic()
            self._stream_doubt.clear()
            try:
                await self._restore_streams()
            except asyncio.CancelledError:
                raise
            except Exception:  # never fatal: a watcher that died would leave a lost stream unnoticed
                self.metrics.task_errors.labels("bridge-streams").inc()
                log.exception("looking at the streams failed; looking again")

    async def _restore_streams(self) -> None:
        """A stream gone (created again here), one an ack showed going back, or one whose message at the
        last sequence this bridge was acked is not the one it sent, lost what it held: every engine starts
        a new generation from its replay buffer, every master publishes its full state. Batches went on
        mid-generation on a stream created again by someone else (a replica, another bridge): without
        this, what they followed would be missing for good. (Not judged by the stream's creation time:
        nats-server 2.14 may change it across restarts after an update, nats-io/nats-server#8470.) Done
        between reconciles, so that a subscription starting meanwhile is started over too."""
        js = self.nc.jetstream()
        went_back, self._went_back = self._went_back, set()
        for tier, name in (("l1", self.cfg.nats.l1Stream.name), ("l3", self.cfg.nats.l3Stream.name)):
            # the last ack before the stream's info is asked: one that comes meanwhile may be of a message
            # stored after the server answered (a busy stream then looked as if it had lost it)
            acked = self.publisher.last_acked(name)
            try:
                info, recreated = await ensure_again(js, self.cfg.nats, tier)
                lost = recreated or name in went_back or await self._not_ours(js, name, info, acked)
            except Exception as exc:  # NATS away: looked at again the next round
                self.metrics.task_errors.labels("bridge-streams").inc()
                self._streams_unchecked("stream %s: cannot check or recreate it (%s); looking again", name,
                                        describe(exc))
                if name in went_back:
                    self._went_back.add(name)
                    self._stream_doubt.set()
                continue
            known, now = self._stream_ids.get(tier, ""), stream_id(info)
            # the generation the loss is found at, kept in the stream for the bridges after this one (none
            # begun before is resumed); a naming tried again keeps the first look's
            found_at = new_generation() if lost else self.l1.lost_before
            if not recreated and now == known and (lost or tier in self._unnamed):
                info = await self._name_anew(js, tier, info, found_at if tier == "l1" else None)
                if not lost and stream_id(info) != now and tier == "l1":  # named at a retry: the records follow
                    self.resume_points.stream_id = stream_id(info)
            else:
                if known and now != known and INCARNATION in (info.config.metadata or {}):
                    if tier not in self._unnamed:
                        # named anew by another bridge, or created again by someone: a loss here too
                        lost, found_at = True, new_generation()
                    elif tier == "l1":  # the loss this bridge failed to name, named since: started over already
                        self.resume_points.stream_id = now
                self._unnamed.discard(tier)
            self._stream_ids[tier] = stream_id(info)
            if not lost:
                continue
            if not recreated:
                log.error("stream %s lost what this bridge published to it (deleted or its storage lost, and "
                          "created again): every %s starts over", name, "engine" if tier == "l1" else "master")
            async with self._reconciling:
                self.metrics.streams_recreated.labels(name).inc()
                self.publisher.forget_stream(name)
                self._went_back.discard(name)  # acks of the new stream counted from the old one's
                if tier == "l1":  # positions on the lost stream mean nothing on the new one
                    self.resume_points.stream_id = stream_id(info)
                    self.l1.stream_lost(max(found_at, generations_lost_before(info)))
                    self._targets_changed()
                    for sub in self.subscribers.values():
                        sub.start_over()
                else:
                    for target, poller in self.pollers.items():
                        self.l3.forget(target.name)  # the subject's last sequence on the lost stream
                        poller.start_over()

    async def _name_anew(self, js, tier: str, info, lost_before: int | None):
        """The stream lost its messages but kept its name (its storage lost where a cluster kept its
        assignment, a backup restored): replicas, snapshots and resume records would take it for the stream
        they knew, and replicas would follow on from their old position, past all it holds. Named anew,
        it is the new stream it is to all of them. A failure is counted, logged, and tried again at the next
        look; the engines start over all the same."""
        try:
            named = await name_anew(js, info, lost_before)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._unnamed.add(tier)
            self.metrics.task_errors.labels("bridge-streams").inc()
            log.error("stream %s lost its messages but kept its name, and naming it anew failed (%s): replicas "
                      "take it for the stream they followed until it is; trying again", info.config.name,
                      getattr(exc, "description", None) or describe(exc))
            return info
        self._unnamed.discard(tier)
        log.error("stream %s lost its messages but kept its name (%s): named anew (%s), replicas rebuild from it",
                  info.config.name, stream_id(info), stream_id(named))
        return named

    async def _not_ours(self, js, name: str, info, acked: tuple[int, str] | None) -> bool:
        """Whether the stream lost ``acked``, the last message this bridge was acked on it before ``info``
        was asked: its sequence is past the stream's last, or the message there is another. One purged
        (behind a snapshot) tells nothing."""
        if acked is None:
            return False
        if not leader_answered(info):
            return False  # judged at the next look
        seq, msg_id = acked
        if info.state.last_seq < seq:
            return True
        try:
            msg = await js.get_msg(name, seq=seq)
        except NotFoundError:
            return False
        return (msg.headers or {}).get("Nats-Msg-Id") != msg_id

    def _l3_refused(self, master: str) -> None:
        """The stream refused a message of ``master`` for good: indexers would wait on its seq, so the
        master's next poll publishes its full state, which sets the order anew."""
        for target, poller in self.pollers.items():
            if target.name == master:
                poller.start_over()

    async def set_masters(self, masters: list[MasterTarget]) -> None:
        """Discovery's Mooncake masters: poll what this bridge polls (all, or its share); a master that is
        gone gets an empty full state (its L3 entries drop), from one bridge (where sharded, pending until
        it is on the stream: bridge/removals.py)."""
        async with self._targets_lock:
            self._masters = list(masters)
            names = {t.name for t in masters}
            gone = (self._discovered_masters | self._inherited_masters) - names
            self._discovered_masters, self._inherited_masters = names, set()
            await self._poll(self._mine_masters(masters))
            if self.removals is not None:
                for name in names:
                    self.removals.cancel("master", name)
            self._masters_unremoved -= names  # listed again: not removed after all
            for name in sorted(gone):
                log.info("mooncake master %s is gone: its L3 entries are dropped", name, extra={"master": name})
                if self.removals is not None:
                    self.removals.add("master", name)
                    self._settle_now.set()
                else:
                    self._masters_unremoved.add(name)
            await self._remove_masters()
            self._want_shards()
            await self.targets_record.save(masters=self._recorded_masters())

    def _recorded_masters(self) -> set[str]:
        """The masters the targets record keeps: those listed, and those gone whose removal is not stored yet
        (a bridge that starts from the record removes them)."""
        pending = self.removals.names("master") if self.removals is not None else set()
        return self._discovered_masters | pending | self._masters_unremoved

    async def _remove_masters(self) -> None:
        """Each gone master's empty full state (not sharded), one after the other; one not stored (NATS away,
        or refused) stays to be tried again by the next round of ``_remove_when_due``, and in the targets
        record, so that a bridge started meanwhile publishes it too."""
        for name in sorted(self._masters_unremoved):
            try:
                done = await self.l3.full(name, {})
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                done = False
                self._master_removal_failed("mooncake master %s: its removal was not stored (%s: %s); trying again",
                                            name, type(exc).__name__, exc)
            if not done:
                break  # NATS away, most likely: the others wait for the next round, not a timeout each
            self._masters_unremoved.discard(name)

    def _mine_masters(self, masters: list[MasterTarget]) -> list[MasterTarget]:
        return masters if self.shards is None else [m for m in masters if MASTER + m.name in self.shards.owned]

    async def _poll(self, masters: list[MasterTarget]) -> None:
        async with self._reconciling:
            await self._poll_now(masters)

    async def _poll_now(self, masters: list[MasterTarget]) -> None:
        if self._http is None:
            self._http = aiohttp.ClientSession()
        wanted = set(masters)
        for target in [t for t in self.pollers if t not in wanted]:
            await self.pollers.pop(target).stop()
            self.l3.forget(target.name)
            log.info("stopped polling mooncake master %s", target.name, extra={"master": target.name})
        for target in masters:
            if target not in self.pollers:
                poller = MooncakePoller(target, self.cfg.ingest.l3, self.l3, self.metrics, self._http,
                                        segments_timeout=self.cfg.discovery.segmentsFetchTimeout)
                poller.start()
                self.pollers[target] = poller
                log.info("polling mooncake master %s at %s", target.name, target.url, extra={"master": target.name})

    async def stop(self) -> None:
        if self._lease_task:
            await cancel_and_wait(self._lease_task)
        if self._streams_task:
            await cancel_and_wait(self._streams_task)
        await self._stop_sources()  # (the subscriptions' retry with them)
        # the last acks and resume records before the leases go: the next holder resumes from them
        if self.publisher:
            await self.publisher.flush(5.0)
        if self.resume_points is not None:
            await self.resume_points.stop()
        try:
            if self.lease:
                await self.lease.stop()
            if self.shards:
                await self.shards.stop()
        finally:  # the connections go whatever failed before
            if self.publisher:
                await self.publisher.close()
            if self.stream_conn is not None:
                await self.stream_conn.close()
            if self._http is not None:
                await self._http.close()
            if self.nc:
                await self.nc.drain()
            self.ctx.term()
