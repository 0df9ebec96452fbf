"""`components.servers`: `vllm_served` gives a `vllm serve` process for a `with` block, stopped after it, its temporary
folder removed. A stand-in interpreter serves `/v1/models` as vLLM's server does, so this runs without vLLM
(`tests/integration/test_vllm.py` and `test_agents.py` run the real one through it)."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from tests.conftest import alive

# Answers `python -m components.models.vllm_cli serve MODEL --port N ...` as vLLM's server would at /v1/models,
# after leaving a file in its TMPDIR, as vLLM leaves its IPC sockets there.
FAKE_SERVER = '''
import http.server, os, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
open(os.path.join(os.environ["TMPDIR"], "ipc-socket"), "w").close()
print(os.getpid(), os.environ["TMPDIR"], flush=True)

class Models(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/v1/models" else 404)
        self.end_headers()
        self.wfile.write(b'{"data": []}')

http.server.HTTPServer(("127.0.0.1", port), Models).serve_forever()
'''


def test_a_served_model_is_stopped_and_its_temporary_folder_removed_after_the_block(tmp_path, monkeypatch):
    from components.servers import free_port, vllm_served

    script = tmp_path / "server.py"
    script.write_text(FAKE_SERVER)
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} {script} \"$@\"\n")
    python.chmod(0o755)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    log = tmp_path / "serve.log"
    with vllm_served("some/model", free_port(), log, python=python) as server:
        pid, folder = log.read_text().splitlines()[0].split()
        assert int(pid) == server.pid and Path(folder).parent == scratch
        assert (Path(folder) / "ipc-socket").exists() and server.poll() is None
    assert server.poll() is not None and not list(scratch.iterdir())


def test_a_process_group_that_ignores_sigterm_is_killed_after_the_grace_period():
    """How `coevo server down` and `vllm_served` stop a server: SIGTERM to the group, SIGKILL once `grace_s` is over."""
    import subprocess
    import time

    from components.servers import _end_group

    # A leader that ignores SIGTERM, with a child in its group that ignores it too.
    child = ("import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
             "print(os.getpid(), flush=True); time.sleep(60)")
    code = (f"import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            f"subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True, stdout=subprocess.PIPE, text=True)
    child_pid = int(proc.stdout.readline())
    start = time.monotonic()
    _end_group(proc.pid, lambda: proc.poll() is None, 1.0, "a test group")
    assert proc.poll() == -9 and 1.0 <= time.monotonic() - start < 10
    deadline = time.monotonic() + 5
    while alive(child_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.stdout.close()
    assert not alive(child_pid), "a member of the group outlived SIGKILL"
