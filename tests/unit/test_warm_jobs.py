"""Warm job start (`components/jobs/warm.py`): jobs forked from a server that imported torch once.

Each test runs real jobs through `run_job`, as the flow does: a forked process of its own, which the
kernel reports as the job's command, with the job's environment, exit code and output.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from components.jobs.launch import StageJobError, run_job
from tests.conftest import alive

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="warm jobs are Linux-only (warm.enabled)")


def _spec(tmp_path: Path, **body) -> Path:
    spec = tmp_path / "a1.spec.json"
    spec.write_text(json.dumps(body))
    return spec


def _blocking_spec(tmp_path: Path) -> Path:
    """A FIFO whose first reader (the launcher, which looks for `processes` in it) reads `{}`; the job, the
    next reader, blocks on it until it is killed."""
    fifo = tmp_path / "block.spec.json"
    os.mkfifo(fifo)

    def feed_once() -> None:
        with open(fifo, "w") as f:
            f.write("{}")

    threading.Thread(target=feed_once, daemon=True).start()
    return fifo


def test_a_warm_job_is_a_process_of_its_own_named_as_its_command(tmp_path, monkeypatch):
    """While it runs, the job's pid is not this one's and the kernel reports its command line as
    `python -m components.jobs verify --spec <spec>`; a bad spec's error and exit code 2 come back."""
    monkeypatch.setenv("COEVO_WARM_JOBS", "1")
    fifo = _blocking_spec(tmp_path)
    seen: dict = {}

    def on_start(pid: int) -> None:
        seen["pid"] = pid
        for _ in range(400):
            seen["cmdline"] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            if " -m components.jobs " in seen["cmdline"]:
                break
            time.sleep(0.005)
        os.kill(pid, 9)

    with pytest.raises(StageJobError, match="killed by signal 9"):
        run_job("verify", fifo, lambda _: None, 60, on_start=on_start)
    assert seen["pid"] != os.getpid()
    assert seen["cmdline"].endswith(f"-m components.jobs verify --spec {fifo}"), seen
    spec = _spec(tmp_path, nonsense=True)
    lines: list[str] = []
    with pytest.raises(StageJobError, match="exited with code 2") as e:
        run_job("verify", spec, lines.append, 60)
    assert not e.value.transient
    assert any(f"{spec}: not a valid stage spec" in line for line in lines), lines


def test_a_killed_warm_job_is_a_transient_failure_and_the_server_serves_the_next(tmp_path, monkeypatch):
    """SIGKILL of the job (an OOM, a preemption) is transient, as for a new interpreter; the server
    it was forked from is untouched and forks the next job."""
    monkeypatch.setenv("COEVO_WARM_JOBS", "1")
    spec = _spec(tmp_path, nonsense=True)
    fifo = _blocking_spec(tmp_path)

    def kill(pid: int) -> None:
        threading.Timer(0.5, os.kill, (pid, 9)).start()

    with pytest.raises(StageJobError, match="killed by signal 9") as e:
        run_job("verify", fifo, lambda _: None, 60, on_start=kill)
    assert e.value.transient
    with pytest.raises(StageJobError, match="exited with code 2"):
        run_job("verify", spec, lambda _: None, 60)


def test_a_warm_job_past_its_timeout_is_killed(tmp_path, monkeypatch):
    monkeypatch.setenv("COEVO_WARM_JOBS", "1")
    fifo = _blocking_spec(tmp_path)
    t0 = time.monotonic()
    with pytest.raises(StageJobError, match="timed out after 2s") as e:
        run_job("verify", fifo, lambda _: None, 2)
    assert e.value.transient and time.monotonic() - t0 < 30


def test_warm_and_cold_jobs_publish_the_same_bytes(tmp_path, monkeypatch):
    """Round 0's bootstrap of a tiny config, once forked from the warm server and once as a new interpreter:
    the same parts and the same checkpoint, byte for byte. The server runs with the jobs' hash seed."""
    from components.config import load_config
    from components.jobs.launch import content_hashes, execute
    from components.stages import build_spec
    from components.store import Store
    from tests.conftest import REPO

    monkeypatch.setenv("COEVO_TORCH_THREADS", "1")
    hashes = {}
    for mode in ("1", "0"):
        monkeypatch.setenv("COEVO_WARM_JOBS", mode)
        cfg = load_config(REPO / "configs" / "micro.yaml", [f"workdir={tmp_path / mode}", "bootstrap.steps=10",
                                                            "bootstrap.problems_per_level=20", "tracking.enabled=false"])
        spec = build_spec(cfg, Store.for_config(cfg), 0, "bootstrap", 1, None)
        lines: list[str] = []
        execute(cfg, spec, log=lines.append)
        hashes[mode] = content_hashes(Path(spec.out_dir))
        assert any("wrote" in line for line in lines), lines
    assert hashes["1"] == hashes["0"] and "artifact:model" in hashes["1"], hashes


def test_the_server_is_kept_across_per_job_variables_and_replaced_when_imports_would_differ(tmp_path, monkeypatch):
    """MLflow sets its session id in the flow's environment after the first stage: the same server serves on.
    A variable an import may read (HF_HUB_OFFLINE, read by transformers) gets a new one."""
    from components.jobs import warm

    monkeypatch.setenv("COEVO_WARM_JOBS", "1")
    spec = _spec(tmp_path, nonsense=True)

    def server_after_a_job() -> int:
        with pytest.raises(StageJobError, match="exited with code 2"):
            run_job("verify", spec, lambda _: None, 60)
        return warm._server.proc.pid

    first = server_after_a_job()
    monkeypatch.setenv("_MLFLOW_TELEMETRY_SESSION_ID", "a-session")
    assert server_after_a_job() == first
    monkeypatch.setenv("HF_HUB_OFFLINE", "0" if os.environ.get("HF_HUB_OFFLINE") == "1" else "1")
    assert server_after_a_job() != first


def _caller_with_a_server(tmp_path: Path, scratch: Path, **popen):
    """A process that ran one (failing) job through a warm server with TMPDIR=`scratch`, then sleeps: itself, and
    its server's pid."""
    import subprocess

    from tests.conftest import REPO

    caller = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom components.jobs import warm\nfrom components.jobs.launch import "
         "StageJobError, run_job\ntry:\n    run_job('verify', sys.argv[1], lambda _: None, 60)\nexcept StageJobError:\n"
         "    pass\nprint(warm._server.proc.pid, flush=True)\ntime.sleep(600)\n", str(_spec(tmp_path, nonsense=True))],
        cwd=REPO, env=os.environ | {"COEVO_WARM_JOBS": "1", "TMPDIR": str(scratch), "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE, text=True, **popen)
    return caller, int(caller.stdout.readline())


def _ended(server: int) -> None:
    """Wait up to 10 s for the server to end (it removes its folder, where it can, before it exits)."""
    for _ in range(200):
        if not alive(server):
            break
        time.sleep(0.05)
    assert not alive(server), "the server outlived its caller"


def test_a_killed_caller_leaves_neither_its_server_nor_the_servers_folder(tmp_path):
    """The server ends when its caller's stdin closes, and removes its socket's folder: a caller killed before
    its exit hooks ran (SIGKILL) left one `coevo-warm-*` folder in /tmp for every such run."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    caller, server = _caller_with_a_server(tmp_path, scratch)
    try:
        assert len(list(scratch.glob("coevo-warm-*"))) == 1  # the server's (the caller's imports leave others)
    finally:
        caller.kill()
        caller.wait()
    _ended(server)
    assert not list(scratch.glob("coevo-warm-*")), sorted(scratch.glob("coevo-warm-*/*"))


def test_the_next_server_removes_the_folder_of_one_killed_with_its_caller(tmp_path):
    """A server killed together with its caller (its process group killed whole, as a CI runner or the fault
    tests do) cannot remove its folder: the next server to start removes it, its socket refusing connections.
    A live server's folder, and a folder whose server has not bound its socket yet, stay."""
    import signal
    import socket

    from components.jobs import warm

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    caller, server = _caller_with_a_server(tmp_path, scratch, start_new_session=True)
    (dead,) = scratch.glob("coevo-warm-*")
    os.killpg(caller.pid, signal.SIGKILL)
    caller.wait()
    _ended(server)
    assert (dead / "jobs.sock").exists()  # what the suite used to leave behind
    starting = scratch / "coevo-warm-starting"
    starting.mkdir()
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as live:
        (scratch / "coevo-warm-live").mkdir()
        live.bind(str(scratch / "coevo-warm-live" / "jobs.sock"))
        live.listen(1)
        caller, server = _caller_with_a_server(tmp_path, scratch)
        try:
            assert not dead.exists()
            assert starting.exists() and (scratch / "coevo-warm-live" / "jobs.sock").exists()
            assert warm.sweep_stale(str(scratch)) == []
        finally:
            caller.kill()
            caller.wait()
    _ended(server)
    assert warm.sweep_stale(str(scratch)) == [str(scratch / "coevo-warm-live")]  # its listener is closed now
    assert sorted(p.name for p in scratch.glob("coevo-warm-*")) == ["coevo-warm-starting"]
