"""The sandbox against each attack of `components.envs.attacks`: every one ends as a failed execution with its
reason, the host is unchanged, and the next execution runs as if nothing happened. bubblewrap is a test
prerequisite (`make test` installs it): without it these fail at `Sandbox()`, they do not skip."""

import logging
import os
import socket
import time
from pathlib import Path

import pytest

from components.envs import attacks
from components.envs.sandbox import Limits, Sandbox, SandboxError

LIMITS = Limits(wall_s=3.0, cpu_s=1, output_bytes=1 << 20)


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return Sandbox(LIMITS)


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    """A secret in the host's environment and working directory, and a port the host listens on."""
    secret = tmp_path_factory.mktemp("host") / "secret.txt"
    secret.write_text("canary-file")
    old = os.environ.get(attacks.ENV_SECRET)
    os.environ[attacks.ENV_SECRET] = "canary-env"
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    yield {"secret_file": str(secret), "home": str(Path.home()), "port": srv.getsockname()[1]}
    srv.close()
    if old is None:
        del os.environ[attacks.ENV_SECRET]
    else:
        os.environ[attacks.ENV_SECRET] = old


def _attack(sandbox: Sandbox, host: dict, name: str):
    return sandbox.run_python(attacks.render(attacks.ATTACKS[name], **host))


def _processes_with(marker: str) -> list[str]:
    found = []
    for p in Path("/proc").iterdir():
        try:
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if marker in cmd and "pytest" not in cmd:
            found.append(f"{p.name}: {cmd}")
    return found


def test_a_plain_program_runs_and_sees_only_its_files(sandbox):
    r = sandbox.run_python("import os\nprint(open('data.txt').read(), sorted(os.listdir('.')), os.getcwd())",
                           {"data.txt": "hello"}, stdin="")
    assert r.ok and r.reason is None and r.exit_code == 0
    assert r.stdout.split() == ["hello", "['data.txt',", "'main.py']", "/work"]


@pytest.mark.parametrize("name, reason", [
    ("infinite loop", "cpu_time"),
    ("sleep past the wall clock", "timeout"),
    ("10 GB allocation", "memory"),
    ("100 MB of output", "output_limit"),
])
def test_a_resource_attack_ends_with_its_reason(sandbox, host, name, reason):
    r = _attack(sandbox, host, name)
    assert (r.ok, r.reason) == (False, reason), r
    assert r.wall_s < LIMITS.wall_s + 2
    assert len(r.stdout) <= LIMITS.output_bytes


def test_a_fork_bomb_is_stopped_by_the_process_limit(sandbox, host):
    r = _attack(sandbox, host, "fork bomb")
    assert not r.ok and r.reason in ("exit:1", "timeout"), r
    assert "BlockingIOError" in r.stderr or r.reason == "timeout"
    assert sandbox.run_python("print('alive')").stdout == "alive\n"


def test_writes_outside_the_tmpfs_are_refused(sandbox, host):
    r = _attack(sandbox, host, "write outside its tmpfs")
    assert not r.ok and "WROTE" not in r.stdout and r.stdout.count("refused") == 4, r
    assert not Path("/usr/coevo-escape").exists() and not Path("/coevo-escape").exists()


def test_the_hosts_environment_home_and_workdir_are_out_of_reach(sandbox, host):
    r = _attack(sandbox, host, "read the host's environment, home and workdir")
    assert not r.ok and "canary" not in r.stdout + r.stderr, r
    assert "ENV None" in r.stdout and r.stdout.count("refused") == 3


def test_the_network_is_unreachable(sandbox, host):
    r = _attack(sandbox, host, "network connect")
    assert not r.ok and "CONNECTED" not in r.stdout and r.stdout.count("refused") == 2, r


def test_no_child_outlives_the_run(sandbox, host):
    r = _attack(sandbox, host, "a child that outlives the run")
    assert (r.ok, r.reason) == (False, "exit:3"), r
    # The kernel kills what is left in the sandbox's PID namespace when its init exits, and under load a killed
    # process can still be listed in /proc for a moment: give it a second to go, no more.
    deadline = time.monotonic() + 1.0
    while _processes_with(f"sleep {attacks.MARKER}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _processes_with(f"sleep {attacks.MARKER}") == []


def test_files_the_code_writes_stay_in_its_tmpfs(sandbox):
    r = sandbox.run_python("open('out.txt', 'w').write('x')\nopen('/tmp/t', 'w').write('y')\nprint('done')")
    assert r.ok and r.stdout == "done\n"
    assert sandbox.run_python("import os\nprint(os.listdir('.'), os.listdir('/tmp'))").stdout == "['main.py'] []\n"


def test_a_file_larger_than_the_limit_is_cut(tmp_path):
    r = Sandbox(Limits(file_mb=1)).run_python("open('big', 'wb').write(b'x' * (2 << 20))")
    assert not r.ok and r.reason in ("signal:25", "exit:1"), r  # SIGXFSZ, or the OSError it becomes


def test_running_unsandboxed_is_explicit_and_warns(caplog):
    with caplog.at_level(logging.WARNING):
        r = Sandbox(LIMITS, isolation="none").run_python("print('on the host')")
    assert r.ok and r.stdout == "on the host\n"
    assert "isolation is 'none'" in caplog.text
    with pytest.raises(ValueError, match="isolation must be one of"):
        Sandbox(LIMITS, isolation="off")


def test_a_missing_bubblewrap_is_a_setup_error(monkeypatch):
    monkeypatch.setattr("components.envs.sandbox.BWRAP", "bwrap-not-installed")
    with pytest.raises(SandboxError, match="bubblewrap .* is not installed"):
        Sandbox(LIMITS)


@pytest.mark.parametrize("isolation", ["bwrap", "none"])
def test_the_program_runs_under_every_rlimit(isolation):
    program = ("import resource as r\n"
               "print([r.getrlimit(getattr(r, 'RLIMIT_' + n)) for n in ('CPU', 'AS', 'FSIZE', 'NOFILE', 'CORE')])")
    got = Sandbox(LIMITS, isolation=isolation).run_python(program)
    assert got.ok, got.stderr
    assert eval(got.stdout) == [(LIMITS.cpu_s, LIMITS.cpu_s + 1), (LIMITS.memory_mb << 20,) * 2,
                                (LIMITS.file_mb << 20,) * 2, (LIMITS.open_files,) * 2, (0, 0)]


def test_a_missing_prlimit_is_a_setup_error(monkeypatch):
    monkeypatch.setattr("components.envs.sandbox.PRLIMIT", "prlimit-not-installed")
    for isolation in ("bwrap", "none"):
        with pytest.raises(SandboxError, match="prlimit is not installed"):
            Sandbox(LIMITS, isolation=isolation)


def test_bad_limits_and_file_names_are_refused(sandbox):
    with pytest.raises(ValueError, match="sandbox limit wall_s must be > 0"):
        Limits(wall_s=0)
    with pytest.raises(ValueError, match="sandbox file name '../x'"):
        sandbox.run_python("pass", {"../x": ""})
