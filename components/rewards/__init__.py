"""Reward models: a process reward model (`prm`, two heads), an outcome reward model (`orm`), the implicit PRM
(`implicit`, policy/reference log-ratio, no training) and the sampler's confidence (`confidence`, its least likely
token a step, no training), behind one protocol, `RewardModel`.

    rm = load_reward_model("prm", "workdir/.../r1/train_reward/a1/prm", separator=domain.step_separator)
    rm.score(prompts, completions, steps)    # one list per trajectory: a score per step (or one, for an ORM)

A new reward model is one class with `name`, `granularity` and `score`, named in the config by dotted
path (`score.reward_model: my_pkg.rewards:LengthPenalty`); `load_reward_model` builds it with the
model URI (None for one that trains nothing) and the domain's step separator. The helpers below are
shared by the built-in ones; they import torch lazily so `import components.rewards` stays cheap.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from components.instantiate import locate

# Built-in reward models by config name; anything else is a dotted path 'pkg.module:Class'.
REWARD_MODELS: dict[str, str] = {
    "prm": "components.rewards.prm:PRMScorer",
    "orm": "components.rewards.orm:ORMScorer",
    "implicit": "components.rewards.implicit:ImplicitPRM",
    "confidence": "components.rewards.confidence:SamplerConfidence",
}
# Those trained by the `train_reward` stage, under their role in the `models` table.
TRAINED = ("prm", "orm")


@runtime_checkable
class RewardModel(Protocol):
    name: str  # the `scorer` column of its `scores` rows
    granularity: Literal["step", "outcome"]  # a score per step (min/last/mean aggregates follow) or per trajectory

    def score(self, prompts: list[str], completions: list[str], steps: list[list[str]]) -> list[list[float]]:
        """Per trajectory: one score per step of `steps` ('step'), or a list of one ('outcome')."""
        ...


def load_reward_model(name: str, uri: str | None = None, *, separator: str = "\n", reference_uri: str | None = None,
                      beta: float = 0.05, prompt_format: Any = None, dtype: str = "float32",
                      max_length: int | None = None) -> RewardModel:
    """Build a reward model by config name or dotted path. `uri` is its checkpoint (the policy, for the
    implicit PRM, scored against `reference_uri`); `separator` is the domain's step separator. The built-in
    ones read prompts rendered as the policy's (`prompt_format`), in `dtype`, cut to `max_length` tokens
    (counted in `.truncated`); a user's model is built with `uri` and `separator` only."""
    if name == "implicit":
        return locate(REWARD_MODELS[name])(uri, reference_uri, beta=beta, separator=separator,
                                           prompt_format=prompt_format)
    if name in REWARD_MODELS:
        return locate(REWARD_MODELS[name])(uri, separator=separator, prompt_format=prompt_format, dtype=dtype,
                                           max_length=max_length)
    if ":" not in name:
        raise ValueError(f"unknown reward model {name!r}: known ones are {sorted(REWARD_MODELS)}, or give a dotted "
                         "path 'pkg.module:Class'")
    protocol = (f"reward model {name!r} does not follow components.rewards.RewardModel: it is built as "
                "Class(uri=..., separator=...) and has `name`, `granularity` ('step' or 'outcome') and "
                "`score(prompts, completions, steps)`")
    try:
        rm = locate(name)(uri=uri, separator=separator)
    except TypeError as e:
        raise ValueError(f"{protocol} ({e})") from None
    if not isinstance(rm, RewardModel) or rm.granularity not in ("step", "outcome"):
        raise ValueError(protocol)
    return rm


def score_rows(rm: RewardModel, model_id: str | None, trajectories: list[dict[str, Any]],
               steps: dict[str, list[str]], episodes: dict[str, list[dict[str, Any]]] | None = None
               ) -> list[dict[str, Any]]:
    """`scores` rows of a reward model over trajectories: every step plus min/last/mean, or one per trajectory.
    `episodes` (an environment's conversations by trajectory id, as sampled) go to a model that reads the sampled
    tokens themselves (`score_episodes`: the implicit PRM); a model that reads text gets the steps."""
    from components.scoring import step_score_rows, trajectory_score_rows

    tids = [t["trajectory_id"] for t in trajectories]
    if episodes is not None and hasattr(rm, "score_episodes"):
        values = rm.score_episodes([episodes[t] for t in tids])
    else:
        values = rm.score([t["prompt"] for t in trajectories], [t["completion"] for t in trajectories],
                          [steps.get(t, []) for t in tids])
    if rm.granularity == "outcome":
        return trajectory_score_rows(tids, [v[0] for v in values], rm.name, model_id)
    return step_score_rows(tids, values, rm.name, model_id)


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


def sequence_logprobs(model: Any, ids: list[list[int]], pad_id: int, dev: str, batch_size: int) -> list[Any]:
    """Per sequence, `token_logprobs` under `model`: a float32 CPU tensor of len - 1, token t's at index t - 1.
    Batched by length and right-padded, so a batch pads little."""
    import torch

    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    out: dict[int, Any] = {}
    for b in range(0, len(order), batch_size):
        idx = order[b:b + batch_size]
        x, mask = pad_right([ids[i] for i in idx], pad_id)
        x, mask = x.to(dev), mask.to(dev)
        with torch.inference_mode():
            lp = token_logprobs(model(input_ids=x, attention_mask=mask).logits, x).cpu()
        out |= {i: lp[row, : len(ids[i]) - 1] for row, i in enumerate(idx)}
    return [out[i] for i in range(len(ids))]


def episode_turns(tok: Any, path: str, chats: list[list[dict[str, Any]]], where: str
                  ) -> tuple[list[list[int]], list[list[tuple[int, int]]]]:
    """Episodes encoded append-only as they were sampled (`envs.agent.ChatEncoder`), and per episode the token
    span [a, b) of each assistant turn; an episode whose assistant turns do not match its runs of assistant tokens
    is an error naming `where` and the episode."""
    from components.envs.agent import ChatEncoder, assistant_spans

    enc = ChatEncoder(tok, path)
    encoded = [enc.encode(chat, add_generation_prompt=False) for chat in chats]
    spans = []
    for k, (chat, (_, mask)) in enumerate(zip(chats, encoded, strict=True)):
        runs = assistant_spans(mask)
        turns = sum(m["role"] == "assistant" for m in chat)
        if len(runs) != turns:
            raise ValueError(f"{where}: episode {k} has {turns} assistant turns but {len(runs)} runs of assistant "
                             "tokens")
        spans.append(runs)
    return [ids for ids, _ in encoded], spans


def trainer_kwargs(params: Any, output_dir: str) -> dict[str, Any]:
    """`TrainingArguments` fields common to the PRM and ORM trainers (both are `transformers.Trainer`s)."""
    return dict(
        output_dir=output_dir, max_steps=params.max_steps, per_device_train_batch_size=params.batch_size,
        learning_rate=params.learning_rate, lr_scheduler_type="cosine",
        warmup_steps=int(params.warmup_ratio * params.max_steps), weight_decay=params.weight_decay,
        # at least four logged losses, so a short run's first and final loss are not NaN
        logging_steps=min(params.logging_steps, max(params.max_steps // 4, 1)), save_strategy="no", report_to="none",
        use_cpu=device() == "cpu",
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
