"""Calc-X, the paper's tool-use task (Agent Lightning, section 4.3), as word problems generated in code.

Calc-X (Kadlcik et al., 2023) gathers grade-school arithmetic word problems (GSM8K, Ape210K, MAWPS, SVAMP,
ASDiv, ...) whose solutions are chains of calculator calls. No dataset downloads here, so the problems are
generated from templates of the same kinds: a question in words over one to three operations (+ - * /),
integers and money amounts with cents, the answer a number. Each problem carries its solution as one
expression (`expression`, Calc-X's `chain` in one step) and its `result`.

    {"id": "calcx-train-17", "question": "Maya buys 4 notebooks at $2.35 each and pays with a $20 bill.
     How much change does she get?", "expression": "20 - 4 * 2.35", "result": 10.6, "split": "train",
     "kind": "change", "operations": 2}

Splits are fixed: `problems("val", n)` is always the same list (its own seed), `problems("train", n)`
never holds a question of the val split (checked, not assumed). `write_tasks` writes both as a JSONL
tasks file (`id`, `question`, `result`, `split`, ...).

What the agent (`rlgate.demo.calc_x_agent`) and the warm start's teacher share is here too: the task
prompt (Agent Lightning's calc_x example's, word for word), the calculator tool (the `calculate`
signature of the MCP calculator that example runs) and the teacher's answers.
"""

from __future__ import annotations

import ast
import json
import operator
import random
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Any

# Agent Lightning's examples/calc_x: the question, then this; the answer is read between the sharps
OUTPUT_FORMAT = (
    "Output the answer when you are ready. The answer should be surrounded by three sharps (`###`), "
    "in the form of ### ANSWER: <answer> ###."
)
SPLIT_SEEDS = {"train": 1, "val": 2}

NAMES = ("Maya", "Liam", "Ava", "Noah", "Emma", "Omar", "Sofia", "Ravi", "Chen", "Lucia", "Tom", "Nadia")
ITEMS = ("apples", "stickers", "marbles", "books", "pencils", "cards", "shells", "stamps", "cookies", "toys")
GOODS = (
    ("notebook", "notebooks"),
    ("pen", "pens"),
    ("sandwich", "sandwiches"),
    ("ticket", "tickets"),
    ("bottle of juice", "bottles of juice"),
    ("scarf", "scarves"),
    ("mug", "mugs"),
)


@dataclass(frozen=True)
class Problem:
    id: str
    question: str
    expression: str
    result: int | float
    split: str
    kind: str
    operations: int

    @property
    def prompt(self) -> str:
        """What the agent sends as its task (Agent Lightning's calc_x: the question and OUTPUT_FORMAT)."""
        return f"{self.question} {OUTPUT_FORMAT}"


def _money(rng: random.Random, low: int, high: int) -> Decimal:
    """A price with cents between low and high dollars (never a whole number)."""
    cents = rng.randint(low * 100 + 1, high * 100 - 1)
    if cents % 100 == 0:
        cents += rng.choice((5, 25, 50))
    return Decimal(cents).scaleb(-2)  # always two decimals: 3.30, not 3.3


def _fmt(value: Decimal | int) -> str:
    return f"{value:f}" if isinstance(value, Decimal) else str(value)


# Each template: rng -> (kind, question, expression). Every expression's value is a number a grade-school
# answer would give (divisions come out even).
def _gain(rng: random.Random) -> tuple[str, str, str]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(12, 95), rng.randint(5, 60)
    return (
        "add",
        f"{name} has {a} {item}. A friend gives {name} {b} more. How many {item} does {name} have now?",
        f"{a} + {b}",
    )


def _loss(rng: random.Random) -> tuple[str, str, str]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a = rng.randint(40, 200)
    b = rng.randint(5, a - 5)
    return (
        "subtract",
        f"{name} had {a} {item} and gave away {b} of them. How many {item} are left?",
        f"{a} - {b}",
    )


def _boxes(rng: random.Random) -> tuple[str, str, str]:
    item = rng.choice(ITEMS)
    a, b = rng.randint(6, 48), rng.randint(3, 25)
    return "multiply", f"Each box holds {a} {item}. How many {item} are in {b} boxes?", f"{a} * {b}"


def _share(rng: random.Random) -> tuple[str, str, str]:
    item = rng.choice(ITEMS)
    each, children = rng.randint(3, 30), rng.randint(2, 12)
    total = each * children
    return (
        "divide",
        f"{total} {item} are shared equally among {children} children. How many {item} does each child get?",
        f"{total} / {children}",
    )


def _price(rng: random.Random) -> tuple[str, str, str]:
    one, many = rng.choice(GOODS)
    price, n = _money(rng, 1, 15), rng.randint(2, 12)
    return (
        "price",
        f"One {one} costs ${_fmt(price)}. How much do {n} {many} cost in dollars?",
        f"{n} * {_fmt(price)}",
    )


def _change(rng: random.Random) -> tuple[str, str, str]:
    name = rng.choice(NAMES)
    one, many = rng.choice(GOODS)
    price, n = _money(rng, 1, 9), rng.randint(2, 6)
    bill = next(b for b in (10, 20, 50, 100) if b > price * n)
    return (
        "change",
        f"{name} buys {n} {many} at ${_fmt(price)} each and pays with a ${bill} bill. How much change does "
        f"{name} get in dollars?",
        f"{bill} - {n} * {_fmt(price)}",
    )


def _farm(rng: random.Random) -> tuple[str, str, str]:
    a, b = rng.randint(15, 90), rng.randint(10, 70)
    c = rng.randint(5, a + b - 5)
    return (
        "add-subtract",
        f"A farm has {a} cows and {b} sheep. The farmer sells {c} of the animals. How many animals are left?",
        f"{a} + {b} - {c}",
    )


def _trip(rng: random.Random) -> tuple[str, str, str]:
    speed, hours, extra = rng.randint(40, 95), rng.randint(2, 9), rng.randint(10, 120)
    return (
        "multiply-add",
        f"A train travels {speed} km every hour for {hours} hours, then {extra} km more. How many km does it "
        "travel in all?",
        f"{speed} * {hours} + {extra}",
    )


def _savings(rng: random.Random) -> tuple[str, str, str]:
    name = rng.choice(NAMES)
    start, weekly, weeks = rng.randint(20, 150), rng.randint(5, 40), rng.randint(3, 12)
    return (
        "add-multiply",
        f"{name} has ${start} saved and saves ${weekly} more every week. How many dollars will {name} have "
        f"after {weeks} weeks?",
        f"{start} + {weekly} * {weeks}",
    )


def _wages(rng: random.Random) -> tuple[str, str, str]:
    name = rng.choice(NAMES)
    wage, hours, days = rng.randint(9, 30), rng.randint(3, 8), rng.randint(2, 6)
    spent = rng.randint(10, wage * hours * days - 10)
    return (
        "wages",
        f"{name} earns ${wage} an hour and works {hours} hours a day for {days} days, then spends ${spent}. "
        f"How many dollars does {name} have left?",
        f"{wage} * {hours} * {days} - {spent}",
    )


def _chairs(rng: random.Random) -> tuple[str, str, str]:
    rows, per_row, extra = rng.randint(4, 20), rng.randint(5, 16), rng.randint(3, 30)
    guests = rng.randint(10, rows * per_row + extra - 1)
    return (
        "chairs",
        f"A hall has {rows} rows of {per_row} chairs and {extra} extra chairs. {guests} guests sit down, one "
        "on each chair. How many chairs are empty?",
        f"{rows} * {per_row} + {extra} - {guests}",
    )


def _split_bill(rng: random.Random) -> tuple[str, str, str]:
    people = rng.randint(2, 8)
    meal, tip = _money(rng, 20, 120), rng.randint(5, 30)
    total = meal + tip
    while (total * 100) % people:  # an even split to the cent
        meal += Decimal("0.01")
        total = meal + tip
    return (
        "split",
        f"A meal costs ${_fmt(meal)} and the tip is ${tip}. {people} friends split the bill equally. How many "
        "dollars does each friend pay?",
        f"({_fmt(meal)} + {tip}) / {people}",
    )


TEMPLATES: tuple[Callable[[random.Random], tuple[str, str, str]], ...] = (
    _gain,
    _loss,
    _boxes,
    _share,
    _price,
    _change,
    _farm,
    _trip,
    _savings,
    _wages,
    _chairs,
    _split_bill,
)

_OPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


def exact_value(expression: str) -> Fraction:
    """The expression's value in exact fractions (numbers, + - * /, parentheses, unary minus)."""

    def value(node: ast.AST) -> Fraction:
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, int | float)
            and not isinstance(node.value, bool)
        ):
            return Fraction(str(node.value))
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd):
            return value(node.operand)
        raise ValueError("not arithmetic")

    if len(expression) > 200:
        raise ValueError("expression too long")
    return value(ast.parse(expression, mode="eval").body)


def as_number(value: Fraction) -> int | float:
    return int(value) if value.denominator == 1 else float(value)


# `calculate` as AutoGen offers it to the model (its FunctionTool schema in OpenAI's shape: name, docstring,
# signature, as recorded from its requests), for what renders prompts without AutoGen (the benchmark, the
# template test)
TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Calculates/evaluates the given expression.",
        "parameters": {
            "type": "object",
            "properties": {
                "expression": {"description": "expression", "title": "Expression", "type": "string"}
            },
            "required": ["expression"],
            "additionalProperties": False,
        },
        "strict": False,
    },
}


def calculate(expression: str) -> str:
    """Calculates/evaluates the given expression."""
    # The agent's tool: the signature and the description (this docstring, which AutoGen sends as the
    # tool's description) of the MCP calculator Agent Lightning's calc_x example runs. Numbers, + - * / and
    # parentheses; the result as a number, or the error a calculator gives.
    try:
        value = exact_value(expression)
    except ZeroDivisionError:
        return "Error: division by zero"
    except (ValueError, SyntaxError, TypeError, RecursionError):
        return f"Error: cannot evaluate {expression!r}"
    number = as_number(value)
    return str(number) if isinstance(number, int) else f"{number:.10g}"


def _operations(expression: str) -> int:
    return sum(expression.count(op) for op in " + - * / ".split())


def _generate(rng: random.Random) -> Iterator[tuple[str, str, str]]:
    while True:
        yield rng.choice(TEMPLATES)(rng)


def problems(split: str, n: int) -> list[Problem]:
    """The first `n` problems of `split` ("train" or "val"): always the same, no question twice; train
    never holds a val problem's computation (the expressions of the val split's first 2,000 are excluded,
    so that a val problem is not a train one with other names and items)."""
    if split not in SPLIT_SEEDS:
        raise ValueError(f"split is 'train' or 'val', not {split!r}")
    excluded = set() if split == "val" else {p.expression for p in problems("val", 2000)}
    seen: set[str] = set()
    out: list[Problem] = []
    for kind, question, expression in _generate(random.Random(SPLIT_SEEDS[split])):
        if question in seen or expression in excluded:
            continue
        seen.add(question)
        out.append(
            Problem(
                id=f"calcx-{split}-{len(out)}",
                question=question,
                expression=expression,
                result=as_number(exact_value(expression)),
                split=split,
                kind=kind,
                operations=_operations(expression),
            )
        )
        if len(out) == n:
            return out
    raise AssertionError("unreachable")


def write_tasks(path: Path, train: int, val: int) -> Path:
    """A JSONL tasks file: `train` problems of the train split, then `val` of the val split."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as file:
        for problem in problems("train", train) + problems("val", val):
            file.write(json.dumps(asdict(problem)) + "\n")
    return path


def read_tasks(path: Path) -> list[Problem]:
    return [Problem(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------------------------------------------------
# The warm start's teacher: a program that answers the agent's calls, imperfect on purpose


def _slip(expression: str, rng: random.Random) -> str:
    """A plausible wrong expression, of another value: one operator swapped or one number changed."""
    for _ in range(20):
        wrong = _slip_once(expression, rng)
        if exact_value(wrong) != exact_value(expression):
            return wrong
    return f"{expression} + 1"


def _slip_once(expression: str, rng: random.Random) -> str:
    tokens = expression.split(" ")
    operators = [i for i, t in enumerate(tokens) if t in "+-*/"]
    if operators and rng.random() < 0.5:
        i = rng.choice(operators)
        tokens[i] = rng.choice([op for op in "+-*" if op != tokens[i]])
    else:
        numbers = [i for i, t in enumerate(tokens) if t.strip("()").replace(".", "").isdigit()]
        i = rng.choice(numbers)
        core = tokens[i].strip("()")
        wrong = str(int(Decimal(core)) + rng.choice((-2, -1, 1, 2, 10))) if "." not in core else core[::-1]
        tokens[i] = tokens[i].replace(core, wrong)
    return " ".join(tokens)


def teacher_message(
    messages: list[dict[str, Any]], expressions: dict[str, str], rng: random.Random, slip_rate: float
) -> dict[str, Any]:
    """The assistant message the teacher writes next: on the task, a `calculate` call of the problem's
    expression (with probability `slip_rate` a wrong one: `_slip`); after the tool's result, the answer in
    the task's format with that result. `expressions`: question text -> expression (the tasks file)."""
    if messages[-1]["role"] == "tool":
        return {"role": "assistant", "content": f"### ANSWER: {messages[-1]['content']} ###"}
    task = next(m["content"] for m in messages if m["role"] == "user")
    question = task.removesuffix(" " + OUTPUT_FORMAT)
    expression = expressions[question]
    if rng.random() < slip_rate:
        expression = _slip(expression, rng)
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": f"call_{rng.getrandbits(32):08x}",
                "type": "function",
                "function": {"name": "calculate", "arguments": json.dumps({"expression": expression})},
            }
        ],
    }
