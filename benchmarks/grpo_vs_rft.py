"""Does recipe grpo reach rft's accuracy on fewer generated tokens? Arith at micro scale, the arms side by side.

    .venv/bin/python benchmarks/grpo_vs_rft.py --workdir /tmp/grpo-bench --seeds 0 1 --rounds 4 --heldout 1000

Per seed, `rft` runs configs/micro.yaml (its bootstrap, then `--rounds` rounds); every other arm starts from that
run's round-0 policy as it is (`bootstrap.steps=0`), so all arms of a seed start from the same model:
- `grpo`: configs/micro-grpo.yaml as shipped (DAPO loss, 32 problems per level x 8 rollouts, lr 2e-5, 2 passes);
- `grpo-lr1e-4`: the same at learning rate 1e-4;
- `grpo-lr2e-4`, `grpo-lr5e-4`, `grpo-lr5e-4-wide` (with `--arms`): at 2e-4, at rft's learning rate, then at
  rft's with 64 problems a level;
- `grpo-lr1e-4-cosine` (with `--arms`): 1e-4 decayed to 0 over each round's steps.
- any `rft-lr<rate>` (with `--arms`): rft at that SFT learning rate, from rft's round-0 policy; the issue's figure is
  reported against every rft arm;
- any
  `grpo-lr<rate>[-cosine][-p<N>][-top<L>][-g<G>][-it<K>][-t<T>][-ptx[<W>]][-pb<B>][-sil[all]][-checked|-checkjudge]
  [-implicit|-prm[l]|-prm[l]min|-prm[l]judge|-oracle|-oraclemin|-oraclejudge|-confjudge[hi]|-bigconfjudge][<S>]`
  (with `--arms`): that rate, constant or decayed, N problems a level, sampling only the L hardest learnable levels
  (`curriculum.max_levels`) in groups of G, K passes over each round's rollouts (`num_iterations`) sampled at
  temperature T (grpo's default 1.0; rft samples at 0.8), the round-0 demonstrations beside the policy gradient at
  weight W (PPO-ptx, default 1), B of them a forward pass, half of those the round's own right answers (`-sil`) or
  every round's (`-silall`), rft's step checker (`-checked`; `-checkjudge`: it only judges what `-sil` imitates,
  rewards untouched), and step credit from the implicit PRM or from a PRM the rounds train (as in grpo_shaping.py), or
  that PRM's lowest step score in the reward (`-prmmin`), each at weight S (default 0.5), which the report sets
  against the same arm without it; `-oracle` and `-oraclemin` are the last two with arith's exact step labels for the
  PRM's scores (benchmarks/oracle_prm.py): what a PRM that ranks as the checker does would pay; `-prmjudge` and
  `-oraclejudge` shape nothing: the trained PRM, or the exact labels, judge which right answers `-sil` imitates;
  `-prml`, `-prmlmin` and `-prmljudge` train the PRM with arith-coevo.yaml's likelihood head instead of the
  classifier. After a judge arm, the number S is the most the judge may leave out of a round's right answers
  (`filter.judge_max_drop`, default 0.3 for a PRM), not a weight. `-confjudge` is a judge too: the sampler's
  confidence (`score.reward_model: confidence`, no rollouts, no training) leaves out right answers whose least likely
  token had p < 0.3, at most half of a round's; `-bigconfjudge` another model's confidence (`--judge-model`, as
  `score.confidence_model`: one that did not write the answers), below p = 0.005.

`--tiny HIDDEN LAYERS HEADS WIDTH` gives every arm a policy of that size instead of micro's 128x2 (its rft arm
bootstraps it), and `--set KEY=VALUE` adds an override to every arm, for example rft's own learning rate.

Each is a `coevo run` in its own process, one at a time; committed stages are skipped, so a second call only
reports (`--report-only` runs nothing, not even the runs' servers). Then, from the store (`v_round_summary`), per
arm and seed: cumulative generated tokens and held-out greedy accuracy on level 3 (the hardest) by round, and the
issue's figure: the tokens grpo needed to first reach rft's final level-3 accuracy, as a share of rft's (goal: at
most 0.7), or "never". Written to `--out` (JSON) too.

The level-3 test set holds 60 problems, so one problem is 1.7 points. `--heldout N` evaluates every arm's policy of
every round again, greedily, on N more level-3 problems that no trajectory in the store has (not the test set's,
not a demonstration's, not a sample's), and reports the same figures on them too. Each model's answers are kept in
`<workdir>/heldout.json`, so a second call evaluates only what is new.
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
# `prmmin` is the same PRM's lowest step score added to each rollout's reward instead (credit=trajectory; the PPO
# reward of Math-Shepherd, Wang et al. 2024), the nearest a PRM comes to rft's step checker, which zeroes a right
# answer with one unsound step.
STEP = ["train_policy.grpo.credit=step", "train_policy.grpo.shaping_weight=0.5"]
PRM = ["score.mc_rollouts=2", "train_reward.enabled=true", "train_reward.steps=100", "score.reward_model=prm"]
SHAPING = {
    "implicit": ["score.reward_model=implicit", *STEP],
    "prm": [*PRM, *STEP],
    "prmmin": [*PRM, "train_policy.grpo.shaping_aggregate=min", "train_policy.grpo.shaping_weight=0.5"],
}
# The same two with arith's exact step labels for scores (benchmarks/oracle_prm.py): what a PRM that ranks as the
# step checker does would pay. No rollouts, no training.
ORACLE = ["score.reward_model=benchmarks.oracle_prm:OracleStepPRM"]
SHAPING |= {"oracle": [*ORACLE, *STEP],
            "oraclemin": [*ORACLE, "train_policy.grpo.shaping_aggregate=min", "train_policy.grpo.shaping_weight=0.5"]}
# Or no shaping: the reward model judges which right answers self-imitation (-sil) trains on, as rft's filter
# judges its SFT data: filter.min_step_score on the weakest step; the trained PRM's threshold capped to leave out
# at most 30% of a round's right answers (filter.judge_max_drop, as the coevo judge's in prm-without-checker.md).
SHAPING |= {"prmjudge": [*PRM, "filter.min_step_score=0.5", "filter.judge_max_drop=0.3"],
            "oraclejudge": [*ORACLE, "filter.min_step_score=0.5"]}
# Or the sampler's own confidence judges (score.reward_model confidence: a step's least likely token; no rollouts,
# no training): right answers whose least likely token had p < 0.3, at most half of a round's.
SHAPING |= {"confjudge": ["score.reward_model=confidence", "filter.min_step_score=0.3", "filter.judge_max_drop=0.5"]}
# `confjudgehi`: the same at p < 0.5, as rft's confidence judge in prm_without_checker.py: it catches more unsound
# right answers and drops more sound ones.
SHAPING |= {"confjudgehi": [*SHAPING["confjudge"][:1], "filter.min_step_score=0.5", "filter.judge_max_drop=0.5"]}
# `bigconfjudge`: another model's confidence judges (score.confidence_model, `--judge-model`): one that did not write
# the answers, as prm_without_checker.py's rft-bigconf, at its threshold (p < 0.005), at most half of a round's.
SHAPING |= {"bigconfjudge": [*SHAPING["confjudge"][:1], "score.confidence_model={judge_model}",
                             "filter.min_step_score=0.005", "filter.judge_max_drop=0.5"]}
# A judge arm's number is the most it may leave out of a round's right answers (filter.judge_max_drop), not a weight.
NUMBER = dict.fromkeys(["prmjudge", "prmljudge", "oraclejudge", "confjudge", "confjudgehi", "bigconfjudge"],
                       "filter.judge_max_drop")
# `prml...`: the same three with the PRM arith-coevo.yaml trains instead of the classifier: the likelihood head (a
# step scores by its least likely token under the PRM's own LM head), kept a language model on the demonstrations.
PRML = [*PRM, "train_reward.head=likelihood", "train_reward.lm_weight=1", "train_reward.demos=true"]
SHAPING |= {"prml": [*PRML, *STEP], "prmlmin": [*PRML, *SHAPING["prmmin"][len(PRM):]],
            "prmljudge": [*PRML, *SHAPING["prmjudge"][len(PRM):]]}
# An arm's numeric parts (ARM's named groups) and the config key each sets, in the order the overrides list them.
SETTINGS = {"problems": "generate.problems_per_level", "levels": "curriculum.max_levels",
            "group": "generate.samples_per_problem", "iterations": "train_policy.grpo.num_iterations",
            "temperature": "generate.temperature"}
PTX = {"ptx_batch": "train_policy.grpo.ptx_batch_size"}  # the same, after ptx_weight
ARM = re.compile(r"grpo-lr(?P<lr>[0-9.]+(?:e-?[0-9]+)?)(?P<cosine>-cosine)?(?:-p(?P<problems>[0-9]+))?"
                 r"(?:-top(?P<levels>[0-9]+))?(?:-g(?P<group>[0-9]+))?"
                 r"(?:-it(?P<iterations>[0-9]+))?(?:-t(?P<temperature>[0-9.]+))?"
                 r"(?P<ptx>-ptx(?P<weight>[0-9.]+)?)?(?:-pb(?P<ptx_batch>[0-9]+))?"
                 r"(?P<sil>-sil(?P<replayed>all)?)?(?P<checked>-checked|-checkjudge)?"
                 r"(?:-(?P<credit>implicit|prmmin|prmjudge|prmlmin|prmljudge|prml|prm|oraclemin|oraclejudge|oracle"
                 r"|confjudgehi|confjudge|bigconfjudge)"
                 r"(?P<shaping>[0-9.]+)?)?")


def arm_overrides(arm: str) -> tuple[str, list[str]]:
    """An arm's config and overrides: a named arm, `rft-lr<rate>` (rft's SFT at that rate), or
    `grpo-lr<rate>[-cosine][-p<N>][-top<L>][-g<G>][-it<K>][-t<T>][-ptx[<W>]][-pb<B>][-sil[all]][-checked|-checkjudge]
    [-implicit|-prm[l]|-prm[l]min|-prm[l]judge|-oracle|-oraclemin|-oraclejudge|-confjudge[hi]|-bigconfjudge][<S>]`:
    the rate, decayed to 0 over each round's steps as rft's SFT rounds end (docs/grpo.md, "Why"), N problems a level
    a round from the L hardest learnable levels in groups of G, K passes over its rollouts sampled at temperature T,
    the round-0 demonstrations' NLL at weight W (default 1) beside the policy gradient (PPO-ptx), B examples a ptx batch
    (`ptx_batch_size`), half of them the round's own right answers (`-sil`, self-imitation: ptx_pool right_answers) or
    every round's (`-silall`: all_right_answers), rft's step checker on the right answers (filter.check_steps: a right
    answer whose steps fail it earns 0, `-checked`; or only leaves self-imitation, `-checkjudge`:
    unsound_reward=outcome), and step credit, or a trained PRM's lowest step score in the reward (`-prmmin`), either
    at weight S (default 0.5), or the same from arith's exact step labels (`-oracle`, `-oraclemin`), or either judging
    which right answers self-imitation trains on, no shaping (`-prmjudge`, `-oraclejudge`: filter.min_step_score),
    as the sampler's confidence does (`-confjudge`: a least likely token below p = 0.3; `-confjudgehi`: 0.5), or
    another model's (`-bigconfjudge`: `--judge-model`, below p = 0.005);
    `prml` for `prm`: the PRM's likelihood head.

    >>> arm_overrides("grpo-lr1e-4-cosine")
    ('configs/micro-grpo.yaml', ['train_policy.grpo.learning_rate=1e-4', 'train_policy.grpo.lr_scheduler=cosine'])
    >>> arm_overrides("grpo-lr1e-5-p96")[1]
    ['train_policy.grpo.learning_rate=1e-5', 'generate.problems_per_level=96']
    >>> arm_overrides("grpo-lr1e-5-p96-implicit")[1][2:]
    ['score.reward_model=implicit', 'train_policy.grpo.credit=step', 'train_policy.grpo.shaping_weight=0.5']
    >>> arm_overrides("grpo-lr3e-4-ptx")[1], arm_overrides("grpo-lr3e-4-ptx0.5")[1][1]
    (['train_policy.grpo.learning_rate=3e-4', 'train_policy.grpo.ptx_weight=1'], 'train_policy.grpo.ptx_weight=0.5')
    >>> arm_overrides("grpo-lr1e-4-p64-top1-it4-ptx")[1][1:3]
    ['generate.problems_per_level=64', 'curriculum.max_levels=1']
    >>> arm_overrides("grpo-lr1e-4-p64-top1-it4-ptx")[1][3:]
    ['train_policy.grpo.num_iterations=4', 'train_policy.grpo.ptx_weight=1']
    >>> arm_overrides("grpo-lr1e-4-p32-top1-g16-it8-ptx")[1][2:4]
    ['curriculum.max_levels=1', 'generate.samples_per_problem=16']
    >>> arm_overrides("grpo-lr1e-4-p64-top1-it8-ptx-checked")[1][-2:]
    ['train_policy.grpo.ptx_weight=1', 'filter.check_steps=true']
    >>> arm_overrides("grpo-lr1e-4-top1-it8-t0.8-ptx")[1][-2:]
    ['generate.temperature=0.8', 'train_policy.grpo.ptx_weight=1']
    >>> arm_overrides("grpo-lr1e-4-top1-it8-ptx-pb32-sil-checked")[1][-3:]
    ['train_policy.grpo.ptx_batch_size=32', 'train_policy.grpo.ptx_pool=right_answers', 'filter.check_steps=true']
    >>> arm_overrides("grpo-lr1e-4-ptx-sil-checkjudge")[1][-2:]
    ['filter.check_steps=true', 'train_policy.grpo.unsound_reward=outcome']
    >>> arm_overrides("grpo-lr1e-4-ptx-silall")[1][-1]
    'train_policy.grpo.ptx_pool=all_right_answers'
    >>> arm_overrides("grpo-lr1e-4-ptx-sil-prmmin")[1][-3:]
    ['score.reward_model=prm', 'train_policy.grpo.shaping_aggregate=min', 'train_policy.grpo.shaping_weight=0.5']
    >>> arm_overrides("grpo-lr1e-4-ptx-sil-prmmin2")[1][-1], unshaped("grpo-lr1e-4-ptx-sil-prmmin2")
    ('train_policy.grpo.shaping_weight=2', 'grpo-lr1e-4-ptx-sil')
    >>> arm_overrides("grpo-lr1e-4-ptx-sil-oraclemin")[1][-3:-1]
    ['score.reward_model=benchmarks.oracle_prm:OracleStepPRM', 'train_policy.grpo.shaping_aggregate=min']
    >>> unshaped("grpo-lr1e-4-ptx-sil-oracle")
    'grpo-lr1e-4-ptx-sil'
    >>> arm_overrides("grpo-lr1e-4-ptx-sil-prmjudge")[1][-2:], unshaped("grpo-lr1e-4-ptx-sil-oraclejudge")
    (['filter.min_step_score=0.5', 'filter.judge_max_drop=0.3'], 'grpo-lr1e-4-ptx-sil')
    >>> arm_overrides("grpo-lr1e-4-ptx-sil-prmljudge")[1][-5:-2]
    ['train_reward.head=likelihood', 'train_reward.lm_weight=1', 'train_reward.demos=true']
    >>> arm_overrides("grpo-lr1e-4-ptx-sil-prmljudge0.6")[1][-1]
    'filter.judge_max_drop=0.6'
    >>> arm_overrides("grpo-lr1e-4-ptx-sil-confjudge")[1][-3:]
    ['score.reward_model=confidence', 'filter.min_step_score=0.3', 'filter.judge_max_drop=0.5']
    >>> arm_overrides("grpo-lr1e-4-ptx-sil-confjudgehi")[1][-2:]
    ['filter.min_step_score=0.5', 'filter.judge_max_drop=0.5']
    >>> arm_overrides("grpo-lr1e-4-ptx-sil-bigconfjudge")[1][-3:]
    ['score.confidence_model={judge_model}', 'filter.min_step_score=0.005', 'filter.judge_max_drop=0.5']
    >>> arm_overrides("rft-lr1e-5")
    ('configs/micro.yaml', ['train_policy.learning_rate=1e-5'])
    >>> arm_overrides("grpo-fast")
    Traceback (most recent call last):
    argparse.ArgumentTypeError: unknown arm 'grpo-fast': choose rft, grpo, grpo-lr5e-4-wide, rft-lr<rate> or grpo-lr<rate>[-cosine][-p<N>][-top<L>][-g<G>][-it<K>][-t<T>][-ptx[<W>]][-pb<B>][-sil[all]][-checked|-checkjudge][-implicit|-prm[l]|-prm[l]min|-prm[l]judge|-oracle|-oraclemin|-oraclejudge|-confjudge[hi]|-bigconfjudge][<S>]
    """
    if arm in ARMS:
        return ARMS[arm]
    if m := re.fullmatch(r"rft-lr([0-9.]+(?:e-?[0-9]+)?)", arm):
        return "configs/micro.yaml", [f"train_policy.learning_rate={m[1]}"]
    m = ARM.fullmatch(arm)
    if m is None:
        raise argparse.ArgumentTypeError(f"unknown arm {arm!r}: choose {', '.join(ARMS)}, rft-lr<rate> or "
                                         "grpo-lr<rate>[-cosine][-p<N>][-top<L>][-g<G>][-it<K>][-t<T>][-ptx[<W>]]"
                                         "[-pb<B>][-sil[all]][-checked|-checkjudge][-implicit|-prm[l]|-prm[l]min"
                                         "|-prm[l]judge|-oracle|-oraclemin|-oraclejudge|-confjudge[hi]"
                                         "|-bigconfjudge][<S>]")
    return "configs/micro-grpo.yaml", [f"train_policy.grpo.learning_rate={m['lr']}",
                                       *(["train_policy.grpo.lr_scheduler=cosine"] if m["cosine"] else []),
                                       *(f"{key}={m[group]}" for group, key in SETTINGS.items() if m[group]),
                                       *([f"train_policy.grpo.ptx_weight={m['weight'] or 1}"] if m["ptx"] else []),
                                       *(f"{key}={m[group]}" for group, key in PTX.items() if m[group]),
                                       *([f"train_policy.grpo.ptx_pool={'all_' if m['replayed'] else ''}right_answers"]
                                         if m["sil"] else []),
                                       *(["filter.check_steps=true"] if m["checked"] else []),
                                       *(["train_policy.grpo.unsound_reward=outcome"]
                                         if m["checked"] == "-checkjudge" else []),
                                       *(SHAPING[m["credit"]] if m["credit"] else []),
                                       *([f"{NUMBER.get(m['credit'], 'train_policy.grpo.shaping_weight')}="
                                          f"{m['shaping']}"] if m["shaping"] else [])]


def unshaped(arm: str) -> str | None:
    """The arm a step-credit arm is measured against: itself without the credit.

    >>> unshaped("grpo-lr1e-5-p96-prm"), unshaped("grpo-lr1e-5-p96")
    ('grpo-lr1e-5-p96', None)
    """
    m = ARM.fullmatch(arm)
    return arm[: m.start("credit") - 1] if m and m["credit"] else None


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


class HeldOut:
    """`n` level-3 problems of `domain` (the arms': configs/micro.yaml's, with `--set`) that are the prompt of no
    trajectory in `store` (its test set, demonstrations and samples, every experiment) and lie outside the domain's
    test set, drawn with a seed no run uses; which ones depends on what the store holds, so later arms can only
    remove problems. Every model's greedy answers to them are cached in `<workdir>/heldout.json` by model id and
    prompt, so a second call generates only new pairs."""

    def __init__(self, domain, max_new_tokens: int, store, workdir: Path, n: int):
        self.domain, self.max_new_tokens = domain, max_new_tokens
        _, rows = store.query("SELECT DISTINCT prompt FROM trajectories WHERE level = ?", [HARDEST])
        seen = {r[0] for r in rows}
        pool = self.domain.sample_problems(HARDEST, n + len(seen), seed=-1)
        self.problems = [p for p in pool if p.prompt not in seen][:n]
        if len(self.problems) < n:
            raise ValueError(f"--heldout {n}: only {len(self.problems)} level-{HARDEST} problems are left outside "
                             "the store")
        self.path = workdir / "heldout.json"
        self.cache = json.loads(self.path.read_text()) if self.path.exists() else {}

    def accuracy(self, store, experiment: str) -> dict[int, float]:
        """Greedy accuracy of each round's evaluated policy of `experiment` on the problems, by round."""
        from transformers.utils import logging as hf_logging

        from components.models.backends import HFBackend

        hf_logging.disable_progress_bar()  # a bar per model load
        _, rows = store.query("SELECT DISTINCT e.round, e.model_id, m.uri FROM evaluations e JOIN models m USING "
                              "(model_id) WHERE e.experiment_id = ? ORDER BY e.round", [experiment])
        out = {}
        for rnd, model_id, uri in rows:
            done = self.cache.setdefault(model_id, {})
            todo = [p for p in self.problems if p.prompt not in done]
            if todo:
                samples = HFBackend(uri, progress=False).generate(
                    [p.prompt for p in todo], n=1, temperature=0.0, top_p=1.0, max_new_tokens=self.max_new_tokens,
                    seed=0)
                right = self.domain.verify([s[0].text for s in samples], [p.answer for p in todo])
                done.update({p.prompt: r for p, r in zip(todo, right, strict=True)})
                tmp = self.path.with_suffix(".tmp")
                tmp.write_text(json.dumps(self.cache))
                tmp.replace(self.path)  # a cut run leaves the last whole cache
            out[rnd] = sum(done[p.prompt] for p in self.problems) / len(self.problems)
        return out


def _report(report: dict, seeds: list[int], key: str, what: str) -> None:
    """The accuracy rows and the issue's figure, on `key` (the test set's `hardest` or the `heldout` set)."""
    print(f"\nlevel-{HARDEST} greedy accuracy by round, {what} (cumulative generated tokens)")
    for arm, by_seed in report.items():
        for seed, rows in by_seed.items():
            print(f"{arm:12s} seed {seed}: " + "  ".join(f"r{r['round']} {r[key]:.3f} ({r['tokens']})" for r in rows))
    print(f"\nthe issue's figure, {what}: tokens to first reach rft's final level-{HARDEST} accuracy, as a share of "
          "rft's (goal <= 0.7)")
    for base in [a for a in report if a.startswith("rft")]:
        for arm in [a for a in report if not a.startswith("rft")]:
            for seed in seeds:
                rft = report[base][seed]
                target, budget = rft[-1][key], rft[-1]["tokens"]
                hit = next((r for r in report[arm][seed] if r["round"] > 0 and r[key] >= target), None)
                share = "never" if hit is None else f"{hit['tokens'] / budget:.2f}"
                print(f"{arm:12s} seed {seed}: {base}'s final {target:.3f} at {budget} tokens; {arm}: {share}")
    shaped = [a for a in report if unshaped(a) in report]
    if shaped:
        print(f"\nstep credit, {what}: final level-{HARDEST} accuracy minus the same arm's without it, per seed, and "
              "its tokens (sampled + labelling) as a multiple (goal: +0.05 beyond the seeds' spread)")
    for arm in shaped:
        base = report[unshaped(arm)]
        print(f"{arm:12s} " + "  ".join(
            f"seed {s}: {report[arm][s][-1][key] - base[s][-1][key]:+.3f} at "
            f"{report[arm][s][-1]['budget'] / max(base[s][-1]['budget'], 1):.2f}x" for s in seeds))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/grpo-bench"))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--grpo-rounds", type=int, default=None, metavar="N",
                    help="rounds for the grpo arms (default: --rounds): a grpo round samples fewer tokens than "
                         "rft's, so more of them fit in 0.7x rft's tokens")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--arms", nargs="+", type=_arm, default=["rft", "grpo", "grpo-lr1e-4"],
                    help="rft always runs first: every other arm starts from its round-0 policy")
    ap.add_argument("--tiny", type=int, nargs=4, metavar=("HIDDEN", "LAYERS", "HEADS", "WIDTH"),
                    help="the policy's size for every arm (default: micro's 128 2 4 384)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="an override for every arm (repeatable)")
    ap.add_argument("--heldout", type=int, default=0, metavar="N",
                    help=f"evaluate every round's policy again on N level-{HARDEST} problems no run saw")
    ap.add_argument("--judge-model", default=None, metavar="PATH",
                    help="the model whose confidence judges a -bigconfjudge arm (score.confidence_model)")
    ap.add_argument("--report-only", action="store_true",
                    help="run nothing: report the arms' committed rounds (a second call without it only reports "
                         "too, but starts each run's server)")
    args = ap.parse_args()
    size = [] if args.tiny is None else [f"policy.tiny.{k}={v}" for k, v in zip(
        ("hidden_size", "num_layers", "num_heads", "intermediate_size"), args.tiny)]
    from components.config import load_config
    from components.domains import get_domain
    from components.store import Store

    args.workdir.mkdir(parents=True, exist_ok=True)
    store = Store(args.workdir / "store")
    report = {}
    for seed in args.seeds:
        base = [f"workdir={args.workdir}", f"seed={seed}", *size, *args.overrides]
        for arm in ["rft", *[a for a in args.arms if a != "rft"]]:
            config, extra = arm_overrides(arm)
            if any("{judge_model}" in o for o in extra):
                if args.judge_model is None:
                    sys.exit(f"{arm} is judged by another model's confidence: name it with --judge-model PATH")
                extra = [o.replace("{judge_model}", args.judge_model) for o in extra]
            exp = f"bench-{arm}-s{seed}"
            rounds = args.rounds if arm.startswith("rft") else args.grpo_rounds or args.rounds
            if args.report_only:
                if not store.committed_model(exp, rounds, "policy"):
                    sys.exit(f"--report-only: {exp} has no committed round {rounds} in {args.workdir}; "
                             "run it first (without --report-only)")
            else:
                start = [] if arm == "rft" else [
                    f"policy.model={store.committed_model(f'bench-rft-s{seed}', 0, 'policy')['uri']}",
                    "bootstrap.steps=0"]
                print(f"[bench] seed {seed}: {arm}", flush=True)
                _run(config, [*base, f"rounds={rounds}", f"experiment={exp}", *extra, *start],
                     args.workdir / f"{exp}.log")
            report.setdefault(arm, {})[seed] = _rows(store, exp)
    cfg = load_config(REPO / "configs" / "micro.yaml", args.overrides)
    domain = get_domain(cfg.domain.name, **cfg.domain.options)
    _report(report, args.seeds, "hardest", f"on the test set ({len(domain.test_set(HARDEST))} problems)")
    if args.heldout:
        heldout = HeldOut(domain, cfg.evaluate.max_new_tokens, store, args.workdir, args.heldout)
        for arm, by_seed in report.items():
            for seed, rows in by_seed.items():
                print(f"[bench] held out: {arm} seed {seed}", flush=True)
                acc = heldout.accuracy(store, f"bench-{arm}-s{seed}")
                for r in rows:
                    r["heldout"] = acc[r["round"]]
        _report(report, args.seeds, "heldout", f"on {len(heldout.problems)} problems held out from every run")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
