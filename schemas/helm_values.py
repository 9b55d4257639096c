"""Helm values files as configuration, and the one table of renamed settings.

``--config`` takes the chart's own ``values.yaml``, the documented product's ``values.yaml``
(``tests/data/seed-values.yaml``) or the tree the chart renders; each key means there what it means
in the chart.

- Keys only the deployment uses (``image``, ``resources``, ``serviceAccount``, ``podLabels``, ...) are
  accepted and left out of the product's tree; the NATS sub-chart's values under ``nats`` likewise.
- Every setting has one name, the model's (schemas/config.py). The names the documented product's
  values use and this project's earlier second names (``RENAMED``) are still accepted: they are folded
  into the setting's name and reported (the processes log a deprecation warning naming both).
- Where both names are given they must agree; different values are an error naming both (the same rule
  the chart applies at render time).
"""

from __future__ import annotations

from typing import Any, NamedTuple

#: Top-level values that shape the Kubernetes objects, not the processes.
DEPLOYMENT_KEYS = frozenset({
    "enabled", "global", "image", "imagePullSecrets", "nameOverride", "fullnameOverride", "service", "serviceAccount",
    "rbac", "resources", "indexer", "bridge", "monitoring", "podAnnotations", "podLabels", "nodeSelector",
    "tolerations", "affinity", "podSecurityContext", "securityContext", "networkPolicy", "externalNats", "jetstream",
    "natsTls", "topologySpread", "podDisruptionBudget", "registration",
})
#: Top-level values of the official NATS chart (2.14.2), found under ``nats`` when it is our sub-chart.
NATS_CHART_KEYS = frozenset({
    "enabled", "config", "configMap", "container", "extraResources", "fullnameOverride", "global", "headlessService",
    "nameOverride", "namespaceOverride", "natsBox", "podDisruptionBudget", "podTemplate", "promExporter", "reloader",
    "service", "serviceAccount", "statefulSet", "tlsCA",
    "auth",  # ours: authorization of the bundled NATS (the chart's nats.auth)
    "resources",  # ours: resources of its containers (the chart's nats.resources)
    "goMaxProcs",  # ours: nats-server's GOMAXPROCS (the chart's nats.goMaxProcs)
    "timerSlackUs",  # ours: nats-server's timer slack (the chart's nats.timerSlackUs)
})

#: Deprecated name -> the setting's name. The documented product's names (``blockKey.prefixCachingHashAlgo``,
#: ``service.targetPort``, ``discovery.labels.*``) and the chart's earlier ``jetstream`` block.
RENAMED: dict[str, str] = {
    "blockKey.prefixCachingHashAlgo": "blockKey.hashAlgo",
    "service.targetPort": "http.port",
    "discovery.labels.engineKey": "discovery.vllm.labelSelector",
    "discovery.labels.engineValue": "discovery.vllm.labelSelector",
    "discovery.labels.pdRoleKey": "discovery.vllm.pdRoleLabel",
    "discovery.labels.pdRoleValue": "discovery.vllm.pdRoles",
    "discovery.labels.kvManagerKey": "discovery.mooncakeMaster.labelSelector",
    "discovery.labels.kvManagerValue": "discovery.mooncakeMaster.labelSelector",
    "jetstream.replicas": "nats.replicas",
    "jetstream.leaseTtl": "nats.lease.ttl",
    "jetstream.duplicateWindow": "nats.l1Stream.duplicateWindow, nats.l3Stream.duplicateWindow",
    "jetstream.storage": "nats.l1Stream.storage, nats.l3Stream.storage",
    "jetstream.l1.*": "nats.l1Stream.*",
    "jetstream.l3.*": "nats.l3Stream.*",
}
#: discovery.labels.<key> -> (section, field, how): one-label selectors of the documented values.
_LABELS = {"engineKey": ("vllm", "labelSelector", "key"), "engineValue": ("vllm", "labelSelector", "value"),
           "pdRoleKey": ("vllm", "pdRoleLabel", None), "pdRoleValue": ("vllm", "pdRoles", None),
           "kvManagerKey": ("mooncakeMaster", "labelSelector", "key"),
           "kvManagerValue": ("mooncakeMaster", "labelSelector", "value")}
LABEL_KEYS = tuple(_LABELS)
_LABEL_DEFAULTS = {"engineKey": "openfuyao.com/engine", "engineValue": "vllm",
                   "kvManagerKey": "openfuyao.com/kvmanager", "kvManagerValue": "mooncake"}
_MISSING = object()


class Renamed(NamedTuple):
    """A deprecated name found in the input: ``written`` as the user wrote it, ``name`` the setting's."""

    written: str
    name: str

    def warning(self) -> str:
        verb = "are" if "/" in self.written else "is"
        return f"{self.written} {verb} deprecated: use {self.name} (same meaning; the old name still works)"


def parent_node(tree: dict, path: list[str]) -> dict:
    """The mapping that holds ``path[-1]``, created on the way where missing."""
    node = tree
    for seg in path[:-1]:
        nxt = node.get(seg)
        if not isinstance(nxt, dict):
            nxt = node[seg] = {}
        node = nxt
    return node


def fold(tree: dict, path: list[str], value: Any, source: str, notes: list[Renamed] | None = None) -> None:
    """Set ``tree[path]`` to ``value`` given under the name ``source``; a different value already there
    (given under the setting's own name) is a conflict."""
    node = parent_node(tree, path)
    have = node.get(path[-1], _MISSING)
    if have is not _MISSING and have != value and str(have) != str(value):
        raise ValueError(f"{source} ({value!r}) and {'.'.join(path)} ({have!r}) name the same setting with "
                         "different values: set only one")
    node[path[-1]] = value
    if notes is not None:
        notes.append(Renamed(source, ".".join(path)))


def to_config_tree(values: dict, nats_fields: frozenset[str], notes: list[Renamed] | None = None) -> dict:
    """The product's configuration tree from a values tree: deployment keys left out, deprecated names
    folded into the settings' names (each one reported in ``notes``). Idempotent."""
    out = dict(values)
    if any(k in values for k in DEPLOYMENT_KEYS) or _has_nats_chart_values(values, nats_fields):
        out = {k: v for k, v in values.items() if k not in DEPLOYMENT_KEYS}
        nats = out.get("nats")
        if isinstance(nats, dict):
            out["nats"] = {k: v for k, v in nats.items() if k in nats_fields or k not in NATS_CHART_KEYS}
        _fold_deployment_names(values, out, notes)
    _fold_block_key(out, notes)
    _fold_labels(out, notes)
    return out


def _fold_deployment_names(values: dict, out: dict, notes: list[Renamed] | None) -> None:
    nats = values.get("nats")
    service = values.get("service")
    if isinstance(service, dict) and service.get("targetPort") is not None:
        fold(out, ["http", "port"], service["targetPort"], "service.targetPort", notes)
    external = values.get("externalNats")
    if isinstance(external, dict) and external.get("url") and not (isinstance(nats, dict) and nats.get("enabled")):
        fold(out, ["nats", "url"], external["url"], "externalNats.url")  # the chart's key for an external NATS
    js = values.get("jetstream")
    if isinstance(js, dict):
        for key in ("duplicateWindow", "storage"):
            if key in js:
                for stream in ("l1Stream", "l3Stream"):
                    fold(out, ["nats", stream, key], js[key], f"jetstream.{key}", notes)
        if "replicas" in js:  # every JetStream asset: the streams follow nats.replicas unless given their own
            fold(out, ["nats", "replicas"], js["replicas"], "jetstream.replicas", notes)
        if "leaseTtl" in js:
            fold(out, ["nats", "lease", "ttl"], js["leaseTtl"], "jetstream.leaseTtl", notes)
        for tier in ("l1", "l3"):
            for key, value in (js.get(tier) or {}).items():
                fold(out, ["nats", f"{tier}Stream", key], value, f"jetstream.{tier}.{key}", notes)


def _fold_block_key(out: dict, notes: list[Renamed] | None) -> None:
    block_key = out.get("blockKey")
    if isinstance(block_key, dict) and "prefixCachingHashAlgo" in block_key:
        block_key = out["blockKey"] = dict(block_key)
        fold(block_key, ["hashAlgo"], block_key.pop("prefixCachingHashAlgo"), "blockKey.prefixCachingHashAlgo")
        if notes is not None:
            notes.append(Renamed("blockKey.prefixCachingHashAlgo", "blockKey.hashAlgo"))


def _fold_labels(out: dict, notes: list[Renamed] | None) -> None:
    """``discovery.labels.{engineKey,engineValue,pdRoleKey,pdRoleValue,kvManagerKey,kvManagerValue}`` are
    one-label selectors: folded into ``vllm.labelSelector`` / ``pdRoleLabel`` / ``pdRoles`` and
    ``mooncakeMaster.labelSelector`` (which may hold more labels, but not another value for that one)."""
    data = out.get("discovery")
    if not isinstance(data, dict) or "labels" not in data:
        return
    data = out["discovery"] = dict(data)
    labels = data.pop("labels") or {}
    if not isinstance(labels, dict):
        raise ValueError("discovery.labels must be a mapping")
    unknown = set(labels) - set(_LABELS)
    if unknown:
        raise ValueError(f"discovery.labels: unknown keys {sorted(unknown)} (known: {sorted(_LABELS)})")
    for section in ("vllm", "mooncakeMaster"):
        data[section] = dict(data.get(section) or {})
    for role_key, field_name in (("pdRoleKey", "pdRoleLabel"), ("pdRoleValue", "pdRoles")):
        if role_key in labels:
            value = labels[role_key]
            value = [value] if role_key == "pdRoleValue" and isinstance(value, str) else value
            fold(data["vllm"], [field_name], value, f"discovery.labels.{role_key}")
            if notes is not None:
                notes.append(Renamed(f"discovery.labels.{role_key}", f"discovery.vllm.{field_name}"))
    for prefix, section in (("engine", "vllm"), ("kvManager", "mooncakeMaster")):
        given = [k for k in (f"{prefix}Key", f"{prefix}Value") if k in labels]
        if not given:
            continue
        key = str(labels.get(f"{prefix}Key") or _LABEL_DEFAULTS[f"{prefix}Key"])
        value = str(labels.get(f"{prefix}Value") or _LABEL_DEFAULTS[f"{prefix}Value"])
        selector = data[section].get("labelSelector")
        if selector is None:
            data[section]["labelSelector"] = {key: value}
        elif not isinstance(selector, dict) or selector.get(key, value) != value or key not in selector:
            raise ValueError(f"discovery.labels.{prefix}Key/{prefix}Value ({key}={value}) and "
                             f"discovery.{section}.labelSelector ({selector}) name the same setting with "
                             "different values: set only one")
        if notes is not None:
            notes.append(Renamed("/".join(f"discovery.labels.{k}" for k in given), f"discovery.{section}.labelSelector"))


def _has_nats_chart_values(values: dict, nats_fields: frozenset[str]) -> bool:
    nats = values.get("nats")
    return isinstance(nats, dict) and any(k in NATS_CHART_KEYS and k not in nats_fields for k in nats)
