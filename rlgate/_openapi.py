"""What the gateway's and `rlgate serve`'s OpenAPI documents share: FastAPI's document of an app's routes,
completed by the caller (what FastAPI cannot see), built on the first request to the app's openapi_url and
then kept; and an error answer in the OpenAI error shape. Neither service imports the other; both import this."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi


def install(app: FastAPI, description: str, complete: Callable[[dict[str, Any]], None]) -> None:
    """Serve FastAPI's document of `app`'s routes with `description`, `complete`d (it finds
    `components.schemas` there), at the app's openapi_url: built on the first request, then kept."""

    def document() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(
                title=app.title, version=app.version, routes=app.routes, description=description
            )
            doc.setdefault("components", {}).setdefault("schemas", {})
            complete(doc)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = document  # type: ignore[method-assign]  # FastAPI's way to replace it


def error_answer(description: str, schema: str) -> dict[str, Any]:
    """An error response of an operation: `description`, a JSON body of `#/components/schemas/{schema}`."""
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}},
    }
