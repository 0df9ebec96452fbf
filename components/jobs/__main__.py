"""Run one stage as its own process.

    python -m components.jobs generate --spec workdir/exp/r1/generate/a1.spec.json

Exit codes: 0 success (manifest published), 2 bad spec or input, 75 a transient engine or server fault
(a timeout, a server gone away: the flow retries it), 1 any other failure. A job that
dies at any point leaves only an `a<k>.tmp/` folder, which nothing reads.

Under `accelerate launch` (a training stage with `processes` > 1, see `launch.job_command`) every process
runs the stage and trains, and only the first (RANK 0) writes the attempt: its tables, model and manifest.
The others write into a scratch folder of their own, removed at the end (and with the job's temporary folder by
`run_job`, where they were killed), and print nothing to stdout.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

from components import storage
from components.jobs.launch import EXIT_TRANSIENT
from components.jobs.spec import SpecError, StageSpec
from components.manifest import Manifest, ManifestError, StageOutputWriter
from components.models.backends import BackendError
from components.storage import StorageError
from components.seeding import seed_everything


def _die_with_launcher() -> None:
    """Under `accelerate launch` torchrun starts each process in a session of its own, so the SIGKILL that ends a
    job past its timeout (`run_job`) reaches the launcher alone: have the kernel kill this process too when the
    launcher dies (Linux's PR_SET_PDEATHSIG), as a lone job dies."""
    if "LOCAL_RANK" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    launcher = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1: PR_SET_PDEATHSIG
    if os.getppid() != launcher or launcher == 1:  # it died before the call (orphans go to init)
        os._exit(1)


def main(argv: list[str] | None = None) -> int:
    from components.stages import STAGES

    ap = argparse.ArgumentParser(prog="python -m components.jobs", description=__doc__.splitlines()[0])
    ap.add_argument("stage", choices=sorted(STAGES))
    ap.add_argument("--spec", required=True, help="path to the stage spec JSON")
    args = ap.parse_args(argv)
    _die_with_launcher()
    try:
        spec = StageSpec.from_file(args.spec)
        if spec.stage != args.stage:
            raise SpecError(f"{args.spec}: spec is for stage {spec.stage!r}, not {args.stage!r}")
        spec.cfg()  # validate before any work
    except (SpecError, ValueError, StorageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # Single-threaded intra-op keeps CPU results bit-identical across runs and machines' load.
    threads = int(os.environ.get("COEVO_TORCH_THREADS", "0"))
    if threads:
        import torch

        torch.set_num_threads(threads)
    if STAGES[spec.stage].gpu:  # a model stage: its libraries load here, so `startup_s` counts them, not the body
        import torch  # noqa: F401
        import transformers  # noqa: F401
    seed_everything(spec.seed)
    # From `run_job`'s launch to here: the interpreter, the imports, the spec (benchmarks/scale.py).
    launched = float(os.environ.get("COEVO_JOB_LAUNCHED_AT", "nan"))
    startup = {"startup_s": round(time.time() - launched, 3)} if launched == launched else {}
    rank = int(os.environ.get("RANK", "0"))  # torchrun's (accelerate launch); a lone job is rank 0
    scratch = None
    if rank != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - the first process reports; errors still reach stderr
        scratch = Path(tempfile.mkdtemp(prefix=f"coevo-rank{rank}-"))
    t0 = time.perf_counter()
    try:
        # Never `out_dir` nor its `.tmp` but in the first process: the others' writes go to their scratch.
        out = StageOutputWriter(storage.writable_mirror(spec.out_dir) if scratch is None else scratch / "out",
                                spec.stage_run_id)
        metrics = STAGES[spec.stage].run(spec, out)
        total = time.perf_counter() - t0
        if scratch is not None:
            return 0
        manifest = Manifest(
            experiment=spec.experiment, round=spec.round, stage=spec.stage, attempt=spec.attempt,
            config_hash=spec.config_hash, seed=spec.seed, code_version=spec.code_version,
            inputs={i.stage_run_id: i.manifest_sha256 for i in spec.inputs} | {"params": spec.params}
            | ({"shard": spec.shard, "shards": spec.shards} if spec.shards > 1 else {}),
            metrics={k: float(v) for k, v in metrics.items()}, timings={"total_s": round(total, 3), **startup},
        )
        path = out.finish(manifest)
        storage.push(path.parent, spec.out_dir)  # shared storage: the parts, then the manifest
    except (SpecError, ManifestError, FileNotFoundError) as e:
        print(f"error: {spec.stage_run_id}: {e}", file=sys.stderr)
        return 2
    except StorageError as e:  # refused credentials fail the stage; unreachable storage is retried
        print(f"error: {spec.stage_run_id}: {e}", file=sys.stderr)
        return EXIT_TRANSIENT if e.transient else 2
    except BackendError as e:  # the engine or server, named; a transient fault is retried (EXIT_TRANSIENT)
        print(f"error: {spec.stage_run_id}: {e}", file=sys.stderr)
        return EXIT_TRANSIENT if e.transient else 1
    except Exception:
        traceback.print_exc()
        print(f"error: {spec.stage_run_id} failed" + (f" (rank {rank})" if rank else ""), file=sys.stderr)
        return 1
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    print(f"[{spec.stage}] wrote {storage.join(spec.out_dir, path.name)} in {total:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
