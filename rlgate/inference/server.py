"""`rlgate serve`: an OpenAI-compatible HTTP server on the CPU engine that answers in vLLM 0.33's wire format.

Endpoints (docs/vllm-wire-format.md has the field-by-field contract): `POST /v1/chat/completions`,
`POST /v1/completions`, `POST /v1/responses` (all with `stream`; `rlgate.inference.responses`; as vLLM without
its response store, `GET /v1/responses/{id}` and its cancel route answer 404), `GET /v1/models`, `GET /health`, `POST /tokenize`,
`POST /detokenize`, runtime LoRA (`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`), and vLLM's RL
routes for pause/resume and full-weight updates (`rlgate.inference.weights`: `/pause`, `/resume`, `/is_paused`,
`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`, `/finish_weight_update`,
`/update_weight_version`, `/weight_info`). As in vLLM, the LoRA routes exist only when runtime LoRA updating
is enabled and the RL routes only in dev mode; `--api-key` guards `/v1` as vLLM's does; adapter and weight
paths must lie under the weights root (`rlgate.inference.access`). Keep the server on a private network behind
the gateway. Tools are parsed hermes-style
(`rlgate.inference.tools`), as `vllm serve --enable-auto-tool-choice --tool-call-parser hermes`.

What it reports as log-probs is `--logprobs-mode` (`rlgate.inference.engine`), with vLLM's four values and
vLLM's default (`raw_logprobs`); a learner needs `processed_logprobs`. How it still differs from vLLM
(checked by vLLM's own code in tests/test_vllm_oracle.py) is listed in docs/vllm-wire-format.md, "Known
differences".

Entry points: `build_app(model_dir, ...)` (a FastAPI app, every option of `rlgate serve`) and
`serve(app, host, port)`, which `rlgate serve --model DIR --port N` runs with it; it prints `READY <port>`
once listening.
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
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel, ValidationError

from rlgate.inference import openapi, responses
from rlgate.inference.access import ApiKeyMiddleware
from rlgate.inference.endpoints import Server
from rlgate.inference.engine import LogprobsMode
from rlgate.inference.model import Model
from rlgate.inference.protocol import (
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
from rlgate.inference.responses_protocol import ResponsesRequest

log = structlog.get_logger("rlgate.serve")


async def _parse(request: Request, model_cls: type[BaseModel]) -> Any:
    """The body as `model_cls`, with vLLM's 400s for a wrong content type, bad JSON, or invalid fields."""
    if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
        raise BadRequest(
            "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed",
            type="Bad Request",
        )
    raw = await request.body()
    try:
        body = json.loads(raw)
        orjson.dumps(
            body
        )  # what cannot be written back (echoed, logged) is refused here, not answered with 500
    except orjson.JSONEncodeError as exc:  # lone UTF-16 surrogates, integers past 64 bits, nesting past 254
        raise BadRequest(
            f"1 validation error:\n  the body cannot be encoded as JSON: {exc}",
            param="body",
            type="Bad Request",
        ) from exc
    except RecursionError as exc:
        raise BadRequest(
            "1 validation error:\n  the body is nested too deeply", param="body", type="Bad Request"
        ) from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        pos = getattr(exc, "pos", 0)
        raise BadRequest(
            f"1 validation error:\n  {{'type': 'json_invalid', 'loc': 'body.{pos}', 'msg': 'JSON decode "
            f"error', 'input': '<dict of 0 items>', 'ctx': {{'error': '{getattr(exc, 'msg', exc)}'}}}}",
            param=f"body.{pos}",
            type="Bad Request",
        ) from exc
    if not isinstance(body, dict):
        raise request_validation_error(
            [
                {
                    "type": "model_attributes_type",
                    "loc": ("body",),
                    "input": body,
                    "msg": "Input should be a valid dictionary or object to extract fields from",
                }
            ]
        )
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
        raise request_validation_error(
            [{"type": "missing", "loc": ("body", key), "msg": "Field required", "input": None}]
        )
    raise request_validation_error(
        [
            {
                "type": "string_type",
                "loc": ("body", key),
                "input": value,
                "msg": "Input should be a valid string",
            }
        ]
    )


# -- The app's objects (`build_app` puts them on `app.state`), as vLLM's routers take theirs ------------


def _server(request: Request) -> Server:
    return request.app.state.server


def _model(request: Request) -> Model:
    return request.app.state.model


def _ok(body: dict[str, Any]) -> Response:
    return Response(orjson.dumps(body), media_type="application/json")


# -- Routes every server has ------------------------------------------------------------------------

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat(request: Request) -> Response:
    return await _server(request).chat(await _parse(request, ChatCompletionRequest))


@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    return await responses.create(_server(request), await _parse(request, ResponsesRequest))


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str) -> Response:
    raise responses.ResponseNotFound(response_id)


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str) -> Response:
    raise responses.ResponseNotFound(response_id)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await _server(request).completions(await _parse(request, CompletionRequest))


@router.get("/v1/models")
async def models(request: Request) -> Response:
    return _ok(_server(request).models())


@router.get("/health")
async def health() -> Response:
    return Response(status_code=200)


@router.post("/tokenize")
async def tokenize(request: Request) -> Response:
    return _ok(_server(request).tokenize(await _parse(request, TokenizeRequest)))


@router.post("/detokenize")
async def detokenize(request: Request) -> Response:
    return _ok(_server(request).detokenize(await _parse(request, DetokenizeRequest)))


# -- Gated routes (inference.access): registered only when enabled, as vLLM registers them ------------

lora_router = APIRouter()  # VLLM_ALLOW_RUNTIME_LORA_UPDATING / --allow-runtime-lora-updating
rl_router = APIRouter()  # VLLM_SERVER_DEV_MODE / --dev-mode: vLLM's RL routes (rlgate/inference/weights.py)


async def _optional_json(request: Request) -> dict[str, Any]:
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


@lora_router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request) -> Response:
    body = await _parse(request, LoadLoraAdapterRequest)
    return PlainTextResponse(
        await _model(request).adapters.load(body.lora_name, body.lora_path, bool(body.load_inplace))
    )


@lora_router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> Response:
    body = await _parse(request, UnloadLoraAdapterRequest)
    return PlainTextResponse(await _model(request).adapters.unload(body.lora_name))


@rl_router.post("/pause")
async def pause(request: Request, mode: str = "abort", clear_cache: bool = True) -> Response:
    await _model(request).weights.pause(mode)  # type: ignore[arg-type]  # pause() refuses another mode
    return _ok({"status": "paused"})


@rl_router.post("/resume")
async def resume(request: Request) -> Response:
    _model(request).weights.resume()
    return _ok({"status": "resumed"})


@rl_router.get("/is_paused")
async def is_paused(request: Request) -> Response:
    return _ok({"is_paused": _model(request).weights.paused})


@rl_router.post("/init_weight_transfer_engine")
async def init_weight_transfer_engine(request: Request) -> Response:
    body = await _optional_json(request)
    if not isinstance(body.get("init_info"), dict):
        raise BadRequest("init_info (an object) is required", param="init_info")
    _model(request).weights.init(body["init_info"])
    return _ok({"message": "Weight transfer initialized"})


@rl_router.post("/start_weight_update")
async def start_weight_update(request: Request) -> Response:
    _model(request).weights.start()
    return _ok({"message": "Weight update started"})


@rl_router.post("/update_weights")
async def update_weights(request: Request) -> Response:
    body = await _optional_json(request)
    if not isinstance(body.get("update_info"), dict | list):
        raise BadRequest("update_info (an object, or a list of them) is required", param="update_info")
    await _model(request).weights.update(body["update_info"])
    return _ok({"message": "Weights updated"})


@rl_router.post("/finish_weight_update")
async def finish_weight_update(request: Request) -> Response:
    _model(request).weights.finish(
        _string_field(await _optional_json(request), "weight_version", required=False)
    )
    return _ok({"message": "Weight update finished"})


@rl_router.post("/update_weight_version")
async def update_weight_version(request: Request) -> Response:
    weights = _model(request).weights
    weights.version = _string_field(await _optional_json(request), "new_version", required=True)
    return _ok({"success": True, "new_version": weights.version})


@rl_router.get("/weight_info")
async def weight_info(request: Request) -> Response:
    return _ok({"weight_version": _model(request).weights.version})


# -- The app ----------------------------------------------------------------------------------------


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """The scheduler runs while the app does; the adapters and the scheduler close with it."""
    model: Model = app.state.model
    model.scheduler.start()
    try:
        yield
    finally:
        await model.adapters.aclose()
        await model.scheduler.aclose()


async def _serve_error(request: Request, exc: ServeError) -> Response:
    return Response(
        orjson.dumps(exc.body()),
        status_code=exc.status,
        media_type="application/json",
        headers=exc.headers,
    )


async def _internal_error(request: Request, exc: Exception) -> Response:
    """vLLM's 500 body, never a bare text."""
    log.error("request failed", path=request.url.path, exc_info=exc)
    body = {
        "error": {
            "message": "Internal server error",
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        }
    }
    return Response(orjson.dumps(body), status_code=500, media_type="application/json")


def build_app(
    model_dir: Path | str,
    *,
    served_model_name: str | None = None,
    batch_window_s: float = 0.003,
    logprobs_mode: LogprobsMode = "raw_logprobs",
    allow_runtime_lora_updating: bool = False,
    dev_mode: bool = False,
    api_keys: list[str] | None = None,
    weights_root: Path | str | None = None,
) -> FastAPI:
    """The FastAPI app of `rlgate serve` for the Hugging Face causal LM folder `model_dir` (float32, CPU).
    The model loads now; the scheduler starts with the app (lifespan). `logprobs_mode` is vLLM's
    `--logprobs-mode` (`rlgate.inference.engine`), with vLLM's default. The gates (`rlgate.inference.access`), all off by
    default: `allow_runtime_lora_updating` serves the LoRA routes, `dev_mode` the RL routes, `api_keys`
    requires one of them on `/v1`; adapters and weight files must lie under `weights_root` (default: the
    model folder's parent)."""
    model = Model(
        Path(model_dir),
        served_model_name,
        batch_window_s,
        logprobs_mode,
        Path(weights_root) if weights_root is not None else None,
    )
    app = FastAPI(
        title="rlgate serve",
        lifespan=_lifespan,
        docs_url=None,
        redoc_url=None,
        exception_handlers={ServeError: _serve_error, Exception: _internal_error},
    )
    app.state.model = model
    app.state.server = Server(model)
    openapi.install(app)  # request bodies as _parse validates them (inference.openapi)
    if allow_runtime_lora_updating:
        log.warning(
            "runtime LoRA loading and unloading is enabled", weights_root=str(model.weights_root.root)
        )
        app.include_router(lora_router)
    if dev_mode:
        log.warning(
            "development (RL) routes are enabled: pause, weight updates, version",
            weights_root=str(model.weights_root.root),
        )
        app.include_router(rl_router)
    app.include_router(router)  # after the gated routes, as the OpenAPI document lists them
    if tokens := [key for key in api_keys or [] if key]:
        app.add_middleware(ApiKeyMiddleware, tokens=tokens)
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


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, announce: bool = True) -> None:
    """Serve `app` (`build_app`'s) until interrupted; prints `READY <port>` once listening (port 0 picks
    one)."""
    asyncio.run(_serve(app, host, port, announce))
