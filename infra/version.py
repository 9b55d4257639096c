"""The product's version, from one place: ``[project] version`` in pyproject.toml.

A source checkout reads pyproject.toml itself (an editable install's metadata keeps the version it was
installed with); an installed distribution reads its metadata, which the build copied from it.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

DISTRIBUTION = "cache-indexer"
_PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def _from_source() -> str | None:
    try:
        import tomllib  # Python 3.11+; 3.10 falls back to the metadata
    except ImportError:
        return None
    try:
        project = tomllib.loads(_PYPROJECT.read_text()).get("project", {})
    except (OSError, ValueError):
        return None
    return project.get("version") if project.get("name") == DISTRIBUTION else None


def _from_metadata() -> str | None:
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return None


#: "0+unknown" only where neither a source tree nor an installed distribution is found
VERSION: str = _from_source() or _from_metadata() or "0+unknown"
