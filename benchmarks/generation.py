"""Generation throughput, side by side in one run: HF `generate` vs vLLM vs the OpenAI client on `vllm serve`,
and vLLM's prefix caching on the Monte Carlo rollouts of a round.

    make vllm && PYTHONPATH=. .venv-vllm/bin/python benchmarks/generation.py        # ~6 min on 2 CPU cores
    PYTHONPATH=. .venv-vllm/bin/python benchmarks/generation.py --no-server --out /tmp/gen.json

It runs in `.venv-vllm`, which has torch and transformers as well as vLLM, so all three engines run here
on the same model, prompts, n, temperature and max tokens. The model is a stand-in built here
(`components.models.standin`: a BPE tokenizer trained on arith text, a random Qwen2, a chat template),
prompted as a chat model is, under a system prompt. Its weights are random, so its completions are noise:
what is measured is the engine, not the answers.

1. Throughput: `--problems` arith prompts, n samples each: generated tokens per second of each engine.
2. Monte Carlo rollouts: the workload `score` sends its backend (`labeling.mc_step_labels`): k rollouts
   from every prefix (prompt + the first i steps) of the problems' reference solutions, in one call. The
   prefixes share their chat template and system prompt, and a problem's prefixes share its question and
   earlier steps: prefix caching computes those blocks once. vLLM with the cache on vs off.

Timings are wall clock after each engine's start (reported apart).

3. On a CUDA machine only: decode throughput against the HBM roofline. A bf16 stand-in (`--roofline-size`:
   190M or 1.1B parameters) decodes `--roofline-tokens` tokens for each of `--roofline-batch` sequences (EOS
   ignored), with vLLM where it is installed, else HF `generate` (eager, then with a compiled static cache) and
   the bare forward loop; the roofline is batch x bandwidth / model bytes (`--hbm-tb-s`: 3.0 for an H100, 4.2
   measured on an H200), the bound of a decode step that reads every weight once. On an image without vLLM:

       python3 benchmarks/generation.py --gpu-only --hbm-tb-s 4.24 --roofline-size 1b
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

SYSTEM = ("You are a careful arithmetic tutor. Solve the problem one operation per line: write the operation "
          "on the running total and its result, as in 3+4=7, then the next operation on that result. Never skip "
          "or merge operations, never reorder them, and do not explain in words. When every operation is done, "
          "write a last line with four hash marks, a space and the final number, as in #### 12.")


def _timed(backend, prompts: list[str], **kw) -> dict[str, float]:
    t = time.perf_counter()
    out = backend.generate(prompts, **kw)
    dt = time.perf_counter() - t
    tokens = sum(s.num_tokens for per in out for s in per)
    return {"seconds": dt, "tokens": tokens, "tokens_per_s": tokens / dt}


STANDINS = {"190m": dict(hidden_size=1024, num_layers=16, num_heads=16, num_kv_heads=8, intermediate_size=2816),
            "1b": dict(hidden_size=2048, num_layers=24, num_heads=16, num_kv_heads=8, intermediate_size=5632)}


def gpu_roofline(work: Path, texts: list[str], batch: int, new_tokens: int, hbm_tb_s: float,
                 size: str = "190m") -> list[dict]:
    """Decode tokens/s of a bf16 stand-in (`STANDINS[size]`) at `batch` sequences, against the HBM roofline, one
    row per engine: vLLM where it is installed; else HF `generate` as the hf backend runs it (dynamic cache),
    the model's own KV-cached forward in a Python loop (what generate's loop costs on top), and `generate` with
    a static cache, which transformers compiles into CUDA graphs (its first call, the compile, is left out)."""
    import torch

    from components.models.standin import build_standin, param_count

    model = str(build_standin(work / f"standin-gpu-{size}", texts, seed=0, max_position_embeddings=2048,
                              **STANDINS[size]))
    params = param_count(model)
    roofline = batch * hbm_tb_s * 1e12 / (2 * params)  # bf16: 2 bytes a parameter, all read once per step
    rows = []

    def row(engine: str, tokens: int, seconds: float) -> None:
        rows.append({"engine": engine, "gpu": torch.cuda.get_device_name(), "parameters": params, "batch": batch,
                     "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
                     "roofline_tokens_per_s": roofline, "share_of_roofline": tokens / seconds / roofline})

    prompts = ["1+2-3+4\n"] * batch
    try:
        from vllm import LLM, SamplingParams

        llm = LLM(model=model, dtype="bfloat16", max_num_seqs=batch, gpu_memory_utilization=0.8, seed=0)
        sp = SamplingParams(temperature=0.8, max_tokens=new_tokens, ignore_eos=True, seed=0)
        llm.generate(prompts[:8], sp, use_tqdm=False)  # warm-up
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        row("vllm", sum(len(c.token_ids) for o in outs for c in o.outputs), time.perf_counter() - t)
        return rows
    except ImportError:  # a GPU image with torch and transformers only
        pass
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    tok.padding_side = "left"
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).cuda().eval()
    enc = tok(prompts, return_tensors="pt", padding=True).to("cuda")
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True, temperature=0.8,
              pad_token_id=tok.pad_token_id)

    def timed(fn) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t

    with torch.inference_mode():
        lm.generate(**enc, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
        row("hf generate", batch * new_tokens, timed(lambda: lm.generate(**enc, **kw)))

        def loop() -> None:
            out = lm(enc["input_ids"], attention_mask=enc["attention_mask"], use_cache=True)
            for _ in range(new_tokens - 1):
                nxt = torch.multinomial(torch.softmax(out.logits[:, -1].float() / 0.8, -1), 1)
                out = lm(nxt, past_key_values=out.past_key_values, use_cache=True)

        loop()
        row("forward loop", batch * new_tokens, timed(loop))
        static = lambda: lm.generate(**enc, **kw, cache_implementation="static")  # noqa: E731
        compile_s = timed(static)
        row("hf generate, static cache", batch * new_tokens, timed(static))
        rows[-1]["compile_seconds"] = compile_s
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problems", type=int, default=128, help="prompts for the throughput test")
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=8, help="Monte Carlo rollouts per prefix")
    ap.add_argument("--mc-problems", type=int, default=64, help="problems whose reference prefixes are rolled out")
    ap.add_argument("--no-server", action="store_true", help="leave out the OpenAI client on vllm serve")
    ap.add_argument("--roofline-batch", type=int, default=256, help="GPU only: sequences decoded at once")
    ap.add_argument("--roofline-tokens", type=int, default=256, help="GPU only: tokens decoded per sequence")
    ap.add_argument("--hbm-tb-s", type=float, default=3.0, help="GPU only: HBM bandwidth, TB/s")
    ap.add_argument("--roofline-size", choices=sorted(STANDINS), default="190m", help="GPU only: the stand-in")
    ap.add_argument("--gpu-only", action="store_true", help="the roofline alone (a GPU image without vLLM)")
    ap.add_argument("--out", type=Path, help="also write the figures as JSON")
    args = ap.parse_args()

    import torch

    from components.domains import get_domain

    if args.gpu_only:
        from components.models.standin import domain_texts

        texts = list(domain_texts(get_domain("arith"), n_per_level=300, seed=0))
        rows = gpu_roofline(Path(tempfile.mkdtemp(prefix="coevo-bench-gpu-")), texts, args.roofline_batch,
                            args.roofline_tokens, args.hbm_tb_s, args.roofline_size)
        _print_gpu(rows)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"gpu": rows, "settings": {**vars(args), "out": str(args.out)}}, indent=1))
        return
    from components.labeling import mc_step_labels
    from components.models.backends import HFBackend
    from components.models.prompts import PromptFormat
    from components.models.standin import build_standin, domain_texts, param_count
    from components.models.vllm_backend import VLLMBackend

    torch.set_num_threads(os.cpu_count() or 1)
    domain = get_domain("arith")
    work = Path(tempfile.mkdtemp(prefix="coevo-bench-gen-"))
    texts = list(domain_texts(domain, n_per_level=300, seed=0))  # the GPU stand-in reuses them
    model = str(build_standin(work / "standin", texts, seed=0))
    fmt = PromptFormat("chat", SYSTEM)
    problems = [p for level in domain.levels() for p in domain.test_set(level)]
    prompts = [p.prompt for p in problems[: args.problems]]
    kw = dict(n=args.n, temperature=0.8, top_p=1.0, max_new_tokens=args.max_new_tokens, seed=0)
    res: dict = {"model": {"path": "stand-in (qwen2, random init)", "parameters": param_count(model)},
                 "device": "cuda" if torch.cuda.is_available() else f"cpu ({os.cpu_count()} cores)",
                 "throughput": {}, "mc_rollouts": {}, "engine_start_s": {},
                 "settings": {**vars(args), "out": str(args.out) if args.out else None}}
    n_prompt = len(HFBackend(model, progress=False, prompt_format=fmt).prompts.encode(prompts[:1])[0])
    res["settings"]["prompt_tokens_first"] = n_prompt
    print(f"stand-in: {res['model']['parameters']:,} parameters; {len(prompts)} prompts x n={args.n}, "
          f"{args.max_new_tokens} new tokens; a chat prompt is ~{n_prompt} tokens", flush=True)

    hf = HFBackend(model, batch_size=256, progress=False, prompt_format=fmt)
    res["throughput"]["hf"] = _timed(hf, prompts, **kw)
    print(f"hf generate      {res['throughput']['hf']['tokens_per_s']:9.0f} tokens/s", flush=True)
    del hf
    gc.collect()

    # Rollout slots as score builds them: every non-final prefix of each reference solution.
    items = [{"trajectory_id": p.problem_id, "problem_id": p.problem_id, "prompt": p.prompt, "answer_ref": p.answer,
              "steps": domain.split_steps(domain.reference_solution(p))}
             for p in problems[-args.mc_problems:]]  # the hardest levels: the longest solutions
    for caching in (True, False):
        t = time.perf_counter()
        engine = VLLMBackend(model, batch_size=256, prompt_format=fmt, enable_prefix_caching=caching)
        res["engine_start_s"][f"vllm_cache_{'on' if caching else 'off'}"] = time.perf_counter() - t
        if caching:
            res["throughput"]["vllm"] = _timed(engine, prompts, **kw)
            print(f"vllm             {res['throughput']['vllm']['tokens_per_s']:9.0f} tokens/s", flush=True)
        before = engine.stats()
        t = time.perf_counter()
        _, stats = mc_step_labels(domain, engine, items, k=args.k, temperature=0.8,
                                  max_new_tokens=args.max_new_tokens, seed=1)
        dt = time.perf_counter() - t
        after = engine.stats()
        queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
        hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
        row = {"seconds": dt, "rollouts": stats["rollouts"], "prefixes": stats["unique_prefixes"],
               "tokens": stats["generated_tokens"], "tokens_per_s": stats["generated_tokens"] / dt,
               "prefix_cache_hit_rate": hits / queries if queries else 0.0}
        res["mc_rollouts"]["cache_on" if caching else "cache_off"] = row
        print(f"MC rollouts, prefix cache {'on ' if caching else 'off'}: {row['rollouts']} rollouts from "
              f"{row['prefixes']} prefixes in {dt:.1f}s, {row['tokens_per_s']:.0f} tokens/s, "
              f"hit rate {row['prefix_cache_hit_rate']:.1%}", flush=True)
        engine.close()
        del engine
        gc.collect()

    if not args.no_server:
        from components.models.openai_backend import OpenAIBackend

        from components.servers import free_port, vllm_served

        port = free_port()
        t = time.perf_counter()
        with vllm_served(model, port, work / "serve.log", python=sys.executable):
            res["engine_start_s"]["vllm_serve"] = time.perf_counter() - t
            client = OpenAIBackend(model, base_url=f"http://127.0.0.1:{port}/v1", batch_size=64, prompt_format=fmt)
            res["throughput"]["openai_vllm_serve"] = _timed(client, prompts, **kw)
            print(f"openai -> serve  {res['throughput']['openai_vllm_serve']['tokens_per_s']:9.0f} tokens/s",
                  flush=True)

    tp, mc = res["throughput"], res["mc_rollouts"]
    ratios = {"vllm_over_hf": tp["vllm"]["tokens_per_s"] / tp["hf"]["tokens_per_s"],
              "mc_cache_on_over_off_tokens_per_s": mc["cache_on"]["tokens_per_s"] / mc["cache_off"]["tokens_per_s"],
              "mc_cache_off_over_on_seconds": mc["cache_off"]["seconds"] / mc["cache_on"]["seconds"]}
    if "openai_vllm_serve" in tp:
        ratios["server_over_hf"] = tp["openai_vllm_serve"]["tokens_per_s"] / tp["hf"]["tokens_per_s"]
        ratios["server_over_vllm"] = tp["openai_vllm_serve"]["tokens_per_s"] / tp["vllm"]["tokens_per_s"]
    res["ratios"] = ratios
    res["gpu"] = (gpu_roofline(work, texts, args.roofline_batch, args.roofline_tokens, args.hbm_tb_s,
                               args.roofline_size) if torch.cuda.is_available() else "not measured: no GPU here")
    print("\nratios, measured side by side in this run:")
    for k, v in ratios.items():
        print(f"  {k:36s} {v:6.2f}")
    if isinstance(res["gpu"], str):
        print(f"GPU roofline: {res['gpu']}")
    else:
        _print_gpu(res["gpu"])
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1))


def _print_gpu(rows: list[dict]) -> None:
    for g in rows:
        print(f"GPU roofline ({g['gpu']}, {g['engine']}, {g['parameters']:,} parameters bf16, batch {g['batch']}): "
              f"{g['tokens_per_s']:.0f} tokens/s = {g['share_of_roofline']:.1%} of {g['roofline_tokens_per_s']:.0f}",
              flush=True)


if __name__ == "__main__":  # vLLM's engine starts worker processes: the guard keeps them from re-running this
    main()
