"""The `vllm` and `hf` backends side by side, in one process of `.venv-vllm`, on one model.

    .venv-vllm/bin/python tests/integration/vllm_side_by_side.py MODEL OUT.json

Run by tests/integration/test_vllm.py, which asserts on what this measures; it asserts nothing itself.
Everything runs on the micro config's domain (arith, levels 1-3, the held-out sets): greedy decoding,
sampled pass rates, Monte Carlo step labels on the same prefixes, seeded reproducibility, the prefix
cache, the PRM-guided step sampler (with the domain's oracle as its judge) and the waves of
`until_correct`.
"""

from __future__ import annotations

import json
import sys
import time


def main(model: str, out_path: str) -> None:
    from components.domains import get_domain
    from components.generation import generate_until_correct
    from components.labeling import mc_step_labels
    from components.models.backends import HFBackend
    from components.models.vllm_backend import VLLMBackend
    from components.search import prm_step_search

    domain = get_domain("arith", max_level=3, digits=1, test_size=60)
    problems = [p for level in (1, 2, 3) for p in domain.test_set(level)]
    prompts, refs = [p.prompt for p in problems], [p.answer for p in problems]
    t0 = time.perf_counter()
    engines = {"vllm": VLLMBackend(model, batch_size=256), "hf": HFBackend(model, progress=False)}
    out: dict = {"engine_start_s": time.perf_counter() - t0, "problems": len(problems)}
    kw = dict(top_p=1.0, max_new_tokens=48)

    greedy = {k: b.generate(prompts, n=1, temperature=0.0, seed=0, **kw) for k, b in engines.items()}
    out["greedy_same_text"] = sum(a[0].text == b[0].text for a, b in zip(greedy["hf"], greedy["vllm"]))
    out["greedy_same_tokens"] = sum(a[0].num_tokens == b[0].num_tokens for a, b in zip(greedy["hf"], greedy["vllm"]))

    n = 8
    for k, b in engines.items():
        samples = b.generate(prompts, n=n, temperature=0.8, seed=1, **kw)
        right = domain.verify([s.text for per in samples for s in per], [r for r in refs for _ in range(n)])
        out[f"{k}_right_per_problem"] = [sum(bool(c) for c in right[i * n:(i + 1) * n]) / n
                                         for i in range(len(problems))]
    again = engines["vllm"].generate(prompts, n=n, temperature=0.8, seed=1, **kw)
    first = engines["vllm"].generate(prompts, n=n, temperature=0.8, seed=1, **kw)
    out["vllm_reproduces_itself"] = again == first
    out["vllm_other_seed_differs"] = engines["vllm"].generate(prompts, n=n, temperature=0.8, seed=2, **kw) != first

    # Monte Carlo labels of the same prefixes (the steps of HF's greedy solutions), k rollouts each.
    items = [{"trajectory_id": f"t{i}", "problem_id": p.problem_id, "prompt": p.prompt, "answer_ref": p.answer,
              "steps": domain.split_steps(g[0].text)} for i, (p, g) in enumerate(zip(problems, greedy["hf"]))]
    before = engines["vllm"].stats()
    k = 8
    for name, b in engines.items():
        t = time.perf_counter()
        rows, stats = mc_step_labels(domain, b, items, k=k, temperature=0.8, max_new_tokens=40, seed=3)
        out[f"{name}_mc_seconds"] = time.perf_counter() - t
        out[f"{name}_mc_soft"] = {f"{r['trajectory_id']}/{r['step_index']}": r["value"] for r in rows
                                  if r["source"] == "mc_soft" and r["num_rollouts"]}
        out["mc_rollouts"], out["mc_k"] = stats["rollouts"], k
    after = engines["vllm"].stats()
    out["mc_prefix_cache_queries"] = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    out["mc_prefix_cache_hits"] = after["prefix_cache_hits"] - before["prefix_cache_hits"]

    # The PRM-guided step sampler on vLLM: each step drawn with stop=[separator], judged by the oracle.
    by_prompt = {p.prompt: p for p in problems}

    def oracle_judge(ps: list[str], steps: list[list[str]]) -> list[list[float]]:
        got = []
        for p, st in zip(ps, steps):
            labels = domain.oracle_step_labels(by_prompt[p], "".join(s + domain.step_separator for s in st)) or []
            got.append([1.0 if ok else 0.0 for ok in labels] or [0.0] * len(st))
        return got

    hard = [p for p in problems if p.level == 3][:30]
    searched, sstats = prm_step_search(domain, engines["vllm"], oracle_judge, [p.prompt for p in hard], n=2,
                                       max_tries=4, threshold=0.5, temperature=0.8, top_p=1.0, max_new_tokens=48,
                                       seed=4)
    plain = engines["vllm"].generate([p.prompt for p in hard], n=2, temperature=0.8, seed=4, **kw)
    for name, got in (("searched", searched), ("plain", plain)):
        right = domain.verify([s.text for per in got for s in per], [p.answer for p in hard for _ in range(2)])
        out[f"{name}_right"], out[f"{name}_total"] = sum(bool(c) for c in right), len(right)
    out["search_redraws"] = sstats["redraws"]

    # until_correct waves through vLLM: every problem ends with its samples or with `want` right ones.
    batch, waves = generate_until_correct(
        domain, engines["vllm"], hard, verifier=domain.verify, want=2, wave_size=2, n=8, seed=5,
        experiment="x", round=1, purpose="train", policy_model_id="m", temperature=0.8, top_p=1.0,
        max_new_tokens=48, sample=None)
    out["waves"] = {k: float(v) for k, v in waves.items()}
    out["waves_trajectories"] = len(batch.trajectories)
    out["vllm_stats"] = engines["vllm"].stats()
    engines["vllm"].close()

    # What vLLM cannot start: an architecture it does not know, a LoRA adapter folder, a KV cache over memory.
    import shutil
    from pathlib import Path

    from components.models.backends import BackendError

    bad = Path(out_path).parent / "unknown-arch"  # in the test's folder, beside the result: /tmp kept them
    shutil.copytree(model, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(config | {"architectures": ["NoSuchForCausalLM"]}))
    adapter = Path(out_path).parent / "adapter"
    shutil.copytree(model, adapter)
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": model, "peft_type": "LORA"}))
    out["refused"] = {}
    for name, path, options in (("unknown_arch", bad, {}), ("adapter", adapter, {}),
                                ("out_of_memory", model, {"cpu_kv_cache_gib": 1 << 16})):  # a 64 TiB KV cache
        try:
            VLLMBackend(str(path), **options)
            out["refused"][name] = None
        except BackendError as e:
            out["refused"][name] = {"message": str(e), "transient": e.transient}
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":  # vLLM's engine starts worker processes: the guard keeps them from re-running this
    main(sys.argv[1], sys.argv[2])
