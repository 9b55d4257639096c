"""The command line as a new user meets it: help pages, `config show`, `python -m bench`, and the
README's test command in a fresh clone with nothing beside it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
SUBCOMMANDS = ["local", "simulate", "bridge", "indexer", "events", "config"]


def cli(*args: str, cwd: Path = ROOT, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cache_indexer.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


@pytest.mark.parametrize("sub", SUBCOMMANDS)
def test_every_subcommand_help_has_a_description_and_no_raw_markup(sub):
    r = cli(sub, "--help")
    assert r.returncode == 0, r.stderr
    usage, _, rest = r.stdout.partition("\n\n")
    description = rest.split("\n\n")[0].strip()
    assert description and not description.startswith(("options:", "positional")), r.stdout
    assert "``" not in r.stdout and ":class:" not in r.stdout, r.stdout


def test_top_level_help_lists_every_subcommand():
    out = cli("--help").stdout
    assert "``" not in out
    for sub in SUBCOMMANDS:
        assert f"\n  {sub} " in out or f"\n    {sub} " in out, (sub, out)


def test_config_show_prints_durations_as_written_and_the_local_tree(tmp_path):
    r = cli("config", "show")
    assert r.returncode == 0, r.stderr
    tree = yaml.safe_load(r.stdout)
    assert tree["http"]["shutdownTimeout"] == "10s" and tree["nats"]["l1Stream"]["maxAge"] == "24h"
    assert tree["nats"]["embedded"] is False and tree["http"]["host"] == "0.0.0.0"
    local = yaml.safe_load(cli("config", "show", "--local", env={"CACHE_INDEXER_RUNTIME_DIR": str(tmp_path)}).stdout)
    assert local["nats"]["embedded"] is True and local["http"]["host"] == "127.0.0.1"
    assert local["discovery"]["static"]["extraFiles"] == [str(tmp_path / "simulated-targets.yaml")]
    again = tmp_path / "shown.yaml"
    again.write_text(r.stdout)
    assert yaml.safe_load(cli("config", "show", "--config", str(again)).stdout) == tree, "what it prints loads back"


def test_bench_help_and_unknown_names():
    run = lambda *a: subprocess.run([sys.executable, "-m", "bench", *a], cwd=ROOT, capture_output=True, text=True,
                                    timeout=60)
    r = run("--help")
    assert r.returncode == 0 and "usage:" in r.stdout and "hashing" in r.stdout
    r = run("nope")
    assert r.returncode == 2 and "invalid choice: 'nope'" in r.stderr and "Traceback" not in r.stderr


def test_the_dynamo_side_by_side_says_what_is_missing_and_skips():
    """The peer is an optional extra: without it the benchmark prints why and how to get it."""
    env = {k: v for k, v in os.environ.items() if k != "DYNAMO_PYTHON"}
    code = "import bench.dynamo as d; d.dynamo_python = lambda: None; print(d.table(d.run()))"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0 and "skipped: Dynamo's indexer is not installed: pip install -e '.[bench]'" in r.stdout


@pytest.mark.skipif(not (ROOT / ".git").exists() or shutil.which("git") is None, reason="needs a git checkout")
def test_readme_test_command_collects_in_a_fresh_clone_without_shared(tmp_path):
    """A user's clone has no ../shared: every test must find its data inside the repository."""
    clone = tmp_path / "clone" / "cache-indexer"
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(ROOT), str(clone)], check=True, timeout=120)
    assert not (clone.parent / "shared").exists()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
                       cwd=clone, capture_output=True, text=True, timeout=300, env={**env, "PYTHONPATH": str(clone)})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "error" not in r.stdout.lower().split("\n")[-2], r.stdout[-2000:]
    collected = [line for line in r.stdout.splitlines() if "::" in line]
    assert len(collected) > 250, f"only {len(collected)} tests collected"
