"""What the `coevo` commands share: the consoles, the error exit, the --workdir option, tables, the store.

`flows/cli.py` (the run and inspect commands) and `flows/ops_cli.py` (the operator's commands) both
import from here, so neither imports the other's internals.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from components.store import Store

console = Console()
err = Console(stderr=True)

WorkdirOpt = Annotated[Path, typer.Option("--workdir", "-w", envvar="COEVO_WORKDIR", help="Experiment workdir.")]


def fail(msg: str, code: int = 1) -> NoReturn:
    """Print `error: msg` on stderr and exit with `code` (2: bad input, 1: the work itself failed)."""
    err.print(f"[bold red]error:[/] {msg}", highlight=False, markup=True)
    raise typer.Exit(code)


def open_store(workdir: Path, catalog: str | None = None) -> Store:
    """The store a command reads: `catalog` (a shared one: postgres:…), else COEVO_CATALOG, else the
    workdir's embedded store. A bad location exits 2, naming it."""
    from components.store import Store, StoreError

    try:
        return Store(catalog or os.environ.get("COEVO_CATALOG") or Path(workdir) / "store")
    except StoreError as e:
        fail(str(e), 2)


def print_table(cols: Sequence[Any], rows: Iterable[Sequence[Any]], title: str | None = None, *,
                right: Iterable[str] = (), width: int | None = None, count: bool = True) -> None:
    """A rich table on stdout; None shows as NULL, `right` names right-aligned columns.

    `width`: at least this many columns wide even when stdout is narrower or not a terminal (rich
    would wrap the cells). `count` adds the "(N rows)" line below.
    """
    table = Table(title=title)
    right = set(right)
    for c in cols:
        table.add_column(str(c), justify="right" if c in right else "left")
    n = 0
    for r in rows:
        table.add_row(*("NULL" if v is None else str(v) for v in r))
        n += 1
    (Console(width=max(console.width, width)) if width else console).print(table)
    if count:
        console.print(f"({n} rows)", style="dim")
