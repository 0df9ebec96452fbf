"""Per-table content hashes and checkpoint sha256s of one config's run: the proof that a refactor keeps behaviour.

    .venv/bin/python benchmarks/fingerprint.py configs/micro.yaml --workdir /tmp/fp-micro > micro.txt

Runs the config end to end through the `coevo` CLI (Prefect's ephemeral server, MLflow, DuckDB) in a
fresh workdir, then prints one line per data table (row count, content hash; attempt ids and file
locations are not content) and one line per model (sha256 of its checkpoint folder). Run it before
and after a change and `diff` the two: the same config and seed on the same machine, with one torch
thread per job, print the same lines. Two things outside the code also enter them: the code version
(`verifications.verifier_version` is the git sha, so compare two checkouts' copies outside git, or
two commits' runs with that in mind) and `HF_HUB_OFFLINE` (transformers writes `local_files_only`
into a saved tokenizer's config), which this script sets as the CLI does.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--workdir", required=True, type=Path)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args()
    env = dict(os.environ, PREFECT_HOME=str(args.workdir / ".prefect"), COEVO_TORCH_THREADS="1", HF_HUB_OFFLINE="1",
               PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="180")  # a busy machine starts it slowly
    args.workdir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "flows.cli", "run", "--config", args.config, "--set", f"workdir={args.workdir}"]
    for o in args.overrides:
        cmd += ["--set", o]
    log = args.workdir / "run.log"
    with log.open("w") as f:
        rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        sys.exit(f"coevo run failed (exit {rc}); see {log}")
    from components.config import load_config
    from components.store import Store

    cfg = load_config(args.config, [f"workdir={args.workdir}", *args.overrides])
    store = Store.for_config(cfg)
    for table, (n, h) in sorted(store.table_hashes(cfg.experiment).items()):
        print(f"table {table:14s} {n:7d} {h}")
    for m in store.rows("SELECT model_id, sha256 FROM models WHERE experiment_id=? ORDER BY model_id", [cfg.experiment]):
        print(f"model {m['model_id']:40s} {m['sha256']}")


if __name__ == "__main__":
    main()
