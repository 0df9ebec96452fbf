"""Is MCTS-sampled training data worth its tokens? Arith at micro scale, `until_correct` sampling against
`generate.mcts`, the arms side by side, and the compute curves of a coevo run.

    .venv/bin/python benchmarks/search.py --workdir /tmp/search-bench --seeds 0 1 --rounds 4

Per seed:
- `until_correct`: configs/micro.yaml with rejection sampling in waves (`until_correct: 2`, `wave_size: 2`, up to
  8 samples per problem), its bootstrap, then `--rounds` rounds;
- `mcts`: the same config from that run's round-0 policy (`bootstrap.steps=0`), sampling by `generate.mcts`
  (K = 4 draws per expansion, 2 rollouts per valued prefix, up to 4 solutions returned per tree: its terminal
  leaves, then its nodes completed by their rollouts) with a token budget
  per problem equal to what `until_correct` spent per problem over its rounds, so both arms spend about the same;
- `mcts_dpo`: `mcts`, and DPO after the SFT on the tree's step pairs (`score.tree`, `filter.step_dpo_pairs`,
  `train_policy.method=sft+dpo`: a wrong answer against a right one parting from it at siblings apart in Q,
  MCTS-DPO), which cost no tokens beyond the search's;
- `mcts_rpo`: `mcts_dpo` with the chosen side's NLL added to the DPO loss (`train_policy.dpo.sft_weight=1`,
  RPO), which keeps DPO from lowering the likelihood of the right answers it prefers.

Each arm is a `coevo run` in its own process, one at a time; committed stages are skipped, so a second call only
reports. From the store (`v_round_summary`), per arm and seed: the round's whole budget (`budget_tokens`: samples,
and for MCTS its siblings, duplicates and rollouts) cumulated, and held-out greedy accuracy on level 3 (the
hardest) by round. The issue's figure: the final level-3 accuracy of mcts minus until_correct, per seed, against
the spread between seeds.

With `--curves`, configs/micro-coevo.yaml runs `--rounds` rounds from seed 0's round-0 policy (or
`--curves-model`), and its compute curves (greedy, maj@N, PRM best-of-N, PRM beam search, MCTS on level 3) are
printed for round 0 and the last round. Round 0 has no PRM of its own to guide the searches, so evaluate draws
no curve there: its curve is drawn here, by round 0's evaluate job run again outside the store with round 1's
PRM as its reward model (`round0_curve`). `--curves-only` skips the arms. Everything goes to `--out` (JSON) too.

    .venv/bin/python benchmarks/search.py --workdir /tmp/search-bench --curves-only --curves-model <round-0 policy>
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.grpo_vs_rft import _run  # noqa: E402 - `coevo run` in its own process, its output to a log

HARDEST = 3
UNTIL_CORRECT = ["generate.until_correct=2", "generate.wave_size=2"]
MCTS = "generate.mcts={{simulations: 64, expansions: 4, max_step_tokens: 16, rollouts: 2, token_budget: {budget}}}"
TREE_DPO = ["score.tree={pair_margin: 0.25}", "filter.step_dpo_pairs=true", "train_policy.method=sft+dpo",
            "train_policy.dpo={steps: 20, batch_size: 16, learning_rate: 5.0e-5, beta: 0.1, reference: previous}"]


def _rows(store, experiment: str) -> list[dict]:
    cols, rows = store.query("SELECT round, budget_tokens, greedy_acc_by_level FROM v_round_summary "
                             "WHERE experiment_id = ? ORDER BY round", [experiment])
    problems = dict(store.query("SELECT round, count(DISTINCT problem_id) FROM trajectories WHERE experiment_id = ? "
                                "AND purpose = 'train' GROUP BY round", [experiment])[1])
    out, total = [], 0
    for r in (dict(zip(cols, row)) for row in rows):
        total += r["budget_tokens"] or 0
        out.append({"round": r["round"], "budget_tokens": r["budget_tokens"], "cumulative_tokens": total,
                    "problems": problems.get(r["round"], 0), "hardest": r["greedy_acc_by_level"].get(HARDEST)})
    return out


def round0_curve(workdir: Path, config: Path, overrides: list[str]) -> list[dict]:
    """Round 0's compute curve, guided by round 1's PRM: round 0's evaluate job (the same seed, so the same samples)
    run again into a scratch folder that nothing commits, with the first PRM as the round's reward model."""
    import dataclasses
    import tempfile

    import pyarrow.parquet as pq

    from components.config import load_config
    from components.jobs.launch import execute
    from components.search.curves import curve_points
    from components.stages import build_spec
    from components.store import Store

    cfg = load_config(config, overrides)
    store = Store(workdir / "store")
    prm = store.committed_model(cfg.experiment, 1, "prm")
    if prm is None:
        raise SystemExit(f"{cfg.experiment}: no PRM committed in round 1 to guide round 0's curve")
    out = Path(tempfile.mkdtemp(prefix="coevo-round0-curve-")) / "a1"
    spec = build_spec(cfg, store, 0, "evaluate", 1, None, out_dir=out)
    spec = dataclasses.replace(spec, params={**spec.params, "prm_uri": prm["uri"], "prm_model_id": prm["model_id"]})
    with (workdir / f"{cfg.experiment}-round0-curve.log").open("w") as f:
        execute(cfg, spec, log=lambda line: print(line, file=f, flush=True))
    rows = [r for part in sorted(out.glob("part-evaluations-*.parquet")) for r in pq.read_table(part).to_pylist()]
    return curve_points(rows)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/search-bench"))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--curves", action="store_true", help="also run micro-coevo and print its compute curves")
    ap.add_argument("--curves-only", action="store_true", help="the curves alone, not the arms")
    ap.add_argument("--curves-model", help="the curves run's round-0 policy (default: seed 0's until_correct's)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from components.search.curves import curve_points
    from components.store import Store

    args.workdir.mkdir(parents=True, exist_ok=True)
    store = lambda: Store(args.workdir / "store")  # noqa: E731 - a fresh reader after each run's commits
    report: dict = {"arms": {}}
    for seed in [] if args.curves_only else args.seeds:
        base = [f"workdir={args.workdir}", f"seed={seed}", f"rounds={args.rounds}"]
        exp = f"bench-uc-s{seed}"
        print(f"[bench] seed {seed}: until_correct", flush=True)
        _run("configs/micro.yaml", [*base, f"experiment={exp}", *UNTIL_CORRECT], args.workdir / f"{exp}.log")
        uc = _rows(store(), exp)
        spent = [r for r in uc if r["round"] > 0]
        budget = round(sum(r["budget_tokens"] for r in spent) / max(sum(r["problems"] for r in spent), 1))
        model = store().committed_model(exp, 0, "policy")
        exp_m = f"bench-mcts-s{seed}"
        print(f"[bench] seed {seed}: mcts at {budget} tokens per problem", flush=True)
        arm = [*base, f"experiment={exp_m}", MCTS.format(budget=budget), "generate.samples_per_problem=4",
               f"policy.model={model['uri']}", "bootstrap.steps=0"]
        _run("configs/micro.yaml", arm, args.workdir / f"{exp_m}.log")
        exp_d = f"bench-mcts-dpo-s{seed}"
        print(f"[bench] seed {seed}: mcts, and DPO on the tree's step pairs", flush=True)
        _run("configs/micro.yaml", [*arm, f"experiment={exp_d}", *TREE_DPO], args.workdir / f"{exp_d}.log")
        exp_r = f"bench-mcts-rpo-s{seed}"
        print(f"[bench] seed {seed}: mcts, and RPO on the tree's step pairs", flush=True)
        _run("configs/micro.yaml", [*arm, f"experiment={exp_r}", *TREE_DPO, "train_policy.dpo.sft_weight=1.0"],
             args.workdir / f"{exp_r}.log")
        report["arms"].setdefault("until_correct", {})[seed] = uc
        report["arms"].setdefault("mcts", {})[seed] = _rows(store(), exp_m)
        report["arms"].setdefault("mcts_dpo", {})[seed] = _rows(store(), exp_d)
        report["arms"].setdefault("mcts_rpo", {})[seed] = _rows(store(), exp_r)
        report.setdefault("mcts_token_budget", {})[seed] = budget
    if not args.curves_only:
        _report_arms(report, args.seeds, store)
    if args.curves or args.curves_only:
        exp_c = "bench-curves"
        model = args.curves_model or store().committed_model(f"bench-uc-s{args.seeds[0]}", 0, "policy")["uri"]
        print(f"[bench] curves: micro-coevo, {args.rounds} rounds", flush=True)
        config = REPO / "configs" / "micro-coevo.yaml"
        overrides = [f"workdir={args.workdir}", f"experiment={exp_c}", f"rounds={args.rounds}", f"policy.model={model}",
                     "bootstrap.steps=0"]
        _run(str(config.relative_to(REPO)), overrides, args.workdir / f"{exp_c}.log")
        curves = curve_points(store().evaluations(exp_c))
        print("[bench] curves: round 0's, under round 1's PRM", flush=True)
        curves[0] = round0_curve(args.workdir, config, overrides)
        report["curves"] = curves
        from components.plots import compute_curve

        plot = compute_curve({0: curves[0], max(curves): curves[max(curves)]}, args.workdir / "compute-curves.png",
                             f"micro-coevo, round 0 (guided by round 1's PRM) and round {max(curves)}")
        print(f"[bench] the curves' plot: {plot}", flush=True)
        for rnd in (0, max(curves)):
            print(f"\ncompute curve, round {rnd}, level {curves[rnd][0]['level']} ({curves[rnd][0]['n']} problems): "
                  "accuracy at tokens per problem" + (" (round 1's PRM guides)" if rnd == 0 else ""))
            for method in ("greedy", "maj", "prm_bon", "beam", "mcts"):
                pts = sorted((p for p in curves[rnd] if p["method"] == method), key=lambda p: p["budget"])
                print(f"  {method:8s} " + "  ".join(f"N={p['budget']}: {p['accuracy']:.3f} @ {p['tokens']:.0f}"
                                                    for p in pts))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1, default=str))


def _report_arms(report: dict, seed_list: list[int], store) -> None:
    print(f"\nlevel-{HARDEST} greedy accuracy by round (cumulative budget tokens: samples, search and rollouts)")
    for arm, seeds in report["arms"].items():
        for seed, rows in seeds.items():
            print(f"{arm:14s} seed {seed}: " + "  ".join(f"r{r['round']} {r['hardest']:.3f} ({r['cumulative_tokens']})"
                                                        for r in rows), flush=True)
    final = {arm: {s: rows[-1]["hardest"] for s, rows in seeds.items()} for arm, seeds in report["arms"].items()}
    diffs = {arm: [final[arm][s] - final["until_correct"][s] for s in seed_list]
             for arm in ("mcts", "mcts_dpo", "mcts_rpo")}
    spread = {arm: max(v.values()) - min(v.values()) for arm, v in final.items()}
    report["final"], report["difference"], report["seed_spread"] = final, diffs, spread
    pairs = dict(store().query("SELECT experiment_id, count(*) FROM step_pairs JOIN trajectories USING (trajectory_id) "
                               "WHERE source = 'tree' GROUP BY 1")[1])
    report["tree_pairs"] = {s: pairs.get(f"bench-mcts-dpo-s{s}", 0) for s in seed_list}
    print(f"\nthe tree's step pairs, all rounds, per seed: {report['tree_pairs']}")
    for arm, d in diffs.items():
        print(f"the issue's figure: final level-{HARDEST} accuracy, {arm} - until_correct, per seed: "
              + ", ".join(f"{x:+.3f}" for x in d))
    print("goal +0.05 beyond the seed spread; spread: " + ", ".join(f"{a} {v:.3f}" for a, v in spread.items()))


if __name__ == "__main__":
    main()
