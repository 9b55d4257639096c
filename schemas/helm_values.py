"""Helm values files as configuration: ``--config`` takes the chart's own ``values.yaml``, the documented
product's ``values.yaml`` (``tests/data/seed-values.yaml``) or the tree the chart renders, and each key
means there what it means in the chart.

- Keys only the deployment uses (``image``, ``resources``, ``serviceAccount``, ``podLabels``, ...) are
  accepted and left out of the product's tree; the NATS sub-chart's values under ``nats`` likewise.
- Keys that name a product setting another way are folded into it: ``service.targetPort`` is
  ``http.port``; ``jetstream.*`` are the streams' limits and the lease TTL; ``externalNats.url`` is
  ``nats.url``. Section-level synonyms (``blockKey.prefixCachingHashAlgo``, ``discovery.labels.*``)
  are folded by their sections in schemas/config.py with ``fold``.
- Rule where two keys name one setting: whichever is given is used; both given with different values
  is an error naming both (the same rule the chart applies at render time).
"""

from __future__ import annotations

from typing import Any

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
})
_MISSING = object()


def parent_node(tree: dict, path: list[str]) -> dict:
    """The mapping that holds ``path[-1]``, created on the way where missing."""
    node = tree
    for seg in path[:-1]:
        nxt = node.get(seg)
        if not isinstance(nxt, dict):
            nxt = node[seg] = {}
        node = nxt
    return node


def fold(tree: dict, path: list[str], value: Any, source: str) -> None:
    """Set ``tree[path]`` to ``value`` given under the name ``source``; a different value already there
    (given under the product's own name) is a conflict."""
    node = parent_node(tree, path)
    have = node.get(path[-1], _MISSING)
    if have is not _MISSING and have != value and str(have) != str(value):
        raise ValueError(f"{source} ({value!r}) and {'.'.join(path)} ({have!r}) name the same setting with "
                         "different values: set only one")
    node[path[-1]] = value


def to_config_tree(values: dict, nats_fields: frozenset[str]) -> dict:
    """The product's configuration tree from a values tree (the product's own trees pass unchanged)."""
    if not any(k in values for k in DEPLOYMENT_KEYS) and not _has_nats_chart_values(values, nats_fields):
        return values
    out = {k: v for k, v in values.items() if k not in DEPLOYMENT_KEYS}
    nats = out.get("nats")
    if isinstance(nats, dict):
        out["nats"] = {k: v for k, v in nats.items() if k in nats_fields or k not in NATS_CHART_KEYS}
    service = values.get("service")
    if isinstance(service, dict) and service.get("targetPort") is not None:
        fold(out, ["http", "port"], service["targetPort"], "service.targetPort")
    external = values.get("externalNats")
    if isinstance(external, dict) and external.get("url") and not (isinstance(nats, dict) and nats.get("enabled")):
        fold(out, ["nats", "url"], external["url"], "externalNats.url")
    js = values.get("jetstream")
    if isinstance(js, dict):
        for key, target in (("replicas", "replicas"), ("duplicateWindow", "duplicateWindow"), ("storage", "storage")):
            if key in js:
                for stream in ("l1Stream", "l3Stream"):
                    fold(out, ["nats", stream, target], js[key], f"jetstream.{key}")
        if "replicas" in js:  # every JetStream asset, the lease and record buckets and snapshots too
            fold(out, ["nats", "replicas"], js["replicas"], "jetstream.replicas")
        if "leaseTtl" in js:
            fold(out, ["nats", "lease", "ttl"], js["leaseTtl"], "jetstream.leaseTtl")
        for tier in ("l1", "l3"):
            for key, value in (js.get(tier) or {}).items():
                fold(out, ["nats", f"{tier}Stream", key], value, f"jetstream.{tier}.{key}")
    return out


def _has_nats_chart_values(values: dict, nats_fields: frozenset[str]) -> bool:
    nats = values.get("nats")
    return isinstance(nats, dict) and any(k in NATS_CHART_KEYS and k not in nats_fields for k in nats)
