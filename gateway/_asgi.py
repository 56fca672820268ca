"""Raw ASGI plumbing of the hot path: reading a JSON body, sending a whole body, noticing a hang-up, and
SSE error events in each stream dialect."""

from __future__ import annotations

from typing import Any

import orjson

from gateway import errors
from rlgate.episodes import Endpoint


async def read_json(receive: Any, limit: int) -> dict[str, Any]:
    chunks = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise errors.BadRequest("the client disconnected before sending its request")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise errors.PayloadTooLarge(f"request body larger than {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    raw = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise errors.BadRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(body, dict):
        raise errors.BadRequest("request body must be a JSON object", code="invalid_json")
    return body


async def send_body(send: Any, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*headers, (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def disconnected(receive: Any) -> None:
    """Returns when the client disconnects (the request body has been read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def error_event(endpoint: Endpoint, status: int, type_: str, message: str, code: Any) -> bytes:
    """An SSE error event in the stream's own dialect (vLLM's for chat/completions, OpenAI's for responses)."""
    if endpoint == "responses":
        return (
            b"event: error\ndata: "
            + orjson.dumps({"type": "error", "code": str(code or status), "message": message, "param": None})
            + b"\n\n"
        )
    return (
        b"data: "
        + orjson.dumps({"error": {"message": message, "type": type_, "param": None, "code": status}})
        + b"\n\n"
    )
