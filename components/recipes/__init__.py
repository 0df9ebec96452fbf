"""Recipes: which stages a round runs, in order, and the settings each recipe refuses.

    from components.recipes import get_recipe
    get_recipe("coevo").round_stages(1)   # ['generate', 'verify', 'score', 'train_reward', 'filter', ...]

A recipe is one small module that defines `RECIPE` (`rft.py`, `coevo.py`); `recipe:` in the config
names a built-in one or a user's by dotted path (`my_pkg.recipes:RECIPE`). The strategies a recipe's
stages use are typed config fields (the labeller `score.mc_strategy`, the ranker `filter.rank_by`, the
trainer `train_policy.method`, the reward model `score.reward_model`); a recipe's `check` refuses the
ones that contradict it, when the config loads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import reduce
from typing import Any

from components.instantiate import locate

RECIPES: dict[str, str] = {
    "rft": "components.recipes.rft:RECIPE",
    "coevo": "components.recipes.coevo:RECIPE",
    "grpo": "components.recipes.grpo:RECIPE",
    "import": "components.recipes.import_only:RECIPE",
}


def _accept(cfg: Any) -> None:  # noqa: ARG001
    return None


def _reads_all(cfg: Any) -> list[str]:  # noqa: ARG001
    return []


def grpo_settings(cfg: Any) -> list[str]:
    """`Recipe.unused` of a recipe without a policy gradient (rft, coevo): recipe grpo's settings where `cfg` moves
    them from their defaults.

    >>> from types import SimpleNamespace
    >>> from components.config import FilterConfig, GRPOSection
    >>> cfg = SimpleNamespace(train_policy=SimpleNamespace(grpo=GRPOSection(num_iterations=8)),
    ...                       filter=FilterConfig(max_groups=16))
    >>> grpo_settings(cfg)
    ['train_policy.grpo.num_iterations=8 (recipe grpo reads it)', 'filter.max_groups=16 (recipe grpo reads it)']
    """
    keys = [f"train_policy.grpo.{k}" for k in type(cfg.train_policy.grpo).model_fields] + ["filter.max_groups"]
    return [f"{k}={v!r} (recipe grpo reads it)" for k, v in moved_settings(cfg, keys)]


def moved_settings(cfg: Any, keys: list[str]) -> list[tuple[str, Any]]:
    """(key, value) for each dotted setting of `keys` that `cfg` moves from its field's default, in `keys`' order."""
    out = []
    for key in keys:
        *path, name = key.split(".")
        section = reduce(getattr, path, cfg)
        value = getattr(section, name)
        if value != type(section).model_fields[name].get_default(call_default_factory=True):
            out.append((key, value))
    return out


@dataclass(frozen=True)
class Recipe:
    name: str
    stages: tuple[str, ...]  # one round's stages (rounds 1+), in order
    description: str = ""
    bootstrap: tuple[str, ...] = ("bootstrap", "evaluate")  # round 0
    # Given the ExperimentConfig as it loads (the config calls it: no import back), raises ValueError
    # saying what to set where the config contradicts the recipe.
    check: Callable[[Any], None] = _accept
    # Stages a round runs only where the config says so (grpo's train_reward: with train_reward.enabled).
    when: Mapping[str, Callable[[Any], bool]] = field(default_factory=dict)
    # Given the ExperimentConfig, the settings it moves from their defaults that this recipe never reads ("KEY=VALUE
    # (what it reads instead)"): the flow logs them as a warning. A config switched from another recipe by an
    # override keeps that recipe's settings, so they are named, not refused.
    unused: Callable[[Any], list[str]] = _reads_all

    def round_stages(self, round: int, cfg: Any = None) -> list[str]:
        """The stages of `round`, in order. With the config given: the stages `when` leaves out are left out, and
        an experiment with `imports` runs the `import` stage in round 0 too, after the bootstrap, so its
        trajectories join round 0's data. Without it, every stage the recipe can run."""
        stages = list(self.bootstrap if round == 0 else self.stages)
        if cfg is not None:
            stages = [s for s in stages if s not in self.when or self.when[s](cfg)]
        if round == 0 and cfg is not None and cfg.imports and "import" not in stages:
            stages.insert(stages.index("bootstrap") + 1 if "bootstrap" in stages else 0, "import")
        return stages


def get_recipe(name: str) -> Recipe:
    """A built-in recipe by name, or a user's by dotted path 'pkg.module:RECIPE'."""
    if name in RECIPES:
        return locate(RECIPES[name])
    if ":" not in name:
        raise ValueError(f"unknown recipe {name!r}: known recipes are {sorted(RECIPES)}, or give a dotted path "
                         "'pkg.module:RECIPE'")
    recipe = locate(name)
    if not isinstance(recipe, Recipe):
        raise ValueError(f"{name!r} is a {type(recipe).__name__}, not a components.recipes.Recipe")
    return recipe


__all__ = ["RECIPES", "Recipe", "get_recipe", "grpo_settings", "moved_settings"]
