"""LLM-as-judge reward: a judge model, reached through litellm (any provider it supports), grades the
answer against a rubric and ends its reply with `SCORE: <number>`."""

from __future__ import annotations

import json
import os
import re
from typing import TYPE_CHECKING, Any

from reward_hooks.rewards.errors import RewardInputError

if TYPE_CHECKING:
    from reward_hooks.rewards.registry import RewardInput

DEFAULT_TIMEOUT_S = 60.0
DEFAULT_RUBRIC = (
    "Score how well the answer answers the question. 1 means fully correct and complete (when a reference "
    "answer is given: it agrees with the reference, however phrased); 0 means wrong, missing or off-topic; "
    "partially correct answers get a score in between."
)
SYSTEM_PROMPT = (
    "You are a strict, impartial grader. Read the question, the answer to grade, the reference answer if "
    "there is one, and the rubric. Briefly explain your judgement, then end your reply with a final line "
    "of the form\nSCORE: <number between 0 and 1>"
)

# `\s*(?:\*+\s*)?`, not `\s*\**\s*`: two adjacent `\s*` split a run of spaces every possible way, quadratic
# in its length when no number follows.
_SCORE = re.compile(r"SCORE:\s*(?:\*+\s*)?([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)", re.IGNORECASE)


def judge_messages(inp: RewardInput, rubric: str) -> list[dict[str, str]]:
    """The chat messages sent to the judge: the system prompt, then one user message with the question
    (when known), the answer, the reference answer (when `ground_truth` is not None; a non-string is
    written as JSON) and the rubric."""
    sections = []
    if inp.question is not None:
        sections.append(f"## Question\n{inp.question}")
    sections.append(f"## Answer to grade\n{inp.answer}")
    if inp.ground_truth is not None:
        truth = inp.ground_truth
        reference = truth if isinstance(truth, str) else json.dumps(truth, ensure_ascii=False, default=str)
        sections.append(f"## Reference answer\n{reference}")
    sections.append(f"## Rubric\n{rubric}")
    sections.append("End your reply with the line `SCORE: <number between 0 and 1>`.")
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "\n\n".join(sections)}]


def parse_score(reply: str | None) -> float:
    """The number after the last `SCORE:` in `reply` (case-insensitive, markdown bold tolerated), clamped
    to [0, 1]. ValueError when there is none."""
    found = _SCORE.findall(reply or "")
    if not found:
        raise ValueError(f"the judge's reply has no 'SCORE: <number>' line: {(reply or '')[-500:]!r}")
    return min(1.0, max(0.0, float(found[-1])))


def llm_judge(inp: RewardInput) -> float:
    """The judge model's score of the answer, in [0, 1]: `parse_score` of its reply to `judge_messages`.

    One `litellm.completion` call with temperature 0. Params: `model` (required, a litellm model name such
    as `openai/gpt-4o-mini` or `hosted_vllm/Qwen/Qwen2.5-7B-Instruct`), `api_base` and `api_key`
    (optional; otherwise litellm's provider defaults and environment variables), `rubric` (default
    `DEFAULT_RUBRIC`), `timeout_s` (default 60). A reply without a score raises ValueError, and errors of
    the call (network, provider) propagate, so the reward job can retry.
    """
    params = inp.params
    model = params.get("model")
    if not isinstance(model, str) or not model:
        raise RewardInputError(
            f"params.model must name the judge model (a litellm model name), got {model!r}"
        )
    rubric = params.get("rubric", DEFAULT_RUBRIC)
    if not isinstance(rubric, str) or not rubric.strip():
        raise RewardInputError(f"params.rubric must be a non-empty string, got {rubric!r}")
    options: dict[str, Any] = {k: params[k] for k in ("api_base", "api_key") if params.get(k) is not None}

    # litellm otherwise fetches its model-cost map from the internet at import; the copy it ships is enough.
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm  # here, not at module import: it is slow to import and only the judge needs it

    response = litellm.completion(
        model=model,
        messages=judge_messages(inp, rubric),
        temperature=0,
        timeout=float(params.get("timeout_s", DEFAULT_TIMEOUT_S)),
        **options,
    )
    return parse_score(response.choices[0].message.content)
