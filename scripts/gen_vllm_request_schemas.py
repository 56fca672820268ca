"""Write gateway/vllm_requests.json: the JSON schemas of vLLM 0.33's request bodies for
/v1/chat/completions, /v1/completions and /v1/responses, taken from vLLM's own OpenAPI document (its routers
in a FastAPI app), with every schema they reference. The gateway's OpenAPI document (`gateway.openapi`)
describes its proxy routes with them, so the served document needs no vLLM installed.

Run with the vLLM oracle's Python (scripts/test makes it):

    .venv-vllm/bin/python scripts/gen_vllm_request_schemas.py [--check]

`--check` exits 1 when the file differs from what vLLM generates (tests/test_openapi.py runs it).
Descriptions below the request models themselves are dropped (they are vLLM's and OpenAI's docs, most of
the file's size otherwise).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent.parent / "gateway" / "vllm_requests.json"
REQUESTS = {
    "chat.completions": "ChatCompletionRequest",
    "completions": "CompletionRequest",
    "responses": "ResponsesRequest",
}


def _strip(node: Any, keep_descriptions: bool) -> Any:
    if isinstance(node, dict):
        return {
            k: _strip(v, False)
            for k, v in node.items()
            if keep_descriptions or k not in ("description", "examples", "title")
        }
    if isinstance(node, list):
        return [_strip(v, False) for v in node]
    return node


def _closure(schemas: dict[str, Any], root: str) -> set[str]:
    seen, todo = set(), [root]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        text = json.dumps(schemas[name])
        todo += [part.split('"', 1)[0] for part in text.split('"#/components/schemas/')[1:]]
    return seen


def generate() -> str:
    import vllm
    from fastapi import FastAPI
    from vllm.entrypoints.openai.chat_completion.api_router import router as chat
    from vllm.entrypoints.openai.completion.api_router import router as completion
    from vllm.entrypoints.openai.responses.api_router import router as responses

    app = FastAPI()
    for router in (chat, completion, responses):
        app.include_router(router)
    schemas = app.openapi()["components"]["schemas"]
    names = set().union(*(_closure(schemas, root) for root in REQUESTS.values()))
    out = {}
    for name in sorted(names):
        schema = _strip(schemas[name], False)
        if name in REQUESTS.values():  # the request models keep their field descriptions
            schema = {
                **schema,
                "properties": {k: _strip(v, True) for k, v in schemas[name]["properties"].items()},
            }
        out[name] = schema
    # one schema a line: a vLLM upgrade shows as a readable diff
    head = json.dumps({"vllm_version": vllm.__version__, "requests": REQUESTS}, sort_keys=True)[:-1]
    lines = [
        f" {json.dumps(name)}: {json.dumps(schema, sort_keys=True)}" for name, schema in sorted(out.items())
    ]
    return head + ', "schemas": {\n' + ",\n".join(lines) + "\n}}\n"


def main() -> int:
    text = generate()
    if "--check" in sys.argv[1:]:
        if OUT.read_text() != text:
            print(f"{OUT} is not what vLLM generates: run {' '.join(sys.argv[:1])}", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT} ({len(text)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
