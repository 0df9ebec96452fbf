"""What staleness costs in a grpo round: one round's rollouts trained with 1, 2 and 4 passes (num_iterations), each
optimizer step one step staler than the last, side by side from the same policy and the same rollouts.

    .venv/bin/coevo run --config configs/micro-grpo.yaml --set rounds=0 --set workdir=/tmp/mg
    .venv/bin/python benchmarks/grpo_staleness.py --model /tmp/mg/micro-grpo/r0/bootstrap/a1/model

The round: 48 problems of arith level 3 and 48 of level 2, 8 rollouts each at temperature 1, advantages as the
grpo filter computes them (groups with equal rewards dropped). Per arm: optimizer steps, staleness (mean and
max), TRL's clip fraction, `policy_shift` (mean log pi_old - log pi_new per sampled token), and the sampled
reward before and after, on the round's own prompts (new samples) and on 96 held-out problems of the same
levels. Figures go to stdout and to `--out` (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from components.domains import get_domain  # noqa: E402
from components.models.backends import HFBackend  # noqa: E402
from components.rl.advantages import group_advantages  # noqa: E402
from components.training.grpo import GRPOParams, train_grpo  # noqa: E402

G = 8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the round's starting policy (micro-grpo's round 0)")
    ap.add_argument("--learning-rate", type=float, default=1e-4)
    ap.add_argument("--work", default="/tmp/grpo-staleness", help="where the trained arms are written")
    ap.add_argument("--out", default=None, help="JSON file for the figures")
    args = ap.parse_args()
    d = get_domain("arith", max_level=3, digits=1, test_size=60)
    train = d.sample_problems(3, 48, seed=10) + d.sample_problems(2, 48, seed=20)
    held = d.sample_problems(3, 48, seed=30) + d.sample_problems(2, 48, seed=40)
    prompt_ids = HFBackend(args.model, batch_size=256, progress=False).prompts.encode([p.prompt for p in train])

    def sample(model: str, problems, seed: int):
        b = HFBackend(model, batch_size=256, progress=False)
        ids = prompt_ids if problems is train else b.prompts.encode([p.prompt for p in problems])
        out = b.generate_ids(ids, n=G, temperature=1.0, top_p=1.0, max_new_tokens=48, seed=seed)
        return [(p, i, x) for p, i, xs in zip(problems, ids, out, strict=True) for x in xs]

    def reward(samples) -> float:
        return sum(d.verify([x.text], [p.answer])[0] or 0.0 for p, _, x in samples) / len(samples)

    rollouts = [{"trajectory_id": f"{p.problem_id}-{k % G}", "group_id": p.problem_id, "prompt_ids": ids,
                 "completion_ids": list(x.token_ids), "outcome": d.verify([x.text], [p.answer])[0] or 0.0}
                for k, (p, ids, x) in enumerate(sample(args.model, train, 0))]
    adv = {a["trajectory_id"]: a for a in group_advantages(rollouts)}
    kept = [r | {"reward": adv[r["trajectory_id"]]["reward"], "advantage": adv[r["trajectory_id"]]["advantage"]}
            for r in rollouts if adv[r["trajectory_id"]]["kept"]]
    before = {"own": sum(r["outcome"] for r in rollouts) / len(rollouts), "held_out": reward(sample(args.model, held, 5))}
    print(f"{len(rollouts)} rollouts, {len(kept)} in groups that differ; sampled reward before: own prompts "
          f"{before['own']:.3f}, held-out {before['held_out']:.3f}", flush=True)
    arms = []
    for mu in (1, 2, 4):
        out = f"{args.work}/mu{mu}"
        m, _ = train_grpo(args.model, None, kept, out, GRPOParams(num_generations=G, groups_per_step=4, num_iterations=mu,
                                                                 learning_rate=args.learning_rate, epsilon_high=0.28))
        arm = {"num_iterations": mu, "steps": m["steps"], "staleness_mean": m["staleness_mean"],
               "staleness_max": m["staleness_max"], "clip_fraction": m["clip_ratio"], "policy_shift": m["policy_shift"],
               "train_s": m["runtime_s"], "own": reward(sample(out, train, 1)), "held_out": reward(sample(out, held, 5))}
        arms.append(arm)
        print(f"num_iterations {mu}: {arm['steps']} steps, staleness mean {arm['staleness_mean']:.1f} max "
              f"{arm['staleness_max']}, clip {arm['clip_fraction']:.4f}, policy_shift {arm['policy_shift']:.4f}, "
              f"{arm['train_s']:.1f}s; reward own prompts {before['own']:.3f} -> {arm['own']:.3f}, held-out "
              f"{before['held_out']:.3f} -> {arm['held_out']:.3f}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"before": before, "arms": arms}, indent=1))


if __name__ == "__main__":
    main()
