"""The tool-call format of Qwen2.5, Hermes and the stand-in's chat template: calls as JSON inside tags.

An assistant turn that calls a tool:

    Let me look at the table first.
    <tool_call>
    {"name": "run_sql", "arguments": {"query": "SELECT * FROM employees LIMIT 3"}}
    </tool_call>

A turn without a call is the agent's final answer. `parse` never raises: a call it cannot read (bad JSON,
no name, arguments that are not an object, a tag left open) becomes `Action.parse_error`, which the
environment answers with an error observation the agent sees and `v_tool_stats` counts.

    >>> a = parse('<tool_call>{"name": "calculate", "arguments": {"expression": "2*3"}}</tool_call>')
    >>> a.tool_calls[0].name, a.tool_calls[0].arguments, a.parse_error
    ('calculate', {'expression': '2*3'}, None)
    >>> parse('<tool_call>{"name": "calculate", "arguments": {"expression": </tool_call>').parse_error
    'tool call 1 is not valid JSON: Expecting value at char 49'
    >>> parse("#### 6").tool_calls
    ()
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from components.envs.base import Action, Tool, ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.S)


def parse(text: str) -> Action:
    calls, errors = [], []
    for i, m in enumerate(_CALL.finditer(text), 1):
        body = m.group(1).strip()
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            errors.append(f"tool call {i} is not valid JSON: {e.msg} at char {e.pos}")
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            errors.append(f'tool call {i} must be {{"name": ..., "arguments": {{...}}}}')
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            errors.append(f"tool call {i} ({obj['name']}): arguments must be a JSON object")
            continue
        calls.append(ToolCall(obj["name"], args))
    closed = _CALL.sub("", text)
    if OPEN in closed:
        errors.append(f"a {OPEN} is never closed with {CLOSE}")
    return Action(text, tuple(calls), "; ".join(errors) or None)


def format_call(name: str, arguments: dict) -> str:
    """How the agent writes a call: what reference episodes contain and the parser reads back."""
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{CLOSE}"


def system_prompt(tools: Sequence[Tool], instructions: str) -> str:
    """The system message: the task's instructions, then each tool's schema on one line (short, for the small
    models this trains; the full schemas go to backends that take `tools=` natively)."""
    if not tools:
        return instructions
    lines = [json.dumps(t.schema()["function"], separators=(",", ":")) for t in tools]
    return (f"{instructions}\nTools, called as {OPEN}{{\"name\": ..., \"arguments\": {{...}}}}{CLOSE}:\n"
            + "\n".join(lines))
