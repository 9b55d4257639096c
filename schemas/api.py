"""Wire contract of the HTTP API (``POST /kv-cache/hit-rate``), as pydantic models.

``schemas/openapi.json`` and ``schemas/jsonschema/`` are generated from these models
(``python -m cache_indexer.schemas.generate``); a test fails when the files are stale.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from cache_indexer.schemas.events import MAX_BLOCK_SIZE

TokenId = Annotated[int, Field(ge=0, lt=1 << 64)]
#: Bounds of the optional LoRA and multimodal fields (each counted, as every input from outside)
MAX_NAME_CHARS = 4096
MAX_MM_FEATURES = 1024


class MultiModalFeature(BaseModel):
    """A multimodal item of the prompt (an image, an audio clip), as vLLM hashes it into the extra keys of
    every block its placeholder tokens overlap."""

    model_config = ConfigDict(extra="forbid", strict=True)

    identifier: str = Field(min_length=1, max_length=MAX_NAME_CHARS,
                            description="vLLM's mm hash of the item (its `identifier`, as the engine computed it).")
    offset: int = Field(ge=0, description="First token of the item's placeholder in token_ids.")
    length: int = Field(gt=0, description="Tokens of the placeholder.")


class HitRateBody(BaseModel):
    """The tokenized request, as the engine will see it."""

    model_config = ConfigDict(extra="forbid", strict=True)

    token_ids: list[TokenId] = Field(description="Prompt token ids; only full blocks are scored.")
    cache_salt: str = Field("", description="vLLM cache_salt of the request; hashed into the first block only.")
    block_size: int = Field(gt=0, le=MAX_BLOCK_SIZE, description="The engines' KV-cache block size in tokens.")
    lora_name: str = Field("", max_length=MAX_NAME_CHARS,
                           description="The LoRA adapter serving the request (vLLM mixes it into every block's "
                                       "hash); empty: the base model. An extension of this project.")
    lora_path: str = Field("", max_length=MAX_NAME_CHARS,
                           description="The adapter's path as the engine loaded it (vLLM >= 0.31 hashes it too).")
    mm_features: list[MultiModalFeature] = Field(
        [], max_length=MAX_MM_FEATURES,
        description="Multimodal items with their placeholder ranges (vLLM mixes them into the blocks they "
                    "overlap); empty: a text-only prompt. An extension of this project.")


class HitRateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    server_ip: list[Annotated[str, Field(pattern=r"\S")]] = Field(
        min_length=1, description="Candidate vLLM pod IPs; answered in this order. Empty or blank entries are a 400.")
    body: HitRateBody
    explain: bool = Field(False, description="Also say, per candidate, why its ratio is what it is (`explain` in "
                                             "each item). An extension of this project.")


class Explanation(BaseModel):
    """Why a candidate's L1 ratio is what it is (``explain: true``)."""

    cause: str = Field(description="One line: unknown pod, no events since subscribed, blockKey mismatch, the "
                                   "prefix stopping at block k, or the whole prefix cached.")
    known: bool = Field(description="Events of the pod were applied by this replica.")
    subscribed: bool | None = Field(description="The active bridge subscribes to it (null: its record is unreadable).")
    ranks: list[int] = Field(description="Its data-parallel ranks that hold blocks.")
    first_seen_s_ago: float | None = Field(description="Since its first event this replica applied (stream time).")
    last_event_s_ago: float | None = Field(description="Since its last event this replica applied.")
    request_blocks: int = Field(description="Full blocks in the request.")
    l1_blocks: int = Field(description="Of them, cached from block 0 on its GPU (its best rank).")
    first_missing_block: int | None = Field(description="The first block not cached (null: all are).")
    block_key_ok: bool | None = Field(description="The bridge's last check of the engine's hash against blockKey "
                                                  "(null: not checked yet).")
    block_key_advice: str = Field("", description="On a mismatch, the setting the engine's hash matches.")
    first_block_matches_under: list[dict[str, str | None]] = Field(
        description="Other usual settings (hashAlgo, pythonHashSeed, extraKeysEncoding) under which the request's "
                    "first block is on the pod: blockKey differs from the engine's.")


class ServerScore(BaseModel):
    server_ip: str
    l1_hit_ratio: float = Field(ge=0, le=1, description="Longest cached prefix in the pod's GPU cache / full blocks.")
    l3_hit_ratio: float = Field(ge=0, le=1, description="Longest cached prefix in the pod's Mooncake segment / full blocks.")
    message: str = ""
    status: int = 0
    explain: Explanation | None = Field(None, description="Only with `explain: true` in the request.")


class HitRateResponse(BaseModel):
    status: int = Field(0, description="0 on success; on error the HTTP status code.")
    message: str = Field("", description="Empty on success (the documented contract); on error what was wrong.")
    server_score_list: list[ServerScore] = []


class ErrorResponse(HitRateResponse):
    """Every error of the API: ``status`` equals the HTTP status code, ``message`` says what was wrong."""
