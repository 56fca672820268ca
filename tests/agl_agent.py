"""Agents written as Agent Lightning 1.0's controller runs them (`config.local.agent_class`: it imports the
class and calls `run()` in a process of its own; exit 0 is success) -- a TEST FIXTURE, run by
tests/test_agl_controller.py under the real `agl-controller`, in Agent Lightning's own venv (Python 3.12,
httpx). As Agent Lightning's gsm8k agent does, it reads its question from the environment the controller
builds (`env_map`), asks the model through `AGL_OPENAI_BASE_URL` with `AGL_KEY`, and posts its reward to
`AGL_EVENT_URL`."""

from __future__ import annotations

import os

import httpx


class MathAgent:
    def run(self) -> None:
        headers = {"Authorization": f"Bearer {os.environ['AGL_KEY']}"}
        answer = httpx.post(
            os.environ["AGL_OPENAI_BASE_URL"] + "/chat/completions",
            headers=headers,
            json={
                "model": "auto",
                "messages": [{"role": "user", "content": os.environ["QUESTION"]}],
                "max_tokens": 8,
            },
            timeout=60,
        )
        answer.raise_for_status()
        text = answer.json()["choices"][0]["message"]["content"] or ""
        reward = 1.0 if text.strip() == os.environ["ANSWER"] else 0.0
        event = {"event_type": "reward", "data": {"value": reward}}
        httpx.post(os.environ["AGL_EVENT_URL"], headers=headers, json=event, timeout=60).raise_for_status()


class FailingAgent:
    def run(self) -> None:
        raise RuntimeError("this agent fails on purpose")
