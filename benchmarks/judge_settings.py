"""A round's judge (filter.judge: round) trained again with other train_reward settings, from the spec its run
stored: how each ranks the round's right answers, against the domain's step checker.

    .venv/bin/python benchmarks/judge_settings.py --workdir /tmp/jb --experiment prm-coevo-judge-cap-s0 --round 1 \\
        --set learning_rate=1e-4 --set learning_rate=3e-4 --set steps=50,learning_rate=3e-4

Each --set is one variant: comma-separated `key=value` pairs of `train_reward` (values as JSON: 3e-4, false).
The stored settings train first, to check that training again reproduces the run's judge. Every variant reads
the same committed inputs (the run's labels and demonstrations) and trains in a scratch folder through `python -m
components.jobs train_reward`, started as a run starts it, with one torch thread; nothing is written to the store.

For each it prints the ranking (`components/filtering.py::judge_ranking`: the AUC, and the catch rate of the best
threshold in hindsight that drops at most 5% of the sound answers) and what the filter would have done with it at
`filter.min_step_score`, capped by `filter.judge_max_drop` where the run set it: the unsound answers caught and the
sound ones dropped.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ["COEVO_TORCH_THREADS"] = "1"  # as the benchmark's runs train: results then do not depend on the load


def _variant(text: str) -> dict:
    """`key=value,key=value` as train_reward settings; a value is read as JSON, else kept as a string."""
    out = {}
    for pair in text.split(","):
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(f"--set {text!r}: expected key=value[,key=value...]")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


def _with(spec: dict, settings: dict) -> dict:
    """The stored spec with `settings` over its train_reward; a bad key or value exits, naming it."""
    from components.config import load_config_dict

    spec = json.loads(json.dumps(spec))
    spec["config"]["train_reward"].update(settings)
    try:
        load_config_dict(spec["config"], source=f"({spec['experiment']} round {spec['round']} train_reward's spec)")
    except ValueError as e:
        sys.exit(f"--set {','.join(f'{k}={v}' for k, v in settings.items())}: {e}")
    return spec


def _train(spec: dict, settings: dict, scratch: Path) -> Path:
    """Round r's train_reward job with `settings` over the stored ones, in its own folder under `scratch`."""
    from components.jobs.launch import StageJobError, run_job

    spec = _with(spec, settings)
    name = "-".join(f"{k}={v}" for k, v in settings.items()) or "stored"
    out = scratch / f"{spec['experiment']}-r{spec['round']}" / name
    if not (out / "manifest.json").exists():
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(out.with_name(out.name + ".tmp"), ignore_errors=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        spec["out_dir"], spec["attempt"] = str(out), 999
        path = out.with_name(out.name + ".spec.json")
        path.write_text(json.dumps(spec))
        try:  # as a run starts the job: its environment (PYTHONHASHSEED=0), one torch thread
            run_job("train_reward", path, log=lambda line: None, timeout_s=3600)
        except StageJobError as e:
            sys.exit(f"{name}: {e}")
    return out


def main() -> None:
    import duckdb

    from components.config import load_config_dict
    from components.domains import get_domain
    from components.filtering import judge_catch_rates, judge_ranking, judge_threshold, step_rejects
    from components.store import Store

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--experiment", required=True)
    ap.add_argument("--round", type=int, required=True)
    ap.add_argument("--set", dest="variants", type=_variant, action="append", default=[],
                    help="one variant: key=value[,key=value...] of train_reward")
    ap.add_argument("--scratch", type=Path, help="where the variants train (default: <workdir>/judge-settings)")
    args = ap.parse_args()
    store = Store(args.workdir / "store")
    run = store.committed_run(args.experiment, args.round, "train_reward")
    if run is None:
        sys.exit(f"{args.experiment}: no committed train_reward in round {args.round} under {args.workdir}")
    spec = json.loads(run["spec_json"])
    cfg = load_config_dict(spec["config"], source=f"spec of {run['stage_run_id']}")
    if not cfg.filter.judges_in_round:
        sys.exit(f"{args.experiment}: filter.judge is {cfg.filter.judge!r}; its train_reward judges nothing")
    domain = get_domain(cfg.domain.name, **cfg.domain.options)
    answers = {r["trajectory_id"]: domain.check_steps(r["prompt"], r["completion"]) for r in store.rows(
        "SELECT t.trajectory_id, t.prompt, t.completion FROM trajectories t JOIN verifications v USING (trajectory_id) "
        "WHERE t.experiment_id = ? AND t.round = ? AND t.purpose = 'train' AND v.correct", [args.experiment, args.round])}
    if not any(ok is False for ok in answers.values()):
        sys.exit(f"{args.experiment}: round {args.round} has no right answer that the step checker rejects")
    for settings in args.variants:  # every variant checked before the first trains
        _with(spec, settings)
    scratch = (args.scratch or args.workdir / "judge-settings").resolve()
    print(f"{args.experiment}, round {args.round}: {len(answers)} right answers, "
          f"{sum(ok is False for ok in answers.values())} of them unsound; the filter: min_step_score "
          f"{cfg.filter.min_step_score}, judge_max_drop {cfg.filter.judge_max_drop}")
    print(f"{'variant':<40} {'auc':>6} {'hindsight':>9} {'threshold':>9} {'caught':>7} {'sound dropped':>13}")
    for settings in [{}, *args.variants]:
        out = _train(spec, settings, scratch)
        weakest = dict(duckdb.sql(f"SELECT trajectory_id, value FROM read_parquet('{out}/part-scores-*.parquet') "
                                  "WHERE scorer = 'judge' AND aggregate = 'min'").fetchall())
        ranked = judge_ranking(weakest, answers)
        # What the run's filter would have dropped with this judge, measured as the filter measures it.
        t = judge_threshold([weakest[a] for a in answers if a in weakest], cfg.filter.min_step_score,
                            cfg.filter.judge_max_drop)
        rates = judge_catch_rates({a: True for a in answers if a in weakest}, answers,
                                  step_rejects(list(answers), prm_min=weakest, min_step_score=t))
        name = ", ".join(f"{k}={v}" for k, v in settings.items()) or "as stored"
        print(f"{name:<40} {ranked['judge_auc']:>6.3f} {ranked['judge_hindsight_catch']:>9.3f} "
              f"{'-' if t is None else format(t, '.3f'):>9} {rates.get('judge_catch_rate', float('nan')):>7.3f} "
              f"{rates.get('judge_false_reject_rate', float('nan')):>13.3f}", flush=True)


if __name__ == "__main__":
    main()
