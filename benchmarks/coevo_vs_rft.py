"""Does `coevo` beat the `rft` baseline on the same generation budget? All arms, one command.

    .venv/bin/python benchmarks/coevo_vs_rft.py --parallel              # the embedded default: rft, rft-until1, coevo
    .venv/bin/python benchmarks/coevo_vs_rft.py --rounds 2 --workdir /tmp/bench
    .venv/bin/python benchmarks/coevo_vs_rft.py --only coevo --tag v4   # rerun a changed arm beside the others
    .venv/bin/python benchmarks/coevo_vs_rft.py --only rft-n4 coevo-n4 --parallel   # 4 draws for every problem

Runs (each `coevo run`, its own process; committed stages are skipped, so a second call only reports):
- `rft`: configs/arith.yaml as shipped (outcome filter plus the domain's step checker, no reward model;
  8 samples per problem, 6 rounds): the baseline;
- `coevo`: configs/arith-coevo.yaml (the same checker, plus Monte Carlo labels and a PRM with the
  likelihood head; one draw at a time, up to 4, until a problem has a right answer, DART-Math's rejection
  sampling; 11 rounds), whose Monte Carlo rollouts count in its budget;
- `rft-until1`: rft with coevo's sampler and rounds: the control that tells a saving from sampling less
  apart from one the reward model brings;
- on `--only`: `coevo-cls` (coevo with the classifier PRM head instead of the likelihood head),
  `rft-n4` (rft with 4 samples for every problem) and `coevo-n4` (coevo likewise, 6 rounds, classifier
  head: arith-coevo.yaml before the sampler and the likelihood head).

Then, from the store (`v_round_summary`, `evaluations`), it prints:
1. the budget: cumulative generated tokens (sampling + Monte Carlo rollouts) per round and recipe;
2. figure 1, for each coevo arm: the tokens it needed to reach `rft`'s final held-out accuracy (ratio;
   <= 0.5 is the target), and its accuracy at `rft`'s final budget minus `rft`'s (>= +10 points is the
   target); the same against its control (`rft-until1`, `rft-n4` for `coevo-n4`);
3. figure 2, for each coevo arm: the last round's PRM against oracle step labels on held-out samples:
   step F1 (>= 0.85 is the target) and PRM best-of-8 vs maj@8 vs greedy (Let's Verify Step by Step's
   ordering);
and writes `accuracy_vs_tokens.png` beside the store. `--parallel` runs the arms at once (one torch
thread each).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _coevo_sampling() -> list[str]:
    """arith-coevo.yaml's sampler and rounds as overrides, read from it: the control samples as coevo does."""
    from components.config import load_config

    cfg = load_config(REPO / "configs" / "arith-coevo.yaml")
    g = cfg.generate
    return [f"generate.samples_per_problem={g.samples_per_problem}", f"generate.until_correct={g.until_correct}",
            f"generate.wave_size={g.wave_size}", f"rounds={cfg.rounds}"]


CLASSIFIER = ["train_reward.head=classifier", "train_reward.lm_weight=0"]
RUNS = {
    "rft": ("configs/arith.yaml", ["experiment=bench-rft"]),
    "coevo": ("configs/arith-coevo.yaml", ["experiment=bench-coevo"]),
    # The control: rft with arith-coevo.yaml's sampler and rounds, so a saving from sampling less is not
    # credited to the reward model.
    "rft-until1": ("configs/arith.yaml", ["experiment=bench-rft-until1", *_coevo_sampling()]),
    # coevo with the classifier PRM head (TRL's token classification) instead of the likelihood head.
    "coevo-cls": ("configs/arith-coevo.yaml", ["experiment=bench-coevo-cls", *CLASSIFIER]),
    # 4 samples for every problem: rft's control for coevo-n4, arith-coevo.yaml before the sampler and the
    # likelihood head.
    "rft-n4": ("configs/arith.yaml", ["experiment=bench-rft-n4", "generate.samples_per_problem=4"]),
    "coevo-n4": ("configs/arith-coevo.yaml", ["experiment=bench-coevo-n4", "generate.until_correct=null",
                                              "rounds=6", *CLASSIFIER]),
}
DEFAULT_ARMS = ["rft", "rft-until1", "coevo"]  # coevo-cls, rft-n4 and coevo-n4 run on --only
# Figure 1 compares each coevo arm with the baseline and with its control (the same sampling, no reward model).
BASELINES = {"coevo": ("rft", "rft-until1"), "coevo-cls": ("rft", "rft-until1"), "coevo-n4": ("rft", "rft-n4")}


def _launch(name: str, workdir: Path, rounds: int | None) -> subprocess.Popen:
    config, sets = RUNS[name][0], [s for s in RUNS[name][1] if not s.startswith("experiment=")]
    sets = [f"experiment={_experiment(name)}", *sets]
    # One DuckDB store for both (its commits retry on the lock), but an MLflow SQLite file each: two
    # processes creating and migrating one SQLite file at once fail.
    sets = [*sets, f"workdir={workdir}", f"tracking.tracking_uri=sqlite:///{workdir / f'mlflow-{name}.db'}"]
    sets += [f"rounds={rounds}"] if rounds is not None else []
    cmd = [str(Path(sys.executable).parent / "coevo"), "run", "--config", str(REPO / config)]
    for s in sets:
        cmd += ["--set", s]
    log = open(_log_path(name, workdir), "w")
    # A busy machine starts Prefect's temporary server slowly: 180 s, not the default 20 s.
    env = {"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180", "COEVO_TORCH_THREADS": "1"} | os.environ
    env["PREFECT_HOME"] = str(workdir / ".prefect" / name)
    Path(env["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)
    print(f"[{name}] {' '.join(cmd)}  (log: {log.name})", flush=True)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)


TAGS: dict[str, str] = {}  # arm -> suffix of its experiment name (--tag), so a changed arm reruns beside the others


def _log_path(name: str, workdir: Path) -> Path:
    return workdir / (f"{name}-{TAGS[name]}.log" if name in TAGS else f"{name}.log")


NAMES: dict[str, str] = {}  # arm -> experiment to report it from (--experiment ARM=NAME)


def _experiment(name: str) -> str:
    if name in NAMES:
        return NAMES[name]
    base = next(s.split("=", 1)[1] for s in RUNS[name][1] if s.startswith("experiment="))
    return f"{base}-{TAGS[name]}" if name in TAGS else base


def _summary(store, name: str) -> list[dict]:
    rows = store.rows("SELECT round, budget_tokens, greedy_acc, greedy_acc_by_level FROM v_round_summary "
                      "WHERE experiment_id=? ORDER BY round", [_experiment(name)])
    total = 0
    for r in rows:
        total += int(r["budget_tokens"] or 0)
        r["cum_tokens"] = total
        r["hard_acc"] = r["greedy_acc_by_level"][max(r["greedy_acc_by_level"])]
    return rows


def _tokens_to_reach(rows: list[dict], key: str, target: float) -> int | None:
    return next((r["cum_tokens"] for r in rows if r["round"] > 0 and r[key] >= target - 1e-12), None)


def _acc_at_budget(rows: list[dict], key: str, budget: int) -> float:
    """Accuracy of the last round whose cumulative budget fits in `budget`."""
    fit = [r for r in rows if r["cum_tokens"] <= budget]
    return fit[-1][key] if fit else float("nan")


def report(workdir: Path, names: list[str]) -> dict:
    from components.plots import _save, plt
    from components.store import Store

    store = Store(workdir / "store")
    data = {n: rows for n in names if (rows := _summary(store, n))}
    print("\n== budget and held-out greedy accuracy per round (hard = hardest level) ==")
    print(f"{'recipe':<12} {'round':>5} {'cum tokens':>11} {'all levels':>10} {'hard':>6}")
    for n, rows in data.items():
        for r in rows:
            print(f"{n:<12} {r['round']:>5} {r['cum_tokens']:>11,} {r['greedy_acc']:>10.3f} {r['hard_acc']:>6.3f}")
    out: dict = {"rounds": data}
    for arm, baseline in ((a, b) for a in BASELINES if a in data for b in BASELINES[a] if b in data):
        base, co = data[baseline], data[arm]
        print(f"\n== figure 1: {arm} vs {baseline} on the generation budget ==")
        for key, label in (("greedy_acc", "all levels"), ("hard_acc", "hardest level")):
            target, budget = base[-1][key], base[-1]["cum_tokens"]
            need = _tokens_to_reach(co, key, target)
            ratio = need / budget if need else float("inf")
            gap = _acc_at_budget(co, key, budget) - target
            suffix = ("" if arm == "coevo" else f"_{arm}") + ("" if baseline == "rft" else f"_vs_{baseline}")
            out[f"fig1_{key}{suffix}"] = {
                "baseline_final": target, "baseline_tokens": budget, "coevo_tokens_to_match": need,
                "token_ratio": ratio, "coevo_minus_baseline_at_budget": gap}
            print(f"[{label}] {baseline} final {target:.3f} after {budget:,} tokens; {arm} reaches it after "
                  f"{need if need is None else f'{need:,}'} tokens: ratio {ratio:.2f} (target <= 0.50); "
                  f"at {baseline}'s budget {arm} is {100 * gap:+.1f} points (target >= +10)")
    for arm in (a for a in BASELINES if a in data):
        last = data[arm][-1]["round"]
        ev = dict(store.query("SELECT metric, value FROM evaluations WHERE experiment_id=? AND round=? AND level=-1",
                              [_experiment(arm), last])[1])
        if "prm_step_f1" in ev:
            print(f"\n== figure 2 ({arm}): the round-{last} PRM on held-out samples, against oracle step labels ==")
            print(f"step F1 {ev['prm_step_f1']:.3f} (target >= 0.85; precision {ev['prm_step_precision']:.3f}, "
                  f"recall {ev['prm_step_recall']:.3f}); erroneous-step F1 {ev['prm_error_f1']:.3f}; "
                  f"ProcessBench F1 {ev['processbench_f1']:.3f}")
            bon, maj, greedy = ev.get("prm_bon_at_8"), ev.get("maj_at_8"), ev["greedy_acc"]
            if bon is not None and maj is not None:
                print(f"PRM best-of-8 {bon:.3f} > maj@8 {maj:.3f} > greedy {greedy:.3f}: "
                      f"{'holds' if bon > maj > greedy else 'does NOT hold'}")
            keys = ("prm_step_f1", "prm_error_f1", "processbench_f1", "prm_bon_at_8", "maj_at_8", "greedy_acc",
                    "prm_bon_at_16", "maj_at_16")
            out["fig2" + ("" if arm == "coevo" else f"_{arm}")] = {k: ev.get(k) for k in keys}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), dpi=110)
    for ax, key, label in ((axes[0], "greedy_acc", "all levels"), (axes[1], "hard_acc", "hardest level")):
        for n, rows in data.items():
            ax.plot([r["cum_tokens"] / 1000 for r in rows], [100 * r[key] for r in rows], marker="o", label=n)
        ax.set_xlabel("cumulative generated tokens, Monte Carlo rollouts included (thousands)")
        ax.set_ylabel(f"held-out greedy accuracy, {label} (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("coevo vs rft on the same generation budget")
    plot = _save(fig, workdir / "accuracy_vs_tokens.png")
    (workdir / "coevo_vs_rft.json").write_text(json.dumps(out, indent=2, default=str))
    print(f"\nplot: {plot}\njson: {workdir / 'coevo_vs_rft.json'}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=REPO / "workdir" / "bench")
    ap.add_argument("--rounds", type=int, default=None, help="override every config's rounds")
    ap.add_argument("--only", nargs="+", choices=sorted(RUNS), default=DEFAULT_ARMS)
    ap.add_argument("--parallel", action="store_true", help="run the recipes at the same time")
    ap.add_argument("--report-only", action="store_true", help="skip the runs; report what the store holds")
    ap.add_argument("--tag", default=None, help="suffix the experiment names of the --only arms (bench-coevo-TAG): "
                                                "rerun a changed arm in the same store and compare it with the others")
    ap.add_argument("--experiment", action="append", default=[], metavar="ARM=NAME",
                    help="with --report-only: report ARM from the store's experiment NAME (a run made under "
                         "another tag or an earlier definition of the arm); repeatable")
    args = ap.parse_args()
    for item in args.experiment:
        arm, _, name = item.partition("=")
        if arm not in RUNS or not name:
            ap.error(f"--experiment {item!r}: expected ARM=NAME with ARM one of {', '.join(RUNS)}")
        NAMES[arm] = name
    if NAMES and not args.report_only:
        ap.error("--experiment only renames what a report reads: add --report-only")
    TAGS.update({n: args.tag for n in args.only} if args.tag else {})
    args.workdir = args.workdir.resolve()
    args.workdir.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        t0 = time.perf_counter()
        if args.parallel:  # DuckDB admits one writer: the flows retry on its lock, commits are short
            procs = {n: _launch(n, args.workdir, args.rounds) for n in args.only}
        else:
            procs = {}
            for n in args.only:
                procs[n] = _launch(n, args.workdir, args.rounds)
                procs[n].wait()
        for n, p in procs.items():
            if p.wait() != 0:
                sys.exit(f"[{n}] failed (exit {p.returncode}); see {_log_path(n, args.workdir)}")
        print(f"runs done in {time.perf_counter() - t0:.0f}s")
    report(args.workdir, list(RUNS))  # every arm the store holds


if __name__ == "__main__":
    main()
