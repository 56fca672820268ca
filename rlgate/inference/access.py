"""Who may reach what on `rlgate serve`, gated as vLLM 0.33 gates it.

- Runtime LoRA (`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`) is served only when enabled: vLLM's
  `VLLM_ALLOW_RUNTIME_LORA_UPDATING` ("1" or "true", any case; `vllm/envs.py`), or `rlgate serve
  --allow-runtime-lora-updating true`. vLLM does not register the routes otherwise
  (`vllm/entrypoints/serve/lora/api_router.py`), so they are 404 `{"detail": "Not Found"}`.
- The RL routes (`/pause`, `/resume`, `/is_paused`, the weight-transfer phases, `/update_weight_version`,
  `/weight_info`) are served only in dev mode: vLLM's `VLLM_SERVER_DEV_MODE` (an integer, non-zero = on;
  `vllm/entrypoints/launchers/api_server/routers.py`), or `rlgate serve --dev-mode true`. Otherwise 404.
- `--api-key` (or vLLM's `VLLM_API_KEY` when no `--api-key` is given): `ApiKeyMiddleware`, a copy of vLLM's
  `AuthenticationMiddleware` (`vllm/entrypoints/serve/middleware/authenticate.py`): a bearer token is
  required on paths under `/v1`, `/v2`, `/inference` and `/cohere` only, except OPTIONS; anything else is
  401 `{"error": "Unauthorized"}`. As in vLLM, the dev-mode routes and `/health`, `/tokenize` are not under
  those prefixes and stay open: keep the server on a private network.
- Paths the client names (an adapter's `lora_path`, a weight file's `update_info.path`) must lie under the
  weights root (`--weights-root`; default: the parent folder of `--model`), after symlinks are resolved.
  vLLM has no such root (it loads any local path or Hugging Face repo); this one is rlgate's. A path
  outside the root gets the same error as a missing one, so answers do not tell which paths exist.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Awaitable
from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

GUARDED_PREFIX = ("/v1", "/v2", "/inference", "/cohere")  # vLLM's, as is


class VllmEnvironment(BaseSettings):
    """vLLM's own environment variables for the same gates, parsed as vLLM parses them (`vllm/envs.py`);
    `rlgate serve`'s flags win when given."""

    model_config = SettingsConfigDict(env_prefix="VLLM_", extra="ignore", case_sensitive=True)

    ALLOW_RUNTIME_LORA_UPDATING: bool = Field(False, description="Serve the runtime LoRA routes.")
    SERVER_DEV_MODE: bool = Field(False, description="Serve the RL (pause, weight-update, version) routes.")
    API_KEY: str | None = Field(None, description="The API key, when --api-key is not given.")

    @field_validator("ALLOW_RUNTIME_LORA_UPDATING", mode="before")
    @classmethod
    def _lora(cls, value: object) -> bool:  # vLLM: .strip().lower() in ("1", "true"); anything else is off
        return value if isinstance(value, bool) else str(value).strip().lower() in ("1", "true")

    @field_validator("SERVER_DEV_MODE", mode="before")
    @classmethod
    def _dev(cls, value: object) -> bool:  # vLLM: bool(int(value)); a non-integer is an error
        return value if isinstance(value, bool) else bool(int(str(value)))


class ApiKeyMiddleware:
    """vLLM's `AuthenticationMiddleware`: pure ASGI, keys compared as SHA-256 digests in constant time."""

    def __init__(self, app: ASGIApp, tokens: list[str]) -> None:
        self.app = app
        self.api_tokens = [hashlib.sha256(t.encode("utf-8")).digest() for t in tokens]

    def verify_token(self, headers: Headers) -> bool:
        scheme, _, param = (headers.get("Authorization") or "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        param_hash = hashlib.sha256(param.encode("utf-8")).digest()
        match = False
        for token_hash in self.api_tokens:
            match |= secrets.compare_digest(param_hash, token_hash)
        return match

    def __call__(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            return self.app(scope, receive, send)
        url_path = scope["path"].removeprefix(scope.get("root_path", ""))
        if url_path.startswith(GUARDED_PREFIX) and not self.verify_token(Headers(scope=scope)):
            return JSONResponse(content={"error": "Unauthorized"}, status_code=401)(scope, receive, send)
        return self.app(scope, receive, send)


class WeightsRoot:
    """The one folder under which clients may name adapters and weight files."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        if self.root == Path(self.root.anchor):
            raise ValueError(
                f"the weights root {str(root)!r} is the filesystem root: every file would be "
                "readable; give --weights-root a folder of its own"
            )
        if not self.root.is_dir():
            raise ValueError(f"the weights root {str(root)!r} is not a folder")

    def resolve(self, path: str) -> Path | None:
        """`path` resolved (symlinks followed) when it lies under the root, else None. Callers answer None
        exactly as they answer a path that does not exist."""
        try:
            resolved = Path(path).resolve()
        except (OSError, RuntimeError, ValueError):
            return None
        return resolved if resolved.is_relative_to(self.root) else None
