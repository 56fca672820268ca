"""vLLM 0.33.0's own code as a judge, run under the oracle venv's python (`.venv-vllm`, made by scripts/test).

A TEST HELPER, run by tests/test_vllm_oracle.py as `python tests/vllm_oracle.py FD`: writes `{"ready": true}`
to file descriptor FD (default: stdout), then reads stdin lines, each a JSON list of cases, and answers each
with a line on FD holding the JSON list of answers, one per case. FD is a channel of its own: whatever vLLM
logs or prints goes to stdout and stderr, which the test keeps in a file and shows when the oracle fails. Nothing here
re-implements vLLM; every answer comes from vLLM's own models, parsers, routers and exception handlers
(the glue between them follows vLLM's serving code, cited per function):

- `{"op": "validate", "model": M, "body": obj}`: `obj` validated with vLLM's pydantic model M
  (ChatCompletionResponse, ChatCompletionStreamResponse, CompletionResponse, CompletionStreamResponse,
  ErrorResponse, ResponsesResponse, and ResponseStreamEvent: openai's union of Responses stream events,
  with vLLM's wrappers for the events carrying a whole response) and serialized back the way vLLM serializes
  M (`model_dump()` for answers and errors, `model_dump_json(exclude_unset=True, ...)` for stream chunks,
  `model_dump(mode="json", by_alias=True)` / `model_dump_json(by_alias=True)` for Responses bodies and
  events): `{"ok", "error", "extra", "dump"}`.
  `extra` lists the keys vLLM's models do not know (they accept them silently: `extra="allow"`).
- `{"op": "parse", "model_dir", "request", "text", "finish_reason", "pieces"?}`: what
  `vllm serve --enable-auto-tool-choice --tool-call-parser hermes` makes of a model's output text: its
  Parser (`ParserManager.get_parser`), `assemble_chat_message_fields` and `resolve_finish_reason` for the
  whole text; with `pieces` (the text of each streamed token), the deltas of `ChatStreamProcessor`.
- `{"op": "http", "requests": [{"method", "path", "json" | "content", "headers"?}]}`: the status and body
  of vLLM's own routers (chat, completions, responses, the RL routes) and exception handlers, on an app whose engine
  is a stub that builds the request's `SamplingParams` as vLLM's serving code does (`to_sampling_params`,
  whose checks answer 400) and accepts the rest: 200 means vLLM's request validation let it through.
- `{"op": "anthropic", "body"}`: the chat completion request vLLM's `/v1/messages` makes of an Anthropic
  Messages request (`AnthropicServingMessages.to_chat_completion_request`).
- `{"op": "process", "logits", "temperature", "top_k", "top_p", "logit_bias"}`: the logits vLLM's v1 sampler
  samples from for a request with these fields: vLLM's `SamplingParams` built from them (which raises
  small temperatures to 0.01), then its own temperature and top-k/top-p functions.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import warnings
from types import SimpleNamespace
from typing import Any

warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)


def _models() -> dict[str, Any]:
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionResponse,
        ChatCompletionStreamResponse,
    )
    from vllm.entrypoints.openai.completion.protocol import CompletionResponse, CompletionStreamResponse
    from vllm.entrypoints.openai.responses.protocol import ResponsesResponse
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse

    return {
        m.__name__: m
        for m in (
            ChatCompletionResponse,
            ChatCompletionStreamResponse,
            CompletionResponse,
            CompletionStreamResponse,
            ErrorResponse,
            ResponsesResponse,
        )
    }


def _validate_event(body: Any) -> Any:
    """A Responses stream event as vLLM's stream builds it: the events carrying a whole response with vLLM's
    own wrappers (their `response` is vLLM's ResponsesResponse), the others with openai's discriminated union
    `ResponseStreamEvent`, which must accept every event anyway (what the OpenAI SDK parses them with)."""
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter
    from vllm.entrypoints.openai.responses import protocol

    event = TypeAdapter(ResponseStreamEvent).validate_python(body)
    wrappers = {
        "response.created": protocol.ResponseCreatedEvent,
        "response.in_progress": protocol.ResponseInProgressEvent,
        "response.completed": protocol.ResponseCompletedEvent,
        "response.incomplete": protocol.ResponseIncompleteEvent,
    }
    wrapper = wrappers.get(body.get("type"))
    return event if wrapper is None else wrapper.model_validate(body)


def _extra_keys(obj: Any, path: str = "") -> list[str]:
    """Paths of keys that no vLLM model field declares (pydantic keeps them in `model_extra`)."""
    from pydantic import BaseModel

    found: list[str] = []
    if isinstance(obj, BaseModel):
        found += [f"{path}.{k}" for k in (obj.model_extra or {})]
        for name in type(obj).model_fields:
            found += _extra_keys(getattr(obj, name), f"{path}.{name}")
    elif isinstance(obj, list | tuple):
        for i, item in enumerate(obj):
            found += _extra_keys(item, f"{path}[{i}]")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            found += _extra_keys(v, f"{path}.{k}")
    return found


def validate(case: dict[str, Any]) -> dict[str, Any]:
    from pydantic import ValidationError

    try:
        if case["model"] == "ResponseStreamEvent":
            obj = _validate_event(case["body"])
        else:
            obj = _models()[case["model"]].model_validate(case["body"])
    except ValidationError as exc:
        return {"ok": False, "error": str(exc), "extra": [], "dump": None}
    if case["model"] in ("ResponsesResponse", "ResponseStreamEvent"):
        # responses/api_router.py: model_dump(mode="json", by_alias=True); events model_dump_json(by_alias=True)
        dump = json.loads(obj.model_dump_json(indent=None, by_alias=True))
    elif case["model"] == "ChatCompletionStreamResponse":  # chat_completion_stream_generator
        dump = json.loads(obj.model_dump_json(exclude_unset=True, exclude_none=not obj.choices))
    elif case["model"] == "CompletionStreamResponse":  # completion_stream_generator (usage chunk: no nulls)
        dump = json.loads(obj.model_dump_json(exclude_unset=bool(obj.choices), exclude_none=not obj.choices))
    else:  # JSONResponse(content=response.model_dump())
        dump = json.loads(json.dumps(obj.model_dump(), ensure_ascii=False))
    return {"ok": True, "error": None, "extra": _extra_keys(obj), "dump": dump}


_tokenizers: dict[str, Any] = {}


def _parser(model_dir: str) -> tuple[Any, Any]:
    from transformers import AutoTokenizer
    from vllm.parser.parser_manager import ParserManager

    if model_dir not in _tokenizers:
        _tokenizers[model_dir] = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    tokenizer = _tokenizers[model_dir]
    parser_cls = ParserManager.get_parser(
        tool_parser_name="hermes", enable_auto_tools=True, tokenizer=tokenizer
    )
    return parser_cls, tokenizer


def parse(case: dict[str, Any]) -> dict[str, Any]:
    """vLLM's chat answer fields for one choice's output text (serving.py, full and streaming paths)."""
    from vllm.entrypoints.openai.chat_completion.message_assembly import assemble_chat_message_fields
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.chat_completion.stream_processor import ChatStreamProcessor
    from vllm.entrypoints.serve.utils.tool_calls_utils import resolve_finish_reason

    parser_cls, tokenizer = _parser(case["model_dir"])
    request = ChatCompletionRequest.model_validate(case["request"])
    parser = parser_cls(tokenizer)
    request = parser.adjust_request(request)
    reasoning, content, tool_calls = parser.parse(case["text"], request, enable_auto_tools=True)
    fields = assemble_chat_message_fields(
        request, reasoning, content, tool_calls, enable_auto_tools=True, parser_cls=parser_cls
    )
    answer: dict[str, Any] = {
        "content": fields.content,
        "tool_calls": [
            {"name": c.function.name, "arguments": c.function.arguments} for c in fields.tool_calls
        ],
        "finish_reason": resolve_finish_reason(case["finish_reason"], request, bool(fields.tool_calls)),
    }
    if case.get("pieces") is not None:
        processor = ChatStreamProcessor(
            request, parser_cls(tokenizer), enable_auto_tools=True, parser_cls=parser_cls
        )
        deltas, finish = [], None
        pieces, ids = case["pieces"], case.get("token_ids") or [[0]] * len(case["pieces"])
        for i, (piece, token_ids) in enumerate(zip(pieces, ids, strict=True)):
            last = i == len(pieces) - 1
            step = processor.step(
                piece, token_ids, case["finish_reason"] if last else None, case.get("prompt_token_ids") or [0]
            )
            delta = step.delta
            if delta is None and last:  # serving.py: a finishing choice always sends a chunk
                deltas.append({})
            else:  # as the chunk carries it (model_dump_json(exclude_unset=True))
                deltas.append(
                    None if delta is None else json.loads(delta.model_dump_json(exclude_unset=True))
                )
            finish = step.finish_reason
        answer["stream"] = {"deltas": deltas, "finish_reason": finish}
    return answer


def _app() -> Any:
    from fastapi import FastAPI
    from vllm.entrypoints.openai.chat_completion.api_router import router as chat_router
    from vllm.entrypoints.openai.completion.api_router import router as completion_router
    from vllm.entrypoints.openai.responses.api_router import router as responses_router
    from vllm.entrypoints.rl.online.api_router import router as rl_router
    from vllm.entrypoints.serve.exception_handling.register import init_exception_handler

    class StubServing:
        """Accepts every request that vLLM's request models and routers let through."""

        async def _accept(self, request: Any, raw_request: Any) -> Any:
            # serving.py: the engine's SamplingParams, whose checks (top_k, temperature, ...) raise 400s
            request.to_sampling_params(request.max_tokens or 16, {})

            async def chunks():
                yield "data: accepted\n\n"

            return chunks()

        create_chat_completion = _accept
        create_completion = _accept

    class StubEngine:
        def __getattr__(self, name: str) -> Any:
            async def call(*args: Any, **kwargs: Any) -> Any:
                return "stub"

            return call

    class StubResponses:
        """vLLM's OpenAIServingResponses up to the engine (serving.py `_create_responses`), store off as
        without VLLM_ENABLE_RESPONSES_API_STORE, for a non-harmony model."""

        use_harmony, enable_store = False, False

        async def create_responses(self, request: Any, raw_request: Any) -> Any:
            from vllm.entrypoints.openai.responses.serving import OpenAIServingResponses
            from vllm.entrypoints.serve.engine.serving import create_error_response

            self.create_error_response = create_error_response
            error = OpenAIServingResponses._validate_create_responses_input(self, request)
            if error is not None:
                return error
            if request.previous_response_id is not None:
                return OpenAIServingResponses._make_not_found_error(self, request.previous_response_id)
            request.to_sampling_params(request.max_output_tokens or 16, {})

            async def events():
                yield SimpleNamespace(type="accepted", model_dump_json=lambda **kwargs: "{}")

            return events()

    app = FastAPI()
    for router in (chat_router, completion_router, rl_router, responses_router):
        app.include_router(router)
    init_exception_handler(app)
    app.state.args = SimpleNamespace(log_error_stack=False, sse_keep_alive_interval=0)
    app.state.openai_serving_chat = StubServing()
    app.state.openai_serving_completion = StubServing()
    app.state.openai_serving_responses = StubResponses()
    app.state.engine_client = StubEngine()
    return app


def http(case: dict[str, Any]) -> list[dict[str, Any]]:
    import httpx

    async def run() -> list[dict[str, Any]]:
        transport = httpx.ASGITransport(app=_app())
        answers = []
        async with httpx.AsyncClient(transport=transport, base_url="http://vllm") as client:
            for r in case["requests"]:
                kwargs: dict[str, Any] = {"headers": r.get("headers") or {}}
                if "json" in r:
                    kwargs["json"] = r["json"]
                else:
                    kwargs["content"] = r.get("content", "").encode()
                response = await client.request(r.get("method", "POST"), r["path"], **kwargs)
                try:
                    body = response.json()
                except ValueError:
                    body = response.text
                answers.append({"status": response.status_code, "body": body})
        return answers

    return asyncio.run(run())


def process(case: dict[str, Any]) -> list[float | None]:
    """The logits vLLM's v1 sampler samples from (`processed_logits` mode) for one row: logit_bias added
    (its LogitBiasLogitsProcessor), then `Sampler.apply_temperature`, then `apply_top_k_top_p`. -inf: None."""
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
    from vllm.v1.sample.sampler import Sampler

    params = SamplingParams(temperature=case["temperature"], top_k=case["top_k"], top_p=case["top_p"])
    logits = torch.tensor([case["logits"]], dtype=torch.float32)
    for token, bias in case["logit_bias"].items():
        logits[0, int(token)] += bias
    logits = Sampler.apply_temperature(logits, torch.tensor([params.temperature]), all_random=True)
    k = torch.tensor([params.top_k]) if params.top_k > 0 else None
    p = torch.tensor([params.top_p]) if params.top_p < 1 else None
    logits = apply_top_k_top_p(logits, k, p)
    return [None if v == float("-inf") else v for v in logits[0].tolist()]


def anthropic(case: dict[str, Any]) -> dict[str, Any]:
    """The chat completion request vLLM's `/v1/messages` makes of an Anthropic request (`body`):
    `AnthropicMessagesRequest`, then `AnthropicServingMessages.to_chat_completion_request` (a template that
    takes inline system messages: no merging), dumped with the fields it set: `{"ok", "error", "chat"}`."""
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

    try:
        request = AnthropicMessagesRequest.model_validate(case["body"])
        chat = AnthropicServingMessages.to_chat_completion_request(request)
    except Exception as exc:  # a request vLLM refuses: its message
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:500], "chat": None}
    return {
        "ok": True,
        "error": None,
        "chat": chat.model_dump(mode="json", exclude_unset=True, by_alias=True),
    }


OPS = {"validate": validate, "parse": parse, "http": http, "process": process, "anthropic": anthropic}


def main() -> None:
    """One JSON list of cases per stdin line, one JSON list of answers per line on the answer channel (a
    test session keeps one oracle process: importing vLLM and torch takes seconds)."""
    answers = os.fdopen(int(sys.argv[1]), "w", encoding="utf-8") if len(sys.argv) > 1 else sys.stdout
    _models()  # import up front, so that the first answer is not the slow one
    print(json.dumps({"ready": True}), file=answers, flush=True)
    for line in sys.stdin:
        if line.strip():
            cases = json.loads(line)
            print(json.dumps([OPS[case["op"]](case) for case in cases]), file=answers, flush=True)


if __name__ == "__main__":
    main()
