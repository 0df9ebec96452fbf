"""A realistic stand-in for a hub model, built locally: a byte-level BPE tokenizer trained on a domain's
text, a ChatML chat template, and a randomly initialised Qwen2 (or Llama) saved like any hub checkpoint.

    coevo build-model workdir/standin --domain arith [--arch qwen2|llama] [--size small|mini|micro|tiny]

    path = build_standin("workdir/standin", domain_texts("arith"), arch="qwen2", seed=0)
    AutoTokenizer.from_pretrained(path); AutoModelForCausalLM.from_pretrained(path)

Where `tiny.create_tiny_llama` is one character per token, this one has what real checkpoints have
and the real-model path must cope with: multi-character tokens (a run of symbols takes the newline
ending a step with it), special tokens at the *end* of the vocabulary (as Qwen2 puts them, so pad is
not 0), a pad distinct from EOS,
grouped-query attention, tied embeddings, a chat template, and for `llama` a BOS the tokenizer adds
itself. The weights are random: it is for testing plumbing, not for accuracy. With `--copy-steps` the
init first learns one thing a pretrained model knows, copying a value from its context (`pretrain_copy`).

The BPE stops merging when the text has no pair left inside a pre-token, so `vocab_size` is an upper
bound: arithmetic text (digits, + - = and "####") stops at 265 tokens for qwen2 (single digits) and
295 for llama (up to three digits) whatever the bound; a wordier domain's text goes further.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

    from components.domains import Domain

# Qwen2's names for end-of-text and the ChatML markers; Llama 3's for BOS. Added after training, so
# their ids come after the BPE vocabulary, in this order.
EOS = "<|endoftext|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
BOS = "<|begin_of_text|>"
PAD = "<|pad|>"
SPECIAL = [EOS, IM_START, IM_END, BOS, PAD]

# ChatML as Qwen2.5 writes it, without its default system message: the prompt is exactly the turns given. Tools
# as Qwen2.5 takes them: `tools=` (JSON schemas) listed in the system turn, with the <tool_call> format the agent
# answers in; a tool's result is a user turn holding <tool_response> blocks, consecutive results in one turn.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
    "\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif not (tools and loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

ARCHS = ("qwen2", "llama")


@dataclass(frozen=True)
class StandinConfig:
    arch: str = "qwen2"                   # "qwen2" (q/k/v biases, no BOS added) or "llama" (BOS added)
    vocab_size: int = 2000                # BPE upper bound, special tokens included; the text may stop it sooner
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2                 # grouped-query attention, as Qwen2.5 and Llama 3 use
    intermediate_size: int = 704          # SwiGLU width, ~2.75x hidden
    max_position_embeddings: int = 1024   # tokens; also the tokenizer's model_max_length

    def __post_init__(self) -> None:
        """
        >>> StandinConfig(arch="gpt2")
        Traceback (most recent call last):
        ValueError: unknown arch 'gpt2': choose one of qwen2, llama
        """
        if self.arch not in ARCHS:
            raise ValueError(f"unknown arch {self.arch!r}: choose one of {', '.join(ARCHS)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} must be divisible by num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} must be divisible by num_kv_heads {self.num_kv_heads}")
        if self.vocab_size < 256 + len(SPECIAL):
            raise ValueError(f"vocab_size {self.vocab_size} is below the 256 bytes plus {len(SPECIAL)} special tokens")


# `coevo build-model --size`: small ~3M parameters on arith; mini ~1.3M, between it and micro (heads of 32, as
# vLLM's CPU attention needs); micro, the width and depth of configs/micro.yaml's char model (the learning test on
# the real-model path); tiny ~0.1M (seconds to build, for tests).
SIZES = {
    "small": StandinConfig(),
    "mini": StandinConfig(hidden_size=192, num_layers=3, num_heads=6, num_kv_heads=2, intermediate_size=528),
    "micro": StandinConfig(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=384,
                           max_position_embeddings=256),
    "tiny": StandinConfig(vocab_size=400, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                          intermediate_size=176, max_position_embeddings=256),
}


def domain_texts(domain: str | Domain, levels: Sequence[int] | None = None, n_per_level: int = 200,
                 seed: int = 0) -> Iterator[str]:
    """Prompt plus gold solution, as the policy will read and write them, for `n_per_level` problems per level.

    >>> next(domain_texts("arith", levels=[2], n_per_level=1))
    '8+5-3\\n8+5=13\\n13-3=10\\n#### 10\\n'
    """
    from components.domains import get_domain

    d = get_domain(domain) if isinstance(domain, str) else domain
    episodes = callable(getattr(d, "reference_episode", None))  # an environment: its conversations, tool calls too
    for level in d.levels() if levels is None else levels:
        for p in d.sample_problems(level, n_per_level, seed):
            if episodes:
                yield "\n".join(m["content"] for m in d.reference_episode(p)) + "\n<tool_response>\n</tool_response>"
            else:
                yield p.prompt + d.reference_solution(p)


# Llama 3's split (its tiktoken pattern): numbers in runs of up to 3 digits.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def train_tokenizer(texts: Iterable[str], cfg: StandinConfig) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on `texts` with the arch's own pre-tokenizer, wrapped for transformers, with
    the chat template set.

    Qwen2 splits numbers into single digits, Llama 3 into runs of up to three; the BPE merges only inside
    those pieces (and in runs of symbols such as "####" or "=-").
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as QWEN2_SPLIT

    tk = Tokenizer(models.BPE())
    if cfg.arch == "qwen2":
        # AutoTokenizer loads any qwen2 checkpoint as Qwen2Tokenizer, which rebuilds the normalizer and
        # pre-tokenizer from its own code: training with anything else would give merges it never applies.
        tk.normalizer = normalizers.NFC()
    split = QWEN2_SPLIT if cfg.arch == "qwen2" else LLAMA3_SPLIT
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),  # no prefix space: decode(encode(x)) == x
    ])
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size - len(SPECIAL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: any text encodes, no <unk>
        show_progress=False,
    )
    tk.train_from_iterator(texts, trainer)
    tk.add_special_tokens(SPECIAL)
    if cfg.arch == "llama":  # Llama's tokenizer puts BOS in front of every encoded text
        tk.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tk.token_to_id(BOS))])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token=BOS, eos_token=EOS, pad_token=PAD, extra_special_tokens=[IM_START, IM_END],
        model_max_length=cfg.max_position_embeddings, clean_up_tokenization_spaces=False,  # " ." stays " ."
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def copy_batch(words: Sequence[int], digits: Sequence[int], rng: random.Random, n: int = 16,
               lengths: tuple[int, int] = (64, 320)) -> list[tuple[list[int], list[int]]]:
    """`n` token sequences for in-context copying, with their labels (-100 where there is nothing to learn).

    Each is random `words` with one to three numbers (two to five `digits`) in its first half; the second
    half is random words again, where the same numbers come back in the same order. Only the returning
    digits are labelled.

    >>> batch = copy_batch(range(20, 30), range(10), random.Random(0), 2)
    >>> [(len(x) == len(y), sum(t != -100 for t in y) >= 2) for x, y in batch]
    [(True, True), (True, True)]
    """
    out = []
    for _ in range(n):
        half = rng.randint(*lengths) // 2
        numbers = [[rng.choice(digits) for _ in range(rng.randint(2, 5))] for _ in range(rng.randint(1, 3))]
        x = [rng.choice(words) for _ in range(half)]
        for number in numbers:
            at = rng.randrange(len(x))
            x[at:at] = number
        y = [-100] * len(x)
        after = set(rng.sample(range(half), len(numbers)))  # the words the numbers come back after, in order
        returning = iter(numbers)
        for i in range(half):
            x.append(rng.choice(words))
            y.append(-100)
            if i in after:
                number = next(returning)
                x += number
                y += number
        out.append((x, y))
    return out


def copy_vocab(tok: Any) -> tuple[list[int], list[int]]:
    """The ids `copy_batch` draws from: every token without a digit, specials aside, and the ten digits."""
    vocab = tok.get_vocab()
    specials = set(tok.all_special_ids)
    words = sorted(i for t, i in vocab.items() if i not in specials and not any(c.isdigit() for c in t))
    return words, [vocab[str(d)] for d in range(10)]


def pretrain_copy(model: Any, tok: Any, steps: int, *, seed: int = 0, batch_size: int = 16, lr: float = 1e-3,
                  lengths: tuple[int, int] = (64, 320), log: Any = None) -> list[float]:
    """Train `model` in place for `steps` AdamW steps on `copy_batch` sequences over `tok`'s vocabulary, and
    return the loss of each step. `lengths` are cut to fit the model's positions.

    A hub model comes pretrained, and one thing pretraining gives it is copying a value from its context
    (induction heads form early in any language model's training). A stand-in's random init has none, so
    it writes values from memory instead (docs/envs.md: every round-0 sql miss was a value the question
    gave). This gives it that one skill on text that holds no task: random tokens and random numbers.
    """
    import torch

    cap = model.config.max_position_embeddings - 30  # a sequence is at most its length plus 30 digits: 3 numbers, twice
    lengths = (min(lengths[0], cap), min(lengths[1], cap))
    words, digits = copy_vocab(tok)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50))
    model.train()
    losses = []
    for step in range(1, steps + 1):
        batch = copy_batch(words, digits, rng, batch_size, lengths)
        width = max(len(x) for x, _ in batch)
        ids = torch.tensor([x + [tok.pad_token_id] * (width - len(x)) for x, _ in batch])
        labels = torch.tensor([y + [-100] * (width - len(y)) for _, y in batch])
        mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x, _ in batch])
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        warmup.step()
        opt.zero_grad()
        losses.append(loss.item())
        if log is not None and (step % 100 == 0 or step == steps):
            log(f"[copy pretraining] step {step}/{steps}, loss {losses[-1]:.3f}")
    model.eval()
    return losses


def build_standin(out_dir: str | Path, texts: Iterable[str], cfg: StandinConfig | None = None, *, seed: int = 0,
                  copy_steps: int = 0, copy_lengths: tuple[int, int] = (64, 320), log: Any = None,
                  **fields: Any) -> Path:
    """Train the tokenizer on `texts`, randomly initialise the model for `seed`, save both (safetensors) to
    `out_dir`, which must be missing or empty. `fields` override those of `cfg` (default `StandinConfig()`),
    e.g. `build_standin(out, texts, arch="llama", hidden_size=64)`. The same texts, config and seed give
    byte-identical files. With `copy_steps`, the init is first trained that many steps to copy from its
    context (`pretrain_copy`, on sequences of `copy_lengths` tokens); `log` takes its progress lines.
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    cfg = replace(cfg or StandinConfig(), **fields)  # replace() runs the validation again
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty folder: give a new path")

    tok = train_tokenizer(texts, cfg)
    config_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM),
                             "llama": (LlamaConfig, LlamaForCausalLM)}[cfg.arch]
    config = config_cls(
        vocab_size=len(tok), hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        intermediate_size=cfg.intermediate_size, max_position_embeddings=cfg.max_position_embeddings,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True,  # as the small Qwen2.5 and Llama 3.2 checkpoints do
    )
    torch.manual_seed(seed)  # the init is all torch RNG
    model = model_cls(config)  # float32: CPU-safe; a GPU run can load it with dtype="auto" or bf16
    if copy_steps:
        pretrain_copy(model, tok, copy_steps, seed=seed, lengths=copy_lengths, log=log)
    # As Qwen2.5-Instruct ships it: generation also stops at the end of a chat turn.
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=[tok.eos_token_id, tok.convert_tokens_to_ids(IM_END)],
        pad_token_id=tok.pad_token_id)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)  # safetensors is the default
    tok.save_pretrained(out)
    return out


def param_count(model_dir: str | Path) -> int:
    """Parameters stored in `model_dir/model.safetensors` (a tied head is stored once), read from its header."""
    from safetensors import safe_open

    with safe_open(str(Path(model_dir) / "model.safetensors"), framework="pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
