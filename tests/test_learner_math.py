"""Credit assignment, advantages and samples against hand-computed tensors, and against OpenRLHF's own
estimator code (`RemoteExperienceMaker.compute_advantages_and_returns`) on the same rewards."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("openrlhf")

from learner.advantages import group_advantages, whiten  # noqa: E402
from learner.credit import assign_credit, returns_to_go  # noqa: E402
from learner.samples import Transition, build_samples, history_splits, micro_batches  # noqa: E402


def close(a, b, tol=1e-6) -> bool:
    return torch.allclose(
        torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=tol, rtol=0
    )


# ---------------------------------------------------------------------------------------------------------
# credit


def test_identical_credit_gives_every_call_the_final_return_not_r_over_t():
    assert close(assign_credit(2.0, torch.zeros(4)), [2.0, 2.0, 2.0, 2.0])


def test_discounted_and_last_only_credit():
    assert close(assign_credit(1.0, torch.zeros(3), "discounted", gamma=0.5), [0.25, 0.5, 1.0])
    assert close(assign_credit(3.0, torch.zeros(3), "last_only"), [0.0, 0.0, 3.0])
    assert assign_credit(1.0, torch.zeros(0)).shape == (0,)


def test_intermediate_rewards_are_added_as_returns_to_go():
    r = torch.tensor([0.0, -0.5, 0.0, 1.0])
    assert close(returns_to_go(r, 1.0), [0.5, 0.5, 1.0, 1.0])
    assert close(returns_to_go(r, 0.5), [-0.125, -0.25, 0.5, 1.0])
    got = assign_credit(1.0, r, "identical", gamma=1.0, add_intermediate=True)
    assert close(got, [1.5, 1.5, 2.0, 2.0])
    assert close(assign_credit(1.0, r, "identical"), [1.0] * 4)  # off unless asked for


def test_credit_rejects_nan_and_bad_gamma():
    with pytest.raises(ValueError):
        assign_credit(float("nan"), torch.zeros(2))
    with pytest.raises(ValueError):
        assign_credit(1.0, torch.zeros(2), "discounted", gamma=1.5)


# ---------------------------------------------------------------------------------------------------------
# advantages: hand-computed


def test_group_norm_over_episodes_counts_each_episode_once():
    # three episodes of 1, 2 and 3 calls with returns 1, 0, 0 (identical credit)
    returns = [torch.tensor([1.0]), torch.tensor([0.0, 0.0]), torch.tensor([0.0, 0.0, 0.0])]
    mean, std = 1 / 3, math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)
    got = group_advantages(returns, "group_norm", "episodes")
    assert close(got[0], [(1 - mean) / std]) and close(got[1], [-mean / std] * 2)
    assert close(got[2], [-mean / std] * 3)


def test_group_norm_over_transitions_counts_each_call_once():
    returns = [torch.tensor([1.0]), torch.tensor([0.0, 0.0]), torch.tensor([0.0, 0.0, 0.0])]
    values = torch.tensor([1.0, 0, 0, 0, 0, 0])
    mean, std = values.mean(), values.std()  # Bessel-corrected, as OpenRLHF's torch.std
    got = group_advantages(returns, "group_norm", "transitions")
    assert close(got[0], (1 - mean) / (std + 1e-9)) and close(got[2], [(-mean / (std + 1e-9)).item()] * 3)
    # the two readings differ when episodes have different lengths
    assert not close(got[0], group_advantages(returns, "group_norm", "episodes")[0])


def test_rloo_and_baselines_by_hand():
    returns = [torch.tensor([1.0, 1.0]), torch.tensor([0.0]), torch.tensor([0.5, 0.5, 0.5])]
    rloo = group_advantages(returns, "rloo", "episodes")
    assert close(rloo[0], [1 - 0.25] * 2) and close(rloo[1], [0 - 0.75]) and close(rloo[2], [0.5 - 0.5] * 3)
    dr = group_advantages(returns, "dr_grpo", "episodes")
    assert close(dr[1], [-0.5])
    rloo_t = group_advantages(returns, "rloo", "transitions")
    assert close(rloo_t[1], [0 - 3.5 / 5])  # the other five calls: 1, 1, .5, .5, .5


def test_zero_std_group_gives_zero_advantages_and_singletons_none():
    same = [torch.tensor([1.0, 1.0]), torch.tensor([1.0])]
    for estimator in ("group_norm", "rloo", "reinforce_baseline", "dr_grpo"):
        got = group_advantages(same, estimator, "episodes")
        assert all(close(a, torch.zeros_like(a)) for a in got)
        assert not any(torch.isnan(a).any() for a in got)
    assert group_advantages([torch.tensor([1.0, 0.0])], "group_norm", "episodes") is None
    assert group_advantages([torch.tensor([1.0])], "group_norm", "transitions") is None
    # two calls of one episode are two units when statistics are over transitions
    assert group_advantages([torch.tensor([1.0, 0.0])], "group_norm", "transitions") is not None


def test_whiten_counts_every_token_once():
    advantages = [torch.tensor([1.0]), torch.tensor([-1.0, 0.0])]
    counts = [torch.tensor([3]), torch.tensor([1, 2])]
    tokens = torch.tensor([1.0, 1, 1, -1, 0, 0])
    mean, std = tokens.mean(), tokens.std(unbiased=False)
    got = whiten(advantages, counts)
    assert close(got[0], (1 - mean) / std) and close(got[1], (torch.tensor([-1.0, 0.0]) - mean) / std)


# ---------------------------------------------------------------------------------------------------------
# advantages: against OpenRLHF's own code


def _openrlhf_advantages(
    rewards: torch.Tensor, n: int, estimator: str, lengths: list[int]
) -> list[torch.Tensor]:
    """Run RemoteExperienceMaker.compute_advantages_and_returns on single-sample experiences."""
    from learner import _openrlhf  # noqa: F401  (closes the import gaps: first, or run alone this fails)

    from openrlhf.trainer.ppo_utils.experience import Experience  # isort: skip
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker  # isort: skip

    args = SimpleNamespace(
        rollout=SimpleNamespace(n_samples_per_prompt=n),
        algo=SimpleNamespace(advantage=SimpleNamespace(estimator=estimator, gamma=1.0, no_std_norm=False)),
        reward=SimpleNamespace(clip_range=None),
    )
    maker = SimpleNamespace(
        strategy=SimpleNamespace(args=args), kl_ctl=SimpleNamespace(value=0.0), advantage_estimator=estimator
    )
    maker.get_cumulative_returns = lambda *a: RemoteExperienceMaker.get_cumulative_returns(maker, *a)
    experiences = []
    for i, (reward, length) in enumerate(zip(rewards.tolist(), lengths, strict=True)):
        mask = torch.ones((1, length), dtype=torch.bool)
        experiences.append(
            Experience(
                action_mask=mask, rewards=torch.tensor([reward]), index=[i], kl=torch.zeros((1, length))
            )
        )
    RemoteExperienceMaker.compute_advantages_and_returns(maker, experiences)
    return [e.advantages[0] for e in experiences]


@pytest.mark.parametrize("estimator", ["group_norm", "rloo", "reinforce_baseline", "dr_grpo"])
def test_estimators_equal_openrlhf_on_equal_groups(estimator: str):
    torch.manual_seed(0)
    n, groups = 4, 3
    rewards = torch.randint(0, 3, (groups * n,)).float() / 2
    rewards[n : 2 * n] = 1.0  # one group with zero std
    lengths = [int(x) for x in torch.randint(1, 6, (groups * n,))]
    expected = _openrlhf_advantages(rewards, n, estimator, lengths)

    ours: list[torch.Tensor] = []
    for g in range(groups):
        returns = [torch.tensor([float(rewards[g * n + i])]) for i in range(n)]
        ours.extend(group_advantages(returns, estimator, "episodes"))
    if estimator == "reinforce_baseline":
        ours = whiten(ours, [torch.tensor([length]) for length in lengths])
    for i, (mine, theirs) in enumerate(zip(ours, expected, strict=True)):
        # OpenRLHF puts the advantage on every action token of the sample
        assert close(theirs, torch.full((lengths[i],), float(mine[0])), tol=1e-5), (i, mine, theirs)


# ---------------------------------------------------------------------------------------------------------
# samples


def call(index: int, prompt, completion, advantage=1.0, rollout="r1", temperature=1.0, bias=()):
    return Transition(
        rollout,
        index,
        tuple(prompt),
        tuple(completion),
        tuple(-0.1 * (k + 1) for k in range(len(completion))),
        advantage,
        0,
        temperature,
        tuple(bias),
    )


def test_transition_samples_mask_only_their_completion():
    [s] = build_samples([[call(0, [1, 2, 3], [7, 8], advantage=0.5)]])
    assert s.tokens == [1, 2, 3, 7, 8]
    assert s.action_mask == [False, False, True, True]  # aligned with tokens[1:]
    assert s.advantages == [0.0, 0.0, 0.5, 0.5] and s.rollout_logprobs[2:] == [-0.1, -0.2]


def test_trajectory_merges_calls_that_extend_the_context_and_breaks_otherwise():
    first = call(0, [1, 2], [3, 4], advantage=1.0)
    second = call(1, [1, 2, 3, 4, 5, 6], [9], advantage=2.0)  # extends: new prompt tokens 5, 6
    third = call(2, [1, 9, 9], [4], advantage=3.0)  # does not extend: a new sample
    merged, alone = build_samples([[first, second, third]], "trajectory")
    assert merged.tokens == [1, 2, 3, 4, 5, 6, 9]
    assert merged.action_mask == [False, True, True, False, False, True]
    assert merged.advantages == [0.0, 1.0, 1.0, 0.0, 0.0, 2.0] and merged.calls == [("r1", 0), ("r1", 1)]
    assert alone.tokens == [1, 9, 9, 4]
    # transition shape: one sample per call, no merging
    assert len(build_samples([[first, second, third]], "transition")) == 3
    # another temperature breaks a merge as well
    hot = call(1, [1, 2, 3, 4, 5, 6], [9], temperature=0.5)
    assert len(build_samples([[first, hot]], "trajectory")) == 2
    # the step counts the calls a history edit split off (a harness compacting its context): one here
    assert history_splits([merged, alone]) == 1
    assert history_splits(build_samples([[first, second]], "trajectory")) == 0


def test_micro_batches_respect_the_token_budget_and_pad_right():
    samples = build_samples([[call(i, [1] * (i + 2), [5, 6]) for i in range(6)]])
    batches = micro_batches(samples, token_budget=20, pad_token_id=0)
    assert sum(len(b.samples) for b in batches) == 6
    for b in batches:
        assert b.sequences.numel() <= 20 or len(b.samples) == 1
        assert b.action_mask.shape == (len(b.samples), b.sequences.shape[1] - 1)
        for r, s in enumerate(b.samples):
            n = len(s.tokens)
            assert b.sequences[r, :n].tolist() == s.tokens and b.attention_mask[r, n:].sum() == 0
            assert b.action_mask[r].sum() == 2 and b.advantages[r, n - 1 :].abs().sum() == 0


# ---------------------------------------------------------------------------------------------------------
# properties against OpenRLHF's own estimator code


@pytest.mark.parametrize("over", ["episodes", "transitions"])
@pytest.mark.parametrize("estimator", ["group_norm", "rloo", "reinforce_baseline", "dr_grpo"])
def test_equal_returns_give_exactly_zero_advantages(estimator: str, over: str):
    """Per-episode 1/T weights in float32 once left a std of ~1e-8 (the size of eps): [1] and [1]*5 gave
    -0.703 for every call under group_norm."""
    got = group_advantages([torch.full((1,), 1.0), torch.full((5,), 1.0)], estimator, over)
    assert all(bool((a == 0).all()) for a in got), got
    g = torch.Generator().manual_seed(12)
    for _ in range(500):
        value = float(torch.rand((), generator=g)) * 10 - 5
        returns = [torch.full((int(torch.randint(1, 9, (), generator=g)),), value) for _ in range(4)]
        assert all(bool((a == 0).all()) for a in group_advantages(returns, estimator, over))


@pytest.mark.parametrize("estimator", ["group_norm", "rloo", "reinforce_baseline", "dr_grpo"])
def test_multi_call_episodes_of_every_group_size_equal_openrlhf(estimator: str):
    """Identical credit over episodes of 1-5 calls, real-valued rewards, groups of 2-8 episodes: every
    call's advantage is OpenRLHF's advantage of its episode (one sample per episode, its tokens the
    episode's trained tokens). reinforce_baseline whitens over one group's tokens, as OpenRLHF's call on
    that group does."""
    g = torch.Generator().manual_seed(5)
    for n in range(2, 9):
        rewards = torch.randn(n, generator=g) * 3
        calls = [int(x) for x in torch.randint(1, 6, (n,), generator=g)]
        tokens = [torch.randint(1, 7, (t,), generator=g) for t in calls]
        expected = _openrlhf_advantages(rewards, n, estimator, [int(t.sum()) for t in tokens])
        returns = [assign_credit(float(r), torch.zeros(t)) for r, t in zip(rewards, calls, strict=True)]
        ours = group_advantages(returns, estimator, "episodes")
        if estimator == "reinforce_baseline":
            ours = whiten(ours, tokens)
        for mine, theirs in zip(ours, expected, strict=True):
            assert close(mine, torch.full_like(mine, float(theirs[0])), tol=2e-5), (n, mine, theirs)
            assert close(theirs, torch.full_like(theirs, float(theirs[0])))


def _view(rid: str, reward: float, calls: list[tuple[str, int]]):
    from rlgate.episodes import RolloutView

    return RolloutView.model_validate(
        {
            "rollout_id": rid,
            "task_id": "t",
            "status": "closed",
            "created_at": 0.0,
            "reward": reward,
            "calls": [
                {
                    "rollout_id": rid,
                    "endpoint": "chat.completions",
                    "policy_version": 0,
                    "request": {},
                    "started_at": 0.0,
                    "latency_ms": 1.0,
                    "index": i,
                    "agent_name": agent,
                    "model": model,
                    "prompt_token_ids": [1, 2],
                    "completion_token_ids": [3] * length,
                    "completion_logprobs": [-0.5] * length,
                }
                for i, (agent, length, *rest) in enumerate(calls)
                for model in [rest[0] if rest else "tiny"]
            ],
        }
    )


def test_reinforce_baseline_whitens_over_the_trained_tokens_only():
    """The critic's calls count for the returns but are not trained: OpenRLHF, training only the
    solver's tokens, whitens over those. Whitening over all calls once gave other advantages."""
    from learner.settings import LearnerSettings
    from learner.transitions import credited_transitions

    views = [
        _view("a", 1.0, [("solver", 2), ("critic", 30)]),
        _view("b", 0.0, [("solver", 3), ("critic", 1)]),
        _view("c", 0.0, [("solver", 1), ("critic", 1)]),
    ]
    settings = LearnerSettings(estimator="reinforce_baseline", train_agents=["solver"], tensorboard=False)
    per_episode, counts = credited_transitions([views], settings, 0, "tiny")
    assert counts["other_agent"] == 3 and counts["trained"] == 3
    got = [ep[0].advantage for ep in per_episode]
    expected = _openrlhf_advantages(torch.tensor([1.0, 0.0, 0.0]), 3, "reinforce_baseline", [2, 3, 1])
    assert got == pytest.approx([float(e[0]) for e in expected], abs=1e-5)


def test_calls_to_other_models_are_not_trained_but_count_for_the_return():
    from learner.settings import LearnerSettings
    from learner.transitions import credited_transitions

    views = [
        _view("a", 1.0, [("x", 2), ("x", 2, "judge-70b")]),
        _view("b", 0.0, [("x", 2, "policy-v3"), ("x", 2)]),
    ]
    per_episode, counts = credited_transitions([views], LearnerSettings(tensorboard=False), 3, "tiny")
    assert counts["other_model"] == 1 and counts["trained"] == 3
    assert [[t.index for t in ep] for ep in per_episode] == [[0], [0, 1]]
    assert per_episode[0][0].advantage == pytest.approx(2**-0.5, abs=1e-6)  # (1 - 0.5) / std([1, 0])


@pytest.mark.parametrize(
    ("request_fields", "held"),
    [
        ({}, False),
        ({"tools": [{"type": "function"}], "tool_choice": "auto"}, False),
        ({"tools": [{"type": "function"}], "tool_choice": "none"}, False),
        ({"response_format": {"type": "text"}}, False),
        ({"structured_outputs": {"regex": "a|b"}}, True),
        ({"guided_json": {"type": "object"}}, True),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, True),
        ({"response_format": {"type": "json_object"}}, True),
        ({"tools": [{"type": "function"}], "tool_choice": "required"}, True),
        (
            {"tools": [{"type": "function"}], "tool_choice": {"type": "function", "function": {"name": "f"}}},
            True,
        ),
    ],
)
def test_calls_sampled_under_a_grammar_are_not_trained(request_fields: dict, held: bool):
    """Their log-probs are those of the masked distribution (tests/test_real_model.py measures the gap on
    real vLLM), which the learner cannot recompute."""
    from learner.transitions import constrained

    assert constrained({"model": "m", "messages": [], **request_fields}) is held
