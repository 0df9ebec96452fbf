"""The infra files as their tools read them: the Kubernetes work pool's base job template, the stage-job
Dockerfile and the compose file of the services.

Docker and a Kubernetes cluster are absent here, so these tests validate the files rather than run them.
The job template goes through prefect-kubernetes's own classes (the worker's job configuration, rendered
to the Job manifest a worker would submit) and Prefect's own validation (the server's template and job
variable checks); one test creates the work pool with the documented CLI command on Prefect's local
server. The Dockerfile and the compose file are parsed and checked against the repository and the
installed versions. No test here skips: each either checks its file or fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import uuid
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, TELEMETRY_OFF

INFRA = REPO / "infra"
TEMPLATE_YAML = INFRA / "k8s-stage-job.yaml"
TEMPLATE_JSON = INFRA / "k8s-stage-job.json"
POOL_CREATE = "prefect work-pool create coevo-gpu --type kubernetes --base-job-template infra/k8s-stage-job.json"
SPEC = "/workdir/exp/r1/generate/a1.spec.json"


def template() -> dict:
    return yaml.safe_load(TEMPLATE_YAML.read_text())


def container(manifest: dict) -> dict:
    return manifest["spec"]["template"]["spec"]["containers"][0]


def render(values: dict, flow_run_name: str = "generate-exp-a1"):
    """The worker's job configuration for `values`, prepared for a flow run, as a Kubernetes worker builds it
    before it submits the Job (KubernetesWorkerJobConfiguration.resolve_for_flow_run, minus the API reads)."""
    from prefect.client.schemas.objects import FlowRun
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    # The template holds no block or variable references, so the client is never called.
    config = asyncio.run(KubernetesWorkerJobConfiguration.from_template_and_values(
        base_job_template=template(), values=values, client=object()))
    flow_run = FlowRun(id=uuid.uuid4(), name=flow_run_name, flow_id=uuid.uuid4())
    config.prepare_for_flow_run(flow_run)
    return config, flow_run


def pyproject_pin(name: str) -> str:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = [d.split("#")[0].strip() for d in deps if re.match(rf"{re.escape(name)}==", d)]
    assert len(pins) == 1, f"expected one exact pin of {name} in pyproject.toml's dependencies, found {pins}"
    return pins[0]


# -- the Kubernetes base job template -----------------------------------------------------------------

def test_template_json_is_the_yaml():
    """`prefect work-pool create --base-job-template` reads JSON only: the JSON file is the YAML, as data."""
    assert TEMPLATE_YAML.read_text().startswith(f"# {POOL_CREATE}\n"), \
        f"expected {TEMPLATE_YAML.name} to open with the command that uses it: # {POOL_CREATE}"
    assert json.loads(TEMPLATE_JSON.read_text()) == template(), (
        f"expected {TEMPLATE_JSON.name} to equal {TEMPLATE_YAML.name} as data, found them different: "
        "regenerate it with the command in the YAML file's header")


def test_job_configuration_keys_are_the_kubernetes_workers():
    from prefect_kubernetes.worker import KubernetesWorker, KubernetesWorkerJobConfiguration

    keys = set(template()["job_configuration"])
    fields = KubernetesWorkerJobConfiguration.model_fields
    unknown = keys - set(fields)
    assert not unknown, \
        f"expected only KubernetesWorkerJobConfiguration fields {sorted(fields)}, found {sorted(unknown)}"
    required = {k for k, f in fields.items() if f.is_required()}
    assert required <= keys, \
        f"expected the worker's required fields {sorted(required)}, missing {sorted(required - keys)}"
    default = set(KubernetesWorker.get_default_base_job_template()["job_configuration"])
    assert keys == default, (f"expected the keys of the worker's default template {sorted(default)}, "
                             f"found {sorted(keys)}")


def test_placeholders_are_declared_and_the_variables_a_valid_schema():
    """Prefect's server runs these two checks when a work pool is created (WorkPoolCreate, then
    is_valid_schema on the variables): the server's own functions, called here."""
    from prefect.server.schemas.actions import validate_base_job_template
    from prefect.utilities.schema_tools import is_valid_schema
    from prefect.utilities.templating import find_placeholders

    tpl = template()
    validate_base_job_template(tpl)  # raises ValueError naming undeclared variables
    is_valid_schema(tpl["variables"], preprocess=False)  # raises ValueError on an invalid JSON schema
    used = {p.name for p in find_placeholders(json.dumps(tpl["job_configuration"]))}
    declared = set(tpl["variables"]["properties"])
    assert used <= declared, f"expected every placeholder declared in variables, undeclared: {sorted(used - declared)}"
    assert declared <= used, f"expected every variable used in job_configuration, unused: {sorted(declared - used)}"
    # The pool runner's `stage_job` deployment sets no job variables: a required one would refuse its runs.
    assert not tpl["variables"].get("required"), \
        f"expected no required variables, found {tpl['variables'].get('required')}"


def test_rendered_job_runs_the_flow_run_on_its_gpus():
    from components.jobs.__main__ import main as job_main
    from components.jobs.launch import job_command

    values = {"gpu_count": 2, "workdir_pvc": "exp-pvc", "stage_timeout_s": 900}
    config, flow_run = render(values)
    manifest = config.job_manifest
    c = container(manifest)
    want = ["prefect", "flow-run", "execute"]
    assert c["args"] == want, f"expected the container's args {want} (the worker's own), found {c.get('args')}"
    assert "command" not in c, f"expected no container command (the image has no entrypoint), found {c['command']}"
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env.get("PREFECT__FLOW_RUN_ID") == str(flow_run.id), \
        f"expected PREFECT__FLOW_RUN_ID={flow_run.id} in the container's env, found {env.get('PREFECT__FLOW_RUN_ID')}"
    sigterm = env.get("PREFECT_FLOW_RUN_EXECUTE_SIGTERM_BEHAVIOR")
    assert sigterm == "crash", f"expected an evicted run to end Crashed (crash), not rescheduled, found {sigterm}"
    limits = c["resources"]["limits"]
    assert limits.get("nvidia.com/gpu") == 2, f"expected resources.limits nvidia.com/gpu == gpu_count 2, found {limits}"
    assert manifest["spec"]["backoffLimit"] == 0, \
        f"expected backoffLimit 0, found {manifest['spec'].get('backoffLimit')}"
    assert manifest["spec"]["activeDeadlineSeconds"] == 900, \
        f"expected activeDeadlineSeconds == stage_timeout_s 900, found {manifest['spec'].get('activeDeadlineSeconds')}"
    pod = manifest["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never", f"expected restartPolicy Never, found {pod.get('restartPolicy')}"
    assert c["workingDir"] == "/opt/coevo", f"expected workingDir /opt/coevo, found {c.get('workingDir')}"
    claims = {v["name"]: v.get("persistentVolumeClaim", {}).get("claimName") for v in pod["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert claims.get("workdir") == "exp-pvc" and mounts.get("workdir") == env.get("COEVO_WORKDIR") == "/workdir", \
        f"expected claim exp-pvc mounted at COEVO_WORKDIR=/workdir, found claims {claims}, mounts {mounts}, env {env}"
    secrets = [(f["secretRef"]["name"], f["secretRef"].get("optional")) for f in c.get("envFrom", [])]
    assert secrets == [("coevo-s3", True)] and env.get("AWS_ENDPOINT_URL"), \
        f"expected the bucket's credentials from the optional Secret coevo-s3 and an S3 endpoint in the env " \
        f"(execution.storage), found envFrom {secrets}, AWS_ENDPOINT_URL {env.get('AWS_ENDPOINT_URL')}"
    meta = manifest["metadata"]
    assert meta["namespace"] == "coevo" and meta["generateName"] == "generate-exp-a1-", \
        f"expected namespace coevo and generateName after the flow run (generate-exp-a1-), found {meta}"

    # What the flow run runs in that pod: the stage_job flow (the pool runner's deployment entrypoint) runs
    # `python -m components.jobs <stage> --spec <spec>`, which accepts these args (it stops at the absent spec).
    from tasks.pool import ENTRYPOINT, FLOW

    module, _, name = ENTRYPOINT.rpartition(".")
    stage_job = getattr(__import__(module, fromlist=[name]), name)
    assert stage_job.name == FLOW, \
        f"expected the entrypoint {ENTRYPOINT} to be the flow {FLOW!r}, found {stage_job.name!r}"
    cmd = job_command("generate", Path(SPEC), "python")
    assert cmd == ["python", "-m", "components.jobs", "generate", "--spec", SPEC], \
        f"expected the stage job command, found {cmd}"
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = job_main(cmd[3:])
    assert rc == 2 and f"spec file not found: {SPEC}" in err.getvalue(), \
        f"expected `python -m components.jobs` to accept the args and exit 2 on the missing spec, " \
        f"found {rc}: {err.getvalue()}"

    # A `command` job variable replaces the worker's: the stage job alone, with no flow run around it.
    direct = "python -m components.jobs generate --spec " + SPEC
    config, _ = render({"command": direct})
    args = container(config.job_manifest)["args"]
    assert args == shlex.split(direct), f"expected the command variable as the args {shlex.split(direct)}, found {args}"


def test_variable_defaults_validate_and_bad_values_are_rejected():
    """Prefect's server validates a work pool's defaults, and a deployment's and a flow run's job variables,
    with schema_tools.validate (prefect/server/api/validation.py); the same call, with the same flags."""
    from prefect.utilities.schema_tools import ValidationError, validate

    variables = template()["variables"]
    defaults = {k: p["default"] for k, p in variables["properties"].items() if "default" in p}
    # The work pool's defaults (validate_job_variable_defaults_for_work_pool: required keys ignored), then a
    # flow run's full set (validate_job_variables_for_deployment_flow_run: required keys checked).
    for ignore_required in (True, False):
        validate(defaults, variables, raise_on_error=True, preprocess=True, ignore_required=ignore_required,
                 allow_none_with_default=True)
    for bad, field in [({"gpu_count": "x"}, "gpu_count"), ({"gpu_count": -1}, "gpu_count"),
                       ({"image_pull_policy": "Sometimes"}, "image_pull_policy"),
                       ({"stage_timeout_s": 0}, "stage_timeout_s"),
                       ({"env": "COEVO_WORKDIR=/w"}, "env")]:
        try:
            validate({**defaults, **bad}, variables, raise_on_error=True, preprocess=True, ignore_required=False,
                     allow_none_with_default=True)
        except ValidationError as e:
            assert f"'{field}'" in str(e), f"expected the error for {bad} to name {field!r}, found {e}"
        else:
            raise AssertionError(f"expected Prefect's validation to reject {bad}, found it accepted")


def test_gpu_stages_route_to_the_gpu_pool():
    """The GPU stages (Stage.gpu) are the stages tagged `gpu` (the tag concurrency limit's tag) and the
    ones execution.gpu_pool sends to this pool; the template's gpu_count help names the others."""
    from components.config import load_config
    from components.jobs.launch import pool_of
    from components.stages import STAGES
    from tasks.stages import stage_tags

    gpu = sorted(n for n, s in STAGES.items() if s.gpu)
    tagged = sorted(n for n in STAGES if "gpu" in stage_tags(n))
    assert tagged == gpu, f"expected the stages tagged `gpu` to be the GPU stages {gpu}, found {tagged}"
    cfg = load_config(REPO / "configs" / "arith.yaml", ["execution.gpu_pool=coevo-gpu", "execution.pool=coevo-cpu"])
    routed = sorted(n for n in STAGES if pool_of(cfg, n) == "coevo-gpu")
    assert routed == gpu, f"expected execution.gpu_pool to get the GPU stages {gpu}, found {routed}"
    props = template()["variables"]["properties"]
    cpu = sorted(set(STAGES) - set(gpu))
    m = re.search(r"the CPU stages \(([\w, ]+)\)", props["gpu_count"]["description"])
    named = sorted(m.group(1).replace(" ", "").split(",")) if m else None
    assert named == cpu, f"expected gpu_count's description to name the CPU stages {cpu}, found {named}"
    assert props["gpu_count"]["default"] == 1 and props["gpu_count"]["minimum"] == 0, \
        f"expected gpu_count default 1, minimum 0, found {props['gpu_count']}"


def test_work_pool_created_with_the_documented_command(prefect_server):
    """The documented command, run as a user runs it, against Prefect's local server. Then the pool read
    back; the pool runner's `stage_job` deployment on it and a flow run of it accepted; that run's Job built
    as a worker builds it (resolve_for_flow_run, through the API); a bad job variable refused by the
    server; and the `gpu` tag limit set with the documented command, which tags the GPU stages' task runs
    while it exists (and only then: a tagged run asks the server for slots)."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound, PrefectHTTPStatusError
    from prefect.settings import get_current_settings
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    from components.config import load_config
    from components.stages import STAGES
    from tasks.pool import ensure_deployment
    from tasks.stages import stage_task

    env = {**os.environ, **TELEMETRY_OFF, "PREFECT_API_URL": str(get_current_settings().api.url)}

    def prefect(*args: str) -> str:
        p = subprocess.run([sys.executable, "-m", "prefect", *args], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=120, check=False)
        assert p.returncode == 0, \
            f"expected `prefect {' '.join(args)}` to exit 0, found {p.returncode}:\n{p.stdout}\n{p.stderr}"
        return p.stdout

    async def job_for(flow_run_id, pool):
        async with get_client() as client:
            flow_run = await client.read_flow_run(flow_run_id)
            config = await KubernetesWorkerJobConfiguration.resolve_for_flow_run(
                flow_run, client=client, work_pool=pool, worker_name="k8s-worker")
        return config.job_manifest

    prefect(*shlex.split(POOL_CREATE)[1:])
    with get_client(sync_client=True) as client:
        pool = client.read_work_pool("coevo-gpu")
        assert pool.type == "kubernetes", f"expected a kubernetes pool, found {pool.type}"
        assert pool.base_job_template == template(), \
            "expected the pool's base job template to be infra/k8s-stage-job.yaml's, found another"

        deployment_id = ensure_deployment(client, "coevo-gpu")
        run = client.create_flow_run_from_deployment(
            deployment_id, parameters={"stage": "generate", "spec": SPEC, "timeout_s": 60.0}, name="generate-exp-a1")
        try:
            manifest = asyncio.run(job_for(run.id, pool))
        finally:
            client.delete_flow_run(run.id)  # no worker polls this pool: nothing would ever run it
        c = container(manifest)
        env_vars = {e["name"]: e.get("value") for e in c["env"]}
        executes = c["args"] == ["prefect", "flow-run", "execute"]
        assert executes and env_vars.get("PREFECT__FLOW_RUN_ID") == str(run.id), \
            f"expected the pod to execute flow run {run.id}, found args {c['args']}, env {env_vars}"
        assert c["resources"]["limits"].get("nvidia.com/gpu") == 1, f"expected 1 GPU by default, found {c['resources']}"
        assert manifest["metadata"]["labels"].get("prefect.io/deployment-name") == "coevo-gpu", \
            f"expected the Job labelled with the stage_job deployment coevo-gpu, found {manifest['metadata']['labels']}"

        flow_id = client.create_flow_from_name("stage_job")
        with pytest.raises(PrefectHTTPStatusError) as e:
            client.create_deployment(flow_id=flow_id, name="bad", work_pool_name="coevo-gpu",
                                     job_variables={"gpu_count": "x"})
        assert e.value.response.status_code == 422 and "gpu_count" in e.value.response.text, \
            f"expected a 422 naming gpu_count, found {e.value.response.status_code}: {e.value.response.text}"

        try:
            before = client.read_concurrency_limit_by_tag("gpu").concurrency_limit
        except ObjectNotFound:
            before = None
        cfg = load_config(REPO / "configs" / "micro.yaml")
        gpu = {n: {"gpu"} if s.gpu else set() for n, s in STAGES.items()}
        try:
            prefect("concurrency-limit", "create", "gpu", "3")
            got = client.read_concurrency_limit_by_tag("gpu").concurrency_limit
            assert got == 3, f"expected the `gpu` tag limit 3 after `concurrency-limit create gpu 3`, found {got}"
            tags = {n: stage_task(cfg, n).tags for n in STAGES}
            assert tags == gpu, f"expected the GPU stages' task runs tagged `gpu` under the limit, found {tags}"
            client.delete_concurrency_limit_by_tag("gpu")
            tags = {n: stage_task(cfg, n).tags for n in STAGES}
            assert not any(tags.values()), f"expected no tag without a limit (no slot request), found {tags}"
        finally:  # the server is the session's: leave the limit as it was, whichever assertion failed
            if before is not None:
                client.create_concurrency_limit(tag="gpu", concurrency_limit=before)
            else:
                try:
                    client.delete_concurrency_limit_by_tag("gpu")
                except ObjectNotFound:
                    pass


# -- the stage-job image -------------------------------------------------------------------------------

def dockerfile() -> list[tuple[str, str]]:
    """(instruction, arguments) of infra/Dockerfile, continuation lines joined, comments dropped."""
    out, cur = [], ""
    for line in (INFRA / "Dockerfile").read_text().splitlines():
        if not cur and (not line.strip() or line.lstrip().startswith("#")):
            continue
        cur += line.rstrip()
        if cur.endswith("\\"):
            cur = cur[:-1] + " "
            continue
        word, _, rest = cur.strip().partition(" ")
        out.append((word.upper(), " ".join(rest.split())))
        cur = ""
    assert not cur, f"expected no dangling continuation at the end of the Dockerfile, found {cur!r}"
    return out


def test_dockerfile_builds_the_stage_job_image():
    text = (INFRA / "Dockerfile").read_text()
    assert text.startswith("# docker build -f infra/Dockerfile "), \
        "expected the Dockerfile to open with the command that builds it"
    ins = dockerfile()
    words = [w for w, _ in ins]
    assert words[0] == "ARG" and ins[0][1].startswith("BASE_IMAGE="), \
        f"expected ARG BASE_IMAGE=... first, found {ins[0]}"
    froms = [a for w, a in ins if w == "FROM"]
    assert froms == ["${BASE_IMAGE}"], f"expected one FROM ${{BASE_IMAGE}}, found {froms}"
    assert "ENTRYPOINT" not in words, "expected no ENTRYPOINT: the work pool's container args are the whole command"
    workdirs = [a for w, a in ins if w == "WORKDIR"]
    want_dir = container(template()["job_configuration"]["job_manifest"])["workingDir"]
    assert workdirs == [want_dir] == ["/opt/coevo"], \
        f"expected WORKDIR /opt/coevo, the template's workingDir ({want_dir}), found {workdirs}"

    copies = [(i, a.split()[:-1]) for i, (w, a) in enumerate(ins) if w == "COPY"]
    sources = [s for _, srcs in copies for s in srcs]
    missing = [s for s in sources if not (REPO / s).exists()]
    assert not missing, f"expected every COPY source in the repository, missing {missing}"
    include = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.rstrip("*") for p in include}
    assert {"pyproject.toml", "constraints.txt", "configs"} | packages <= set(sources), \
        f"expected COPY of the pins, configs and the packages {sorted(packages)}, found {sources}"

    runs = [(i, a) for i, (w, a) in enumerate(ins) if w == "RUN"]
    torch_pin = pyproject_pin("torch")
    torch_runs = [i for i, a in runs if f'"{torch_pin}"' in a or f" {torch_pin} " in f"{a} "]
    deps_runs = [i for i, a in runs if "-r /tmp/requirements.txt -c constraints.txt" in a]
    assert torch_runs and deps_runs and torch_runs[0] < deps_runs[0], \
        f"expected {torch_pin} installed before the project's dependencies, found RUNs {runs}"
    assert all("-c constraints.txt" in a for i, a in runs if "pip install" in a and "--no-deps" not in a), \
        f"expected every pip install of dependencies under -c constraints.txt, found {runs}"
    pins_copied = min(i for i, srcs in copies if "constraints.txt" in srcs)
    code_copied = min(i for i, srcs in copies if packages & set(srcs))
    assert pins_copied < torch_runs[0] < deps_runs[0] < code_copied, \
        "expected the pins copied, torch and the dependencies installed, then the code copied " \
        "(a code change keeps the environment's layers), found another order"
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    pk = [d for d in extra if d.startswith("prefect-kubernetes==")]
    pk_runs = [a for _, a in runs if "prefect-kubernetes==" in a]
    assert len(pk) == 1 and len(pk_runs) == 1 and f'"{pk[0]}"' in pk_runs[0], \
        f"expected the worker's package installed at the test extra's pin {pk}, found {pk_runs}"
    makefile_torch = re.findall(r'pip install -q "(torch==[^"]+)"', (REPO / "Makefile").read_text())
    assert makefile_torch == [torch_pin], \
        f"expected the Makefile to install {torch_pin} first too, found {makefile_torch}"
    # .dockerignore leaves .git out, so the build names the commit the runs record (components.tracking).
    assert "CODE_VERSION=" in [a for w, a in ins if w == "ARG"], f"expected ARG CODE_VERSION=, found {ins}"
    assert any("COEVO_CODE_VERSION=${CODE_VERSION}" in a.split() for w, a in ins if w == "ENV"), \
        f"expected ENV COEVO_CODE_VERSION=${{CODE_VERSION}}, found {[a for w, a in ins if w == 'ENV']}"
    cmd = [a for w, a in ins if w == "CMD"]
    assert cmd and json.loads(cmd[-1])[:3] == ["python", "-m", "components.jobs"], \
        f"expected CMD python -m components.jobs, found {cmd}"


def test_dockerignore_keeps_environments_out_and_the_sources_in():
    patterns = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    for want in (".git", ".venv", ".venv-*", "workdir"):
        assert want in patterns, f"expected .dockerignore to exclude {want}, found {patterns}"
    sources = {s for w, a in dockerfile() if w == "COPY" for s in a.split()[:-1]}
    excluded = sorted(s for s in sources if s in patterns)
    assert not excluded, f"expected no COPY source excluded by .dockerignore, found {excluded}"


def test_dockerfile_runs_jobs_as_a_non_root_user():
    """The last USER decides who the jobs run as. Kubernetes's `runAsNonRoot` can only verify a numeric one."""
    ins = dockerfile()
    users = [(i, a) for i, (w, a) in enumerate(ins) if w == "USER"]
    assert users, "expected a USER instruction: without one the stage jobs run as root"
    at, user = users[-1]
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0 and (not gid or gid.isdigit() and int(gid) != 0), \
        f"expected the last USER a numeric uid[:gid] other than 0 (root), found {user!r}"
    runs = [a for i, (w, a) in enumerate(ins) if w == "RUN" and i < at]
    made = [a for a in runs if re.search(rf"\buseradd\b.*--uid {uid}\b", a)]
    assert made, f"expected a RUN before USER {user} to create uid {uid} (useradd --uid {uid}), found {runs}"
    mounts = container(template()["job_configuration"]["job_manifest"])["volumeMounts"]
    workdir = next(m["mountPath"] for m in mounts if m["name"] == "workdir")
    chowned = [a for a in runs if re.search(rf"\bchown\b.*\b(coevo|{uid})(:\S+)? {re.escape(workdir)}\b", a)]
    assert chowned, f"expected a RUN to give the job's user the workdir mount {workdir} (chown), found {runs}"


# -- the services --------------------------------------------------------------------------------------

def test_compose_stands_up_the_services():
    import prefect

    path = INFRA / "docker-compose.yaml"
    text = path.read_text()
    assert text.startswith("# docker compose -f infra/docker-compose.yaml up -d\n"), \
        "expected the compose file to open with the command that uses it"
    services = yaml.safe_load(text)["services"]
    want = {"postgres", "prefect-server", "mlflow", "minio"}
    assert want <= set(services), f"expected services {sorted(want)}, found {sorted(services)}"

    published = {}
    for name, s in services.items():
        for binding in s.get("ports", []):
            m = re.fullmatch(r"127\.0\.0\.1:(\d+):(\d+)", str(binding))
            assert m, f"expected {name}'s port binding as 127.0.0.1:HOST:CONTAINER, found {binding!r}"
            assert m.group(1) not in published, \
                f"expected host port {m.group(1)} bound once, found {name} and {published[m.group(1)]}"
            published[m.group(1)] = name
    documented = dict.fromkeys(re.findall(r"http://127\.0\.0\.1:(\d+)", text.split("\nname:")[0]))
    for port, name in [("4200", "prefect-server"), ("5000", "mlflow"), ("9000", "minio"), ("9001", "minio")]:
        assert published.get(port) == name, \
            f"expected host port {port} published by {name}, found {published.get(port)}"
        assert port in documented, f"expected the header to give the address 127.0.0.1:{port}, found {list(documented)}"

    tag = services["prefect-server"]["image"].rpartition(":")[2]
    py = f"python{sys.version_info.major}.{sys.version_info.minor}"
    assert tag == f"{prefect.__version__}-{py}", \
        f"expected prefect-server's tag {prefect.__version__}-{py}, found {tag}"
    mlflow_tag = services["mlflow"]["image"].rpartition(":")[2]
    assert mlflow_tag == f"v{version('mlflow')}", f"expected mlflow's tag v{version('mlflow')}, found {mlflow_tag}"

    stateful = {n for n, s in services.items() if s.get("volumes")}
    assert {"postgres", "minio"} <= stateful, f"expected postgres and minio to keep volumes, found {sorted(stateful)}"
    for name in stateful | {"prefect-server", "mlflow"}:
        assert services[name].get("healthcheck", {}).get("test"), f"expected a healthcheck on {name}, found none"
    for name, s in services.items():
        for dep, cond in (s.get("depends_on") or {}).items():
            assert dep in services, f"expected {name}'s dependency {dep} to be a service"
            if cond.get("condition") == "service_healthy":
                assert "healthcheck" in services[dep], \
                    f"expected {dep} (which {name} waits healthy on) to have a healthcheck, found none"

    pg = services["postgres"]["environment"]["POSTGRES_DB"]
    prefect_db = services["prefect-server"]["environment"]["PREFECT_API_DATABASE_CONNECTION_URL"]
    assert prefect_db.startswith("postgresql+asyncpg://") and prefect_db.endswith(f"@postgres:5432/{pg}"), \
        f"expected Prefect on postgres's database {pg!r} through asyncpg, found {prefect_db}"
    mlflow_cmd = " ".join(services["mlflow"]["command"])
    init_sql = yaml.safe_load(text)["configs"]["create-mlflow-db"]["content"]
    assert "@postgres:5432/mlflow" in mlflow_cmd and "CREATE DATABASE mlflow" in init_sql, \
        f"expected MLflow on a database `mlflow` that postgres's init script creates, " \
        f"found {mlflow_cmd!r}, {init_sql!r}"


COMPOSE_SECRETS = {"POSTGRES_PASSWORD", "MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD"}
SECRET_KEY = re.compile(r"PASSWORD|SECRET|TOKEN|ACCESS_KEY|ROOT_USER", re.I)
# `${NAME}`, `${NAME:-default}`, `${NAME-default}`, `${NAME:?message}`, ...; `$${` is compose's literal `${`.
INTERPOLATION = re.compile(r"(?<!\$)\$\{(\w+)(?:(:?[-?+])([^}]*))?\}")


def compose_text() -> str:
    return (INFRA / "docker-compose.yaml").read_text()


def test_compose_publishes_every_port_on_loopback_only():
    """A port published without a host address listens on every interface, with the services' passwords
    one guess away: each binding names 127.0.0.1, in the short form or the long one."""
    services = yaml.safe_load(compose_text())["services"]
    seen = []
    for name, s in services.items():
        assert s.get("network_mode") != "host", f"expected {name} on compose's network, found network_mode: host"
        for binding in s.get("ports", []):
            host_ip = binding.get("host_ip") if isinstance(binding, dict) else str(binding).rsplit(":", 2)[0]
            assert str(binding).count(":") == 2 or isinstance(binding, dict), \
                f"expected {name}'s port as 127.0.0.1:HOST:CONTAINER, found {binding!r}"
            assert host_ip == "127.0.0.1", f"expected {name}'s port {binding!r} bound to 127.0.0.1, found {host_ip!r}"
            seen.append(binding)
    assert seen, "expected published ports to check, found none"


def test_compose_credentials_come_from_the_environment_without_defaults():
    """Compose's `${NAME:?message}` refuses to start without NAME; `${NAME:-x}` would start on a known x."""
    text = compose_text()
    uses = INTERPOLATION.findall(text)
    secret_uses = [(n, op, arg) for n, op, arg in uses if SECRET_KEY.search(n)]
    defaulted = [f"${{{n}{op}{arg}}}" for n, op, arg in secret_uses if op != ":?" or not arg.strip()]
    assert not defaulted, f"expected every credential as ${{NAME:?message}}, found {defaulted}"
    assert COMPOSE_SECRETS <= {n for n, _, _ in secret_uses}, \
        f"expected {sorted(COMPOSE_SECRETS)} taken from the environment, found {sorted({n for n, _, _ in uses})}"

    # No credential written out: each secret-named setting, and each password in a URL, is a required variable.
    required = re.compile(r"\$\{(\w+):\?[^}]+\}")
    doc = yaml.safe_load(text)
    url_passwords = []
    for name, s in doc["services"].items():
        env = s.get("environment") or {}
        assert isinstance(env, dict), f"expected {name}'s environment as a mapping, found {env!r}"
        for key, value in env.items():
            if SECRET_KEY.search(key):
                assert required.fullmatch(str(value)), f"expected {name}'s {key} as ${{NAME:?message}}, found {value!r}"
        for password in re.findall(r"://[\w.-]+:(\$\{[^}]*\}|[^@\s/'\"]*)@", json.dumps(s)):
            assert required.fullmatch(password), \
                f"expected the password in {name}'s URL as ${{NAME:?message}}, found {password!r}"
            url_passwords.append(password)
    assert len(url_passwords) >= 2, f"expected Prefect's and MLflow's database URLs checked, found {url_passwords}"
    minio = doc["services"]["minio"]["environment"]
    for key in ("MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD"):
        m = required.fullmatch(str(minio.get(key)))
        assert m and m.group(1) == key, f"expected MinIO's {key} as ${{{key}:?message}}, found {minio.get(key)!r}"
    header = text.split("\nname:")[0]
    missing = sorted(n for n in COMPOSE_SECRETS if n not in header)
    assert not missing and "infra/.env" in header, \
        f"expected the header to say how to set {sorted(COMPOSE_SECRETS)} (infra/.env), missing {missing}"

    ignored = {ln.strip() for ln in (REPO / ".gitignore").read_text().splitlines()}
    assert ignored & {".env", "infra/.env", "/infra/.env"}, \
        "expected .gitignore to keep infra/.env (the credentials) out of the repository, found no such pattern"

    # Where Docker Compose is installed (not on the project's machines), compose itself must agree.
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True, check=False).returncode == 0:
        def config(**secrets: str) -> subprocess.CompletedProcess:
            env = {**{k: v for k, v in os.environ.items() if k not in COMPOSE_SECRETS}, **secrets}
            return subprocess.run([docker, "compose", "-f", str(INFRA / "docker-compose.yaml"), "--env-file",
                                   os.devnull, "config", "--quiet"], capture_output=True, text=True, env=env,
                                  check=False, timeout=60)

        p = config()
        assert p.returncode != 0 and any(n in p.stderr for n in COMPOSE_SECRETS), \
            f"expected `docker compose config` to refuse without the credentials, found {p.returncode}: {p.stderr}"
        p = config(**{n: "x" * 12 for n in COMPOSE_SECRETS})
        assert p.returncode == 0, f"expected `docker compose config` to pass with them set, found {p.stderr}"


# -- nothing that nothing uses -------------------------------------------------------------------------

def test_no_ray_cluster():
    """infra/ray-cluster.yaml described a Ray cluster that no code path used: it is gone, and so is every
    mention of it."""
    assert not (INFRA / "ray-cluster.yaml").exists(), "expected infra/ray-cluster.yaml removed"
    roots = ["README.md", "Makefile", "pyproject.toml", "docs", "infra", "components", "flows", "tasks", "configs",
             "notebooks", "tests"]
    files = [f for r in roots for f in ([REPO / r] if (REPO / r).is_file() else (REPO / r).rglob("*"))
             if f.is_file() and f.suffix in {"", ".md", ".py", ".yaml", ".yml", ".json", ".toml", ".ipynb"}
             and f.resolve() != Path(__file__).resolve() and "__pycache__" not in f.parts]
    mentions = [str(f.relative_to(REPO)) for f in files if "ray-cluster" in f.read_text(errors="replace")]
    assert not mentions, f"expected no mention of ray-cluster, found it in {mentions}"
