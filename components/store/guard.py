"""The one guard for SQL that a user hands the store: one read-only statement, on a locked connection.

    from components.store import Store
    Store("workdir/store").query("SELECT * FROM v_round_summary")   # through this guard
    coevo query "COPY trajectories TO '/tmp/x.csv'"                         # refused, exit 2

`coevo query`, the notebooks (`Store.query_df`) and every other read of the store go through it.
Two walls, each covering what the other cannot:

1. DuckDB's own parser says what the SQL is (`extract_statements`, never a regex): exactly one
   statement, of a kind that only reads. DuckDB parses WITH, DESCRIBE, SHOW, SUMMARIZE, FROM-first,
   `PIVOT ... IN (...)` and the PRAGMAs that are table functions (`PRAGMA table_info`) as SELECT.
   EXPLAIN passes when what it explains does: EXPLAIN ANALYZE runs its statement, and a SELECT is
   what this guard runs anyway. Everything else (COPY, EXPORT, ATTACH, INSTALL, LOAD, SET, PRAGMA,
   CALL, CHECKPOINT, CREATE, INSERT, PREPARE, a transaction, ...) is refused before it runs.
2. The connection: read-only, with no external access, so a SELECT can still not reach a file, the
   network or an extension through a function (`read_text`, `read_csv`, `glob`, `getenv`, a
   `FROM 'file.csv'` scan), and with its configuration locked so no statement can turn that back.
   See https://duckdb.org/docs/stable/operations_manual/securing_duckdb/overview.

The SQL is parsed on that locked connection too: parsing `IMPORT DATABASE 'dir'` reads `dir`'s
scripts, and on an open connection a parse error would echo them back.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import duckdb

from components.store.errors import StoreError

T = TypeVar("T")

READ_ONLY = "SELECT, WITH, DESCRIBE, SHOW, EXPLAIN"
_ALLOWED = {duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN}


class QueryRefused(StoreError):
    """The SQL is not one read-only statement, or it reached outside the store."""


def _empty_folder() -> str:
    """An empty folder for DuckDB's secret directory: nothing is ever written to it or read from it.

    One per user, made once and kept (`<tmp>/coevo-no-secrets-<uid>`), so that a process killed before its exit
    handlers run leaves nothing behind: one folder per process, removed at exit, left 387 in /tmp after a day of
    tests whose jobs are killed on purpose. Where that folder is not a private empty folder of this user's (a
    link, someone else's, open to others, or holding a file), the process makes one of its own and removes it
    when it exits (not when a forked child does); DuckDB works on with the folder gone."""
    shared = os.path.join(tempfile.gettempdir(), f"coevo-no-secrets-{os.getuid()}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(shared, 0o700)
    st = os.lstat(shared)
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077 and not os.listdir(shared):
        return shared
    own, made_by = tempfile.mkdtemp(prefix="coevo-no-secrets-"), os.getpid()
    atexit.register(lambda: os.getpid() == made_by and shutil.rmtree(own, ignore_errors=True))
    return own


_NO_SECRETS = _empty_folder()

# Settings a locked reader starts with: DuckDB takes some of them only before first use (the secret manager).
STARTUP = {
    "autoinstall_known_extensions": False,
    "autoload_known_extensions": False,
    "allow_community_extensions": False,
    # Not ~/.duckdb/stored_secrets: an empty folder of this process's. (`allow_persistent_secrets = false` would
    # do too, but then the postgres extension refuses to attach a catalog: "Unknown secret storage".)
    "secret_directory": _NO_SECRETS,
    "python_enable_replacements": False,  # a table name is a store table, never a caller's variable
}
# Then, once whatever it needs is attached or loaded, in this order:
LOCK = {
    "enable_external_access": False,  # no file, URL, ATTACH or extension outside the store
    "lock_configuration": True,  # no SET or RESET can undo the above
}


def locked_config() -> dict[str, Any]:
    """DuckDB connect config for a reader that sees the store's own data (one database file) and
    nothing else. A connection that must attach or load something first starts with `STARTUP` and calls `lock`."""
    return STARTUP | LOCK


def lock(con: duckdb.DuckDBPyConnection, allowed_directories: Sequence[str] = ()) -> None:
    """Lock a connection opened with `STARTUP`, as `locked_config` locks one at connect.

    For a reader that attaches its store first (a DuckLake catalog): attach, then lock.
    `allowed_directories`: where the store's data lies outside what is attached (its Parquet files);
    DuckDB takes them only after start and while external access is on, so they come first.
    """
    for name, value in STARTUP.items():
        if con.execute("SELECT current_setting(?)", [name]).fetchone()[0] != value:
            raise RuntimeError(f"guard.lock: the connection was not opened with guard.STARTUP ({name})")
    if allowed_directories:
        con.execute("SET allowed_directories = ?", [list(allowed_directories)])
    for name, value in LOCK.items():
        con.execute(f"SET {name} = {str(value).lower()}")


def _words(text: str) -> list[tuple[int, duckdb.token_type, str]]:
    """DuckDB's tokens of `text` as (offset, type, text); comments are not tokens."""
    tokens = duckdb.tokenize(text)
    ends = [o for o, _ in tokens[1:]] + [len(text)]
    return [(o, t, text[o:end].strip()) for (o, t), end in zip(tokens, ends)]


def _kind(st: duckdb.Statement) -> str:
    """`COPY statement`, or `INSTALL (a LOAD statement)` where the first word says more than the type."""
    words = [w for _, _, w in _words(st.query)]
    first = words[0].upper() if words else ""
    if not st.type.name.isidentifier():  # a type the Python API has no name for (UPDATE EXTENSIONS)
        return f"{' '.join(words[:2]).upper()} (a statement of a kind this guard does not know)"
    if not first.isidentifier() or first in (st.type.name, "WITH"):
        return f"{st.type.name} statement"
    return f"{first} (a {st.type.name} statement)"


def _explained(con: duckdb.DuckDBPyConnection, st: duckdb.Statement) -> list[list[duckdb.Statement]]:
    """What an `EXPLAIN [ANALYZE] [(options)] <statement>` wraps, parsed each way the text can be read.

    A leading parenthesis is either the options or the start of the statement (`EXPLAIN (SELECT 1)`),
    so both readings are returned; those that do not parse are left out.
    """
    text = st.query
    words = _words(text)
    i = 1  # after EXPLAIN
    if i < len(words) and words[i][2].upper() in ("ANALYZE", "ANALYSE"):
        i += 1
    starts = [i]
    if i < len(words) and words[i][2].startswith("("):
        depth = 0
        for j in range(i, len(words)):
            if words[j][1] == duckdb.token_type.operator:
                depth += words[j][2].count("(") - words[j][2].count(")")
            if depth == 0:
                starts.insert(0, j + 1)
                break
    readings = []
    for s in starts:
        if s < len(words):
            try:
                readings.append(con.extract_statements(text[words[s][0]:]))
            except duckdb.ParserException:
                pass
    return readings


def check(con: duckdb.DuckDBPyConnection, sql: str) -> duckdb.Statement:
    """The one read-only statement in `sql`, parsed by `con` (the locked one); else QueryRefused."""
    statements = con.extract_statements(sql)
    if len(statements) != 1:
        kinds = ", ".join(s.type.name for s in statements)
        hint = ""
        if len(statements) > 1 and any(not s.query.strip() for s in statements):
            # DuckDB expanded one statement into several (PIVOT without IN creates an enum type first).
            hint = "; DuckDB expands this one statement into several" + (
                ": give PIVOT its values, PIVOT t ON col IN ('a', 'b')" if "PIVOT" in sql.upper() else "")
        raise QueryRefused(f"coevo query takes one read-only statement ({READ_ONLY}); got {len(statements)} "
                           f"statements{f' ({kinds})' if kinds else ''}{hint}")
    st = statements[0]
    if st.type not in _ALLOWED:
        raise QueryRefused(f"coevo query takes one read-only statement ({READ_ONLY}); refused: {_kind(st)}")
    if st.type == duckdb.StatementType.EXPLAIN:
        readings = _explained(con, st)
        bad = [r for r in readings if len(r) != 1 or r[0].type != duckdb.StatementType.SELECT]
        if bad or not readings:
            what = _kind(bad[0][0]) if bad and bad[0] else "what it explains"
            raise QueryRefused(f"coevo query takes one read-only statement ({READ_ONLY}); refused: EXPLAIN of {what}")
    return st


def run(con: duckdb.DuckDBPyConnection, sql: str, params: list[Any] | dict[str, Any] | None,
        fetch: Callable[[duckdb.DuckDBPyConnection], T]) -> T:
    """Check `sql`, run it on `con` (opened with `locked_config`) and `fetch` the result.

    A file, URL or extension that the locked connection refuses is a QueryRefused too; any other
    DuckDB error (a typo, an unknown table) is raised as DuckDB raised it.
    """
    try:
        return fetch(con.execute(check(con, sql), params or []))
    except duckdb.PermissionException as e:
        raise QueryRefused(f"coevo query reads the store's own tables only; DuckDB refused: {e}") from None
