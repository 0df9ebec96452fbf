"""The agent loop on a real model: each conversation as token ids that only ever grow, sampled in batches.

    encoder = ChatEncoder(tokenizer, "workdir/standin")
    ids, mask = encoder.encode(messages)   # mask 1: the assistant's own tokens, the only ones trained on
    sampler = ChatSampler(backend, encoder, temperature=1.0, top_p=1.0, max_new_tokens=96, seed=0)
    records = EpisodeRunner(sampler, toolcalls.parse, env.limits).run([(p, env.episode(p)) for p in problems])

Append-only tokenization. A conversation is tokenized segment by segment, never as one text: the rendered
text before each assistant turn, then that turn's ids as the model sampled them (kept on its message as
`token_ids`, the template's turn end included), then the rendered text after it, and so on. Re-tokenizing a
whole conversation would merge tokens across those boundaries and re-spell what the model sampled (a BPE model
can sample a spelling the tokenizer would not produce), so the ids trained on would differ from the ids
sampled. The sampler and the trainers call the same `encode`, so the two are equal by construction, and
`tests/unit/test_agent_tokens.py` checks it token by token on a trained BPE tokenizer.

An assistant message without `token_ids` (a reference episode) is its content tokenized, plus the turn end.
A turn cut at `max_new_tokens` gets the turn end the template writes, masked out: the model did not sample it.
A template that rewrites earlier turns when a later one is added (one that drops past reasoning, or trims the
assistant's text) cannot be extended this way: `encode` raises TemplateError naming the model.
"""

from __future__ import annotations

from typing import Any

from components.envs.base import Message
from components.models.prompts import PromptFormat, _adds_bos, chat_turn_end, check_prompt_format
from components.seeding import seed_stream


class TemplateError(ValueError):
    """A chat template that is not append-only: rendering a longer conversation changes the text of a shorter one."""


def assistant_spans(mask: list[int]) -> list[tuple[int, int]]:
    """The [start, end) runs of 1 in an assistant mask: one per assistant turn, in order.

    >>> assistant_spans([0, 0, 1, 1, 0, 1, 0, 0, 1])
    [(2, 4), (5, 6), (8, 9)]
    """
    runs, start = [], None
    for t, m in enumerate([*mask, 0]):
        if m and start is None:
            start = t
        elif not m and start is not None:
            runs.append((start, t))
            start = None
    return runs


class ChatEncoder:
    """Conversations as (token ids, assistant mask) with the model's chat template, append-only."""

    def __init__(self, tok: Any, where: str = "model"):
        check_prompt_format(tok, PromptFormat("chat"), where)
        self.tok, self.where = tok, where
        self.turn_end = chat_turn_end(tok, where)
        self.turn_end_id = tok.convert_tokens_to_ids(self.turn_end)
        self._strip_bos = bool(tok.bos_token) and _adds_bos(tok)

    def render(self, messages: list[Message], add_generation_prompt: bool) -> str:
        plain = [{k: v for k, v in m.items() if k != "token_ids"} for m in messages]
        text = self.tok.apply_chat_template(plain, tokenize=False, add_generation_prompt=add_generation_prompt)
        if self._strip_bos and text.startswith(self.tok.bos_token):
            text = text[len(self.tok.bos_token):]  # the tokenizer adds it to the first segment: one BOS, not two
        return text

    def encode(self, messages: list[Message], add_generation_prompt: bool = True) -> tuple[list[int], list[int]]:
        """The conversation's ids, and per id 1 where the assistant wrote it (its sampled ids, or a reference
        turn's content and turn end), else 0. With `add_generation_prompt` (and after any non-assistant last
        message) the ids end with the header of the next assistant turn."""
        ids: list[int] = []
        mask: list[int] = []
        done = ""  # the rendered text that `ids` stand for so far
        for k, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            head = self.render(messages[:k], add_generation_prompt=True)
            done = self._extend(ids, mask, done, head, k)
            own = list(m.get("token_ids") or ())
            if not own:
                own = self.tok(m["content"], add_special_tokens=False)["input_ids"] + [self.turn_end_id]
            ids += own
            mask += [1] * len(own)
            if own[-1] != self.turn_end_id:  # cut at max_new_tokens, or stopped at another EOS: the template closes it
                ids.append(self.turn_end_id)
                mask.append(0)
            closed = self.render(messages[:k + 1], add_generation_prompt=False)
            expect = head + m["content"] + self.turn_end
            if not closed.startswith(expect):
                raise TemplateError(f"{self.where}: its chat template does not write assistant turn {k} as the text "
                                    f"it was given followed by {self.turn_end!r}; an agent's conversation must be "
                                    "rendered append-only (keep the content verbatim, drop nothing earlier)")
            done = expect
        if add_generation_prompt or not messages or messages[-1]["role"] != "assistant":
            self._extend(ids, mask, done, self.render(messages, add_generation_prompt=True), len(messages))
        return ids, mask

    def _extend(self, ids: list[int], mask: list[int], done: str, text: str, k: int) -> str:
        if not text.startswith(done):
            raise TemplateError(f"{self.where}: its chat template renders the conversation up to message {k} with a "
                                "different beginning than the conversation before it: it is not append-only, and the "
                                "agent's sampled tokens cannot be kept as they were")
        new = self.tok(text[len(done):], add_special_tokens=not ids)["input_ids"] if text[len(done):] or not ids else []
        ids += new
        mask += [0] * len(new)
        return text


class ChatSampler:
    """The EpisodeRunner's `generate` on a backend with `generate_ids` (hf, vllm, openai with a tokenizer): each
    call samples one assistant turn for every live conversation in one batch, seeded by (seed, call number).

    A conversation whose prompt leaves no room for `max_new_tokens` within `max_context` tokens is not sampled:
    its episode ends as `truncated_context`, counted in `context_full`."""

    def __init__(self, backend: Any, encoder: ChatEncoder, *, temperature: float, top_p: float,
                 max_new_tokens: int, seed: int, max_context: int | None = None):
        if not hasattr(backend, "generate_ids"):
            raise TypeError(f"{type(backend).__name__} cannot sample from token ids (no generate_ids): the agent loop "
                            "keeps each conversation's tokens as sampled, so it needs hf, vllm or openai")
        self.backend, self.encoder = backend, encoder
        self.temperature, self.top_p, self.max_new_tokens, self.seed = temperature, top_p, max_new_tokens, seed
        self.max_context = max_context
        self.calls = 0
        self.context_full = 0
        self.prompt_tokens = 0

    def __call__(self, conversations: list[list[Message]]) -> list[tuple[str, int, str, tuple[int, ...]]]:
        prompts = [self.encoder.encode(c)[0] for c in conversations]
        fits = [i for i, p in enumerate(prompts)
                if self.max_context is None or len(p) + self.max_new_tokens <= self.max_context]
        self.context_full += len(prompts) - len(fits)
        self.prompt_tokens += sum(len(prompts[i]) for i in fits)
        samples = self.backend.generate_ids([prompts[i] for i in fits], n=1, temperature=self.temperature,
                                            top_p=self.top_p, max_new_tokens=self.max_new_tokens,
                                            seed=seed_stream(self.seed, self.calls)) if fits else []
        self.calls += 1
        out: list[tuple[str, int, str, tuple[int, ...]]] = [("", 0, "context", ())] * len(prompts)
        for i, (s,) in zip(fits, samples, strict=True):
            if not s.token_ids:
                raise ValueError(f"{type(self.backend).__name__} returned no token ids for a sample: the agent loop "
                                 "needs the sampled ids (vLLM's return_token_ids, for an OpenAI-compatible server)")
            out[i] = (s.text, s.num_tokens, s.finish_reason, tuple(s.token_ids))
        return out
