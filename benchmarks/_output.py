"""What every benchmark does with its result: print it as JSON and, with --json FILE, write it there."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any


def emit_json(result: dict[str, Any], json_path: Path | None) -> None:
    text = json.dumps(result, indent=2)
    print(text)
    if json_path is None:
        return
    json_path.parent.mkdir(parents=True, exist_ok=True)
    # Temp file + rename: an interrupted run never leaves a truncated result behind.
    handle, temp_name = tempfile.mkstemp(prefix=f".{json_path.name}.", dir=json_path.parent)
    with os.fdopen(handle, "w") as temp:
        temp.write(text + "\n")
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(temp_name, 0o666 & ~umask)  # mkstemp makes it private; a result file should not be
    os.replace(temp_name, json_path)


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line, ``PROG: error: MESSAGE``, exit 2 (argparse prints the usage too)."""

    def error(self, message: str) -> None:
        print(f"{Path(self.prog).stem}: error: {message}")
        sys.exit(2)


def add_bundle_argument(parser: argparse.ArgumentParser, default: str | None = None) -> None:
    """--bundle: a shipped measured bundle's name or a bundle directory (required unless `default`)."""
    import traces

    parser.add_argument(
        "--bundle",
        required=default is None,
        default=default,
        help=f"a bundle directory, or one of {', '.join(traces.MEASURED_BUNDLE_NAMES)}",
    )
