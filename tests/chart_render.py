"""Rendering the Helm chart with Helm's own engine (helm-python-sdk), with the official NATS chart as its
sub-chart: the archive (Apache-2.0, not committed) comes from ../shared/charts/ and is copied into a
temporary copy of the chart, as `helm dependency build` would put it. Shared by the chart tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT, SHARED

CHART = ROOT / "charts" / "cache-indexer"
NATS_ARCHIVE = SHARED / "charts" / "nats-2.14.2.tgz"
needs_nats_chart = pytest.mark.skipif(
    not NATS_ARCHIVE.exists(),
    reason=f"the official NATS chart archive is not at {NATS_ARCHIVE} (third-party, not committed; CI has it)")


def chart_with_nats(dest: Path) -> Path:
    """A copy of the chart with the NATS archive in charts/."""
    chart = dest / "cache-indexer"
    shutil.copytree(CHART, chart, ignore=shutil.ignore_patterns("*.tgz"))
    (chart / "charts").mkdir(exist_ok=True)
    shutil.copy(NATS_ARCHIVE, chart / "charts" / NATS_ARCHIVE.name)
    return chart


def umbrella(dest: Path, values: dict, chart: Path) -> Path:
    """An InferNex-like umbrella chart with cache-indexer as a conditional sub-chart."""
    parent = dest / "infernex"
    (parent / "charts").mkdir(parents=True)
    shutil.copytree(chart, parent / "charts" / "cache-indexer")
    (parent / "Chart.yaml").write_text(yaml.safe_dump({
        "apiVersion": "v2", "name": "infernex", "version": "26.6.0",
        "dependencies": [{"name": "cache-indexer", "version": "0.1.0", "repository": "file://charts/cache-indexer",
                          "condition": "cache-indexer.enabled"}]}))
    (parent / "values.yaml").write_text(yaml.safe_dump(values))
    return parent


def render(chart: Path, values: dict | None = None, name: str = "cache-indexer", namespace: str = "infer",
           hooks: bool = False) -> list[dict]:
    import helm_python as helm

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
            if doc and (hooks or "helm.sh/hook" not in (doc["metadata"].get("annotations") or {})):
                objs.append(doc)
    return objs


def by_kind(objs, kind, name=None):
    return [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def config_of(objs) -> dict:
    cm = [o for o in by_kind(objs, "ConfigMap") if o["metadata"]["name"].endswith("-config")
          and "config.yaml" in o.get("data", {})][0]
    return yaml.safe_load(cm["data"]["config.yaml"])


def nats_conf_of(objs) -> str:
    cm = [o for o in by_kind(objs, "ConfigMap") if "nats.conf" in o.get("data", {})][0]
    return cm["data"]["nats.conf"]


def secrets_of(objs) -> dict[str, dict[str, str]]:
    """The rendered Secrets' data, decoded, by name."""
    import base64

    return {s["metadata"]["name"]: {k: base64.b64decode(v).decode() for k, v in (s.get("data") or {}).items()}
            for s in by_kind(objs, "Secret")}


def container_env(objs, kind: str, name: str) -> dict[str, str]:
    """The environment the first container of a rendered workload gets, secretKeyRefs resolved against
    the rendered Secrets (fieldRefs and the like left out)."""
    secrets = secrets_of(objs)
    workload = by_kind(objs, kind, name)[0]
    env = {}
    for e in workload["spec"]["template"]["spec"]["containers"][0].get("env", []):
        ref = (e.get("valueFrom") or {}).get("secretKeyRef")
        if ref:
            env[e["name"]] = secrets[ref["name"]][ref["key"]]
        elif "value" in e:
            env[e["name"]] = e["value"]
    return env
