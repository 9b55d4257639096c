"""Issue 25: the import graph of the product's packages points one way, and no module uses another
package's private names.

Layers, bottom to top (docs/development.md, Layout): ``schemas`` (the contracts: wire formats, configuration, the
block hash); ``infra`` (the shared ground: NATS streams, leases, authentication, tasks, metrics,
configuration loading); ``bridge`` and ``indexer`` side by side, neither importing the other; ``api``
above the indexer; ``cache_indexer``, the program, on top. Every import statement counts, also one
inside a function, and so does an attribute read through an imported module (``block_hash._x``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: package -> the product packages it may import (besides itself)
MAY_IMPORT: dict[str, set[str]] = {
    "schemas": set(),
    "infra": {"schemas"},
    "bridge": {"schemas", "infra"},
    "indexer": {"schemas", "infra"},
    "api": {"schemas", "infra", "indexer"},
    "cache_indexer": {"schemas", "infra", "bridge", "indexer", "api"},
}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def violations(root: Path) -> list[str]:
    """Every import against the layers and every use of another package's private name, as
    ``path:line: what`` (the test's subject; also run on a tree made to break the rules)."""
    found = []
    for package in MAY_IMPORT:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root)
            tree = ast.parse(path.read_text(), str(rel))
            modules: dict[str, str] = {}  # local name -> the other package's module it is bound to
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    targets = [(alias.name, alias.asname or alias.name.split(".")[0], None) for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    targets = [(node.module, alias.asname or alias.name, alias.name) for alias in node.names]
                else:
                    continue
                for module, local, name in targets:
                    top = module.split(".")[0]
                    if top not in MAY_IMPORT or top == package:
                        continue
                    if top not in MAY_IMPORT[package]:
                        found.append(f"{rel}:{node.lineno}: {package} imports {module} (a layer it may not use)")
                    parts = module.split(".")[1:] + ([name] if name else [])
                    if any(_private(p) for p in parts):
                        found.append(f"{rel}:{node.lineno}: private name {'.'.join([module] + ([name] if name else []))}")
                    modules[local] = module if name is None else f"{module}.{name}"
            for node in ast.walk(tree):
                if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                        and node.value.id in modules and _private(node.attr)):
                    found.append(f"{rel}:{node.lineno}: private name {modules[node.value.id]}.{node.attr}")
    return list(dict.fromkeys(found))


def test_imports_point_one_way_and_private_names_stay_home():
    assert violations(ROOT) == []


@pytest.mark.parametrize("source, what", [
    ("from indexer.l1_state import L1State\n", "bridge imports indexer.l1_state"),
    ("def f():\n    from cache_indexer import cli\n", "bridge imports cache_indexer"),
    ("from infra.streams import _helper\n", "private name infra.streams._helper"),
    ("from schemas import block_hash\nx = block_hash._blockhash\n", "private name schemas.block_hash._blockhash"),
    ("import infra.streams\n", None),
])
def test_the_walk_sees_what_it_must(tmp_path, source, what):
    """The checker itself: a bridge module that breaks a rule is named, one that keeps them is not."""
    for package in MAY_IMPORT:
        (tmp_path / package).mkdir()
    (tmp_path / "bridge" / "m.py").write_text(source)
    found = violations(tmp_path)
    assert [v for v in found if what in v] if what else not found, found


def test_each_package_says_what_it_holds_and_may_import():
    for package in MAY_IMPORT:
        doc = ast.get_docstring(ast.parse((ROOT / package / "__init__.py").read_text()))
        assert doc and "import" in doc, f"{package}/__init__.py: a docstring saying what it holds and may import"


def test_the_image_and_the_wheel_carry_every_package():
    """A package the program imports but the image or the wheel leaves out fails only once deployed."""
    import re

    from setuptools import find_packages

    docker = (ROOT / "Dockerfile").read_text()
    include = re.search(r"^include = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    found = set(find_packages(ROOT, include=re.findall(r'"([^"]+)"', include)))
    for package in MAY_IMPORT:
        assert f"COPY {package} ./{package}" in docker, f"the Dockerfile does not copy {package}/"
        subpackages = {str(p.parent.relative_to(ROOT)).replace("/", ".") for p in (ROOT / package).rglob("__init__.py")}
        assert subpackages <= found, f"the wheel leaves out {sorted(subpackages - found)}"
