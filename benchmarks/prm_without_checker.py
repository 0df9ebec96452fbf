"""Does the PRM earn its keep where no hand-written step checker exists? All arms, one command.

    .venv/bin/python benchmarks/prm_without_checker.py --parallel 2             # every arm, seeds 0 and 1
    .venv/bin/python benchmarks/prm_without_checker.py --only coevo-outcome --seeds 0
    .venv/bin/python benchmarks/prm_without_checker.py --report-only

The embedded arith task (configs/arith.yaml, configs/arith-coevo.yaml). Every arm starts from ONE bootstrap
(`prm-boot`, run first: round 0 of configs/arith.yaml), samples as arith-coevo.yaml does (one draw at a time,
up to 4, until a problem has a right answer) for the same number of rounds, and counts the same tokens
(sampling, Monte Carlo rollouts and discarded search draws). The arms differ only in this:

- `rft-outcome`: rft with the outcome verifier alone (`filter.check_steps=false`);
- `coevo-outcome`: coevo with `check_steps=false`; its PRM, trained on Monte Carlo labels (and the round-0
  demonstrations, as arith-coevo.yaml does), never on oracle labels or the checker, decides which right
  answers to keep (`filter.min_step_score`) and ranks them;
- `coevo-explore`: coevo-outcome whose sampler redraws the step the PRM flags, at a higher temperature
  (`generate.search.redraw_temperature`);
- `coevo-stepdpo`: coevo-outcome whose policy, after its SFT, trains by DPO on step-level pairs from the Monte
  Carlo search (`filter.step_dpo_pairs`, `train_policy.method=sft+dpo`; Step-DPO, MCTS-DPO);
- `coevo-judge`: coevo-outcome whose judge is the round's own PRM, from round 1: it trains on the wrong answers'
  labels, the demonstrations and right answers an earlier filter kept, never on the right answers it judges, and
  re-judges the replay pool (`filter.judge=round`);
- `coevo-judge-cap`: coevo-judge whose threshold is calibrated each round on the answers it judges: it drops at
  most 30% of them, the lowest scored first (`filter.judge_max_drop=0.3`); `coevo-judge-cap20` at most 20%;
  `coevo-judge-cap-lr` the 30% cap with a PRM that trains at a third of the learning rate, `-lr4` at a tenth,
  `coevo-judge-cap20-lr` the 20% cap at a third;
- `coevo-judge-big`: coevo-judge-cap-lr whose PRM starts from its own backbone, four times the policy's size and
  trained on the same demonstrations (PRM_BOOT, built first), not from the policy that sampled the round;
  `coevo-judge-big-t30` the same at threshold 0.3 (`filter.min_step_score`) instead of one half, and
  `coevo-judge-big-t30-cap40` that with a 40% cap, `-cap50` with a 50% cap;
- `coevo-judge-both`: coevo-judge-cap-lr whose filter, from round 2, drops a right answer only where the previous
  round's PRM also scores it low (`filter.judge=round_and_previous`);
- `rft-confjudge`: rft-outcome whose judge is the sampler's confidence (`score.reward_model=confidence`): a step
  scores the probability of its least likely token under the policy that sampled it. Nothing trains and nothing
  rolls out, so it costs rft-outcome's tokens. It drops the right answers whose weakest step scores below
  CONF_THRESHOLD, at most 30% of them, the lowest first;
- `rft-bigconf`: rft-confjudge whose judge is PRM_BOOT's backbone (`score.confidence_model`), fixed for the run:
  a model that did not write the answers. It drops those below BIG_CONF_THRESHOLD, at most 40% of them. It costs
  rft-outcome's tokens too;
- `rft-checker`: rft with the domain's step checker (`check_steps=true`): the reference, not a competitor.

Each arm runs once per seed (`--seeds`, default 0 1): a seed changes sampling and training, not the bootstrap.
Then, from the store, it prints per arm and round the cumulative tokens, held-out greedy accuracy (all levels,
hardest level), the share of right greedy answers whose steps do not check (skipped operations, cancelling
slips), and the filter's catch rate (the share of right answers with unsound steps that the learned judges
reject, against the share of sound ones they reject); then the seed-to-seed spread, and last the recovery
ratios, (coevo - rft-outcome) / (rft-checker - rft-outcome) on final accuracy at the seeds the arm and both
baselines ran, with a 90% interval over those seeds (a paired bootstrap), the catch rates and the tokens;
and how each learned judge ranks the right answers whatever its threshold (the AUC, and the catch rate of the best
threshold in hindsight that drops at most 5% of the sound ones; for filter.judge=round, also the round's PRM and the
previous round's together, by their z-scores summed and as a rule that drops only what fails both;
`--sampler-ranking` adds the sampler's likelihood and its confidence, each alone and summed with the judge's score,
`--mc-ranking` Monte Carlo rollouts from the answers' own prefixes), what each would catch dropping as many as
the judge did, the filter's judge replayed at other fixed thresholds (THRESHOLDS), and the sound right answers the
judges dropped, by level.
It writes `prm_without_checker.png` and `.json` beside the store.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from statistics import mean

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

BOOT = "prm-boot"
# The judge's own backbone for `coevo-judge-big`: round 0 of configs/arith.yaml at four times the width's parameters
# (3.24M: hidden 256, MLP 704), trained as prm-boot is, on the same demonstrations; not the policy that samples.
PRM_BOOT = ("prm-boot-prm", ["policy.tiny.hidden_size=256", "policy.tiny.intermediate_size=704"])
# The PRM's verdict on a step is P(good); a right answer whose weakest step it scores below one half is dropped.
PRM_FILTER = ["filter.check_steps=false", "filter.min_step_score=0.5"]
# coevo-judge-cap-lr's judge on PRM_BOOT's backbone: the 30% cap, a third of arith-coevo.yaml's learning rate.
BIG_JUDGE = [*PRM_FILTER, "filter.judge=round", "filter.judge_max_drop=0.3", "train_reward.learning_rate=3e-4",
             "train_reward.model={prm_boot}"]
# The sampler's confidence judge drops a right answer one of whose tokens it sampled at a probability below this.
CONF_THRESHOLD = 0.5
# ...and PRM_BOOT's backbone's confidence (rft-bigconf) below this: a larger model's least likely token in a sound
# step is still far less likely than the sampler's own.
BIG_CONF_THRESHOLD = 0.005
ARMS: dict[str, tuple[str, list[str]]] = {
    "rft-outcome": ("configs/arith.yaml", ["filter.check_steps=false"]),
    "coevo-outcome": ("configs/arith-coevo.yaml", PRM_FILTER),
    "coevo-explore": ("configs/arith-coevo.yaml",
                      [*PRM_FILTER, 'generate.search={"max_tries": 2, "threshold": 0.5, "redraw_temperature": 1.2}']),
    # coevo-outcome whose policy also trains by DPO on the Monte Carlo search's step-level pairs, after its SFT.
    "coevo-stepdpo": ("configs/arith-coevo.yaml", [*PRM_FILTER, "filter.step_dpo_pairs=true",
                                                   "train_policy.method=sft+dpo"]),
    # coevo-outcome whose judge is the round's own PRM, trained without the round's right answers (filter.judge).
    "coevo-judge": ("configs/arith-coevo.yaml", [*PRM_FILTER, "filter.judge=round"]),
    # coevo-judge whose threshold is calibrated on the answers it judges: it drops at most 30% of a round's right
    # answers (rft-outcome's rounds held 5-36% unsound ones), the lowest scored first.
    "coevo-judge-cap": ("configs/arith-coevo.yaml", [*PRM_FILTER, "filter.judge=round", "filter.judge_max_drop=0.3"]),
    "coevo-judge-cap20": ("configs/arith-coevo.yaml", [*PRM_FILTER, "filter.judge=round",
                                                       "filter.judge_max_drop=0.2"]),
    # coevo-judge-cap whose PRM trains at a third of arith-coevo.yaml's learning rate: round 1's judge then ranks the
    # right answers better (docs/prm-without-checker.md, "How the judges rank").
    "coevo-judge-cap-lr": ("configs/arith-coevo.yaml", [*PRM_FILTER, "filter.judge=round", "filter.judge_max_drop=0.3",
                                                        "train_reward.learning_rate=3e-4"]),
    "coevo-judge-cap20-lr": ("configs/arith-coevo.yaml", [*PRM_FILTER, "filter.judge=round",
                                                          "filter.judge_max_drop=0.2",
                                                          "train_reward.learning_rate=3e-4"]),
    # coevo-judge-cap-lr whose PRM starts from its own larger backbone (PRM_BOOT), not the policy (train_reward.model).
    "coevo-judge-big": ("configs/arith-coevo.yaml", BIG_JUDGE),
    # coevo-judge-big at a lower threshold: its unsound right answers score near 0, and its sound ones' lower tail
    # (the longest chains) reaches below one half (docs/prm-without-checker.md, "The big judge at four seeds").
    "coevo-judge-big-t30": ("configs/arith-coevo.yaml", [*BIG_JUDGE, "filter.min_step_score=0.3"]),
    # coevo-judge-big-t30 whose cap is 40%: round 1's unsound right answers were 33-40% of its right answers, more
    # than the 30% cap lets a judge drop; from round 2 on the threshold, not the cap, binds.
    "coevo-judge-big-t30-cap40": ("configs/arith-coevo.yaml", [*BIG_JUDGE, "filter.min_step_score=0.3",
                                                               "filter.judge_max_drop=0.4"]),
    # ...and at 50%: replayed on the eight seeds' stored round 1 (threshold 0.3), 50% catches 0.976 of round 1's
    # unsound right answers and drops 21.2% of its sound ones, 40% 0.905 and 9.6%; from round 2 on both 0.956, 3.0%.
    "coevo-judge-big-t30-cap50": ("configs/arith-coevo.yaml", [*BIG_JUDGE, "filter.min_step_score=0.3",
                                                               "filter.judge_max_drop=0.5"]),
    "coevo-judge-cap-lr4": ("configs/arith-coevo.yaml", [*PRM_FILTER, "filter.judge=round", "filter.judge_max_drop=0.3",
                                                         "train_reward.learning_rate=1e-4"]),
    # coevo-judge-cap-lr whose drops from round 2 need the previous round's PRM to agree (round_and_previous).
    "coevo-judge-both": ("configs/arith-coevo.yaml", [*PRM_FILTER, "filter.judge=round_and_previous",
                                                      "filter.judge_max_drop=0.3", "train_reward.learning_rate=3e-4"]),
    "rft-confjudge": ("configs/arith.yaml", ["filter.check_steps=false", "score.reward_model=confidence",
                                             f"filter.min_step_score={CONF_THRESHOLD}", "filter.judge_max_drop=0.3"]),
    # rft-confjudge whose judge is PRM_BOOT's backbone, which did not write the answers and never trains: its
    # confidence, replayed on rft-outcome's right answers at seeds 0-11, ranks them at an AUC of 0.95-0.996; at
    # BIG_CONF_THRESHOLD it caught 0.90-0.93 of level 3's unsound right answers and dropped 8-9% of its sound ones.
    "rft-bigconf": ("configs/arith.yaml", ["filter.check_steps=false", "score.reward_model=confidence",
                                           "score.confidence_model={prm_boot}",
                                           f"filter.min_step_score={BIG_CONF_THRESHOLD}", "filter.judge_max_drop=0.4"]),
    "rft-checker": ("configs/arith.yaml", ["filter.check_steps=true"]),
}
# The fixed thresholds `_ranking` replays each filter's judge at (filter.min_step_score; the run's cap kept).
THRESHOLDS = (0.5, 0.3, 0.2, 0.1)
# Who ranks the right answers in `_ranking`: the round's own PRM, the previous round's, the two together (the sum of
# their z-scores within the round; filter.judge=round arms, whose score stage still runs the previous round's PRM),
# the sampler's confidence
# (its least likely token, as rft-confjudge's filter scored it), the sampler's likelihood, the filter's judge with
# the likelihood (`both`, the sum of their z-scores within the round) and with the confidence (`both-conf`), and the
# answer's own Monte Carlo values (its weakest prefix's share of the sampler's rollouts that reach the answer).
RANKERS = ("judge", "prm", "judge+prm", "confidence", "sampler", "both", "both-conf", "mc")
# A `selections` reason that starts with one of these: a learned judge dropped the right answer (the checker apart).
JUDGED = ("prm:", "confidence:", "mc_hard:")
# The filter's own judge among them: the round's PRM (filter.judge=round), else the previous round's, else the
# sampler's confidence (rft-confjudge).
FILTER_JUDGES = ("judge", "prm", "confidence")
# The arms a judge filters, against rft-outcome and rft-checker.
JUDGE_ARMS = ("coevo-outcome", "coevo-explore", "coevo-stepdpo", "coevo-judge", "coevo-judge-cap", "coevo-judge-cap20",
              "coevo-judge-cap-lr", "coevo-judge-cap20-lr", "coevo-judge-big", "coevo-judge-big-t30",
              "coevo-judge-big-t30-cap40", "coevo-judge-big-t30-cap50",
              "coevo-judge-cap-lr4", "coevo-judge-both", "rft-confjudge", "rft-bigconf")


def _sampler() -> list[str]:
    """arith-coevo.yaml's sampler, read from it, so the rft arms sample as the coevo arms do."""
    from components.config import load_config

    g = load_config(REPO / "configs" / "arith-coevo.yaml").generate
    return [f"generate.samples_per_problem={g.samples_per_problem}", f"generate.until_correct={g.until_correct}",
            f"generate.wave_size={g.wave_size}"]


def experiment(arm: str, seed: int) -> str:
    return f"prm-{arm}-s{seed}"


def _command(config: str, sets: list[str], workdir: Path, name: str) -> tuple[list[str], dict[str, str]]:
    # One DuckDB store (commits retry on its lock), one MLflow SQLite file per run: two processes creating and
    # migrating one SQLite file at once fail.
    sets = [*sets, f"workdir={workdir}", f"tracking.tracking_uri=sqlite:///{workdir / f'mlflow-{name}.db'}"]
    cmd = [str(Path(sys.executable).parent / "coevo"), "run", "--config", str(REPO / config)]
    for s in sets:
        cmd += ["--set", s]
    env = os.environ | {"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180", "COEVO_TORCH_THREADS": "1",
                        "PREFECT_HOME": str(workdir / ".prefect" / name)}
    Path(env["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)
    return cmd, env


def _run_all(jobs: dict[str, tuple[list[str], dict[str, str]]], workdir: Path, parallel: int) -> None:
    """Each job a `coevo run` process, at most `parallel` at once; exits naming the first that fails."""
    todo, running = list(jobs), {}
    while todo or running:
        while todo and len(running) < parallel:
            name = todo.pop(0)
            cmd, env = jobs[name]
            log = open(workdir / f"{name}.log", "w")
            print(f"[{name}] {' '.join(cmd)}  (log: {log.name})", flush=True)
            running[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
        time.sleep(2)
        for name, p in list(running.items()):
            if p.poll() is not None:
                del running[name]
                if p.returncode != 0:
                    for other in running.values():
                        other.terminate()
                    sys.exit(f"[{name}] failed (exit {p.returncode}); see {workdir / f'{name}.log'}")
                print(f"[{name}] done", flush=True)


def run(workdir: Path, arms: list[str], seeds: list[int], rounds: int, parallel: int) -> None:
    from components.store import Store

    cmd, env = _command("configs/arith.yaml", [f"experiment={BOOT}", "rounds=0"], workdir, BOOT)
    _run_all({BOOT: (cmd, env)}, workdir, 1)
    boot = Store(workdir / "store").committed_model(BOOT, 0, "policy")
    start = [f"policy.model={boot['uri']}", "bootstrap.steps=0", f"rounds={rounds}", *_sampler()]
    prm_boot = None
    if any("{prm_boot}" in s for arm in arms for s in ARMS[arm][1]):
        name, sets = PRM_BOOT
        _run_all({name: _command("configs/arith.yaml", [f"experiment={name}", "rounds=0", *sets], workdir, name)},
                 workdir, 1)
        prm_boot = Store(workdir / "store").committed_model(name, 0, "policy")["uri"]
    jobs = {}
    for seed in seeds:
        for arm in arms:
            config, sets = ARMS[arm]
            name = experiment(arm, seed)
            sets = [s.replace("{prm_boot}", str(prm_boot)) for s in sets]
            jobs[name] = _command(config, [f"experiment={name}", f"seed={seed}", *start, *sets], workdir, name)
    _run_all(jobs, workdir, parallel)


# -- the report ---------------------------------------------------------------------------------

def _rounds(store, name: str) -> list[dict]:
    rows = store.rows("SELECT round, budget_tokens, greedy_acc, greedy_acc_by_level FROM v_round_summary "
                      "WHERE experiment_id = ? ORDER BY round", [name])
    ev = {(r, m): v for r, m, v in store.query(
        "SELECT round, metric, value FROM evaluations WHERE experiment_id = ? AND level = -1 "
        "AND metric IN ('greedy_unsound_rate', 'greedy_sound_acc')", [name])[1]}
    filt = {r: json.loads(m) for r, m in store.query(
        "SELECT round, metrics_json FROM stage_runs WHERE experiment_id = ? AND stage = 'filter' "
        "AND status = 'committed'", [name])[1]}
    total = 0
    for r in rows:
        total += int(r["budget_tokens"] or 0)
        f = filt.get(r["round"], {})
        r |= {"cum_tokens": total, "hard_acc": r["greedy_acc_by_level"][max(r["greedy_acc_by_level"])],
              "unsound": ev.get((r["round"], "greedy_unsound_rate")),
              "sound_acc": ev.get((r["round"], "greedy_sound_acc")),
              "right_unsound": f.get("right_unsound"), "right_answers": f.get("right_answers"),
              "catch": f.get("judge_catch_rate"), "false_reject": f.get("judge_false_reject_rate")}
    return rows


def _unsound_kinds(store, names: list[str]) -> tuple[dict[str, tuple[int, int]], dict[int, tuple[int, int]]]:
    """Right training answers whose steps the checker rejects, by kind: a step the oracle calls wrong
    (a slip that a later one cancels), or every step right but one skipped or added; (dropped by a
    learned judge, all), over every round. And the sound ones (the checker accepts them) by level: (dropped by a
    learned judge, all)."""
    from components.domains.arith import ArithDomain

    d = ArithDomain()
    rows = store.rows("""
        SELECT t.level, t.prompt, t.completion, sel.reason,
               bool_and(l.value = 1.0) FILTER (WHERE l.source = 'oracle') AS oracle_ok
        FROM trajectories t JOIN verifications v USING (trajectory_id)
        JOIN selections sel ON sel.trajectory_id = t.trajectory_id AND sel.purpose = 'policy_sft'
        LEFT JOIN step_labels l ON l.trajectory_id = t.trajectory_id
        WHERE t.experiment_id IN (SELECT unnest(?)) AND t.purpose = 'train' AND v.correct GROUP BY ALL""", [names])
    kinds: dict[str, list[int]] = {"a wrong step": [0, 0], "a skipped or added step": [0, 0]}
    sound: dict[int, list[int]] = {}
    for r in rows:
        ok = d.check_steps(r["prompt"], r["completion"])
        if ok is False:
            k = kinds["a skipped or added step" if r["oracle_ok"] else "a wrong step"]
        elif ok:
            k = sound.setdefault(r["level"], [0, 0])
        else:
            continue
        k[0] += r["reason"].startswith(JUDGED)
        k[1] += 1
    return {k: (c, n) for k, (c, n) in kinds.items() if n}, {lv: (c, n) for lv, (c, n) in sorted(sound.items())}


def _ranking(store, name: str, sampler: bool, mc: bool = False) -> dict[int, dict[str, dict]]:
    """Per round, how each learned judge ranks the round's right answers against the checker, whatever its
    threshold (`judge_ranking`): the round's own PRM (`judge`, filter.judge=round) and the previous round's
    (`prm`), and with `sampler`, the policy that sampled them, by its log-likelihood of the whole answer and by
    its confidence (`confidence`, its least likely token), and `both` and `both-conf`: the filter's judge plus
    either (z-scores summed); with `mc`, Monte Carlo labels of the right
    answers' own prefixes, as score labels wrong ones (arith-coevo.yaml's k, temperature and length), ranked by the
    weakest. Each ranker also gets `at_count`: the catch and false-reject rates had it dropped as many right
    answers as the filter's judge did, its lowest first."""
    from components.domains.arith import ArithDomain
    from components.filtering import judge_ranking, judge_threshold

    d = ArithDomain()
    rows = store.rows("""
        SELECT t.round, t.trajectory_id, t.prompt, t.completion, t.token_ids, m.uri AS sampler, sc.scorer, sc.value,
               p.answer AS answer_ref
        FROM trajectories t JOIN verifications v USING (trajectory_id) JOIN problems p USING (problem_id)
        JOIN scores sc ON sc.trajectory_id = t.trajectory_id AND sc.aggregate = 'min'
                      AND sc.scorer IN ('judge', 'prm', 'confidence')
        JOIN stage_runs sr ON sr.stage_run_id = sc.stage_run_id AND sr.round = t.round AND sr.status = 'committed'
        JOIN models m ON m.model_id = t.policy_model_id
        WHERE t.experiment_id = ? AND t.purpose = 'train' AND v.correct""", [name])
    judged: dict[int, set[str]] = {}
    for rnd, tid in store.query("""
        SELECT t.round, t.trajectory_id FROM trajectories t JOIN verifications v USING (trajectory_id)
        JOIN selections sel ON sel.trajectory_id = t.trajectory_id AND sel.purpose = 'policy_sft'
        WHERE t.experiment_id = ? AND t.purpose = 'train' AND v.correct
          AND split_part(sel.reason, ':', 1) IN (SELECT unnest(?))""", [name, [j.rstrip(":") for j in JUDGED]])[1]:
        judged.setdefault(rnd, set()).add(tid)
    dropped = {rnd: len(ts) for rnd, ts in judged.items()}
    checker = {r["trajectory_id"]: d.check_steps(r["prompt"], r["completion"]) for r in rows}
    weakest: dict[tuple[int, str], dict[str, float]] = {}
    for r in rows:
        weakest.setdefault((r["round"], r["scorer"]), {})[r["trajectory_id"]] = r["value"]
    both_prms: dict[int, dict] = {}
    config = store.query("SELECT config_json FROM experiments WHERE experiment_id = ?", [name])[1]
    f = json.loads(config[0][0])["filter"] if config else {}
    for rnd in sorted({r["round"] for r in rows}):
        judge, prev = weakest.get((rnd, "judge")), weakest.get((rnd, "prm"))
        if judge and prev and (common := [t for t in judge if t in prev]):
            zj, zp = _z({t: judge[t] for t in common}), _z({t: prev[t] for t in common})
            weakest[(rnd, "judge+prm")] = {t: zj[t] + zp[t] for t in common}
            both_prms[rnd] = _and_rule(f, judged.get(rnd, set()), prev, checker)
    if sampler:
        for rnd in {r["round"] for r in rows}:
            answers = {r["trajectory_id"]: r for r in rows if r["round"] == rnd}
            weakest[(rnd, "sampler")] = ll = _sampler_loglik(list(answers.values()))
            own = next((weakest[(rnd, w)] for w in FILTER_JUDGES if (rnd, w) in weakest), None)
            if (rnd, "confidence") not in weakest:
                weakest[(rnd, "confidence")] = _sampler_confidence(store, list(answers.values()))
            conf = weakest[(rnd, "confidence")]
            if own and own is not conf:
                zj, zl, zc = _z(own), _z({t: ll[t] for t in own}), _z({t: conf[t] for t in own})
                weakest[(rnd, "both")] = {t: zj[t] + zl[t] for t in own}
                weakest[(rnd, "both-conf")] = {t: zj[t] + zc[t] for t in own}
    if mc:
        for rnd in {r["round"] for r in rows}:
            weakest[(rnd, "mc")] = _mc_weakest(store, list({r["trajectory_id"]: r for r in rows if r["round"] == rnd}
                                                           .values()), rnd)
    out: dict[int, dict[str, dict]] = {}
    for (rnd, who), scores in sorted(weakest.items()):
        if ranked := judge_ranking(scores, checker):
            lowest = sorted(scores, key=scores.get)[:dropped.get(rnd, 0)]
            at = _rates(lowest, scores, checker)
            out.setdefault(rnd, {})[who] = ranked | {"at_count": at, "dropped": len(lowest),
                                                     "unsound": sum(checker[t] is False for t in scores),
                                                     "sound": sum(checker[t] is True for t in scores)}
            if who in FILTER_JUDGES:  # a P(good): the run's threshold rule at other thresholds, its cap kept
                cuts = {t: judge_threshold(list(scores.values()), t, f.get("judge_max_drop")) for t in THRESHOLDS}
                out[rnd][who]["at_threshold"] = {t: _rates([x for x in scores if scores[x] < c], scores, checker)
                                                 for t, c in cuts.items()}
    for rnd, rule in both_prms.items():
        out.setdefault(rnd, {})["judge-and-prm"] = rule
    return out


def _rates(drops, pool, checker: dict[str, bool | None]) -> dict[str, float | None]:
    """The share of `pool`'s unsound right answers that `drops` holds (catch), and of its sound ones (false_reject)."""
    return {k: sum(checker[t] is want for t in drops) / n if (n := sum(checker[t] is want for t in pool)) else None
            for k, want in (("catch", False), ("false_reject", True))}


def _and_rule(f: dict, judged: set[str], prev: dict[str, float], checker: dict[str, bool | None]) -> dict:
    """What the filter would have dropped had a right answer to fail both judges: the round's own PRM (the filter's
    drops, `judged`) and the previous round's (`prev`, each right answer's weakest step), under the run's own
    threshold rule (`f`, its filter settings: min_step_score, capped by judge_max_drop). The catch and
    false-reject rates of that rule, and of the filter as it ran, over the right answers both scored."""
    from components.filtering import judge_threshold

    cut = judge_threshold(list(prev.values()), f["min_step_score"], f["judge_max_drop"])
    both = {t for t in judged if t in prev and prev[t] < cut}
    return {"unsound": sum(checker[t] is False for t in prev), "sound": sum(checker[t] is True for t in prev),
            "and": _rates(both, prev, checker), "filter": _rates(judged & set(prev), prev, checker)}


def _mc_weakest(store, answers: list[dict], rnd: int) -> dict[str, float]:
    """Each answer's weakest Monte Carlo value over its own non-final prefixes (1.0 for a one-step answer): the
    share of k rollouts from the prefix, by the policy that sampled it, that reach the reference answer."""
    from components.config import load_config
    from components.domains.arith import ArithDomain
    from components.labeling import mc_step_labels
    from components.models.backends import get_backend

    cfg = load_config(REPO / "configs" / "arith-coevo.yaml")
    sc = cfg.score
    steps = _answer_steps(store, answers)
    out = {a["trajectory_id"]: 1.0 for a in answers}
    for uri in {a["sampler"] for a in answers}:
        items = [{"trajectory_id": a["trajectory_id"], "prompt": a["prompt"], "steps": steps[a["trajectory_id"]],
                  "answer_ref": a["answer_ref"]} for a in answers if a["sampler"] == uri]
        labels, _ = mc_step_labels(ArithDomain(), get_backend("hf", uri, progress=False), items, k=sc.mc_rollouts,
                                   temperature=sc.mc_temperature, seed=rnd,
                                   max_new_tokens=sc.mc_max_new_tokens or cfg.generate.max_new_tokens)
        for lab in labels:
            if lab["source"] == "mc_soft" and lab["num_rollouts"]:
                out[lab["trajectory_id"]] = min(out[lab["trajectory_id"]], lab["value"])
    return out


def _answer_steps(store, answers: list[dict]) -> dict[str, list[str]]:
    """Each answer's stored steps, in order."""
    steps: dict[str, list[str]] = {}
    for r in store.rows("SELECT trajectory_id, text FROM steps WHERE trajectory_id IN (SELECT unnest(?)) "
                        "ORDER BY trajectory_id, step_index", [[a["trajectory_id"] for a in answers]]):
        steps.setdefault(r["trajectory_id"], []).append(r["text"])
    return steps


def _z(scores: dict[str, float]) -> dict[str, float]:
    """Each score's distance from their mean in standard deviations (all 0 when they are equal)."""
    m = mean(scores.values())
    sd = (sum((v - m) ** 2 for v in scores.values()) / len(scores)) ** 0.5 or 1.0
    return {t: (v - m) / sd for t, v in scores.items()}


def _sampler_confidence(store, answers: list[dict]) -> dict[str, float]:
    """Each answer's weakest step under the sampler's confidence, as `score.reward_model=confidence` scores it."""
    from components.domains.arith import ArithDomain
    from components.rewards import load_reward_model

    steps = _answer_steps(store, answers)
    out = {}
    for uri in {a["sampler"] for a in answers}:
        mine = [a for a in answers if a["sampler"] == uri]
        rm = load_reward_model("confidence", uri, separator=ArithDomain().step_separator)
        scores = rm.score([a["prompt"] for a in mine], [a["completion"] for a in mine],
                          [steps[a["trajectory_id"]] for a in mine])
        out |= {a["trajectory_id"]: min(sc) for a, sc in zip(mine, scores)}
    return out


def _sampler_loglik(answers: list[dict]) -> dict[str, float]:
    """Each answer's log-likelihood (the sum over its sampled tokens) under the policy that sampled it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = {}
    for uri in {a["sampler"] for a in answers}:
        model, tok = AutoModelForCausalLM.from_pretrained(uri).eval(), AutoTokenizer.from_pretrained(uri)
        for a in (a for a in answers if a["sampler"] == uri):
            prompt, ids = tok(a["prompt"])["input_ids"], list(a["token_ids"])
            with torch.no_grad():
                logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].float()
            out[a["trajectory_id"]] = float(torch.log_softmax(logits, -1).gather(1, torch.tensor(ids)[:, None]).sum())
    return out


def _pooled(rows: list[dict]) -> tuple[float | None, float | None]:
    """Catch and false-reject rates over all rounds, weighted by the right answers they are shares of."""
    bad = [(r["catch"], r["right_unsound"]) for r in rows if r["catch"] is not None]
    good = [(r["false_reject"], r["right_answers"] - r["right_unsound"]) for r in rows if r["false_reject"] is not None]
    n_bad, n_good = sum(n for _, n in bad), sum(n for _, n in good)
    return (sum(c * n for c, n in bad) / n_bad if n_bad else None,
            sum(c * n for c, n in good) / n_good if n_good else None)


def _pooled_ranked(rows: list[dict], key: str) -> tuple[float | None, float | None]:
    """`_pooled` over `_ranking`'s rows: each row's `key` rates, weighted by its unsound and sound right answers."""
    return _pooled([{"catch": r[key]["catch"], "right_unsound": r["unsound"], "false_reject": r[key]["false_reject"],
                     "right_answers": r["unsound"] + r["sound"]} for r in rows])


def _within(rows: list[dict], budget: int) -> dict:
    """The last round whose cumulative tokens fit in `budget` (round 0 costs none)."""
    return [r for r in rows if r["cum_tokens"] <= budget][-1]


def _f(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def report(workdir: Path, seeds: list[int], sampler: bool = False, mc: bool = False) -> dict:
    from components.plots import _save, plt
    from components.store import Store

    store = Store(workdir / "store")
    data = {(arm, s): rows for arm in ARMS for s in seeds if (rows := _rounds(store, experiment(arm, s)))}
    print("\n== per round: cumulative tokens, held-out greedy accuracy, unsound right answers, the filter's judges ==")
    print(f"{'arm':<14} {'seed':>4} {'round':>5} {'cum tokens':>11} {'all':>6} {'hard':>6} {'unsound':>8} "
          f"{'right bad/all':>14} {'catch':>6} {'false rej':>9}")
    for (arm, s), rows in data.items():
        for r in rows:
            counts = "" if r["right_answers"] is None else f"{r['right_unsound']:.0f}/{r['right_answers']:.0f}"
            print(f"{arm:<14} {s:>4} {r['round']:>5} {r['cum_tokens']:>11,} {r['greedy_acc']:>6.3f} "
                  f"{r['hard_acc']:>6.3f} {_f(r['unsound']):>8} {counts:>14} {_f(r['catch']):>6} "
                  f"{_f(r['false_reject']):>9}")
    final: dict[str, dict] = {}
    for arm in ARMS:
        runs = [data[(arm, s)] for s in seeds if (arm, s) in data]
        if not runs:
            continue
        last = [rows[-1] for rows in runs]
        catch = [_pooled(rows) for rows in runs]
        ran = [s for s in seeds if (arm, s) in data]
        per_seed = {s: {"all": data[(arm, s)][-1]["greedy_acc"], "hard": data[(arm, s)][-1]["hard_acc"],
                        "tokens": data[(arm, s)][-1]["cum_tokens"]} for s in ran}
        final[arm] = _over(per_seed, ran) | {
            "seeds": ran, "rounds": last[0]["round"], "per_seed": per_seed,
            "unsound": mean(r["unsound"] for r in last) if all(r["unsound"] is not None for r in last) else None,
            "catch": mean(c for c, _ in catch) if all(c is not None for c, _ in catch) else None,
            "false_reject": mean(f for _, f in catch) if all(f is not None for _, f in catch) else None,
        }
    print("\n== final round, mean over seeds (spread: max - min over seeds) ==")
    print(f"{'arm':<14} {'seeds':>6} {'all':>6} {'spread':>7} {'hard':>6} {'spread':>7} {'unsound':>8} {'tokens':>10}")
    for arm, f in final.items():
        print(f"{arm:<14} {len(f['seeds']):>6} {f['all']:>6.3f} {f['all_spread']:>7.3f} {f['hard']:>6.3f} "
              f"{f['hard_spread']:>7.3f} {_f(f['unsound']):>8} {f['tokens']:>10,.0f}")
    out: dict = {"final": final, "recovery": {}, "unsound_kinds": {}}
    print("\n== right answers whose steps do not check, by kind, and the share the learned judges dropped ==")
    for arm in (a for a in ARMS if any((a, s) in data for s in seeds)):
        kinds, sound = _unsound_kinds(store, [experiment(arm, s) for s in seeds if (arm, s) in data])
        out["unsound_kinds"][arm] = kinds
        out.setdefault("sound_by_level", {})[arm] = sound
        print(f"{arm:<14} " + "; ".join(f"{k}: {n} ({c / n:.2f} dropped by a judge)" for k, (c, n) in kinds.items()))
        if arm in JUDGE_ARMS:
            print(f"{'':<14} sound ones by level: " + "; ".join(f"level {lv}: {n} ({c / n:.3f} dropped by a judge)"
                                                            for lv, (c, n) in sound.items()))
    print("\n== how the learned judges rank the right answers, whatever their threshold: AUC (an unsound one scored "
          "below a sound one) and the catch rate of the best threshold in hindsight that drops at most 5% of the "
          "sound ones ==")
    print(f"{'arm':<18} {'seed':>4} {'round':>5}  " + "  ".join(f"{w + ' auc/catch':>16}" for w in RANKERS))
    out["ranking"] = {}
    for (arm, s), rows in data.items():
        if arm not in JUDGE_ARMS:
            continue
        ranked = _ranking(store, experiment(arm, s), sampler, mc)
        out["ranking"][experiment(arm, s)] = ranked
        for rnd, by in ranked.items():
            cells = [f"{by[w]['judge_auc']:.3f}/{by[w]['judge_hindsight_catch']:.3f}" if w in by else "-"
                     for w in RANKERS]
            print(f"{arm:<18} {s:>4} {rnd:>5}  " + "  ".join(f"{c:>16}" for c in cells))
    for arm in (a for a in JUDGE_ARMS if any((a, s) in data for s in seeds)):
        later = [next(by[w] for w in FILTER_JUDGES if w in by) for s in seeds for rnd, by in
                 out["ranking"].get(experiment(arm, s), {}).items() if rnd >= 2 and set(FILTER_JUDGES) & set(by)]
        if later:
            met = sum(r["judge_hindsight_catch"] >= 0.8 for r in later)
            print(f"{arm}: from round 2 on, a threshold chosen in hindsight catches >= 0.8 at <= 5% of the sound "
                  f"dropped in {met} of {len(later)} rounds")
            rates = {t: _pooled_ranked([r | {"t": r["at_threshold"][t]} for r in later], "t") for t in THRESHOLDS}
            print(f"{arm}: its judge replayed at other thresholds, rounds 2 on ({len(later)} rounds): "
                  + "; ".join(f"{t}: catch {_f(c)}, sound dropped {_f(fr)}" for t, (c, fr) in rates.items()))
        rules = [by["judge-and-prm"] for s in seeds for rnd, by in out["ranking"].get(experiment(arm, s), {}).items()
                 if "judge-and-prm" in by]
        for key, label in (("filter", "the filter as it ran"), ("and", "had an answer to fail the previous PRM too")):
            if rules:
                catch, fr = _pooled_ranked(rules, key)
                print(f"{arm}: {label}, rounds 2 on ({len(rules)} rounds): catch {_f(catch)}, sound dropped {_f(fr)}")
        # Each ranker dropping as many right answers as the filter's judge did, pooled over rounds 1 and on, and
        # over rounds 2 and on (where the previous round's PRM, and so judge+prm, exists).
        for first in (1, 2):
            runs = [by for s in seeds for rnd, by in out["ranking"].get(experiment(arm, s), {}).items()
                    if rnd >= first]
            for w in (w for w in RANKERS if any(w in by for by in runs)):
                at = [by[w] for by in runs if w in by]
                catch, fr = _pooled_ranked(at, "at_count")
                print(f"{arm}: {w} dropping the judge's count, rounds {first} on ({len(at)} rounds): "
                      f"catch {_f(catch)}, sound dropped {_f(fr)}")
    if data:
        _plot(data, workdir, _save, plt)
    print("\n== recovery, catch rate and tokens (goals: recovery >= 0.75 on both, catch >= 0.80 with <= 0.05 of "
          "good ones rejected, tokens <= rft-outcome's) ==")
    for arm in (a for a in JUDGE_ARMS if a in final):
        f = final[arm]
        # The baselines at the arm's own seeds: an arm run at fewer seeds is not compared with other seeds' means.
        shared = [s for s in f["seeds"] if all(s in final.get(b, {}).get("per_seed", {})
                                                for b in ("rft-outcome", "rft-checker"))]
        base = ref = None
        if shared:
            base, ref = (_over(final[b]["per_seed"], shared) for b in ("rft-outcome", "rft-checker"))
            f = _over(f["per_seed"], shared) | {"seeds": shared, "catch": f["catch"], "false_reject": f["false_reject"]}
        if shared != final[arm]["seeds"]:
            print(f"{arm}: compared at seeds {shared}, those the baselines ran too")
        rec = {}
        for key in ("all", "hard"):
            if base and ref:
                gain = ref[key] - base[key]
                spread = max(base[f"{key}_spread"], ref[f"{key}_spread"], f[f"{key}_spread"])
                rec[key] = {"ratio": (f[key] - base[key]) / gain if gain else None, "checker_gain": gain,
                            "arm_minus_outcome": f[key] - base[key], "seed_spread": spread,
                            "interval": _interval([final[a]["per_seed"] for a in (arm, "rft-outcome", "rft-checker")],
                                                  shared, key)}
        # The same comparison at rft-outcome's budget: each seed's last round within rft-outcome's final tokens.
        matched = [(s, _within(data[(arm, s)], data[("rft-outcome", s)][-1]["cum_tokens"])) for s in f["seeds"]
                   if ("rft-outcome", s) in data]
        for key in ("all", "hard"):
            if base and ref and matched:
                acc = mean(r["hard_acc" if key == "hard" else "greedy_acc"] for _, r in matched)
                gain = ref[key] - base[key]
                rec[f"{key}_at_budget"] = {"ratio": (acc - base[key]) / gain if gain else None, "accuracy": acc,
                                           "rounds": [r["round"] for _, r in matched]}
        out["recovery"][arm] = rec | {"catch": f["catch"], "false_reject": f["false_reject"], "tokens": f["tokens"],
                                      "rft_outcome_tokens": base["tokens"] if base else None}
        for key, label in (("all", "all levels"), ("hard", "hardest level")):
            if key in rec:
                r = rec[key]
                tie = (" (a tie: the checker's gain is within the seed spread)"
                       if abs(r["checker_gain"]) <= r["seed_spread"] else "")
                lo, hi = r["interval"]
                print(f"{arm} [{label}]: recovery {_f(r['ratio'], '.2f')} = ({f[key]:.3f} - {base[key]:.3f}) / "
                      f"({ref[key]:.3f} - {base[key]:.3f}); seed spread {r['seed_spread']:.3f}{tie}; "
                      f"90% interval over seeds {_f(lo, '.2f')}..{_f(hi, '.2f')}")
            if f"{key}_at_budget" in rec:
                r = rec[f"{key}_at_budget"]
                print(f"{arm} [{label}] at rft-outcome's budget (rounds {r['rounds']}): recovery "
                      f"{_f(r['ratio'], '.2f')} ({r['accuracy']:.3f})")
        print(f"{arm}: catch rate {_f(f['catch'])}, good ones rejected {_f(f['false_reject'])}; tokens "
              f"{f['tokens']:,.0f} vs rft-outcome {base['tokens'] if base else float('nan'):,.0f}")
    (workdir / "prm_without_checker.json").write_text(json.dumps(out, indent=2, default=str))
    print(f"\nplot: {workdir / 'prm_without_checker.png'}\njson: {workdir / 'prm_without_checker.json'}")
    return out


def _interval(per_seed: list[dict], seeds: list[int], key: str, draws: int = 20000) -> tuple[float | None, ...]:
    """The 5th and 95th percentiles of recovery over seeds drawn with replacement, each draw's seeds the same for
    the arm and both baselines (per_seed: the arm's, rft-outcome's, rft-checker's); draws where the checker gains
    nothing have no recovery and are left out. One seed gives no interval."""
    if len(seeds) < 2:
        return None, None
    rng, ratios = random.Random(0), []
    for _ in range(draws):
        drawn = rng.choices(seeds, k=len(seeds))
        arm, base, ref = (mean(ps[s][key] for s in drawn) for ps in per_seed)
        if ref > base:
            ratios.append((arm - base) / (ref - base))
    ratios.sort()
    return (ratios[int(0.05 * len(ratios))], ratios[int(0.95 * len(ratios))]) if ratios else (None, None)


def _over(per_seed: dict, seeds: list[int]) -> dict:
    """An arm's final-round means and spreads (max - min) over some of its seeds (per_seed: its final rounds)."""
    rows = [per_seed[s] for s in seeds]
    return ({k: mean(r[k] for r in rows) for k in ("all", "hard", "tokens")}
            | {f"{k}_spread": max(r[k] for r in rows) - min(r[k] for r in rows) for k in ("all", "hard")})


def _plot(data: dict, workdir: Path, save, plt) -> None:
    fig, grid = plt.subplots(2, 2, figsize=(13, 9), dpi=110)
    axes = grid.ravel()
    # One colour per arm run (tab20: more arms than the default cycle's ten), one legend entry per arm.
    colors = {arm: plt.get_cmap("tab20")(i % 20) for i, arm in enumerate(dict.fromkeys(a for a, _ in data))}
    panels = (("greedy_acc", "held-out greedy accuracy, all levels (%)"),
              ("hard_acc", "held-out greedy accuracy, hardest level (%)"),
              ("unsound", "right greedy answers whose steps do not check (%)"))
    for ax, (key, label) in zip(axes, panels):
        labelled = set()
        for (arm, s), rows in data.items():
            pts = [(r["cum_tokens"] / 1000, 100 * r[key]) for r in rows if r[key] is not None]
            ax.plot(*zip(*pts), marker="o", color=colors[arm], linestyle="-" if s == min(x for _, x in data) else "--",
                    label=None if arm in labelled else arm)
            labelled.add(arm)
        ax.set_xlabel("cumulative generated tokens, rollouts included (thousands)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    ax = axes[3]  # the PRM as a judge, round by round: what it catches against what it wrongly drops
    for (arm, s), rows in data.items():
        pts = [(r["round"], 100 * r["catch"], 100 * r["false_reject"]) for r in rows if r["catch"] is not None]
        if arm in JUDGE_ARMS and pts:
            style = "-" if s == min(x for _, x in data) else "--"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=colors[arm], linestyle=style)
            ax.plot([p[0] for p in pts], [p[2] for p in pts], marker="x", color=colors[arm], linestyle=style, alpha=0.5)
    ax.axhline(80, color="grey", linewidth=0.8, linestyle=":")
    ax.axhline(5, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xlabel("round")
    ax.set_ylabel("the PRM as the filter's judge (%)")
    ax.set_title("o: unsound right answers caught; x: sound ones dropped (goals: >= 80, <= 5)", fontsize=9)
    ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="lower right", title="solid: the first seed; dashed: the others",
                   title_fontsize=7)
    fig.suptitle("Without a step checker: the outcome verifier alone, the PRM as the judge, and the checker")
    save(fig, workdir / "prm_without_checker.png")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=REPO / "workdir" / "prm-bench")
    ap.add_argument("--rounds", type=int, default=4, help="rounds of every arm")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--only", nargs="+", choices=sorted(ARMS), default=list(ARMS))
    ap.add_argument("--parallel", type=int, default=1, help="runs at once (one torch thread each)")
    ap.add_argument("--report-only", action="store_true", help="skip the runs; report what the store holds")
    ap.add_argument("--sampler-ranking", action="store_true",
                    help="also rank each round's right answers by their sampler's log-likelihood and its confidence "
                         "(loads each policy)")
    ap.add_argument("--mc-ranking", action="store_true",
                    help="also rank them by Monte Carlo rollouts from their own prefixes (loads each policy)")
    args = ap.parse_args()
    args.workdir = args.workdir.resolve()
    args.workdir.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        t0 = time.perf_counter()
        run(args.workdir, args.only, args.seeds, args.rounds, args.parallel)
        print(f"runs done in {time.perf_counter() - t0:.0f}s")
    report(args.workdir, args.seeds, args.sampler_ranking, args.mc_ranking)


if __name__ == "__main__":
    main()
