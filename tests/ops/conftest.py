"""The operator tests read the session's `micro_workdir` (tests/conftest.py): `micro` as shipped and
`micro-b`, another seed, so `coevo compare` has two real experiments to put side by side."""

from __future__ import annotations

import subprocess

from tests.conftest import run_coevo


def coevo(*args: str, env: dict[str, str] | None = None, check: bool = True,
          timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the `coevo` CLI with the operator commands, in a subprocess, as a user would."""
    return run_coevo(*args, env={"COLUMNS": "200", **(env or {})}, check=check, timeout=timeout)
