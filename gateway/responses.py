"""OpenAI's Responses API on the agent surface, served by the policy's chat completions.

A harness that speaks the Responses API (Codex CLI, the OpenAI SDK's `client.responses`, the Agents SDK)
calls `POST .../v1/responses`; the gateway turns the request into the chat completion vLLM's own
`/v1/responses` renders for a chat-template model (vLLM 0.33, `entrypoints/openai/responses/`: the input
items as chat messages, `construct_input_messages`; function, namespace and custom tools as chat tools,
`get_function_tools`), sends that upstream with token ids and log-probs, records it as a chat call
(`CallRecord.agent_api` says the agent spoke Responses), and answers in the Responses shape: a response
object, or its event stream, built from the chat answer the way vLLM builds its own from the same parsed
deltas (`build_response_output_items`, `SimpleStreamingEventProcessor`). So every token the model sampled
is recorded with its id and log-prob, streamed or not, which vLLM's `/v1/responses` cannot give: in a
stream it reports log-probs only for tokens that made text, several to a delta.

Where this differs from vLLM's `/v1/responses`, on purpose (docs/agents.md):
- content the learner cannot train on exactly is a 400: images and files in the input, encrypted reasoning
  (vLLM refuses that too), `enable_response_messages` (the record holds the ids; the rendered text is the
  upstream's);
- tools the gateway cannot run are not shown to the model, as vLLM does not show them (`web_search`,
  `file_search`, `mcp`, ...): their calls never happen; they are echoed in the answer as sent;
- no response store: `previous_response_id` is 404, as from vLLM with its store off (its default);
- echoed sampling fields the agent left unset are vLLM's defaults for a model without a generation config
  (temperature and top_p 1.0), and `max_output_tokens` is echoed as asked (vLLM: what the context left).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway import capture
from gateway.capture import InvalidField as Invalid
from gateway.streaming import StreamAssembler, TranslatedRelay
from rlgate import responses_items as items

LOGPROBS_INCLUDE = "message.output_text.logprobs"
NAMESPACE_SEPARATOR = "__"  # vLLM's flat name of a namespace's function: "<namespace>__<name>"
CUSTOM_INPUT_KEY = "input"  # a custom tool is shown as a function of one string argument
CUSTOM_PARAMETERS = {
    "type": "object",
    "properties": {
        CUSTOM_INPUT_KEY: {"type": "string", "description": "The freeform text payload for this tool."}
    },
    "required": [CUSTOM_INPUT_KEY],
    "additionalProperties": False,
}
# the chat completion fields a Responses request carries under the same name, passed on as they are
PASSED_ON = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "logit_bias",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "user",
    "cache_salt",
    "priority",
    "vllm_xargs",
    "chat_template_kwargs",
    "structured_outputs",
    "include_reasoning",
)
UNSUPPORTED_PARTS = ("input_image", "input_file", "input_audio")


@dataclass(slots=True)
class Request:
    """What the answer needs of the agent's Responses request: its echoed fields and how to name calls."""

    body: dict[str, Any]
    response_id: str
    created_at: int
    names: dict[str, tuple[str, str | None]]  # flat chat tool name -> (name, namespace)
    custom: frozenset[str]
    logprobs: bool  # the agent asked for the output text's log-probs
    top_logprobs: int
    parallel: bool
    tools: list[dict[str, Any]] = field(default_factory=list)
    constrained: bool = False  # vLLM constrains the answer to a tool call: its echo of `text` is null


# ---------------------------------------------------------------------------------------------------------
# Request: Responses -> chat completion


def to_chat(body: dict[str, Any]) -> tuple[dict[str, Any], Request]:
    """The chat completion vLLM's `/v1/responses` renders for `body` (raise `Invalid`), and what the answer
    needs of the request."""
    _check(body)
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise Invalid("tools", "tools: a list of tools")
    chat_tools, names, custom = _tools(tools)
    include = body.get("include")
    if include is not None and (
        not isinstance(include, list) or not all(isinstance(i, str) for i in include)
    ):
        raise Invalid("include", "include: a list of strings")
    logprobs = isinstance(include, list) and LOGPROBS_INCLUDE in include
    top = body.get("top_logprobs")
    if top is not None and (not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= 20):
        raise Invalid("top_logprobs", "top_logprobs: an integer from 0 to 20")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None:
        parallel = capture.is_true(parallel)  # vLLM reads booleans laxly ("false", 0, ...)
    request = Request(
        body=body,
        response_id=_response_id(body.get("request_id")),
        created_at=int(time.time()),
        names=names,
        custom=custom,
        logprobs=logprobs,
        top_logprobs=top or 0,
        parallel=parallel is not False,
        tools=tools,
        constrained=_constrained(body, chat_tools),
    )
    raw_input = body.get("input")
    chat: dict[str, Any] = {"messages": input_messages(body.get("instructions"), raw_input)}
    if body.get("model") is not None:
        chat["model"] = body["model"]
    max_output = body.get("max_output_tokens")
    if max_output is not None:
        if not isinstance(max_output, int) or isinstance(max_output, bool) or max_output < 1:
            raise Invalid("max_output_tokens", "max_output_tokens: a positive integer")
        chat["max_tokens"] = max_output
    for name in PASSED_ON:
        if body.get(name) is not None:
            chat[name] = body[name]
    if chat_tools:
        chat["tools"] = chat_tools
        chat["tool_choice"] = _tool_choice(body.get("tool_choice", "auto"), tools, chat_tools, names)
    elif body.get("tool_choice", "auto") not in ("auto", "none"):
        _tool_choice(body.get("tool_choice"), tools, chat_tools, names)  # raises: nothing it can call
    if parallel is not None:
        chat["parallel_tool_calls"] = parallel
    _text_format(body.get("text"), chat)
    _reasoning(body.get("reasoning"), chat)
    if _continues(raw_input):  # a partial assistant message: the model goes on with it
        chat["add_generation_prompt"] = False
        chat["continue_final_message"] = True
    if logprobs:
        chat["logprobs"] = True
        if top:
            chat["top_logprobs"] = top
    chat.update(capture.chat_stream(body.get("stream")))
    return chat, request


def _constrained(body: dict[str, Any], chat_tools: list[dict[str, Any]]) -> bool:
    """Whether vLLM (its hermes parser, strict tool calling on: its default) constrains the answer to a tool
    call's envelope, which also drops the request's `text` from its echo: with tools shown, a required or
    named tool choice; with "auto", a strict function tool, or `parallel_tool_calls: false` without a
    `text.format` (`abstract_parser.py` `_apply_structural_tag`)."""
    if not chat_tools:
        return False
    choice = body.get("tool_choice", "auto")
    if choice == "required" or isinstance(choice, dict):
        return True
    if choice != "auto":
        return False
    if any(capture.is_true(t["function"].get("strict")) for t in chat_tools):
        return True
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    parallel = body.get("parallel_tool_calls")
    return (
        parallel is not None
        and not capture.is_true(parallel)
        and fmt is None
        and body.get("structured_outputs") is None
    )


def _response_id(asked: Any) -> str:
    if isinstance(asked, str) and asked:
        return asked
    return f"resp_{uuid.uuid4().int & 0xFFFFFFFFFFFFFFFF:016x}"


def _check(body: dict[str, Any]) -> None:
    """vLLM's own refusals, in its order, and what the gateway cannot record exactly."""
    background = capture.is_true(body.get("background"))
    if background and not capture.is_true(body.get("store", True)):
        raise Invalid("background", "background can only be used when `store` is true")
    if body.get("prompt") is not None:
        raise Invalid("prompt", "prompt template is not supported")
    if background:
        raise Invalid(
            "background",
            "background mode needs a response store, which the gateway does not keep: call without it",
        )
    if body.get("previous_input_messages") is not None and body.get("previous_response_id") is not None:
        raise Invalid(
            "previous_response_id",
            "Only one of `previous_input_messages` and `previous_response_id` can be set.",
        )
    previous = body.get("previous_response_id")
    if previous is not None:
        raise Invalid("response_id", f"Response with id '{previous}' not found.", status=404)
    if body.get("previous_input_messages") is not None:
        raise Invalid("previous_input_messages", "previous_input_messages is not supported: send the input")
    if capture.is_true(body.get("enable_response_messages")):
        raise Invalid(
            "enable_response_messages",
            "enable_response_messages is not supported by this gateway: the call's token ids are recorded "
            "(GET /rollouts/{id}); the rendered text is the inference server's",
        )
    text = body.get("text")
    if (
        body.get("structured_outputs") is not None
        and isinstance(text, dict)
        and text.get("format") is not None
    ):
        raise Invalid("structured_outputs", "Cannot specify both structured_outputs and text.format")
    if not isinstance(body.get("input"), (str, list)):
        raise Invalid("input", "input: a string or a list of input items")


def input_messages(instructions: Any, raw_input: Any) -> list[dict[str, Any]]:
    """vLLM's `construct_input_messages`: the instructions as a system message, a string input as one user
    message, input items as chat messages (a function call, reasoning or text joins the assistant message
    before it)."""
    messages: list[dict[str, Any]] = []
    if instructions:
        if not isinstance(instructions, str):
            raise Invalid("instructions", "instructions: a string")
        messages.append({"role": "system", "content": instructions})
    if isinstance(raw_input, str):
        messages.append({"role": "user", "content": raw_input})
        return messages
    for i, item in enumerate(raw_input):
        message = _item(item, messages[-1] if messages else None, f"input.{i}")
        if message is not None:
            messages.append(message)
    return messages


def _item(item: Any, previous: dict[str, Any] | None, where: str) -> dict[str, Any] | None:
    """One input item as a chat message (vLLM's `_construct_message_from_response_item`); None when it
    joined `previous` (an assistant message)."""
    if not isinstance(item, dict):
        raise Invalid(where, f"{where}: an input item (object) is required")
    assistant = previous if previous is not None and previous.get("role") == "assistant" else None
    kind = item.get("type")
    if kind in ("function_call", "custom_tool_call"):
        call_id, name = item.get("call_id"), item.get("name")
        if not isinstance(call_id, str) or not isinstance(name, str):
            raise Invalid(where, f"{where}: a {kind} item needs a string call_id and name")
        if kind == "function_call":
            arguments = item.get("arguments")
            if not isinstance(arguments, str):
                raise Invalid(where, f"{where}.arguments: a string is required")
            namespace = item.get("namespace")
            if namespace:
                name = f"{namespace}{NAMESPACE_SEPARATOR}{name}"
        else:
            payload = item.get("input") or ""
            if not isinstance(payload, str):
                raise Invalid(where, f"{where}.input: a string is required")
            arguments = json.dumps({CUSTOM_INPUT_KEY: payload}, ensure_ascii=False)
        call = {"id": call_id, "function": {"name": name, "arguments": arguments}, "type": "function"}
        return items.input_tool_call(call, assistant)
    if kind == "reasoning":
        if item.get("encrypted_content"):
            raise Invalid("input", "Encrypted content is not supported.")
        reasoning = _reasoning_text(item, where)
        if assistant is not None and assistant.get("reasoning") is None:
            assistant["reasoning"] = reasoning
            return None
        return {"role": "assistant", "reasoning": reasoning}
    if kind in ("function_call_output", "custom_tool_call_output"):
        output = item.get("output")
        if isinstance(output, list):  # content parts: their text, as a chat tool message's parts
            output = _parts(output, f"{where}.output")
        return {"role": "tool", "content": output, "tool_call_id": item.get("call_id")}
    role = item.get("role")
    if kind not in (None, "message") or role is None:
        raise Invalid("input", f"Unsupported input item type: {kind}")
    content = item.get("content")
    if role == "assistant":
        text = content if isinstance(content, str) else None
        if isinstance(content, list) and content:
            first = content[0]
            text = first.get("text") if isinstance(first, dict) else None
        if text is not None:
            if assistant is not None and assistant.get("content") is None:
                assistant["content"] = text
                return None
            return {"role": "assistant", "content": text}
    if role not in ("user", "system", "developer", "assistant"):
        raise Invalid(f"{where}.role", f"{where}.role: user, system, developer or assistant")
    message: dict[str, Any] = {"role": role}
    if isinstance(content, list):
        message["content"] = _parts(content, f"{where}.content")
    elif isinstance(content, str):
        message["content"] = content
    else:
        raise Invalid(f"{where}.content", f"{where}.content: a string or a list of content parts")
    if isinstance(item.get("name"), str):
        message["name"] = item["name"]
    return message


def _parts(parts: list[Any], where: str) -> list[dict[str, Any]]:
    """Content parts as chat text parts (vLLM renders input_text, output_text and text parts alike: their
    text, joined by newlines); images, files and audio are a 400."""
    out = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in UNSUPPORTED_PARTS:
            raise Invalid(
                f"{where}.{j}",
                f"{where}.{j}: {kind} parts are not supported by this gateway (text only: what the policy "
                "can be trained on exactly)",
            )
        if kind not in ("input_text", "output_text", "text", "refusal"):
            raise Invalid(f"{where}.{j}", f"{where}.{j}: unsupported content part type {kind!r}")
        assert isinstance(part, dict)
        text = part.get("refusal") if kind == "refusal" else part.get("text")
        if not isinstance(text, str):
            raise Invalid(f"{where}.{j}", f"{where}.{j}: a string text is required")
        out.append({"type": "text", "text": text})
    return out


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    for key in ("content", "summary"):  # vLLM reads the content, else the summary
        parts = item.get(key)
        if isinstance(parts, list) and parts:
            first = parts[0]
            text = first.get("text") if isinstance(first, dict) else None
            if not isinstance(text, str):
                raise Invalid(where, f"{where}.{key}.0.text: a string is required")
            return text
    return ""


def _continues(raw_input: Any) -> bool:
    """vLLM's `should_continue_final_message`: the last item is a message or reasoning still in progress."""
    if not isinstance(raw_input, list) or not raw_input or not isinstance(raw_input[-1], dict):
        return False
    last = raw_input[-1]
    return last.get("type", "message") in ("message", "reasoning") and last.get("status") in (
        "in_progress",
        "incomplete",
    )


def _tools(
    tools: list[Any],
) -> tuple[list[dict[str, Any]], dict[str, tuple[str, str | None]], frozenset[str]]:
    """(the chat tools the model is shown, flat name -> (name, namespace), custom tool names): vLLM's
    `get_function_tools`: functions as they are, a namespace's functions as `<namespace>__<name>`, a custom
    tool as a function of one string; other tools are not shown (the gateway runs no server tools)."""
    chat: list[dict[str, Any]] = []
    names: dict[str, tuple[str, str | None]] = {}
    custom: set[str] = set()
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind is None:
            raise Invalid(f"tools.{i}", f"tools.{i}: a tool object with a type is required")
        assert isinstance(tool, dict)
        if kind == "function":
            chat.append(_function(tool, f"tools.{i}"))
        elif kind == "namespace":
            namespace, inner = tool.get("name"), tool.get("tools")
            if not isinstance(namespace, str) or not isinstance(inner, list):
                raise Invalid(f"tools.{i}", f"tools.{i}: a namespace needs a name and a list of tools")
            for j, function in enumerate(inner):
                if isinstance(function, dict) and function.get("type") == "function":
                    flat = _function(function, f"tools.{i}.tools.{j}")
                    local = flat["function"]["name"]
                    flat["function"]["name"] = f"{namespace}{NAMESPACE_SEPARATOR}{local}"
                    names[flat["function"]["name"]] = (local, namespace)
                    chat.append(flat)
        elif kind == "custom":
            name = tool.get("name")
            if not isinstance(name, str) or not name:
                raise Invalid(f"tools.{i}", f"tools.{i}: a custom tool needs a name")
            custom.add(name)
            chat.append(
                {
                    "type": "function",
                    "function": {
                        "name": name,
                        "description": tool.get("description"),
                        "parameters": CUSTOM_PARAMETERS,
                    },
                }
            )
    return chat, names, frozenset(custom)


def _function(tool: dict[str, Any], where: str) -> dict[str, Any]:
    """A flat function tool in chat form: name, description, parameters, and strict and defer_loading when
    set (openai's FunctionTool made vLLM's FunctionDefinition)."""
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise Invalid(where, f"{where}: a function tool needs a name")
    parameters = tool.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise Invalid(where, f"{where}.parameters: a JSON schema object")
    # vLLM's FunctionDefinition as it dumps it (templates render the keys in this order)
    function: dict[str, Any] = {
        "name": name,
        "description": tool.get("description"),
        "parameters": parameters,
    }
    for key in ("strict", "defer_loading"):
        if tool.get(key) is not None:
            function[key] = tool[key]
    return {"type": "function", "function": function}


def _tool_choice(
    choice: Any, tools: list[Any], chat_tools: list[dict[str, Any]], names: dict[str, tuple[str, str | None]]
) -> Any:
    if choice in ("auto", "none"):
        return choice
    if not chat_tools:
        raise Invalid(
            "tool_choice",
            "tool_choice requires a function call, but tools contains no function tool the model can call."
            if tools
            else "Tool choice 'required' must be specified with 'tools' parameter."
            if choice == "required"
            else "Tool choice 'function' not found in 'tools' parameter.",
        )
    if choice == "required":
        return choice
    kind = choice.get("type") if isinstance(choice, dict) else None
    name = choice.get("name") if isinstance(choice, dict) else None
    if kind not in ("function", "custom") or not isinstance(name, str):
        raise Invalid(
            "tool_choice",
            'tool_choice: "none", "auto", "required", or {"type": "function" or "custom", "name": ...}',
        )
    flat = {t["function"]["name"] for t in chat_tools}
    if name not in flat:  # a namespace's function named by its own name, when only one namespace has it
        candidates = [n for n, (local, _) in names.items() if local == name]
        if len(candidates) > 1:
            raise Invalid(
                "tool_choice",
                f"Tool choice '{name}' is ambiguous: it is defined in more than one namespace "
                f"({', '.join(sorted(candidates))}). Select it by its full '<namespace>__<name>' name.",
            )
        if not candidates:
            raise Invalid("tool_choice", "Tool choice 'function' not found in 'tools' parameter.")
        name = candidates[0]
    return {"type": "function", "function": {"name": name}}


def _text_format(text: Any, chat: dict[str, Any]) -> None:
    if (text := capture.optional_object(text, "text")) is None:
        return
    fmt = text.get("format")
    if fmt is None:
        return
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return
    if kind == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif kind == "json_schema" and isinstance(fmt.get("schema"), dict):
        schema = {"name": fmt.get("name") or "schema", "schema": fmt["schema"]}
        if fmt.get("strict") is not None:
            schema["strict"] = fmt["strict"]
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    else:
        raise Invalid("text.format", "text.format: text, json_object, or json_schema with a schema")


def _reasoning(reasoning: Any, chat: dict[str, Any]) -> None:
    if (reasoning := capture.optional_object(reasoning, "reasoning")) is None:
        return
    effort = reasoning.get("effort")
    if effort is not None:
        if not isinstance(effort, str):
            raise Invalid("reasoning.effort", "reasoning.effort: a string")
        chat["reasoning_effort"] = effort


# ---------------------------------------------------------------------------------------------------------
# Answer: chat completion -> response


def _random() -> str:
    return f"{uuid.uuid4().int & 0xFFFFFFFFFFFFFFFF:016x}"


def _reasoning_item(item_id: str, text: str | None, status: str | None) -> dict[str, Any]:
    return {
        "id": item_id,
        "summary": [],
        "type": "reasoning",
        "content": None if text is None else [{"text": text, "type": "reasoning_text"}],
        "encrypted_content": None,
        "status": status,
    }


def _call_item(
    request: Request, item_id: str, call_id: str, flat_name: str, arguments: str, status: str
) -> dict[str, Any]:
    if flat_name in request.custom:
        return {
            "call_id": call_id,
            "input": _custom_input(arguments),
            "name": flat_name,
            "type": "custom_tool_call",
            "id": item_id,
            "async": None,
            "caller": None,
            "namespace": None,
        }
    name, namespace = request.names.get(flat_name, (flat_name, None))
    return items.function_call(item_id, call_id, name, arguments, status, namespace)


def _custom_input(arguments: str) -> str:
    """A custom tool's payload from the function shim's arguments (bare text passes through)."""
    try:
        parsed = json.loads(arguments)
    except (ValueError, RecursionError):
        return arguments
    value = parsed.get(CUSTOM_INPUT_KEY) if isinstance(parsed, dict) else None
    return _whole(value) if isinstance(value, str) else arguments


_SURROGATE = re.compile("[\ud800-\udfff]")


def _whole(text: str) -> str:
    """`text` with each lone surrogate (a \\uD8xx escape without its pair decodes to one) as U+FFFD: no
    JSON encoder writes one out. Character by character, so a prefix stays a prefix."""
    return _SURROGATE.sub("\ufffd", text)


def _logprob(entry: dict[str, Any]) -> dict[str, Any]:
    """A chat log-prob entry as a Responses one (openai's `response_output_text.Logprob`)."""
    token = entry.get("token") or ""
    return {
        "token": token,
        "bytes": entry.get("bytes") or list(token.encode("utf-8", "replace")),
        "logprob": max(entry.get("logprob", 0.0), -9999.0),
        "top_logprobs": [
            {
                "token": t.get("token") or "",
                "bytes": t.get("bytes") or list((t.get("token") or "").encode("utf-8", "replace")),
                "logprob": max(t.get("logprob", 0.0), -9999.0),
            }
            for t in entry.get("top_logprobs") or ()
        ],
    }


def _status(finish_reason: Any) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def usage(chat_usage: Any) -> dict[str, Any]:
    """The chat answer's usage as the Responses API's (reasoning tokens: the chat's own count of them)."""
    chat_usage = chat_usage if isinstance(chat_usage, dict) else {}
    prompt = _count(chat_usage.get("prompt_tokens"))
    completion = _count(chat_usage.get("completion_tokens"))
    details = chat_usage.get("prompt_tokens_details")
    details = details if isinstance(details, dict) else {}
    output = chat_usage.get("completion_tokens_details")
    output = output if isinstance(output, dict) else {}
    return {
        "input_tokens": prompt,
        "input_tokens_details": {
            "cached_tokens": _count(details.get("cached_tokens")),
            "cache_write_tokens": 0,
            "input_tokens_per_turn": [],
            "cached_tokens_per_turn": [],
        },
        "output_tokens": completion,
        "output_tokens_details": {
            "reasoning_tokens": _count(output.get("reasoning_tokens")),
            "tool_output_tokens": 0,
            "output_tokens_per_turn": [],
            "tool_output_tokens_per_turn": [],
        },
        "total_tokens": prompt + completion,
    }


def _echo_tool(tool: Any) -> Any:
    """A function tool as vLLM echoes it (openai's `FunctionTool`, every field); other tools as sent."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        return tool
    return items.function_tool(tool)


def _echo_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and isinstance(choice.get("name"), str):
        return {"name": choice["name"], "type": choice.get("type", "function")}
    return choice


def _echo_text(text: Any) -> Any:
    if not isinstance(text, dict):
        return None
    fmt = text.get("format")
    return {"format": fmt, "verbosity": text.get("verbosity")}


def body(
    request: Request,
    model: Any,
    output: list[dict[str, Any]],
    status: str,
    chat_usage: dict[str, Any] | None,
    final: bool = True,
) -> dict[str, Any]:
    """The response object (vLLM's `ResponsesResponse.from_request`, dumped as it dumps it); `final=False`:
    the in-progress response of a stream's first two events (no usage)."""
    asked = request.body
    tools = request.tools
    choice = asked.get("tool_choice", "auto")
    if not tools and choice in ("auto", "none"):
        choice = "none"
    temperature, top_p = asked.get("temperature"), asked.get("top_p")
    return {
        "id": request.response_id,
        "created_at": request.created_at,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": asked.get("instructions"),
        "metadata": asked.get("metadata"),
        "model": model,
        "object": "response",
        "output": output,
        "parallel_tool_calls": request.parallel,
        "temperature": 1.0 if temperature is None else float(temperature),
        "tool_choice": _echo_tool_choice(choice),
        "tools": [_echo_tool(t) for t in tools],
        "top_p": 1.0 if top_p is None else float(top_p),
        "background": bool(asked.get("background", False)),
        "max_output_tokens": asked.get("max_output_tokens"),
        "max_tool_calls": asked.get("max_tool_calls"),
        "previous_response_id": None,
        "prompt": None,
        "prompt_cache_options": None,
        "prompt_cache_key": asked.get("prompt_cache_key"),
        "prompt_cache_retention": asked.get("prompt_cache_retention"),
        "reasoning": items.reasoning(asked.get("reasoning")),
        "safety_identifier": asked.get("safety_identifier"),
        "service_tier": asked.get("service_tier", "auto"),
        "status": status,
        "text": None if request.constrained else _echo_text(asked.get("text")),
        "top_logprobs": request.top_logprobs if request.logprobs else None,
        "truncation": asked.get("truncation", "disabled"),
        "usage": usage(chat_usage) if final else None,
        "user": asked.get("user"),
        "presence_penalty": float(asked.get("presence_penalty") or 0.0),
        "frequency_penalty": float(asked.get("frequency_penalty") or 0.0),
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "input_messages": None,
        "output_messages": None,
    }


def response(payload: dict[str, Any], request: Request) -> dict[str, Any]:
    """The response for a chat completion's first choice (vLLM's `build_response_output_items`: reasoning,
    then a message when there is text, then one item per tool call; the last item is incomplete when the
    token budget cut it)."""
    choice = (payload.get("choices") or [{}])[0]
    msg = choice.get("message") or {}
    status = _status(choice.get("finish_reason"))
    calls = msg.get("tool_calls") or []
    if not request.parallel:
        calls = calls[:1]
    output: list[dict[str, Any]] = []
    reasoning = msg.get("reasoning") or msg.get("reasoning_content")
    if reasoning:
        output.append(_reasoning_item(f"rs_{_random()}", reasoning, None))
    content = msg.get("content")
    if content:
        logprobs = None
        if request.logprobs:
            logprobs = [_logprob(e) for e in (choice.get("logprobs") or {}).get("content") or ()]
        output.append(
            items.message(
                f"msg_{_random()}", [items.text_part(content, logprobs)], "completed" if calls else status
            )
        )
    for i, call in enumerate(calls):
        function = call.get("function") or {}
        output.append(
            _call_item(
                request,
                f"ctc_{_random()}" if function.get("name") in request.custom else f"fc_{_random()}",
                call.get("id") or f"call_{_random()}",
                function.get("name") or "",
                function.get("arguments") or "",
                status if i == len(calls) - 1 else "completed",
            )
        )
    return body(request, payload.get("model"), output, status, payload.get("usage"))


# ---------------------------------------------------------------------------------------------------------
# Streams: chat chunks -> Responses events


class ResponsesRelay(TranslatedRelay):
    """A chat completion stream turned into the Responses event stream (`TranslatedRelay`: the terminal
    event, response.completed, or response.incomplete when the token budget ran out, waits in `held` until
    the call is committed).

    Events as vLLM's `/v1/responses` sends them for a chat-template model (`SimpleStreamingEventProcessor`):
    response.created and response.in_progress, then one open item at a time, opened by the kind of the
    chunk's delta (a tool call over reasoning over text; a tool call of another index opens a new item):
    a reasoning item (reasoning_text deltas), a message (output_text deltas, with the chunk's log-probs when
    asked), a function call (its arguments' deltas) or a custom tool call (its input's deltas); a change
    closes the open item as completed, the end closes the last one with the response's status.
    `sequence_number` counts every event from 0. An upstream error chunk ends the stream with an error
    event, and nothing after it."""

    def __init__(self, assembler: StreamAssembler, request: Request) -> None:
        super().__init__(assembler)
        self.request = request
        self._sequence = 0
        self._model: Any = None
        self._finish: Any = None
        self._items: list[dict[str, Any]] = []
        self._index = 0
        self._state: str | None = None  # "content", "reasoning", "call"
        self._item_id = ""
        self._text = ""
        self._logprobs: list[dict[str, Any]] = []
        self._call: dict[str, Any] = {}

    def _emit(self, out: list[bytes], event: dict[str, Any]) -> None:
        event["sequence_number"] = self._sequence
        self._sequence += 1
        out.append(b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event))

    def _error(self, code: Any, message: str, out: list[bytes]) -> None:
        self._emit(
            out,
            {"type": "error", "code": None if code is None else str(code), "message": message, "param": None},
        )

    def _start(self, chunk: dict[str, Any], out: list[bytes]) -> bool:
        self._model = chunk.get("model")
        start = body(self.request, self._model, [], "in_progress", None, final=False)
        self._emit(out, {"response": start, "sequence_number": 0, "type": "response.created"})
        self._emit(out, {"response": start, "sequence_number": 0, "type": "response.in_progress"})
        return True

    def _translate(self, chunk: dict[str, Any], out: list[bytes]) -> None:
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            if choice.get("finish_reason") is not None:
                self._finish = choice["finish_reason"]
            delta = choice.get("delta") or {}
            logprobs = (choice.get("logprobs") or {}).get("content") or []
            self._delta(delta, logprobs, out)

    def _delta(self, delta: dict[str, Any], logprobs: list[dict[str, Any]], out: list[bytes]) -> None:
        """One chat delta, split as vLLM's `split_delta` (reasoning, content, then tool calls by index)."""
        reasoning = delta.get("reasoning")
        if reasoning is None:
            reasoning = delta.get("reasoning_content")
        calls = [c for c in delta.get("tool_calls") or () if isinstance(c, dict)]
        if not self.request.parallel:
            calls = [c for c in calls if c.get("index") == 0]
        if reasoning is not None:
            self._move("reasoning", None, out)
            self._text += reasoning
            self._emit(
                out,
                {
                    "content_index": 0,
                    "delta": reasoning,
                    "item_id": self._item_id,
                    "output_index": self._index,
                    "sequence_number": 0,
                    "type": "response.reasoning_text.delta",
                },
            )
        content = delta.get("content")
        if content:
            self._move("content", None, out)
            entries = [_logprob(e) for e in logprobs] if self.request.logprobs else []
            self._text += content
            self._logprobs += entries
            self._emit(
                out,
                {
                    "content_index": 0,
                    "delta": content,
                    "item_id": self._item_id,
                    "logprobs": [items.stream_logprob(e) for e in entries],
                    "output_index": self._index,
                    "sequence_number": 0,
                    "type": "response.output_text.delta",
                },
            )
        groups: dict[Any, list[dict[str, Any]]] = {}
        for call in calls:
            groups.setdefault(call.get("index"), []).append(call)
        for group in groups.values():
            if group[0].get("function") is None:
                continue
            self._move("call", group[0], out)
            arguments = "".join((c.get("function") or {}).get("arguments") or "" for c in group)
            if arguments:
                self._arguments(arguments, out)

    def _move(self, state: str, call: dict[str, Any] | None, out: list[bytes]) -> None:
        """Open the item for `state` unless it is open (a tool call of another index is another item)."""
        if state == self._state and (
            state != "call"
            or call is None
            or call.get("index") is None
            or self._call.get("index") is None
            or call.get("index") == self._call["index"]
        ):
            return
        self._close("completed", out)
        self._state, self._text, self._logprobs = state, "", []
        if state == "content":
            self._item_id = f"msg_{_random()}"
            self._added(items.message(self._item_id, [], "in_progress"), out)
            self._emit(
                out,
                {
                    "content_index": 0,
                    "item_id": self._item_id,
                    "output_index": self._index,
                    "part": items.text_part("", []),
                    "sequence_number": 0,
                    "type": "response.content_part.added",
                },
            )
        elif state == "reasoning":
            self._item_id = f"rs_{_random()}"
            self._added(_reasoning_item(self._item_id, None, "in_progress"), out)
            self._emit(
                out,
                {
                    "content_index": 0,
                    "item_id": self._item_id,
                    "output_index": self._index,
                    "part": {"text": "", "type": "reasoning_text"},
                    "sequence_number": 0,
                    "type": "response.content_part.added",
                },
            )
        else:
            assert call is not None
            function = call.get("function") or {}
            flat = function.get("name") or ""
            custom = flat in self.request.custom
            self._item_id = f"ctc_{_random()}" if custom else f"fc_{_random()}"
            self._call = {
                "index": call.get("index"),
                "id": call.get("id") or f"call_{_random()}",
                "name": flat,
                "custom": custom,
                "payload": "",
                "input": _CustomInput() if custom else None,
            }
            item = _call_item(self.request, self._item_id, self._call["id"], flat, "", "in_progress")
            if custom:
                item["input"] = ""
            self._added(item, out)

    def _added(self, item: dict[str, Any], out: list[bytes]) -> None:
        self._emit(
            out,
            {
                "item": item,
                "output_index": self._index,
                "sequence_number": 0,
                "type": "response.output_item.added",
            },
        )

    def _arguments(self, arguments: str, out: list[bytes]) -> None:
        self._text += arguments
        if self._call["custom"]:
            self._custom_delta(self._call["input"].feed(arguments), out)
            return
        self._emit(
            out,
            {
                "delta": arguments,
                "item_id": self._item_id,
                "output_index": self._index,
                "sequence_number": 0,
                "type": "response.function_call_arguments.delta",
            },
        )

    def _custom_delta(self, payload: str, out: list[bytes]) -> None:
        """vLLM's custom input deltas: what is new of the payload, or all of it when it is not an extension."""
        streamed = self._call["payload"]
        if payload == streamed:
            return
        self._call["payload"] = payload
        self._emit(
            out,
            {
                "delta": payload[len(streamed) :] if payload.startswith(streamed) else payload,
                "item_id": self._item_id,
                "output_index": self._index,
                "sequence_number": 0,
                "type": "response.custom_tool_call_input.delta",
            },
        )

    def _close(self, status: str, out: list[bytes]) -> None:
        state, self._state = self._state, None
        if state is None:
            return
        item_id, index, text = self._item_id, self._index, self._text
        if state == "content":
            part = items.text_part(text, self._logprobs or None)
            item = items.message(item_id, [part] if text else [], status)
            self._emit(
                out,
                {
                    "content_index": 0,
                    "item_id": item_id,
                    "logprobs": [],
                    "output_index": index,
                    "sequence_number": 0,
                    "text": text,
                    "type": "response.output_text.done",
                },
            )
            self._part_done(part, out)
        elif state == "reasoning":
            part = {"text": text, "type": "reasoning_text"}
            item = _reasoning_item(item_id, text, status)
            self._emit(
                out,
                {
                    "content_index": 0,
                    "item_id": item_id,
                    "output_index": index,
                    "sequence_number": 0,
                    "text": text,
                    "type": "response.reasoning_text.done",
                },
            )
            self._part_done(part, out)
        elif self._call["custom"]:
            payload = _custom_input(text)
            self._custom_delta(payload, out)
            self._emit(
                out,
                {
                    "input": payload,
                    "item_id": item_id,
                    "output_index": index,
                    "sequence_number": 0,
                    "type": "response.custom_tool_call_input.done",
                },
            )
            item = _call_item(self.request, item_id, self._call["id"], self._call["name"], text, status)
        else:
            item = _call_item(self.request, item_id, self._call["id"], self._call["name"], text, status)
            self._emit(
                out,
                {
                    "arguments": text,
                    "item_id": item_id,
                    "output_index": index,
                    "sequence_number": 0,
                    "type": "response.function_call_arguments.done",
                    "name": item["name"],
                },
            )
        self._emit(
            out,
            {"item": item, "output_index": index, "sequence_number": 0, "type": "response.output_item.done"},
        )
        self._items.append(item)
        self._index += 1

    def _part_done(self, part: dict[str, Any], out: list[bytes]) -> None:
        self._emit(
            out,
            {
                "content_index": 0,
                "item_id": self._item_id,
                "output_index": self._index,
                "part": part,
                "sequence_number": 0,
                "type": "response.content_part.done",
            },
        )

    def _finish_events(self) -> list[bytes]:
        out: list[bytes] = []
        if not self._started:
            return out
        status = _status(self._finish)
        self._close(status, out)
        final = body(self.request, self._model, self._items, status, self._usage)
        self._emit(out, {"response": final, "sequence_number": 0, "type": f"response.{status}"})
        return out


class _CustomInput:
    """A custom tool's payload as its shim's JSON arguments stream in: the `input` string's value decoded as
    far as it is complete, so that the streamed input deltas stay a prefix of the final input (vLLM's
    `decode_custom_tool_input_prefix`). Each delta is scanned once (a re-scan of everything per delta
    would be quadratic in the answer's length, on the event loop)."""

    # the arguments' start, as the shim's JSON object begins: {"input": "  (vLLM streams nothing else)
    _OPEN = re.compile(r'\s*\{\s*"' + CUSTOM_INPUT_KEY + r'"\s*:\s*"')
    _OPENING = '{"' + CUSTOM_INPUT_KEY + '":"'
    _WAIT_MAX = 4096  # characters of arguments without that start: it never comes
    _BODY = re.compile(r'(?:[^"\\]|\\.)*', re.DOTALL)  # a JSON string's body, escapes whole

    def __init__(self) -> None:
        self.text = ""
        self.payload = ""
        self._start: int | None = None  # where the value's body starts
        self._scanned = 0  # the body is scanned (whole escapes) up to here
        self._decoded = 0  # and decoded into `payload` up to here
        self._closed = False

    def feed(self, delta: str) -> str:
        if self._closed:  # the string ended, or the arguments are not the shim's object
            return self.payload
        self.text += delta
        if self._start is None:
            found = self._OPEN.match(self.text)
            if found is None:
                squeezed = "".join(self.text[:256].split())
                if not self._OPENING.startswith(squeezed) or len(self.text) > self._WAIT_MAX:
                    self._closed = True  # not the shim's object: nothing streams before the end
                return self.payload
            self._start = self._scanned = self._decoded = found.end()
        match = self._BODY.match(self.text, self._scanned)
        assert match is not None  # the pattern matches the empty string
        end = self._scanned = match.end()
        self._closed = end < len(self.text) and self.text[end] == '"'  # (else at a lone trailing backslash)
        if not self._closed:
            end = self._before_unfinished_escape(end)
        try:
            piece = json.loads('"' + self.text[self._decoded : end] + '"')
        except ValueError:
            return self.payload
        if piece and "\ud800" <= piece[-1] <= "\udbff":  # half a surrogate pair: wait for the other half
            piece, end = piece[:-1], end - 6
        self.payload += _whole(piece)
        self._decoded = end
        return self.payload

    def _before_unfinished_escape(self, end: int) -> int:
        """`end`, or where a \\uXXXX escape that has not all its digits yet starts (it waits for them)."""
        for back in range(2, 6):  # "\\u" and up to three digits before `end`
            i = end - back
            if i < self._decoded:
                break
            if self.text[i] == "\\" and self.text[i + 1] == "u":
                first = i
                while first > self._decoded and self.text[first - 1] == "\\":
                    first -= 1
                return i if (i - first) % 2 == 0 else end  # an escape's backslash, not an escaped one
        return end
