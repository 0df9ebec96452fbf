"""How a grpo run's reward model ranked each round's right answers, against the domain's step checker: does the
score that shaped the reward tell sound answers from unsound ones, and by how much does it pay them apart?

    .venv/bin/python benchmarks/shaping_vs_checker.py --workdir /tmp/gptx \\
        --experiment bench-grpo-lr1e-4-p64-top1-it8-ptx-sil-prmmin-s0

Reads the store only. Per round, over the rollouts with a right answer and a score of the run's
`train_policy.grpo.shaping_aggregate` (`scores`, scorer = score.reward_model): how many the checker rejects,
the ranking (`components/filtering.py::judge_ranking`: the AUC, and the catch rate of the best threshold in
hindsight that drops at most 5% of the sound answers), and the mean score of the sound and the unsound ones. The
reward gap is that difference times `shaping_weight`; rft's checker, and grpo's `filter.check_steps`, pay 1.
Under `credit: step` each step was shaped on its own, so the aggregate only summarises what shaped.
"""

from __future__ import annotations

import argparse
import json
import sys
from itertools import groupby
from pathlib import Path
from statistics import fmean

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main() -> None:
    from components.config import load_config_dict
    from components.domains import get_domain
    from components.filtering import judge_ranking
    from components.store import Store

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--experiment", required=True)
    args = ap.parse_args()
    store = Store(args.workdir / "store")
    run = store.committed_run(args.experiment, 1, "filter")
    if run is None:
        sys.exit(f"{args.experiment}: no committed filter in round 1 under {args.workdir}")
    cfg = load_config_dict(json.loads(run["spec_json"])["config"], source=f"spec of {run['stage_run_id']}")
    g, scorer = cfg.train_policy.grpo, cfg.score.reward_model
    if cfg.recipe != "grpo" or scorer == "none":
        sys.exit(f"{args.experiment}: recipe {cfg.recipe!r}, score.reward_model {scorer!r}: no reward model shaped "
                 "a grpo reward")
    domain = get_domain(cfg.domain.name, **cfg.domain.options)
    rows = store.rows(
        "SELECT t.round, t.trajectory_id, t.prompt, t.completion, s.value FROM trajectories t "
        "JOIN scores o ON o.trajectory_id = t.trajectory_id AND o.scorer = 'outcome' AND o.value > 0 "
        "JOIN scores s ON s.trajectory_id = t.trajectory_id AND s.scorer = ? AND s.aggregate = ? "
        "WHERE t.experiment_id = ? ORDER BY t.round, t.trajectory_id", [scorer, g.shaping_aggregate, args.experiment])
    print(f"{args.experiment}: {scorer} {g.shaping_aggregate} step score at shaping_weight {g.shaping_weight}, "
          "on each round's right answers, against the step checker"
          + (" (credit=step shaped each step; this is their aggregate)" if g.credit == "step" else ""))
    for rnd, group in groupby(rows, key=lambda r: r["round"]):  # the query orders by round
        these = list(group)
        score = {r["trajectory_id"]: r["value"] for r in these}
        checker = {r["trajectory_id"]: domain.check_steps(r["prompt"], r["completion"]) for r in these}
        sound = [score[t] for t, ok in checker.items() if ok is True]
        unsound = [score[t] for t, ok in checker.items() if ok is False]
        if not sound or not unsound:
            print(f"round {rnd}: {len(sound)} sound, {len(unsound)} unsound: nothing to rank")
            continue
        rank = judge_ranking(score, checker)
        good, bad = fmean(sound), fmean(unsound)
        print(f"round {rnd}: {len(sound) + len(unsound)} right, {len(unsound)} unsound; AUC {rank['judge_auc']:.3f}, "
              f"hindsight catch at 5% {rank['judge_hindsight_catch']:.3f}; mean score sound {good:.3f}, unsound "
              f"{bad:.3f}; reward gap {g.shaping_weight * (good - bad):+.3f} (the checker's: 1)")


if __name__ == "__main__":
    main()
