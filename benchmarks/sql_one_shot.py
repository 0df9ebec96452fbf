"""Does the SQL agent's exploration pay? The agent that may run queries (`run_sql`) against one-shot answers, both
trained by rft from their own reference episodes, on the same problems, at the tokens each used.

    .venv/bin/python benchmarks/sql_one_shot.py --workdir /tmp/agents-bench --seeds 0 1 --rounds 4

Per seed, two arms, each a round-0 policy from configs/sql.yaml's bootstrap on the same micro stand-in, then
`--rounds` rft rounds:
- `run_sql`: the environment as shipped: one exploratory query, its rows, then the answer (the reference
  episodes), up to 3 turns. Its experiments are `benchmarks/grpo_agents.py`'s round-0 policy and `rft` arm, so
  with the same `--workdir` they are read, not run again;
- `one-shot`: `domain.options.explore=false`: one turn, no tool; its reference episodes are the gold query alone.

With `--lookup` both arms run on `domain.options.lookup_values=true` (each database spells its stored values its
own way, and the question names them plainly), as experiments of their own (`bench-sql-lookup-*`). With
`--hide-columns`, on `domain.options.hide_columns=true` (each database names its columns its own way, and the
prompt lists its tables only), as `bench-sql-columns-*`.

The stand-in is built once a `--workdir` (`coevo build-model --domain sql --size micro --positions 768`); with
`--copy-steps 800 --standin-seed 1` it is configs/sql.yaml's, trained to copy numbers first.

Reported from the store (`v_round_summary`): held-out greedy execution match per level by round, and the tokens
each arm sampled (cumulative), with their mean per episode. Written to `--out` (JSON) too.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from grpo_agents import SQL_FIRST_FORM, mean, print_levels, rows  # noqa: E402
from grpo_vs_rft import _run  # noqa: E402

CONFIG = "configs/sql.yaml"
ARMS = {"run_sql": ("bench-sql-boot-s{seed}", "bench-sql-rft-s{seed}", []),
        "one-shot": ("bench-sql-oneshot-boot-s{seed}", "bench-sql-oneshot-s{seed}", ["domain.options.explore=false"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/agents-bench"))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--lookup", action="store_true",
                    help="domain.options.lookup_values=true in both arms: stored values spelled per database")
    ap.add_argument("--hide-columns", action="store_true",
                    help="domain.options.hide_columns=true in both arms: columns named per database, not in the prompt")
    ap.add_argument("--copy-steps", type=int, default=0,
                    help="`coevo build-model --copy-steps` for the stand-in (configs/sql.yaml's header: 800)")
    ap.add_argument("--standin-seed", type=int, default=0,
                    help="`coevo build-model --seed` for the stand-in (configs/sql.yaml's header: 1)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from components.store import Store

    args.workdir.mkdir(parents=True, exist_ok=True)
    model = args.workdir / "standin-sql"
    if not (model / "config.json").exists():
        subprocess.run([str(REPO / ".venv" / "bin" / "coevo"), "build-model", str(model), "--domain", "sql", "--size",
                        "micro", "--positions", "768", "--copy-steps", str(args.copy_steps),
                        "--seed", str(args.standin_seed)], cwd=REPO, check=True)
    report: dict[str, dict[int, list[dict]]] = {}
    per_episode: dict[str, dict[int, float]] = {}
    for seed in args.seeds:
        base = [f"workdir={args.workdir}", f"seed={seed}", *SQL_FIRST_FORM]
        for arm, (boot, exp, extra) in ARMS.items():
            boot, exp = boot.format(seed=seed), exp.format(seed=seed)
            for on, form, option in ((args.lookup, "lookup", "lookup_values"), (args.hide_columns, "columns",
                                                                                   "hide_columns")):
                if on:
                    boot, exp = (x.replace("bench-sql-", f"bench-sql-{form}-") for x in (boot, exp))
                    extra = [*extra, f"domain.options.{option}=true"]
            print(f"[bench] seed {seed}: {arm}", flush=True)
            _run(CONFIG, [*base, f"experiment={boot}", "rounds=0", f"policy.model={model}", *extra],
                 args.workdir / f"{boot}.log")
            start = Store(args.workdir / "store").committed_model(boot, 0, "policy")["uri"]
            _run(CONFIG, [*base, f"rounds={args.rounds}", f"experiment={exp}", f"policy.model={start}",
                          "bootstrap.steps=0", *extra], args.workdir / f"{exp}.log")
            store = Store(args.workdir / "store")
            report.setdefault(arm, {})[seed] = rows(store, exp)
            _, [(tokens, episodes)] = store.query(
                "SELECT sum(num_tokens), count(*) FROM trajectories WHERE experiment_id = ? AND purpose = 'train' "
                "AND round > 0", [exp])
            per_episode.setdefault(arm, {})[seed] = tokens / max(episodes, 1)
    forms = [name for on, name in ((args.lookup, "lookup_values"), (args.hide_columns, "hide_columns")) if on]
    print_levels(report, "sql" + (f" ({', '.join(forms)})" if forms else "") + ": held-out greedy execution match by "
                 "round", "sampled")
    print(f"\nround {args.rounds}, mean over levels, and tokens sampled per training episode")
    for arm, seeds in report.items():
        print(f"{arm:13s} " + "  ".join(f"seed {s}: {mean(rs[-1]):.3f} at {rs[-1]['budget']} tokens "
                                        f"({per_episode[arm][s]:.1f} per episode)" for s, rs in seeds.items()))
    if args.out:
        args.out.write_text(json.dumps({"accuracy": report, "tokens_per_episode": per_episode}, indent=1))


if __name__ == "__main__":
    main()
