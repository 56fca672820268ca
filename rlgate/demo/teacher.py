"""The warm start's teacher: a program that answers Calc-X chats in the OpenAI chat-completions format.

Real pipelines warm-start a policy on traces of a stronger model, recorded through the same gateway
(`rlgate export --format sft`). No such model runs here, so this program plays it: it answers
`POST /v1/chat/completions` with `rlgate.demo.calc_chat.warm_start_answer` (a tool call part of the time, some
of them malformed, otherwise a direct answer that is often wrong) and returns the message as vLLM does
for a hermes-format model: well-formed calls in `tool_calls` with finish reason `tool_calls`, a malformed
one as plain content. It serves no token ids or log-probs: its calls are recorded for their messages (the
warm start's data) and are not trainable. It is the demo's data source, not an inference server.

    python -m rlgate.demo.teacher --port 8200 --tool-rate 0.45 --broken-rate 0.2
    python -m rlgate.demo.teacher --port 8200 --task calc-x --tasks tasks.jsonl --slip-rate 0.3

`--task calc-x` answers the AutoGen Calc-X agent's calls instead (`rlgate.demo.calc_x.teacher_message`: the
problem's expression through the calculator, a share `--slip-rate` of them wrong, then the answer in the
task's format), knowing each question's expression from the tasks file.
"""

from __future__ import annotations

import argparse
import random
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from rlgate.demo.calc_chat import warm_start_answer

Answer = Callable[[list[dict[str, Any]], random.Random], dict[str, Any]]


def calc_chat_answer(tool_rate: float, broken_rate: float) -> Answer:
    return lambda messages, rng: warm_start_answer(messages, rng, tool_rate, broken_rate)


def calc_x_answer(tasks: Path, slip_rate: float) -> Answer:
    from rlgate.demo.calc_x import read_tasks, teacher_message

    expressions = {problem.question: problem.expression for problem in read_tasks(tasks)}
    return lambda messages, rng: teacher_message(messages, expressions, rng, slip_rate)


def build_app(answer: Answer, seed: int, model: str = "teacher") -> FastAPI:
    app = FastAPI(title="rlgate demo teacher")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": model, "object": "model", "created": 0, "owned_by": "rlgate"}],
        }

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        body = await request.json()
        try:
            # one generator per conversation, seeded by the question: the same traces whatever
            # order concurrent requests arrive in
            question = next(m["content"] for m in body["messages"] if m["role"] == "user")
            rng = random.Random(f"{seed}:{question}")
            message = answer(body["messages"], rng)
        except (KeyError, TypeError, ValueError, StopIteration) as exc:
            error = {"message": f"not a Calc-X conversation: {exc}", "type": "BadRequestError", "param": None}
            return JSONResponse({"error": {**error, "code": 400}}, status_code=400)
        calls = message.get("tool_calls") or []
        return JSONResponse(
            {
                "id": f"chatcmpl-{uuid.uuid4().hex}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body.get("model") or model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": message["content"], "tool_calls": calls},
                        "logprobs": None,
                        "finish_reason": "tool_calls" if calls else "stop",
                        "stop_reason": None,
                    }
                ],
                "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
            }
        )

    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8200)
    parser.add_argument(
        "--tool-rate", type=float, default=0.45, help="Share of first turns that call the tool."
    )
    parser.add_argument(
        "--broken-rate", type=float, default=0.2, help="Share of those calls that are malformed."
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--task", choices=("calc-chat", "calc-x"), default="calc-chat")
    parser.add_argument("--tasks", type=Path, default=None, help="calc-x: the tasks file (JSONL).")
    parser.add_argument("--slip-rate", type=float, default=0.3, help="calc-x: share of wrong expressions.")
    args = parser.parse_args(argv)
    if args.task == "calc-x":
        if args.tasks is None:
            parser.error("--task calc-x needs --tasks FILE")
        answer = calc_x_answer(args.tasks, args.slip_rate)
    else:
        answer = calc_chat_answer(args.tool_rate, args.broken_rate)
    app = build_app(answer, args.seed)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
