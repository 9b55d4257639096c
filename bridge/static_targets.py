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
from pydantic import BaseModel, ConfigDict, Field

from bridge.mooncake_poller import MasterTarget
from bridge.vllm_subscriber import Endpoint


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


def load_targets(path: str | Path) -> TargetsFile:
    text = Path(path).read_text()
    return TargetsFile.model_validate(yaml.safe_load(text) or {})


class StaticTargets:
    """Polls the file's modification time; ``changed()`` returns the new targets when it changed,
    None when it did not. A file that disappears means no targets; one that never existed, no change."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._stamp: tuple[int, int] | None = None

    def changed(self) -> TargetsFile | None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            if self._stamp is None:
                return None
            self._stamp = None
            return TargetsFile()
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self._stamp:
            return None
        self._stamp = stamp
        return load_targets(self.path)
