"""The sandbox that runs model-written code: what each attack ends as, and how many executions a second it takes.

    .venv/bin/python benchmarks/sandbox.py --runs 400 --workers 2

1. The attack table: each program of `components.envs.attacks` once, under the code environment's limits
   (`CodeEnv.sandbox_limits`, wall 5 s and CPU 2 s): how it ended (`reason`), its wall time, and what the
   host saw afterwards (a file written outside, a process left behind, a secret read).
2. Throughput: `--runs` executions of the code environment's test harness on a right solution (a real
   `run_tests` call: the solution, its tests, one JSON line back), from `--workers` threads: executions per
   second, and the p50 and p99 latency of one execution. Goal: >= 50/s on 2 cores, p50 <= 50 ms.
3. The same execution from a caller holding `--parent-gb` GiB of written memory, as a stage holding a model
   does: its p50 latency, one at a time, against the bare caller's. Starting a process must not copy the
   caller's page tables (a `preexec_fn` makes Python fork; without one it vforks).

Figures go to stdout and to `--out` (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from components.envs import attacks  # noqa: E402
from components.envs.code import CodeEnv  # noqa: E402
from components.envs.sandbox import Sandbox  # noqa: E402


def leftovers() -> list[str]:
    found = []
    for p in Path("/proc").iterdir():
        try:
            if f"sleep {attacks.MARKER}" in (p / "cmdline").read_bytes().replace(b"\0", b" ").decode():
                found.append(p.name)
        except OSError:
            pass
    return found


def attack_table(sandbox: Sandbox) -> list[dict]:
    os.environ[attacks.ENV_SECRET] = "canary-env"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        secret = Path(tmp, "secret.txt")
        secret.write_text("canary-file")
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        for name, program in attacks.ATTACKS.items():
            r = sandbox.run_python(attacks.render(program, str(secret), str(Path.home()), srv.getsockname()[1]))
            host = []
            if Path("/usr/coevo-escape").exists() or Path("/coevo-escape").exists():
                host.append("FILE WRITTEN")
            if leftovers():
                host.append("PROCESS LEFT")
            if "canary" in r.stdout + r.stderr:
                host.append("SECRET READ")
            if "WROTE" in r.stdout or "CONNECTED" in r.stdout:
                host.append("ESCAPED")
            rows.append({"attack": name, "ok": r.ok, "reason": r.reason, "wall_s": r.wall_s,
                         "stdout_bytes": len(r.stdout), "host": ", ".join(host) or "unchanged"})
        srv.close()
    healthy = sandbox.run_python("print('alive')")
    rows.append({"attack": "(a plain run afterwards)", "ok": healthy.ok, "reason": healthy.reason,
                 "wall_s": healthy.wall_s, "stdout_bytes": len(healthy.stdout), "host": "unchanged"})
    return rows


def one_run(env: CodeEnv, problem) -> tuple[float, bool]:
    """One `run_tests` call on the problem's right solution: its seconds, and whether every test passed."""
    t0 = time.perf_counter()
    passed, _ = env.run_tests(problem, problem.meta["solution"])
    return time.perf_counter() - t0, passed == len(problem.meta["tests"])


def throughput(env: CodeEnv, problem, runs: int, workers: int) -> dict:
    one_run(env, problem)  # warm the page cache
    t0 = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        got = list(pool.map(lambda _: one_run(env, problem), range(runs)))
    wall = time.perf_counter() - t0
    lat = sorted(t for t, _ in got)
    return {"runs": runs, "workers": workers, "ok": sum(ok for _, ok in got), "per_s": runs / wall,
            "p50_ms": 1000 * statistics.median(lat), "p99_ms": 1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))]}


def heavy_caller(env: CodeEnv, problem, runs: int, gb: float) -> dict:
    def p50() -> float:
        return 1000 * statistics.median(one_run(env, problem)[0] for _ in range(runs))

    bare = p50()
    ballast = bytearray(b"\x01") * int(gb * (1 << 30))  # written, so every page is the caller's own
    heavy = p50()
    del ballast
    return {"runs": runs, "parent_gb": gb, "bare_p50_ms": bare, "heavy_p50_ms": heavy}


def main(a: argparse.Namespace) -> dict:
    env = CodeEnv()
    table = attack_table(env.sandbox)
    print(f"{'attack':<48}{'reason':<14}{'wall':>7}  host")
    for r in table:
        print(f"{r['attack']:<48}{str(r['reason'] or 'ok'):<14}{r['wall_s']:>6.2f}s  {r['host']}")
    problem = env.sample_problems(2, 1, seed=0)[0]
    t = throughput(env, problem, a.runs, a.workers)
    cores = len(os.sched_getaffinity(0))
    print(f"\n{t['runs']} sandboxed test runs from {t['workers']} threads on {cores} cores: {t['per_s']:.1f}/s "
          f"(goal >= 50), p50 {t['p50_ms']:.1f} ms (goal <= 50), p99 {t['p99_ms']:.1f} ms; {t['ok']} passed")
    h = heavy_caller(env, problem, max(1, a.runs // 4), a.parent_gb)
    print(f"one at a time, {h['runs']} runs: p50 {h['bare_p50_ms']:.1f} ms from a bare caller, "
          f"{h['heavy_p50_ms']:.1f} ms from one holding {h['parent_gb']:g} GiB")
    figures = {"attacks": table, "throughput": t, "heavy_caller": h, "cores": cores}
    Path(a.out).write_text(json.dumps(figures, indent=2) + "\n")
    return figures


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=400)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--parent-gb", type=float, default=2.0, help="memory the caller holds in part 3")
    ap.add_argument("--out", default="/tmp/sandbox-bench.json")
    main(ap.parse_args())
