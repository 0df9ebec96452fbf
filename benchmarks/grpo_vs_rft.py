"""Does recipe grpo reach rft's accuracy on fewer generated tokens? Arith at micro scale, the arms side by side.

    .venv/bin/python benchmarks/grpo_vs_rft.py --workdir /tmp/grpo-bench --seeds 0 1 --rounds 4

Per seed, `rft` runs configs/micro.yaml (its bootstrap, then `--rounds` rounds); every other arm starts from that
run's round-0 policy as it is (`bootstrap.steps=0`), so all arms of a seed start from the same model:
- `grpo`: configs/micro-grpo.yaml as shipped (DAPO loss, 32 problems per level x 8 rollouts, lr 2e-5, 2 passes);
- `grpo-lr1e-4`: the same at learning rate 1e-4;
- `grpo-lr2e-4`, `grpo-lr5e-4`, `grpo-lr5e-4-wide` (with `--arms`): at 2e-4, at rft's learning rate, then at
  rft's with 64 problems a level;
- `grpo-lr1e-4-cosine` (with `--arms`): 1e-4 decayed to 0 over each round's steps.
- any `rft-lr<rate>` (with `--arms`): rft at that SFT learning rate, from rft's round-0 policy; the issue's figure
  is reported against every rft arm;
- any `grpo-lr<rate>[-cosine][-p<N>][-implicit|-prm]` (with `--arms`): that rate, constant or decayed, N problems
  a level, and step credit from the implicit PRM or from a PRM the rounds train (as in grpo_shaping.py), which the
  report sets against the same arm without it.

`--tiny HIDDEN LAYERS HEADS WIDTH` gives every arm a policy of that size instead of micro's 128x2 (its rft arm
bootstraps it), and `--set KEY=VALUE` adds an override to every arm, for example rft's own learning rate.

Each is a `coevo run` in its own process, one at a time; committed stages are skipped, so a second call only
reports. Then, from the store (`v_round_summary`), per arm and seed: cumulative generated tokens and held-out
greedy accuracy on level 3 (the hardest) by round, and the issue's figure: the tokens grpo needed to first reach
rft's final level-3 accuracy, as a share of rft's (goal: at most 0.7), or "never". Written to `--out` (JSON) too.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

ARMS = {
    "rft": ("configs/micro.yaml", []),
    "grpo": ("configs/micro-grpo.yaml", []),
    # rft's SFT takes 150 steps at 5e-4 a round; grpo as shipped about 20 at 2e-5. This gives grpo rft's step size
    # and twice the problems a level (still about 0.7x rft's sampled tokens a round); `grpo-lr<rate>` the rate alone.
    "grpo-lr5e-4-wide": ("configs/micro-grpo.yaml", ["train_policy.grpo.learning_rate=5e-4",
                                                      "generate.problems_per_level=64"]),
}
HARDEST = 3
# Step credit at weight 0.5 (benchmarks/grpo_shaping.py): from the implicit PRM, or from a PRM grpo's rounds train
# on Monte Carlo step labels (k=2), whose labelling rollouts count in the arm's tokens.
STEP = ["train_policy.grpo.credit=step", "train_policy.grpo.shaping_weight=0.5"]
SHAPING = {
    "implicit": ["score.reward_model=implicit", *STEP],
    "prm": ["score.mc_rollouts=2", "train_reward.enabled=true", "train_reward.steps=100", "score.reward_model=prm",
            *STEP],
}
ARM = re.compile(r"grpo-lr([0-9.]+(?:e-?[0-9]+)?)(-cosine)?(?:-p([0-9]+))?(?:-(implicit|prm))?")


def arm_overrides(arm: str) -> tuple[str, list[str]]:
    """An arm's config and overrides: a named arm, `rft-lr<rate>` (rft's SFT at that rate), or
    `grpo-lr<rate>[-cosine][-p<N>][-implicit|-prm]`: the rate, decayed to 0 over each round's steps as rft's SFT
    rounds end (docs/grpo.md, "Why"), N problems a level a round, and step credit.

    >>> arm_overrides("grpo-lr1e-4-cosine")
    ('configs/micro-grpo.yaml', ['train_policy.grpo.learning_rate=1e-4', 'train_policy.grpo.lr_scheduler=cosine'])
    >>> arm_overrides("grpo-lr1e-5-p96")[1]
    ['train_policy.grpo.learning_rate=1e-5', 'generate.problems_per_level=96']
    >>> arm_overrides("grpo-lr1e-5-p96-implicit")[1][2:]
    ['score.reward_model=implicit', 'train_policy.grpo.credit=step', 'train_policy.grpo.shaping_weight=0.5']
    >>> arm_overrides("rft-lr1e-5")
    ('configs/micro.yaml', ['train_policy.learning_rate=1e-5'])
    >>> arm_overrides("grpo-fast")
    Traceback (most recent call last):
    argparse.ArgumentTypeError: unknown arm 'grpo-fast': choose rft, grpo, grpo-lr5e-4-wide, rft-lr<rate> or grpo-lr<rate>[-cosine][-p<N>][-implicit|-prm]
    """
    if arm in ARMS:
        return ARMS[arm]
    if m := re.fullmatch(r"rft-lr([0-9.]+(?:e-?[0-9]+)?)", arm):
        return "configs/micro.yaml", [f"train_policy.learning_rate={m[1]}"]
    m = ARM.fullmatch(arm)
    if m is None:
        raise argparse.ArgumentTypeError(f"unknown arm {arm!r}: choose {', '.join(ARMS)}, rft-lr<rate> or "
                                         "grpo-lr<rate>[-cosine][-p<N>][-implicit|-prm]")
    return "configs/micro-grpo.yaml", [f"train_policy.grpo.learning_rate={m[1]}",
                                       *(["train_policy.grpo.lr_scheduler=cosine"] if m[2] else []),
                                       *([f"generate.problems_per_level={m[3]}"] if m[3] else []),
                                       *(SHAPING[m[4]] if m[4] else [])]


def unshaped(arm: str) -> str | None:
    """The arm a step-credit arm is measured against: itself without the credit.

    >>> unshaped("grpo-lr1e-5-p96-prm"), unshaped("grpo-lr1e-5-p96")
    ('grpo-lr1e-5-p96', None)
    """
    m = ARM.fullmatch(arm)
    return arm[: m.start(4) - 1] if m and m[4] else None


def _arm(name: str) -> str:
    """`--arms`'s type: a name `arm_overrides` knows, or argparse's error."""
    arm_overrides(name)
    return name


def _run(config: str, overrides: list[str], log: Path) -> None:
    cmd = [str(REPO / ".venv" / "bin" / "coevo"), "run", "--config", str(REPO / config)]
    for o in overrides:
        cmd += ["--set", o]
    with log.open("w") as f:
        subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, check=True)


def _rows(store, experiment: str) -> list[dict]:
    """Per round: cumulative sampled tokens (`tokens`), cumulative tokens with Monte Carlo labelling's (`budget`),
    and level-3 greedy accuracy."""
    cols, rows = store.query("SELECT round, generated_tokens, budget_tokens, greedy_acc_by_level FROM v_round_summary "
                             "WHERE experiment_id = ? ORDER BY round", [experiment])
    out, total, budget = [], 0, 0
    for r in (dict(zip(cols, row)) for row in rows):
        total += r["generated_tokens"] or 0
        budget += r["budget_tokens"] or 0
        out.append({"round": r["round"], "tokens": total, "budget": budget,
                    "hardest": r["greedy_acc_by_level"].get(HARDEST)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/grpo-bench"))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--arms", nargs="+", type=_arm, default=["rft", "grpo", "grpo-lr1e-4"],
                    help="rft always runs first: every other arm starts from its round-0 policy")
    ap.add_argument("--tiny", type=int, nargs=4, metavar=("HIDDEN", "LAYERS", "HEADS", "WIDTH"),
                    help="the policy's size for every arm (default: micro's 128 2 4 384)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="an override for every arm (repeatable)")
    args = ap.parse_args()
    size = [] if args.tiny is None else [f"policy.tiny.{k}={v}" for k, v in zip(
        ("hidden_size", "num_layers", "num_heads", "intermediate_size"), args.tiny)]
    from components.store import Store

    args.workdir.mkdir(parents=True, exist_ok=True)
    report = {}
    for seed in args.seeds:
        base = [f"workdir={args.workdir}", f"seed={seed}", f"rounds={args.rounds}", *size, *args.overrides]
        for arm in ["rft", *[a for a in args.arms if a != "rft"]]:
            config, extra = arm_overrides(arm)
            exp = f"bench-{arm}-s{seed}"
            start = []
            if arm != "rft":
                model = Store(args.workdir / "store").committed_model(f"bench-rft-s{seed}", 0, "policy")
                start = [f"policy.model={model['uri']}", "bootstrap.steps=0"]
            print(f"[bench] seed {seed}: {arm}", flush=True)
            _run(config, [*base, f"experiment={exp}", *extra, *start], args.workdir / f"{exp}.log")
            report.setdefault(arm, {})[seed] = _rows(Store(args.workdir / "store"), exp)
    print(f"\nlevel-{HARDEST} greedy accuracy by round (cumulative generated tokens)")
    for arm, seeds in report.items():
        for seed, rows in seeds.items():
            print(f"{arm:12s} seed {seed}: " + "  ".join(f"r{r['round']} {r['hardest']:.3f} ({r['tokens']})" for r in rows))
    print("\nthe issue's figure: tokens to first reach rft's final level-3 accuracy, as a share of rft's (goal <= 0.7)")
    for base in [a for a in report if a.startswith("rft")]:
        for arm in [a for a in report if not a.startswith("rft")]:
            for seed in args.seeds:
                rft = report[base][seed]
                target, budget = rft[-1]["hardest"], rft[-1]["tokens"]
                hit = next((r for r in report[arm][seed] if r["round"] > 0 and r["hardest"] >= target), None)
                share = "never" if hit is None else f"{hit['tokens'] / budget:.2f}"
                print(f"{arm:12s} seed {seed}: {base}'s final {target:.3f} at {budget} tokens; {arm}: {share}")
    shaped = [a for a in report if unshaped(a) in report]
    if shaped:
        print(f"\nstep credit: final level-{HARDEST} accuracy minus the same arm's without it, per seed, and its tokens "
              "(sampled + labelling) as a multiple (goal: +0.05 beyond the seeds' spread)")
    for arm in shaped:
        base = report[unshaped(arm)]
        print(f"{arm:12s} " + "  ".join(
            f"seed {s}: {report[arm][s][-1]['hardest'] - base[s][-1]['hardest']:+.3f} at "
            f"{report[arm][s][-1]['budget'] / max(base[s][-1]['budget'], 1):.2f}x" for s in args.seeds))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
