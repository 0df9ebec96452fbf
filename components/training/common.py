"""What every trainer here shares (SFT, DPO, the reward models): schedule checks, the load dtype, counted
truncation, the chat turn end as EOS, loading and saving, and training on several processes.

    dtype = check_dtype("bfloat16", lora=False, use_cpu=True, where="SFTParams")
    model, tok = load_for_training("workdir/.../model", num_threads=1, dtype="bfloat16")
    lengths = token_lengths(tok, texts)
    metrics = check_truncation(lengths, 256, 0.0, "train_policy")   # raises TruncationError past the fraction

Truncation is never silent: a trainer tokenizes each example exactly as TRL will, before training, counts
those longer than `max_length`, returns the count as `truncated` / `truncated_fraction`, and fails with
`TruncationError` when more than `max_truncated_fraction` of them would be cut, naming the config key to
change (`setting` is the caller's config section, e.g. "train_policy").
"""

from __future__ import annotations

import atexit
import contextlib
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ProgressCallback = Callable[[int, int, float], None]  # (step, max_steps, loss)

DTYPES = ("float32", "bfloat16", "float16", "auto")


class TruncationError(ValueError):
    """More examples (or prompts) exceed a length limit than the settings allow."""


def check_schedule(params: Any) -> None:
    """The checks every trainer's params share (SFTParams, DPOParams): steps, batch, logging, warmup, LR,
    accumulation and the truncation allowance."""
    name = type(params).__name__
    if params.max_steps < 1 or params.batch_size < 1 or params.logging_steps < 1:
        raise ValueError(f"{name}: max_steps, batch_size and logging_steps must be >= 1")
    if not 0 <= params.warmup_ratio < 1:
        raise ValueError(f"{name}.warmup_ratio must be in [0, 1), got {params.warmup_ratio}")
    if params.learning_rate <= 0:
        raise ValueError(f"{name}.learning_rate must be > 0, got {params.learning_rate}")
    # getattr: params of a trainer without these settings (a reward model's) pass the shared checks too
    if getattr(params, "gradient_accumulation_steps", 1) < 1:
        raise ValueError(f"{name}.gradient_accumulation_steps must be >= 1, got {params.gradient_accumulation_steps}")
    if not 0 <= getattr(params, "max_truncated_fraction", 0.0) <= 1:
        raise ValueError(f"{name}.max_truncated_fraction must be in [0, 1], got {params.max_truncated_fraction}")
    max_length = getattr(params, "max_length", None)
    if max_length is not None and max_length < 2:
        raise ValueError(f"{name}.max_length must be >= 2 tokens or None, got {max_length}")


# -- dtype -------------------------------------------------------------------------------------

def check_dtype(dtype: str, *, lora: bool, use_cpu: bool | None, where: str) -> None:
    """Refuse at build time what cannot train: an unknown name, fp16 on CPU, fp16 weights fully fine-tuned.

    fp16 needs loss scaling, and the Trainer's scaler cannot unscale fp16 gradients: only LoRA, whose
    adapters peft keeps in fp32 over a frozen fp16 base, trains under it.

    >>> check_dtype("float16", lora=False, use_cpu=False, where="SFTParams")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: SFTParams.dtype float16 trains only LoRA adapters (...); use bfloat16, or set lora
    """
    if dtype not in DTYPES:
        raise ValueError(f"{where}.dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    if dtype == "float16":
        if use_cpu:
            raise ValueError(f"{where}.dtype float16 needs a CUDA device; on CPU use bfloat16 or float32")
        if not lora:
            raise ValueError(f"{where}.dtype float16 trains only LoRA adapters (fp16 weights cannot be loss-scaled); "
                             "use bfloat16, or set lora")


def torch_dtype(dtype: str | None):
    """torch dtype for a DTYPES name; None means float32 (CPU-safe), "auto" the checkpoint's own."""
    import torch

    if dtype is None:
        return torch.float32
    if dtype == "auto":
        return "auto"
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    return getattr(torch, dtype)


def check_loaded_dtype(model: Any, *, lora: bool, use_cpu: bool, where: str) -> None:
    """After loading with dtype "auto": the checkpoint's own dtype must pass the same rules as a named one."""
    name = str(model.dtype).removeprefix("torch.")
    if name == "float16":
        try:
            check_dtype(name, lora=lora, use_cpu=use_cpu, where=where)
        except ValueError as e:
            raise ValueError(f"{e} (dtype auto took the checkpoint's float16)") from None


# -- loading -------------------------------------------------------------------------------------

def load_for_training(model_path: str, num_threads: int | None, dtype: str = "float32"):
    """(model in `dtype`, tokenizer with a pad token) to train from; sets torch's threads when asked.

    A LoRA adapter folder (adapter_config.json) loads as its base with the adapter merged in.
    """
    import torch
    from transformers import AutoTokenizer

    from components.training.lora import load_causal_lm

    if num_threads is not None:
        torch.set_num_threads(num_threads)
    tok = AutoTokenizer.from_pretrained(model_path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return load_causal_lm(model_path, torch_dtype(dtype)), tok


def load_policy_to_train(model_path: str, params: Any):
    """(model, tokenizer, use_cpu) for a policy trainer (SFTParams, DPOParams): the device and dtype checked
    before and after loading, the prompt format checked against the tokenizer, and under `chat` the
    template's turn end made the EOS completions end with, so generation stops where training taught it."""
    import torch

    from components.models.prompts import chat_turn_end, check_prompt_format

    where, lora = type(params).__name__, params.lora is not None
    use_cpu = not torch.cuda.is_available() if params.use_cpu is None else params.use_cpu
    check_dtype(params.dtype, lora=lora, use_cpu=use_cpu, where=where)
    model, tok = load_for_training(model_path, params.num_threads, params.dtype)
    check_loaded_dtype(model, lora=lora, use_cpu=use_cpu, where=where)
    check_prompt_format(tok, params.prompt_format, model_path)
    if params.prompt_format.kind == "chat":
        use_turn_end_as_eos(model, tok, chat_turn_end(tok, model_path))
    return model, tok, use_cpu


@contextlib.contextmanager
def quiet_datasets():
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


def keep_safetensors_only(out: Path) -> None:
    """Trainer.save_model also pickles the TrainingArguments (training_args.bin): drop it, then refuse
    any other pickle, so a checkpoint can be loaded without unpickling code."""
    (out / "training_args.bin").unlink(missing_ok=True)
    pickles = [p.name for p in out.rglob("*") if p.suffix in (".bin", ".pt", ".pth", ".pkl")]
    if pickles:
        raise RuntimeError(f"{out}: refusing pickled checkpoint files {pickles}; safetensors only")
    if not any(out.glob("*.safetensors")):
        raise RuntimeError(f"{out}: no safetensors weights were written")


# -- several processes (`accelerate launch`) -------------------------------------------------------
#
# A training stage with `processes: N` runs N copies of its job (components/jobs/launch.py). The Trainer
# finds torchrun's environment and trains under DDP (or FSDP); each process takes batch / N examples of
# every global batch, so the run steps on the batches one process would, and only the main process saves.

def training_processes() -> int:
    """Processes training together: torchrun's WORLD_SIZE under `accelerate launch`, else 1."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def leave_process_group() -> None:
    """Destroy the process group the Trainer's accelerator joined, where one is up (accelerate's own
    `end_training` step, which no Trainer calls). A process that exits inside its group can abort (SIGABRT,
    "terminate called without an active exception") while the interpreter finalizes: gloo's worker threads
    still hold work whose tensors reference Python objects (pytorch/pytorch#179291). It failed a 2-process job
    once in CI, after the job had written everything; 28 runs of that job here did not repeat it."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# One group serves every trainer a process runs (a stage may train several models), so it is left once, at
# exit, before the interpreter starts to finalize.
if training_processes() > 1:
    atexit.register(leave_process_group)


def process_batch(batch_size: int, name: str, section: str) -> int:
    """`per_device_train_batch_size` for a global batch of `batch_size`: its share in each process. `name` is the
    batch's setting and `section` the config section whose `processes` runs it, for the error.

    >>> process_batch(64, "train_policy.batch_size", "train_policy")
    64
    """
    n = training_processes()
    if batch_size % n:
        raise ValueError(f"{name}={batch_size} does not split over {section.split('.')[0]}.processes={n} "
                         "training processes: set processes to a divisor of it")
    return batch_size // n


def check_fsdp(setting: str, **unsupported: bool) -> None:
    """Under FSDP (`strategy: fsdp`) every process holds a shard of the weights, and only the full weights are
    gathered to save: refuse what needs the model whole afterwards (a LoRA merge, the likelihood PRM's
    calibration), naming each setting that asks for it."""
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
        return
    bad = [name for name, on in unsupported.items() if on]
    if bad:
        raise ValueError(f"{setting.split('.')[0]}.strategy=fsdp saves full fine-tuned weights only, not with "
                         f"{', '.join(bad)}: use strategy=ddp")


def processes_metric(trainer: Any) -> dict[str, int]:
    """{"processes": N} where N > 1 processes trained, for a trainer's metrics; {} for one, whose metrics stay
    as they were."""
    n = trainer.accelerator.num_processes
    return {"processes": n} if n > 1 else {}


def save_trained(trainer: Any, out_dir: str | Path, save: Callable[[], None], tok: Any = None) -> None:
    """Write what `trainer` trained to `out_dir` once. One process: `save()`, as ever. Under DDP every process
    holds the same weights and the main one calls `save()`. Under FSDP each holds a shard: `save_model` gathers
    the full state dict (a collective every process joins) and the main process writes it, `tok` beside it.
    Every process then waits for the write."""
    acc = trainer.accelerator
    if acc.num_processes == 1:
        save()
        return
    if trainer.is_fsdp_enabled:
        trainer.save_model(str(out_dir))
        if acc.is_main_process:
            (Path(out_dir) / "training_args.bin").unlink(missing_ok=True)  # save_model pickles the arguments too
            if tok is not None:
                tok.save_pretrained(out_dir)
    elif acc.is_main_process:
        save()
    acc.wait_for_everyone()


# -- chat turn end -------------------------------------------------------------------------------

def use_turn_end_as_eos(model: Any, tok: Any, turn_end: str) -> None:
    """Make the chat template's turn terminator the EOS that completions end with, as Qwen2.5-Instruct ships:
    tokenizer.eos_token and config.eos_token_id become it, and generation_config.eos_token_id keeps the
    old EOS beside it. TRL's SFTConfig.eos_token does the same for SFT; DPOConfig has no such field, so
    both trainers call this one function before building the trainer."""
    if tok.eos_token == turn_end:
        return
    tok.eos_token = turn_end
    model.config.get_text_config().eos_token_id = tok.eos_token_id
    eos = model.generation_config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    if tok.eos_token_id not in eos:
        model.generation_config.eos_token_id = [tok.eos_token_id, *eos]


# -- counted truncation --------------------------------------------------------------------------

def token_lengths(tok: Any, texts: Sequence[str]) -> list[int]:
    """Token counts as TRL tokenizes a plain-text example: the tokenizer's own call, special tokens added."""
    return [len(ids) for ids in tok(list(texts))["input_ids"]] if texts else []


def check_truncation(lengths: Sequence[int], limit: int | None, max_fraction: float, setting: str,
                     key: str = "max_length", noun: str = "examples") -> dict[str, float]:
    """{"truncated", "truncated_fraction"} of `lengths` over `limit`; TruncationError past `max_fraction`.

    >>> check_truncation([3, 9, 4], 8, 0.5, "train_policy")
    {'truncated': 1, 'truncated_fraction': 0.3333333333333333}
    >>> check_truncation([3, 9, 4], 8, 0.0, "train_policy")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    components.training.common.TruncationError: 1 of 3 examples (33.3%) exceed train_policy.max_length=8 tokens; ...
    """
    n = sum(length > limit for length in lengths) if limit is not None else 0
    fraction = n / len(lengths) if lengths else 0.0
    if fraction > max_fraction:
        raise TruncationError(
            f"{n} of {len(lengths)} {noun} ({100 * fraction:.1f}%) exceed {setting}.{key}={limit} tokens; raise "
            f"{setting}.{key} or allow it with {setting}.max_truncated_fraction (now {max_fraction})")
    return {"truncated": n, "truncated_fraction": fraction}
