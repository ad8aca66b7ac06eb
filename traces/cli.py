"""`ciera traces ...`: inspect and validate trace bundles."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from .bundle import TABLE_NAMES, read_bundle
from .errors import TraceError

USER_ERRORS: tuple[type[BaseException], ...] = (TraceError,)

traces_app = typer.Typer(
    help="Inspect and validate trace bundles (docs/trace-format.md).", no_args_is_help=True
)


@traces_app.command("validate")
def validate_command(
    bundle: Annotated[str, typer.Argument(help="Bundle directory, or a shipped one: analytic, measured.")],
    json_out: Annotated[bool, typer.Option("--json", help="Print the row counts as JSON.")] = False,
) -> None:
    """Check a bundle against the schema and consistency rules; exit 2 on the first problem.

    What the reader substituted (a version-1 bundle read as version 2) is printed as notes."""
    from . import resolve_bundle

    loaded = read_bundle(resolve_bundle(bundle))
    counts = {name: len(loaded.table(name)) for name in TABLE_NAMES}
    if json_out:
        print(json.dumps({"bundle": str(bundle), "valid": True, "rows": counts, "notes": list(loaded.notes)}))
        for note in loaded.notes:
            Console(stderr=True).print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)
        return
    table = Table(title=f"{bundle}: valid trace bundle")
    table.add_column("table")
    table.add_column("rows", justify="right")
    for name, count in counts.items():
        table.add_row(name, str(count))
    console = Console()
    console.print(table)
    for note in loaded.notes:
        console.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)


def register(app: typer.Typer) -> None:
    app.add_typer(traces_app, name="traces")
