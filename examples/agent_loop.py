"""A tool-using agent loop with the official ``openai`` client: a calculator and a document
lookup, run against ``prefixcache serve``. Every step resends the same tools block and the
growing transcript; the sidecar renders tools canonically, so from step 2 on the tools block
and all earlier turns come from the prefix cache (printed per step).

    pip install openai                         # not a prefixcache dependency
    prefixcache serve --model PATH_OR_NAME     # e.g. smollm2
    python examples/agent_loop.py [--base-url URL] [--model NAME] [--steps 6] [--force-tools 2]

``--force-tools N`` sends ``tool_choice="required"`` (one call per step) for the first N steps, so the loop calls
tools even on a model that would not (the grammar engine then forces a valid call); after
that the model decides (``auto``) and the loop ends when it answers in text.

A template that ignores tools (the demo model's, SmolLM2's) gets them in the sidecar's generic
JSON format (docs/sidecar.md), its replies held to it by a grammar; ``--chat-template FILE``
gives the model a template that renders them in a format of its own instead.
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import os
import sys

import openai

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"

DOCUMENTS = {
    "prefix-cache": "A prefix cache keeps the KV state of token prefixes in 16-token blocks.",
    "eviction": "Blocks no request uses stay cached; the least recently used leaves go first.",
    "pinning": "Pinned prefixes are evicted last and can be saved to disk and loaded back.",
}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression (+ - * / ** and parentheses).",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look up a document by key: " + ", ".join(DOCUMENTS) + ".",
            "parameters": {
                "type": "object",
                "properties": {"key": {"enum": list(DOCUMENTS)}},
                "required": ["key"],
            },
        },
    },
]

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
}


def calculate(expression: str) -> str:
    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError("only numbers and + - * / ** are allowed")

    try:
        return str(value(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as exc:
        return f"error: {exc}"


def run_tool(name: str, arguments: str) -> str:
    try:
        args = json.loads(arguments)
    except ValueError:
        return "error: arguments are not JSON"
    if name == "calculator":
        return calculate(str(args.get("expression", "")))
    if name == "lookup":
        return DOCUMENTS.get(str(args.get("key")), "error: no such document")
    return f"error: unknown tool {name!r}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--base-url",
        default=os.environ.get("PREFIXCACHE_BASE_URL", DEFAULT_BASE_URL),
        help=f"$PREFIXCACHE_BASE_URL, else {DEFAULT_BASE_URL} (here: %(default)s)",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("PREFIXCACHE_API_KEY"),
        help="a key, if the server has keys (default: $PREFIXCACHE_API_KEY)",
    )
    parser.add_argument("--model", default=None, help="model name (default: the server's)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--force-tools", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args(argv)

    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key or "none", max_retries=0)
    model = args.model or client.models.list().data[0].id
    messages: list[dict] = [
        {
            "role": "system",
            "content": "You answer questions about the prefix cache. Use the tools: look "
            "documents up, compute numbers, then answer briefly.",
        },
        {
            "role": "user",
            "content": "How many tokens do 12 full blocks hold, and what is evicted first?",
        },
    ]
    for step in range(1, args.steps + 1):
        choice = "required" if step <= args.force_tools else "auto"
        try:
            reply = client.chat.completions.create(
                model=model,
                messages=messages,
                tools=TOOLS,
                tool_choice=choice,
                parallel_tool_calls=False,  # one call per step
                max_tokens=args.max_tokens,
                temperature=0,
            )
        except openai.BadRequestError as exc:
            print(f"the server refused the request: {exc.message}", file=sys.stderr)
            return 1
        usage = reply.usage
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        message = reply.choices[0].message
        print(
            f"step {step}: prompt {usage.prompt_tokens} tokens, cached {cached}, "
            f"finish {reply.choices[0].finish_reason}"
        )
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            print(f"answer: {message.content}")
            break
        for call in message.tool_calls:
            result = run_tool(call.function.name, call.function.arguments)
            print(f"  {call.function.name}({call.function.arguments}) -> {result}")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
