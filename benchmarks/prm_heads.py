"""Which PRM head reads a round better? Retrain one round's PRM of a stored coevo experiment with each head,
on the same labels and from the same policy, and score the held-out samples of chosen rounds.

    .venv/bin/python benchmarks/prm_heads.py --experiment bench-coevo-v3 --round 11 --eval-rounds 1 3 11 \
        --workdir workdir/bench

For each head (`classifier`; `likelihood` with `lm_weight` 1), `train_prm` puts a fresh head on the policy
that sampled round R (the round's `train_reward` input) and trains it with the experiment's
`train_reward` settings on what that stage trains on: every round's Monte Carlo labels up to R
(`components.labeling.prm_examples`) and, with `train_reward.demos`, the round-0 demonstrations. The PRM
the experiment itself trained in round R is scored beside them (`as run`). On the held-out samples of
each evaluation round (greedy = sample 0, then N samples), as the evaluate stage computes them
(`components.evaluation.reward_metrics`): PRM best-of-N by the weakest step, maj@N, greedy, pass@N, step
F1 of the right-step and the erroneous-step classes against the oracle labels at a 0.5 threshold, and
the step AUC (the chance a right step outscores a wrong one: ranking, threshold-free).
The store is only read, one short connection per query, so it can run beside a benchmark writing to it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from components.config import ExperimentConfig  # noqa: E402
from components.domains import get_domain  # noqa: E402
from components.labeling import prm_examples  # noqa: E402
from components.evaluation import reward_metrics  # noqa: E402
from components.reward_eval import step_auc  # noqa: E402
from components.rewards.prm import PRMParams, PRMScorer, train_prm  # noqa: E402
from components.store import Store  # noqa: E402


def _steps(store: Store, experiment: str, purpose: str, round: int) -> dict[str, list[str]]:
    out: dict[str, list[str]] = defaultdict(list)
    for tid, text in store.query(
            "SELECT s.trajectory_id, s.text FROM steps s JOIN trajectories t USING (trajectory_id) WHERE "
            "t.experiment_id=? AND t.purpose=? AND t.round=? ORDER BY s.trajectory_id, s.step_index",
            [experiment, purpose, round])[1]:
        out[tid].append(text)
    return out


def training_examples(store: Store, cfg: ExperimentConfig, round: int) -> list[dict]:
    """What round `round`'s train_reward stage trains on (its label window, source and demonstrations)."""
    tr, domain = cfg.train_reward, get_domain(cfg.domain.name, **cfg.domain.options)
    first = max(1, round - tr.window_rounds + 1) if tr.window_rounds else 1
    examples = []
    for r in range(first, round + 1):
        steps = _steps(store, cfg.experiment, "train", r)
        labels: dict[str, dict[int, dict[str, float]]] = defaultdict(dict)
        for tid, i, source, value in store.query(
                "SELECT l.trajectory_id, l.step_index, l.source, l.value FROM step_labels l JOIN trajectories t "
                "USING (trajectory_id) WHERE t.experiment_id=? AND t.purpose='train' AND t.round=?",
                [cfg.experiment, r])[1]:
            labels[tid].setdefault(i, {})[source] = value
        items = [{"trajectory_id": tid, "prompt": prompt, "steps": steps.get(tid, [])} for tid, prompt in store.query(
            "SELECT trajectory_id, prompt FROM trajectories WHERE experiment_id=? AND purpose='train' AND round=? "
            "ORDER BY trajectory_id", [cfg.experiment, r])[1]]
        examples += prm_examples(items, labels, source=tr.label_source, soft_threshold=tr.soft_threshold)[0]
    if tr.demos:
        seen = {(e["prompt"], tuple(e["completions"])) for e in examples}
        for prompt, completion in store.query(
                "SELECT t.prompt, t.completion FROM selections s JOIN trajectories t USING (trajectory_id) WHERE "
                "s.experiment_id=? AND s.round=0 AND s.selected AND s.purpose='policy_sft' ORDER BY t.trajectory_id", [cfg.experiment])[1]:
            steps = domain.split_steps(completion)
            if steps and (prompt, tuple(steps)) not in seen:
                seen.add((prompt, tuple(steps)))
                examples.append({"prompt": prompt, "completions": steps, "labels": [True] * len(steps)})
    return examples


def held_out(store: Store, experiment: str, round: int) -> list[dict]:
    steps = _steps(store, experiment, "eval", round)
    oracle: dict[str, dict[int, bool]] = defaultdict(dict)
    for tid, i, value in store.query(
            "SELECT l.trajectory_id, l.step_index, l.value FROM step_labels l JOIN trajectories t USING (trajectory_id) "
            "WHERE t.experiment_id=? AND t.purpose='eval' AND t.round=? AND l.source='oracle'", [experiment, round])[1]:
        oracle[tid][i] = value == 1.0
    rows = store.rows(
        "SELECT t.trajectory_id, t.problem_id, t.level, t.sample_index, t.prompt, t.completion, t.answer, v.correct "
        "FROM trajectories t "
        "JOIN verifications v USING (trajectory_id) WHERE t.experiment_id=? AND t.purpose='eval' AND t.round=?",
        [experiment, round])
    for r in rows:
        r["steps"] = steps.get(r["trajectory_id"], [])
        r["oracle"] = [oracle[r["trajectory_id"]].get(i) for i in range(len(r["steps"]))]
    return rows


def metrics(rows: list[dict], step_scores: list[list[float]], n: int) -> dict[str, float]:
    """The evaluate stage's numbers (`reward_metrics`, pooled over levels) for these step scores, plus greedy
    and the step AUC."""
    oracle = {r["trajectory_id"]: r["oracle"] for r in rows if None not in r["oracle"]}
    prm_steps = {r["trajectory_id"]: s for r, s in zip(rows, step_scores)}
    got = {m["metric"]: m["value"] for m in reward_metrics(
        rows, {r["trajectory_id"]: bool(r["correct"]) for r in rows}, best_of_n=[n], experiment="", round=0,
        model_id="", prm_steps=prm_steps, oracle=oracle) if m["level"] == -1}
    greedy = [bool(r["correct"]) for r in rows if r["sample_index"] == 0]
    labelled = [t for t in prm_steps if t in oracle and len(oracle[t]) == len(prm_steps[t]) and prm_steps[t]]
    return {f"bon@{n}": got[f"prm_bon_at_{n}"], f"maj@{n}": got[f"maj_at_{n}"], "greedy": sum(greedy) / len(greedy),
            f"pass@{n}": got[f"pass_at_{n}"], "step_f1": got["prm_step_f1"], "error_f1": got["prm_error_f1"],
            "step_auc": step_auc([v for t in labelled for v in prm_steps[t]], [v for t in labelled for v in oracle[t]])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experiment", required=True)
    ap.add_argument("--round", type=int, required=True, help="the round whose PRM is retrained")
    ap.add_argument("--eval-rounds", type=int, nargs="+", default=None, help="held-out samples of these rounds "
                                                                             "(default: --round)")
    ap.add_argument("--workdir", type=Path, default=REPO / "workdir" / "bench")
    ap.add_argument("--n", type=int, default=8, help="N of best-of-N, maj@N and pass@N")
    ap.add_argument("--steps", type=int, default=None, help="training steps (default: the experiment's)")
    ap.add_argument("--out", type=Path, default=None, help="keep the trained PRMs here (default: a temporary folder)")
    ap.add_argument("--json", type=Path, default=None, help="also write the table as JSON")
    args = ap.parse_args()

    store = Store(args.workdir / "store")
    found = store.query("SELECT config_json FROM experiments WHERE experiment_id=?", [args.experiment])[1]
    if not found:
        sys.exit(f"no experiment {args.experiment!r} in {store.path}")
    cfg = ExperimentConfig.model_validate_json(found[0][0])
    run = store.committed_run(args.experiment, args.round, "train_reward")
    if run is None:
        sys.exit(f"{args.experiment} has no committed train_reward stage in round {args.round}")
    policy = json.loads(run["spec_json"])["params"]["policy_uri"]
    examples = training_examples(store, cfg, args.round)
    tr = cfg.train_reward
    print(f"{args.experiment} round {args.round}: {len(examples)} PRM examples, policy {policy}")

    out = args.out or Path(tempfile.mkdtemp(prefix="prm_heads-"))
    prms = {"as run": str(Path(run["out_dir"]) / "prm")}
    for head, lm_weight in (("classifier", 0.0), ("likelihood", 1.0)):
        t0 = time.perf_counter()
        params = PRMParams(max_steps=args.steps or tr.steps, batch_size=tr.batch_size, learning_rate=tr.learning_rate,
                           seed=cfg.seed, head=head, lm_weight=lm_weight)
        m = train_prm(policy, examples, str(out / head), params)
        print(f"  {head}: {m['steps']} steps, loss {m['first_loss']:.3f} -> {m['final_loss']:.3f} "
              f"in {time.perf_counter() - t0:.0f}s")
        prms[head] = str(out / head)

    table = []
    for r in args.eval_rounds or [args.round]:
        rows = held_out(store, args.experiment, r)
        for name, path in prms.items():
            scores = PRMScorer(path).score_steps([x["prompt"] for x in rows], [x["steps"] for x in rows])
            table.append({"eval_round": r, "prm": name, **metrics(rows, scores, args.n)})
    cols = [c for c in table[0] if c not in ("eval_round", "prm")]
    print(f"\n{'eval round':>10} {'PRM':>10} " + " ".join(f"{c:>9}" for c in cols))
    for row in table:
        print(f"{row['eval_round']:>10} {row['prm']:>10} " + " ".join(f"{row[c]:>9.3f}" for c in cols))
    if args.json:
        args.json.write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
