"""Prometheus metrics of all components, on one registry per process (or per test instance).

Every metric object exists in every process (code shared by the components may update any), but a
process's registry exports only its own component's families and the shared ones: a bridge shows no
``cache_indexer_ready``, an indexer no bridge gauges. ``local`` (and tests) export everything.
"""

from __future__ import annotations

import platform
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.metrics import MetricWrapperBase

from cache_indexer.infra.version import VERSION

Component = Literal["bridge", "indexer"]

#: Exported by every process: its HTTP server, event loop, NATS connection and records, its build.
SHARED = frozenset({
    "build_info", "http_header_timeouts", "http_headers_too_large", "loop_lag", "loop_lag_max", "loop_step",
    "loop_step_max", "streams_recreated", "nats_disconnects", "registration_errors", "task_errors"})
#: Exported by indexer replicas only: the hit-rate API, the index, ingest from the streams, snapshots.
INDEXER = frozenset({
    "http_requests", "http_latency", "hashed_blocks", "best_hit_ratio", "unknown_candidates",
    "registrations_refused", "index_blocks", "index_entries", "index_workers", "ingest_applied", "ingest_errors",
    "ingest_lost_gaps", "ingest_read_back", "ingest_consumer_restarts", "ingest_consumer_errors", "ingest_lag", "ingest_last_seq", "ready", "snapshot_loads",
    "snapshot_load_failures", "snapshot_writes", "snapshot_ingest_pause", "stream_reloads", "history_lost",
    "l3_out_of_order", "l3_incomplete_states"})
#: Exported by bridges only: vLLM subscriptions, Mooncake polls, publishing, the lease.
BRIDGE = frozenset({
    "bridge_batches", "bridge_block_events", "block_key_checks", "block_key_mismatched_pods", "bridge_malformed",
    "bridge_gaps", "bridge_replays", "bridge_resets", "publish_retries", "publish_inflight", "subscriptions",
    "subscriptions_disconnected", "bridge_resubscribes", "bridge_read_sweep_woken", "bridge_buffered_bytes", "l3_poll_errors",
    "l3_poller_restarts", "l3_unparsed_keys", "l3_unlocatable_keys", "l3_relocated_keys", "l3_batch_query",
    "l3_message_parts", "publish_refused", "l3_keys", "l3_poll_seconds", "targets_reload_errors", "bridge_leader",
    "discovery_lists", "discovery_watches"})
_OWN = {"bridge": BRIDGE, "indexer": INDEXER}

_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_LAG_BUCKETS = (0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    """``component``: the process's own families only (with the shared ones); None: all of them."""

    def __init__(self, component: Component | None = None) -> None:
        r = self.registry = CollectorRegistry()
        self.component = component
        p = "cache_indexer_"
        self.build_info = Gauge(p + "build_info", "Always 1: the version, Python, whether the C accelerators "
                                "are built (native) and the component of this process.",
                                ["version", "python", "native", "component"], registry=r)
        # API
        self.http_requests = Counter(p + "http_requests_total", "HTTP requests by path and status.",
                                     ["path", "status"], registry=r)
        self.http_header_timeouts = Counter(p + "http_header_timeouts_total",
                                            "Connections closed: request headers not complete within "
                                            "http.readHeaderTimeout.", registry=r)
        self.streams_recreated = Counter(p + "streams_recreated_total", "Streams found gone (deleted, storage lost) "
                                         "and created again; what they held is lost.", ["stream"], registry=r)
        self.nats_disconnects = Counter(p + "nats_disconnects_total", "Times a NATS connection was lost (a bridge has two: "
                                        "one for its stream messages).",
                                        registry=r)
        self.http_headers_too_large = Counter(p + "http_headers_too_large_total",
                                              "Connections refused (431): a request's header block over "
                                              "http.maxHeaderBytes.", registry=r)
        self.registration_errors = Counter(p + "registration_errors_total",
                                           "Registrations not followed: a lost watch of the records bucket, or a "
                                           "value that is not a registration.", registry=r)
        self.registrations_refused = Counter(p + "registrations_refused_total",
                                             "POST /register and /unregister refused, by reason.", ["reason"],
                                             registry=r)
        self.http_latency = Histogram(p + "http_request_duration_seconds", "HTTP request latency by path and status.",
                                      ["path", "status"], buckets=_LATENCY_BUCKETS, registry=r)
        self.hashed_blocks = Counter(p + "hit_rate_hashed_blocks_total", "Blocks hashed by hit-rate queries.", registry=r)
        self.best_hit_ratio = Histogram(p + "hit_rate_best_ratio", "Per answered query, the best ratio among its "
                                        "candidates, by tier: how much of the traffic could land on cached "
                                        "prefixes.", ["tier"], buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0),
                                        registry=r)
        self.unknown_candidates = Counter(p + "hit_rate_unknown_candidates_total",
                                          "Candidates no KV-cache event was seen for (a router naming pods by "
                                          "anything but the IP the bridge subscribes to shows up here).",
                                          registry=r)
        self.loop_lag = Histogram(p + "event_loop_lag_seconds", "How late the process's timers fired, the latest "
                                  "in each second (every timer it sets counts, and one of the monitor's own every "
                                  "second; wall clock: this process's own work, or waiting for a core).", buckets=_LAG_BUCKETS,
                                  registry=r)
        self.loop_lag_max = Gauge(p + "event_loop_lag_max_seconds", "The longest event_loop_lag_seconds of the last "
                                  "10 to 20 s.", registry=r)
        self.loop_step = Histogram(p + "event_loop_step_seconds", "Steps of the event loop (a task's step, an I/O "
                                   "callback) of 1 ms or more, in CPU time of the loop's thread: this process's "
                                   "own work, which a query arriving meanwhile waits for.", buckets=_LAG_BUCKETS,
                                   registry=r)
        self.loop_step_max = Gauge(p + "event_loop_step_max_seconds", "The longest event_loop_step_seconds of the "
                                   "last 10 to 20 s.", registry=r)
        # index / ingest
        self.index_blocks = Gauge(p + "index_blocks", "Block hashes held, by tier: distinct up to 64 workers, past "
                                  "that counted once per group of 64 workers holding them (the exact count walks "
                                  "the index).", ["tier"], registry=r)
        self.index_entries = Gauge(p + "index_entries", "(block, worker) entries held, by tier.", ["tier"], registry=r)
        self.index_workers = Gauge(p + "index_workers", "(pod, rank) workers with blocks, by tier.", ["tier"], registry=r)
        self.ingest_applied = Counter(p + "ingest_messages_total", "Stream messages applied, by stream.", ["stream"], registry=r)
        self.ingest_consumer_restarts = Counter(
            p + "ingest_consumer_restarts_total", "Ordered consumers of a stream made again, by stream and reason: gap (a "
            "message skipped), heartbeat (none for two intervals: the server restarted, the consumer was deleted), "
            "reconnect, status (an unexpected status message).", ["stream", "reason"], registry=r)
        self.ingest_consumer_errors = Counter(
            p + "ingest_consumer_errors_total", "Failures to make a stream's ordered consumer again or to answer its flow "
            "control (NATS away): each is tried again.", ["stream"], registry=r)
        self.ingest_errors = Counter(p + "ingest_malformed_messages_total", "Stream messages that could not be applied.",
                                     ["stream"], registry=r)
        self.ingest_lost_gaps = Counter(p + "ingest_lost_gaps_total", "L1 batches declared lost by the indexer (one never "
                                        "arrived within 30 s of stream time): the worker starts again after them.",
                                        registry=r)
        self.ingest_read_back = Counter(p + "ingest_read_back_total", "Early L1 messages read back from the stream: "
                                        "more arrived before a missing one than an indexer holds (2x "
                                        "nats.publish.window per worker); nothing is lost.", registry=r)
        self.ingest_lag = Gauge(p + "ingest_lag_messages", "Stream messages not yet applied, by stream.", ["stream"], registry=r)
        self.ingest_last_seq = Gauge(p + "ingest_last_stream_sequence", "Last applied stream sequence.", ["stream"], registry=r)
        self.ready = Gauge(p + "ready", "1 when the index has caught up with the streams.", registry=r)
        self.snapshot_loads = Counter(p + "snapshot_loads_total", "Snapshots loaded (start or reload).", registry=r)
        self.snapshot_load_failures = Counter(p + "snapshot_load_failures_total",
                                              "Snapshot reads that failed (object pruned or damaged while read).",
                                              registry=r)
        self.snapshot_writes = Counter(p + "snapshot_writes_total", "Snapshots written by this replica.", registry=r)
        self.snapshot_ingest_pause = Histogram(p + "snapshot_ingest_pause_seconds",
                                               "How long L1 ingest waited while a snapshot copied the tables "
                                               "(off the event loop: queries are answered meanwhile).",
                                               buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
                                               registry=r)
        self.stream_reloads = Counter(p + "stream_reloads_total", "Reloads after the next message was purged.", registry=r)
        self.history_lost = Counter(p + "stream_history_lost_total",
                                    "Times the stream's retained messages did not reach back to the index.", registry=r)
        # bridge
        self.bridge_batches = Counter(p + "bridge_batches_total", "vLLM batches seen by the bridge, by outcome "
                                      "(overflow: dropped for want of room, replayed later).",
                                      ["outcome"], registry=r)
        self.bridge_block_events = Counter(p + "bridge_block_events_total", "Block events published.", registry=r)
        self.block_key_checks = Counter(p + "block_key_checks_total",
                                        "Engine block hashes recomputed with blockKey, by result (match, mismatch).",
                                        ["result"], registry=r)
        self.block_key_mismatched_pods = Gauge(p + "block_key_mismatched_pods",
                                               "Pods whose last checked block hash did not match blockKey: their "
                                               "hit ratios are 0.", registry=r)
        self.bridge_malformed = Counter(p + "bridge_malformed_payloads_total", "vLLM payloads that could not be decoded.",
                                        registry=r)
        self.bridge_gaps = Counter(p + "bridge_seq_gaps_total", "vLLM sequence gaps detected.", registry=r)
        self.bridge_replays = Counter(p + "bridge_replays_total", "Replay requests to vLLM, by result.", ["result"], registry=r)
        self.bridge_resets = Counter(p + "bridge_resets_total", "Resets published, by reason.", ["reason"], registry=r)
        self.publish_retries = Counter(p + "bridge_publish_retries_total", "JetStream publishes re-sent.", registry=r)
        self.publish_inflight = Gauge(p + "bridge_publish_inflight", "Unacknowledged JetStream publishes.", registry=r)
        self.subscriptions = Gauge(p + "bridge_subscriptions", "Active vLLM ZMQ subscriptions.", registry=r)
        self.subscriptions_disconnected = Gauge(
            p + "bridge_subscriptions_disconnected", "vLLM ZMQ subscriptions without a connection to their engine now.",
            registry=r)
        self.bridge_read_sweep_woken = Counter(
            p + "bridge_read_sweep_wakeups_total", "Subscriptions woken by the read sweep: a message libzmq's signal "
            "did not announce, found late by up to the sweep's interval.", registry=r)
        self.bridge_resubscribes = Counter(
            p + "bridge_resubscribes_total", "SUB sockets made anew after libzmq gave a connection up (a message over "
            "ingest.l1.maxBatchBytes, or another protocol error).", registry=r)
        self.bridge_buffered_bytes = Gauge(p + "bridge_buffered_bytes", "Bytes of vLLM batches received and not "
                                           "yet published (bounded by ingest.l1.maxBufferedBytes).", registry=r)
        self.l3_poll_errors = Counter(p + "l3_poll_errors_total",
                                      "Mooncake master polls that failed, by reason (timeout, connection, "
                                      "malformed, publish, internal).", ["reason"], registry=r)
        self.l3_poller_restarts = Counter(p + "l3_poller_restarts_total",
                                          "Mooncake pollers that ended unexpectedly and were restarted.", registry=r)
        self.l3_unparsed_keys = Counter(p + "l3_unparsed_keys_total", "Mooncake keys without a usable block hash.",
                                        registry=r)
        self.l3_unlocatable_keys = Counter(p + "l3_unlocatable_keys_total",
                                           "Mooncake keys containing ',' that /batch_query_keys cannot be asked "
                                           "about (skipped rather than leased through /query_key).", registry=r)
        self.l3_relocated_keys = Counter(p + "l3_relocated_keys_total",
                                         "Known Mooncake keys located again, by why (segment, rolling).",
                                         ["why"], registry=r)
        self.l3_batch_query = Gauge(p + "l3_batch_query_keys", "1 while a Mooncake master is asked through the "
                                    "read-only /batch_query_keys, 0 while it falls back to /query_key.",
                                    ["master"], registry=r)
        self.l3_message_parts = Counter(p + "l3_message_parts_total", "L3 messages published, by kind; a state "
                                        "over the message limit is split into several.", ["kind"], registry=r)
        self.publish_refused = Counter(p + "bridge_publish_refused_total", "JetStream publishes that can never be "
                                       "stored (over the payload limit, refused by the stream): dropped, not "
                                       "retried, by reason.", ["reason"], registry=r)
        self.l3_out_of_order = Counter(p + "l3_diffs_refused_total", "L3 diffs refused by the indexer: a repeat, of an "
                                       "older bridge, or held too long for a missing one (the next full state "
                                       "puts the master right).", registry=r)
        self.l3_incomplete_states = Counter(p + "l3_incomplete_full_states_total", "L3 full states whose parts did "
                                            "not all arrive in order (dropped; the next full state repairs).",
                                            registry=r)
        self.l3_keys = Gauge(p + "l3_keys", "Keys tracked per Mooncake master.", ["master"], registry=r)
        self.l3_poll_seconds = Histogram(p + "l3_poll_seconds", "Duration of one Mooncake master poll.",
                                         buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10), registry=r)
        self.task_errors = Counter(p + "task_errors_total",
                                   "Failures a long-lived task caught, logged and went on from (tried again), by task: "
                                   "one that keeps rising names work that is not getting done.", ["task"], registry=r)
        self.targets_reload_errors = Counter(p + "targets_reload_errors_total",
                                             "Static targets file versions that could not be used (kept the last good).",
                                             registry=r)
        self.bridge_leader = Gauge(p + "bridge_leader", "1 while this bridge holds the ingest lease.", registry=r)
        self.discovery_lists = Counter(p + "discovery_lists_total", "Kubernetes pod LISTs by what is discovered "
                                       "(at start and after 410 Gone; steady watching lists nothing).", ["kind"],
                                       registry=r)
        self.discovery_watches = Counter(p + "discovery_watches_total", "Kubernetes pod watches opened (each "
                                         "resumes from the last resourceVersion).", ["kind"], registry=r)

        self._keep_own(component)
        ProcessCollector(registry=r)  # process_cpu_seconds_total, process_resident_memory_bytes, ...

    def _keep_own(self, component: Component | None) -> None:
        metrics = {name for name, value in vars(self).items() if isinstance(value, MetricWrapperBase)}
        unassigned = metrics - SHARED - INDEXER - BRIDGE
        if unassigned:  # a new metric must say which processes export it
            raise AssertionError(f"metrics in no component (infra/metrics.py SHARED, INDEXER, BRIDGE): {unassigned}")
        if component is None:
            return
        for name in metrics - SHARED - _OWN[component]:
            self.registry.unregister(getattr(self, name))

    def set_build_info(self, native: bool) -> None:
        """``native``: every C accelerator of the package is built (setup.py); the pure-Python paths are
        exact, only slower."""
        self.build_info.labels(version=VERSION, python=platform.python_version(), native="yes" if native else "no",
                               component=self.component or "local").set(1)

    def render(self) -> bytes:
        return generate_latest(self.registry)
