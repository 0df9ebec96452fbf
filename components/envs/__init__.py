"""Environments: problems an agent solves by acting over several turns (`base.py` has the protocol).

    >>> sorted(ENVS)
    ['calculator', 'code', 'sql']
    >>> get_env("arith", max_level=2).levels()   # a single-turn domain, as a one-turn environment
    [1, 2]
    >>> get_env("calculator").tools[0].name
    'calculate'
"""

from __future__ import annotations

from typing import Any

from components.domains import DOMAINS, get_domain
from components.envs.base import Action, Environment, EpisodeLimits, EpisodeRecord, EpisodeRunner, StepResult, Tool
from components.instantiate import locate

# Dotted paths, imported on demand.
ENVS: dict[str, str] = {
    "calculator": "components.envs.calculator:CalculatorEnv",
    "code": "components.envs.code:CodeEnv",
    "sql": "components.envs.sql:SqlEnv",
}


def get_env(name: str, **options: Any) -> Environment:
    """A built-in environment, a registered domain as a one-turn environment, or 'pkg.module:Class'."""
    if name in ENVS:
        return locate(ENVS[name])(**options)
    if name in DOMAINS:
        from components.envs.adapters import DomainEnv

        return DomainEnv(get_domain(name, **options))
    if ":" in name:
        return locate(name)(**options)
    raise ValueError(f"unknown environment {name!r}: known are {sorted(ENVS)} and the domains {sorted(DOMAINS)}, "
                     "or give a dotted path 'pkg.module:Class'")


__all__ = ["ENVS", "Action", "Environment", "EpisodeLimits", "EpisodeRecord", "EpisodeRunner", "StepResult", "Tool",
           "get_env"]
