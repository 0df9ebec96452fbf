"""Prefect's temporary server for one `coevo` process, on a port that is this process's own.

Without `PREFECT_API_URL` Prefect starts a temporary server in a subprocess, on a port drawn at random from
8000-8999 that a test bind finds free. Two `coevo run`s that start together can draw the same port (the benchmark
runs pairs of them; `tests/fault` four): the second's server fails to bind once its startup is done, about 8 s on
two busy cores, but its health check has already been answered by the first's. The run then goes on against the
other process's server, its flow and task runs recorded in the other's database, and fails with `ConnectError`
when that process ends and stops its server (measured: a benchmark's rft run lost at its last round this way).

`start_own_server` draws the port from the kernel instead (a bind to port 0: concurrent binders get different
ports), and returns only once the socket listening there belongs to the server process it started; where that
process exits first, or another listens there, it stops it and tries another port. `use_own_server` registers
the server where Prefect's client looks for its temporary server, as Prefect's own test harness does
(`prefect.testing.utilities.prefect_test_harness`), so the flow uses it and stops it at exit.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from components.servers import free_port


def listens_on(pid: int, port: int) -> bool:
    """Whether process `pid` (or a child of it) holds a socket listening on 127.0.0.1:`port`."""
    import psutil

    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return False
    for p in procs:
        try:
            if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
                   for c in p.net_connections(kind="tcp")):
                return True
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return False


def start_own_server(attempts: int = 5, timeout: float | None = None,
                     pick_port: Callable[[], int] = free_port) -> Any:
    """A started `SubprocessASGIServer` whose process listens on its port; raises RuntimeError after `attempts`
    ports where none did within `timeout` seconds (default: PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS)."""
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS

    wait = timeout or PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()
    tried = []
    for _ in range(attempts):
        port = pick_port()
        tried.append(port)
        server = SubprocessASGIServer(port=port)
        try:
            server.start(timeout=int(wait))  # answers once /api/health does on the port, whoever serves it
        except RuntimeError:
            server.stop()
            continue
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and server.server_process.poll() is None:
            if listens_on(server.server_process.pid, port):
                return server
            time.sleep(0.1)
        server.stop()  # it exited (another process holds the port) or never listened
    raise RuntimeError(f"Prefect's temporary server did not start on any of ports {tried}; set PREFECT_API_URL to a "
                       "running server (`coevo server up`) or raise PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS")


def use_own_server() -> str | None:
    """Where no PREFECT_API_URL is set, so Prefect's client would start a temporary server: start this process's
    own (`start_own_server`) and make it the one the client uses. Returns its API URL, else None."""
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value():
        return None
    current = SubprocessASGIServer._instances.get(None)
    if current is not None and current.running:
        return current.api_url
    server = start_own_server()
    SubprocessASGIServer._instances[None] = server
    return server.api_url
