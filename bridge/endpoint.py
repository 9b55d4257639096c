"""A vLLM KV-event endpoint: one data-parallel rank of a pod, as discovery lists it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Endpoint:
    pod: str  # pod IP: the key the API is asked by
    rank: int
    pub: str  # tcp://host:port of the PUB socket
    replay: str | None  # tcp://host:port of the ROUTER replay socket, None when not configured
    name: str = ""
    #: Changes when the engine behind the endpoint restarts (pod uid + container restarts); a new
    #: epoch is a new endpoint, so the bridge starts a fresh subscription (reset + replay from 0).
    epoch: str = ""
