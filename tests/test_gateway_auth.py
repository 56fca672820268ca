"""The trust boundary, tried as an agent under training would try it: two kinds of credential that never
open each other's surface, rollout keys that open one rollout alone, and a control port that keeps the
operator surface off the agent's port. Every refusal is a 4xx in the OpenAI error shape, and nothing is
recorded, created or changed; a refused completion never reaches the upstream."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import redis
from conftest import REDIS_URL, Proc, free_port, rlgate, start_gateway
from test_gateway_errors import assert_openai_error
from test_gateway_proxy import MESSAGES, MODEL

from reward_hooks.client import post_reward

OPERATOR = "op-" + "5e" * 16
API_KEY = "agent-key-" + "7a" * 8
ROLLOUT_SECRET = "rks-" + "c3" * 16
WEBHOOK_SECRET = "whsec-" + "9d" * 16
CHAT = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4}


class CountingUpstream:
    """A real HTTP hop in front of the fake vLLM that counts the completion requests reaching it."""

    def __init__(self, target: str) -> None:
        self.posts = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _forward(self, method: str) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                if method == "POST":
                    outer.posts += 1
                answer = httpx.request(
                    method,
                    target + self.path.removeprefix("/v1"),
                    content=body or None,
                    headers={"content-type": "application/json"},
                    timeout=30,
                )
                self.send_response(answer.status_code)
                self.send_header("content-type", answer.headers.get("content-type", "application/json"))
                self.send_header("content-length", str(len(answer.content)))
                self.end_headers()
                self.wfile.write(answer.content)

            def do_GET(self) -> None:
                self._forward("GET")

            def do_POST(self) -> None:
                self._forward("POST")

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def counting(fake_vllm: Proc) -> Iterator[CountingUpstream]:
    upstream = CountingUpstream(fake_vllm.url)
    yield upstream
    upstream.close()


def start_keyed_gateway(tmp_path, counting: CountingUpstream, **settings: str) -> Proc:
    """A gateway in front of `counting` with both credentials (the operator token, the agents' API key) and
    rollout keys signed with ROLLOUT_SECRET; `settings` on top."""
    return start_gateway(
        tmp_path,
        counting.url,
        operator_token=OPERATOR,
        api_keys=API_KEY,
        rollout_key_secret=ROLLOUT_SECRET,
        **settings,
    )


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def create(gateway_url: str, rollout_id: str, task_id: str | None = None) -> dict:
    response = httpx.post(
        f"{gateway_url}/rollouts",
        json={"rollout_id": rollout_id, "task_id": task_id},
        headers=bearer(OPERATOR),
    )
    assert response.status_code == 201, response.text
    return response.json()


def read(gateway_url: str, rollout_id: str) -> dict:
    response = httpx.get(f"{gateway_url}/rollouts/{rollout_id}", headers=bearer(OPERATOR))
    assert response.status_code == 200, response.text
    return response.json()


def rollout_keys(client: redis.Redis) -> list[bytes]:
    return sorted(client.keys("rlgate:rollout:*"))


def operator_requests(rid: str) -> list[tuple[str, str, dict | None]]:
    """Every kind of operator route, aimed at rollout `rid`."""
    return [
        ("GET", f"/rollouts/{rid}", None),
        ("POST", "/rollouts", {"rollout_id": "squatted", "task_id": "wrong-task"}),
        ("POST", f"/rollouts/{rid}/reward", {"reward": 1.0}),
        ("POST", f"/rollouts/{rid}/calls/0/reward", {"reward": 1.0}),
        ("POST", f"/rollouts/{rid}/finish", {"reward_fn": "exact_match", "ground_truth": "42"}),
        ("POST", f"/rollouts/{rid}/fail", {"reason": "sabotage"}),
        ("GET", "/metrics", None),
        ("GET", "/openapi.json", None),
    ]


def test_operator_surface_needs_the_operator_token(counting: CountingUpstream, tmp_path, redis_client):
    proc = start_keyed_gateway(tmp_path, counting, webhook_secret=WEBHOOK_SECRET)
    try:
        created = create(proc.url, "r-a", "task-a")
        key_a = created["api_key"]
        assert key_a.startswith("rk-r-a.")
        assert created["base_url"] == f"{proc.url}/tasks/task-a/rollouts/r-a/v1"
        ok = httpx.post(f"{created['base_url']}/chat/completions", json=CHAT, headers=bearer(key_a))
        assert ok.status_code == 200, ok.text
        before = {k: redis_client.dump(k) for k in rollout_keys(redis_client)}
        attempts = {
            "no credential": {},
            "a wrong token": bearer("not-the-operator-token-at-all"),
            "an agent API key": bearer(API_KEY),
            "the rollout's own key": bearer(key_a),
            "a basic header": {"Authorization": "Basic " + OPERATOR},
        }
        for who, headers in attempts.items():
            for method, path, body in operator_requests("r-a"):
                response = httpx.request(method, proc.url + path, json=body, headers=headers)
                status = 403 if who in ("an agent API key", "the rollout's own key") else 401
                error = assert_openai_error(response, status)
                if status == 403:
                    assert error["code"] == "wrong_credential", (who, path)
        # nothing was created, read into being, rewarded or queued
        assert {k: redis_client.dump(k) for k in rollout_keys(redis_client)} == before
        assert redis_client.keys("rq:*") == [] and redis_client.xlen("rlgate:episodes") == 0
        assert read(proc.url, "r-a")["status"] == "open"
        # /healthz tells an anonymous caller only that the process is up; the operator gets the checks
        assert httpx.get(f"{proc.url}/healthz").json() == {"status": "ok"}
        assert httpx.get(f"{proc.url}/healthz", headers=bearer(OPERATOR)).json()["redis"] == "ok"
        assert "rlgate_gateway_calls" in httpx.get(f"{proc.url}/metrics", headers=bearer(OPERATOR)).text
        assert httpx.get(f"{proc.url}/openapi.json", headers=bearer(OPERATOR)).status_code == 200
        # reward routes: the operator token, or a valid signature instead, each on its own
        answer = httpx.post(
            f"{proc.url}/rollouts/r-a/calls/0/reward", json={"reward": 0.5}, headers=bearer(OPERATOR)
        )
        assert answer.status_code == 200, answer.text
        assert post_reward(proc.url, "r-a", 1.0, secret=WEBHOOK_SECRET)["outcome"] == "closed"
        assert read(proc.url, "r-a")["reward"] == 1.0
    finally:
        proc.kill()
    log = proc.log()
    assert '"event":"call"' in log
    for secret in (OPERATOR, ROLLOUT_SECRET, WEBHOOK_SECRET, API_KEY, key_a):
        assert secret not in log


def test_agent_surface_refuses_the_operator_token_and_other_rollouts_keys(
    counting: CountingUpstream, tmp_path, redis_client
):
    proc = start_keyed_gateway(tmp_path, counting)
    try:
        key_a = create(proc.url, "r-a")["api_key"]
        create(proc.url, "r-b", "task-b")
        keys_before = rollout_keys(redis_client)
        refused = [
            ("/rollouts/r-b/v1/chat/completions", bearer(OPERATOR), 403),
            ("/rollouts/r-b/v1/models", bearer(OPERATOR), 403),
            ("/v1/chat/completions", {**bearer(OPERATOR), "X-Rollout-Id": "r-b"}, 403),
            ("/rollouts/r-b/v1/chat/completions", bearer(key_a), 403),
            ("/rollouts/r-b/v1/completions", bearer(key_a), 403),
            ("/rollouts/r-b/v1/responses", bearer(key_a), 403),
            ("/tasks/task-b/rollouts/r-b/v1/chat/completions", bearer(key_a), 403),
            ("/v1/chat/completions", {**bearer(key_a), "X-Rollout-Id": "r-b"}, 403),
            ("/rollouts/r-b/v1/models", bearer(key_a), 403),
            ("/rollouts/r-b/v1/chat/completions", bearer("rk-r-b." + "0" * 64), 401),  # forged
            ("/rollouts/r-b/v1/chat/completions", bearer(key_a.replace("rk-r-a.", "rk-r-b.")), 401),
            ("/rollouts/r-b/v1/chat/completions", {}, 401),
            ("/rollouts/r-b/v1/chat/completions", bearer("agent-key-guess"), 401),
        ]
        for path, headers, status in refused:
            method = "GET" if path.endswith("/models") else "POST"
            response = httpx.request(
                method, proc.url + path, json=None if method == "GET" else CHAT, headers=headers
            )
            error = assert_openai_error(response, status)
            if status == 403:
                assert error["code"] in ("wrong_credential", "rollout_key_mismatch"), (path, error)
        assert counting.posts == 0  # the upstream never saw a refused call
        assert read(proc.url, "r-b")["calls"] == [] and rollout_keys(redis_client) == keys_before
        # the right credentials do work: the rollout's key on its rollout, an API key on any
        assert (
            httpx.post(
                f"{proc.url}/rollouts/r-a/v1/chat/completions", json=CHAT, headers=bearer(key_a)
            ).status_code
            == 200
        )
        assert (
            httpx.post(
                f"{proc.url}/rollouts/r-b/v1/chat/completions", json=CHAT, headers=bearer(API_KEY)
            ).status_code
            == 200
        )
        assert counting.posts == 2
        assert len(read(proc.url, "r-a")["calls"]) == 1 and len(read(proc.url, "r-b")["calls"]) == 1
        # without a webhook secret, the reward routes take the operator token alone
        for headers in ({}, bearer(key_a)):
            response = httpx.post(f"{proc.url}/rollouts/r-a/reward", json={"reward": 1}, headers=headers)
            assert_openai_error(response, 403 if headers else 401)
        assert read(proc.url, "r-a")["status"] == "open"
        assert (
            httpx.post(
                f"{proc.url}/rollouts/r-a/reward", json={"reward": 1}, headers=bearer(OPERATOR)
            ).json()["outcome"]
            == "closed"
        )
    finally:
        proc.kill()


def test_required_rollout_keys(counting: CountingUpstream, tmp_path, redis_client):
    proc = start_keyed_gateway(tmp_path, counting, require_rollout_keys="true")
    try:
        key_a = create(proc.url, "r-a")["api_key"]
        create(proc.url, "r-b")
        for headers in (bearer(API_KEY), {}, bearer(OPERATOR)):
            response = httpx.post(f"{proc.url}/rollouts/r-b/v1/chat/completions", json=CHAT, headers=headers)
            assert_openai_error(response, 403 if headers == bearer(OPERATOR) else 401)
        error = assert_openai_error(
            httpx.post(f"{proc.url}/rollouts/r-b/v1/chat/completions", json=CHAT, headers=bearer(API_KEY)),
            401,
        )
        assert error["code"] == "rollout_key_required"
        error = assert_openai_error(
            httpx.post(f"{proc.url}/rollouts/r-b/v1/chat/completions", json=CHAT, headers=bearer(key_a)), 403
        )
        assert error["code"] == "rollout_key_mismatch"
        assert counting.posts == 0 and read(proc.url, "r-b")["calls"] == []
        # a call that names no rollout goes to its key's rollout
        for path in ("/rollouts/r-a/v1/chat/completions", "/v1/chat/completions"):
            response = httpx.post(proc.url + path, json=CHAT, headers=bearer(key_a))
            assert response.status_code == 200 and response.headers["x-rollout-id"] == "r-a"
        assert len(read(proc.url, "r-a")["calls"]) == 2 and counting.posts == 2
    finally:
        proc.kill()


def test_control_port_keeps_the_operator_surface_off_the_agent_port(
    counting: CountingUpstream, tmp_path, redis_client
):
    control_port = free_port()
    proc = start_gateway(
        tmp_path,
        counting.url,
        operator_token=OPERATOR,
        api_keys=API_KEY,
        webhook_secret=WEBHOOK_SECRET,
        control_port=str(control_port),
    )
    control = f"http://127.0.0.1:{control_port}"
    try:
        unknown = httpx.get(f"{proc.url}/nothing/here").json()
        for method, path, body in [*operator_requests("r-a"), ("GET", "/docs", None)]:
            for headers in ({}, bearer(OPERATOR), bearer(API_KEY)):
                response = httpx.request(method, proc.url + path, json=body, headers=headers)
                error = assert_openai_error(response, 404)
                # told apart from an unknown path by nothing but the path in the message
                assert {**error, "message": None} == {**unknown["error"], "message": None}
        assert httpx.get(f"{proc.url}/healthz").json() == {"status": "ok"}
        # the control port: health and metrics open, the rest behind the operator token, no agent surface
        assert httpx.get(f"{control}/healthz").json()["redis"] == "ok"
        assert "rlgate_gateway_calls" in httpx.get(f"{control}/metrics").text
        agent_path = httpx.post(f"{control}/v1/chat/completions", json=CHAT, headers=bearer(API_KEY))
        assert_openai_error(agent_path, 404)
        assert_openai_error(httpx.post(f"{control}/rollouts", json={"rollout_id": "r-a"}), 401)
        agent_key = httpx.post(f"{control}/rollouts", json={"rollout_id": "r-a"}, headers=bearer(API_KEY))
        assert_openai_error(agent_key, 403)
        assert rollout_keys(redis_client) == [] and counting.posts == 0
        created = create(control, "r-a")
        assert created["base_url"] == f"{proc.url}/rollouts/r-a/v1"  # the agent port, not the control port
        agent = httpx.post(f"{created['base_url']}/chat/completions", json=CHAT, headers=bearer(API_KEY))
        assert agent.status_code == 200 and counting.posts == 1
        assert post_reward(control, "r-a", 1.0, secret=WEBHOOK_SECRET)["outcome"] == "closed"
        stored = read(control, "r-a")
        assert stored["status"] == "closed" and len(stored["calls"]) == 1
        proc.kill(signal.SIGTERM)  # both listeners drain and the process exits cleanly
        assert proc.process.returncode == 0
        for url in (proc.url, control):
            with pytest.raises(httpx.TransportError):
                httpx.get(f"{url}/healthz")
    finally:
        proc.kill()


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"api_keys": API_KEY}, "operator surface would be open"),
        ({"require_rollout_keys": "true", "operator_token": OPERATOR}, "needs rollout_key_secret"),
        ({"api_keys": f"{API_KEY},{OPERATOR}", "operator_token": OPERATOR}, "must differ"),
        ({"operator_token": "short"}, "at least 16 characters"),
        (
            {"api_keys": "rk-looks-like-a-rollout-key", "operator_token": OPERATOR},
            "must not start with 'rk-'",
        ),
    ],
)
def test_unsafe_layouts_refuse_to_start(settings: dict[str, str], message: str, tmp_path):
    port = free_port()
    env = {
        **os.environ,
        "RLGATE_REDIS_URL": REDIS_URL,
        "RLGATE_PORT": str(port),
        **{f"RLGATE_{k.upper()}": v for k, v in settings.items()},
    }
    done = rlgate("gateway", env=env, timeout=60)
    assert done.returncode != 0
    assert message in done.stdout + done.stderr
    assert OPERATOR not in done.stdout + done.stderr


def test_a_rollout_key_never_recreates_a_rollout_redis_lost(
    counting: CountingUpstream, tmp_path, redis_client
):
    """Only POST /rollouts hands out rollout keys, so a call with one continues a rollout that exists: when
    Redis lost it, every gateway process (not only the one that recorded it) answers 409 rollout_data_lost
    and recreates nothing."""
    settings = dict(operator_token=OPERATOR, rollout_key_secret=ROLLOUT_SECRET, require_rollout_keys="true")
    first = start_gateway(tmp_path, counting.url, **settings)
    second = None
    try:
        key = create(first.url, "r-lost")["api_key"]
        assert (
            httpx.post(f"{first.url}/v1/chat/completions", json=CHAT, headers=bearer(key)).status_code == 200
        )
        redis_client.delete("rlgate:rollout:{r-lost}", "rlgate:rollout:{r-lost}:calls")  # lost
        second = start_gateway(tmp_path, counting.url, **settings)  # never saw r-lost
        posts = counting.posts
        for proc in (second, first):
            url = f"{proc.url}/rollouts/r-lost/v1/chat/completions"
            response = httpx.post(url, json=CHAT, headers=bearer(key))
            assert assert_openai_error(response, 409)["code"] == "rollout_data_lost"
            # a stream learns it at its end, in place of [DONE] (checked when the call is recorded)
            with httpx.stream("POST", url, json={**CHAT, "stream": True}, headers=bearer(key)) as stream:
                lines = [line for line in stream.iter_lines() if line.startswith("data:")]
            assert "data: [DONE]" not in lines and "no longer in Redis" in lines[-1]
        assert not redis_client.exists("rlgate:rollout:{r-lost}", "rlgate:rollout:{r-lost}:calls")
        assert counting.posts - posts <= 4  # the upstream may have answered; nothing was kept
        key_b = create(second.url, "r-new")["api_key"]
        assert (
            httpx.post(f"{second.url}/v1/chat/completions", json=CHAT, headers=bearer(key_b)).status_code
            == 200
        )
    finally:
        first.kill()
        if second is not None:
            second.kill()
