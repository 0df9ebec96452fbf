"""Reward models: a process reward model (`prm`), an outcome reward model (`orm`) and the implicit PRM
(`implicit`, policy/reference log-ratio, no training). Each scorer returns plain `list[float]`s.

    from components.rewards.prm import PRMScorer, aggregate, train_prm
    from components.rewards.orm import ORMScorer, train_orm
    from components.rewards.implicit import implicit_step_rewards

The helpers below are shared by the three; they import torch lazily so `import components.rewards`
stays cheap.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def pad_right(seqs: list[list[int]], pad_id: int):
    """(input_ids, attention_mask) tensors. Right padding keeps every real token at its own position,
    and causal attention never lets a real token see the padding after it, so no position_ids fix-up.

    >>> ids, mask = pad_right([[5, 6, 7], [8]], pad_id=0)
    >>> ids.tolist(), mask.tolist()
    ([[5, 6, 7], [8, 0, 0]], [[1, 1, 1], [1, 0, 0]])
    """
    import torch

    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids, mask


def token_logprobs(logits: Any, input_ids: Any) -> Any:
    """log p(token t | tokens < t) for t >= 1, at index t - 1: (batch, length - 1), in float32."""
    return logits[:, :-1].float().log_softmax(-1).gather(-1, input_ids[:, 1:, None])[..., 0]


def trainer_kwargs(params: Any, output_dir: str) -> dict[str, Any]:
    """`TrainingArguments` fields common to the PRM and ORM trainers (both are `transformers.Trainer`s)."""
    return dict(
        output_dir=output_dir, max_steps=params.max_steps, per_device_train_batch_size=params.batch_size,
        learning_rate=params.learning_rate, lr_scheduler_type="cosine",
        warmup_steps=int(params.warmup_ratio * params.max_steps), weight_decay=params.weight_decay,
        logging_steps=params.logging_steps, save_strategy="no", report_to="none", use_cpu=device() == "cpu",
        seed=params.seed, data_seed=params.seed, dataloader_num_workers=0, disable_tqdm=True, bf16=False, fp16=False,
    )


def losses(log_history: list[dict[str, Any]]) -> list[float]:
    return [float(h["loss"]) for h in log_history if "loss" in h]


def save_checkpoint(model: Any, tok: Any, out_dir: str | Path) -> None:
    """Weights (safetensors: transformers 5 writes nothing else), config and tokenizer; refuses pickles."""
    out = Path(out_dir)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    bad = [p.name for p in out.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl")]
    if bad:
        raise RuntimeError(f"{out}: refusing pickled checkpoint files {bad}; safetensors only")
