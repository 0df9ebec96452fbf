"""Any OpenAI-compatible completions server as a generation backend, through the official `openai` client.

    vllm serve workdir/arith-default/r0/bootstrap/a1/model --port 8000 &
    backend = get_backend("openai", "workdir/arith-default/r0/bootstrap/a1/model", base_url="http://127.0.0.1:8000")
    samples = backend.generate(["3+4\\n"], n=4, temperature=0.8, top_p=1.0, max_new_tokens=32, seed=0)

In a config: `generate: {backend: openai, backend_options: {base_url: "http://gpu-node:8000/v1"}}`.

A whole run against one long-lived server, whose policy changes every round: start it with vLLM's development
endpoints and a fixed name, and let each stage load its round's checkpoint into it (the server must read the
workdir's path, e.g. over a shared filesystem):

    VLLM_SERVER_DEV_MODE=1 vllm serve workdir/.../r0/bootstrap/a1/model --served-model-name policy --port 8000
    generate: {backend: openai, backend_options: {base_url: "http://gpu-node:8000/v1", served_model_name: policy,
                                                  reload_weights: true}}

Before its first request a stage then pauses the server (in-flight requests finish), reloads the weights in place
from its model's folder (`/collective_rpc` `reload_weights`), clears the prefix cache, and resumes. One server
serves one experiment at a time.

Where the model's tokenizer is at hand (the model is a local folder, or `tokenizer` names one), prompts are
rendered and cut by HFBackend's PromptEncoder and sent as token ids, with its EOS ids as vLLM's `stop_token_ids`:
the server reads what `hf` would feed the model and stops where `hf` stops. Without one (a hub name served
elsewhere) prompts go as text, and only the raw prompt format is possible.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from components.models.backends import BackendError, PromptEncoder, Sample, _cut_at_stop
from components.models.prompts import PromptFormat
from components.seeding import seed_stream

# Statuses the client retries itself, with 5xx (openai/_base_client.py `_should_retry`): still failing after
# max_retries, the server is overloaded or restarting, and the stage may succeed later.
RETRIED_STATUS = (408, 409, 429)


class OpenAIBackend:
    """An OpenAI-compatible server, e.g. `vllm serve MODEL`: POST {base_url}/completions.

    One request per prompt (its n samples share it), at most `batch_size` in flight; the server batches them.
    Prompt i is seeded with seed_stream(seed, i), as by VLLMBackend. Token counts come from vLLM's
    `return_token_ids`; from other servers, from `logprobs` where returned, else `usage.completion_tokens`
    shared across the n samples. Stop strings are left out of the text, as by every backend.

    The client retries refused or broken connections, timeouts, 429 and 5xx `max_retries` times, with backoff.
    What still fails raises BackendError, transient for those and not for a 4xx or a malformed response, and
    cancels the requests still in flight. `served_model_name` is the name the server knows the model by
    (`vllm serve PATH` serves it as PATH); `dtype` is the server's business and is ignored here.
    """

    def __init__(self, model_name_or_path: str, base_url: str = "http://127.0.0.1:8000/v1", api_key: str | None = None,
                 batch_size: int = 16, stop: list[str] | None = None, timeout_s: float = 600, max_retries: int = 3,
                 served_model_name: str | None = None, tokenizer: str | None = None,
                 prompt_format: PromptFormat | dict[str, Any] | str | None = None, max_prompt_length: int | None = None,
                 max_truncated_fraction: float = 0.0, setting: str = "generate", dtype: str | None = None,
                 reload_weights: bool = False):
        if batch_size < 1:
            raise ValueError(f"{setting}.batch_size (requests in flight) must be >= 1, got {batch_size}")
        if reload_weights and served_model_name is None:
            raise ValueError(f"{setting}.backend_options.reload_weights needs served_model_name: the fixed name the "
                             "server was started with (`vllm serve ... --served-model-name policy`), as each stage "
                             "loads another checkpoint into it")
        if reload_weights and not Path(model_name_or_path).expanduser().is_dir():
            raise ValueError(f"{setting}.backend_options.reload_weights: the model {model_name_or_path} is not a "
                             "local checkpoint folder, so the server has nothing to load")
        self.reload_weights, self.weight_reloads, self.weight_reload_s = reload_weights, 0, 0.0
        self.model, self.served_model_name = model_name_or_path, served_model_name or model_name_or_path
        self.base_url = api_root(base_url)
        self.api_key = api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"  # vLLM takes any key unless --api-key
        self.batch_size, self.stop, self.timeout_s, self.max_retries = batch_size, stop, timeout_s, max_retries
        if tokenizer is None and Path(model_name_or_path).expanduser().is_dir():
            tokenizer = model_name_or_path
        self.prompts: PromptEncoder | None = None
        if tokenizer is not None:
            path = str(Path(tokenizer).expanduser()) if tokenizer.startswith("~") else tokenizer
            self.prompts = PromptEncoder.from_pretrained(path, model_name_or_path, prompt_format, max_prompt_length,
                                                         max_truncated_fraction, setting)
        elif PromptFormat.of(prompt_format).kind != "raw" or max_prompt_length is not None:
            raise ValueError(
                f"backend 'openai' (model {model_name_or_path}): prompt_format 'chat' and {setting}.max_prompt_length "
                "need the model's tokenizer, to render and cut prompts as training does; give backend_options."
                "tokenizer (a folder or hub name), or serve a local model folder")

    @property
    def truncated_prompts(self) -> int:
        return self.prompts.truncated_prompts if self.prompts else 0

    def stats(self) -> dict[str, float]:
        """The server's weight reloads, where `reload_weights` is on (the stage logs them as `engine_*`)."""
        return {"weight_reloads": self.weight_reloads, "weight_reload_s": self.weight_reload_s} \
            if self.reload_weights else {}

    def load_weights(self) -> None:
        """Load this backend's checkpoint into the server, in place: pause it (letting in-flight requests finish),
        `reload_weights` from the folder, clear the prefix cache (its blocks hold the old weights' keys), and resume,
        even after a failure. Needs vLLM's development endpoints (VLLM_SERVER_DEV_MODE=1)."""
        import httpx2  # the openai client's own HTTP library

        root = self.base_url.removesuffix("/v1")
        path = str(Path(self.model).expanduser().resolve())
        start = time.perf_counter()
        with httpx2.Client(base_url=root, timeout=self.timeout_s,
                           headers={"Authorization": f"Bearer {self.api_key}"}) as client:
            def call(method: str, route: str, **kwargs: Any) -> object:
                try:
                    r = client.request(method, route, **kwargs)
                except httpx2.HTTPError as e:
                    raise self._error(f"reloading weights: {method} {root}{route} failed ({_cause(e)})", True,
                                      route) from e
                if r.status_code == 404:
                    raise self._error(f"reloading weights: the server has no {route}; start it with "
                                      "VLLM_SERVER_DEV_MODE=1 for vLLM's development endpoints", False, route)
                body = _json(r)
                if r.status_code >= 400 or (isinstance(body, dict) and body.get("success") is False):
                    raise self._error(f"reloading weights: {method} {root}{route}: HTTP {r.status_code}: "
                                      f"{_server_message(body)}", r.status_code >= 500, route)
                return body

            info = call("GET", "/server_info", params={"config_format": "json"})
            config = info.get("vllm_config") if isinstance(info, dict) else None
            device = ((config or {}).get("device_config") or {}).get("device") if isinstance(config, dict) else None
            if device == "cpu" and tied_embeddings(path):
                raise self._error(
                    "reloading weights: the model ties its output layer to its embeddings (tie_word_embeddings), "
                    "and vLLM's CPU build keeps that layer's prepacked weights across reload_weights, so the server "
                    "would sample with the old ones; serve a checkpoint whose embeddings are untied, or start a "
                    "server per stage", False, "/server_info")
            call("POST", "/pause", params={"mode": "wait"})
            try:
                call("POST", "/collective_rpc", json={"method": "reload_weights", "kwargs": {"weights_path": path}})
                call("POST", "/reset_prefix_cache")
            except BackendError:
                with contextlib.suppress(BackendError):  # the first failure is the one to report
                    call("POST", "/resume")
                raise
            call("POST", "/resume")
        self.weight_reloads += 1
        self.weight_reload_s += time.perf_counter() - start

    def generate(self, prompts: list[str], n: int, temperature: float, top_p: float, max_new_tokens: int,
                 seed: int, stop: list[str] | None = None) -> list[list[Sample]]:
        if not prompts:
            return []
        sent: list[str] | list[list[int]] = self.prompts.encode(prompts) if self.prompts else list(prompts)
        return self._generate(sent, n, temperature, top_p, max_new_tokens, seed, stop)

    def generate_ids(self, prompt_ids: list[list[int]], n: int, temperature: float, top_p: float,
                     max_new_tokens: int, seed: int, stop: list[str] | None = None) -> list[list[Sample]]:
        """`generate` on prompts given as token ids; each Sample carries the ids the server sampled (vLLM's
        `return_token_ids`)."""
        if self.prompts is None:
            raise ValueError(f"backend 'openai' (model {self.model}): sampling from token ids needs the model's "
                             "tokenizer, for its stop ids; give backend_options.tokenizer or serve a local folder")
        return self._generate(prompt_ids, n, temperature, top_p, max_new_tokens, seed, stop)

    def _generate(self, sent: list[str] | list[list[int]], n: int, temperature: float, top_p: float,
                  max_new_tokens: int, seed: int, stop: list[str] | None) -> list[list[Sample]]:
        stop = self.stop if stop is None else stop
        if not sent:
            return []
        if self.reload_weights and not self.weight_reloads:
            self.load_weights()
        extra: dict[str, Any] = {"return_token_ids": True}  # vLLM's; a strict server answers 400, named in the error
        if self.prompts:
            extra["stop_token_ids"] = self.prompts.eos_ids
        # Greedy decoding gives one answer, and vLLM's server refuses n > 1 with temperature 0: ask once, copy.
        copies = n if temperature == 0 else 1
        params: dict[str, Any] = dict(model=self.served_model_name, n=n // copies, temperature=temperature,
                                      top_p=top_p if temperature > 0 else 1.0, max_tokens=max_new_tokens,
                                      extra_body=extra)
        if stop:
            params["stop"] = stop
        return [per * copies for per in _run(self._generate_all(sent, params, seed, stop))]

    async def _generate_all(self, sent: list[str] | list[list[int]], params: dict[str, Any], seed: int,
                            stop: list[str] | None) -> list[list[Sample]]:
        from openai import AsyncOpenAI, Timeout

        # A client per call: an async client belongs to the event loop it first ran in.
        client = AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, max_retries=self.max_retries,
                             timeout=Timeout(self.timeout_s, connect=min(self.timeout_s, 10.0)))
        in_flight = asyncio.Semaphore(self.batch_size)

        async def one(i: int) -> list[Sample]:
            async with in_flight:
                return await self._request(client, sent[i], seed_stream(seed, i), params, stop)

        tasks = [asyncio.create_task(one(i)) for i in range(len(sent))]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:  # after the first failure (or an interrupt) cancel the rest; vLLM aborts a request whose client left
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await client.close()
        errors = [task.exception() for task in tasks if not task.cancelled() and task.exception()]
        if errors:
            raise errors[0]
        return [task.result() for task in tasks]

    async def _request(self, client: Any, prompt: str | list[int], seed: int, params: dict[str, Any],
                       stop: list[str] | None) -> list[Sample]:
        from openai import APIConnectionError, APIStatusError, APITimeoutError

        try:
            raw = await client.completions.with_raw_response.create(prompt=prompt, seed=seed, **params)
        except APIStatusError as e:
            transient = e.status_code >= 500 or e.status_code in RETRIED_STATUS
            raise self._error(f"HTTP {e.status_code}: {_server_message(e.body)}", transient) from e
        except APITimeoutError as e:  # before APIConnectionError, its base class
            raise self._error(f"timed out: no answer within timeout_s={self.timeout_s}, after "
                              f"{self.max_retries} retries", True) from e
        except APIConnectionError as e:
            raise self._error(f"connection refused or lost after {self.max_retries} retries ({_cause(e)})", True) from e
        try:  # parsed here rather than by the client, which passes bad JSON and missing fields through unchecked
            return _samples(json.loads(raw.content), params["n"], stop)
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise self._error(f"malformed response ({type(e).__name__}: {e}): {raw.text[:300]!r}", False) from e

    def _error(self, what: str, transient: bool, route: str = "/completions") -> BackendError:
        where = f"POST {self.base_url}{route}" if route == "/completions" else "the server"
        return BackendError("openai", self.model, f"{where} (served model {self.served_model_name!r}): {what}",
                            transient=transient)


def tied_embeddings(model_dir: str | Path) -> bool:
    """Whether a checkpoint's output layer is its input embeddings (`tie_word_embeddings`, at the top of its
    config or in its text config)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    text = config.get("text_config") or {}
    return bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))


def api_root(base_url: str) -> str:
    """The API root the client posts under: `/v1` added to a bare server address.

    >>> api_root("http://127.0.0.1:8000"), api_root("http://127.0.0.1:8000/v1/")
    ('http://127.0.0.1:8000/v1', 'http://127.0.0.1:8000/v1')
    """
    url = base_url.rstrip("/")
    return url if urlsplit(url).path else f"{url}/v1"


def _samples(body: Any, n: int, stop: list[str] | None) -> list[Sample]:
    """One response's choices, by index, as Samples; ValueError (or a lookup error) where it is not a completion."""
    choices = body.get("choices") if isinstance(body, dict) else None
    if not isinstance(choices, list):
        raise ValueError("no 'choices' list")
    if len(choices) != n:
        raise ValueError(f"{len(choices)} choices for n={n}")
    completion_tokens = (body.get("usage") or {}).get("completion_tokens")
    out = []
    for k, c in enumerate(sorted(choices, key=lambda c: c["index"])):
        text, cut = _cut_at_stop(c["text"], stop)  # a server that ignored `stop` is cut here, as HFBackend cuts
        reason = "length" if c.get("finish_reason") == "length" and not cut else "stop"
        ids = tuple(c["token_ids"]) if isinstance(c.get("token_ids"), list) else None
        out.append(Sample(text, _num_tokens(c, completion_tokens, k, n), reason, ids))
    return out


def _num_tokens(choice: dict[str, Any], completion_tokens: Any, k: int, n: int) -> int:
    """Choice k's generated tokens: vLLM's token_ids, else logprobs' tokens, else its share of the usage.

    >>> [_num_tokens({}, 7, k, 3) for k in range(3)]
    [3, 2, 2]
    """
    if isinstance(choice.get("token_ids"), list):
        return len(choice["token_ids"])
    tokens = (choice.get("logprobs") or {}).get("tokens")
    if isinstance(tokens, list):
        return len(tokens)
    if isinstance(completion_tokens, int):
        share, rest = divmod(completion_tokens, n)
        return share + (k < rest)
    raise ValueError("no token counts: neither choices[].token_ids, choices[].logprobs nor usage.completion_tokens")


def _server_message(body: object) -> str:
    """What the server said: the error's message (vLLM, OpenAI, FastAPI's `detail`), else the body as it came.

    >>> _server_message({"error": {"message": "no such model"}}), _server_message({"detail": "Missing 'method'"})
    ('no such model', "Missing 'method'")
    """
    if isinstance(body, dict):
        inner = body.get("error")
        if isinstance(inner, (dict, str)) and inner:
            return _server_message(inner) if isinstance(inner, dict) else inner
        message = body.get("message", body.get("detail"))
        return message if isinstance(message, str) and message else json.dumps(body)[:500]
    return str(body)[:500] if body else "(empty body)"


def _json(response: Any) -> object:
    """A response's JSON body, else its text."""
    try:
        return response.json()
    except ValueError:
        return response.text


def _cause(e: BaseException) -> str:
    """What failed under the client's wrapping: the socket's error where there is one ('Connect call failed')."""
    found, link = e.__cause__ or e, e
    for _ in range(16):  # the chain runs through the client, httpx2, httpcore2 and anyio
        link = link.__cause__ or link.__context__
        if link is None:
            break
        if isinstance(link, OSError):
            found = link
    return f"{type(found).__name__}: {found}"


def _run(coro: Any) -> Any:
    """asyncio.run, in a thread of its own where the caller's thread runs an event loop already (a notebook)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()
