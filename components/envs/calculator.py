"""`calculator`: integer arithmetic with a calculator tool, the cheapest multi-turn environment.

The agent learns to call `calculate` with the problem's expression and to answer with what it returns, from
a product of two digits (level 1) to one of three digits by three plus a third number (level 5). No level can
be answered from memory: held-out problems are products the model never saw. The answer is the last line
`#### <integer>`; the reward is 1 when it equals the value.

    >>> env = CalculatorEnv()
    >>> p = env.sample_problems(level=3, n=1, seed=0)[0]
    >>> p.prompt, p.answer
    ('What is 30*48+73?', '1513')
    >>> [m["role"] for m in env.reference_episode(p)]
    ['system', 'user', 'assistant', 'tool', 'assistant']
    >>> calculate("2*(3+4)//5")
    '2'
    >>> calculate("__import__('os')")
    Traceback (most recent call last):
    ValueError: only integers, + - * // % and parentheses
"""

from __future__ import annotations

import ast
import operator
import random
import re
from dataclasses import dataclass

from components.domains.base import Problem
from components.envs import toolcalls
from components.envs.base import EpisodeLimits, Message, Tool
from components.envs.episodes import Called, LeveledProblems, ToolEpisode, reference_messages

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
        ast.Mod: operator.mod}
_ANSWER = re.compile(r"####\s*(-?\d+)\s*$")
_QUESTION = re.compile(r"What is (.+)\?")
_NUMBER = re.compile(r"\d+")
# Level: (digits of a, digits of b, whether a third number is added)
_SHAPES = {1: (1, 1, False), 2: (2, 1, False), 3: (2, 2, True), 4: (3, 2, True), 5: (3, 3, True)}


def _eval(node: ast.AST) -> int:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        a, b = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Mult) and max(abs(a), abs(b)) > 10**12:
            raise ValueError("numbers too large")
        return _OPS[type(node.op)](a, b)
    raise ValueError("only integers, + - * // % and parentheses")


def calculate(expression: str) -> str:
    """The tool: evaluated on its syntax tree, never by `eval`, so it runs nothing but arithmetic. A bad
    expression raises ValueError, which the episode turns into an error observation (a failed call)."""
    try:
        return str(_eval(ast.parse(expression.strip(), mode="eval")))
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    except (SyntaxError, RecursionError) as e:
        raise ValueError(e.msg if isinstance(e, SyntaxError) else "expression too deep") from None


TOOLS = (Tool("calculate", "Evaluate an integer expression with + - * // % and parentheses.",
              {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
              calculate),)


@dataclass
class CalculatorEnv(LeveledProblems):
    name: str = "calculator"
    max_level: int = 5
    test_size: int = 100
    limits: EpisodeLimits = EpisodeLimits(max_turns=3, max_wall_s=30.0, max_observation_chars=200)
    tools: tuple[Tool, ...] = TOOLS
    instructions: str = "Answer with a last line '#### <integer>'."

    def _draw(self, rng: random.Random, level: int) -> Problem:
        da, db, plus = _SHAPES[level]
        a, b = rng.randint(10 ** (da - 1), 10**da - 1), rng.randint(10 ** (db - 1), 10**db - 1)
        expr = f"{a}*{b}" + (f"+{rng.randint(10, 99)}" if plus else "")
        return Problem.make(self.name, level, f"What is {expr}?", calculate(expr), {"expression": expr})

    def episode(self, problem: Problem) -> ToolEpisode:
        return ToolEpisode(self, problem, self.limits)

    def bind(self, problem: Problem) -> tuple[dict[str, Tool], None]:
        return {t.name: t for t in self.tools}, None

    def extract_answer(self, text: str) -> str | None:
        m = _ANSWER.search(text.strip())
        return m.group(1) if m else None

    def score(self, problem: Problem, text: str, context: None = None) -> float:
        return float(self.extract_answer(text) == problem.answer)

    def check_answer(self, prompt: str, calls: list[Called], answer: str) -> bool:
        """The answer repeats what the last `calculate` returned, and that call computed the question's
        expression from the question's own numbers: an answer written without the tool, one that ignores its
        result, or a call on the answer itself or on part of the question does not check out.

        >>> env, c = CalculatorEnv(), lambda e, out: Called("calculate", {"expression": e}, out, True)
        >>> q = "What is 30*48+73?"
        >>> [env.check_answer(q, calls, "#### 1513") for calls in
        ...  ([c("30*48+73", "1513")], [c("73+48*30", "1513")], [c("1513", "1513")], [c("30*48", "1440")], [])]
        [True, True, False, False, False]
        """
        asked = _QUESTION.fullmatch(prompt.strip())
        done = [c for c in calls if c.name == "calculate" and c.arguments is not None]
        if asked is None or not done:
            return False
        expression = str(done[-1].arguments.get("expression", ""))
        try:
            same = calculate(expression) == calculate(asked.group(1))
        except ValueError:
            return False
        return (same and sorted(_NUMBER.findall(expression)) == sorted(_NUMBER.findall(asked.group(1)))
                and self.extract_answer(answer) == done[-1].observation.strip())

    def reference_episode(self, problem: Problem) -> list[Message]:
        """One call to the calculator, then the answer."""
        final = f"#### {problem.answer}"
        call = toolcalls.format_call("calculate", {"expression": problem.meta["expression"]})
        return reference_messages(self, problem, [(call, None), (final, None)], self.limits)
