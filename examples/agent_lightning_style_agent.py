"""An agent written the way Agent Lightning 1.x's example agents are (its gsm8k ChatAgent and
CompletionAgent): our own code, reading the same environment and posting the same event, so that it runs
against rlgate exactly as it would against Agent Lightning's server.

Environment (what Agent Lightning's controller sets, and what `POST /rollouts` returns as `agent_env`):
    AGL_OPENAI_BASE_URL  .../proxy/rollout/{rollout}/attempt/{attempt}/mode/{train|val}/openai/v1
    AGL_EVENT_URL        .../api/rollouts/{rollout}/attempt/{attempt}/events
    AGL_KEY              the key for both (Bearer)
    QUESTION, ANSWER     the task; the reward is 1 when the answer's text holds ANSWER
    AGENT_STYLE          chat (default) or completion: a prompt of token ids made with the tokenizer at
                         AGENT_TOKENIZER, and the answer decoded from the choice's `token_ids`, as Agent
                         Lightning's completion agents do
    AGENT_MAX_TOKENS     default 16
As those agents, it sends model "auto", lets any error end it with exit status 1, and reports the reward
itself with `raise_for_status()`.
"""

from __future__ import annotations

import json
import os

import httpx
from openai import OpenAI


def choice_token_ids(choice) -> list[int]:
    """The ids the server generated, as Agent Lightning's agents read them."""
    token_ids = getattr(choice, "token_ids", None)
    if token_ids is None and hasattr(choice, "model_extra"):
        token_ids = (choice.model_extra or {}).get("token_ids")
    if token_ids is None:
        raise ValueError("OpenAI response choice did not include token_ids")
    return token_ids


def main() -> None:
    key = os.environ.get("AGL_KEY", "")
    client = OpenAI(base_url=os.environ["AGL_OPENAI_BASE_URL"], api_key=key or "dummy", max_retries=6)
    question, answer = os.environ["QUESTION"], os.environ["ANSWER"]
    max_tokens = int(os.environ.get("AGENT_MAX_TOKENS", "16"))
    if os.environ.get("AGENT_STYLE", "chat") == "completion":
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(os.environ["AGENT_TOKENIZER"])
        prompt = tokenizer(question, add_special_tokens=False)["input_ids"]
        reply = client.completions.create(model="auto", prompt=prompt, temperature=1.0, max_tokens=max_tokens)
        text = tokenizer.decode(choice_token_ids(reply.choices[0]))
    else:
        reply = client.chat.completions.create(
            model="auto",
            messages=[{"role": "user", "content": question}],
            temperature=1.0,
            max_tokens=max_tokens,
        )
        text = reply.choices[0].message.content or ""
    reward = 1.0 if answer in text else 0.0
    httpx.post(
        os.environ["AGL_EVENT_URL"],
        json={"event_type": "reward", "data": {"value": reward}},
        headers={"Authorization": f"Bearer {key}"},
        timeout=10.0,
    ).raise_for_status()
    print(json.dumps({"answer": text, "reward": reward}))


if __name__ == "__main__":
    main()
