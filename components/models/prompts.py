"""How a domain's prompt becomes the text a model reads: the one function every backend and trainer calls.

    fmt = PromptFormat("chat", system="Solve step by step.")
    text = render_prompt(tokenizer, "3+4\\n", fmt)   # '<|im_start|>system\\n...<|im_start|>assistant\\n'

`raw` feeds the domain's prompt as it is (the char-level default model was trained that way). `chat`
wraps it as one user turn, after an optional system turn, with the tokenizer's own chat template and
the generation prompt (the assistant header) appended, as an instruct model expects. Generation, SFT,
DPO and the reward models all render through `render_prompt`, so training sees exactly what sampling saw.

Rendered text is tokenized like any text (special tokens added), by TRL and vLLM as by the HF backend, so a
template that writes the BOS itself (Llama 3's) has it dropped here rather than doubled. In chat mode a
completion ends with the template's turn terminator, `chat_turn_end(tokenizer)` ("<|im_end|>" for ChatML),
and generation stops there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FORMATS = ("raw", "chat")


@dataclass(frozen=True)
class PromptFormat:
    kind: str = "raw"           # "raw" | "chat"
    system: str | None = None   # chat only: a system turn before the user's

    def __post_init__(self) -> None:
        if self.kind not in FORMATS:
            raise ValueError(f"prompt_format must be one of {list(FORMATS)}, got {self.kind!r}")
        if self.system is not None and self.kind != "chat":
            raise ValueError("system_prompt needs prompt_format: chat")

    @classmethod
    def of(cls, value: PromptFormat | dict[str, Any] | str | None) -> PromptFormat:
        """From a PromptFormat, a dict (as specs carry it), a kind name, or None (raw)."""
        if isinstance(value, PromptFormat):
            return value
        if value is None:
            return cls()
        if isinstance(value, str):
            return cls(value)
        return cls(**value)


RAW = PromptFormat()


def check_prompt_format(tokenizer: Any, fmt: PromptFormat, where: str) -> None:
    """Fail early, naming the model, where `chat` is asked of a tokenizer that has no chat template."""
    if fmt.kind == "chat" and not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{where}: prompt_format is 'chat' but its tokenizer has no chat_template "
                         "(tokenizer_config.json or chat_template.jinja); use prompt_format: raw, or a model with one")


def render_prompt(tokenizer: Any, prompt: str, fmt: PromptFormat = RAW) -> str:
    """The exact text fed to the model before its completion.

    >>> render_prompt(None, "3+4\\n")
    '3+4\\n'
    """
    if fmt.kind == "raw":
        return prompt
    messages = ([{"role": "system", "content": fmt.system}] if fmt.system else []) + [
        {"role": "user", "content": prompt}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    bos = tokenizer.bos_token
    if bos and text.startswith(bos) and _adds_bos(tokenizer):
        text = text[len(bos):]  # the tokenizer puts it back: one BOS, not two
    return text


def render_prompts(tokenizer: Any, prompts: list[str], fmt: PromptFormat = RAW) -> list[str]:
    if fmt.kind == "raw":
        return list(prompts)
    return [render_prompt(tokenizer, p, fmt) for p in prompts]


def _adds_bos(tokenizer: Any) -> bool:
    ids = tokenizer("a")["input_ids"]
    return bool(ids) and ids[0] == tokenizer.bos_token_id


_PROBE = "\u2063coevo\u2063"  # content no template rewrites, to find where an assistant turn's text ends


def chat_turn_end(tokenizer: Any, where: str = "model") -> str:
    """The special token the chat template closes an assistant turn with ("<|im_end|>" for ChatML,
    "<|eot_id|>" for Llama 3, the EOS for templates that end turns with it).

    A chat-trained completion ends with it, and generation stops at it. Fails, naming `where`, when the
    template writes no special token right after the assistant's text.
    """
    messages = [{"role": "user", "content": "1"}, {"role": "assistant", "content": _PROBE}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    tail = text[text.index(_PROBE) + len(_PROBE):] if _PROBE in text else ""
    specials = sorted({t for t in [*tokenizer.all_special_tokens,
                                   *(a.content for a in tokenizer.added_tokens_decoder.values() if a.special)]
                       if t}, key=len, reverse=True)
    end = next((t for t in specials if tail.lstrip(" ").startswith(t)), None)
    if end is None:
        raise ValueError(f"{where}: its chat template closes an assistant turn with {tail[:40]!r}, not a special "
                         "token, so there is no token for a completion to end (and generation to stop) at; "
                         "use prompt_format: raw")
    return end
