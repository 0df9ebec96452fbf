"""The store at scale: ingest, the views, memory and reads during a commit, on synthetic rows.

    .venv/bin/python benchmarks/store_scale.py --steps 10000000 --workdir /tmp/store-scale
    .venv/bin/python benchmarks/store_scale.py --steps 100000000 --workdir /tmp/store-scale

Issue 27 moved the store to a DuckLake (a catalog plus Parquet files) so that readers never stall a round.
This checks that the move costs little, with rows in proportion to `--steps` (all experiments and rounds
together): trajectories of 10 steps each, one verification, selection and outcome score per trajectory,
one `mc_soft` label and one PRM score per step, a model trained on the correct ones, and evaluations.
Each experiment's rounds go through the real `Store.start_stage_run` + `Store.commit`, one commit per stage
(generate, verify, score, filter, train_policy, evaluate), as the flow does. The synthesis (DuckDB SQL
over `range()`, hashed with a fixed seed, so the same rows every run) is never timed. In one run:

1. ingest: rows/s through `Store.commit` (not `start_stage_run`, a bookkeeping transaction before the job),
   against rewriting the same parts as plain Parquet with DuckDB (`COPY (SELECT * FROM read_parquet(part))
   TO ...`). Goal: store / plain at least 0.5. A commit has a fixed cost (about 35 ms of catalog round trips,
   and 4 ms a part, on 2 cores), which rules the ratio at small `--steps`: read it at 10M and above.
2. `SELECT * FROM v_round_summary` over every round, through `Store.query`, median of 3. Goal: < 2 s on
   2 cores at 100M steps.
3. one experiment's `v_lineage` (count and distinct trajectories), median of 3.
4. the process's peak memory (ru_maxrss). Goal: < 4 GiB. DuckDB keeps its defaults (80% of RAM).
5. `v_round_summary` timed again and again in a second process, while this one commits `--busy-rounds` (3)
   more rounds of experiment e0, each the size of the others: median busy time / median idle time. Goal: < 2x.
   Three rounds give 10 to 20 busy samples at 10M steps, where one round gave 4 to 6 and a noisy median.
6. the store's size on disk and its number of data files.

Figures go to stdout and to `<workdir>/store_scale.json`. Job outputs are deleted once committed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from components.manifest import Manifest, StageOutputWriter, part_path, read_manifest, sha256_file  # noqa: E402
from components.store import StageRunRef, Store  # noqa: E402
from components.tables import PARTS  # noqa: E402

SEED = 1234  # every synthetic value is a hash of its row number and this
STEPS = 10  # steps per trajectory
SAMPLES = 4  # trajectories per problem
LEVELS = 5  # curriculum levels
ROLLOUTS = 8  # Monte Carlo rollouts behind each mc_soft label
CONFIG_HASH = "store-scale"
IDLE_SAMPLES = 10  # reader queries timed before the commit starts
SUMMARY = "SELECT * FROM v_round_summary"
LINEAGE = "SELECT count(*), count(DISTINCT trajectory_id) FROM v_lineage WHERE experiment_id = ?"
GIB = 1 << 30


def round_jobs(exp: str, rnd: int, n: int) -> dict[str, tuple[list[tuple[str, str]], dict[str, float]]]:
    """{stage: ([(table, SELECT of one part)], manifest metrics)} for `n` trajectories of one round.
    Ids are hashes, as `components.generation.trajectory_id` makes them, so no file is sorted by key."""
    problems = max(1, n // SAMPLES)  # the same pool every round: later rounds add no problems
    p = f"(t // {SAMPLES} % {problems})"
    tid = f"substr(md5('{exp}|{rnd}|' || t), 1, 24)"
    ok = f"(hash('{exp}', {rnd}, t, {SEED}) % 10 < 6)"  # 60% correct
    T = f"(SELECT range AS t FROM range({n}))"
    S = f"(SELECT range // {STEPS} AS t, (range % {STEPS})::INTEGER AS step_index, range AS s FROM range({n * STEPS}))"
    model, parent = f"'{exp}/policy/r{rnd}/a1'", f"'{exp}/policy/r{rnd - 1}/a1'"
    return {
        "generate": ([
            ("problems", f"SELECT substr(md5('p' || p), 1, 16) AS problem_id, 'synthetic' AS domain, "
                         f"(p % {LEVELS})::INTEGER AS level, 'What is ' || p || ' * 7 + 3?' AS prompt, "
                         f"(p * 7 + 3)::VARCHAR AS answer, '{{}}' AS meta_json, 'train' AS split "
                         f"FROM (SELECT range AS p FROM range({problems}))"),
            ("trajectories", f"SELECT {tid} AS trajectory_id, '{exp}' AS experiment_id, {rnd}::INTEGER AS round, "
                             f"'train' AS purpose, substr(md5('p' || {p}), 1, 16) AS problem_id, "
                             f"({p} % {LEVELS})::INTEGER AS level, {parent} AS policy_model_id, "
                             f"(t % {SAMPLES})::INTEGER AS sample_index, 'What is ' || {p} || ' * 7 + 3?' AS prompt, "
                             f"'Multiply by 7, then add 3. The answer is ' || ({p} * 7 + 3) AS completion, "
                             f"CASE WHEN {ok} THEN ({p} * 7 + 3)::VARCHAR ELSE '0' END AS answer, "
                             f"(100 + hash('{exp}', {rnd}, t, {SEED}, 3) % 400)::INTEGER AS num_tokens, 'stop' AS finish_reason, "
                             "0.8::DOUBLE AS temperature, 1.0::DOUBLE AS top_p, 512::INTEGER AS max_new_tokens, "
                             f"({SEED} + t)::BIGINT AS seed, NULL::INTEGER[] AS token_ids FROM {T}"),
            ("steps", f"SELECT {tid} AS trajectory_id, step_index, "
                      f"'Step ' || step_index || ': x = ' || hash(s, {SEED}) % 1000 AS text FROM {S}"),
        ], {"search_discarded_tokens": 0.0}),
        "verify": ([
            ("verifications", f"SELECT {tid} AS trajectory_id, 'synthetic' AS verifier, '1' AS verifier_version, "
                              f"{ok} AS correct, {ok}::DOUBLE AS reward, NULL::VARCHAR AS detail FROM {T}"),
        ], {}),
        "score": ([
            ("scores", f"SELECT {tid} AS trajectory_id, 'prm' AS scorer, 'synthetic/prm' AS model_id, step_index, "
                       f"'step' AS aggregate, (hash(s, {SEED}, 1) % 1000 / 1000)::DOUBLE AS value FROM {S}"),
            ("scores", f"SELECT {tid} AS trajectory_id, 'outcome' AS scorer, NULL::VARCHAR AS model_id, "
                       f"-1::INTEGER AS step_index, 'outcome' AS aggregate, {ok}::DOUBLE AS value FROM {T}"),
            ("step_labels", f"SELECT {tid} AS trajectory_id, step_index, 'mc_soft' AS source, "
                            f"(hash(s, {SEED}, 2) % {ROLLOUTS + 1} / {ROLLOUTS})::DOUBLE AS value, "
                            f"{ROLLOUTS}::INTEGER AS num_rollouts FROM {S}"),
        ], {"mc_generated_tokens": float(n * STEPS * ROLLOUTS * 50)}),
        "filter": ([
            ("selections", f"SELECT {tid} AS trajectory_id, '{exp}' AS experiment_id, {rnd}::INTEGER AS round, "
                           f"'policy_sft' AS purpose, {ok} AS selected, (t % {SAMPLES})::INTEGER AS rank, "
                           f"CASE WHEN {ok} THEN 'correct' ELSE 'wrong' END AS reason, NULL::VARCHAR AS pair_id "
                           f"FROM {T}"),
        ], {}),
        "train_policy": ([
            ("models", f"SELECT {model} AS model_id, '{exp}' AS experiment_id, 'policy' AS role, "
                       f"{rnd}::INTEGER AS round, 'file:///synthetic/' || {model} AS uri, md5({model}) AS sha256, "
                       f"{parent} AS parent_model_id, "
                       f"(SELECT count(*) FROM {T} WHERE {ok})::INTEGER AS train_examples, "
                       "NULL::VARCHAR AS mlflow_run_id, NULL::VARCHAR AS registered_name, "
                       "NULL::VARCHAR AS registered_version"),
            ("model_inputs", f"SELECT {model} AS model_id, {tid} AS trajectory_id, {rnd}::INTEGER AS source_round, "
                             f"'new' AS use FROM {T} WHERE {ok}"),
        ], {}),
        "evaluate": ([
            ("evaluations", f"SELECT '{exp}' AS experiment_id, {rnd}::INTEGER AS round, {model} AS model_id, "
                            f"level::INTEGER AS level, metric, least(0.3 + 0.04 * {rnd} + 0.01 * level, 1)::DOUBLE "
                            "AS value, 500::INTEGER AS n FROM range(-1, "
                            f"{LEVELS}) r(level), (VALUES ('greedy_acc'), ('maj_at_4')) m(metric) "
                            "WHERE metric = 'greedy_acc' OR level = -1"),
        ], {}),
    }


def write_job(con: duckdb.DuckDBPyConnection, jobs: Path, ref: StageRunRef,
              parts: list[tuple[str, str]], metrics: dict[str, float]) -> Path:
    """A stage job's output as `StageOutputWriter` publishes it (parts, sha256s, manifest); its manifest."""
    out = StageOutputWriter(jobs / ref.experiment / f"r{ref.round}" / ref.stage / f"a{ref.attempt}", ref.stage_run_id)
    for i, (table, sql) in enumerate(parts):
        name = f"part-{table}-{i:05d}.parquet"
        tmp = out.tmp_dir / name
        if "stage_run_id" in PARTS[table].names:  # the attempt's id, as `StageOutputWriter.write_table` adds it
            sql = f"SELECT *, '{ref.stage_run_id}' AS stage_run_id FROM ({sql})"
        rows = con.execute(f"COPY ({sql}) TO '{tmp}' (FORMAT parquet, COMPRESSION zstd)").fetchone()[0]
        got, want = [(f.name, f.type) for f in pq.read_schema(tmp)], [(f.name, f.type) for f in PARTS[table]]
        if got != want:  # a wrong synthetic column must fail here, not look like a slow commit
            raise SystemExit(f"{table}: synthesised {got}, the store expects {want}")
        out.add_part(table, out.final_dir / name, rows, sha256_file(tmp))
    return out.finish(Manifest(ref.experiment, ref.round, ref.stage, ref.attempt, CONFIG_HASH, SEED, None, {},
                               metrics=metrics, timings={"total_s": 0.0}))


def commit(store: Store, ref: StageRunRef, manifest: Path) -> tuple[int, float]:
    """(rows, seconds) of one stage attempt through the store, as the flow commits it."""
    store.start_stage_run(ref, str(manifest.parent), "{}", CONFIG_HASH, SEED)
    t0 = time.perf_counter()
    m = store.commit(ref, manifest)
    return sum(o["rows"] for o in m.outputs), time.perf_counter() - t0


def plain_copy(con: duckdb.DuckDBPyConnection, manifest: Path, dest: Path) -> tuple[float, int]:
    """(seconds, bytes) to rewrite the job's parts as plain Parquet files: the floor any store pays.
    DuckDB's default codec, as a plain COPY has it; the files are removed once measured."""
    t, nbytes = 0.0, 0
    for o in read_manifest(manifest).outputs:
        target = dest / f"{manifest.parent.parent.name}-{Path(o['path']).name}"
        t0 = time.perf_counter()
        con.execute(f"COPY (SELECT * FROM read_parquet('{part_path(manifest.parent, o['path'])}')) TO '{target}' "
                    "(FORMAT parquet)")
        t += time.perf_counter() - t0
        nbytes += target.stat().st_size
        target.unlink()
    return t, nbytes


def timed(store: Store, sql: str, params: list | None = None, reps: int = 3) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        store.query(sql, params)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def reader(store_path: str, stop: Path) -> None:
    """The second process: `v_round_summary` until `stop` appears; prints each query's (start, end) in
    monotonic time (one clock for every process on Linux), so the writer can tell idle queries from busy
    ones, and its peak memory. That is VmHWM: a child's ru_maxrss starts from its parent's."""
    store = Store(store_path)
    store.query(SUMMARY)  # attaching the store, untimed
    spans = []
    while not stop.exists():
        t0 = time.monotonic()
        store.query(SUMMARY)
        spans.append((t0, time.monotonic()))
        if len(spans) == IDLE_SAMPLES:
            print("ready", flush=True)
    hwm = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmHWM"))
    print(json.dumps({"spans": spans, "peak_gib": int(hwm.split()[1]) / (1 << 20)}), flush=True)


def disk(store_path: Path) -> dict[str, int]:
    data = [p for p in (store_path / "data").rglob("*") if p.is_file()]
    return {"data_bytes": sum(p.stat().st_size for p in data), "data_files": len(data),
            "catalog_bytes": sum(p.stat().st_size for p in store_path.glob("catalog.sqlite*"))}


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU")
    return f"{cpu}, {len(os.sched_getaffinity(0))} cores"


def main(args: argparse.Namespace) -> dict:
    workdir = Path(args.workdir).resolve()
    store_path, jobs, plain, stop = workdir / "store", workdir / "jobs", workdir / "plain", workdir / "stop"
    for p in (store_path, jobs, plain):  # only what this script made: a fresh store every run
        shutil.rmtree(p, ignore_errors=True)
    stop.unlink(missing_ok=True)
    plain.mkdir(parents=True)
    n = args.steps // (STEPS * args.rounds * args.experiments)
    if args.busy_rounds < 1:
        raise SystemExit(f"--busy-rounds {args.busy_rounds}: at least 1 round is committed under reads")
    if n < 1:
        raise SystemExit(f"--steps {args.steps} is too few for {args.rounds} rounds of {args.experiments} experiments")
    experiments = [f"e{i}" for i in range(args.experiments)]
    con = duckdb.connect()  # synthesis and the plain-Parquet floor, beside the store's own connections
    limits = con.execute("SELECT current_setting('memory_limit'), current_setting('threads')").fetchone()
    print(f"{machine()}; duckdb {duckdb.__version__}, memory_limit {limits[0]}, threads {limits[1]}")
    print(f"{args.experiments} experiments x {args.rounds} rounds x {n:,} trajectories x {STEPS} steps")

    store = Store(store_path)
    for exp in experiments:
        store.register_experiment(exp, "{}", CONFIG_HASH, SEED, "synthetic", None)
    rows = store_s = plain_s = plain_bytes = 0
    by_round = []  # store rows/s of each experiment's round: a rate that falls with the store's size shows here
    for rnd in range(1, args.rounds + 1):
        for exp in experiments:
            store.set_round_plan(exp, rnd, list(range(LEVELS)), "synthetic")
            r = s = c = 0
            for stage, (parts, metrics) in round_jobs(exp, rnd, n).items():
                ref = StageRunRef(exp, rnd, stage, 1)
                manifest = write_job(con, jobs, ref, parts, metrics)
                k, dt = commit(store, ref, manifest)
                dc, nbytes = plain_copy(con, manifest, plain)
                r, s, c, plain_bytes = r + k, s + dt, c + dc, plain_bytes + nbytes
            rows, store_s, plain_s = rows + r, store_s + s, plain_s + c
            by_round.append(r / s)
            print(f"  {exp} r{rnd}: {r:,} rows, store {s:.2f}s ({r / s:,.0f} rows/s), plain {c:.2f}s")
            shutil.rmtree(jobs)
    plain.rmdir()

    store.query("SELECT count(*) FROM experiments")  # attaching the reader, untimed
    summary_s = timed(store, SUMMARY)
    lineage_s = timed(store, LINEAGE, [experiments[0]])
    lineage = store.query(LINEAGE, [experiments[0]])[1][0]

    # More rounds of e0, made first, then committed while a second process reads.
    pending = []
    for extra in range(args.rounds + 1, args.rounds + 1 + args.busy_rounds):
        store.set_round_plan(experiments[0], extra, list(range(LEVELS)), "synthetic")
        for stage, (parts, metrics) in round_jobs(experiments[0], extra, n).items():
            ref = StageRunRef(experiments[0], extra, stage, 1)
            pending.append((ref, write_job(con, jobs, ref, parts, metrics)))
    proc = subprocess.Popen([sys.executable, __file__, "--reader", str(store_path), "--workdir", str(workdir)],
                            stdout=subprocess.PIPE, text=True)
    if proc.stdout.readline().strip() != "ready":
        raise SystemExit(f"the reader process failed (exit {proc.wait()})")
    try:
        c0 = time.monotonic()
        for ref, manifest in pending:
            commit(store, ref, manifest)
        c1 = time.monotonic()
    finally:
        stop.touch()  # the reader ends with this process, whatever happened
    read = json.loads(proc.communicate(timeout=600)[0].splitlines()[-1])
    spans = read["spans"]
    stop.unlink()
    shutil.rmtree(jobs)
    idle = [b - a for a, b in spans if b <= c0]
    busy = [b - a for a, b in spans if a < c1 and b > c0]  # any overlap with the commit counts as busy

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)  # KiB on Linux
    figures = {
        "machine": machine(), "duckdb": duckdb.__version__, "duckdb_memory_limit": limits[0],
        "steps": args.steps, "experiments": args.experiments, "rounds": args.rounds, "trajectories_per_round": n,
        "ingest_rows": rows, "ingest_store_s": store_s, "ingest_plain_s": plain_s,
        "ingest_store_rows_per_s": rows / store_s, "ingest_plain_rows_per_s": rows / plain_s,
        "ingest_ratio": plain_s / store_s, "plain_bytes": plain_bytes, "store_rows_per_s_by_round": by_round,
        "round_summary_s": summary_s, "lineage_s": lineage_s, "lineage_rows": lineage[0],
        "lineage_trajectories": lineage[1], "peak_rss_gib": peak,
        "reader_peak_rss_gib": read["peak_gib"],
        "busy_rounds": args.busy_rounds, "busy_commit_s": (c1 - c0) / args.busy_rounds,
        "idle_query_s": statistics.median(idle) if idle else None,
        "busy_query_s": statistics.median(busy) if busy else None, "idle_samples": len(idle),
        "busy_samples": len(busy), "busy_queries_s": busy, "idle_queries_s": idle, **disk(store_path),
    }
    figures["busy_ratio"] = (figures["busy_query_s"] / figures["idle_query_s"]) if busy and idle else None
    (workdir / "store_scale.json").write_text(json.dumps(figures, indent=2) + "\n")
    return figures


def size(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / (1 << 20):.1f} MiB"


def report(f: dict) -> None:
    def verdict(ok: bool | None) -> str:
        return "-" if ok is None else ("pass" if ok else "MISS")

    ratio = f["busy_ratio"]
    lines = [
        ("ingest, store / plain Parquet", f"{f['ingest_ratio']:.2f} ({f['ingest_store_rows_per_s']:,.0f} / "
         f"{f['ingest_plain_rows_per_s']:,.0f} rows/s)", ">= 0.5", f["ingest_ratio"] >= 0.5),
        ("v_round_summary, all rounds", f"{f['round_summary_s']:.3f} s", "< 2 s", f["round_summary_s"] < 2),
        ("v_lineage, one experiment", f"{f['lineage_s']:.3f} s ({f['lineage_rows']:,} rows)", "", None),
        ("peak memory", f"{f['peak_rss_gib']:.2f} GiB (reader {f['reader_peak_rss_gib']:.2f})", "< 4 GiB",
         f["peak_rss_gib"] < 4),
        ("v_round_summary busy / idle", "n/a" if ratio is None else
         f"{ratio:.2f} ({f['busy_query_s']:.3f} / {f['idle_query_s']:.3f} s, "
         f"n={f['busy_samples']}/{f['idle_samples']})",
         "< 2x", None if ratio is None else ratio < 2),
        ("one round's commits, under reads", f"{f['busy_commit_s']:.2f} s", "", None),
        ("store on disk", f"{size(f['data_bytes'])} data, {size(f['catalog_bytes'])} catalog "
         f"(plain Parquet {size(f['plain_bytes'])})", "", None),
        ("data files", f"{f['data_files']:,}", "", None),
    ]
    print(f"\n{f['steps']:,} steps, {f['ingest_rows']:,} rows ingested; {f['machine']}")
    for name, value, goal, ok in lines:
        print(f"{name:<34}{value:<58}{goal:<9}{verdict(ok)}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10_000_000, help="steps in all, over every experiment and round")
    ap.add_argument("--workdir", default="/tmp/store-scale", help="the store, job outputs and store_scale.json")
    ap.add_argument("--rounds", type=int, default=10,
                    help="rounds per experiment (then --busy-rounds more of e0 are committed under a reader)")
    ap.add_argument("--busy-rounds", type=int, default=3, help="rounds of e0 committed while the reader queries")
    ap.add_argument("--experiments", type=int, default=2, help="experiments in the store")
    ap.add_argument("--reader", help=argparse.SUPPRESS)  # the second process's store
    a = ap.parse_args()
    if a.reader:
        reader(a.reader, Path(a.workdir).resolve() / "stop")
    else:
        report(main(a))
