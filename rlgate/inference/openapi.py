"""The OpenAPI document of `rlgate serve` (`GET /openapi.json`, as vLLM serves its own).

The routes read their bodies themselves (`rlgate.inference.server._parse`: vLLM's 400s for a wrong content type,
bad JSON or invalid fields), so FastAPI sees no request model; this module adds each route's body from the
pydantic model `_parse` validates it with (`rlgate.inference.protocol`, `rlgate.inference.responses_protocol`), the
optional JSON bodies of the RL routes, and the errors in vLLM's shape (`{"error": {message, type, param,
code}}`, code = the status) with the statuses each route answers. Gated routes (LoRA, dev mode) appear only
when the app serves them: the document is built from the app's routes.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from rlgate import _openapi
from rlgate.inference.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoraAdapterRequest,
    TokenizeRequest,
    UnloadLoraAdapterRequest,
)
from rlgate.inference.responses_protocol import ResponsesRequest

__all__ = ["install"]

BODIES: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/responses": ResponsesRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
    "/v1/load_lora_adapter": LoadLoraAdapterRequest,
    "/v1/unload_lora_adapter": UnloadLoraAdapterRequest,
}
# The RL routes' optional JSON bodies (`rlgate.inference.server._optional_json`), as their handlers check them.
OPTIONAL_BODIES: dict[str, dict[str, Any]] = {
    "/init_weight_transfer_engine": {
        "type": "object",
        "required": ["init_info"],
        "properties": {"init_info": {"type": "object"}},
    },
    "/update_weights": {
        "type": "object",
        "required": ["update_info"],
        "properties": {
            "update_info": {"anyOf": [{"type": "object"}, {"type": "array", "items": {"type": "object"}}]}
        },
    },
    "/finish_weight_update": {
        "type": "object",
        "properties": {"weight_version": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
    },
    "/update_weight_version": {
        "type": "object",
        "required": ["new_version"],
        "properties": {"new_version": {"type": "string"}},
    },
}
ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "title": "ErrorResponse",
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                "code": {"type": "integer"},
            },
        }
    },
}
_REASONS = {
    400: "Invalid request (vLLM's validation errors, wrong content type, bad JSON).",
    401: "Missing or wrong API key (--api-key).",
    404: "No such model, adapter or response.",
    409: "The weights are paused or being updated.",
    422: "An invalid query or path parameter.",
    503: "The server is paused or shutting down.",
}


def install(app: FastAPI) -> None:
    """Serve the document at the app's openapi_url (built on first request, then kept)."""
    _openapi.install(app, "rlgate serve: a CPU server in vLLM 0.33's OpenAI wire format.", _complete)


def _complete(doc: dict[str, Any]) -> None:
    """FastAPI's document of the app's routes, completed with the bodies `_parse` validates and the errors."""
    schemas = doc["components"]["schemas"]
    served = [model for path, model in BODIES.items() if path in doc["paths"]]
    _, defs = models_json_schema(
        [(model, "validation") for model in served], ref_template="#/components/schemas/{model}"
    )
    schemas.update(defs.get("$defs", {}))
    schemas["ErrorResponse"] = ERROR_SCHEMA
    for path, methods in doc["paths"].items():
        for method, operation in methods.items():
            if path in BODIES:
                operation["requestBody"] = {
                    "required": True,
                    "content": {
                        "application/json": {
                            "schema": {"$ref": f"#/components/schemas/{BODIES[path].__name__}"}
                        }
                    },
                }
            elif path in OPTIONAL_BODIES:
                operation["requestBody"] = {
                    "required": False,
                    "content": {"application/json": {"schema": OPTIONAL_BODIES[path]}},
                }
            statuses = [400, 404, 409, 422, 503] if method == "post" or path.startswith("/v1/") else [422]
            if path.startswith("/v1/"):
                statuses.append(401)
            responses = operation.setdefault("responses", {})
            for status in statuses:
                responses[str(status)] = _openapi.error_answer(_REASONS[status], "ErrorResponse")
            if path == "/health":  # vLLM's: 200 with an empty body
                responses["200"] = {"description": "The server is up (empty body)."}
            elif path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
                responses["200"] = {
                    "description": "Done (vLLM's plain-text message).",
                    "content": {"text/plain": {"schema": {"type": "string"}}},
                }
            elif path in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
                content = responses["200"].setdefault("content", {})
                content["application/json"] = {"schema": {"type": "object", "required": ["id", "object"]}}
                content["text/event-stream"] = {
                    "itemSchema": {
                        "type": "object",
                        "required": ["data"],
                        "properties": {"data": {"type": "string"}},
                    }
                }
