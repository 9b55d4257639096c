"""The Helm chart, rendered with Helm's own engine and the official NATS chart as its sub-chart, each
object validated against the Kubernetes schemas (1.28 and the newest kubernetes-validate knows), for
a default install, the documented product's values.yaml and an InferNex-like umbrella chart. The
Dockerfile's structure is linted too."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import yaml

from tests.chart_render import (CHART, by_kind, chart_with_nats, config_of, container_env, needs_nats_chart, render,
                                umbrella)
from tests.conftest import DATA, ROOT

helm = pytest.importorskip("helm_python")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

KUBE_VERSIONS = ["1.28.0", kubernetes_validate.utils.latest_version()]
SEED_VALUES = yaml.safe_load((DATA / "seed-values.yaml").read_text())


@pytest.fixture(scope="module")
def chart(tmp_path_factory):
    return chart_with_nats(tmp_path_factory.mktemp("chart"))


def validate_all(objs):
    assert objs
    for version in KUBE_VERSIONS:
        for o in objs:
            if o["apiVersion"] != "monitoring.coreos.com/v1":  # CRDs: not in the schemas
                kubernetes_validate.validate(o, version, strict=True)


def pod_specs(objs):
    for o in objs:
        if o["kind"] in ("Deployment", "StatefulSet"):
            yield o["metadata"]["name"], o["spec"]["template"]["spec"]
        elif o["kind"] == "Pod":
            yield o["metadata"]["name"], o["spec"]


def restricted_violations(objs) -> list[str]:
    """The Pod Security Standards' "restricted" profile (v1.28+), as the admission controller checks it."""
    allowed_volumes = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                       "projected", "secret"}
    out = []
    for name, spec in pod_specs(objs):
        psc = spec.get("securityContext") or {}
        for key in ("hostNetwork", "hostPID", "hostIPC"):
            if spec.get(key):
                out.append(f"{name}: {key}")
        for vol in spec.get("volumes") or []:
            kinds = set(vol) - {"name"}
            if not kinds <= allowed_volumes:
                out.append(f"{name}: volume {vol['name']} of type {kinds}")
        for c in (spec.get("initContainers") or []) + spec["containers"]:
            sc = c.get("securityContext") or {}
            where = f"{name}/{c['name']}"
            if sc.get("privileged"):
                out.append(f"{where}: privileged")
            if sc.get("allowPrivilegeEscalation") is not False:
                out.append(f"{where}: allowPrivilegeEscalation must be false")
            if "ALL" not in ((sc.get("capabilities") or {}).get("drop") or []):
                out.append(f"{where}: capabilities must drop ALL")
            if set((sc.get("capabilities") or {}).get("add") or []) - {"NET_BIND_SERVICE"}:
                out.append(f"{where}: adds capabilities")
            if not sc.get("runAsNonRoot", psc.get("runAsNonRoot")):
                out.append(f"{where}: runAsNonRoot must be true")
            if sc.get("runAsUser", psc.get("runAsUser")) == 0:
                out.append(f"{where}: runAsUser 0")
            seccomp = (sc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")
            if seccomp not in ("RuntimeDefault", "Localhost"):
                out.append(f"{where}: seccompProfile must be RuntimeDefault or Localhost")
            for port in c.get("ports") or []:
                if port.get("hostPort"):
                    out.append(f"{where}: hostPort")
    return out


def images(objs) -> set[str]:
    return {c["image"] for _, spec in pod_specs(objs) for c in (spec.get("initContainers") or []) + spec["containers"]}


def names_within_63(objs):
    long = [o["metadata"]["name"] for o in objs if len(o["metadata"]["name"]) > 63]
    assert not long, long


# -- a default install ---------------------------------------------------------------------------
@needs_nats_chart
def test_default_install_is_valid_complete_and_restricted(chart):
    objs = render(chart)
    validate_all(objs)
    kinds = {o["kind"] for o in objs}
    assert {"Deployment", "Service", "ConfigMap", "ServiceAccount", "Role", "RoleBinding", "StatefulSet"} <= kinds
    svc = by_kind(objs, "Service", "cache-indexer-service")[0]
    assert svc["spec"]["ports"][0]["port"] == 8080 and svc["spec"]["ports"][0]["targetPort"] == 28080
    indexer = by_kind(objs, "Deployment", "cache-indexer-indexer")[0]
    c = indexer["spec"]["template"]["spec"]["containers"][0]
    assert indexer["spec"]["replicas"] == 2 and c["ports"][0]["containerPort"] == 28080
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz" and c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["resources"] == SEED_VALUES["resources"], "the documented single resources block"
    assert by_kind(objs, "Role")[0]["rules"] == [{"apiGroups": [""], "resources": ["pods"],
                                                 "verbs": ["get", "list", "watch"]}]
    assert restricted_violations(objs) == []
    assert images(objs) == {"cache-indexer:0.1.0", "nats:2.14.2-alpine", "natsio/nats-server-config-reloader:0.23.0",
                            "natsio/nats-box:0.19.7"}


@needs_nats_chart
def test_network_policies_and_no_api_token_where_none_is_needed(chart):
    """Issue 16 #13: the API from the namespace (or apiFrom), NATS clients only from our pods, and the
    indexer without a ServiceAccount token (only the bridge reads pods)."""
    objs = render(chart, {"networkPolicy": {"apiFrom": [{"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "router"}}}]}})
    validate_all(objs)
    pols = {o["metadata"]["name"]: o["spec"] for o in by_kind(objs, "NetworkPolicy")}
    api = pols["cache-indexer-indexer"]
    assert api["ingress"][0]["ports"] == [{"port": 28080, "protocol": "TCP"}]
    assert api["ingress"][0]["from"][1]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "router"}
    nats = pols["cache-indexer-nats"]
    client = next(r for r in nats["ingress"] if r["ports"][0]["port"] == 4222)
    assert client["from"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "cache-indexer",
                                                                "app.kubernetes.io/instance": "cache-indexer"}}}]
    nats_pods = by_kind(objs, "StatefulSet")[0]["spec"]["template"]["metadata"]["labels"]
    assert all(nats_pods.get(k) == v for k, v in nats["podSelector"]["matchLabels"].items()), "selects the NATS pods"
    for comp, spec in (("indexer", False), ("bridge", None)):
        pod = by_kind(objs, "Deployment", f"cache-indexer-{comp}")[0]["spec"]["template"]
        assert pod["spec"].get("automountServiceAccountToken") is spec
        assert all(pod["metadata"]["labels"].get(k) == v
                   for k, v in pols[f"cache-indexer-{comp}"]["podSelector"]["matchLabels"].items())
    assert not by_kind(render(chart, {"networkPolicy": {"enabled": False}}), "NetworkPolicy")


@needs_nats_chart
@pytest.mark.parametrize("replicas", [{"nats": {"replicas": 3}}, {"jetstream": {"replicas": 3}}],
                         ids=["nats.replicas", "deprecated-jetstream.replicas"])
def test_a_nats_cluster_gets_every_server_in_the_url_and_replicas_on_every_asset(chart, replicas):
    """Issue 16 #3: nats.replicas (formerly jetstream.replicas, still accepted) reaches the streams, the
    KV buckets and the snapshot store, and nats.url lists every server of the StatefulSet (the bundled
    chart does not advertise them)."""
    from cache_indexer.schemas.config import Config

    cluster = {"config": {"cluster": {"enabled": True, "replicas": 3}}}
    objs = render(chart, {**replicas, "nats": {**replicas.get("nats", {}), **cluster}})
    validate_all(objs)
    cfg = Config.model_validate(config_of(objs))
    assert cfg.nats.url.split(",") == ["nats://cache-indexer-nats.infer.svc:4222"] + [
        f"nats://cache-indexer-nats-{i}.cache-indexer-nats-headless.infer.svc:4222" for i in range(3)]
    assert cfg.nats.replicas == cfg.nats.l1Stream.replicas == cfg.nats.l3Stream.replicas == 3
    assert by_kind(objs, "StatefulSet")[0]["spec"]["replicas"] == 3
    assert by_kind(objs, "Service", "cache-indexer-nats-headless")


@needs_nats_chart
def test_config_map_is_the_documented_configuration(chart):
    from cache_indexer.schemas.config import Config

    cfg = Config.model_validate(config_of(render(chart)))
    assert cfg.nats.url == "nats://cache-indexer-nats.infer.svc:4222"
    assert cfg.discovery.mode == "kubernetes" and cfg.discovery.namespace == "infer"
    assert cfg.http.port == 28080 and cfg.blockKey.hashAlgo == "sha256_cbor" and cfg.blockKey.pythonHashSeed == "0"
    assert (cfg.http.readTimeout, cfg.http.writeTimeout, cfg.http.idleTimeout, cfg.http.readHeaderTimeout) == (30, 30, 120, 10)
    assert cfg.discovery.refreshInterval == 10 and cfg.discovery.segmentsFetchTimeout == 2
    assert cfg.nats.l1Stream.maxBytes == 4 << 30 and cfg.nats.l3Stream.maxBytes == 1 << 30


@needs_nats_chart
def test_the_bridges_receive_budget_follows_its_memory_limit(chart):
    """Issue 16 #11: the bytes the bridge may hold received follow the pod's memory limit."""
    from cache_indexer.schemas.config import Config

    def budget(values):
        return Config.model_validate(config_of(render(chart, values))).ingest.l1.maxBufferedBytes

    assert budget({}) == (2 << 30) // 4  # the shared resources block: 2Gi
    assert budget({"bridge": {"resources": {"limits": {"memory": "1Gi"}}}}) == 256 << 20
    assert budget({"resources": {"limits": {"memory": None}}}) == 256 << 20  # no limit: the default
    assert budget({"ingest": {"l1": {"maxBufferedBytes": "100MiB"}}}) == 100 << 20


# -- the documented product's values.yaml, verbatim ------------------------------------------------
@needs_nats_chart
def test_the_documented_values_file_renders_with_its_meaning(chart):
    from cache_indexer.schemas.config import Config

    objs = render(chart, SEED_VALUES, name="cache-indexer", namespace="infer")
    validate_all(objs)
    assert restricted_violations(objs) == []
    cfg = Config.model_validate(config_of(objs))
    assert cfg.blockKey.hashAlgo == "sha256_cbor" and cfg.blockKey.pythonHashSeed == "0"
    assert cfg.discovery.vllm.labelSelector == {"openfuyao.com/engine": "vllm"}
    assert (cfg.discovery.vllm.pdRoleLabel, cfg.discovery.vllm.pdRoles) == ("openfuyao.com/pdRole", ["prefill", "aggregate"])
    assert cfg.discovery.mooncakeMaster.labelSelector == {"openfuyao.com/kvmanager": "mooncake"}
    assert (cfg.discovery.mooncakeMaster.httpPortName, cfg.discovery.mooncakeMaster.rpcPortName) == ("http", "rpc")
    assert cfg.http.port == 28080 and cfg.http.idleTimeout == 120
    svc = by_kind(objs, "Service", "cache-indexer-service")[0]
    assert (svc["spec"]["ports"][0]["port"], svc["spec"]["ports"][0]["targetPort"]) == (8080, 28080)
    for dep in by_kind(objs, "Deployment"):
        if dep["metadata"]["name"].startswith("cache-indexer-"):
            c = dep["spec"]["template"]["spec"]["containers"][0]
            if "nats" not in dep["metadata"]["name"]:
                assert c["image"] == "cr.openfuyao.cn/openfuyao/cache-indexer:26.6.0"
                assert c["resources"] == SEED_VALUES["resources"]


@needs_nats_chart
def test_documented_service_values_move_the_port_everywhere(chart):
    objs = render(chart, {"service": {"name": "kv-index", "port": 9090, "targetPort": 18080}})
    svc = by_kind(objs, "Service", "kv-index")[0]
    assert (svc["spec"]["ports"][0]["port"], svc["spec"]["ports"][0]["targetPort"]) == (9090, 18080)
    c = by_kind(objs, "Deployment", "cache-indexer-indexer")[0]["spec"]["template"]["spec"]["containers"][0]
    assert c["ports"][0]["containerPort"] == 18080 and config_of(objs)["http"]["port"] == 18080
    objs = render(chart, {"http": {"port": 9000}})  # the setting's name alone (the chart's default names neither)
    assert by_kind(objs, "Service", "cache-indexer-service")[0]["spec"]["ports"][0]["targetPort"] == 9000
    assert config_of(objs)["http"]["port"] == 9000
    with pytest.raises(helm.HelmError, match="http.port .* and service.targetPort"):
        render(chart, {"http": {"port": 9000}, "service": {"targetPort": 28080}})


# -- names: the router's URL whatever the release ---------------------------------------------------
LONGEST_RELEASE = "a-very-long-release-name-for-the-inference-stack-x1-x"  # Helm allows 53 characters


@needs_nats_chart
@pytest.mark.parametrize("release", ["cache-indexer", "prod", LONGEST_RELEASE])
def test_service_name_does_not_depend_on_the_release_and_names_fit(chart, release):
    values = {"nats": {"fullnameOverride": "kv-nats"}} if release == LONGEST_RELEASE else None
    objs = render(chart, values, name=release)
    assert by_kind(objs, "Service", "cache-indexer-service")
    names_within_63(objs)
    validate_all(objs)


@needs_nats_chart
def test_a_release_name_too_long_for_the_nats_names_fails_saying_what_to_do(chart):
    with pytest.raises(helm.HelmError, match="set nats.fullnameOverride"):
        render(chart, name=LONGEST_RELEASE)
    assert by_kind(render(chart, name=LONGEST_RELEASE[:45]), "Service", f"{LONGEST_RELEASE[:45]}-nats-headless")


@needs_nats_chart
def test_as_a_subchart_of_infernex_the_routers_url_resolves(chart, tmp_path):
    parent = umbrella(tmp_path, {"cache-indexer": {"enabled": True}, "hermes-router": {"enabled": True}}, chart)
    objs = render(parent, name="infernex", namespace="ai")
    validate_all(objs)
    assert restricted_violations(objs) == []
    svc = by_kind(objs, "Service", "cache-indexer-service")
    assert svc and svc[0]["metadata"]["namespace"] == "ai", "http://cache-indexer-service:8080 from the router"
    assert config_of(objs)["nats"]["url"] == "nats://infernex-nats.ai.svc:4222"
    assert by_kind(objs, "StatefulSet", "infernex-nats")
    names_within_63(objs)
    off = render(umbrella(tmp_path / "off", {"cache-indexer": {"enabled": False}}, chart), name="infernex")
    assert not off


# -- images and pull secrets -----------------------------------------------------------------------
@needs_nats_chart
def test_registry_and_pull_secrets_reach_every_image(chart):
    objs = render(chart, {"global": {"imageRegistry": "mirror.example:5000/",
                                     "imagePullSecrets": [{"name": "mirror"}]},
                          "imagePullSecrets": [{"name": "ours"}]})
    validate_all(objs)
    assert all(i.startswith("mirror.example:5000/") for i in images(objs)), images(objs)
    for name, spec in pod_specs(objs):
        secrets = {s["name"] for s in spec.get("imagePullSecrets") or []}
        assert "mirror" in secrets, name
        if not name.startswith("cache-indexer-nats"):
            assert "ours" in secrets, name
    nats_own = render(chart, {"nats": {"global": {"image": {"registry": "r.example"}}}})
    assert {i for i in images(nats_own) if "nats" in i} and all(
        i.startswith("r.example/") for i in images(nats_own) if "nats" in i)


# -- the bundled NATS ------------------------------------------------------------------------------
@needs_nats_chart
def test_streams_that_do_not_fit_the_nats_store_fail_at_render(chart):
    with pytest.raises(helm.HelmError, match=r"nats.l1Stream.maxBytes .* do not fit the NATS JetStream store"):
        render(chart, {"nats": {"config": {"jetstream": {"fileStore": {"pvc": {"size": "4Gi"}}}}}})
    with pytest.raises(helm.HelmError, match="do not fit"):  # exactly full: no room for the buckets
        render(chart, {"nats": {"l1Stream": {"maxBytes": "8GiB"}, "l3Stream": {"maxBytes": "2GiB"}}})
    with pytest.raises(helm.HelmError, match="do not fit"):  # the deprecated names count the same
        render(chart, {"jetstream": {"l1": {"maxBytes": "8GiB"}, "l3": {"maxBytes": "2GiB"}}})
    render(chart, {"jetstream": {"l1": {"maxBytes": "8GiB"}, "l3": {"maxBytes": "2047MiB"}}})
    objs = render(chart, {"nats": {"l1Stream": {"maxBytes": "16GiB"}, "l3Stream": {"maxBytes": "2GiB"},
                                   "config": {"jetstream": {"fileStore": {"pvc": {"size": "20Gi"}}}}}})
    cfg = config_of(objs)
    assert cfg["nats"]["l1Stream"]["maxBytes"] == "16GiB" and cfg["nats"]["l3Stream"]["maxBytes"] == "2GiB"
    objs = render(chart, {"jetstream": {"l1": {"maxBytes": "3GiB"}, "leaseTtl": "20s", "duplicateWindow": "1m"}})
    cfg = config_of(objs)
    assert "jetstream" not in cfg, "the chart renders the settings' names"
    assert cfg["nats"]["l1Stream"] == {"maxAge": "24h", "maxBytes": "3GiB", "encoding": "msgpack", "duplicateWindow": "1m"}
    assert cfg["nats"]["lease"] == {"ttl": "20s"} and cfg["nats"]["l3Stream"]["duplicateWindow"] == "1m"


def test_chart_without_its_nats_dependency_fails_saying_what_to_do():
    with pytest.raises(helm.HelmError, match="helm dependency build"):
        render(CHART)


def test_chart_lock_pins_the_dependency_of_chart_yaml():
    """Chart.lock's digest is Helm's: sha256 of the JSON of [Chart.yaml's dependencies, the locked ones]."""
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    lock = yaml.safe_load((CHART / "Chart.lock").read_text())
    deps = chart["dependencies"]
    assert [(d["name"], d["version"]) for d in deps] == [("nats", "2.14.2")]
    keys = ("name", "version", "repository", "condition", "tags", "enabled", "import-values", "alias")
    req = [{k: d[k] for k in keys if d.get(k) or k in ("name", "repository")} for d in deps]
    locked = [{k: d[k] for k in ("name", "version", "repository")} for d in lock["dependencies"]]
    digest = hashlib.sha256(json.dumps([req, locked], separators=(",", ":")).encode()).hexdigest()
    assert lock["digest"] == f"sha256:{digest}"
    assert [(d["name"], d["version"], d["repository"]) for d in lock["dependencies"]] == \
        [(d["name"], d["version"], d["repository"]) for d in deps]


# -- the rest of the values ------------------------------------------------------------------------
@needs_nats_chart
def test_replicas_and_pod_placement_values(chart):
    objs = render(chart, {"indexer": {"replicas": 5}, "nodeSelector": {"pool": "cpu"},
                          "tolerations": [{"key": "k", "operator": "Exists", "effect": "NoSchedule"}],
                          "podAnnotations": {"a": "b"}, "podLabels": {"team": "x"},
                          "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                              {"weight": 1, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                                                "labelSelector": {"matchLabels": {"x": "y"}}}}]}},
                          "bridge": {"resources": {"limits": {"memory": "1Gi"}}}})
    validate_all(objs)
    dep = by_kind(objs, "Deployment", "cache-indexer-indexer")[0]
    spec = dep["spec"]["template"]["spec"]
    assert dep["spec"]["replicas"] == 5 and spec["nodeSelector"] == {"pool": "cpu"}
    assert spec["tolerations"][0]["key"] == "k" and "podAntiAffinity" in spec["affinity"]
    meta = dep["spec"]["template"]["metadata"]
    assert meta["annotations"]["a"] == "b" and meta["labels"]["team"] == "x"
    bridge = by_kind(objs, "Deployment", "cache-indexer-bridge")[0]["spec"]["template"]["spec"]["containers"][0]
    assert bridge["resources"] == {"limits": {"memory": "1Gi"}}, "a component's own resources override the block"


def test_external_nats():
    objs = render(CHART, {"nats": {"enabled": False}, "externalNats": {"url": "nats://nats.shared:4222"}})
    validate_all(objs)
    assert config_of(objs)["nats"]["url"] == "nats://nats.shared:4222"
    assert not [o for o in objs if "nats" in o["metadata"]["name"]]
    assert restricted_violations(objs) == []


def test_neither_bundled_nor_external_nats_fails_with_a_clear_message():
    with pytest.raises(helm.HelmError, match="nats.enabled=true .* or externalNats.url"):
        render(CHART, {"nats": {"enabled": False}})


@needs_nats_chart
def test_monitoring_objects_scrape_and_alert_on_metrics_the_product_exports(chart):
    assert not {"PodMonitor", "PrometheusRule"} & {o["kind"] for o in render(chart)}, "off by default"
    objs = render(chart, {"monitoring": {"podMonitor": {"enabled": True},
                                         "prometheusRule": {"enabled": True, "ingestLagMessages": 500}}})
    validate_all(objs)
    pm = by_kind(objs, "PodMonitor")[0]
    deployments = [d for d in by_kind(objs, "Deployment") if not d["metadata"]["name"].startswith("cache-indexer-nats")]
    for d in deployments:  # the monitor selects every component's pods and the port they name http
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert pm["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert [p["name"] for p in d["spec"]["template"]["spec"]["containers"][0]["ports"]] == ["http"]
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] == "http"
    rules = by_kind(objs, "PrometheusRule")[0]["spec"]["groups"][0]["rules"]
    assert len(rules) == 6
    for rule in rules:
        expr = rule["expr"]
        names = set(re.findall(r"cache_indexer_[a-z0-9_]+", expr))
        # one component exports every series a rule reads (each process exports only its own: issue 38)
        assert any(names <= _exported_series(c) for c in ("bridge", "indexer")), f"{rule['alert']}: {names}"
        # not the scrape job's name, which only this chart's PodMonitor makes (issue 38)
        assert "job=" not in expr and "container=" not in expr
        assert all(f'{n}{{namespace="infer"}}' in expr for n in names), "series of the release's namespace"
    assert "> 500" in next(r["expr"] for r in rules if r["alert"] == "CacheIndexerIngestLag")


def _exported_series(component: str | None = None) -> set[str]:
    """The series names a component's processes export (None: any), a counter's _total, a histogram's
    _bucket, _sum and _count."""
    from cache_indexer.infra.metrics import Metrics

    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""]}
    return {f.name + sfx for f in Metrics(component).registry.collect() for sfx in suffixes.get(f.type, [""])}


@needs_nats_chart
def test_a_fleet_install_spreads_budgets_and_sizes_every_container(chart):
    """By default: the indexers and the bridges each spread over nodes by their own pods, a disruption
    budget for each, and resources (CPU and memory requests, a memory limit) on every container the
    chart starts, the NATS sub-chart's and its test pod's included; both placements can be turned off."""
    objs = render(chart, hooks=True)
    validate_all(objs)
    for name, spec in pod_specs(objs):
        for c in spec.get("initContainers", []) + spec["containers"]:
            res = c.get("resources") or {}
            assert {"cpu", "memory"} <= set(res.get("requests", {})) and "memory" in res.get("limits", {}), \
                f"{name}/{c['name']}: {res}"
    pods = {c: by_kind(objs, "Deployment", f"cache-indexer-{c}")[0]["spec"]["template"] for c in ("indexer", "bridge")}
    budgets = {b["metadata"]["name"]: b["spec"] for b in by_kind(objs, "PodDisruptionBudget")}
    for component, other in (("indexer", "bridge"), ("bridge", "indexer")):
        labels, other_labels = pods[component]["metadata"]["labels"], pods[other]["metadata"]["labels"]
        [spread] = pods[component]["spec"]["topologySpreadConstraints"]
        assert spread["topologyKey"] == "kubernetes.io/hostname" and spread["maxSkew"] == 1
        for selector in (spread["labelSelector"]["matchLabels"], budgets[f"cache-indexer-{component}"]["selector"]["matchLabels"]):
            assert selector.items() <= labels.items() and not selector.items() <= other_labels.items()
        assert budgets[f"cache-indexer-{component}"]["maxUnavailable"] == 1
    off = render(chart, {"topologySpread": {"enabled": False}, "podDisruptionBudget": {"enabled": False}})
    assert not any("topologySpreadConstraints" in spec for _, spec in pod_specs(off))
    assert [b["metadata"]["name"] for b in by_kind(off, "PodDisruptionBudget")] == ["cache-indexer-nats"], "the NATS chart's own"


@needs_nats_chart
def test_the_grafana_dashboard_is_a_sidecar_config_map_over_metrics_the_product_exports(chart):
    assert not [o for o in render(chart) if o["metadata"]["name"].endswith("-dashboard")], "off by default"
    objs = render(chart, {"monitoring": {"grafanaDashboard": {"enabled": True, "namespace": "monitoring",
                                                               "annotations": {"grafana_folder": "kv"}}}})
    validate_all(objs)
    cm = by_kind(objs, "ConfigMap", "cache-indexer-dashboard")[0]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1" and cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "kv"}
    dash = json.loads(cm["data"]["cache-indexer.json"])
    panels = dash["panels"]
    assert len({p["id"] for p in panels}) == len(panels) and dash["uid"] == "cache-indexer"
    assert {v["name"] for v in dash["templating"]["list"]} == {"datasource", "namespace"}
    exported, used = _exported_series(), set()
    for panel in panels:
        for target in panel.get("targets", []):
            for name in re.findall(r"cache_indexer_[a-z0-9_]+", target["expr"]):
                assert name in exported, f"{panel['title']!r} uses {name}, which nothing exports"
                used.add(name)
            assert 'namespace="$namespace"' in target["expr"]
    assert {"cache_indexer_http_request_duration_seconds_bucket", "cache_indexer_index_entries",
            "cache_indexer_bridge_block_events_total", "cache_indexer_block_key_mismatched_pods"} <= used


@needs_nats_chart
def test_lint(chart):
    report = helm.lint(str(chart), strict=False, kube_version=f"v{KUBE_VERSIONS[-1]}")
    assert report["total_charts_linted"] == 1
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not problems, problems


def test_dockerfile_structure():
    text = (ROOT / "Dockerfile").read_text()
    froms = re.findall(r"^FROM\s+(\S+)", text, re.M)
    assert froms, "no FROM"
    for image in froms:
        assert ":" in image and not image.endswith(":latest"), f"unpinned base image {image}"
        assert re.search(r":\d+\.\d+\.\d+", image), f"base image {image} is not pinned to a patch version"
    user = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert user and user[-1].split(":")[0] not in ("root", "0"), "the image must run as a non-root user"
    assert re.search(r'^CMD\s+\["indexer"', text, re.M) and 'ENTRYPOINT ["cache-indexer"]' in text


def _container_env(objs, component: str) -> dict:
    [deploy] = [o for o in by_kind(objs, "Deployment") if o["metadata"]["name"].endswith(component)]
    return {e["name"]: e for e in deploy["spec"]["template"]["spec"]["containers"][0].get("env", [])}


@needs_nats_chart
def test_registration_takes_its_token_from_a_secret_and_only_the_indexers_get_it(chart):
    """Off by default; on, a token generated into a Secret (or an existing one) reaches the indexers as
    environment, never the ConfigMap nor the bridges."""
    var = "CACHE_INDEXER_HTTP__REGISTRATIONTOKEN"
    objs = render(chart)
    assert var not in _container_env(objs, "indexer") and not [o for o in by_kind(objs, "Secret")
                                                                if "registration" in o["metadata"]["name"]]
    objs = render(chart, {"registration": {"enabled": True}})
    validate_all(objs)
    [secret] = [o for o in by_kind(objs, "Secret") if o["metadata"]["name"].endswith("-registration")]
    assert len(secret["data"]["token"]) >= 40
    ref = _container_env(objs, "indexer")[var]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": secret["metadata"]["name"], "key": "token"}
    assert var not in _container_env(objs, "bridge")
    assert "registrationToken" not in json.dumps(config_of(objs))
    objs = render(chart, {"registration": {"enabled": True, "existingSecret": "engines-token"}})
    assert _container_env(objs, "indexer")[var]["valueFrom"]["secretKeyRef"] == {"name": "engines-token", "key": "token"}
    assert not [o for o in by_kind(objs, "Secret") if o["metadata"]["name"].endswith("-registration")]


# -- values.schema.json: a typo fails the install, naming the key -----------------------------------
def _merged(base: dict, over: dict) -> dict:
    """Helm's merge of user values over the chart's values.yaml (maps merge, everything else replaces)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _schema_errors(values: dict) -> list[str]:
    """values.schema.json applied as Helm does: to the user's values merged over the chart's values.yaml."""
    import jsonschema

    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    merged = _merged(yaml.safe_load((CHART / "values.yaml").read_text()), values)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in jsonschema.Draft7Validator(schema).iter_errors(merged)]


@pytest.mark.parametrize("values", [None, SEED_VALUES], ids=["chart", "documented"])
def test_the_charts_and_the_documented_values_meet_the_values_schema(values):
    """What Helm applies on install/upgrade/template/lint, checked with jsonschema too (independent of
    the Helm engine's version). A key added to values.yaml without its field in schemas/chart_values.py
    fails here: add it there and run python -m cache_indexer.schemas.generate. Under a second."""
    errors = _schema_errors(values or {})
    assert not errors, errors


@pytest.mark.parametrize("values,named", [
    ({"discovery": {"refreshIntervall": "10s"}}, "refreshIntervall"),
    ({"imagee": {"tag": "1"}}, "imagee"),
    ({"nats": {"l1Streem": {"maxBytes": "1GiB"}}}, "l1Streem"),
    ({"ingest": {"l1": {"rcvHwn": 10}}}, "rcvHwn"),
    ({"blockKey": {"prefixCachingHashAlgo": "md5"}}, "prefixCachingHashAlgo"),
    ({"http": {"readTimeout": "soon"}}, "readTimeout"),
], ids=["nested", "top-level", "under-nats", "tuning", "deprecated-name-bad-value", "bad-duration"])
def test_a_misspelled_or_invalid_value_fails_the_install_naming_it(values, named):
    """Issue 38: before, a typo passed `helm install` and surfaced as a crash-looping pod."""
    errors = _schema_errors(values)
    assert errors and any(named in e for e in errors), errors


@needs_nats_chart
def test_helm_template_with_a_misspelled_value_fails_naming_it(chart):
    """Helm's own engine applies values.schema.json (as `helm template` and `helm install` do)."""
    with pytest.raises(helm.HelmError, match=r"/discovery.*refreshIntervall"):
        render(chart, {"discovery": {"refreshIntervall": "10s"}})
    with pytest.raises(helm.HelmError, match="imagee"):
        render(chart, {"imagee": {"tag": "1"}})
    with pytest.raises(helm.HelmError, match="/http/port"):
        render(chart, {"http": {"port": "x"}})


@needs_nats_chart
def test_without_the_schema_check_the_templates_still_refuse_an_unknown_key(chart, tmp_path):
    """`helm install --skip-schema-validation` (or a Helm that ignores the schema): the chart's own
    check (templates/_values_check.tpl, generated) fails rendering, naming the key."""
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(chart, bare)
    (bare / "values.schema.json").unlink()
    with pytest.raises(helm.HelmError, match=r"unknown value discovery.refreshIntervall"):
        render(bare, {"discovery": {"refreshIntervall": "10s"}})
    with pytest.raises(helm.HelmError, match=r'unknown value "imagee"'):
        render(bare, {"imagee": {"tag": "1"}})
    render(bare, SEED_VALUES)


@needs_nats_chart
def test_deprecated_names_are_listed_for_the_release_notes(chart, tmp_path):
    """The chart names the deprecated keys a release uses (templates/_settings.tpl; NOTES.txt prints them)."""
    import shutil

    probe = tmp_path / "probe"
    shutil.copytree(chart, probe)
    (probe / "templates" / "probe.yaml").write_text(
        'apiVersion: v1\nkind: ConfigMap\nmetadata: {name: probe}\ndata:\n  notes: |\n'
        '    {{- include "cache-indexer.deprecations" . | nindent 4 }}\n')
    notes = lambda values: by_kind(render(probe, values), "ConfigMap", "probe")[0]["data"]["notes"]  # noqa: E731
    assert notes(None).strip() == ""
    seed = notes(SEED_VALUES)
    assert all(n in seed for n in ("service.targetPort: use http.port", "blockKey.prefixCachingHashAlgo: use "
                                   "blockKey.hashAlgo", "discovery.labels.*"))
    assert "jetstream.*: use nats.replicas" in notes({"jetstream": {"replicas": 3}})


@needs_nats_chart
def test_a_text_setting_given_as_a_number_passes_the_schema(chart):
    """`helm install --set blockKey.pythonHashSeed=0` hands Helm the number 0: the schema takes it, as the
    processes do (the seed stays the text "0")."""
    from cache_indexer.schemas.config import Config

    cfg = Config.model_validate(config_of(render(chart, {"blockKey": {"pythonHashSeed": 0}})))
    assert cfg.blockKey.pythonHashSeed == "0"
    assert not _schema_errors({"blockKey": {"pythonHashSeed": 42}, "ingest": {"l1": {"topic": 7}}})


@needs_nats_chart
def test_the_bundled_nats_runs_go_on_the_threads_nats_go_max_procs_names(tmp_path):
    """``nats.goMaxProcs`` (1 by default) is the NATS container's GOMAXPROCS, which a real nats-server
    started with that environment reports in /varz; 0 leaves Go's own choice (no variable), and the
    container's other variables (the passwords) stay either way."""
    import urllib.request

    from cache_indexer.nats_server import NatsServer

    chart = chart_with_nats(tmp_path)

    def env(values):
        return container_env(render(chart, values), "StatefulSet", "cache-indexer-nats")

    default, wide, goes = env(None), env({"nats": {"goMaxProcs": 4}}), env({"nats": {"goMaxProcs": 0}})
    assert default["GOMAXPROCS"] == "1" and wide["GOMAXPROCS"] == "4" and "GOMAXPROCS" not in goes
    assert default["CACHE_INDEXER_BRIDGE_PASSWORD"] and goes["CACHE_INDEXER_BRIDGE_PASSWORD"]
    for given, want in ((default, 1), (wide, 4)):
        server = NatsServer(env={"GOMAXPROCS": given["GOMAXPROCS"]}).start()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{server.monitor_port}/varz", timeout=10) as r:
                assert json.loads(r.read())["gomaxprocs"] == want
        finally:
            server.close()


@needs_nats_chart
def test_the_bundled_nats_runs_with_the_timer_slack_nats_timer_slack_us_names(tmp_path):
    """``nats.timerSlackUs`` (1000 by default) is set by the NATS container's command before it execs
    nats-server with the chart's args; 0 leaves the image's entrypoint as it is. Local mode's embedded
    server (and the benches) get the same slack."""
    from cache_indexer.nats_server import TIMER_SLACK_NS, NatsServer

    chart = chart_with_nats(tmp_path)

    def nats_container(values):
        sts = [o for o in render(chart, values) if o["kind"] == "StatefulSet"
               and o["metadata"]["name"] == "cache-indexer-nats"][0]
        return [c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == "nats"][0]

    default, off = nats_container(None), nats_container({"nats": {"timerSlackUs": 0}})
    assert default["command"][:2] == ["/bin/sh", "-c"]
    assert "echo 1000000 > /proc/self/timerslack_ns" in default["command"][2]
    assert default["command"][2].endswith('exec nats-server "$@"') and default["args"] == off["args"]
    assert "command" not in off
    assert TIMER_SLACK_NS == 1000 * 1000
    server = NatsServer().start()
    try:
        try:
            slack = int(Path(f"/proc/{server.proc.pid}/timerslack_ns").read_text())
        except OSError:  # not Linux, or not allowed to read it
            return
        assert slack == TIMER_SLACK_NS
    finally:
        server.close()
