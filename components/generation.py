"""Stage `generate`: sample completions for a round's problems and segment them into steps."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from components.domains.base import Domain, Problem
from components.models.backends import GenerationBackend, Sample

W = TypeVar("W")  # a wave of samples, as `waves_until_right`'s caller draws it


def trajectory_id(experiment: str, round: int, purpose: str, problem_id: str, sample_index: int) -> str:
    """Stable id: a rerun of the same stage yields the same ids, so lineage survives reruns."""
    key = f"{experiment}|{round}|{purpose}|{problem_id}|{sample_index}".encode()
    return hashlib.sha256(key).hexdigest()[:24]


def problem_row(p: Problem, split: str) -> dict[str, Any]:
    return {"problem_id": p.problem_id, "domain": p.domain, "level": p.level, "prompt": p.prompt,
            "answer": p.answer, "meta_json": json.dumps(p.meta, sort_keys=True), "split": split}


def problem_from_row(row: dict[str, Any]) -> Problem:
    """A `problems` row back as the Problem it was written from, its meta included."""
    return Problem(row["problem_id"], row["domain"], row["level"], row["prompt"], row["answer"],
                   json.loads(row.get("meta_json") or "{}"))


@dataclass
class GeneratedBatch:
    problems: list[dict[str, Any]]
    trajectories: list[dict[str, Any]]
    steps: list[dict[str, Any]]

    @property
    def num_tokens(self) -> int:
        return sum(t["num_tokens"] for t in self.trajectories)


def generate(
    domain: Domain, backend: GenerationBackend, problems: list[Problem], *, experiment: str, round: int,
    purpose: str, policy_model_id: str, n: int, temperature: float, top_p: float, max_new_tokens: int, seed: int,
    split: str = "train", first_sample_index: int = 0, sample: Callable[..., list[list[Sample]]] | None = None,
) -> GeneratedBatch:
    """`n` samples per problem as trajectory and step rows; `sample` replaces `backend.generate` (same
    arguments), as the PRM-guided step search does."""
    samples = (sample or backend.generate)(
        [p.prompt for p in problems], n=n, temperature=temperature, top_p=top_p,
        max_new_tokens=max_new_tokens, seed=seed,
    )
    trajs, steps = [], []
    for p, per_prompt in zip(problems, samples, strict=True):
        for i, s in enumerate(per_prompt):
            idx = first_sample_index + i
            tid = trajectory_id(experiment, round, purpose, p.problem_id, idx)
            trajs.append({
                "trajectory_id": tid, "experiment_id": experiment, "round": round, "purpose": purpose,
                "problem_id": p.problem_id, "level": p.level, "policy_model_id": policy_model_id,
                "sample_index": idx, "prompt": p.prompt, "completion": s.text,
                "answer": domain.extract_answer(s.text), "num_tokens": s.num_tokens,
                "finish_reason": s.finish_reason, "temperature": temperature, "top_p": top_p,
                "max_new_tokens": max_new_tokens, "seed": seed,
                "token_ids": None if s.token_ids is None else list(s.token_ids),
            })
            steps.extend(
                {"trajectory_id": tid, "step_index": k, "text": text}
                for k, text in enumerate(domain.split_steps(s.text))
            )
    return GeneratedBatch([problem_row(p, split) for p in problems], trajs, steps)


def waves_until_right(
    problems: list[Problem], draw: Callable[[list[Problem], int, int, int], tuple[W, Iterable[tuple[str, bool]], int]],
    *, want: int, wave_size: int, n: int, seed: int, progress: Callable[[str], None] | None = None,
) -> tuple[list[W], dict[str, float]]:
    """Rejection sampling in waves (DART-Math), whatever a sample is: each wave draws `wave_size` more samples for
    every problem with fewer than `want` right ones, until `n` per problem are drawn. `draw(problems, k, seed,
    first_sample_index)` draws a wave, k samples a problem, and returns it, each sample's (problem id, right) and
    its tokens. Wave 0 draws at `seed`, wave w > 0 at `seed_stream(seed, w)`; sample indices run on across waves,
    so ids are those of the plain draw where they overlap.

    Returns the waves, in order, and their statistics: problems drawn for and tokens per wave, `waves`, and
    `unmet` (problems still short of `want`)."""
    from components.seeding import seed_stream

    right = dict.fromkeys((p.problem_id for p in problems), 0)
    pending, drawn, w = list(problems), 0, 0
    got: list[W] = []
    stats: dict[str, float] = {}
    while pending and drawn < n:
        k = min(wave_size, n - drawn)
        wave, verdicts, tokens = draw(pending, k, seed if w == 0 else seed_stream(seed, w), drawn)
        for problem_id, ok in verdicts:
            right[problem_id] += bool(ok)
        got.append(wave)
        stats |= {f"wave{w}_problems": len(pending), f"wave{w}_tokens": tokens}
        drawn, asked = drawn + k, len(pending)
        pending = [p for p in pending if right[p.problem_id] < want]
        if progress:
            progress(f"wave {w}: {asked} problems x {k}, {tokens} tokens; {len(pending)} still short of {want} right")
        w += 1
    return got, stats | {"waves": w, "unmet": len(pending)}


def generate_until_correct(
    domain: Domain, backend: GenerationBackend, problems: list[Problem], *,
    verifier: Callable[[list[str], list[str]], list[float | None]], want: int, wave_size: int, n: int, seed: int,
    progress: Callable[[str], None] | None = None, **kw: Any,
) -> tuple[GeneratedBatch, dict[str, float]]:
    """`waves_until_right` on text: each wave is `generate`, judged by `verifier` (the verify stage's function and
    rule). Returns the batch (the problems from wave 0, which draws for all of them) and the waves' statistics."""
    from components.verification import verify

    def draw(pending: list[Problem], k: int, wave_seed: int, first: int):
        b = generate(domain, backend, pending, n=k, seed=wave_seed, first_sample_index=first, **kw)
        answers = {p.problem_id: p.answer for p in pending}
        verdicts = verify(b.trajectories, answers, verifier, name="until_correct", version="")
        return b, [(t["problem_id"], v["correct"]) for t, v in zip(b.trajectories, verdicts, strict=True)], b.num_tokens

    batches, stats = waves_until_right(problems, draw, want=want, wave_size=wave_size, n=n, seed=seed,
                                       progress=progress)
    return GeneratedBatch(batches[0].problems if batches else [], [t for b in batches for t in b.trajectories],
                          [s for b in batches for s in b.steps]), stats


def search_tree_id(experiment: str, round: int, purpose: str, problem_id: str) -> str:
    """Stable id of a problem's search tree in a stage: a rerun writes the same ids, as trajectories do."""
    return hashlib.sha256(f"{experiment}|{round}|{purpose}|{problem_id}|tree".encode()).hexdigest()[:24]


def generate_mcts(
    domain: Domain, backend: GenerationBackend, problems: list[Problem], search: Any, *, experiment: str,
    round: int, purpose: str, policy_model_id: str, n: int, temperature: float, top_p: float, max_new_tokens: int,
    seed: int, value: Callable[[list[tuple[str, str]]], tuple[list[float], int]] | None = None,
    progress: Callable[[str], None] | None = None, split: str = "train",
) -> tuple[GeneratedBatch, list[dict[str, Any]], dict[str, float]]:
    """One MCTS tree per problem (`search`: the config's `generate.mcts`), and up to `n` trajectories from each:
    its best terminal leaves (`Tree.returned`), then, where fewer ended, the rollouts the search paid for, each
    completing its node's prefix (a node's best rollout, right ones first, then higher Q, then deeper). Returns
    the batch, the trees as `nodes` rows (a node naming the trajectory it became) and the search's statistics. A
    trajectory's `num_tokens` is its own solution's; `discarded_tokens` is the rest of what the search generated
    (siblings, duplicates, the other rollouts)."""
    from components.search.mcts import MCTSConfig, node_rows
    from components.search.policy import mcts_sample

    cfg = MCTSConfig.of(search, len(problems))

    def report(sim: int, spent: int) -> None:
        if progress:
            progress(f"simulation {sim}/{cfg.simulations}: {spent} tokens")

    completions: dict[tuple[str, str], tuple[Sample, float]] = {}
    trees, _, stats = mcts_sample(domain, backend, problems, cfg, temperature=temperature, top_p=top_p,
                                  max_step_tokens=search.max_step_tokens, max_new_tokens=max_new_tokens, seed=seed,
                                  rollouts=search.rollouts, value=value, progress=report, completions=completions)
    trajs, steps, nodes = [], [], []
    from_rollouts = 0
    for p, tree in zip(problems, trees, strict=True):
        tree_id = search_tree_id(experiment, round, purpose, p.problem_id)
        picked = [(x, tree.prefix(x.node_id), tree.path_tokens(x.node_id), "stop") for x in tree.returned(n)]
        open_ = [(x, (tree.prompt, tree.prefix(x.node_id))) for x in tree.nodes if not x.terminal]
        rolled = sorted(((x, completions[key]) for x, key in open_ if key in completions),
                        key=lambda xc: (-xc[1][1], -(xc[0].q or 0.0), -xc[0].depth, xc[0].node_id))
        texts = {text for _, text, _, _ in picked}
        for x, (done, _) in rolled:
            if len(picked) >= n:
                break
            text = tree.prefix(x.node_id) + done.text
            if text not in texts:
                texts.add(text)
                picked.append((x, text, tree.path_tokens(x.node_id) + done.num_tokens, done.finish_reason))
                from_rollouts += 1
        if not picked:  # nothing ended and nothing was rolled out (a PRM's values): the deepest node, unfinished
            x = tree.best_leaf()
            picked = [(x, tree.prefix(x.node_id), tree.path_tokens(x.node_id), "length")]
        became: dict[int, str] = {}
        for idx, (leaf, text, tokens, finish) in enumerate(picked):
            tid = became[leaf.node_id] = trajectory_id(experiment, round, purpose, p.problem_id, idx)
            trajs.append({
                "trajectory_id": tid, "experiment_id": experiment, "round": round, "purpose": purpose,
                "problem_id": p.problem_id, "level": p.level, "policy_model_id": policy_model_id,
                "sample_index": idx, "prompt": p.prompt, "completion": text, "answer": domain.extract_answer(text),
                "num_tokens": tokens, "finish_reason": finish,
                "temperature": temperature, "top_p": top_p, "max_new_tokens": max_new_tokens, "seed": seed,
                "token_ids": None,
            })
            steps.extend({"trajectory_id": tid, "step_index": k, "text": s}
                         for k, s in enumerate(domain.split_steps(text)))
        nodes += [{"tree_id": tree_id, "experiment_id": experiment, "round": round, "purpose": purpose,
                   "problem_id": p.problem_id} | row | {"trajectory_id": became.get(row["node_id"])}
                  for row in node_rows(tree)]
    batch = GeneratedBatch([problem_row(p, split) for p in problems], trajs, steps)
    stats = {**stats, "discarded_tokens": stats["generated_tokens"] - batch.num_tokens, "from_rollouts": from_rollouts,
             "right_leaves": sum(int(x.terminal and x.reward == 1.0) for t in trees for x in t.nodes)}
    return batch, nodes, stats
