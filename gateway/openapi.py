"""The gateway's OpenAPI document (`GET /openapi.json` on the operator surface): every route it serves.

FastAPI describes the management routes (`gateway.routes`) and the routes added to them (the reward
webhook, Agent Lightning's event route) from their models. This module adds what FastAPI cannot see:

- the agent surface (`gateway.proxy`, raw ASGI, no FastAPI route): `POST chat/completions`, `completions`,
  `responses`, Anthropic's `messages` and `messages/count_tokens` (`gateway.messages`, their request
  schemas and error shape written here) and `GET models` under each prefix, `/v1`, `/rollouts/{rollout_id}/v1`,
  `/tasks/{task_id}/rollouts/{rollout_id}/v1` and Agent Lightning's
  `/proxy/rollout/{rollout_id}/attempt/{attempt_id}/mode/{mode}/openai/v1`, with the ids as path parameters
  (their patterns are `rlgate.episodes.keys`'), the routing headers, and vLLM 0.33's request bodies as vLLM's own
  OpenAPI document gives them (`vllm_requests.json`, generated from vLLM by
  `scripts/gen_vllm_request_schemas.py`: nothing here imports vLLM). The gateway itself checks only that a
  body is a JSON object it can store; the upstream checks the rest, and its error answers pass through.
- every error answer in the OpenAI error shape the gateway sends (`{"error": {message, type, param,
  code}}`; FastAPI's default 422 body is not what the handlers answer), with the statuses each operation
  can answer (`_STATUSES`).
- links (OpenAPI 3.1 `links`): a created rollout's id into its completion, reward, fail and event routes,
  and a completion's `x-rollout-id` into its rewards; schemathesis's stateful mode follows them
  (tests/test_fuzz.py).

With a control port, the one document is served there and describes both surfaces; the agent surface is
served on the agent port (`servers` says so in each operation's description).
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any, cast

from fastapi import FastAPI

from rlgate import _openapi

__all__ = ["install"]

ID_PATTERN = r"^[A-Za-z0-9._:\-]{1,128}$"  # episodes.keys._ID_RE
ATTEMPT_PATTERN = r"^[A-Za-z0-9_\-]{1,32}$"  # episodes.keys._ATTEMPT_RE ("0": the rollout itself)

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "title": "Error",
    "description": "The OpenAI error shape: every error the gateway answers, and upstream errors passed on.",
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                "code": {"anyOf": [{"type": "string"}, {"type": "integer"}, {"type": "null"}]},
            },
        }
    },
}
_REASONS = {
    400: "Invalid request (bad JSON, an invalid id, JSON that cannot be stored: lone UTF-16 surrogates, "
    "integers past 64 bits, nesting deeper than 254 levels), or the upstream's 400 passed on.",
    401: "No credential, or an unknown one, where one is required.",
    403: "A credential used where it does not open the door (docs/security.md).",
    404: "No such rollout, call or model.",
    405: "Wrong method.",
    409: "The rollout's state refuses this (closed, full, another task or mode, a replayed webhook-id).",
    410: "The rollout expired.",
    413: "The request body is larger than allowed.",
    422: "A body or parameter that fails validation.",
    429: "Held back: a policy push under way, or the backlog of unrewarded episodes is full (Retry-After).",
    502: "The inference server could not be reached or answered with something unreadable.",
    503: "Redis is unavailable (the call is not recorded, so not answered), or no reward queue.",
    504: "The inference server did not answer in time.",
}
# One server-sent event of a streamed answer (OpenAPI 3.2's itemSchema: each event, not the whole stream).
_SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
}
_AUTH = (401, 403)
_BLOCK = {
    "type": "object",
    "required": ["type"],
    "properties": {
        "type": {"enum": ["text", "tool_use", "tool_result", "thinking"]},
        "text": {"type": "string"},
        "id": {"type": "string"},
        "name": {"type": "string"},
        "input": {"type": "object"},
        "tool_use_id": {"type": "string"},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
        "thinking": {"type": "string"},
    },
}
_MESSAGES_BODY = {
    "model": {"type": "string", "minLength": 1},
    "messages": {
        "type": "array",
        "items": {
            "type": "object",
            "required": ["role", "content"],
            "properties": {
                "role": {"enum": ["user", "assistant"]},
                "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _BLOCK}]},
            },
        },
    },
    "system": {"anyOf": [{"type": "string"}, {"type": "array", "items": _BLOCK}]},
    "tools": {
        "type": "array",
        "items": {
            "type": "object",
            "required": ["name", "input_schema"],
            "properties": {
                "name": {"type": "string", "minLength": 1},
                "description": {"type": "string"},
                "input_schema": {"type": "object"},
            },
        },
    },
    "tool_choice": {
        "type": "object",
        "required": ["type"],
        "properties": {"type": {"enum": ["auto", "any", "tool", "none"]}, "name": {"type": "string"}},
    },
}
# Anthropic's Messages API (gateway.messages): the fields the gateway reads (others are ignored, as vLLM does)
MESSAGES_SCHEMAS: dict[str, Any] = {
    "MessagesRequest": {
        "type": "object",
        "title": "MessagesRequest",
        "required": ["model", "messages", "max_tokens"],
        "properties": {
            **_MESSAGES_BODY,
            "max_tokens": {"type": "integer", "minimum": 1},
            "stop_sequences": {"type": "array", "items": {"type": "string"}},
            "stream": {"type": "boolean"},
            "temperature": {"type": "number"},
            "top_p": {"type": "number"},
            "top_k": {"type": "integer"},
        },
    },
    "MessagesCountTokensRequest": {
        "type": "object",
        "title": "MessagesCountTokensRequest",
        "required": ["model", "messages"],
        "properties": _MESSAGES_BODY,
    },
    "AnthropicError": {
        "type": "object",
        "title": "AnthropicError",
        "required": ["type", "error"],
        "description": "Anthropic's error shape: every error on the Messages API's routes.",
        "properties": {
            "type": {"const": "error"},
            "error": {
                "type": "object",
                "required": ["type", "message"],
                "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
            },
        },
    },
}
_AGENT = (400, *_AUTH, 404, 409, 413, 422, 429, 502, 503, 504)  # 404/422: the upstream's, passed on
_OPERATOR = (400, *_AUTH, 404, 413, 422, 503)
# Statuses beyond the surface's set, by (method, path).
_STATUSES: dict[tuple[str, str], tuple[int, ...]] = {
    ("post", "/rollouts"): (409, 429),
    ("post", "/rollouts/{rollout_id}/reward"): (409, 410),
    ("post", "/rollouts/{rollout_id}/calls/{index}/reward"): (409, 410),
    ("post", "/rollouts/{rollout_id}/finish"): (409, 410),
    ("post", "/rollouts/{rollout_id}/fail"): (409, 410),
    ("post", "/api/rollouts/{rollout_id}/attempt/{attempt_id}/events"): (409, 410),
}

_PREFIXES: dict[str, list[dict[str, Any]]] = {
    "/v1": [],
    "/rollouts/{rollout_id}/v1": [{"name": "rollout_id", "pattern": ID_PATTERN}],
    "/tasks/{task_id}/rollouts/{rollout_id}/v1": [
        {"name": "task_id", "pattern": ID_PATTERN},
        {"name": "rollout_id", "pattern": ID_PATTERN},
    ],
    "/proxy/rollout/{rollout_id}/attempt/{attempt_id}/mode/{mode}/openai/v1": [
        {"name": "rollout_id", "pattern": ID_PATTERN},
        {
            "name": "attempt_id",
            "pattern": ATTEMPT_PATTERN,
            "description": "0: the rollout itself; N: the episode {rollout_id}~N.",
        },
        {"name": "mode", "enum": ["train", "val"], "description": "The mode the rollout must have."},
    ],
}
_PREFIX_IDS = {
    "/v1": "",
    "/rollouts/{rollout_id}/v1": "rollout_",
    "/tasks/{task_id}/rollouts/{rollout_id}/v1": "task_rollout_",
    "/proxy/rollout/{rollout_id}/attempt/{attempt_id}/mode/{mode}/openai/v1": "agl_",
}
_ENDPOINTS = {
    "/chat/completions": "chat.completions",
    "/completions": "completions",
    "/responses": "responses",
}
_HEADERS = [
    ("x-rollout-id", ID_PATTERN, "The rollout this call belongs to, when the path names none."),
    ("x-task-id", ID_PATTERN, "The rollout's task (the GRPO group key), when the path names none."),
    ("x-agent-name", None, "Which agent of a multi-agent rollout made the call (kept with the call)."),
    ("x-rlgate-keep-token-ids", r"^(true|false|1|0|yes|no|on|off)$", "Leave the token ids in the answer."),
]


@cache
def _vllm() -> dict[str, Any]:
    return cast(
        dict[str, Any], json.loads(resources.files("gateway").joinpath("vllm_requests.json").read_text())
    )


def install(api: FastAPI) -> None:
    """Serve the document at the app's openapi_url (built on the first request, then kept)."""
    _openapi.install(
        api,
        "The rlgate recording gateway: the agent surface (OpenAI-compatible completion routes, recorded) and "
        "the operator surface (rollouts, rewards, health).",
        _complete,
    )


def _complete(doc: dict[str, Any]) -> None:
    """FastAPI's document of the operator routes, completed with the agent surface, errors and links."""
    schemas = doc["components"]["schemas"]
    vllm = _vllm()
    clash = set(schemas) & set(vllm["schemas"])
    assert not clash, f"vLLM's schema names clash with the gateway's: {clash}"
    schemas.update(vllm["schemas"])
    schemas.update(MESSAGES_SCHEMAS)
    schemas["Error"] = ERROR_SCHEMA
    for path, methods in doc["paths"].items():  # FastAPI's 422 body is replaced by the error shape too
        for method, operation in methods.items():
            _errors(operation, (*_OPERATOR, *_STATUSES.get((method, path), ())))
    for prefix, params in _PREFIXES.items():
        for suffix, endpoint in _ENDPOINTS.items():
            doc["paths"][prefix + suffix] = {"post": _completion(prefix, params, endpoint, vllm)}
        doc["paths"][prefix + "/models"] = {"get": _models(prefix, params)}
        doc["paths"][prefix + "/messages"] = {"post": _messages(prefix, params, count=False)}
        doc["paths"][prefix + "/messages/count_tokens"] = {"post": _messages(prefix, params, count=True)}
    health = doc["paths"].get("/healthz", {}).get("get")
    if health is not None:  # its 503 is the health report too, not an error
        report = {
            "type": "object",
            "required": ["status"],
            "properties": {"status": {"enum": ["ok", "degraded", "unhealthy"]}},
        }
        for status in ("200", "503"):
            health["responses"][status] = {
                "description": "Health: Redis and upstream checks (the agent "
                'port, without the operator token: {"status": "ok"} alone).',
                "content": {"application/json": {"schema": report}},
            }
    _links(doc)
    doc["components"]["securitySchemes"] = {
        "bearer": {
            "type": "http",
            "scheme": "bearer",
            "description": "An agent credential on the agent "
            "surface (API key or rollout key), the operator token on the operator surface; "
            "needed only where configured (docs/security.md).",
        }
    }


def _errors(operation: dict[str, Any], statuses: tuple[int, ...]) -> None:
    responses = operation.setdefault("responses", {})
    for status in sorted(set(statuses)):
        responses[str(status)] = _openapi.error_answer(_REASONS[status], "Error")


def _parameters(params: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for p in params:
        schema = {
            "type": "string",
            **({"pattern": p["pattern"]} if "pattern" in p else {}),
            **({"enum": p["enum"]} if "enum" in p else {}),
        }
        out.append(
            {
                "name": p["name"],
                "in": "path",
                "required": True,
                "schema": schema,
                **({"description": p["description"]} if "description" in p else {}),
            }
        )
    for name, pattern, description in _HEADERS:
        schema = {"type": "string", **({"pattern": pattern} if pattern else {})}
        out.append(
            {"name": name, "in": "header", "required": False, "schema": schema, "description": description}
        )
    return out


def _completion(
    prefix: str, params: list[dict[str, Any]], endpoint: str, vllm: dict[str, Any]
) -> dict[str, Any]:
    model = vllm["requests"][endpoint]
    operation = {
        "operationId": f"{_PREFIX_IDS[prefix]}{endpoint.replace('.', '_')}",
        "tags": ["agent"],
        "summary": f"{endpoint}, forwarded to the inference server and recorded",
        "description": "Agent surface (the agent port). The body is vLLM 0.33's request "
        f"({model}); the gateway checks it is a JSON object it can store and the upstream checks "
        "the rest. `stream: true` answers server-sent events.",
        "parameters": _parameters(params),
        "security": [{"bearer": []}, {}],
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model}"}}},
        },
        "responses": {
            "200": {
                "description": "The upstream's answer as vLLM sends it (token ids and log-probs the gateway asked "
                "for are stripped), once the call is recorded.",
                "headers": {
                    "x-rollout-id": {"schema": {"type": "string"}, "description": "The call's rollout."}
                },
                "content": {
                    "application/json": {"schema": {"type": "object", "required": ["id", "object"]}},
                    "text/event-stream": {"itemSchema": _SSE_EVENT},
                },
            }
        },
    }
    _errors(operation, _AGENT)
    return operation


def _messages(prefix: str, params: list[dict[str, Any]], count: bool) -> dict[str, Any]:
    """Anthropic's Messages API (`gateway.messages`), or its count_tokens, under `prefix`."""
    name = "messages_count_tokens" if count else "messages"
    answer: dict[str, Any] = (
        {
            "type": "object",
            "required": ["input_tokens"],
            "properties": {"input_tokens": {"type": "integer", "minimum": 0}},
        }
        if count
        else {"type": "object", "required": ["id", "type", "role", "content"]}
    )
    content: dict[str, Any] = {"application/json": {"schema": answer}}
    if not count:
        content["text/event-stream"] = {"itemSchema": _SSE_EVENT}
    operation: dict[str, Any] = {
        "operationId": f"{_PREFIX_IDS[prefix]}{name}",
        "tags": ["agent"],
        "summary": "Anthropic's count_tokens: the prompt's length as the policy renders it (not recorded)"
        if count
        else "Anthropic's Messages API, served as a chat completion and recorded",
        "description": "Agent surface (the agent port). Translated as vLLM's own /v1/messages translates "
        "it (docs/agents.md); `?beta=true` is accepted; the credential as `x-api-key` or a Bearer token.",
        "parameters": _parameters(params),
        "security": [{"bearer": []}, {}],
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {
                    "schema": {
                        "$ref": f"#/components/schemas/{'MessagesCountTokensRequest' if count else 'MessagesRequest'}"
                    }
                }
            },
        },
        "responses": {"200": {"description": "The answer, in Anthropic's shape.", "content": content}},
    }
    for status in _AGENT:
        operation["responses"][str(status)] = {
            "description": _REASONS[status],
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/AnthropicError"}}},
        }
    return operation


def _models(prefix: str, params: list[dict[str, Any]]) -> dict[str, Any]:
    operation = {
        "operationId": f"{_PREFIX_IDS[prefix]}models",
        "tags": ["agent"],
        "summary": "The upstream's model list, forwarded (not recorded)",
        "parameters": _parameters(params)[: len(params) + 1],  # only x-rollout-id of the headers is read
        "security": [{"bearer": []}, {}],
        "responses": {
            "200": {
                "description": "The upstream's `/v1/models`.",
                "content": {
                    "application/json": {
                        "schema": {
                            "type": "object",
                            "required": ["object", "data"],
                            "properties": {"object": {"const": "list"}, "data": {"type": "array"}},
                        }
                    }
                },
            }
        },
    }
    _errors(operation, (*_AUTH, 400, 404, 502, 503, 504))
    return operation


def _links(doc: dict[str, Any]) -> None:
    """Links from a created rollout and from a recorded call into the routes that take its id."""
    paths = doc["paths"]

    def op_id(path: str, method: str = "post") -> str | None:
        return cast(str | None, paths.get(path, {}).get(method, {}).get("operationId"))

    targets = {
        "chat": op_id("/rollouts/{rollout_id}/v1/chat/completions"),
        "completion": op_id("/rollouts/{rollout_id}/v1/completions"),
        "response": op_id("/rollouts/{rollout_id}/v1/responses"),
        "agl_chat": op_id(
            "/proxy/rollout/{rollout_id}/attempt/{attempt_id}/mode/{mode}/openai/v1/chat/completions"
        ),
        "show": op_id("/rollouts/{rollout_id}", "get"),
        "reward": op_id("/rollouts/{rollout_id}/reward"),
        "call_reward": op_id("/rollouts/{rollout_id}/calls/{index}/reward"),
        "finish": op_id("/rollouts/{rollout_id}/finish"),
        "fail": op_id("/rollouts/{rollout_id}/fail"),
        "event": op_id("/api/rollouts/{rollout_id}/attempt/{attempt_id}/events"),
    }

    def links(source: str, names: list[str], expression: str, status: str = "200") -> None:
        operation = paths.get(source, {}).get("post")
        if operation is None or status not in operation.get("responses", {}):
            return
        out = {}
        for name in names:
            if targets[name] is None:
                continue
            parameters: dict[str, str | int] = {"rollout_id": expression}
            if name == "agl_chat":
                parameters.update(attempt_id="0", mode="train")  # a val rollout: 409 mode_mismatch
            elif name == "event":
                parameters["attempt_id"] = "0"
            elif name == "call_reward":
                parameters["index"] = 0
            out[name] = {"operationId": targets[name], "parameters": parameters}
        operation["responses"][status]["links"] = out

    links("/rollouts", list(targets), "$response.body#/rollout_id", "201")
    for suffix in _ENDPOINTS:
        links(
            f"/rollouts/{{rollout_id}}/v1{suffix}",
            ["show", "reward", "call_reward", "fail"],
            "$response.header.x-rollout-id",
        )
