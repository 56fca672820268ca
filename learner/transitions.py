"""From the closed episodes of a step's task groups to credited `Transition`s (LightningRL's two levels).

Per group (all episodes of one task in the step):
1. every call of every episode gets its return g_t from the episode's final return R and its
   intermediate rewards r_t (webhook reward + automatic reward of the call): `credit.assign_credit`;
2. the group's advantages are computed from those returns (`advantages.group_advantages`); the baseline
   statistics see every call of the group's episodes, including calls that are not trained below (other
   agents' calls count for the return and the baseline);
3. only trainable calls become transitions: no error, the server's token ids present (its log-probs too,
   or, where the server gave none, the learner's own pre-update ones stand in: `CallRecord.trainable`),
   served by the trained policy (the base model's served name or one of its `policy-v{N}` adapters; a
   judge or tool model called through the same gateway is not the policy), made by one of
   `train_agents` (when set), served by a policy at most `max_staleness` versions old, and sampled
   without a grammar (`constrained`: structured outputs, a JSON response format, a required or named
   tool choice; the server's log-probs are then those of the masked distribution, which the learner
   cannot recompute: measured on SmolLM2 through real vLLM, a regex-held call's log-probs were 1.02
   nats per token from the learner's);
4. `reinforce_baseline` only: the kept transitions' advantages are whitened over the step's trained
   action tokens (`advantages.whiten`), as OpenRLHF whitens over the tokens it trains on; calls dropped
   in 3 take no part.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from learner.advantages import group_advantages, whiten
from learner.credit import assign_credit
from learner.push import ADAPTER_NAME
from learner.samples import Transition
from learner.settings import LearnerSettings
from rlgate.episodes import IndexedCall, RolloutView


def sampling_processing(
    request: dict[str, Any], default_temperature: float
) -> tuple[float, tuple[tuple[int, float], ...], int, float]:
    """(temperature, logit_bias, top_k, top_p) the server applied to a call, from the request the agent
    sent. A temperature of 0 (greedy) reports log-probs of the unscaled, untruncated logits, i.e.
    temperature 1, no top-k, no top-p; temperatures in (0, 0.01) are raised to 0.01, as vLLM does."""
    temperature = request.get("temperature")
    temperature = default_temperature if temperature is None else float(temperature)
    bias = request.get("logit_bias") or {}
    pairs = tuple(sorted((int(k), float(v)) for k, v in bias.items())) if isinstance(bias, dict) else ()
    if temperature == 0:
        return 1.0, pairs, 0, 1.0
    temperature = max(temperature, 0.01)
    top_k = request.get("top_k")
    top_k = int(top_k) if isinstance(top_k, (int, float)) and top_k > 0 else 0
    top_p = request.get("top_p")
    top_p = float(top_p) if isinstance(top_p, (int, float)) and 0 < top_p < 1 else 1.0
    return temperature, pairs, top_k, top_p


# Request fields with which vLLM samples under a grammar (structured outputs; the guided_* names of older
# releases)
GRAMMAR_FIELDS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


def constrained(request: dict[str, Any]) -> bool:
    """Whether the server sampled the call under a grammar: the token mask is part of the distribution
    its log-probs describe and not of the learner's. vLLM holds `tool_choice: "required"` and a named tool
    choice to its tool-call JSON the same way, and `response_format` json_object, json_schema or
    structural_tag."""
    if any(request.get(name) for name in GRAMMAR_FIELDS):
        return True
    response_format = request.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") in (
        "json_object",
        "json_schema",
        "structural_tag",
    ):
        return True
    choice = request.get("tool_choice")
    return bool(request.get("tools")) and (choice == "required" or isinstance(choice, dict))


def credited_transitions(
    groups: Sequence[Sequence[RolloutView]],
    settings: LearnerSettings,
    version: int,
    base_model: str | None = None,
) -> tuple[list[list[Transition]], Counter[str]]:
    """Per episode, its trainable calls as transitions (episodes in group order). Also counts what was
    kept and dropped: calls, trained, failed, other_model, other_agent, stale, constrained,
    singleton_episodes.
    `base_model` is the name the servers serve the trained policy under (None: any model counts)."""
    counts: Counter[str] = Counter()
    out: list[list[Transition]] = []
    for views in groups:
        returns = []
        for view in views:
            rewards = torch.tensor(
                [(c.reward or 0.0) + (c.air_reward or 0.0) for c in view.calls], dtype=torch.float32
            )
            returns.append(
                assign_credit(
                    float(view.reward),  # type: ignore[arg-type]  # a closed episode's: never None
                    rewards,
                    settings.credit,
                    settings.gamma,
                    settings.intermediate_rewards,
                )
            )
        advantages = group_advantages(returns, settings.estimator, settings.stats_over)
        if advantages is None:
            if settings.singleton_groups != "keep":
                counts["singleton_episodes"] += len(views)
                continue
            advantages = returns  # no baseline: REINFORCE with the return itself
        for view, adv in zip(views, advantages, strict=True):
            episode = []
            for call, a in zip(view.calls, adv.tolist(), strict=True):
                counts["calls"] += 1
                reason = _skip_reason(call, settings, version, base_model)
                if reason:
                    counts[reason] += 1
                    continue
                # `_skip_reason` let only trainable calls through: their ids are there
                assert call.prompt_token_ids is not None and call.completion_token_ids is not None
                temperature, bias, top_k, top_p = sampling_processing(
                    call.request, settings.default_temperature
                )
                episode.append(
                    Transition(
                        rollout_id=view.rollout_id,
                        index=call.index,
                        prompt_ids=tuple(call.prompt_token_ids),
                        completion_ids=tuple(call.completion_token_ids),
                        rollout_logprobs=(
                            tuple(call.completion_logprobs)
                            if call.completion_logprobs is not None
                            else (math.nan,) * len(call.completion_token_ids)
                        ),  # see `trainable`
                        advantage=a,
                        policy_version=call.policy_version,
                        temperature=temperature,
                        logit_bias=bias,
                        top_k=top_k,
                        top_p=top_p,
                    )
                )
                counts["trained"] += 1
                counts["no_server_logprobs"] += call.completion_logprobs is None
                counts["staleness_sum"] += version - call.policy_version
            out.append(episode)
    if settings.estimator == "reinforce_baseline":
        kept = [t for episode in out for t in episode]
        if kept:
            whitened = iter(
                whiten(
                    [torch.tensor([t.advantage]) for t in kept],
                    [torch.tensor([len(t.completion_ids)]) for t in kept],
                )
            )
            out = [
                [dataclasses.replace(t, advantage=float(next(whitened))) for t in episode] for episode in out
            ]
    return out, counts


def is_policy_model(model: str | None, base_model: str | None) -> bool:
    """Whether a call's recorded model is the trained policy: its served base name or a `policy-v{N}`
    adapter (records without a model, and a learner that names no base model, count as the policy)."""
    return model is None or base_model is None or model == base_model or bool(ADAPTER_NAME.fullmatch(model))


def _skip_reason(
    call: IndexedCall, settings: LearnerSettings, version: int, base_model: str | None
) -> str | None:
    if not call.trainable:
        return "failed"
    if not is_policy_model(call.model, base_model):
        return "other_model"
    if settings.train_agents and call.agent_name not in settings.train_agents:
        return "other_agent"
    if version - call.policy_version > settings.max_staleness:
        return "stale"
    if constrained(call.request):
        return "constrained"
    return None
