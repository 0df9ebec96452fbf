"""`gsm8k`: grade-school math word problems (Cobbe et al., 2021) from local JSONL, no network.

Each row is `{"question": ..., "answer": "...\\n#### 42"}`; `<<a*b=c>>` calculator annotations are
stripped from the worked solution. Files are read through `datasets.load_dataset("json", ...)`.
`split_steps`, `extract_answer` and `verify` are pure module functions, usable by dotted path
(`components.domains.gsm8k:verify`); the domain exposes them as methods.

    d = Gsm8kDomain("tests/data/gsm8k/train.jsonl", "tests/data/gsm8k/test.jsonl")  # the subset shipped for tests
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from components.domains.base import FileProblems, Problem, verify_answers

MAX_LEVEL = 8  # longer solutions are rare (~0.2% of train) and share the top level
_ANNOTATION = re.compile(r"<<[^>]*>>")
# A minus sign counts only when no digit precedes it, so "16-3" yields 16 and 3, not -3.
_NUMBER = re.compile(r"(?<!\d)-?\d(?:[\d,]*\d)?(?:\.\d+)?")


def _number(text: str) -> str:
    return text.replace(",", "")


def _clean_solution(answer: str) -> str:
    return _ANNOTATION.sub("", answer).strip() + "\n"  # trailing newline, like arith's completions


def _reasoning_lines(solution: str) -> int:
    """Lines before the '####' line; like arith, the level counts work steps, not the answer line."""
    n = 0
    for line in solution.splitlines():
        if line.strip().startswith("####"):
            break
        n += bool(line.strip())
    return n


def _load(path: Path, split: str) -> list[Problem]:
    if not path.is_file():
        raise FileNotFoundError(f"gsm8k {split} file not found: {path}")
    import datasets  # deferred: only this domain needs it, and it is slow to import

    rows = datasets.load_dataset("json", data_files=str(path), split="train")
    problems = []
    for i, row in enumerate(rows, start=1):
        question, answer = row.get("question"), row.get("answer")
        if not isinstance(question, str) or not isinstance(answer, str) or "####" not in answer:
            raise ValueError(f"{path}: row {i} needs string 'question' and 'answer' fields, the answer ending in '#### <number>'")
        solution = _clean_solution(answer)
        level = min(max(_reasoning_lines(solution), 1), MAX_LEVEL)
        final = _number(answer.rsplit("####", 1)[1].strip())
        meta = {"split": split, "row": i, "solution": solution}
        problems.append(Problem.make("gsm8k", level, question.strip() + "\n", final, meta))
    return problems


def split_steps(completion: str) -> list[str]:
    """Non-empty (stripped) lines up to and including the first '####' line."""
    steps = []
    for line in completion.splitlines():
        line = line.strip()
        if line:
            steps.append(line)
            if line.startswith("####"):
                break
    return steps


def extract_answer(completion: str) -> str | None:
    """The number after the last '####', commas stripped; without one, the last number in the text.

    The fallback accepts other answer styles ("A: 18", "The answer is 18.") at the cost of
    reading a number out of truncated text; such text is rarely right, so the cost is small.

    >>> extract_answer("x\\n#### $1,200.50"), extract_answer("16-3 = 13\\nA: -13."), extract_answer("none")
    ('1200.50', '-13', None)
    """
    _, sep, tail = completion.rpartition("####")
    if sep:
        m = _NUMBER.search(tail)
        if m:
            return _number(m[0])
    numbers = _NUMBER.findall(completion)
    return _number(numbers[-1]) if numbers else None


def verify(completions: list[str], references: list[str]) -> list[float | None]:
    """1.0 if the extracted number equals the reference within 1e-6, else 0.0.

    >>> verify(["so 2+3 = 5\\n#### 5", "#### 5.0000001", "#### 6", "no idea"], ["5", "5", "5", "5"])
    [1.0, 1.0, 0.0, 0.0]
    """
    return verify_answers("gsm8k", completions, references, extract_answer,
                          lambda got, ref: abs(float(got) - float(_number(ref))) <= 1e-6)


@dataclass
class Gsm8kDomain(FileProblems):
    train_path: str | Path
    test_path: str | Path
    test_size: int | None = None  # held-out problems per level, in file order; None keeps them all
    name: str = field(default="gsm8k", init=False)
    step_separator: str = field(default="\n", init=False)  # one step a line
    _train: list[Problem] = field(default_factory=list, init=False, repr=False)
    _test: list[Problem] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.test_size is not None and self.test_size < 0:
            raise ValueError(f"gsm8k: test_size must be >= 0 or None, got {self.test_size}")
        self._test = _load(Path(self.test_path), "test")
        test_prompts = {p.prompt for p in self._test}
        # Guard against overlap between the two files: a test question never becomes training data.
        self._train = [p for p in _load(Path(self.train_path), "train") if p.prompt not in test_prompts]

    split_steps = staticmethod(split_steps)
    extract_answer = staticmethod(extract_answer)
    verify = staticmethod(verify)

    def check_steps(self, prompt: str, completion: str) -> None:
        return None

    def oracle_step_labels(self, problem: Problem, completion: str) -> None:
        """GSM8K has no step-level ground truth; step labels come from Monte Carlo rollouts instead."""
        return None
