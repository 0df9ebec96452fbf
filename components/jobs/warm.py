"""Warm job start: stage jobs forked from a server that has imported torch, transformers and the stages once.

A new interpreter costs a job about 2 s before its body starts (torch and transformers alone are 1.5 s
of imports), and about 0.5 s more to tear down: six jobs a round, a quarter of a default round's
time outside the job bodies (`benchmarks/scale.py`). So the flow's process keeps one server,
`python -m components.jobs.warm <socket>`, started with the jobs' environment; it imports `PRELOAD`
and forks one child per job.

Every job is still a process of its own, as the stage contract wants: its memory (and GPU memory)
goes back when it exits, a kill ends it alone, and its exit status is the job's. The server never
runs a tensor operation or touches CUDA, so a child inherits no thread pool and no device context.
The child takes the environment `run_job` gives it, writes its output to the caller's pipe, runs
`components.jobs.__main__.main`, and leaves with `os._exit` after flushing, skipping the interpreter's
teardown (every file it wrote is closed and the manifest fsynced by then). Its process title reads as
the command it stands for (`python -m components.jobs <stage> --spec <spec>`), for `ps` and for the
fault tests that look for it.

The protocol, one SOCK_SEQPACKET connection per job: the caller sends {argv, env, cwd} with its pipe's
write end; the server answers {"pid"} once forked and {"rc"} when the child ended (negative: killed by
that signal, as `subprocess` says). The server ends when its caller does (its stdin closes).

Used where the job would run under this very interpreter with one process; vLLM's environment and
`accelerate launch` keep their own interpreters (`launch.run_job`). `COEVO_WARM_JOBS=0` turns it off.
A server whose imports would see another environment than the caller's now is replaced.
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import IO

# Imported once in the server. Module imports only: nothing here may start a thread pool or init CUDA.
PRELOAD = ["components.jobs.__main__", "components.stages", "torch", "transformers", "trl", "peft"]
# A server serves jobs whose environment is the one it started with, but for these: set per job, per test
# (pytest) or once in the flow's process after its first stage (MLflow's session id), and read by no import.
PER_JOB = ("COEVO_JOB_LAUNCHED_AT", "PYTEST_CURRENT_TEST", "_MLFLOW_TELEMETRY_SESSION_ID")
MAX_MESSAGE = 1 << 20

_lock = threading.Lock()
_server: _Server | None = None


class WarmStartError(RuntimeError):
    """The server could not be started or reached; no job was forked, so a new interpreter may run it."""


def enabled() -> bool:
    return os.environ.get("COEVO_WARM_JOBS", "1") != "0" and sys.platform.startswith("linux")


class _Server:
    def __init__(self, env: dict[str, str], cwd: Path):
        self.env = env
        self.dir = tempfile.mkdtemp(prefix="coevo-warm-")
        self.path = os.path.join(self.dir, "jobs.sock")
        # stdin is ours: its end (this process ending) ends the server; its stdout says when it is ready.
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "components.jobs.warm", self.path], env=env, cwd=cwd,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None)
        except OSError as e:
            raise WarmStartError(f"cannot start the warm job server: {e}") from None
        ready = self.proc.stdout.readline() if self.proc.stdout else b""
        if ready.strip() != b"ready":
            self.proc.kill()
            raise WarmStartError(f"the warm job server did not start (exit {self.proc.wait()}); COEVO_WARM_JOBS=0 "
                               "starts every job as a new interpreter")

    def fits(self, env: dict[str, str]) -> bool:
        strip = lambda e: {k: v for k, v in e.items() if k not in PER_JOB}  # noqa: E731
        return self.proc.poll() is None and strip(self.env) == strip(env)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()
        shutil.rmtree(self.dir, ignore_errors=True)  # the socket's folder


def _server_for(env: dict[str, str], cwd: Path) -> _Server:
    global _server
    with _lock:
        if _server is None or not _server.fits(env):
            if _server is None:
                atexit.unregister(_shutdown)  # once, however many starts failed
                atexit.register(_shutdown)
            else:
                _server.stop()
                _server = None  # a start that fails below leaves no stopped server behind
            _server = _Server(env, cwd)
        return _server


def _shutdown() -> None:
    with _lock:
        if _server is not None:
            _server.stop()


class WarmJob:
    """A forked job with the parts of `subprocess.Popen` that `run_job` uses: pid, stdout, wait, kill."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path):
        server = _server_for(dict(env), cwd)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._sock.connect(server.path)
        except OSError as e:
            raise WarmStartError(f"cannot reach the warm job server at {server.path}: {e}") from None
        read_end, write_end = os.pipe()
        try:
            request = json.dumps({"argv": argv, "env": dict(env), "cwd": str(cwd)}).encode()
            socket.send_fds(self._sock, [request], [write_end])
        finally:
            os.close(write_end)  # the child holds the only write end: its exit is the reader's EOF
        self.stdout: IO[str] = open(read_end, encoding="utf-8", errors="replace")  # noqa: SIM115
        answer = self._sock.recv(MAX_MESSAGE)
        if not answer:
            raise RuntimeError("the warm job server ended before it forked the job")
        self.pid: int = json.loads(answer)["pid"]
        self.returncode: int | None = None

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._sock.settimeout(timeout)
            try:
                answer = self._sock.recv(MAX_MESSAGE)
            except TimeoutError:
                raise subprocess.TimeoutExpired("components.jobs", timeout or 0) from None
            # No answer: the server died with its child (the whole flow's tree was killed): a kill.
            self.returncode = json.loads(answer)["rc"] if answer else -signal.SIGKILL
            self._sock.close()
        return self.returncode

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# -- the server ---------------------------------------------------------------------------------------

def _child(request: dict, out_fd: int) -> None:
    """The job, in the forked child: the caller's environment and pipe, then `main`, then exit."""
    rc = 1
    try:
        try:  # first: setproctitle finds the argv memory it rewrites by the environment that follows it
            from setproctitle import setproctitle

            setproctitle(" ".join([sys.executable, "-m", "components.jobs", *request["argv"]]))
        except ImportError:  # only `ps` and the fault tests read it
            pass
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        os.close(out_fd)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's own streams
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        from components.jobs.__main__ import main

        rc = main(request["argv"])
    except SystemExit as e:  # argparse
        rc = e.code if isinstance(e.code, int) else 2
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)


def serve(path: str) -> None:
    for name in PRELOAD:
        __import__(name)
    if sys.flags.hash_randomization:  # the jobs' set order would change from run to run
        raise SystemExit("the warm job server needs PYTHONHASHSEED=0, as run_job gives it")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    sel.register(sys.stdin.fileno(), selectors.EVENT_READ)
    print("ready", flush=True)
    jobs: dict[int, socket.socket] = {}
    while True:
        for key, _ in sel.select(timeout=0.05):
            if key.fileobj == sys.stdin.fileno():
                if not os.read(sys.stdin.fileno(), 1024):  # our caller ended: so do we, and our jobs
                    for pid in jobs:
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                    os._exit(0)
                continue
            conn, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 1)
            if not message or len(fds) != 1:
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                sel.close()
                listener.close()
                conn.close()
                _child(json.loads(message), fds[0])
            os.close(fds[0])
            conn.send(json.dumps({"pid": pid}).encode())
            jobs[pid] = conn
        while jobs:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = jobs.pop(pid, None)
            if conn is not None:
                try:
                    conn.send(json.dumps({"rc": os.waitstatus_to_exitcode(status)}).encode())
                except OSError:  # the caller gave up on it
                    pass
                conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
