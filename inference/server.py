"""`rlgate serve`: an OpenAI-compatible HTTP server on the CPU engine that answers in vLLM 0.33's wire format.

Endpoints (docs/vllm-wire-format.md has the field-by-field contract): `POST /v1/chat/completions`,
`POST /v1/completions` (both with `stream`), `GET /v1/models`, `GET /health`, `POST /tokenize`,
`POST /detokenize`, runtime LoRA (`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`), and vLLM's RL
routes for pause/resume and full-weight updates (`inference.weights`: `/pause`, `/resume`, `/is_paused`,
`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`, `/finish_weight_update`,
`/update_weight_version`, `/weight_info`; vLLM serves these only with VLLM_SERVER_DEV_MODE=1, so keep
either server on a private network behind the gateway). Tools are parsed hermes-style
(`inference.tools`), as `vllm serve --enable-auto-tool-choice --tool-call-parser hermes`.

What it reports as log-probs is `--logprobs-mode` (`inference.engine`), with vLLM's four values and
vLLM's default (`raw_logprobs`); a learner needs `processed_logprobs`. How it still differs from vLLM
(checked by vLLM's own code in tests/test_vllm_oracle.py) is listed in docs/vllm-wire-format.md, "Known
differences".

Entry points: `build_app(model_dir, ...)` (a FastAPI app) and `serve(model_dir, host, port, ...)`, which
`rlgate serve --model DIR --port N` runs; it prints `READY <port>` once listening.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import orjson
import structlog
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel, ValidationError

from inference.endpoints import Server
from inference.engine import LogprobsMode
from inference.model import Model
from inference.protocol import (
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoraAdapterRequest,
    ServeError,
    TokenizeRequest,
    UnloadLoraAdapterRequest,
    request_validation_error,
)

log = structlog.get_logger("rlgate.serve")


async def _parse(request: Request, model_cls: type[BaseModel]) -> Any:
    """The body as `model_cls`, with vLLM's 400s for a wrong content type, bad JSON, or invalid fields."""
    if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
        raise BadRequest("1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed",
                         type="Bad Request")
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        pos = getattr(exc, "pos", 0)
        raise BadRequest(f"1 validation error:\n  {{'type': 'json_invalid', 'loc': 'body.{pos}', 'msg': 'JSON decode "
                         f"error', 'input': '<dict of 0 items>', 'ctx': {{'error': '{getattr(exc, 'msg', exc)}'}}}}",
                         param=f"body.{pos}", type="Bad Request") from exc
    if not isinstance(body, dict):
        raise request_validation_error([{"type": "model_attributes_type", "loc": ("body",), "input": body,
                                         "msg": "Input should be a valid dictionary or object to extract fields from"}])
    try:
        return model_cls.model_validate(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        for error in errors:  # a validator's own BadRequest keeps its message and param
            if isinstance((error.get("ctx") or {}).get("error"), BadRequest):
                raise error["ctx"]["error"] from exc
        raise request_validation_error([{**e, "loc": ("body", *e["loc"])} for e in errors]) from exc


def _string_field(body: dict[str, Any], key: str, *, required: bool) -> str | None:
    """`body[key]` as vLLM's `Annotated[str, Body(embed=True)]` takes it: a string (or absent/null when not
    required), else vLLM's 400 for a request validation error."""
    value = body.get(key)
    if isinstance(value, str) or (value is None and not required):
        return value
    if value is None:
        raise request_validation_error([{"type": "missing", "loc": ("body", key), "msg": "Field required",
                                         "input": None}])
    raise request_validation_error([{"type": "string_type", "loc": ("body", key), "input": value,
                                     "msg": "Input should be a valid string"}])


def build_app(model_dir: Path | str, *, served_model_name: str | None = None,
              batch_window_s: float = 0.003, logprobs_mode: LogprobsMode = "raw_logprobs") -> FastAPI:
    """The FastAPI app of `rlgate serve` for the Hugging Face causal LM folder `model_dir` (float32, CPU).
    The model loads now; the scheduler starts with the app (lifespan). `logprobs_mode` is vLLM's
    `--logprobs-mode` (`inference.engine`), with vLLM's default."""
    model = Model(Path(model_dir), served_model_name, batch_window_s, logprobs_mode)
    server = Server(model)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        model.scheduler.start()
        try:
            yield
        finally:
            await model.adapters.aclose()
            await model.scheduler.aclose()

    app = FastAPI(title="rlgate serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server

    @app.exception_handler(ServeError)
    async def serve_error(request: Request, exc: ServeError) -> Response:
        return Response(orjson.dumps(exc.body()), status_code=exc.status, media_type="application/json",
                        headers=exc.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:  # vLLM's 500 body, never a bare text
        log.error("request failed", path=request.url.path, exc_info=exc)
        body = {"error": {"message": "Internal server error", "type": "InternalServerError", "param": None,
                          "code": 500}}
        return Response(orjson.dumps(body), status_code=500, media_type="application/json")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await server.chat(await _parse(request, ChatCompletionRequest))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await server.completions(await _parse(request, CompletionRequest))

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        body = await _parse(request, LoadLoraAdapterRequest)
        message = await model.adapters.load(body.lora_name, body.lora_path, bool(body.load_inplace))
        return PlainTextResponse(message)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        body = await _parse(request, UnloadLoraAdapterRequest)
        return PlainTextResponse(await model.adapters.unload(body.lora_name))

    # -- vLLM's RL routes: pause/resume and full-weight updates (inference/weights.py) --

    weights = model.weights

    def ok(body: dict[str, Any]) -> Response:
        return Response(orjson.dumps(body), media_type="application/json")

    async def optional_json(request: Request) -> dict[str, Any]:
        raw = await request.body()
        if not raw.strip():
            return {}
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise BadRequest(f"the body is not JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        return body

    @app.post("/pause")
    async def pause(mode: str = "abort", clear_cache: bool = True) -> Response:
        await weights.pause(mode)  # type: ignore[arg-type]
        return ok({"status": "paused"})

    @app.post("/resume")
    async def resume() -> Response:
        weights.resume()
        return ok({"status": "resumed"})

    @app.get("/is_paused")
    async def is_paused() -> Response:
        return ok({"is_paused": weights.paused})

    @app.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(request: Request) -> Response:
        body = await optional_json(request)
        if not isinstance(body.get("init_info"), dict):
            raise BadRequest("init_info (an object) is required", param="init_info")
        weights.init(body["init_info"])
        return ok({"message": "Weight transfer initialized"})

    @app.post("/start_weight_update")
    async def start_weight_update() -> Response:
        weights.start()
        return ok({"message": "Weight update started"})

    @app.post("/update_weights")
    async def update_weights(request: Request) -> Response:
        body = await optional_json(request)
        if not isinstance(body.get("update_info"), dict | list):
            raise BadRequest("update_info (an object, or a list of them) is required", param="update_info")
        await weights.update(body["update_info"])
        return ok({"message": "Weights updated"})

    @app.post("/finish_weight_update")
    async def finish_weight_update(request: Request) -> Response:
        weights.finish(_string_field(await optional_json(request), "weight_version", required=False))
        return ok({"message": "Weight update finished"})

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> Response:
        weights.version = _string_field(await optional_json(request), "new_version", required=True)
        return ok({"success": True, "new_version": weights.version})

    @app.get("/weight_info")
    async def weight_info() -> Response:
        return ok({"weight_version": weights.version})

    @app.get("/v1/models")
    async def models() -> Response:
        return Response(orjson.dumps(server.models()), media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return Response(orjson.dumps(server.tokenize(await _parse(request, TokenizeRequest))),
                        media_type="application/json")

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return Response(orjson.dumps(server.detokenize(await _parse(request, DetokenizeRequest))),
                        media_type="application/json")

    return app


async def _serve(app: FastAPI, host: str, port: int, announce: bool) -> None:
    import uvicorn

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            await task  # startup failed: raise its error
            return
        await asyncio.sleep(0.01)
    if announce:
        print(f"READY {sock.getsockname()[1]}", flush=True)
    await task


def serve(model_dir: Path | str, host: str = "127.0.0.1", port: int = 8000, *, served_model_name: str | None = None,
          batch_window_s: float = 0.003, logprobs_mode: LogprobsMode = "raw_logprobs", announce: bool = True) -> None:
    """Load the model and serve it until interrupted; prints `READY <port>` once listening (port 0 picks one)."""
    app = build_app(model_dir, served_model_name=served_model_name, batch_window_s=batch_window_s,
                    logprobs_mode=logprobs_mode)
    asyncio.run(_serve(app, host, port, announce))
