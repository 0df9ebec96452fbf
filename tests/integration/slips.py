"""A coding agent that slips, as a generation backend plugged in by dotted path
(`generate.backend: tests.integration.slips:SlipPolicy`): what the hindsight test samples from.

It answers a generated code task at once with its template's solution, and on three samples of four with one
constant moved to another value of its template's range: the slip a small model makes copying a task's numbers
(docs/envs.md). A tiny stand-in trained for seconds writes no such program; a policy that writes them on purpose
puts the filter's relabeling, the store and the training that reads it under test in a minute. The ids it
returns are the model's tokenizer's encoding of its answer and the chat turn's end, as a sampler's are.
"""

from __future__ import annotations

import random
import string
from typing import Any

from transformers import AutoTokenizer

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
        out = []
        for k, ids in enumerate(prompt_ids):
            conversation = self.tok.decode(ids)
            samples = []
            for i in range(n):
                text = self.answer(conversation, random.Random(f"{seed}:{k}:{i}:{conversation}"))
                token_ids = tuple(self.tok.encode(text, add_special_tokens=False)) + (self.turn_end,)
                samples.append(Sample(text, len(token_ids), "stop", token_ids))
            out.append(samples)
        return out
