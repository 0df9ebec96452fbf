"""Policy-gradient training on a round's stored rollouts with TRL's GRPOTrainer (Shao et al. 2024; DAPO, Dr. GRPO).

    metrics, logprobs = train_grpo("workdir/.../r0/model", None, rollouts, "out/model",
                                   GRPOParams(num_generations=4, groups_per_step=2))

Each rollout is {"trajectory_id", "group_id", "prompt_ids", "completion_ids", "reward", "advantage"} plus, for an
agent's episode, "env_mask" (1 on the tokens the model sampled, 0 on observations), with "advantage" a number or
one per completion token. The rollouts were sampled and scored by the round's earlier stages and are in the
store; nothing is generated here. TRL gets them through its `rollout_func`, in one generation batch that holds
every group, and its loss (`loss_type`, the clip `epsilon`/`epsilon_high`, `beta`'s KL to the reference, the
entropy and clip statistics it logs) is used as it is. Two pieces are ours, each the smallest TRL lacks:

- the advantages are the stored ones (components/rl/advantages.py), swapped in after TRL computes its own from
  the same rewards, so the loss trains on exactly what `advantages` in the store says; the largest gap between
  TRL's and ours is returned (`advantage_gap`; 0 up to float error when no shaping or per-turn credit is set);
- the old log-probabilities TRL's clipped ratio divides by are the policy's at the round's start, computed by
  TRL in that one generation batch, before any update. That policy sampled the rollouts (train_policy
  starts from the policy generate used), so they are the sampler's, as verl recomputes them rather than trusting
  an engine's (vLLM reports log-probabilities before temperature).

With `ptx_weight` > 0, each forward pass also takes the next `ptx_batch_size` of `ptx_examples` (the round-0
demonstrations: already tokenized, `labels` -100 where no loss falls) and adds `ptx_weight` times their mean token
NLL to TRL's loss: InstructGPT's PPO-ptx (Ouyang et al. 2022), a third piece of ours, since GRPOTrainer trains on
its rollouts alone. rft's SFT replays the demonstrations beside a round's samples; this is the same anchor for a
policy-gradient round (docs/grpo.md, "Why"). With `ptx_own` (ptx_pool right_answers), half of each ptx batch is
the round's own right answers instead, those of groups without a learning signal included: self-imitation
(Oh et al. 2018), rft's SFT data beside the policy gradient.

Optimizer step k trains on rollouts k steps stale. Each rollout's summed log-probability under the policy that
sampled it and under the trained one is returned, for the store: what the round's updates moved.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from components.models.prompts import RAW, PromptFormat
from components.training.common import (ProgressCallback, check_dtype, keep_safetensors_only, load_policy_to_train,
                                        quiet_datasets, save_trained)
from components.training.lora import LoraParams, lora_config, save_lora

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo")
LR_SCHEDULERS = ("constant", "cosine", "linear")
DECODE_WINDOW = 8  # step_token_advantages: tokens of context each token is decoded with
KEYS = ("trajectory_id", "group_id", "prompt_ids", "completion_ids", "reward", "advantage")


@dataclass
class GRPOParams:
    num_generations: int                 # the group size: every group has exactly this many rollouts
    groups_per_step: int = 4             # groups per optimizer step (one group per forward pass)
    num_iterations: int = 1              # passes over the round's rollouts (GRPO's mu)
    learning_rate: float = 1e-5
    lr_scheduler: str = "constant"       # constant, or cosine | linear: decayed to 0 over the round's steps
    loss_type: str = "dapo"              # grpo | dr_grpo | dapo | bnpo (TRL's)
    beta: float = 0.0                    # KL to the reference; 0: no reference is loaded
    epsilon: float = 0.2                 # the ratio's clip, low side (and high side without epsilon_high)
    epsilon_high: float | None = None    # DAPO's clip-higher
    temperature: float = 1.0             # the sampler's: log-probabilities are of logits / temperature
    seed: int = 0
    logging_steps: int = 1
    ptx_weight: float = 0.0              # PPO-ptx: the demonstrations' NLL, times this, added to every forward pass
    ptx_batch_size: int = 8              # demonstrations per forward pass (one group's)
    setting: str = "train_policy.grpo"   # the config section errors name
    prompt_format: PromptFormat = RAW
    dtype: str = "float32"
    gradient_checkpointing: bool = False
    lora: LoraParams | None = None
    num_threads: int | None = None
    use_cpu: bool | None = None

    def __post_init__(self) -> None:
        self.prompt_format = PromptFormat.of(self.prompt_format)
        self.lora = LoraParams.of(self.lora)
        where = type(self).__name__
        check_dtype(self.dtype, lora=self.lora is not None, use_cpu=self.use_cpu, where=where)
        if self.num_generations < 2:
            raise ValueError(f"{where}.num_generations must be >= 2: an advantage compares a rollout with its group")
        if self.groups_per_step < 1 or self.num_iterations < 1 or self.logging_steps < 1:
            raise ValueError(f"{where}: groups_per_step, num_iterations and logging_steps must be >= 1")
        if self.lr_scheduler not in LR_SCHEDULERS:
            raise ValueError(f"{where}.lr_scheduler must be one of {', '.join(LR_SCHEDULERS)}; "
                             f"got {self.lr_scheduler!r}")
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"{where}.loss_type must be one of {', '.join(LOSS_TYPES)}; got {self.loss_type!r}")
        if not self.learning_rate > 0 or not self.beta >= 0 or not self.epsilon > 0 or not self.temperature > 0:
            raise ValueError(f"{where}: learning_rate, epsilon and temperature must be > 0 and beta >= 0")
        if not (math.isfinite(self.ptx_weight) and self.ptx_weight >= 0) or self.ptx_batch_size < 1:
            raise ValueError(f"{where}: ptx_weight must be a finite number >= 0 and ptx_batch_size >= 1; got "
                             f"{self.ptx_weight!r} and {self.ptx_batch_size!r}")


class PtxBatches:
    """The examples PPO-ptx adds to each forward pass, `size` at a time, in a seeded order that starts over when
    it runs out. Each example is {"input_ids", "labels"} (-100 where no loss falls), at least one label kept.
    With `own` (ptx_pool right_answers: the round's right answers), half of each batch (rounded up) comes from
    `own` and the rest from `examples` (the demonstrations), each pool in its own order.

    >>> b = PtxBatches([{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}, {"input_ids": [4, 5], "labels": [-100, 5]}],
    ...                size=2, pad_id=0, seed=0)
    >>> ids, mask, labels = b.next()
    >>> ids.tolist(), mask.tolist(), labels.tolist()
    ([[4, 5, 0], [1, 2, 3]], [[1, 1, 0], [1, 1, 1]], [[-100, 5, -100], [-100, 2, 3]])
    >>> b = PtxBatches([{"input_ids": [1, 2], "labels": [-100, 2]}], size=3, pad_id=0,
    ...                own=[{"input_ids": [7, 8], "labels": [-100, 8]}])
    >>> b.next()[0].tolist()
    [[7, 8], [7, 8], [1, 2]]
    >>> PtxBatches([{"input_ids": [1, 2], "labels": [-100, -100]}], size=1, pad_id=0)
    Traceback (most recent call last):
    ValueError: train_grpo: ptx example 0 has no token to train on (every label is -100)
    """

    def __init__(self, examples: list[dict[str, list[int]]], size: int, pad_id: int, seed: int = 0,
                 own: list[dict[str, list[int]]] | None = None):
        import random

        for what, pool in (("ptx example", examples), ("right answer", own or [])):
            for i, e in enumerate(pool):
                if len(e["input_ids"]) != len(e["labels"]):
                    raise ValueError(f"train_grpo: {what} {i} has {len(e['input_ids'])} ids and {len(e['labels'])} "
                                     "labels")
                if all(x == -100 for x in e["labels"]):
                    raise ValueError(f"train_grpo: {what} {i} has no token to train on (every label is -100)")
        if not examples:
            raise ValueError("train_grpo: ptx_weight > 0 needs ptx examples (the demonstrations); got none")
        self.examples, self.own, self.size, self.pad_id = examples, own or [], size, pad_id
        # (pool, examples of it per batch); a round without right answers trains on the demonstrations alone
        self.take = [(self.own, size - size // 2), (examples, size // 2)] if self.own else [(examples, size)]
        self.rng, self.orders = random.Random(seed), [[] for _ in self.take]

    def next(self):
        from components.rewards import pad_right

        chunk = []
        for (pool, n), order in zip(self.take, self.orders, strict=True):
            for _ in range(n):
                if not order:
                    order.extend(range(len(pool)))
                    self.rng.shuffle(order)
                chunk.append(pool[order.pop()])
        ids, mask = pad_right([e["input_ids"] for e in chunk], self.pad_id)
        labels, _ = pad_right([e["labels"] for e in chunk], -100)
        return ids, mask, labels


def text_ptx_examples(encoder: Any, rows: list[dict[str, str]]) -> list[dict[str, list[int]]]:
    """PPO-ptx examples from {"prompt", "completion"} rows (a text domain's demonstrations): the prompt as the
    policy's PromptEncoder renders it for sampling, then the completion and the first end-of-sequence id, with
    the loss on the completion's tokens alone, as SFT puts it."""
    prompt_ids = encoder.encode([r["prompt"] for r in rows])
    out = []
    for r, p in zip(rows, prompt_ids, strict=True):
        c = encoder.tok(r["completion"], add_special_tokens=False)["input_ids"] + encoder.eos_ids[:1]
        out.append({"input_ids": list(p) + c, "labels": [-100] * len(p) + c})
    return out


def check_rollouts(rollouts: list[dict[str, Any]], group_size: int) -> dict[str, list[dict[str, Any]]]:
    """The rollouts by group, in order; refuses a missing key, an empty completion, a reward or advantage that is
    not finite, an advantage list of the wrong length, and a group of the wrong size, naming the rollout.

    >>> r = {"group_id": "g", "prompt_ids": [1], "completion_ids": [2, 3], "reward": 1.0, "advantage": 0.5}
    >>> sorted(check_rollouts([r | {"trajectory_id": "a"}, r | {"trajectory_id": "b"}], 2))
    ['g']
    >>> check_rollouts([r | {"trajectory_id": "a", "advantage": float("nan")}], 1)
    Traceback (most recent call last):
    ValueError: train_grpo: rollout a has advantage nan, expected a finite number
    """
    if not rollouts:
        raise ValueError("train_grpo: no rollouts")
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rollouts:
        missing = [k for k in KEYS if k not in r]
        if missing:
            raise ValueError(f"train_grpo: rollout {r.get('trajectory_id', '?')} is missing {missing}")
        tid, n = r["trajectory_id"], len(r["completion_ids"])
        if not n or not r["prompt_ids"]:
            raise ValueError(f"train_grpo: rollout {tid} has no prompt or no completion tokens")
        adv = r["advantage"]
        for name, values in (("reward", [r["reward"]]), ("advantage", adv if isinstance(adv, list) else [adv])):
            bad = [v for v in values if not isinstance(v, (int, float)) or not math.isfinite(v)]
            if bad:
                raise ValueError(f"train_grpo: rollout {tid} has {name} {bad[0]}, expected a finite number")
        if isinstance(adv, list) and len(adv) != n:
            raise ValueError(f"train_grpo: rollout {tid} has {len(adv)} advantages for {n} completion tokens")
        if "env_mask" in r and len(r["env_mask"]) != n:
            raise ValueError(f"train_grpo: rollout {tid} has an env_mask of {len(r['env_mask'])} for {n} tokens")
        groups.setdefault(r["group_id"], []).append(r)
    for gid, g in groups.items():
        if len(g) != group_size:
            raise ValueError(f"train_grpo: group {gid} has {len(g)} rollouts, expected num_generations={group_size}")
    return groups


def episode_rollout(encoder: Any, trajectory_id: str, group_id: str, messages: list[dict[str, Any]], reward: float,
                    turn_advantages: list[float]) -> dict[str, Any]:
    """An agent's episode as a rollout: its conversation as `encoder` (a ChatEncoder) tokenizes it, append-only,
    the ids before the first assistant token its prompt and the rest its completion, with `env_mask` 1 on the
    assistant's sampled tokens only. `turn_advantages` has one advantage per assistant turn, in order; where they
    differ each turn's tokens get their own (a per-token list), else the one number."""
    ids, mask = encoder.encode(messages, add_generation_prompt=False)
    if 1 not in mask:
        raise ValueError(f"train_grpo: episode {trajectory_id} has no assistant turn to train on")
    first = mask.index(1)
    env_mask = mask[first:]
    starts = [i for i, m in enumerate(env_mask) if m and (i == 0 or not env_mask[i - 1])]
    if len(starts) != len(turn_advantages):
        raise ValueError(f"train_grpo: episode {trajectory_id} has {len(starts)} assistant turns in its tokens and "
                         f"{len(turn_advantages)} turn advantages")
    advantage: float | list[float] = turn_advantages[0]
    if len(set(turn_advantages)) > 1:
        turn = [sum(s <= i for s in starts) - 1 for i in range(len(env_mask))]
        advantage = [float(turn_advantages[max(k, 0)]) for k in turn]
    return {"trajectory_id": trajectory_id, "group_id": group_id, "prompt_ids": ids[:first],
            "completion_ids": ids[first:], "env_mask": env_mask, "reward": reward, "advantage": advantage}


def step_token_advantages(decode: Any, completion_ids: list[int], steps: list[str], advantages: list[float],
                          where: str = "rollout") -> list[float]:
    """One advantage per completion token: its step's, where a token belongs to the step its last character
    falls in (in the text `decode` makes of the ids), tokens before the first step to the first, and the
    rest (the answer line's end, EOS) to the last. `steps` are the completion's steps as the domain cut them,
    in order, each found in the decoded text after the one before.

    >>> text = "1+2=3\\n3*4=12\\n#### 12"
    >>> ids = list(range(len(text)))  # one token per character
    >>> adv = step_token_advantages(lambda ids: text[:len(ids)], ids, ["1+2=3", "3*4=12", "#### 12"], [1.0, -1.0, 0.5])
    >>> "".join({1.0: "a", -1.0: "b", 0.5: "c"}[a] for a in adv)
    'aaaaaabbbbbbbccccccc'
    """
    if len(steps) != len(advantages) or not steps:
        raise ValueError(f"train_grpo: {where} has {len(steps)} steps and {len(advantages)} step advantages")
    text = decode(completion_ids)
    starts, pos = [], 0
    for k, step in enumerate(steps):
        at = text.find(step, pos)
        if at < 0:
            raise ValueError(f"train_grpo: {where}'s step {k} ({step[:40]!r}) is not in the text its token ids decode to")
        starts.append(at)
        pos = at + len(step)
    # Each token's end in the text: the previous end plus what the token adds, decoded in a window of the tokens
    # before it (a token may complete a character they began), so the cost stays linear in the length.
    out, end = [], 0
    for i in range(len(completion_ids)):
        window = completion_ids[max(0, i - DECODE_WINDOW):i]
        end += max(0, len(decode(window + [completion_ids[i]])) - len(decode(window)))
        k = sum(s < end for s in starts) - 1
        out.append(float(advantages[max(k, 0)]))
    return out


def train_grpo(model_path: str, ref_model_path: str | None, rollouts: list[dict[str, Any]], out_dir: str,
               params: GRPOParams, progress_callback: ProgressCallback | None = None,
               ptx_examples: list[dict[str, list[int]]] | None = None,
               ptx_own: list[dict[str, list[int]]] | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Train the policy at `model_path` on `rollouts`, save it to `out_dir`; (metrics, one row per rollout).

    The metrics: steps, runtime_s, rollouts and groups trained on, the mean of TRL's logged `loss`, `entropy`,
    `kl` (beta > 0), `clip_ratio` (TRL's region mean: the share of tokens whose ratio was clipped),
    `advantage_gap`, the learning rate of the last step (`final_learning_rate`, as TRL logged it),
    and the staleness of the rollouts each step trained on (`staleness_mean`, `staleness_max`,
    in optimizer steps since they were sampled); with ptx_weight > 0, `ptx_loss`, the ptx batches' mean NLL over
    the round's forward passes, `ptx_examples`, and `ptx_right_answers` (`ptx_own`: the round's right answers that
    share each ptx batch with the demonstrations, ptx_pool right_answers). The rows: {"trajectory_id", "tokens",
    "old_logprob", "new_logprob"}, summed over the tokens the model sampled.
    """
    import datasets
    import torch
    from transformers import PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from components.rewards import save_checkpoint

    groups = check_rollouts(rollouts, params.num_generations)
    by_tid = {r["trajectory_id"]: r for r in rollouts}
    n_groups, g = len(groups), params.num_generations
    accumulate = min(params.groups_per_step, n_groups)
    max_steps = n_groups * params.num_iterations // accumulate
    model, tok, use_cpu = load_policy_to_train(model_path, params)
    old = sequence_logprobs(model, rollouts, params.temperature, tok.pad_token_id)
    ds = datasets.Dataset.from_list([{"prompt": tok.decode(gr[0]["prompt_ids"]), "group_id": gid}
                                     for gid, gr in groups.items()])
    batch: dict[str, list[str]] = {"groups": [], "tids": []}
    gaps: list[float] = []
    ptx = PtxBatches(ptx_examples or [], params.ptx_batch_size, tok.pad_token_id, params.seed, ptx_own) \
        if params.ptx_weight > 0 else None
    ptx_losses: list[float] = []

    def rollout_func(prompts: list[Any], trainer: Any) -> dict[str, Any]:
        # TRL asks for each group num_generations times in a row; the stored rollouts answer, in their order.
        taken: dict[str, int] = {}
        out: dict[str, Any] = {"prompt_ids": [], "completion_ids": [], "logprobs": None, "trajectory_id": []}
        masks = []
        for gid in batch["groups"]:
            r = groups[gid][taken.setdefault(gid, 0)]
            taken[gid] += 1
            out["prompt_ids"].append(list(r["prompt_ids"]))
            out["completion_ids"].append(list(r["completion_ids"]))
            out["trajectory_id"].append(r["trajectory_id"])
            masks.append(list(r.get("env_mask") or [1] * len(r["completion_ids"])))
        if any(0 in m for m in masks):
            out["env_mask"] = masks
        batch["tids"] = out["trajectory_id"]
        return out

    def stored_reward(prompts: list[Any], completions: list[Any], trajectory_id: list[str], **_: Any) -> list[float]:
        return [float(by_tid[t]["reward"]) for t in trajectory_id]

    class StoredRolloutTrainer(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            batch["groups"] = [x["group_id"] for x in inputs]
            out = super()._generate_and_score_completions(inputs)
            width = out["completion_ids"].shape[1]
            ours = [by_tid[t]["advantage"] for t in batch["tids"]]
            if any(isinstance(a, list) for a in ours):  # per-token credit: a (batch, tokens) advantage
                ours = torch.tensor([a + [0.0] * (width - len(a)) if isinstance(a, list) else [a] * width
                                     for a in ours], dtype=torch.float32)
            else:
                ours = torch.tensor(ours, dtype=torch.float32)
                gaps.append(float((out["advantages"].float().cpu() - ours).abs().max()))
            out["advantages"] = ours.to(out["advantages"].device)
            return out

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            if ptx is None:
                return loss
            ids, mask, labels = (t.to(loss.device) for t in ptx.next())
            nll = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            ptx_losses.append(float(nll.detach()))
            return loss + params.ptx_weight * nll

    history: list[dict[str, float]] = []

    class _Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs:
                history.append(dict(logs))
                if "loss" in logs and progress_callback is not None:
                    progress_callback(state.global_step, state.max_steps, float(logs["loss"]))

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    with tempfile.TemporaryDirectory(prefix="coevo-grpo-") as scratch:
        args = GRPOConfig(
            output_dir=scratch, max_steps=max_steps, per_device_train_batch_size=g, num_generations=g,
            steps_per_generation=n_groups, gradient_accumulation_steps=accumulate,
            num_iterations=params.num_iterations, learning_rate=params.learning_rate,
            lr_scheduler_type=params.lr_scheduler,
            loss_type=params.loss_type, beta=params.beta, epsilon=params.epsilon, epsilon_high=params.epsilon_high,
            temperature=params.temperature, max_completion_length=max(len(r["completion_ids"]) for r in rollouts),
            seed=params.seed, data_seed=params.seed, use_cpu=use_cpu, bf16=False, fp16=False,
            activation_checkpointing=params.gradient_checkpointing, logging_steps=params.logging_steps,
            logging_first_step=True, disable_tqdm=True, report_to="none", save_strategy="no",
            dataloader_num_workers=0, dataloader_pin_memory=not use_cpu, log_completions=False,
        )
        peft_config = lora_config(params.lora, model, f"{params.setting}.lora") if params.lora else None
        # With beta > 0, TRL loads the reference from the policy's config name and readies it as it readies the
        # policy (its fused log-prob head, dropout off): pointed at ref_model_path for that, it loads ours.
        own_name = model.config._name_or_path
        if params.beta > 0 and ref_model_path:
            model.config._name_or_path = ref_model_path
        try:
            with warnings.catch_warnings(), quiet_datasets():
                warnings.filterwarnings("ignore", category=UserWarning)
                trainer = StoredRolloutTrainer(model=model, reward_funcs=[stored_reward], args=args,
                                               train_dataset=ds, processing_class=tok, callbacks=[_Record()],
                                               peft_config=peft_config, rollout_func=rollout_func)
        finally:
            model.config._name_or_path = own_name
        trainer.remove_callback(PrinterCallback)
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*gradient_checkpointing.*", category=FutureWarning)
            result = trainer.train()
        runtime = time.perf_counter() - t0
    tok.padding_side = "left"
    trained = trainer.accelerator.unwrap_model(trainer.model)
    new = sequence_logprobs(trained, rollouts, params.temperature, tok.pad_token_id)
    if params.lora:
        save_trained(trainer, out_dir, lambda: save_lora(trained, tok, out_dir, params.lora, base=model_path))
        keep_safetensors_only(Path(out_dir))
    else:
        save_trained(trainer, out_dir, lambda: save_checkpoint(trained, tok, out_dir), tok)
    steps = int(result.global_step)
    rows = [{"trajectory_id": r["trajectory_id"], "tokens": o[1], "old_logprob": o[0], "new_logprob": n[0]}
            for r, o, n in zip(rollouts, old, new, strict=True)]
    tokens = sum(x["tokens"] for x in rows)
    return {
        "steps": steps, "runtime_s": runtime, "rollouts": len(rollouts), "groups": n_groups,
        "train_loss": float(result.training_loss),
        **{name: _mean(history, key) for name, key in (("entropy", "entropy"), ("kl", "kl"),
                                                       ("clip_ratio", "clip_ratio/region_mean"))},
        "advantage_gap": max(gaps) if gaps else math.nan,
        **({"ptx_loss": sum(ptx_losses) / max(len(ptx_losses), 1), "ptx_examples": len(ptx.examples),
            "ptx_right_answers": len(ptx.own)} if ptx is not None else {}),
        "final_learning_rate": next((float(h["learning_rate"]) for h in reversed(history) if "learning_rate" in h),
                                    math.nan),
        "staleness_mean": (steps - 1) / 2 if steps else math.nan, "staleness_max": max(steps - 1, 0),
        # How far the round's updates moved the policy on its own rollouts: mean per sampled token of
        # log pi_old - log pi_new (a KL estimate, k1), the cost of training k steps on them.
        "policy_shift": sum(x["old_logprob"] - x["new_logprob"] for x in rows) / max(tokens, 1),
    }, rows


def sequence_logprobs(model: Any, rollouts: list[dict[str, Any]], temperature: float, pad_id: int,
                      batch_size: int = 16) -> list[tuple[float, int]]:
    """(sum of log p(token) over each rollout's sampled completion tokens, their count), with logits divided by
    `temperature` as the sampler's were."""
    import torch

    from components.rewards import pad_right, token_logprobs

    out: list[tuple[float, int]] = []
    was_training = model.training
    model.eval()
    with torch.inference_mode():
        for i in range(0, len(rollouts), batch_size):
            chunk = rollouts[i:i + batch_size]
            seqs = [list(r["prompt_ids"]) + list(r["completion_ids"]) for r in chunk]
            ids, mask = pad_right(seqs, pad_id)
            ids, mask = ids.to(model.device), mask.to(model.device)
            lp = token_logprobs(model(input_ids=ids, attention_mask=mask).logits.float() / temperature, ids)
            for row, r in enumerate(chunk):
                start, n = len(r["prompt_ids"]), len(r["completion_ids"])
                keep = torch.tensor(r.get("env_mask") or [1] * n, dtype=torch.bool, device=lp.device)
                out.append((float(lp[row, start - 1:start - 1 + n][keep].sum()), int(keep.sum())))
    model.train(was_training)
    return out


def _mean(history: list[dict[str, float]], key: str) -> float:
    values = [float(h[key]) for h in history if key in h and h[key] is not None]
    return sum(values) / len(values) if values else math.nan
