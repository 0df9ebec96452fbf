"""Process reward model: a token-classification head on a causal-LM backbone that scores every step.

    ex = {"prompt": "3+4-2\\n", "completions": ["3+4=7", "7-2=6", "#### 6"], "labels": [True, False, False]}
    metrics = train_prm("workdir/.../train_policy/a1/model", [ex], "out/prm", PRMParams(max_steps=300))
    scores = PRMScorer("out/prm").score_steps([ex["prompt"]], [ex["completions"]])  # [[p1, p2, p3]]
    aggregate(scores[0])                                                            # {"min", "last", "mean"}

The data is TRL's PRM format (Math-Shepherd, https://arxiv.org/abs/2312.08935): the input is the prompt,
then each step followed by the separator "\\n"; a step's label sits on its separator (its last token)
and every other position is -100. `trl.experimental.prm.PRMTrainer` was removed in TRL 1.14, so a
plain `transformers.Trainer` trains it: `LlamaForTokenClassification`'s own cross-entropy ignores -100,
which is exactly that trainer's loss. Checkpoints are safetensors only.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from typing import Any

from components.rewards import device, losses, pad_right, save_checkpoint, trainer_kwargs

STEP_SEPARATOR = "\n"  # TRL's PRM default, and the arith/gsm8k step delimiter
LABELS = {0: "bad", 1: "good"}


@dataclass
class PRMParams:
    max_steps: int = 300
    batch_size: int = 64                # trajectories per optimizer step
    learning_rate: float = 1e-3
    seed: int = 0                       # also fixes the new head's initialisation
    warmup_ratio: float = 0.05          # of max_steps
    weight_decay: float = 0.0
    logging_steps: int = 25
    max_length: int = 256               # tokens; longer trajectories are cut, losing their last steps' labels

    def __post_init__(self) -> None:
        for name in ("max_steps", "batch_size", "max_length", "logging_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"PRMParams.{name} must be >= 1, got {getattr(self, name)}")
        if self.learning_rate <= 0:
            raise ValueError(f"PRMParams.learning_rate must be > 0, got {self.learning_rate}")


def tokenize_steps(tok: Any, prompt: str, steps: list[str]) -> tuple[list[int], list[int]]:
    """Token ids of prompt + (step + separator)*, and the index of each step's separator token.

    No special tokens: coevo's backends and SFT feed the policy plain text, so the backbone reads a
    trajectory the way it learned it. Each step is tokenised on its own, as TRL's PRM format does.

    >>> from components.models.tokenizer import build_char_tokenizer
    >>> ids, ends = tokenize_steps(build_char_tokenizer(), "1+2\\n", ["1+2=3", "#### 3"])
    >>> len(ids), ends
    (17, [9, 16])
    """
    prompt_ids, *step_ids, sep = tok([prompt, *steps, STEP_SEPARATOR], add_special_tokens=False)["input_ids"]
    if not sep:
        raise ValueError(f"tokenizer maps the step separator {STEP_SEPARATOR!r} to no token")
    ids, ends = list(prompt_ids), []
    for s in step_ids:
        ids += s + sep
        ends.append(len(ids) - 1)
    return ids, ends


def _label(value: Any) -> int:
    """A step's training target: 1 good, 0 bad, -100 (ignored by the loss) for an unlabelled step (None)."""
    if value is None:
        return -100
    if value not in (0, 1):  # True/False pass: bool is an int
        raise ValueError(f"PRM labels are bool or None, got {value!r}; threshold soft Monte Carlo labels first")
    return int(value)


def train_prm(base_model_path: str, examples: list[dict[str, Any]], out_dir: str, params: PRMParams,
              init_from_prm: str | None = None) -> dict[str, Any]:
    """Train a PRM from a policy backbone (new head), or warm-start from the previous round's PRM."""
    import torch
    from datasets import Dataset
    from transformers import (AutoModelForTokenClassification, AutoTokenizer, DataCollatorForTokenClassification,
                              Trainer, TrainingArguments, set_seed)

    if not examples:
        raise ValueError("train_prm: no examples")
    source = init_from_prm or base_model_path
    tok = AutoTokenizer.from_pretrained(source)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "right"
    rows, n_pos, n_lab = [], 0, 0
    for e in examples:
        if len(e["completions"]) != len(e["labels"]):
            raise ValueError(f"train_prm: {len(e['completions'])} steps but {len(e['labels'])} labels")
        ids, ends = tokenize_steps(tok, e["prompt"], e["completions"])
        labels = [-100] * len(ids)
        for end, value in zip(ends, e["labels"]):
            labels[end] = _label(value)
        labels = labels[: params.max_length]
        n_pos += sum(v == 1 for v in labels)
        n_lab += sum(v != -100 for v in labels)
        rows.append({"input_ids": ids[: params.max_length], "labels": labels})

    set_seed(params.seed)
    model = AutoModelForTokenClassification.from_pretrained(
        source, num_labels=2, id2label=LABELS, label2id={v: k for k, v in LABELS.items()}, dtype=torch.float32)
    model.config.pad_token_id = tok.pad_token_id
    with tempfile.TemporaryDirectory() as scratch:  # Trainer wants an output_dir; nothing of it is kept
        trainer = Trainer(model=model, args=TrainingArguments(**trainer_kwargs(params, scratch)),
                          train_dataset=Dataset.from_list(rows), data_collator=DataCollatorForTokenClassification(tok))
        t0 = time.perf_counter()
        out = trainer.train()
        runtime = time.perf_counter() - t0
    save_checkpoint(trainer.model, tok, out_dir)
    hist = losses(trainer.state.log_history)
    return {
        "train_loss": float(out.training_loss), "first_loss": hist[0] if hist else float("nan"),
        "final_loss": hist[-1] if hist else float("nan"), "steps": int(out.global_step), "runtime_s": runtime,
        "examples": len(rows), "labelled_steps": n_lab, "good_fraction": n_pos / max(n_lab, 1),
        "init": "prm" if init_from_prm else "policy",
    }


class PRMScorer:
    """`score_steps`: P(step is good) at each step's separator, one forward pass per trajectory."""

    def __init__(self, path: str, device_name: str | None = None):
        import torch
        from transformers import AutoModelForTokenClassification, AutoTokenizer

        self.torch = torch
        self.device = device_name or device()
        self.tok = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForTokenClassification.from_pretrained(path, dtype=torch.float32).to(self.device).eval()
        self.good = self.model.config.label2id.get("good", 1)
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else 0  # masked: any id works

    def score_steps(self, prompts: list[str], steps: list[list[str]], batch_size: int = 256) -> list[list[float]]:
        if len(prompts) != len(steps):
            raise ValueError(f"score_steps: {len(prompts)} prompts but {len(steps)} step lists")
        enc = [tokenize_steps(self.tok, p, s) for p, s in zip(prompts, steps)]
        # Sorted by length so a batch pads little; trajectories without steps need no forward pass.
        order = sorted((i for i, (_, ends) in enumerate(enc) if ends), key=lambda i: len(enc[i][0]))
        out: list[list[float]] = [[] for _ in prompts]
        for b in range(0, len(order), batch_size):
            idx = order[b:b + batch_size]
            ids, mask = pad_right([enc[i][0] for i in idx], self.pad_id)
            with self.torch.inference_mode():
                logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
            probs = logits.float().softmax(-1)[..., self.good].cpu()
            for row, i in enumerate(idx):
                out[i] = probs[row, enc[i][1]].tolist()
        return out


def aggregate(step_scores: list[float]) -> dict[str, float]:
    """A trajectory's score from its step scores: `min` (the weakest step, as in "Let's Verify Step by
    Step", Lightman et al. 2023), `last` and `mean`. A trajectory with no steps scores 0.

    >>> aggregate([1.0, 0.25, 0.5, 0.25])
    {'min': 0.25, 'last': 0.25, 'mean': 0.5}
    >>> aggregate([])
    {'min': 0.0, 'last': 0.0, 'mean': 0.0}
    """
    if not step_scores:
        return {"min": 0.0, "last": 0.0, "mean": 0.0}
    return {"min": min(step_scores), "last": step_scores[-1], "mean": sum(step_scores) / len(step_scores)}
