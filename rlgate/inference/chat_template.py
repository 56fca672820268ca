"""ChatML with Hermes-style tools: the chat template of the tiny models built in code and of a real model
whose own template has no tools section (SmolLM2-Instruct's: `rlgate.models`).

Laid out as Qwen2.5 renders tools, the layout vLLM's `hermes` tool parser reads back. Tools (OpenAI
`{"type": "function", "function": {...}}` objects) go into the system turn as one JSON line each; an
assistant tool call renders as `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>` (arguments
given as a JSON string are inserted as is, a mapping through `tojson`); consecutive tool results form one
user turn of `<tool_response>` blocks.

Without a system message the template writes `default_system` (a model's own default, such as SmolLM2's
"You are a helpful AI assistant named SmolLM, trained by Hugging Face"), or none when it is None (the
tiny models). The text of each turn is exactly what a model trained on ChatML saw: `<|im_start|>ROLE\\n
CONTENT<|im_end|>\\n`.
"""

from __future__ import annotations

import json

_TOOLS_PREAMBLE = r"""
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments ' }}
    {{- 'within <tool_call></tool_call> XML tags:\n<tool_call>\n' }}
    {{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
"""

_TURNS = r"""
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- elif message.role == 'assistant' and message.tool_calls %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for call in message.tool_calls %}
            {%- set fn = call.function if call.function is defined else call %}
            {{- '\n<tool_call>\n{"name": "' + fn.name + '", "arguments": ' }}
            {%- if fn.arguments is string %}
                {{- fn.arguments }}
            {%- else %}
                {{- fn.arguments | tojson }}
            {%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' + (message.content or '') + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""


def chatml_tools_template(default_system: str | None = None) -> str:
    """The Jinja chat template (module docstring); `default_system`: the system text used when the
    conversation has no system message (None: no system turn then, unless there are tools)."""
    # the default as a Jinja string literal (JSON's escapes are Jinja's)
    default = "" if default_system is None else json.dumps(default_system)
    if default_system is None:
        tools_system = (
            "{%- if messages[0].role == 'system' %}\n"
            "        {{- messages[0].content + '\\n\\n' }}\n"
            "    {%- endif %}"
        )
        plain_system = (
            "{%- elif messages and messages[0].role == 'system' %}\n"
            "    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n"
        )
    else:
        tools_system = (
            "{%- if messages and messages[0].role == 'system' %}\n"
            "        {{- messages[0].content + '\\n\\n' }}\n"
            "    {%- else %}\n"
            f"        {{{{- {default} + '\\n\\n' }}}}\n"
            "    {%- endif %}"
        )
        plain_system = (
            "{%- elif messages and messages[0].role == 'system' %}\n"
            "    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n"
            "{%- else %}\n"
            f"    {{{{- '<|im_start|>system\\n' + {default} + '<|im_end|>\\n' }}}}\n"
        )
    head = (
        "{%- if tools %}\n"
        "    {{- '<|im_start|>system\\n' }}\n"
        f"    {tools_system}" + _TOOLS_PREAMBLE + plain_system + "{%- endif %}"
    )
    return (head + _TURNS).strip()
