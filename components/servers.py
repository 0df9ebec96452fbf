"""Local Prefect and MLflow servers for one workdir: start, stop, status.

    coevo server up   [--workdir workdir] [--prefect-port 4200] [--mlflow-port 5000]
    coevo server status
    coevo server down

Each server runs as its own process group, started detached, with its log, pid file and a small
JSON state file (URL, port, command) under `<workdir>/servers/`. The Prefect server keeps its
SQLite database under `<workdir>/servers/prefect-home/` unless `PREFECT_API_DATABASE_CONNECTION_URL`
names Postgres; MLflow serves the same `sqlite:///<workdir>/mlflow.db` the runs write to.

Plain Python, no Prefect import: the servers are subprocesses started through their own CLIs.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SERVERS = ("prefect", "mlflow")
DEFAULT_PORTS = {"prefect": 4200, "mlflow": 5000}
# What a health probe hits: Prefect's API health route, MLflow's /health.
HEALTH_PATH = {"prefect": "/api/health", "mlflow": "/health"}
# A substring of the process command line, so a recycled pid is not taken for our server.
CMD_MARKER = {"prefect": "prefect", "mlflow": "mlflow"}


class ServerError(RuntimeError):
    """A server could not be started or stopped; the message says why and what to do."""


@dataclass
class ServerInfo:
    name: str
    pid: int
    host: str
    port: int
    url: str          # the UI; the Prefect API is url + "/api"
    log: str
    cmd: list[str]
    started_at: float

    @property
    def api_url(self) -> str:
        return self.url + "/api" if self.name == "prefect" else self.url


@dataclass
class ServerStatus:
    name: str
    running: bool
    pid: int | None
    url: str | None
    http_status: int | None   # of GET <url>/<health>; None when nothing answered
    log: str | None


def servers_dir(workdir: str | Path) -> Path:
    return Path(workdir).resolve() / "servers"


def mlflow_store_uri(workdir: str | Path) -> str:
    """The MLflow tracking store a run in this workdir writes to (see `components.tracking.tracking_uri`)."""
    return f"sqlite:///{Path(workdir).resolve() / 'mlflow.db'}"


# -- process bookkeeping ----------------------------------------------------------------------

def _pid_file(workdir: Path, name: str) -> Path:
    return servers_dir(workdir) / f"{name}.pid"


def _state_file(workdir: Path, name: str) -> Path:
    return servers_dir(workdir) / f"{name}.json"


def _alive(pid: int, name: str) -> bool:
    """The pid is a live (not zombie) process whose command line is this server's."""
    try:
        os.waitpid(pid, os.WNOHANG)  # reap it if it is our own exited child
    except ChildProcessError:
        pass
    proc = Path(f"/proc/{pid}")
    if proc.exists():
        try:
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            return False
        return state != "Z" and CMD_MARKER[name] in cmdline
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return sys.platform != "linux"


def read_info(workdir: str | Path, name: str) -> ServerInfo | None:
    f = _state_file(Path(workdir), name)
    if not f.is_file():
        return None
    d = json.loads(f.read_text())
    return ServerInfo(**d)


def _running(workdir: Path, name: str) -> ServerInfo | None:
    """The recorded server if its process is alive; a stale record is removed."""
    info = read_info(workdir, name)
    if info is None:
        _pid_file(workdir, name).unlink(missing_ok=True)
        return None
    if _alive(info.pid, name):
        return info
    _pid_file(workdir, name).unlink(missing_ok=True)
    _state_file(workdir, name).unlink(missing_ok=True)
    return None


def check_port_free(host: str, port: int, what: str) -> None:
    """Bind the port the way the server will (SO_REUSEADDR, like uvicorn); busy means someone listens."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno in (errno.EADDRINUSE, errno.EACCES):
                flag = f"--{what}-port"
                raise ServerError(
                    f"port {port} on {host} is busy ({e.strerror}): another process is listening there; "
                    f"stop it, or start the {what} server on another port with {flag} <port>"
                ) from None
            raise ServerError(f"cannot bind {host}:{port} for the {what} server: {e}") from None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def http_status(url: str, timeout_s: float = 3.0) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return None


# -- commands ---------------------------------------------------------------------------------

def _commands(workdir: Path, host: str, ports: dict[str, int]) -> dict[str, tuple[list[str], dict[str, str]]]:
    sd = servers_dir(workdir)
    base_env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "MLFLOW_ENABLE_TELEMETRY": "false",
                "DO_NOT_TRACK": "1"}
    p_url = f"http://{host}:{ports['prefect']}"
    prefect_env = {
        **base_env,
        "PREFECT_HOME": str(sd / "prefect-home"),
        # Host and port go through the settings, not only the flags: the UI bundle reads its API
        # address from them, and would otherwise call the default :4200.
        "PREFECT_SERVER_API_HOST": host,
        "PREFECT_SERVER_API_PORT": str(ports["prefect"]),
        "PREFECT_UI_API_URL": f"{p_url}/api",
        "PREFECT_API_URL": f"{p_url}/api",
        "PREFECT_UI_URL": p_url,
    }
    prefect_cmd = [sys.executable, "-m", "prefect", "server", "start", "--host", host,
                   "--port", str(ports["prefect"])]
    artifacts = Path(workdir).resolve() / "mlartifacts"
    mlflow_cmd = [sys.executable, "-m", "mlflow", "server",
                  "--backend-store-uri", mlflow_store_uri(workdir),
                  "--default-artifact-root", artifacts.as_uri(),
                  "--host", host, "--port", str(ports["mlflow"]),
                  # One worker: a laptop serves one user, and each worker costs ~200 MB.
                  "--workers", "1"]
    mlflow_env = {k: v for k, v in base_env.items() if k != "MLFLOW_TRACKING_URI"}
    return {"prefect": (prefect_cmd, prefect_env), "mlflow": (mlflow_cmd, mlflow_env)}


def up(workdir: str | Path, host: str = "127.0.0.1", prefect_port: int = DEFAULT_PORTS["prefect"],
       mlflow_port: int = DEFAULT_PORTS["mlflow"], timeout_s: float = 120.0) -> dict[str, ServerInfo]:
    """Start both servers and wait until each answers its health route; refuse if one already runs."""
    workdir = Path(workdir).resolve()
    ports = {"prefect": prefect_port, "mlflow": mlflow_port}
    for name in SERVERS:
        info = _running(workdir, name)
        if info is not None:
            raise ServerError(
                f"the {name} server of {workdir} is already running (pid {info.pid}) at {info.url}; "
                f"`coevo server down --workdir {workdir}` stops it"
            )
    for name in SERVERS:
        check_port_free(host, ports[name], name)
    sd = servers_dir(workdir)
    sd.mkdir(parents=True, exist_ok=True)
    (sd / "prefect-home").mkdir(exist_ok=True)
    started: dict[str, ServerInfo] = {}
    try:
        for name, (cmd, env) in _commands(workdir, host, ports).items():
            log = sd / f"{name}.log"
            with open(log, "ab") as fh:
                fh.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n".encode())
                fh.flush()
                # A new session: the server outlives this command, and `down` stops its whole group.
                proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        env=env, cwd=str(workdir), start_new_session=True)
            info = ServerInfo(name=name, pid=proc.pid, host=host, port=ports[name],
                              url=f"http://{host}:{ports[name]}", log=str(log), cmd=cmd, started_at=time.time())
            _pid_file(workdir, name).write_text(f"{proc.pid}\n")
            _state_file(workdir, name).write_text(json.dumps(asdict(info), indent=1))
            started[name] = info
        for name, info in started.items():
            _wait_healthy(info, timeout_s)
    except BaseException:
        for info in started.values():
            _stop(workdir, info)
        raise
    return started


def _wait_healthy(info: ServerInfo, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    url = info.url + HEALTH_PATH[info.name]
    while time.monotonic() < deadline:
        if http_status(url, timeout_s=2.0) == 200:
            return
        if not _alive(info.pid, info.name):
            raise ServerError(f"the {info.name} server exited during startup; last lines of {info.log}:\n"
                              f"{_tail(Path(info.log))}")
        time.sleep(0.5)
    raise ServerError(f"the {info.name} server did not answer {url} within {timeout_s:.0f}s; "
                      f"last lines of {info.log}:\n{_tail(Path(info.log))}")


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def _end_group(pgid: int, alive: Callable[[], bool], grace_s: float, what: str) -> None:
    """SIGTERM the process group `pgid`, and SIGKILL it if `alive()` still holds after `grace_s`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        except PermissionError as e:
            raise ServerError(f"cannot stop {what} (pid {pgid}): {e}") from None
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and alive():
            time.sleep(0.2)
        if not alive():
            return


def _stop(workdir: Path, info: ServerInfo, grace_s: float = 15.0) -> None:
    """SIGTERM the server's process group, then SIGKILL what is left after the grace period."""
    _end_group(info.pid, lambda: _alive(info.pid, info.name), grace_s, f"the {info.name} server")
    _pid_file(workdir, info.name).unlink(missing_ok=True)
    _state_file(workdir, info.name).unlink(missing_ok=True)


def down(workdir: str | Path) -> list[ServerInfo]:
    """Stop whichever of the two servers runs; returns those stopped."""
    workdir = Path(workdir).resolve()
    stopped = []
    for name in SERVERS:
        info = _running(workdir, name)
        if info is not None:
            _stop(workdir, info)
            stopped.append(info)
    return stopped


def status(workdir: str | Path) -> list[ServerStatus]:
    workdir = Path(workdir).resolve()
    out = []
    for name in SERVERS:
        info = _running(workdir, name)
        if info is None:
            out.append(ServerStatus(name, False, None, None, None, None))
        else:
            code = http_status(info.url + HEALTH_PATH[name])
            out.append(ServerStatus(name, True, info.pid, info.url, code, info.log))
    return out


# -- vllm serve ---------------------------------------------------------------------------------

def vllm_serve(model: str, port: int, log: Path, *, python: str | Path, host: str = "127.0.0.1",
               kv_cache_gib: int = 2, timeout_s: float = 600, served_model_name: str | None = None,
               dev_mode: bool = False, tmpdir: str | Path | None = None) -> subprocess.Popen:
    """Start `vllm serve MODEL` from a vLLM environment (`python` is its interpreter: `.venv-vllm/bin/python`,
    through `components.models.vllm_cli`) in its own process group, and return once `/v1/models` answers;
    stop it with `os.killpg(proc.pid, ...)`, or start it with `vllm_served`, which stops it.

    The settings mirror VLLMBackend's on a CPU, so a server and the offline engine sample alike: float32,
    seed 0, eager mode, whole-prompt prefill and a KV cache of `kv_cache_gib`. `served_model_name` and
    `dev_mode` (vLLM's development endpoints) make a server whose weights each stage reloads
    (the openai backend's `reload_weights`). `tmpdir` is its TMPDIR: vLLM leaves its IPC sockets there."""
    command = [str(python), "-m", "components.models.vllm_cli", "serve", model, "--host", host, "--port", str(port),
               "--dtype", "float32", "--seed", "0", "--enforce-eager", "--no-enable-chunked-prefill",
               "--max-num-batched-tokens", "8192", "--kv-cache-memory-bytes", str(kv_cache_gib * 2**30)]
    if served_model_name:
        command += ["--served-model-name", served_model_name]
    env = os.environ | {"VLLM_LOGGING_LEVEL": "WARNING",
                        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    if tmpdir is not None:
        env["TMPDIR"] = str(tmpdir)
    if dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    with log.open("w") as out:  # the server writes to its own copy of the file
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                cwd=REPO_ROOT)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerError(f"vllm serve {model} exited with code {proc.returncode}:\n{_tail(log)}")
        if http_status(f"http://{host}:{port}/v1/models", timeout_s=2) == 200:
            return proc
        time.sleep(2)
    os.killpg(proc.pid, signal.SIGKILL)
    raise ServerError(f"vllm serve {model} did not answer on {host}:{port} in {timeout_s:.0f} s:\n{_tail(log)}")


@contextmanager
def vllm_served(model: str, port: int, log: Path, **options) -> Iterator[subprocess.Popen]:
    """`vllm_serve(model, port, log, **options)` for the `with` block: then SIGTERM to its process group (SIGKILL
    after 60 s), and its temporary folder removed, where vLLM left its IPC sockets, which it never removes."""
    folder = tempfile.mkdtemp(prefix="coevo-vllm-serve-")
    try:
        proc = vllm_serve(model, port, log, tmpdir=folder, **options)
        try:
            yield proc
        finally:
            _end_group(proc.pid, lambda: proc.poll() is None, 60.0, f"vllm serve {model}")
            proc.wait()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
