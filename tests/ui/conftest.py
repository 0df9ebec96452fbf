"""Real servers and a real browser for the UI test: `coevo server up`, `coevo serve`, headless Chromium.

Chromium and its driver come from Debian (`chromium`, `chromium-driver`). If they are missing the
fixture installs them with apt-get, and if that is impossible the test fails saying why: a UI test
that silently skips tests nothing.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO, coevo_cmd, coevo_env, run_coevo

CHROMEDRIVER = "/usr/bin/chromedriver"
SCREENS = Path("/tmp/coevo-screens")  # a copy of every screenshot, to look at after the run
UI_EXPERIMENT = "ui-micro"


def coevo(*args: str, env: dict[str, str] | None = None, check: bool = True, timeout: float = 300,
          ) -> subprocess.CompletedProcess:
    return run_coevo(*args, env={"COLUMNS": "200", **(env or {})}, check=check, timeout=timeout)


def _chromium() -> str | None:
    return shutil.which("chromium") if Path(CHROMEDRIVER).exists() else None


@pytest.fixture(scope="session")
def chromium_binary() -> str:
    found = _chromium()
    if found:
        return found
    if os.geteuid() != 0:
        pytest.fail("chromium and chromium-driver are not installed and this user cannot apt-get install them: "
                    "run `sudo apt-get install -y chromium chromium-driver` (or `make test`)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "chromium", "chromium-driver"]):
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if p.returncode != 0:
            pytest.fail(f"could not install Chromium for the UI test: `{' '.join(cmd)}` exited {p.returncode}:\n"
                        f"{p.stderr[-2000:]}")
    found = _chromium()
    if not found:
        pytest.fail(f"apt-get installed chromium, but chromium or {CHROMEDRIVER} is still missing")
    return found


@pytest.fixture
def browser(chromium_binary, tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium_binary
    # As root in a container: no sandbox, no GPU, and no background traffic to Google services.
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", "--window-size=1400,1000", f"--user-data-dir={tmp_path / 'chrome-profile'}"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


@dataclass
class Servers:
    workdir: Path
    prefect_url: str
    mlflow_url: str

    @property
    def prefect_api(self) -> str:
        return self.prefect_url + "/api"


@pytest.fixture
def servers(tmp_path):
    from components.servers import free_port

    workdir = tmp_path / "workdir"
    pp, mp = free_port(), free_port()
    coevo("server", "up", "--workdir", str(workdir), "--prefect-port", str(pp), "--mlflow-port", str(mp))
    try:
        yield Servers(workdir, f"http://127.0.0.1:{pp}", f"http://127.0.0.1:{mp}")
    finally:
        coevo("server", "down", "--workdir", str(workdir), check=False)


@pytest.fixture
def user_configs(servers, tmp_path) -> Path:
    """A user's own config folder, as `coevo serve --configs` takes it: the micro config, one round shorter in
    training, writing to the test's workdir. Round 1 still generates, filters, trains and evaluates."""
    import yaml

    folder = tmp_path / "my-configs"
    folder.mkdir()
    cfg = yaml.safe_load((REPO / "configs" / "micro.yaml").read_text())
    cfg.update(experiment=UI_EXPERIMENT, workdir=str(servers.workdir))
    cfg["bootstrap"]["steps"] = 300  # enough that round 1 selects samples and trains
    cfg["train_policy"]["steps"] = 20
    cfg["generate"]["problems_per_level"] = 20
    cfg["evaluate"]["problems_per_level"] = 20
    (folder / f"{UI_EXPERIMENT}.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return folder


@pytest.fixture
def served(servers, user_configs, tmp_path):
    """`coevo serve --configs <user_configs>` in the background against the test's Prefect server; stopped
    (SIGINT) afterwards. Its TMPDIR is its own, removed after it: the run left a Prefect `runner_storage/<uuid>`
    folder in /tmp. Short, so a warm server's socket path still fits in 108 bytes."""
    log = open(tmp_path / "serve.log", "w")
    tmp = tempfile.mkdtemp(prefix="coevo-serve-")
    env = coevo_env(env={"PREFECT_API_URL": servers.prefect_api, "MLFLOW_TRACKING_URI": servers.mlflow_url,
                         "COEVO_WORKDIR": str(servers.workdir), "TMPDIR": tmp})
    proc = subprocess.Popen(coevo_cmd("serve", "--configs", str(user_configs)), cwd=REPO, env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # the runner pauses its deployments and exits on SIGINT
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


def wait_for(fn, timeout: float, what: str, interval: float = 1.0):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            v = fn()
            if v:
                return v
        except Exception as e:  # noqa: BLE001 - retried until the deadline, then reported
            last = e
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}" + (f": {last!r}" if last else ""))
