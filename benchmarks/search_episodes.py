"""MCTS over turns against plain sampling of episodes, side by side from one policy on one environment's problems:
how many problems each solves, how many right episodes it hands back, and what it generated.

    coevo run --config configs/calculator.yaml --set rounds=0 --set workdir=/tmp/calc   # a round-0 policy
    .venv/bin/python benchmarks/search_episodes.py --model /tmp/calc/calculator/r0/bootstrap/a1/model

Per level, `--problems` problems. Plain: `--n` episodes each through the batched loop. MCTS: one tree each
(`--simulations`, `--expansions` draws a leaf, `--rollouts` a valued node, `--widening` progressive widening's
alpha), up to `--n` episodes from it, the whole search's tokens counted (expansions, duplicate draws, rollouts);
`--equal-tokens` stops it at the tokens plain sampling spent. Both at `--temperature`. Figures go to stdout and to
`--out` (JSON).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from components.envs import get_env  # noqa: E402
from components.envs.rollout import run_episodes  # noqa: E402
from components.models.backends import HFBackend  # noqa: E402
from components.search.episodes import episode_mcts  # noqa: E402
from components.search.mcts import MCTSConfig  # noqa: E402
from components.stages.base import agent_sampler  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a policy with a chat template that calls tools")
    ap.add_argument("--env", default="calculator")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--problems", type=int, default=30)
    ap.add_argument("--n", type=int, default=4, help="episodes per problem")
    ap.add_argument("--simulations", type=int, default=8)
    ap.add_argument("--expansions", type=int, default=3)
    ap.add_argument("--rollouts", type=int, default=1)
    ap.add_argument("--widening", type=float, default=0.0,
                    help="progressive widening's alpha (0: each node draws once)")
    ap.add_argument("--equal-tokens", action="store_true",
                    help="give the search the tokens plain sampling spent on the level as its budget (and enough "
                         "simulations to spend them)")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--out", default=None, help="JSON file for the figures")
    args = ap.parse_args()
    env = get_env(args.env)
    backend = HFBackend(args.model, batch_size=64, progress=False)

    def sampler():
        return agent_sampler(backend, args.model, temperature=args.temperature, top_p=1.0,
                             max_new_tokens=args.max_new_tokens, seed=0)

    rows = []
    for level in args.levels:
        problems = env.sample_problems(level, args.problems, seed=100 + level)
        t0 = time.perf_counter()
        batch, _ = run_episodes(env, sampler(), problems, n=args.n, experiment="bench", round=1, purpose="train",
                                policy_model_id=None, seed=0)
        plain_s = time.perf_counter() - t0
        right = [r.problem.problem_id for r in batch.records if r.right]
        plain = {"episodes": len(batch.records), "right": len(right), "solved": len(set(right)),
                 "tokens": sum(t["num_tokens"] for t in batch.trajectories), "seconds": plain_s}
        t0 = time.perf_counter()
        budget = plain["tokens"] if args.equal_tokens else None
        cfg = MCTSConfig(simulations=args.simulations, expansions=args.expansions, widening=args.widening,
                         token_budget=budget)
        _, picked, stats = episode_mcts(env, sampler(), problems, cfg, rollouts=args.rollouts, n=args.n)
        mcts_s = time.perf_counter() - t0
        eps = [rec for got in picked for _, rec in got]
        right = [r.problem.problem_id for r in eps if r.right]
        mcts = {"episodes": len(eps), "right": len(right), "solved": len(set(right)),
                "tokens": stats["generated_tokens"], "seconds": mcts_s, "nodes": stats["nodes"]}
        rows.append({"level": level, "problems": len(problems), "plain": plain, "mcts": mcts})
        for name, r in (("plain", plain), ("mcts", mcts)):
            print(f"level {level} {name:5s}: solved {r['solved']:2d}/{len(problems)}, right episodes "
                  f"{r['right']:3d}/{r['episodes']:3d}, {r['tokens']:6d} tokens generated, {r['seconds']:.1f}s",
                  flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
