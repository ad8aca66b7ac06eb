"""Runs a script of benchmarks/ the way a user does (its own process, DeepSpeed on CPU), for its tests."""

from __future__ import annotations

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
