"""Configuration loading (file < env < flags, errors naming the field) and generated schema files."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from cache_indexer.infra.config_loader import ConfigError, load_config
from cache_indexer.schemas import generate
from tests.conftest import DATA, ROOT

SEED_VALUES = DATA / "seed-values.yaml"  # the documented product's values.yaml, exactly as documented


def test_defaults():
    cfg = load_config(env={})
    assert cfg.blockKey.hashAlgo == "sha256_cbor" and cfg.http.port == 28080
    assert cfg.http.maxHitRateBodyBytes == 4 * 1024 * 1024


def test_file_env_and_flags_in_precedence(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("http:\n  port: 9000\n  readTimeout: 3s\nblockKey:\n  pythonHashSeed: '0'\nlog:\n  level: debug\n")
    cfg = load_config(f, env={"CACHE_INDEXER_HTTP__PORT": "9100", "CACHE_INDEXER_LOG__LEVEL": "warning",
                              "CACHE_INDEXER_REQUIRE_NATS": "1"},
                      overrides=["http.port=9200", "nats.l1Stream.maxBytes=8GiB", "http.maxHitRateBodyBytes=1MiB"])
    assert cfg.http.port == 9200 and cfg.log.level == "warning" and cfg.http.readTimeout == 3.0
    assert cfg.blockKey.pythonHashSeed == "0"
    assert cfg.nats.l1Stream.maxBytes == 8 * 1024**3 and cfg.http.maxHitRateBodyBytes == 1024**2


def test_env_paths_are_case_insensitive():
    cfg = load_config(env={"CACHE_INDEXER_BLOCKKEY__HASHALGO": "sha256", "CACHE_INDEXER_NATS__L1STREAM__REPLICAS": "3"})
    assert cfg.blockKey.hashAlgo == "sha256" and cfg.nats.l1Stream.replicas == 3


@pytest.mark.parametrize("overrides,field", [
    (["http.port=70000"], "http.port"),
    (["blockKey.hashAlgo=md5"], "blockKey.hashAlgo"),
    (["http.readTimeout=soon"], "http.readTimeout"),
    (["http.nope=1"], "http.nope"),
    (["blockKey.hashAlgo=xxhash", "blockKey.pythonHashSeed=null"], "blockKey"),
    (["nats.l1Stream.maxAge=1m", "nats.l1Stream.duplicateWindow=2m"], "nats.l1Stream"),
])
def test_invalid_config_names_the_field(overrides, field):
    with pytest.raises(ConfigError) as exc:
        load_config(env={}, overrides=overrides)
    assert field in str(exc.value)


def test_cli_fails_at_startup_with_the_field_name():
    r = subprocess.run([sys.executable, "-m", "cache_indexer.cli", "indexer", "--set", "http.port=-1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "http.port" in r.stderr


def test_generated_schemas_are_current():
    stale = [str(p) for p, doc in generate.documents().items() if not p.exists() or p.read_text() != generate.render(doc)]
    assert not stale, f"run python -m cache_indexer.schemas.generate; stale: {stale}"


def test_openapi_documents_every_error_code():
    doc = generate.openapi()
    responses = doc["paths"]["/kv-cache/hit-rate"]["post"]["responses"]
    assert {"200", "400", "405", "413", "500"} <= set(responses)


def test_the_documented_values_file_loads_with_its_documented_meaning():
    cfg = load_config(SEED_VALUES, env={})
    assert cfg.blockKey.hashAlgo == "sha256_cbor" and cfg.blockKey.pythonHashSeed == "0"
    assert cfg.blockKey.useIntBlockHashes is True
    assert cfg.http.port == 28080, "service.targetPort is the port the API listens on"
    assert (cfg.http.shutdownTimeout, cfg.http.readHeaderTimeout, cfg.http.readTimeout, cfg.http.writeTimeout,
            cfg.http.idleTimeout) == (10, 10, 30, 30, 120)
    assert (cfg.http.maxHeaderBytes, cfg.http.maxHitRateBodyBytes) == (1048576, 4194304)
    assert (cfg.discovery.refreshInterval, cfg.discovery.segmentsFetchTimeout) == (10, 2)
    v, m = cfg.discovery.vllm, cfg.discovery.mooncakeMaster
    assert v.labelSelector == {"openfuyao.com/engine": "vllm"} and v.zmqPortName == "zmq-pub"
    assert v.pdRoleLabel == "openfuyao.com/pdRole" and v.pdRoles == ["prefill", "aggregate"]
    assert m.labelSelector == {"openfuyao.com/kvmanager": "mooncake"}
    assert (m.httpPortName, m.rpcPortName, m.httpPort, m.rpcPort) == ("http", "rpc", 9003, 0)
    assert (cfg.ingest.l1.backoffInitial, cfg.ingest.l1.backoffMax) == (1, 30)
    assert (cfg.ingest.l3.scheme, cfg.ingest.l3.pollInterval, cfg.ingest.l3.httpTimeout) == ("http", 10, 5)
    assert cfg.log.level == "info"


def test_defaults_are_the_documented_ones():
    documented = load_config(SEED_VALUES, env={}).model_dump()
    assert load_config(env={}).model_dump() == documented


def test_the_charts_own_values_file_loads():
    cfg = load_config(ROOT / "charts" / "cache-indexer" / "values.yaml", env={})
    assert cfg.discovery.mode == "kubernetes" and cfg.blockKey.pythonHashSeed == "0"
    assert cfg.nats.l3Stream.maxBytes < cfg.nats.l1Stream.maxBytes


@pytest.mark.parametrize("path", [SEED_VALUES, ROOT / "charts" / "cache-indexer" / "values.yaml"], ids=["documented", "chart"])
def test_config_show_prints_the_effective_tree_of_a_values_file(path):
    import yaml

    r = subprocess.run([sys.executable, "-m", "cache_indexer.cli", "config", "show", "--config", str(path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    tree = yaml.safe_load(r.stdout)
    assert tree["blockKey"]["hashAlgo"] == "sha256_cbor" and tree["blockKey"]["pythonHashSeed"] == "0"
    assert "image" not in tree and "resources" not in tree and "labels" not in tree["discovery"]
    assert tree["http"]["idleTimeout"] == "120s"


@pytest.mark.parametrize("text,problem", [
    ("blockKey:\n  hashAlgo: sha256\n  prefixCachingHashAlgo: sha256_cbor\n", "blockKey.prefixCachingHashAlgo"),
    ("http:\n  port: 9000\nservice:\n  targetPort: 28080\n", "service.targetPort"),
    ("discovery:\n  labels:\n    engineValue: sglang\n  vllm:\n    labelSelector: {openfuyao.com/engine: vllm}\n",
     "discovery.labels.engineKey/engineValue"),
    ("discovery:\n  labels:\n    pdRoleValue: [prefill]\n  vllm:\n    pdRoles: [decode]\n", "discovery.labels.pdRoleValue"),
    ("discovery:\n  labels:\n    engineName: x\n", "unknown keys"),
    ("nats:\n  bogus: 1\n", "nats.bogus"),
])
def test_two_names_for_one_setting_must_agree(tmp_path, text, problem):
    f = tmp_path / "values.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=problem.replace(".", r"\.")):
        load_config(f, env={})


def test_both_names_agreeing_is_fine(tmp_path):
    f = tmp_path / "values.yaml"
    f.write_text("blockKey:\n  hashAlgo: sha256\n  prefixCachingHashAlgo: sha256\nservice:\n  targetPort: 9000\n"
                 "http:\n  port: 9000\ndiscovery:\n  labels:\n    engineKey: app\n    engineValue: vllm\n"
                 "  vllm:\n    labelSelector: {app: vllm, tier: gpu}\n")
    cfg = load_config(f, env={})
    assert cfg.blockKey.hashAlgo == "sha256" and cfg.http.port == 9000
    assert cfg.discovery.vllm.labelSelector == {"app": "vllm", "tier": "gpu"}


@pytest.mark.parametrize("text", ["0123", "00", "0", "1e3", "0x1F"])
def test_text_settings_stay_text_from_every_source(tmp_path, text):
    assert load_config(env={"CACHE_INDEXER_BLOCKKEY__PYTHONHASHSEED": text}).blockKey.pythonHashSeed == text
    assert load_config(env={}, overrides=[f"blockKey.pythonHashSeed={text}"]).blockKey.pythonHashSeed == text
    f = tmp_path / "c.yaml"
    f.write_text(f"blockKey:\n  pythonHashSeed: {text}\ningest:\n  l1:\n    topic: {text}\n")
    cfg = load_config(f, env={})
    assert cfg.blockKey.pythonHashSeed == text and cfg.ingest.l1.topic == text
    assert load_config(env={"CACHE_INDEXER_BLOCKKEY__PYTHONHASHSEED": "null"}).blockKey.pythonHashSeed is None


def test_documented_names_work_from_the_environment():
    cfg = load_config(env={"CACHE_INDEXER_BLOCKKEY__PREFIXCACHINGHASHALGO": "xxhash",
                           "CACHE_INDEXER_DISCOVERY__LABELS__ENGINEVALUE": "vllm-a"})
    assert cfg.blockKey.hashAlgo == "xxhash" and cfg.discovery.vllm.labelSelector == {"openfuyao.com/engine": "vllm-a"}


# -- one name per setting (issue 38) ---------------------------------------------------------------
def test_a_deprecated_name_is_logged_naming_both_and_the_setting_shows_its_name():
    """The documented values file works as it is; each deprecated name it uses is one warning that names
    the current name, and `config show` prints the current names. A few seconds (one process)."""
    import yaml

    r = subprocess.run([sys.executable, "-m", "cache_indexer.cli", "config", "show", "--config", str(SEED_VALUES)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    for old, new in (("blockKey.prefixCachingHashAlgo", "blockKey.hashAlgo"), ("service.targetPort", "http.port"),
                     ("discovery.labels.pdRoleValue", "discovery.vllm.pdRoles"),
                     ("discovery.labels.engineKey/discovery.labels.engineValue", "discovery.vllm.labelSelector")):
        assert f"{old} " in r.stderr and f"deprecated: use {new} " in r.stderr, r.stderr
    tree = yaml.safe_load(r.stdout)
    assert "prefixCachingHashAlgo" not in tree["blockKey"] and tree["blockKey"]["hashAlgo"] == "sha256_cbor"
    chart = subprocess.run([sys.executable, "-m", "cache_indexer.cli", "config", "show", "--config",
                            str(ROOT / "charts" / "cache-indexer" / "values.yaml")], capture_output=True, text=True,
                           timeout=60)
    assert chart.returncode == 0 and "deprecated" not in chart.stderr, "the chart's own values use current names"


@pytest.mark.parametrize("text,renamed", [
    ("jetstream:\n  l1:\n    maxBytes: 2GiB\n  leaseTtl: 20s\n  replicas: 3\n",
     {"jetstream.l1.maxBytes": "nats.l1Stream.maxBytes", "jetstream.leaseTtl": "nats.lease.ttl",
      "jetstream.replicas": "nats.replicas"}),
    ("service:\n  targetPort: 9000\n", {"service.targetPort": "http.port"}),
    ("http:\n  port: 9000\n", {}),
])
def test_every_deprecated_name_found_is_reported(tmp_path, text, renamed):
    f = tmp_path / "values.yaml"
    f.write_text(text)
    cfg = load_config(f, env={})
    assert {n.written: n.name for n in cfg.renamed} == renamed
    if "replicas" in text:  # one knob: every stream follows nats.replicas
        assert cfg.nats.replicas == cfg.nats.l1Stream.replicas == cfg.nats.l3Stream.replicas == 3
        assert cfg.nats.l1Stream.maxBytes == 2 << 30 and cfg.nats.lease.ttl == 20


@pytest.mark.parametrize("source", ["file", "env", "flag"])
def test_an_error_names_the_key_as_the_user_wrote_it(tmp_path, source):
    """Before, a bad value under a deprecated name was reported under the other name only."""
    f = tmp_path / "values.yaml"
    f.write_text("blockKey:\n  prefixCachingHashAlgo: md5\n")
    kwargs = {"file": {"file": f, "env": {}},
              "env": {"env": {"CACHE_INDEXER_BLOCKKEY__PREFIXCACHINGHASHALGO": "md5"}},
              "flag": {"env": {}, "overrides": ["blockKey.prefixCachingHashAlgo=md5"]}}[source]
    with pytest.raises(ConfigError, match=r"blockKey\.prefixCachingHashAlgo \(now blockKey\.hashAlgo\)"):
        load_config(**kwargs)


def test_secrets_are_never_printed_by_config_show():
    """registrationToken, the NATS password and token, and credentials in a NATS URL: masked. One process."""
    env = {**os.environ, "CACHE_INDEXER_HTTP__REGISTRATIONTOKEN": "reg-s3cret", "CACHE_INDEXER_NATS__USER": "u",
           "CACHE_INDEXER_NATS__PASSWORD": "pw-s3cret", "CACHE_INDEXER_NATS__URL": "nats://u:url-s3cret@nats:4222"}
    r = subprocess.run([sys.executable, "-m", "cache_indexer.cli", "config", "show"], capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    assert "s3cret" not in r.stdout + r.stderr
    import yaml

    tree = yaml.safe_load(r.stdout)
    assert tree["http"]["registrationToken"] == tree["nats"]["password"] == "**********"
    assert tree["nats"]["url"] == "nats://***@nats:4222"
    token_only = subprocess.run([sys.executable, "-m", "cache_indexer.cli", "config", "show"], capture_output=True,
                                text=True, timeout=60, env={**os.environ, "CACHE_INDEXER_NATS__TOKEN": "tok-s3cret"})
    assert token_only.returncode == 0 and "s3cret" not in token_only.stdout


def test_the_generated_files_come_from_the_model():
    """The reference, the JSON Schema, values.schema.json and the chart's key check are regenerated and
    compared (test_generated_schemas_are_current); here: each setting of the model is in each of them,
    with its description."""
    import json

    from cache_indexer.schemas.chart_values import CHART_NATS_SETTINGS
    from cache_indexer.schemas.config_reference import settings

    reference = (ROOT / "docs" / "configuration.md").read_text()
    values_schema = json.loads((ROOT / "charts" / "cache-indexer" / "values.schema.json").read_text())
    config_schema = json.loads((ROOT / "schemas" / "jsonschema" / "config.json").read_text())
    for path, info, _ in settings(generate.Config):
        assert info.description, f"{path} has no description"
        assert f"| `{path}` |" in reference, path
        chart_sets_it = path.startswith("nats.") and path.split(".")[1] not in CHART_NATS_SETTINGS
        for schema in (config_schema,) if chart_sets_it else (config_schema, values_schema):
            node = schema
            for seg in path.split("."):
                while "$ref" in node:
                    node = schema["$defs"][node["$ref"].rsplit("/", 1)[-1]]
                node = node["properties"][seg]
            assert node.get("description") == info.description, path
    assert values_schema["additionalProperties"] is False
