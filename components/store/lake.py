"""Where the store lives and how a process connects to it: a DuckLake catalog plus Parquet data files.

    Location.parse("workdir/store")                                   # embedded: catalog.sqlite + data/
    Location.parse("postgres:host=db dbname=coevo", "s3://runs/store/")  # shared: Postgres catalog, data in a bucket

Why DuckLake and not one DuckDB file: a DuckDB file admits one read-write process or many readers, never
both, so a notebook held open failed a round's commit. DuckLake keeps the tables' metadata in a catalog
database and their rows in immutable Parquet files; every commit is a snapshot, so any number of readers
(in any process, on any machine that reaches the catalog) keep reading the snapshot they started on while
the flow commits the next one, and `AT (VERSION => n)` reads an old one. The embedded catalog is SQLite in
WAL mode: there a commit beside an open reader took 0.019 s, against 3 s in SQLite's default journal
mode, which makes a writer wait for readers. A Postgres catalog lets a team share one store.

DuckDB's extensions come from the `duckdb-extension-*` wheels (pyproject.toml) and are loaded by path:
nothing is downloaded at run time, and a reader can then turn external access off.
Credentials never enter a config or the store: Postgres's come from libpq's environment (PGPASSWORD,
PGUSER, ~/.pgpass), the bucket's from AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and AWS_ENDPOINT_URL.
"""

from __future__ import annotations

import importlib.util
import os
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import duckdb

from components.storage import is_remote

T = TypeVar("T")

CATALOG_FILE = "catalog.sqlite"
LAKE = "store"  # the name the lake is attached under: `store.trajectories`, and the default schema
METADATA = f"__ducklake_metadata_{LAKE}"  # DuckLake's own name for the attached catalog database


class LakeError(RuntimeError):
    """The catalog or the data could not be reached, or an extension is missing. `transient`: worth a retry
    (a busy catalog, a commit that conflicted with another writer's)."""

    def __init__(self, message: str, transient: bool = False):
        super().__init__(message)
        self.transient = transient


def extension_path(name: str) -> str:
    """The loadable file of DuckDB extension `name` from its `duckdb-extension-<name>` wheel, for this duckdb."""
    package = f"duckdb_extension_{name}"
    spec = importlib.util.find_spec(package)
    want = f"duckdb-extension-{name.replace('_', '-')}=={duckdb.__version__}"
    if spec is None or not spec.submodule_search_locations:
        raise LakeError(f"DuckDB extension {name!r} is not installed: pip install {want}")
    path = Path(next(iter(spec.submodule_search_locations))) / "extensions" / f"v{duckdb.__version__}" / \
        f"{name}.duckdb_extension"
    if not path.is_file():
        raise LakeError(f"{package} has no build for duckdb {duckdb.__version__} ({path}): pip install {want}")
    return str(path)


@dataclass(frozen=True)
class Location:
    """A store: its DuckLake catalog (`sqlite:<file>` or `postgres:<libpq connection string>`), and where a new
    store puts its data files (an existing one keeps the path its catalog recorded)."""

    catalog: str
    data_path: str | None  # None: a shared catalog's reader, which finds the path in the catalog
    root: Path | None = None  # the folder of an embedded store; None for a shared catalog

    @classmethod
    def parse(cls, where: str | Path, data_path: str | None = None) -> Location:
        s = str(where)
        if s.startswith("postgres:"):
            return cls(s, _dir(data_path) if data_path else None)
        if "://" in s or s.startswith(("sqlite:", "ducklake:")):
            raise LakeError(f"store {s!r}: expected a local folder (the embedded store) or postgres:<connection "
                            "string>, e.g. postgres:host=127.0.0.1 port=5432 dbname=coevo")
        root = Path(s).expanduser().resolve()
        return cls(f"sqlite:{root / CATALOG_FILE}", _dir(data_path or str(root / "data")), root)

    @property
    def is_postgres(self) -> bool:
        return self.catalog.startswith("postgres:")

    @property
    def remote_data(self) -> bool:
        """Whether the data may lie in a bucket: a remote data path, or a shared catalog's unknown one."""
        if self.data_path is None:
            return self.is_postgres
        return is_remote(self.data_path)

    def exists(self) -> bool:
        """Whether the store has been created. A shared catalog is taken to exist: connecting says otherwise."""
        return self.root is None or (self.root / CATALOG_FILE).is_file()

    def describe(self) -> str:
        return str(self.root) if self.root is not None else _redact(self.catalog)


def _dir(path: str) -> str:
    return path if path.endswith("/") else path + "/"


def _redact(catalog: str) -> str:
    """The catalog string with any password in it masked, for messages."""
    return " ".join("password=***" if part.lower().startswith("password=") else part for part in catalog.split())


def _s3_secret(con: duckdb.DuckDBPyConnection, required: bool) -> None:
    """A temporary (never persisted) S3 secret from the environment, as fsspec and the AWS SDKs read it."""
    key, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    if not key or not secret:
        if not required:
            return
        raise LakeError("the store's data lies in a bucket: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                        "(and AWS_ENDPOINT_URL for an S3-compatible endpoint)")
    opts = {"KEY_ID": key, "SECRET": secret,
            "REGION": os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"}
    if token := os.environ.get("AWS_SESSION_TOKEN"):
        opts["SESSION_TOKEN"] = token
    if endpoint := os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"):
        u = urlsplit(endpoint)
        opts |= {"ENDPOINT": u.netloc or u.path, "URL_STYLE": "path", "USE_SSL": "true" if u.scheme == "https" else "false"}
    body = ", ".join(f"{k} '{str(v).replace(chr(39), chr(39) * 2)}'" for k, v in opts.items())
    con.execute(f"CREATE OR REPLACE TEMPORARY SECRET coevo_s3 (TYPE s3, {body})")


def create_embedded(loc: Location, build: Callable[[duckdb.DuckDBPyConnection], None]) -> bool:
    """Make the embedded store whole or not at all: its catalog is built under a temporary name (WAL mode, a
    file setting that lasts, so commits never wait for readers; DuckLake's metadata; then `build(con)`: the
    tables) and linked into place only when done, so no reader ever finds half a store. False where another
    process made it first."""
    assert loc.root is not None
    loc.root.mkdir(parents=True, exist_ok=True)
    final = loc.root / CATALOG_FILE
    tmp = loc.root / f".{CATALOG_FILE}.{os.getpid()}.{threading.get_ident()}.tmp"
    for p in (tmp, Path(f"{tmp}-wal"), Path(f"{tmp}-shm")):
        p.unlink(missing_ok=True)
    try:
        with sqlite3.connect(tmp) as c:
            c.execute("PRAGMA journal_mode=WAL")
        con = _open(Location(f"sqlite:{tmp}", loc.data_path, loc.root), False, None, None)
        try:
            build(con)
            con.execute("USE memory")
            con.execute(f"DETACH {LAKE}")
        finally:
            con.close()
        with sqlite3.connect(tmp) as c:  # everything into the main file: the -wal is not linked along
            c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        try:
            os.link(tmp, final)  # atomic, and refuses where the store already exists
        except FileExistsError:
            return False
        return True
    finally:
        for p in (tmp, Path(f"{tmp}-wal"), Path(f"{tmp}-shm")):
            p.unlink(missing_ok=True)


def _open(loc: Location, read_only: bool, snapshot: int | None, config: dict[str, Any] | None) -> duckdb.DuckDBPyConnection:
    con = duckdb.connect(config={"autoinstall_known_extensions": False, "autoload_known_extensions": False}
                         | (config or {}))
    try:
        for name in ("ducklake", "postgres_scanner" if loc.is_postgres else "sqlite_scanner"):
            con.execute(f"LOAD '{extension_path(name)}'")
        if loc.remote_data:
            con.execute(f"LOAD '{extension_path('httpfs')}'")
            _s3_secret(con, required=loc.data_path is not None)
        opts = ["READ_ONLY"] if read_only else [f"DATA_PATH '{loc.data_path}'"] if loc.data_path else []
        if snapshot is not None:
            opts.append(f"SNAPSHOT_VERSION {int(snapshot)}")
        escaped = loc.catalog.replace("'", "''")
        retry_busy(lambda: con.execute(f"ATTACH 'ducklake:{escaped}' AS {LAKE}" + (f" ({', '.join(opts)})" if opts else "")),
                   f"attaching {loc.describe()}")
        con.execute(f"USE {LAKE}")
        return con
    except BaseException:
        con.close()
        raise


# One DuckDB database per process, store and mode, with the extensions loaded and the store attached: loading
# them costs about 0.4 s, a cursor on it 5 ms. Each transaction on a cursor reads the catalog's newest snapshot.
_BASES: dict[tuple, duckdb.DuckDBPyConnection] = {}
_BASES_LOCK = threading.Lock()


def connect(loc: Location, *, read_only: bool, snapshot: int | None = None, config: dict[str, Any] | None = None,
            prepare: Callable[[duckdb.DuckDBPyConnection], None] | None = None) -> duckdb.DuckDBPyConnection:
    """A connection with the store attached as `store` and in use; close it when done. A writer creates the
    store where it does not exist yet; a reader (`read_only`) can also be pinned to one `snapshot`.
    `config`: DuckDB's settings at start (a guarded reader's `guard.STARTUP`); `prepare(con)` runs once on
    a new database before any use (a reader's lock)."""
    def opened(snap: int | None) -> duckdb.DuckDBPyConnection:
        con = _open(loc, read_only, snap, config)
        try:
            if prepare:
                prepare(con)
        except BaseException:
            con.close()
            raise
        return con

    if snapshot is not None:
        return opened(snapshot)
    catalog_file = loc.root / CATALOG_FILE if loc.root is not None else None
    if catalog_file is not None and not catalog_file.exists():
        raise LakeError(f"no store at {loc.describe()}")
    # A catalog file removed and made again is another store: its inode tells them apart.
    inode = catalog_file.stat().st_ino if catalog_file is not None else None
    key = (os.getpid(), loc.catalog, loc.data_path, read_only, inode, tuple(sorted((config or {}).items())))
    with _BASES_LOCK:
        if key not in _BASES:
            _BASES[key] = opened(None)
        cur = _BASES[key].cursor()
    cur.execute(f"USE {LAKE}")
    return cur


def data_path(con: duckdb.DuckDBPyConnection) -> str:
    """The data path the attached store's catalog recorded when it was created."""
    return con.execute(f"SELECT value FROM {METADATA}.ducklake_metadata WHERE key = 'data_path'").fetchone()[0]


def table_folder(con: duckdb.DuckDBPyConnection, table: str) -> str:
    """Where the attached store keeps `table`'s data files (`<data path>/main/<table>/`): a file handed to the
    store (`ducklake_add_data_files`) lies there, inside the folder a reader may read."""
    row = con.execute(
        f"SELECT s.path, s.path_is_relative, t.path, t.path_is_relative FROM {METADATA}.ducklake_table AS t "
        f"JOIN {METADATA}.ducklake_schema AS s USING (schema_id) WHERE t.table_name = ? AND s.schema_name = 'main' "
        "AND t.end_snapshot IS NULL AND s.end_snapshot IS NULL", [table]).fetchone()
    if row is None:
        raise LakeError(f"the store has no table {table!r}")
    schema, schema_relative, folder, folder_relative = row
    if schema_relative:
        schema = data_path(con).rstrip("/") + "/" + schema
    return (schema.rstrip("/") + "/" + folder if folder_relative else folder).rstrip("/") + "/"


def is_busy(e: BaseException) -> bool:
    """A fault another writer or reader causes, which passes: SQLite's lock, DuckLake's commit conflict."""
    s = str(e).lower()
    return any(m in s for m in ("database is locked", "database is busy", "sqlite_busy", "transaction conflict",
                                "conflict on", "could not serialize", "deadlock detected"))


def retry_busy(fn: Callable[[], T], what: str, timeout_s: float = 30.0) -> T:
    """`fn()`, tried again while the catalog is busy, up to `timeout_s`; other errors pass at once."""
    deadline = time.monotonic() + timeout_s
    delay = 0.02
    while True:
        try:
            return fn()
        except duckdb.Error as e:
            if not is_busy(e):
                if isinstance(e, (duckdb.IOException, duckdb.ConnectionException)) or "connect" in str(e).lower():
                    raise LakeError(f"{what}: {e}") from None
                raise
            if time.monotonic() > deadline:
                raise LakeError(f"{what}: the catalog stayed busy for {timeout_s:.0f}s: {e}", transient=True) from None
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
