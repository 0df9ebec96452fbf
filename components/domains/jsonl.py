"""`jsonl`: bring your own problems as a file (JSONL/JSON, Parquet, or a `datasets` save_to_disk dir), no Python.

Each row needs a question and an answer field; an answer checker chosen by name (`checkers.py`:
`numeric`, `exact`, `math`) reads and compares final answers. Levels come from `level_field`, else
from the length of the worked solution (lines of work before the answer line, like `gsm8k`), else
everything is level 1. Without a `test` file, a seeded split keyed by question text holds out
`test_fraction` of the problems. In YAML:

    domain:
      name: jsonl
      options: {train: ../shared/data/gsm8k/train.jsonl, test: ../shared/data/gsm8k/test.jsonl}

    d = JsonlDomain(train="math.parquet", answer_field="solution", checker="math", level_field="level")
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from components.domains.base import FileProblems, Problem, unique_problems
from components.domains.checkers import Checker, get_checker

_LEVEL = re.compile(r"\s*(?:level\s*)?(-?\d+)\s*", re.IGNORECASE)  # 3, "3", "Level 3"


def _answer_step(step: str) -> bool:
    """Is this step the final-answer step? A '####' line, or one holding a `\\boxed{}` answer.

    >>> _answer_step("#### 72"), _answer_step(r"so it is $\\boxed{5}$."), _answer_step("48/2 = 24")
    (True, True, False)
    """
    return step.startswith("####") or "\\boxed{" in step


def _clip(value: Any, n: int = 120) -> str:
    s = repr(value)
    return s if len(s) <= n else s[:n] + "…"


def _read_rows(path: Path, split: str) -> tuple[list[dict[str, Any]], str]:
    """The rows of a file or save_to_disk dir, and how to name the source in errors."""
    import datasets  # deferred: slow to import, and only file-backed domains need it

    if path.is_dir():
        try:
            data = datasets.load_from_disk(str(path))
        except Exception as e:  # datasets raises several kinds for a dir it cannot read
            raise ValueError(f"{path}: not a directory saved by datasets' save_to_disk ({e})") from e
        if isinstance(data, datasets.DatasetDict):
            if split not in data:
                raise ValueError(f"{path}: no split {split!r} in this DatasetDict; it has {sorted(data)}")
            return data[split].to_list(), f"{path} [split {split!r}]"
        return data.to_list(), str(path)
    suffix = path.suffix.lower()
    kind = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}.get(suffix)
    if kind is None:
        raise ValueError(f"{path}: unsupported file type {suffix!r}; use .jsonl, .json, .parquet or a save_to_disk dir")
    try:
        rows = datasets.load_dataset(kind, data_files=str(path), split="train")
    except Exception as e:  # malformed JSON, mixed column types, bad Parquet: all the user's file
        raise ValueError(f"{path}: cannot read as {kind}: {e}") from e
    return rows.to_list(), str(path)


def _has_split(path: Path, split: str) -> bool:
    """Is `path` a DatasetDict dir with `split` in it?"""
    import json

    meta = path / "dataset_dict.json"
    return path.is_dir() and meta.is_file() and split in json.loads(meta.read_text()).get("splits", [])


@dataclass
class JsonlDomain(FileProblems):
    train: str | Path
    test: str | Path | None = None  # None: a `test_split` of a DatasetDict `train` dir, else a seeded split
    question_field: str = "question"
    answer_field: str = "answer"
    solution_field: str | None = None  # worked solutions; without one, a worked answer field serves
    checker: str = "numeric"  # 'numeric', 'exact' or 'math' (components/domains/checkers.py)
    level_field: str | None = None  # integer levels (3 or "Level 3"); None: from solution length
    answer_pattern: str | None = None  # regex, group 1 is the answer; None: after the last '####' if any
    step_separator: str = "\n"
    max_level: int = 8  # solution-length levels above this share the top level
    prompt_template: str | None = None  # str.format template with {question}; None: the question + "\n"
    test_fraction: float = 0.1  # held out when there is no test file
    split_seed: int = 0
    train_split: str = "train"  # split names inside save_to_disk DatasetDict dirs
    test_split: str = "test"
    test_size: int | None = None  # held-out problems per level, in file order; None keeps them all
    name: str = "jsonl"  # problem ids hash this, so two datasets coexist under different names
    _checker: Checker = field(init=False, repr=False)
    _pattern: re.Pattern | None = field(default=None, init=False, repr=False)
    _train: list[Problem] = field(default_factory=list, init=False, repr=False)
    _test: list[Problem] = field(default_factory=list, init=False, repr=False)
    _by_question: dict[str, Problem] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self._checker = get_checker(self.checker)
        if not self.step_separator:
            raise ValueError("jsonl: step_separator must be a non-empty string")
        if self.max_level < 1:
            raise ValueError(f"jsonl: max_level must be >= 1, got {self.max_level}")
        if not 0.0 < self.test_fraction < 1.0:
            raise ValueError(f"jsonl: test_fraction must be in (0, 1), got {self.test_fraction}")
        if self.test_size is not None and self.test_size < 0:
            raise ValueError(f"jsonl: test_size must be >= 0 or None, got {self.test_size}")
        if self.answer_pattern is not None:
            try:
                self._pattern = re.compile(self.answer_pattern)
            except re.error as e:
                raise ValueError(f"jsonl: answer_pattern {self.answer_pattern!r} is not a valid regex: {e}") from e
            if self._pattern.groups < 1:
                raise ValueError(f"jsonl: answer_pattern {self.answer_pattern!r} needs a group: group 1 is the answer")
        if self.prompt_template is not None:
            try:
                self.prompt_template.format(question="")
            except (KeyError, IndexError, ValueError) as e:
                raise ValueError(f"jsonl: prompt_template must be a str.format template with only {{question}}: {e!r}") from e
        train_path = Path(self.train)
        test_path = Path(self.test) if self.test is not None else None
        for p in (train_path, test_path):
            if p is not None and not p.exists():
                raise FileNotFoundError(f"jsonl: file not found: {p}")
        train = self._load(train_path, self.train_split, "train")
        if test_path is None and _has_split(train_path, self.test_split):
            test_path = train_path
        if test_path is not None:
            test = self._load(test_path, self.test_split, "test")
        else:
            train, test = self._seeded_split(train)
        test_prompts = {p.prompt for p in test}
        # A test question never becomes training data, even when the two files overlap.
        self._train = [p for p in train if p.prompt not in test_prompts]
        self._test = test
        for p in self._test + self._train:
            self._by_question.setdefault(p.meta["question"], p)
            self._by_question.setdefault(p.prompt.strip(), p)

    # -- loading ----------------------------------------------------------------------------------

    def _load(self, path: Path, split_name: str, split: str) -> list[Problem]:
        rows, source = _read_rows(path, split_name)
        if not rows:
            raise ValueError(f"{source}: no rows: expected one problem a row")
        return unique_problems([self._problem(row, i, source, split) for i, row in enumerate(rows, start=1)])

    def _problem(self, row: dict[str, Any], i: int, source: str, split: str) -> Problem:
        def bad(field_name: str, what: str) -> ValueError:
            return ValueError(f"{source}: row {i}: field {field_name!r}: {what}")

        question = row.get(self.question_field)
        if not isinstance(question, str) or not question.strip():
            raise bad(self.question_field, f"expected a non-empty string question, got {_clip(question)}")
        raw = row.get(self.answer_field)
        if raw is None:
            raise bad(self.answer_field, "missing: expected the answer")
        text, worked = self._answer_text(raw)
        if text is None:
            raise bad(self.answer_field, f"answer_pattern {self.answer_pattern!r} does not match {_clip(raw)}")
        try:
            answer = self._checker.parse_reference(text)
        except ValueError as e:
            raise bad(self.answer_field, f"checker {self.checker!r} cannot parse the answer {_clip(raw)}: {e}") from e
        if self.solution_field is not None:
            solution = row.get(self.solution_field)
            if not isinstance(solution, str) or not solution.strip():
                raise bad(self.solution_field, f"expected a non-empty string solution, got {_clip(solution)}")
        else:
            solution = raw if worked else None
        q = question.strip()
        prompt = self.prompt_template.format(question=q) if self.prompt_template is not None else q + "\n"
        meta: dict[str, Any] = {"split": split, "row": i, "source": source, "question": q}
        if solution is None:
            meta["solution"] = f"#### {answer}\n"
            level = 1
        else:
            meta["solution"] = self._gold(solution, answer)
            level = min(max(self._work_steps(meta["solution"]), 1), self.max_level)
        if self.level_field is not None:
            level = self._level(row.get(self.level_field), bad)
        return Problem.make(self.name, level, prompt, answer, meta)

    def _answer_text(self, raw: Any) -> tuple[str | None, bool]:
        """(the answer part of the answer field, is the field a worked solution around it?)."""
        if not isinstance(raw, str):
            return raw, False
        if self._pattern is not None:
            m = self._pattern.search(raw)
            if m is None or m.group(1) is None:
                return None, False
            return m.group(1).strip(), bool(raw[:m.start(1)].strip())
        if "####" in raw:
            head, _, tail = raw.rpartition("####")
            return tail.strip(), bool(head.strip())
        # A MATH-style solution with its answer boxed at the end is a worked solution too.
        return raw, "\\boxed{" in raw and bool(re.sub(r"\\boxed\{.*\}|\$", "", raw, flags=re.S).strip(" .\n"))

    def _gold(self, solution: str, answer: str) -> str:
        """The worked solution, ending in a line the checker reads as `answer` ('#### answer' added if not)."""
        text = solution.strip() + "\n"
        got = self._checker.extract(text)
        if got is None or not self._checker.equal(got, answer):
            text += f"#### {answer}\n"
        return text

    def _work_steps(self, solution: str) -> int:
        steps = self.split_steps(solution)
        return len(steps) - bool(steps and _answer_step(steps[-1]))

    def _level(self, value: Any, bad) -> int:
        if isinstance(value, bool):
            raise bad(self.level_field, f"expected an integer level (3 or 'Level 3'), got {_clip(value)}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        m = _LEVEL.fullmatch(value) if isinstance(value, str) else None
        if m is None:
            raise bad(self.level_field, f"expected an integer level (3 or 'Level 3'), got {_clip(value)}")
        return int(m[1])

    def _seeded_split(self, problems: list[Problem]) -> tuple[list[Problem], list[Problem]]:
        """Hold out the `test_fraction` whose hash of (seed, question) is smallest: file order plays no part."""
        def key(p: Problem) -> tuple[str, str]:
            return hashlib.sha256(f"{self.split_seed}\x1f{p.meta['question']}".encode()).hexdigest(), p.problem_id

        ranked = sorted(problems, key=key)
        k = min(max(round(len(ranked) * self.test_fraction), 1), len(ranked) - 1) if len(ranked) > 1 else 0
        held = {p.problem_id for p in ranked[:k]}
        for p in ranked[:k]:
            p.meta["split"] = "test"
        # File order within each side, so the test set reads like the file.
        return [p for p in problems if p.problem_id not in held], [p for p in problems if p.problem_id in held]

    # -- the Domain protocol ------------------------------------------------------------------------

    def split_steps(self, completion: str) -> list[str]:
        """Non-empty (stripped) pieces between step separators, up to and including the answer step."""
        steps = []
        for piece in completion.split(self.step_separator):
            piece = piece.strip()
            if piece:
                steps.append(piece)
                if _answer_step(piece):
                    break
        return steps

    def extract_answer(self, completion: str) -> str | None:
        return self._checker.extract(completion)

    def verify(self, completions: list[str], references: list[str]) -> list[float | None]:
        """1.0 where the checker finds the reference answer, else 0.0."""
        return self._checker.verify(completions, references)

    def find_problem(self, question: str) -> Problem | None:
        """The problem (train or test) whose question, or prompt, is `question` after stripping."""
        return self._by_question.get(question.strip())

    def check_steps(self, prompt: str, completion: str) -> None:
        return None

    def oracle_step_labels(self, problem: Problem, completion: str) -> None:
        """No step-level ground truth; step labels come from Monte Carlo rollouts instead."""
        return None
