"""What a stage is: its definition (`Stage`), how it plans its inputs (`Planner`) and the helpers its job body shares.

A stage module (`components/stages/generate.py`, ...) defines three things and registers them as one `Stage`:

- `Inputs`, a dataclass: the typed record of what the stage reads besides committed tables (model URIs,
  levels, seeds). It crosses the process boundary inside the spec as JSON.
- `plan(p: Planner) -> Inputs`: resolved against the store in the flow's process; it names every committed
  upstream output the job may read with `p.read(stage, round)`.
- `run(spec: StageSpec, out: StageOutputWriter) -> metrics`: the job body, in its own process. It reads
  `spec.inputs_as(Inputs)` and committed Parquet (`spec.rows`), calls pure functions and writes rows.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from components.config import ExperimentConfig
from components.jobs.spec import InputRef, StageSpec
from components import storage
from components.manifest import MANIFEST, StageOutputWriter, part_path, read_manifest, sha256_dir
from components.store import Store
from components.tables import to_table


class PlanningError(RuntimeError):
    """An upstream stage has no committed attempt; the stage cannot run yet."""


@dataclass(frozen=True)
class Stage:
    name: str  # also the `stage` column, the task name and the MLflow metric prefix
    section: str  # the config section it reads (`cfg.<section>`)
    gpu: bool  # holds an accelerator: a `gpu` tag concurrency limit serialises these per machine
    reads: tuple[str, ...]  # stages (of any round) whose committed outputs it may read
    writes: tuple[str, ...]  # store tables it writes
    inputs: type  # the typed record `plan` returns and `run` reads
    plan: Callable[[Planner], Any]
    run: Callable[[StageSpec, StageOutputWriter], dict[str, float]]
    # The name its seed is derived under, where that is not its own: `bootstrap` was round 0's
    # `train_policy` before it became a stage, and keeps its seed so stored experiments reproduce.
    seed_name: str | None = None
    # Samples from the policy with `generate.backend`: under vLLM its job runs in vLLM's environment.
    samples: bool = False
    # A stage that can be sharded (`execution.shards`) says how its shards' metrics combine, and which tables
    # are computed over all shards at once: `merge(spec, shard_metrics, read)` -> (metrics, {table: rows}),
    # where `read(table)` gives the shards' rows of a table. It runs in the flow's process, after every shard
    # published. None: the stage always runs as one job.
    merge: Callable[[StageSpec, list[dict[str, float]], Callable[[str], list[dict[str, Any]]]],
                    tuple[dict[str, float], dict[str, list[dict[str, Any]]]]] | None = None


@dataclass
class Planner:
    """What `plan` sees: the config, the store, the round, the stages the recipe runs in it, and the
    committed inputs collected so far."""

    cfg: ExperimentConfig
    store: Store
    round: int
    round_stages: list[str]
    refs: list[InputRef] = field(default_factory=list)

    def read(self, stage: str, round: int | None = None) -> None:
        """Let the job read `stage`'s committed output of `round` (this round by default)."""
        self.refs.append(input_ref(self.store, self.cfg.experiment, self.round if round is None else round, stage))

    def committed(self, stage: str, round: int) -> bool:
        return self.store.committed_run(self.cfg.experiment, round, stage) is not None

    def model(self, round: int, role: str = "policy") -> dict[str, Any]:
        m = self.store.committed_model(self.cfg.experiment, round, role)
        if m is None:
            raise PlanningError(f"{self.cfg.experiment} round {round}: no committed {role} model")
        return m

    def optional_model(self, round: int, role: str) -> dict[str, Any] | None:
        return self.store.committed_model(self.cfg.experiment, round, role)


def input_ref(store: Store, experiment: str, round: int, stage: str) -> InputRef:
    run = store.committed_run(experiment, round, stage)
    if run is None:
        raise PlanningError(f"{experiment} round {round}: stage {stage!r} has no committed attempt")
    out_dir = run["out_dir"]
    m = read_manifest(storage.fetch(storage.join(out_dir, MANIFEST)))
    if m.sha256 != run["manifest_sha256"]:
        raise PlanningError(
            f"{out_dir}/manifest.json changed after it was committed (sha256 {m.sha256[:12]}… vs "
            f"{run['manifest_sha256'][:12]}…): the committed output was tampered with"
        )
    tables: dict[str, list[str]] = {}
    for o in m.outputs:
        tables.setdefault(o["table"], []).append(part_path(out_dir, o["path"]))
    return InputRef(round=round, stage=stage, stage_run_id=run["stage_run_id"], dir=out_dir,
                    manifest_sha256=run["manifest_sha256"], tables=tables)


# -- helpers the job bodies share ------------------------------------------------------------------

def log(stage: str, msg: str) -> None:
    print(f"[{stage}] {msg}", flush=True)


def domain_of(spec: StageSpec):
    from components.domains import get_domain

    cfg = spec.cfg()
    return get_domain(cfg.domain.name, **cfg.domain.options)


def prompt_format_of(cfg: ExperimentConfig):
    from components.models.prompts import PromptFormat

    return PromptFormat(cfg.policy.prompt_format, cfg.policy.system_prompt)


def backend_of(spec: StageSpec, model_uri: str):
    """The config's generation backend on `model_uri`; the real-model settings (chat prompts, dtype, prompt
    length) reach it where they differ from the defaults, which every backend takes."""
    from components.envs.rollout import is_agent
    from components.models.backends import BACKENDS, get_backend

    cfg = spec.cfg()
    g, pol = cfg.generate, cfg.policy
    real = {}
    if pol.prompt_format != "raw":
        real["prompt_format"] = prompt_format_of(cfg)
    if pol.dtype != "float32":
        real["dtype"] = pol.dtype
    if g.max_prompt_length is not None:
        real |= {"max_prompt_length": g.max_prompt_length, "max_truncated_fraction": pol.max_truncated_fraction}
    if g.backend not in BACKENDS and set(real) == {"prompt_format"} and is_agent(domain_of(spec)):
        real = {}  # an environment's chats are rendered by the agent loop (ChatEncoder), not by the backend
    if real and g.backend not in BACKENDS:
        raise ValueError(f"policy.prompt_format/dtype and generate.max_prompt_length reach the built-in backends "
                         f"({', '.join(sorted(BACKENDS))}), not {g.backend!r}")
    return get_backend(g.backend, model_uri, batch_size=g.batch_size, **real, **g.backend_options)


def agent_sampler(backend: Any, model_uri: str, *, temperature: float, top_p: float, max_new_tokens: int, seed: int):
    """The agent loop's policy on `backend`: its tokenizer's chat template, append-only, within the model's context."""
    from transformers import AutoConfig, AutoTokenizer

    from components.envs.agent import ChatEncoder, ChatSampler

    prompts = getattr(backend, "prompts", None)
    tok = prompts.tok if prompts is not None else AutoTokenizer.from_pretrained(model_uri)
    context = getattr(AutoConfig.from_pretrained(model_uri), "max_position_embeddings", None)
    return ChatSampler(backend, ChatEncoder(tok, model_uri), temperature=temperature, top_p=top_p,
                       max_new_tokens=max_new_tokens, seed=seed, max_context=context)


def sft_examples(spec: StageSpec, trajectories: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What SFT trains on for each trajectory: {"prompt", "completion"}; for an environment's episode, its chat
    {"messages"} from the stored turns (round 0's from `bootstrap`, later rounds' from `generate`, and from `filter`
    where it relabels episodes or poses them again)."""
    from components.envs.rollout import conversations, is_agent

    if not is_agent(domain_of(spec)):
        return [{"prompt": t["prompt"], "completion": t["completion"]} for t in trajectories]
    chats: dict[str, list[dict[str, Any]]] = {}
    replays = spec.cfg().filter.replays
    for r in sorted({t["round"] for t in trajectories}):
        chats |= conversations(spec.rows("bootstrap" if r == 0 else "generate", "turns", round=r))
        if r > 0 and replays:  # the filter's relabeled and variant episodes (filter.hindsight, filter.variants)
            chats |= conversations(spec.rows("filter", "turns", round=r))
    missing = [t["trajectory_id"] for t in trajectories if t["trajectory_id"] not in chats]
    if missing:
        raise RuntimeError(f"{spec.stage_run_id}: {len(missing)} selected episodes have no stored turns "
                           f"(first: {missing[0]}); was the experiment started before its domain was an environment?")
    return [{"messages": chats[t["trajectory_id"]]} for t in trajectories]


def backend_metrics(backend: Any) -> dict[str, float]:
    """What a backend reports of itself: the prompts it cut (`truncated_prompts`, which v_round_summary
    counts) and its engine's counters (`stats()`: vLLM's prefix cache), as `engine_<name>`."""
    out: dict[str, float] = {}
    if hasattr(backend, "truncated_prompts"):
        out["truncated_prompts"] = float(backend.truncated_prompts)
    if hasattr(backend, "stats"):
        out |= {f"engine_{k}": float(v) for k, v in backend.stats().items()}
    return out


def merged_counts(shard_metrics: list[dict[str, float]], maxed: tuple[str, ...] = ()) -> dict[str, float]:
    """Shards' metrics as one stage's: counts add up; wall times and other `maxed` keys (the shards ran side by
    side) take the largest; the engine's prefix-cache hit rate and the agent loop's environment share are
    recomputed from their summed counters.

    >>> merged_counts([{"tokens": 5, "mc_seconds": 2.0}, {"tokens": 7, "mc_seconds": 3.0}], maxed=("mc_seconds",))
    {'tokens': 12.0, 'mc_seconds': 3.0}
    """
    out: dict[str, float] = {}
    for m in shard_metrics:
        for k, v in m.items():
            out[k] = max(out.get(k, v), v) if k in maxed else out.get(k, 0.0) + float(v)
    if "agent_env_share" in out:  # an agent loop's share of time in the environment, over all shards' seconds
        from components.envs.rollout import env_share

        out["agent_env_share"] = env_share(out.get("agent_env_seconds", 0.0), out.get("agent_gen_seconds", 0.0))
    if "engine_prefix_cache_hit_rate" in out:
        q = out.get("engine_prefix_cache_queries", 0.0)
        out["engine_prefix_cache_hit_rate"] = out.get("engine_prefix_cache_hits", 0.0) / q if q else 0.0
    return {k: float(v) for k, v in out.items()}


def trainer_settings(cfg: ExperimentConfig, section: str, max_length: int,
                     gradient_accumulation_steps: int = 1) -> dict[str, Any]:
    """The SFTParams/DPOParams fields a config section shares with `policy`: prompt format, dtype, LoRA,
    memory and lengths; errors name `section` (e.g. "train_policy.max_length")."""
    pol = cfg.policy
    out = {"prompt_format": prompt_format_of(cfg), "dtype": pol.dtype,
           "lora": pol.lora.model_dump() if pol.lora else None, "gradient_checkpointing": pol.gradient_checkpointing,
           "max_length": max_length, "max_truncated_fraction": pol.max_truncated_fraction, "setting": section}
    if gradient_accumulation_steps != 1:
        out["gradient_accumulation_steps"] = gradient_accumulation_steps
    return out


def write(out: StageOutputWriter, **tables: list[dict[str, Any]]) -> None:
    for name, rows in tables.items():
        out.write_table(name, to_table(name, rows))


def steps_by_trajectory(steps: list[dict[str, Any]]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for r in sorted(steps, key=lambda r: (r["trajectory_id"], r["step_index"])):
        out.setdefault(r["trajectory_id"], []).append(r["text"])
    return out


def reward_steps(spec: StageSpec, stage: str, round: int | None = None) -> dict[str, list[str]]:
    """Each trajectory's steps as a reward model reads them: a text domain's `steps` rows; for an environment's
    episodes, each assistant turn with the observations after it (`envs.rollout.episode_steps`)."""
    from components.envs.rollout import episode_steps, is_agent

    if is_agent(domain_of(spec)):
        return episode_steps(spec.rows(stage, "turns", round=round))
    return steps_by_trajectory(spec.rows(stage, "steps", round=round))


def problems_by_id(rows: list[dict[str, Any]]) -> dict[str, Any]:
    from components.generation import problem_from_row

    return {p["problem_id"]: problem_from_row(p) for p in rows}


def reward_scores(spec: StageSpec, name: str, uri: str | None, model_id: str | None, trajs: list[dict[str, Any]],
                  steps: dict[str, list[str]], reference_uri: str | None = None,
                  turns: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """`scores` rows of one reward model over `trajs`, built with the domain's step separator. An environment's
    episodes also pass their `turns` rows, for a model that reads the sampled tokens (the implicit PRM)."""
    from components.envs.rollout import conversations
    from components.rewards import score_rows

    rm = reward_model_of(spec, name, uri, reference_uri=reference_uri)
    episodes = conversations(turns) if turns is not None and hasattr(rm, "score_episodes") else None
    return score_rows(rm, model_id, trajs, steps, episodes)


def confidence_judge(cfg: ExperimentConfig, policy: dict[str, Any]) -> tuple[str, str]:
    """(uri, model id) of the model whose confidence scores steps under score.reward_model=confidence:
    score.confidence_model where set (a local folder by its absolute path, as the stage may run elsewhere; a hub
    name as given; either is its own id), else `policy`, the `models` row of the policy that sampled."""
    from components.models.checkpoint import model_uri

    if cfg.score.confidence_model is None:
        return policy["uri"], policy["model_id"]
    uri = model_uri(cfg.score.confidence_model)
    return uri, uri


def reward_model_of(spec: StageSpec, name: str, uri: str | None, reference_uri: str | None = None,
                    max_length: int | None = None):
    """The config's reward model `name` at `uri`, reading prompts as the policy renders them."""
    from components.rewards import load_reward_model

    cfg = spec.cfg()
    return load_reward_model(name, uri, separator=domain_of(spec).step_separator, reference_uri=reference_uri,
                             beta=cfg.score.implicit_beta, prompt_format=prompt_format_of(cfg),
                             dtype=cfg.policy.dtype, max_length=max_length)


def model_id(spec: StageSpec, role: str = "policy") -> str:
    """`<experiment>/<role>/r<round>/a<attempt>`: a rerun's model is a new model, and the next round's
    `parent_model_id` names the one it was actually trained from."""
    return f"{spec.experiment}/{role}/r{spec.round}/a{spec.attempt}"


def model_row(spec: StageSpec, role: str, model_dir: Path, artifact: str | None, parent: str | None,
              train_examples: int, uri: str | None = None) -> dict[str, Any]:
    """A `models` row for the checkpoint in `model_dir`: at the attempt's `artifact` folder, or at `uri`."""
    return {"model_id": model_id(spec, role), "experiment_id": spec.experiment, "role": role, "round": spec.round,
            "uri": uri or storage.join(spec.out_dir, str(artifact)), "sha256": sha256_dir(model_dir),
            "parent_model_id": parent, "train_examples": train_examples, "mlflow_run_id": None,
            "registered_name": None, "registered_version": None}


def given_model_row(spec: StageSpec, name_or_path: str) -> dict[str, Any]:
    """Round 0's `models` row for `policy.model` taken as it is: a local folder by its absolute path, a hub
    name as given; the sha256 is of the files either way (a hub name's cached snapshot)."""
    from components.models.checkpoint import model_uri, resolve_checkpoint

    return model_row(spec, "policy", resolve_checkpoint(name_or_path), None, None, 0, uri=model_uri(name_or_path))


def model_input(spec: StageSpec, role: str, trajectory_id: str, source_round: int, use: str | None = None) -> dict[str, Any]:
    use = use or ("new" if source_round == spec.round else "replay")
    return {"model_id": model_id(spec, role), "trajectory_id": trajectory_id, "source_round": source_round, "use": use}


def selected(spec: StageSpec, round: int, demos_only: bool = False) -> dict[str, dict[str, Any]]:
    """Trajectories selected for policy SFT in `round`. Round 0: the demonstrations `bootstrap` stored, and
    the verified-correct trajectories `import` stored where the job may read them (unless `demos_only`). Later
    rounds: what `filter` selected of `generate`'s episodes, and of its own replayed ones (filter.hindsight,
    filter.variants)."""
    if round == 0:
        sources = [(("bootstrap",), "bootstrap")] + ([(("import",), "import")]
                                                     if not demos_only and spec.has("import", 0) else [])
    else:
        sources = [(("generate", "filter") if spec.cfg().filter.replays else ("generate",), "filter")]
    out: dict[str, dict[str, Any]] = {}
    for src_t, src_s in sources:
        trajs = {t["trajectory_id"]: t for stage in src_t for t in spec.rows(stage, "trajectories", round=round)}
        out |= {s["trajectory_id"]: trajs[s["trajectory_id"]] for s in spec.rows(src_s, "selections", round=round)
                if s["selected"] and s["purpose"] == "policy_sft"}
    return out


def train_progress(stage: str) -> Callable[[int, int, float | None], None]:
    def report(step: int, total: int, loss: float | None) -> None:
        loss_s = f", loss {loss:.4f}" if loss is not None else ""
        log(stage, f"step {step}/{total}{loss_s}")
    return report


def count_progress(stage: str, what: str) -> Callable[[int, int], None]:
    """A `(done, total)` callback that logs `[stage] <what> done/total` at each tenth of the total and at the end,
    with the seconds since it was made: the line the progress bar reads (`what` ends in a word it knows, such
    as `episodes`)."""
    t0 = time.perf_counter()

    def report(done: int, total: int) -> None:
        if done == total or done % max(1, total // 10) == 0:
            log(stage, f"{what} {done}/{total} ({time.perf_counter() - t0:.1f}s)")
    return report


def copy_model(uri: str, dest: Path) -> None:
    from components.models.tiny import load_policy

    model, tok = load_policy(uri, dtype="auto")  # a bf16 policy carried over stays bf16
    model.save_pretrained(dest, safe_serialization=True)
    tok.save_pretrained(dest)
