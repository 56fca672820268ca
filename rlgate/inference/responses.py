"""`POST /v1/responses` of `rlgate serve`: vLLM 0.33's Responses API for a non-harmony model served with
`--enable-auto-tool-choice --tool-call-parser hermes` (`entrypoints/openai/responses/serving.py`, the
`SimpleContext` path; docs/vllm-wire-format.md section 7 has the contract).

The request renders through the chat template (`ResponsesRequest.chat_messages`), generates with the
engine the chat endpoint uses, and its text is parsed by the same hermes code (`rlgate.inference.tools`):

- Non-streaming (`_make_response_output_items` + `build_response_output_items`): a message item when
  there is content (whitespace before a call is none), then one `function_call` item per call; the last
  item's status is "incomplete" when `max_output_tokens` cut the generation. With the logprobs `include`,
  the message's text part carries the log-probs of every generated token (tool-call markup and EOS
  included); with calls only, they are lost, as in vLLM.
- Streaming (`_process_simple_streaming_events`): each token's chat delta (the same streaming hermes
  parser as chat) drives vLLM's `SimpleStreamingEventProcessor` state machine: a message item opens on
  content, a function-call item on a call's name; the log-probs of a content delta are those of the token
  that produced it (tokens producing no content, such as tool-call markup and EOS, report none there), and
  the terminal `response.completed` / `response.incomplete` carries the streamed items.
- `enable_response_messages`: `input_messages` = the rendered prompt text and its token ids,
  `output_messages` = all generated text and token ids (EOS included), `[]` when nothing was generated.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import orjson
from fastapi.responses import Response, StreamingResponse

from rlgate import responses_items as items
from rlgate.inference.endpoints import Server, _aiter, _log_completion, random_id
from rlgate.inference.engine import SamplingParams
from rlgate.inference.model import Output
from rlgate.inference.protocol import BadRequest, ServeError
from rlgate.inference.responses_protocol import ResponsesRequest
from rlgate.inference.tools import chat_fields, tool_call_id


class ResponseNotFound(ServeError):
    """vLLM's `_make_not_found_error`: the response store is off (as vLLM without
    `VLLM_ENABLE_RESPONSES_API_STORE`), so every response id is unknown."""

    status = 404
    type = "invalid_request_error"

    def __init__(self, response_id: str) -> None:
        super().__init__(f"Response with id '{response_id}' not found.", param="response_id")


def check(request: ResponsesRequest) -> None:
    """vLLM's `_validate_create_responses_input` and previous-response lookup, store off."""
    if request.store and request.background:
        raise BadRequest(
            "This vLLM engine does not support `store=True` and therefore does not support the "
            "background mode. To enable these features, set the environment variable "
            "`VLLM_ENABLE_RESPONSES_API_STORE=1` when launching the vLLM server.",
            param="background",
            type="invalid_request_error",
        )
    if request.previous_input_messages and request.previous_response_id:
        raise BadRequest(
            "Only one of `previous_input_messages` and `previous_response_id` can be set.",
            param="previous_response_id",
            type="invalid_request_error",
        )
    if request.previous_response_id is not None:
        raise ResponseNotFound(request.previous_response_id)


async def create(server: Server, request: ResponsesRequest) -> Response:
    m = server.model
    m.check_model(request.model)
    check(request)
    prompt_text = m.chat_prompt(request.chat_messages(), request.chat_tools(), param="input")
    prompt = m.tokenizer.encode(prompt_text, add_special_tokens=False)
    max_tokens = m.budget(request.max_output_tokens, "max_output_tokens", len(prompt))
    k = (request.top_logprobs or 0) if request.wants_logprobs() else 0
    params = m.sampling(request, max_tokens, k, 0)
    stops = request.stop_strings()
    started = time.perf_counter()
    out = await m.generate(prompt, params, stops, request.model)
    _log_completion("responses", started, [len(prompt)], [out], bool(request.stream))
    answer = _Answer(server, request, params, prompt_text, prompt, out, stops)
    if request.stream:
        return StreamingResponse(_aiter(answer.frames()), media_type="text/event-stream")
    return Response(orjson.dumps(answer.body(answer.items(), answer.status())), media_type="application/json")


# ---------------------------------------------------------------- items


def _logprob(entry: dict[str, Any]) -> dict[str, Any]:
    """A chat log-prob entry in the order of openai's `response_output_text.Logprob`."""
    return {
        "token": entry["token"],
        "bytes": entry["bytes"],
        "logprob": entry["logprob"],
        "top_logprobs": [
            {"token": t["token"], "bytes": t["bytes"], "logprob": t["logprob"]} for t in entry["top_logprobs"]
        ],
    }


def _echo_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    return choice if isinstance(choice, str) else {"name": choice["name"], "type": "function"}


def _echo_text(text: dict[str, Any] | None) -> dict[str, Any] | None:
    if text is None:
        return None
    fmt = text.get("format")
    return {"format": None if fmt is None else {"type": "text"}, "verbosity": text.get("verbosity")}


class _Answer:
    """One finished generation as vLLM's response object, or as its event stream."""

    def __init__(
        self,
        server: Server,
        request: ResponsesRequest,
        params: SamplingParams,
        prompt_text: str,
        prompt: list[int],
        out: Output,
        stops: list[str],
    ) -> None:
        self.server, self.request, self.params = server, request, params
        self.prompt_text, self.prompt, self.out, self.stops = prompt_text, prompt, out, stops
        self.created = int(time.time())
        self.k = (request.top_logprobs or 0) if request.wants_logprobs() else 0

    def status(self) -> str:
        return "incomplete" if self.out.finish_reason == "length" else "completed"

    def logprobs(self, lo: int, hi: int) -> list[dict[str, Any]]:
        return self.server.token_logprobs(self.out, lo, hi, self.k)

    def items(self) -> list[dict[str, Any]]:
        """The output items of a non-streamed answer (vLLM's `build_response_output_items`)."""
        request, out = self.request, self.out
        content, calls, _ = chat_fields(out.text, request.tool_choice, out.finish_reason)
        if request.parallel_tool_calls is False:
            calls = calls[:1]
        last = self.status()
        output: list[dict[str, Any]] = []
        if content:
            lps = (
                [_logprob(e) for e in self.logprobs(0, len(out.token_ids))]
                if request.wants_logprobs()
                else None
            )
            output.append(
                items.message(
                    f"msg_{random_id()}", [items.text_part(content, lps)], "completed" if calls else last
                )
            )
        for i, call in enumerate(calls):
            output.append(
                items.function_call(
                    f"fc_{random_id()}",
                    call.id,
                    call.name,
                    call.arguments,
                    last if i == len(calls) - 1 else "completed",
                )
            )
        return output

    def body(self, output: list[dict[str, Any]], status: str, final: bool = True) -> dict[str, Any]:
        """vLLM's `ResponsesResponse.from_request` dumped with `model_dump(mode="json", by_alias=True)`;
        `final=False`: the in-progress response of the stream's first two events."""
        request, params, out = self.request, self.params, self.out
        usage = messages_in = messages_out = None
        if final:
            usage = {
                "input_tokens": len(self.prompt),
                "input_tokens_details": {
                    "cached_tokens": 0,
                    "cache_write_tokens": 0,
                    "input_tokens_per_turn": [],
                    "cached_tokens_per_turn": [],
                },
                "output_tokens": len(out.token_ids),
                "output_tokens_details": {
                    "reasoning_tokens": 0,
                    "tool_output_tokens": 0,
                    "output_tokens_per_turn": [],
                    "tool_output_tokens_per_turn": [],
                },
                "total_tokens": len(self.prompt) + len(out.token_ids),
            }
            if request.enable_response_messages:
                messages_in = [
                    {"message": self.prompt_text, "tokens": self.prompt, "type": "raw_message_tokens"}
                ]
                messages_out = (
                    [{"message": out.text, "tokens": out.token_ids, "type": "raw_message_tokens"}]
                    if out.token_ids
                    else []
                )
        return {
            "id": request.request_id,
            "created_at": self.created,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": request.instructions,
            "metadata": request.metadata,
            "model": self.server.model.name,
            "object": "response",
            "output": output,
            "parallel_tool_calls": True
            if request.parallel_tool_calls is None
            else request.parallel_tool_calls,
            "temperature": float(params.temperature),
            "tool_choice": _echo_tool_choice(request.tool_choice),
            "tools": [items.function_tool(t) for t in request.tools],
            "top_p": float(params.top_p),
            "background": request.background,
            "max_output_tokens": params.max_tokens,
            "max_tool_calls": request.max_tool_calls,
            "previous_response_id": request.previous_response_id,
            "prompt": None,
            "prompt_cache_options": None,
            "prompt_cache_key": request.prompt_cache_key,
            "prompt_cache_retention": request.prompt_cache_retention,
            "reasoning": items.reasoning(request.reasoning),
            "safety_identifier": request.safety_identifier,
            "service_tier": request.service_tier,
            "status": status,
            "text": _echo_text(request.text),
            "top_logprobs": request.top_logprobs if request.wants_logprobs() else None,
            "truncation": request.truncation,
            "usage": usage,
            "user": request.user,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "input_messages": messages_in,
            "output_messages": messages_out,
        }

    def frames(self) -> Iterator[bytes]:
        """vLLM's event stream: `event: TYPE\\ndata: JSON\\n\\n` per event, `sequence_number` from 0, no [DONE]."""
        events = _Events(self)
        start = self.body([], "in_progress", final=False)
        events.emit({"response": start, "sequence_number": None, "type": "response.created"})
        events.emit({"response": start, "sequence_number": None, "type": "response.in_progress"})
        deltas, _ = self.server.stream_deltas(self.request, self.out, self.stops)
        for pos, delta in enumerate(deltas):
            if delta is not None:
                events.step(delta, pos)
        events.close(self.status())
        status = self.status()
        events.emit(
            {
                "response": self.body(events.items, status),
                "sequence_number": None,
                "type": f"response.{status}",
            }
        )
        for seq, event in enumerate(events.events):
            event["sequence_number"] = seq
            yield b"event: %s\ndata: %s\n\n" % (event["type"].encode(), orjson.dumps(event))


class _Events:
    """vLLM's `SimpleStreamingEventProcessor` (streaming_events.py): one open item at a time, a message
    (content) or a function call (by the call's index); a change closes the open item as "completed",
    the end closes the last with the response's status."""

    def __init__(self, answer: _Answer) -> None:
        self.answer = answer
        self.events: list[dict[str, Any]] = []
        self.items: list[dict[str, Any]] = []
        self.state: str | None = None  # "content" | "call"
        self.index, self.item_id, self.text = 0, "", ""
        self.logprobs: list[dict[str, Any]] = []
        self.call: dict[str, Any] = {}

    def emit(self, event: dict[str, Any]) -> None:
        self.events.append(event)

    def step(self, delta: dict[str, Any], pos: int) -> None:
        """One token's chat delta, split as vLLM's `split_delta` (content first, then calls by index)."""
        calls = delta.get("tool_calls") or []
        if self.answer.request.parallel_tool_calls is False:
            calls = [c for c in calls if c.get("index") == 0]
        if delta.get("content"):
            self.move("content", None)
            self._content(delta["content"], pos)
        groups: dict[int, list[dict[str, Any]]] = {}
        for call in calls:
            groups.setdefault(call["index"], []).append(call)
        for group in groups.values():
            self.move("call", group[0])
            arguments = "".join(c["function"].get("arguments") or "" for c in group)
            if arguments:
                self.call["arguments"] += arguments
                self.emit(
                    {
                        "delta": arguments,
                        "item_id": self.item_id,
                        "output_index": self.index,
                        "sequence_number": None,
                        "type": "response.function_call_arguments.delta",
                    }
                )

    def move(self, state: str, call: dict[str, Any] | None) -> None:
        if state == self.state and (state == "content" or call["index"] == self.call["index"]):
            return
        self.close("completed")
        self.state = state
        if state == "content":
            self.item_id, self.text, self.logprobs = f"msg_{random_id()}", "", []
            self.emit(
                {
                    "item": items.message(self.item_id, [], "in_progress"),
                    "output_index": self.index,
                    "sequence_number": None,
                    "type": "response.output_item.added",
                }
            )
            self.emit(
                {
                    "content_index": 0,
                    "item_id": self.item_id,
                    "output_index": self.index,
                    "part": items.text_part("", []),
                    "sequence_number": None,
                    "type": "response.content_part.added",
                }
            )
            return
        self.item_id = f"fc_{random_id()}"
        self.call = {
            "index": call["index"],
            "id": call.get("id") or tool_call_id(),
            "name": call["function"]["name"],
            "arguments": "",
        }
        self.emit(
            {
                "item": items.function_call(
                    self.item_id, self.call["id"], self.call["name"], "", "in_progress"
                ),
                "output_index": self.index,
                "sequence_number": None,
                "type": "response.output_item.added",
            }
        )

    def _content(self, text: str, pos: int) -> None:
        entries = self.answer.logprobs(pos, pos + 1) if self.answer.request.wants_logprobs() else []
        self.text += text
        self.logprobs += [_logprob(e) for e in entries]
        self.emit(
            {
                "content_index": 0,
                "delta": text,
                "item_id": self.item_id,
                "logprobs": [items.stream_logprob(e) for e in entries],
                "output_index": self.index,
                "sequence_number": None,
                "type": "response.output_text.delta",
            }
        )

    def close(self, status: str) -> None:
        if self.state == "content":
            part = items.text_part(self.text, self.logprobs or None)
            item = items.message(self.item_id, [part] if self.text else [], status)
            self.emit(
                {
                    "content_index": 0,
                    "item_id": self.item_id,
                    "logprobs": [],
                    "output_index": self.index,
                    "sequence_number": None,
                    "text": self.text,
                    "type": "response.output_text.done",
                }
            )
            self.emit(
                {
                    "content_index": 0,
                    "item_id": self.item_id,
                    "output_index": self.index,
                    "part": part,
                    "sequence_number": None,
                    "type": "response.content_part.done",
                }
            )
        elif self.state == "call":
            call = self.call
            item = items.function_call(self.item_id, call["id"], call["name"], call["arguments"], status)
            self.emit(
                {
                    "arguments": call["arguments"],
                    "item_id": self.item_id,
                    "output_index": self.index,
                    "sequence_number": None,
                    "type": "response.function_call_arguments.done",
                    "name": call["name"],
                }
            )
        else:
            return
        self.emit(
            {
                "item": item,
                "output_index": self.index,
                "sequence_number": None,
                "type": "response.output_item.done",
            }
        )
        self.items.append(item)
        self.index += 1
        self.state = None
