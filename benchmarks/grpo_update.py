"""What one grpo update does to greedy accuracy, taken apart: one round's rollouts, trained by several arms side by
side from the same policy, each arm changing one thing about the update.

    .venv/bin/python benchmarks/grpo_update.py --model <micro round-0 policy>
    python benchmarks/grpo_update.py --tiny 512 8 8 1536 --bootstrap-lr 1e-3     # a larger policy, on a GPU

Without `--model`, it first makes the round-0 policy as micro's bootstrap does (a from-scratch tiny Llama of
`--tiny` hidden size, layers, heads and SwiGLU width; SFT on 600 demonstrations each of levels 1 and 2 plus 8% seed
demonstrations of level 3, `--bootstrap-steps` of batch 64 at `--bootstrap-lr`, cosine), so the policy's size is
the one thing that changes.

The round is as micro-grpo samples one: `--problems-per-level` (48) problems each of arith levels 3 and 2, 8
rollouts each at temperature 1, advantages as the grpo filter computes them (groups with equal rewards dropped).
Every arm takes as many optimizer steps (`--passes` (2) over the kept groups, 4 groups a step) at a constant
learning rate, no warmup, as a grpo round does:

- `grpo`: the advantages as stored, DAPO loss;
- `positive`: every negative advantage set to 0, so only the right rollouts train;
- `negative`: every positive advantage set to 0, so only the wrong rollouts train;
- `sft-like`: advantage 1 on every right rollout and 0 elsewhere: SFT on the right rollouts, through TRL's
  GRPOTrainer and the DAPO loss;
- `grpo-kl`: `grpo` with a KL to the starting policy, beta 0.1 (`reference: initial`);
- `grpo-cosine`: `grpo` with the learning rate decayed to 0 over the round's steps (`lr_scheduler: cosine`);
- `grpo-ptx`: `grpo` plus `--ptx-weight` times the NLL of 8 of the round-0 demonstrations in every forward pass
  (PPO-ptx, `train_policy.grpo.ptx_weight`): the demonstrations replayed beside the policy gradient, as rft's SFT
  replays them beside a round's samples;
- `sft`: coevo's SFT trainer (`train_sft`, as rft trains) on the same right rollouts' text, batches of 16;
- `sft-refs`: the same trainer on the domain's reference solutions to the round's problems: any update of this
  size, on data that is all correct;
- `sft-refs-cosine`: `sft-refs` with the rate decayed to 0 over the steps, as rft's rounds train.

Each arm runs at every `--learning-rates`. Per arm: optimizer steps, `policy_shift` (grpo arms), the sampled reward on
the round's own prompts (new samples), and greedy accuracy by level on `--eval-per-level` problems of levels 1 to 3
drawn apart from the round's (300 each: a paired difference of one problem is 0.33 points). Figures go to stdout and
to `--out` (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from components.config import BootstrapConfig  # noqa: E402
from components.domains import get_domain  # noqa: E402
from components.models.backends import HFBackend  # noqa: E402
from components.models.tiny import TinyLlamaConfig, create_tiny_llama  # noqa: E402
from components.rl.advantages import group_advantages  # noqa: E402
from components.training.data import demonstrations  # noqa: E402
from components.training.grpo import GRPOParams, text_ptx_examples, train_grpo  # noqa: E402
from components.training.sft import SFTParams, train_sft  # noqa: E402

G, GROUPS_PER_STEP = 8, 4
# grpo arms: (advantage from (stored advantage, right?), beta, learning-rate schedule); sft arms: their data.
GRPO_ARMS = {
    "grpo": (lambda a, right: a, 0.0, "constant"),
    "positive": (lambda a, right: max(a, 0.0), 0.0, "constant"),
    "negative": (lambda a, right: min(a, 0.0), 0.0, "constant"),
    "sft-like": (lambda a, right: 1.0 if right else 0.0, 0.0, "constant"),
    "grpo-kl": (lambda a, right: a, 0.1, "constant"),
    "grpo-cosine": (lambda a, right: a, 0.0, "cosine"),
    "grpo-ptx": (lambda a, right: a, 0.0, "constant"),
}
# configs/micro.yaml's bootstrap: its demonstrations are also grpo-ptx's
BOOTSTRAP = BootstrapConfig(levels=[1, 2], problems_per_level=600, seed_levels=[3], seed_fraction=0.08, steps=500,
                            batch_size=64, learning_rate=3e-3)
SFT_ARMS = {"sft": "constant", "sft-refs": "constant", "sft-refs-cosine": "cosine"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="the round's starting policy (a micro round-0 policy); omitted: bootstrap one")
    ap.add_argument("--tiny", type=int, nargs=4, metavar=("HIDDEN", "LAYERS", "HEADS", "WIDTH"),
                    default=[128, 2, 4, 384],
                    help="without --model: the from-scratch policy's size (micro's by default)")
    ap.add_argument("--bootstrap-steps", type=int, default=500)
    ap.add_argument("--bootstrap-lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0, help="without --model: the init's and the demonstrations' seed")
    ap.add_argument("--learning-rates", type=float, nargs="+", default=[1e-4, 5e-4])
    ap.add_argument("--arms", nargs="+", choices=[*GRPO_ARMS, *SFT_ARMS], default=[*GRPO_ARMS, *SFT_ARMS])
    ap.add_argument("--problems-per-level", type=int, default=48, help="the round's problems at levels 2 and 3 each")
    ap.add_argument("--passes", type=int, default=2, help="num_iterations: passes over the round's kept groups")
    ap.add_argument("--ptx-weight", type=float, default=1.0, help="grpo-ptx: the demonstrations' NLL weight")
    ap.add_argument("--eval-per-level", type=int, default=300)
    ap.add_argument("--work", default="/tmp/grpo-update", help="where the trained arms are written")
    ap.add_argument("--out", default=None, help="JSON file for the figures")
    args = ap.parse_args()
    d = get_domain("arith", max_level=3, digits=1, test_size=60)
    if args.model is None:
        args.model = _bootstrap(d, args)
    n = args.problems_per_level
    train = d.sample_problems(3, n, seed=10) + d.sample_problems(2, n, seed=20)
    seen = {p.prompt for p in train}
    held = {level: [p for p in d.sample_problems(level, args.eval_per_level + 2 * n, seed=70 + level)
                    if p.prompt not in seen][:args.eval_per_level] for level in (1, 2, 3)}
    prompt_ids = HFBackend(args.model, batch_size=256, progress=False).prompts.encode([p.prompt for p in train])

    def sample(model: str, seed: int):
        return HFBackend(model, batch_size=256, progress=False).generate_ids(
            prompt_ids, n=G, temperature=1.0, top_p=1.0, max_new_tokens=48, seed=seed)

    def right(p, text: str) -> float:
        return d.verify([text], [p.answer])[0] or 0.0

    def measure(model: str) -> dict[str, Any]:
        own = sum(right(p, x.text) for p, xs in zip(train, sample(model, 1)) for x in xs) / (G * len(train))
        b = HFBackend(model, batch_size=256, progress=False)
        greedy = {}
        for level, problems in held.items():
            out = b.generate([p.prompt for p in problems], n=1, temperature=0.0, top_p=1.0, max_new_tokens=48, seed=0)
            greedy[level] = sum(right(p, xs[0].text) for p, xs in zip(problems, out)) / len(problems)
        return {"own": own, "greedy": greedy}

    samples = sample(args.model, 0)
    rollouts = [{"trajectory_id": f"{p.problem_id}-{k}", "group_id": p.problem_id, "prompt_ids": ids,
                 "completion_ids": list(x.token_ids), "outcome": right(p, x.text), "prompt": p.prompt, "text": x.text}
                for p, ids, xs in zip(train, prompt_ids, samples, strict=True) for k, x in enumerate(xs)]
    adv = {a["trajectory_id"]: a for a in group_advantages(rollouts)}
    kept = [r | {"reward": adv[r["trajectory_id"]]["reward"], "advantage": adv[r["trajectory_id"]]["advantage"]}
            for r in rollouts if adv[r["trajectory_id"]]["kept"]]
    n_groups = len(kept) // G
    steps = n_groups * args.passes // GROUPS_PER_STEP
    sft_data = {"sft": [{"prompt": r["prompt"], "completion": r["text"]} for r in kept if r["outcome"] > 0],
                "sft-refs": [{"prompt": p.prompt, "completion": d.reference_solution(p)} for p in train]}
    sft_data["sft-refs-cosine"] = sft_data["sft-refs"]
    demos = demonstrations(d, BOOTSTRAP.model_copy(update={"steps": args.bootstrap_steps,
                                                           "learning_rate": args.bootstrap_lr}),
                           args.seed, "grpo-update")[1]
    ptx = text_ptx_examples(HFBackend(args.model, batch_size=256, progress=False).prompts,
                            [{"prompt": t["prompt"], "completion": t["completion"]} for t in demos])
    before = measure(args.model)
    print(f"{len(rollouts)} rollouts, {len(kept)} in {n_groups} groups that differ "
          f"({sum(r['outcome'] for r in kept):.0f} right); {steps} optimizer steps an arm; greedy accuracy on "
          f"{args.eval_per_level} problems a level", flush=True)
    print(f"{'before':10s}           {'':38s} own {before['own']:.3f}, greedy {_levels(before['greedy'])}", flush=True)
    arms = []
    for lr in args.learning_rates:
        for name in args.arms:
            out = f"{args.work}/{name}-lr{lr:g}"
            if name in SFT_ARMS:
                m = train_sft(args.model, sft_data[name], out, SFTParams(
                    max_steps=steps, batch_size=16, learning_rate=lr, warmup_ratio=0.0, lr_scheduler=SFT_ARMS[name],
                    logging_steps=1000))
                m |= {"clip_ratio": float("nan"), "policy_shift": float("nan")}
            else:
                transform, beta, schedule = GRPO_ARMS[name]
                these = [r | {"advantage": transform(r["advantage"], r["outcome"] > 0)} for r in kept]
                m, _ = train_grpo(args.model, args.model if beta else None, these, out, GRPOParams(
                    num_generations=G, groups_per_step=GROUPS_PER_STEP, num_iterations=args.passes, learning_rate=lr,
                    epsilon_high=0.28, beta=beta, lr_scheduler=schedule,
                    ptx_weight=args.ptx_weight if name.endswith("-ptx") else 0.0), ptx_examples=ptx)
            arm = {"arm": name, "learning_rate": lr, "steps": m["steps"], "clip_fraction": m["clip_ratio"],
                   "policy_shift": m["policy_shift"], **measure(out)}
            arms.append(arm)
            print(f"{name:10s} lr {lr:g}: {arm['steps']:2d} steps, clip {arm['clip_fraction']:.4f}, policy_shift "
                  f"{arm['policy_shift']:+.4f}; own {arm['own']:.3f}, greedy {_levels(arm['greedy'])}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"before": before, "arms": arms}, indent=1))


def _bootstrap(d, args) -> str:
    """Round 0 as configs/micro.yaml's bootstrap makes it, at the policy size `--tiny`."""
    hidden, layers, heads, width = args.tiny
    b = BOOTSTRAP.model_copy(update={"steps": args.bootstrap_steps, "learning_rate": args.bootstrap_lr})
    _, trajs, _ = demonstrations(d, b, args.seed, "grpo-update")
    init = create_tiny_llama(TinyLlamaConfig(hidden_size=hidden, num_layers=layers, num_heads=heads,
                                             intermediate_size=width), f"{args.work}/init", seed=args.seed)
    out = f"{args.work}/round0"
    m = train_sft(str(init), [{"prompt": t["prompt"], "completion": t["completion"]} for t in trajs], out,
                  SFTParams(max_steps=b.steps, batch_size=b.batch_size, learning_rate=b.learning_rate, seed=args.seed,
                            logging_steps=50))
    params = sum(p.numel() for p in HFBackend(out, progress=False).model.parameters())
    print(f"bootstrap: {params / 1e6:.2f}M parameters ({hidden}x{layers}, {heads} heads, width {width}), "
          f"{b.steps} steps at {b.learning_rate:g} on {len(trajs)} demonstrations, final loss {m['final_loss']:.4f}",
          flush=True)
    return out


def _levels(acc: dict[int, float]) -> str:
    return " ".join(f"L{k} {v:.3f}" for k, v in acc.items())


if __name__ == "__main__":
    main()
