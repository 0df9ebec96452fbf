"""`code`: write a Python function that passes its unit tests; run them (`run_tests`) and revise.

Two sources:

- generated (the default): tasks in five levels, from arithmetic on one argument (1) to list and string
  processing (2-3), sequences (4) and small algorithms (5), each with a reference solution whose outputs
  make the tests;
- a JSONL file of HumanEval- or MBPP-style rows: `prompt`, and `test` + `entry_point` (HumanEval: a
  `check(candidate)` function) or `test_list` (MBPP: assert lines, with an optional `test_setup_code`); a
  `level` field where the file has one, else 1.

Every execution of the agent's code runs in the sandbox (`components.envs.sandbox`): the tool's and the
final scoring's alike. The answer is the last ```python block of a turn without a call; the reward is 1
when every test passes.

    >>> env = CodeEnv()
    >>> p = env.sample_problems(level=2, n=1, seed=0)[0]
    >>> print(p.prompt)
    Write a Python function `f(xs)` that returns the list xs with every element multiplied by 7.
    >>> env.score(p, "```python\\n" + p.meta["solution"] + "\\n```"), env.score(p, "def f(xs):\\n    return 0")
    (1.0, 0.0)
"""

from __future__ import annotations

import ast
import json
import random
import re
import secrets
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from components.domains.base import Problem
from components.envs import toolcalls
from components.envs.base import EpisodeLimits, Message, Tool
from components.envs.episodes import Called, FileProblems, ToolEpisode, reference_messages
from components.envs.sandbox import ExecResult, Limits, Sandbox

_PY_BLOCK = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.S)
_PASSED = re.compile(r"(\d+)/(\d+) tests passed")

# The harness the sandbox runs: the solution, then each test in its own namespace. It imports nothing (an
# import costs the sandboxed interpreter about 16 ms here) and prints one line: a nonce it read from stdin
# before any of the solution ran, then its results. A solution that exits early, or prints a forged line
# without the nonce, passes nothing.
HARNESS = """\
def main():
    nonce = input()
    ns = {}
    try:
        exec(compile(open("solution.py").read(), "solution.py", "exec"), ns)
    except BaseException as e:
        print(nonce, repr(("load", type(e).__name__ + ": " + str(e))))
        return
    tests = {}
    exec(open("tests.py").read(), tests)
    results = []
    for test in tests["TESTS"]:
        try:
            exec(test, dict(ns))
            results.append(None)
        except AssertionError as e:
            results.append(("AssertionError " + str(e)).strip())
        except BaseException as e:
            results.append(type(e).__name__ + ": " + str(e))
    print(nonce, repr(("results", results)))
main()
"""


class CodeError(ValueError):
    """A tasks file that cannot be used: names the file and the row."""


# A test input with a word of each length from 1 to 13 letters, so that each k of a template counting or keeping
# the words longer than k (or of at least k letters) gives other expectations.
LADDER = "'a an the four quick orange rainbow elephant wonderful strawberry magnificent grandmothers extraordinary'"

# (signature, task text with {params}, reference body with {params}, test inputs) per level.
TASKS: dict[int, list[tuple[str, str, str, list[str]]]] = {
    1: [("f(x)", "returns x multiplied by {k} plus {c}", "return x * {k} + {c}", ["0", "1", "7", "-3"]),
        ("f(x)", "returns the remainder of x divided by {m}", "return x % {m}", ["0", "5", "17", "100"]),
        ("f(x)", "returns x squared minus {c}", "return x * x - {c}", ["0", "2", "-4", "9"])],
    2: [("f(xs)", "returns the sum of the elements of the list xs that are greater than {k}",
         "return sum(x for x in xs if x > {k})", ["[]", "[1, 5, 9]", "[{k}, {k}]", "[10, -2, 4, 7]"]),
        ("f(xs)", "returns how many elements of the list xs are divisible by {m}",
         "return sum(1 for x in xs if x % {m} == 0)", ["[]", "[1, 2, 3, 4, 6, 8]", "[0, 10, 15]"]),
        ("f(xs)", "returns the largest element of the list xs minus the smallest, or 0 for an empty list",
         "return max(xs) - min(xs) if xs else 0", ["[]", "[3]", "[4, -1, 8]"]),
        ("f(xs)", "returns the list xs with every element multiplied by {k}",
         "return [x * {k} for x in xs]", ["[]", "[1, -2, 3]", "[0, 10]"]),
        ("f(xs)", "returns how many elements of the list xs are at least {k} and at most {hi}",
         "return sum(1 for x in xs if {k} <= x <= {hi})", ["[]", "[{k}, {hi}, 0]", "[1, 5, 9, 20, 33, 40]"]),
        ("f(xs)", "returns the index of the first element of the list xs greater than {k}, or -1 when there is none",
         "return next((i for i, x in enumerate(xs) if x > {k}), -1)", ["[]", "[1, 2, 10, 20]", "[{k}, 0]"]),
        ("f(xs)", "returns the sum of the elements of the list xs at even positions (0, 2, 4, ...) minus {c}",
         "return sum(xs[0::2]) - {c}", ["[]", "[5]", "[1, 2, 3, 4, 5]"])],
    3: [("f(s)", "returns the string s reversed, without its vowels (aeiou, either case)",
         "return ''.join(ch for ch in reversed(s) if ch.lower() not in 'aeiou')", ["''", "'hello'", "'Audio Lab'"]),
        ("f(s)", "returns how many words of the string s (split on spaces) are longer than {k} letters",
         "return sum(1 for w in s.split() if len(w) > {k})", ["''", "'a bb ccc dddd'", "'the quick brown fox'",
                                                              LADDER]),
        ("f(s)", "returns s with every {k}th character (counting from 1) in upper case",
         "return ''.join(ch.upper() if (i + 1) % {k} == 0 else ch for i, ch in enumerate(s))",
         ["''", "'abcdefgh'", "'hello world'"]),
        ("f(s)", "returns s with each lower-case letter shifted {k} places forward in the alphabet (z wraps to a); "
         "other characters stay as they are",
         "return ''.join(chr((ord(ch) - 97 + {k}) % 26 + 97) if 'a' <= ch <= 'z' else ch for ch in s)",
         ["''", "'abc xyz'", "'Hello, world!'"]),
        ("f(s)", "returns the words of the string s (split on spaces) that have at least {k} letters, joined by "
         "single spaces",
         "return ' '.join(w for w in s.split() if len(w) >= {k})", ["''", "'a bb ccc dddd eeeee'",
                                                                   "'extraordinary ideas need evidence'", LADDER]),
        ("f(s)", "returns the string s repeated {k} times with a '-' between the copies",
         "return '-'.join([s] * {k})", ["''", "'ab'", "'x y'"]),
        ("f(s)", "returns s cut to its first {m} characters followed by '...' when it is longer than {m}, else s",
         "return s if len(s) <= {m} else s[:{m}] + '...'", ["''", "'ab'", "'a considerably longer sentence'"]),
        ("f(s)", "returns s padded on the left with '*' to {c} characters (a longer s stays as it is)",
         "return s.rjust({c}, '*')", ["''", "'abc'", "'a sentence of forty-one characters, or so'"])],
    4: [("f(n)", "returns the list of the first n terms of the sequence a0 = {c}, a(i+1) = (a(i) * {k} + 1) % {m}",
         "out, a = [], {c}\n    for _ in range(n):\n        out.append(a)\n        a = (a * {k} + 1) % {m}\n    return out",
         ["0", "1", "6"]),
        ("f(xs)", "returns the running maximum of the list xs: element i is the largest of xs[0..i]",
         "out = []\n    for x in xs:\n        out.append(x if not out else max(out[-1], x))\n    return out",
         ["[]", "[3, 1, 4, 1, 5]", "[-2, -5, 0]"]),
        ("f(xs)", "returns the elements of the list xs without repeats, in the order they first appear",
         "seen, out = set(), []\n    for x in xs:\n        if x not in seen:\n            seen.add(x)\n"
         "            out.append(x)\n    return out", ["[]", "[3, 1, 3, 2, 1]", "[5, 5, 5]"]),
        ("f(xs)", "returns the running sums of the list xs, each taken modulo {m}",
         "out, s = [], 0\n    for x in xs:\n        s = (s + x) % {m}\n        out.append(s)\n    return out",
         ["[]", "[5, 9, 13]", "[20, -7, 4, 11, 30]"]),
        ("f(n)", "returns the list of the first n powers of {k}, starting with 1, each taken modulo {m}",
         "out, p = [], 1\n    for _ in range(n):\n        out.append(p % {m})\n        p = p * {k}\n    return out",
         ["0", "1", "6"]),
        ("f(xs)", "returns the differences between consecutive elements of the list xs (each element minus the one "
         "before it), each multiplied by {k}",
         "out = []\n    for i in range(1, len(xs)):\n        out.append((xs[i] - xs[i - 1]) * {k})\n    return out",
         ["[]", "[4]", "[1, 4, 9, 16]", "[10, 3, 3, -2]"]),
        ("f(n)", "returns the list of the first n terms of the sequence a0 = {c}, a(i+1) = a(i) // 2 when a(i) is "
         "even, else a(i) * {k} + 1",
         "out, a = [], {c}\n    for _ in range(n):\n        out.append(a)\n"
         "        a = a // 2 if a % 2 == 0 else a * {k} + 1\n    return out", ["0", "1", "7"]),
        ("f(xs)", "returns the list xs with each element replaced by its sum with the element before it, taking "
         "{c} as the element before the first",
         "out, prev = [], {c}\n    for x in xs:\n        out.append(prev + x)\n        prev = x\n    return out",
         ["[]", "[1]", "[3, 1, 4, 1, 5]"]),
        ("f(n)", "returns the list of the first n numbers from {c} upward that are divisible by {k}",
         "out, x = [], {c}\n    while len(out) < n:\n        if x % {k} == 0:\n            out.append(x)\n"
         "        x += 1\n    return out", ["0", "1", "5"])],
    5: [("f(s)", "returns True when the brackets ()[]{{}} in the string s are balanced, else False",
         "pairs, stack = {{')': '(', ']': '[', '}}': '{{'}}, []\n    for ch in s:\n        if ch in '([{{':\n"
         "            stack.append(ch)\n        elif ch in pairs:\n            if not stack or stack.pop() != pairs[ch]:\n"
         "                return False\n    return not stack", ["''", "'([]{{}})'", "'(]'", "'(('", "'a(b)c'"]),
        ("f(s)", "returns the run-length encoding of the string s: each run as its character then its length",
         "out, i = '', 0\n    while i < len(s):\n        j = i\n        while j < len(s) and s[j] == s[i]:\n"
         "            j += 1\n        out += s[i] + str(j - i)\n        i = j\n    return out",
         ["''", "'aaabcc'", "'abc'", "'zzzzzzzzzzzz'"]),
        ("f(xs)", "returns the {k} most frequent elements of the list xs, most frequent first, ties by smaller value",
         "from collections import Counter\n    c = Counter(xs)\n    return sorted(c, key=lambda x: (-c[x], x))[:{k}]",
         ["[]", "[1, 1, 2, 2, 3]", "[5, 4, 4, 5, 5, 6]"]),
        ("f(n)", "returns term n of the sequence t(0) = {c}, t(1) = {k}, t(i) = t(i-1) + t(i-2)",
         "a, b = {c}, {k}\n    for _ in range(n):\n        a, b = b, a + b\n    return a", ["0", "1", "2", "7"]),
        ("f(xs)", "returns the {k}th smallest distinct element of the list xs, or None when it has fewer distinct "
         "elements", "d = sorted(set(xs))\n    return d[{k} - 1] if len(d) >= {k} else None",
         ["[]", "[9, 1, 8, 2, 7, 3, 6, 4, 5, 1]", "[4, 4, 4]"]),
        ("f(xs)", "returns the length of the longest run of consecutive elements of the list xs that are each greater "
         "than the one before, counting the run's first element",
         "best = run = 0\n    for i, x in enumerate(xs):\n        run = run + 1 if i and x > xs[i - 1] else 1\n"
         "        best = max(best, run)\n    return best", ["[]", "[1, 2, 3, 1, 2]", "[5, 4, 3]", "[1, 3, 5, 7]"]),
        ("f(n)", "returns how many of the numbers 2 to n (inclusive) are prime and leave remainder 1 when divided "
         "by {k}",
         "return sum(1 for p in range(2, n + 1) if all(p % d for d in range(2, int(p ** 0.5) + 1)) and p % {k} == 1)",
         ["1", "10", "50", "97"])],
}


DEFAULT_RANGES: dict[str, tuple[int, int]] = {"k": (2, 9), "m": (3, 15)}  # c is 1-40 in every template

# Parameter ranges wider than DEFAULT_RANGES, for the templates of levels 3 and 4 with one parameter.
# A held-out task carries a value its template shows in no training task, so with 8 values and 4 of them held out
# the policy had to write numbers it had seen in no solution (docs/envs.md, "Two level-4 demonstrations a
# template"). Each range stops where two of its values would give the same expectations on every test
# (`test_each_value_of_a_wide_range_changes_what_the_tests_expect`).
RANGES: dict[str, dict[str, tuple[int, int]]] = {
    TASKS[3][1][1]: {"k": (2, 12)},  # words longer than k letters: LADDER's longest has 13
    TASKS[3][2][1]: {"k": (2, 11)},  # every kth character: 'hello world' has 11
    TASKS[3][3][1]: {"k": (2, 25)},  # shifted k places
    TASKS[3][4][1]: {"k": (2, 13)},  # words of at least k letters
    TASKS[3][5][1]: {"k": (2, 30)},  # repeated k times
    TASKS[3][6][1]: {"m": (2, 29)},  # cut to m characters: the longest test has 30
    TASKS[4][3][1]: {"m": (3, 57)},  # running sums modulo m: the sums reach 58, and 29 and 58 would agree
    TASKS[4][5][1]: {"k": (2, 40)},  # differences times k
}


def answer_code(text: str) -> str:
    blocks = _PY_BLOCK.findall(text)
    return (blocks[-1] if blocks else text).strip()


def report(result: ExecResult, tests: list[str], nonce: str) -> tuple[int, str]:
    """(tests passed, the observation the agent reads) from one sandboxed run of the harness."""
    if not result.ok:
        return 0, f"error: the run failed ({result.describe()})"
    line = next((ln for ln in reversed(result.stdout.splitlines()) if ln.startswith(nonce + " ")), None)
    try:
        kind, value = ast.literal_eval(line[len(nonce) + 1:]) if line else (None, None)
    except (ValueError, SyntaxError):
        kind = None
    if kind == "load":
        return 0, f"error: the code does not load: {value}"
    if kind != "results" or not isinstance(value, list) or len(value) != len(tests):
        return 0, "error: the tests did not finish (did the code exit early?)"
    failed = [(t, r) for t, r in zip(tests, value) if r is not None]
    passed = len(tests) - len(failed)
    lines = [f"{passed}/{len(tests)} tests passed"] + [f"FAILED {t.strip()}: {r}" for t, r in failed[:3]]
    return passed, "\n".join(lines)


@dataclass
class CodeEnv(FileProblems):
    name: str = "code"
    max_level: int = 5
    test_size: int = 20
    tasks: str | None = None  # a HumanEval/MBPP-style JSONL file; None: generated tasks
    # The share of reference episodes that first try the solution with one integer constant changed, read the
    # failing tests, then try the solution itself: demonstrations of revising, not only of passing.
    revise_fraction: float = 0.0
    cycle_templates: bool = False  # True: a level's tasks take its templates in turn (N tasks: ~N/T each)
    isolation: str = "bwrap"  # "none" runs model code on the host: only by an explicit config switch
    sandbox_limits: Limits = Limits(wall_s=5.0, cpu_s=2, memory_mb=512, output_bytes=65536)
    limits: EpisodeLimits = EpisodeLimits(max_turns=3, max_wall_s=60.0, max_observation_chars=600)
    instructions: str = "Answer with the whole function in one ```python block. You may run the tests first."
    tools: tuple[Tool, ...] = (Tool("run_tests", "Run the task's unit tests against your code; see which fail.",
                                    {"type": "object", "properties": {"code": {"type": "string"}},
                                     "required": ["code"]}, None),)
    _files: dict[str, list[Problem]] = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if not 0.0 <= self.revise_fraction <= 1.0:
            raise CodeError(f"{self.name}: revise_fraction must be within [0, 1], got {self.revise_fraction}")
        self.sandbox = Sandbox(self.sandbox_limits, self.isolation)
        if self.tasks is not None:
            self._load(Path(self.tasks))

    # -- problems ------------------------------------------------------------------------------
    def _templates(self, level: int) -> list[tuple[str, str, str, list[str]]]:
        return TASKS[level]

    def _draw(self, rng: random.Random, level: int, fixed: tuple[str, str, str, list[str]] | None = None) -> Problem:
        """A task of `level` with parameters drawn from `rng`: its template drawn too, or `fixed`."""
        template = rng.choice(TASKS[level]) if fixed is None else fixed
        ranges = ranges_of(template)
        return self.task(level, template, {name: rng.randint(*ranges[name]) for name in ("k", "c", "m")})

    def hindsight(self, problem: Problem, text: str) -> Problem | None:
        """The generated task that the answer `text` solves, where it is `problem`'s template with other constants
        in the template's ranges: the goal the answer reached (hindsight relabeling, Andrychowicz et al. 2017). None
        for any other answer, a task from a file, or constants outside the ranges.

        >>> env = CodeEnv()
        >>> p = env.task(4, TASKS[4][3], {"k": 2, "c": 1, "m": 13})
        >>> q = env.hindsight(p, "```python\\n" + p.meta["solution"].replace("% 13", "% 6") + "\\n```")
        >>> q.prompt
        'Write a Python function `f(xs)` that returns the running sums of the list xs, each taken modulo 6.'
        >>> env.hindsight(p, "```python\\ndef f(xs):\\n    return xs\\n```") is None
        True
        """
        asked = None if self._files else parse_task(problem.prompt)
        if asked is None:
            return None
        level, template, params = asked
        code = "\n".join(line.rstrip() for line in answer_code(text).splitlines())
        wrote = _pattern(f"def {template[0]}:\n    {template[2]}").fullmatch(code)
        if wrote is None:
            return None
        params = params | _params(wrote)
        if any(not lo <= params[k] <= hi for k, (lo, hi) in ranges_of(template).items()):
            return None
        relabeled = self.task(level, template, params)
        return None if relabeled.problem_id == problem.problem_id else relabeled

    def variants(self, problem: Problem, turns: list[str], n: int, rng: random.Random,
                 ) -> list[tuple[Problem, list[str]]]:
        """Up to `n` tasks of `problem`'s template with other constants drawn from its ranges, each with the
        assistant `turns` written with them, where the last turn's program is the template's with the asked
        constants: the answer posed again (filter.variants). That program is written anew in every turn that
        holds it, a tool call's arguments included. None for any other answer, or a task from a file.

        >>> env = CodeEnv()
        >>> p = env.task(4, TASKS[4][3], {"k": 2, "c": 1, "m": 13})
        >>> [(q.prompt[-10:], t[-1].splitlines()[4]) for q, t in env.variants(p, ["```python\\n" + p.meta["solution"]
        ...                                                                     + "\\n```"], 2, random.Random(0))]
        [('modulo 57.', '        s = (s + x) % 57'), ('modulo 27.', '        s = (s + x) % 27')]
        >>> env.variants(p, ["```python\\ndef f(xs):\\n    return xs\\n```"], 2, random.Random(0))
        []
        """
        asked = None if self._files else parse_task(problem.prompt)
        if asked is None or not turns:
            return []
        level, template, params = asked
        written = answer_code(turns[-1])
        code = "\n".join(line.rstrip() for line in written.splitlines())
        wrote = _pattern(f"def {template[0]}:\n    {template[2]}").fullmatch(code)
        if wrote is None or params | _params(wrote) != params:
            return []
        used = {name for _, name, _, _ in string.Formatter().parse(template[1] + template[2]) if name}
        used = (used - {"hi"}) | ({"k", "c"} if "hi" in used else set())
        ranges = ranges_of(template)
        out: dict[str, tuple[Problem, list[str]]] = {problem.problem_id: (problem, turns)}
        for _ in range(4 * n):
            if len(out) > n:
                break
            goal = self.task(level, template, params | {name: rng.randint(*ranges[name]) for name in sorted(used)})
            new = goal.meta["solution"]
            out.setdefault(goal.problem_id, (goal, [t.replace(written, new).replace(json.dumps(written)[1:-1],
                                                                                   json.dumps(new)[1:-1])
                                                    for t in turns]))
        return list(out.values())[1:]

    def constants(self, prompt: str) -> list[str] | None:
        """The constants a generated task's prompt asks for, each as `<template>: <name>=<value>` (the template named
        by its level and place in `TASKS`), or None for a prompt no template wrote: what filter.max_per_value counts.

        >>> CodeEnv().constants(CodeEnv().task(4, TASKS[4][0], {"k": 5, "c": 19, "m": 13}).prompt)
        ['level 4 template 1: c=19', 'level 4 template 1: k=5', 'level 4 template 1: m=13']
        """
        found = _asked(prompt)
        if found is None:
            return None
        level, i, asked = found
        return [f"level {level} template {i + 1}: {k}={v}" for k, v in sorted(_params(asked).items())]

    def task(self, level: int, template: tuple[str, str, str, list[str]], params: dict[str, int]) -> Problem:
        """The task of `template` with `params` (k, c, m): its prompt, and tests whose expectations come from the
        template's reference."""
        sig, text, body, inputs = template
        params = {**params, "hi": params["k"] + params["c"]}  # an upper bound above k
        solution = f"def {sig}:\n    {body.format(**params)}"
        ns: dict[str, Any] = {}
        exec(solution, ns)  # our own reference, never the model's: its outputs are the tests' expectations
        args = [a.format(**params) for a in inputs]
        tests = [f"assert f({a}) == {ns['f'](eval(a))!r}" for a in args]
        prompt = f"Write a Python function `{sig}` that {text.format(**params)}."
        return Problem.make(self.name, level, prompt, json.dumps(tests), {"solution": solution, "tests": tests})

    def _load(self, path: Path) -> None:
        problems = []
        try:
            lines = path.read_text().splitlines()
        except OSError as e:
            raise CodeError(f"{path}: cannot read the tasks file: {e}") from None
        for i, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise CodeError(f"{path}: row {i} is not JSON: {e.msg}") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise CodeError(f"{path}: row {i} needs a `prompt` string")
            if row.get("test") and row.get("entry_point"):
                tests = [f"{row['test']}\ncheck({row['entry_point']})"]
            elif row.get("test_list"):
                tests = [f"{row.get('test_setup_code', '')}\n{t}".strip() for t in row["test_list"]]
            else:
                raise CodeError(f"{path}: row {i} has no tests: give `test` and `entry_point` (HumanEval) or "
                                "`test_list` (MBPP)")
            prompt = f"Complete this Python code so that it works:\n{row['prompt']}"
            meta = {"tests": tests, "solution": (row.get("prompt", "") + row["canonical_solution"])
                    if row.get("canonical_solution") else row.get("code"), "task_id": row.get("task_id")}
            problems.append(Problem.make(self.name, int(row.get("level", 1)), prompt, json.dumps(tests), meta))
        if not problems:
            raise CodeError(f"{path}: no tasks")
        self._hold_out(problems)

    # -- episodes ------------------------------------------------------------------------------
    def run_tests(self, problem: Problem, code: str) -> tuple[int, str]:
        tests = problem.meta["tests"]
        nonce = secrets.token_hex(16)
        result = self.sandbox.run_python(HARNESS, {"solution.py": code, "tests.py": f"TESTS = {tests!r}\n"},
                                         stdin=nonce + "\n")
        return report(result, tests, nonce)

    def episode(self, problem: Problem) -> ToolEpisode:
        return ToolEpisode(self, problem, self.limits)

    def bind(self, problem: Problem) -> tuple[dict[str, Tool], None]:
        return {"run_tests": Tool("run_tests", self.tools[0].description, self.tools[0].parameters,
                                  lambda code: self.run_tests(problem, code)[1])}, None

    def extract_answer(self, text: str) -> str | None:
        return answer_code(text).strip() or None

    def score(self, problem: Problem, text: str, context: None = None) -> float:
        passed, _ = self.run_tests(problem, answer_code(text))
        return float(passed == len(problem.meta["tests"]))

    def check_answer(self, prompt: str, calls: list[Called], answer: str) -> bool:
        """The answer is the program the episode last ran with `run_tests`, and that run passed every test: the
        agent answered what it had tested. An answer written without a run, or changed after its last one, does
        not check out.

        >>> env, run = CodeEnv(), lambda code, out: Called("run_tests", {"code": code}, out, True)
        >>> ok, bad = "def f(x):\\n    return x", "def f(x):\\n    return 0"
        >>> answer = "```python\\n" + ok + "\\n```"
        >>> [env.check_answer("", calls, answer) for calls in ([run(bad, "1/3 tests passed"), run(ok, "3/3 tests passed")],
        ...  [run(ok, "3/3 tests passed"), run(bad, "1/3 tests passed")], [run(ok, "2/3 tests passed")], [])]
        [True, False, False, False]
        """
        runs = [c for c in calls if c.name == "run_tests" and c.arguments is not None]
        if not runs:
            return False
        passed = _PASSED.match(runs[-1].observation)
        return (passed is not None and passed.group(1) == passed.group(2)
                and str(runs[-1].arguments.get("code", "")).strip() == answer_code(answer))

    def reference_episode(self, problem: Problem) -> list[Message]:
        """The solution tried with `run_tests`, its report, then the same solution as the answer. A
        `revise_fraction` of them (chosen by problem, so the same each time) first try a flawed copy of the
        solution (`flawed`) and read which tests fail."""
        solution = problem.meta.get("solution")
        if not solution:
            raise CodeError(f"{self.name}: task {problem.meta.get('task_id') or problem.problem_id} has no reference "
                            "solution (canonical_solution or code)")
        def episode(*tries: str) -> list[Message]:
            turns = [(toolcalls.format_call("run_tests", {"code": code}), None) for code in tries]
            return reference_messages(self, problem, [*turns, (f"```python\n{solution}\n```", None)], self.limits)

        rng = random.Random(problem.problem_id)
        if rng.random() < self.revise_fraction and self.limits.max_turns >= 3:
            wrong = flawed(solution, rng)
            if wrong is not None:
                # The slip's own run is the episode's first report: where its tests catch nothing, the plain
                # episode instead. Each try runs in the sandbox once.
                messages = episode(wrong, solution)
                total = len(problem.meta["tests"])
                first = next(m["content"] for m in messages if m["role"] == "tool")
                if not first.startswith(f"{total}/{total} tests passed"):
                    return messages
        return episode(solution)


def parse_task(text: str) -> tuple[int, tuple[str, str, str, list[str]], dict[str, int]] | None:
    """The generated task whose prompt `text` holds: its level, template and parameters (k, c, m, those the template
    does not use at a default), or None.

    >>> level, template, params = parse_task(CodeEnv().task(4, TASKS[4][4], {"k": 3, "c": 1, "m": 11}).prompt)
    >>> level, template[1][:32], params
    (4, 'returns the list of the first n ', {'k': 3, 'c': 1, 'm': 11})
    """
    found = _asked(text)
    if found is None:
        return None
    level, i, asked = found
    return level, TASKS[level][i], {"k": 2, "c": 1, "m": 3} | _params(asked)


def _asked(text: str) -> tuple[int, int, re.Match[str]] | None:
    """The level and place in `TASKS` of the template whose prompt `text` holds, and its match, or None."""
    for level, templates in TASKS.items():
        for i, template in enumerate(templates):
            asked = _pattern(f"Write a Python function `{template[0]}` that {template[1]}.").search(text)
            if asked is not None:
                return level, i, asked
    return None


def ranges_of(template: tuple[str, str, str, list[str]]) -> dict[str, tuple[int, int]]:
    """The ranges `CodeEnv._draw` draws the template's parameters from: c is 1-40 in every template."""
    return DEFAULT_RANGES | {"c": (1, 40)} | RANGES.get(template[1], {})


def _params(match: re.Match[str]) -> dict[str, int]:
    """A template's parameters as `_pattern` matched them; an upper bound `hi` is k + c (`task`)."""
    params = {k: int(v) for k, v in match.groupdict().items()}
    if "hi" in params:
        params["c"] = params.pop("hi") - params["k"]
    return params


def _pattern(fmt: str) -> re.Pattern[str]:
    """A template's format string as a regex: its text literal, each parameter a named group of digits, and a
    parameter that comes again the same digits."""
    out, seen = [], set()
    for literal, name, _, _ in string.Formatter().parse(fmt):
        out.append(re.escape(literal))
        if name is not None:
            out.append(f"(?P={name})" if name in seen else rf"(?P<{name}>\d+)")
            seen.add(name)
    return re.compile("".join(out))


_INT = re.compile(r"(?<![\w.'\"])\d+(?![\w.'\"])")


def flawed(solution: str, rng: random.Random) -> str | None:
    """`solution` with one integer constant of its body moved by 1 or 2 (never below 0): the slip a small model
    makes copying a task's numbers. None when the body has no integer constant."""
    body = solution.find("\n") + 1
    found = list(_INT.finditer(solution, body))
    if not found:
        return None
    m = rng.choice(found)
    value = int(m.group())
    other = rng.choice([v for v in (value - 2, value - 1, value + 1, value + 2) if v >= 0])
    return solution[:m.start()] + str(other) + solution[m.end():]
