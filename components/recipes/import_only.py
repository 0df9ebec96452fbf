"""`import`: an experiment that holds existing trajectories, loaded by `coevo import` (the `import` stage),
re-verified and with their lineage; no policy is sampled or trained.

    coevo import trajectories.jsonl --config configs/gsm8k.yaml --experiment my-solutions
"""

from __future__ import annotations

from components.recipes import Recipe


def check(cfg) -> None:
    if not cfg.imports:
        raise ValueError("recipe 'import' needs files to import: give them to `coevo import`, or set `imports`")
    if cfg.rounds != 0:
        raise ValueError("recipe 'import' has round 0 only: set rounds=0")


RECIPE = Recipe(name="import", stages=(), bootstrap=("import",), check=check,
                description="existing trajectories, re-verified, with their lineage (coevo import)")
