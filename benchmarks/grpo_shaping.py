"""Does a reward model's step-level credit make grpo learn more than the outcome alone? Arith at micro scale, no
step checker anywhere, the arms side by side.

    .venv/bin/python benchmarks/grpo_shaping.py --workdir /tmp/shaping-bench --seeds 0 1 --rounds 4

Per seed, configs/micro-grpo.yaml's bootstrap trains a round-0 policy (`bench-boot-s<seed>`, `rounds=0`), and every
arm starts from it as it is (`bootstrap.steps=0`), so all arms of a seed start from the same model:
- `outcome`: configs/micro-grpo.yaml as shipped: the verifier's reward, one advantage per rollout;
- `implicit-step`: step credit (`train_policy.grpo.credit: step`, weight 0.5) from the implicit PRM (the policy's
  log-ratio against the round-0 model), from round 2 on (round 1's policy is its own reference);
- `prm-step`: step credit from a PRM that grpo's rounds train: round r's score stage labels steps by Monte Carlo
  rollouts (k=2), train_reward trains a PRM on them, and round r+1's steps are scored by it (round 1's by the Monte
  Carlo values themselves). Its labelling rollouts count in its token budget.

Each arm is a `coevo run` in its own process, one at a time; committed stages are skipped, so a second call only
reports. Then, from the store (`v_round_summary`), per arm and seed: held-out greedy accuracy on level 3 (the
hardest) by round, with cumulative tokens (sampled + labelling), and each shaped arm's final level-3 accuracy
against outcome-only's (the issue's goal: +5 points, beyond the seeds' spread). Written to `--out` (JSON) too.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from grpo_vs_rft import HARDEST, SHAPING, _rows, _run  # noqa: E402

CONFIG = "configs/micro-grpo.yaml"
ARMS = {"outcome": [], "implicit-step": SHAPING["implicit"], "prm-step": SHAPING["prm"]}


# Where a round's wall time goes: each stage's job time by kind, and the rest (Prefect's tasks, starting each
# stage's process, committing its outputs to the store, MLflow) as orchestration.
KINDS = {"generate": "sampling", "verify": "scoring", "score": "scoring", "train_reward": "reward model",
         "filter": "training", "train_policy": "training", "evaluate": "evaluation"}
TIMES = """
WITH s AS (
    SELECT experiment_id, round, stage, duration_s, started_at, finished_at,
           TRY_CAST(json_extract(metrics_json, '$.tokens') AS DOUBLE)
               / TRY_CAST(json_extract(metrics_json, '$.tokens_per_s') AS DOUBLE) AS sampling_s,
           TRY_CAST(json_extract(metrics_json, '$.runtime_s') AS DOUBLE) AS optimizer_s
    FROM stage_runs WHERE status = 'committed' AND NOT stale AND experiment_id = ?
), r AS (
    SELECT round, max(finished_at) AS done FROM s GROUP BY round
)
SELECT s.round, s.stage, s.duration_s, s.sampling_s, s.optimizer_s,
       epoch(r.done) - epoch(p.done) AS round_wall_s
FROM s JOIN r USING (round) JOIN r p ON p.round = s.round - 1
ORDER BY s.round, s.started_at
"""


def round_times(store, experiment: str) -> dict[str, float]:
    """Mean seconds per round (rounds 1+) by kind, orchestration included, and the pure sampling and optimizer
    seconds inside generate and train_policy."""
    _, rows = store.query(TIMES, [experiment])
    rounds = sorted({r[0] for r in rows})
    out: dict[str, float] = {}
    walls: dict[int, float] = {}
    for rnd, stage, duration, sampling, optimizer, wall in rows:
        kind = KINDS.get(stage, stage)
        out[kind] = out.get(kind, 0.0) + duration
        out["of which decoding"] = out.get("of which decoding", 0.0) + (sampling or 0.0) * (stage == "generate")
        out["of which optimizer steps"] = out.get("of which optimizer steps", 0.0) + (optimizer or 0.0) * (
            stage == "train_policy")
        walls[rnd] = wall
    out["orchestration"] = sum(walls.values()) - sum(v for k, v in out.items() if not k.startswith("of which"))
    out["round"] = sum(walls.values())
    return {k: v / max(len(rounds), 1) for k, v in out.items()}


def print_round_times(store, experiments: dict[str, str]) -> None:
    print("\nwhere a round's time goes: mean seconds per round (rounds 1+), share of the round's wall time")
    for name, exp in experiments.items():
        t = round_times(store, exp)
        order = ["sampling", "of which decoding", "scoring", "reward model", "training", "of which optimizer steps",
                 "evaluation", "orchestration"]
        parts = [f"{k} {t[k]:.1f}s ({t[k] / t['round']:.0%})" for k in order if k in t]
        print(f"{name:22s} round {t['round']:.1f}s: " + ", ".join(parts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/shaping-bench"))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--times-only", action="store_true", help="print where the rounds' time went, from the store")
    args = ap.parse_args()
    from components.store import Store

    if args.times_only:
        print_round_times(Store(args.workdir / "store"), {f"{arm} seed {seed}": f"bench-{arm}-s{seed}"
                                                          for seed in args.seeds for arm in args.arms})
        return
    args.workdir.mkdir(parents=True, exist_ok=True)
    report: dict[str, dict[int, list[dict]]] = {}
    for seed in args.seeds:
        base = [f"workdir={args.workdir}", f"seed={seed}"]
        boot = f"bench-boot-s{seed}"
        print(f"[bench] seed {seed}: round-0 policy", flush=True)
        _run(CONFIG, [*base, f"experiment={boot}", "rounds=0"], args.workdir / f"{boot}.log")
        model = Store(args.workdir / "store").committed_model(boot, 0, "policy")
        for arm in args.arms:
            exp = f"bench-{arm}-s{seed}"
            print(f"[bench] seed {seed}: {arm}", flush=True)
            _run(CONFIG, [*base, f"rounds={args.rounds}", f"experiment={exp}", f"policy.model={model['uri']}",
                          "bootstrap.steps=0", *ARMS[arm]], args.workdir / f"{exp}.log")
            report.setdefault(arm, {})[seed] = _rows(Store(args.workdir / "store"), exp)
    print(f"\nlevel-{HARDEST} greedy accuracy by round (cumulative tokens: sampled + labelling)")
    for arm, seeds in report.items():
        for seed, rows in seeds.items():
            print(f"{arm:14s} seed {seed}: " + "  ".join(f"r{r['round']} {r['hardest']:.3f} ({r['budget']})"
                                                        for r in rows))
    if "outcome" in report:
        print(f"\nfinal level-{HARDEST} accuracy minus outcome-only's, per seed (goal: +0.05 beyond the seeds' spread)")
        for arm in [a for a in report if a != "outcome"]:
            gains = [report[arm][s][-1]["hardest"] - report["outcome"][s][-1]["hardest"] for s in args.seeds]
            tokens = [report[arm][s][-1]["budget"] / max(report["outcome"][s][-1]["budget"], 1) for s in args.seeds]
            print(f"{arm:14s} " + "  ".join(f"seed {s}: {g:+.3f} at {t:.2f}x the tokens"
                                            for s, g, t in zip(args.seeds, gains, tokens)))
    print_round_times(Store(args.workdir / "store"), {f"{arm} seed {seed}": f"bench-{arm}-s{seed}"
                                                      for seed in args.seeds for arm in args.arms})
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
