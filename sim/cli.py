"""`ciera simulate`: placeholder until the simulator lands (keeps the console script importable)."""

from __future__ import annotations

import typer

from .errors import SimInputError

USER_ERRORS: tuple[type[BaseException], ...] = (SimInputError,)


def register(app: typer.Typer) -> None:
    return None
