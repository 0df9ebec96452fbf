"""Environments: the protocol, the built-in calculator, sql and code environments, the batched episode loop and
the adapters. The agent here is scripted (reference episodes replayed, or fixed turns): what is under test is
the environments' side of each turn."""

import json
import random
import re
import sqlite3
import time

import pytest

from components.envs import get_env, toolcalls
from components.envs.adapters import DomainEnv, SkyrlEnv, TrlEnv
from components.envs.base import EpisodeLimits, EpisodeRunner
from components.envs.code import CodeEnv, CodeError
from components.envs.sql import SqlEnv, SqlError


def scripted(turns_by_prompt: dict[str, list[str]]):
    """A backend that answers each conversation with its script's next assistant turn."""
    calls = []

    def generate(conversations):
        calls.append(len(conversations))
        out = []
        for conv in conversations:
            user = next(m["content"] for m in conv if m["role"] == "user")
            k = sum(m["role"] == "assistant" for m in conv)
            script = turns_by_prompt[user]
            text = script[min(k, len(script) - 1)]
            out.append((text, len(text.split()), "stop"))
        return out

    generate.calls = calls
    return generate


def replay(env, problems, limits=None):
    """Each problem's reference episode replayed through the runner: every one must score 1."""
    scripts = {p.prompt: [m["content"] for m in env.reference_episode(p) if m["role"] == "assistant"]
               for p in problems}
    runner = EpisodeRunner(scripted(scripts), toolcalls.parse, limits or env.limits)
    return runner.run([(p, env.episode(p)) for p in problems]), scripts


@pytest.fixture(scope="module")
def code_env():
    return CodeEnv()


@pytest.mark.parametrize("name", ["calculator", "sql", "code"])
def test_reference_episodes_of_every_level_score_one_through_the_loop(name, code_env):
    env = code_env if name == "code" else get_env(name)
    problems = [p for level in env.levels() for p in env.sample_problems(level, 2, seed=3)]
    records, scripts = replay(env, problems)
    assert [r.status for r in records] == ["done"] * len(problems)
    assert [r.reward for r in records] == [1.0] * len(problems), [r.messages for r in records if r.reward != 1]
    for rec in records:
        roles = [t.role for t in rec.turns]
        assert roles[:2] == ["system", "user"] and roles[-1] == "assistant"
        assert rec.turns[-1].reward == 1.0 and rec.turns[-1].num_tokens > 0
        if "tool" in roles:  # every tool turn names its tool, holds its JSON arguments and succeeded
            tool = next(t for t in rec.turns if t.role == "tool")
            assert tool.tool_name in {t.name for t in env.tools} and tool.ok and json.loads(tool.tool_arguments)


def test_the_held_out_set_is_fixed_and_never_drawn_for_training(code_env):
    for env in (get_env("calculator"), get_env("sql"), code_env):
        for level in env.levels():
            test = {p.problem_id for p in env.test_set(level)}
            assert test and test == {p.problem_id for p in env.test_set(level)}
            train = env.sample_problems(level, 10, seed=1)
            assert not test & {p.problem_id for p in train}
            assert [p.problem_id for p in train] == [p.problem_id for p in env.sample_problems(level, 10, seed=1)]


def test_malformed_calls_become_error_observations_the_agent_sees():
    env = get_env("calculator")
    p = env.sample_problems(4, 1, seed=0)[0]
    turns = ['<tool_call>{"name": "calculate", "arguments": {"expression": </tool_call>',  # bad JSON
             toolcalls.format_call("python", {"code": "1"}),  # unknown tool
             toolcalls.format_call("calculate", {"expr": "1+1"}),  # wrong argument
             f"#### {p.answer}"]
    limits = EpisodeLimits(max_turns=5)
    [rec] = EpisodeRunner(scripted({p.prompt: turns}), toolcalls.parse, limits).run([(p, env.episode(p))])
    tools = [t for t in rec.turns if t.role == "tool"]
    assert [t.ok for t in tools] == [False, False, False] and rec.reward == 1.0
    assert "not valid JSON" in tools[0].content and tools[0].tool_name == "invalid"
    assert "unknown tool 'python'" in tools[1].content
    assert "missing ['expression']; unknown ['expr']" in tools[2].content


def test_an_episode_that_never_answers_is_cut_at_its_turn_limit():
    env = get_env("calculator")
    p = env.sample_problems(2, 1, seed=0)[0]
    call = toolcalls.format_call("calculate", {"expression": "1+1"})
    gen = scripted({p.prompt: [call]})
    [rec] = EpisodeRunner(gen, toolcalls.parse, EpisodeLimits(max_turns=3)).run([(p, env.episode(p))])
    assert (rec.status, rec.reward) == ("truncated_turns", 0.0)
    assert sum(t.role == "assistant" for t in rec.turns) == 3 and gen.calls == [1, 1, 1]


def test_the_time_limit_counts_an_episodes_own_time_not_the_batch_it_waits_in():
    env = get_env("calculator")
    problems = env.sample_problems(2, 8, seed=0)
    call = toolcalls.format_call("calculate", {"expression": "1+1"})
    gen = scripted({p.prompt: [call] for p in problems})

    def slow_batch(conversations):  # 0.4 s a batch of 8: 0.05 s each episode's share
        time.sleep(0.4)
        return gen(conversations)

    limits = EpisodeLimits(max_turns=3, max_wall_s=0.3)
    records = EpisodeRunner(slow_batch, toolcalls.parse, limits).run([(p, env.episode(p)) for p in problems])
    assert {r.status for r in records} == {"truncated_turns"}  # 1.2 s went by; each episode's own share was 0.15 s
    assert all(0.14 < r.gen_s < 0.3 for r in records)

    class Slow:  # an environment whose every step takes 0.2 s
        def __init__(self, episode):
            self.episode = episode

        def reset(self):
            return self.episode.reset()

        def step(self, action):
            time.sleep(0.2)
            return self.episode.step(action)

    [rec] = EpisodeRunner(gen, toolcalls.parse, limits).run([(problems[0], Slow(env.episode(problems[0])))])
    assert rec.status == "truncated_time" and sum(t.role == "assistant" for t in rec.turns) == 2


def test_live_episodes_step_together_and_a_raising_environment_fails_only_its_own():
    env = get_env("calculator")
    problems = env.sample_problems(3, 4, seed=0)

    class Broken:
        def reset(self):
            return [{"role": "user", "content": problems[0].prompt}]

        def step(self, action):
            raise RuntimeError("the environment broke")

    scripts = {p.prompt: [m["content"] for m in env.reference_episode(p) if m["role"] == "assistant"]
               for p in problems}
    gen = scripted(scripts)
    episodes = [(problems[0], Broken())] + [(p, env.episode(p)) for p in problems[1:]]
    records = EpisodeRunner(gen, toolcalls.parse, env.limits).run(episodes)
    assert records[0].status == "error" and "RuntimeError: the environment broke" in records[0].error
    assert [r.reward for r in records[1:]] == [1.0, 1.0, 1.0]
    assert gen.calls == [4, 3]  # one batch a turn, of every live episode


def test_long_observations_are_cut_and_counted():
    env = SqlEnv(limits=EpisodeLimits(max_turns=3, max_observation_chars=40))
    p = env.sample_problems(1, 1, seed=0)[0]
    ep = env.episode(p)
    ep.reset()
    result = ep.step(toolcalls.parse(toolcalls.format_call("run_sql", {"query": "SELECT * FROM sqlite_master"})))
    assert result.info["tool_calls"][0]["truncated"] and "[cut: " in result.observations[0]["content"]


# -- sql ---------------------------------------------------------------------------------------
def _sql_episode(env, level=1):
    p = env.sample_problems(level, 1, seed=0)[0]
    ep = env.episode(p)
    ep.reset()
    return p, ep


def test_generated_sql_questions_have_the_shape_of_their_level_and_a_spread_held_out_set():
    """Each template's gold query has the shape `level_of` gives its level (level 5 once held "the N best-paid",
    a level-1 query), and no template fills more than two thirds of a level's held-out set (half the draws are
    of each schema, and at levels 3 and 4 the shop schema has one template)."""
    from components.envs.sql import QUESTIONS, level_of

    env = SqlEnv(test_size=30)
    for level, by_schema in QUESTIONS.items():
        templates = [gold for pairs in by_schema.values() for _, gold in pairs]
        assert {level_of(gold) for gold in templates} == {level}, level
        shapes = [re.compile(re.sub(r"\\\{\w+\\\}", ".+?", re.escape(gold)) + "$") for gold in templates]
        held_out = [next(i for i, s in enumerate(shapes) if s.match(p.meta["gold"])) for p in env.test_set(level)]
        assert max(map(held_out.count, held_out)) <= 20, (level, sorted(map(held_out.count, set(held_out))))
        if len(templates) >= 3:
            assert len(set(held_out)) >= 3, (level, held_out)


def test_cycle_templates_gives_each_template_of_a_level_its_share():
    """`cycle_templates: true`: a level's problems take its templates in turn, a refused draw (a duplicate, a held-out
    problem, an empty answer) retried on the same template. Level 5's held-out set is then 6 of each of its 5
    templates (12, 10, 5, 2 and 1 as drawn at random), and 12 training problems hold each 2 or 3 times."""
    from components.envs.sql import QUESTIONS

    def counts(env: SqlEnv, problems) -> list[int]:
        golds = [gold for pairs in QUESTIONS[5].values() for _, gold in pairs]
        shapes = [re.compile(re.sub(r"\\\{\w+\\\}", ".+?", re.escape(g)) + "$") for g in golds]
        got = [next(i for i, sh in enumerate(shapes) if sh.match(p.meta["gold"])) for p in problems]
        return [got.count(i) for i in range(len(golds))]

    cycled, drawn = SqlEnv(test_size=30, cycle_templates=True), SqlEnv(test_size=30)
    assert counts(cycled, cycled.test_set(5)) == [6] * 5
    assert sorted(counts(drawn, drawn.test_set(5))) == [1, 2, 5, 10, 12]
    train = cycled.sample_problems(5, 12, seed=3)
    assert sorted(counts(cycled, train)) == [2, 2, 2, 3, 3]
    assert not {p.problem_id for p in train} & {p.problem_id for p in cycled.test_set(5)}
    assert cycled.sample_problems(5, 12, seed=3) == train  # deterministic given the seed


def test_cycle_templates_moves_on_from_a_template_with_no_new_task():
    """Code's level 4 has two templates without parameters: one task each. Taking turns, a draw does not stall on
    them: the held-out set is still 30 tasks, at most 2 of which are those two, and each other template has 3-4."""
    from components.envs.code import TASKS

    env = CodeEnv(test_size=30, cycle_templates=True)
    bodies = [body for _, _, body, _ in TASKS[4]]
    fixed = {b for b in bodies if "{" not in b}
    held_out = env.test_set(4)
    assert len(held_out) == 30 and len(fixed) == 2
    shapes = [re.compile(re.sub(r"\\\{\w+\\\}", ".+?", re.escape(b)) + "$") for b in bodies]
    counts = [0] * len(bodies)
    for p in held_out:
        counts[next(i for i, sh in enumerate(shapes) if sh.match(p.meta["solution"].split("\n    ", 1)[1]))] += 1
    assert sum(c for c, b in zip(counts, bodies) if b in fixed) <= 2
    assert all(c >= 3 for c, b in zip(counts, bodies) if b not in fixed), counts
    assert CodeEnv(test_size=30).test_set(4) != held_out
    # A spent template leaves the turns: a small level gives about as many distinct tasks as drawn at random. Level
    # 3 has 155, 125 beside its held-out set; with a spent template kept in the turns, level 2 gave 184 of 300. Taking
    # turns may drop a template a few tasks early: 50 refusals in a row also happen with 1 value of 24 left.
    drawn = CodeEnv(test_size=30)
    assert [len(drawn.sample_problems(lv, 300, seed=7)) for lv in (2, 3)] == [300, 125]
    cycled = [len(env.sample_problems(lv, 300, seed=7)) for lv in (2, 3)]
    assert cycled[0] == 300 and 120 <= cycled[1] <= 125, cycled


@pytest.mark.parametrize("query, expected", [
    ("DELETE FROM employees", "not authorized"),
    ("ATTACH DATABASE '/tmp/coevo-attach.db' AS x", "not authorized"),
    ("PRAGMA writable_schema = 1", "not authorized"),
    ("CREATE TABLE t (x)", "not authorized"),
    ("SELECT load_extension('/tmp/x')", "not authorized"),
    ("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c", "ran past 0.5s"),
    ("SELEC 1", "syntax error"),
])
def test_sql_execution_is_read_only_and_bounded(query, expected):
    env = SqlEnv(timeout_s=0.5)
    p, ep = _sql_episode(env)
    result = ep.step(toolcalls.parse(toolcalls.format_call("run_sql", {"query": query})))
    info = result.info["tool_calls"][0]
    assert not info["ok"] and expected in info["error"], info
    assert env.score(p, f"```sql\n{p.meta['gold']}\n```") == 1.0  # the database is unchanged


def test_sql_rows_are_capped():
    env = SqlEnv(max_rows=3)
    p, ep = _sql_episode(env)
    out = ep.step(toolcalls.parse(toolcalls.format_call(
        "run_sql", {"query": "SELECT a.name FROM sqlite_master AS a, sqlite_master AS b, sqlite_master AS c"})))
    assert out.observations[0]["content"].endswith("[more than 3 rows]")


def test_execution_match_compares_multisets_and_order_only_where_the_gold_orders():
    env = SqlEnv()
    top = next(p for p in env.sample_problems(1, 60, seed=2) if p.meta["ordered"])  # "the N best-paid"
    flat = env.sample_problems(1, 1, seed=0)[0]
    gold_top, gold_flat = top.meta["gold"], flat.meta["gold"]
    assert env.score(top, gold_top) == 1.0
    reversed_top = gold_top.replace("SELECT name FROM employees ORDER BY salary DESC",
                                    "SELECT name FROM (SELECT name, salary FROM employees ORDER BY salary DESC")
    assert env.score(top, reversed_top + ") ORDER BY salary") == 0.0  # the same rows, not in the order asked for
    assert env.score(flat, f"SELECT * FROM ({gold_flat}) ORDER BY name DESC") == 1.0  # any order
    assert env.score(flat, f"SELECT * FROM ({gold_flat}) UNION ALL SELECT * FROM ({gold_flat})") == 0.0  # multiset


def test_a_test_suite_of_sibling_databases_refuses_a_query_right_on_one_database_by_chance():
    """`d.name = 'Legal'` returns the rows of `d.city = 'Lisbon'` where Legal is Lisbon's only department; the
    siblings (the same schema and values, other rows) tell them apart, and an equivalent rewrite still passes."""
    lone, suite = SqlEnv(), SqlEnv(test_suite=4)
    for p in lone.sample_problems(3, 200, seed=0):
        city = re.search(r"d\.city = '(\w+)'", p.meta["gold"])
        con = lone._database(p) if city else None
        depts = con.execute("SELECT name FROM departments WHERE city = ?", (city[1],)).fetchall() if city else []
        if len(depts) == 1:
            break
    else:
        pytest.fail("no level-3 question on a city with one department in 200 draws")
    by_name = p.meta["gold"].replace(f"d.city = '{city[1]}'", f"d.name = '{depts[0][0]}'")
    nested = f"SELECT name FROM employees WHERE dept_id IN (SELECT id FROM departments WHERE city = '{city[1]}')"
    assert (lone.score(p, by_name), suite.score(p, by_name)) == (1.0, 0.0)
    assert (suite.score(p, p.meta["gold"]), suite.score(p, nested)) == (1.0, 1.0)
    assert [r.reward for r in replay(suite, [p])[0]] == [1.0]  # through the episode, on its own connection
    with pytest.raises(SqlError, match=r"test_suite=-1: expected a count of sibling databases >= 0"):
        SqlEnv(test_suite=-1)


@pytest.fixture
def spider(tmp_path):
    db = tmp_path / "database" / "zoo" / "zoo.sqlite"
    db.parent.mkdir(parents=True)
    con = sqlite3.connect(db)
    con.executescript("CREATE TABLE animal (id INTEGER, name TEXT, legs INTEGER);"
                      + "".join(f"INSERT INTO animal VALUES ({i}, 'a{i}', {i % 3 * 2});" for i in range(30)))
    con.commit()
    con.close()
    rows = [{"db_id": "zoo", "question": f"Names of animals with more than {k} legs?",
             "query": f"SELECT name FROM animal WHERE legs > {k}"} for k in range(4)]
    rows += [{"db_id": "zoo", "question": f"How many animals have {k} legs?",
              "SQL": f"SELECT count(*) FROM animal WHERE legs = {k}", "evidence": "legs is an integer"} for k in range(40)]
    path = tmp_path / "dev.json"
    path.write_text(json.dumps(rows))
    return path, tmp_path / "database", rows


def test_spider_and_bird_format_questions_over_sqlite_files(spider):
    path, databases, rows = spider
    env = SqlEnv(questions=str(path), databases=str(databases))
    assert env.levels() == [2] or set(env.levels()) <= {1, 2}
    problems = env.sample_problems(2, 3, seed=0) + env.test_set(2)
    assert all("Tables: CREATE TABLE animal" in p.prompt and "Hint: legs is an integer" in p.prompt for p in problems)
    records, _ = replay(env, problems)
    assert [r.reward for r in records] == [1.0] * len(problems)
    assert (databases / "zoo" / "zoo.sqlite").stat().st_size > 0
    with pytest.raises(SqlError, match=r"test_suite=2: .* 0 with Spider/BIRD files"):
        SqlEnv(questions=str(path), databases=str(databases), test_suite=2)


def test_a_missing_or_corrupt_database_or_a_bad_row_is_named_at_load(spider, tmp_path):
    path, databases, rows = spider
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(rows[:2] + [{"db_id": "gone", "question": "q", "query": "SELECT 1"}]))
    with pytest.raises(SqlError, match=r"bad.json: row 2: database .*gone/gone.sqlite is missing"):
        SqlEnv(questions=str(bad), databases=str(databases))
    (databases / "junk").mkdir()
    (databases / "junk" / "junk.sqlite").write_text("not a database")
    bad.write_text(json.dumps([{"db_id": "junk", "question": "q", "query": "SELECT 1"}]))
    with pytest.raises(SqlError, match=r"row 0: database .*junk.sqlite is not a readable SQLite file"):
        SqlEnv(questions=str(bad), databases=str(databases))
    bad.write_text(json.dumps([{"db_id": "zoo", "question": "q"}]))
    with pytest.raises(SqlError, match=r"row 0 needs db_id, question and query \(Spider\) or SQL \(BIRD\)"):
        SqlEnv(questions=str(bad), databases=str(databases))


# -- code --------------------------------------------------------------------------------------
def test_run_tests_reports_failures_and_a_hostile_answer_fails_safely(code_env):
    p = code_env.sample_problems(2, 1, seed=0)[0]
    ep = code_env.episode(p)
    ep.reset()
    wrong = ep.step(toolcalls.parse(toolcalls.format_call("run_tests", {"code": "def f(xs):\n    return 0"})))
    assert wrong.observations[0]["content"].startswith(f"0/{len(p.meta['tests'])} tests passed") or \
        "tests passed\nFAILED assert f(" in wrong.observations[0]["content"]
    loop = ep.step(toolcalls.parse(toolcalls.format_call("run_tests", {"code": "while True:\n    pass"})))
    assert "error: the run failed (cpu_time" in loop.observations[0]["content"]
    done = ep.step(toolcalls.parse(f"```python\n{p.meta['solution']}\n```"))
    assert (done.done, done.reward) == (True, 1.0)


def test_revise_demonstrations_fail_first_then_pass_through_the_loop():
    """`revise_fraction` reference episodes try the solution with one constant moved, read the failing tests,
    then try and answer the solution: the loop replays them to reward 1, and which problems revise is fixed."""
    env = CodeEnv(revise_fraction=1.0)
    problems = [p for level in env.levels() for p in env.sample_problems(level, 2, seed=3)]
    records, _ = replay(env, problems)
    assert [r.reward for r in records] == [1.0] * len(problems)
    revised = 0
    for p, rec in zip(problems, records):
        reports = [t.content for t in rec.turns if t.role == "tool"]
        calls = [json.loads(t.tool_arguments)["code"] for t in rec.turns if t.role == "tool"]
        total = len(p.meta["tests"])
        if len(reports) == 2:  # else the body has no constant, or the tests miss the slip: the plain episode
            revised += 1
            assert not reports[0].startswith(f"{total}/{total}") and "FAILED assert f(" in reports[0]
            assert reports[1] == f"{total}/{total} tests passed" and calls[1] == p.meta["solution"]
            assert calls[0] != calls[1] and len(calls[0].splitlines()) == len(calls[1].splitlines())
        else:
            assert reports == [f"{total}/{total} tests passed"]
    assert revised >= len(problems) * 0.8, revised
    half = CodeEnv(revise_fraction=0.5)
    first = [len(half.reference_episode(p)) for p in problems]
    assert first == [len(half.reference_episode(p)) for p in problems] and len(set(first)) == 2
    assert [len(CodeEnv().reference_episode(p)) for p in problems] == [min(first)] * len(problems)
    with pytest.raises(CodeError, match="revise_fraction must be within"):
        CodeEnv(revise_fraction=1.5)


def test_a_revise_demonstration_runs_each_try_in_the_sandbox_once(monkeypatch):
    """A revising reference episode reads whether its tests catch the slip from the slip's own run in the episode,
    so each try runs in the sandbox once (the slip, the solution, then the answer's score), not the slip twice."""
    env = CodeEnv(revise_fraction=1.0)
    problems = [p for level in env.levels() for p in env.sample_problems(level, 2, seed=3)]
    runs: list[str] = []
    run_python = env.sandbox.run_python
    monkeypatch.setattr(env.sandbox, "run_python", lambda *a, **k: runs.append(a[1]["solution.py"]) or run_python(
        *a, **k))
    revised = 0
    for p in problems:
        runs.clear()
        reports = [m["content"] for m in env.reference_episode(p) if m["role"] == "tool"]
        assert runs[-1] == p.meta["solution"], runs
        if len(reports) == 2:  # the slip, the solution, then the solution as the answer, scored
            revised += 1
            assert len(runs) == 3 and runs[0] != runs[1] == runs[2], runs
        else:  # no constant to move, or tests that miss the slip (its episode, then the plain one)
            assert len(runs) in (2, 5), runs
    assert revised >= len(problems) * 0.8, revised


@pytest.mark.parametrize("hack", [
    "import os\nos._exit(0)",  # exit before any test runs
    "import sys\nsys.exit(0)",
    "print(\"x ('results', [None, None, None, None, None])\")\nimport os\nos._exit(0)",  # a forged report
])
def test_a_solution_that_exits_early_or_forges_the_report_passes_nothing(code_env, hack):
    p = code_env.sample_problems(1, 1, seed=0)[0]
    assert code_env.score(p, f"```python\n{hack}\n```") == 0.0
    passed, seen = code_env.run_tests(p, hack)
    assert passed == 0 and seen.startswith("error: "), seen


def test_humaneval_and_mbpp_jsonl_tasks(tmp_path, code_env):
    path = tmp_path / "tasks.jsonl"
    rows = [{"task_id": f"H/{i}", "prompt": f"def add{i}(x):\n", "canonical_solution": f"    return x + {i}\n",
             "test": f"def check(c):\n    assert c(1) == {1 + i}\n", "entry_point": f"add{i}"} for i in range(12)]
    rows += [{"task_id": f"M/{i}", "prompt": f"Write mul{i}(x) returning x * {i}.", "code": f"def mul{i}(x):\n    return x * {i}",
              "test_list": [f"assert mul{i}(2) == {2 * i}", f"assert mul{i}(0) == 0"]} for i in range(12)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    env = CodeEnv(tasks=str(path))
    problems = env.sample_problems(1, 4, seed=0) + env.test_set(1)
    records, _ = replay(env, problems)
    assert [r.reward for r in records] == [1.0] * len(problems)
    path.write_text(json.dumps(rows[0]) + "\n" + json.dumps({"task_id": "x", "prompt": "def f(): pass"}) + "\n")
    with pytest.raises(CodeError, match=r"tasks.jsonl: row 2 has no tests: give `test` and `entry_point`"):
        CodeEnv(tasks=str(path))
    path.write_text("{not json\n")
    with pytest.raises(CodeError, match=r"tasks.jsonl: row 1 is not JSON"):
        CodeEnv(tasks=str(path))


def test_hindsight_relabels_a_wrong_episode_with_the_task_its_program_solves_and_replays_it(code_env):
    from components.envs.code import TASKS
    from components.envs.hindsight import relabel_episodes
    from components.envs.rollout import episode_batch

    seq = TASKS[4][0]  # a0 = c, a(i+1) = (a(i) * k + 1) % m
    asked = code_env.task(4, seq, {"k": 5, "c": 19, "m": 13})
    wrote = code_env.task(4, seq, {"k": 5, "c": 19, "m": 7})  # the loop, with another modulus
    held = next(p for p in code_env.test_set(4) if "(a(i) * " in p.prompt)  # a held-out task of the template
    asked2 = code_env.task(4, seq, {"k": 2, "c": 1, "m": 3})
    assert held.problem_id != asked2.problem_id
    # Each episode as the policy played it: the asked task's prompt, the turns of another task's reference.
    played = [(asked, wrote), (asked2, held), (asked, code_env.task(4, TASKS[4][3], {"k": 2, "c": 1, "m": 9}))]
    records, _ = replay(code_env, [w for _, w in played])
    for rec, (p, _) in zip(records, played):
        first = code_env.episode(p).reset()
        rec.problem, rec.messages[:len(first)] = p, first
        for turn, m in zip(rec.turns, first):
            turn.content = m["content"]
    batch = episode_batch(code_env, records, 3, experiment="e", round=1, purpose="train", policy_model_id="e/p",
                          seed=0, temperature=1.0, top_p=1.0, max_new_tokens=120)
    assert [code_env.score(p, rec.messages[-1]["content"]) for rec, (p, _) in zip(records, played)] == [0.0] * 3
    chats = {t["trajectory_id"]: rec.messages for t, rec in zip(batch.trajectories, records)}
    got, sources = relabel_episodes(code_env, batch.trajectories, batch.tables["problems"], chats, experiment="e",
                                    round=1)
    # Only the first: the second's program is a held-out task, the third's another template.
    [t] = got.trajectories
    assert sources == {t["trajectory_id"]: batch.trajectories[0]["trajectory_id"]}
    assert t["purpose"] == "hindsight" and t["problem_id"] == wrote.problem_id and t["prompt"] == wrote.prompt
    assert got.rewards[t["trajectory_id"]] == 1.0 and got.tables["problems"][0]["split"] == "train"
    # The turns are the policy's own; the observations are what the relabeled task's tests say of them.
    turns = [r for r in got.tables["turns"] if r["trajectory_id"] == t["trajectory_id"]]
    assert [r["content"] for r in turns if r["role"] == "assistant"] == [
        m["content"] for m in records[0].messages if m["role"] == "assistant"]
    total = len(wrote.meta["tests"])
    assert [r["content"].splitlines()[0] for r in turns if r["role"] == "tool"][-1] == f"{total}/{total} tests passed"
    assert code_env.hindsight(asked, "no code at all") is None
    assert code_env.hindsight(asked, records[0].messages[-1]["content"].replace("% 7", "% 99")) is None  # out of range


def test_variants_pose_a_right_episode_again_with_other_constants_in_every_turn(code_env):
    from components.envs.code import TASKS, parse_task
    from components.envs.hindsight import vary_episodes
    from components.envs.rollout import episode_batch

    seq = TASKS[4][0]  # a0 = c, a(i+1) = (a(i) * k + 1) % m
    params = {"k": 5, "c": 19, "m": 13}
    asked = code_env.task(4, seq, params)
    records, _ = replay(code_env, [asked])  # its reference episode: run_tests on the program, then the answer
    [rec] = records
    assert rec.right and [t.tool_name for t in rec.turns if t.role == "tool"] == ["run_tests"]
    batch = episode_batch(code_env, records, 1, experiment="e", round=1, purpose="train", policy_model_id="e/p",
                          seed=0, temperature=1.0, top_p=1.0, max_new_tokens=120)
    [src] = batch.trajectories
    chats = {src["trajectory_id"]: rec.messages}
    got, sources = vary_episodes(code_env, [src], batch.tables["problems"], chats, 3, 0, experiment="e", round=1)
    assert len(got.trajectories) == 3 and set(sources.values()) == {src["trajectory_id"]}
    held_out = {p.problem_id for p in code_env.test_set(4)}
    for t in got.trajectories:
        level, template, drawn = parse_task(t["prompt"])
        assert (level, template) == (4, seq) and drawn != params and t["problem_id"] not in held_out
        assert t["purpose"] == "variant" and got.rewards[t["trajectory_id"]] == 1.0
        program = code_env.task(4, seq, drawn).meta["solution"]
        turns = [r for r in got.tables["turns"] if r["trajectory_id"] == t["trajectory_id"]]
        # The program is written with the drawn constants in both turns, the tests' call and the answer, and the
        # tests ran again on the variant's task.
        call, answer = [r["content"] for r in turns if r["role"] == "assistant"]
        assert json.dumps(program)[1:-1] in call and f"```python\n{program}\n```" in answer
        total = len(code_env.task(4, seq, drawn).meta["tests"])
        assert [r["content"] for r in turns if r["role"] == "tool"] == [f"{total}/{total} tests passed"]
    again, _ = vary_episodes(code_env, [src], batch.tables["problems"], chats, 3, 0, experiment="e", round=1)
    assert [t["problem_id"] for t in again.trajectories] == [t["problem_id"] for t in got.trajectories]  # seeded
    # No variant of an answer with other constants than the asked ones, nor of another program.
    slipped = rec.messages[-1]["content"].replace("% 13", "% 7")
    assert code_env.score(asked, slipped) == 0.0 and code_env.variants(asked, [slipped], 3, random.Random(0)) == []
    assert code_env.variants(asked, ["no code at all"], 3, random.Random(0)) == []


# -- adapters ----------------------------------------------------------------------------------
def test_a_single_turn_domain_keeps_its_verifier():
    env = get_env("arith", max_level=2)
    assert isinstance(env, DomainEnv) and env.tools == ()
    problems = env.sample_problems(2, 5, seed=0)
    records, _ = replay(env, problems)
    assert [r.reward for r in records] == [1.0] * 5 and [len(r.turns) for r in records] == [2] * 5
    wrong = env.episode(problems[0])
    wrong.reset()
    assert wrong.step(toolcalls.parse("1+1=3\n#### 3\n")).reward == 0.0


class Counter:
    """An environment written for TRL's GRPOTrainer(environment_factory=Counter)."""

    def reset(self, target: int, **kwargs) -> str:
        self.target, self.value = target, 0
        return f"Reach {target}."

    def add(self, n: int) -> str:
        """Add to the counter.

        Args:
            n: how much to add
        """
        self.value += n
        return str(self.value)

    def get_reward(self) -> float:
        return float(self.value == self.target)


def test_an_environment_written_for_trl_runs_in_a_few_lines():
    rows = [{"prompt": [{"role": "user", "content": f"Count to {t}."}], "target": t} for t in range(1, 40)]
    env = TrlEnv(Counter, rows, name="counter")
    assert [t.name for t in env.tools] == ["add"]
    assert env.tools[0].parameters["properties"]["n"] == {"type": "integer", "description": "how much to add"}
    problems = env.sample_problems(1, 3, seed=0)
    scripts = {p.prompt + f"\n\nReach {p.meta['row']['target']}.":
               [toolcalls.format_call("add", {"n": p.meta["row"]["target"]}), "done"] for p in problems}
    records = EpisodeRunner(scripted(scripts), toolcalls.parse, env.limits).run([(p, env.episode(p)) for p in problems])
    assert [r.reward for r in records] == [1.0] * 3
    assert records[0].turns[3].content == str(problems[0].meta["row"]["target"])


class Guess:
    """An environment written for skyrl-gym (a BaseTextEnv): it parses its own actions."""

    def __init__(self, env_config, extras):
        self.answer, self.turns = extras["answer"], 0

    def init(self, prompt):
        return prompt, {}

    def step(self, action):
        self.turns += 1
        if action.strip() == str(self.answer):
            return {"observations": [], "reward": 1.0, "done": True, "metadata": {}}
        hint = "higher" if int(action) < self.answer else "lower"
        return {"observations": [{"role": "user", "content": hint}], "reward": 0.0, "done": False, "metadata": {}}


def test_an_environment_written_for_skyrl_gym_runs_in_a_few_lines():
    rows = [{"prompt": f"Guess my number ({i}).", "answer": 7} for i in range(30)]
    env = SkyrlEnv(Guess, rows, name="guess")
    p = env.sample_problems(1, 1, seed=0)[0]
    [rec] = EpisodeRunner(scripted({p.prompt: ["3", "9", "7"]}), toolcalls.parse, EpisodeLimits(max_turns=4)).run(
        [(p, env.episode(p))])
    assert rec.reward == 1.0 and [t.content for t in rec.turns if t.role == "user"][1:] == ["higher", "lower"]


def test_monte_carlo_turn_labels_go_on_from_each_turn_with_what_it_observed():
    from components.envs.labels import mc_turn_labels

    env = get_env("calculator")
    p = env.sample_problems(3, 1, seed=0)[0]
    expression = p.prompt.removeprefix("What is ").removesuffix("?")
    right, wrong = (toolcalls.format_call("calculate", {"expression": e}) for e in (expression, "1+1"))
    episodes = {"a": [right, f"#### {p.answer}"], "b": [wrong, "#### 2"], "c": [right, "#### 7"]}
    items = []
    for tid, turns in episodes.items():
        [rec] = EpisodeRunner(scripted({p.prompt: turns}), toolcalls.parse, env.limits).run([(p, env.episode(p))])
        items.append({"trajectory_id": tid, "problem": p, "messages": rec.messages, "correct": rec.reward >= 1.0})
    calls = []

    def answers_what_it_read(conversations):
        """Answers with the last observation, every other conversation of a batch one off it."""
        calls.append(len(conversations))
        return [(f"#### {int([m['content'] for m in c if m['role'] == 'tool'][-1]) + i % 2}", 2, "stop")
                for i, c in enumerate(conversations)]

    rows, stats = mc_turn_labels(env, answers_what_it_read, items, k=4)
    soft = {(r["trajectory_id"], r["step_index"]): (r["value"], r["num_rollouts"]) for r in rows
            if r["source"] == "mc_soft"}
    # From the right call's observation half the continuations answer right; from the wrong call's, none can.
    # The last turn is the episode's own outcome.
    assert soft == {("a", 0): (0.5, 4), ("a", 1): (1.0, 0), ("b", 0): (0.0, 4), ("b", 1): (0.0, 0),
                    ("c", 0): (0.5, 4), ("c", 1): (0.0, 0)}
    assert {(r["trajectory_id"], r["step_index"]): r["value"] for r in rows if r["source"] == "mc_hard"}[("a", 0)] == 1
    # a and c open with the same call: one prefix, rolled out once; all 8 continuations in one batch.
    assert (stats["unique_prefixes"], stats["rollouts"], stats["replay_mismatches"], calls) == (2, 8, 0, [8])


def test_first_error_turn_labels_search_a_wrong_episode_for_its_first_dead_turn():
    """score.mc_strategy=first_error on episodes: a right episode is 1 at every turn with no rollout; a wrong one is
    searched by bisection over its turns, and what a rolled-out turn says fixes the turns before or after it."""
    from components.envs.labels import mc_first_error_turn_labels

    env = get_env("calculator")
    p, q = env.sample_problems(3, 2, seed=0)
    expression = p.prompt.removeprefix("What is ").removesuffix("?")
    right, wrong = (toolcalls.format_call("calculate", {"expression": e}) for e in (expression, "1+1"))
    episodes = {"a": (p, [right, f"#### {p.answer}"]),  # right
                "b": (p, [wrong, "#### 2"]),  # dead from its first turn: from the wrong call's result, no way on
                "c": (p, [right, "#### 7"]),  # alive after its right call, dead at its answer
                "d": (p, [wrong, right, "#### 7"]),  # bisection rolls out turn 1 only: alive, so turn 0 is too
                "e": (q, [wrong, "#### 2"])}  # no episode of q is right: not searched
    items = []
    for tid, (problem, turns) in episodes.items():
        [rec] = EpisodeRunner(scripted({problem.prompt: turns}), toolcalls.parse, env.limits).run(
            [(problem, env.episode(problem))])
        items.append({"trajectory_id": tid, "problem": problem, "messages": rec.messages,
                      "correct": rec.reward >= 1.0, "root_alive": problem is p})
    assert [it["correct"] for it in items] == [True, False, False, False, False]
    calls = []

    def answers_what_it_read(conversations):
        calls.append(len(conversations))
        return [(f"#### {[m['content'] for m in c if m['role'] == 'tool'][-1]}", 2, "stop") for c in conversations]

    rows, stats = mc_first_error_turn_labels(env, answers_what_it_read, items, k=2)
    assert {r["source"] for r in rows} == {"mc_hard"}
    got = {(r["trajectory_id"], r["step_index"]): (r["value"], r["num_rollouts"]) for r in rows}
    assert got == {("a", 0): (1.0, 0), ("a", 1): (1.0, 0),
                   ("b", 0): (0.0, 2), ("b", 1): (0.0, 0),
                   ("c", 0): (1.0, 2), ("c", 1): (0.0, 0),
                   ("d", 0): (1.0, 0), ("d", 1): (1.0, 2), ("d", 2): (0.0, 0),
                   ("e", 1): (0.0, 0)}
    assert (stats["unique_prefixes"], stats["rollouts"], stats["search_levels"], stats["dead_root"]) == (3, 6, 1, 1)
    assert calls == [6] and stats["replay_mismatches"] == 0  # one level: every continuation in one batch


def test_a_resumed_episode_has_its_environment_replayed_to_where_it_stood():
    """A stateful environment (TRL's style: a counter): going on from a turn needs the state that turn left."""
    from components.envs.labels import mc_turn_labels

    env = TrlEnv(Counter, [{"prompt": [{"role": "user", "content": f"Count ({i})."}], "target": 5} for i in range(40)],
                 name="counter")
    p = env.sample_problems(1, 1, seed=0)[0]
    add = {n: toolcalls.format_call("add", {"n": n}) for n in (2, 3)}
    [rec] = EpisodeRunner(scripted({p.prompt + "\n\nReach 5.": [add[3], add[3], "done"]}), toolcalls.parse,
                          env.limits).run([(p, env.episode(p))])
    assert rec.reward == 0.0  # 3 + 3 overshoots
    edited = [dict(m) for m in rec.messages]
    edited[3]["content"] = "4"  # a stored observation the environment would not give

    def adds_two_to_three(conversations):
        return [(add[2] if c[-1]["content"] == "3" else "done", 1, "stop") for c in conversations]

    items = [{"trajectory_id": "t", "problem": p, "messages": rec.messages, "correct": False},
             {"trajectory_id": "u", "problem": p, "messages": edited, "correct": False}]
    rows, stats = mc_turn_labels(env, adds_two_to_three, items, k=2)
    soft = {(r["trajectory_id"], r["step_index"]): r["value"] for r in rows if r["source"] == "mc_soft"}
    # After the first add the counter stood at 3: adding 2 reaches 5. Replayed from 0 it would stand at 2.
    assert soft == {("t", 0): 1.0, ("t", 1): 0.0, ("t", 2): 0.0, ("u", 0): 0.0, ("u", 1): 0.0, ("u", 2): 0.0}
    assert stats["replay_mismatches"] == 4  # u's two prefixes, rolled out twice each


@pytest.mark.parametrize("name", ["calculator", "sql"])
def test_a_reward_model_reads_an_episode_as_its_turns_with_what_each_observed(name):
    """A PRM's steps for an episode: each assistant turn with the observations after it. Joined they are the
    transcript the store keeps as the completion, and there is one per assistant turn (one per Monte Carlo label)."""
    from components.envs.records import episode_rows
    from components.envs.rollout import episode_steps

    env = get_env(name)
    records, _ = replay(env, env.sample_problems(3, 3, seed=0))
    for k, rec in enumerate(records):
        rows = episode_rows(rec, experiment="e", round=1, purpose="train", policy_model_id=None, sample_index=k,
                            temperature=1.0, top_p=1.0, max_new_tokens=64, seed=0, verifier="v", verifier_version="1")
        [traj] = rows["trajectories"]
        steps = episode_steps(rows["turns"])[traj["trajectory_id"]]
        assert "\n".join(steps) == traj["completion"] and len(steps) == len(rows["steps"]) == 2
        assert steps[0].startswith(rows["steps"][0]["text"]) and "\n[tool:" in steps[0]


def test_sql_one_shot_answers_in_one_turn_with_no_tool_over_the_same_problems():
    """`explore=False`: the baseline the agent is compared with. Same problems and held-out set, one turn, no tool."""
    agent, one_shot = SqlEnv(test_size=5), SqlEnv(test_size=5, explore=False)
    assert [p.problem_id for p in one_shot.test_set(3)] == [p.problem_id for p in agent.test_set(3)]
    problems = one_shot.sample_problems(3, 3, seed=0)
    records, _ = replay(one_shot, problems)
    assert [r.reward for r in records] == [1.0] * 3
    assert [m["role"] for m in one_shot.reference_episode(problems[0])] == ["system", "user", "assistant"]
    assert "run_sql" not in records[0].messages[0]["content"] and one_shot.tools == ()
    look = toolcalls.format_call("run_sql", {"query": "SELECT 1"})
    [rec] = EpisodeRunner(scripted({problems[0].prompt: [look]}), toolcalls.parse, one_shot.limits).run(
        [(problems[0], one_shot.episode(problems[0]))])
    assert (rec.status, rec.reward) == ("truncated_turns", 0.0) and rec.turns[-1].content.startswith("error: unknown")


def test_sql_lookup_values_are_spelled_per_database_so_only_a_look_at_the_data_answers():
    """`lookup_values=True`: each database stores its categorical values in a style of its own while the question
    names them plainly. The reference episode looks the spelling up and scores 1; the plain name scores 0 wherever
    the stored spelling differs from it (all but the plain style, and lower case for the lower-case categories).
    The default environment stores the plain names."""
    from components.envs.sql import CATEGORIES, CITIES, COUNTRIES, DEPTS, SPELLINGS

    env = SqlEnv(lookup_values=True)
    problems = [p for lv in (1, 3) for p in env.sample_problems(lv, 12, seed=5)]
    looked = [p for p in problems if p.meta["lookup"]]
    assert {p.meta["spelling"] for p in looked} == {"plain", "upper", "lower", "code"}
    records, _ = replay(env, problems)
    assert [r.reward for r in records] == [1.0] * len(problems)
    names = CATEGORIES + CITIES + COUNTRIES + DEPTS
    for p, rec in zip(problems, records, strict=True):
        call, seen = [t.content for t in rec.turns if t.role in ("assistant", "tool")][:2]
        # No LIMIT: a policy copied the exploration's LIMIT into its answer to "the N best-paid" (docs/envs.md).
        assert (p.meta["lookup"] or "SELECT count(*) FROM") in call and "LIMIT" not in call
        if not p.meta["lookup"]:
            continue
        value = re.search(r"'([^']+)'", p.meta["gold"]).group(1)
        assert value in seen  # the observation shows the stored spelling
        [plain] = [n for n in names if SPELLINGS[p.meta["spelling"]](n) == value]
        assert plain in p.prompt and (value == plain) == (p.meta["spelling"] == "plain" or plain == plain.lower()
                                                          and p.meta["spelling"] == "lower")
        guessed = env.score(p, "```sql\n" + p.meta["gold"].replace(f"'{value}'", f"'{plain}'") + "\n```")
        assert guessed == float(value == plain), p.meta
    # Over more draws than the replay above (12 a level is too few to count on): most stored spellings differ.
    looked = [p for lv in (1, 3) for p in env.sample_problems(lv, 100, seed=5) if p.meta["lookup"]]
    assert sum(SPELLINGS[p.meta["spelling"]](n) != n for p in looked for n in names if n in p.prompt) > len(looked) / 2
    for p in SqlEnv().sample_problems(3, 6, seed=5):
        assert "spelling" not in p.meta and re.search(r"'([^']+)'", p.meta["gold"]).group(1) in names


def test_sql_hide_columns_names_columns_per_database_so_only_a_look_at_the_tables_answers():
    """`hide_columns=True`: each database names its columns from COLUMN_NAMES its own way, and the prompt lists its
    tables without them. The reference episode reads the header of the tables the gold query reads (no rows) and
    scores 1, on the problem's database and on its siblings; the gold query with the usual names scores 0 wherever a
    column it reads was renamed. With lookup_values as well, the episode looks at both."""
    from components.envs.sql import COLUMN_NAMES, renamed

    env = SqlEnv(hide_columns=True, test_suite=2)
    problems = [p for lv in env.levels() for p in env.sample_problems(lv, 8, seed=5)]
    drawn = {name for p in problems for name in p.meta["columns"].values()}
    assert drawn == {name for names in COLUMN_NAMES.values() for name in names}  # every name is some database's
    records, _ = replay(env, problems)
    assert [r.reward for r in records] == [1.0] * len(problems)
    moved = 0
    for p, rec in zip(problems, records, strict=True):
        assert re.search(r"\. Tables: [a-z]+(, [a-z]+)+\.\nQuestion: ", p.prompt) and "TEXT" not in p.prompt
        look, header = [t.content for t in rec.turns if t.role in ("assistant", "tool")][:2]
        assert "WHERE 0" in look and header.endswith("(0 rows)")
        usual = {v: k for k, v in p.meta["columns"].items()}
        plain = renamed(p.meta["gold"], usual)
        if plain != p.meta["gold"]:
            moved += 1
            assert all(name in header for name in p.meta["columns"].values() if name in p.meta["gold"])
            assert env.score(p, f"```sql\n{plain}\n```") == 0.0
    assert moved > len(problems) / 2
    both = SqlEnv(hide_columns=True, lookup_values=True)
    problems = both.sample_problems(3, 6, seed=5)
    records, _ = replay(both, problems)
    assert [r.reward for r in records] == [1.0] * 6
    assert all(sum(t.role == "tool" for t in rec.turns) == 2 for rec in records)
    # The default environment shows every column, under its usual name.
    for p in SqlEnv().sample_problems(1, 4, seed=5):
        assert "columns" not in p.meta and "name TEXT" in p.prompt


def stored_turns(rec, trajectory_id: str = "") -> list[dict]:
    """An episode's turns as the store keeps the columns a step checker reads."""
    return [{"trajectory_id": trajectory_id, "turn_index": t.turn_index, "role": t.role, "content": t.content,
             "tool_name": t.tool_name, "tool_ok": t.ok} for t in rec.turns]


def checked(env, scripts: dict[str, list[str]], problems) -> list[tuple[float, bool | None]]:
    """Each problem's scripted episode through the loop: its reward, and the step checker's verdict on its turns
    as the store keeps them."""
    runner = EpisodeRunner(scripted(scripts), toolcalls.parse, env.limits)
    return [(rec.reward, env.check_episode(p.prompt, stored_turns(rec)))
            for p, rec in zip(problems, runner.run([(p, env.episode(p)) for p in problems]), strict=True)]


def test_the_step_checker_passes_every_reference_episode_and_no_right_answer_reached_by_a_shortcut(code_env):
    """filter.check_steps on episodes (`check_episode`): every reference episode of every level checks out, run
    through the loop, and each shortcut below is right (reward 1) and does not: a calculator answer written without
    the tool, from a call on the answer itself, or after a call that did not parse; code answered untested, or
    changed after its last run; an SQL value spelled as stored but never looked up, or an exploratory query that
    failed. The one-shot SQL environment has no tool, so nothing to check."""
    from components.envs.calculator import CalculatorEnv
    from components.envs.code import flawed

    call = toolcalls.format_call
    calc, lookup = CalculatorEnv(), SqlEnv(lookup_values=True)
    for env in (calc, SqlEnv(), lookup, code_env):
        problems = [p for level in env.levels() for p in env.sample_problems(level, 3, seed=4)]
        scripts = {p.prompt: [m["content"] for m in env.reference_episode(p) if m["role"] == "assistant"]
                   for p in problems}
        assert checked(env, scripts, problems) == [(1.0, True)] * len(problems), env.name
    one_shot = SqlEnv(explore=False)
    problems = one_shot.sample_problems(1, 3, seed=4)
    assert checked(one_shot, {p.prompt: [f"```sql\n{p.meta['gold']}\n```"] for p in problems}, problems) == \
        [(1.0, None)] * 3

    p = calc.sample_problems(3, 1, seed=4)[0]
    shortcuts = [[f"#### {p.answer}"], [call("calculate", {"expression": p.answer}), f"#### {p.answer}"],
                 ['<tool_call>{"name": </tool_call>', call("calculate", {"expression": p.meta["expression"]}),
                  f"#### {p.answer}"]]
    for script in shortcuts:
        assert checked(calc, {p.prompt: script}, [p]) == [(1.0, False)], script
    p = next(p for p in code_env.sample_problems(4, 20, seed=4) if flawed(p.meta["solution"], random.Random(0)))
    solution, wrong = p.meta["solution"], flawed(p.meta["solution"], random.Random(0))
    for script in ([f"```python\n{solution}\n```"],
                   [call("run_tests", {"code": wrong}), f"```python\n{solution}\n```"]):
        assert checked(code_env, {p.prompt: script}, [p]) == [(1.0, False)], script
    p = next(p for p in lookup.sample_problems(1, 40, seed=4) if p.meta["lookup"] and p.meta["spelling"] != "plain")
    answer = f"```sql\n{p.meta['gold']}\n```"
    for script in ([answer], [call("run_sql", {"query": "SELECT nothing FROM nowhere"}), answer]):
        assert checked(lookup, {p.prompt: script}, [p]) == [(1.0, False)], script


def test_grpo_checks_right_episodes_on_their_turns():
    """filter.check_steps under recipe grpo (`steps_checked`): the right episodes' verdicts, from their turns; a wrong
    one is not checked, and an environment without a tool checks nothing."""
    from components.envs.calculator import CalculatorEnv
    from components.stages.filter import steps_checked

    env = CalculatorEnv()
    p = env.sample_problems(2, 1, seed=4)[0]
    runner = EpisodeRunner(scripted({p.prompt: [f"#### {p.answer}"]}), toolcalls.parse, env.limits)
    shortcut = runner.run([(p, env.episode(p))])[0]
    reference = replay(env, [p])[0][0]
    turns = [row for tid, rec in (("ref", reference), ("short", shortcut), ("wrong", shortcut))
             for row in stored_turns(rec, tid)]
    trajs = [{"trajectory_id": tid, "prompt": p.prompt, "completion": ""} for tid in ("ref", "short", "wrong")]
    assert steps_checked(env, trajs, {"ref": 1.0, "short": 1.0, "wrong": 0.0}, turns) == {"ref": True, "short": False}
    assert steps_checked(SqlEnv(explore=False), trajs, {"ref": 1.0, "short": 1.0, "wrong": 0.0}, turns) == {}


class WarmGuess(Guess):
    """Guess, rewarding each turn itself (as skyrl-gym environments do): 0.5 for a guess within 2 of the answer."""

    def step(self, action):
        out = super().step(action)
        return out if out["done"] else out | {"reward": 0.5 if abs(int(action) - self.answer) <= 2 else 0.0}


def test_an_environments_own_turn_rewards_become_step_scores_and_each_turns_advantage():
    """score.reward_model=env: the turn rewards the environment gave, stored on the turns that earned them, are the
    episode's step scores (scorer `env`), which grpo's step credit takes as each turn's step reward."""
    from components.envs.labels import env_score_rows
    from components.envs.records import episode_rows
    from components.rl.advantages import group_advantages, step_advantages
    from components.stages.filter import step_rewards

    env = SkyrlEnv(WarmGuess, [{"prompt": f"Guess my number ({i}).", "answer": 7} for i in range(30)], name="guess")
    p = env.sample_problems(1, 1, seed=0)[0]
    scripts = [["3", "9", "7"], ["1", "2", "3", "4"]]  # warm then right; cold throughout, cut at 4 turns
    rows = {"trajectories": [], "turns": []}
    for k, script in enumerate(scripts):
        [rec] = EpisodeRunner(scripted({p.prompt: script}), toolcalls.parse, EpisodeLimits(max_turns=4)).run(
            [(p, env.episode(p))])
        got = episode_rows(rec, experiment="e", round=1, purpose="train", policy_model_id=None, sample_index=k,
                           temperature=1.0, top_p=1.0, max_new_tokens=8, seed=k, verifier="v", verifier_version="1")
        rows["trajectories"] += got["trajectories"]
        rows["turns"] += got["turns"]
    scores = env_score_rows(rows["trajectories"], rows["turns"])
    right, wrong = (t["trajectory_id"] for t in rows["trajectories"])
    steps = {r["trajectory_id"]: [] for r in scores}
    for r in scores:
        if r["aggregate"] == "step":
            steps[r["trajectory_id"]].append(r["value"])
    assert steps == {right: [0.0, 0.5, 1.0], wrong: [0.0, 0.0, 0.0, 0.0]} and {r["scorer"] for r in scores} == {"env"}
    process, source = step_rewards(scores, [], {right: 3, wrong: 4})
    assert source == "env step scores" and process == steps
    advantages = group_advantages([{"trajectory_id": t, "group_id": "g", "outcome": o, "shaping": 0.0}
                                   for t, o in ((right, 1.0), (wrong, 0.0))], scale="group", max_groups=None, seed=0)
    turns = step_advantages(advantages, process, 0.5)
    warm = [r["advantage"] for r in sorted(turns, key=lambda r: r["turn_index"]) if r["trajectory_id"] == right]
    assert warm[0] != warm[2]  # each turn of the right episode gets its own advantage from its turn rewards


def test_each_value_of_a_wide_range_changes_what_the_tests_expect():
    """A template with a wide parameter range (`RANGES`) gets tests that tell every value of it apart: with k 5-18
    on the old test strings, a solution written for k = 5 passed every task up to k = 18. Each range also names a
    template that exists, and is wider than the default it replaces."""
    from components.envs.code import DEFAULT_RANGES, RANGES, TASKS

    env = CodeEnv(isolation="none")
    templates = {t[1]: (level, t) for level, ts in TASKS.items() for t in ts}
    assert set(RANGES) <= set(templates), set(RANGES) - set(templates)
    for text, ranges in RANGES.items():
        level, template = templates[text]
        for name, (lo, hi) in ranges.items():
            assert hi - lo > DEFAULT_RANGES[name][1] - DEFAULT_RANGES[name][0], (text, name)
            expected = {}
            for value in range(lo, hi + 1):
                tests = env.task(level, template, {"k": 5, "c": 7, "m": 11, name: value}).meta["tests"]
                expected.setdefault(tuple(t.split(" == ", 1)[1] for t in tests), []).append(value)
            assert all(len(values) == 1 for values in expected.values()), (text, name, list(expected.values()))


def test_generated_code_tasks_are_many_per_level_and_their_tests_tell_answers_apart():
    """Every level has dozens of distinct tasks beside its held-out set, no template fills more than half of a
    held-out set (level 4's once held 28 of 30 tasks of one), and no task's tests all expect one value (a
    function returning a constant would pass them)."""
    env = CodeEnv(isolation="none", test_size=30)  # nothing runs: expectations come from our own references
    for level in env.levels():
        drawn = env.sample_problems(level, 300, seed=0)
        assert len({p.problem_id for p in drawn}) >= 60, level
        shapes = [re.sub(r"\d+", "#", p.meta["solution"]) for p in env.test_set(level)]
        assert len(set(shapes)) >= 3 and max(map(shapes.count, shapes)) <= 15, (level, sorted(set(shapes)))
        for p in drawn + env.test_set(level):
            expected = {t.split(" == ", 1)[1] for t in p.meta["tests"]}
            assert len(expected) >= 2, p.prompt
