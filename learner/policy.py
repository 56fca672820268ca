"""The policy being trained: OpenRLHF's `Actor` around a Hugging Face causal LM (with a peft LoRA), its
log-probs under the processing the server sampled with, and one update with OpenRLHF's `PolicyLoss`.

The learner loads the model itself and hands the module to `Actor`: `Actor`'s own loading path only
offers bf16/fp16 weights, and a CPU learner trains a small model in float32. The LoRA is made with the
same `LoraConfig` as `Actor`'s (`TaskType.CAUSAL_LM`, rank, alpha, target modules, no bias).

Log-probs: the server sampled from z' = truncate((z + logit_bias) / T) (vLLM applies logit processors
such as logit_bias before temperature, then top-k and top-p; `rlgate serve` does the same), and with
`--logprobs-mode processed_logprobs` reports log-softmax(z') of the sampled token. The learner computes
log pi(y_j | x, y_<j) from the same z' (OpenRLHF's `log_probs_from_logits` on the processed logits, top-k
and top-p re-applied per row), so its ratios compare like with like. Sampling defaults a server takes from
the model's generation_config.json (when the request names no temperature, top_p or top_k) are not
known to the learner: `default_temperature` stands for the temperature only.

One update (per epoch over a step's samples): gradients of all micro-batches are accumulated, each
micro-batch's loss scaled by the step's totals (OpenRLHF's `batch_num_tokens` / `global_batch_size`),
so the result does not depend on how samples were split; then the gradient norm is clipped and AdamW
steps: torch's (`engine=torch`), or DeepSpeed's engine through OpenRLHF's strategy (`engine=deepspeed`,
`learner._deepspeed`). With K data-parallel ranks (`learner.ranks`) each rank trains its share of the
step; the totals are summed over the ranks and each loss is multiplied by K, because DeepSpeed averages
the ranks' gradients: the step's gradient is the same as one rank's on all the samples.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from learner._openrlhf import (
    Actor,
    PolicyLoss,
    aggregate_loss,
    compute_approx_kl,
    log_probs_from_logits,
    masked_mean,
)
from learner.forward import action_forward, truncate
from learner.ranks import Ranks
from learner.samples import MicroBatch
from learner.settings import LearnerSettings

# OpenRLHF's named importance-correction schemes -> PolicyLoss(level, mode)
IS_SCHEMES = {
    "off": ("off", "mask"),
    "tis": ("token", "clip"),
    "icepop": ("token", "mask"),
    "seq-mask-tis": ("seq", "mask"),
}


@dataclass
class UpdateStats:
    loss: float
    policy_loss: float
    kl: float
    clip_ratio: float
    ppo_kl: float
    rollout_kl: float  # mean(rollout log-prob - learner log-prob) over action tokens
    # The importance weights w = exp(old - rollout) per action token (old: the learner's log-probs before
    # the step's first update), whatever the correction scheme: their mean and max, the mean absolute log
    # gap |old - rollout|, and the fraction outside [is_threshold_low, is_threshold_high] (the tokens TIS
    # clamps and ICEPOP masks).
    is_weight_mean: float
    is_weight_max: float
    logprob_gap: float
    is_outside: float
    is_filter_ratio: float
    entropy: float
    grad_norm: float
    tokens: int
    samples: int


def processed_log_probs(logits: torch.Tensor, batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs of tokens[1:], the processed logits) under each row's logit_bias, temperature, top-k and
    top-p. `logits` [B, L, V] float32 (position j predicts token j+1); returns [B, L-1] and [B, L-1, V]."""
    z = logits[:, :-1, :]
    if batch.logit_bias:
        bias = torch.zeros((z.shape[0], z.shape[-1]), dtype=z.dtype, device=z.device)
        for row, token, value in batch.logit_bias:
            if 0 <= token < z.shape[-1]:
                bias[row, token] += value
        z = z + bias[:, None, :]
    z = z / batch.temperature[:, None, None].to(device=z.device, dtype=z.dtype)
    targets = batch.sequences[:, 1:].to(z.device)
    if bool((batch.top_k > 0).any()) or bool((batch.top_p < 1).any()):
        z = _truncate(z, batch.top_k.tolist(), batch.top_p.tolist(), targets)
    return log_probs_from_logits(z, targets), z


def _truncate(z: torch.Tensor, top_k: list[int], top_p: list[float], targets: torch.Tensor) -> torch.Tensor:
    """`learner.forward.truncate` on every position of z [B, L-1, V], each row's top-k and top-p."""
    rows, positions, vocab = z.shape
    per_position = torch.tensor(top_k, device=z.device).repeat_interleave(positions)
    p_per_position = torch.tensor(top_p, dtype=torch.float32, device=z.device).repeat_interleave(positions)
    flat = truncate(z.reshape(-1, vocab), per_position, p_per_position, targets.reshape(-1))
    return flat.view(rows, positions, vocab)


def masked_entropy(z: torch.Tensor) -> float:
    """Mean entropy -sum p log p of the processed distributions z [N, V] of the action positions."""
    with torch.no_grad():
        if not len(z):
            return 0.0
        logp = torch.log_softmax(z.float(), dim=-1)
        return float(-(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1).mean())


class Policy:
    """The trainable policy and its optimizer (this rank's, with `ranks`; see the module docstring)."""

    def __init__(self, settings: LearnerSettings, ranks: Ranks | None = None) -> None:
        self.settings = settings
        self.ranks = ranks or Ranks()
        device = settings.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = (
            torch.device("cuda", self.ranks.local_rank) if device == "cuda" else torch.device(device)
        )
        torch.manual_seed(settings.seed)
        dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16
        # a local folder, or a Hugging Face Hub id: taken from the Hugging Face cache (where vLLM downloads it
        # in compose), downloaded into it when missing (unless HF_HUB_OFFLINE=1)
        local = Path(settings.model).is_dir()
        base = AutoModelForCausalLM.from_pretrained(
            str(settings.model), local_files_only=local, dtype=dtype, attn_implementation="sdpa"
        )
        base.config.use_cache = False
        self.pad_token_id = base.config.pad_token_id if base.config.pad_token_id is not None else 0
        self.lora = settings.finetune == "lora"
        self.reference = None
        if self.lora:
            from peft import LoraConfig, TaskType, get_peft_model

            base.enable_input_require_grads()
            config = LoraConfig(
                task_type=TaskType.CAUSAL_LM,
                r=settings.lora_rank,
                lora_alpha=settings.lora_alpha,
                target_modules=list(settings.lora_target_modules),
                lora_dropout=0.0,
                bias="none",
            )
            model: torch.nn.Module = get_peft_model(base, config)
        else:
            model = base
            if settings.kl_coef > 0:  # a frozen copy of the initial weights for the KL term
                self.reference = Actor(copy.deepcopy(base).requires_grad_(False).eval())
                self.reference.packing_samples = False
                self.reference.to(self.device)
        self.actor = Actor(model)
        self.actor.packing_samples = False
        self.actor.to(self.device)
        self.trainable = [p for p in self.actor.parameters() if p.requires_grad]
        self.deepspeed = None
        if settings.engine == "deepspeed":
            from learner._deepspeed import DeepSpeedEngine

            self.deepspeed = DeepSpeedEngine(
                self.actor,
                self.device,
                zero_stage=settings.zero_stage,
                learning_rate=settings.learning_rate,
                weight_decay=settings.weight_decay,
                max_grad_norm=settings.max_grad_norm,
                seed=settings.seed,
            )
            self.actor = self.deepspeed.actor  # its module is now the DeepSpeed engine
        else:
            self.optimizer = torch.optim.AdamW(
                self.trainable, lr=settings.learning_rate, weight_decay=settings.weight_decay
            )
        # raw_logprobs are not of the distribution sampled from: no importance correction against them
        level, mode = IS_SCHEMES[
            "off" if settings.logprobs_mode == "raw_logprobs" else settings.is_correction
        ]
        self.loss_fn = PolicyLoss(
            clip_eps_low=settings.clip_eps_low,
            clip_eps_high=settings.clip_eps_high,
            dual_clip=settings.dual_clip,
            token_level_loss=settings.token_level_loss,
            policy_loss_type=settings.policy_loss,
            is_correction_level=level,
            is_correction_mode=mode,
            is_correction_threshold=[settings.is_threshold_low, settings.is_threshold_high],
        )

    @property
    def peft_model(self) -> Any:
        """The Hugging Face (peft) model itself, inside the DeepSpeed engine if there is one."""
        return getattr(self.actor.model, "module", self.actor.model)

    def _log_probs(self, batch: MicroBatch, actor: Actor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs [B, L-1] of tokens[1:], zero off the action mask where `forward` is not `full`; the
        processed logits of the action positions [N, V]), by the `forward` setting's pass."""
        actor = actor or self.actor
        forward = self.settings.forward
        if forward != "full":
            result = action_forward(actor.model, batch, self.device, share_prefix=forward == "shared-prefix")
            return result.log_probs, result.z
        output = actor(
            batch.sequences.to(self.device),
            attention_mask=batch.attention_mask.to(self.device),
            return_output=True,
        )
        log_probs, z = processed_log_probs(output["logits"], batch)
        return log_probs, z[batch.action_mask.to(z.device)]

    @torch.no_grad()
    def log_probs(self, batch: MicroBatch, reference: bool = False) -> torch.Tensor:
        """Log-probs of tokens[1:] without gradients; `reference`: of the initial policy (the base model:
        the adapter disabled, or the frozen copy when every weight trains)."""
        self.actor.eval()
        if reference and not self.lora:
            assert self.reference is not None, "the reference model exists only with kl_coef > 0"
            return self._log_probs(batch, self.reference)[0]
        context = self.peft_model.disable_adapter() if reference else contextlib.nullcontext()
        with context:
            return self._log_probs(batch)[0]

    def update(
        self, batches: list[MicroBatch], old_log_probs: list[torch.Tensor] | None = None
    ) -> UpdateStats:
        """One optimizer step over `batches` (gradient accumulation). `old_log_probs` (per micro-batch) are
        the policy's log-probs before this step's first update; None means this is that first update and
        the current log-probs (detached) are the old ones.

        With K ranks, `batches` are this rank's (every rank runs as many: `Ranks.pad`): the step's totals
        N (action tokens) and S (samples with an action token) are summed over the ranks, each
        micro-batch's loss is OpenRLHF's `aggregate_loss` with `dp_size=K` (token level: sum of its
        masked per-token losses / N * K), and DeepSpeed's average of the ranks' gradients is then the
        gradient of sum over all micro-batches / N. The returned statistics are the step's: the losses
        summed over the ranks / K, the token-weighted ones summed, the maximum weight the maximum."""
        s = self.settings
        k = self.ranks.size
        total_tokens, total_samples = (
            int(v)
            for v in self.ranks.sum(
                [
                    sum(b.num_actions for b in batches),
                    sum(1 for b in batches for sample in b.samples if sample.num_actions),
                ]
            )
        )
        if total_tokens == 0:
            raise ValueError("no action tokens to train on")
        references = [self.log_probs(b, reference=True) for b in batches] if s.kl_coef > 0 else None
        self.actor.train()
        if self.deepspeed is None:
            self.optimizer.zero_grad(set_to_none=True)
        sums = dict(
            loss=0.0,
            policy_loss=0.0,
            kl=0.0,
            clip=0.0,
            ppo_kl=0.0,
            rollout_kl=0.0,
            filt=0.0,
            entropy=0.0,
            w_mean=0.0,
            gap=0.0,
            outside=0.0,
        )
        w_max = 0.0
        for i, batch in enumerate(batches):
            mask = batch.action_mask.to(self.device)
            last = i == len(batches) - 1
            log_probs, z = self._log_probs(batch)
            if not batch.num_actions:  # padding (`Ranks.pad`): no loss, but DeepSpeed reduces on every rank
                self._backward(log_probs.sum() * 0.0, last)
                continue
            old = log_probs.detach() if old_log_probs is None else old_log_probs[i].to(self.device)
            rollout_lp = batch.rollout_logprobs.to(self.device)
            unknown = torch.isnan(rollout_lp)  # calls the server gave no log-probs for: ours before the step
            if bool(unknown.any()):
                rollout_lp = torch.where(unknown, old, rollout_lp)
            policy_loss, clip_ratio, ppo_kl, rollout_kl, filtered = self.loss_fn(
                log_probs,
                old,
                batch.advantages.to(self.device),
                action_mask=mask,
                rollout_log_probs=rollout_lp,
                dp_size=k,
                batch_num_tokens=total_tokens,
                global_batch_size=total_samples,
            )
            loss = policy_loss
            if references is not None:
                kl = compute_approx_kl(log_probs, references[i].to(self.device), kl_estimator=s.kl_estimator)
                # as OpenRLHF's actor aggregates it (`ppo_actor.training_step`: aggregate_loss with the step's
                # loss_batch_info and token_level_loss left at its default): a token mean over the step,
                # whatever the policy loss's reduction
                kl_loss = aggregate_loss(
                    kl, mask, dp_size=k, batch_num_tokens=total_tokens, global_batch_size=total_samples
                )
                loss = loss + s.kl_coef * kl_loss
                sums["kl"] += float(kl_loss.detach())
            self._backward(loss, last)
            sums["loss"] += float(loss.detach())
            sums["policy_loss"] += float(policy_loss.detach())
            share = batch.num_actions / total_tokens  # the micro-batch's share of the step's tokens
            sums["clip"] += float(clip_ratio) * share
            sums["ppo_kl"] += float(ppo_kl) * share
            if rollout_kl is not None:
                sums["rollout_kl"] += float(rollout_kl) * share
                sums["filt"] += float(filtered) * share
            else:
                sums["rollout_kl"] += (
                    float(masked_mean(rollout_lp - log_probs.detach(), mask.float(), dim=None)) * share
                )
            sums["entropy"] += masked_entropy(z) * share
            log_w = (old - rollout_lp).detach()[mask]
            w = log_w.exp()
            sums["w_mean"] += float(w.sum()) / total_tokens
            sums["gap"] += float(log_w.abs().sum()) / total_tokens
            sums["outside"] += (
                float(((w < s.is_threshold_low) | (w > s.is_threshold_high)).sum()) / total_tokens
            )
            w_max = max(w_max, float(w.max()))
        if self.deepspeed is not None:
            grad_norm = self.deepspeed.step()
        else:
            if s.max_grad_norm > 0:
                grad_norm = float(torch.nn.utils.clip_grad_norm_(self.trainable, s.max_grad_norm))
            else:
                grad_norm = float(
                    torch.norm(torch.stack([p.grad.norm() for p in self.trainable if p.grad is not None]))
                )
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        if k > 1:  # the step's numbers, not this rank's
            keys = list(sums)
            sums = dict(zip(keys, self.ranks.sum([sums[key] for key in keys]), strict=True))
            for key in ("loss", "policy_loss", "kl"):
                sums[key] /= k
            [w_max] = self.ranks.max([w_max])
        return UpdateStats(
            loss=sums["loss"],
            policy_loss=sums["policy_loss"],
            kl=sums["kl"],
            clip_ratio=sums["clip"],
            ppo_kl=sums["ppo_kl"],
            rollout_kl=sums["rollout_kl"],
            is_filter_ratio=sums["filt"],
            entropy=sums["entropy"],
            grad_norm=grad_norm,
            is_weight_mean=sums["w_mean"],
            is_weight_max=w_max,
            logprob_gap=sums["gap"],
            is_outside=sums["outside"],
            tokens=total_tokens,
            samples=total_samples,
        )

    def _backward(self, loss: torch.Tensor, last: bool) -> None:
        if self.deepspeed is None:
            loss.backward()
        else:
            self.deepspeed.backward(loss, last)

    # -----------------------------------------------------------------------------------------------------
    # Saving and restoring

    def save_adapter(self, path: Path) -> None:
        """The LoRA adapter as a PEFT folder (adapter_config.json + adapter_model.safetensors)."""
        self.peft_model.save_pretrained(str(path), safe_serialization=True)

    @torch.no_grad()
    def weights(self) -> dict[str, torch.Tensor]:
        """Every weight of the policy under the base model's own parameter names (what an inference server
        loads): the trained weights, or with a LoRA the base weights with the adapter merged in."""
        if not self.lora:
            return {n: p.detach().contiguous() for n, p in self.actor.model.named_parameters()}
        self.peft_model.merge_adapter()
        try:
            merged = {}
            for name, p in self.peft_model.named_parameters():
                if "lora_" in name:
                    continue
                name = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
                merged[name] = p.detach().clone().contiguous()
            return merged
        finally:
            self.peft_model.unmerge_adapter()

    def save_weights(self, path: Path) -> None:
        """`weights()` as one safetensors file (the CPU transport of a full push)."""
        from safetensors.torch import save_file

        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        save_file({n: t.to("cpu") for n, t in self.weights().items()}, str(tmp))
        tmp.replace(path)

    def save(self, directory: Path) -> None:
        """The trainable weights, the optimizer and the RNG into `directory` (DeepSpeed: its checkpoint,
        written by every rank; the RNG state by rank 0, every rank loads it)."""
        directory.mkdir(parents=True, exist_ok=True)
        if self.ranks.leader:
            torch.save({"torch_rng": torch.get_rng_state()}, directory / "rng.pt")
        if self.deepspeed is not None:
            self.deepspeed.save(directory)
            return
        trainable = {n: p.detach().clone() for n, p in self.actor.named_parameters() if p.requires_grad}
        torch.save(
            {"trainable": trainable, "optimizer": self.optimizer.state_dict()}, directory / "policy.pt"
        )

    def load(self, directory: Path) -> None:
        torch.set_rng_state(torch.load(directory / "rng.pt", weights_only=True)["torch_rng"])
        if self.deepspeed is not None:
            self.deepspeed.load(directory)
            return
        state = torch.load(directory / "policy.pt", weights_only=True)
        params = dict(self.actor.named_parameters())
        with torch.no_grad():
            for name, value in state["trainable"].items():
                params[name].copy_(value)
        self.optimizer.load_state_dict(state["optimizer"])
