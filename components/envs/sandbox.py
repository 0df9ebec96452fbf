"""Run model-written code where it can harm nothing: bubblewrap namespaces, rlimits and a wall-clock timeout.

Every execution gets:

- no network (`--unshare-net`: only a loopback with nothing behind it), its own pid, ipc and uts namespaces;
- a read-only system: `/usr` (and the `/bin`, `/lib` links into it) bound read-only, the root remounted
  read-only; nothing of the host's home, working directory or store is bound;
- a fresh, size-capped tmpfs at `/work` (its cwd, holding the files it was given) and at `/tmp`;
- none of the host's environment variables (`--clearenv`; PATH, HOME and LANG set to sandbox values);
- rlimits on CPU time, address space, processes, file size and open files, and a wall-clock timeout;
- its own uid where coevo runs as root, so the process limit counts its processes alone, and every process it
  started dies with it (`--die-with-parent`, and the pid namespace ends with its first process);
- stdout and stderr read up to `Limits.output_bytes` each: past it the run is killed and marked so.

A failed execution is a result, never an exception: `ExecResult.reason` names what ended it (`timeout`,
`cpu_time`, `memory`, `output_limit`, `signal:<n>`, `exit:<code>`). Only a broken sandbox (bubblewrap
missing) raises `SandboxError`, at construction.

`Sandbox(isolation="none")` runs the code with the rlimits and timeout alone. It logs a warning each time it is
made: it is for a machine that cannot run bubblewrap, by an explicit config switch, never a default.
"""

from __future__ import annotations

import itertools
import logging
import os
import selectors
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

BWRAP = "bwrap"
PRLIMIT = "prlimit"  # util-linux, as `setpriv` is
PYTHON = "/usr/bin/python3"  # the system's: the sandbox binds /usr, never coevo's virtual environment
ISOLATIONS = ("bwrap", "none")
# The sandbox's own uids, where coevo runs as root: each execution takes the next, so RLIMIT_NPROC (which
# counts a uid's processes host-wide, and never limits root) bounds that execution alone.
_UID_BASE, _UID_SPAN = 200_000, 50_000
_uids = itertools.count()


class SandboxError(RuntimeError):
    """The sandbox itself cannot run (bubblewrap missing or refused): a setup fault, not a failed execution."""


@dataclass(frozen=True)
class Limits:
    wall_s: float = 10.0
    cpu_s: int = 5
    memory_mb: int = 1024  # address space (RLIMIT_AS)
    processes: int = 32  # RLIMIT_NPROC of the sandbox's uid
    file_mb: int = 16  # the largest file it may write (RLIMIT_FSIZE)
    open_files: int = 64
    tmpfs_mb: int = 64  # each of /work and /tmp
    output_bytes: int = 1 << 20  # stdout and stderr each; past it the run is killed

    def __post_init__(self):
        for name in ("wall_s", "cpu_s", "memory_mb", "processes", "file_mb", "open_files", "tmpfs_mb", "output_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"sandbox limit {name} must be > 0, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class ExecResult:
    ok: bool  # exited 0 within every limit
    reason: str | None  # None when ok; else timeout | cpu_time | memory | output_limit | signal:<n> | exit:<code>
    exit_code: int | None  # None when killed by a signal
    stdout: str
    stderr: str
    wall_s: float

    def describe(self) -> str:
        """One line for an observation or a log: the reason and the last line of stderr."""
        if self.ok:
            return "ok"
        tail = self.stderr.strip().splitlines()[-1:] or [""]
        return f"{self.reason}: {tail[0][:200]}".rstrip(": ")


class Sandbox:
    """Runs programs under `limits`; `run_python(code)` is the common case. Thread-safe: every call is its own
    process tree."""

    def __init__(self, limits: Limits | None = None, isolation: str = "bwrap"):
        if isolation not in ISOLATIONS:
            raise ValueError(f"sandbox isolation must be one of {ISOLATIONS}, got {isolation!r}")
        self.limits = limits or Limits()
        self.isolation = isolation
        if shutil.which(PRLIMIT) is None:
            raise SandboxError("prlimit is not installed: it sets the sandbox's rlimits (Debian: apt-get install "
                               "util-linux)")
        if isolation == "none":
            log.warning("sandbox isolation is 'none': model-written code runs on this host with rlimits only, "
                        "and can read its files and reach its network")
        elif shutil.which(BWRAP) is None:
            raise SandboxError("bubblewrap (bwrap) is not installed: `make sandbox` installs it (Debian: "
                               "apt-get install bubblewrap); or set the sandbox isolation to 'none' explicitly")

    def run_python(self, code: str, files: Mapping[str, str] | None = None, stdin: str = "") -> ExecResult:
        """`python3 main.py` in `/work`, which holds `code` as main.py and each of `files` (name: text)."""
        return self.run([PYTHON, "-I", "-S", "main.py"], {"main.py": code, **(files or {})}, stdin)

    def run(self, argv: Sequence[str], files: Mapping[str, str] | None = None, stdin: str = "") -> ExecResult:
        for name in files or {}:
            if "/" in name or name in ("", ".", ".."):
                raise ValueError(f"sandbox file name {name!r}: a plain name is expected")
        if self.isolation == "none":
            with tempfile.TemporaryDirectory(prefix="coevo-unsandboxed-") as cwd:
                for name, text in (files or {}).items():
                    Path(cwd, name).write_text(text)
                return self._execute(list(argv), cwd, stdin, ())
        fds = []
        try:  # the files reach the sandbox's tmpfs as copies, through descriptors: no host path is bound
            for name, text in (files or {}).items():
                fd = os.memfd_create(name)
                os.write(fd, text.encode())
                os.lseek(fd, 0, os.SEEK_SET)
                fds.append((fd, name))
            return self._execute(self._bwrap(argv, fds), "/", stdin, [fd for fd, _ in fds])
        finally:
            for fd, _ in fds:
                os.close(fd)

    def _bwrap(self, argv: Sequence[str], fds: Sequence[tuple[int, str]]) -> list[str]:
        size = str(self.limits.tmpfs_mb << 20)
        cmd = []
        if os.geteuid() == 0:
            uid = str(_UID_BASE + next(_uids) % _UID_SPAN)
            cmd = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all"]
        cmd += [BWRAP, "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session", "--disable-userns",
                "--ro-bind", "/usr", "/usr"]
        for link in ("bin", "sbin", "lib", "lib64", "lib32"):
            if os.path.islink(f"/{link}"):
                cmd += ["--symlink", os.readlink(f"/{link}"), f"/{link}"]
        cmd += ["--proc", "/proc", "--dev", "/dev",
                "--size", size, "--tmpfs", "/tmp", "--size", size, "--tmpfs", "/work"]
        for fd, name in fds:
            cmd += ["--file", str(fd), f"/work/{name}"]
        cmd += ["--remount-ro", "/", "--chdir", "/work", "--clearenv",
                "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/work", "--setenv", "LANG", "C.UTF-8",
                "--setenv", "PYTHONDONTWRITEBYTECODE", "1", "--", *argv]
        return cmd

    def _execute(self, cmd: list[str], cwd: str, stdin: str, fds: Sequence[int]) -> ExecResult:
        lim = self.limits
        # As root, the run has a uid of its own (`setpriv`), and the limit counts its processes alone. Otherwise
        # the limit counts every process of the user's uid: the run may start `processes` more than it has.
        nproc = lim.processes if os.geteuid() == 0 else lim.processes + _user_processes()
        # `prlimit` sets the limits and execs the rest, so the whole tree inherits them. A `preexec_fn` would do the
        # same, but it makes Python fork the caller, page tables and all (a policy's weights, in a stage), where
        # without one it vforks.
        limit = [PRLIMIT, f"--cpu={lim.cpu_s}:{lim.cpu_s + 1}", f"--as={lim.memory_mb << 20}",
                 f"--fsize={lim.file_mb << 20}", f"--nofile={lim.open_files}", "--core=0", f"--nproc={nproc}", "--"]
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": cwd, "PYTHONDONTWRITEBYTECODE": "1"}
        t0 = time.monotonic()
        proc = subprocess.Popen(limit + cmd, cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=env, start_new_session=True, pass_fds=tuple(fds))
        out, err, why = _collect(proc, stdin.encode(), lim.output_bytes, t0 + lim.wall_s)
        if why is not None:
            _kill(proc)
        code = proc.wait()
        wall = time.monotonic() - t0
        if why is None:
            why = _reason(code, err)
        return ExecResult(why is None, why, code if code >= 0 else None,
                          out.decode(errors="replace"), err.decode(errors="replace"), wall)


def _collect(proc: subprocess.Popen, stdin: bytes, cap: int, deadline: float) -> tuple[bytes, bytes, str | None]:
    """Feed stdin, read stdout and stderr until both close; stop at the deadline or past `cap` bytes."""
    bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    sel = selectors.DefaultSelector()
    for f in bufs:
        os.set_blocking(f.fileno(), False)
        sel.register(f, selectors.EVENT_READ)
    try:
        proc.stdin.write(stdin)
        proc.stdin.close()
    except (BrokenPipeError, OSError):
        pass
    why = None
    while sel.get_map():
        left = deadline - time.monotonic()
        if left <= 0:
            why = "timeout"
            break
        for key, _ in sel.select(timeout=min(left, 0.5)):
            chunk = os.read(key.fd, 65536)
            if not chunk:
                sel.unregister(key.fileobj)
                continue
            buf = bufs[key.fileobj]
            buf += chunk[:cap + 1 - len(buf)]
            if len(buf) > cap:
                why = "output_limit"
                break
        if why:
            break
    sel.close()
    if why is None:  # the streams closed: the process is ending; it still has the rest of the wall time
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            why = "timeout"
    out, err = (bytes(bufs[f][:cap]) for f in (proc.stdout, proc.stderr))
    return out, err, why


def _kill(proc: subprocess.Popen) -> None:
    """The whole session: bubblewrap, and through its pid namespace everything the code started."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _reason(code: int, err: bytes) -> str | None:
    """What ended a run that exited by itself. bubblewrap reports its child's death by signal n as 128 + n."""
    if code == 0:
        return None
    sig = -code if code < 0 else code - 128 if code > 128 else None
    if sig == signal.SIGXCPU:
        return "cpu_time"
    if b"MemoryError" in err or b"Cannot allocate memory" in err:
        return "memory"
    return f"signal:{sig}" if sig else f"exit:{code}"


def _user_processes() -> int:
    uid = os.getuid()
    n = 0
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                n += p.stat().st_uid == uid
            except OSError:
                pass
    return n
