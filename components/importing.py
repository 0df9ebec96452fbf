"""Import existing trajectories: read a user's file, find each one's problem, re-verify, build store rows.

    spec = ImportSpec(models=["6b_finetuning", "6b_verification", "175b_finetuning", "175b_verification"])
    trajs = read_trajectories("../shared/data/gsm8k/example_model_solutions.jsonl", spec)
    result = match_and_verify(trajs, Gsm8kDomain(train, test), "exp", 1)
    print(result.summary())
    to_table("trajectories", result.trajectories)  # and problems, steps, verifications, step_labels

Two layouts are read. Simple: one trajectory a row, `{"question", "completion", "correct"?, "step_labels"?}`.
Wide (`ImportSpec.models`): one trajectory per (row, model key), each key naming a sub-object
`{"solution", "is_correct"}`, as in GSM8K's `example_model_solutions.jsonl`.

A given correctness label is never trusted: every trajectory is re-verified with `domain.verify`, the
given label is kept in the lineage, and the two are compared in an agreement report. Pure: nothing
here touches the store; the caller commits the rows.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from components.domains.base import Domain, Problem
from components.generation import problem_row
from components.verification import resolve_verifier, verify

MAX_MISSES_SHOWN = 5  # unmatched trajectories named in the error; the rest are counted


@dataclass
class ImportSpec:
    """Where the fields are in the user's file. Field names are top-level keys of a row."""

    prompt_field: str = "question"  # the problem text; matched against the domain's prompts, stripped
    completion_field: str = "completion"  # simple layout: the solution text
    correct_field: str | None = None  # simple layout: given label, bool or 0/1 (null: unlabelled)
    step_labels_field: str | None = None  # simple layout: one bool or 0/1 per step of `domain.split_steps`
    model_field: str | None = None  # simple layout: the model that wrote the row, recorded as its source
    # Wide layout: one trajectory per (row, key); each key names a sub-object holding the fields below.
    models: list[str] | None = None
    nested_completion: str = "solution"
    nested_correct: str | None = "is_correct"
    nested_step_labels: str | None = None

    def __post_init__(self):
        if self.models is not None:
            if not self.models or not all(isinstance(m, str) and m for m in self.models):
                raise ValueError(f"ImportSpec.models must be a non-empty list of field names, got {self.models!r}")
            if len(set(self.models)) != len(self.models):
                raise ValueError(f"ImportSpec.models names a key twice: {self.models!r}")
        for name in ("prompt_field", "completion_field", "nested_completion"):
            if not getattr(self, name):
                raise ValueError(f"ImportSpec.{name} must name a field")


@dataclass(frozen=True)
class ImportedTrajectory:
    question: str
    completion: str  # as written in the file; normalisation happens in `match_and_verify`
    correct: bool | None  # the given label, None if the file has none
    step_labels: list[bool] | None
    source_file: str
    source_row: int  # 1-based: the line of a JSONL file, the row of a Parquet file
    source_model: str | None  # the wide layout's key, or `model_field`'s value


# -- reading ---------------------------------------------------------------------------------------

def _rows(path: Path) -> list[tuple[int, Any]]:
    if not path.is_file():
        raise FileNotFoundError(f"import: file not found: {path}")
    suffix = path.suffix.lower()
    if suffix in (".parquet", ".pq"):
        import pyarrow.parquet as pq

        return list(enumerate(pq.read_table(path).to_pylist(), start=1))
    if suffix not in (".jsonl", ".ndjson", ".json"):
        raise ValueError(f"import: {path}: expected a .jsonl or .parquet file")
    rows = []
    with path.open(encoding="utf-8") as f:
        for i, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rows.append((i, json.loads(line)))
            except json.JSONDecodeError as e:
                raise ValueError(f"import: {path}: row {i} is not valid JSON: {e}") from None
    return rows


def _field(obj: Any, key: str, where: str) -> Any:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected an object with field {key!r}, got {type(obj).__name__}")
    if key not in obj:
        raise ValueError(f"{where}: missing field {key!r} (fields: {sorted(obj)})")
    return obj[key]


def _text(value: Any, key: str, where: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{where}: field {key!r} must be a string, got {type(value).__name__}")
    return value


def _label(value: Any, key: str, where: str) -> bool | None:
    if value is None:
        return None
    if isinstance(value, (bool, int, float)) and value in (0, 1):
        return bool(value)
    raise ValueError(f"{where}: field {key!r} must be a bool or 0/1, got {value!r}")


def _labels(value: Any, key: str, where: str) -> list[bool] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise ValueError(f"{where}: field {key!r} must be a list of bools or 0/1, got {type(value).__name__}")
    labels = [_label(v, key, where) for v in value]
    if None in labels:
        raise ValueError(f"{where}: field {key!r} has a null step label")
    return labels


def read_trajectories(path: str | Path, spec: ImportSpec) -> list[ImportedTrajectory]:
    """Every trajectory in a JSONL or Parquet file, in file order; a missing or mistyped field is an
    error naming the file and the row."""
    path = Path(path)
    out = []
    for i, row in _rows(path):
        where = f"import: {path}: row {i}"
        question = _text(_field(row, spec.prompt_field, where), spec.prompt_field, where)
        if spec.models is None:
            model = None
            if spec.model_field is not None:
                model = _text(_field(row, spec.model_field, where), spec.model_field, where)
            out.append(ImportedTrajectory(
                question=question,
                completion=_text(_field(row, spec.completion_field, where), spec.completion_field, where),
                correct=None if spec.correct_field is None
                else _label(_field(row, spec.correct_field, where), spec.correct_field, where),
                step_labels=None if spec.step_labels_field is None
                else _labels(_field(row, spec.step_labels_field, where), spec.step_labels_field, where),
                source_file=str(path), source_row=i, source_model=model))
            continue
        for model in spec.models:
            sub = _field(row, model, where)
            at = f"{where}, {model!r}"
            out.append(ImportedTrajectory(
                question=question,
                completion=_text(_field(sub, spec.nested_completion, at), spec.nested_completion, at),
                correct=None if spec.nested_correct is None
                else _label(_field(sub, spec.nested_correct, at), spec.nested_correct, at),
                step_labels=None if spec.nested_step_labels is None
                else _labels(_field(sub, spec.nested_step_labels, at), spec.nested_step_labels, at),
                source_file=str(path), source_row=i, source_model=model))
    return out


# -- normalisation ---------------------------------------------------------------------------------

_ANNOTATION = re.compile(r"<<[^>]*>>")
_A_LINE = re.compile(r"^\s*A:\s*(.*?)\s*$")


def normalize_gsm8k(completion: str) -> str:
    """GSM8K's released model solutions to the dataset's own format: calculator annotations stripped
    and a final 'A: <answer>' line written as '#### <answer>', so `split_steps` ends there as it does
    on the gold solutions. Other text is left alone.

    >>> normalize_gsm8k("16 - 3 = <<16-3=13>>13 left\\nA: 13")
    '16 - 3 = 13 left\\n#### 13\\n'
    >>> normalize_gsm8k("so 5\\n#### 5\\n")
    'so 5\\n#### 5\\n'
    """
    lines = _ANNOTATION.sub("", completion).strip().splitlines()
    if lines and "####" not in completion and (m := _A_LINE.match(lines[-1])):
        lines[-1] = f"#### {m[1]}"
    return "\n".join(lines) + "\n"  # trailing newline, like the domain's reference solutions


# The normalisation hook: a domain's `normalize_completion(text) -> text` method if it has one, else
# the function here for its name, else none. Needed only where a file's format differs from the one
# the domain's `split_steps` and `verify` read.
NORMALIZERS: dict[str, Callable[[str], str]] = {"gsm8k": normalize_gsm8k}


def normalizer_for(domain: Domain) -> Callable[[str], str]:
    own = getattr(domain, "normalize_completion", None)
    if callable(own):
        return own
    return NORMALIZERS.get(domain.name, lambda text: text)


# -- matching --------------------------------------------------------------------------------------

def _key(question: str) -> str:
    return question.strip()


def problem_index(domain: Domain) -> dict[str, tuple[Problem, str]]:
    """Stripped prompt -> (problem, split) over every problem the domain can enumerate: its test sets
    at every level, then whatever full splits it keeps (`_test`, `_train` lists, as `Gsm8kDomain` has;
    its `test_set` is capped by `test_size` and by the levels with training problems). The first
    occurrence wins, so a question in both splits counts as test."""
    index: dict[str, tuple[Problem, str]] = {}
    pools: list[tuple[list[Problem], str]] = [(domain.test_set(level), "test") for level in domain.levels()]
    pools += [(getattr(domain, attr), split) for attr, split in (("_test", "test"), ("_train", "train"))
              if isinstance(getattr(domain, attr, None), list)]
    for problems, split in pools:
        for p in problems:
            index.setdefault(_key(p.prompt), (p, p.meta.get("split", split)))
    return index


def _finder(domain: Domain) -> Callable[[str], tuple[Problem, str] | None]:
    """The domain's own `find_problem(question) -> Problem | None` where it has one, else an index."""
    find = getattr(domain, "find_problem", None)
    if callable(find):
        def found(question: str) -> tuple[Problem, str] | None:
            p = find(question)
            return None if p is None else (p, p.meta.get("split", "train"))
        return found
    return problem_index(domain).get


def import_trajectory_id(experiment: str, round: int, source_file: str, source_row: int, source_model: str | None) -> str:
    """Stable id from where the trajectory came from: reimporting the same file gives the same ids.
    The file's name, not its path, so moving the file changes nothing.

    >>> import_trajectory_id("e", 1, "/a/x.jsonl", 3, "6b") == import_trajectory_id("e", 1, "/b/x.jsonl", 3, "6b")
    True
    """
    key = f"import|{experiment}|{round}|{Path(source_file).name}|{source_row}|{source_model or ''}".encode()
    return hashlib.sha256(key).hexdigest()[:24]


# -- the result ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Agreement:
    """Given labels against the verifier. `agree` and `rate` count only trajectories with a given label."""

    imported: int = 0
    labelled: int = 0  # with a given label
    given_right: int = 0
    verifier_right: int = 0
    agree: int = 0

    @property
    def rate(self) -> float | None:
        return self.agree / self.labelled if self.labelled else None

    def add(self, given: bool | None, verified: bool | None) -> Agreement:
        return Agreement(self.imported + 1, self.labelled + (given is not None), self.given_right + bool(given),
                         self.verifier_right + bool(verified),
                         self.agree + (given is not None and given == verified))


@dataclass
class ImportResult:
    # Store rows, exactly `components.tables` columns less `stage_run_id`.
    problems: list[dict[str, Any]]
    trajectories: list[dict[str, Any]]
    steps: list[dict[str, Any]]
    verifications: list[dict[str, Any]]
    step_labels: list[dict[str, Any]]
    # Per trajectory: {"trajectory_id", "source_file", "source_row", "source_model", "given_correct",
    # "original_completion" (None where normalisation changed nothing)}. The trajectories table has no
    # column for it yet.
    lineage: list[dict[str, Any]]
    overall: Agreement
    by_model: dict[str, Agreement]  # key: source model, "-" where none
    confusion: dict[tuple[bool | None, bool | None], int]  # (given, verifier) -> count
    by_split: dict[str, int] = field(default_factory=dict)  # trajectories per split of their problems

    def tables(self) -> dict[str, list[dict[str, Any]]]:
        return {"problems": self.problems, "trajectories": self.trajectories, "steps": self.steps,
                "verifications": self.verifications, "step_labels": self.step_labels}

    def metrics(self) -> dict[str, float]:
        m: dict[str, float] = {"imported": self.overall.imported, "labelled": self.overall.labelled,
                               "verifier_right": self.overall.verifier_right, "given_right": self.overall.given_right,
                               "agree": self.overall.agree}
        if self.overall.rate is not None:
            m["agreement"] = self.overall.rate
        m |= {f"agreement_{k}": a.rate for k, a in self.by_model.items() if a.rate is not None}
        m |= {f"imported_{split}": n for split, n in self.by_split.items()}
        return m

    def summary(self) -> str:
        def pct(n: int, d: int) -> str:
            return f"{100 * n / d:.1f}%" if d else "-"

        def line(name: str, a: Agreement) -> str:
            rate = "-" if a.rate is None else f"{100 * a.rate:.1f}%"
            return (f"{name:<20} {a.imported:>8} {a.labelled:>8} {pct(a.given_right, a.labelled):>8} "
                    f"{pct(a.verifier_right, a.imported):>8} {a.agree:>8} {rate:>8}")

        splits = ", ".join(f"{n} {s}" for s, n in sorted(self.by_split.items()))
        out = [f"imported {self.overall.imported} trajectories on {len(self.problems)} problems ({splits})",
               f"{'source model':<20} {'n':>8} {'labelled':>8} {'given ok':>8} {'verif ok':>8} {'agree':>8} {'rate':>8}"]
        out += [line(name, a) for name, a in sorted(self.by_model.items())]
        out.append(line("all", self.overall))

        def cell(v: bool | None) -> str:
            return "none" if v is None else str(v).lower()

        out.append("given \\ verifier      true    false     none")
        for g in (True, False, None):
            counts = [self.confusion.get((g, v), 0) for v in (True, False, None)]
            if g is not None or any(counts):
                out.append(f"{cell(g):<17} " + " ".join(f"{c:>8}" for c in counts))
        return "\n".join(out)


def match_and_verify(trajs: list[ImportedTrajectory], domain: Domain, experiment: str, round: int, *,
                     purpose: str = "train", verifier_version: str = "dev", step_label_source: str = "given",
                     normalize: Callable[[str], str] | None = None) -> ImportResult:
    """Store rows for imported trajectories, re-verified by the domain, with the agreement report.

    Each trajectory's problem is found by its stripped question; any miss fails the whole import,
    naming the first few. Completions pass through `normalize` (default: `normalizer_for(domain)`)
    before segmentation and verification; the original text stays in the lineage. Given step labels
    must number exactly the domain's steps. `purpose` is the trajectories' `purpose` column; the
    verifier row is the verify stage's (`<domain>.verify`). Rows for a problem repeat once per problem.
    """
    find = _finder(domain)
    normalize = normalize or normalizer_for(domain)
    found = [find(_key(t.question)) for t in trajs]
    misses = [t for t, f in zip(trajs, found) if f is None]
    if misses:
        shown = "; ".join(f"{Path(t.source_file).name} row {t.source_row}: {_key(t.question)[:60]!r}"
                          for t in misses[:MAX_MISSES_SHOWN])
        more = f" (and {len(misses) - MAX_MISSES_SHOWN} more)" if len(misses) > MAX_MISSES_SHOWN else ""
        raise ValueError(f"import: {len(misses)} of {len(trajs)} trajectories have no problem in domain "
                         f"{domain.name!r}: {shown}{more}")

    problems: dict[str, dict[str, Any]] = {}
    rows, steps, labels, lineage = [], [], [], []
    per_problem: Counter[str] = Counter()
    by_split: Counter[str] = Counter()
    for t, (p, split) in zip(trajs, found):
        tid = import_trajectory_id(experiment, round, t.source_file, t.source_row, t.source_model)
        completion = normalize(t.completion)
        problems.setdefault(p.problem_id, problem_row(p, split))
        by_split[split] += 1
        rows.append({
            "trajectory_id": tid, "experiment_id": experiment, "round": round, "purpose": purpose,
            "problem_id": p.problem_id, "level": p.level,
            "policy_model_id": None if t.source_model is None else f"external:{t.source_model}",
            "sample_index": per_problem[p.problem_id], "prompt": p.prompt, "completion": completion,
            "answer": domain.extract_answer(completion), "num_tokens": 0, "finish_reason": "import",
            "temperature": None, "top_p": None, "max_new_tokens": None, "seed": None, "token_ids": None,
        })
        per_problem[p.problem_id] += 1
        texts = domain.split_steps(completion)
        steps += [{"trajectory_id": tid, "step_index": k, "text": s} for k, s in enumerate(texts)]
        if t.step_labels is not None:
            if len(t.step_labels) != len(texts):
                raise ValueError(f"import: {t.source_file}: row {t.source_row}: {len(t.step_labels)} step labels "
                                 f"but the {domain.name} domain splits the completion into {len(texts)} steps")
            labels += [{"trajectory_id": tid, "step_index": k, "source": step_label_source,
                        "value": 1.0 if ok else 0.0, "num_rollouts": 0} for k, ok in enumerate(t.step_labels)]
        lineage.append({"trajectory_id": tid, "source_file": t.source_file, "source_row": t.source_row,
                        "source_model": t.source_model, "given_correct": t.correct,
                        "original_completion": None if completion == t.completion else t.completion})
    dupes = [tid for tid, n in Counter(r["trajectory_id"] for r in rows).items() if n > 1]
    if dupes:
        raise ValueError(f"import: {len(dupes)} trajectories share an id (the same file name, row and model "
                         f"imported twice into round {round})")

    name, fn = resolve_verifier(domain, None)
    answers = {pid: p["answer"] for pid, p in problems.items()}
    vers = verify(rows, answers, fn, name=name, version=verifier_version)

    overall, by_model = Agreement(), defaultdict(Agreement)
    confusion: Counter[tuple[bool | None, bool | None]] = Counter()
    for t, v in zip(trajs, vers):
        overall = overall.add(t.correct, v["correct"])
        by_model[t.source_model or "-"] = by_model[t.source_model or "-"].add(t.correct, v["correct"])
        confusion[(t.correct, v["correct"])] += 1
    return ImportResult(list(problems.values()), rows, steps, vers, labels, lineage, overall, dict(by_model),
                        dict(confusion), dict(by_split))
