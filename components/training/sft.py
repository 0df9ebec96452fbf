"""Supervised fine-tuning of the policy on selected trajectories, with TRL's SFTTrainer.

    metrics = train_sft("workdir/.../model", [{"prompt": "3+4\\n", "completion": "3+4=7\\n#### 7\\n"}],
                        "out/model", SFTParams(max_steps=300))

Prompt-completion data: the loss is on the completion only, and TRL appends EOS to it, so the
model learns to stop. Checkpoints are safetensors only.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class SFTParams:
    max_steps: int = 300
    batch_size: int = 64
    learning_rate: float = 1e-3
    warmup_ratio: float = 0.05          # of max_steps
    weight_decay: float = 0.0
    lr_scheduler: str = "cosine"
    seed: int = 0
    logging_steps: int = 25
    max_length: int = 256               # tokens; longer examples are truncated


def train_sft(model_path: str, examples: list[dict[str, str]], out_dir: str, params: SFTParams,
              progress_callback: Callable[[int, int, float | None], None] | None = None) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    if not examples:
        raise ValueError("train_sft: no examples")
    tok = AutoTokenizer.from_pretrained(model_path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "right"
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    ds = Dataset.from_list([{"prompt": e["prompt"], "completion": e["completion"]} for e in examples])
    args = _sft_config(SFTConfig, out_dir, params)
    losses: list[float] = []

    class _Progress(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            loss = (logs or {}).get("loss")
            if loss is not None:
                losses.append(float(loss))
            if progress_callback and loss is not None:
                progress_callback(state.global_step, state.max_steps, loss)

    trainer = SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok, callbacks=[_Progress()])
    t0 = time.perf_counter()
    out = trainer.train()
    runtime = time.perf_counter() - t0
    tok.padding_side = "left"
    trainer.save_model(out_dir)
    tok.save_pretrained(out_dir)
    _drop_trainer_files(Path(out_dir))
    n_tokens = sum(len(tok(e["prompt"] + e["completion"], add_special_tokens=False)["input_ids"]) + 1
                   for e in examples)
    mean_len = n_tokens / len(examples)
    return {
        "train_loss": float(out.training_loss), "final_loss": losses[-1] if losses else math.nan,
        "first_loss": losses[0] if losses else math.nan, "steps": int(out.global_step), "runtime_s": runtime,
        "tokens_seen": int(mean_len * params.batch_size * out.global_step),
        "tokens_per_s": mean_len * params.batch_size * out.global_step / max(runtime, 1e-9),
    }


def _sft_config(SFTConfig, out_dir: str, params: SFTParams):
    return SFTConfig(
        output_dir=str(Path(out_dir) / ".trainer"), max_steps=params.max_steps,
        per_device_train_batch_size=params.batch_size, learning_rate=params.learning_rate,
        lr_scheduler_type=params.lr_scheduler, warmup_steps=max(0, int(params.warmup_ratio * params.max_steps)),
        weight_decay=params.weight_decay, logging_steps=params.logging_steps, save_strategy="no", report_to="none",
        use_cpu=True, seed=params.seed, data_seed=params.seed, dataloader_num_workers=0, disable_tqdm=True,
        max_length=params.max_length, packing=False, completion_only_loss=True, bf16=False, fp16=False,
    )


def _drop_trainer_files(out: Path) -> None:
    """Keep only what loading needs: weights (safetensors), config, tokenizer. No pickled training args."""
    import shutil

    shutil.rmtree(out / ".trainer", ignore_errors=True)
    for f in ("training_args.bin",):
        (out / f).unlink(missing_ok=True)
    bad = [p.name for p in out.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl")]
    if bad:
        raise RuntimeError(f"{out}: refusing pickled checkpoint files {bad}; safetensors only")
