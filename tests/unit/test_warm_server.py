"""The warm server as a process worker's (`components/jobs/warm.py` with `--parent`, `flows/warm_engine.py`).

A real server, started as `flows/warm_engine.py` starts it, serves modules of the standard library
run as `python -m <module>` would run them: their exit status and output come back, a caller that
hangs up takes its job with it, a request from another environment is refused, and the server ends
with the process it was started for, removing its socket.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, alive

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork, SOCK_SEQPACKET and pidfd")


@pytest.fixture
def server(tmp_path):
    """A server for a stand-in worker (a sleeping process), with `json` preloaded and COEVO_RUN per job."""
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    path = tmp_path / "srv" / "jobs.sock"
    path.parent.mkdir()
    env = os.environ | {"PYTHONHASHSEED": "0", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "components.jobs.warm", str(path), "--parent", str(worker.pid),
                             "--preload", "json", "--per-job", "COEVO_RUN"], env=env, cwd=REPO,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"ready"
    yield path, env, worker, proc
    worker.kill()
    worker.wait()
    proc.kill()
    proc.wait()


def _request(path: Path, module: str, argv: list[str], env: dict, out_fd: int) -> tuple[socket.socket, dict]:
    from components.jobs.warm import send_request

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(str(path))
    return sock, send_request(sock, {"module": module, "argv": argv, "env": env, "cwd": str(REPO)}, out_fd)


def test_a_module_runs_as_its_command_would_with_its_exit_status_and_output(server, tmp_path):
    path, env, _, _ = server
    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        sock, answer = _request(path, "json.tool", [str(tmp_path / "missing.json")], env | {"COEVO_RUN": "1"},
                                f.fileno())
    assert "pid" in answer, answer
    assert json.loads(sock.recv(1 << 20)) == {"rc": 2}  # `python -m json.tool <missing>`: argparse, 2
    assert "missing.json" in out.read_text(), out.read_text()
    good = tmp_path / "good.json"
    good.write_text('{"b": 1, "a": [2]}')
    with open(out, "w") as f:
        sock, answer = _request(path, "json.tool", ["--sort-keys", "--compact", str(good)], env, f.fileno())
    assert json.loads(sock.recv(1 << 20)) == {"rc": 0}, out.read_text()
    assert out.read_text().strip() == '{"a":[2],"b":1}'


def test_a_caller_that_hangs_up_takes_its_job_with_it(server):
    path, env, _, _ = server
    sock, answer = _request(path, "timeit", ["-n", "1", "-r", "1", "import time; time.sleep(120)"], env, 1)
    pid = answer["pid"]
    assert alive(pid)
    sock.close()  # as when the flow run's process (the worker's child) is killed
    t0 = time.monotonic()
    while alive(pid) and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    assert not alive(pid), "the job outlived its caller"


def test_a_request_from_another_environment_is_refused(server):
    path, env, _, _ = server
    sock, answer = _request(path, "json.tool", ["--help"], env | {"PREFECT_API_URL": "http://elsewhere"}, 1)
    assert "pid" not in answer and "PREFECT_API_URL" in answer["refused"], answer


def test_the_server_ends_with_its_worker_and_kills_its_jobs(server):
    path, env, worker, proc = server
    _, answer = _request(path, "timeit", ["-n", "1", "-r", "1", "import time; time.sleep(120)"], env, 1)
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait()
    assert proc.wait(timeout=10) == 0
    t0 = time.monotonic()
    while alive(answer["pid"]) and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    assert not alive(answer["pid"]), "the job outlived its worker"
    assert not path.parent.exists(), "the server left its socket's folder"
