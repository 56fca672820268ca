"""The policy update on a real tiny model: OpenRLHF's Actor and PolicyLoss, our processed log-probs."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("openrlhf")

from learner._openrlhf import PolicyLoss  # noqa: E402
from learner.policy import Policy, processed_log_probs  # noqa: E402
from learner.samples import Transition, build_samples, collate, micro_batches  # noqa: E402
from learner.settings import LearnerSettings  # noqa: E402
from rlgate.inference.tiny_model import build_tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("learner_policy") / "tiny", seed=1)


def settings(model: Path, **kw) -> LearnerSettings:
    return LearnerSettings(**{"model": model, "tensorboard": False, "learning_rate": 1e-2, **kw})


def transitions(n: int = 6, bias=()) -> list[list[Transition]]:
    g = torch.Generator().manual_seed(0)
    episodes = []
    for i in range(n):
        prompt = torch.randint(0, 256, (4 + i,), generator=g).tolist()
        completion = torch.randint(0, 256, (2 + i % 3,), generator=g).tolist()
        episodes.append(
            [
                Transition(
                    f"r{i}",
                    0,
                    tuple(prompt),
                    tuple(completion),
                    tuple([-5.5] * len(completion)),
                    1.0 if i % 2 else -1.0,
                    0,
                    0.7,
                    bias,
                )
            ]
        )
    return episodes


def openrlhf_loss(log_probs, old_log_probs, batch, rollout_log_probs=None) -> tuple:
    """OpenRLHF's PolicyLoss as `is_correction="tis"` and the default settings configure it (clip 0.2 / 0.28,
    token-level TIS weights clamped to [0.5, 5]), called directly on one micro-batch's tensors: its outputs
    (loss, clip ratio, ...). `rollout_log_probs` defaults to the batch's."""
    reference = PolicyLoss(
        clip_eps_low=0.2,
        clip_eps_high=0.28,
        is_correction_level="token",
        is_correction_mode="clip",
        is_correction_threshold=[0.5, 5.0],
    )
    return reference(
        log_probs,
        old_log_probs,
        batch.advantages,
        action_mask=batch.action_mask,
        rollout_log_probs=batch.rollout_logprobs if rollout_log_probs is None else rollout_log_probs,
    )


def test_processed_log_probs_are_log_softmax_of_biased_tempered_logits():
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 7)
    [a], [b] = (
        build_samples([[Transition("r", 0, (1, 2), (3, 4), (0.0, 0.0), 1.0, 0, 0.5, ((3, 2.0),))]]),
        build_samples([[Transition("q", 0, (5, 6), (1, 0), (0.0, 0.0), 1.0, 0, 2.0, ())]]),
    )
    batch = collate([a, b], pad_token_id=0)
    got, _ = processed_log_probs(logits.clone(), batch)
    z0 = logits[0, :-1].clone()
    z0[:, 3] += 2.0
    want0 = torch.log_softmax(z0 / 0.5, -1).gather(-1, batch.sequences[0, 1:, None]).squeeze(-1)
    want1 = torch.log_softmax(logits[1, :-1] / 2.0, -1).gather(-1, batch.sequences[1, 1:, None]).squeeze(-1)
    assert torch.allclose(got[0], want0, atol=1e-5) and torch.allclose(got[1], want1, atol=1e-5)


def test_one_update_changes_the_lora_weights_with_a_finite_loss(tiny: Path):
    policy = Policy(settings(tiny))
    before = {n: p.detach().clone() for n, p in policy.actor.named_parameters()}
    batches = micro_batches(build_samples(transitions()), 64, policy.pad_token_id)
    assert len(batches) > 1
    stats = policy.update(batches)
    assert torch.isfinite(torch.tensor(stats.loss)) and stats.grad_norm > 0
    assert stats.tokens == sum(b.num_actions for b in batches) and stats.samples == 6
    changed = [n for n, p in policy.actor.named_parameters() if not torch.equal(p, before[n])]
    assert changed and all("lora_" in n for n in changed)  # only the adapter trains


def test_the_update_does_not_depend_on_the_micro_batch_split(tiny: Path):
    samples = build_samples(transitions())
    results = []
    for budget in (10_000, 40):
        torch.manual_seed(0)
        policy = Policy(settings(tiny, max_grad_norm=0.0))
        # plain SGD with lr 1: the parameter change is the gradient (Adam's first step is ~lr * sign(g),
        # which turns float noise in zero gradients into full steps)
        policy.optimizer = torch.optim.SGD(policy.trainable, lr=1.0)
        stats = policy.update(micro_batches(samples, budget, policy.pad_token_id))
        results.append(
            (
                stats.loss,
                {n: p.detach().clone() for n, p in policy.actor.named_parameters() if p.requires_grad},
            )
        )
    (loss_a, params_a), (loss_b, params_b) = results
    assert abs(loss_a - loss_b) < 1e-5
    assert all(torch.allclose(params_a[n], params_b[n], atol=1e-6) for n in params_a)
    initial = Policy(settings(tiny)).actor.state_dict()
    assert any(not torch.equal(params_a[n], initial[n]) for n in params_a)


def test_policy_loss_is_openrlhfs_with_token_level_reduction(tiny: Path):
    """The learner's loss on one micro-batch equals PolicyLoss called directly on the same tensors."""
    policy = Policy(settings(tiny, is_correction="tis"))
    [batch] = micro_batches(build_samples(transitions(3)), 10_000, policy.pad_token_id)
    log_probs = policy.log_probs(batch)
    want = openrlhf_loss(log_probs, log_probs, batch)[0]
    # token-level loss over all action tokens: masked mean of -ratio * A * clip(is_weight) (ratio 1)
    is_weight = (log_probs - batch.rollout_logprobs).exp().clamp(0.5, 5.0)
    manual = (-(batch.advantages * is_weight) * batch.action_mask).sum() / batch.action_mask.sum()
    assert torch.allclose(want, manual, atol=1e-5)
    stats = policy.update([batch])
    assert abs(stats.policy_loss - float(want)) < 1e-5


def test_save_and_load_restore_weights_and_optimizer(tiny: Path, tmp_path: Path):
    policy = Policy(settings(tiny))
    policy.update(micro_batches(build_samples(transitions()), 10_000, policy.pad_token_id))
    policy.save(tmp_path / "state")
    other = Policy(settings(tiny))
    other.load(tmp_path / "state")
    for (n, p), (_, q) in zip(policy.actor.named_parameters(), other.actor.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    assert other.optimizer.state_dict()["state"].keys() == policy.optimizer.state_dict()["state"].keys()
    # the next update is the same from both
    batches = micro_batches(build_samples(transitions()), 10_000, policy.pad_token_id)
    assert policy.update(batches).loss == pytest.approx(other.update(batches).loss, abs=1e-6)


def test_full_finetuning_trains_every_weight(tiny: Path):
    policy = Policy(settings(tiny, finetune="full", push="full", kl_coef=0.1))
    before = {n: p.detach().clone() for n, p in policy.actor.named_parameters()}
    stats = policy.update(micro_batches(build_samples(transitions()), 10_000, policy.pad_token_id))
    assert stats.kl == pytest.approx(0.0, abs=1e-6)  # the reference is the initial policy: no KL yet
    changed = [n for n, p in policy.actor.named_parameters() if not torch.equal(p, before[n])]
    assert len(changed) == len(before)
    assert "lora" not in "".join(changed)


def test_merged_weights_reproduce_the_lora_policy(tiny: Path, tmp_path: Path):
    """What a full push sends for a LoRA policy: the base weights with the adapter merged, under the base
    model's own names; loaded into a plain model they give the policy's log-probs."""
    from transformers import AutoModelForCausalLM

    policy = Policy(settings(tiny))
    batches = micro_batches(build_samples(transitions()), 10_000, policy.pad_token_id)
    for _ in range(3):
        policy.update(batches)
    policy.save_weights(tmp_path / "w.safetensors")
    from safetensors.torch import load_file

    plain = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(load_file(str(tmp_path / "w.safetensors")), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embeddings
    [batch] = batches
    with torch.no_grad():
        logits = plain(
            batch.sequences,
            attention_mask=batch.attention_mask,
            position_ids=(batch.attention_mask.cumsum(-1) - 1).clamp(min=0),
        ).logits.float()
    ours = policy.log_probs(batch)
    theirs = processed_log_probs(logits, batch)[0]
    mask = batch.action_mask
    assert torch.allclose(ours[mask], theirs[mask], atol=1e-4)
    base = policy.log_probs(batch, reference=True)
    assert not torch.allclose(ours[mask], base[mask], atol=1e-3)  # the adapter did change the policy


def test_a_clipped_second_epoch_is_openrlhfs_loss_against_the_step_start(tiny: Path):
    """epochs_per_step 2: the second pass's ratios are against the log-probs before the step's first
    update, and large enough to clip; its loss and clip fraction are PolicyLoss's on the same tensors."""
    policy = Policy(settings(tiny, learning_rate=0.05, is_correction="tis"))
    [batch] = micro_batches(build_samples(transitions(4)), 10_000, policy.pad_token_id)
    old = policy.log_probs(batch)
    policy.update([batch], [old])
    now = policy.log_probs(batch)
    want, clip_ratio = openrlhf_loss(now, old, batch)[:2]
    assert float(clip_ratio) > 0.1  # the case is clipped
    stats = policy.update([batch], [old])
    assert stats.policy_loss == pytest.approx(float(want), abs=1e-5)
    assert stats.clip_ratio == pytest.approx(float(clip_ratio), abs=1e-6)


@pytest.mark.parametrize("token_level", [True, False])
def test_the_kl_term_is_a_token_mean_over_the_step_as_openrlhf_aggregates_it(tiny: Path, token_level: bool):
    """OpenRLHF 0.11.2's actor (`ppo_actor.training_step`) calls `aggregate_loss(kl, action_mask,
    **loss_batch_info)`: loss_batch_info carries only dp_size, batch_num_tokens and global_batch_size, so
    the KL is a token mean over the step whatever `token_level_loss` says for the policy loss."""
    from learner._openrlhf import aggregate_loss

    policy = Policy(settings(tiny, kl_coef=0.1, token_level_loss=token_level))
    batches = micro_batches(build_samples(transitions()), 40, policy.pad_token_id)
    assert len(batches) > 1
    policy.update(batches)  # away from the reference (the adapter starts as the identity)
    tokens = sum(b.num_actions for b in batches)
    samples = sum(len(b.samples) for b in batches)
    want, per_sample = 0.0, []
    for b in batches:
        log_ratio = policy.log_probs(b) - policy.log_probs(b, reference=True)
        k3 = (-log_ratio).exp() - 1 + log_ratio  # Schulman's k3 of KL(pi || ref)
        # called as ppo_actor calls it, micro-batch by micro-batch with the step's totals
        want += float(
            aggregate_loss(k3, b.action_mask, dp_size=1, batch_num_tokens=tokens, global_batch_size=samples)
        )
        per_sample += ((k3 * b.action_mask).sum(-1) / b.action_mask.sum(-1)).tolist()
    assert abs(want - sum(per_sample) / len(per_sample)) > 1e-3 * want > 0  # the reductions differ here
    stats = policy.update(batches)
    assert stats.kl == pytest.approx(want, rel=1e-4)


def test_importance_weight_statistics_are_logged(tiny: Path):
    """Per step: the mean and max of exp(old - rollout) over action tokens, the mean |log gap| and the
    fraction outside the IS thresholds (what TIS clamps, ICEPOP masks)."""
    policy = Policy(settings(tiny))
    [batch] = micro_batches(build_samples(transitions()), 10_000, policy.pad_token_id)
    n = int(batch.action_mask.sum())  # rollout log-probs on both sides of the learner's ~ -5.5
    batch.rollout_logprobs[batch.action_mask] = torch.tensor([-1.0, -5.6, -9.0] * n)[:n]
    log_w = (policy.log_probs(batch) - batch.rollout_logprobs)[batch.action_mask]
    w = log_w.exp()
    stats = policy.update([batch])
    assert stats.is_weight_mean == pytest.approx(float(w.mean()), rel=1e-5)
    assert stats.is_weight_max == pytest.approx(float(w.max()), rel=1e-5)
    assert stats.logprob_gap == pytest.approx(float(log_w.abs().mean()), rel=1e-5)
    assert stats.is_outside == pytest.approx(float(((w < 0.5) | (w > 5.0)).float().mean()), abs=1e-6)
    assert 0 < stats.is_outside < 1 and stats.is_weight_max > 5


def test_raw_logprobs_mode_turns_the_importance_correction_off(tiny: Path):
    policy = Policy(settings(tiny, logprobs_mode="raw_logprobs", is_correction="icepop"))
    assert policy.loss_fn.is_correction_level == "off"


def test_a_call_without_server_logprobs_trains_with_importance_weight_one(tiny: Path):
    """vLLM's Responses API gives no log-probs for an answer of tool calls only: such a call trains with
    the learner's own pre-update log-probs as the sampler's, judged by OpenRLHF's PolicyLoss with TIS."""
    policy = Policy(settings(tiny, is_correction="tis"))
    episodes = transitions(3)
    episodes[1] = [
        dataclasses.replace(episodes[1][0], rollout_logprobs=(math.nan,) * len(episodes[1][0].completion_ids))
    ]
    [batch] = micro_batches(build_samples(episodes), 10_000, policy.pad_token_id)
    log_probs = policy.log_probs(batch)
    unknown = torch.isnan(batch.rollout_logprobs)
    assert unknown.any() and not unknown[0].any()
    want = openrlhf_loss(
        log_probs, log_probs, batch, torch.where(unknown, log_probs, batch.rollout_logprobs)
    )[0]
    stats = policy.update([batch])
    assert math.isfinite(stats.loss) and abs(stats.policy_loss - float(want)) < 1e-5
    mask = batch.action_mask & ~unknown
    w = (log_probs - batch.rollout_logprobs).exp()[mask]
    # the unknown tokens count with weight 1
    assert stats.is_weight_mean == pytest.approx(
        float((w.sum() + (batch.action_mask & unknown).sum()) / batch.action_mask.sum()), rel=1e-5
    )


def test_deepspeed_applies_every_micro_batchs_gradient_as_torch_does(tiny: Path):
    """`--engine deepspeed` over several micro-batches: the same loss, gradient norm and update as torch's
    AdamW. (DeepSpeed's one-micro-batch config makes every backward an accumulation boundary unless told
    otherwise, and ZeRO-1 then kept only the last micro-batch's gradient.)"""
    pytest.importorskip("deepspeed")
    import os

    import torch.distributed as dist

    samples = build_samples(transitions(10))
    results = {}
    environ = dict(os.environ)
    try:
        for engine in ("torch", "deepspeed"):
            policy = Policy(settings(tiny, engine=engine, zero_stage=1))
            batches = micro_batches(samples, 60, policy.pad_token_id)
            assert len(batches) >= 3
            stats = policy.update(batches)
            params = {
                n: p.detach().clone() for n, p in policy.peft_model.named_parameters() if p.requires_grad
            }
            results[engine] = stats, params
    finally:  # the group of one and its launcher variables (MASTER_PORT...) must not reach later subprocesses
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)
    (torch_stats, torch_params), (ds_stats, ds_params) = results["torch"], results["deepspeed"]
    assert ds_stats.loss == pytest.approx(torch_stats.loss, abs=1e-6)
    assert ds_stats.grad_norm == pytest.approx(torch_stats.grad_norm, rel=1e-5) and ds_stats.grad_norm > 0
    assert torch_params.keys() == ds_params.keys()
    assert all(torch.allclose(torch_params[n], ds_params[n], atol=1e-5) for n in torch_params)
