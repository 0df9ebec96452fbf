"""The pool runner's HTTP transport (`tasks/pool.QuickRetry`) against a real HTTP server on 127.0.0.1 that
answers 503 as a Prefect server on SQLite does when a write collides, then 200."""

from __future__ import annotations

import http.server
import threading
import time

import httpx
import pytest

from tasks.pool import QuickRetry


@pytest.fixture
def busy_server():
    """A server whose first `busy[0]` answers are 503; `seen` counts the requests it got."""
    busy, seen = [0], []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers["Content-Length"]))
            seen.append(body)
            code = 503 if len(seen) <= busy[0] else 200
            self.send_response(code)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", busy, seen
    server.shutdown()


def test_a_503_is_retried_within_a_second_with_the_same_body(busy_server):
    url, busy, seen = busy_server
    busy[0] = 3
    t0 = time.monotonic()
    with httpx.Client(transport=QuickRetry()) as client:
        r = client.post(url + "/flow_runs/", json={"name": "micro/r1/generate/a1.shard0"})
    assert r.status_code == 200 and len(seen) == 4, (r.status_code, len(seen))
    assert len(set(seen)) == 1 and b"a1.shard0" in seen[0]  # each retry sent the same write
    assert time.monotonic() - t0 < 1.0  # Prefect's client alone would have waited 2 s at the first 503


def test_a_503_that_outlasts_the_retries_reaches_the_caller(busy_server):
    url, busy, seen = busy_server
    busy[0] = 100
    with httpx.Client(transport=QuickRetry()) as client:
        r = client.post(url + "/flow_runs/", json={})
    assert r.status_code == 503 and len(seen) == 1 + len(QuickRetry.BACKOFF_S)
