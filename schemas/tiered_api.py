"""Wire contract of the ecosystem API, ``POST /query`` and ``POST /query_by_hash``: the requests and answers
of NVIDIA Dynamo's standalone KV indexer (1.6.1), which follows Mooncake RFC #1403, so that a router
written for either can ask cache-indexer. Beside the seed API (schemas/api.py), not instead of it.

Differences, all additive: Mooncake's L3 is one more field (``l3``); ``lora_path`` and ``mm_features``
reach vLLM's extra keys (vLLM >= 0.31 hashes the adapter's path; Dynamo has no multimodal field);
``block_size`` may be given per request (else ``blockKey.blockSize``). Unknown fields are ignored, as
Dynamo's serde does. ``/query_by_hash`` takes the engines' block hashes (what vLLM publishes and this
index keys on); Dynamo's takes its own XXH3 token hashes, which no engine publishes.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AliasChoices, BaseModel, ConfigDict, Field

from cache_indexer.schemas.api import MAX_MM_FEATURES, MAX_NAME_CHARS, MultiModalFeature, TokenId
from cache_indexer.schemas.events import MAX_BLOCK_SIZE

#: An engine block hash as a client may send it: Dynamo's i64, or the uint64 vLLM publishes
BlockHash = Annotated[int, Field(ge=-(1 << 63), lt=1 << 64)]


class _Scope(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model_name: str = Field(max_length=MAX_NAME_CHARS, validation_alias=AliasChoices("model_name", "model"),
                            description="The model (required, as in Dynamo; Mooncake's `model` is accepted "
                                        "too). Discovered pods serve every model.")
    routing_group: str = Field("default", max_length=MAX_NAME_CHARS,
                               validation_alias=AliasChoices("routing_group", "tenant_id"),
                               description="Dynamo's routing group (`tenant_id` before 1.3, accepted too).")
    block_size: int | None = Field(None, gt=0, le=MAX_BLOCK_SIZE, description="The engines' KV-cache block size; default "
                                   "`blockKey.blockSize`. An extension of this project.")


class QueryRequest(_Scope):
    token_ids: list[TokenId] = Field(description="Prompt token ids; only full blocks are matched.")
    cache_salt: str = Field("", description="vLLM cache_salt of the request; hashed into the first block only.")
    lora_name: str = Field("", max_length=MAX_NAME_CHARS, description="The LoRA adapter serving the request.")
    lora_path: str = Field("", max_length=MAX_NAME_CHARS,
                           description="The adapter's path as the engine loaded it (vLLM >= 0.31 hashes it).")
    mm_features: list[MultiModalFeature] = Field([], max_length=MAX_MM_FEATURES,
                                                 description="Multimodal items with their placeholder ranges.")


class QueryByHashRequest(_Scope):
    block_hashes: list[BlockHash] = Field(validation_alias=AliasChoices("block_hashes", "seq_hashes"), description="The request's block hashes as the engines publish them "
                                          "(vLLM's, chained; Mooncake's `seq_hashes` is accepted too), from block 0.")


class InstanceMatch(BaseModel):
    longest_matched: int = Field(description="Tokens matched on any tier of the best rank (= disk).")
    gpu: int = Field(description="Tokens on the GPU, best rank.")
    dp: dict[str, int] = Field(description="Per data-parallel rank with any match, its tokens on the GPU.")
    cpu: int = Field(description="Tokens on the GPU or the CPU (vLLM KV offloading), best rank.")
    disk: int = Field(description="Tokens on the GPU, the CPU or STORAGE, best rank.")
    l3: int = Field(description="Tokens in the pod's Mooncake Store segment. An extension of this project.")


class QueryResponse(BaseModel):
    scores: dict[str, dict[str, int]] = Field(description="Dynamo's legacy field: instance -> rank -> GPU tokens, "
                                              "ranks with a GPU match.")
    frequencies: list[int] = Field(description="Always empty (as Dynamo's standalone indexer answers).")
    instances: dict[str, InstanceMatch] = Field(description="Instances with any match: a registered instance's "
                                                "id, or a discovered pod's address.")


class QueryError(BaseModel):
    error: str = Field(description="What was wrong.")


class RegisterRequest(BaseModel):
    """An engine rank outside Kubernetes labels (Dynamo's /register; Mooncake's spellings too). Requires
    ``Authorization: Bearer <http.registrationToken>``. Unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)

    instance_id: Annotated[int, Field(ge=0, lt=1 << 64)] | Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,128}$")] = \
        Field(description="The instance: Dynamo's integer, or a name (letters, digits, '_', '-'). /query answers "
                          "it under this id.")
    endpoint: str = Field(max_length=1024, description="The engine's ZMQ PUB socket, tcp://host:port.")
    replay_endpoint: str | None = Field(None, max_length=1024, description="Its ROUTER replay socket, tcp://host:port.")
    model_name: str = Field(max_length=MAX_NAME_CHARS, validation_alias=AliasChoices("model_name", "model"))
    routing_group: str = Field("default", max_length=MAX_NAME_CHARS,
                               validation_alias=AliasChoices("routing_group", "tenant_id"))
    block_size: int = Field(gt=0, le=MAX_BLOCK_SIZE, description="Tokens per block; one value per model and routing group (409 otherwise).")
    dp_rank: int = Field(0, ge=0, le=1023, description="The data-parallel rank this endpoint publishes for.")
    lora_name: str = Field("", max_length=MAX_NAME_CHARS)


class UnregisterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    instance_id: Annotated[int, Field(ge=0, lt=1 << 64)] | str
    dp_rank: int | None = Field(None, description="One rank; absent: every rank of the instance.")


class Listener(BaseModel):
    endpoint: str
    status: str = Field(description="`active` (events indexed), `subscribed` (a bridge subscribes, no events yet), "
                                    "`registered` (no bridge has taken it up yet).")


class WorkerInfo(BaseModel):
    """One target of ``GET /workers``: Dynamo's fields; ``source`` is `registration`, `labels` or `file`."""

    instance_id: int | str
    source: str
    status: str = Field(description="The best of its ranks' listener statuses.")
    model_name: str
    routing_group: str
    block_size: int
    endpoints: dict[str, str]
    listeners: dict[str, Listener]
