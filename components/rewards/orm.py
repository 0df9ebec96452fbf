"""Outcome reward model: a sequence-classification head (one scalar) trained with TRL's `RewardTrainer`.

    examples = [{"prompt": "3+4\\n", "completion": "3+4=7\\n#### 7\\n", "label": True},
                {"prompt": "3+4\\n", "completion": "3+4=8\\n#### 8\\n", "label": False}]
    metrics = train_orm("workdir/.../train_policy/a1/model", examples, "out/orm", ORMParams(max_steps=300))
    ORMScorer("out/orm").score(["3+4\\n"], ["3+4=7\\n#### 7\\n"])   # [reward]

Outcome labels become Bradley-Terry pairs (a correct vs an incorrect completion of the same prompt),
the format `RewardTrainer` wants: {"prompt", "chosen", "rejected"}. It appends EOS and reads the
reward at the last non-pad token, and `ORMScorer` tokenises the same way. Rewards are logits: only
their differences mean something, so rank with them, do not threshold them.
"""

from __future__ import annotations

import random
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from components.rewards import device, losses, pad_right, save_checkpoint, trainer_kwargs


@dataclass
class ORMParams:
    max_steps: int = 300
    batch_size: int = 64                # pairs per optimizer step
    learning_rate: float = 1e-3
    seed: int = 0                       # head initialisation and pair sampling
    warmup_ratio: float = 0.05          # of max_steps
    weight_decay: float = 0.0
    logging_steps: int = 25
    max_length: int = 256               # tokens; TRL drops longer pairs
    max_pairs_per_prompt: int = 8       # caps correct x incorrect, so one prompt with many samples cannot dominate

    def __post_init__(self) -> None:
        for name in ("max_steps", "batch_size", "max_length", "logging_steps", "max_pairs_per_prompt"):
            if getattr(self, name) < 1:
                raise ValueError(f"ORMParams.{name} must be >= 1, got {getattr(self, name)}")
        if self.learning_rate <= 0:
            raise ValueError(f"ORMParams.learning_rate must be > 0, got {self.learning_rate}")


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
    """Train an ORM from a policy backbone (new head) or a previous ORM (warm start)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, set_seed
    from trl import RewardConfig, RewardTrainer

    pairs = preference_pairs(examples, params.max_pairs_per_prompt, params.seed)
    if not pairs:
        raise ValueError("train_orm: no prompt has both a correct and an incorrect completion, so there is no pair "
                         "to train on; sample more completions per problem")
    tok = AutoTokenizer.from_pretrained(base_model_path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    set_seed(params.seed)
    model = AutoModelForSequenceClassification.from_pretrained(base_model_path, num_labels=1, dtype=torch.float32)
    model.config.pad_token_id = tok.pad_token_id
    with tempfile.TemporaryDirectory() as scratch:  # Trainer wants an output_dir; nothing of it is kept
        # RewardConfig turns gradient checkpointing (and bf16) on by default; both only slow a small fp32 model down.
        args = RewardConfig(**trainer_kwargs(params, scratch), activation_checkpointing=False,
                            max_length=params.max_length)
        trainer = RewardTrainer(model=model, args=args, train_dataset=Dataset.from_list(pairs), processing_class=tok)
        t0 = time.perf_counter()
        out = trainer.train()
        runtime = time.perf_counter() - t0
    save_checkpoint(trainer.model, tok, out_dir)
    hist = losses(trainer.state.log_history)
    accuracy = [float(h["accuracy"]) for h in trainer.state.log_history if "accuracy" in h]
    return {
        "train_loss": float(out.training_loss), "first_loss": hist[0] if hist else float("nan"),
        "final_loss": hist[-1] if hist else float("nan"), "final_pair_accuracy": accuracy[-1] if accuracy else
        float("nan"), "steps": int(out.global_step), "runtime_s": runtime, "pairs": len(pairs),
        "prompts": len({p["prompt"] for p in pairs}),
    }


class ORMScorer:
    """`score_completions`: one scalar reward per (prompt, completion), read at EOS as `RewardTrainer`
    trained it. A `components.rewards.RewardModel` of granularity 'outcome'."""

    name = "orm"
    granularity = "outcome"

    def __init__(self, path: str, device_name: str | None = None, separator: str = "\n"):  # noqa: ARG002
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.torch = torch
        self.device = device_name or device()
        self.tok = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)
        self.model.to(self.device).eval()

    def score(self, prompts: list[str], completions: list[str], steps: list[list[str]]) -> list[list[float]]:  # noqa: ARG002
        return [[v] for v in self.score_completions(prompts, completions)]

    def score_completions(self, prompts: list[str], completions: list[str], batch_size: int = 256) -> list[float]:
        if len(prompts) != len(completions):
            raise ValueError(f"score: {len(prompts)} prompts but {len(completions)} completions")
        eos = self.tok.eos_token
        # Same text and tokenizer call as RewardTrainer: prompt + completion + EOS, default special tokens.
        texts = [p + c if c.endswith(eos) else p + c + eos for p, c in zip(prompts, completions)]
        enc = self.tok(texts)["input_ids"]
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
