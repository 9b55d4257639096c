"""Generates ``schemas/openapi.json``, ``schemas/jsonschema/*.json``, the chart's ``values.schema.json`` and
``docs/configuration.md`` from the pydantic models.

    python -m cache_indexer.schemas.generate          # write the files
    python -m cache_indexer.schemas.generate --check  # exit 1 when the files are stale
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pydantic.json_schema import models_json_schema

from cache_indexer.schemas.api import ErrorResponse, HitRateRequest, HitRateResponse
from cache_indexer.schemas.config import Config
from cache_indexer.schemas.config_reference import configuration_md, values_check_template, values_schema
from cache_indexer.schemas.events import L1Envelope, L3Envelope
from cache_indexer.schemas.tiered_api import (QueryByHashRequest, QueryError, QueryRequest, QueryResponse, RegisterRequest,
                                UnregisterRequest, WorkerInfo)

HERE = Path(__file__).parent
ROOT = HERE.parent

_ERRORS = {
    "400": "Malformed request: empty body, invalid JSON, unknown field, wrong type, empty server_ip, block_size outside 1..65536.",
    "405": "Method other than POST.",
    "408": "The body was not received within http.readTimeout.",
    "413": "Body larger than http.maxHitRateBodyBytes.",
    "500": "The computation failed.",
}


_QUERY_ERRORS = {
    "400": "Not JSON, an empty body, or a request that cannot be answered (cache_salt with block hashes, a "
           "multimodal item past the prompt).",
    "408": "The body was not received within http.readTimeout.",
    "413": "Body larger than http.maxHitRateBodyBytes.",
    "422": "JSON that does not fit the contract: a missing field, a wrong type, a value out of range.",
}


def _tiered_route(summary: str, op: str, request: str) -> dict:
    ref = lambda name: {"$ref": f"#/components/schemas/{name}"}  # noqa: E731
    err = {"content": {"application/json": {"schema": ref("QueryError")}}}
    return {"post": {
        "summary": summary, "operationId": op,
        "requestBody": {"required": True, "content": {"application/json": {"schema": ref(request)}}},
        "responses": {"200": {"description": "Tokens matched per instance and tier.",
                              "content": {"application/json": {"schema": ref("QueryResponse")}}},
                      **{code: {"description": text, **err} for code, text in _QUERY_ERRORS.items()}},
    }}


_REGISTRATION_ERRORS = {
    "400": "Not JSON, or a registration that cannot be used (an endpoint that is not tcp://host:port, an "
           "instance id that is not an integer or a name, a rank over 1023, a block size under 1).",
    "401": "Authorization: Bearer <token> missing or wrong (before the body, with Expect: 100-continue).",
    "403": "Registration is off (no http.registrationToken).",
    "404": "/unregister: the instance is not registered.",
    "409": "The rank is registered already, the model's block size differs, or http.maxRegistrations is reached.",
    "413": "Body over 64 KiB.",
    "422": "JSON that does not fit the contract.",
    "503": "The replica cannot read the registrations yet (starting, or NATS unreachable).",
}


def _registration_route(summary: str, op: str, request: str, ok: str, ok_text: str) -> dict:
    ref = lambda name: {"$ref": f"#/components/schemas/{name}"}  # noqa: E731
    err = {"content": {"application/json": {"schema": ref("QueryError")}}}
    codes = {c: t for c, t in _REGISTRATION_ERRORS.items() if c != "404" or op == "unregister"}
    return {"post": {
        "summary": summary, "operationId": op, "security": [{"registrationToken": []}],
        "requestBody": {"required": True, "content": {"application/json": {"schema": ref(request)}}},
        "responses": {ok: {"description": ok_text}, **{c: {"description": t, **err} for c, t in codes.items()}},
    }}


def openapi() -> dict:
    _, defs = models_json_schema(
        [(HitRateRequest, "validation"), (HitRateResponse, "serialization"), (ErrorResponse, "serialization"),
         (QueryRequest, "validation"), (QueryByHashRequest, "validation"), (QueryResponse, "serialization"),
         (QueryError, "serialization"), (RegisterRequest, "validation"), (UnregisterRequest, "validation"),
         (WorkerInfo, "serialization")],
        ref_template="#/components/schemas/{model}",
    )
    ref = lambda name: {"$ref": f"#/components/schemas/{name}"}  # noqa: E731
    err = {"content": {"application/json": {"schema": ref("ErrorResponse")}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "cache-indexer", "version": "1",
                 "description": "KV-cache hit ratios of candidate vLLM pods (the seed API, /kv-cache/hit-rate), "
                                "and tokens matched per instance, DP rank and tier (the ecosystem's API of NVIDIA "
                                "Dynamo's standalone indexer and Mooncake RFC #1403: /query, /query_by_hash)."},
        "paths": {
            "/kv-cache/hit-rate": {"post": {
                "summary": "L1 (GPU) and L3 (Mooncake) hit ratios of each candidate pod, in input order",
                "operationId": "hitRate",
                "requestBody": {"required": True, "content": {"application/json": {"schema": ref("HitRateRequest")}}},
                "responses": {"200": {"description": "Ratios per candidate; status 0.",
                                      "content": {"application/json": {"schema": ref("HitRateResponse")}}},
                              **{code: {"description": text, **err} for code, text in _ERRORS.items()}},
            }},
            "/query": _tiered_route("Tokens of a tokenized request matched per instance, DP rank and tier "
                                    "(GPU, then CPU, then STORAGE; Mooncake L3)", "query", "QueryRequest"),
            "/query_by_hash": _tiered_route("The same for a request given as the engines' block hashes",
                                            "queryByHash", "QueryByHashRequest"),
            "/register": _registration_route(
                "Register an engine rank outside Kubernetes labels (kept in NATS; every bridge and replica sees it)",
                "register", "RegisterRequest", "201", "Registered: {\"status\": \"ok\"}."),
            "/unregister": _registration_route("Drop a registered instance (one rank, or all); its blocks leave the "
                                               "index", "unregister", "UnregisterRequest", "200",
                                               "Unregistered: {\"status\": \"ok\"}."),
            "/workers": {"get": {"summary": "Every target: registered engines and the pods the bridge subscribes to",
                                 "operationId": "workers",
                                 "responses": {"200": {"description": "One item per instance.", "content": {
                                     "application/json": {"schema": {"type": "array",
                                                                     "items": ref("WorkerInfo")}}}}}}},
            "/healthz": {"get": {"summary": "Liveness", "operationId": "healthz",
                                 "responses": {"200": {"description": "The process is alive."}}}},
            "/readyz": {"get": {"summary": "Readiness: the index has caught up with the streams",
                                "operationId": "readyz",
                                "responses": {"200": {"description": "Ready."},
                                              "503": {"description": "Still replaying the streams."}}}},
            "/metrics": {"get": {"summary": "Prometheus metrics", "operationId": "metrics",
                                 "responses": {"200": {"description": "Prometheus text format.",
                                                       "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
        },
        "components": {"schemas": defs["$defs"],
                       "securitySchemes": {"registrationToken": {"type": "http", "scheme": "bearer",
                                                                 "description": "http.registrationToken"}}},
    }


def documents() -> dict[Path, dict | str]:
    """Every generated file and its content (a JSON document, or text)."""
    return {
        ROOT / "charts" / "cache-indexer" / "values.schema.json": values_schema(),
        ROOT / "docs" / "configuration.md": configuration_md(),
        ROOT / "charts" / "cache-indexer" / "templates" / "_values_check.tpl": values_check_template(),
        HERE / "openapi.json": openapi(),
        HERE / "jsonschema" / "hit-rate-request.json": HitRateRequest.model_json_schema(),
        HERE / "jsonschema" / "hit-rate-response.json": HitRateResponse.model_json_schema(mode="serialization"),
        HERE / "jsonschema" / "l1-stream-message.json": L1Envelope.model_json_schema(),
        HERE / "jsonschema" / "l3-stream-message.json": L3Envelope.model_json_schema(),
        HERE / "jsonschema" / "config.json": Config.model_json_schema(),
    }


def render(doc: dict | str) -> str:
    return doc if isinstance(doc, str) else json.dumps(doc, indent=2, sort_keys=True) + "\n"


def main(argv: list[str]) -> int:
    stale = []
    for path, doc in documents().items():
        text = render(doc)
        if "--check" in argv:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print("stale generated files (run python -m cache_indexer.schemas.generate):\n  " + "\n  ".join(stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
