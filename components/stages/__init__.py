"""The stages of a round, in one registry: every module of this package that defines `STAGE` is one.

    from components.stages import STAGES, build_spec
    STAGES["score"].gpu, STAGES["score"].reads, STAGES["score"].writes   # True, ('generate', 'verify'), (...)
    spec = build_spec(cfg, store, round=1, stage="score", attempt=1, code_version=None)

A `Stage` (`base.py`) gives its name, config section, GPU flag, the stages it reads, the tables it
writes, its typed inputs, how it plans them against the store (in the flow's process) and its job body
(in its own process: `python -m components.jobs <stage> --spec spec.json`). Which stages a round runs,
and in what order, is the recipe's (`components/recipes/`). A new stage is a new module here.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import asdict
from pathlib import Path

from components.config import ExperimentConfig
from components.jobs.spec import StageSpec
from components.seeding import derive_seed
from components.stages.base import Planner, PlanningError, Stage
from components.storage import join
from components.store import Store


def _discover() -> dict[str, Stage]:
    found: dict[str, Stage] = {}
    for m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        stage = getattr(importlib.import_module(f"{__name__}.{m.name}"), "STAGE", None)
        if isinstance(stage, Stage):
            found[stage.name] = stage
    return found


STAGES: dict[str, Stage] = _discover()


def get_stage(name: str) -> Stage:
    if name not in STAGES:
        raise ValueError(f"unknown stage {name!r}: the stages are {sorted(STAGES)}")
    return STAGES[name]


def build_spec(cfg: ExperimentConfig, store: Store, round: int, stage: str, attempt: int,
               code_version: str | None, out_dir: str | Path | None = None) -> StageSpec:
    """The job spec of one attempt: the stage's typed inputs and every committed output it may read,
    resolved against the store now (jobs never open it)."""
    from components.recipes import get_recipe

    st = get_stage(stage)
    planner = Planner(cfg, store, round, get_recipe(cfg.recipe).round_stages(round, cfg))
    inputs = st.plan(planner)
    return StageSpec(
        experiment=cfg.experiment, round=round, stage=stage, attempt=attempt,
        out_dir=str(out_dir or join(cfg.storage_dir, f"r{round}", stage, f"a{attempt}")),
        seed=derive_seed(cfg.seed, round, st.seed_name or stage), config=cfg.to_dict(), config_hash=cfg.config_hash(),
        code_version=code_version, inputs=planner.refs, params=asdict(inputs),
    )


__all__ = ["STAGES", "Planner", "PlanningError", "Stage", "build_spec", "get_stage"]
