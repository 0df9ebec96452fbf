"""`import` (round 0): a user's existing trajectories into the store, each re-verified by the domain, with
its source file, row and model in `trajectory_sources` and the agreement between its given label and the
verifier in the stage's metrics. It runs as recipe `import` (`coevo import`: an experiment that only holds
them), or in round 0 of any experiment whose config lists `imports`: there the verified-correct ones join
the policy's SFT replay pool, given step labels train the PRM, and the verdicts train the ORM.

    coevo import ../shared/data/gsm8k/example_model_solutions.jsonl --config configs/gsm8k.yaml \\
        --experiment gsm8k-solutions --models 6b_finetuning,175b_verification --purpose eval
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from components.jobs.spec import StageSpec
from components.manifest import StageOutputWriter
from components.stages.base import Planner, PlanningError, Stage, domain_of, log, write


@dataclass
class Inputs:
    files: list[dict]  # one `ImportConfig` each, its path made absolute


def plan(p: Planner) -> Inputs:
    if not p.cfg.imports:
        raise PlanningError(f"{p.cfg.experiment}: recipe 'import' has nothing to import: `imports` is empty")
    files = []
    for imp in p.cfg.imports:
        path = Path(imp.path).expanduser().resolve()
        if not path.is_file():
            raise PlanningError(f"imports: {imp.path}: no such file")
        files.append(imp.model_dump() | {"path": str(path)})
    return Inputs(files=files)


def run(spec: StageSpec, out: StageOutputWriter) -> dict[str, float]:
    from components.importing import ImportSpec, match_and_verify, read_trajectories

    inp, domain = spec.inputs_as(Inputs), domain_of(spec)
    trajs = []
    for f in inp.files:
        fields = {k: v for k, v in f.items() if k not in ("path", "purpose")}
        got = read_trajectories(f["path"], ImportSpec(**fields))
        log("import", f"{f['path']}: {len(got)} trajectories")
        trajs += [(t, f["purpose"]) for t in got]
    purposes = {purpose for _, purpose in trajs}
    if len(purposes) > 1:
        raise ValueError("imports: every file of one import must have the same purpose (train or eval)")
    purpose = purposes.pop()
    result = match_and_verify([t for t, _ in trajs], domain, spec.experiment, spec.round, purpose=purpose,
                              verifier_version=spec.code_version or "dev")
    held_out = result.by_split.get("test", 0)
    if purpose == "train" and held_out:
        raise ValueError(f"imports: {held_out} of {result.overall.imported} trajectories are on the domain's held-out "
                         "(test) problems; training on them would leak the evaluation: import them with purpose: eval")
    right = {v["trajectory_id"] for v in result.verifications if v["correct"]}
    # For training (purpose train): the verified-correct ones join round 0's SFT data, as demos do.
    selections = [] if purpose != "train" else [
        {"trajectory_id": t["trajectory_id"], "experiment_id": spec.experiment, "round": spec.round,
         "purpose": "policy_sft", "selected": t["trajectory_id"] in right, "rank": None, "pair_id": None,
         "reason": "imported, verified correct" if t["trajectory_id"] in right else "imported, not verified correct"}
        for t in result.trajectories]
    write(out, **result.tables(), trajectory_sources=result.lineage, selections=selections)
    for line in result.summary().splitlines():
        log("import", line)
    return {k: float(v) for k, v in result.metrics().items()}


STAGE = Stage(name="import", section="imports", gpu=False, reads=(),
              writes=("problems", "trajectories", "steps", "verifications", "step_labels", "trajectory_sources",
                      "selections"),
              inputs=Inputs, plan=plan, run=run)
