"""Calc-X in miniature (after the paper's section 4.3): "last digit of A+B?" with a calculator tool.

An episode has one or two LLM calls, both one-token completions on the policy:

    call 1  prompt "37+45 last digit? "             -> "C" (call the calculator) or a digit (answer now)
    call 2  prompt "37+45 last digit? C=82"          -> a digit, read from the calculator's result
            (only after "C": the agent appends the calculator's output to what the model wrote)

The reward (the `math_answer` reward job, on the rq worker) is 1 if the final digit is the last digit of
A+B. A model that answers by itself is right one time in ten; one that calls the calculator and reads its
result is right almost always. The tiny model built with seed 0 starts out calling the calculator about
one time in twenty (measured: 4.7% over 200 questions), so its success rate starts near 10-15%;
reinforcement learning with identical credit (both calls of a rewarded episode get its advantage) teaches
it to call the tool. (Offering "C" slightly less, a bias of 99.8, made the first call so rare that a run
collapsed onto guessing before it found the tool: measured once, 13% -> 4% in 10 minutes.)

The sampling is what a careful agent would send a small model: `max_tokens=1`, a `logit_bias` of +100 on
the allowed tokens (C and the digits, then the digits only), so that every sample is a valid action, and
a low temperature. The learner computes its log-probs under the same bias and temperature (recorded with
each call), so the policy gradient is that of the distribution actually sampled from.

Token ids are those of the tiny model's byte-level tokenizer (id = byte value), which `rlgate demo`
builds; a different model needs its own ids for "C" and the digits.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

TOOL_TOKEN = "C"
DIGITS = "0123456789"
FIRST_CALL_BIAS = {str(ord(c)): 100 for c in TOOL_TOKEN + DIGITS}
ANSWER_BIAS = {str(ord(c)): 100 for c in DIGITS}
TEMPERATURE = 0.15


@dataclass(frozen=True)
class Question:
    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}+{self.b} last digit? "

    @property
    def answer(self) -> str:
        return str((self.a + self.b) % 10)

    def calculator(self) -> str:
        """What the calculator tool returns for this question's expression."""
        return f"={self.a + self.b}"


def random_question(rng: random.Random) -> Question:
    return Question(rng.randint(10, 99), rng.randint(10, 99))
