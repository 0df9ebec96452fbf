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
that signal, as `subprocess` says). The server ends when its caller does (its stdin closes), and removes its
socket's folder; one killed together with its caller cannot, so each new server first removes the folders of
dead ones (`sweep_stale`).

Used where the job would run under this very interpreter with one process; vLLM's environment and
`accelerate launch` keep their own interpreters (`launch.run_job`). `COEVO_WARM_JOBS=0` turns it off.
A server whose imports would see another environment than the caller's now is replaced.

A process worker's server (`flows/warm_engine.py`) is the same server with other arguments: it
preloads Prefect's engine too, forks children that run a module as `python -m <module>` would, ends
with the worker's pid instead of its stdin, and refuses a request whose environment is not its own.
Any server kills a job whose caller hung up.
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


def sweep_stale(tmp: str | None = None) -> list[str]:
    """Remove the socket folders (`coevo-warm-*`, this user's) of servers that died without removing their own: a
    server killed with its caller (a process group killed whole) cannot. A folder is stale when its socket is
    there and refuses a connection, so nobody listens; a folder still without a socket is a server starting.
    Returns the folders removed."""
    removed = []
    tmp = tmp or tempfile.gettempdir()
    try:
        names = os.listdir(tmp)
    except OSError:
        return removed
    for name in names:
        folder = os.path.join(tmp, name)
        if not name.startswith("coevo-warm-") or name.startswith("coevo-warm-worker-"):
            continue  # a worker's server folder is named by its worker, and reused
        try:
            if os.lstat(folder).st_uid != os.getuid() or not os.path.exists(path := os.path.join(folder, "jobs.sock")):
                continue
        except OSError:
            continue
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as probe:
            probe.settimeout(1.0)
            try:
                probe.connect(path)
                continue  # a live server: it reads an empty request and hangs up
            except ConnectionRefusedError:
                pass
            except OSError:
                continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


class _Server:
    def __init__(self, env: dict[str, str], cwd: Path):
        self.env = env
        sweep_stale()
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


def send_request(sock: socket.socket, request: dict, out_fd: int) -> dict:
    """Send a server a job, `request` ({argv, env, cwd} and optionally a `module`), with the descriptor its
    output goes to; its answer: {"pid"} once forked, {"refused"}, or {} if the server hung up."""
    socket.send_fds(sock, [json.dumps(request).encode()], [out_fd])
    answer = sock.recv(MAX_MESSAGE)
    return json.loads(answer) if answer else {}


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
        self.stdout: IO[str] = open(read_end, encoding="utf-8", errors="replace")  # noqa: SIM115
        try:
            answer = send_request(self._sock, {"argv": argv, "env": dict(env), "cwd": str(cwd)}, write_end)
        finally:
            os.close(write_end)  # the child holds the only write end: its exit is the reader's EOF
        if "pid" not in answer:
            raise RuntimeError("the warm job server ended before it forked the job")
        self.pid: int = answer["pid"]
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
    """The job, in the forked child: the caller's environment and pipe, then its code, then exit.

    A request names a stage job (`argv` for `components.jobs.__main__.main`), or a `module` to run as
    `python -m <module> <argv>` would (a Prefect flow run's engine: `flows/warm_engine.py`)."""
    rc = 1
    module = request.get("module")
    try:
        try:  # first: setproctitle finds the argv memory it rewrites by the environment that follows it
            from setproctitle import setproctitle

            setproctitle(" ".join([sys.executable, "-m", module or "components.jobs", *request["argv"]]))
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
        if module:
            import runpy
            import warnings

            sys.argv = [module, *request["argv"]]
            rc = 0
            with warnings.catch_warnings():  # it is imported (preloaded) here, unlike under `python -m`
                warnings.filterwarnings("ignore", r".*found in sys\.modules after import of package", RuntimeWarning)
                runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            from components.jobs.__main__ import main

            rc = main(request["argv"])
    except SystemExit as e:  # argparse, or the module's own exit
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        rc = 1
    finally:
        try:
            if module:  # what the interpreter's exit runs first: the module's threads drain (Prefect's log and
                _exit_hooks()  # event workers), then its atexit hooks; only the slow module teardown is skipped
            for stream in (sys.stdout, sys.stderr):
                if not stream.closed:  # a module may close its own (`json.tool` does)
                    stream.flush()
        finally:
            os._exit(rc)  # never back into the server's loop


def _exit_hooks() -> None:
    import atexit

    try:
        threading._shutdown()  # type: ignore[attr-defined]  # joins non-daemon threads, runs their exit hooks
        atexit._run_exitfuncs()
    except BaseException:
        import traceback

        traceback.print_exc()


def serve(path: str, preload: list[str] = PRELOAD, parent: int | None = None,
          per_job: tuple[str, ...] | None = None) -> None:
    """Fork a job per connection to `path`, with `preload` imported once.

    It ends, killing its jobs, when its caller's stdin closes or, given `parent`, when that process ends
    (a worker's server outlives the flow run that started it). A job whose caller hangs up before it
    ends is killed: the caller stands for it. Given `per_job`, a request whose environment differs from
    the server's in another variable is refused, so the caller can start its job as a new interpreter.
    """
    mine = {k: v for k, v in os.environ.items() if k not in (per_job or ())}  # as started: imports add some
    for name in preload:
        __import__(name)
    if sys.flags.hash_randomization:  # the jobs' set order would change from run to run
        raise SystemExit("the warm job server needs PYTHONHASHSEED=0, as run_job gives it")
    if threading.active_count() > 1:  # a fork copies only this thread: a pool or client thread would be lost
        raise SystemExit(f"the warm job server's imports started threads: {threading.enumerate()}")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    if parent is None:
        sel.register(sys.stdin.fileno(), selectors.EVENT_READ, "caller")
    else:
        sel.register(os.pidfd_open(parent), selectors.EVENT_READ, "caller")
    print("ready", flush=True)
    jobs: dict[int, socket.socket] = {}
    hung_up: set[int] = set()

    def kill(pid: int) -> None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    while True:
        for key, _ in sel.select(timeout=0.05):
            if key.data == "caller":
                if parent is not None or not os.read(sys.stdin.fileno(), 1024):  # it ended: so do we, and our jobs
                    for pid in jobs:
                        kill(pid)
                    # and the socket's folder: a caller killed (SIGKILL) before its exit hooks cannot remove it
                    shutil.rmtree(os.path.dirname(path), ignore_errors=True)
                    os._exit(0)
                continue
            if key.data != "accept":  # a job's caller hung up (its answer is still to come, so this is EOF)
                sel.unregister(key.fileobj)
                hung_up.add(key.data)
                kill(key.data)
                continue
            conn, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 1)
            if not message or len(fds) != 1:
                conn.close()
                continue
            request = json.loads(message)
            if per_job is not None and (differ := sorted(
                    k for k in set(mine) | set(request["env"])
                    if k not in per_job and mine.get(k) != request["env"].get(k))):
                os.close(fds[0])
                conn.send(json.dumps({"refused": f"its environment differs from this server's in {differ}"}).encode())
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                sel.close()
                listener.close()
                for c in [conn, *jobs.values()]:  # the other jobs' callers must see this server's end alone
                    c.close()
                _child(request, fds[0])
            os.close(fds[0])
            conn.send(json.dumps({"pid": pid}).encode())
            jobs[pid] = conn
            sel.register(conn, selectors.EVENT_READ, pid)
        while jobs:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = jobs.pop(pid, None)
            if conn is not None:
                if pid in hung_up:
                    hung_up.discard(pid)
                else:
                    sel.unregister(conn)
                try:
                    conn.send(json.dumps({"rc": os.waitstatus_to_exitcode(status)}).encode())
                except OSError:  # the caller gave up on it
                    pass
                conn.close()


def _main(argv: list[str]) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m components.jobs.warm", description=serve.__doc__.splitlines()[0])
    ap.add_argument("socket")
    ap.add_argument("--preload", default=",".join(PRELOAD), help="modules to import once, comma-separated")
    ap.add_argument("--parent", type=int, help="end with this process, not with stdin")
    ap.add_argument("--per-job", help="comma-separated variables a job's environment may differ in")
    args = ap.parse_args(argv)
    serve(args.socket, args.preload.split(","), args.parent,
          None if args.per_job is None else tuple(args.per_job.split(",")))


if __name__ == "__main__":
    _main(sys.argv[1:])
