"""Any OpenAI-compatible completions server as a generation backend."""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from components.models.backends import Sample
from components.seeding import seed_stream


class OpenAIBackend:
    """Any OpenAI-compatible completions server, e.g. `vllm serve MODEL`: POST {base_url}/v1/completions.

    One request per prompt (n samples each), `max_concurrency` in flight; the server batches them.
    Token counts come from `logprobs` (one entry per generated token); servers that do not return
    them get the request's `usage.completion_tokens` shared evenly across its n samples.
    """

    def __init__(self, model_name_or_path: str, base_url: str = "http://127.0.0.1:8000", api_key: str = "EMPTY",
                 batch_size: int = 16, stop: list[str] | None = None, timeout_s: float = 600):
        self.model, self.base_url, self.api_key = model_name_or_path, base_url.rstrip("/"), api_key
        self.max_concurrency, self.stop, self.timeout_s = batch_size, stop, timeout_s

    def generate(self, prompts: list[str], n: int, temperature: float, top_p: float, max_new_tokens: int,
                 seed: int, stop: list[str] | None = None) -> list[list[Sample]]:
        stop = self.stop if stop is None else stop

        def one(i: int) -> list[Sample]:
            body = {"model": self.model, "prompt": prompts[i], "n": n, "temperature": temperature,
                    "top_p": top_p, "max_tokens": max_new_tokens, "seed": seed_stream(seed, i), "logprobs": 0}
            if stop:
                body["stop"] = stop
            resp = self._post(body)
            choices = sorted(resp["choices"], key=lambda c: c["index"])
            per_choice = resp.get("usage", {}).get("completion_tokens", 0) // max(1, len(choices))
            return [Sample(c["text"], len((c.get("logprobs") or {}).get("tokens") or []) or per_choice,
                           "length" if c.get("finish_reason") == "length" else "stop") for c in choices]

        with ThreadPoolExecutor(max_workers=max(1, self.max_concurrency)) as pool:
            return list(pool.map(one, range(len(prompts))))

    def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(
            f"{self.base_url}/v1/completions", data=json.dumps(body).encode(), method="POST",
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {self.api_key}"})
        with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
            return json.loads(resp.read())
