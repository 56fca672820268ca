"""vLLM 0.33.0's own code judges `rlgate serve` (and the fake vLLM): real HTTP to the real server process, every
answer and stream chunk validated and re-serialized by vLLM's pydantic models, the hermes tool parsing
compared with vLLM's parser on the same texts, bad requests compared with vLLM's routers and exception
handlers, and the sampler's processed logits compared with vLLM's top-k/top-p code.

vLLM runs in its own venv (`.venv-vllm`, which scripts/test creates; `RLGATE_VLLM_PYTHON` names another
python). Without it these tests FAIL, unless `RLGATE_SKIP_VLLM_ORACLE=1` says to skip them.
What the judge still finds different is listed in docs/vllm-wire-format.md ("Known differences").
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import random
import re
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import httpx
import pytest
from conftest import ROOT, Proc
from test_gateway_proxy import MESSAGES, TOOLS
from test_serve_responses import CALCULATOR, CALCULATOR_CALL

ORACLE_SCRIPT = ROOT / "tests" / "vllm_oracle.py"
TOOL_CALL_TOKEN = 259  # `<tool_call>` in the tiny model's tokenizer


# to start (importing vLLM and torch) or to answer one batch of cases; under pytest's timeout (300 s,
# pyproject.toml), so that a hung oracle fails with its own output rather than pytest's stack dump
ORACLE_TIMEOUT_S = 240


class Oracle:
    """One long-lived `tests/vllm_oracle.py` process under the oracle venv's python (`command` runs it).

    Answers come on a pipe of their own (its file descriptor is the command's last argument), so that
    nothing vLLM logs or prints can corrupt them; its stdout and stderr go to a temporary file that a
    failure shows. An oracle that does not answer within `timeout_s` is killed and fails the test.
    """

    def __init__(self, command: list[str], timeout_s: float = ORACLE_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self.output = tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace")
        read, write = os.pipe()
        try:
            self.process = subprocess.Popen(
                [*command, str(write)],
                stdin=subprocess.PIPE,
                stdout=self.output,
                stderr=subprocess.STDOUT,
                pass_fds=(write,),
                text=True,
                cwd=ROOT,
            )
        finally:
            os.close(write)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, args=(os.fdopen(read, encoding="utf-8"),), daemon=True).start()
        ready = self._answer("to start")
        if not (isinstance(ready, dict) and ready.get("ready")):
            self._fail(f"the vLLM oracle did not start: {ready!r}")

    def _read(self, answers: Any) -> None:
        with answers:
            for line in answers:
                self.lines.put(line)
        self.lines.put(None)  # the oracle closed its channel: it exited

    def _answer(self, what: str) -> Any:
        try:
            line = self.lines.get(timeout=self.timeout_s)
        except queue.Empty:
            self._fail(f"the vLLM oracle did not answer {what} within {self.timeout_s:g} s")
        if line is None:
            self._fail(
                f"the vLLM oracle exited (status {self.process.wait(timeout=30)}) instead of answering {what}"
            )
        return json.loads(line)

    def _fail(self, message: str) -> NoReturn:
        self.process.kill()
        self.process.wait(timeout=30)
        self.output.seek(0)
        pytest.fail(f"{message}; its output:\n{self.output.read()[-20000:]}", pytrace=False)

    def ask(self, cases: list[dict[str, Any]]) -> list[Any]:
        try:
            self.process.stdin.write(json.dumps(cases) + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            self._fail("the vLLM oracle is gone")
        return self._answer(f"{len(cases)} cases")

    def close(self) -> None:
        self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=30)
        self.output.close()


@pytest.fixture(scope="session")
def oracle_python() -> str:
    python = os.environ.get("RLGATE_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
    if not Path(python).is_file():
        message = (
            f"vLLM oracle python not found at {python}: run scripts/test (it creates .venv-vllm) or set "
            f"RLGATE_VLLM_PYTHON; RLGATE_SKIP_VLLM_ORACLE=1 skips these tests"
        )
        if os.environ.get("RLGATE_SKIP_VLLM_ORACLE") == "1":
            pytest.skip(message)
        pytest.fail(message)
    return python


@pytest.fixture(scope="session")
def oracle(oracle_python: str) -> Iterator[Oracle]:
    judge = Oracle([oracle_python, str(ORACLE_SCRIPT)])
    yield judge
    judge.close()


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's folder (its tokenizer is what vLLM's parser gets)."""
    from rlgate.inference.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("oracle_tokenizer") / "tiny", seed=0)


def post(proc: Proc, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{proc.url}{path}", json=body, timeout=120)


def sse(proc: Proc, path: str, body: dict) -> list[dict]:
    frames = []
    with httpx.stream("POST", f"{proc.url}{path}", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line:
                assert line.startswith("data: "), line
                data = line[len("data: ") :]
                frames.append(data if data == "[DONE]" else json.loads(data))
    assert frames[-1] == "[DONE]" and "[DONE]" not in frames[:-1]
    return frames[:-1]


def exact(value: Any) -> str:
    """Order-sensitive rendering: equal iff same keys, same key order, same values."""
    return json.dumps(value, ensure_ascii=False)


def judge_bodies(oracle: Oracle, model: str, bodies: list[dict]) -> None:
    """Each body validates as vLLM's `model`, has no key vLLM's models lack, and is what vLLM's own
    serialization of it gives (keys, their order, null-vs-absent)."""
    answers = oracle.ask([{"op": "validate", "model": model, "body": b} for b in bodies])
    for body, answer in zip(bodies, answers, strict=True):
        assert answer["ok"], f"{model} rejects {body}: {answer['error']}"
        assert answer["extra"] == [], f"keys vLLM does not have: {answer['extra']} in {body}"
        assert exact(answer["dump"]) == exact(body), f"vLLM serializes\n{answer['dump']}\nwe sent\n{body}"


def test_oracle_answers_survive_vllm_logging_to_stdout(oracle_python: str, tokenizer_dir: Path):
    """Configured as `vllm serve` configures it, vLLM logs to stdout; its hermes parser logs an ERROR with a
    traceback for an unparsable call. The answers still come back, and so does the log, in the output."""
    boot = (
        "import runpy, sys; from vllm.config.logging import LoggingConfig; from vllm.logger import "
        "configure_logging; configure_logging(LoggingConfig()); print('noise on stdout', flush=True); "
        f"runpy.run_path({str(ORACLE_SCRIPT)!r}, run_name='__main__')"
    )
    judge = Oracle([oracle_python, "-c", boot])
    try:
        request = {"model": "m", "messages": MESSAGES, "tools": TOOLS, "tool_choice": "auto"}
        text = '<tool_call>{"name": "calculator"}</tool_call>'
        [answer] = judge.ask(
            [
                {
                    "op": "parse",
                    "model_dir": str(tokenizer_dir),
                    "request": request,
                    "text": text,
                    "finish_reason": "stop",
                }
            ]
        )
        assert answer == {"content": text, "tool_calls": [], "finish_reason": "stop"}
        judge.output.seek(0)
        assert "Error in extracting tool call from response." in judge.output.read()
    finally:
        judge.close()


def test_a_hung_oracle_fails_with_its_output():
    """An oracle that stops answering fails the test within its timeout, showing what it wrote."""
    hang = (
        "import os, sys, time; out = os.fdopen(int(sys.argv[1]), 'w'); out.write('{\"ready\": true}\\n'); "
        "out.flush(); sys.stdin.readline(); print('stuck on a case', file=sys.stderr, flush=True); "
        "time.sleep(600)"
    )
    judge = Oracle([sys.executable, "-c", hang], timeout_s=3)
    with pytest.raises(
        pytest.fail.Exception, match=r"(?s)did not answer 1 cases within 3 s.*stuck on a case"
    ):
        judge.ask([{"op": "validate"}])
    assert judge.process.poll() is not None  # killed
    judge.close()
    silent = [
        sys.executable,
        "-c",
        "import sys, time; print('stuck importing', file=sys.stderr, flush=True); time.sleep(600)",
    ]
    with pytest.raises(
        pytest.fail.Exception, match=r"(?s)did not answer to start within 3 s.*stuck importing"
    ):
        Oracle(silent, timeout_s=3)


def test_scripts_test_checks_every_module_the_oracle_imports():
    """scripts/test reinstalls the oracle venv when its check fails: the check imports what the oracle does."""
    import ast

    def imported(source: str) -> set[str]:
        names = set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                names |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names.add(node.module)
        return names

    script = (ROOT / "scripts" / "test").read_text()
    check = re.search(r"oracle_ok\(\) \{.*?<<'PY'\n(.*?)\nPY\n", script, re.DOTALL)
    assert check, "scripts/test has no oracle_ok check"
    missing = imported(ORACLE_SCRIPT.read_text()) - imported(check.group(1)) - set(sys.stdlib_module_names)
    assert not missing, f"scripts/test's oracle_ok does not import {sorted(missing)}"


CHAT_CASES = [
    {"max_tokens": 6, "seed": 1},
    {"max_tokens": 5, "seed": 2, "logprobs": True, "top_logprobs": 3, "return_token_ids": True},
    {"max_tokens": 4, "seed": 3, "n": 2, "logprobs": True},
    {"max_tokens": 8, "seed": 4, "stop": ["e", "a"], "temperature": 0.7, "top_p": 0.9},
    {
        "max_tokens": 3,
        "seed": 5,
        "tools": TOOLS,
        "logit_bias": {str(TOOL_CALL_TOKEN): 100},
        "return_token_ids": True,
    },
    {"max_tokens": 3, "seed": 6, "tools": TOOLS, "tool_choice": "required"},
    {
        "max_tokens": 4,
        "seed": 7,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "calculator"}},
    },
    {"max_tokens": 5, "seed": 8, "temperature": 0, "logprobs": True, "top_logprobs": 2},
]
STREAM_OPTIONS = [None, {"include_usage": True}, {"include_usage": True, "continuous_usage_stats": True}]


def answers_and_chunks(proc: Proc, path: str, bodies: list[dict]) -> tuple[list[dict], list[dict]]:
    """Each body's answer, and the chunks of each streamed again (with STREAM_OPTIONS in turn)."""
    answers, chunks = [], []
    for i, body in enumerate(bodies):
        response = post(proc, path, body)
        assert response.status_code == 200, response.text
        answers.append(response.json())
        options = STREAM_OPTIONS[i % len(STREAM_OPTIONS)]
        chunks += sse(
            proc, path, {**body, "stream": True, **({"stream_options": options} if options else {})}
        )
    return answers, chunks


@pytest.mark.parametrize("upstream_name", ["rlgate_serve", "fake_vllm"])
def test_chat_answers_and_chunks_are_vllms(
    upstream_name: str, oracle: Oracle, request: pytest.FixtureRequest
):
    proc = request.getfixturevalue(upstream_name)
    bodies = [{"model": "fake-model", "messages": MESSAGES, **case} for case in CHAT_CASES]
    answers, chunks = answers_and_chunks(proc, "/chat/completions", bodies)
    judge_bodies(oracle, "ChatCompletionResponse", answers)
    judge_bodies(oracle, "ChatCompletionStreamResponse", chunks)
    assert len(chunks) > 3 * len(CHAT_CASES)


COMPLETION_CASES = [
    {"prompt": "Once", "max_tokens": 5, "seed": 1},
    {"prompt": "Once", "max_tokens": 5, "seed": 2, "logprobs": 2, "return_token_ids": True},
    {"prompt": ["Once", "Twice"], "max_tokens": 3, "seed": 3, "n": 2},
    {"prompt": "Echo", "max_tokens": 3, "seed": 4, "echo": True},
    {"prompt": "Echo", "max_tokens": 3, "seed": 5, "echo": True, "return_token_ids": True, "logprobs": 0},
    {"prompt": [72, 105], "max_tokens": 4, "seed": 6, "stop": "e"},
]


@pytest.mark.parametrize("upstream_name", ["rlgate_serve", "fake_vllm"])
def test_completion_answers_and_chunks_are_vllms(
    upstream_name: str, oracle: Oracle, request: pytest.FixtureRequest
):
    proc = request.getfixturevalue(upstream_name)
    bodies = [{"model": "fake-model", **case} for case in COMPLETION_CASES]
    answers, chunks = answers_and_chunks(proc, "/completions", bodies)
    judge_bodies(oracle, "CompletionResponse", answers)
    judge_bodies(oracle, "CompletionStreamResponse", chunks)


def test_completions_echo_streams_as_vllm(rlgate_serve: Proc, oracle: Oracle):
    """vLLM's completion_stream_generator: with `echo`, a choice's first chunk carries the prompt text before
    its first token's, and `prompt_token_ids` (with or without return_token_ids); every chunk is one of
    vLLM's CompletionStreamResponse as vLLM serializes it."""
    body = {"model": "fake-model", "prompt": "Echo", "max_tokens": 4, "seed": 9, "n": 2}
    plain = post(rlgate_serve, "/completions", {**body, "echo": True}).json()
    frames = sse(rlgate_serve, "/completions", {**body, "echo": True, "stream": True})
    for index in (0, 1):
        mine = [f["choices"][0] for f in frames if f["choices"][0]["index"] == index]
        assert mine[0]["text"].startswith("Echo")
        assert "".join(c["text"] for c in mine) == plain["choices"][index]["text"]
        assert mine[0]["prompt_token_ids"] == [69, 99, 104, 111]
        assert all(c["prompt_token_ids"] is None for c in mine[1:])
    with_ids = sse(
        rlgate_serve, "/completions", {**body, "echo": True, "stream": True, "return_token_ids": True}
    )
    first = [f["choices"][0] for f in with_ids if f["choices"][0]["index"] == 0]
    assert not first[0]["text"].startswith("Echo")  # return_token_ids drops the echoed text, as vLLM's
    assert first[0]["prompt_token_ids"] == [69, 99, 104, 111]
    judge_bodies(oracle, "CompletionResponse", [plain])
    judge_bodies(oracle, "CompletionStreamResponse", frames + with_ids)


# ------------------------------------------------------------------------------------------- hermes tool calls

HERMES_TEXTS = [
    'Let me compute.<tool_call>\n{"name": "calculator", "arguments": {"expression": "17+25"}}\n</tool_call>',
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17+25"}}\n</tool_call>',
    '\n\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "1"}}\n</tool_call>',
    '  <tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {"x": "é"}}',
    '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n<tool_call>{"name": "b", "arguments": [2]}'
    "</tool_call>",
    '<tool_call>{"name": "calculator"}</tool_call>',
    '<tool_call>{"name": "calculator"}',
    '<tool_call>{"name": "calculator"',  # cut by length as the name completes: vLLM adds arguments "{}"
    '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call><tool_call>{"name": "b"}',
    '<tool_call>{"name": 7, "arguments": {}}</tool_call>',
    '<tool_call>["calculator", {}]</tool_call>',
    '<tool_call>{"name": "a", "argu',
    '<tool_call>{"name": "a", "arguments": "plain string"}</tool_call>',
    '<tool_call>{"name": "a", "arguments": null}',
    "plain text",
    "",
    "   ",
    "ends with <tool",
    "<tool_call><tool_call>",
    'text <tool_call>{"name": "f", "arguments": {"k": "v"}}</tool_call> trailing',
]
TOOL_CHOICES = ["auto", "required", {"type": "function", "function": {"name": "calculator"}}, "none", None]


def hermes_pieces(text: str, rng: random.Random, eos: bool = True) -> list[str]:
    """Token texts: the tags as one token each (as the tiny tokenizer has them), the rest in 1-3 characters,
    then the EOS token's empty text (a `length` cut has none: its last token finishes the choice)."""
    pieces = []
    for part in re.split(r"(</?tool_call>)", text):
        if part in ("<tool_call>", "</tool_call>"):
            pieces.append(part)
            continue
        i = 0
        while i < len(part):
            step = rng.randint(1, 3)
            pieces.append(part[i : i + step])
            i += step
    return [*pieces, ""] if eos or not pieces else pieces


def no_ids(deltas: list[dict | None]) -> list[dict | None]:
    out = []
    for delta in deltas:
        if delta and delta.get("tool_calls"):
            delta = {
                **delta,
                "tool_calls": [{**c, "id": "ID"} if "id" in c else c for c in delta["tool_calls"]],
            }
        out.append(delta)
    return out


def test_hermes_matches_vllms_parser(oracle: Oracle, tokenizer_dir: Path):
    from rlgate.inference.tools import chat_fields, hermes_stream_deltas, keeps_tool_calls

    rng = random.Random(0)
    cases, mine = [], []
    for text, choice, finish in itertools.product(HERMES_TEXTS, TOOL_CHOICES, ["stop", "length"]):
        request = {"model": "m", "messages": MESSAGES, "tools": TOOLS, "tool_choice": choice}
        pieces = hermes_pieces(text, rng, eos=finish == "stop")
        cases.append(
            {
                "op": "parse",
                "model_dir": str(tokenizer_dir),
                "request": request,
                "text": text,
                "finish_reason": finish,
                "pieces": pieces,
            }
        )
        content, calls, finish_reason = chat_fields(text, choice, finish)
        if choice == "none":
            deltas = [{"content": p} if p else None for p in pieces]
            deltas[-1] = deltas[-1] or {}
        else:
            deltas = [
                d if d is not None or i < len(pieces) - 1 else {}
                for i, d in enumerate(hermes_stream_deltas(pieces, keeps_tool_calls(choice)))
            ]
        mine.append(
            {
                "content": content,
                "tool_calls": [{"name": c.name, "arguments": c.arguments} for c in calls],
                "finish_reason": finish_reason,
                "deltas": no_ids(deltas),
            }
        )
    answers = oracle.ask(cases)
    differences = []
    for case, ours, vllm in zip(cases, mine, answers, strict=True):
        theirs = {
            "content": vllm["content"],
            "tool_calls": vllm["tool_calls"],
            "finish_reason": vllm["finish_reason"],
            "deltas": no_ids(vllm["stream"]["deltas"]),
        }
        if exact(ours) != exact(theirs):
            differences.append(
                (case["text"], case["request"]["tool_choice"], case["finish_reason"], ours, theirs)
            )
    assert not differences, "\n".join(map(repr, differences[:5])) + f"\n... {len(differences)} differ"
    assert sum(bool(a["tool_calls"]) for a in answers) >= 20  # the corpus does exercise calls


def test_hermes_stream_finish_reason_is_vllms(oracle: Oracle, tokenizer_dir: Path):
    """The streamed finish reason: "tool_calls" once a call streamed (even one the whole text cannot parse)."""
    from rlgate.inference.tools import HermesStream

    rng = random.Random(1)
    cases, mine = [], []
    for text, choice in itertools.product(HERMES_TEXTS, TOOL_CHOICES[:3]):
        pieces = hermes_pieces(text, rng)
        cases.append(
            {
                "op": "parse",
                "model_dir": str(tokenizer_dir),
                "text": text,
                "finish_reason": "stop",
                "request": {"model": "m", "messages": MESSAGES, "tools": TOOLS, "tool_choice": choice},
                "pieces": pieces,
            }
        )
        stream = HermesStream()
        for i, piece in enumerate(pieces):
            stream.step(piece, i == len(pieces) - 1)
        mine.append("tool_calls" if stream.streamed and not isinstance(choice, dict) else "stop")
    theirs = [a["stream"]["finish_reason"] for a in oracle.ask(cases)]
    assert mine == theirs
    assert "tool_calls" in theirs and "stop" in theirs


# ------------------------------------------------------------------------------------------------- errors

BAD_CHAT = [
    {"model": "fake-model", "messages": MESSAGES, "tools": [], "tool_choice": "auto"},
    {"model": "fake-model", "messages": MESSAGES, "tools": []},
    {"model": "fake-model", "messages": MESSAGES, "tool_choice": "auto"},
    {"model": "fake-model", "messages": MESSAGES, "tools": TOOLS, "tool_choice": "sometimes"},
    {"model": "fake-model", "messages": MESSAGES, "tools": TOOLS, "tool_choice": {"type": "function"}},
    {
        "model": "fake-model",
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "other"}},
    },
    {
        "model": "fake-model",
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": 3}},
    },
    {"model": "fake-model", "messages": MESSAGES, "top_logprobs": 2},
    {"model": "fake-model", "messages": MESSAGES, "stream_options": {"include_usage": True}},
    {"model": "fake-model"},
    {"model": "fake-model", "messages": "hello"},
    {"model": "fake-model", "messages": MESSAGES, "max_tokens": "many"},
    {"model": "fake-model", "messages": MESSAGES, "logprobs": True, "top_logprobs": -3},
    {"model": "fake-model", "messages": MESSAGES, "temperature": "hot", "n": "two"},
    {"model": "fake-model", "messages": MESSAGES, "top_k": -2},
]
BAD_COMPLETION = [
    {"model": "fake-model", "prompt": "x", "stream_options": {"include_usage": True}},
    {"model": "fake-model"},
    {"model": "fake-model", "prompt": "x", "logprobs": -2},
    {"model": "fake-model", "prompt": "x", "echo": "yes please"},
    {"model": "fake-model", "prompt": ""},
    {"model": "fake-model", "prompt": "x", "top_k": -7},
]
BAD_RL = [
    ("/finish_weight_update", {"weight_version": 3}),
    ("/finish_weight_update", {"weight_version": ["v1"]}),
    ("/update_weight_version", {"new_version": 7}),
    ("/update_weight_version", {}),
]


def test_error_statuses_and_bodies_are_vllms(rlgate_serve: Proc, oracle: Oracle):
    base = rlgate_serve.url.removesuffix("/v1")
    requests = (
        [("/v1/chat/completions", b) for b in BAD_CHAT]
        + [("/v1/completions", b) for b in BAD_COMPLETION]
        + BAD_RL
    )
    raw = [
        ("/v1/chat/completions", '{"model": ', "application/json"),
        ("/v1/chat/completions", "[1, 2]", "application/json"),
        ("/v1/completions", "hi", "text/plain"),
    ]
    [vllm] = oracle.ask(
        [
            {
                "op": "http",
                "requests": [{"path": p, "json": b} for p, b in requests]
                + [{"path": p, "content": c, "headers": {"content-type": t}} for p, c, t in raw],
            }
        ]
    )
    ours = [httpx.post(f"{base}{p}", json=b, timeout=60) for p, b in requests]
    ours += [
        httpx.post(f"{base}{p}", content=c.encode(), headers={"content-type": t}, timeout=60)
        for p, c, t in raw
    ]
    labels = [f"{p} {b}" for p, b in requests] + [f"{p} {c!r} as {t}" for p, c, t in raw]
    differences = []
    for label, mine, theirs in zip(labels, ours, vllm, strict=True):
        assert theirs["status"] == 400, f"vLLM accepts {label}: the case is not a bad request"
        if mine.status_code != 400 or exact(mine.json()) != exact(theirs["body"]):
            differences.append(
                f"{label}\n  ours  {mine.status_code} {mine.text}\n  vLLM  400 {exact(theirs['body'])}"
            )
    assert not differences, "\n".join(differences)


# ------------------------------------------------------------------------------------- sampling: top-k/top-p


def test_processed_logits_match_vllms_sampler(oracle: Oracle):
    """`inference.engine.processed_logits` (bias, temperature, top-k, top-p) and the learner's own
    re-application of them (`learner.policy.processed_log_probs`: it recomputes the log-probs of the
    distribution the server sampled from) against vLLM's own `SamplingParams` (which raises small
    temperatures), `Sampler.apply_temperature` and `apply_top_k_top_p` on the same random logits."""
    import torch

    from learner.samples import Transition, build_samples, collate
    from learner.transitions import sampling_processing
    from rlgate.inference.engine import SamplingParams, processed_logits

    generator = torch.Generator().manual_seed(0)
    settings = [
        (1.0, 0, 1.0),
        (0.5, 0, 1.0),
        (0.7, 5, 1.0),
        (1.3, 0, 0.9),
        (0.8, 20, 0.5),
        (1.0, 3, 0.95),
        (0.2, 0, 0.3),
        (2.0, 1, 1.0),
        (0.001, 0, 1.0),
        (1e-45, 4, 0.9),
    ]  # the last two: raised to 0.01
    cases, mine = [], []
    for temperature, top_k, top_p in settings:
        logits = (torch.randn(64, generator=generator) * 3).tolist()
        bias = {"3": 2.5, "10": -4.0}
        cases.append(
            {
                "op": "process",
                "logits": logits,
                "temperature": temperature,
                "top_k": top_k,
                "top_p": top_p,
                "logit_bias": bias,
            }
        )
        params = SamplingParams(
            temperature=temperature, top_k=top_k, top_p=top_p, logit_bias={int(k): v for k, v in bias.items()}
        )
        mine.append(processed_logits(torch.tensor(logits), params))
    theirs_all = oracle.ask(cases)
    for ours, theirs, setting in zip(mine, theirs_all, settings, strict=True):
        theirs = torch.tensor([float("-inf") if v is None else v for v in theirs])
        assert torch.equal(torch.isinf(ours), torch.isinf(theirs)), f"kept tokens differ at {setting}"
        kept = ~torch.isinf(ours)
        assert torch.allclose(ours[kept], theirs[kept], atol=1e-5), setting

    # the learner: its processing read from the request as the agent sent it, its log-probs of the kept
    # tokens those of vLLM's processed logits (a one-token "completion": the most likely token)
    from learner.policy import processed_log_probs

    for case, theirs in zip(cases, theirs_all, strict=True):
        request = {k: case[k] for k in ("temperature", "top_k", "top_p", "logit_bias")}
        temperature, bias, top_k, top_p = sampling_processing(request, 1.0)
        theirs = torch.tensor([float("-inf") if v is None else v for v in theirs])
        for token in torch.nonzero(~torch.isinf(theirs)).flatten().tolist()[:5]:
            sample = build_samples(
                [[Transition("r", 0, (1,), (token,), (0.0,), 1.0, 0, temperature, bias, top_k, top_p)]]
            )
            logits = torch.tensor(case["logits"])[None, None].repeat(1, 2, 1)  # position 0 predicts the token
            got = processed_log_probs(logits, collate(sample, 0))[0][0, 0]
            want = torch.log_softmax(theirs, dim=-1)[token]
            assert abs(float(got) - float(want)) < 1e-4, (case["temperature"], top_k, top_p, token)


# ------------------------------------------------------------------------------------------- /v1/responses

RESPONSES_TOOLS = [CALCULATOR]
RESPONSES_CASES = [
    {"input": "What is 17 + 25?", "max_output_tokens": 6, "seed": 1},
    {
        "input": "What is 17 + 25?",
        "max_output_tokens": 5,
        "seed": 2,
        "include": ["message.output_text.logprobs"],
        "top_logprobs": 2,
        "enable_response_messages": True,
        "instructions": "You are terse.",
    },
    {
        "input": [
            {"role": "user", "content": "Hi"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
            {"role": "user", "content": [{"type": "input_text", "text": "Again"}]},
        ],
        "max_output_tokens": 4,
        "seed": 3,
        "temperature": 0.5,
        "top_p": 0.9,
        "include": [],
        "metadata": {"k": "v"},
        "user": "u1",
    },
    {
        "input": [
            {"role": "user", "content": "Weather?"},
            *CALCULATOR_CALL,
        ],
        "tools": RESPONSES_TOOLS,
        "max_output_tokens": 4,
        "seed": 4,
        "enable_response_messages": True,
    },
    # a hermes call that never parses (the random model writes only `<tool_call>`): its text stays content
    {
        "input": "Use the tool.",
        "tools": RESPONSES_TOOLS,
        "tool_choice": "required",
        "max_output_tokens": 3,
        "seed": 5,
        "logit_bias": {str(TOOL_CALL_TOKEN): 100},
        "include": ["message.output_text.logprobs"],
    },
    {
        "input": "Name a tool.",
        "tools": RESPONSES_TOOLS,
        "tool_choice": {"type": "function", "name": "calculator"},
        "max_output_tokens": 4,
        "seed": 6,
        "temperature": 0,
        "parallel_tool_calls": False,
        "reasoning": {"effort": "low"},
        "text": {"format": {"type": "text"}},
        "prompt_cache_key": "k",
    },
]


def responses_events(proc: Proc, body: dict) -> list[dict]:
    """A Responses stream as vLLM frames it: `event: TYPE` then `data: JSON` then a blank line, no [DONE]."""
    with httpx.stream("POST", f"{proc.url}/responses", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        raw = response.read().decode()
    blocks = raw.split("\n\n")
    assert blocks[-1] == "", raw[-200:]
    events = []
    for block in blocks[:-1]:
        event_line, data_line = block.split("\n")
        assert event_line.startswith("event: ") and data_line.startswith("data: "), block
        event = json.loads(data_line[len("data: ") :])
        assert event["type"] == event_line[len("event: ") :]
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def judge_events(oracle: Oracle, events: list[dict]) -> None:
    """Each event validates as openai's `ResponseStreamEvent` (those carrying a response also as vLLM's
    wrappers) and is what vLLM's serialization gives; the only key vLLM's types lack is the `name` vLLM
    itself adds to `function_call_arguments.done`."""
    answers = oracle.ask([{"op": "validate", "model": "ResponseStreamEvent", "body": e} for e in events])
    for event, answer in zip(events, answers, strict=True):
        assert answer["ok"], f"ResponseStreamEvent rejects {event}: {answer['error']}"
        allowed = [".name"] if event["type"] == "response.function_call_arguments.done" else []
        assert [k for k in answer["extra"] if k not in allowed] == [], (
            f"unknown keys {answer['extra']} in {event}"
        )
        assert exact(answer["dump"]) == exact(event), f"vLLM serializes\n{answer['dump']}\nwe sent\n{event}"


@pytest.mark.parametrize("upstream_name", ["rlgate_serve", "fake_vllm"])
def test_responses_bodies_and_events_are_vllms(
    upstream_name: str, oracle: Oracle, request: pytest.FixtureRequest
):
    proc = request.getfixturevalue(upstream_name)
    bodies, events = [], []
    # the fake vLLM answers text only and echoes tools as sent: it gets the cases without tools
    cases = (
        RESPONSES_CASES
        if upstream_name == "rlgate_serve"
        else [c for c in RESPONSES_CASES if "tools" not in c]
    )
    for case in cases:
        body = {"model": "fake-model", **case}
        response = post(proc, "/responses", body)
        assert response.status_code == 200, response.text
        bodies.append(response.json())
        events += responses_events(proc, {**body, "stream": True})
    judge_bodies(oracle, "ResponsesResponse", bodies)
    judge_events(oracle, events)
    types = {e["type"] for e in events}
    assert {
        "response.created",
        "response.in_progress",
        "response.output_text.delta",
        "response.content_part.done",
        "response.output_item.done",
    } <= types
    assert types & {"response.completed", "response.incomplete"}
    with_lps = [b for b in bodies if b["top_logprobs"] is not None]
    assert with_lps and all(p["logprobs"] for b in with_lps for i in b["output"] for p in i["content"])
    assert any(b["input_messages"] for b in bodies) and bodies[0]["input_messages"] is None


def test_responses_function_call_events_are_vllms(oracle: Oracle):
    """vLLM's own streaming-event emitters (streaming_events.py) give the reference shapes for a streamed
    function call; ours (rlgate.responses_items) are judged the same way as every other event."""
    from rlgate.responses_items import function_call

    item = function_call("fc_1", "chatcmpl-tool-1", "calculator", "", "in_progress")
    events = [
        {"item": item, "output_index": 1, "sequence_number": 8, "type": "response.output_item.added"},
        {
            "delta": '{"expression": "1"}',
            "item_id": "fc_1",
            "output_index": 1,
            "sequence_number": 9,
            "type": "response.function_call_arguments.delta",
        },
        {
            "arguments": '{"expression": "1"}',
            "item_id": "fc_1",
            "output_index": 1,
            "sequence_number": 10,
            "type": "response.function_call_arguments.done",
            "name": "calculator",
        },
        {
            "item": {**item, "arguments": '{"expression": "1"}', "status": "completed"},
            "output_index": 1,
            "sequence_number": 11,
            "type": "response.output_item.done",
        },
    ]
    judge_events(oracle, events)


BAD_RESPONSES = [
    {"model": "fake-model", "input": "x", "prompt": {"id": "p1"}},
    {"model": "fake-model", "input": "x", "background": True, "store": False},
    {"model": "fake-model", "input": "x", "tool_choice": "required"},
    {"model": "fake-model", "input": "x", "tool_choice": {"type": "function", "name": "calculator"}},
    {
        "model": "fake-model",
        "input": "x",
        "tools": RESPONSES_TOOLS,
        "tool_choice": {"type": "function", "name": "f"},
    },
    {"model": "fake-model", "input": "x", "include": ["message.output_text.everything"]},
    {"model": "fake-model"},
    {"model": "fake-model", "input": "x", "max_output_tokens": "many"},
    {"model": "fake-model", "input": "x", "top_k": -2},
    {"model": "fake-model", "input": "x", "presence_penalty": 3},
]
MISSING_RESPONSES = [  # accepted by vLLM's request model, refused by its serving code (store off)
    ({"model": "fake-model", "input": "x", "background": True}, 400),
    ({"model": "fake-model", "input": "x", "previous_response_id": "resp_0123"}, 404),
]


def test_responses_errors_are_vllms(rlgate_serve: Proc, oracle: Oracle):
    base = rlgate_serve.url.removesuffix("/v1")
    cases = [(b, 400) for b in BAD_RESPONSES] + MISSING_RESPONSES
    [vllm] = oracle.ask(
        [
            {
                "op": "http",
                "requests": [{"path": "/v1/responses", "json": b} for b, _ in cases]
                + [
                    {
                        "path": "/v1/responses",
                        "content": '{"input": ',
                        "headers": {"content-type": "application/json"},
                    }
                ],
            }
        ]
    )
    ours = [httpx.post(f"{base}/v1/responses", json=b, timeout=60) for b, _ in cases]
    ours.append(
        httpx.post(
            f"{base}/v1/responses",
            content=b'{"input": ',
            headers={"content-type": "application/json"},
            timeout=60,
        )
    )
    differences = []
    for (body, status), mine, theirs in zip([*cases, ("bad JSON", 400)], ours, vllm, strict=True):
        assert theirs["status"] == status, f"vLLM answers {theirs} to {body}"
        if mine.status_code != status or exact(mine.json()) != exact(theirs["body"]):
            differences.append(
                f"{body}\n  ours  {mine.status_code} {mine.text}\n  vLLM  {status} {exact(theirs['body'])}"
            )
    assert not differences, "\n".join(differences)


def _pruned(value: Any) -> Any:
    """Without null fields (vLLM's request model sets them; the gateway leaves them out, as unset)."""
    if isinstance(value, dict):
        return {k: _pruned(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_pruned(v) for v in value]
    return value


ANTHROPIC_TOOL = {
    "name": "calc",
    "description": "Adds.",
    "input_schema": {"properties": {"a": {"type": "integer"}}},
}
ANTHROPIC_REQUESTS = [
    {  # system blocks (Claude Code's billing header left out), sampling fields, stop strings, a stream
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=1"},
            {"type": "text", "text": "You are terse."},
            {"type": "text", "text": " Answer in digits."},
        ],
        "messages": [{"role": "user", "content": "2+3?"}],
        "stop_sequences": ["\n\n"],
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "stream": True,
    },
    {  # a tool turn: thinking, text and tool_use; tool results (string and blocks) before the user's text
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Add 2 and 3, then 4 and 5."}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Two calls.", "signature": "s"},
                    {"type": "text", "text": "Adding."},
                    {"type": "tool_use", "id": "toolu_1", "name": "calc", "input": {"a": 2, "b": [3, "x"]}},
                    {"type": "tool_use", "id": "toolu_2", "name": "calc", "input": {}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Here:"},
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "5"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_2",
                        "content": [{"type": "text", "text": "9"}],
                    },
                    {"type": "text", "text": "Go on."},
                ],
            },
        ],
        "tools": [ANTHROPIC_TOOL],
        "tool_choice": {"type": "any"},
    },
    {  # a named tool, no parallel calls; an inline system message; a tool result inside an assistant turn
        "messages": [
            {
                "role": "system",
                "content": [{"type": "text", "text": "Be exact."}, {"type": "text", "text": "!"}],
            },
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t", "content": None}]},
            {"role": "system", "content": ""},
        ],
        "tools": [ANTHROPIC_TOOL, {"name": "other", "input_schema": {"type": "object", "properties": {}}}],
        "tool_choice": {"type": "tool", "name": "calc", "disable_parallel_tool_use": True},
    },
    {  # thinking with a budget, structured output, vLLM's own extras
        "max_tokens": 3000,
        "messages": [{"role": "user", "content": "Plan."}],
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}, "effort": "low"},
        "cache_salt": "salt",
        "vllm_xargs": {"k": 1},
        "chat_template_kwargs": {"enable_thinking": True},
    },
    {
        "messages": [{"role": "user", "content": "none"}],
        "tools": [ANTHROPIC_TOOL],
        "tool_choice": {"type": "none"},
    },
]


@pytest.mark.parametrize("request_body", ANTHROPIC_REQUESTS, ids=range(len(ANTHROPIC_REQUESTS)))
def test_the_messages_api_is_translated_as_vllms_own_messages_api_translates_it(oracle: Oracle, request_body):
    """The chat completion the gateway makes of a Messages request (`gateway.messages.to_chat`) is the one
    vLLM 0.33's `/v1/messages` makes (its `to_chat_completion_request`): the same messages, tools (their
    schemas' keys in the same order: the template renders them so), tool choice and fields."""
    from gateway import messages

    body = {"model": "policy", "max_tokens": 64, **request_body}
    [theirs] = oracle.ask([{"op": "anthropic", "body": body}])
    assert theirs["ok"], theirs["error"]
    ours = messages.to_chat(body)
    assert _pruned(ours) == _pruned(theirs["chat"])
    for mine, vllms in zip(ours.get("tools", []), theirs["chat"].get("tools") or [], strict=True):
        assert list(mine["function"]["parameters"]) == list(vllms["function"]["parameters"])
