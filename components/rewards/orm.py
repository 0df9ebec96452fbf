"""Outcome reward model: a sequence-classification head (one scalar) trained with TRL's `RewardTrainer`.

    examples = [{"prompt": "3+4\\n", "completion": "3+4=7\\n#### 7\\n", "label": True},
                {"prompt": "3+4\\n", "completion": "3+4=8\\n#### 8\\n", "label": False}]
    metrics = train_orm("workdir/.../train_policy/a1/model", examples, "out/orm", ORMParams(max_steps=300))
    ORMScorer("out/orm").score(["3+4\\n"], ["3+4=7\\n#### 7\\n"])   # [reward]

Outcome labels become Bradley-Terry pairs (a correct vs an incorrect completion of the same prompt),
the format `RewardTrainer` wants: {"prompt", "chosen", "rejected"}. It appends EOS and reads the
reward at the last non-pad token, and `ORMScorer` tokenises the same way. Rewards are logits: only
their differences mean something, so rank with them, do not threshold them.

A real model: `prompt_format="chat"` renders the prompt with the chat template as the policy saw it, and
the template's turn terminator ("<|im_end|>") is the EOS appended, as a chat completion ends (give the
scorer the same format). `RewardTrainer` drops a pair whose longer side exceeds `max_length` tokens:
such pairs are counted before training (`truncated`) and fail past `max_truncated_fraction`, naming
`train_reward.max_length`. The scorer cuts a longer input to its first `max_length` tokens and counts it
in `truncated`. `dtype` trains and scores float32 (the default), bfloat16 or the checkpoint's own.
"""

from __future__ import annotations

import random
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from components.models.prompts import RAW, PromptFormat, chat_turn_end, check_prompt_format, render_prompt
from components.rewards import device, losses, pad_right, save_checkpoint, trainer_kwargs
from components.rewards.prm import full_checkpoint
from components.training.common import (check_dtype, check_loaded_dtype, check_truncation, process_batch,
                                        processes_metric, quiet_datasets, save_trained, token_lengths,
                                        torch_dtype)


@dataclass
class ORMParams:
    max_steps: int = 300
    batch_size: int = 64                # pairs per optimizer step
    learning_rate: float = 1e-3
    seed: int = 0                       # head initialisation and pair sampling
    warmup_ratio: float = 0.05          # of max_steps
    weight_decay: float = 0.0
    logging_steps: int = 25
    max_length: int | None = 256        # tokens of prompt + completion + EOS; TRL drops longer pairs, counted here
    max_pairs_per_prompt: int = 8       # caps correct x incorrect, so one prompt with many samples cannot dominate
    max_truncated_fraction: float = 0.0  # the share of pairs allowed over max_length before TruncationError
    setting: str = "train_reward"       # the config section that errors name, e.g. "train_reward.max_length"
    prompt_format: PromptFormat = RAW   # raw, or chat: prompts rendered as the policy saw them (the scorer's too)
    dtype: str = "float32"              # weights trained and saved: float32, bfloat16, auto

    def __post_init__(self) -> None:
        self.prompt_format = PromptFormat.of(self.prompt_format)
        for name in ("max_steps", "batch_size", "logging_steps", "max_pairs_per_prompt"):
            if getattr(self, name) < 1:
                raise ValueError(f"ORMParams.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_length is not None and self.max_length < 1:
            raise ValueError(f"ORMParams.max_length must be >= 1 or None, got {self.max_length}")
        if self.learning_rate <= 0:
            raise ValueError(f"ORMParams.learning_rate must be > 0, got {self.learning_rate}")
        if not 0 <= self.max_truncated_fraction <= 1:
            raise ValueError(f"ORMParams.max_truncated_fraction must be in [0, 1], got {self.max_truncated_fraction}")
        # No LoRA here, so float16 (which trains only adapters) is refused with check_dtype's reason.
        check_dtype(self.dtype, lora=False, use_cpu=None, where="ORMParams")


def preference_pairs(examples: list[dict[str, Any]], max_pairs_per_prompt: int, seed: int) -> list[dict[str, str]]:
    """Every (correct, incorrect) pair of distinct completions per prompt, a seeded sample of at most
    `max_pairs_per_prompt`. Prompts with only one outcome give no pair.

    >>> ex = [{"prompt": "p", "completion": c, "label": ok} for c, ok in [("a", True), ("b", False), ("b", False)]]
    >>> preference_pairs(ex + [{"prompt": "q", "completion": "c", "label": True}], 8, seed=0)
    [{'prompt': 'p', 'chosen': 'a', 'rejected': 'b'}]
    """
    by_prompt: dict[str, tuple[dict[str, None], dict[str, None]]] = defaultdict(lambda: ({}, {}))
    for e in examples:  # dicts as ordered sets: deduplicated, in input order
        by_prompt[e["prompt"]][0 if e["label"] else 1][e["completion"]] = None
    rng = random.Random(seed)
    pairs = []
    for prompt, (good, bad) in by_prompt.items():
        combos = [(g, b) for g in good for b in bad]
        if len(combos) > max_pairs_per_prompt:
            combos = rng.sample(combos, max_pairs_per_prompt)
        pairs += [{"prompt": prompt, "chosen": g, "rejected": b} for g, b in combos]
    return pairs


def train_orm(base_model_path: str, examples: list[dict[str, Any]], out_dir: str, params: ORMParams) -> dict[str, Any]:
    """Train an ORM from a policy backbone (new head) or a previous ORM (warm start).

    Returns the losses, final_pair_accuracy, steps, runtime_s, pairs (those trained on), prompts, and
    truncated / truncated_fraction (pairs over max_length, which TRL drops, counted before training).
    """
    import torch
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, set_seed
    from trl import RewardConfig, RewardTrainer

    pairs = preference_pairs(examples, params.max_pairs_per_prompt, params.seed)
    if not pairs:
        raise ValueError("train_orm: no prompt has both a correct and an incorrect completion, so there is no pair "
                         "to train on; sample more completions per problem")
    use_cpu = device() == "cpu"  # as trainer_kwargs decides it
    check_dtype(params.dtype, lora=False, use_cpu=use_cpu, where="ORMParams")
    tok = AutoTokenizer.from_pretrained(base_model_path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    fmt = params.prompt_format
    check_prompt_format(tok, fmt, base_model_path)
    # A chat completion ends with the template's turn end: RewardTrainer appends it (its eos_token), as the scorer does.
    eos = chat_turn_end(tok, base_model_path) if fmt.kind == "chat" else tok.eos_token
    if fmt.kind == "chat":
        pairs = [p | {"prompt": render_prompt(tok, p["prompt"], fmt)} for p in pairs]
    # RewardTrainer tokenizes prompt + completion + EOS with the tokenizer's own call, and drops a pair
    # when either side is long.
    lengths = [max(c, r) for c, r in zip(*(token_lengths(tok, [_with_eos(p["prompt"] + p[k], eos) for p in pairs])
                                           for k in ("chosen", "rejected")), strict=True)]
    truncation = check_truncation(lengths, params.max_length, params.max_truncated_fraction, params.setting,
                                  noun="pairs")
    if truncation["truncated"] == len(pairs):
        raise ValueError(f"train_orm: every pair exceeds {params.setting}.max_length={params.max_length} tokens, "
                         "so there is nothing to train on; raise it")
    with tempfile.TemporaryDirectory() as scratch:  # Trainer wants an output_dir; nothing of it is kept
        set_seed(params.seed)
        model = AutoModelForSequenceClassification.from_pretrained(
            full_checkpoint(base_model_path, torch_dtype(params.dtype), Path(scratch) / "base"), num_labels=1,
            dtype=torch_dtype(params.dtype))
        check_loaded_dtype(model, lora=False, use_cpu=use_cpu, where="ORMParams")
        model.config.pad_token_id = tok.pad_token_id
        per_process = process_batch(params.batch_size, "the ORM's batch (ORMParams.batch_size)", params.setting)
        # RewardConfig turns gradient checkpointing (and bf16) on by default; both only slow a small fp32 model down.
        args = RewardConfig(**(trainer_kwargs(params, scratch) | {"per_device_train_batch_size": per_process}),
                            activation_checkpointing=False, max_length=params.max_length,
                            eos_token=eos if fmt.kind == "chat" else None)
        with quiet_datasets():  # TRL's dataset.map progress bars would flood the stage log
            trainer = RewardTrainer(model=model, args=args, train_dataset=Dataset.from_list(pairs),
                                    processing_class=tok)
        used = len(trainer.train_dataset)  # what TRL kept: pairs over max_length are dropped
        t0 = time.perf_counter()
        out = trainer.train()
        runtime = time.perf_counter() - t0
    save_trained(trainer, out_dir, lambda: save_checkpoint(trainer.model, tok, out_dir), tok)
    hist = losses(trainer.state.log_history)
    accuracy = [float(h["accuracy"]) for h in trainer.state.log_history if "accuracy" in h]
    return {
        "train_loss": float(out.training_loss), "first_loss": hist[0] if hist else float("nan"),
        "final_loss": hist[-1] if hist else float("nan"), "final_pair_accuracy": accuracy[-1] if accuracy else
        float("nan"), "steps": int(out.global_step), "runtime_s": runtime, "pairs": used,
        "prompts": len({p["prompt"] for p in pairs}), **truncation, **processes_metric(trainer),
    }


def _with_eos(text: str, eos: str) -> str:
    return text if text.endswith(eos) else text + eos


class ORMScorer:
    """`score_completions`: one scalar reward per (prompt, completion), read at EOS as `RewardTrainer`
    trained it. A `components.rewards.RewardModel` of granularity 'outcome'.

    `prompt_format` must be the one the ORM was trained with. `max_length` (tokens; None: no limit) cuts a
    longer input to its first `max_length` tokens, scored at the last of them; each adds 1 to `truncated`.
    """

    name = "orm"
    granularity = "outcome"

    def __init__(self, path: str, device_name: str | None = None, separator: str = "\n",  # noqa: ARG002
                 prompt_format: PromptFormat | dict[str, Any] | str | None = None, dtype: str = "float32",
                 max_length: int | None = None):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if max_length is not None and max_length < 1:
            raise ValueError(f"ORMScorer.max_length must be >= 1 or None, got {max_length}")
        self.torch = torch
        self.device = device_name or device()
        self.tok = AutoTokenizer.from_pretrained(path)
        self.prompt_format = PromptFormat.of(prompt_format)
        check_prompt_format(self.tok, self.prompt_format, path)
        # Training made the turn end the saved EOS already; a chat ORM saved otherwise still reads at it.
        self.eos = chat_turn_end(self.tok, path) if self.prompt_format.kind == "chat" else self.tok.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch_dtype(dtype))
        self.model.to(self.device).eval()
        self.max_length, self.truncated = max_length, 0

    def score(self, prompts: list[str], completions: list[str], steps: list[list[str]]) -> list[list[float]]:  # noqa: ARG002
        return [[v] for v in self.score_completions(prompts, completions)]

    def score_completions(self, prompts: list[str], completions: list[str], batch_size: int = 256) -> list[float]:
        if len(prompts) != len(completions):
            raise ValueError(f"score: {len(prompts)} prompts but {len(completions)} completions")
        # Same text and tokenizer call as RewardTrainer: prompt + completion + EOS, default special tokens.
        texts = [_with_eos(render_prompt(self.tok, p, self.prompt_format) + c, self.eos)
                 for p, c in zip(prompts, completions)]
        enc = self.tok(texts)["input_ids"]
        if self.max_length is not None:
            self.truncated += sum(len(ids) > self.max_length for ids in enc)
            enc = [ids[: self.max_length] for ids in enc]
        order = sorted(range(len(enc)), key=lambda i: len(enc[i]))  # similar lengths per batch: less padding
        out = [0.0] * len(enc)
        for b in range(0, len(order), batch_size):
            idx = order[b:b + batch_size]
            ids, mask = pad_right([enc[i] for i in idx], self.model.config.pad_token_id)
            with self.torch.inference_mode():
                logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
            for i, value in zip(idx, logits[:, 0].float().cpu().tolist()):
                out[i] = value
        return out
