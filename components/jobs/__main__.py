"""Run one stage as its own process.

    python -m components.jobs generate --spec workdir/exp/r1/generate/a1.spec.json

Exit codes: 0 success (manifest published), 2 bad spec or input, 75 a transient engine or server fault
(a timeout, a server gone away: the flow retries it), 1 any other failure. A job that
dies at any point leaves only an `a<k>.tmp/` folder, which nothing reads.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

from components.jobs.launch import EXIT_TRANSIENT
from components.jobs.spec import SpecError, StageSpec
from components.manifest import Manifest, ManifestError, StageOutputWriter
from components.models.backends import BackendError
from components.seeding import seed_everything


def main(argv: list[str] | None = None) -> int:
    from components.stages import STAGES

    ap = argparse.ArgumentParser(prog="python -m components.jobs", description=__doc__.splitlines()[0])
    ap.add_argument("stage", choices=sorted(STAGES))
    ap.add_argument("--spec", required=True, help="path to the stage spec JSON")
    args = ap.parse_args(argv)
    try:
        spec = StageSpec.from_file(args.spec)
        if spec.stage != args.stage:
            raise SpecError(f"{args.spec}: spec is for stage {spec.stage!r}, not {args.stage!r}")
        spec.cfg()  # validate before any work
    except (SpecError, ValueError) as e:
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
    t0 = time.perf_counter()
    try:
        out = StageOutputWriter(Path(spec.out_dir))
        metrics = STAGES[spec.stage].run(spec, out)
        total = time.perf_counter() - t0
        manifest = Manifest(
            experiment=spec.experiment, round=spec.round, stage=spec.stage, attempt=spec.attempt,
            config_hash=spec.config_hash, seed=spec.seed, code_version=spec.code_version,
            inputs={i.stage_run_id: i.manifest_sha256 for i in spec.inputs} | {"params": spec.params}
            | ({"shard": spec.shard, "shards": spec.shards} if spec.shards > 1 else {}),
            metrics={k: float(v) for k, v in metrics.items()}, timings={"total_s": round(total, 3), **startup},
        )
        path = out.finish(manifest)
    except (SpecError, ManifestError, FileNotFoundError) as e:
        print(f"error: {spec.stage_run_id}: {e}", file=sys.stderr)
        return 2
    except BackendError as e:  # the engine or server, named; a transient fault is retried (EXIT_TRANSIENT)
        print(f"error: {spec.stage_run_id}: {e}", file=sys.stderr)
        return EXIT_TRANSIENT if e.transient else 1
    except Exception:
        traceback.print_exc()
        print(f"error: {spec.stage_run_id} failed", file=sys.stderr)
        return 1
    print(f"[{spec.stage}] wrote {path} in {total:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
