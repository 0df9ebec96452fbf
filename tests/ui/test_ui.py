"""The operator's day in a real browser: start servers, serve the deployments, fill in the run form and
press Submit, watch the run's progress and rounds in the Prefect UI, and the result in the MLflow UI.

    pytest tests/ui -q        # screenshots land in the test's tmp dir and /tmp/coevo-screens/
"""

from __future__ import annotations

import json
import shutil
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import REPO

from .conftest import SCREENS, UI_EXPERIMENT, coevo, wait_for

pytestmark = pytest.mark.slow

EXPERIMENT = UI_EXPERIMENT  # the user's config `user_configs` writes: micro, shorter training


def _screenshot(driver, tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.png"
    driver.save_screenshot(str(path))
    SCREENS.mkdir(parents=True, exist_ok=True)
    shutil.copy(path, SCREENS / path.name)
    return path


def _wait_text(driver, texts: list[str], timeout: float = 60, scroll: bool = False) -> str:
    """Wait until every text is visible in the rendered page (single-page apps render late); `scroll`: scroll
    every scrolled box to its end first, for sections that load when they come into view."""
    def seen():
        if scroll:
            driver.execute_script("document.querySelectorAll('*').forEach(e => { if (e.scrollHeight > "
                                  "e.clientHeight + 1) e.scrollTop = e.scrollHeight; })")
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


def _property(driver, label: str):
    """A field of Prefect's parameter form, by its label (`rounds (Optional)`)."""
    return driver.find_element("xpath", "//div[contains(@class,'schema-form-property')][.//span[contains(@class,"
                                        f"'schema-form-property__label') and starts-with(normalize-space(.), '{label} ')]]")


def _tab(driver, name: str) -> None:
    driver.find_element("xpath", f"//*[contains(@class,'tab') and normalize-space(.)='{name}']").click()


def test_run_from_the_form_and_see_it_in_both_uis(servers, served, user_configs, browser, tmp_path):
    from mlflow.tracking import MlflowClient
    from prefect.client.orchestration import get_client
    from prefect.exceptions import PrefectHTTPStatusError
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from selenium.webdriver.support.ui import Select

    name = "self_evolution/self-evolution"
    user_config = str((user_configs / f"{EXPERIMENT}.yaml").resolve())
    with temporary_settings(updates={PREFECT_API_URL: servers.prefect_api}):
        def deployed():  # all four: `coevo serve` registers them one by one
            with get_client(sync_client=True) as c:
                return [c.read_deployment_by_name(n) for n in (name, "evolution_round/evolution-round",
                                                                "run_stage/run-stage", "evaluate_model/evaluate-model")]

        deployment = wait_for(deployed, 120, "`coevo serve` to register its deployments", interval=2)[0]
        # The form's choices: the checkout's configs and the user's folder; typed, bounded fields.
        props = deployment.parameter_openapi_schema["properties"]
        assert {"configs/micro.yaml", "configs/micro-grpo.yaml", user_config} <= set(props["config_path"]["enum"])
        assert props["rounds"]["anyOf"][0] == {"minimum": 0, "type": "integer"}
        assert props["recipe"]["anyOf"][0]["enum"] == ["rft", "coevo", "grpo", "import"]
        assert [(s.active, s.parameters) for s in deployment.schedules] == [(False, {"more_rounds": 1})]
        with get_client(sync_client=True) as c:
            stage = c.read_deployment_by_name("run_stage/run-stage").parameter_openapi_schema["properties"]["stage"]
            assert {"generate", "train_policy", "evaluate"} <= set(stage["enum"])
            # A value that does not fit is refused by the API before a run exists, with Prefect's message.
            with pytest.raises(PrefectHTTPStatusError, match="minimum of 0"):
                c.create_flow_run_from_deployment(deployment.id, parameters={"rounds": -1})
            assert not c.read_flow_runs()

    # The operator's way: the deployment's run form, a config picked from the list, rounds set to 1, Submit.
    browser.get(f"{servers.prefect_url}/deployments/deployment/{deployment.id}/run")
    _wait_text(browser, ["config_path", "rounds", "overrides", "Submit"])
    Select(_property(browser, "config_path").find_element("tag name", "select")).select_by_visible_text(user_config)
    _property(browser, "rounds").find_element("xpath", ".//button[normalize-space(.)='int']").click()
    wait_for(lambda: _property(browser, "rounds").find_element("tag name", "input"), 10, "the rounds input")
    _property(browser, "rounds").find_element("tag name", "input").send_keys("1")
    _screenshot(browser, tmp_path, "prefect-run-form")
    browser.find_element("xpath", "//button[normalize-space(.)='Submit']").click()

    def submitted():
        with get_client(sync_client=True) as c:
            return c.read_flow_runs()

    with temporary_settings(updates={PREFECT_API_URL: servers.prefect_api}):
        runs = wait_for(submitted, 60, "the form's flow run")
        assert len(runs) == 1 and runs[0].parameters["rounds"] == 1, [r.parameters for r in runs]
        assert runs[0].parameters["config_path"] == user_config

        def finished():
            with get_client(sync_client=True) as c:
                run = c.read_flow_run(runs[0].id)
            return run if run.state is not None and run.state.is_final() else None

        run = wait_for(finished, 1500, "the flow run to finish", interval=3)
    log = (tmp_path / "serve.log").read_text()
    assert run.state.is_completed(), f"flow run ended {run.state}\n{log[-4000:]}"

    # Each round published its table artifact; each sampling and training stage its progress artifact.
    keys = [f"{EXPERIMENT}-round-{r}" for r in (0, 1)]
    arts = _post(f"{servers.prefect_api}/artifacts/filter", {"artifacts": {"key": {"any_": keys}}})
    assert {a["key"] for a in arts} == set(keys), arts
    rows = json.loads(arts[0]["data"]) if isinstance(arts[0]["data"], str) else arts[0]["data"]
    assert any(r["metric"] == "greedy_acc" for r in rows)
    progress = {a["key"]: a for a in _post(f"{servers.prefect_api}/artifacts/filter",
                                           {"artifacts": {"type": {"any_": ["progress"]}}})}
    for stage in ("r0-bootstrap", "r1-generate", "r1-train-policy", "r1-evaluate"):
        key = f"{EXPERIMENT}-{stage}-progress"
        assert key in progress, sorted(progress)
        assert progress[key]["data"] == 100 and progress[key]["description"].endswith(": done"), progress[key]
        assert progress[key]["task_run_id"] is not None

    # The run page links each round: its flow run, table, plot and MLflow run.
    browser.get(f"{servers.prefect_url}/runs/flow-run/{run.id}")
    _wait_text(browser, [run.name, "Completed", "Artifacts"])
    _tab(browser, "Artifacts")
    _wait_text(browser, [f"{EXPERIMENT}-rounds", f"{EXPERIMENT}-mlflow"])
    _screenshot(browser, tmp_path, "prefect-run-artifacts")
    index = _post(f"{servers.prefect_api}/artifacts/filter", {"artifacts": {"key": {"any_": [f"{EXPERIMENT}-rounds"]}}})
    browser.get(f"{servers.prefect_url}/artifacts/artifact/{index[0]['id']}")
    _wait_text(browser, [f"{EXPERIMENT}: rounds", "greedy acc", "flow run", "table", "plot"])
    wait_for(lambda: browser.execute_script(
        "return Array.from(document.images).filter(i => i.complete && i.naturalWidth > 0).length"), 30,
        "the round plot, served by MLflow, to load")
    _screenshot(browser, tmp_path, "prefect-rounds")
    round_runs = [a.get_attribute("href") for a in browser.find_elements("xpath", "//a[normalize-space(.)='flow run']")]
    assert len(round_runs) == 2, round_runs
    browser.get(round_runs[1])
    _wait_text(browser, ["evolution_round", "Completed", "Artifacts"])
    _tab(browser, "Artifacts")
    _wait_text(browser, [keys[1], f"{EXPERIMENT}-r1-generate-progress", f"{EXPERIMENT}-r1-train-policy-progress"],
               scroll=True)
    _screenshot(browser, tmp_path, "prefect-round-run-artifacts")

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
    # Each MLflow run links back to the Prefect flow run that made it.
    assert round1.data.tags["prefect.flow_run_url"] == round_runs[1]
    assert round_runs[1] in round1.data.tags["mlflow.note.content"]
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
