"""Wire contract of the HTTP API (``POST /kv-cache/hit-rate``), as pydantic models.

``schemas/openapi.json`` and ``schemas/jsonschema/`` are generated from these models
(``python -m schemas.generate``); a test fails when the files are stale.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

TokenId = Annotated[int, Field(ge=0, lt=1 << 64)]


class HitRateBody(BaseModel):
    """The tokenized request, as the engine will see it."""

    model_config = ConfigDict(extra="forbid", strict=True)

    token_ids: list[TokenId] = Field(description="Prompt token ids; only full blocks are scored.")
    cache_salt: str = Field("", description="vLLM cache_salt of the request; hashed into the first block only.")
    block_size: int = Field(gt=0, description="The engines' KV-cache block size in tokens.")


class HitRateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    server_ip: list[Annotated[str, Field(pattern=r"\S")]] = Field(
        min_length=1, description="Candidate vLLM pod IPs; answered in this order. Empty or blank entries are a 400.")
    body: HitRateBody


class ServerScore(BaseModel):
    server_ip: str
    l1_hit_ratio: float = Field(ge=0, le=1, description="Longest cached prefix in the pod's GPU cache / full blocks.")
    l3_hit_ratio: float = Field(ge=0, le=1, description="Longest cached prefix in the pod's Mooncake segment / full blocks.")
    message: str = ""
    status: int = 0


class HitRateResponse(BaseModel):
    status: int = Field(0, description="0 on success; on error the HTTP status code.")
    message: str = Field("", description="Empty on success (the documented contract); on error what was wrong.")
    server_score_list: list[ServerScore] = []


class ErrorResponse(HitRateResponse):
    """Every error of the API: ``status`` equals the HTTP status code, ``message`` says what was wrong."""
