"""The query guard (components/store/guard.py): escape attempts against a real store, each refused with
a clear message, nothing written, nothing read; and the read-only statements that must still pass.

    pytest tests/unit/test_query_guard.py -q -p no:xdist
    python -m tests.unit.test_query_guard        # prints the escape table of docs/store.md
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from components.store import Store, StoreError
from components.store.guard import QueryRefused, lock

MARKER = "MARKER-7f3a-secret"  # in every file outside the store; must never come back
TYPE = "coevo query takes one read-only statement (SELECT, WITH, DESCRIBE, SHOW, EXPLAIN)"
OUTSIDE = "coevo query reads the store's own tables only; DuckDB refused: Permission Error"

# (id, SQL, what the message says). {tmp}: a folder outside the store holding the secret files;
# {out}: an empty folder where a write would land, empty before and after.
ESCAPES = [
    # comments and several statements
    ("block-comment-hides-copy", "/* x */ COPY (SELECT 1 AS a) TO '{out}/x.csv'", f"{TYPE}; refused: COPY statement"),
    ("line-comment-hides-copy", "-- x\nCOPY (SELECT 1 AS a) TO '{out}/x.csv'", f"{TYPE}; refused: COPY statement"),
    ("select-then-copy", "SELECT 1; COPY (SELECT 1 AS a) TO '{out}/y.csv'", f"{TYPE}; got 2 statements (SELECT, COPY)"),
    ("with-select-then-install", "WITH x AS (SELECT 1) SELECT * FROM x; INSTALL httpfs",
     f"{TYPE}; got 2 statements (SELECT, LOAD)"),
    ("two-selects", "SELECT 1; SELECT 2", f"{TYPE}; got 2 statements (SELECT, SELECT)"),
    ("only-a-comment", "-- SELECT 1", f"{TYPE}; got 0 statements"),
    ("with-then-delete", "WITH x AS (SELECT 1) DELETE FROM problems", f"{TYPE}; refused: DELETE statement"),
    # COPY, EXPORT, IMPORT, ATTACH
    ("copy-to-parquet", "COPY problems TO '{out}/problems.parquet' (FORMAT parquet)",
     f"{TYPE}; refused: COPY statement"),
    ("copy-from-file", "COPY problems FROM '{tmp}/secret.csv'", f"{TYPE}; refused: COPY statement"),
    ("copy-from-database", "COPY FROM DATABASE coevo TO other",
     f"{TYPE}; got 4 statements (TRANSACTION, COPY_DATABASE, COPY_DATABASE, TRANSACTION)"),
    ("export-database", "EXPORT DATABASE '{out}/export'", f"{TYPE}; refused: EXPORT statement"),
    ("import-database", "IMPORT DATABASE '{tmp}/import'", f"{OUTSIDE}: Cannot access file"),
    ("attach", "ATTACH '{out}/other.duckdb' AS other", f"{TYPE}; refused: ATTACH statement"),
    ("detach", "DETACH coevo", f"{TYPE}; refused: DETACH statement"),
    ("use", "USE memory", f"{TYPE}; refused: USE (a SET statement)"),
    # extensions
    ("install", "INSTALL httpfs", f"{TYPE}; refused: INSTALL (a LOAD statement)"),
    ("force-install", "FORCE INSTALL httpfs", f"{TYPE}; refused: FORCE (a LOAD statement)"),
    ("load", "LOAD '{tmp}/evil.duckdb_extension'", f"{TYPE}; refused: LOAD statement"),
    ("update-extensions", "UPDATE EXTENSIONS", f"{TYPE}; refused: UPDATE EXTENSIONS (a statement of a kind"),
    # settings
    ("set-external-access-on", "SET enable_external_access = true", f"{TYPE}; refused: SET statement"),
    ("reset-lock", "RESET lock_configuration", f"{TYPE}; refused: RESET (a SET statement)"),
    ("set-variable", "SET VARIABLE home = 1", f"{TYPE}; refused: SET statement"),
    ("pragma-profile-to-file", "PRAGMA profiling_output = '{out}/profile.json'",
     f"{TYPE}; refused: PRAGMA (a SET statement)"),
    ("pragma-enable-profiling", "PRAGMA enable_profiling", f"{TYPE}; refused: PRAGMA statement"),
    # CALL and maintenance
    ("call-read-text", "CALL read_text('{tmp}/secret.txt')", f"{TYPE}; refused: CALL statement"),
    ("checkpoint", "CHECKPOINT", f"{TYPE}; refused: CHECKPOINT (a CALL statement)"),
    ("vacuum", "VACUUM", f"{TYPE}; refused: VACUUM statement"),
    ("begin-transaction", "BEGIN TRANSACTION", f"{TYPE}; refused: BEGIN (a TRANSACTION statement)"),
    ("prepare-copy", "PREPARE p AS COPY (SELECT 1) TO '{out}/p.csv'", f"{TYPE}; refused: PREPARE statement"),
    # macros and other writes
    ("create-macro", "CREATE MACRO leak(p) AS TABLE SELECT * FROM read_text(p)", f"{TYPE}; refused: CREATE statement"),
    ("create-temp-macro", "CREATE TEMP MACRO one() AS 1", f"{TYPE}; refused: CREATE statement"),
    ("create-table", "CREATE TABLE x AS SELECT 1 AS a", f"{TYPE}; refused: CREATE statement"),
    ("create-temp-table", "CREATE TEMP TABLE x AS SELECT 1 AS a", f"{TYPE}; refused: CREATE statement"),
    ("create-view", "CREATE VIEW v AS SELECT 1 AS a", f"{TYPE}; refused: CREATE statement"),
    ("create-secret", "CREATE SECRET s (TYPE s3, KEY_ID 'k', SECRET 's')", f"{TYPE}; refused: CREATE statement"),
    ("insert", "INSERT INTO problems VALUES ('p9', 'arith', 1, '1+1', '2', NULL, 'train')",
     f"{TYPE}; refused: INSERT statement"),
    ("update", "UPDATE problems SET answer = '3'", f"{TYPE}; refused: UPDATE statement"),
    ("delete", "DELETE FROM problems", f"{TYPE}; refused: DELETE statement"),
    ("truncate", "TRUNCATE problems", f"{TYPE}; refused: TRUNCATE (a DELETE statement)"),
    ("drop", "DROP TABLE problems", f"{TYPE}; refused: DROP statement"),
    ("alter", "ALTER TABLE problems ADD COLUMN x INT", f"{TYPE}; refused: ALTER statement"),
    ("explain-analyze-copy", "EXPLAIN ANALYZE COPY (SELECT 1) TO '{out}/e.csv'",
     f"{TYPE}; refused: EXPLAIN of COPY statement"),
    ("explain-options-copy", "EXPLAIN (FORMAT json) COPY (SELECT 1) TO '{out}/e.csv'",
     f"{TYPE}; refused: EXPLAIN of COPY statement"),
    ("pivot-creates-a-type", "PIVOT problems ON domain", f"{TYPE}; got 2 statements (CREATE, SELECT)"),
    # functions that read files or the environment from inside a SELECT
    ("read_text", "SELECT * FROM read_text('{tmp}/secret.txt')", f"{OUTSIDE}: Cannot access file"),
    ("read_blob", "SELECT * FROM read_blob('{tmp}/secret.txt')", f"{OUTSIDE}: Cannot access file"),
    ("read_csv", "SELECT * FROM read_csv('{tmp}/secret.csv')", f"{OUTSIDE}: Cannot access file"),
    ("read_csv_auto", "SELECT * FROM read_csv_auto('{tmp}/secret.csv')", f"{OUTSIDE}: Cannot access file"),
    ("read_parquet", "SELECT * FROM read_parquet('{tmp}/secret.parquet')", f"{OUTSIDE}: Cannot access file"),
    ("read_json", "SELECT * FROM read_json('{tmp}/secret.json')", f"{OUTSIDE}: Cannot access file"),
    ("parquet_metadata", "SELECT * FROM parquet_metadata('{tmp}/secret.parquet')", f"{OUTSIDE}: Cannot access file"),
    ("sniff_csv", "SELECT * FROM sniff_csv('{tmp}/secret.csv')", f"{OUTSIDE}: Cannot access file"),
    ("glob", "SELECT * FROM glob('{tmp}/*')", f"{OUTSIDE}: Cannot access file"),
    ("replacement-scan", "SELECT * FROM '{tmp}/secret.csv'", f"{OUTSIDE}: Cannot access file"),
    ("read-in-a-subquery", "SELECT (SELECT content FROM read_text('{tmp}/secret.txt')) AS c",
     f"{OUTSIDE}: Cannot access file"),
    ("read-through-query-function", "SELECT * FROM query('SELECT * FROM read_text(''{tmp}/secret.txt'')')",
     f"{OUTSIDE}: Cannot access file"),
    ("copy-through-query-function", "SELECT * FROM query('COPY (SELECT 1) TO ''{out}/q.csv''')",
     "Parser Error: Expected a single SELECT statement"),
    ("read-over-http", "SELECT * FROM read_parquet('https://example.com/x.parquet')", f"{OUTSIDE}: Cannot access file"),
    ("getenv", "SELECT getenv('HOME')", "Scalar Function with name getenv does not exist"),
]

ALLOWED = [
    ("select-a-view", "SELECT count(*) FROM v_round_summary", None, [(0,)]),
    ("with", "WITH p AS (SELECT * FROM problems) SELECT count(*) FROM p", None, [(2,)]),
    ("params", "SELECT problem_id FROM problems WHERE level = ? AND domain = ?", [2, "arith"], [("p2",)]),
    ("comments-and-semicolon", "-- how many\n/* problems */ SELECT count(*) FROM problems; -- done", None, [(2,)]),
    ("from-first", "FROM problems SELECT problem_id ORDER BY 1", None, [("p1",), ("p2",)]),
    ("pivot-with-values", "PIVOT problems ON domain IN ('arith') USING count(*) GROUP BY level ORDER BY level", None,
     [(1, 1), (2, 1)]),
    ("pragma-table-function", "PRAGMA table_info('problems')", None, None),
    ("describe", "DESCRIBE trajectories", None, None),
    ("show-tables", "SHOW TABLES", None, None),
    ("summarize", "SUMMARIZE problems", None, None),
    ("explain", "EXPLAIN SELECT * FROM problems", None, None),
    ("explain-analyze", "EXPLAIN ANALYZE SELECT count(*) FROM problems", None, None),
    ("explain-parenthesised", "EXPLAIN (SELECT 1) UNION SELECT 2", None, None),
]


def make_store(root: Path) -> tuple[Store, dict[str, str]]:
    """A real store with two problems, and beside it (outside it) files that hold MARKER."""
    store = Store(root / "wd" / "store")
    with store.writer() as con:
        con.execute("INSERT INTO problems VALUES ('p1', 'arith', 1, '1+1', '2', NULL, 'train'), "
                    "('p2', 'arith', 2, '2+2', '4', NULL, 'train')")
    store.query("SELECT 1")  # a reader's first open adds SQLite's -wal and -shm beside the catalog
    tmp = root / "outside"
    (tmp / "import").mkdir(parents=True)
    (tmp / "secret.txt").write_text(MARKER + "\n")
    (tmp / "secret.csv").write_text(f"a,b\n{MARKER},1\n")
    (tmp / "secret.json").write_text(f'{{"a": "{MARKER}"}}\n')
    pq.write_table(pa.table({"a": [MARKER]}), tmp / "secret.parquet")
    (tmp / "import" / "schema.sql").write_text(f"CREATE TABLE leaked AS SELECT '{MARKER}' AS a; {MARKER} garbage\n")
    (tmp / "import" / "load.sql").write_text(f"SELECT '{MARKER}';\n")
    (root / "written").mkdir()
    return store, {"tmp": str(tmp), "out": str(root / "written")}


def _files(root: Path) -> set[Path]:
    return set(root.rglob("*"))


@pytest.fixture
def guarded(tmp_path, monkeypatch):
    # DuckDB puts extensions and secrets under $HOME: a HOME of our own shows that nothing lands there.
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return make_store(tmp_path)


@pytest.fixture(scope="module")
def shared_guarded(tmp_path_factory):
    """`guarded` made once for the statements that only read or are refused (1.4 s a store): each test checks
    that it left every file under the root as it found it, so the next starts from the same store."""
    root = tmp_path_factory.mktemp("guarded")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOME", str(root / "home"))
        store, paths = make_store(root)
        yield store, paths, root


def _store_unchanged(store: Store) -> None:
    assert store.query("SELECT problem_id, answer FROM problems ORDER BY 1")[1] == [("p1", "2"), ("p2", "4")]
    assert {r[0] for r in store.query("SHOW TABLES")[1]}.isdisjoint({"x", "v", "leaked", "other"})


@pytest.mark.parametrize("sql, message", [c[1:] for c in ESCAPES], ids=[c[0] for c in ESCAPES])
def test_escape_is_refused_and_nothing_is_written_or_read(shared_guarded, sql, message):
    store, paths, root = shared_guarded
    sql = sql.format(**paths)
    before = _files(root)
    with pytest.raises(StoreError) as e:
        store.query(sql)
    said = str(e.value)
    assert message in said.splitlines()[0], said
    assert MARKER not in said and str(root / "home") not in said
    assert not any(Path(paths["out"]).iterdir())
    assert _files(root) == before  # not the store, not $HOME, nothing
    _store_unchanged(store)


@pytest.mark.parametrize("how", ["query", "query_arrow", "query_df", "rows"])
@pytest.mark.parametrize("case", ["select-then-copy", "read_text", "create-macro"])
def test_every_read_path_is_guarded(shared_guarded, how, case):
    store, paths, root = shared_guarded
    before = _files(root)
    _, sql, message = next(c for c in ESCAPES if c[0] == case)
    with pytest.raises(QueryRefused, match="^" + re.escape(message)) as e:
        getattr(store, how)(sql.format(**paths))
    assert MARKER not in str(e.value) and _files(root) == before


@pytest.mark.parametrize("sql, params, rows", [c[1:] for c in ALLOWED], ids=[c[0] for c in ALLOWED])
def test_read_only_statements_pass(shared_guarded, sql, params, rows):
    store, _, root = shared_guarded
    before = _files(root)
    cols, got = store.query(sql, params)
    assert cols and got
    if rows is not None:
        assert got == rows
    assert _files(root) == before


def test_the_reader_is_locked_even_without_the_parser_check(guarded):
    """The second wall alone: SQL run straight on the reader connection cannot open a file or unlock it."""
    store, paths = guarded
    with store.reader() as con:
        with pytest.raises(duckdb.PermissionException, match="disabled by configuration"):
            con.execute(f"SELECT * FROM read_text('{paths['tmp']}/secret.txt')")
        with pytest.raises(duckdb.PermissionException):
            con.execute(f"COPY (SELECT 1) TO '{paths['out']}/x.csv'")
        for setting in ("SET enable_external_access = true", "RESET enable_external_access",
                        "SET lock_configuration = false", "SET allowed_directories = ['/']"):
            with pytest.raises(duckdb.InvalidInputException, match="configuration has been locked"):
                con.execute(setting)
    assert not any(Path(paths["out"]).iterdir())


def test_the_readers_lake_is_locked_after_it_attached_its_store(guarded):
    """`Store.reader` attaches the DuckLake (catalog and data folder) first, then `guard.lock`: it keeps what
    it attached and its data folder, and reaches nothing else."""
    store, paths = guarded
    with store.reader() as con:
        assert con.execute("SELECT count(*) FROM problems").fetchone() == (2,)
        allowed = con.execute("SELECT current_setting('allowed_directories')").fetchone()[0]
        temp = con.execute("SELECT current_setting('temp_directory')").fetchone()[0]
        # its data folder, and DuckDB's own spill folder, which DuckDB adds itself
        assert set(allowed) - {str(Path(temp).resolve()) + "/"} == {str(store.path / "data") + "/"}
        with pytest.raises(duckdb.PermissionException):
            con.execute(f"SELECT * FROM read_text('{paths['tmp']}/secret.txt')")
        with pytest.raises(duckdb.PermissionException):  # beside the store, not in it
            con.execute(f"SELECT * FROM read_text('{store.path.parent}/../outside/secret.txt')")
        with pytest.raises(duckdb.PermissionException):
            con.execute(f"ATTACH '{paths['out']}/other.duckdb' AS o")
        with pytest.raises(duckdb.InvalidInputException, match="configuration has been locked"):
            con.execute("SET allowed_directories = ['/']")
    assert not any(Path(paths["out"]).iterdir())


def test_the_writer_is_not_locked(guarded):
    """Commits ingest Parquet with read_parquet: the writer keeps external access."""
    store, paths = guarded
    with store.writer() as con:
        assert con.execute("SELECT current_setting('enable_external_access')").fetchone() == (True,)
        assert con.execute(f"SELECT a FROM read_parquet('{paths['tmp']}/secret.parquet')").fetchone() == (MARKER,)


def test_coevo_query_refuses_exits_2_and_writes_nothing(guarded, tmp_path):
    from tests.unit.test_cli_errors import coevo

    store, paths = guarded
    wd = str(store.path.parent)
    for sql, message in [
        ("/* x */ COPY (SELECT 1 AS a) TO '{out}/x.csv'", f"{TYPE}; refused: COPY statement"),
        ("SELECT 1; COPY (SELECT 1 AS a) TO '{out}/y.csv'", f"{TYPE}; got 2 statements (SELECT, COPY)"),
        ("WITH x AS (SELECT 1) SELECT * FROM x; INSTALL httpfs", f"{TYPE}; got 2 statements (SELECT, LOAD)"),
        ("SELECT * FROM read_text('/etc/hostname')", f"{OUTSIDE}: Cannot access file \"/etc/hostname\""),
    ]:
        for output in (["--format", "table"], ["--format", "parquet", "--out", f"{paths['out']}.parquet"]):
            r = coevo("query", sql.format(**paths), "--workdir", wd, *output, cwd=tmp_path)
            assert r.returncode == 2, (sql, r.stdout, r.stderr)
            assert message in " ".join(r.stderr.split()), r.stderr
            assert "Traceback" not in r.stderr
            assert r.stdout.strip() == "" and MARKER not in r.stderr  # no rows: not the file's content
            assert not any(Path(paths["out"]).iterdir()) and not Path(paths["out"] + ".parquet").exists()
    assert not (tmp_path / ".duckdb").exists()  # the CLI's HOME
    _store_unchanged(store)


def print_table() -> None:
    """The escape table of docs/store.md: each attempt run against a fresh store, and what it got."""
    short = {TYPE: "[T]", OUTSIDE + ":": "[O]"}
    print("\n".join(f"- {k} = {v}" for v, k in short.items()))
    with tempfile.TemporaryDirectory() as d:
        store, paths = make_store(Path(d))

        def shown(text: str) -> str:
            for long, abbr in [*short.items(), (paths["tmp"], "$TMP"), (paths["out"], "$OUT"), ("\n", "\\n")]:
                text = text.replace(long, abbr)
            return text.replace("|", "\\|")

        print("\n| attempt | SQL | refused with |\n|---|---|---|")
        for name, sql, _ in ESCAPES:
            try:
                store.query(sql.format(**paths))
                got = "ran: NOT REFUSED"
            except StoreError as e:
                got = f"{type(e).__name__}: {str(e).splitlines()[0]}"
            print(f"| {name} | `{shown(sql.format(**paths))}` | {shown(got)} |")
        print("\n| allowed | SQL | result |\n|---|---|---|")
        for name, sql, params, _ in ALLOWED:
            cols, rows = store.query(sql, params)
            more = ", ..." if len(cols) > 3 else ""
            print(f"| {name} | `{shown(sql)}` | {len(rows)} rows of {', '.join(cols[:3])}{more} |")


if __name__ == "__main__":
    sys.exit(print_table())


def _python_with_tmpdir(tmp: Path, code: str, check: bool = True) -> subprocess.CompletedProcess:
    """`python -c code` run from the repository with TMPDIR=tmp (its stdout captured)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=check,
                          env={**os.environ, "TMPDIR": str(tmp)}, cwd=Path(__file__).resolve().parents[2])


def test_readers_share_one_empty_secret_folder_that_a_killed_one_cannot_leak(tmp_path):
    """Every process that reads the store points DuckDB's secret directory at an empty folder. One folder per
    process, removed at exit, leaked one per killed job (387 in /tmp after a day of the suite): now every process
    of a user shares one private folder, so a thousand readers, killed or not, leave that one."""
    code = "import os, components.store.guard as g; print(g._NO_SECRETS)"
    first, second = (_python_with_tmpdir(tmp_path, code).stdout.strip() for _ in range(2))
    killed = _python_with_tmpdir(tmp_path, "import os, signal, components.store.guard; "
                                           "os.kill(os.getpid(), signal.SIGKILL)", check=False)
    assert killed.returncode == -9
    shared = tmp_path / f"coevo-no-secrets-{os.getuid()}"
    assert first == second == str(shared)
    assert list(tmp_path.iterdir()) == [shared] and list(shared.iterdir()) == []
    assert shared.stat().st_mode & 0o777 == 0o700


@pytest.mark.parametrize("spoil", ["a file in it", "open to others", "a link"])
def test_a_shared_folder_that_is_not_private_and_empty_is_not_used(tmp_path, spoil):
    """A secret left in the shared folder would be loaded by every reader: then, or where the folder is open to
    others or a link to elsewhere, a process makes an empty folder of its own and removes it when it exits."""
    shared = tmp_path / f"coevo-no-secrets-{os.getuid()}"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    if spoil == "a link":
        shared.symlink_to(elsewhere)
    else:
        shared.mkdir(mode=0o700)
        if spoil == "a file in it":
            (shared / "s3.duckdb_secret").write_text("")
        else:
            shared.chmod(0o777)
    before = sorted(tmp_path.rglob("*"))
    out = _python_with_tmpdir(tmp_path, "import os, components.store.guard as g; "
                                        "print(g._NO_SECRETS, os.path.isdir(g._NO_SECRETS), os.listdir(g._NO_SECRETS))"
                              ).stdout
    folder, existed, listed = out.split()
    assert Path(folder).parent == tmp_path and Path(folder) not in (shared, elsewhere)
    assert (existed, listed) == ("True", "[]")
    assert sorted(tmp_path.rglob("*")) == before  # its own folder went when it exited


def test_a_forked_child_leaves_its_parents_own_secret_folder(tmp_path):
    """A forked child runs its parent's exit handlers when it exits (a worker forks its flow runs): without the
    pid check the child removed the folder its parent still named."""
    shared = tmp_path / f"coevo-no-secrets-{os.getuid()}"
    shared.mkdir()
    shared.chmod(0o777)  # not private: the process makes its own
    code = ("import os, sys, components.store.guard as g\n"
            "pid = os.fork()\n"
            "if pid == 0:\n    sys.exit(0)\n"
            "os.waitpid(pid, 0)\n"
            "print(os.path.isdir(g._NO_SECRETS), g._NO_SECRETS)\n")
    existed, folder = _python_with_tmpdir(tmp_path, code).stdout.split()
    assert existed == "True" and Path(folder).name.startswith("coevo-no-secrets-") and Path(folder).exists() is False
    assert list(tmp_path.iterdir()) == [shared]  # the parent's exit removed its own
