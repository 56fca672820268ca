"""The OpenAI error shape every rlgate service answers errors in: `{"error": {message, type, param, code}}`.

Each service's error module subclasses `ApiError` (status, OpenAI error `type`, optional `code`), raises
it, and maps it to a response in one handler; client faults are 4xx, never 5xx.
"""

from __future__ import annotations

from typing import Any

import orjson


class ApiError(Exception):
    status: int = 500
    type: str = "internal_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers = headers or {}

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str, param: str | None = None, code: Any = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}})
