"""The dashboard (/ui) in a real headless browser against a running loop: the real gateway process (split
layout, operator token) in front of the fake vLLM, rollouts recorded by agent calls, rewards through the
reward routes, a learners' consumer group that took and acknowledged some episodes, and learner steps and
a policy pointer written through the store. The browser logs in, reads the numbers, clicks from the
overview to a rollout and back, and every number it reads is compared with the store's.

Needs Debian's chromium and chromium-driver (`apt-get install -y chromium chromium-driver`); skipped when
they are missing. Selenium drives that executable; nothing is downloaded.
"""

from __future__ import annotations

import asyncio
import math
import re
import shutil
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from conftest import REDIS_URL, ROOT, Proc, free_port, start_fake_vllm, start_gateway
from prometheus_client.parser import text_string_to_metric_families

from gateway.ui.html import num
from rlgate.episodes import ClosedEpisodes, EpisodeStore, IndexedCall, Policy

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.common.exceptions import StaleElementReferenceException  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    not (CHROMIUM and CHROMEDRIVER), reason="needs chromium and chromium-driver (apt-get install)"
)

OPERATOR = "dashboard-operator-token-5d1c9e7a"
API_KEY = "sk-dashboard-agent-key-0123456789"
MODEL = "fake-model"
XSS = '<script>window.__pwned=1</script><img src=x onerror="window.__pwned=2">'
# rollout index -> what happens to it
CLOSED = {0: 1.0, 1: 0.0, 3: 1.0, 4: 0.5, 6: 1.0, 7: 0.0}
FAILED = {2}
N_ROLLOUTS = 11  # plus the "xss" rollout, left open


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def with_store(prefix: str, job: Callable[[EpisodeStore], Any]) -> Any:
    store = EpisodeStore.from_url(REDIS_URL, prefix=prefix)
    try:
        return await job(store)
    finally:
        await store.aclose()


@dataclass
class Loop:
    gateway: Proc
    control: str
    prefix: str
    rollouts: list[str]
    steps: list[dict[str, Any]]
    acked: list[str] = field(default_factory=list)

    def store(self, job: Callable[[EpisodeStore], Any]) -> Any:
        return run(with_store(self.prefix, job))


def _wait(condition: Callable[[], Any], what: str, timeout_s: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _step(n: int) -> dict[str, Any]:
    """A learner step with the fields the learner writes (learner/loop.py), values known to the test."""
    return {
        "step": n,
        "time": time.time() - 60 * (6 - n),
        "policy_version": n,
        "episodes": 8 + n,
        "groups": 2,
        "reward_mean": 0.1 * n,
        "success_rate": 0.125 * n,
        # the episodes' serving versions: the previous one's (most) and this step's own
        "by_version": {str(n - 1): [6 + n, n, 0.5 * n], str(n): [2, 1, 0.25]},
        "val_episodes": 4 if n % 2 == 0 else 0,
        "val_by_version": {str(n - 1): [4, n // 2, 0.2 * n]} if n % 2 == 0 else {},
        "val_reward_mean": 0.2 * n if n % 2 == 0 else math.nan,
        "val_success_rate": 0.15 * n if n % 2 == 0 else math.nan,
        "group_reward_std": 0.3 + 0.01 * n,
        "loss": 1.0 / n,
        "policy_loss": 0.9 / n,
        "kl": 0.001 * n,
        "ppo_kl": 0.0005 * n,
        "rollout_kl": 0.0002,
        "clip_ratio": 0.01 * n,
        "entropy": 2.5 - 0.1 * n,
        "is_weight_mean": 1.0 + 0.001 * n,
        "is_weight_max": 1.2 + 0.01 * n,
        "is_outside": 0.0,
        "is_filter_ratio": 0.0,
        "logprob_gap": 0.002 * n,
        "dropped_stale": n % 3,
        "dropped_failed": 0,
        "push_seconds": 0.25 * n,
        "train_seconds": 1.5,
    }


def _chat(client: httpx.Client, agent_url: str, rid: str, messages: list, agent: str) -> None:
    answer = client.post(
        f"{agent_url}/rollouts/{rid}/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "max_tokens": 6, "logprobs": True},
        headers={"authorization": f"Bearer {API_KEY}", "x-agent-name": agent},
    )
    assert answer.status_code == 200, answer.text


@pytest.fixture(scope="module")
def loop(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Loop]:
    tmp = tmp_path_factory.mktemp("dashboard")
    prefix = f"dash{uuid.uuid4().hex[:8]}"
    upstream = start_fake_vllm(tmp)
    control_port = free_port()
    gateway = start_gateway(
        tmp,
        upstream.url,
        operator_token=OPERATOR,
        api_keys=API_KEY,
        control_port=str(control_port),
        key_prefix=prefix,
        policy_poll_s="0.2",
        record_token_text="true",
        wait_healthy=False,
    )
    control = f"http://127.0.0.1:{control_port}"
    operator = {"authorization": f"Bearer {OPERATOR}"}
    rollouts = [f"task{i % 3}-run{i}" for i in range(N_ROLLOUTS)] + ["xss"]
    try:
        with httpx.Client(timeout=30) as client:
            _wait(lambda: _ok(client, f"{control}/healthz"), "the gateway")
            run(with_store(prefix, lambda s: ClosedEpisodes(s).ensure_group()))
            for i, rid in enumerate(rollouts):
                body = {"rollout_id": rid, "task_id": f"task{i % 3}", "mode": "val" if i == 10 else "train"}
                assert client.post(f"{control}/rollouts", json=body, headers=operator).status_code == 201
                question = XSS if rid == "xss" else f"What is {i} + {i}?"
                agent = "<b>bold</b>" if rid == "xss" else ("solver", "critic")[i % 2]
                _chat(client, gateway.url, rid, [{"role": "user", "content": question}], agent)
            # the learner pushes version 2: calls from now on are served (and tagged) with it
            run(with_store(prefix, lambda s: s.set_policy(Policy(version=2))))
            _wait(
                lambda: client.get(f"{control}/healthz", headers=operator).json().get("policy_version") == 2,
                "the gateway to follow the policy pointer",
            )
            for i, rid in enumerate(rollouts[:N_ROLLOUTS]):
                call_id = f"call_{i}"
                messages = [
                    {"role": "user", "content": f"What is {i} + {i}?"},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {
                                "id": call_id,
                                "type": "function",
                                "function": {"name": "add", "arguments": f'{{"a": {i}, "b": {i}}}'},
                            }
                        ],
                    },
                    {"role": "tool", "tool_call_id": call_id, "content": str(2 * i)},
                ]
                _chat(client, gateway.url, rid, messages, ("solver", "critic")[i % 2])
            for i, rid in enumerate(rollouts):
                if i in CLOSED or i in FAILED:
                    answer = client.post(
                        f"{control}/rollouts/{rid}/calls/0/reward", json={"reward": 0.25}, headers=operator
                    )
                    assert answer.status_code == 200, answer.text
                if i in CLOSED:
                    answer = client.post(
                        f"{control}/rollouts/{rid}/reward", json={"reward": CLOSED[i]}, headers=operator
                    )
                    assert answer.status_code == 200, answer.text
                elif i in FAILED:
                    answer = client.post(
                        f"{control}/rollouts/{rid}/fail", json={"reason": "agent crashed"}, headers=operator
                    )
                    assert answer.status_code == 200, answer.text

        async def learn(store: EpisodeStore) -> list[str]:
            """A learner takes three closed episodes and acknowledges (trains on) two of them."""
            stream = ClosedEpisodes(store)
            taken = await stream.read("learner-0", count=3, block_ms=100)
            for entry in taken[:2]:
                assert await stream.ack(entry)
            for n in range(1, 7):
                await store.add_learner_step(_step(n))
            return [e.rollout_id for e in taken[:2]]

        acked = run(with_store(prefix, learn))
        steps = run(with_store(prefix, lambda s: s.learner_steps(100)))
        yield Loop(gateway, control, prefix, rollouts, steps, acked)
    finally:
        gateway.kill(signal.SIGTERM)
        upstream.kill(signal.SIGTERM)
        client = redis.Redis.from_url(REDIS_URL)
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        if keys:
            client.delete(*keys)
        client.close()


def _ok(client: httpx.Client, url: str) -> bool:
    try:
        return client.get(url).status_code == 200
    except httpx.TransportError:
        return False


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1400,1000",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def text(driver: Any, css: str) -> str:
    """An element's text, read in one script call (the live part of a page is replaced while it refreshes)."""
    value = driver.execute_script(
        "const e = document.querySelector(arguments[0]); return e && e.textContent;", css
    )
    assert value is not None, f"no {css} on {driver.current_url}"
    return value.strip()


def click(driver: Any, css: str) -> None:
    for _ in range(20):
        try:
            driver.find_element(By.CSS_SELECTOR, css).click()
            return
        except StaleElementReferenceException:  # the live part was replaced under the click: find it again
            time.sleep(0.1)
    raise AssertionError(f"could not click {css}")


def login(driver: Any, loop: Loop) -> None:
    driver.delete_all_cookies()
    driver.get(f"{loop.control}/ui")
    assert driver.current_url.startswith(f"{loop.control}/ui/login"), driver.current_url
    driver.find_element(By.ID, "token").send_keys(OPERATOR)
    driver.find_element(By.ID, "login").click()
    _wait(lambda: driver.current_url == f"{loop.control}/ui", "the overview after login")


def test_overview_numbers_and_a_click_to_a_rollout_and_back(loop: Loop, browser: Any):
    login(browser, loop)
    cookie = browser.get_cookie("rlgate_ui")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and OPERATOR not in cookie["value"]
    statuses = _check_overview_numbers(browser, loop)
    _check_overview_charts(browser, loop)

    # the page refreshes itself: a rollout started now appears without a reload
    new = f"late-{uuid.uuid4().hex[:6]}"
    with httpx.Client(timeout=30) as client:
        _chat(client, loop.gateway.url, new, [{"role": "user", "content": "hi"}], "solver")
    _wait(lambda: new in text(browser, "#recent"), "the overview to show the new rollout")
    assert text(browser, "#open") == str(statuses.count("open") + 1)
    assert browser.execute_script("return document.querySelector('#live').dataset.refreshed") is not None

    _check_overview_errors(browser, loop)

    # click from the overview to a rollout, and compare its page with the store's record
    rid = loop.rollouts[4]
    click(browser, f'#recent a[href="/ui/rollouts/{rid}"]')
    _wait(lambda: browser.current_url == f"{loop.control}/ui/rollouts/{rid}", "the rollout page")
    view = loop.store(lambda s: s.get_rollout_view(rid))
    assert text(browser, "#rollout-id") == rid
    assert text(browser, "#r-status") == view.status.value == "closed"
    assert text(browser, "#r-reward") == num(view.reward) == "0.5"
    assert text(browser, "#r-calls") == str(len(view.calls)) == "2"
    sections = browser.find_elements(By.CSS_SELECTOR, "section.call")
    assert [s.get_attribute("data-index") for s in sections] == ["0", "1"]
    for call in view.calls:
        _check_call_section(browser, call)
    assert [c.policy_version for c in view.calls] == [0, 2]
    assert [c.reward for c in view.calls] == [0.25, None]
    # the tool call and its result are shown
    assert "add" in text(browser, "#call-1 .request") and '"a": 4' in text(browser, "#call-1 .request")
    assert text(browser, "#call-1 .msg.role-tool pre") == "8"

    # and back: the browser's back button, then the navigation link
    browser.back()
    _wait(lambda: browser.current_url == f"{loop.control}/ui", "the overview again")
    assert text(browser, "#policy-version") == "2"
    click(browser, "#nav-rollouts")
    _wait(lambda: "/ui/rollouts" in browser.current_url, "the rollouts page")
    click(browser, "#nav-overview")
    _wait(lambda: browser.current_url == f"{loop.control}/ui", "the overview from the navigation")


def _check_overview_numbers(browser: Any, loop: Loop) -> list[str]:
    """The overview's counts against the store's records; returns the rollouts' statuses."""

    async def truth(store: EpisodeStore) -> dict[str, Any]:
        rows = [await store.get_rollout(rid) for rid in loop.rollouts]
        return {
            "status": {r.rollout_id: r.status.value for r in rows},
            "version": await store.policy_version(),
        }

    facts = loop.store(truth)
    statuses = list(facts["status"].values())
    assert statuses.count("open") == len(loop.rollouts) - len(CLOSED) - len(FAILED)
    assert text(browser, "#open") == str(statuses.count("open"))
    # closed, not yet trained: published (6 closed) minus the 2 the learner acknowledged
    assert statuses.count("consumed") == len(loop.acked) == 2
    assert text(browser, "#closed-waiting") == str(statuses.count("closed")) == "4"
    assert text(browser, "#policy-version") == str(facts["version"]) == "2"
    assert text(browser, "#indexed") == str(len(loop.rollouts))
    assert text(browser, "#reward-jobs") == "0"
    pushed = next(s for s in loop.steps if s["policy_version"] == 2)["time"]
    assert time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(pushed)) in text(browser, "#policy-version + small")
    assert re.fullmatch(r"\d+\.\d\d", text(browser, "#episodes-started-per-s"))
    return statuses


def _check_overview_charts(browser: Any, loop: Loop) -> None:
    """The charts: one point per policy version that served episodes, summed over the learner steps."""
    for chart, key in (("chart-success", "by_version"), ("chart-validation", "val_by_version")):
        sums: dict[int, list[float]] = {}
        for step in loop.steps:
            for version, row in step[key].items():
                sums[int(version)] = [
                    a + b for a, b in zip(sums.get(int(version), [0, 0, 0]), row, strict=True)
                ]
        expected = [f"success rate: {num(ok / n)} at {v}" for v, (n, ok, _) in sorted(sums.items())] + [
            f"mean reward: {num(total / n)} at {v}" for v, (n, _, total) in sorted(sums.items())
        ]
        points = browser.find_elements(By.CSS_SELECTOR, f"#{chart} circle title")
        assert [p.get_attribute("textContent") for p in points] == expected
        assert len(expected) == 2 * (7 if key == "by_version" else 3)


def _check_overview_errors(browser: Any, loop: Loop) -> None:
    """This gateway's errors by kind, as its own Prometheus counter says (read by prometheus_client's
    parser), after one more error."""
    with httpx.Client(timeout=30) as client:
        answer = client.post(
            f"{loop.gateway.url}/rollouts/err-{uuid.uuid4().hex[:6]}/v1/chat/completions",
            json={"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]},
            headers={"authorization": f"Bearer {API_KEY}"},
        )
        assert answer.status_code == 404, answer.text
        exposed = client.get(f"{loop.control}/metrics").text
    counted = {
        sample.labels["kind"]: int(sample.value)
        for family in text_string_to_metric_families(exposed)
        if family.name == "rlgate_gateway_errors"
        for sample in family.samples
        if sample.name.endswith("_total")
    }
    assert counted and all(counted.values())
    rows = (  # read in one script: the live part may be replaced between two element reads
        "return Array.from(document.querySelectorAll('#errors tr[data-kind]'))"
        ".map(r => [r.dataset.kind, r.querySelector('td.num').textContent])"
    )
    _wait(
        lambda: {kind: int(total) for kind, total in browser.execute_script(rows)} == counted,
        "the overview's error table to equal the gateway's counter",
    )


def _check_call_section(browser: Any, call: IndexedCall) -> None:
    """One call's section on a rollout page against the store's record of the call."""

    def fact(name: str) -> str:
        return text(browser, f'#call-{call.index} dd[data-fact="{name}"]')

    assert fact("policy version") == str(call.policy_version)
    assert fact("latency ms") == num(call.latency_ms)
    assert fact("agent") == call.agent_name == "solver"
    assert fact("reward") == num(call.reward)
    # the completion as the server's token text (RLGATE_RECORD_TOKEN_TEXT), each token's id kept
    tokens = browser.find_elements(By.CSS_SELECTOR, f"#call-{call.index} .tokens.text .t")
    assert [int(t.get_attribute("data-id")) for t in tokens] == call.completion_token_ids
    assert call.completion_token_texts and len(call.completion_token_texts) == len(tokens)
    assert [t.get_attribute("textContent") for t in tokens] == [
        tok.replace("\n", "↵\n") if tok else "∅" for tok in call.completion_token_texts
    ]
    expected = [f"lp{min(9, int(math.exp(lp) * 10))}" for lp in call.completion_logprobs]
    assert [t.get_attribute("class").split()[1] for t in tokens] == expected


def test_the_rollouts_listing_filters_as_the_store_says(loop: Loop, browser: Any):
    login(browser, loop)
    browser.get(f"{loop.control}/ui/rollouts?status=closed")
    shown = [
        r.get_attribute("data-rollout")
        for r in browser.find_elements(By.CSS_SELECTOR, "#rollouts tr[data-rollout]")
    ]
    listing = loop.store(lambda s: s.list_rollouts(status="closed", limit=50))
    assert shown == [r.rollout_id for r in listing.rollouts] and len(shown) == 4
    for row in listing.rollouts:
        cells = [
            c.text
            for c in browser.find_elements(
                By.CSS_SELECTOR, f'#rollouts tr[data-rollout="{row.rollout_id}"] td'
            )
        ]
        assert cells[1:4] == [row.task_id, "closed", row.mode]
        assert cells[5] == "0–2" and cells[6] == num(row.reward) and cells[7] == str(row.calls)
    # filters the store does not apply itself: the agent of the first call, the reward, the policy version
    browser.get(f"{loop.control}/ui/rollouts?agent=critic&min_reward=0.1")
    shown = {
        r.get_attribute("data-rollout")
        for r in browser.find_elements(By.CSS_SELECTOR, "#rollouts tr[data-rollout]")
    }
    expected = {loop.rollouts[i] for i, reward in CLOSED.items() if i % 2 == 1 and reward >= 0.1}
    assert shown == expected and len(expected) == 1
    browser.get(f"{loop.control}/ui/rollouts?limit=5")
    first = [
        r.get_attribute("data-rollout")
        for r in browser.find_elements(By.CSS_SELECTOR, "#rollouts tr[data-rollout]")
    ]
    click(browser, "#next-page")
    second = [
        r.get_attribute("data-rollout")
        for r in browser.find_elements(By.CSS_SELECTOR, "#rollouts tr[data-rollout]")
    ]
    everything = loop.store(lambda s: s.list_rollouts(limit=10))
    assert first + second == [r.rollout_id for r in everything.rollouts]


def test_the_training_page_shows_the_learner_steps(loop: Loop, browser: Any):
    login(browser, loop)
    browser.get(f"{loop.control}/ui/training")
    rows = browser.find_elements(By.CSS_SELECTOR, "#steps tr[data-step]")
    assert [int(r.get_attribute("data-step")) for r in rows] == [s["step"] for s in reversed(loop.steps)]
    for row, step in zip(rows, reversed(loop.steps), strict=True):
        for cell in row.find_elements(By.CSS_SELECTOR, "td[data-key]"):
            assert cell.text == num(step.get(cell.get_attribute("data-key"))), cell.get_attribute("data-key")
    for chart in ("loss", "kl", "clip-fraction", "entropy", "importance-weights", "push-time--s-"):
        assert browser.find_elements(By.CSS_SELECTOR, f"#chart-{chart} polyline"), chart


def test_agent_text_is_shown_as_text(loop: Loop, browser: Any):
    login(browser, loop)
    browser.get(f"{loop.control}/ui/rollouts/xss")
    assert text(browser, "#call-0 .request pre") == XSS
    assert "<b>bold</b>" in text(browser, "#call-0 dl.facts")
    assert browser.execute_script("return window.__pwned") is None
    assert not browser.find_elements(By.CSS_SELECTOR, "main img, main b, main script")
    browser.get(f"{loop.control}/ui")
    assert browser.execute_script("return window.__pwned") is None


def test_a_large_call_is_cut_on_its_page(loop: Loop):
    """A message of 300,000 characters (too long for the model: the upstream's 400 is recorded as a failed
    call): the page shows the first 4,000, says how many more there are, and shows the error."""
    rid = f"big-{uuid.uuid4().hex[:6]}"
    big = "x" * 300_000
    with httpx.Client(timeout=60) as client:
        answer = client.post(
            f"{loop.gateway.url}/rollouts/{rid}/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": big}], "max_tokens": 6},
            headers={"authorization": f"Bearer {API_KEY}"},
        )
        assert answer.status_code == 400, answer.text
        page = client.get(
            f"{loop.control}/ui/rollouts/{rid}", headers={"authorization": f"Bearer {OPERATOR}"}
        )
    assert page.status_code == 200
    assert "x" * 4000 + "<em> … 296000 more characters</em>" in page.text
    assert len(page.content) < 60_000
    view = loop.store(lambda s: s.get_rollout_view(rid))
    error = view.calls[0].error
    assert error is not None and f"error {error.status} {error.type}" in page.text


def test_screenshots(loop: Loop, browser: Any, tmp_path: Path):
    """The three pages as PNGs, for the README (docs/) and in the test's tmp dir."""
    login(browser, loop)
    pages = {
        "overview": "/ui",
        "rollout": f"/ui/rollouts/{loop.rollouts[4]}",
        "training": "/ui/training",
    }
    for name, path in pages.items():
        browser.get(loop.control + path)
        _wait(lambda: browser.execute_script("return document.readyState") == "complete", "the page")
        png = browser.get_screenshot_as_png()
        assert png.startswith(b"\x89PNG") and len(png) > 10_000
        (tmp_path / f"dashboard_{name}.png").write_bytes(png)
        (ROOT / "docs" / f"dashboard_{name}.png").write_bytes(png)


def test_who_may_see_the_dashboard(loop: Loop):
    ui = f"{loop.control}/ui"
    with httpx.Client(timeout=30, follow_redirects=False) as client:
        answer = client.get(f"{ui}/rollouts?status=closed")
        assert answer.status_code == 303 and answer.headers["location"].startswith("/ui/login?next=")
        assert client.get(f"{ui}?fragment=1").status_code == 401
        assert client.get(ui, headers={"cookie": "rlgate_ui=9999999999.00ff"}).status_code == 303
        for header in (f"Bearer {API_KEY}",):  # an agent credential is refused as on every operator route
            assert client.get(ui, headers={"authorization": header}).status_code == 403
        assert client.get(ui, headers={"authorization": "Bearer not-the-token-at-all"}).status_code == 401
        assert client.post(f"{ui}/login", data={"token": "wrong-token-wrong-token"}).status_code == 401
        assert client.post(f"{ui}/login", content="a=1&b=2&c=3&d=4&e=5").status_code == 400
        # a form posted from another site (login CSRF, logging the operator out) is refused
        host = loop.control.removeprefix("http://")
        for headers in (
            {"origin": "http://evil.example"},
            {"origin": "null", "sec-fetch-site": "cross-site"},  # a sandboxed frame elsewhere
            {"sec-fetch-site": "cross-site"},
            {"sec-fetch-site": "same-site", "origin": f"http://{host}"},
        ):
            for route in ("login", "logout"):
                answer = client.post(f"{ui}/{route}", data={"token": OPERATOR}, headers=headers)
                assert answer.status_code == 403 and "set-cookie" not in answer.headers, (route, headers)
        same = {"origin": f"http://{host}", "sec-fetch-site": "same-origin"}
        assert client.post(f"{ui}/logout", headers=same).status_code == 303
        # ?token= sets the cookie and sends the browser on without the token in its address
        answer = client.get(f"{ui}/rollouts", params={"token": OPERATOR, "status": "open"})
        assert answer.status_code == 303 and answer.headers["location"] == "/ui/rollouts?status=open"
        set_cookie = answer.headers["set-cookie"]
        assert "HttpOnly" in set_cookie and "SameSite=Strict" in set_cookie and OPERATOR not in set_cookie
        assert "Secure" not in set_cookie  # plain http here: a Secure cookie would never come back
        behind_tls = client.get(
            f"{ui}/rollouts", params={"token": OPERATOR}, headers={"x-forwarded-proto": "https"}
        )  # a TLS-terminating proxy in front: the browser speaks https
        assert "; Secure" in behind_tls.headers["set-cookie"]
        forwarded = client.get(
            f"{ui}/rollouts", params={"token": OPERATOR}, headers={"forwarded": "for=1.2.3.4;proto=https"}
        )
        assert "; Secure" in forwarded.headers["set-cookie"]
        cookie = answer.headers["set-cookie"].split(";")[0]
        page = client.get(f"{ui}/rollouts?status=open", headers={"cookie": cookie})
        assert page.status_code == 200 and "default-src 'none'" in page.headers["content-security-policy"]
        operator = {"authorization": f"Bearer {OPERATOR}"}
        assert client.get(ui, headers=operator).status_code == 200
        # bad input is a 4xx page, never a 500
        for path, status in (
            ("/rollouts?status=bogus", 400),
            ("/rollouts?min_reward=lots", 400),
            ("/rollouts?limit=100000", 400),
            ("/rollouts?cursor=nonsense", 400),
            ("/rollouts/no%20such", 400),
            ("/rollouts/missing-rollout", 404),
            ("/rollouts/xss?limit=0", 400),
            ("/training?steps=-1", 400),
            ("/static/../../etc/passwd", 404),
        ):
            assert client.get(ui + path, headers=operator).status_code == status, path
        # the agent port has no dashboard, and the API document does not list it
        assert client.get(f"{loop.gateway.url}/ui", headers=operator).status_code == 404
        assert not [
            p
            for p in client.get(f"{loop.control}/openapi.json", headers=operator).json()["paths"]
            if p.startswith("/ui")
        ]
    assert OPERATOR not in loop.gateway.log()


def test_an_open_gateway_serves_the_dashboard(gateway: Proc):
    """Without an operator token (the development mode) the dashboard is open, as the other operator
    routes are."""
    answer = httpx.get(f"{gateway.url}/ui", timeout=30)
    assert answer.status_code == 200 and 'id="policy-version"' in answer.text
    assert httpx.get(f"{gateway.url}/ui/login", timeout=30).status_code == 303
