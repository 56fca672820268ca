"""The Calc-X chat agent (`rlgate.demo.calc_chat`): OpenAI-SDK code as anyone writes it, with the tools API.

`solve()` is the agent: it sends the question with `tools=[calculate]` and `tool_choice="auto"`, runs
the calls the model makes and sends their results back as `tool` messages, until the model answers
without a call (at most `MAX_TURNS` model calls). No token ids, no `logit_bias`, nothing rlgate-specific.

Against any OpenAI-compatible server, e.g. vLLM serving a model under the name `policy`:

    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=... python -m rlgate.demo.chat_agent --model policy

solves `--episodes` questions and prints how many it got right. With `--gateway URL` it runs as the
demo's harness drives it: every episode under its own rollout (`.../tasks/{task}/rollouts/{id}/v1`, so
the gateway records it), graded by the `math_answer` reward job through `/rollouts/{id}/finish`, tasks of
`--rollouts-per-task` episodes (the learner's GRPO groups), `--concurrency` in flight, until stopped or
`--episodes` are done. `--stats FILE` appends one JSON line per episode (time, used the tool, wrote a
well-formed call, turns, right) for the demo's curve.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import time
import uuid
from typing import Any

import httpx
import openai

from rlgate.demo.calc_chat import SYSTEM, TOOLS, Question, calculate, random_question

MAX_TURNS = 4
TEMPERATURE = 0.7
MAX_TOKENS = 96


async def solve(llm: openai.AsyncOpenAI, model: str, question: Question) -> dict[str, Any]:
    """Run one conversation; returns the final answer and what happened on the way."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": question.text},
    ]
    used_tool = well_formed = False
    answer = ""
    turns = 0
    while turns < MAX_TURNS:
        turns += 1
        response = await llm.chat.completions.create(
            model=model,
            messages=messages,
            tools=TOOLS,
            tool_choice="auto",
            temperature=TEMPERATURE,
            max_tokens=MAX_TOKENS,
        )
        message = response.choices[0].message
        answer = message.content or ""
        used_tool = used_tool or bool(message.tool_calls) or "<tool_call>" in answer
        if not message.tool_calls:
            break
        well_formed = True
        messages.append(message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
        for call in message.tool_calls:
            result = (
                calculate(call.function.arguments) if call.function.name == "calculate" else "unknown tool"
            )
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    right = answer.strip() == f"ANSWER: {question.answer}"
    return {
        "answer": answer,
        "turns": turns,
        "used_tool": used_tool,
        "well_formed": well_formed,
        "right": right,
    }


async def episode(
    client: openai.AsyncOpenAI,
    http: httpx.AsyncClient,
    args: argparse.Namespace,
    task_id: str,
    question: Question,
) -> dict[str, Any]:
    """One episode through the gateway: a rollout of its own, then the reward job."""
    rollout_id = uuid.uuid4().hex
    llm = client.with_options(base_url=f"{args.gateway}/tasks/{task_id}/rollouts/{rollout_id}/v1")
    result = await solve(llm, args.model, question)
    finished = await http.post(
        f"{args.gateway}/rollouts/{rollout_id}/finish",
        json={"reward_fn": "math_answer", "ground_truth": question.answer},
    )
    finished.raise_for_status()
    return result


async def run(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    client = openai.AsyncOpenAI(
        base_url=None if args.gateway is None else f"{args.gateway}/v1",
        api_key=os.environ.get("OPENAI_API_KEY", "unused"),
        max_retries=5,
        timeout=120,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    stats = open(args.stats, "a", buffering=1) if args.stats else None  # noqa: SIM115 (closed below)
    done = right = started = 0

    async def one(task_id: str, question: Question, http: httpx.AsyncClient) -> None:
        nonlocal done, right
        try:
            if args.gateway is None:
                result = await solve(client, args.model, question)
            else:
                result = await episode(client, http, args, task_id, question)
        except (openai.OpenAIError, httpx.HTTPError) as exc:
            print(f"chat_agent: an episode of task {task_id} failed: {exc!r}", flush=True)
            return
        done += 1
        right += result["right"]
        if stats is not None:
            stats.write(json.dumps({"time": time.time(), "task_id": task_id, **result}) + "\n")

    async with httpx.AsyncClient(timeout=60) as http:
        running: set[asyncio.Task[None]] = set()
        stopped = asyncio.ensure_future(stop.wait())
        number = 0
        while not stop.is_set() and (args.episodes == 0 or started < args.episodes or running):
            while (
                len(running) * args.rollouts_per_task < args.concurrency
                and (args.episodes == 0 or started < args.episodes)
                and not stop.is_set()
            ):
                number += 1
                question = random_question(rng)
                group = [
                    asyncio.create_task(one(f"{args.prefix}{number}", question, http))
                    for _ in range(args.rollouts_per_task)
                ]
                started += len(group)
                t = asyncio.ensure_future(asyncio.gather(*group))
                running.add(t)
                t.add_done_callback(running.discard)
            if not running:
                break
            await asyncio.wait([stopped, *running], return_when=asyncio.FIRST_COMPLETED)
        for t in running:
            t.cancel()
    if stats is not None:
        stats.close()
    await client.close()
    if args.gateway is None:
        print(f"{right} of {done} answered right ({right / max(done, 1):.1%})")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--gateway",
        default=None,
        help="The rlgate gateway's base URL: record every episode as a rollout and ask for its reward. "
        "Without it the agent talks to OPENAI_BASE_URL and grades itself.",
    )
    parser.add_argument("--model", default="policy", help="The model name to ask for.")
    parser.add_argument("--episodes", type=int, default=0, help="Stop after this many (0: until stopped).")
    parser.add_argument("--concurrency", type=int, default=16, help="Episodes in flight.")
    parser.add_argument("--rollouts-per-task", type=int, default=1, help="Episodes per question.")
    parser.add_argument("--prefix", default="calc", help="Task ids are PREFIX1, PREFIX2, ...")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the question generator.")
    parser.add_argument("--stats", default=None, help="Append one JSON line per episode to this file.")
    args = parser.parse_args(argv)
    if args.gateway is None and not os.environ.get("OPENAI_BASE_URL"):
        parser.error("set OPENAI_BASE_URL (the server's /v1 URL) or pass --gateway")
    return args


if __name__ == "__main__":
    asyncio.run(run(parse()))
