"""MCTS on vLLM: how much of a search's prompts the prefix cache serves, and its tokens/s against independent
sampling of as many tokens, side by side on one engine.

    PYTHONPATH=. .venv-vllm/bin/python benchmarks/search_vllm.py --model <a micro run's round-0 policy>

(`coevo query "SELECT uri FROM models WHERE round = 0 AND role = 'policy'"` names one; `make vllm` builds
.venv-vllm.) On the hardest level's problems of the micro config's arith:

1. `mcts`: `components.search.policy.mcts_sample`, as generate.mcts runs it: every simulation sends the leaves of
   all trees to the engine in one call (K draws each), then their new children's rollouts in one more. A node's
   prompt is the problem and the steps above it, so siblings and their descendants share blocks of it.
2. `independent`: the same problems sampled whole, as plain `generate` does, with n per problem set so the
   total generated tokens match the search's.
3. `mcts, cache off`: the search again on an engine without prefix caching; the same seeds give the same trees.

vLLM caches whole KV blocks. The CPU build's default block is 128 tokens, longer than these prompts (the micro
policy's characters are its tokens), so `--block-size` defaults to 32, the smallest its attention takes (the
GPU build's default is 16). Engine starts are not in the timings.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _delta(before: dict, after: dict) -> tuple[int, int, float]:
    q = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    h = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    return q, h, h / q if q else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a policy folder, e.g. a micro run's round-0 model")
    ap.add_argument("--problems", type=int, default=64, help="level-3 problems, one tree each")
    ap.add_argument("--simulations", type=int, default=16)
    ap.add_argument("--expansions", type=int, default=4)
    ap.add_argument("--rollouts", type=int, default=2)
    ap.add_argument("--max-step-tokens", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--block-size", type=int, default=32, help="the KV cache block, in tokens")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from components.domains.arith import ArithDomain
    from components.models.vllm_backend import VLLMBackend
    from components.search.mcts import MCTSConfig, node_rows
    from components.search.policy import mcts_sample

    domain = ArithDomain(max_level=3, digits=1, test_size=60)  # configs/micro.yaml's
    problems = domain.sample_problems(3, args.problems, seed=0)
    cfg = MCTSConfig(simulations=args.simulations, expansions=args.expansions)
    kw = dict(temperature=0.8, top_p=1.0, max_step_tokens=args.max_step_tokens, max_new_tokens=args.max_new_tokens,
              seed=0, rollouts=args.rollouts)
    res: dict = {"settings": {**vars(args), "model": str(args.model), "out": str(args.out) if args.out else None},
                 "device": f"cpu ({os.cpu_count()} cores)", "runs": {}}

    def search(engine) -> tuple[list, dict]:
        before, t = engine.stats(), time.perf_counter()
        trees, _, stats = mcts_sample(domain, engine, problems, cfg, **kw)
        dt = time.perf_counter() - t
        q, h, rate = _delta(before, engine.stats())
        row = {"seconds": dt, "tokens": stats["generated_tokens"], "tokens_per_s": stats["generated_tokens"] / dt,
               "backend_calls": stats["backend_calls"], "nodes": stats["nodes"], "solved": stats["solved"],
               "prompt_tokens_looked_up": q, "prompt_tokens_cached": h, "prefix_cache_hit_rate": rate}
        return [node_rows(t) for t in trees], row

    engine = VLLMBackend(args.model, batch_size=256, engine_kwargs={"block_size": args.block_size})
    trees, res["runs"]["mcts"] = search(engine)
    tokens = res["runs"]["mcts"]["tokens"]
    prompts = [p.prompt for p in problems]
    pilot = engine.generate(prompts, n=2, temperature=0.8, top_p=1.0, max_new_tokens=args.max_new_tokens, seed=1)
    per_sample = sum(s.num_tokens for row in pilot for s in row) / (2 * len(prompts))
    n = max(1, math.ceil(tokens / (per_sample * len(prompts))))
    before, t = engine.stats(), time.perf_counter()
    outs = engine.generate(prompts, n=n, temperature=0.8, top_p=1.0, max_new_tokens=args.max_new_tokens, seed=2)
    dt = time.perf_counter() - t
    q, h, rate = _delta(before, engine.stats())
    got = sum(s.num_tokens for row in outs for s in row)
    res["runs"]["independent"] = {"seconds": dt, "tokens": got, "tokens_per_s": got / dt, "backend_calls": 1,
                                  "samples_per_problem": n, "prompt_tokens_looked_up": q, "prompt_tokens_cached": h,
                                  "prefix_cache_hit_rate": rate,
                                  "solved": sum(any(v == 1.0 for v in domain.verify([s.text for s in row],
                                                                                    [p.answer] * len(row)))
                                                for p, row in zip(problems, outs))}
    engine.close()
    del engine
    gc.collect()

    engine = VLLMBackend(args.model, batch_size=256, enable_prefix_caching=False,
                         engine_kwargs={"block_size": args.block_size})
    trees_off, res["runs"]["mcts, cache off"] = search(engine)
    engine.close()
    res["same_trees_cache_on_and_off"] = trees == trees_off

    print(f"{len(problems)} level-3 problems; MCTS {args.simulations} simulations, K={args.expansions}, "
          f"{args.rollouts} rollouts per valued prefix; KV block {args.block_size} tokens")
    print(f"{'run':18s} {'tokens':>8s} {'seconds':>8s} {'tokens/s':>9s} {'calls':>6s} {'hit rate':>9s} {'solved':>7s}")
    for name, r in res["runs"].items():
        print(f"{name:18s} {r['tokens']:8d} {r['seconds']:8.1f} {r['tokens_per_s']:9.0f} {r['backend_calls']:6d} "
              f"{r['prefix_cache_hit_rate']:9.1%} {r['solved']:7d}")
    on, ind, off = (res["runs"][k]["tokens_per_s"] for k in ("mcts", "independent", "mcts, cache off"))
    print(f"MCTS tokens/s: {on / ind:.2f}x independent sampling's; the cache makes it {on / off:.2f}x faster; "
          f"same trees with the cache on and off: {res['same_trees_cache_on_and_off']}")
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
