"""Generation backends behind one interface: `hf` (transformers generate, here), `vllm` (vllm_backend.py),
`openai` (openai_backend.py).

    backend = get_backend("hf", "workdir/arith-default/r0/bootstrap/a1/model")
    samples = backend.generate(["3+4\\n"], n=4, temperature=0.8, top_p=1.0, max_new_tokens=32, seed=0)

Each returns, per prompt, `n` Samples: the completion text (special tokens stripped, cut at EOS or at
a stop string, which is left out as vLLM and OpenAI do), its token count and why it stopped. The same
call with the same seed gives the same samples; with `hf` on CPU, byte for byte. Temperature 0 is
greedy decoding.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Protocol

from components.models.prompts import PromptFormat, chat_turn_end, check_prompt_format, render_prompts
from components.seeding import seed_stream


@dataclass(frozen=True)
class Sample:
    text: str           # the completion only, decoded, without special tokens or the stop string
    num_tokens: int     # tokens generated, EOS included
    finish_reason: str  # "stop": EOS or a stop string; "length": ran into max_new_tokens
    # The sampled ids (EOS included), where the backend returns them; samples compare by what they say, not by it.
    token_ids: tuple[int, ...] | None = field(default=None, compare=False)


class GenerationBackend(Protocol):
    def generate(self, prompts: list[str], n: int, temperature: float, top_p: float, max_new_tokens: int,
                 seed: int, stop: list[str] | None = None) -> list[list[Sample]]: ...


class TokenBackend(GenerationBackend, Protocol):
    """A backend that also samples from token ids and returns the sampled ids (hf, vllm, and openai where it has
    the tokenizer): what the agent loop needs to keep a conversation's tokens append-only."""

    def generate_ids(self, prompt_ids: list[list[int]], n: int, temperature: float, top_p: float,
                     max_new_tokens: int, seed: int, stop: list[str] | None = None) -> list[list[Sample]]: ...


def _cut_at_stop(text: str, stop: list[str] | None) -> tuple[str, bool]:
    """Cut at the earliest stop string, which is dropped.

    >>> _cut_at_stop("a=1\\n####", ["####", "="])
    ('a', True)
    """
    hits = [i for i in (text.find(s) for s in stop or []) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


class PromptEncoder:
    """Prompts as token ids, the same for every backend, and the ids generation stops at.

    Each prompt is rendered in `prompt_format` with the model's own tokenizer (`models.prompts`), and
    tokenized as TRL's SFTTrainer tokenizes training prompts (a BOS for models that use one). A prompt
    over `max_prompt_length` tokens keeps its last tokens (and its BOS) and is counted in
    `truncated_prompts`; more than `max_truncated_fraction` of one call's prompts over it raises
    TruncationError naming `setting`. Generation stops at the tokenizer's EOS, the generation config's
    (`generation_eos`) and, under `chat`, the template's turn terminator (`chat_turn_end`), the token
    chat training ends completions with.
    """

    def __init__(self, tok: Any, model_name_or_path: str,
                 prompt_format: PromptFormat | dict[str, Any] | str | None = None, max_prompt_length: int | None = None,
                 max_truncated_fraction: float = 0.0, setting: str = "generate",
                 generation_eos: int | list[int] | None = None):
        if max_prompt_length is not None and max_prompt_length < 1:
            raise ValueError(f"{setting}.max_prompt_length must be >= 1 token or None, got {max_prompt_length}")
        if not 0 <= max_truncated_fraction <= 1:
            raise ValueError(f"{setting}.max_truncated_fraction must be in [0, 1], got {max_truncated_fraction}")
        self.tok, self.format = tok, PromptFormat.of(prompt_format)
        check_prompt_format(tok, self.format, model_name_or_path)
        self.max_prompt_length, self.max_truncated_fraction = max_prompt_length, max_truncated_fraction
        self.setting, self.truncated_prompts = setting, 0
        eos = ([] if generation_eos is None else [generation_eos] if isinstance(generation_eos, int)
               else list(generation_eos))
        if tok.eos_token_id is not None:
            eos.append(tok.eos_token_id)
        if self.format.kind == "chat":  # where chat training ends a completion, whatever the configs say
            eos.append(tok.convert_tokens_to_ids(chat_turn_end(tok, model_name_or_path)))
        self.eos_ids = sorted(set(eos))
        if not self.eos_ids:
            raise ValueError(f"{model_name_or_path}: neither the tokenizer nor the generation config names an EOS")

    @classmethod
    def from_pretrained(cls, path: str, model_name_or_path: str | None = None, *args: Any, **kw: Any) -> PromptEncoder:
        """The encoder for a tokenizer folder or hub name, with the EOS ids of its generation config (which
        HFBackend reads off the loaded model instead); `model_name_or_path` (default `path`) names it in errors."""
        from transformers import AutoTokenizer, GenerationConfig

        try:
            generation_eos = GenerationConfig.from_pretrained(path).eos_token_id
        except OSError:  # no generation_config.json: the tokenizer's EOS alone
            generation_eos = None
        return cls(AutoTokenizer.from_pretrained(path), model_name_or_path or path, *args, **kw,
                   generation_eos=generation_eos)

    def encode(self, prompts: list[str]) -> list[list[int]]:
        texts = render_prompts(self.tok, prompts, self.format)
        return self._cut(self.tok(texts, add_special_tokens=True)["input_ids"])

    def _cut(self, prompt_ids: list[list[int]]) -> list[list[int]]:
        """Prompts over max_prompt_length keep their last tokens (and a leading BOS); counted, or refused."""
        limit = self.max_prompt_length
        if limit is None:
            return prompt_ids
        from components.training.common import check_truncation

        check_truncation([len(ids) for ids in prompt_ids], limit, self.max_truncated_fraction, self.setting,
                         key="max_prompt_length", noun="prompts")
        bos = self.tok.bos_token_id
        out = []
        for ids in prompt_ids:
            if len(ids) > limit:
                self.truncated_prompts += 1
                keep_bos = bos is not None and ids[0] == bos and limit > 1
                ids = [bos, *ids[len(ids) - limit + 1:]] if keep_bos else ids[len(ids) - limit:]
            out.append(ids)
        return out


class EncodedPrompts(ABC):
    """`generate` for a backend that samples from token ids: its text prompts are `self.prompts`' ids (hf, vllm)."""

    prompts: PromptEncoder

    @property
    def truncated_prompts(self) -> int:
        return self.prompts.truncated_prompts

    def generate(self, prompts: list[str], n: int, temperature: float, top_p: float, max_new_tokens: int,
                 seed: int, stop: list[str] | None = None) -> list[list[Sample]]:
        return self.generate_ids(self.prompts.encode(prompts), n, temperature, top_p, max_new_tokens, seed, stop)

    @abstractmethod
    def generate_ids(self, prompt_ids: list[list[int]], n: int, temperature: float, top_p: float,
                     max_new_tokens: int, seed: int, stop: list[str] | None = None) -> list[list[Sample]]: ...


class HFBackend(EncodedPrompts):
    """transformers `generate`, batched, for CPU or GPU.

    The n copies of every prompt are sorted by prompt length and cut into batches of `batch_size`, so
    left padding stays short and sequences of one level finish together. Each batch reseeds torch
    from (seed, batch index) inside `fork_rng`, so results do not depend on what ran before and the
    caller's RNG is left alone. Sampled outputs do depend on `batch_size` (it sets the batches).

    `prompt_format`, `max_prompt_length` and `max_truncated_fraction` are the PromptEncoder's: prompts are
    rendered and cut as the trainers render them, and generation stops where chat training ends a turn.
    """

    def __init__(self, model_name_or_path: str, batch_size: int = 256, device: str = "auto",
                 dtype: str | None = None, stop: list[str] | None = None, num_threads: int | None = None,
                 progress: bool = True, prompt_format: PromptFormat | dict[str, Any] | str | None = None,
                 max_prompt_length: int | None = None, max_truncated_fraction: float = 0.0,
                 setting: str = "generate"):
        import torch

        from components.models.tiny import load_policy

        if num_threads is not None:
            # Process-wide. On a shared CPU, 1 thread per process beats 2 by up to 10x: intra-op
            # threads spin at barriers when the cores are already busy.
            torch.set_num_threads(num_threads)
        self.torch = torch
        if device == "auto":  # the GPU where one exists: the same config runs on a laptop and a GPU node
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model, self.tok = load_policy(model_name_or_path, device=device, dtype=dtype)
        self.prompts = PromptEncoder(self.tok, model_name_or_path, prompt_format, max_prompt_length,
                                     max_truncated_fraction, setting, self.model.generation_config.eos_token_id)
        self.batch_size, self.stop, self.progress = batch_size, stop, progress

    def generate_ids(self, prompt_ids: list[list[int]], n: int, temperature: float, top_p: float,
                     max_new_tokens: int, seed: int, stop: list[str] | None = None) -> list[list[Sample]]:
        """`generate` on prompts given as token ids, as they are (not rendered or cut)."""
        torch, tok = self.torch, self.tok
        stop = self.stop if stop is None else stop
        flat = [(i, j) for i in range(len(prompt_ids)) for j in range(n)]
        order = sorted(range(len(flat)), key=lambda k: (len(prompt_ids[flat[k][0]]), k))
        kw: dict[str, Any] = dict(max_new_tokens=max_new_tokens, eos_token_id=self.prompts.eos_ids,
                                  pad_token_id=tok.pad_token_id)
        if temperature > 0:
            kw |= dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)  # top_k=0: off
        else:
            kw |= dict(do_sample=False, temperature=None, top_p=None, top_k=None)  # greedy; drop model defaults
        if stop:
            kw |= dict(stop_strings=stop, tokenizer=tok)
        device = self.model.device
        rng_devices = [device.index or 0] if device.type == "cuda" else []
        out: list[Sample | None] = [None] * len(flat)
        n_batches = -(-len(order) // self.batch_size)
        for b in range(n_batches):
            idx = order[b * self.batch_size:(b + 1) * self.batch_size]
            enc = tok.pad({"input_ids": [prompt_ids[flat[k][0]] for k in idx]}, return_tensors="pt").to(device)
            with torch.random.fork_rng(devices=rng_devices), torch.inference_mode():
                torch.manual_seed(seed_stream(seed, b))
                gen = self.model.generate(**enc, **kw)
            for k, ids in zip(idx, gen[:, enc["input_ids"].shape[1]:].tolist(), strict=True):
                out[k] = self._sample(ids, stop)
            if self.progress and ((b + 1) % max(1, n_batches // 10) == 0 or b + 1 == n_batches):
                done = min(len(order), (b + 1) * self.batch_size)
                print(f"[generate] samples {done}/{len(order)} (batch {b + 1}/{n_batches})", flush=True)
        result: list[list[Sample]] = [[] for _ in prompt_ids]
        for (i, _), s in zip(flat, out, strict=True):
            result[i].append(s)
        return result

    def _sample(self, ids: list[int], stop: list[str] | None) -> Sample:
        end = next((p for p, t in enumerate(ids) if t in self.prompts.eos_ids), None)
        if end is not None:
            ids = ids[: end + 1]
        else:  # a row that finished on a stop string, or early in its batch, is padded on the right
            while ids and ids[-1] == self.tok.pad_token_id:
                ids = ids[:-1]
        text, cut = _cut_at_stop(self.tok.decode(ids, skip_special_tokens=True), stop)
        return Sample(text, len(ids), "stop" if end is not None or cut else "length", tuple(ids))


# The engines' modules import their packages lazily: vllm lives in its own environment.
BACKENDS = {"hf": "components.models.backends:HFBackend", "vllm": "components.models.vllm_backend:VLLMBackend",
            "openai": "components.models.openai_backend:OpenAIBackend"}


class BackendError(RuntimeError):
    """An engine or server failed. The message names the backend and model; `transient` is True where the
    same call may succeed when retried (a timeout, a server that went away), False for bad input or config."""

    def __init__(self, backend: str, model: str, message: str, transient: bool = False):
        super().__init__(f"backend {backend!r} (model {model}): {message}")
        self.backend, self.model, self.transient = backend, model, transient


def get_backend(kind: str, model: str, **options: Any) -> GenerationBackend:
    """`kind` is "hf", "vllm", "openai" or a dotted path 'pkg.module:Class' to a `GenerationBackend`;
    `options` are that backend's constructor arguments."""
    from components.instantiate import locate

    if kind in BACKENDS:
        return locate(BACKENDS[kind])(model, **options)
    if ":" in kind:
        return locate(kind)(model, **options)
    raise ValueError(f"unknown generation backend {kind!r}: expected one of {sorted(BACKENDS)}, or a dotted path "
                     "'pkg.module:Class'")
