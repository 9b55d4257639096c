"""Issue 25: the import graph of the product's packages points one way, and no module uses another
package's private names. Issue 38: the distribution has one top-level name, ``cache_indexer``, and the
repository's folders are imported as its subpackages (``cache_indexer.bridge``, ...), never by their bare
folder names (which would collide with any other ``api`` or ``schemas`` in site-packages).

Layers, bottom to top (docs/development.md, Layout): ``schemas`` (the contracts: wire formats, configuration, the
block hash); ``infra`` (the shared ground: NATS streams, leases, authentication, tasks, metrics,
configuration loading); ``bridge`` and ``indexer`` side by side, neither importing the other; ``api``
above the indexer; ``cache_indexer``, the program, on top. A layer is a folder at the repository root,
imported as ``cache_indexer.<folder>`` (``cache_indexer`` itself for the program's own folder). Every import
statement counts, also one inside a function, and so does an attribute read through an imported module
(``block_hash._x``).
"""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOP = "cache_indexer"
#: package (folder) -> the product packages it may import (besides itself)
MAY_IMPORT: dict[str, set[str]] = {
    "schemas": set(),
    "infra": {"schemas"},
    "bridge": {"schemas", "infra"},
    "indexer": {"schemas", "infra"},
    "api": {"schemas", "infra", "indexer"},
    TOP: {"schemas", "infra", "bridge", "indexer", "api"},
}
#: the folders installed under cache_indexer, whose bare names no code may import
SUBPACKAGES = tuple(p for p in MAY_IMPORT if p != TOP)
#: where tests/test_layout.py looks for Python files beside the product (tests, benchmarks, the build)
OTHER_CODE = ("tests", "bench", "examples", "setup.py")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _layer(full: str) -> tuple[str | None, int]:
    """The layer a dotted import name belongs to and how many of its parts name the layer
    (``cache_indexer.infra.streams`` -> ("infra", 2); ``cache_indexer.cli`` -> ("cache_indexer", 1))."""
    parts = full.split(".")
    if parts[0] != TOP:
        return None, 0
    if len(parts) > 1 and parts[1] in SUBPACKAGES:
        return parts[1], 2
    return TOP, 1


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
                    targets = [(alias.name, alias.asname or alias.name.split(".")[0], alias.name if alias.asname else alias.name.split(".")[0])
                               for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    targets = [(f"{node.module}.{alias.name}", alias.asname or alias.name, f"{node.module}.{alias.name}")
                               for alias in node.names]
                else:
                    continue
                for full, local, bound in targets:
                    layer, depth = _layer(full)
                    if layer is None or layer == package:
                        continue
                    if layer not in MAY_IMPORT[package]:
                        found.append(f"{rel}:{node.lineno}: {package} imports {full} (a layer it may not use)")
                    if any(_private(p) for p in full.split(".")[depth:]):
                        found.append(f"{rel}:{node.lineno}: private name {full}")
                    modules[local] = bound
            for node in ast.walk(tree):
                if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                        and node.value.id in modules and _private(node.attr)):
                    found.append(f"{rel}:{node.lineno}: private name {modules[node.value.id]}.{node.attr}")
    return list(dict.fromkeys(found))


def _python_files(root: Path):
    for name in (*MAY_IMPORT, *OTHER_CODE):
        base = root / name
        yield from sorted(base.rglob("*.py")) if base.is_dir() else ([base] if base.is_file() else [])


def _module_names(root: Path) -> set[str]:
    """The bare dotted names the folders' modules would have (``indexer.service``, ``schemas._blockhash``)."""
    names = set()
    for package in SUBPACKAGES:
        for path in (root / package).rglob("*"):
            if path.suffix in (".py", ".c") and path.name != "__init__.py":
                names.add(".".join(path.relative_to(root).with_suffix("").parts))
    return names


def bare_names(root: Path) -> list[str]:
    """Every import of a folder by its bare name (``import bridge.service``, ``from schemas import x``), and
    every string literal that names one of their modules by it (a ``mock.patch`` or ``-m`` target, an
    extension module's name, a logger's), in the product, the tests, the benchmarks and the build."""
    modules = _module_names(root)
    dotted = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
    found = []
    for path in _python_files(root):
        rel = path.relative_to(root)
        tree = ast.parse(path.read_text(), str(rel))
        docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
                  and dotted.fullmatch(node.value)):
                parts = node.value.split(".")
                if any(".".join(parts[:n]) in modules for n in range(2, len(parts) + 1)):
                    found.append(f"{rel}:{node.lineno}: {node.value!r} names a module by its bare name")
                continue
            else:
                continue
            found += [f"{rel}:{node.lineno}: imports {name} (cache_indexer.{name})" for name in names
                      if name.split(".")[0] in SUBPACKAGES]
    return found


def test_imports_point_one_way_and_private_names_stay_home():
    assert violations(ROOT) == []


def test_code_imports_the_folders_as_subpackages_of_cache_indexer():
    """``import bridge`` would find another distribution's ``bridge`` once installed (or nothing at all)."""
    assert bare_names(ROOT) == []


@pytest.mark.parametrize("source, what", [
    ("from cache_indexer.indexer.l1_state import L1State\n", "bridge imports cache_indexer.indexer.l1_state"),
    ("from cache_indexer import indexer\n", "bridge imports cache_indexer.indexer"),
    ("def f():\n    from cache_indexer import cli\n", "bridge imports cache_indexer.cli"),
    ("import cache_indexer.replica as r\n", "bridge imports cache_indexer.replica"),
    ("from cache_indexer.infra.streams import _helper\n", "private name cache_indexer.infra.streams._helper"),
    ("from cache_indexer.schemas import block_hash\nx = block_hash._blockhash\n",
     "private name cache_indexer.schemas.block_hash._blockhash"),
    ("import cache_indexer.infra.streams\n", None),
    ("from cache_indexer.infra import streams\n", None),
])
def test_the_walk_sees_what_it_must(tmp_path, source, what):
    """The checker itself: a bridge module that breaks a rule is named, one that keeps them is not."""
    for package in MAY_IMPORT:
        (tmp_path / package).mkdir()
    (tmp_path / "bridge" / "m.py").write_text(source)
    found = violations(tmp_path)
    assert [v for v in found if what in v] if what else not found, found


#: old-style sources, built from parts so that the rename codemod leaves them as they are
_OLD = "infra"


@pytest.mark.parametrize("source, what", [
    (f"import {_OLD}.streams as s\n", f"imports {_OLD}.streams"),
    (f"def f():\n    from {_OLD} import streams\n", f"imports {_OLD} "),
    (f"import os, {_OLD}\n", f"imports {_OLD} "),
    (f"X = '{_OLD}.streams.records_bucket'\n", f"'{_OLD}.streams.records_bucket' names a module"),
    (f"KEY = '{_OLD}.targets'\n", None),  # not a module: a key, a file name
    (f"ROLE = '{_OLD}'\n", None),
    (f'"""Docs may say {_OLD}.streams."""\n', None),
    ("from cache_indexer.infra import streams\nimport cache_indexer.infra.streams as s\n", None),
])
def test_the_bare_name_check_sees_what_it_must(tmp_path, source, what):
    for package in MAY_IMPORT:
        (tmp_path / package).mkdir()
    (tmp_path / "infra" / "streams.py").write_text("")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_m.py").write_text(source)
    found = bare_names(tmp_path)
    assert [v for v in found if what in v] if what else not found, found


def test_each_package_says_what_it_holds_and_may_import():
    for package in MAY_IMPORT:
        doc = ast.get_docstring(ast.parse((ROOT / package / "__init__.py").read_text()))
        assert doc and "import" in doc, f"{package}/__init__.py: a docstring saying what it holds and may import"


def test_the_image_and_the_wheel_carry_every_package_under_one_top_level_name():
    """A package the program imports but the image or the wheel leaves out fails only once deployed; a
    second top-level name in the wheel collides with other distributions in site-packages."""
    import cache_indexer

    docker = (ROOT / "Dockerfile").read_text()
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed, package_dir = set(tool["packages"]), tool["package-dir"]
    assert {p.split(".")[0] for p in listed} == {TOP}, "one top-level package"
    assert package_dir == {f"{TOP}.{p}": p for p in SUBPACKAGES}, "each folder installed as cache_indexer.<folder>"
    assert tuple(sorted(cache_indexer.SUBPACKAGES)) == tuple(sorted(SUBPACKAGES))
    assert set(tool["package-data"]) <= listed
    for package in MAY_IMPORT:
        assert f"COPY {package} ./{package}" in docker, f"the Dockerfile does not copy {package}/"
        prefix = "" if package == TOP else f"{TOP}."
        subpackages = {prefix + str(p.parent.relative_to(ROOT)).replace("/", ".") for p in (ROOT / package).rglob("__init__.py")}
        assert subpackages <= listed, f"the wheel leaves out {sorted(subpackages - listed)}"


def test_a_subpackage_imports_from_the_repository_folder():
    """In a source tree ``cache_indexer.bridge`` is the repository's bridge/ (cache_indexer/__init__.py)."""
    import cache_indexer.bridge
    import cache_indexer.schemas.block_hash

    assert Path(cache_indexer.bridge.__file__).resolve() == ROOT / "bridge" / "__init__.py"
    assert Path(cache_indexer.schemas.block_hash.__file__).resolve() == ROOT / "schemas" / "block_hash.py"
