"""Supervised fine-tuning of the policy with TRL's SFTTrainer.

    metrics = train_sft("workdir/.../model", [{"prompt": "3+4\\n", "completion": "3+4=7\\n#### 7\\n"}],
                        "out/model", SFTParams(max_steps=300))

Prompt-completion data: the loss is on the completion only, and every completion ends with EOS so
the model learns to stop. `max_steps * batch_size` may exceed the data: the Trainer then runs more
epochs, reshuffled each epoch from the seed. The saved model is weights (safetensors), config,
generation config and tokenizer; no pickles. On CPU two runs with the same seed and data give a
byte-identical model.safetensors.

A real model: `prompt_format="chat"` renders each prompt with the tokenizer's chat template
(`models.prompts.render_prompt`, as generation does), and the template's turn terminator ("<|im_end|>"
for ChatML) becomes the EOS every completion ends with; the saved tokenizer, config and generation
config carry it, as Qwen2.5-Instruct's do, so generation stops where training taught it to. Examples
over `max_length` tokens are counted before training (`common.check_truncation`). `dtype`, gradient
accumulation and checkpointing, and LoRA (`lora.LoraParams`) are settings; the defaults train fp32
weights in full on raw prompts, as before they existed.
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
from components.training.common import (ProgressCallback, TruncationError, check_dtype, check_fsdp, check_schedule,
                                        check_truncation, keep_safetensors_only, load_for_training,
                                        load_policy_to_train, process_batch, processes_metric, quiet_datasets,
                                        save_trained, token_lengths)
from components.training.lora import LoraParams, lora_config, save_lora

__all__ = ["ProgressCallback", "SFTParams", "TruncationError", "check_schedule", "load_for_training", "train_sft"]


@dataclass
class SFTParams:
    max_steps: int = 300
    batch_size: int = 64                # examples per forward pass (all processes'); a step sees this x accumulation
    learning_rate: float = 1e-3
    warmup_ratio: float = 0.05          # fraction of max_steps spent ramping the LR up linearly
    weight_decay: float = 0.0
    lr_scheduler: str = "cosine"        # any transformers SchedulerType, e.g. "constant", "linear"
    seed: int = 0                       # model init of new heads, dropout and data order
    logging_steps: int = 50             # loss is logged (and progress_callback called) this often
    max_length: int | None = 256        # tokens of prompt + completion; longer examples are cut, and counted
    max_truncated_fraction: float = 0.0  # the share of examples allowed over max_length before TruncationError
    setting: str = "train_policy"       # the config section that errors name, e.g. "train_policy.max_length"
    prompt_format: PromptFormat = RAW   # raw, or chat: the tokenizer's template, completions end at its turn end
    dtype: str = "float32"              # weights trained and saved: float32, bfloat16, float16 (CUDA, LoRA), auto
    gradient_accumulation_steps: int = 1  # forward passes per optimizer step
    gradient_checkpointing: bool = False  # recompute activations in backward: less memory, ~20% slower
    lora: LoraParams | None = None      # train LoRA adapters instead of every weight
    num_threads: int | None = None      # torch intra-op threads (process-wide); None leaves the setting alone
    use_cpu: bool | None = None         # None: CPU exactly when no CUDA device exists
    bf16: bool = False                  # GPU mixed precision
    full_determinism: bool = False      # GPU bitwise reproducibility (slower); CPU is deterministic already

    def __post_init__(self) -> None:
        self.prompt_format = PromptFormat.of(self.prompt_format)
        self.lora = LoraParams.of(self.lora)
        check_schedule(self)
        check_dtype(self.dtype, lora=self.lora is not None, use_cpu=self.use_cpu, where=type(self).__name__)


def train_sft(model_path: str, examples: list[dict[str, Any]], out_dir: str, params: SFTParams,
              progress_callback: ProgressCallback | None = None) -> dict[str, Any]:
    """Fine-tune the model at `model_path` on {"prompt", "completion"} examples, or on agent episodes
    ({"messages"}: chat messages, an assistant's with its sampled `token_ids`), trained on the assistant's tokens
    alone; save it to `out_dir`.

    Returns train_loss (mean over all steps), first_loss / final_loss (first and last logged),
    steps, tokens_seen (non-padding tokens fed, prompts included), runtime_s, tokens_per_s, and
    truncated / truncated_fraction (examples longer than max_length, counted before training).
    """
    import datasets
    import torch
    from transformers import PrinterCallback, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    if not examples:
        raise ValueError("train_sft: no examples")
    check_fsdp(params.setting, **{"policy.lora": params.lora is not None})
    model, tok, use_cpu = load_policy_to_train(model_path, params)
    if "messages" in examples[0]:
        rows = _episode_rows(tok, model_path, examples, params)
        lengths = [len(r["input_ids"]) for r in rows]
    else:
        fmt = params.prompt_format
        # TRL appends EOS to completions too; doing it here keeps the contract if that default changes.
        eos = tok.eos_token
        rows = [{"prompt": render_prompt(tok, e["prompt"], fmt),
                 "completion": e["completion"] + ("" if e["completion"].endswith(eos) else eos)} for e in examples]
        lengths = token_lengths(tok, [r["prompt"] + r["completion"] for r in rows])
    truncation = check_truncation(lengths, params.max_length, params.max_truncated_fraction, params.setting)
    ds = datasets.Dataset.from_list(rows)
    peft_config = lora_config(params.lora, model, f"{params.setting}.lora") if params.lora else None
    losses: list[float] = []

    class _Progress(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))
                if progress_callback is not None:
                    progress_callback(state.global_step, state.max_steps, float(logs["loss"]))

    with tempfile.TemporaryDirectory(prefix="coevo-sft-") as scratch:
        # TRL 1.16 still sets the renamed `gradient_checkpointing`, and peft reads `is_gradient_checkpointing`;
        # TRL's dataset.map progress bars would flood the stage log.
        with warnings.catch_warnings(), quiet_datasets():
            warnings.filterwarnings("ignore", message=".*gradient_checkpointing.*", category=FutureWarning)
            args = _sft_config(SFTConfig, scratch, params, use_cpu, fp16=model.dtype == torch.float16)
            trainer = SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok,
                                 callbacks=[_Progress()], peft_config=peft_config)
        trainer.remove_callback(PrinterCallback)  # it prints every log dict; progress_callback reports instead
        t0 = time.perf_counter()
        with warnings.catch_warnings():  # peft and checkpointing call renamed `*gradient_checkpointing*` methods
            warnings.filterwarnings("ignore", message=".*gradient_checkpointing.*", category=FutureWarning)
            result = trainer.train()
        runtime = time.perf_counter() - t0
        tokens_seen = int(trainer.state.num_input_tokens_seen)
        out = Path(out_dir)
        tok.padding_side = "left"  # saved for generation
        if params.lora:
            save_trained(trainer, out, lambda: save_lora(trainer.accelerator.unwrap_model(trainer.model), tok, out,
                                                         params.lora, base=model_path))
        else:
            save_trained(trainer, out, lambda: trainer.save_model(str(out)), tok)
    if trainer.accelerator.is_main_process:  # the only one that wrote
        keep_safetensors_only(out)
    return {
        "train_loss": float(result.training_loss),
        "first_loss": losses[0] if losses else math.nan, "final_loss": losses[-1] if losses else math.nan,
        "steps": int(result.global_step), "tokens_seen": tokens_seen, "runtime_s": runtime,
        "tokens_per_s": tokens_seen / max(runtime, 1e-9), **truncation, **processes_metric(trainer),
    }


def _episode_rows(tok: Any, model_path: str, examples: list[dict[str, Any]], params: SFTParams) -> list[dict[str, Any]]:
    """Episodes ({"messages"}) as TRL's pre-tokenized rows: the conversation's ids, append-only as the agent loop
    sampled them, and `assistant_masks`, so the loss falls on the assistant's tokens alone (observations, tool
    results and the template's headers are masked out)."""
    from components.envs.agent import ChatEncoder

    if params.prompt_format.kind != "chat":
        raise ValueError(f"{params.setting}: episodes train with the chat template: set policy.prompt_format=chat")
    enc = ChatEncoder(tok, model_path)
    rows = []
    for i, e in enumerate(examples):
        ids, mask = enc.encode(e["messages"], add_generation_prompt=False)
        if not any(mask):
            raise ValueError(f"{params.setting}: example {i} has no assistant turn to train on")
        rows.append({"input_ids": ids, "assistant_masks": mask})
    return rows


def _sft_config(SFTConfig, output_dir: str, params: SFTParams, use_cpu: bool, fp16: bool):
    return SFTConfig(
        output_dir=output_dir,  # scratch: with save_strategy="no" nothing lands there
        max_steps=params.max_steps,  # each of N processes (`accelerate launch`) takes 1/N of every batch
        per_device_train_batch_size=process_batch(params.batch_size, f"{params.setting}.batch_size", params.setting),
        gradient_accumulation_steps=params.gradient_accumulation_steps,
        learning_rate=params.learning_rate, lr_scheduler_type=params.lr_scheduler,
        warmup_steps=params.warmup_ratio,  # transformers 5 dropped warmup_ratio: a float < 1 is a ratio
        weight_decay=params.weight_decay, seed=params.seed, data_seed=params.seed,
        full_determinism=params.full_determinism, use_cpu=use_cpu, bf16=params.bf16,
        fp16=fp16,  # fp16 weights (LoRA only) need loss scaling: the Trainer's fp16 mode brings its scaler
        logging_steps=params.logging_steps, logging_first_step=True, disable_tqdm=True, report_to="none",
        save_strategy="no", dataloader_num_workers=0, dataloader_pin_memory=not use_cpu,
        include_num_input_tokens_seen="non_padding",
        max_length=params.max_length, packing=False, completion_only_loss=True,
        # SFTConfig turns activation checkpointing on by default: off unless asked, as recomputing activations
        # only slows a small model (18% measured on the micro policy), and the trained bytes are the same.
        activation_checkpointing=params.gradient_checkpointing,
    )
