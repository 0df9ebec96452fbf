"""Prefect's temporary server is the `coevo` process's own, even where another server already answers on the port
it drew (flows/prefect_server.py).

    pytest tests/ops/test_prefect_server.py -q
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from components.servers import free_port, http_status
from flows.prefect_server import listens_on, start_own_server


class _Healthy(BaseHTTPRequestHandler):
    """Another process's server: every path answers 200, /api/health included."""

    def do_GET(self):  # noqa: N802
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"true")

    def log_message(self, *args):
        pass


def test_a_port_another_server_answers_on_is_given_up_for_one_of_its_own():
    """The first port drawn is held by a server that answers Prefect's health check, as another coevo run's
    temporary server does when two draw the same port: Prefect's own start returns there, against the other
    server. start_own_server waits for its process to listen, sees it exit, and starts on the next port: the
    server it returns listens there itself and answers."""
    other = ThreadingHTTPServer(("127.0.0.1", 0), _Healthy)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    taken = other.server_address[1]
    drawn = iter([taken])
    server = None
    try:
        server = start_own_server(attempts=2, timeout=60, pick_port=lambda: next(drawn, None) or free_port())
        assert server.port != taken
        assert listens_on(server.server_process.pid, server.port)
        assert not listens_on(server.server_process.pid, taken)
        assert http_status(f"{server.api_url}/health") == 200
    finally:
        if server is not None:
            server.stop()
        other.shutdown()
        other.server_close()
