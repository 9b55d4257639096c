"""Configuration loading (file < env < flags, errors naming the field) and generated schema files."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cache_indexer.config_loader import ConfigError, load_config
from schemas import generate


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
    (["blockKey.hashAlgo=xxhash"], "blockKey"),
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
    assert not stale, f"run python -m schemas.generate; stale: {stale}"


def test_openapi_documents_every_error_code():
    doc = generate.openapi()
    responses = doc["paths"]["/kv-cache/hit-rate"]["post"]["responses"]
    assert {"200", "400", "405", "413", "500"} <= set(responses)
