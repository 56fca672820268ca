"""Text-answer rewards: exact match, word-level F1 (SQuAD / MuSiQue) and Agent Lightning's RAG reward.

Ground truth for all three: one string or a non-empty list of acceptable strings; the score is the best
over the list. Anything else raises ValueError.
"""

from __future__ import annotations

import re
import string
import unicodedata
from collections import Counter
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from reward_hooks.rewards.registry import RewardInput

DEFAULT_ANSWER_TAGS = ("<answer>", "</answer>")

_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """SQuAD's answer normalization, made Unicode-aware.

    In order: Unicode NFKC, lowercase, delete punctuation (ASCII `string.punctuation` and every Unicode
    punctuation character, category P*: curly quotes, dashes, ...), replace the words a/an/the with a
    space, collapse whitespace runs to one space and strip. On ASCII text this is exactly SQuAD v1.1's
    `normalize_answer`.
    """
    text = unicodedata.normalize("NFKC", text).lower()
    text = "".join(
        ch for ch in text if ch not in string.punctuation and not unicodedata.category(ch).startswith("P")
    )
    return " ".join(_ARTICLES.sub(" ", text).split())


def ground_truths(ground_truth: Any) -> list[str]:
    """The acceptable answers: a string, or a non-empty list of strings."""
    if isinstance(ground_truth, str):
        return [ground_truth]
    if (
        isinstance(ground_truth, list | tuple)
        and ground_truth
        and all(isinstance(item, str) for item in ground_truth)
    ):
        return list(ground_truth)
    raise ValueError(f"ground_truth must be a string or a non-empty list of strings, got {ground_truth!r}")


def exact_match(inp: RewardInput) -> float:
    """1.0 if `normalize_answer(answer) == normalize_answer(g)` for some ground truth g, else 0.0."""
    prediction = normalize_answer(inp.answer)
    return float(any(prediction == normalize_answer(g) for g in ground_truths(inp.ground_truth)))


def token_f1(prediction: str, ground_truth: str) -> float:
    """Word-level F1 of two strings, SQuAD-style.

    Tokens are `normalize_answer(s).split()`. With `common = sum((Counter(pred) & Counter(gold)).values())`
    (bag-of-tokens overlap, duplicates counted as often as both sides have them):
    `precision = common / len(pred)`, `recall = common / len(gold)`,
    `F1 = 2 * precision * recall / (precision + recall)`, and 0.0 when `common == 0`.
    When either side has no tokens: 1.0 if both have none, else 0.0.
    """
    pred_tokens = normalize_answer(prediction).split()
    gold_tokens = normalize_answer(ground_truth).split()
    if not pred_tokens or not gold_tokens:
        return float(pred_tokens == gold_tokens)
    common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if common == 0:
        return 0.0
    precision = common / len(pred_tokens)
    recall = common / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def f1(inp: RewardInput) -> float:
    """`max(token_f1(answer, g) for g in ground truths)`: the paper's MuSiQue correctness."""
    return max(token_f1(inp.answer, g) for g in ground_truths(inp.ground_truth))


def extract_tagged(answer: str, tags: tuple[str, str]) -> str | None:
    """The text inside the last `open ... close` pair of `answer`, or None if there is none.

    Pairs are found left to right as `re.findall(open + "(.*?)" + close, answer, re.DOTALL)` finds them
    (the first `open`, then the first `close` after it, then on from there), but with `str.find`, in
    time linear in the answer's length: the regex retries the lazy scan from every `open` that has no
    `close` after it, quadratic on an answer of many unclosed tags.
    """
    open_tag, close_tag = tags
    last, pos = None, 0
    while (start := answer.find(open_tag, pos)) >= 0:
        end = answer.find(close_tag, start + len(open_tag))
        if end < 0:  # no close after this open, so none after any later one either
            break
        last = answer[start + len(open_tag) : end]
        pos = end + len(close_tag)
    return last


def format_and_f1(inp: RewardInput) -> float:
    """Agent Lightning's RAG reward: `0.9 * correctness + 0.1 * format`.

    `params["answer_tags"]`: the opening and closing tag, default `["<answer>", "</answer>"]`. The answer
    is the text inside the last tag pair. `format` is 1 if that text has a non-whitespace character, else
    0. `correctness` is the best `token_f1` of that text against the ground truths. With no tag pair, or
    only whitespace inside, both terms are 0 (the whole reply is not graded instead): the format is what
    makes an answer gradable. Values: 0.0 (no or empty tags), 0.1 (tagged, no word overlap), up to 1.0.
    """
    tags = inp.params.get("answer_tags", DEFAULT_ANSWER_TAGS)
    if (
        not isinstance(tags, list | tuple)
        or len(tags) != 2
        or not all(isinstance(tag, str) and tag for tag in tags)
    ):
        raise ValueError(f"params.answer_tags must be two non-empty strings [open, close], got {tags!r}")
    golds = ground_truths(inp.ground_truth)
    tagged = extract_tagged(inp.answer, (tags[0], tags[1]))
    if tagged is None or not tagged.strip():
        return 0.0
    correctness = max(token_f1(tagged, g) for g in golds)
    return 0.9 * correctness + 0.1
