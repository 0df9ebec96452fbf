"""A store that spans machines, stood in on one: the DuckLake catalog in Postgres, its data in a bucket (moto's
S3), the orchestrator (`coevo run`) in one process and an analyst's reader in another, with a home and a working
folder of its own, reaching the store through nothing but the catalog string and the environment's credentials.

The reader holds one transaction open from the store's first commit to the run's end, and polls new snapshots
beside it: the run neither fails nor waits, every total it sees is a sum of whole commits, and the held
transaction keeps its snapshot. Then `coevo query --catalog` answers on the finished run, as of round 0 too, and
a wrong password or an unreachable catalog is refused with a clear message and exit 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, coevo_cmd, coevo_env

pytestmark = pytest.mark.slow

MICRO = REPO / "configs" / "micro.yaml"
# A round 0 and one round, small: this test is about where the rows go, not about learning.
SMALL = ["rounds=1", "bootstrap.steps=150", "bootstrap.problems_per_level=200", "generate.problems_per_level=20",
         "train_policy.steps=20", "evaluate.problems_per_level=20"]
SLOW_START = {"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180"}  # a busy machine starts it slowly
COUNTS = "SELECT (SELECT count(*) FROM trajectories), (SELECT count(*) FROM verifications)"

READER = """
import json, sys, time
from components.store import Store
store, stop, sql = Store(sys.argv[1]), sys.argv[2], sys.argv[3]
out = {"polled": [], "held": [], "errors": []}
deadline = time.monotonic() + 900
def ready():
    try:
        store.query("SELECT count(*) FROM coevo_meta")
        return True
    except Exception:
        return False
import pathlib
while not ready() and not pathlib.Path(stop).exists() and time.monotonic() < deadline:
    time.sleep(0.2)
with store.reader() as held:
    held.execute("BEGIN TRANSACTION")
    while not pathlib.Path(stop).exists() and time.monotonic() < deadline:
        try:
            out["held"].append(held.execute(sql).fetchone())
            out["polled"].append(store.query(sql)[1][0])
        except Exception as e:
            out["errors"].append(f"{type(e).__name__}: {e}")
        time.sleep(0.5)
    held.execute("COMMIT")
print(json.dumps(out, default=list))
"""


def _analyst(tmp: Path, extra: dict[str, str]) -> dict[str, str]:
    """Another machine: its own home and folder; the catalog's and the bucket's credentials, nothing else."""
    home = tmp / "analyst"
    home.mkdir(exist_ok=True)
    return coevo_env(tmp / "analyst-prefect") | {"HOME": str(home)} | SLOW_START | extra


def test_an_orchestrator_and_a_reader_on_other_machines_share_one_store(tmp_path, postgres, s3_endpoint):
    postgres.createdb("lake")
    catalog = postgres.catalog("lake")
    creds = s3_endpoint.env() | postgres.env()
    workdir = tmp_path / "orchestrator"
    sets = [f"workdir={workdir}", "experiment=shared", f"execution.catalog={catalog}",
            f"execution.storage=s3://{s3_endpoint.bucket}/team", *SMALL]
    stop = tmp_path / "stop"
    reader = subprocess.Popen([sys.executable, "-c", READER, catalog, str(stop), COUNTS], cwd=REPO,
                              env=_analyst(tmp_path, creds | {"PYTHONPATH": str(REPO)}), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        t0 = time.monotonic()
        run = subprocess.run(coevo_cmd("run", "--config", str(MICRO), *[x for s in sets for x in ("--set", s)]),
                             cwd=REPO, env=coevo_env(tmp_path / "prefect") | creds | SLOW_START, capture_output=True, text=True,
                             timeout=900)
        took = time.monotonic() - t0
    finally:
        stop.touch()
        try:
            out, err = reader.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            reader.kill()
            out, err = reader.communicate()
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:] + err[-2000:]
    seen = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
    assert seen and not seen["errors"], (seen, err[-2000:])

    # The analyst's `coevo query`, from another folder, by the catalog string alone.
    def query(sql: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(coevo_cmd("query", sql, "--catalog", catalog, "--format", "json", *args),
                              cwd=tmp_path / "analyst", env=env or _analyst(tmp_path, creds), capture_output=True,
                              text=True, timeout=300)

    final = query(COUNTS.replace("(SELECT count(*) FROM verifications)", "(SELECT count(*) FROM verifications) AS v"))
    assert final.returncode == 0, final.stderr
    total = tuple(json.loads(final.stdout)[0].values())
    runs = json.loads(query("SELECT round, stage, status, rows_json FROM stage_runs ORDER BY started_at").stdout)
    assert {r["status"] for r in runs} == {"committed"} and {r["round"] for r in runs} == {0, 1}
    whole = [(0, 0)]  # the totals after each commit, in commit order
    for r in runs:
        rows = json.loads(r["rows_json"] or "{}")
        whole.append((whole[-1][0] + rows.get("trajectories", 0), whole[-1][1] + rows.get("verifications", 0)))
    assert tuple(whole[-1]) == total and total[0] > 0

    polled = [tuple(c) for c in seen["polled"]]
    assert len(set(polled)) >= 3, f"the reader barely ran beside the run ({took:.0f}s): {sorted(set(polled))}"
    assert all(c in whole for c in polled), f"a reader saw half a stage: {polled} vs whole commits {whole}"
    assert [whole.index(c) for c in polled] == sorted(whole.index(c) for c in polled), "a reader went back in time"
    held = [tuple(c) for c in seen["held"]]
    assert len(held) == len(polled) and len(set(held)) == 1, "the held transaction's snapshot moved"

    # As of round 0: the store as it stood after round 0's last stage.
    r0 = query("SELECT count(*) AS n FROM trajectories WHERE round > 0", "--as-of", "shared/r0")
    assert r0.returncode == 0, r0.stderr
    assert json.loads(r0.stdout) == [{"n": 0}]
    assert json.loads(query("SELECT count(*) AS n FROM trajectories WHERE round > 0").stdout)[0]["n"] > 0

    # Where things are: the data files in the bucket, nothing of the store on the orchestrator's disk, and no
    # credential in the catalog.
    keys = s3_endpoint.fs().find(f"{s3_endpoint.bucket}/team/store")
    assert [k for k in keys if k.endswith(".parquet")], keys
    assert not (workdir / "store").exists()
    dump = subprocess.run(["pg_dump", "-h", "127.0.0.1", "-p", str(postgres.port), "-U", postgres.user, "lake"],
                          env=os.environ | postgres.env(), capture_output=True, text=True, check=True).stdout
    assert "ducklake_snapshot" in dump
    assert s3_endpoint.secret not in dump and postgres.password not in dump

    # Bad input: a wrong password, an unreachable catalog. Each is refused with a message, exit 2, no traceback.
    bad = query("SELECT 1", env=_analyst(tmp_path, creds | {"PGPASSWORD": "wrong"}))
    assert bad.returncode == 2 and "password authentication failed" in bad.stderr, bad.stderr
    gone = subprocess.run(coevo_cmd("query", "SELECT 1", "--catalog", postgres.catalog("lake").replace(
        f"port={postgres.port}", "port=1")), cwd=tmp_path / "analyst", env=_analyst(tmp_path, creds),
        capture_output=True, text=True, timeout=300)
    assert gone.returncode == 2 and "Traceback" not in gone.stderr, gone.stderr
    assert "port=1" in " ".join(gone.stderr.split()) and "password" not in gone.stderr.lower(), gone.stderr
