"""Issue 38, version and observability: one version (pyproject.toml) behind ``--version``,
``__version__``, the chart's appVersion and ``cache_indexer_build_info``; each process exporting only its
own metrics; JSON logs with RFC 3339 timestamps and pod / rank / master as fields; a LICENSE. The
process test runs a real bridge and a real indexer against a real nats-server (about 10 s)."""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import subprocess
import sys
import tomllib
from datetime import datetime
from importlib.util import find_spec

import aiohttp
import yaml
from prometheus_client.parser import text_string_to_metric_families

import cache_indexer
from cache_indexer.cli import NATIVE_MODULES
from cache_indexer.infra.log_format import JsonFormatter, TextFormatter
from cache_indexer.infra.metrics import BRIDGE, INDEXER, SHARED, Metrics
from tests.conftest import ROOT, free_port, http_ready, make_config, wait_for
from tests.test_recovery import stop_all, write_config

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
RFC3339_MS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}(Z|[+-]\d\d:\d\d)$")


def test_one_version_behind_the_package_the_command_and_the_chart():
    version = PYPROJECT["version"]
    assert cache_indexer.__version__ == version
    chart = yaml.safe_load((ROOT / "charts" / "cache-indexer" / "Chart.yaml").read_text())
    assert chart["appVersion"] == version, "Chart.yaml appVersion follows pyproject.toml's version"
    out = subprocess.run([sys.executable, "-m", "cache_indexer.cli", "--version"], cwd=ROOT, capture_output=True,
                         text=True, timeout=30, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0 and out.stdout.strip() == f"cache-indexer {version}", out


def test_the_license_the_package_declares_is_in_the_repository():
    assert PYPROJECT["license"] == {"text": "Apache-2.0"}
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    assert re.search(r"^COPY .*\bLICENSE\b", (ROOT / "Dockerfile").read_text(), re.M), "the wheel carries it"


def test_build_info_names_the_accelerators_setup_py_builds():
    assert set(NATIVE_MODULES) == set(re.findall(r'Extension\("([\w.]+)"', (ROOT / "setup.py").read_text()))


def test_every_metric_is_exported_by_the_processes_it_belongs_to():
    assert not (SHARED & BRIDGE or SHARED & INDEXER or BRIDGE & INDEXER), "each metric in one group"
    families = {name: _families(Metrics(name)) for name in ("bridge", "indexer")}
    everything = _families(Metrics())
    assert families["bridge"] | families["indexer"] == everything, "local mode exports both"
    assert "cache_indexer_ready" not in families["bridge"] and "cache_indexer_bridge_leader" not in families["indexer"]
    assert "process_resident_memory_bytes" in families["bridge"] & families["indexer"]


def _families(metrics: Metrics) -> set[str]:
    return {f.name for f in metrics.registry.collect()}


def _names(families) -> set[str]:
    """Family names as the text format shows them, without a counter's ``_created`` companion."""
    return {(f if isinstance(f, str) else f.name).removesuffix("_created") for f in families}


def test_json_logs_carry_rfc3339_timestamps_and_what_a_record_is_about():
    logger = logging.getLogger("cache_indexer.test")
    record = logger.makeRecord(logger.name, logging.WARNING, __file__, 1, "%s rank %d: gap", ("10.0.0.7", 1), None,
                               extra={"pod": "10.0.0.7", "rank": 1})
    line = json.loads(JsonFormatter().format(record))
    assert RFC3339_MS.match(line["ts"]) and datetime.fromisoformat(line["ts"]).utcoffset() is not None, line
    assert (line["level"], line["msg"], line["pod"], line["rank"]) == ("warning", "10.0.0.7 rank 1: gap", "10.0.0.7", 1)
    assert RFC3339_MS.match(TextFormatter().format(record).split(" ")[0])


async def test_a_bridge_and_an_indexer_export_only_their_own_series_and_log_json(nats_url, stream_prefix, tmp_path):
    """Each process scraped: exactly its component's families (and the shared ones: its HTTP server,
    event loop, NATS connection, process and build), the build naming pyproject's version; its log one
    JSON object a line, the bridge's subscription naming the engine's pod and rank as fields; and the
    chart's `helm test` script passing against the indexer."""
    cfg = make_config(nats_url, stream_prefix, log={"format": "json", "level": "info"})
    targets = tmp_path / "targets.yaml"
    targets.write_text(f"vllm:\n  - ip: 127.0.0.1\n    zmqPort: {free_port()}\n")
    ports = {"bridge": free_port(), "indexer": free_port()}
    logs = {name: tmp_path / f"{name}.log" for name in ports}
    procs = {}
    for name, port in ports.items():
        cfg_file = write_config(cfg, tmp_path / f"{name}.yaml", **{"discovery.static.file": str(targets),
                                                                    "http.port": port})
        with logs[name].open("wb") as err:
            procs[name] = subprocess.Popen([sys.executable, "-m", "cache_indexer.cli", name, "--config", str(cfg_file)],
                                           cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=err)
    try:
        async with aiohttp.ClientSession() as session:
            for name, port in ports.items():
                await wait_for(lambda: http_ready(session, f"http://127.0.0.1:{port}/readyz"), 60, f"{name} ready")
            await wait_for(lambda: "subscribed 127.0.0.1 rank 0" in logs["bridge"].read_text(), 30, "the subscription")
            scraped = {}
            for name, port in ports.items():
                async with session.get(f"http://127.0.0.1:{port}/metrics") as r:
                    scraped[name] = {f.name: f for f in text_string_to_metric_families(await r.text())}
        for name in ports:
            assert _names(scraped[name]) == _names(text_string_to_metric_families(Metrics(name).render().decode())), \
                f"{name} exports its own families only"
            (build,) = scraped[name]["cache_indexer_build_info"].samples
            native = "yes" if all(find_spec(m) for m in NATIVE_MODULES) else "no"
            assert build.labels == {"version": PYPROJECT["version"], "python": platform.python_version(),
                                    "native": native, "component": name} and build.value == 1
        assert "cache_indexer_ready" not in scraped["bridge"]
        assert [s.value for s in scraped["bridge"]["cache_indexer_bridge_leader"].samples] == [1]
        assert [s.value for s in scraped["indexer"]["cache_indexer_ready"].samples] == [1]
        assert not {n for n in scraped["indexer"] if n.startswith(("cache_indexer_bridge_", "cache_indexer_l3_poll"))}

        from tests.chart_render import CHART, by_kind, render

        objs = render(CHART, {"nats": {"enabled": False}, "externalNats": {"url": "nats://nats:4222"}}, hooks=True)
        script = next(p for p in by_kind(objs, "Pod") if p["metadata"]["name"].endswith("-test-hit-rate"))
        script = script["spec"]["containers"][0]["args"][0]
        url = f"http://127.0.0.1:{ports['indexer']}/kv-cache/hit-rate"
        out = subprocess.run([sys.executable, "-c", script, url, "16"], capture_output=True, text=True, timeout=90)
        assert out.returncode == 0 and f"POST {url}: 200" in out.stdout, out
    finally:
        await stop_all(procs.values(), 30)
    for name in ports:
        lines = [json.loads(line) for line in logs[name].read_text().splitlines()]
        assert lines and all(RFC3339_MS.match(line["ts"]) for line in lines), name
    subscribed = [line for line in map(json.loads, logs["bridge"].read_text().splitlines())
                  if line["msg"].startswith("subscribed 127.0.0.1 rank 0")]
    assert subscribed and subscribed[0]["pod"] == "127.0.0.1" and subscribed[0]["rank"] == 0
