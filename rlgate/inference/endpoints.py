"""The endpoints of `rlgate serve`: each builds vLLM 0.33's response (or chunk sequence) for one request;
`rlgate.inference.server` has the contract and the differences from vLLM."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import orjson
import structlog
from fastapi.responses import Response, StreamingResponse

from rlgate.inference.engine import SamplingParams
from rlgate.inference.model import Model, Output
from rlgate.inference.protocol import (
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from rlgate.inference.responses_protocol import ResponsesRequest
from rlgate.inference.tools import HermesStream, chat_fields, keeps_tool_calls

log = structlog.get_logger("rlgate.serve")
LOGPROB_FLOOR = -9999.0  # vLLM clamps reported log-probs here (-inf is not JSON)


def random_id() -> str:  # vllm.utils.random_uuid: 16 hex characters
    return f"{uuid.uuid4().int & 0xFFFFFFFFFFFFFFFF:016x}"


def _lp(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


# ---------------------------------------------------------------- response pieces


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


DONE = b"data: [DONE]\n\n"


def _steps(outputs: list[Output]) -> Iterator[tuple[int, int, bool]]:
    """Engine order of streamed tokens: (choice, position, last), one token per step, choices interleaved."""
    for pos in range(max(len(o.token_ids) for o in outputs)):
        for i, out in enumerate(outputs):
            if pos < len(out.token_ids):
                yield i, pos, pos == len(out.token_ids) - 1


class Server:
    """The endpoints. Each builds vLLM's response for one request."""

    def __init__(self, model: Model) -> None:
        self.model = model

    # ------------------------------------------------------------ chat
    def token_logprobs(self, out: Output, lo: int, hi: int, k: int) -> list[dict[str, Any]]:
        """Tokens lo..hi-1 as vLLM's chat and Responses log-prob entries show them: `{"token", "logprob",
        "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}` with the first k candidates (sampled
        first), clamped at -9999.0. (Responses reorders the keys: `rlgate.inference.responses`.)"""
        detok, entries = self.model.detok, []
        for pos in range(lo, hi):
            tops = [
                {"token": detok.token_str(t), "logprob": _lp(v), "bytes": detok.token_bytes(t)}
                for t, v in out.top_logprobs[pos][:k]
            ]
            token = out.token_ids[pos]
            entries.append(
                {
                    "token": detok.token_str(token),
                    "logprob": _lp(out.logprobs[pos]),
                    "bytes": detok.token_bytes(token),
                    "top_logprobs": tops,
                }
            )
        return entries

    def chat_logprobs(self, out: Output, lo: int, hi: int, k: int) -> dict[str, Any]:
        return {"content": self.token_logprobs(out, lo, hi, k)}

    async def chat(self, request: ChatCompletionRequest) -> Response:
        m = self.model
        m.check_model(request.model)
        prompt = m.render_chat(request.messages, request.tools)
        param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        max_tokens = m.budget(request.max_completion_tokens or request.max_tokens, param, len(prompt))
        k = (request.top_logprobs or 0) if request.logprobs else 0
        params = [m.sampling(request, max_tokens, k, i) for i in range(request.n)]
        stops = request.stop_strings()
        started = time.perf_counter()
        outputs = await asyncio.gather(*(m.generate(prompt, p, stops, request.model) for p in params))
        _log_completion("chat.completions", started, [len(prompt)], outputs, bool(request.stream))
        fields = [chat_fields(o.text, request.tool_choice, o.finish_reason) for o in outputs]
        rti, lp = bool(request.return_token_ids), bool(request.logprobs)
        head = {
            "id": f"chatcmpl-{random_id()}",
            "object": "chat.completion.chunk" if request.stream else "chat.completion",
            "created": int(time.time()),
            "model": m.name,
        }
        if request.stream:
            frames = self.chat_frames(request, head, prompt, outputs, stops)
            return StreamingResponse(_aiter(frames), media_type="text/event-stream")
        choices = []
        for i, (out, (content, calls, finish)) in enumerate(zip(outputs, fields, strict=True)):
            message: dict[str, Any] = {
                "role": "assistant",
                "content": content,
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
            }
            if calls:  # vLLM's ChatMessage drops an empty tool_calls list
                message["tool_calls"] = [c.to_wire() for c in calls]
            message["reasoning"] = None
            choices.append(
                {
                    "index": i,
                    "message": message,
                    "logprobs": self.chat_logprobs(out, 0, len(out.token_ids), k) if lp else None,
                    "finish_reason": finish,
                    "stop_reason": out.stop_reason,
                    "token_ids": out.token_ids if rti else None,
                    "routed_experts": None,
                    "weight_versions": None,
                }
            )
        body = {
            **head,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": m.fingerprint,
            "usage": _usage(len(prompt), sum(len(o.token_ids) for o in outputs)),
            "prompt_logprobs": None,
            "prompt_token_ids": prompt if rti else None,
            "prompt_text": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }
        return Response(orjson.dumps(body), media_type="application/json")

    def chat_frames(
        self,
        request: ChatCompletionRequest,
        head: dict[str, Any],
        prompt: list[int],
        outputs: list[Output],
        stops: list[str],
    ) -> Iterator[bytes]:
        m, n = self.model, len(outputs)
        rti, lp = bool(request.return_token_ids), bool(request.logprobs)
        k = (request.top_logprobs or 0) if lp else 0
        opts = request.stream_options or None
        inc_usage = bool(opts and opts.include_usage)
        cont = inc_usage and bool(opts and opts.continuous_usage_stats)
        P = len(prompt)
        deltas, finish = zip(*(self.stream_deltas(request, out, stops) for out in outputs), strict=True)
        for i in range(n):
            frame: dict[str, Any] = {
                **head,
                "choices": [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            }
            if cont:
                frame["usage"] = {
                    "prompt_tokens": P,
                    "total_tokens": P,
                    "completion_tokens": 0,
                    "completion_tokens_details": None,
                }
            yield _sse({**frame, "prompt_token_ids": prompt if rti else None, "prompt_text": None})
        for i, pos, last in _steps(outputs):
            out, delta = outputs[i], deltas[i][pos]
            if delta is None:  # nothing to say; vLLM still sends a chunk carrying metadata
                if not last and not lp and not rti:
                    continue
                delta = {}
            choice: dict[str, Any] = {
                "index": i,
                "delta": delta,
                "logprobs": self.chat_logprobs(out, pos, pos + 1, k) if lp else None,
                "finish_reason": finish[i] if last else None,
            }
            if last:
                choice["stop_reason"] = out.stop_reason
            choice["token_ids"] = [out.token_ids[pos]] if rti else None
            if last:
                choice["weight_versions"] = None
            frame = {**head, "choices": [choice]}
            if cont:
                frame["usage"] = {
                    "prompt_tokens": P,
                    "total_tokens": P + pos + 1,
                    "completion_tokens": pos + 1,
                    "completion_tokens_details": None,
                }
            if last and not inc_usage:
                frame["system_fingerprint"] = m.fingerprint
            frame["kv_transfer_params"] = None
            yield _sse(frame)
        yield from self._closing_frames(head, P, outputs, inc_usage)

    def _closing_frames(
        self, head: dict[str, Any], prompt_tokens: int, outputs: list[Output], include_usage: bool
    ) -> Iterator[bytes]:
        """The end of every stream: the usage chunk (with `stream_options.include_usage`), then [DONE]."""
        if include_usage:
            total = sum(len(o.token_ids) for o in outputs)
            yield _sse(
                {
                    **head,
                    "choices": [],
                    "usage": {
                        "prompt_tokens": prompt_tokens,
                        "total_tokens": prompt_tokens + total,
                        "completion_tokens": total,
                    },
                    "system_fingerprint": self.model.fingerprint,
                }
            )
        yield DONE

    def stream_deltas(
        self, request: ChatCompletionRequest | ResponsesRequest, out: Output, stops: list[str]
    ) -> tuple[list[dict[str, Any] | None], str]:
        """Per token, the delta to stream (None: nothing), and the chat choice's finish reason. Unless
        `tool_choice` is "none", the text goes through the streaming hermes parser (`rlgate.inference.tools`),
        as vLLM's does (its Responses stream too): the finish reason is "tool_calls" once a call streamed
        (a named tool: "stop")."""
        pieces = self.model.detok.stream_pieces(out.token_ids, out.text, stops)
        if request.tool_choice == "none":
            return [{"content": p} if p else None for p in pieces], out.finish_reason
        parser = HermesStream(keeps_tool_calls(request.tool_choice))
        deltas = [parser.step(p, i == len(pieces) - 1) for i, p in enumerate(pieces)]
        named = isinstance(request.tool_choice, dict)
        finish = (
            "tool_calls"
            if parser.streamed and out.finish_reason == "stop" and not named
            else out.finish_reason
        )
        return deltas, finish

    # ------------------------------------------------------------ completions
    def completion_logprobs(
        self, out: Output, lo: int, hi: int, k: int, offset: int
    ) -> tuple[dict[str, Any], int]:
        """`logprobs: k`: the sampled token plus the top k, merged (so k entries when the sampled token is
        among the top k, else k + 1). `text_offset` continues from `offset`."""
        detok = self.model.detok
        result: dict[str, list[Any]] = {
            "text_offset": [],
            "token_logprobs": [],
            "tokens": [],
            "top_logprobs": [],
        }
        for pos in range(lo, hi):
            token, logprob = out.token_ids[pos], out.logprobs[pos]
            candidates = out.top_logprobs[pos]  # sampled first, then the best others (k + 1 asked)
            better = sum(1 for _, v in candidates[1:] if v > logprob)
            keep = candidates[: k if better < k else k + 1] if k > 0 else candidates[:1]
            string = detok.token_str(token)
            result["text_offset"].append(offset)
            result["token_logprobs"].append(_lp(logprob))
            result["tokens"].append(string)
            result["top_logprobs"].append({detok.token_str(t): _lp(v) for t, v in keep})
            offset += len(string)
        return result, offset

    async def completions(self, request: CompletionRequest) -> Response:
        m = self.model
        m.check_model(request.model)
        prompts = self._prompts(request.prompt)
        longest = max(len(p) for p in prompts)
        max_tokens = m.budget(16 if request.max_tokens is None else request.max_tokens, "max_tokens", longest)
        k = request.logprobs
        stops = request.stop_strings()
        pairs = [
            (p, m.sampling(request, min(max_tokens, m.max_model_len - len(p)), 0 if k is None else k + 1, i))
            for p in prompts
            for i in range(request.n)
        ]
        started = time.perf_counter()
        outputs = await asyncio.gather(*(m.generate(p, params, stops, request.model) for p, params in pairs))
        _log_completion("completions", started, [len(p) for p in prompts], outputs, bool(request.stream))
        rti = bool(request.return_token_ids)
        echo = bool(request.echo) and not rti  # vLLM: return_token_ids drops the echoed prompt text
        head = {
            "id": f"cmpl-{random_id()}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": m.name,
        }
        P = sum(len(p) for p in prompts)
        if request.stream:
            return StreamingResponse(
                _aiter(self.completion_frames(request, head, pairs, outputs, stops, P, echo)),
                media_type="text/event-stream",
            )
        choices = []
        for j, ((prompt, _), out) in enumerate(zip(pairs, outputs, strict=True)):
            prefix = m.detok.text(prompt) if echo else ""
            choices.append(
                {
                    "index": j,
                    "text": prefix + out.text,
                    "logprobs": None
                    if k is None
                    else self.completion_logprobs(out, 0, len(out.token_ids), k, len(prefix))[0],
                    "finish_reason": out.finish_reason,
                    "stop_reason": out.stop_reason,
                    "token_ids": out.token_ids if rti else None,
                    "prompt_logprobs": None,
                    "prompt_token_ids": prompt if rti else None,
                    "routed_experts": None,
                    "weight_versions": None,
                }
            )
        body = {
            **head,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": m.fingerprint,
            "usage": _usage(P, sum(len(o.token_ids) for o in outputs)),
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }
        return Response(orjson.dumps(body), media_type="application/json")

    def completion_frames(
        self,
        request: CompletionRequest,
        head: dict[str, Any],
        pairs: list[tuple[list[int], SamplingParams]],
        outputs: list[Output],
        stops: list[str],
        P: int,
        echo: bool,
    ) -> Iterator[bytes]:
        """vLLM's completion chunks. With `echo`, a choice's first chunk carries the prompt's text before its
        first token's, and the prompt's token ids (with or without `return_token_ids`)."""
        m, k, rti = self.model, request.logprobs, bool(request.return_token_ids)
        opts = request.stream_options
        inc_usage = bool(opts and opts.include_usage)
        cont = inc_usage and bool(opts and opts.continuous_usage_stats)
        pieces = [m.detok.stream_pieces(o.token_ids, o.text, stops) for o in outputs]
        prefixes = [m.detok.text(prompt) if echo else "" for prompt, _ in pairs]
        offsets = [len(prefix) for prefix in prefixes]
        for j, pos, last in _steps(outputs):
            out, prompt = outputs[j], pairs[j][0]
            lps = None
            if k is not None:
                lps, offsets[j] = self.completion_logprobs(out, pos, pos + 1, k, offsets[j])
            frame: dict[str, Any] = {
                **head,
                "choices": [
                    {
                        "index": j,
                        "text": prefixes[j] + pieces[j][pos] if pos == 0 else pieces[j][pos],
                        "logprobs": lps,
                        "finish_reason": out.finish_reason if last else None,
                        "stop_reason": out.stop_reason if last else None,
                        "prompt_token_ids": prompt if (rti or request.echo) and pos == 0 else None,
                        "token_ids": [out.token_ids[pos]] if rti else None,
                        "weight_versions": None,
                    }
                ],
            }
            if cont:
                frame["usage"] = {
                    "prompt_tokens": len(prompt),
                    "total_tokens": len(prompt) + pos + 1,
                    "completion_tokens": pos + 1,
                }
            if last and not inc_usage:
                frame["system_fingerprint"] = m.fingerprint
            frame["kv_transfer_params"] = None
            yield _sse(frame)
        yield from self._closing_frames(head, P, outputs, inc_usage)

    def _prompts(self, prompt: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        elif prompt and isinstance(prompt[0], int):
            prompt = [prompt]  # type: ignore[list-item]  # one prompt of token ids
        if not prompt:
            raise BadRequest("prompt must not be empty", param="prompt")
        ids = [
            self.model.tokenizer.encode(p, add_special_tokens=False) if isinstance(p, str) else list(p)
            for p in prompt
        ]
        for p in ids:
            if not p:
                raise BadRequest("a prompt needs at least one token", param="prompt")
            if any(not 0 <= t < self.model.vocab_size for t in p):
                raise BadRequest(f"Token id out of vocabulary (size {self.model.vocab_size})", param="prompt")
        return ids

    # ------------------------------------------------------------ the rest
    def models(self) -> dict[str, Any]:
        m = self.model
        permission = {
            "id": f"modelperm-{random_id()}",
            "object": "model_permission",
            "created": m.created,
            "allow_create_engine": False,
            "allow_sampling": True,
            "allow_logprobs": True,
            "allow_search_indices": False,
            "allow_view": True,
            "allow_fine_tuning": False,
            "organization": "*",
            "group": None,
            "is_blocking": False,
        }
        data = [
            {
                "id": m.name,
                "object": "model",
                "created": m.created,
                "owned_by": "vllm",
                "root": m.path,
                "parent": None,
                "max_model_len": m.max_model_len,
                "permission": [permission],
            }
        ]
        data += [
            {
                "id": a.name,
                "object": "model",
                "created": m.created,
                "owned_by": "vllm",
                "root": a.path,
                "parent": m.name,
                "max_model_len": m.max_model_len,
                "permission": [permission],
            }
            for a in m.adapters.loaded.values()
        ]
        return {"object": "list", "data": data}

    def tokenize(self, request: TokenizeRequest) -> dict[str, Any]:
        m = self.model
        m.check_model(request.model)
        if request.messages is not None:
            ids = m.render_chat(request.messages, request.tools, request.add_generation_prompt)
        else:
            ids = m.tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens)
        strs = m.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return {"count": len(ids), "max_model_len": m.max_model_len, "tokens": ids, "token_strs": strs}

    def detokenize(self, request: DetokenizeRequest) -> dict[str, Any]:
        m = self.model
        m.check_model(request.model)
        if any(not 0 <= t < m.vocab_size for t in request.tokens):
            raise BadRequest(f"Token id out of vocabulary (size {m.vocab_size})", param="tokens")
        return {"prompt": m.tokenizer.decode(request.tokens)}


def _log_completion(
    endpoint: str, started: float, prompt_lens: list[int], outputs: list[Output], stream: bool
) -> None:
    """The one log line per generation request: latency, tokens, finish reasons."""
    log.info(
        "completion",
        endpoint=endpoint,
        stream=stream,
        choices=len(outputs),
        prompt_tokens=sum(prompt_lens),
        completion_tokens=sum(len(o.token_ids) for o in outputs),
        finish_reasons=sorted({o.finish_reason for o in outputs}),
        latency_ms=round((time.perf_counter() - started) * 1000, 1),
    )


async def _aiter(frames: Iterator[bytes]) -> AsyncIterator[bytes]:
    for frame in frames:
        yield frame


# ---------------------------------------------------------------- HTTP
