"""Every Redis key rlgate uses, built in one place. This docstring is the key layout.

| key                                   | type | writer                         | reader                  | TTL  |
|---------------------------------------|------|--------------------------------|-------------------------|------|
| `{prefix}:rollout:{<rid>}`            | hash | gateway (create, first call)   | gateway, reward, learner| none |
| `{prefix}:rollout:{<rid>}:calls`      | list | gateway (one entry per choice) | gateway, learner        | none |
| `{prefix}:policy`                     | hash | learner (`version`)            | gateway (polled)        | none |

- The rollout hash holds the fields of `records.Rollout`: `schema_version`, `rollout_id`, `task_id` ('' for
  none), `status`, `created_at` (unix seconds), `metadata` (JSON object).
- The calls list holds one `records.CallRecord` as JSON per LLM transition, in commit order; a call's
  index is its position in the list (0-based), so it is never stored twice. A request with `n > 1`
  appends one entry per choice, in choice order, in the same script call.
- Both keys of a rollout carry the Redis Cluster hash tag `{<rid>}`, so the Lua scripts that touch both
  (create, record) hit one slot and run unchanged on a cluster. Keys without a rollout (`policy`) are
  only ever touched by single-key commands.
- Expiry of open rollouts and the closed-episode stream come with the episode lifecycle (issue 3); until
  then nothing here expires.
"""

from __future__ import annotations

import re

from episodes.errors import InvalidId

# Characters allowed in rollout and task ids: they appear in URL paths and inside a hash tag, so no
# slashes and no braces.
_ID_RE = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


def validate_id(value: str, what: str = "id") -> str:
    """Return `value` if it can be used as a rollout or task id, else raise `InvalidId`."""
    if not _ID_RE.fullmatch(value):
        raise InvalidId(f"invalid {what} {value!r}: use 1-128 characters from A-Z a-z 0-9 . _ : -")
    return value


class Keys:
    """Builds the keys of one rlgate deployment; `prefix` lets several share a Redis."""

    __slots__ = ("prefix", "policy")

    def __init__(self, prefix: str = "rlgate") -> None:
        if not prefix or "{" in prefix or "}" in prefix:
            raise InvalidId(f"invalid key prefix {prefix!r}")
        self.prefix = prefix
        self.policy = f"{prefix}:policy"

    def rollout(self, rollout_id: str) -> str:
        return f"{self.prefix}:rollout:{{{rollout_id}}}"

    def calls(self, rollout_id: str) -> str:
        return f"{self.prefix}:rollout:{{{rollout_id}}}:calls"
