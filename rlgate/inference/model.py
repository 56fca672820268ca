"""The model behind `rlgate serve`: loading a Hugging Face folder, rendering chat prompts, mapping request
sampling fields to the engine's, and applying stop strings to what the engine returns."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import structlog
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from rlgate.inference.access import WeightsRoot
from rlgate.inference.detokenize import Detokenizer
from rlgate.inference.engine import Completion, Engine, LogprobsMode, SamplingParams
from rlgate.inference.lora import Adapters
from rlgate.inference.protocol import BadRequest, ModelNotFound, SamplingFields
from rlgate.inference.scheduler import Scheduler
from rlgate.inference.weights import WeightSync

log = structlog.get_logger("rlgate.serve")


@dataclass
class Output:
    """One finished choice after stop strings: what the response reports."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    text: str
    finish_reason: str
    stop_reason: str | int | None


class Model:
    """The loaded model, its tokenizer and the batching scheduler behind the endpoints."""

    def __init__(
        self,
        model_dir: Path,
        served_model_name: str | None,
        batch_window_s: float,
        logprobs_mode: LogprobsMode = "raw_logprobs",
        weights_root: Path | None = None,
    ) -> None:
        self.path = str(model_dir)
        # where clients may name adapters and weight files (inference.access): by default the model's parent
        self.weights_root = root = WeightsRoot(
            weights_root if weights_root is not None else Path(model_dir).resolve().parent
        )
        self.name = served_model_name or str(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
        eos = {self.tokenizer.eos_token_id} - {None}
        try:
            generation = GenerationConfig.from_pretrained(model_dir, local_files_only=True)
        except OSError:
            generation = None
        generation_eos = generation.eos_token_id if generation is not None else None
        self.defaults = _sampling_defaults(generation)
        eos |= set(generation_eos if isinstance(generation_eos, list) else [generation_eos]) - {None}
        self.eos_token_ids = tuple(sorted(eos))
        pad = (
            self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_token_ids[0]
        )
        self.engine = Engine(
            model, pad_token_id=pad, eos_token_ids=self.eos_token_ids, logprobs_mode=logprobs_mode
        )
        self.max_model_len = int(getattr(model.config, "max_position_embeddings", None) or 2048)
        self.vocab_size = int(model.config.vocab_size)
        self.detok = Detokenizer(self.tokenizer)
        self.scheduler = Scheduler(self.engine, window_s=batch_window_s)
        self.adapters = Adapters(
            model, self.name, pad, self.eos_token_ids, batch_window_s, logprobs_mode, root=root
        )
        self.weights = WeightSync(
            model,
            self.scheduler,
            lambda: (self.scheduler, *(adapter.scheduler for adapter in self.adapters.loaded.values())),
            root=root,
        )
        self.fingerprint = f"rlgate-{hashlib.sha256(self.path.encode()).hexdigest()[:8]}"
        self.created = int(time.time())

    def check_model(self, requested: str | None) -> None:
        if requested and requested != self.name and requested not in self.adapters.loaded:
            aliases = ", ".join([self.name, *self.adapters.loaded])
            raise ModelNotFound(
                f"The model `{requested}` does not exist. Valid aliases: {aliases}.", param="model"
            )

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        return self.tokenizer.encode(
            self.chat_prompt(messages, tools, add_generation_prompt), add_special_tokens=False
        )

    def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool = True,
        param: str = "messages",
    ) -> str:
        """The chat template's text for these messages (what `render_chat` tokenizes)."""
        messages = [_flatten_content(m) for m in messages]
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
            )
        except Exception as exc:  # a template error is the request's fault (missing keys, bad roles)
            raise BadRequest(f"the chat template failed on these messages: {exc}", param=param) from exc

    def budget(self, requested: int | None, param: str, prompt_len: int) -> int:
        """vLLM 0.33: max_tokens > max_model_len and prompts >= max_model_len are 400s; otherwise max_tokens is
        clamped to what is left of the context (None: all of it)."""
        if requested is not None and requested > self.max_model_len:
            raise BadRequest(
                f"{param}={requested} cannot be greater than max_model_len={self.max_model_len}. "
                f"Please request fewer output tokens. (parameter={param}, value={requested})",
                param=param,
            )
        if prompt_len >= self.max_model_len:
            raise BadRequest(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                f"prompt contains {prompt_len} input tokens, which exceeds this limit even without any "
                f"output tokens. Please reduce the length of the input prompt. "
                f"(parameter=input_tokens, value={prompt_len})",
                param="input_tokens",
            )
        left = self.max_model_len - prompt_len
        return left if requested is None else min(requested, left)

    def sampling(
        self, request: SamplingFields, max_tokens: int, top_logprobs: int, index: int
    ) -> SamplingParams:
        bias: dict[int, float] = {}
        for key, value in (request.logit_bias or {}).items():
            try:
                token_id = int(key)
            except ValueError:
                raise BadRequest(f"logit_bias key {key!r} is not a token id", param="logit_bias") from None
            if not 0 <= token_id < self.vocab_size:
                raise BadRequest(
                    f"token_id(s) [{token_id}] in logit_bias contain out-of-vocab token ids. "
                    f"Vocabulary size: {self.vocab_size}",
                    param="logit_bias",
                )
            bias[token_id] = max(-100.0, min(100.0, value))

        def pick(name: str, fallback: float) -> Any:
            value = getattr(request, name)
            return self.defaults.get(name, fallback) if value is None else value

        top_k = pick("top_k", 0)
        if top_k < -1:  # vLLM's SamplingParams._verify_args: -1 is accepted as off, lower is a 400
            raise BadRequest(f"top_k must be 0 (disable), or at least 1, got {top_k}.")
        # SamplingParams raises temperatures in (0, 0.01) to 0.01, as vLLM's does
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=max(0, top_k),
            seed=None if request.seed is None else request.seed + index,
            logit_bias=bias,
            stop_token_ids=tuple(request.stop_token_ids or ()),
            top_logprobs=top_logprobs,
        )

    async def generate(
        self, prompt: list[int], params: SamplingParams, stops: list[str], model: str | None = None
    ) -> Output:
        """Generate with the base model, or with the LoRA adapter named `model`."""
        if stops:
            params = replace(params, stop=self._stop_check(stops))
        async with self.weights.admit():
            # looked up once admitted: a request held by a pause runs on the adapter loaded by then
            adapter = self.adapters.loaded.get(model) if model else None
            scheduler = adapter.scheduler if adapter is not None else self.scheduler
            return self.finish(await scheduler.generate(prompt, params), params, stops)

    def _stop_check(self, stops: list[str]) -> Callable[[list[int]], bool] | None:
        """Whether a row's text holds a stop string, from the text of its last tokens only.

        `finish` cuts the output at the first token whose text completes a stop string; this check ends
        generation there. It must never fire before that token: a match in the decoded tail is a match
        in the whole text (UTF-8 resynchronizes after a cut character, which decodes as U+FFFD, so stop
        strings holding U+FFFD are not checked early). It may fire later (a stop string spread over more
        tokens than the tail holds), which only costs the tokens generated meanwhile.
        """
        if any("\ufffd" in s for s in stops):
            return None
        span = 4 * max(len(s) for s in stops) + 4  # tokens: a character is at most 4 byte-level tokens
        text = self.detok.text

        def hit(ids: list[int]) -> bool:
            tail = text(ids[-span:])
            return any(s in tail for s in stops)

        return hit

    def finish(self, done: Completion, params: SamplingParams, stops: list[str]) -> Output:
        """Apply stop strings to an engine completion and decode it."""
        ids = done.token_ids
        stop_reason: str | int | None = None
        finish = done.finish_reason
        if done.stop_token_id is not None and done.stop_token_id in params.stop_token_ids:
            stop_reason = done.stop_token_id  # vLLM reports a stop_token_ids hit by id, an EOS as null
        keep, text = len(ids), self.detok.text(ids)
        if stops:
            longest = max(len(s) for s in stops)
            for i in range(len(ids)):
                prefix = self.detok.text(ids[: i + 1])
                window = max(0, len(self.detok.text(ids[:i])) - longest)
                hits = [(prefix.find(s, window), s) for s in stops if prefix.find(s, window) >= 0]
                if hits:
                    pos, stop = min(hits)
                    keep, text, finish, stop_reason = i + 1, prefix[:pos], "stop", stop
                    break
        return Output(ids[:keep], done.logprobs[:keep], done.top_logprobs[:keep], text, finish, stop_reason)


def _sampling_defaults(generation: GenerationConfig | None) -> dict[str, Any]:
    """The sampling defaults a model's generation_config.json sets explicitly (temperature, top_p, top_k),
    which vLLM applies to requests that leave them out (`--generation-config auto`, its default). Others
    that vLLM would also take (repetition_penalty, min_p, max_new_tokens) are not supported by the engine
    and are logged, not applied."""
    if generation is None:
        return {}
    explicit = generation.to_diff_dict()
    defaults = {k: explicit[k] for k in ("temperature", "top_p", "top_k") if explicit.get(k) is not None}
    ignored = [k for k in ("repetition_penalty", "min_p", "max_new_tokens") if explicit.get(k) is not None]
    if ignored:
        log.warning("generation_config defaults not applied", keys=ignored)
    return defaults


def _flatten_content(message: dict[str, Any]) -> dict[str, Any]:
    """A list of content parts becomes its text, as vLLM does for string-content chat templates (the
    Responses API's parts are `input_text` / `output_text`)."""
    content = message.get("content")
    if isinstance(content, list):
        text = "\n".join(
            p.get("text", "")
            for p in content
            if isinstance(p, dict) and p.get("type") in ("text", "input_text", "output_text")
        )
        return {**message, "content": text}
    return message
