"""The operator tests read the session's `micro_workdir` (tests/conftest.py): `micro` as shipped and
`micro-b`, another seed, so `coevo compare` has two real experiments to put side by side."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MICRO = REPO / "configs" / "micro.yaml"


def coevo(*args: str, env: dict[str, str] | None = None, check: bool = True,
          timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the `coevo` CLI with the operator commands, in a subprocess, as a user would."""
    full_env = {**os.environ, "COLUMNS": "200", **(env or {})}
    p = subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=REPO, env=full_env,
                       capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"coevo {' '.join(args)} exited {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}")
    return p
