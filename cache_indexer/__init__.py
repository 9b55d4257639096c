"""The program, on top: the ``cache-indexer`` command (``cli``), a replica (indexer + API,
``replica``), local mode's embedded nats-server (``nats_server``, ``runtime_file``), the events CLI
(``inspect_events``; ``decode_event`` for the nats CLI's --translate) and ``simulate`` (fake vLLM
engines, which only it and the tests run).

May import: every package of the product. Nothing of the product imports it.

It is also the distribution's one top-level name: the product's packages are imported as
``cache_indexer.schemas``, ``cache_indexer.infra``, ``cache_indexer.bridge``, ``cache_indexer.indexer``
and ``cache_indexer.api``. A wheel installs them as real subfolders (pyproject.toml's package-dir); in a
source tree (a checkout, an editable install) they are the folders beside this one, which the
repository keeps as its layout, so the package's search path also covers the repository root there.
"""

from pathlib import Path as _Path

#: the product's packages; folders at the repository root, subpackages of this one once installed
SUBPACKAGES = ("schemas", "infra", "bridge", "indexer", "api")


def _source_root() -> _Path | None:
    """The repository root when this package is run from a source tree (the subpackages beside it, not in
    it), else None. Checked precisely so that an unrelated ``api`` package next to an installed
    ``cache_indexer`` in site-packages is never taken for ours."""
    here = _Path(__file__).resolve().parent
    root = here.parent
    if any((here / name).is_dir() for name in SUBPACKAGES) or not (root / "pyproject.toml").is_file():
        return None
    if not all((root / name / "__init__.py").is_file() for name in SUBPACKAGES):
        return None
    return root


_root = _source_root()
if _root is not None and str(_root) not in __path__:
    __path__.append(str(_root))  # cache_indexer.bridge -> <repo>/bridge

from cache_indexer.infra.version import VERSION as __version__  # noqa: E402  (needs the search path above)

__all__ = ["__version__"]
