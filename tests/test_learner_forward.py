"""The learner's forward passes (`learner.forward`): the output head on the action positions only, and the
prefix the rows share run once, give the log-probs and the update of OpenRLHF's full pass."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch

pytest.importorskip("openrlhf")

from learner.forward import MIN_SHARED, action_forward, shared_prefix  # noqa: E402
from learner.policy import Policy  # noqa: E402
from learner.samples import Transition, build_samples, collate, micro_batches  # noqa: E402
from learner.settings import LearnerSettings  # noqa: E402
from rlgate.inference.tiny_model import build_tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # grouped-query attention (4 heads, 2 key/value heads), as real models have
    return build_tiny_model(tmp_path_factory.mktemp("forward") / "tiny", seed=3, num_heads=2, num_kv_heads=1)


def agent_episodes(groups: int = 3, per_group: int = 4, seed: int = 0) -> list[list[Transition]]:
    """Two-call episodes as an agent makes them: one system prompt for all, a question per group, a
    completion, a tool result, a second completion; sampled with top-p, temperature and a logit bias."""
    rng = random.Random(seed)
    system = [rng.randrange(256) for _ in range(24)]
    episodes = []
    for g in range(groups):
        question = [rng.randrange(256) for _ in range(rng.randint(5, 9))]
        for r in range(per_group):
            rollout = f"g{g}r{r}"
            first = [rng.randrange(256) for _ in range(rng.randint(3, 7))]
            tool = [rng.randrange(256) for _ in range(4)]
            second = [rng.randrange(256) for _ in range(rng.randint(2, 5))]
            advantage = 1.0 if r % 2 else -1.0
            common = dict(policy_version=0, temperature=0.7, logit_bias=((7, 2.5),), top_k=40, top_p=0.9)
            prompt = system + question
            episodes.append(
                [
                    Transition(
                        rollout, 0, tuple(prompt), tuple(first), (-3.0,) * len(first), advantage, **common
                    ),
                    Transition(
                        rollout,
                        1,
                        tuple(prompt + first + tool),
                        tuple(second),
                        (-3.0,) * len(second),
                        advantage,
                        **common,
                    ),
                ]
            )
    return episodes


def policy(tiny: Path, forward: str) -> Policy:
    return Policy(LearnerSettings(model=tiny, tensorboard=False, learning_rate=1e-2, forward=forward, seed=5))


def test_the_shared_prefix_stops_at_the_first_difference_and_before_any_action():
    batch = collate(build_samples(agent_episodes(), "trajectory"), 0)
    assert shared_prefix(batch) == 24  # the system prompt; the questions differ
    one_group = collate(build_samples(agent_episodes(groups=1), "trajectory"), 0)
    first_action = int(one_group.action_mask.float().argmax(-1).min())
    assert shared_prefix(one_group) == first_action  # system + question, up to the first completion
    one_row = build_samples(agent_episodes(groups=1, per_group=1), "trajectory")
    assert len(one_row) == 1 and shared_prefix(collate(one_row, 0)) == 0


@pytest.mark.parametrize("shape", ["transition", "trajectory"])
def test_every_forward_gives_the_full_passs_log_probs(tiny: Path, shape: str):
    """With a trained adapter (so that the LoRA is in the sums), on batches with a shared prefix."""
    trained = policy(tiny, "full")
    [batch] = micro_batches(build_samples(agent_episodes(), shape), 100_000, trained.pad_token_id)
    trained.update([batch])
    full = trained.log_probs(batch)
    mask = batch.action_mask
    for forward in ("actions", "shared-prefix"):
        trained.settings.forward = forward  # type: ignore[assignment]
        got = trained.log_probs(batch)
        assert torch.allclose(got[mask], full[mask], atol=2e-5), forward
        assert not got[~mask].any()  # nothing computed off the actions
    result = action_forward(trained.actor.model, batch, trained.device)
    assert result.shared >= MIN_SHARED and result.z.shape == (int(mask.sum()), 261)
    assert torch.isinf(result.z).any()  # top-k 40 and top-p 0.9 cut tokens at every position


def test_an_update_through_the_shared_prefix_is_the_full_passs_update(tiny: Path):
    """Same initial weights, same batches: the loss, the statistics and every trained weight after two
    steps agree within float rounding, so the prefix's gradient flows back from every row."""
    samples = build_samples(agent_episodes(groups=2, per_group=4, seed=1), "trajectory")
    outcomes = {}
    for forward in ("full", "shared-prefix"):
        p = policy(tiny, forward)
        initial = {n: t.detach().clone() for n, t in p.actor.named_parameters() if t.requires_grad}
        batches = micro_batches(samples, 100_000, p.pad_token_id)
        stats = [p.update(batches) for _ in range(2)]
        weights = {n: t.detach().clone() for n, t in p.actor.named_parameters() if t.requires_grad}
        outcomes[forward] = (stats, weights)
    (full_stats, full_weights), (shared_stats, shared_weights) = outcomes["full"], outcomes["shared-prefix"]
    for a, b in zip(full_stats, shared_stats, strict=True):
        assert a.loss == pytest.approx(b.loss, abs=1e-5)
        assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-4)
        assert a.entropy == pytest.approx(b.entropy, rel=1e-4)
        assert a.tokens == b.tokens
    assert full_stats[1].grad_norm > 0
    # AdamW's first steps are about lr * sign(gradient) per weight, so a weight whose gradient is ~0 may move
    # either way: compare each tensor's difference with how far the update moved it
    for name, weight in full_weights.items():
        moved = float((weight - initial[name]).abs().max())
        differs = float((shared_weights[name] - weight).abs().max())
        assert moved > 0 and differs <= 0.02 * moved, name


def test_prefix_aware_micro_batches_keep_shared_prefixes_together_within_the_budget():
    """Calls of an agent with two different system prompts (its tool call, then a reflection without the
    tools): in token order each micro-batch holds one kind, and costs its common prefix once."""
    from learner.samples import prefix_cost

    episodes = agent_episodes(groups=4, per_group=4)
    reflections = [
        [dataclasses.replace(call, prompt_ids=(99,) * 10 + call.prompt_ids[24:]) for call in episode]
        for episode in agent_episodes(groups=4, per_group=4, seed=9)
    ]
    samples = build_samples(episodes + reflections, "transition")
    budget = 400
    batches = micro_batches(samples, budget, 0, share_prefix=True)
    assert sorted(tuple(s.tokens) for b in batches for s in b.samples) == sorted(
        tuple(s.tokens) for s in samples
    )
    for batch in batches:
        assert len(batch.samples) == 1 or prefix_cost(batch.samples) <= budget
        assert len({tuple(s.tokens[:10]) for s in batch.samples}) == 1  # one system prompt per micro-batch
    padded = micro_batches(samples, budget, 0)
    assert len(batches) < len(padded)  # the shared prefix counted once fits more rows in each
