"""Targets outside Kubernetes: a YAML file listing vLLM pods, reloaded when it changes.

    vllm:
      - ip: 10.0.0.1          # the pod IP the router asks about (required)
        name: vllm-0          # optional, for logs and headers
        host: 10.0.0.1        # optional address to connect to (default: ip)
        zmqPort: 5557         # PUB port of rank 0; rank r uses zmqPort + r
        replayPort: 5558      # ROUTER replay port of rank 0 (0 or absent: no replay)
        dpRanks: 1
    mooncakeMasters:
      - host: 10.0.0.9        # admin HTTP port of a Mooncake Master
        httpPort: 9003
        name: mooncake-0      # optional, default host:port
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cache_indexer.bridge.mooncake_poller import MasterTarget
from cache_indexer.bridge.endpoint import Endpoint


class VllmTarget(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ip: str
    name: str = ""
    host: str = ""
    zmqPort: int = Field(5557, gt=0, le=65535)
    replayPort: int = Field(0, ge=0, le=65535)
    dpRanks: int = Field(1, ge=1)

    def endpoints(self) -> list[Endpoint]:
        host = self.host or self.ip
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return [Endpoint(pod=self.ip, rank=r, pub=f"tcp://{host}:{self.zmqPort + r}",
                         replay=f"tcp://{host}:{self.replayPort + r}" if self.replayPort else None,
                         name=self.name or self.ip)
                for r in range(self.dpRanks)]


class MooncakeMasterTarget(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str
    name: str = ""
    httpPort: int = Field(9003, gt=0, le=65535)

    def target(self, scheme: str = "http") -> MasterTarget:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return MasterTarget(name=self.name or f"{self.host}:{self.httpPort}", url=f"{scheme}://{host}:{self.httpPort}")


class TargetsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    vllm: list[VllmTarget] = []
    mooncakeMasters: list[MooncakeMasterTarget] = []

    def endpoints(self) -> list[Endpoint]:
        return [ep for t in self.vllm for ep in t.endpoints()]


class TargetsError(ValueError):
    """A targets file that cannot be used; the message names the file and line."""


def _line_of(root: yaml.Node | None, loc: tuple) -> int | None:
    """1-based line of the YAML node at a pydantic error location (as deep as the location exists)."""
    node, line = root, None
    for key in loc:
        if node is None:
            break
        line = node.start_mark.line + 1
        if isinstance(node, yaml.MappingNode):
            node = next((v for k, v in node.value if k.value == key), None)
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            node = node.value[key]
        else:
            node = None
    return node.start_mark.line + 1 if node is not None else line


#: libyaml's safe loader where PyYAML has it (its wheels do), else the pure-Python one: at 1,000 pods the
#: pure-Python parse took the bridge's event loop for about a second at start and at each edit of the file
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _parse(text: str) -> tuple[yaml.Node | None, object]:
    """The document's node tree (for the lines of errors) and its data, from one parse."""
    loader = _Loader(text)
    try:
        root = loader.get_single_node()
        return root, loader.construct_document(root) if root is not None else None
    finally:
        loader.dispose()


def load_targets(path: str | Path) -> TargetsFile:
    text = Path(path).read_text()
    try:
        root, data = _parse(text)
        data = data or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise TargetsError(f"{where}: not valid YAML: {getattr(exc, 'problem', exc)}") from None
    if not isinstance(data, dict):
        raise TargetsError(f"{path}:1: expected a mapping with 'vllm' and 'mooncakeMasters' lists")
    try:
        return TargetsFile.model_validate(data)
    except ValidationError as exc:
        errors = []
        for err in exc.errors(include_url=False):
            line = _line_of(root, err["loc"])
            loc = ".".join(str(x) for x in err["loc"])
            errors.append(f"{path}:{line or 1}: {loc}: {err['msg']}")
        raise TargetsError("; ".join(errors)) from None


class StaticTargets:
    """Polls the files' modification times; ``changed()`` returns the targets of all files together when
    any changed, None when none did. A file that disappears lists nothing any more (``vanished`` names
    it); one that never existed, no change. A file that cannot be used raises TargetsError once per
    version, and the caller keeps what it had.

    Local mode watches two: the configured file and the overlay ``cache-indexer simulate`` writes."""

    def __init__(self, path: str | Path, *extra: str | Path) -> None:
        self.path = Path(path)
        self.paths = [self.path, *map(Path, extra)]
        self._stamps: dict[Path, tuple[int, int] | None] = {p: None for p in self.paths}
        self.vanished: list[Path] = []

    def _stamp(self, path: Path) -> tuple[int, int] | None:
        try:
            st = path.stat()
        except FileNotFoundError:
            return None
        return (st.st_mtime_ns, st.st_size)

    def again(self) -> None:
        """What ``changed()`` returned last could not be applied: the next call reads the files anew."""
        self._stamps = {p: None if stamp is None else (-1, -1) for p, stamp in self._stamps.items()}

    def changed(self) -> TargetsFile | None:
        stamps = {p: self._stamp(p) for p in self.paths}
        if stamps == self._stamps:
            return None
        self.vanished = [p for p in self.paths if self._stamps[p] is not None and stamps[p] is None]
        self._stamps = stamps
        merged = TargetsFile()
        for path, stamp in stamps.items():
            if stamp is not None:
                one = load_targets(path)
                merged.vllm += one.vllm
                merged.mooncakeMasters += one.mooncakeMasters
        return merged
