"""The demo's agent: plain OpenAI-SDK code. It knows nothing of rlgate but two URLs: its base URL per
rollout (`.../tasks/{task}/rollouts/{rollout}/v1`, which is how the gateway learns what to record under
which episode) and the reward endpoint it asks to grade its answer (`/rollouts/{rollout}/finish` with
the `math_answer` reward job and the ground truth).

    python -m rlgate.demo.agent --gateway http://127.0.0.1:8100 --model tiny --concurrency 32

Runs until stopped (SIGTERM/SIGINT): tasks of `--rollouts-per-task` episodes each (the learner's GRPO
groups), `--concurrency` episodes in flight.

Against a gateway with credentials and a control port (docker compose), as a harness drives it: with
`--control URL` each episode is created there (`POST /rollouts`, with the operator token from
`RLGATE_OPERATOR_TOKEN`), the agent uses the `base_url` and `api_key` it returns, and the reward job is
asked for there too.

With `--ledger PATH` every answered call and every accepted finish is appended to PATH as a JSON line (the
agents' own count of what the gateway acknowledged: `scripts/chaos` compares it with the store).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import uuid

import httpx
import openai

from rlgate.demo.task import ANSWER_BIAS, FIRST_CALL_BIAS, TEMPERATURE, TOOL_TOKEN, Question, random_question

FINISH_TRIES = 8  # a finish that found no gateway (restarting) or a 5xx is asked again, with backoff


class Ledger:
    """`--ledger`: one JSON line per answered call and per accepted finish (None: nothing written)."""

    def __init__(self, path: str | None) -> None:
        self.file = open(path, "a", buffering=1) if path else None  # noqa: SIM115 (kept open for the run)

    def write(self, **entry: object) -> None:
        if self.file is not None:
            self.file.write(json.dumps(entry) + "\n")


async def finish(http: httpx.AsyncClient, gateway: str, rollout_id: str, body: dict) -> int:
    """Ask for the reward job; a transport error, 429 or 5xx is retried (the gateway may be restarting), a
    409 after a retry means the first try closed it already. Returns the accepting status."""
    for attempt in range(FINISH_TRIES):
        try:
            response = await http.post(f"{gateway}/rollouts/{rollout_id}/finish", json=body)
        except httpx.TransportError:
            if attempt == FINISH_TRIES - 1:
                raise
        else:
            if response.status_code == 409 and attempt:
                return 409
            if response.status_code != 429 and response.status_code < 500:
                response.raise_for_status()
                return response.status_code
            if attempt == FINISH_TRIES - 1:
                response.raise_for_status()
        await asyncio.sleep(min(0.25 * 2**attempt, 4.0))
    raise AssertionError("unreachable")


async def episode(
    client: openai.AsyncOpenAI,
    http: httpx.AsyncClient,
    gateway: str,
    model: str,
    task_id: str,
    question: Question,
    control: str | None = None,
    ledger: Ledger | None = None,
) -> None:
    ledger = ledger or Ledger(None)
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
    try:
        await _solve(llm, http, gateway, model, rollout_id, question, ledger)
    except Exception as exc:  # a crashed episode says so (never trained), as far as the gateway answers
        ledger.write(rollout=rollout_id, failed=repr(exc)[:200])
        with contextlib.suppress(httpx.HTTPError):
            await http.post(f"{gateway}/rollouts/{rollout_id}/fail", json={"reason": repr(exc)[:200]})
        raise


async def _solve(
    llm: openai.AsyncOpenAI,
    http: httpx.AsyncClient,
    gateway: str,
    model: str,
    rollout_id: str,
    question: Question,
    ledger: Ledger,
) -> None:
    first = await llm.completions.create(
        model=model, prompt=question.prompt, max_tokens=1, temperature=TEMPERATURE, logit_bias=FIRST_CALL_BIAS
    )
    ledger.write(rollout=rollout_id, call=first.id)
    answer = first.choices[0].text
    if answer == TOOL_TOKEN:  # the model asked for the calculator: run it, show the model its result
        prompt = question.prompt + answer + question.calculator()
        second = await llm.completions.create(
            model=model, prompt=prompt, max_tokens=1, temperature=TEMPERATURE, logit_bias=ANSWER_BIAS
        )
        ledger.write(rollout=rollout_id, call=second.id)
        answer = second.choices[0].text
    status = await finish(
        http, gateway, rollout_id, {"reward_fn": "math_answer", "ground_truth": question.answer}
    )
    ledger.write(rollout=rollout_id, finished=status)


async def task(
    client: openai.AsyncOpenAI,
    http: httpx.AsyncClient,
    args: argparse.Namespace,
    number: int,
    rng: random.Random,
    ledger: Ledger,
) -> None:
    question = random_question(rng)
    results = await asyncio.gather(
        *(
            episode(
                client,
                http,
                args.gateway,
                args.model,
                f"{args.prefix}{number}",
                question,
                args.control,
                ledger,
            )
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
    ledger = Ledger(args.ledger)
    async with httpx.AsyncClient(timeout=30, headers=headers) as http:
        running: set[asyncio.Task[None]] = set()
        stopped = asyncio.ensure_future(stop.wait())
        number = 0
        while not stop.is_set():
            while len(running) * args.rollouts_per_task < args.concurrency:
                number += 1
                t = asyncio.create_task(task(client, http, args, number, rng, ledger))
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
    parser.add_argument("--ledger", default=None, help="Append every answered call and accepted finish here.")
    return parser.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse()))
