"""The Calc-X task generated in code (`rlgate.demo.calc_x`): fixed splits that share no computation, every
answer the calculator's, the teacher's answers in the agent's format."""

from __future__ import annotations

import json
import random
from fractions import Fraction

from rlgate.demo.calc_x import (
    OUTPUT_FORMAT,
    calculate,
    exact_value,
    problems,
    read_tasks,
    teacher_message,
    write_tasks,
)


def test_the_splits_are_fixed_and_share_no_computation():
    val = problems("val", 200)
    assert val == problems("val", 200)  # the same list every time
    assert [p.id for p in val[:3]] == ["calcx-val-0", "calcx-val-1", "calcx-val-2"]
    train = problems("train", 2000)
    assert not {p.expression for p in val} & {p.expression for p in train}
    assert len({p.question for p in train}) == len(train)
    assert {p.operations for p in val} == {1, 2, 3}
    assert any(isinstance(p.result, float) for p in val) and any(isinstance(p.result, int) for p in val)
    for problem in val + train:  # the ground truth is what the calculator answers to the solution
        assert Fraction(calculate(problem.expression)) == Fraction(str(problem.result))


def test_money_reads_with_cents():
    questions = [p.question for p in problems("val", 400) if p.kind in ("price", "change", "split")]
    assert questions and all("$" in q for q in questions)
    for question in questions:
        for word in (w.rstrip(".,?") for w in question.split()):
            if word.startswith("$") and "." in word:
                assert len(word.split(".")[1]) == 2, question


def test_the_calculator_answers_like_a_calculator():
    assert calculate("17 * 25") == "425"
    assert calculate("(103.44 + 16) / 8") == "14.93"
    assert calculate("20 - 3 * 2.35") == "12.95"
    assert calculate("1 / 0") == "Error: division by zero"
    assert calculate("__import__('os')").startswith("Error: cannot evaluate")
    assert calculate("2 ** 99999999").startswith("Error: cannot evaluate")  # no powers: only + - * /
    assert calculate("1" * 300).startswith("Error: cannot evaluate")  # long input refused before parsing
    assert exact_value("-(2 + 3) * 4") == -20


def test_the_teacher_calls_the_tool_then_answers_in_the_tasks_format(tmp_path):
    path = write_tasks(tmp_path / "tasks.jsonl", 50, 10)
    tasks = read_tasks(path)
    assert [t.split for t in tasks].count("val") == 10
    expressions = {t.question: t.expression for t in tasks}
    rng = random.Random(0)
    slipped = 0
    for task in tasks[:50]:
        messages = [{"role": "user", "content": f"{task.question} {OUTPUT_FORMAT}"}]
        call = teacher_message(messages, expressions, rng, slip_rate=0.35)
        [tool_call] = call["tool_calls"]
        expression = json.loads(tool_call["function"]["arguments"])["expression"]
        slipped += exact_value(expression) != exact_value(task.expression)
        messages += [call, {"role": "tool", "content": calculate(expression)}]
        answer = teacher_message(messages, expressions, rng, slip_rate=0.35)
        assert answer["content"] == f"### ANSWER: {calculate(expression)} ###"
    assert 8 <= slipped <= 28  # about 35% of 50, each one of another value


def test_the_real_model_demo_refuses_an_engine_it_cannot_use_in_one_line(tmp_path):
    import subprocess
    import sys

    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlgate",
            "demo",
            "--task",
            "calc-x",
            "--inference",
            "rlgate-serve",
            "--workdir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 2
    assert (
        refused.stderr
        == "rlgate demo: error: --task calc-x starts one real vLLM of its own (--inference auto or vllm)\n"
    )
    assert not any(tmp_path.iterdir())  # nothing started, nothing written
