"""`rlgate learner` settings: flags or RLGATE_LEARNER_* environment variables (the settings every service
shares also from their RLGATE_* names: `rlgate.episodes.settings`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, ClassVar, Literal

from pydantic import BeforeValidator, Field, SecretStr, model_validator
from pydantic_settings import SettingsConfigDict

from rlgate.episodes.settings import (
    SHARED_ENV,
    RedisTimeoutSeconds,
    RetentionSeconds,
    StoreSettings,
)
from rlgate.episodes.store import RETENTION_S

# A model as given (a folder, or a Hub id): text, so that `./tiny` stays a path (a Path would drop the `./`).
ModelRef = Annotated[str, BeforeValidator(lambda value: str(value) if isinstance(value, Path) else value)]


class LearnerSettings(StoreSettings):
    model_config = SettingsConfigDict(env_prefix="RLGATE_LEARNER_", extra="ignore")
    shared_env: ClassVar[dict[str, str]] = {k: v for k, v in SHARED_ENV.items() if k != "redis_timeout_s"}

    # Where episodes come from and where weights go
    # longer than the gateway's 5 s: the learner's reads are whole groups of episodes. Its own variable only
    # (RLGATE_LEARNER_REDIS_TIMEOUT_S): a short RLGATE_REDIS_TIMEOUT_S meant for the gateway does not reach it
    redis_timeout_s: RedisTimeoutSeconds = 10.0
    consumer: str = Field(
        "learner-0",
        description="This learner's name in the consumer group; keep it "
        "stable across restarts, so a restarted learner takes back its own pending episodes.",
    )
    group: str = Field("learners", description="The consumer group of the closed-episode stream.")
    model: ModelRef = Field(
        "model",
        description="The base policy: a local Hugging Face folder, or a Hub id (e.g. "
        "Qwen/Qwen2.5-1.5B-Instruct) taken from the Hugging Face cache and downloaded there when "
        "missing.",
    )
    served_model_name: str | None = Field(
        None,
        description="The name the inference servers serve the base model under (what agents ask "
        "for); default: the model path, as vLLM names it.",
    )
    inference_urls: list[str] = Field(
        ["http://127.0.0.1:8000"],
        description="Every inference server's base URL (no /v1); adapters are loaded on each.",
    )
    inference_api_key: SecretStr | None = Field(
        None,
        description="The inference servers' --api-key (vLLM and rlgate serve guard /v1 with it, the LoRA "
        "routes included).",
    )
    output_dir: Path = Field(
        Path("learner_output"),
        description="Adapters, checkpoints and TensorBoard "
        "logs. The inference servers must read adapters from the same paths.",
    )
    push: Literal["lora", "full"] = Field(
        "lora",
        description="How weights reach the inference servers: lora saves the adapter and loads it as "
        "policy-v{N}; full sends the whole (merged) weights through vLLM's weight-transfer phases, with "
        "the gateways drained and the servers paused meanwhile.",
    )
    push_transport: Literal["safetensors", "nccl"] = Field(
        "safetensors",
        description="Full push: a safetensors file the servers read (rlgate serve; the servers "
        "must see output_dir), or NCCL through vLLM's trainer-side client (vLLM on GPUs; not run yet).",
    )
    push_nccl_address: str = Field(
        "127.0.0.1", description="NCCL transport: this learner's address as the vLLM workers reach it."
    )
    push_nccl_port: int = Field(
        29600, description="NCCL transport: the first rendezvous port (one per server)."
    )
    finetune: Literal["lora", "full"] = Field("lora", description="Train a LoRA adapter, or every weight.")
    push_drain_s: float = Field(
        0.5,
        ge=0,
        description="Full push: how long to wait after telling the "
        "gateways to hold new calls (at least twice their RLGATE_POLICY_POLL_S).",
    )
    outage_s: float = Field(
        300.0,
        ge=0,
        description="How long the learner rides out Redis or every inference server being unreachable "
        "(restarting), retrying with backoff, before it exits (a restart resumes from the checkpoint).",
    )
    server_check_s: float = Field(
        2.0,
        ge=0,
        description="LoRA push: every this many seconds, reload the pointer's adapter on any inference "
        "server whose /v1/models does not list it (a server that restarted); 0: never.",
    )
    resume: bool = Field(
        True,
        description="Continue from the last checkpoint in output_dir when there is one "
        "(its weights, optimizer, step and version; it re-pushes that version). --no-resume "
        "starts fresh from the base weights at version 0.",
    )

    # Steps and groups
    tasks_per_step: int = Field(8, ge=1, description="Task groups per training step.")
    rollouts_per_task: int = Field(8, ge=1, description="Closed episodes a task needs to form its group.")
    max_group_wait_s: float = Field(
        60.0,
        gt=0,
        description="An incomplete group trains after waiting this long if it has at least two episodes.",
    )
    singleton_groups: Literal["drop", "keep"] = Field(
        "drop",
        description="A group of one episode (no task id, or alone after the wait) has no baseline: "
        "drop it (acknowledged, counted) or keep it with advantage = its return.",
    )
    success_threshold: float = Field(
        1.0, description="An episode counts as a success in the logs when its return is at least this."
    )
    retention_s: RetentionSeconds = RETENTION_S
    max_steps: int = Field(0, ge=0, description="Stop after this many steps (0: run until stopped).")

    # Credit and advantages
    train_agents: list[str] = Field(
        default_factory=list,
        description="Only these agents' calls are "
        "trained (X-Agent-Name); empty: all. Others still count for the return.",
    )
    credit: Literal["identical", "discounted", "last_only"] = "identical"
    gamma: float = Field(1.0, ge=0, le=1)
    intermediate_rewards: bool = Field(
        False,
        description="Add the returns-to-go of per-call rewards "
        "(webhook and automatic) to each call's credit.",
    )
    estimator: Literal["group_norm", "rloo", "reinforce_baseline", "dr_grpo"] = "group_norm"
    stats_over: Literal["episodes", "transitions"] = "episodes"
    dynamic_filtering: bool = Field(
        False,
        description="DAPO's dynamic sampling (OpenRLHF's --dynamic_filtering): a task group whose "
        "episodes all have the same reward carries no group-relative signal and is acknowledged untrained; a "
        "step waits for tasks_per_step groups whose rewards differ. Keeps a nearly solved task from "
        "training on its rare failures alone (AdamW scales that tiny gradient to a full step).",
    )
    sample_shape: Literal["transition", "trajectory"] = "transition"
    max_staleness: int = Field(
        4,
        ge=0,
        description="Calls served by a policy more than this many versions "
        "older than the one being trained are dropped.",
    )
    logprobs_mode: Literal["processed_logprobs", "raw_logprobs"] = Field(
        "processed_logprobs",
        description="What the inference servers' log-probs are (vLLM's --logprobs-mode; "
        "vLLM defaults to raw_logprobs). processed_logprobs: of the distribution sampled from (after "
        "logit_bias and temperature), what the importance correction needs. raw_logprobs: of the raw "
        "logits; the importance correction against them is turned off (is_correction is ignored).",
    )
    logprob_check_tolerance: float = Field(
        0.5,
        ge=0,
        description="On the first step with calls served by the learner's current weights, the "
        "learner recomputes their log-probs; a mean absolute gap above this (nats per token) stops it with "
        "an error naming the likely cause (0: no check).",
    )
    default_temperature: float = Field(
        1.0,
        gt=0,
        description="The temperature a call was sampled with "
        "when its request named none (the server's default).",
    )

    # The update
    lora_rank: int = Field(8, ge=1)
    lora_alpha: int = Field(16, ge=1)
    lora_target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    learning_rate: float = Field(5e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(1.0, ge=0, description="Gradient clipping (0: off).")
    epochs_per_step: int = Field(1, ge=1, description="Passes over a step's samples.")
    micro_batch_tokens: int = Field(8192, ge=1, description="Padded tokens per micro-batch.")
    forward: Literal["shared-prefix", "actions", "full"] = Field(
        "shared-prefix",
        description="How a micro-batch's log-probs are computed (learner.forward). full: OpenRLHF's Actor, "
        "the output head at every position; actions: the head at the action positions only; shared-prefix: "
        "that, and the prefix all rows share (system message, tools) run once and its cache repeated for "
        "each row. The same log-probs and gradients up to float rounding.",
    )
    policy_loss: Literal["ppo", "gspo"] = "ppo"
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.28
    dual_clip: float | None = None
    token_level_loss: bool = True
    kl_coef: float = Field(0.0, ge=0, description="KL penalty against the frozen base policy (0: none).")
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    is_correction: Literal["off", "tis", "icepop", "seq-mask-tis"] = Field(
        "tis", description="Importance correction against the rollout log-probs (OpenRLHF's options)."
    )
    is_threshold_low: float = 0.5
    is_threshold_high: float = 5.0
    engine: Literal["torch", "deepspeed"] = Field(
        "torch",
        description="torch: AdamW in this process; deepspeed: OpenRLHF's DeepspeedStrategy (ZeRO "
        "stage `zero_stage`, gloo on a CPU, nccl on a GPU), in one process or in several data-parallel "
        "ranks started by torchrun or DeepSpeed's launcher.",
    )
    zero_stage: int = Field(
        1, ge=0, le=3, description="DeepSpeed ZeRO stage (engine=deepspeed; 0-2 with several ranks)."
    )
    dist_timeout_s: float = Field(
        600.0,
        gt=0,
        description="Several ranks: how long a rank waits in a collective for the others before the "
        "step fails (a rank that dies is noticed at once on gloo).",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="Where the policy trains (auto: cuda "
        "if available); bf16 weights on a GPU, float32 on the CPU.",
    )
    seed: int = 0
    threads: int = Field(0, ge=0, description="torch threads (0: torch's default).")
    tensorboard: bool = True

    @model_validator(mode="after")
    def _push_matches_finetune(self) -> LearnerSettings:
        if self.push == "lora" and self.finetune == "full":
            raise ValueError("--push lora needs --finetune lora (full fine-tuning has no adapter to push)")
        if self.dynamic_filtering and self.rollouts_per_task < 2:
            raise ValueError(
                "--dynamic-filtering needs --rollouts-per-task of at least 2 (a group to compare)"
            )
        if self.dynamic_filtering and self.intermediate_rewards:
            raise ValueError(
                "--dynamic-filtering looks at episodes' final rewards only; with --intermediate-rewards a "
                "group of equal final rewards can still carry signal: use one or the other"
            )
        return self
