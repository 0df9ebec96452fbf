"""Supervised fine-tuning of the policy with TRL's SFTTrainer.

    metrics = train_sft("workdir/.../model", [{"prompt": "3+4\\n", "completion": "3+4=7\\n#### 7\\n"}],
                        "out/model", SFTParams(max_steps=300))

Prompt-completion data: the loss is on the completion only, and every completion ends with EOS so
the model learns to stop. `max_steps * batch_size` may exceed the data: the Trainer then runs more
epochs, reshuffled each epoch from the seed. The saved model is weights (safetensors), config,
generation config and tokenizer; no pickles. On CPU two runs with the same seed and data give a
byte-identical model.safetensors.
"""

from __future__ import annotations

import contextlib
import math
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ProgressCallback = Callable[[int, int, float], None]  # (step, max_steps, loss)


@dataclass
class SFTParams:
    max_steps: int = 300
    batch_size: int = 64
    learning_rate: float = 1e-3
    warmup_ratio: float = 0.05          # fraction of max_steps spent ramping the LR up linearly
    weight_decay: float = 0.0
    lr_scheduler: str = "cosine"        # any transformers SchedulerType, e.g. "constant", "linear"
    seed: int = 0                       # model init of new heads, dropout and data order
    logging_steps: int = 50             # loss is logged (and progress_callback called) this often
    max_length: int | None = 256        # tokens; longer examples are truncated
    num_threads: int | None = None      # torch intra-op threads (process-wide); None leaves the setting alone
    use_cpu: bool | None = None         # None: CPU exactly when no CUDA device exists
    bf16: bool = False                  # GPU mixed precision
    full_determinism: bool = False      # GPU bitwise reproducibility (slower); CPU is deterministic already

    def __post_init__(self) -> None:
        check_schedule(self)


def check_schedule(params: Any) -> None:
    """The checks every trainer's params share (SFTParams, DPOParams): steps, batch, logging, warmup, LR."""
    name = type(params).__name__
    if params.max_steps < 1 or params.batch_size < 1 or params.logging_steps < 1:
        raise ValueError(f"{name}: max_steps, batch_size and logging_steps must be >= 1")
    if not 0 <= params.warmup_ratio < 1:
        raise ValueError(f"{name}.warmup_ratio must be in [0, 1), got {params.warmup_ratio}")
    if params.learning_rate <= 0:
        raise ValueError(f"{name}.learning_rate must be > 0, got {params.learning_rate}")


def train_sft(model_path: str, examples: list[dict[str, str]], out_dir: str, params: SFTParams,
              progress_callback: ProgressCallback | None = None) -> dict[str, Any]:
    """Fine-tune the model at `model_path` on {"prompt", "completion"} examples; save it to `out_dir`.

    Returns train_loss (mean over all steps), first_loss / final_loss (first and last logged),
    steps, tokens_seen (non-padding tokens fed, prompts included), runtime_s and tokens_per_s.
    """
    import datasets
    import torch
    from transformers import PrinterCallback, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    if not examples:
        raise ValueError("train_sft: no examples")
    model, tok = load_for_training(model_path, params.num_threads)
    # TRL appends EOS to completions too; doing it here keeps the contract if that default changes.
    eos = tok.eos_token
    ds = datasets.Dataset.from_list([
        {"prompt": e["prompt"], "completion": e["completion"] + ("" if e["completion"].endswith(eos) else eos)}
        for e in examples])
    use_cpu = not torch.cuda.is_available() if params.use_cpu is None else params.use_cpu
    losses: list[float] = []

    class _Progress(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))
                if progress_callback is not None:
                    progress_callback(state.global_step, state.max_steps, float(logs["loss"]))

    with tempfile.TemporaryDirectory(prefix="coevo-sft-") as scratch:
        with warnings.catch_warnings():  # TRL 1.16 still sets the renamed `gradient_checkpointing`
            warnings.filterwarnings("ignore", message=".*gradient_checkpointing.*", category=FutureWarning)
            args = _sft_config(SFTConfig, scratch, params, use_cpu)
        with _quiet_datasets():  # TRL's dataset.map progress bars would flood the stage log
            trainer = SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok,
                                 callbacks=[_Progress()])
        trainer.remove_callback(PrinterCallback)  # it prints every log dict; progress_callback reports instead
        t0 = time.perf_counter()
        result = trainer.train()
        runtime = time.perf_counter() - t0
        tokens_seen = int(trainer.state.num_input_tokens_seen)
        out = Path(out_dir)
        tok.padding_side = "left"  # saved for generation
        trainer.save_model(str(out))
    _keep_safetensors_only(out)
    return {
        "train_loss": float(result.training_loss),
        "first_loss": losses[0] if losses else math.nan, "final_loss": losses[-1] if losses else math.nan,
        "steps": int(result.global_step), "tokens_seen": tokens_seen, "runtime_s": runtime,
        "tokens_per_s": tokens_seen / max(runtime, 1e-9),
    }


def load_for_training(model_path: str, num_threads: int | None):
    """(model in fp32, tokenizer with a pad token) to train from; sets torch's threads when asked."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if num_threads is not None:
        torch.set_num_threads(num_threads)
    tok = AutoTokenizer.from_pretrained(model_path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32), tok


def _sft_config(SFTConfig, output_dir: str, params: SFTParams, use_cpu: bool):
    return SFTConfig(
        output_dir=output_dir,  # scratch: with save_strategy="no" nothing lands there
        max_steps=params.max_steps, per_device_train_batch_size=params.batch_size,
        learning_rate=params.learning_rate, lr_scheduler_type=params.lr_scheduler,
        warmup_steps=params.warmup_ratio,  # transformers 5 dropped warmup_ratio: a float < 1 is a ratio
        weight_decay=params.weight_decay, seed=params.seed, data_seed=params.seed,
        full_determinism=params.full_determinism, use_cpu=use_cpu, bf16=params.bf16,
        logging_steps=params.logging_steps, logging_first_step=True, disable_tqdm=True, report_to="none",
        save_strategy="no", dataloader_num_workers=0, dataloader_pin_memory=not use_cpu,
        include_num_input_tokens_seen="non_padding",
        max_length=params.max_length, packing=False, completion_only_loss=True,
        # SFTConfig turns activation checkpointing on by default: recomputing activations only slows a small
        # model (18% measured on the micro policy), and the trained bytes are the same either way.
        activation_checkpointing=False,
    )


@contextlib.contextmanager
def _quiet_datasets():
    """Turn datasets' progress bars off for a block, then restore the caller's setting."""
    from datasets.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    if are_progress_bars_disabled():
        yield
        return
    disable_progress_bars()
    try:
        yield
    finally:
        enable_progress_bars()


def _keep_safetensors_only(out: Path) -> None:
    """Trainer.save_model also pickles the TrainingArguments (training_args.bin): drop it, then refuse
    any other pickle, so a checkpoint can be loaded without unpickling code."""
    (out / "training_args.bin").unlink(missing_ok=True)
    pickles = [p.name for p in out.rglob("*") if p.suffix in (".bin", ".pt", ".pth", ".pkl")]
    if pickles:
        raise RuntimeError(f"{out}: refusing pickled checkpoint files {pickles}; safetensors only")
    if not any(out.glob("*.safetensors")):
        raise RuntimeError(f"{out}: no safetensors weights were written")
