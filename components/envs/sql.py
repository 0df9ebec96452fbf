"""`sql`: questions over SQLite databases, answered with a query; the reward is execution match.

Two sources:

- generated (the default): each problem has its own small database, built from a seed (a company:
  departments, employees, projects; or a shop: customers, products, orders), and a question in one of five
  levels: 1 filter, 2 aggregate, 3 join, 4 group and having, 5 nested;
- Spider/BIRD format (`questions=` a JSON list of {db_id, question, query|SQL}, `databases=` a folder of
  `<db_id>/<db_id>.sqlite`): levels from the gold query's shape, the same five.

The agent may run exploratory queries (`run_sql`) and answers with a turn that holds no call: its last
```sql block (or the whole turn). With `explore=False` it answers in one turn, with no tool: the one-shot
baseline the agent is measured against (its reference episodes are the gold query alone). With
`lookup_values=True` each generated database stores its countries, categories, cities and department names in
a style of its own (as written, UPPER, lower, or a three-letter code, `SPELLINGS`) while the question names them
plainly, as BIRD's questions name values the data spells otherwise: a filter on one is right only after a look
at the data, which the reference episodes take (`SELECT DISTINCT country FROM customers`). With
`hide_columns=True` each generated database names some of its columns its own way (`COLUMN_NAMES`: `pay`,
`wage` or `earnings` for the salary) and the prompt lists its tables without their columns, as a database too
large for the prompt would: a query is right only with this database's names, which the reference episodes read
from the tables' header (`SELECT * FROM employees, departments WHERE 0`).

Execution is read-only and bounded: an authorizer lets through reads and nothing else (no ATTACH, PRAGMA, writes
or extensions), a progress handler ends a query past `timeout_s`, and at most `max_rows` rows are fetched. The reward is 1 when the answer's rows equal the gold query's as
multisets; order counts only where the gold query has an ORDER BY. On one database a wrong query can return the
right rows (`d.name = 'Legal'` where Legal is the only department in Lisbon); with `test_suite=k` a generated
question's answer must also match on k sibling databases (its schema, values and spelling, other rows), as
Spider's test-suite accuracy asks (Zhong et al., 2020). The agent explores its own database only.

    >>> env = SqlEnv()
    >>> p = env.sample_problems(level=3, n=1, seed=0)[0]
    >>> print(p.prompt)  # doctest: +ELLIPSIS
    Database shop-...
    Question: List the names of customers who ordered a product in the toys category.
    >>> env.score(p, "```sql\\n" + p.meta["gold"] + "\\n```"), env.score(p, "SELECT 1")
    (1.0, 0.0)
"""

from __future__ import annotations

import json
import random
import re
import sqlite3
import time
from collections import Counter
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path

from components.domains.base import Problem
from components.envs import toolcalls
from components.envs.base import EpisodeLimits, Message, Tool
from components.envs.episodes import Called, FileProblems, ToolEpisode, reference_messages

NAMES = ["Ada", "Ben", "Cleo", "Dan", "Eva", "Finn", "Gia", "Hugo", "Ines", "Jon", "Kai", "Lea", "Max", "Nia",
         "Omar", "Pia", "Quin", "Rosa", "Sam", "Tara", "Uma", "Vic", "Wes", "Xia", "Yara", "Zoe"]
CITIES = ["Lisbon", "Oslo", "Porto", "Rome", "Turin", "Vienna"]
DEPTS = ["Sales", "Research", "Support", "Legal", "Design", "Finance"]
COUNTRIES = ["Chile", "Japan", "Kenya", "Peru", "Spain"]
CATEGORIES = ["books", "games", "tools", "toys"]
_SQL_BLOCK = re.compile(r"```sql\s*(.*?)```", re.S | re.I)
_LITERAL = re.compile(r"'((?:[^']|'')*)'")
_ALLOWED = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}


class SqlError(ValueError):
    """A database or questions file that cannot be used: names the file and the row."""


# How a database stores its categorical values (`lookup_values`): each database draws one style, so the
# question's plain name ("Spain") is not the value to filter on ('SPA'), and only a look at the data says which.
SPELLINGS = {"plain": str, "upper": str.upper, "lower": str.lower, "code": lambda v: v[:3].upper()}
# The parameters that are stored values, and the query that shows how a database spells each.
LOOKUPS = {"country": "SELECT DISTINCT country FROM customers", "category": "SELECT DISTINCT category FROM products",
           "city": "SELECT DISTINCT city FROM departments", "dept": "SELECT name FROM departments"}
# The columns a database names its own way (`hide_columns`), and the names each draws from: never the usual one.
COLUMN_NAMES = {"salary": ("pay", "wage", "earnings"), "hired_year": ("start_year", "joined", "hire_year"),
                "budget": ("funds", "spend", "allocation"), "city": ("town", "site", "location"),
                "country": ("nation", "land", "home"), "category": ("kind", "section", "product_type"),
                "price": ("cost", "list_price", "amount"), "quantity": ("qty", "units", "count_ordered"),
                "year": ("order_year", "placed", "yr")}


def renamed(sql: str, columns: dict[str, str]) -> str:
    """`sql` (a database's script, a query) with each column of `columns` under its database's name.

    >>> renamed("SELECT d.city FROM employees WHERE hired_year > 2015 AND year = 1", {"city": "town", "year": "placed"})
    'SELECT d.town FROM employees WHERE hired_year > 2015 AND placed = 1'
    """
    if not columns:
        return sql
    return re.sub(r"\b(" + "|".join(map(re.escape, columns)) + r")\b", lambda m: columns[m.group(1)], sql)


def _company(rng: random.Random, spell=str) -> str:
    depts = rng.sample(DEPTS, 4)
    rows = [f"INSERT INTO departments VALUES ({i + 1}, '{spell(d)}', '{spell(rng.choice(CITIES))}');"
            for i, d in enumerate(depts)]
    salaries = rng.sample(range(30, 121), 12)  # distinct, so "best paid" has no ties
    for i, name in enumerate(rng.sample(NAMES, 12)):
        rows.append(f"INSERT INTO employees VALUES ({i + 1}, '{name}', {rng.randint(1, 4)}, {salaries[i] * 1000}, "
                    f"{rng.randint(2010, 2024)});")
    for i in range(5):
        rows.append(f"INSERT INTO projects VALUES ({i + 1}, 'P{i + 1}', {rng.randint(1, 3)}, {rng.randint(5, 90) * 1000});")
    return ("CREATE TABLE departments (id INTEGER PRIMARY KEY, name TEXT, city TEXT);\n"
            "CREATE TABLE employees (id INTEGER PRIMARY KEY, name TEXT, dept_id INTEGER REFERENCES departments(id), "
            "salary INTEGER, hired_year INTEGER);\n"
            "CREATE TABLE projects (id INTEGER PRIMARY KEY, name TEXT, dept_id INTEGER REFERENCES departments(id), "
            "budget INTEGER);\n" + "\n".join(rows))


def _shop(rng: random.Random, spell=str) -> str:
    rows = [f"INSERT INTO customers VALUES ({i + 1}, '{n}', '{spell(rng.choice(COUNTRIES))}');"
            for i, n in enumerate(rng.sample(NAMES, 8))]
    prices = rng.sample(range(3, 80), 8)
    rows += [f"INSERT INTO products VALUES ({i + 1}, 'item{i + 1}', '{spell(rng.choice(CATEGORIES))}', {prices[i]});"
             for i in range(8)]
    rows += [f"INSERT INTO orders VALUES ({i + 1}, {rng.randint(1, 7)}, {rng.randint(1, 8)}, {rng.randint(1, 5)}, "
             f"{rng.randint(2019, 2024)});" for i in range(16)]
    return ("CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT, country TEXT);\n"
            "CREATE TABLE products (id INTEGER PRIMARY KEY, name TEXT, category TEXT, price INTEGER);\n"
            "CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER REFERENCES customers(id), "
            "product_id INTEGER REFERENCES products(id), quantity INTEGER, year INTEGER);\n" + "\n".join(rows))


SCHEMAS = {"company": _company, "shop": _shop}

# Per level, per schema: (question, gold query) templates; {x} are drawn by `_params`.
QUESTIONS: dict[int, dict[str, list[tuple[str, str]]]] = {
    1: {"company": [("List the names of employees hired after {year}.",
                     "SELECT name FROM employees WHERE hired_year > {year}"),
                    ("List the names of employees earning at least {salary}.",
                     "SELECT name FROM employees WHERE salary >= {salary}"),
                    ("List the names of the {top} best-paid employees, highest salary first.",
                     "SELECT name FROM employees ORDER BY salary DESC LIMIT {top}")],
        "shop": [("List the names of customers from {country}.", "SELECT name FROM customers WHERE country = '{country}'"),
                 ("List the names of products in the {category} category.",
                  "SELECT name FROM products WHERE category = '{category}'")]},
    2: {"company": [("How many employees earn more than {salary}?",
                     "SELECT count(*) FROM employees WHERE salary > {salary}"),
                    ("What is the highest salary of employees hired before {year}?",
                     "SELECT max(salary) FROM employees WHERE hired_year < {year}")],
        "shop": [("How many orders were placed in {oyear}?", "SELECT count(*) FROM orders WHERE year = {oyear}"),
                 ("What is the total quantity ordered in {oyear} or later?",
                  "SELECT sum(quantity) FROM orders WHERE year >= {oyear}")]},
    3: {"company": [("List the names of employees who work in {city}.",
                     "SELECT e.name FROM employees e JOIN departments d ON e.dept_id = d.id WHERE d.city = '{city}'"),
                    ("List the names of employees in the {dept} department.",
                     "SELECT e.name FROM employees e JOIN departments d ON e.dept_id = d.id WHERE d.name = '{dept}'")],
        "shop": [("List the names of customers who ordered a product in the {category} category.",
                  "SELECT DISTINCT c.name FROM customers c JOIN orders o ON o.customer_id = c.id "
                  "JOIN products p ON o.product_id = p.id WHERE p.category = '{category}'")]},
    4: {"company": [("Which departments have more than {k} employees? Give their names.",
                     "SELECT d.name FROM departments d JOIN employees e ON e.dept_id = d.id GROUP BY d.id, d.name "
                     "HAVING count(*) > {k}"),
                    ("For each city with employees, how many employees work there?",
                     "SELECT d.city, count(*) FROM employees e JOIN departments d ON e.dept_id = d.id GROUP BY d.city")],
        "shop": [("Which customers placed at least {k} orders? Give their names.",
                  "SELECT c.name FROM customers c JOIN orders o ON o.customer_id = c.id GROUP BY c.id, c.name "
                  "HAVING count(*) >= {k}")]},
    5: {"company": [("List the names of employees who earn more than the average salary.",
                     "SELECT name FROM employees WHERE salary > (SELECT avg(salary) FROM employees)"),
                    ("List the names of departments that have no projects.",
                     "SELECT name FROM departments WHERE id NOT IN (SELECT dept_id FROM projects)"),
                    ("List the names of employees who earn more than every employee hired before {year}.",
                     "SELECT name FROM employees WHERE salary > "
                     "(SELECT max(salary) FROM employees WHERE hired_year < {year})")],
        "shop": [("List the names of products that were never ordered.",
                  "SELECT name FROM products WHERE id NOT IN (SELECT product_id FROM orders)"),
                 ("List the names of customers who placed an order in {oyear}.",
                  "SELECT name FROM customers WHERE id IN (SELECT customer_id FROM orders WHERE year = {oyear})")]},
}


def _params(rng: random.Random) -> dict[str, object]:
    return {"year": rng.randint(2012, 2022), "salary": rng.randint(4, 11) * 10000, "country": rng.choice(COUNTRIES),
            "category": rng.choice(CATEGORIES), "oyear": rng.randint(2019, 2024), "city": rng.choice(CITIES),
            "dept": rng.choice(DEPTS), "k": rng.randint(1, 3), "top": rng.randint(2, 4)}


def connect(script: str | None = None, path: str | Path | None = None) -> sqlite3.Connection:
    """A database that only reads: built in memory from `script`, or a file opened read-only."""
    if path is not None:
        con = sqlite3.connect(f"file:{Path(path).resolve()}?mode=ro", uri=True, check_same_thread=False)
    else:
        con = sqlite3.connect(":memory:", check_same_thread=False)
        con.executescript(script or "")
    con.set_authorizer(lambda action, *_: sqlite3.SQLITE_OK if action in _ALLOWED else sqlite3.SQLITE_DENY)
    return con


def execute(con: sqlite3.Connection, query: str, timeout_s: float = 2.0, max_rows: int = 200) -> tuple[list[str], list[tuple]]:
    """Run one read-only query: (column names, at most `max_rows` rows). Raises sqlite3.Error on a refused,
    failing or timed-out query."""
    deadline = time.monotonic() + timeout_s
    con.set_progress_handler(lambda: int(time.monotonic() > deadline), 1000)
    try:
        cur = con.execute(query)
        rows = cur.fetchmany(max_rows + 1)
        return [d[0] for d in cur.description or []], rows
    except sqlite3.OperationalError as e:
        if "interrupted" in str(e):
            raise sqlite3.OperationalError(f"query ran past {timeout_s:g}s") from None
        raise
    finally:
        con.set_progress_handler(None, 0)


def render(columns: list[str], rows: list[tuple], max_rows: int) -> str:
    shown = rows[:max_rows]
    lines = [" | ".join(columns)] + [" | ".join("NULL" if v is None else str(v) for v in r) for r in shown]
    more = len(rows) > max_rows
    return "\n".join(lines) + (f"\n[more than {max_rows} rows]" if more else f"\n({len(shown)} rows)")


def _norm(row: tuple) -> tuple:
    return tuple(round(v, 6) if isinstance(v, float) else v for v in row)


def answer_query(text: str) -> str:
    blocks = _SQL_BLOCK.findall(text)
    return (blocks[-1] if blocks else text).strip().rstrip(";")


def level_of(query: str) -> int:
    """A Spider/BIRD gold query's level, by its shape: nested 5, GROUP BY 4, JOIN 3, aggregate 2, else 1."""
    q = query.upper()
    if q.count("SELECT") > 1:
        return 5
    if "GROUP BY" in q:
        return 4
    if " JOIN " in q:
        return 3
    if re.search(r"\b(COUNT|SUM|AVG|MIN|MAX)\s*\(", q):
        return 2
    return 1


TOOL_SCHEMA = {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}


@dataclass
class SqlEnv(FileProblems):
    name: str = "sql"
    max_level: int = 5
    test_size: int = 50
    questions: str | None = None  # Spider/BIRD questions JSON; None: generated databases
    databases: str | None = None  # its folder of <db_id>/<db_id>.sqlite
    timeout_s: float = 2.0
    max_rows: int = 20  # rows an observation shows (execution match compares up to 10x more)
    limits: EpisodeLimits = EpisodeLimits(max_turns=3, max_wall_s=30.0, max_observation_chars=600)
    instructions: str = "Answer with one SQLite query in a ```sql block. You may run queries first."
    tools: tuple[Tool, ...] = (Tool("run_sql", "Run a read-only SQLite query on the database; see its rows.",
                                    TOOL_SCHEMA, None),)
    explore: bool = True  # False: one turn, no run_sql (the one-shot baseline)
    lookup_values: bool = False  # True: each database spells its stored values its own way (SPELLINGS)
    hide_columns: bool = False  # True: each database names some columns its own way (COLUMN_NAMES), not shown
    cycle_templates: bool = False  # True: a level's problems take its templates in turn (N problems: ~N/T each)
    test_suite: int = 0  # sibling databases the answer must match on as well (generated questions only)
    _files: dict[str, list[Problem]] = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if not self.explore:
            self.tools, self.instructions = (), "Answer with one SQLite query in a ```sql block."
            self.limits = EpisodeLimits(1, self.limits.max_wall_s, self.limits.max_observation_chars)
        if (self.questions is None) != (self.databases is None):
            raise SqlError("sql: give both `questions` (a Spider/BIRD JSON file) and `databases` (its folder), or neither")
        if self.test_suite < 0 or (self.test_suite and self.questions is not None):
            raise SqlError(f"sql: test_suite={self.test_suite}: expected a count of sibling databases >= 0, and 0 with "
                           "Spider/BIRD files, which give one database a question")
        if self.questions is not None:
            self._load(Path(self.questions), Path(self.databases))

    # -- problems ------------------------------------------------------------------------------
    def _templates(self, level: int) -> list[tuple[str, tuple[str, str]]]:
        return [(schema, t) for schema in sorted(QUESTIONS[level]) for t in QUESTIONS[level][schema]]

    def _draw(self, rng: random.Random, level: int, fixed: tuple[str, tuple[str, str]] | None = None) -> Problem:
        """A question of `level` on a database drawn from `rng`: its schema and template drawn too, or `fixed`."""
        for _ in range(100):
            schema = rng.choice(sorted(s for s in SCHEMAS if QUESTIONS[level].get(s))) if fixed is None else fixed[0]
            db_seed = rng.randrange(10**9)
            question, template = rng.choice(QUESTIONS[level][schema]) if fixed is None else fixed[1]
            params = _params(rng)
            spelling = rng.choice(sorted(SPELLINGS)) if self.lookup_values else "plain"
            spell = SPELLINGS[spelling]
            stored = {k: spell(v) if k in LOOKUPS else v for k, v in params.items()}
            columns = ({k: random.Random(f"{db_seed}:{k}").choice(v) for k, v in COLUMN_NAMES.items()}
                       if self.hide_columns else {})
            question, gold = question.format(**params), renamed(template.format(**stored), columns)
            script = renamed(SCHEMAS[schema](random.Random(db_seed), spell), columns)
            _, rows = execute(connect(script), gold, self.timeout_s, 10 * self.max_rows)
            if rows and rows[0] != (None,) and rows[0] != (0,):  # a question whose answer is nothing teaches nothing
                meta = {"schema": schema, "db_seed": db_seed, "gold": gold, "ordered": "ORDER BY" in gold.upper()}
                if self.lookup_values:
                    lookup = next((q for k, q in LOOKUPS.items() if f"{{{k}}}" in template), None)
                    meta |= {"spelling": spelling, "lookup": lookup and renamed(lookup, columns)}
                if self.hide_columns:
                    meta["columns"] = columns
                # The database's name is in the prompt: the same question on another database is another problem.
                prompt = f"Database {schema}-{db_seed}. {self._describe(script)}\nQuestion: {question}"
                return Problem.make(self.name, level, prompt, gold, meta)
        raise RuntimeError(f"sql: no non-empty question at level {level} in 100 draws")

    def _describe(self, script: str) -> str:
        tables = [line.split(" (", 1) for line in script.splitlines() if line.startswith("CREATE TABLE")]
        if self.hide_columns:
            return "Tables: " + ", ".join(name.removeprefix("CREATE TABLE ") for name, _ in tables) + "."
        return "Tables: " + "; ".join(f"{name.removeprefix('CREATE TABLE ')}({cols.rstrip(');')})"
                                      for name, cols in tables)

    def _load(self, questions: Path, databases: Path) -> None:
        try:
            rows = json.loads(questions.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise SqlError(f"{questions}: not a readable JSON list of questions: {e}") from None
        if not isinstance(rows, list):
            raise SqlError(f"{questions}: expected a JSON list of questions, got {type(rows).__name__}")
        problems: list[Problem] = []
        schemas: dict[str, str] = {}
        for i, row in enumerate(rows):
            gold = row.get("query") or row.get("SQL") if isinstance(row, dict) else None
            if not gold or not row.get("question") or not row.get("db_id"):
                raise SqlError(f"{questions}: row {i} needs db_id, question and query (Spider) or SQL (BIRD)")
            db = databases / row["db_id"] / f"{row['db_id']}.sqlite"
            if row["db_id"] not in schemas:
                if not db.is_file():
                    raise SqlError(f"{questions}: row {i}: database {db} is missing")
                try:
                    con = connect(path=db)
                    ddl = [r[0] for r in con.execute("SELECT sql FROM sqlite_master WHERE type = 'table'")]
                    con.close()
                except sqlite3.DatabaseError as e:
                    raise SqlError(f"{questions}: row {i}: database {db} is not a readable SQLite file: {e}") from None
                schemas[row["db_id"]] = "Tables: " + "; ".join(" ".join(d.split()) for d in ddl if d)
            meta = {"db_path": str(db), "gold": gold, "ordered": "ORDER BY" in gold.upper(), "db_id": row["db_id"],
                    "evidence": row.get("evidence")}
            hint = f"\nHint: {row['evidence']}" if row.get("evidence") else ""
            problems.append(Problem.make(self.name, level_of(gold),
                                         f"{schemas[row['db_id']]}\nQuestion: {row['question']}{hint}", gold, meta))
        # A fixed tenth of the questions (by id) is held out.
        self._hold_out(problems)

    # -- episodes ------------------------------------------------------------------------------
    def _database(self, problem: Problem, sibling: int | None = None) -> sqlite3.Connection:
        """The problem's database, or its `sibling`-th sibling: the same schema and spelling, rows from another seed."""
        if "db_path" in problem.meta:
            return connect(path=problem.meta["db_path"])
        spell = SPELLINGS[problem.meta.get("spelling", "plain")]
        seed = problem.meta["db_seed"] if sibling is None else f"{problem.meta['db_seed']}/{sibling}"
        script = SCHEMAS[problem.meta["schema"]](random.Random(seed), spell)
        return connect(renamed(script, problem.meta.get("columns", {})))

    def episode(self, problem: Problem) -> ToolEpisode:
        return ToolEpisode(self, problem, self.limits)

    def bind(self, problem: Problem) -> tuple[dict[str, Tool], sqlite3.Connection]:
        con = self._database(problem)

        def run_sql(query: str) -> str:
            try:
                cols, rows = execute(con, query, self.timeout_s, self.max_rows)
            except sqlite3.Error as e:
                raise ValueError(str(e)) from None
            return render(cols, rows, self.max_rows)

        if not self.explore:
            return {}, con
        return {"run_sql": Tool("run_sql", self.tools[0].description, TOOL_SCHEMA, run_sql)}, con

    def extract_answer(self, text: str) -> str | None:
        return answer_query(text) or None

    def score(self, problem: Problem, text: str, con: sqlite3.Connection | None = None) -> float:
        """Execution match: the answer's rows against the gold query's, as multisets (in order where the gold
        query orders), on the problem's database and, with `test_suite`, on each sibling. A query that fails, is
        refused or times out scores 0."""
        query = answer_query(text)
        if not self._matches(con or self._database(problem), problem, query):
            return 0.0
        for i in range(self.test_suite):  # 0 for Spider/BIRD files (__post_init__)
            with closing(self._database(problem, i)) as sibling:
                if not self._matches(sibling, problem, query):
                    return 0.0
        return 1.0

    def _matches(self, con: sqlite3.Connection, problem: Problem, query: str) -> bool:
        cap = 10 * self.max_rows
        try:
            _, want = execute(con, problem.meta["gold"], self.timeout_s, cap)
            _, got = execute(con, query, self.timeout_s, cap)
        except (sqlite3.Error, sqlite3.Warning, ValueError):
            return False
        want, got = [_norm(r) for r in want], [_norm(r) for r in got]
        return want == got if problem.meta["ordered"] else Counter(want) == Counter(got)

    def check_answer(self, prompt: str, calls: list[Called], answer: str) -> bool:
        """Every value the answer quotes is one the question or a query's rows showed: an answer that filters on
        a spelling it never saw (`lookup_values`: 'KENYA' where the question says Kenya) does not check out, even
        where the guess was right. LIKE's wildcards at either end are not part of the value.

        >>> env, seen = SqlEnv(), [Called("run_sql", {"query": "SELECT DISTINCT country FROM customers"},
        ...                               "country\\nKENYA\\nPERU", True)]
        >>> q = "Question: How many customers live in Kenya?"
        >>> [env.check_answer(q, calls, f"```sql\\nSELECT count(*) FROM customers WHERE country {cond}\\n```")
        ...  for calls, cond in [(seen, "= 'KENYA'"), ([], "= 'KENYA'"), ([], "LIKE 'Ken%'"), ([], "= 'Kenya'")]]
        [True, False, True, True]
        """
        shown = [prompt] + [c.observation for c in calls]
        values = [v.replace("''", "'").strip("%") for v in _LITERAL.findall(answer_query(answer))]
        return all(any(v in text for text in shown) for v in values)

    def reference_episode(self, problem: Problem) -> list[Message]:
        """One exploratory query, its result, then the gold query as the answer; with `explore=False`, the answer
        alone. The query looks up how the database spells the value the question filters on (`lookup_values`),
        or else counts the rows of the first table the gold query reads. With `hide_columns` a first query reads the
        header of every table the gold query reads, none of their rows. No query holds a LIMIT: a policy taught
        `SELECT * FROM employees LIMIT 3` first answered "the N best-paid" with `LIMIT 3` whatever N was
        (docs/envs.md)."""
        answer = f"```sql\n{problem.meta['gold']}\n```"
        if not self.explore:
            return reference_messages(self, problem, [(answer, None)], self.limits)
        tables = list(dict.fromkeys(re.findall(r"\b(?:FROM|JOIN)\s+(\w+)", problem.meta["gold"], re.I)))
        queries = [f"SELECT * FROM {', '.join(tables)} WHERE 0"] if "columns" in problem.meta else []
        if problem.meta.get("lookup") or not queries:
            queries.append(problem.meta.get("lookup") or f"SELECT count(*) FROM {tables[0]}")
        looks = [(toolcalls.format_call("run_sql", {"query": q}), None) for q in queries]
        return reference_messages(self, problem, [*looks, (answer, None)], self.limits)
