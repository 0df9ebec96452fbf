"""Every notebook in notebooks/ executes top to bottom against a micro run and draws its figures.

    pytest tests/ops/test_notebooks.py -q
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
MIN_FIGURES = {"01_compare_rounds": 4, "02_trajectory_sql": 4, "03_reward_model_calibration": 1}


def test_the_three_notebooks_are_there():
    assert [p.stem for p in NOTEBOOKS] == sorted(MIN_FIGURES)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_and_draws(path: Path, micro_workdir, monkeypatch, tmp_path):
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("COEVO_WORKDIR", str(micro_workdir.path))
    monkeypatch.setenv("COEVO_EXPERIMENT", "micro")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    nb = nbformat.read(path, as_version=4)
    # "python3" resolves to this interpreter's ipykernel (jupyter_client swaps `python` for sys.executable).
    NotebookClient(nb, kernel_name="python3", timeout=300, resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    figures = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
               if "image/png" in o.get("data", {})]
    assert len(figures) >= MIN_FIGURES[path.stem], f"{path.name}: {len(figures)} figures"
    nbformat.write(nb, tmp_path / path.name)  # the executed copy, for a look when a figure is wrong
