"""Does the self-improvement loop learn? A plain loop over our model, backend and SFT code, no flows.

    .venv/bin/python benchmarks/plain_loop.py                       # bootstrap + 4 rounds: ~12 min on one idle core
    .venv/bin/python benchmarks/plain_loop.py --rounds 2 --out /tmp/loop.json

1. Bootstrap: a from-scratch tiny Llama is trained on levels 1-2 of chained one-digit arithmetic,
   plus a few seed demonstrations of the longer levels 3-6 (without them the model never produces a
   chain longer than it was shown, so there is nothing correct to sample).
2. Each round (RFT, after STaR / ReST-EM): sample k completions per problem at temperature T, keep
   those whose answer is right, fine-tune on them, and measure greedy accuracy on held-out problems.

Format (character level; the level is the number of +/- operations):
    prompt "3+4-2+5\\n"   completion "3+4=7\\n7-2=5\\n5+5=10\\n#### 10\\n"

The generator is inline on purpose: this checks components.models and components.training alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from components.models.backends import HFBackend
from components.models.tiny import TinyLlamaConfig, create_tiny_llama
from components.training.sft import SFTParams, train_sft


@dataclass
class LoopConfig:
    seed: int = 0
    threads: int = 1                      # torch threads; 1 per process wins on a shared 2-core box
    hidden_size: int = 128
    num_layers: int = 4
    # bootstrap
    boot_levels: list[int] = field(default_factory=lambda: [1, 2])
    boot_problems_per_level: int = 2000   # distinct problems (level 1 has only 200, half held out)
    seed_levels: list[int] = field(default_factory=lambda: [3, 4, 5, 6])
    seed_fraction: float = 0.06           # seed demos, split over seed_levels, per nominal bootstrap problem
    boot_steps: int = 600
    boot_lr: float = 2e-3
    batch_size: int = 64
    bootstrap_model: str = ""             # a saved bootstrap to start from instead of training one
    # rounds
    rounds: int = 4
    round_levels: list[int] = field(default_factory=lambda: [2, 3, 4, 5, 6])  # level 2 doubles as replay
    problems_per_level: int = 150         # sampled per round and level (fresh draws each round)
    samples_per_problem: int = 4
    temperature: float = 0.8
    round_steps: int = 150
    round_epochs: float = 3.0             # > 0 caps round steps at this many passes over the round's data
    round_lr: float = 5e-4                # half the bootstrap's: a fresh Adam on a trained model
    keep: str = "answer"                  # "answer": right final answer (outcome RFT); "exact": every step right
    init: str = "previous"                # "previous": continue from last round; "bootstrap": ReST-EM style
    replay: float = 0.5                   # bootstrap examples added per new example (against forgetting)
    # evaluation
    eval_levels: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 5, 6])
    eval_per_level: int = 100
    max_new_tokens: int = 96


# -- the arithmetic domain, inline ----------------------------------------------------------

def make_problem(rng: random.Random, level: int) -> tuple[str, str, str]:
    """(prompt, completion, answer) for a chain of `level` +/- operations on digits 0..9."""
    nums = [rng.randrange(10) for _ in range(level + 1)]
    ops = [rng.choice("+-") for _ in range(level)]
    prompt = str(nums[0]) + "".join(o + str(n) for o, n in zip(ops, nums[1:])) + "\n"
    total, lines = nums[0], []
    for o, n in zip(ops, nums[1:]):
        new = total + n if o == "+" else total - n
        lines.append(f"{total}{o}{n}={new}")
        total = new
    return prompt, "\n".join(lines) + f"\n#### {total}\n", str(total)


def extract_answer(completion: str) -> str | None:
    for line in completion.split("\n"):
        if line.startswith("#### "):
            return line[5:].strip()
    return None


def draw(level: int, n: int, key: str, exclude: set[str]) -> list[tuple[str, str, str]]:
    """Up to n distinct problems not in `exclude` (a level's space can be smaller than n)."""
    rng, seen, out = random.Random(f"{key}:{level}"), set(exclude), []
    for _ in range(50 * n):
        p = make_problem(rng, level)
        if p[0] not in seen:
            seen.add(p[0])
            out.append(p)
            if len(out) == n:
                break
    return out


# -- the loop ---------------------------------------------------------------------------------

def evaluate(model_dir: str, test: dict[int, list], cfg: LoopConfig) -> dict[int, float]:
    backend = HFBackend(model_dir, progress=False)
    flat = [p for lv in cfg.eval_levels for p in test[lv]]
    out = backend.generate([p[0] for p in flat], n=1, temperature=0.0, top_p=1.0,
                           max_new_tokens=cfg.max_new_tokens, seed=0)
    ok = [extract_answer(s[0].text) == p[2] for p, s in zip(flat, out)]
    acc, i = {}, 0
    for lv in cfg.eval_levels:
        acc[lv] = sum(ok[i:i + len(test[lv])]) / len(test[lv])
        i += len(test[lv])
    return acc


class Timer:
    """Wall and CPU seconds of a block. With 1 thread, CPU seconds are what the wall time would be on
    an idle machine, so runs on a shared box stay comparable."""

    def __enter__(self):
        self.w0, self.c0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall, self.cpu = time.perf_counter() - self.w0, time.process_time() - self.c0


def run(cfg: LoopConfig, work: Path) -> dict:
    torch.set_num_threads(cfg.threads)
    test = {lv: draw(lv, cfg.eval_per_level, f"test:{cfg.seed}", set()) for lv in cfg.eval_levels}
    held_out = {p[0] for ps in test.values() for p in ps}
    rows: list[dict] = []
    t_start, c_start = time.perf_counter(), time.process_time()

    # bootstrap
    boot = [p for lv in cfg.boot_levels for p in draw(lv, cfg.boot_problems_per_level, f"boot:{cfg.seed}", held_out)]
    n_seed = round(cfg.seed_fraction * cfg.boot_problems_per_level * len(cfg.boot_levels) / len(cfg.seed_levels))
    seeds = [p for lv in cfg.seed_levels for p in draw(lv, n_seed, f"seed:{cfg.seed}", held_out)]
    demos = [{"prompt": p[0], "completion": p[1]} for p in boot + seeds]
    tiny = TinyLlamaConfig(hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
                           intermediate_size=3 * cfg.hidden_size)
    boot_dir = cfg.bootstrap_model or str(work / "r0")
    with Timer() as tt:
        if cfg.bootstrap_model:  # reuse a bootstrap while tuning the rounds
            m = {"steps": 0, "tokens_per_s": 0.0, "final_loss": float("nan")}
        else:
            init = create_tiny_llama(tiny, work / "init", seed=cfg.seed)
            m = train_sft(str(init), demos, boot_dir, SFTParams(
                max_steps=cfg.boot_steps, batch_size=cfg.batch_size, learning_rate=cfg.boot_lr, seed=cfg.seed))
    with Timer() as te:
        acc = evaluate(boot_dir, test, cfg)
    rows.append({"round": 0, "examples": len(demos), "steps": m["steps"], "gen_s": 0.0, "gen_cpu_s": 0.0,
                 "train_s": tt.wall, "train_cpu_s": tt.cpu, "eval_s": te.wall, "train_tok_s": m["tokens_per_s"],
                 "final_loss": m["final_loss"], "acc": acc})
    print(f"r0 bootstrap: {len(boot)} demos at levels {cfg.boot_levels} + {len(seeds)} seed demos; "
          f"{m['steps']} steps in {tt.wall:.0f}s ({tt.cpu:.0f} cpu s, {m['tokens_per_s']:.0f} tok/s); "
          f"eval {te.wall:.0f}s; acc {_fmt(acc)}", flush=True)

    model, pool = boot_dir, demos
    for r in range(1, cfg.rounds + 1):
        with Timer() as tg:
            problems = [(lv, p) for lv in cfg.round_levels
                        for p in draw(lv, cfg.problems_per_level, f"round:{cfg.seed}:{r}", held_out)]
            backend = HFBackend(model, progress=False)
            samples = backend.generate([p[0] for _, p in problems], n=cfg.samples_per_problem,
                                       temperature=cfg.temperature, top_p=1.0, max_new_tokens=cfg.max_new_tokens,
                                       seed=cfg.seed * 1000 + r)
        gen_tokens = sum(s.num_tokens for per in samples for s in per)
        keep = (lambda p, s: s.text == p[1]) if cfg.keep == "exact" else (lambda p, s: extract_answer(s.text) == p[2])
        new = [{"prompt": p[0], "completion": s.text} for (_, p), per in zip(problems, samples) for s in per
               if keep(p, s)]
        solved = {lv: 0 for lv in cfg.round_levels}  # problems with at least one kept sample
        for (lv, p), per in zip(problems, samples):
            solved[lv] += any(keep(p, s) for s in per)
        replay = random.Random(r).sample(pool, min(len(pool), round(cfg.replay * len(new))))
        examples = new + replay
        steps = cfg.round_steps
        if cfg.round_epochs > 0:
            steps = max(1, min(steps, round(cfg.round_epochs * len(examples) / cfg.batch_size)))
        start = model if cfg.init == "previous" else boot_dir
        out_dir = str(work / f"r{r}")
        with Timer() as tt:
            m = train_sft(start, examples, out_dir, SFTParams(
                max_steps=steps, batch_size=cfg.batch_size, learning_rate=cfg.round_lr, seed=cfg.seed + r))
        with Timer() as te:
            acc = evaluate(out_dir, test, cfg)
        rows.append({"round": r, "examples": len(examples), "new": len(new), "steps": m["steps"],
                     "gen_s": tg.wall, "gen_cpu_s": tg.cpu, "gen_tok_s": gen_tokens / tg.wall,
                     "train_s": tt.wall, "train_cpu_s": tt.cpu, "eval_s": te.wall, "train_tok_s": m["tokens_per_s"],
                     "final_loss": m["final_loss"], "solved": solved, "acc": acc})
        print(f"r{r}: gen {len(problems)}x{cfg.samples_per_problem} in {tg.wall:.0f}s ({tg.cpu:.0f} cpu s, "
              f"{gen_tokens / tg.wall:.0f} tok/s), {len(new)} correct (solved per level {solved}); "
              f"train {len(examples)} ex, {m['steps']} steps in {tt.wall:.0f}s ({tt.cpu:.0f} cpu s, "
              f"{m['tokens_per_s']:.0f} tok/s); eval {te.wall:.0f}s; acc {_fmt(acc)}", flush=True)
        model = out_dir
    total, cpu = time.perf_counter() - t_start, time.process_time() - c_start
    loop = sum(x["gen_s"] + x["train_s"] for x in rows)
    loop_cpu = sum(x["gen_cpu_s"] + x["train_cpu_s"] for x in rows)
    print(f"total {total:.0f}s wall, {cpu:.0f} cpu s; generate+train {loop:.0f}s wall, {loop_cpu:.0f} cpu s "
          f"(the rest is evaluation and loading)")
    _table(rows, cfg)
    return {"config": dataclasses.asdict(cfg), "rounds": rows, "total_s": total, "total_cpu_s": cpu,
            "loop_s": loop, "loop_cpu_s": loop_cpu}


def _fmt(acc: dict[int, float]) -> str:
    return " ".join(f"L{lv}={a:.0%}" for lv, a in acc.items())


def _table(rows: list[dict], cfg: LoopConfig) -> None:
    head = "| round | gen s (cpu) | train s (cpu) | steps | examples | " + " | ".join(f"L{lv}" for lv in cfg.eval_levels) + " |"
    print(head)
    print("|" + "---|" * (5 + len(cfg.eval_levels)))
    for x in rows:
        accs = " | ".join(f"{x['acc'][lv]:.0%}" for lv in cfg.eval_levels)
        print(f"| {x['round']} | {x['gen_s']:.0f} ({x['gen_cpu_s']:.0f}) | {x['train_s']:.0f} ({x['train_cpu_s']:.0f}) "
              f"| {x['steps']} | {x['examples']} | {accs} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(LoopConfig):
        default = getattr(LoopConfig(), f.name)
        if isinstance(default, list):
            ap.add_argument(f"--{f.name.replace('_', '-')}", type=lambda s: [int(x) for x in s.split(",")],
                            default=default, help="comma-separated")
        elif isinstance(default, bool):
            ap.add_argument(f"--{f.name.replace('_', '-')}", type=lambda s: s.lower() in ("1", "true", "yes"),
                            default=default)
        else:
            ap.add_argument(f"--{f.name.replace('_', '-')}", type=type(default), default=default)
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--workdir", help="keep the checkpoints here (default: a temporary directory)")
    a = vars(ap.parse_args())
    out, workdir = a.pop("out"), a.pop("workdir")
    cfg = LoopConfig(**a)
    work = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="coevo-loop-"))
    try:
        res = run(cfg, work)
    finally:
        if not workdir:
            shutil.rmtree(work, ignore_errors=True)
    if out:
        Path(out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
