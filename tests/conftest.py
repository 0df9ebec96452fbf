"""Shared fixtures. Tests use the real parts: DuckDB files, Prefect's local server, MLflow's SQLite store."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# A small subset of GSM8K (MIT), shipped so a fresh clone runs the GSM8K tests: how it was drawn is in its README.
GSM8K_DATA = REPO / "tests" / "data" / "gsm8k"

# No outside calls from tests: Prefect's and MLflow's telemetry, the HF Hub.
TELEMETRY_OFF = {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1",
                 "MLFLOW_ENABLE_TELEMETRY": "false", "HF_HUB_OFFLINE": "1"}

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
for _k, _v in TELEMETRY_OFF.items():
    os.environ.setdefault(_k, _v)
# One torch thread per stage job, as the fault tests run them: results are then the same whatever
# else the machine is doing, and two runs sharing two cores do not spin against each other.
os.environ.setdefault("COEVO_TORCH_THREADS", "1")
# The code version every run in the suite records (`experiments.code_version`, `verifications.verifier_version`),
# read once: a commit made while the suite runs must not make a rerun's rows differ from the run's.
if not os.environ.get("COEVO_CODE_VERSION"):
    from components.tracking import code_version

    os.environ["COEVO_CODE_VERSION"] = code_version() or ""


# -- two workers (`make test`: pytest-xdist, `-n 2`) -------------------------------------------------

# A session fixture runs once per worker, so the tests that read one shared run must all go to one
# worker, and each other module (its module-scoped fixtures: a run, a trained model) stays whole. xdist's
# own `loadgroup` marks do not reach its scheduler under pytest 9 (it renames `item._nodeid`, which pytest 9
# no longer reads), and the scheduler sees node ids only: the groups are by path, and collection checks them
# against the fixtures each test uses, so a test that reads a shared run from outside its group fails at once.
SHARED_RUNS = {  # group: (the session fixture, the paths of the tests that use it)
    "fault": ("fault_runs", ("tests/fault/",)),
    "micro": ("micro_workdir", ("tests/integration/test_pipeline.py", "tests/integration/test_coevo_recipe.py",
                                "tests/integration/test_implicit_prm.py", "tests/integration/test_search.py",
                                "tests/ops/")),
}
SLOW_DIRS = ("tests/integration/", "tests/extension/", "tests/ui/", "tests/ops/", "tests/fault/")  # scheduled first


def test_group(nodeid: str) -> str:
    """The unit of work one worker takes whole: a shared run's group, else the test's module. A module's
    fixtures (module scope) are then made once, not once on each worker that runs one of its tests."""
    path = nodeid.split("::", 1)[0]
    for group, (_, paths) in SHARED_RUNS.items():
        if path.startswith(paths):
            return group
    return path


test_group.__test__ = False  # a helper, not a test


@pytest.hookimpl(optionalhook=True)  # xdist's hook: `-p no:xdist` (one process) must still load this file
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class SharedRunScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return test_group(nodeid)

    return SharedRunScheduling(config, log)


def pytest_collection_modifyitems(config, items):  # noqa: ARG001
    for item in items:
        names = getattr(item, "fixturenames", ())
        for group, (fixture, _) in SHARED_RUNS.items():
            if fixture in names and test_group(item.nodeid) != group:
                raise pytest.UsageError(f"{item.nodeid} uses {fixture}: add its path to SHARED_RUNS[{group!r}] in "
                                        "tests/conftest.py, so one worker runs every test of that shared run")
    # The longest groups first, so that each worker starts one, then the slow modules, and the short ones
    # fill in behind them (make test keeps this order: --no-loadscope-reorder). A stable sort keeps each
    # group's own order (the fault tests read their runs in file order).
    order = [*SHARED_RUNS, "slow"]

    def rank(item) -> int:
        g = test_group(item.nodeid)
        return order.index(g) if g in SHARED_RUNS else order.index("slow") if g.startswith(SLOW_DIRS) else len(order)

    items.sort(key=rank)


# -- processes -------------------------------------------------------------------------------------

def proc_stat(pid: int) -> tuple[str, int] | None:
    """A process's state letter and parent pid from /proc; None once it is gone (or going: ESRCH mid-exit)."""
    try:
        s = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = s[s.rfind(")") + 2:].split()
    return rest[0], int(rest[1])  # state, ppid


def alive(pid: int) -> bool:
    """Whether `pid` runs: not gone, and not a zombie left for whoever inherited it to reap."""
    st = proc_stat(pid)
    return st is not None and st[0] not in ("Z", "X")


# -- the `coevo` CLI in a subprocess, as a user runs it ---------------------------------------------

def coevo_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "flows.cli", *args]


_PREFECT_DB: list[Path] = []
_PREFECT_DB_LOCK = threading.Lock()


def migrated_prefect_db() -> Path:
    """A Prefect database at this Prefect's schema head, made once per test process (`prefect server database
    upgrade`, about 12 s of CPU) and removed at its exit. A `coevo` process whose PREFECT_HOME is new starts its
    ephemeral server on a copy, as a user's second run starts on the database its first one made: it saves the
    migrations, about half of that server's start (28 s against 15 s for a one-task flow, measured)."""
    with _PREFECT_DB_LOCK:
        if not _PREFECT_DB:
            import atexit
            import shutil
            import tempfile

            home = Path(tempfile.mkdtemp(prefix="coevo-prefect-db-"))
            atexit.register(shutil.rmtree, home, ignore_errors=True)
            env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
            p = subprocess.run([sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"],
                               env=env | TELEMETRY_OFF | {"PREFECT_HOME": str(home)}, capture_output=True, text=True,
                               timeout=300)
            if p.returncode != 0 or not (home / "prefect.db").is_file():
                raise AssertionError(f"`prefect server database upgrade -y` in {home} exited {p.returncode}:\n"
                                     f"{p.stdout[-2000:]}{p.stderr[-3000:]}")
            _PREFECT_DB.append(home / "prefect.db")
        return _PREFECT_DB[0]


def coevo_env(prefect_home: Path | None = None, *, base: Mapping[str, str] | None = None,
              env: Mapping[str, str] | None = None, unset: Iterable[str] = ()) -> dict[str, str]:
    """The environment of a `coevo` process: `base` (default: this process's), PYTHONPATH=REPO,
    telemetry off, one torch thread, PREFECT_HOME if given, then `env` on top and `unset` removed.
    A new PREFECT_HOME gets a migrated Prefect database (`migrated_prefect_db`)."""
    full = dict(os.environ if base is None else base)
    full |= {"PYTHONPATH": str(REPO), **TELEMETRY_OFF, "COEVO_TORCH_THREADS": "1"}
    if prefect_home is not None:
        full["PREFECT_HOME"] = str(prefect_home)
        if not (prefect_home / "prefect.db").exists():
            import shutil

            prefect_home.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(migrated_prefect_db(), prefect_home / "prefect.db")
    full |= env or {}
    for k in unset:
        full.pop(k, None)
    return full


def run_coevo(*args: str, prefect_home: Path | None = None, base: Mapping[str, str] | None = None,
              env: Mapping[str, str] | None = None, unset: Iterable[str] = (), cwd: Path = REPO,
              check: bool = False, timeout: float = 600) -> subprocess.CompletedProcess:
    """`coevo *args` to completion, its output captured; with `check`, a non-zero exit fails the test."""
    p = subprocess.run(coevo_cmd(*args), cwd=cwd, env=coevo_env(prefect_home, base=base, env=env, unset=unset),
                       capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"coevo {' '.join(args)} exited {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}")
    return p


@pytest.fixture
def repo() -> Path:
    return REPO


def untied_copy(model: str | Path, dst: Path) -> Path:
    """`model` with `tie_word_embeddings` off and its output layer a copy of its embeddings: the same function."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model)
    m.config.tie_word_embeddings = False
    m.lm_head.weight = torch.nn.Parameter(m.get_input_embeddings().weight.detach().clone())
    m.save_pretrained(dst)
    for f in Path(model).iterdir():  # the tokenizer and chat template, as they were
        if f.is_file() and not (dst / f.name).exists():
            shutil.copy(f, dst / f.name)
    return dst


@pytest.fixture(scope="session")
def prefect_server():
    """Prefect's real local server (temporary, SQLite), for the whole session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


@dataclass(frozen=True)
class MicroWorkdir:
    path: Path
    experiments: tuple[str, str] = ("micro", "micro-b")

    @property
    def config(self) -> Path:
        return REPO / "configs" / "micro.yaml"

    def overrides(self, experiment: str = "micro") -> list[str]:
        if experiment == "micro-b":  # after `micro`: it starts from micro's round-0 policy
            return [f"workdir={self.path}", *MICRO_B, *self.start_from_round0()]
        return [f"workdir={self.path}"]

    def start_from_round0(self) -> list[str]:
        """Overrides that start another micro-scale experiment from `micro`'s round-0 policy as it is
        (`bootstrap.steps=0`). Its bootstrap is deterministic and every micro config shares it, so this is
        the model the experiment would have trained itself (and its demos, stored for replay, are the same):
        it saves each such run the bootstrap's ~100 s."""
        from components.store import Store

        model = Store(self.path / "store").committed_model("micro", 0, "policy")
        return [f"policy.model={model['uri']}", "bootstrap.steps=0"]


# Runs from micro's round-0 policy that test a dataflow, not how far SFT moves the policy, train 40 steps a round
# (150 in configs/micro.yaml): enough that later rounds still have right answers to score, rank and judge.
SHORT_SFT = ["train_policy.steps=40"]
# The second experiment, so `coevo compare` has two to put side by side: micro's round-0 policy, then
# another seed's samples and shorter training.
MICRO_B = ["experiment=micro-b", "seed=1", *SHORT_SFT]


@pytest.fixture(scope="session")
def micro_workdir(prefect_server, tmp_path_factory) -> MicroWorkdir:
    """One workdir with two micro experiments, run once per session through the real `self_evolution`
    flow (Prefect's local server, MLflow on the workdir's SQLite store, DuckDB), shared by the
    integration, operator and notebook tests, which only read it."""
    from flows.evolution import self_evolution

    w = MicroWorkdir(tmp_path_factory.mktemp("micro"))
    for exp in w.experiments:
        self_evolution(config_path=str(w.config), overrides=w.overrides(exp))
    return w


def assert_plans_read_what_they_declare(cfg, store, tmp_path: Path) -> None:
    """Each stage's plan, against a real store, names only committed outputs of the stages its registry
    entry says it reads (the registry is the one written form of the dataflow)."""
    from components.recipes import get_recipe
    from components.stages import STAGES, build_spec

    for r in range(cfg.rounds + 1):
        for stage in get_recipe(cfg.recipe).round_stages(r, cfg):
            spec = build_spec(cfg, store, r, stage, attempt=99, code_version=None, out_dir=tmp_path / f"{r}-{stage}")
            read = {i.stage for i in spec.inputs}
            assert read <= set(STAGES[stage].reads), (r, stage, read)
            assert all(i.round <= r for i in spec.inputs), (r, stage)


def assert_ptx_replays_the_demonstrations(store, experiment: str, rounds: list[int]) -> int:
    """train_policy.grpo.ptx_weight > 0: each grpo round in `rounds` names every round-0 demonstration once beside its
    rollouts (`model_inputs` use 'ptx', source round 0; an episode trains on its assistant turns), and logs their
    count and mean NLL. Returns how many demonstrations there are."""
    demos = store.query("SELECT count(*) FROM selections s JOIN trajectories t USING (trajectory_id) WHERE "
                        "t.experiment_id = ? AND s.round = 0 AND s.selected AND s.purpose = 'policy_sft'",
                        [experiment])[1][0][0]
    _, rows = store.query(
        "SELECT m.round, count(*), "
        "json_extract(r.metrics_json, '$.ptx_examples')::INTEGER, json_extract(r.metrics_json, '$.ptx_loss')::DOUBLE "
        "FROM model_inputs i JOIN models m USING (model_id) JOIN stage_runs r ON r.experiment_id = m.experiment_id "
        "AND r.round = m.round AND r.stage = 'train_policy' AND r.status = 'committed' "
        "WHERE m.experiment_id = ? AND m.role = 'policy' AND i.use = 'ptx' AND i.source_round = 0 "
        "GROUP BY ALL ORDER BY ALL", [experiment])
    assert demos > 0 and [row[:3] for row in rows] == [(r, demos, demos) for r in rounds], (demos, rows)
    assert all(0 < nll < 10 for *_, nll in rows)
    return demos


@dataclass
class S3Endpoint:
    """A real S3-compatible endpoint on 127.0.0.1 (moto's server) with one bucket, whose requests are signed and
    checked against an IAM user's key (moto's INITIAL_NO_AUTH_ACTION_COUNT), so wrong credentials are refused."""

    url: str
    bucket: str
    key: str
    secret: str

    def env(self, key: str | None = None, secret: str | None = None) -> dict[str, str]:
        """What a process needs to use the bucket: credentials and endpoint, from the environment only.
        No metadata service and no credentials file: a missing key must fail here, not reach out."""
        return {"AWS_ENDPOINT_URL": self.url, "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
                "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent", "AWS_CONFIG_FILE": "/nonexistent",
                "AWS_ACCESS_KEY_ID": key or self.key, "AWS_SECRET_ACCESS_KEY": secret or self.secret}

    def fs(self):
        import s3fs

        return s3fs.S3FileSystem(key=self.key, secret=self.secret, endpoint_url=self.url, skip_instance_cache=True,
                                 use_listings_cache=False)


@pytest.fixture(scope="module")
def s3_endpoint(tmp_path_factory) -> Iterable[S3Endpoint]:
    import json
    import socket
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("moto") / "server.log"
    # The first 4 requests (the IAM user, its key, its policy, the bucket) go unchecked; every later one is signed.
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            env=os.environ | {"INITIAL_NO_AUTH_ACTION_COUNT": "4"}, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        for _ in range(150):
            try:
                urllib.request.urlopen(f"{url}/moto-api/", timeout=1)
                break
            except OSError:
                time.sleep(0.2)
        else:
            raise AssertionError(f"moto's S3 server did not start on {url}: {log.read_text()[-2000:]}")
        import boto3

        kw = {"endpoint_url": url, "region_name": "us-east-1", "aws_access_key_id": "bootstrap",
              "aws_secret_access_key": "bootstrap"}
        iam = boto3.client("iam", **kw)
        iam.create_user(UserName="coevo")
        key = iam.create_access_key(UserName="coevo")["AccessKey"]
        policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
        iam.put_user_policy(UserName="coevo", PolicyName="all", PolicyDocument=json.dumps(policy))
        boto3.client("s3", **kw).create_bucket(Bucket="coevo")
        yield S3Endpoint(url, "coevo", key["AccessKeyId"], key["SecretAccessKey"])
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@dataclass
class Postgres:
    """A Postgres server of the test's own on 127.0.0.1 (Debian's postgresql-15), with password auth: a store's
    shared catalog. Its password reaches a process through PGPASSWORD only."""

    port: int
    user: str
    password: str

    def catalog(self, dbname: str) -> str:
        return f"postgres:host=127.0.0.1 port={self.port} user={self.user} dbname={dbname}"

    def env(self, password: str | None = None) -> dict[str, str]:
        return {"PGPASSWORD": password or self.password, "PGCONNECT_TIMEOUT": "5"}

    def createdb(self, name: str) -> None:
        subprocess.run(["psql", "-h", "127.0.0.1", "-p", str(self.port), "-U", self.user, "-d", "postgres", "-v",
                        "ON_ERROR_STOP=1", "-c", f"CREATE DATABASE {name}"], check=True, capture_output=True,
                       env=os.environ | self.env())


def _pg_bin() -> Path:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"))
    assert found, "no Postgres server (Debian's postgresql-15): `make test` installs it"
    return found[-1].parent


@pytest.fixture(scope="module")
def postgres() -> Iterable[Postgres]:
    import pwd
    import secrets
    import socket

    import shutil
    import tempfile

    bin_dir = _pg_bin()
    # Postgres refuses to run as root: as root (CI), the server runs as Debian's `postgres` user, in a folder
    # of its own (pytest's are private to root).
    run_as = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    root = Path(tempfile.mkdtemp(prefix="coevo-pg-"))
    if run_as:
        os.chown(root, pwd.getpwnam("postgres").pw_uid, -1)
    password = secrets.token_hex(12)
    (root / "pw").write_text(password)
    if run_as:
        os.chown(root / "pw", pwd.getpwnam("postgres").pw_uid, -1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    data = root / "data"
    subprocess.run([*run_as, str(bin_dir / "initdb"), "-D", str(data), "-U", "coevo", "-A", "scram-sha-256",
                    "--pwfile", str(root / "pw")], check=True, capture_output=True)
    subprocess.run([*run_as, str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(root / "log"), "-w", "-t", "60",
                    "-o", f"-p {port} -k {root} -c listen_addresses=127.0.0.1", "start"], check=True, capture_output=True)
    try:
        yield Postgres(port, "coevo", password)
    finally:
        subprocess.run([*run_as, str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"],
                       capture_output=True)
        shutil.rmtree(root, ignore_errors=True)
