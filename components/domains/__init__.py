"""Domains: problems, prompt format, step segmentation, answer extraction, verifier, oracle labels.

    >>> get_domain("arith", max_level=2).levels()
    [1, 2]
"""

from __future__ import annotations

from typing import Any

from components.domains.base import Domain, Problem, problem_id
from components.instantiate import locate

# Dotted paths, imported on demand: building `arith` should not pay for importing `datasets`.
DOMAINS: dict[str, str] = {
    "arith": "components.domains.arith:ArithDomain",
    "gsm8k": "components.domains.gsm8k:Gsm8kDomain",
    "jsonl": "components.domains.jsonl:JsonlDomain",
}


def get_domain(name: str, **options: Any) -> Domain:
    """Build a registered domain by name, a built-in environment (`components.envs.ENVS`: calculator, sql,
    code), or a user domain or environment by dotted path 'pkg.module:Class'."""
    from components.envs import ENVS  # envs build on domains: imported here, not at the top

    if name in DOMAINS:
        return locate(DOMAINS[name])(**options)
    if name in ENVS:
        return locate(ENVS[name])(**options)
    if ":" in name:
        return locate(name)(**options)
    raise ValueError(f"unknown domain {name!r}: known domains are {sorted(DOMAINS)}, the environments {sorted(ENVS)}, "
                     "or give a dotted path 'pkg.module:Class'")


__all__ = ["DOMAINS", "Domain", "Problem", "get_domain", "problem_id"]
