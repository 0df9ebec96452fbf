"""`arith`: synthetic multi-step integer arithmetic with exact per-step truth.

The text format is short because the embedded tiny model is character-level:

    prompt      "3+4-2+5\\n"
    completion  "3+4=7\\n7-2=5\\n5+5=10\\n#### 10\\n"

One step per line carries the running total; negative intermediates are written plainly
("2-5=-3\\n-3+4=1\\n#### 1\\n"). The level is the number of +/- operations. Because every step has a
known truth, `oracle_step_labels` lets us measure PRM quality exactly. `split_steps`,
`extract_answer` and `verify` are pure module functions (`components.domains.arith:verify`).

    >>> d = ArithDomain()
    >>> p = d.sample_problems(level=3, n=1, seed=0)[0]
    >>> d.verify([d.reference_solution(p)], [p.answer])
    [1.0]
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from components.domains.base import Problem, verify_answers

_EQUATION = re.compile(r"(-?\d+)([+-])(\d+)=(-?\d+)")
_INTEGER = re.compile(r"-?\d+")
_TOKEN = re.compile(r"\d+|[+-]")


def _answer_line(line: str) -> bool:
    return line.startswith("####")


def _running_totals(operands: list[int], ops: list[str]) -> list[int]:
    totals = [operands[0]]
    for op, b in zip(ops, operands[1:]):
        totals.append(totals[-1] + b if op == "+" else totals[-1] - b)
    return totals


def _parse_prompt(prompt: str) -> tuple[list[int], list[str]]:
    """'3+4-2\\n' -> ([3, 4, 2], ['+', '-']); the prompt is the source of truth, not `meta`."""
    tokens = _TOKEN.findall(prompt)
    return [int(t) for t in tokens[0::2]], tokens[1::2]


def _rewrite(totals: list[int], ops: list[str], operands: list[int], k: int) -> str:
    """The expression after its first k operations are done: '7-1+9-9', k=1 -> '6+9-9'."""
    return str(totals[k]) + "".join(f"{op}{b}" for op, b in zip(ops[k:], operands[k + 1:]))


def split_steps(completion: str) -> list[str]:
    """Non-empty (stripped) lines up to and including the first '####' answer line."""
    steps = []
    for line in completion.splitlines():
        line = line.strip()
        if line:
            steps.append(line)
            if _answer_line(line):
                break
    return steps


def extract_answer(completion: str) -> str | None:
    """The integer on the FIRST line starting with '####', canonicalised; None if absent or not an integer.

    The first, not the last: decoding stops at EOS in practice, so anything after the first answer
    line is babble, and this matches `split_steps`, which ends there too.

    >>> extract_answer("2-5=-3\\n#### -3\\n#### 7\\n"), extract_answer("3+4=7\\n"), extract_answer("#### x")
    ('-3', None, None)
    """
    for line in completion.splitlines():
        line = line.strip()
        if _answer_line(line):
            value = line[4:].strip()
            return str(int(value)) if _INTEGER.fullmatch(value) else None
    return None


def verify(completions: list[str], references: list[str]) -> list[float | None]:
    """1.0 if the extracted answer equals the reference integer, else 0.0 (unparseable counts as wrong).

    >>> verify(["3+4=7\\n#### 7\\n", "3+4=8\\n#### 8\\n", "garbage"], ["7", "7", "7"])
    [1.0, 0.0, 0.0]
    """
    return verify_answers("arith", completions, references, extract_answer, lambda got, ref: int(got) == int(ref))


@dataclass
class ArithDomain:
    max_level: int = 6  # levels are 1..max_level +/- operations
    digits: int = 1  # operand digits: operands are drawn from 0..10**digits - 1
    test_size: int = 200  # held-out problems per level (capped at half a level's problem space)
    test_seed: int = 1234  # the test set depends only on this, digits and the level
    # "chain": each step "a+b=c" carries the running total; "rewrite": each step rewrites the
    # expression with its first operation done ("7-1+9\n" -> "6+9\n#### 15\n"), so every step reads
    # only the line above it: no counting of which operand comes next, which length-generalises.
    format: str = "chain"
    name: str = field(default="arith", init=False)
    step_separator: str = field(default="\n", init=False)  # one step a line
    _test_cache: dict[int, list[Problem]] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.max_level < 1:
            raise ValueError(f"arith: max_level must be >= 1, got {self.max_level}")
        if self.digits < 1:
            raise ValueError(f"arith: digits must be >= 1, got {self.digits}")
        if self.format not in ("chain", "rewrite"):
            raise ValueError(f"arith: format must be 'chain' or 'rewrite', got {self.format!r}")
        if self.test_size < 0:
            raise ValueError(f"arith: test_size must be >= 0, got {self.test_size}")

    def levels(self) -> list[int]:
        return list(range(1, self.max_level + 1))

    def _space(self, level: int) -> int:
        """Number of distinct prompts at `level`: first operand, then (op, operand) per operation."""
        v = 10**self.digits
        return v * (2 * v) ** level

    def _check_level(self, level: int) -> None:
        if level not in self.levels():
            raise ValueError(f"arith: level {level} not in {self.levels()}")

    def _draw(self, rng: random.Random, level: int) -> Problem:
        hi = 10**self.digits - 1
        operands = [rng.randint(0, hi) for _ in range(level + 1)]
        ops = [rng.choice("+-") for _ in range(level)]
        prompt = str(operands[0]) + "".join(f"{op}{b}" for op, b in zip(ops, operands[1:])) + "\n"
        answer = str(_running_totals(operands, ops)[-1])
        return Problem.make(self.name, level, prompt, answer, {"operands": operands, "ops": ops})

    def _draw_unique(self, rng: random.Random, level: int, n: int, exclude: set[str]) -> list[Problem]:
        """`n` draws, unique until the space (minus `exclude`) is used up, then repeats."""
        available = self._space(level) - len(exclude)
        if n > 0 and available <= 0:
            raise ValueError(f"arith: no problems left at level {level} outside the test set")
        out: list[Problem] = []
        seen: set[str] = set()
        while len(out) < n:
            p = self._draw(rng, level)
            if p.prompt in exclude or (p.prompt in seen and len(seen) < available):
                continue
            seen.add(p.prompt)
            out.append(p)
        return out

    def test_set(self, level: int) -> list[Problem]:
        self._check_level(level)
        if level not in self._test_cache:
            # A string seed is hashed with sha512 by `random`, so it is stable across processes.
            rng = random.Random(f"arith-test:{self.test_seed}:{level}")
            size = min(self.test_size, self._space(level) // 2)  # leave half the space for training
            self._test_cache[level] = self._draw_unique(rng, level, size, set())
        return list(self._test_cache[level])

    def sample_problems(self, level: int, n: int, seed: int) -> list[Problem]:
        """`n` problems outside the test set; the level is mixed into the seed so levels differ."""
        self._check_level(level)
        test_prompts = {p.prompt for p in self.test_set(level)}
        return self._draw_unique(random.Random(f"arith-sample:{seed}:{level}"), level, n, test_prompts)

    def reference_solution(self, problem: Problem) -> str:
        """The gold completion.

        >>> ArithDomain().reference_solution(Problem.make("arith", 2, "2-5+4\\n", "1"))
        '2-5=-3\\n-3+4=1\\n#### 1\\n'
        """
        operands, ops = _parse_prompt(problem.prompt)
        totals = _running_totals(operands, ops)
        if self.format == "rewrite":
            lines = [_rewrite(totals, ops, operands, k) for k in range(1, len(ops))]
        else:
            lines = [f"{a}{op}{b}={c}" for a, op, b, c in zip(totals, ops, operands[1:], totals[1:])]
        return "\n".join([*lines, f"#### {totals[-1]}"]) + "\n"

    split_steps = staticmethod(split_steps)
    extract_answer = staticmethod(extract_answer)
    verify = staticmethod(verify)

    def check_steps(self, prompt: str, completion: str) -> bool | None:
        """A step checker, as rStar-Math verifies each step by executing it: every worked line must
        apply the problem's next operation to the previous line's result and compute it right, and
        the '####' line must repeat the last result. It reads the problem statement, not the answer,
        so a right answer reached by skipping an operation ('2+6-3+0' in two steps) or by two
        cancelling slips fails it. It passes when every oracle step label is True, there is one line
        per operation, and the answer is written canonically. None for the `rewrite` format.

        >>> d = ArithDomain()
        >>> d.check_steps("3+4-2\\n", "3+4=7\\n7-2=5\\n#### 5\\n"), d.check_steps("3+4-2\\n", "3+4=8\\n8-3=5\\n#### 5\\n")
        (True, False)
        """
        if self.format != "chain":
            return None
        operands, ops = _parse_prompt(prompt)
        steps = self.split_steps(completion)
        # One true line per operation, in order, none skipped or added, then the answer as written.
        return (len(steps) == len(ops) + 1 and all(self._step_labels(operands, ops, steps))
                and steps[-1][4:].strip() == str(_running_totals(operands, ops)[-1]))

    def oracle_step_labels(self, problem: Problem, completion: str) -> list[bool]:
        """Exact per-step truth, Math-Shepherd-style: a step is good iff the gold solution continues from it.

        Step k ('a<op>b=c') is correct iff a is the true running total before operation k, op and b
        are operation k of the problem, and c is the true total after it. The '#### x' line is correct
        iff x is the true answer. Later steps are judged against the TRUE totals even after a mistake,
        so one slip does not poison the rest. Malformed lines and surplus equations are False.

        >>> d = ArithDomain()
        >>> d.oracle_step_labels(Problem.make("arith", 2, "3+4-2\\n", "5"), "3+4=8\\n7-2=5\\n#### 6\\n")
        [False, True, False]
        """
        operands, ops = _parse_prompt(problem.prompt)
        return self._step_labels(operands, ops, self.split_steps(completion))

    def _step_labels(self, operands: list[int], ops: list[str], steps: list[str]) -> list[bool]:
        totals = _running_totals(operands, ops)
        labels = []
        for k, step in enumerate(steps):
            if _answer_line(step):
                value = step[4:].strip()
                labels.append(bool(_INTEGER.fullmatch(value)) and int(value) == totals[-1])
                continue
            if self.format == "rewrite":
                labels.append(k < len(ops) - 1 and step == _rewrite(totals, ops, operands, k + 1))
                continue
            m = _EQUATION.fullmatch(step)
            labels.append(
                m is not None and k < len(ops)
                and (int(m[1]), m[2], int(m[3]), int(m[4])) == (totals[k], ops[k], operands[k + 1], totals[k + 1])
            )
        return labels
