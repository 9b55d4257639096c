"""Issue 38, the chart's operations: bridges roll over standby-first, a bridge startupProbe, grace periods
that follow http.shutdownTimeout, NOTES.txt with the first commands, a `helm test` asking the hit-rate
API, and alert rules that do not depend on the scrape job's name. Rendered with Helm's own engine,
validated against the Kubernetes schemas. About 10 s."""

from __future__ import annotations

import pytest

from tests.chart_render import by_kind, chart_with_nats, needs_nats_chart, render
from tests.test_chart import restricted_violations, validate_all

helm = pytest.importorskip("helm_python")
pytestmark = needs_nats_chart


@pytest.fixture(scope="module")
def chart(tmp_path_factory):
    return chart_with_nats(tmp_path_factory.mktemp("chart"))


def _deployment(objs, component: str) -> dict:
    return by_kind(objs, "Deployment", f"cache-indexer-{component}")[0]


def _container(objs, component: str) -> dict:
    return _deployment(objs, component)["spec"]["template"]["spec"]["containers"][0]


def test_bridges_roll_over_standby_first_and_a_single_bridge_is_recreated(chart):
    """With the lease (the default) or shards, a new bridge is up before an old one stops: never fewer
    bridges than wanted, one more meanwhile. A single active bridge (no election) is never doubled."""
    for values in (None, {"ingest": {"sharded": True}}):
        objs = render(chart, values)
        validate_all(objs)
        strategy = _deployment(objs, "bridge")["spec"]["strategy"]
        assert strategy == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
    single = render(chart, {"ingest": {"leaderElection": False}})
    assert _deployment(single, "bridge")["spec"]["strategy"] == {"type": "Recreate"}


def test_a_bridge_has_a_startup_probe_on_its_health_endpoint(chart):
    objs = render(chart)
    bridge = _container(objs, "bridge")
    probe = bridge["startupProbe"]
    assert probe["httpGet"] == {"path": "/healthz", "port": "http"}
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 60, "a minute to start before liveness counts"


@pytest.mark.parametrize("timeout, grace", [(None, 20), ("1m", 70), ("500ms", 11), (45, 55), ("2.5s", 13)])
def test_grace_periods_follow_the_shutdown_timeout(chart, timeout, grace):
    """Kubernetes kills a pod only after it had http.shutdownTimeout to stop by itself, and 10 s more."""
    objs = render(chart, None if timeout is None else {"http": {"shutdownTimeout": timeout}})
    for component in ("bridge", "indexer"):
        assert _deployment(objs, component)["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == grace


def test_a_shutdown_timeout_that_is_not_a_duration_fails_naming_it(chart, tmp_path):
    with pytest.raises(helm.HelmError, match="/http/shutdownTimeout.*'10x' does not match"):  # values.schema.json
        render(chart, {"http": {"shutdownTimeout": "10x"}})
    import shutil

    bare = tmp_path / "bare"  # where the schema is skipped, the template's own parse says it
    shutil.copytree(chart, bare)
    (bare / "values.schema.json").unlink()
    with pytest.raises(helm.HelmError, match='not a duration: "10x"'):
        render(bare, {"http": {"shutdownTimeout": "10x"}})


def helm_test_pod(objs) -> dict:
    pods = [o for o in by_kind(objs, "Pod") if o["metadata"]["name"] == "cache-indexer-test-hit-rate"]
    assert len(pods) == 1
    return pods[0]


def test_helm_test_asks_the_hit_rate_api_through_the_routers_service(chart):
    objs = render(chart, {"service": {"port": 9090}, "blockKey": {"blockSize": 32}}, hooks=True)
    validate_all(objs)
    pod = helm_test_pod(objs)
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod["spec"]["restartPolicy"] == "Never"
    container = pod["spec"]["containers"][0]
    assert container["image"] == _container(objs, "indexer")["image"], "our image: no other to mirror"
    assert container["args"][1:] == ["http://cache-indexer-service.infer.svc:9090/kv-cache/hit-rate", "32"]
    assert "resources" in container
    assert restricted_violations([pod]) == []
    assert not [o for o in render(chart) if o["kind"] == "Pod"], "a hook: not installed with the release"


def test_notes_name_the_release_and_the_first_commands(chart):
    c = helm.Chart.load(str(chart))
    try:
        out = c.render({"service": {"port": 9090}}, name="ci", namespace="infer")
    finally:
        c.close()
    notes = next(text for path, text in out.items() if path.endswith("NOTES.txt"))
    assert "http://cache-indexer-service.infer.svc:9090/kv-cache/hit-rate" in notes
    for command in ("kubectl -n infer get pods -l app.kubernetes.io/instance=ci", "helm test ci -n infer",
                    "port-forward svc/cache-indexer-service 8080:9090", "cache-indexer --version",
                    "deploy/ci-nats-box -- nats stream info KV_L1"):
        assert command in notes
    assert "{{" not in notes and "<no value>" not in notes
    nats_box = [d["metadata"]["name"] for d in by_kind(render(chart, name="ci"), "Deployment")]
    assert "ci-nats-box" in nats_box, "the deployment NOTES.txt execs into"


def test_alert_rules_select_by_a_configurable_matcher_not_the_scrape_job(chart):
    def exprs(values) -> list[str]:
        objs = render(chart, {"monitoring": {"prometheusRule": {"enabled": True, **values}}})
        return [r["expr"] for r in by_kind(objs, "PrometheusRule")[0]["spec"]["groups"][0]["rules"]]

    default = exprs({})
    assert all('{namespace="infer"}' in e and "job=" not in e for e in default)
    custom = exprs({"selector": 'kubernetes_namespace="{{ .Release.Namespace }}",team="ai"'})
    assert all('{kubernetes_namespace="infer",team="ai"}' in e for e in custom)
    assert all("{}" in e for e in exprs({"selector": ""})), "no matcher at all: metric names only"
