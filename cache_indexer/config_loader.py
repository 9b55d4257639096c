"""Builds the effective configuration: defaults < YAML file < environment < flags.

- file: the Helm-rendered YAML (``--config``), same tree as ``schemas.config.Config``;
- environment: ``CACHE_INDEXER_<SECTION>__<FIELD>``, ``__`` separating levels, values read as YAML
  scalars (``CACHE_INDEXER_HTTP__PORT=8080``, ``CACHE_INDEXER_BLOCKKEY__PYTHONHASHSEED=0``);
- flags: ``--set section.field=value`` (repeatable), like ``helm --set``.
Invalid configuration raises ConfigError naming the field.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from schemas.config import Config

ENV_PREFIX = "CACHE_INDEXER_"


class ConfigError(ValueError):
    pass


def _field_names(model: type, path: list[str]) -> list[str]:
    """Map case-insensitive env/flag path segments onto the model's field names."""
    out: list[str] = []
    current: Any = model
    for seg in path:
        fields = getattr(current, "model_fields", None)
        if not fields:
            out.append(seg)
            current = None
            continue
        match = next((name for name in fields if name.lower() == seg.lower()), seg)
        out.append(match)
        annotation = fields[match].annotation if match in fields else None
        current = annotation if isinstance(annotation, type) else None
    return out


def _set_path(tree: dict, path: list[str], value: Any) -> None:
    node = tree
    for seg in path[:-1]:
        nxt = node.get(seg)
        if not isinstance(nxt, dict):
            nxt = node[seg] = {}
        node = nxt
    node[path[-1]] = value


def _scalar(text: str) -> Any:
    try:
        return yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        return text


def load_config(file: str | Path | None = None, env: Mapping[str, str] | None = None,
                overrides: Iterable[str] = (), base: dict | None = None) -> Config:
    tree: dict = dict(base or {})
    if file:
        try:
            loaded = yaml.safe_load(Path(file).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read config file {file}: {exc}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {file} must hold a mapping")
        _merge(tree, loaded)
    env = os.environ if env is None else env
    for key, value in sorted(env.items()):
        if key.startswith(ENV_PREFIX):
            path = [p for p in key[len(ENV_PREFIX):].split("__") if p]
            if len(path) >= 2:  # CACHE_INDEXER_<SECTION>__<FIELD>; other CACHE_INDEXER_* are not config
                _set_path(tree, _field_names(Config, path), _scalar(value))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set expects path=value, got {item!r}")
        path, value = item.split("=", 1)
        _set_path(tree, _field_names(Config, path.strip().split(".")), _scalar(value))
    try:
        return Config.model_validate(tree)
    except ValidationError as exc:
        lines = []
        for err in exc.errors(include_url=False):
            loc = ".".join(str(x) for x in err["loc"])
            lines.append(f"  {loc}: {err['msg']}")
        raise ConfigError("invalid configuration:\n" + "\n".join(lines)) from None


def _merge(dst: dict, src: dict) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _merge(dst[k], v)
        else:
            dst[k] = v
