"""The Helm chart's values: the product's settings (schemas/config.py) plus the keys that shape the
Kubernetes objects, each with its description. ``charts/cache-indexer/values.schema.json`` is generated
from these models (``python -m cache_indexer.schemas.generate``): Helm applies it on install, upgrade, template and
lint, so a misspelled key fails there, named, instead of as a crash-looping pod.

Every key the chart owns is closed (``additionalProperties: false``); Kubernetes objects passed through
as they are (resources, affinity, security contexts, ...) are open, and so are ``global`` (shared with the
NATS sub-chart) and the NATS sub-chart's own keys under ``nats``. A key added to ``values.yaml`` needs
its field here (tests/test_chart.py renders the chart's own values against the schema)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, create_model

from cache_indexer.schemas.config import (BlockKeyConfig, DiscoveryConfig, Duration, HttpConfig, IngestConfig, LogConfig, NatsConfig,
                            SnapshotConfig, StreamConfig, setting)
from cache_indexer.schemas.helm_values import NATS_CHART_KEYS

#: A Kubernetes object (or list) passed into the manifests as it is.
KubeObject = dict[str, Any]


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ImageValues(_Closed):
    """The image of the indexers and bridges (build and push it: no public registry hosts it)."""

    repository: str = setting("cache-indexer", "Image repository.")
    tag: str = setting("", "Image tag; default: the chart's appVersion.")
    pullPolicy: Literal["Always", "IfNotPresent", "Never"] = setting("IfNotPresent", "Image pull policy.")


class GlobalValues(BaseModel):
    """Values Helm hands to every chart of the release, the NATS sub-chart's included (open: the
    sub-chart reads its own)."""

    model_config = ConfigDict(extra="allow")
    imageRegistry: str = setting("", "Prefix of every image, ours and the NATS sub-chart's (mirrored, offline "
                                     "clusters).")
    imagePullSecrets: list[KubeObject] = setting([], "Pull secrets of every pod, ours and the NATS sub-chart's.")


class ServiceValues(_Closed):
    """The Service the router calls: `http://<name>:<port>/kv-cache/hit-rate`."""

    name: str = setting("cache-indexer-service", "Service name, whatever the release name.")
    type: str = setting("ClusterIP", "Service type.")
    port: int = setting(8080, "Service port.", ge=1, le=65535)
    targetPort: int | None = Field(None, ge=1, le=65535, deprecated=True,
                                   description="Deprecated: use http.port (the indexers' API port).")


class WorkloadValues(_Closed):
    replicas: int = setting(2, "Pods of this component.", ge=0)
    resources: KubeObject = setting({}, "Resources of its containers; default: `resources`.")


class BridgeValues(WorkloadValues):
    """The bridges: active/standby (one holds the ingest lease) or sharded (`ingest.sharded`)."""

    httpPort: int = setting(28081, "Health and metrics port of the bridge (internal).", ge=1, le=65535)


class IndexerValues(WorkloadValues):
    """The indexer replicas serving the API (each holds the whole index)."""


class ServiceAccountValues(_Closed):
    create: bool = setting(True, "Create the ServiceAccount.")
    name: str = setting("", "Its name; default: the release's full name.")
    annotations: dict[str, str] = setting({}, "Its annotations.")


class RbacValues(_Closed):
    create: bool = setting(True, """Role and RoleBinding to get/list/watch pods in the discovery namespace; only the
        bridge mounts a ServiceAccount token (the indexers have `automountServiceAccountToken: false`).""")


class NetworkPolicyValues(_Closed):
    """NetworkPolicies: the API from the release namespace plus `apiFrom`; the bridge's ops port and NATS
    monitoring from the namespace plus `metricsFrom`; the bundled NATS only from this release's pods."""

    enabled: bool = setting(True, "Create the NetworkPolicies.")
    apiFrom: list[KubeObject] = setting([], """More NetworkPolicy peers allowed to the API port (a router or Prometheus
        in another namespace, e.g. a namespaceSelector). `/metrics` is on the API port: expose it only to your
        monitoring.""")
    metricsFrom: list[KubeObject] = setting([], "More peers allowed to the bridge's ops port and NATS monitoring.")


class TopologySpreadValues(_Closed):
    """Indexers and bridges spread over nodes, each by its own pods."""

    enabled: bool = setting(True, "Add topology spread constraints.")
    topologyKey: str = setting("kubernetes.io/hostname", "Node label to spread over.")
    maxSkew: int = setting(1, "Largest difference of pods between two domains.", ge=1)
    whenUnsatisfiable: Literal["ScheduleAnyway", "DoNotSchedule"] = setting("ScheduleAnyway", "A preference or a "
                                                                                              "rule.")


class PodDisruptionBudgetValues(_Closed):
    enabled: bool = setting(True, "A voluntary eviction (a node drain) takes at most `maxUnavailable` indexers, "
                                  "and bridges, at a time.")
    maxUnavailable: int | str = setting(1, "Pods (or a percentage) unavailable at most.")


class PodMonitorValues(_Closed):
    enabled: bool = setting(False, "prometheus-operator PodMonitor for /metrics of the indexers and bridges.")
    interval: str = setting("30s", "Scrape interval.")
    labels: dict[str, str] = setting({}, "Labels the Prometheus selects PodMonitors by.")


class PrometheusRuleValues(_Closed):
    enabled: bool = setting(False, """A PrometheusRule (over this chart's PodMonitor or any scrape of the pods):
        CacheIndexerBlockKeyMismatch,
        CacheIndexerNoActiveBridge, CacheIndexerReplicaNotReady, CacheIndexerIngestLag, CacheIndexerHistoryLost.""")
    labels: dict[str, str] = setting({}, "Labels the Prometheus selects rules by.")
    ingestLagMessages: int = setting(10000, "Ingest lag (messages) that alerts.", ge=0)
    selector: str = setting('namespace="{{ .Release.Namespace }}"', """PromQL label matchers every rule adds (a
        template): where this release's series are. The rules select by metric name, never the scrape job; the
        default holds wherever scraping keeps the pod's namespace as `namespace` (prometheus-operator,
        kube-prometheus-stack); e.g. `kubernetes_namespace="..."` elsewhere, `""` for none.""")


class GrafanaDashboardValues(_Closed):
    enabled: bool = setting(False, """A ConfigMap Grafana's dashboard sidecar loads (charts/cache-indexer/dashboards/):
        the API's rate, latency and ratios, the index, snapshots, the bridge, Mooncake polls.""")
    labels: dict[str, str] = setting({"grafana_dashboard": "1"}, "What the sidecar looks for.")
    annotations: dict[str, str] = setting({}, "E.g. a folder annotation.")
    namespace: str = setting("", "Namespace of the ConfigMap; default: the release namespace.")


class MonitoringValues(_Closed):
    podMonitor: PodMonitorValues = PodMonitorValues()
    prometheusRule: PrometheusRuleValues = PrometheusRuleValues()
    grafanaDashboard: GrafanaDashboardValues = GrafanaDashboardValues()


class RegistrationValues(_Closed):
    """POST /register and /unregister, for engines outside Kubernetes labels."""

    enabled: bool = setting(False, "Require `Authorization: Bearer <token>` and accept registrations.")
    existingSecret: str = setting("", "A Secret with key `token`; default: `<release>-registration`, generated "
                                      "and kept.")


class ExternalNatsValues(_Closed):
    """An existing NATS (with `nats.enabled: false`), and the credentials our processes present to it,
    from one Secret in the release namespace (never the ConfigMap). One kind at most."""

    url: str = setting("", "Its URL(s); required when `nats.enabled` is false. Sets `nats.url`.")
    secretName: str = setting("", """The Secret holding the credentials (passwords and tokens reach the processes as
        environment, seed and .creds files are mounted at /etc/nats-credentials).""")
    user: str = setting("", "NATS user (its password under `passwordKey`).")
    passwordKey: str = setting("", "Key of the password in the Secret.")
    tokenKey: str = setting("", "Key of a token in the Secret.")
    nkeySeedKey: str = setting("", "Key of an nkey seed (mounted as a file).")
    credsKey: str = setting("", "Key of a .creds file (mounted as a file).")


class NatsTlsValues(_Closed):
    """TLS to NATS from a Secret laid out as cert-manager writes them (`ca.crt`, `tls.crt`, `tls.key`)."""

    secretName: str = setting("", "The Secret (mounted at /etc/nats-tls); empty: no TLS.")
    caKey: str = setting("ca.crt", "Key of the private CA's certificate.")
    clientCertificate: bool = setting(False, "Present `tls.crt`/`tls.key` (the server verifies clients).")
    serverName: str = setting("", "The name on the server's certificate, where it is not the URL's host.")


class NatsAuthValues(_Closed):
    """Authorization on the bundled NATS: one user per role (bridge, indexer, admin)."""

    enabled: bool = setting(True, """Require users: `cache-indexer-bridge` and `cache-indexer-indexer`, each limited to
        its role, and `admin` (nats-box); passwords generated into `<release>-nats-auth` and kept across
        upgrades.""")
    existingSecret: str = setting("", """A Secret with keys bridge-password, indexer-password, admin-password (letters and
        digits, starting with a letter: NATS reads them unquoted).""")


#: The product's NATS settings a chart user sets under ``nats`` (url, credentials and TLS come from the chart).
CHART_NATS_SETTINGS = ("replicas", "lease", "l1Stream", "l3Stream", "publish", "connectTimeout", "disconnectGrace")


class NatsChartValues(_Closed):
    """The bundled NATS: the official chart's values (open: see its documentation; any other key is a
    typo) and, in the same block, the product's NATS settings (`nats.replicas`, `nats.l1Stream`, ...).
    `nats.url`, the credentials and TLS are set by the chart."""

    enabled: bool = setting(True, "Install the official NATS chart (2.14.2) with the release.")
    auth: NatsAuthValues = NatsAuthValues()
    resources: dict[str, KubeObject] = setting({}, "Resources of the sub-chart's containers (nats, reloader, "
                                                   "natsBox).")
    goMaxProcs: int = setting(1, """Threads nats-server runs Go code on (`GOMAXPROCS`); 0: Go's own choice, the
        node's cores or the container's CPU limit. This NATS takes many small messages one at a time: with
        more threads than it needs, Go wakes an idle one for nearly every message (docs/operations.md,
        sizing).""", ge=0, le=1024)
    timerSlackUs: int = setting(1000, """Timer slack of nats-server's threads (µs; 0: the kernel's, 50 µs), set by the
        container's command before it starts the server (the image's /bin/sh). While nats-server handles a
        message, Go's scheduler monitor sleeps 20 µs at a time, a wake-up each: with 1 ms it wakes about half
        as often a lone message and idle; its timers fire up to that much later (docs/operations.md, sizing).""",
                                ge=0, le=100_000)


for _name in CHART_NATS_SETTINGS:  # the same fields, descriptions and types as schemas/config.py's
    NatsChartValues.model_fields[_name] = NatsConfig.model_fields[_name]
for _name in sorted(NATS_CHART_KEYS - set(NatsChartValues.model_fields)):
    NatsChartValues.model_fields[_name] = Field(None, description="The official NATS chart's value.")
    NatsChartValues.model_fields[_name].annotation = Any
NatsChartValues.model_rebuild(force=True)


#: A stream's settings under the deprecated ``jetstream.l1`` / ``jetstream.l3``: the same fields as
#: ``nats.l1Stream`` (schemas/config.py's StreamConfig), every one optional.
def _optional(info) -> object:
    """The field's type, its validators and JSON Schema kept (durations, sizes), or null."""
    kind = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
    return Optional[kind]  # noqa: UP007 (built at run time)


StreamLimitsValues = create_model(
    "StreamLimitsValues", __base__=_Closed,
    **{name: (_optional(info), None) for name, info in StreamConfig.model_fields.items()})


class JetStreamValues(_Closed):
    """Deprecated: the streams' settings are under `nats` (`nats.replicas`, `nats.lease.ttl`,
    `nats.l1Stream.*`, `nats.l3Stream.*`)."""

    replicas: int | None = Field(None, ge=1, le=5, deprecated=True, description="Deprecated: use nats.replicas.")
    duplicateWindow: Duration | None = Field(None, deprecated=True,
                                             description="Deprecated: use nats.l1Stream/l3Stream.duplicateWindow.")
    storage: Literal["file", "memory"] | None = Field(None, deprecated=True,
                                                      description="Deprecated: use nats.l1Stream/l3Stream.storage.")
    leaseTtl: Duration | None = Field(None, deprecated=True, description="Deprecated: use nats.lease.ttl.")
    l1: StreamLimitsValues | None = Field(None, deprecated=True, description="Deprecated: use nats.l1Stream.")
    l3: StreamLimitsValues | None = Field(None, deprecated=True, description="Deprecated: use nats.l3Stream.")


class ChartValues(_Closed):
    """Values of the cache-indexer chart. Every key of the documented product's values.yaml is accepted
    with its meaning; deprecated names are marked so."""

    enabled: bool = setting(True, "The condition of an umbrella chart (`cache-indexer.enabled`).")
    global_: GlobalValues = Field(GlobalValues(), alias="global")
    image: ImageValues = ImageValues()
    imagePullSecrets: list[KubeObject] = setting([], "Pull secrets of our pods (sub-charts get only `global`).")
    nameOverride: str = setting("", "Replaces the chart name in object names.")
    fullnameOverride: str = setting("", "Replaces the release's full name in object names.")
    service: ServiceValues = ServiceValues()
    resources: KubeObject = setting({}, "Resources of every container of ours (indexer/bridge.resources override).")
    indexer: IndexerValues = IndexerValues()
    bridge: BridgeValues = BridgeValues()
    serviceAccount: ServiceAccountValues = ServiceAccountValues()
    rbac: RbacValues = RbacValues()
    networkPolicy: NetworkPolicyValues = NetworkPolicyValues()
    podAnnotations: dict[str, str] = setting({}, "Annotations of our pods.")
    podLabels: dict[str, str] = setting({}, "Labels of our pods.")
    nodeSelector: dict[str, str] = setting({}, "Node selector of our pods.")
    tolerations: list[KubeObject] = setting([], "Tolerations of our pods.")
    affinity: KubeObject = setting({}, "Affinity of our pods.")
    topologySpread: TopologySpreadValues = TopologySpreadValues()
    podDisruptionBudget: PodDisruptionBudgetValues = PodDisruptionBudgetValues()
    podSecurityContext: KubeObject = setting({}, "Pod security context of our pods.")
    securityContext: KubeObject = setting({}, "Security context of our containers.")
    monitoring: MonitoringValues = MonitoringValues()
    registration: RegistrationValues = RegistrationValues()
    externalNats: ExternalNatsValues = ExternalNatsValues()
    natsTls: NatsTlsValues = NatsTlsValues()
    nats: NatsChartValues = NatsChartValues()
    jetstream: JetStreamValues | None = Field(None, deprecated=True, description=JetStreamValues.__doc__)
    log: LogConfig = LogConfig()
    http: HttpConfig = HttpConfig()
    blockKey: BlockKeyConfig = BlockKeyConfig()
    discovery: DiscoveryConfig = DiscoveryConfig()
    ingest: IngestConfig = IngestConfig()
    snapshot: SnapshotConfig = SnapshotConfig()
