"""The agent loop's speed on the sql environment: episodes and tokens a second with hf and with vLLM, and where
an episode's time goes.

    .venv/bin/python benchmarks/agents.py --model workdir/standin-sql --episodes 64

`--episodes` episodes (problems of every level, one episode each) run at once through the batched loop: each
turn, every live episode's next assistant turn is sampled in one call, then each episode's tool calls run. The
same episodes run with `hf` here and with `vllm` in `.venv-vllm` (a subprocess, where that environment exists:
`make vllm`), side by side in one run, so their ratio is measured on the same machine. Per backend: episodes/s,
generated tokens/s, assistant turns, tool calls, and the share of the loop's wall time spent in the environment
against generation. The sandbox's executions/s are `benchmarks/sandbox.py`'s.

Figures go to stdout and to `--out` (JSON).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from components.envs import get_env  # noqa: E402
from components.envs.rollout import run_episodes  # noqa: E402
from components.models.backends import get_backend  # noqa: E402


MARK = "agents-benchmark:"  # the vLLM side's result line, among the engine's own output


def measure(backend_name: str, model: str, episodes: int, max_new_tokens: int, seed: int) -> dict:
    from transformers import AutoConfig

    from components.envs.agent import ChatEncoder, ChatSampler

    env = get_env("sql")
    levels = env.levels()
    problems = [p for lv in levels for p in env.sample_problems(lv, -(-episodes // len(levels)), seed=seed)][:episodes]
    options = {"batch_size": episodes, "prompt_format": "chat"}
    if backend_name == "vllm":
        options |= {"max_model_len": AutoConfig.from_pretrained(model).max_position_embeddings}
    else:
        options |= {"progress": False}
    backend = get_backend(backend_name, model, **options)
    sampler = ChatSampler(backend, ChatEncoder(backend.prompts.tok, model), temperature=1.0, top_p=1.0,
                          max_new_tokens=max_new_tokens, seed=seed,
                          max_context=AutoConfig.from_pretrained(model).max_position_embeddings)
    run_episodes(env, sampler, problems[:4], n=1, experiment="bench", round=1, purpose="warmup", policy_model_id=None,
                 seed=seed)  # the engine's first batch compiles and allocates
    t0 = time.perf_counter()
    batch, stats = run_episodes(env, sampler, problems, n=1, experiment="bench", round=1, purpose="train",
                                policy_model_id=None, seed=seed, max_new_tokens=max_new_tokens)
    wall = time.perf_counter() - t0
    tokens = sum(t["num_tokens"] for t in batch.trajectories)
    return {"backend": backend_name, "episodes": len(problems), "wall_s": wall, "episodes_per_s": len(problems) / wall,
            "tokens": tokens, "tokens_per_s": tokens / wall, "assistant_turns": int(stats["assistant_turns"]),
            "tool_calls": int(stats["tool_calls"]), "env_share": stats["env_share"],
            "env_s": stats["env_seconds"], "gen_s": stats["gen_seconds"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="a chat model folder, e.g. `coevo build-model ... --domain sql`")
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=80)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backend", choices=["hf", "vllm", "both"], default="both")
    ap.add_argument("--json", action="store_true", help="print one JSON line (how the vLLM side reports back)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    if a.backend != "both":
        row = measure(a.backend, a.model, a.episodes, a.max_new_tokens, a.seed)
        print(f"{MARK} {json.dumps(row)}" if a.json else row, flush=True)
        return
    rows = [measure("hf", a.model, a.episodes, a.max_new_tokens, a.seed)]
    vllm_py = REPO / ".venv-vllm" / "bin" / "python"
    if vllm_py.exists():
        out = subprocess.run([str(vllm_py), __file__, "--backend", "vllm", "--json", "--model", a.model,
                              "--episodes", str(a.episodes), "--max-new-tokens", str(a.max_new_tokens),
                              "--seed", str(a.seed)], capture_output=True, text=True, check=True)
        rows += [json.loads(line[len(MARK):]) for line in out.stdout.splitlines() if line.startswith(MARK)]
    else:
        print(f"no {vllm_py}: `make vllm` builds it; hf alone is measured", file=sys.stderr)
    print(f"sql environment, {a.episodes} concurrent episodes, up to {a.max_new_tokens} new tokens a turn")
    print(f"{'backend':8} {'episodes/s':>10} {'tokens/s':>9} {'turns':>6} {'tool calls':>10} {'env share':>9} {'wall s':>7}")
    for r in rows:
        print(f"{r['backend']:8} {r['episodes_per_s']:10.2f} {r['tokens_per_s']:9.1f} {r['assistant_turns']:6d} "
              f"{r['tool_calls']:10d} {r['env_share']:9.1%} {r['wall_s']:7.2f}")
    if len(rows) == 2:
        print(f"vllm / hf: episodes/s {rows[1]['episodes_per_s'] / rows[0]['episodes_per_s']:.2f}, "
              f"tokens/s {rows[1]['tokens_per_s'] / rows[0]['tokens_per_s']:.2f}")
    if a.out:
        a.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
