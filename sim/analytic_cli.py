"""`ciera analytic-bundle`: write the analytic trace bundle (the one shipped is made by this command)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

import traces

from .analytic import generate_bundle, load_settings
from .errors import SimInputError

USER_ERRORS: tuple[type[BaseException], ...] = (SimInputError, traces.TraceError)


def analytic_bundle_command(
    out: Annotated[Path, typer.Option("--out", help="Bundle directory to write.")],
    settings: Annotated[
        Path | None, typer.Option("--settings", help="Generator settings TOML (default: the packaged one).")
    ] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing bundle.")] = False,
) -> None:
    """Generate per-layer traces from model shapes and a cluster preset; every run is marked analytic."""
    loaded = load_settings(settings)
    with Console(stderr=True).status("generating analytic traces"):
        bundle = generate_bundle(loaded)
    path = traces.write_bundle(bundle, out, overwrite=overwrite)
    Console().print(
        f"wrote {path}: {len(bundle.runs)} analytic runs, {len(bundle.events)} events, {len(bundle.layers)} layer rows"
    )


def register(app: typer.Typer) -> None:
    app.command("analytic-bundle")(analytic_bundle_command)
