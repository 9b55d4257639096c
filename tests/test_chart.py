"""The Helm chart, rendered with Helm's own engine (helm-python-sdk) and validated object by object
against the Kubernetes schemas (kubernetes-validate). The Dockerfile's structure is linted too."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import yaml

helm = pytest.importorskip("helm_python")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "cache-indexer"
KUBE_VERSION = "1.30.0"
NATS_VENDORED = bool(list((CHART / "charts").glob("nats-*.tgz"))) if (CHART / "charts").exists() else False


def render(values=None, name="cache-indexer", namespace="infer", chart=CHART):
    c = helm.Chart.load(str(chart))
    try:
        out = c.render(values, name=name, namespace=namespace)
    finally:
        c.close()
    objs = []
    for path, text in out.items():
        if not path.endswith((".yaml", ".yml")):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                objs.append(doc)
    return objs


def by_kind(objs, kind, name=None):
    return [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def config_of(objs) -> dict:
    cm = [o for o in by_kind(objs, "ConfigMap") if o["metadata"]["name"].endswith("-config")][0]
    return yaml.safe_load(cm["data"]["config.yaml"])


def validate_all(objs):
    assert objs
    for o in objs:
        kubernetes_validate.validate(o, KUBE_VERSION, strict=True)


def test_default_render_is_valid_and_complete():
    objs = render()
    validate_all([o for o in objs if not o["metadata"]["name"].startswith("cache-indexer-nats")])
    kinds = {o["kind"] for o in objs}
    assert {"Deployment", "Service", "ConfigMap", "ServiceAccount", "Role", "RoleBinding"} <= kinds
    svc = by_kind(objs, "Service", "cache-indexer-service")[0]
    assert svc["spec"]["ports"][0]["port"] == 8080 and svc["spec"]["ports"][0]["targetPort"] == "http"
    indexer = by_kind(objs, "Deployment", "cache-indexer-indexer")[0]
    assert indexer["spec"]["replicas"] == 2
    c = indexer["spec"]["template"]["spec"]["containers"][0]
    assert c["ports"][0]["containerPort"] == 28080
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz" and c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert by_kind(objs, "Deployment", "cache-indexer-bridge")
    role = by_kind(objs, "Role")[0]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]


def test_config_map_is_a_valid_product_config():
    from schemas.config import Config

    cfg = Config.model_validate(config_of(render()))
    assert cfg.nats.url == "nats://cache-indexer-nats.infer.svc:4222"
    assert cfg.discovery.mode == "kubernetes" and cfg.discovery.namespace == "infer"
    assert cfg.http.port == 28080 and cfg.blockKey.hashAlgo == "sha256_cbor"


def test_replicas_and_pod_placement_values():
    objs = render({"indexer": {"replicas": 5}, "nodeSelector": {"pool": "cpu"},
                   "tolerations": [{"key": "k", "operator": "Exists", "effect": "NoSchedule"}],
                   "podAnnotations": {"a": "b"}, "podLabels": {"team": "x"},
                   "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                       {"weight": 1, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                                         "labelSelector": {"matchLabels": {"x": "y"}}}}]}}})
    validate_all([o for o in objs if "nats" not in o["metadata"]["name"]])
    dep = by_kind(objs, "Deployment", "cache-indexer-indexer")[0]
    spec = dep["spec"]["template"]["spec"]
    assert dep["spec"]["replicas"] == 5 and spec["nodeSelector"] == {"pool": "cpu"}
    assert spec["tolerations"][0]["key"] == "k" and "podAntiAffinity" in spec["affinity"]
    meta = dep["spec"]["template"]["metadata"]
    assert meta["annotations"]["a"] == "b" and meta["labels"]["team"] == "x"


def test_external_nats():
    objs = render({"nats": {"enabled": False}, "externalNats": {"url": "nats://nats.shared:4222"}})
    validate_all(objs)
    assert config_of(objs)["nats"]["url"] == "nats://nats.shared:4222"
    assert not [o for o in objs if "nats" in o["metadata"]["name"]]


def test_neither_bundled_nor_external_nats_fails_with_a_clear_message():
    with pytest.raises(helm.HelmError, match="nats.enabled=true .* or externalNats.url"):
        render({"nats": {"enabled": False}})


def test_renders_as_a_subchart_without_release_hardcoding(tmp_path):
    parent = tmp_path / "suite"
    (parent / "charts").mkdir(parents=True)
    shutil.copytree(CHART, parent / "charts" / "cache-indexer", ignore=shutil.ignore_patterns("*.tgz"))
    (parent / "Chart.yaml").write_text(yaml.safe_dump({
        "apiVersion": "v2", "name": "suite", "version": "1.0.0",
        "dependencies": [{"name": "cache-indexer", "version": "0.1.0", "repository": "file://charts/cache-indexer"}]}))
    (parent / "values.yaml").write_text(yaml.safe_dump({"cache-indexer": {"indexer": {"replicas": 3}}}))
    objs = render(name="prod", namespace="ai", chart=parent)
    mine = [o for o in objs if o["metadata"].get("labels", {}).get("app.kubernetes.io/name") == "cache-indexer"]
    validate_all(mine)
    names = {o["metadata"]["name"] for o in mine}
    assert "prod-cache-indexer-service" in names and "prod-cache-indexer-indexer" in names
    assert all(o["metadata"]["namespace"] == "ai" for o in mine)
    assert by_kind(mine, "Deployment", "prod-cache-indexer-indexer")[0]["spec"]["replicas"] == 3
    assert config_of(mine)["nats"]["url"] == "nats://prod-nats.ai.svc:4222"


def test_monitoring_objects_scrape_and_alert_on_metrics_the_product_exports():
    from cache_indexer.metrics import Metrics

    assert not {"PodMonitor", "PrometheusRule"} & {o["kind"] for o in render()}, "off by default"
    objs = render({"monitoring": {"podMonitor": {"enabled": True}, "prometheusRule": {"enabled": True,
                                                                                      "ingestLagMessages": 500}}})
    validate_all([o for o in objs if o["apiVersion"] != "monitoring.coreos.com/v1"])  # CRDs: not in the schemas
    pm = by_kind(objs, "PodMonitor")[0]
    deployments = by_kind(objs, "Deployment")
    for d in deployments:  # the monitor selects every component's pods and the port they name http
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert pm["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert [p["name"] for p in d["spec"]["template"]["spec"]["containers"][0]["ports"]] == ["http"]
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] == "http"
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""]}
    exported = {f.name + sfx for f in Metrics().registry.collect() for sfx in suffixes.get(f.type, [""])}
    containers = {d["spec"]["template"]["spec"]["containers"][0]["name"] for d in deployments}
    rules = by_kind(objs, "PrometheusRule")[0]["spec"]["groups"][0]["rules"]
    assert len(rules) == 5
    for rule in rules:
        expr = rule["expr"]
        for name in re.findall(r"cache_indexer_[a-z0-9_]+", expr):
            assert name in exported, f"{rule['alert']} uses {name}, which nothing exports"
        assert 'job="infer/cache-indexer"' in expr, "series of this release's PodMonitor only"
        assert set(re.findall(r'container="([a-z]+)"', expr)) <= containers
    assert "> 500" in next(r["expr"] for r in rules if r["alert"] == "CacheIndexerIngestLag")


def test_lint():
    report = helm.lint(str(CHART), strict=False, kube_version=f"v{KUBE_VERSION}")
    assert report["total_charts_linted"] == 1
    errors = [m for m in report["messages"] if m["severity"] >= 3]
    assert not errors, errors
    warnings = [m["error"] for m in report["messages"] if m["severity"] == 2]
    expected = [] if NATS_VENDORED else ["chart directory is missing these dependencies: nats"]
    assert warnings == expected


@pytest.mark.skipif(not NATS_VENDORED, reason="the NATS subchart archive is not vendored "
                    "(run `helm dependency build charts/cache-indexer` on a machine with access to its repository)")
def test_with_the_nats_subchart():  # pragma: no cover - needs the vendored archive
    objs = render()
    validate_all(objs)
    sts = by_kind(objs, "StatefulSet")
    assert sts and "jetstream" in str(by_kind(objs, "ConfigMap"))


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
