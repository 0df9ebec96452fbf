"""Agents that slip, as generation backends plugged in by dotted path (`generate.backend:
tests.integration.slips:SlipPolicy`): what the hindsight and step-checker tests sample from.

`SlipPolicy` is a coding agent: it answers a generated code task at once with its template's solution, and on
three samples of four with one constant moved to another value of its template's range: the slip a small model
makes copying a task's numbers (docs/envs.md). A tiny stand-in trained for seconds writes no such program; a
policy that writes them on purpose puts the filter's relabeling, the store and the training that reads it under
test in a minute. The ids it returns are the model's tokenizer's encoding of its answer and the chat turn's end,
as a sampler's are. `ShortcutCalculator` answers calculator questions right in ways the step checker tells apart.
"""

from __future__ import annotations

import random
import re
import string
from typing import Any

from transformers import AutoTokenizer

from components.envs import toolcalls
from components.envs.calculator import calculate
from components.envs.code import CodeEnv, parse_task, ranges_of
from components.models.backends import Sample


class SlipPolicy:
    def __init__(self, model: str, **_: Any):
        self.tok = AutoTokenizer.from_pretrained(model)
        self.turn_end = self.tok.convert_tokens_to_ids("<|im_end|>")
        self.env = CodeEnv()

    def answer(self, conversation: str, rng: random.Random) -> str:
        asked = parse_task(conversation)
        if asked is None:
            return "I cannot read this task."
        level, template, params = asked
        used = sorted({name for _, name, _, _ in string.Formatter().parse(template[2])} & {"k", "c", "m"})
        if used and "{hi}" not in template[2] and rng.random() < 0.75:
            name = rng.choice(used)
            lo, hi = ranges_of(template)[name]
            params[name] = rng.choice([v for v in range(lo, hi + 1) if v != params[name]])
        return f"```python\n{self.env.task(level, template, params).meta['solution']}\n```"

    def generate_ids(self, prompt_ids: list[list[int]], n: int, temperature: float, top_p: float,
                     max_new_tokens: int, seed: int, stop: list[str] | None = None) -> list[list[Sample]]:
        return scripted(self, prompt_ids, n, seed)


class ShortcutCalculator(SlipPolicy):
    """A calculator agent that answers every question right, one way of four chosen at its first turn: it calls
    `calculate` on the question and repeats the result (sound); answers at once without the tool; calls it on
    another expression and answers right anyway, ignoring the result; or writes a call that does not parse, then
    calls it as asked and repeats the result. All four are right; only the first checks out
    (CalculatorEnv.check_episode)."""

    WAYS = ("sound", "no_tool", "ignores_result", "broken_call")

    def answer(self, conversation: str, rng: random.Random) -> str:
        asked = re.search(r"What is (.+?)\?", conversation).group(1)
        value = calculate(asked)
        turns = conversation.split("<|im_start|>assistant\n")[1:-1]  # its turns so far, each with what came back
        call = lambda e: toolcalls.format_call("calculate", {"expression": e})  # noqa: E731
        if not turns:
            way = rng.choice(self.WAYS)
            return {"sound": call(asked), "no_tool": f"#### {value}", "broken_call": '<tool_call>{"name": </tool_call>',
                    "ignores_result": call(asked.replace("*", "+", 1))}[way]
        last = turns[-1]
        if "<tool_response>\nerror:" in last:  # the broken call's error: call it as asked
            return call(asked)
        result = re.search(r"<tool_response>\n(.*?)\n</tool_response>", last, re.S).group(1)
        return f"#### {result if asked in last.split('<tool_response>')[0] else value}"


def scripted(policy: SlipPolicy, prompt_ids: list[list[int]], n: int, seed: int) -> list[list[Sample]]:
    """`policy.answer` on each decoded conversation, as a sampler's output: the model tokenizer's ids of the text
    and the chat turn's end."""
    out = []
    for k, ids in enumerate(prompt_ids):
        conversation = policy.tok.decode(ids)
        samples = []
        for i in range(n):
            text = policy.answer(conversation, random.Random(f"{seed}:{k}:{i}:{conversation}"))
            token_ids = tuple(policy.tok.encode(text, add_special_tokens=False)) + (policy.turn_end,)
            samples.append(Sample(text, len(token_ids), "stop", token_ids))
        out.append(samples)
    return out
