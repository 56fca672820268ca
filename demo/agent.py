"""The demo's agent: plain OpenAI-SDK code. It knows nothing of rlgate but two URLs: its base URL per
rollout (`.../tasks/{task}/rollouts/{rollout}/v1`, which is how the gateway learns what to record under
which episode) and the reward endpoint it asks to grade its answer (`/rollouts/{rollout}/finish` with
the `math_answer` reward job and the ground truth).

    python -m demo.agent --gateway http://127.0.0.1:8100 --model tiny --concurrency 32

Runs until stopped (SIGTERM/SIGINT): tasks of `--rollouts-per-task` episodes each (the learner's GRPO
groups), `--concurrency` episodes in flight.

Against a gateway with credentials and a control port (docker compose), as a harness drives it: with
`--control URL` each episode is created there (`POST /rollouts`, with the operator token from
`RLGATE_OPERATOR_TOKEN`), the agent uses the `base_url` and `api_key` it returns, and the reward job is
asked for there too.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import uuid

import httpx
import openai

from demo.task import ANSWER_BIAS, FIRST_CALL_BIAS, TEMPERATURE, TOOL_TOKEN, Question, random_question


async def episode(
    client: openai.AsyncOpenAI,
    http: httpx.AsyncClient,
    gateway: str,
    model: str,
    task_id: str,
    question: Question,
    control: str | None = None,
) -> None:
    if control is None:  # an open gateway: the agent names its rollout in its base URL
        rollout_id = uuid.uuid4().hex
        llm = client.with_options(base_url=f"{gateway}/tasks/{task_id}/rollouts/{rollout_id}/v1")
    else:  # the harness creates the rollout; the agent gets its base URL and its key
        while True:  # held while the backlog is over its bound (up to 30 s), then 429: wait and ask again
            created = await http.post(f"{control}/rollouts", json={"task_id": task_id}, timeout=60)
            if created.status_code != 429:
                break
            await asyncio.sleep(float(created.headers.get("retry-after") or 1))
        created.raise_for_status()
        rollout = created.json()
        rollout_id, gateway = rollout["rollout_id"], control
        llm = client.with_options(base_url=rollout["base_url"], api_key=rollout["api_key"] or "unused")
    first = await llm.completions.create(
        model=model, prompt=question.prompt, max_tokens=1, temperature=TEMPERATURE, logit_bias=FIRST_CALL_BIAS
    )
    answer = first.choices[0].text
    if answer == TOOL_TOKEN:  # the model asked for the calculator: run it, show the model its result
        prompt = question.prompt + answer + question.calculator()
        second = await llm.completions.create(
            model=model, prompt=prompt, max_tokens=1, temperature=TEMPERATURE, logit_bias=ANSWER_BIAS
        )
        answer = second.choices[0].text
    response = await http.post(
        f"{gateway}/rollouts/{rollout_id}/finish",
        json={"reward_fn": "math_answer", "ground_truth": question.answer},
    )
    response.raise_for_status()


async def task(
    client: openai.AsyncOpenAI,
    http: httpx.AsyncClient,
    args: argparse.Namespace,
    number: int,
    rng: random.Random,
) -> None:
    question = random_question(rng)
    results = await asyncio.gather(
        *(
            episode(client, http, args.gateway, args.model, f"{args.prefix}{number}", question, args.control)
            for _ in range(args.rollouts_per_task)
        ),
        return_exceptions=True,
    )
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        print(f"agent: {len(errors)} episode(s) of task {number} failed: {errors[0]!r}", flush=True)


async def main(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    client = openai.AsyncOpenAI(base_url=f"{args.gateway}/v1", api_key="unused", max_retries=5, timeout=60)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    token = os.environ.get("RLGATE_OPERATOR_TOKEN")  # for --control: never a flag, which ps would show
    headers = {"Authorization": f"Bearer {token}"} if args.control and token else {}
    async with httpx.AsyncClient(timeout=30, headers=headers) as http:
        running: set[asyncio.Task[None]] = set()
        stopped = asyncio.ensure_future(stop.wait())
        number = 0
        while not stop.is_set():
            while len(running) * args.rollouts_per_task < args.concurrency:
                number += 1
                t = asyncio.create_task(task(client, http, args, number, rng))
                running.add(t)
                t.add_done_callback(running.discard)
            await asyncio.wait([stopped, *running], return_when=asyncio.FIRST_COMPLETED)
        for t in running:
            t.cancel()
    await client.close()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gateway", default="http://127.0.0.1:8100", help="The gateway's base URL.")
    parser.add_argument(
        "--control",
        default=None,
        help="The gateway's control port (its base URL): create "
        "each rollout there and ask for its reward there, with RLGATE_OPERATOR_TOKEN.",
    )
    parser.add_argument("--model", default="tiny", help="The model name to ask for.")
    parser.add_argument("--concurrency", type=int, default=32, help="Episodes in flight.")
    parser.add_argument("--rollouts-per-task", type=int, default=8, help="Episodes per task (a GRPO group).")
    parser.add_argument("--prefix", default="q", help="Task ids are PREFIX1, PREFIX2, ...")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the question generator.")
    return parser.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse()))
