"""Runs a script of benchmarks/ the way a user does (its own process, DeepSpeed on CPU), for its tests."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_benchmark(
    name: str, *args: str, timeout: float = 60, env: dict | None = None
) -> subprocess.CompletedProcess:
    env = os.environ | (env or {})
    env |= {
        "DS_ACCELERATOR": "cpu",
        "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO_ROOT / ".torch_extensions")),
    }
    return subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / name), *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def load_benchmark(name: str):  # noqa: ANN201  (a module)
    """A script of benchmarks/ imported as a module, to call its functions in process (it imports its
    sibling `_output`, so benchmarks/ goes on sys.path)."""
    benchmarks = str(REPO_ROOT / "benchmarks")
    if benchmarks not in sys.path:
        sys.path.insert(0, benchmarks)
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def one_line_error(done: subprocess.CompletedProcess) -> str:
    """A benchmark's refusal of bad input: exit status 2 and one line of output (no traceback); the line."""
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]
