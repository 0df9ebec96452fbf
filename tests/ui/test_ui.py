"""The operator's day in a real browser: start servers, serve the deployments, press "Run" through the
API, watch the result in the Prefect UI and the MLflow UI.

    pytest tests/ui -q        # screenshots land in the test's tmp dir and /tmp/coevo-screens/
"""

from __future__ import annotations

import json
import shutil
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import REPO

from .conftest import SCREENS, coevo, wait_for

pytestmark = pytest.mark.slow

EXPERIMENT = "ui-micro"
# The micro config, one round and shorter training: round 1 still generates, filters, trains and
# evaluates, which is all the pages need to show.
OVERRIDES = [f"experiment={EXPERIMENT}", "rounds=1", "bootstrap.steps=60", "train_policy.steps=20",
             "generate.problems_per_level=20", "evaluate.problems_per_level=20"]


def _screenshot(driver, tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.png"
    driver.save_screenshot(str(path))
    SCREENS.mkdir(parents=True, exist_ok=True)
    shutil.copy(path, SCREENS / path.name)
    return path


def _wait_text(driver, texts: list[str], timeout: float = 60) -> str:
    """Wait until every text is visible in the rendered page (single-page apps render late)."""
    def seen():
        body = driver.find_element("tag name", "body").text
        return body if all(t in body for t in texts) else None

    try:
        return wait_for(seen, timeout, f"{texts} on {driver.current_url}", interval=0.5)
    except AssertionError as e:
        SCREENS.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(SCREENS / "failed-page.png"))
        raise AssertionError(f"{e}\npage text:\n{driver.find_element('tag name', 'body').text[:3000]}") from None


def _post(url: str, body: dict) -> list[dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def test_run_from_the_deployment_and_see_it_in_both_uis(servers, served, browser, tmp_path):
    from mlflow.tracking import MlflowClient
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    name = "self_evolution/self-evolution"
    with temporary_settings(updates={PREFECT_API_URL: servers.prefect_api}):
        def deployed():
            with get_client(sync_client=True) as c:
                return c.read_deployment_by_name(name)

        wait_for(deployed, 120, f"`coevo serve` to register {name}", interval=2)
        # What the UI's "Run" button does: create a flow run of the deployment; the served runner picks it up.
        run = run_deployment(name, parameters={"config_path": str(REPO / "configs" / "micro.yaml"),
                                               "overrides": [f"workdir={servers.workdir}", *OVERRIDES]},
                             timeout=1500, poll_interval=3, as_subflow=False)
    log = (tmp_path / "serve.log").read_text()
    assert run.state is not None and run.state.is_completed(), f"flow run ended {run.state}\n{log[-4000:]}"

    # Each round published its table artifact.
    keys = [f"{EXPERIMENT}-round-{r}" for r in (0, 1)]
    arts = _post(f"{servers.prefect_api}/artifacts/filter", {"artifacts": {"key": {"any_": keys}}})
    assert {a["key"] for a in arts} == set(keys), arts
    rows = json.loads(arts[0]["data"]) if isinstance(arts[0]["data"], str) else arts[0]["data"]
    assert any(r["metric"] == "greedy_acc" for r in rows)

    # Prefect UI: the flow run page shows the run by name, completed.
    browser.get(f"{servers.prefect_url}/runs/flow-run/{run.id}")
    _wait_text(browser, [run.name, "Completed"])
    _screenshot(browser, tmp_path, "prefect-flow-run")
    art = next(a for a in arts if a["key"] == keys[1])
    browser.get(f"{servers.prefect_url}/artifacts/artifact/{art['id']}")
    _wait_text(browser, [keys[1], "greedy_acc", "timing/evaluate"])
    _screenshot(browser, tmp_path, "prefect-round-artifact")

    # MLflow UI: the experiment lists the experiment's parent run; a round run shows the round metric.
    client = MlflowClient(servers.mlflow_url)
    exp = client.get_experiment_by_name(EXPERIMENT)
    assert exp is not None
    round1 = client.search_runs([exp.experiment_id], filter_string="tags.`coevo.round` = '1'")[0]
    acc = round1.data.metrics["evaluate/greedy_acc"]
    # MLflow 3 opens an experiment without a kind in its GenAI view; the runs table is the
    # "Model training" (machine_learning) workflow.
    browser.get(f"{servers.mlflow_url}/#/experiments/{exp.experiment_id}/runs?workflowType=machine_learning")
    _wait_text(browser, [EXPERIMENT, "Run Name", "3 matching runs"])  # the parent and rounds 0 and 1
    _screenshot(browser, tmp_path, "mlflow-experiment")
    browser.get(f"{servers.mlflow_url}/#/experiments/{exp.experiment_id}/runs/{round1.info.run_id}")
    body = _wait_text(browser, ["round-1", "evaluate/greedy_acc"])
    metric = browser.find_element("xpath", "//*[normalize-space(text())='evaluate/greedy_acc']")
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", metric)
    _screenshot(browser, tmp_path, "mlflow-round-run")
    assert f"{acc:g}"[:4] in body or str(round(acc, 4))[:4] in body, f"greedy_acc {acc} not on the run page"

    # The report of the same run opens in the browser, plots included.
    report = tmp_path / "report.html"
    coevo("report", EXPERIMENT, "--workdir", str(servers.workdir), "--out", str(report))
    browser.get(report.as_uri())
    _wait_text(browser, [f"coevo report: {EXPERIMENT}", "Rounds", "Lineage"], timeout=20)
    loaded = browser.execute_script(
        "return Array.from(document.images).filter(i => i.complete && i.naturalWidth > 0).length")
    assert loaded >= 3
    _screenshot(browser, tmp_path, "report")
