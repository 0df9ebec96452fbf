"""`python -m flows.warm_engine`: a process worker's flow run, forked from a server that imported once.

Prefect's process worker starts each flow run as `python -m prefect.engine`: a new interpreter that
imports Prefect (about 1.2 s here), then the flow, whose job imports torch and transformers (about
2 s more), before the first line of the stage's work. A shard pays it every time, and on a 2-core
machine two shards pay it at once (`docs/scale-out.md`). So the `stage_job` deployment asks the
worker for this command instead (`tasks/pool.py`, `execution.warm_workers`).

It is the same flow run, started the same way, in a process forked rather than started:

- The first flow run of a worker starts the worker's server (`components.jobs.warm` with `--parent`
  set to the worker's pid): it imports `prefect.engine`, this project's stage flow and the stages'
  libraries once, then forks one child per flow run, which runs `prefect.engine` as `__main__`, as
  `python -m prefect.engine` would, in this process's environment, cwd and output streams.
- This process stays the worker's child for the run: the worker sees its pid, its output and its
  exit status, which is the engine's. A SIGTERM (Prefect's cancellation) is passed on to the engine;
  if this process is killed, the server kills the engine. When the worker ends, so does its server,
  killing whatever it still runs: a `kill -9` of a worker's process tree still ends its jobs.
- If the server cannot be reached or started, or its environment is not this flow run's (another
  deployment's variables), the flow run starts as a new interpreter, `python -m prefect.engine`.

Linux only (fork, SOCK_SEQPACKET, pidfd); elsewhere it is always the new interpreter.
`COEVO_WARM_JOBS=0` turns it off on a worker's machine.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

from components.jobs import warm  # standard library only: this process must start in milliseconds

# Imported once by the worker's server: the engine, the stage flow and what its jobs import.
PRELOAD = ["prefect.engine", "prefect.flow_engine", "flows.stage_job", "components.jobs.__main__",
           "components.stages", "torch", "transformers", "trl", "peft"]
# What the worker sets per flow run (prefect/runner/_starter_engine.py), and what a local warm job's may differ in.
PER_RUN = ("PREFECT__FLOW_RUN_ID", "PREFECT__CONTROL_PORT", "PREFECT__CONTROL_TOKEN", "PREFECT__STORAGE_BASE_PATH",
           "PREFECT__DEPLOYMENT_NAME", "PREFECT__FLOW_ENTRYPOINT", *warm.PER_JOB)
START_TIMEOUT_S = 120.0


def _cold() -> None:
    """The flow run as Prefect's process worker would start it."""
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, "-m", "prefect.engine", *sys.argv[1:]])


def _server_dir(worker_pid: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"coevo-warm-worker-{os.getuid()}-{worker_pid}")


def _connect(path: str) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(path)
        return sock
    except OSError:
        sock.close()
        return None


def _server(worker_pid: int) -> socket.socket:
    """A connection to the worker's server, started here if there is none (one start at a time)."""
    folder = _server_dir(worker_pid)
    path = os.path.join(folder, "jobs.sock")
    if sock := _connect(path):
        return sock
    os.makedirs(folder, mode=0o700, exist_ok=True)
    failed = os.path.join(folder, "failed")
    with open(os.path.join(folder, "start.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if sock := _connect(path):  # another flow run of this worker started it meanwhile
            return sock
        if os.path.exists(failed):  # once per worker: its later flow runs go cold at once
            raise OSError(f"the worker's warm server failed to start before (see {folder}/server.log)")
        if os.path.exists(path):  # a server that died: its socket is left
            os.unlink(path)
        with open(os.path.join(folder, "server.log"), "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "components.jobs.warm", path, "--parent", str(worker_pid),
                 "--preload", ",".join(PRELOAD), "--per-job", ",".join(PER_RUN)],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, start_new_session=True)
        ready = _readline(proc, START_TIMEOUT_S)
        if ready.strip() != b"ready":
            proc.kill()
            open(failed, "w").close()
            raise OSError(f"the worker's warm server did not start (see {folder}/server.log)")
        proc.stdout.close()
        if not (sock := _connect(path)):
            raise OSError(f"the worker's warm server at {path} does not answer")
        return sock


def _readline(proc: subprocess.Popen, timeout_s: float) -> bytes:
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        return proc.stdout.readline() if sel.select(timeout_s) else b""


def main() -> int:
    worker_pid = os.getppid()
    if os.environ.get("COEVO_WARM_JOBS", "1") == "0" or not sys.platform.startswith("linux"):
        _cold()
    t0 = time.perf_counter()
    try:
        sock = _server(worker_pid)
        request = {"module": "prefect.engine", "argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd()}
        sys.stdout.flush()
        answer = warm.send_request(sock, request, sys.stdout.fileno())
    except (OSError, ValueError) as e:
        print(f"coevo: warm start failed ({e}); starting the flow run as a new interpreter", file=sys.stderr)
        _cold()
    if "pid" not in answer:
        print(f"coevo: the worker's warm server refused this flow run ({answer.get('refused', 'no answer')}); "
              "starting it as a new interpreter", file=sys.stderr)
        _cold()
    pid = answer["pid"]
    print(f"coevo: flow run forked from the worker's warm server as pid {pid} in {time.perf_counter() - t0:.2f}s",
          flush=True)

    def forward(signum, _frame) -> None:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    end = sock.recv(warm.MAX_MESSAGE)  # its exit status (a signal's handler does not interrupt it: PEP 475)
    if not end:  # the server died, and its jobs with it
        print("coevo: the worker's warm server ended before the flow run did", file=sys.stderr)
        return 1
    rc = json.loads(end)["rc"]
    return 128 - rc if rc < 0 else rc  # killed by a signal: as a shell reports it


if __name__ == "__main__":
    sys.exit(main())
