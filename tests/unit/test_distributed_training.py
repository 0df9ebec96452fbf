"""Training across processes (`train_policy.processes`, `train_reward.processes`): N CPU processes on gloo under
`accelerate launch` train as one process does on the same global batch, and only the first writes.

    .venv/bin/python -m pytest tests/unit/test_distributed_training.py -q -n 0

The tolerance. Measured on a 2-core CPU (torch 2.13, transformers 5.23, trl 1.16, one torch thread a process;
8 steps of a global batch of 8, the loss logged every step), the largest relative difference between a loss the
2-process run logs and the one the 1-process run logs is 1.1e-7 for each of SFT, the classifier PRM and the
likelihood PRM (4.8e-7, 6.0e-8 and 9.5e-7 absolute): float32 rounding, the batch summed in two halves. The tests
allow 1e-5, ~90x that.
What a real fault gives is far outside it: the classifier PRM's loss scaled by N (transformers' token classifier
averages over its own process's steps while the Trainer takes it for a sum over all of them) came out 2x, a
relative difference of 1.03.

The classifier PRM's head has dropout (p=0.1, transformers' default for it), and each process draws its own masks
for its half of the batch, so its two curves differ by up to 4% (measured) with dropout on: the script turns
dropout off for that model, to compare the batch arithmetic alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import pytest

from components.models.tiny import TinyLlamaConfig, create_tiny_llama
from tests.conftest import REPO, TELEMETRY_OFF

SMALL = TinyLlamaConfig(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=192)
REL_TOL = 1e-5  # measured 1.1e-7 at most (module docstring)
KINDS = ("sft", "prm-likelihood", "prm")

# One process of the run: trains the three models on fixed data with the settings the stages pass, the loss
# logged every step, into the same folders whatever the rank (only the main process may write them).
SCRIPT = r'''
import atexit, json, os, random, sys

import torch
import torch.distributed as dist

init, out, result = sys.argv[1:4]
# Registered before the trainers' modules load, so it runs after their exit handlers (atexit is last in, first
# out): whether this process is still in its group as the interpreter is about to finalize.
atexit.register(lambda: open(f"{result}.exit{os.environ.get('RANK', '0')}", "w").write(
    "in group" if dist.is_initialized() else "left"))

torch.set_num_threads(1)
from components.domains.arith import ArithDomain
from components.rewards import prm
from components.training.sft import SFTParams, train_sft

D = ArithDomain()
problems = [p for level in (2, 3) for p in D.sample_problems(level, 8, 0)]  # 16: two global batches of 8
rng = random.Random(0)


def broken(p):
    steps = D.split_steps(D.reference_solution(p))
    k = rng.randrange(len(steps))
    steps[k] += "+"
    return steps


curves, metrics = {}, {}
curves["sft"] = []
metrics["sft"] = train_sft(init, [{"prompt": p.prompt, "completion": D.reference_solution(p)} for p in problems],
                           f"{out}/sft",
                           SFTParams(max_steps=8, batch_size=8, learning_rate=3e-3, logging_steps=1, seed=3),
                           progress_callback=lambda step, steps, loss: curves["sft"].append(loss))
examples = [{"prompt": p.prompt, "completions": steps, "labels": D.oracle_step_labels(p, "\n".join(steps) + "\n")}
            for p in problems for steps in (D.split_steps(D.reference_solution(p)), broken(p))]
logged = prm.losses
for kind in ("prm-likelihood", "prm"):
    head = "likelihood" if kind == "prm-likelihood" else "classifier"
    if head == "classifier":  # its head's dropout masks differ by process: off, to compare the arithmetic
        torch.nn.Dropout.forward = lambda self, x: x
    curves[kind] = []
    prm.losses = lambda history, kind=kind: curves[kind].extend(logged(history)) or logged(history)
    metrics[kind] = prm.train_prm(init, examples, f"{out}/{kind}", prm.PRMParams(
        max_steps=8, batch_size=8, learning_rate=3e-3, logging_steps=1, seed=3, head=head,
        lm_weight=1.0 if head == "likelihood" else 0.0))
if int(os.environ.get("RANK", "0")) == 0:
    with open(result, "w") as f:
        json.dump({"curves": curves, "metrics": metrics}, f)
'''


# Imported at start-up by every process of a job (PYTHONPATH): in any but the first, it records each file
# operation Python audits (open, mkdir, rmtree, rename, ...) on the attempt's folder or its .tmp.
WATCH = r'''
import os, sys

if os.environ.get("RANK", "0") != "0":
    _out, _log = os.environ["COEVO_TEST_OUT_DIR"], os.environ["COEVO_TEST_TOUCHED"]

    def _touched(event, args):
        if args and isinstance(args[0], (str, bytes, os.PathLike)) and (
                event == "open" or event.startswith(("os.", "shutil."))):
            path = os.fsdecode(args[0])
            if path == _out or path.startswith((_out + "/", _out + ".tmp")):
                with open(_log, "a") as f:
                    f.write(f"rank {os.environ['RANK']}: {event} {path}\n")

    sys.addaudithook(_touched)
    with open(_log + ".armed", "a") as f:  # the test checks the watch was on
        f.write(f"rank {os.environ['RANK']}\n")
'''


def _env(**extra: str) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO), **TELEMETRY_OFF, COEVO_TORCH_THREADS="1", OMP_NUM_THREADS="1",
                TOKENIZERS_PARALLELISM="false", PYTHONHASHSEED="0", **extra)


def _launch(tmp: Path, processes: int) -> list[str]:
    """The interpreter and the launcher arguments the job runner uses for `train_policy.processes`."""
    from components.jobs.launch import accelerate_launch_args

    spec = tmp / f"p{processes}.spec.json"
    spec.write_text(json.dumps({"config": {"train_policy": {"processes": processes}}}))
    return [sys.executable, *accelerate_launch_args("train_policy", spec)]


@pytest.fixture(scope="module")
def init(tmp_path_factory) -> str:
    return str(create_tiny_llama(SMALL, tmp_path_factory.mktemp("init"), seed=0))


@pytest.fixture(scope="module")
def runs(init, tmp_path_factory) -> dict[int, dict]:
    """{processes: {"curves", "metrics", "out"}} of the script under 1 and 2 processes."""
    tmp = tmp_path_factory.mktemp("runs")
    script = tmp / "train.py"
    script.write_text(SCRIPT)
    out = {}
    for n in (1, 2):
        cmd = [*_launch(tmp, n), str(script), init, str(tmp / f"out{n}"), str(tmp / f"result{n}.json")]
        # TMPDIR: torchrun leaves a log folder there for every launch (run_job gives a job a folder it removes)
        p = subprocess.run(cmd, env=_env(TMPDIR=str(tmp)), cwd=REPO, capture_output=True, text=True, timeout=300,
                           check=False)
        assert p.returncode == 0, f"{n} process(es) failed:\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
        out[n] = json.loads((tmp / f"result{n}.json").read_text()) | {"out": tmp / f"out{n}"}
    return out


def test_the_launcher_starts_n_processes_under_accelerate_and_one_plainly(tmp_path):
    one, two = _launch(tmp_path, 1), _launch(tmp_path, 2)
    assert one == [sys.executable]
    assert two[1:3] == ["-m", "accelerate.commands.launch"] and two[two.index("--num_processes") + 1] == "2"


@pytest.mark.parametrize("kind", KINDS)
def test_two_processes_log_the_loss_curve_of_one(runs, kind):
    one, two = runs[1]["curves"][kind], runs[2]["curves"][kind]
    assert len(one) == len(two) == 8, (one, two)
    worst = max(abs(a - b) / abs(a) for a, b in zip(one, two, strict=True))
    assert worst <= REL_TOL, f"{kind}: loss curves differ by {worst:.3g} relative (allowed {REL_TOL}):\n{one}\n{two}"
    assert runs[2]["metrics"][kind]["processes"] == 2 and "processes" not in runs[1]["metrics"][kind]
    assert runs[2]["metrics"][kind]["steps"] == runs[1]["metrics"][kind]["steps"] == 8


def test_each_process_leaves_its_group_before_the_interpreter_finalizes(runs):
    """Exiting inside a gloo group can abort the process after its work is done (common.leave_process_group)."""
    exits = {p.name.rsplit(".", 1)[1]: p.read_text() for p in runs[2]["out"].parent.glob("result2.json.exit*")}
    assert exits == {"exit0": "left", "exit1": "left"}, exits


def test_the_two_process_checkpoints_are_written_once_and_load(runs):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from components.rewards.prm import PRMScorer

    for kind in KINDS:  # the same files as one process writes: nothing from the second process beside them
        assert sorted(p.name for p in (runs[2]["out"] / kind).iterdir()) == \
            sorted(p.name for p in (runs[1]["out"] / kind).iterdir()), kind
    path = runs[2]["out"] / "sft"
    model, tok = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    ids = tok(["3+4\n"], return_tensors="pt")
    with torch.no_grad():
        new = model.generate(**ids, max_new_tokens=6, do_sample=False)[0, ids["input_ids"].shape[1]:]
    assert len(new) > 0
    scores = PRMScorer(str(runs[2]["out"] / "prm")).score_steps(["3+4\n"], [["3+4=7", "#### 7"]])
    assert len(scores[0]) == 2 and all(0 <= s <= 1 for s in scores[0])


# -- the real stage job, through the job runner -------------------------------------------------------------

def _committed(root: Path, stage: str, rnd: int, tables: dict[str, list[dict]]):
    """A published attempt of `stage` holding `tables`, and its InputRef, as the store would hand it to a spec."""
    from components.jobs.spec import InputRef
    from components.manifest import Manifest, StageOutputWriter, read_manifest
    from components.tables import SCHEMAS, to_table

    out = StageOutputWriter(root / f"r{rnd}" / stage / "a1", f"dd/r{rnd}/{stage}/a1")
    for name, rows in tables.items():
        out.write_table(name, to_table(name, [dict.fromkeys(SCHEMAS[name].names) | r for r in rows]))
    m = read_manifest(out.finish(Manifest(experiment="dd", round=rnd, stage=stage, attempt=1, config_hash="x",
                                          seed=0, code_version=None, inputs={})))
    return InputRef(rnd, stage, m.stage_run_id, str(out.final_dir), m.sha256,
                    {t: m.output_paths(out.final_dir, t) for t in tables})


def _selected(rnd: int, n: int) -> dict[str, list[dict]]:
    trajs = [{"trajectory_id": f"t{rnd}-{i}", "experiment_id": "dd", "round": rnd, "purpose": "train",
              "problem_id": f"p{i}", "sample_index": 0, "prompt": f"{i}+{i % 3}\n",
              "completion": f"{i}+{i % 3}={i + i % 3}\n#### {i + i % 3}\n", "num_tokens": 12} for i in range(n)]
    sel = [{"trajectory_id": t["trajectory_id"], "experiment_id": "dd", "round": rnd, "purpose": "policy_sft",
            "selected": True, "reason": "correct"} for t in trajs]
    return {"trajectories": trajs, "selections": sel}


def _train_policy_spec(tmp_path: Path, init: str, **train_policy) -> Path:
    """The spec of round 1's train_policy over 8 demonstrations (round 0) and 8 new selections, as the flow
    writes it beside the attempt's folder (`dd/r1/train_policy/a1`)."""
    from components.config import load_config_dict
    from components.jobs.spec import StageSpec
    from components.stages.train_policy import Inputs

    root = tmp_path / "dd"
    r0, r1 = _selected(0, 8), _selected(1, 8)
    inputs = [_committed(root, "bootstrap", 0, r0),
              _committed(root, "generate", 1, {"trajectories": r1["trajectories"]}),
              _committed(root, "filter", 1, {"selections": r1["selections"]})]
    cfg = load_config_dict({"experiment": "dd", "workdir": str(tmp_path), "train_policy": train_policy})
    out_dir = root / "r1" / "train_policy" / "a1"
    spec = StageSpec(experiment="dd", round=1, stage="train_policy", attempt=1, out_dir=str(out_dir), seed=7,
                     config=cfg.to_dict(), config_hash=cfg.config_hash(), inputs=inputs,
                     params=asdict(Inputs(init_uri=init, parent_model_id="dd/policy/r0", replay_ratio=1.0)))
    spec_path = out_dir.with_name("a1.spec.json")
    spec_path.parent.mkdir(parents=True)
    spec_path.write_text(spec.to_json())
    return spec_path


def test_a_train_policy_job_on_two_processes_publishes_once(init, tmp_path, monkeypatch):
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from components.jobs.launch import job_command, run_job
    from components.manifest import MANIFEST, verify_manifest

    spec_path = _train_policy_spec(tmp_path, init, steps=4, epochs=None, batch_size=8, learning_rate=3e-3,
                                   processes=2)
    out_dir = spec_path.with_name("a1")
    assert "accelerate.commands.launch" in job_command("train_policy", spec_path)
    scratch, watch, touched = tmp_path / "tmp", tmp_path / "watch", tmp_path / "touched.txt"
    scratch.mkdir()  # the second process's scratch goes here, and is removed
    watch.mkdir()
    (watch / "sitecustomize.py").write_text(WATCH)
    env = _env(TMPDIR=str(scratch), COEVO_TEST_OUT_DIR=str(out_dir), COEVO_TEST_TOUCHED=str(touched))
    for k, v in (env | {"PYTHONPATH": f"{watch}{os.pathsep}{REPO}"}).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # run_job makes the job's temporary folder in it
    lines: list[str] = []
    run_job("train_policy", spec_path, lines.append, timeout_s=300)

    assert sorted(p.name for p in out_dir.parent.iterdir()) == ["a1", "a1.spec.json"]  # no a1.tmp, one attempt
    assert Path(f"{touched}.armed").read_text() == "rank 1\n"  # the watch ran in the second process
    assert not touched.exists(), touched.read_text()  # which never touched a1 nor a1.tmp
    assert not list(scratch.iterdir())  # the job's temporary folder is gone, and with it torchrun's log folder
    assert sum("[train_policy] SFT on 16 examples" in line for line in lines) == 1, lines  # the first reports
    m = verify_manifest(out_dir / MANIFEST)
    assert [a["name"] for a in m.artifacts] == ["model"] and m.metrics["processes"] == 2 and m.metrics["steps"] == 4
    models = pq.read_table(out_dir / next(o["path"] for o in m.outputs if o["table"] == "models")).to_pylist()
    assert [r["uri"] for r in models] == [str(out_dir / "model")]
    model, tok = (cls.from_pretrained(out_dir / "model") for cls in (AutoModelForCausalLM, AutoTokenizer))
    ids = tok(["2+2\n"], return_tensors="pt")
    with torch.no_grad():
        assert model.generate(**ids, max_new_tokens=6, do_sample=False).shape[1] > ids["input_ids"].shape[1]


def test_a_job_killed_at_its_timeout_leaves_no_process_behind(init, tmp_path, monkeypatch):
    """`run_job` ends a job past its timeout with SIGKILL to the process it started, the launcher; torchrun's
    processes live in sessions of their own, so each must die with it (without that, both kept training), and
    neither must the second process's scratch nor torchrun's log folder (each run of this test left both in /tmp)."""
    import signal
    import time

    from components.jobs.launch import StageJobError, run_job

    spec_path = _train_policy_spec(tmp_path, init, steps=100_000, epochs=None, batch_size=8, processes=2)
    scratch = tmp_path / "tmp"  # the temporary folder of the test and of the job's processes
    scratch.mkdir()
    for k, v in _env(TMPDIR=str(scratch)).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    launcher: list[int] = []

    def log(line: str) -> None:  # step 1 took both processes (its gradients are summed over them): both train
        if "[train_policy] step 1/" in line:
            os.kill(launcher[0], signal.SIGKILL)  # as run_job's timeout does

    with pytest.raises(StageJobError, match="killed by signal 9"):
        run_job("train_policy", spec_path, log, timeout_s=300, on_start=launcher.append)
    left = ""
    for _ in range(20):
        left = subprocess.run(["pgrep", "-f", str(spec_path)], capture_output=True, text=True,
                              check=False).stdout.split()
        if not left:
            break
        time.sleep(0.5)
    for pid in left:  # the test's own processes: end them, then fail
        os.kill(int(pid), signal.SIGKILL)
    assert not left, f"processes of the killed job still running: {left}"
    # The second process could not remove its scratch, nor torchrun its log folder: run_job removed the job's
    # temporary folder, which holds both.
    assert not list(scratch.rglob("*")), sorted(scratch.rglob("*"))


# -- bad settings ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("overrides", "message"), [
    (["train_policy.processes=3"], r"train_policy\.processes=3 must divide train_policy\.batch_size=64"),
    (["train_policy.processes=128"], r"train_policy\.processes=128 exceeds train_policy\.batch_size=64"),
    (["train_reward.processes=5", "train_reward.batch_size=8"],
     r"train_reward\.processes=5 must divide train_reward\.batch_size=8"),
    (["train_policy.processes=2", "train_policy.method=sft+dpo", "filter.dpo_pairs=true",
      "train_policy.dpo.batch_size=5"], r"train_policy\.processes=2 must divide train_policy\.dpo\.batch_size=5"),
    (["train_policy.strategy=fsdp"], r"train_policy\.strategy=fsdp shards the model over processes"),
    (["train_policy.processes=0"], r"train_policy\.processes: Input should be greater than or equal to 1"),
])
def test_processes_that_cannot_split_the_batch_are_refused_naming_the_field(overrides, message):
    from components.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message):
        load_config(REPO / "configs/micro.yaml", overrides)


def test_the_defaults_leave_the_config_and_its_hash_as_they_were():
    from components.config import load_config

    cfg = load_config(REPO / "configs/micro.yaml")
    assert (cfg.train_policy.processes, cfg.train_policy.strategy) == (1, "ddp")
    assert not {"processes", "strategy"} & (set(cfg.to_dict()["train_policy"]) | set(cfg.to_dict()["train_reward"]))
    assert "model" not in cfg.to_dict()["train_reward"]  # train_reward.model at its default (null), likewise
    assert cfg.config_hash() == "06256a4c6525349a"  # micro.yaml's before the fields existed
    two = load_config(REPO / "configs/micro.yaml", ["train_policy.processes=2"])
    assert two.to_dict()["train_policy"]["processes"] == 2 and two.config_hash() != cfg.config_hash()


def test_a_batch_the_processes_cannot_split_fails_in_the_trainer_too(monkeypatch):
    from components.training.common import process_batch

    monkeypatch.setenv("WORLD_SIZE", "3")
    assert process_batch(6, "train_policy.batch_size", "train_policy") == 2
    with pytest.raises(ValueError, match=r"train_policy\.dpo\.batch_size=32 does not split over "
                                         r"train_policy\.processes=3"):
        process_batch(32, "train_policy.dpo.batch_size", "train_policy.dpo")


def test_fsdp_and_more_processes_than_gpus_are_refused_before_the_job_starts(tmp_path, monkeypatch):
    import torch

    from components.jobs.launch import StageJobError, accelerate_launch_args

    def spec(section: str, **settings) -> Path:
        path = tmp_path / f"{section}.spec.json"
        path.write_text(json.dumps({"config": {section: settings}}))
        return path

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(StageJobError, match=r"train_reward\.strategy=fsdp shards the model over CUDA GPUs"):
        accelerate_launch_args("train_reward", spec("train_reward", processes=2, strategy="fsdp"))
    cpu = accelerate_launch_args("train_reward", spec("train_reward", processes=2))
    assert "--multi_gpu" in cpu  # torchrun's launcher: accelerate's --cpu one starts a single process
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    fsdp = accelerate_launch_args("train_policy", spec("train_policy", processes=2, strategy="fsdp"))
    assert "--use_fsdp" in fsdp and fsdp[fsdp.index("--fsdp_state_dict_type") + 1] == "FULL_STATE_DICT"
    with pytest.raises(StageJobError, match=r"train_policy\.processes=4 needs a CUDA GPU per process; this "
                                            r"machine has 2"):
        accelerate_launch_args("train_policy", spec("train_policy", processes=4))
