"""Preference training of the policy with TRL's DPOTrainer (Rafailov et al. 2023).

    metrics = train_dpo("workdir/.../r1/model", "workdir/.../r0/model",
                        [{"prompt": "3+4\\n", "chosen": "3+4=7\\n#### 7\\n", "rejected": "3+4=8\\n#### 8\\n"}],
                        "out/model", DPOParams(max_steps=100, beta=0.1))

TRL tokenizes `prompt` and `prompt + completion` as plain text with the tokenizer's own call, as SFT
does, so the char tokenizer (which adds no BOS/EOS) sees exactly the characters, and every completion
ends with EOS so the preference covers stopping. `prompt_format="chat"` renders the prompt with the chat
template first and makes the template's turn terminator the EOS, as in SFT (see sft.py). The reference is
frozen; `ref_model_path` None (or the policy's own path) makes TRL load a second copy of the starting
model, or, with LoRA, use the policy with its adapters switched off. Pairs whose longer side exceeds
`max_length` tokens are counted before training (`truncated`) and fail past `max_truncated_fraction`.
`sft_weight` > 0 adds TRL's "sft" loss, the mean NLL of the chosen tokens, with that weight: RPO (Pang et
al. 2024).

Agent episodes pair as {"chosen": messages, "rejected": messages}: two conversations of one problem, each
assistant turn with its sampled `token_ids`. Each side is tokenized append-only, as SFT tokenizes an episode
(`ChatEncoder`), the shared opening is the prompt, and the preference's log-probabilities sum over the
assistant's tokens alone: observations, tool results and the template's headers are masked out of both sides.

The saved model is weights (safetensors), config, generation config and tokenizer; no pickles. On CPU
two runs with the same seed and data give a byte-identical model.safetensors.
"""

from __future__ import annotations

import math
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from components.models.prompts import RAW, PromptFormat, render_prompt
from components.training.common import (ProgressCallback, check_dtype, check_fsdp, check_schedule, check_truncation,
                                        keep_safetensors_only, load_policy_to_train, process_batch, processes_metric,
                                        quiet_datasets, save_trained, token_lengths)
from components.training.lora import LoraParams, is_adapter_dir, load_causal_lm, lora_config, save_lora

# TRL 1.16 DPOConfig.loss_type choices. "exo_pair" is left out: it needs label_smoothing > 0, which these
# params do not carry.
LOSS_TYPES = ("sigmoid", "hinge", "ipo", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot", "aot_unpaired",
              "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")
PAIR_KEYS = ("prompt", "chosen", "rejected")
EPISODE_PAIR_KEYS = ("chosen", "rejected")


@dataclass
class DPOParams:
    max_steps: int = 100
    batch_size: int = 32                # pairs per optimizer step
    learning_rate: float = 5e-5
    beta: float = 0.1                   # DPO temperature (Rafailov et al. 2023): higher stays closer to the reference
    loss_type: str = "sigmoid"          # any TRL DPO loss_type in LOSS_TYPES
    warmup_ratio: float = 0.05          # fraction of max_steps spent ramping the LR up linearly
    seed: int = 0                       # data order (dropout is off in DPO)
    logging_steps: int = 10             # loss and rewards are logged (and progress_callback called) this often
    max_length: int | None = 256        # tokens of prompt + completion; a prompt this long drops the pair
    max_truncated_fraction: float = 0.0  # the share of pairs allowed over max_length before TruncationError
    setting: str = "train_policy.dpo"   # the config section that errors name, e.g. "train_policy.dpo.max_length"
    prompt_format: PromptFormat = RAW   # raw, or chat: the tokenizer's template, completions end at its turn end
    dtype: str = "float32"              # weights trained and saved: float32, bfloat16, float16 (CUDA, LoRA), auto
    gradient_accumulation_steps: int = 1  # forward passes per optimizer step
    gradient_checkpointing: bool = False  # recompute activations in backward: less memory, ~20% slower
    lora: LoraParams | None = None      # train LoRA adapters; the reference is then the policy without them
    num_threads: int | None = None      # torch intra-op threads (process-wide); None leaves the setting alone
    use_cpu: bool | None = None         # None: CPU exactly when no CUDA device exists
    sft_weight: float = 0.0             # weight of the NLL on chosen (RPO, Pang et al. 2024); 0 = pure DPO

    def __post_init__(self) -> None:
        self.prompt_format = PromptFormat.of(self.prompt_format)
        self.lora = LoraParams.of(self.lora)
        check_schedule(self)
        check_dtype(self.dtype, lora=self.lora is not None, use_cpu=self.use_cpu, where=type(self).__name__)
        if not self.beta > 0:  # also rejects nan
            raise ValueError(f"DPOParams.beta must be > 0, got {self.beta}: it scales the implicit reward")
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"DPOParams.loss_type must be one of {', '.join(LOSS_TYPES)}; got {self.loss_type!r}")
        if not self.sft_weight >= 0:
            raise ValueError(f"DPOParams.sft_weight must be >= 0, got {self.sft_weight}")
        if self.sft_weight > 0 and self.loss_type == "sft":
            raise ValueError("DPOParams: sft_weight adds an SFT term to a preference loss; with loss_type='sft' "
                             "set sft_weight=0 or choose a preference loss_type")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"DPOParams.num_threads must be >= 1 or None, got {self.num_threads}")


def train_dpo(model_path: str, ref_model_path: str | None, pairs: list[dict[str, Any]], out_dir: str,
              params: DPOParams, progress_callback: ProgressCallback | None = None) -> dict[str, Any]:
    """Train the policy at `model_path` to prefer `chosen` over `rejected`; save it to `out_dir`.

    pairs: [{"prompt", "chosen", "rejected"}], completions without EOS (it is appended here); or agent episodes,
    [{"chosen": messages, "rejected": messages}].
    ref_model_path: the frozen reference (previous round's policy or the initial model); None means the
    starting model itself is the reference.

    Returns train_loss (mean over all steps), first_loss / final_loss (first and last logged), steps,
    runtime_s, pairs (the number trained on), truncated / truncated_fraction (pairs over max_length, counted
    before training) and the last logged "rewards/accuracies" (fraction of pairs whose implicit reward
    beta * log(pi/pi_ref) ranks chosen first) and "rewards/margins" (mean chosen minus rejected reward);
    nan where nothing was logged.
    """
    import datasets
    import torch
    from transformers import PrinterCallback, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    from components.rewards import save_checkpoint

    episodes = _check_pairs(pairs)
    check_fsdp(params.setting, **{"policy.lora": params.lora is not None})
    model, tok, use_cpu = load_policy_to_train(model_path, params)
    if episodes:
        rows = episode_pair_rows(tok, model_path, pairs, params)
        lengths = [max(len(r["prompt_ids"]) + len(r["chosen_ids"]), len(r["prompt_ids"]) + len(r["rejected_ids"]))
                   for r in rows]
    else:
        fmt = params.prompt_format
        # TRL appends EOS to completions too; doing it here keeps the contract if that default changes.
        eos = tok.eos_token
        rows = [{"prompt": render_prompt(tok, p["prompt"], fmt),
                 **{k: p[k] + ("" if p[k].endswith(eos) else eos) for k in ("chosen", "rejected")}} for p in pairs]
        # A pair is cut when either side is: TRL truncates prompt + chosen and prompt + rejected separately.
        lengths = [max(c, r) for c, r in zip(token_lengths(tok, [x["prompt"] + x["chosen"] for x in rows]),
                                             token_lengths(tok, [x["prompt"] + x["rejected"] for x in rows]),
                                             strict=True)]
    truncation = check_truncation(lengths, params.max_length, params.max_truncated_fraction, params.setting,
                                  noun="pairs")
    ref_model = None  # TRL then loads the reference from the policy's own path, or with LoRA disables the adapters
    if ref_model_path is not None and not _same_path(ref_model_path, model_path):
        ref_model = load_causal_lm(ref_model_path, model.dtype)
        if ref_model.config.vocab_size != model.config.vocab_size:
            raise ValueError(f"train_dpo: reference {ref_model_path} has vocab {ref_model.config.vocab_size}, the "
                             f"policy {model_path} has {model.config.vocab_size}; they must share a tokenizer")
    elif params.lora is None and is_adapter_dir(model_path):  # TRL would load the adapter's base, not the policy
        ref_model = load_causal_lm(model_path, model.dtype)
    ds = datasets.Dataset.from_list(rows)
    peft_config = lora_config(params.lora, model, f"{params.setting}.lora") if params.lora else None
    history: list[dict[str, float]] = []

    class _Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if not logs:
                return
            history.append(dict(logs))
            if "loss" in logs and progress_callback is not None:
                progress_callback(state.global_step, state.max_steps, float(logs["loss"]))

    with tempfile.TemporaryDirectory(prefix="coevo-dpo-") as scratch:
        args = _dpo_config(DPOConfig, scratch, params, use_cpu, fp16=model.dtype == torch.float16)
        # TRL's dataset.map progress bars would flood the stage log; peft reads `is_gradient_checkpointing`.
        with warnings.catch_warnings(), quiet_datasets():
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            trainer = (_episode_trainer(DPOTrainer) if episodes else DPOTrainer)(
                model=model, ref_model=ref_model, args=args, train_dataset=ds, processing_class=tok,
                callbacks=[_Record()], peft_config=peft_config)
        if episodes:  # built by TRL with the pad token it settled on; only the completion mask is ours
            trainer.data_collator = AssistantMaskCollator(trainer.data_collator)
        trainer.remove_callback(PrinterCallback)  # it prints every log dict; progress_callback reports instead
        used = len(trainer.train_dataset)
        if used == 0:
            raise ValueError(f"train_dpo: every prompt fills max_length={params.max_length} tokens, so TRL dropped "
                             "all pairs; raise max_length")
        t0 = time.perf_counter()
        with warnings.catch_warnings():  # TRL 1.16 and peft call renamed `*gradient_checkpointing*` methods
            warnings.filterwarnings("ignore", message=".*gradient_checkpointing.*", category=FutureWarning)
            result = trainer.train()
        runtime = time.perf_counter() - t0
    tok.padding_side = "left"  # saved for generation
    trained = trainer.accelerator.unwrap_model(trainer.model)
    if params.lora:
        save_trained(trainer, out_dir, lambda: save_lora(trained, tok, out_dir, params.lora, base=model_path))
        if trainer.accelerator.is_main_process:  # the only one that wrote
            keep_safetensors_only(Path(out_dir))
    else:
        save_trained(trainer, out_dir, lambda: save_checkpoint(trained, tok, out_dir), tok)
        if trainer.accelerator.is_main_process and not (Path(out_dir) / "model.safetensors").exists():
            raise RuntimeError(f"{out_dir}: no model.safetensors was written")
    losses = [float(h["loss"]) for h in history if "loss" in h]
    return {
        "train_loss": float(result.training_loss),
        "first_loss": losses[0] if losses else math.nan, "final_loss": losses[-1] if losses else math.nan,
        "steps": int(result.global_step), "runtime_s": runtime, "pairs": used, **truncation,
        **processes_metric(trainer),
        **{k: _last(history, k) for k in ("rewards/accuracies", "rewards/margins")},
    }


def _dpo_config(DPOConfig, output_dir: str, params: DPOParams, use_cpu: bool, fp16: bool):
    # The RPO term is TRL's "sft" loss added to the preference loss; TRL 1.16 has no rpo_alpha any more.
    loss_type, loss_weights = [params.loss_type], None
    if params.sft_weight > 0:
        loss_type, loss_weights = [params.loss_type, "sft"], [1.0, params.sft_weight]
    return DPOConfig(
        output_dir=output_dir,  # scratch: with save_strategy="no" nothing lands there
        max_steps=params.max_steps,  # each of N processes (`accelerate launch`) takes 1/N of every batch
        per_device_train_batch_size=process_batch(params.batch_size, f"{params.setting}.batch_size", params.setting),
        learning_rate=params.learning_rate, lr_scheduler_type="linear",
        warmup_steps=params.warmup_ratio,  # transformers 5 dropped warmup_ratio: a float < 1 is a ratio
        seed=params.seed, data_seed=params.seed, use_cpu=use_cpu,
        # TRL configs default to bf16 and activation checkpointing: both only slow a small fp32 model down,
        # and bf16 on CPU would also change the numbers. bf16 weights come from `dtype` instead; fp16 weights
        # (LoRA only) need the fp16 mode's loss scaler.
        bf16=False, fp16=fp16, activation_checkpointing=params.gradient_checkpointing,
        gradient_accumulation_steps=params.gradient_accumulation_steps,
        logging_steps=params.logging_steps, logging_first_step=True, disable_tqdm=True, report_to="none",
        save_strategy="no", dataloader_num_workers=0, dataloader_pin_memory=not use_cpu,
        beta=params.beta, loss_type=loss_type, loss_weights=loss_weights, max_length=params.max_length,
    )


def episode_pair_rows(tok: Any, model_path: str, pairs: list[dict[str, Any]],
                      params: DPOParams) -> list[dict[str, Any]]:
    """Episode pairs as TRL's pre-tokenized preference rows: `prompt_ids` (the opening both conversations share,
    up to the first token the assistant wrote), `chosen_ids` / `rejected_ids` (the rest of each, append-only as
    the agent loop sampled it) and `chosen_mask` / `rejected_mask` (1 on the assistant's tokens)."""
    from components.envs.agent import ChatEncoder

    if params.prompt_format.kind != "chat":
        raise ValueError(f"{params.setting}: episodes train with the chat template: set policy.prompt_format=chat")
    enc = ChatEncoder(tok, model_path)
    rows = []
    for i, p in enumerate(pairs):
        (c_ids, c_mask), (r_ids, r_mask) = (enc.encode(p[k], add_generation_prompt=False) for k in EPISODE_PAIR_KEYS)
        if not any(c_mask) or not any(r_mask):
            side = "chosen" if not any(c_mask) else "rejected"
            raise ValueError(f"{params.setting}: pairs[{i}].{side} has no assistant turn to train on")
        start = min(c_mask.index(1), r_mask.index(1))
        if c_ids[:start] != r_ids[:start]:
            raise ValueError(f"{params.setting}: pairs[{i}]: the chosen and rejected episodes open with different "
                             "conversations; a pair is two episodes of one problem")
        rows.append({"prompt_ids": c_ids[:start], "chosen_ids": c_ids[start:], "rejected_ids": r_ids[start:],
                     "chosen_mask": c_mask[start:], "rejected_mask": r_mask[start:]})
    return rows


class AssistantMaskCollator:
    """TRL's preference collator, with `completion_mask` set to the assistant's tokens of each side: what TRL
    marks as completion (everything after the prompt) also holds the environment's observations."""

    def __init__(self, inner: Any):
        self.inner = inner

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        import torch
        from trl.trainer.utils import pad

        out = self.inner(examples)
        masks = [[0] * len(e["prompt_ids"]) + list(e[f"{side}_mask"]) for side in EPISODE_PAIR_KEYS for e in examples]
        if self.inner.max_length is not None:  # cut as the collator cut the ids
            cut = (slice(None, self.inner.max_length) if self.inner.truncation_mode == "keep_start"
                   else slice(-self.inner.max_length, None))
            masks = [m[cut] for m in masks]
        mask = pad([torch.tensor(m, dtype=torch.long) for m in masks], padding_value=0, padding_side="right",
                   pad_to_multiple_of=self.inner.pad_to_multiple_of)
        if mask.shape != out["completion_mask"].shape:
            raise RuntimeError(f"assistant mask {tuple(mask.shape)} does not line up with TRL's completion mask "
                               f"{tuple(out['completion_mask'].shape)}")
        out["completion_mask"] = mask
        return out


def _episode_trainer(DPOTrainer: type) -> type:
    """DPOTrainer for rows that `episode_pair_rows` already tokenized: TRL 1.16 would tokenize `prompt` text."""

    class EpisodeDPOTrainer(DPOTrainer):
        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            if args.max_length is None or args.truncation_mode != "keep_start":
                return dataset
            # As TRL does: a prompt that fills max_length leaves no completion token to learn from.
            return dataset.filter(lambda e: len(e["prompt_ids"]) < args.max_length)

        def _set_signature_columns_if_needed(self):
            super()._set_signature_columns_if_needed()
            self._signature_columns = [*self._signature_columns, "chosen_mask", "rejected_mask"]

    return EpisodeDPOTrainer


def _check_pairs(pairs: list[dict[str, Any]]) -> bool:
    """Raise on a malformed pair; True when the pairs are agent episodes (lists of messages), False for text."""
    if not pairs:
        raise ValueError("train_dpo: no pairs")
    episodes = isinstance(pairs[0].get("chosen"), list)
    if episodes:
        for i, p in enumerate(pairs):
            bad = [k for k in EPISODE_PAIR_KEYS if not isinstance(p.get(k), list) or not p[k]]
            if bad:
                raise ValueError(f"train_dpo: pairs[{i}] has missing or empty {bad}; an episode pair is "
                                 "{'chosen': messages, 'rejected': messages}")
        return True
    for i, p in enumerate(pairs):
        missing = [k for k in PAIR_KEYS if k not in p]
        if missing:
            raise ValueError(f"train_dpo: pairs[{i}] is missing {missing}; each pair needs {list(PAIR_KEYS)}")
        bad = [k for k in PAIR_KEYS if not isinstance(p[k], str) or not p[k]]
        if bad:
            raise ValueError(f"train_dpo: pairs[{i}] has empty or non-string {bad}")
    return False


def _same_path(a: str, b: str) -> bool:
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    if pa.exists() and pb.exists():
        return pa.resolve() == pb.resolve()
    return a == b


def _last(history: list[dict[str, float]], key: str) -> float:
    values = [float(h[key]) for h in history if key in h]
    return values[-1] if values else math.nan
