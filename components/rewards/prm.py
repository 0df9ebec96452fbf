"""Process reward model: scores every step of a trajectory, on a causal-LM backbone. Two heads:

- `classifier` (the default): a token-classification head reads each step's separator (TRL's PRM).
- `likelihood`: a step's score is `sigmoid(scale * min log p(token) + bias)` over the tokens of the step
  and the steps before it (a step after a wrong one is wrong: the labels' meaning) under the backbone's
  own language-model head, with `scale` and `bias` learned; the step labels fine-tune the
  whole model through that score, and `lm_weight` keeps it a language model on all-good trajectories.
  A wrong step holds a token the model would not have written, so this head starts from what the
  backbone already computes, where a new classifier head must learn to check the arithmetic from a few
  thousand labels. Measured (benchmarks/prm_heads.py, bench-coevo-v3 round 11, both heads fresh on the
  same policy, labels and 200 steps): step AUC 0.997 against 0.712, erroneous-step F1 0.71 against
  0.30, best-of-8 0.956 against 0.942 on held-out samples (README, "What it measured against rft").

    ex = {"prompt": "3+4-2\\n", "completions": ["3+4=7", "7-2=6", "#### 6"], "labels": [True, False, False]}
    metrics = train_prm("workdir/.../train_policy/a1/model", [ex], "out/prm", PRMParams(max_steps=300))
    scores = PRMScorer("out/prm").score_steps([ex["prompt"]], [ex["completions"]])  # [[p1, p2, p3]]
    aggregate(scores[0])                                                            # {"min", "last", "mean"}

The data is TRL's PRM format (Math-Shepherd, https://arxiv.org/abs/2312.08935): the input is the prompt,
then each step followed by the separator "\\n"; a step's label sits on its separator (its last token)
and every other position is -100. `trl.experimental.prm.PRMTrainer` was removed in TRL 1.14, so a
plain `transformers.Trainer` trains it: `LlamaForTokenClassification`'s own cross-entropy ignores -100,
which is exactly that trainer's loss. Checkpoints are safetensors only; a likelihood PRM is a plain
`LlamaForCausalLM` checkpoint whose config carries `prm_head` and `prm_calibration` ([scale, bias]).

A real model: the PRM reads a trajectory as the policy wrote it. `prompt_format="chat"` renders the
prompt with the tokenizer's chat template (`models.prompts.render_prompt`, as generation and SFT do; give
the scorer the same format), and the whole text is tokenized once, special tokens added as the policy's
own call adds them, so a BPE token that spans a step's end (a run of symbols takes the newline with it)
is the policy's token too (`encode_steps`). Trajectories over `max_length` tokens are counted before
training (`training.common.check_truncation`, naming `train_reward.max_length`); the scorer scores the
steps that fit and counts the cut trajectories in `truncated`. `dtype` loads, trains and scores in
float32 (the default), bfloat16 or the checkpoint's own (`auto`); `lora` trains LoRA adapters (peft;
the classifier's head in full, as `modules_to_save`) and saves them merged into a plain checkpoint.
"""

from __future__ import annotations

import tempfile
import time
import warnings
from bisect import bisect_right
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

from components.models.prompts import RAW, PromptFormat, check_prompt_format, render_prompt
from components.rewards import device, losses, pad_right, save_checkpoint, token_logprobs, trainer_kwargs
from components.training.common import (check_dtype, check_fsdp, check_loaded_dtype, check_truncation, process_batch,
                                        processes_metric, save_trained, torch_dtype, training_processes)
from components.training.lora import LoraParams, is_adapter_dir, load_causal_lm, lora_config

STEP_SEPARATOR = "\n"  # TRL's PRM default, and arith's and gsm8k's (a domain names its own: `step_separator`)
LABELS = {0: "bad", 1: "good"}
HEADS = ("classifier", "likelihood")
# A fresh likelihood head: a step whose least likely token had p = 1/e scores 0.5.
INITIAL_CALIBRATION = (2.0, 2.0)
CALIBRATION_LR_SCALE = 10.0


@dataclass
class PRMParams:
    max_steps: int = 300
    batch_size: int = 64                # trajectories per optimizer step
    learning_rate: float = 1e-3
    seed: int = 0                       # also fixes the new head's initialisation
    warmup_ratio: float = 0.05          # of max_steps
    weight_decay: float = 0.0
    logging_steps: int = 25
    max_length: int | None = 256        # tokens; longer trajectories are cut, losing their last steps' labels
    head: str = "classifier"            # or "likelihood" (module docstring)
    lm_weight: float = 0.0              # weight of the language-model loss on all-good trajectories
    separator: str = STEP_SEPARATOR     # the domain's step separator, after each step
    max_truncated_fraction: float = 0.0  # the share of trajectories allowed over max_length before TruncationError
    setting: str = "train_reward"       # the config section that errors name, e.g. "train_reward.max_length"
    prompt_format: PromptFormat = RAW   # raw, or chat: prompts rendered as the policy saw them (the scorer's too)
    dtype: str = "float32"              # weights trained and saved: float32, bfloat16, float16 (CUDA, LoRA), auto
    lora: LoraParams | None = None      # train LoRA adapters (the classifier head in full); saved merged

    def __post_init__(self) -> None:
        self.prompt_format = PromptFormat.of(self.prompt_format)
        self.lora = LoraParams.of(self.lora)
        if self.head not in HEADS:
            raise ValueError(f"PRMParams.head must be one of {HEADS}, got {self.head!r}")
        if self.lm_weight < 0:
            raise ValueError(f"PRMParams.lm_weight must be >= 0, got {self.lm_weight}")
        for name in ("max_steps", "batch_size", "logging_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"PRMParams.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_length is not None and self.max_length < 1:
            raise ValueError(f"PRMParams.max_length must be >= 1 or None, got {self.max_length}")
        if self.learning_rate <= 0:
            raise ValueError(f"PRMParams.learning_rate must be > 0, got {self.learning_rate}")
        if not 0 <= self.max_truncated_fraction <= 1:
            raise ValueError(f"PRMParams.max_truncated_fraction must be in [0, 1], got {self.max_truncated_fraction}")
        check_dtype(self.dtype, lora=self.lora is not None, use_cpu=None, where="PRMParams")
        if self.lora is not None and not self.lora.merge:
            # A PRM's head and calibration live beside the weights (config.json, the head's own tensors): an
            # adapter folder would carry neither, and every reader would need peft.
            raise ValueError("PRMParams.lora.merge=False: a reward model is saved merged, as a plain checkpoint; "
                             "set lora.merge=True")


class StepTokens(NamedTuple):
    ids: list[int]       # the whole text, tokenized once
    ends: list[int]      # per step, the token holding its last character (its separator's, if it has one)
    prompt_len: int      # tokens wholly inside the prompt (a leading BOS included)


def encode_steps(tok: Any, prompt: str, steps: list[str], separator: str = STEP_SEPARATOR) -> StepTokens:
    """`prompt` + (step + separator)* tokenized as one text, as the policy's own tokenizer call reads it
    (special tokens added), and where each step ends, found from the character offsets.

    Tokenizing each step on its own, as TRL's PRM format does, is right only for a tokenizer that never
    merges across a step's end: a byte-level BPE merges a run of symbols with the newline after it ("=\\n"),
    and the scorer would then read tokens the policy never wrote. Two steps share an end token only where
    one token covers a whole step and its separator.

    >>> from components.models.tokenizer import build_char_tokenizer
    >>> encode_steps(build_char_tokenizer(), "1+2\\n", ["1+2=3", "#### 3"])[1:]
    ([9, 16], 4)
    """
    if not getattr(tok, "is_fast", False):
        raise ValueError(f"the PRM finds step ends from token offsets, which {type(tok).__name__} (a slow "
                         "tokenizer) does not give; load the model's fast tokenizer (tokenizer.json)")
    text, last = prompt, []
    for step in steps:
        text += step + separator
        if len(text) == len(prompt) or (last and len(text) - 1 == last[-1]):
            raise ValueError(f"step {len(last)} is empty and the separator {separator!r} too: no character to "
                             "score it at")
        last.append(len(text) - 1)
    enc = tok(text, add_special_tokens=True, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    # Special tokens the tokenizer adds (BOS) span no character; every other token's start, in order.
    spans = [(i, s) for i, (s, e) in enumerate(enc["offset_mapping"]) if e > s]
    starts = [s for _, s in spans]
    # A step ends at the last token starting at or before its last character: the token covering it (the last
    # byte's, for a character split over byte tokens).
    ends = [spans[max(bisect_right(starts, c) - 1, 0)][0] for c in last]
    prompt_len = next((i for i, (s, e) in enumerate(enc["offset_mapping"]) if e > max(s, len(prompt))), len(ids))
    return StepTokens(ids, ends, prompt_len)


def tokenize_steps(tok: Any, prompt: str, steps: list[str], separator: str = STEP_SEPARATOR) -> tuple[list[int], list[int]]:
    """Token ids of prompt + (step + separator)*, and the index of each step's separator token (its last):
    `encode_steps` without the prompt length.

    >>> from components.models.tokenizer import build_char_tokenizer
    >>> ids, ends = tokenize_steps(build_char_tokenizer(), "1+2\\n", ["1+2=3", "#### 3"])
    >>> len(ids), ends
    (17, [9, 16])
    """
    ids, ends, _ = encode_steps(tok, prompt, steps, separator)
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
    """Train a PRM from a policy backbone (new head), or warm-start from the previous round's PRM.

    Returns the losses, steps, runtime_s, examples, labelled_steps, good_fraction, init, a likelihood
    head's calibration_scale / calibration_bias, and truncated / truncated_fraction (trajectories over
    max_length, counted before training).
    """
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, DataCollatorForTokenClassification, Trainer, TrainingArguments, set_seed

    if not examples:
        raise ValueError("train_prm: no examples")
    if params.lm_weight and params.head != "likelihood":
        raise ValueError("PRMParams.lm_weight needs head='likelihood': a classifier PRM has no language-model head")
    if init_from_prm and prm_head(init_from_prm) != params.head:
        raise ValueError(f"train_prm: {init_from_prm} is a {prm_head(init_from_prm)!r} PRM; it cannot warm-start "
                         f"a {params.head!r} one (set train_reward.init=policy)")
    use_cpu = device() == "cpu"  # as trainer_kwargs decides it
    check_dtype(params.dtype, lora=params.lora is not None, use_cpu=use_cpu, where="PRMParams")
    check_fsdp(params.setting, **{f"{params.setting}.lora": params.lora is not None,
                                  f"{params.setting}.head=likelihood": params.head == "likelihood"})
    source = init_from_prm or base_model_path
    tok = AutoTokenizer.from_pretrained(source)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "right"
    fmt = params.prompt_format
    check_prompt_format(tok, fmt, source)
    limit = params.max_length
    rows, lengths, n_pos, n_lab = [], [], 0, 0
    for e in examples:
        if len(e["completions"]) != len(e["labels"]):
            raise ValueError(f"train_prm: {len(e['completions'])} steps but {len(e['labels'])} labels")
        ids, ends, prompt_len = encode_steps(tok, render_prompt(tok, e["prompt"], fmt), e["completions"],
                                             params.separator)
        lengths.append(len(ids))
        targets = [_label(v) if limit is None or end < limit else -100 for end, v in zip(ends, e["labels"])]
        n_pos += sum(v == 1 for v in targets)
        n_lab += sum(v != -100 for v in targets)
        ids = ids[:limit]
        if params.head == "classifier":
            labels = [-100] * len(ids)
            for end, value in zip(ends, targets):
                if end < len(ids):
                    labels[end] = value
            rows.append({"input_ids": ids, "labels": labels})
        else:
            all_good = all(v is True for v in e["labels"])
            rows.append({"input_ids": ids, "step_of_token": _step_of_token(prompt_len, ends, len(ids)),
                         "step_labels": targets, "lm_from": prompt_len if all_good else len(ids)})
    truncation = check_truncation(lengths, limit, params.max_truncated_fraction, params.setting, noun="trajectories")

    dtype = torch_dtype(params.dtype)
    with tempfile.TemporaryDirectory() as scratch:  # Trainer wants an output_dir; nothing of it is kept
        set_seed(params.seed)
        kwargs = trainer_kwargs(params, "")
        kwargs["per_device_train_batch_size"] = process_batch(params.batch_size, f"{params.setting}.batch_size",
                                                              params.setting)
        if params.head == "classifier":
            model = _token_classifier(source, dtype, Path(scratch) / "base")
            trainer_cls, collator, extra = Trainer, DataCollatorForTokenClassification(tok), {}
            if training_processes() > 1:
                extra["compute_loss_func"] = _token_loss
        else:
            model = load_causal_lm(source, dtype)  # an adapter folder: its base, the adapter merged in
            trainer_cls, collator = _trainer_class(), _likelihood_collator(tok.pad_token_id)
            extra = {"lm_weight": params.lm_weight}
            kwargs["remove_unused_columns"] = False  # the collator's extra columns are not forward() arguments
            if training_processes() > 1:  # the calibration joins the loss outside forward(), where DDP's search
                kwargs["ddp_find_unused_parameters"] = False  # for unused parameters would take it for unused
        check_loaded_dtype(model, lora=params.lora is not None, use_cpu=use_cpu, where="PRMParams")
        kwargs["fp16"] = model.dtype == torch.float16  # fp16 weights (LoRA only) need the Trainer's loss scaler
        model.config.pad_token_id = tok.pad_token_id
        if params.lora:
            model = _with_lora(model, params)
        if params.head == "likelihood":
            scale, bias = getattr(model.config, "prm_calibration", None) or INITIAL_CALIBRATION
            model.prm_calibration = torch.nn.Parameter(torch.tensor([scale, bias], dtype=torch.float32))
        trainer = trainer_cls(model=model, args=TrainingArguments(**(kwargs | {"output_dir": scratch})),
                              train_dataset=Dataset.from_list(rows), data_collator=collator, **extra)
        t0 = time.perf_counter()
        out = trainer.train()
        runtime = time.perf_counter() - t0
    model = trainer.model
    calibration = {}
    if params.head == "likelihood":  # the two scalars live in the config, so the checkpoint is a plain causal LM
        values = [round(float(v), 6) for v in model.prm_calibration.detach()]
        del model.prm_calibration
    if params.lora:
        model = model.merge_and_unload()
    if params.head == "likelihood":
        model.config.prm_head = "likelihood"
        model.config.prm_calibration = values
        calibration = dict(zip(("scale", "bias"), values))
    save_trained(trainer, out_dir, lambda: save_checkpoint(model, tok, out_dir), tok)
    hist = losses(trainer.state.log_history)
    return {
        "train_loss": float(out.training_loss), "first_loss": hist[0] if hist else float("nan"),
        "final_loss": hist[-1] if hist else float("nan"), "steps": int(out.global_step), "runtime_s": runtime,
        "examples": len(rows), "labelled_steps": n_lab, "good_fraction": n_pos / max(n_lab, 1),
        "init": "prm" if init_from_prm else "policy", **{f"calibration_{k}": v for k, v in calibration.items()},
        **truncation, **processes_metric(trainer),
    }


def full_checkpoint(path: str, dtype: Any, scratch: Path) -> str:
    """`path`, or for a LoRA adapter folder (a policy saved with lora.merge=False) its base with the adapter merged
    in, written to `scratch`: transformers would put a classifier head on the base with the adapter unmerged."""
    if not is_adapter_dir(path):
        return path
    load_causal_lm(path, dtype).save_pretrained(scratch)
    return str(scratch)


def _token_classifier(source: str, dtype: Any, scratch: Path):
    """A two-label token-classification model on `source`'s backbone (a new head), or a classifier PRM as it is."""
    from transformers import AutoModelForTokenClassification

    return AutoModelForTokenClassification.from_pretrained(
        full_checkpoint(source, dtype, scratch), num_labels=2, id2label=LABELS,
        label2id={v: k for k, v in LABELS.items()}, dtype=dtype)


def _with_lora(model: Any, params: PRMParams):
    """The model with LoRA adapters (peft); a classifier's head is new, so it trains in full (`modules_to_save`)."""
    from peft import get_peft_model

    lora, task = params.lora, "CAUSAL_LM"
    if params.head == "classifier":
        task, head = "TOKEN_CLS", _head_name(model)
        if head not in lora.modules_to_save:
            lora = replace(lora, modules_to_save=(*lora.modules_to_save, head))
    config = lora_config(lora, model, f"{params.setting}.lora", task_type=task)
    with warnings.catch_warnings():  # peft reads transformers' renamed `is_gradient_checkpointing`
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return get_peft_model(model, config)


def _head_name(model: Any) -> str:
    """The classification head's module name ("score" for transformers' generic heads)."""
    for name in ("score", "classifier"):
        if hasattr(model, name):
            return name
    raise ValueError(f"{type(model).__name__} has no `score` or `classifier` head to train beside LoRA")


def prm_head(path: str) -> str:
    """Which head a saved PRM has: `likelihood` if its config says so, else `classifier`."""
    import json

    return json.loads((Path(path) / "config.json").read_text()).get("prm_head", "classifier")


def _step_of_token(prompt_len: int, ends: list[int], length: int) -> list[int]:
    """Each token's step index (the step's text and its separator), -1 for the prompt; cut at `length`.

    >>> _step_of_token(3, [5, 7, 10], 10)
    [-1, -1, -1, 0, 0, 0, 1, 1, 2, 2]
    """
    out, start = [-1] * length, prompt_len
    for k, end in enumerate(ends):
        stop = min(end + 1, length)
        out[start:stop] = [k] * max(0, stop - start)
        start = end + 1
    return out


def _likelihood_step_logits(calibration: Any, logits: Any, input_ids: Any, step_of_token: Any, n_steps: int) -> Any:
    """(batch, n_steps) logits `scale * min log p + bias`, the min over the tokens of each step and the steps
    before it (a row's missing steps repeat its last step's value). Token j's log-probability is read from
    position j - 1."""
    import torch

    lp = token_logprobs(logits, input_ids)
    seg = step_of_token[:, 1:]
    member = seg[:, None, :] == torch.arange(n_steps, device=seg.device)[None, :, None]
    least = lp[:, None, :].expand(-1, n_steps, -1).masked_fill(~member, float("inf")).amin(-1)
    least = least.masked_fill(~member.any(-1), 0.0)  # a row's missing steps: 0, not inf (0 * inf is a NaN gradient)
    # A step label says whether its prefix can still reach a right answer (Monte Carlo, oracle): a step after
    # a wrong one is wrong too, so a step scores by the least likely token of its whole prefix.
    return calibration[0] * least.cummin(dim=1).values + calibration[1]


def _likelihood_collator(pad_id: int):
    """Right-pads a batch of likelihood-PRM rows; `lm_labels` are the completion's tokens of an all-good row."""

    def collate(rows: list[dict[str, Any]]) -> dict[str, Any]:
        import torch

        ids, mask = pad_right([r["input_ids"] for r in rows], pad_id)
        seg, _ = pad_right([r["step_of_token"] for r in rows], -1)
        labels, _ = pad_right([r["step_labels"] or [-100] for r in rows], -100)
        lm = torch.full_like(ids, -100)
        for i, r in enumerate(rows):
            lm[i, r["lm_from"]:len(r["input_ids"])] = ids[i, r["lm_from"]:len(r["input_ids"])]
        return {"input_ids": ids, "attention_mask": mask, "step_of_token": seg, "step_labels": labels, "lm_labels": lm}

    return collate


def _token_loss(outputs: Any, labels: Any, num_items_in_batch: Any = None) -> Any:
    """The classifier PRM's loss under N processes: the cross-entropy summed over this process's labelled steps,
    over the count of all processes' (`num_items_in_batch`, which the Trainer gathers, then multiplies the loss
    by N against DDP's mean of the gradients), so the step is one process's over the whole batch. The model's own
    loss (transformers 5.23's token classifier) drops the count and averages over its process's steps alone,
    which the Trainer's multiplication then scales N times."""
    import torch.nn.functional as F

    logits = outputs.logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1).to(logits.device),
                           ignore_index=-100, reduction="sum")
    return loss / (num_items_in_batch if num_items_in_batch is not None else (labels != -100).sum().clamp(min=1))


def _likelihood_loss(model: Any, inputs: dict[str, Any], lm_weight: float, calibration: Any = None,
                     counts: Any = None) -> Any:
    """Binary cross-entropy of each labelled step's score, plus `lm_weight` x the LM loss of all-good rows.

    Under N processes `calibration` is the unwrapped model's and `counts(steps, lm_tokens)` turns this process's
    counts into the divisors: each term is summed here and divided by all processes' count over N, so DDP's
    mean of the N gradients is one process's over the whole batch."""
    import torch.nn.functional as F

    out = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
    labels = inputs["step_labels"]
    z = _likelihood_step_logits(model.prm_calibration if calibration is None else calibration, out.logits,
                                inputs["input_ids"], inputs["step_of_token"], labels.shape[1])
    keep = labels != -100
    if counts is not None:
        lm = inputs["lm_labels"][:, 1:]
        n_steps, n_lm = counts(keep.sum(), (lm != -100).sum())
        loss = F.binary_cross_entropy_with_logits(z[keep], labels[keep].float(), reduction="sum") / n_steps
        if lm_weight:
            loss = loss + lm_weight * F.cross_entropy(out.logits[:, :-1].reshape(-1, out.logits.shape[-1]).float(),
                                                      lm.reshape(-1), ignore_index=-100, reduction="sum") / n_lm
        return loss
    loss = F.binary_cross_entropy_with_logits(z[keep], labels[keep].float()) if keep.any() else z.new_zeros(())
    lm = inputs["lm_labels"][:, 1:]
    if lm_weight and (lm != -100).any():
        loss = loss + lm_weight * F.cross_entropy(out.logits[:, :-1].reshape(-1, out.logits.shape[-1]).float(),
                                                  lm.reshape(-1), ignore_index=-100)
    return loss


def _trainer_class():
    from transformers import Trainer

    class LikelihoodTrainer(Trainer):
        def __init__(self, *args: Any, lm_weight: float, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self.lm_weight = lm_weight

        def create_optimizer(self, model=None):
            """The two calibration scalars learn at CALIBRATION_LR_SCALE x the rate: they must follow a backbone
            whose likelihoods move, and a few hundred steps at a fine-tuning rate leave them near their start."""
            opt = super().create_optimizer(model)
            calibration = self.model.prm_calibration
            for group in opt.param_groups:
                group["params"] = [p for p in group["params"] if p is not calibration]
            opt.add_param_group({"params": [calibration], "weight_decay": 0.0,
                                 "lr": self.args.learning_rate * CALIBRATION_LR_SCALE})
            return opt

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # noqa: ARG002
            n = self.accelerator.num_processes
            if n == 1:
                loss = _likelihood_loss(model, inputs, self.lm_weight)
            else:
                def counts(*local: Any) -> list[Any]:  # all processes' counts over N (at least one item's worth)
                    return [(self.accelerator.reduce(c.float(), "sum") / n).clamp(min=1 / n) for c in local]

                loss = _likelihood_loss(model, inputs, self.lm_weight,
                                        self.accelerator.unwrap_model(model).prm_calibration, counts)
            return (loss, None) if return_outputs else loss

    return LikelihoodTrainer


class StepScorer:
    """What the reward models that score steps share: the prompt rendered in the `prompt_format` the model was
    trained or sampled with, then each step and its separator, tokenized as one text (`encode_steps`); a text
    over `max_length` tokens (None: no limit) is cut to the steps that end within it, and counted in `truncated`."""

    def _setup_steps(self, tok: Any, path: str, separator: str, prompt_format: PromptFormat | dict[str, Any] | str | None,
                     max_length: int | None) -> None:
        if max_length is not None and max_length < 1:
            raise ValueError(f"{type(self).__name__}.max_length must be >= 1 or None, got {max_length}")
        self.tok, self.separator, self.max_length, self.truncated = tok, separator, max_length, 0
        self.prompt_format = PromptFormat.of(prompt_format)
        check_prompt_format(tok, self.prompt_format, path)
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0  # masked: any id works

    def _encode_steps(self, prompts: list[str], steps: list[list[str]]) -> list[StepTokens]:
        if len(prompts) != len(steps):
            raise ValueError(f"{type(self).__name__}: {len(prompts)} prompts but {len(steps)} step lists")
        out = []
        for p, s in zip(prompts, steps, strict=True):
            enc = encode_steps(self.tok, render_prompt(self.tok, p, self.prompt_format), s, self.separator)
            cut = cut_steps(enc, self.max_length)
            self.truncated += cut is not enc
            out.append(cut)
        return out


class PRMScorer(StepScorer):
    """`score_steps`: P(step is good) for every step, one forward pass per trajectory (either head).
    A `components.rewards.RewardModel`.

    `prompt_format` must be the one the PRM was trained with (and the policy sampled with). `max_length`
    (tokens; None: no limit) cuts a longer trajectory: the steps that end within it are scored, the rest
    get no score (its list is shorter than its steps), and each cut trajectory adds 1 to `truncated`.
    """

    name = "prm"
    granularity = "step"

    def __init__(self, path: str, device_name: str | None = None, separator: str = STEP_SEPARATOR,
                 prompt_format: PromptFormat | dict[str, Any] | str | None = None, dtype: str = "float32",
                 max_length: int | None = None):
        import torch
        from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

        self._setup_steps(AutoTokenizer.from_pretrained(path), path, separator, prompt_format, max_length)
        self.torch = torch
        self.device = device_name or device()
        self.head = prm_head(path)
        cls = AutoModelForCausalLM if self.head == "likelihood" else AutoModelForTokenClassification
        self.model = cls.from_pretrained(path, dtype=torch_dtype(dtype)).to(self.device).eval()
        if self.head == "likelihood":
            self.calibration = torch.tensor(self.model.config.prm_calibration, dtype=torch.float32, device=self.device)
        else:
            self.good = self.model.config.label2id.get("good", 1)

    def score(self, prompts: list[str], completions: list[str], steps: list[list[str]]) -> list[list[float]]:
        return self.score_steps(prompts, steps)

    def score_steps(self, prompts: list[str], steps: list[list[str]], batch_size: int = 256) -> list[list[float]]:
        enc = self._encode_steps(prompts, steps)
        # Sorted by length so a batch pads little; trajectories without steps (that fit) need no forward pass.
        order = sorted((i for i, e in enumerate(enc) if e.ends), key=lambda i: len(enc[i].ids))
        out: list[list[float]] = [[] for _ in prompts]
        for b in range(0, len(order), batch_size):
            idx = order[b:b + batch_size]
            ids, mask = pad_right([enc[i].ids for i in idx], self.pad_id)
            ids, mask = ids.to(self.device), mask.to(self.device)
            with self.torch.inference_mode():
                logits = self.model(input_ids=ids, attention_mask=mask).logits
                if self.head == "likelihood":
                    seg, _ = pad_right([_step_of_token(enc[i].prompt_len, enc[i].ends, len(enc[i].ids))
                                        for i in idx], -1)
                    probs = _likelihood_step_logits(self.calibration, logits, ids, seg.to(self.device),
                                                    max(len(enc[i].ends) for i in idx)).sigmoid().cpu()
                else:
                    probs = logits.float().softmax(-1)[..., self.good].cpu()
            for row, i in enumerate(idx):
                out[i] = probs[row, : len(enc[i].ends)].tolist() if self.head == "likelihood" \
                    else probs[row, enc[i].ends].tolist()
        return out


def cut_steps(enc: StepTokens, max_length: int | None) -> StepTokens:
    """`enc` cut to max_length tokens, keeping the steps that end within it; `enc` itself where it fits.

    >>> cut_steps(StepTokens([1, 2, 3, 4, 5], [2, 4], 1), 4)
    StepTokens(ids=[1, 2, 3, 4], ends=[2], prompt_len=1)
    """
    if max_length is None or len(enc.ids) <= max_length:
        return enc
    return StepTokens(enc.ids[:max_length], [e for e in enc.ends if e < max_length], min(enc.prompt_len, max_length))


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
