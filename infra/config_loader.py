"""Builds the effective configuration: defaults < YAML file < environment < flags.

- file: the Helm-rendered YAML (``--config``), same tree as ``schemas.config.Config``;
- environment: ``CACHE_INDEXER_<SECTION>__<FIELD>``, ``__`` separating levels, values read as YAML
  scalars (``CACHE_INDEXER_HTTP__PORT=8080``, ``CACHE_INDEXER_BLOCKKEY__PYTHONHASHSEED=0``);
- flags: ``--set section.field=value`` (repeatable), like ``helm --set``.
Text settings stay text from every source, spelled as given: ``CACHE_INDEXER_BLOCKKEY__PYTHONHASHSEED=0123``
and an unquoted ``pythonHashSeed: 0123`` in a file are the seed ``"0123"``, not YAML 1.1's octal 83.
Invalid configuration raises ConfigError naming the field as the user wrote it. Deprecated names
(schemas.helm_values.RENAMED) work; each one found is kept on the Config (``Config.renamed``) for the
process to log once its logging is set up (``log_renamed``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from cache_indexer.schemas.config import Config, NatsConfig, is_text_field
from cache_indexer.schemas.helm_values import Renamed, parent_node, to_config_tree

ENV_PREFIX = "CACHE_INDEXER_"


class ConfigError(ValueError):
    pass


def _annotation_at(path: list[str]) -> Any:
    """The type annotation of the Config field at ``path`` (exact names), or None."""
    current: Any = Config
    annotation = None
    for seg in path:
        fields = getattr(current, "model_fields", None)
        if not fields or seg not in fields:
            return None
        annotation = fields[seg].annotation
        current = annotation if isinstance(annotation, type) else None
    return annotation


def _plain_numbers(node: yaml.Node, path: tuple = ()) -> dict[tuple, str]:
    """Unquoted numbers of a YAML document by path, as written (what a text setting must keep)."""
    out: dict[tuple, str] = {}
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            out.update(_plain_numbers(value, (*path, key.value)))
    elif isinstance(node, yaml.ScalarNode) and node.style is None and node.tag.endswith((":int", ":float")):
        out[path] = node.value
    return out


def _keep_text(tree: dict, raw: dict[tuple, str]) -> None:
    for path, text in raw.items():
        node = tree
        for seg in path[:-1]:
            node = node.get(seg) if isinstance(node, dict) else None
        if isinstance(node, dict) and path[-1] in node and is_text_field(_annotation_at(list(path))):
            node[path[-1]] = text


def _field_names(model: type, path: list[str]) -> list[str]:
    """Map case-insensitive env/flag path segments onto the model's field names (and its synonyms)."""
    out: list[str] = []
    current: Any = model
    names: tuple[str, ...] = ()
    for seg in path:
        fields = getattr(current, "model_fields", None)
        if not fields:
            out.append(next((n for n in names if n.lower() == seg.lower()), seg))
            current, names = None, ()
            continue
        synonyms = getattr(current, "synonyms", {})
        match = next((name for name in [*fields, *synonyms] if name.lower() == seg.lower()), seg)
        out.append(match)
        names = synonyms.get(match, ())
        annotation = fields[match].annotation if match in fields else None
        current = annotation if isinstance(annotation, type) else None
    return out


def _set_path(tree: dict, path: list[str], value: Any) -> None:
    parent_node(tree, path)[path[-1]] = value


def _scalar(text: str, path: list[str]) -> Any:
    """A value from the environment or a flag: text for text settings (null, ~ or nothing: unset where
    unset is allowed), a YAML scalar otherwise."""
    annotation = _annotation_at(path)
    if is_text_field(annotation):
        optional = type(None) in getattr(annotation, "__args__", ())
        return None if optional and text.strip() in ("", "null", "~") else text
    try:
        return yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        return text


def load_config(file: str | Path | None = None, env: Mapping[str, str] | None = None,
                overrides: Iterable[str] = (), base: dict | None = None) -> Config:
    tree: dict = dict(base or {})
    if file:
        try:
            text = Path(file).read_text()
            loaded = yaml.safe_load(text) or {}
            raw = _plain_numbers(yaml.compose(text)) if isinstance(loaded, dict) else {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read config file {file}: {exc}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {file} must hold a mapping")
        _keep_text(loaded, raw)
        _merge(tree, loaded)
    env = os.environ if env is None else env
    for key, value in sorted(env.items()):
        if key.startswith(ENV_PREFIX):
            path = [p for p in key[len(ENV_PREFIX):].split("__") if p]
            if len(path) >= 2:  # CACHE_INDEXER_<SECTION>__<FIELD>; other CACHE_INDEXER_* are not config
                names = _field_names(Config, path)
                _set_path(tree, names, _scalar(value, names))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set expects path=value, got {item!r}")
        path, value = item.split("=", 1)
        names = _field_names(Config, path.strip().split("."))
        _set_path(tree, names, _scalar(value, names))
    notes: list[Renamed] = []
    try:
        tree = to_config_tree(tree, frozenset(NatsConfig.model_fields), notes)
        cfg = Config.model_validate(tree)
    except ValueError as exc:  # ValidationError is one
        if not isinstance(exc, ValidationError):
            raise ConfigError(f"invalid configuration:\n  {exc}") from None
        written = {n.name: n.written for n in notes}
        lines = []
        for err in exc.errors(include_url=False):
            loc = ".".join(str(x) for x in err["loc"])
            loc = f"{written[loc]} (now {loc})" if loc in written else loc
            lines.append(f"  {loc}: {err['msg']}")
        raise ConfigError("invalid configuration:\n" + "\n".join(lines)) from None
    cfg.record_renamed(notes)
    return cfg


def log_renamed(cfg: Config, logger: logging.Logger | None = None) -> None:
    """One deprecation warning per deprecated name used, naming both names."""
    for note in cfg.renamed:
        (logger or logging.getLogger("cache_indexer.config")).warning("configuration: %s", note.warning())


def _merge(dst: dict, src: dict) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _merge(dst[k], v)
        else:
            dst[k] = v
